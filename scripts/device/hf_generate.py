"""The transformers side of scripts/device/check.sh's generation figures (needs torch + transformers).

    hf_generate.py build CONFIG_DIR TOKENIZER_DIR OUT_DIR
        a randomly initialised model of CONFIG_DIR/config.json's shape (seed 0, bf16), saved with the
        tokenizer as a Hugging Face directory that cotrain and transformers both load
    hf_generate.py bench MODEL_DIR --batches 1,8,32,128 --new-tokens 256 --out OUT.json
        transformers' `generate` with the seeds' sampling (T 0.7, top-p 0.9, top-k 50), EOS ignored,
        the same prompt as cotrain's side (scripts/device/prompt.txt): tokens/s and peak memory
"""

import argparse
import json
import os
import shutil
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def build(config_dir, tokenizer_dir, out):
    config = AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for f in os.listdir(tokenizer_dir):
        if f.endswith(".json") and f != "config.json":
            shutil.copy(os.path.join(tokenizer_dir, f), out)
    n = sum(p.numel() for p in model.parameters())
    print(f"built {out}: {n / 1e9:.3f} B parameters on {DEVICE}")


def bench(model_dir, batches, new_tokens, out):
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(DEVICE).eval()
    prompt = open(os.path.join(HERE, "prompt.txt")).read().strip()
    ids = tok(prompt, return_tensors="pt").input_ids.to(DEVICE)
    kwargs = dict(do_sample=True, temperature=0.7, top_p=0.9, top_k=50, max_new_tokens=new_tokens,
                  min_new_tokens=new_tokens, pad_token_id=tok.pad_token_id or 0)
    with torch.no_grad():
        model.generate(ids, **{**kwargs, "max_new_tokens": 8, "min_new_tokens": 8})  # warm-up
        runs = []
        for b in batches:
            torch.cuda.reset_peak_memory_stats() if DEVICE == "cuda" else None
            torch.manual_seed(1)
            batch = ids.expand(b, -1).contiguous()
            sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
            sync()
            t = time.perf_counter()
            out_ids = model.generate(batch, attention_mask=torch.ones_like(batch), **kwargs)
            sync()
            secs = time.perf_counter() - t
            generated = (out_ids.shape[1] - ids.shape[1]) * b
            peak = torch.cuda.max_memory_allocated() // 2**20 if DEVICE == "cuda" else None
            runs.append({"batch": b, "tokens": generated, "seconds": secs, "tok_s": generated / secs, "peak_mib": peak})
            print(json.dumps(runs[-1]), flush=True)
    json.dump({"model": model_dir, "torch": torch.__version__, "device": DEVICE,
               "gpu": torch.cuda.get_device_name(0) if DEVICE == "cuda" else None, "runs": runs}, open(out, "w"), indent=1)


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("config_dir"); b.add_argument("tokenizer_dir"); b.add_argument("out")
    g = sub.add_parser("bench")
    g.add_argument("model_dir"); g.add_argument("--batches", default="1,8,32,128")
    g.add_argument("--new-tokens", type=int, default=256); g.add_argument("--out", required=True)
    a = p.parse_args()
    if a.cmd == "build":
        build(a.config_dir, a.tokenizer_dir, a.out)
    else:
        bench(a.model_dir, [int(x) for x in a.batches.split(",")], a.new_tokens, a.out)


if __name__ == "__main__":
    main()
