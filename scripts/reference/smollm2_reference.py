#!/usr/bin/env python3
"""Reference outputs of the real SmolLM2-135M-Instruct GGUF, computed by Hugging Face transformers.

transformers dequantises the GGUF tensors to float32 and undoes llama.cpp's q/k row permutation
itself, so this is an implementation independent of the Rust GGUF loader. Writes
`model/tests/fixtures/smollm2/reference.json` (small: top-k logits only, not full vocab rows).

Run with the pyref environment (scripts/reference/setup-pyref.sh):
    COTRAIN_DEFAULT_MODEL=/path/to/SmolLM2-135M-Instruct.Q4_1.gguf \\
        python scripts/reference/smollm2_reference.py [--out model/tests/fixtures/smollm2/reference.json]
"""

import argparse
import json
import math
import os
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

SCHEMA_VERSION = 1
ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = Path.home() / ".cache/cotrain/models/SmolLM2-135M-Instruct.Q4_1.gguf"
NEW_TOKENS = 24
TOP_K = 20
FIRST_VOCAB_IDS = 8
# Fixed vocabulary ids whose last-position logits are recorded whatever the top-k holds:
# specials (endoftext, im_start, im_end), a few ordinary ids, and the last id.
FIXED_IDS = [0, 1, 2, 17, 100, 1000, 10000, 30000, 49151]

CHAT_QUESTION = "What is the capital of France?"
PLAIN_TEXT = "The quick brown fox"
CODE_TEXT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def sig(x, digits=7):
    if x == 0.0 or not math.isfinite(x):
        return x
    return float(f"{x:.{digits - 1}e}")


def rounded(t):
    if t.dim() == 0:
        return sig(float(t))
    return [rounded(r) for r in t] if t.dim() > 1 else [sig(float(v)) for v in t]


@torch.no_grad()
def logits_of(model, ids):
    return model(torch.tensor([ids]), use_cache=False).logits[0].double()  # (L, V)


@torch.no_grad()
def greedy(model, ids, n):
    """Greedy decoding with transformers' KV cache, no EOS stop; margins say how safe each step is."""
    out = model.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
        pad_token_id=2, use_cache=True, output_scores=True, return_dict_in_generate=True,
        top_k=None, top_p=None, temperature=None,
    )
    new_ids = out.sequences[0, len(ids):].tolist()
    margins = []
    for s in out.scores:
        top2 = torch.topk(s[0].double(), 2).values
        margins.append(sig(float(top2[0] - top2[1])))
    return new_ids, margins


def case(model, tok, name, text, ids):
    logits = logits_of(model, ids)
    last = logits[-1]
    top = torch.topk(last, TOP_K)
    logp = torch.log_softmax(logits, -1)
    token_logprobs = logp[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    entropy = -(logp.exp() * logp).sum(-1)
    new_ids, margins = greedy(model, ids, NEW_TOKENS)
    # Recomputing the whole sequence without a cache must reproduce the cached choices.
    seq = ids + new_ids
    full = logits_of(model, seq)
    recomputed = full[len(ids) - 1:-1].argmax(-1).tolist()
    if recomputed != new_ids:
        print(f"  warning ({name}): cached greedy {new_ids} != recomputed {recomputed}")
    return {
        "name": name,
        "text": text,
        "input_ids": ids,
        "last_top_ids": top.indices.tolist(),
        "last_top_logits": [sig(float(v)) for v in top.values],
        "last_fixed_ids": FIXED_IDS,
        "last_fixed_logits": [sig(float(last[i])) for i in FIXED_IDS],
        "last_logsumexp": sig(float(torch.logsumexp(last, -1))),
        "last_entropy": sig(float(entropy[-1])),
        "logits_first_ids": rounded(logits[:, :FIRST_VOCAB_IDS]),
        "token_logprobs": rounded(token_logprobs),
        "entropy": rounded(entropy),
        "greedy_new_ids": new_ids,
        "greedy_text": tok.decode(new_ids, skip_special_tokens=False),
        "greedy_top2_margin": margins,
        "greedy_recompute_agrees": recomputed == new_ids,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "model/tests/fixtures/smollm2/reference.json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    transformers.utils.logging.disable_progress_bar()
    gguf = Path(os.environ.get("COTRAIN_DEFAULT_MODEL", DEFAULT_MODEL)).expanduser()

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.eval()

    chat_text = tok.apply_chat_template(
        [{"role": "user", "content": CHAT_QUESTION}], add_generation_prompt=True, tokenize=False)
    prompts = [("chat", chat_text), ("plain", PLAIN_TEXT), ("code", CODE_TEXT)]
    cases = []
    for name, text in prompts:
        ids = tok(text, add_special_tokens=True)["input_ids"]
        cases.append(case(model, tok, name, text, ids))
        c = cases[-1]
        print(f"{name}: {len(ids)} ids, greedy {c['greedy_text']!r}, min margin {min(c['greedy_top2_margin'])}")

    cfg = model.config
    ref = {
        "schema_version": SCHEMA_VERSION,
        "model_file": gguf.name,
        "dtype": "float32",
        "config": {
            "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads,
            "intermediate_size": cfg.intermediate_size,
            "vocab_size": cfg.vocab_size,
            "rope_theta": cfg.rope_parameters["rope_theta"],
            "rms_norm_eps": cfg.rms_norm_eps,
            "tie_word_embeddings": cfg.tie_word_embeddings,
        },
        "chat_messages": [{"role": "user", "content": CHAT_QUESTION}],
        "new_tokens": NEW_TOKENS,
        "generation": "greedy argmax, no EOS stopping",
        "top_k": TOP_K,
        "first_vocab_ids": FIRST_VOCAB_IDS,
        "cases": cases,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(ref, indent=1) + "\n")
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
