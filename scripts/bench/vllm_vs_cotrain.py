#!/usr/bin/env python3
"""cotrain's engine against vLLM's CPU build, side by side in one run on this machine.

1. Generation: `rollout-worker serve --engine cotrain` and `--engine vllm` on the embedded default
   model (SmolLM2-135M-Instruct, f32), one after the other (never at the same time: they would
   share the cores), each asked for n = 1, 32 and 128 samples of 128 tokens of one chat prompt at
   the demo's sampling (temperature 0.8, top-p 0.95), EOS ignored so that every sample is 128
   tokens. Each size is timed after a warm-up request.
2. The demo's MAGRPO step (configs/demo.yaml) with `rollout.engine: cotrain` and `vllm`: a few
   steps each, with the step, generation, training and weight-sync seconds and the bytes synced,
   from the runs' metrics.jsonl.

Usage (from the repository root, after `COTRAIN_VLLM=cpu make setup` and a release build):
    python3 scripts/bench/vllm_vs_cotrain.py [--bin target/release] [--steps 3] [--sizes 1,32,128]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

PROMPT = ("<|im_start|>user\nSummarize in two sentences why the sky is blue, for a ten-year-old."
          "<|im_end|>\n<|im_start|>assistant\n")


def cpu():
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(l.split(":", 1) for l in out.splitlines() if ":" in l)
    return f"{fields.get('Model name', '?').strip()}, family {fields.get('CPU family', '?').strip()}, {os.cpu_count()} CPUs"


def post(addr, path, body, timeout=3600):
    req = urllib.request.Request(f"http://{addr}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def start_worker(binary, engine, max_batch, model="default", device="cpu", dtype="f32"):
    args = [f"{binary}/rollout-worker", "serve", "--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0",
            "--agent", f"a={model}", "--engine", engine, "--max-batch-size", str(max_batch),
            "--device", device, "--dtype", dtype]
    env = dict(os.environ, RUST_LOG="warn")
    started = time.time()
    p = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env)
    line = p.stdout.readline()
    if not line.startswith("listening"):
        p.kill()
        sys.exit(f"{engine} worker did not start: {line!r}")
    http = [w.split("=", 1)[1] for w in line.split() if w.startswith("http=")][0]
    return p, http, time.time() - started


def generation(binary, engine, sizes, tokens, model="default", device="cpu", dtype="f32", prompt=PROMPT):
    p, http, start_s = start_worker(binary, engine, max(sizes), model, device, dtype)
    rows = []
    try:
        post(http, "/v1/completions", {"model": "a", "prompt": prompt, "max_tokens": 8, "temperature": 0.8})
        for n in sizes:
            body = {"model": "a", "prompt": prompt, "n": n, "max_tokens": tokens, "temperature": 0.8,
                    "top_p": 0.95, "ignore_eos": True, "seed": 1}
            t = time.time()
            answer = post(http, "/v1/completions", body)
            secs = time.time() - t
            generated = answer["usage"]["completion_tokens"]
            rows.append((n, generated, secs))
            print(f"  {engine:8} n={n:<4} {generated} tokens in {secs:.1f} s = {generated / secs:.1f} tokens/s", flush=True)
    finally:
        p.terminate()
        p.wait()
    return start_s, rows


def magrpo(binary, engine, steps, out):
    overrides = [f"dataset.train_split=train[:{steps}]", "magrpo.eval_interval=0", f"logging.run_name=bench-{engine}",
                 f"output.base_dir={out}", "output.save_final_model=false", "logging.progress=never",
                 f"rollout.engine={engine}"]
    t = time.time()
    r = subprocess.run([f"{binary}/learner", "train", "--config", "configs/demo.yaml", "--override", *overrides],
                       capture_output=True, text=True, env=dict(os.environ, RUST_LOG="warn"))
    if r.returncode != 0:
        sys.exit(f"learner train ({engine}) failed:\n{r.stderr[-3000:]}")
    with open(f"{out}/bench-{engine}/metrics.jsonl") as f:
        lines = [json.loads(l) for l in f if l.strip()]
    return time.time() - t, lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--sizes", default="1,32,128")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--skip-magrpo", action="store_true")
    ap.add_argument("--model", default="default", help="the served model (the device check: a seed shape's directory)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="f32")
    ap.add_argument("--prompt", default=PROMPT, help="the prompt text (the default is SmolLM2's chat format)")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    print(f"CPU: {cpu()}")
    print(f"generation: {a.model} {a.dtype} on {a.device}, {a.tokens} tokens per sample, temperature 0.8, top-p 0.95")
    gen = {e: generation(a.bin, e, sizes, a.tokens, a.model, a.device, a.dtype, a.prompt) for e in ("cotrain", "vllm")}
    print("\n| n | cotrain tokens/s | vLLM tokens/s | cotrain / vLLM |\n| --- | --- | --- | --- |")
    for (n, gc, sc), (_, gv, sv) in zip(gen["cotrain"][1], gen["vllm"][1]):
        print(f"| {n} | {gc / sc:.1f} | {gv / sv:.1f} | {(gc / sc) / (gv / sv):.2f}x |")
    print(f"\nworker start to serving: cotrain {gen['cotrain'][0]:.1f} s, vllm {gen['vllm'][0]:.1f} s")
    if a.skip_magrpo:
        return
    print(f"\nthe demo's MAGRPO step (configs/demo.yaml, {a.steps} steps; step 1 includes warm-up):")
    with tempfile.TemporaryDirectory() as out:
        runs = {e: magrpo(a.bin, e, a.steps, out) for e in ("cotrain", "vllm")}
    keys = ["time/step", "time/generate", "time/reward", "time/train", "time/weight_sync", "weight_sync/bytes"]
    print("\n| engine | step | " + " | ".join(keys) + " |\n| --- | --- | " + " | ".join("---" for _ in keys) + " |")
    for e, (_, lines) in runs.items():
        for m in lines:
            vals = [f"{m.get(k, float('nan')):.2f}" if k != "weight_sync/bytes" else f"{m.get(k, 0) / 1e6:.0f} MB" for k in keys]
            print(f"| {e} | {m['step']} | " + " | ".join(vals) + " |")
    for e, (secs, lines) in runs.items():
        later = lines[1:] or lines
        mean = sum(m["time/step"] for m in later) / len(later)
        print(f"{e}: whole run {secs:.1f} s; mean step after the first {mean:.2f} s")


if __name__ == "__main__":
    main()
