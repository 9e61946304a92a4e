#!/usr/bin/env python3
"""The transformers side of the generation benchmark: pure sampling from SmolLM2-135M in float32.

For each batch size, a fixed ~20-token prompt is replicated B times and `generate` samples exactly
`--new-tokens` tokens per row (temperature 1, no top-k, no top-p, no EOS stop, KV cache on), so
the comparison with the Rust engine is like for like. One warm-up run precedes the timed runs.
Prints one JSON line per batch size on stdout (progress goes to stderr):

    {"impl":"transformers","batch":8,"new_tokens":128,"seconds":14.2,"tokens_per_s":72.1,...}

Run with the pyref environment (scripts/reference/setup-pyref.sh):
    python scripts/reference/bench_generate.py [BATCH ...]   # default: 1 8 32
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

DEFAULT_MODEL = Path.home() / ".cache/cotrain/models/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "Write a short story about a robot who learns to paint, in the style of a fairy tale:"


def log(msg):
    print(msg, file=sys.stderr, flush=True)


@torch.no_grad()
def sample(model, ids, batch, new_tokens, temperature=1.0, top_p=1.0, top_k=0):
    input_ids = torch.tensor([ids] * batch)
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=True,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        max_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=2,
        use_cache=True,
    )
    assert out.shape == (batch, len(ids) + new_tokens), out.shape
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("batches", nargs="*", type=int, default=[1, 8, 32], help="batch sizes to time")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens sampled per sequence")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (1 disables)")
    ap.add_argument("--top-k", type=int, default=0, help="top-k (0 disables)")
    ap.add_argument("--model", type=Path,
                    default=Path(os.environ.get("COTRAIN_DEFAULT_MODEL", DEFAULT_MODEL)),
                    help="SmolLM2 GGUF file (default: $COTRAIN_DEFAULT_MODEL)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    transformers.utils.logging.disable_progress_bar()
    gguf = args.model.expanduser()
    log(f"loading {gguf}")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.eval()
    ids = tok(PROMPT, add_special_tokens=True)["input_ids"]
    log(f"prompt: {len(ids)} tokens; warm-up")
    settings = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    sample(model, ids, min(args.batches), 16, **settings)

    for batch in args.batches:
        start = time.perf_counter()
        sample(model, ids, batch, args.new_tokens, **settings)
        seconds = time.perf_counter() - start
        print(json.dumps({
            "impl": "transformers",
            "batch": batch,
            "new_tokens": args.new_tokens,
            "seconds": round(seconds, 3),
            "tokens_per_s": round(batch * args.new_tokens / seconds, 2),
            "prompt_tokens": len(ids),
            "threads": args.threads,
        }), flush=True)


if __name__ == "__main__":
    main()
