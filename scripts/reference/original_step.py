#!/usr/bin/env python3
"""One single-turn MAGRPO step done the way the original trainer does it, with transformers, for the
step benchmark (`cargo run --release -p cotrain-learner --example step_bench`).

Setting of notes/toolchain.md: 2 agents, each its own copy of SmolLM2-135M-Instruct in float32,
4 samples per agent of exactly 128 new tokens (EOS ignored) after the same ~100-token chat prompt,
sampled with the seeds' settings by default (temperature 0.7, top-p 0.9, top-k 50; the flags change
them); then per agent: one forward per completion for the summed log-prob loss
L = (1/K) sum_k -A_k * sum_t log p(y_t), backward, one AdamW step (lr 1e-5). The stand-in reward is the
same as the Rust side's (fraction of even token ids, summed over the two agents' aligned completions),
advantages are R - mean(R). Prints one JSON line on stdout.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

GGUF = Path.home() / ".cache/cotrain/models/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = ("You are a careful Python programmer. Write a function `rolling_max(numbers)` that, given a list "
          "of integers, returns the list of the running maximum at every position. For example rolling_max([1, 2, 3, 2, 3, 4, 2]) "
          "returns [1, 2, 3, 3, 3, 4, 4]. Explain briefly, then give the code.")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--model", default=str(GGUF))
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--top-k", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    path = Path(args.model)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    agents = [AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32) for _ in range(2)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-5, weight_decay=0.0) for m in agents]
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True)
    prompt = tok(text, return_tensors="pt").input_ids
    times = []
    for step in range(args.steps):
        t0 = time.time()
        completions = []
        for m in agents:
            m.eval()
            with torch.no_grad():
                out = m.generate(prompt.repeat(4, 1), attention_mask=torch.ones(4, prompt.shape[1], dtype=torch.long),
                                 do_sample=True, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, max_new_tokens=128, min_new_tokens=128,
                                 pad_token_id=tok.eos_token_id)
            completions.append(out[:, prompt.shape[1]:])
        t_gen = time.time() - t0
        rewards = [sum(float((c[j] % 2 == 0).float().mean()) for c in completions) for j in range(4)]
        mean = sum(rewards) / 4
        adv = [r - mean for r in rewards]
        t1 = time.time()
        for m, opt, comp in zip(agents, opts, completions):
            m.train()
            opt.zero_grad()
            for k in range(4):
                ids = torch.cat([prompt[0], comp[k]]).unsqueeze(0)
                logits = m(ids).logits[0, prompt.shape[1] - 1:-1]
                lp = torch.log_softmax(logits.float(), -1).gather(1, comp[k].unsqueeze(1)).sum()
                (-adv[k] * lp / 4).backward()
            opt.step()
        t_train = time.time() - t1
        secs = time.time() - t0
        print(f"original-style step {step + 1}: {secs:.1f} s (generate {t_gen:.1f} s, train {t_train:.1f} s)", file=sys.stderr, flush=True)
        times.append(secs)
    print(json.dumps({"impl": "transformers-original", "agents": 2, "samples": 4, "new_tokens": 128,
                      "prompt_tokens": int(prompt.shape[1]), "step_seconds": times, "best_seconds": min(times)}))


if __name__ == "__main__":
    main()
