#!/usr/bin/env python3
"""Loads a model directory written by cotrain (`learner export`, `RUN_DIR/final_model/agent-{i}`)
with transformers and prints its greedy continuation of a prompt, to compare with cotrain's own:

    $PY scripts/reference/check_export.py DIR "PROMPT"
    target/release/rollout-worker generate --model DIR --prompt "PROMPT" \
        --max-new-tokens 32 --temperature 0 --json

Both tokenise a plain prompt with special tokens added; with --chat (here and there) the prompt
is a user message rendered by the directory's chat template with the generation prompt, then
tokenised without special tokens. Both stop at the ids of generation_config.json's eos_token_id,
so the printed `token_ids` must equal rollout-worker's `samples[0].token_ids`.

A LoRA policy (`model.lora`) exports as a PEFT adapter directory: with --adapter ADAPTER_DIR the
adapter is loaded by PEFT over the base (MODEL_DIR, or a GGUF file such as the embedded default,
which transformers dequantises) and left unmerged, so the tokens must equal rollout-worker's on the
merged export (`learner export --merged`, `<dir>-merged`):

    $PY scripts/reference/check_export.py ~/.cache/cotrain/models/SmolLM2-135M-Instruct.Q4_1.gguf \
        "PROMPT" --adapter exported/agent-0

Prints one JSON object: prompt_token_ids, token_ids, text, and what transformers loaded.
Run with the reference env: ~/.cache/cotrain/pyref/bin/python scripts/reference/check_export.py
"""
import argparse
import json
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("prompt")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    ap.add_argument("--dtype", default="float32", help="compute dtype (rollout-worker generate uses f32 by default)")
    ap.add_argument("--adapter", help="a PEFT adapter directory to load (unmerged) over MODEL_DIR")
    args = ap.parse_args()
    torch.set_num_threads(2)

    path = Path(args.model_dir).expanduser()
    if path.suffix == ".gguf":
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=getattr(torch, args.dtype))
    else:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype))
    peft_version = None
    if args.adapter:
        import peft

        model = peft.PeftModel.from_pretrained(model, args.adapter)
        peft_version = peft.__version__
    model.eval()

    if args.chat:
        text = tok.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=False
        )
        prompt_ids = tok(text, add_special_tokens=False)["input_ids"]
    else:
        prompt_ids = tok(args.prompt, add_special_tokens=True)["input_ids"]

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=args.max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
        )
    new_ids = out[0, len(prompt_ids):].tolist()
    print(json.dumps({
        "prompt_token_ids": prompt_ids,
        "token_ids": new_ids,
        "text": tok.decode(new_ids, skip_special_tokens=True),
        "eos_token_id": model.generation_config.eos_token_id,
        "tokenizer_class": type(tok).__name__,
        "model_class": type(model).__name__,
        "dtype": str(next(model.parameters()).dtype),
        "transformers": transformers.__version__,
        "peft": peft_version,
    }))


if __name__ == "__main__":
    main()
