"""cotrain's methods inside vLLM's model workers.

The rollout worker starts vLLM with `--worker-extension-cls cotrain_vllm_ext.CotrainWorkerExtension`
and calls these methods through vLLM's `/collective_rpc` endpoint (which passes string arguments
only). They feed vLLM's own in-place reload (`model_runner.reload_weights`) from a safetensors file
the rollout worker wrote on a node-local tmpfs, so every name mapping, fusing and dtype conversion
is vLLM's.
"""

import json


class CotrainWorkerExtension:
    def cotrain_reload_weights(self, path: str) -> str:
        """Loads the tensors of the safetensors file at `path` into the running model, in place.

        Tensors the file does not name keep their values, so a file may hold a partial update.
        Returns a JSON object with the tensor count and the seconds the reload took.
        """
        import time

        from safetensors.torch import load_file

        started = time.perf_counter()
        device = str(getattr(self, "device", "cpu"))
        tensors = load_file(path, device=device)
        self.model_runner.reload_weights(weights_iterator=iter(tensors.items()))
        return json.dumps({"tensors": len(tensors), "secs": time.perf_counter() - started})
