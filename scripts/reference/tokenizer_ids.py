#!/usr/bin/env python3
"""Reference token ids for cotrain's GGUF-built SmolLM2 tokenizer (model/tests/tokenizer.rs).

Loads the tokenizer that transformers builds from the SmolLM2-135M-Instruct GGUF
($COTRAIN_DEFAULT_MODEL) and writes model/tests/fixtures/tokenizers/smollm2_ids.json:
a list of {text, ids (add_special_tokens=False), ids_special (add_special_tokens=True), decoded, ...}.

transformers' GGUF conversion gives every `gpt2`-model GGUF plain GPT-2 byte-level pre-tokenization
and ignores `tokenizer.ggml.pre = smollm`, whose rule (and SmolLM2's own tokenizer.json:
Digits(individual_digits) then ByteLevel) also isolates every numeric character. The two differ only
on non-ASCII numerics such as "½". `ids` are therefore computed with SmolLM2's original
pre-tokenizer restored on the same vocabulary; `ids_transformers_gguf` keeps what transformers'
GGUF loader produces, for the record.

Run with the reference env: ~/.cache/cotrain/pyref/bin/python scripts/reference/tokenizer_ids.py
"""
import argparse
import json
import os
from pathlib import Path

from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]

TEXTS = [
    "Hello world",
    " Hello world",
    "Hello, world! How are you today?",
    "The year 2024 had 366 days; 3.14159 is pi.",
    "def add(a, b):\n    return a + b\n\n\nprint(add(1, 2))",
    "  leading spaces and\ttabs\n\nand newlines  ",
    "Führer naïve café — “quotes” ½ €100",
    "нещо на Български, 日本語のテキスト, 한국어, العربية",
    "emoji 🦙🚀 and ZWJ 👨‍👩‍👧",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after a special token",
    "I'm sure they'll say it's fine, won't they? DON'T SHOUT",
    "",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "model/tests/fixtures/tokenizers/smollm2_ids.json")
    ap.add_argument("--model", type=Path, default=Path(os.environ.get(
        "COTRAIN_DEFAULT_MODEL", Path.home() / ".cache/cotrain/models/SmolLM2-135M-Instruct.Q4_1.gguf")))
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(str(args.model.parent), gguf_file=args.model.name)
    gguf_ids = [tok.encode(text, add_special_tokens=False) for text in TEXTS]
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    rows = []
    for text, ids_gguf in zip(TEXTS, gguf_ids):
        ids = tok.encode(text, add_special_tokens=False)
        rows.append({
            "text": text,
            "ids": ids,
            "ids_transformers_gguf": ids_gguf,
            "ids_special": tok.encode(text, add_special_tokens=True),
            "decoded": tok.decode(ids, skip_special_tokens=False),
            "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
        })
    meta = {
        "bos_token": tok.bos_token, "eos_token": tok.eos_token, "pad_token": tok.pad_token,
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
        "vocab_size": len(tok),
    }
    # One case per line keeps the fixture small and its diffs readable.
    body = ",\n  ".join(json.dumps(r, ensure_ascii=False) for r in rows)
    args.out.write_text('{"tokenizer": %s,\n "cases": [\n  %s\n ]}\n' % (json.dumps(meta), body))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
