#!/usr/bin/env python3
"""Where a MaPoRL micro-batch's time can go on this CPU: libtorch's rates for the products of one
policy micro-batch at the original's batch (one question: two rows of ~560 positions, SmolLM2-135M's
widths), forward and input-gradient backward, each projection alone and q/k/v and gate/up fused into
one product; and attention forward + backward (flash and math backends, causal rows and
continuations after a shared prefix, which attend through a mask). Uses the reference's Python
(torch 2.13; see scripts/bench/maporl_step.sh for the venv). Figures: docs/src/figures/zen4.md.

    ~/.cache/cotrain/bench-venv/bin/python scripts/bench/maporl_shapes.py [--positions 1120] [--threads 2]
"""

import argparse
import subprocess
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 576, 1536, 9, 3, 64, 30


def bench(f, n):
    f()
    f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--positions", type=int, default=1120, help="positions of one micro-batch (two rows of 560)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    facts = [" ".join(l.split()) for l in cpu.splitlines() if l.startswith(("Model name", "CPU family", "Model:"))]
    print("; ".join(facts + [f"threads {a.threads}", f"torch {torch.__version__}"]))
    m = a.positions
    x = torch.randn(m, HIDDEN)
    total = 0.0
    print(f"products of {m} positions, ms per layer (GFLOP/s): forward x·Wᵀ, backward dY·W")
    for name, ns, k in [("q,k,v", [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], HIDDEN),
                        ("o", [HIDDEN], HEADS * HEAD_DIM), ("gate,up", [INTER, INTER], HIDDEN), ("down", [HIDDEN], INTER)]:
        xi = x if k == HIDDEN else torch.randn(m, k)
        ws = [torch.randn(n, k) * 0.02 for n in ns]
        gs = [torch.randn(m, n) for n in ns]
        fl = sum(2 * m * k * n for n in ns)
        sep_f = bench(lambda: [xi @ w.t() for w in ws], a.reps)
        sep_b = bench(lambda: sum(g @ w for g, w in zip(gs, ws)), a.reps)
        total += sep_f + sep_b
        line = f"  {name:<8} separate: fwd {sep_f:6.2f} ({fl / sep_f / 1e6:4.0f})  bwd {sep_b:6.2f} ({fl / sep_b / 1e6:4.0f})"
        if len(ws) > 1:
            wf, gf = torch.cat(ws, 0), torch.cat(gs, 1)
            fus_f = bench(lambda: xi @ wf.t(), a.reps)
            fus_b = bench(lambda: gf @ wf, a.reps)
            line += f"   fused: fwd {fus_f:6.2f} ({fl / fus_f / 1e6:4.0f})  bwd {fus_b:6.2f} ({fl / fus_b / 1e6:4.0f})"
        print(line)
    print(f"  all projections, forward + backward: {total:.1f} ms per layer, {total * LAYERS / 1e3:.2f} s per micro-batch")
    print("attention forward + backward (GQA 9/3 heads, head dim 64), ms per layer:")
    for rows, length, prefix in [(2, m // 2, 0), (2, m // 2 - 160, 160)]:
        t_len = length + prefix
        q = torch.randn(rows, HEADS, length, HEAD_DIM, requires_grad=True)
        k = torch.randn(rows, KV_HEADS, t_len, HEAD_DIM, requires_grad=True)
        v = torch.randn(rows, KV_HEADS, t_len, HEAD_DIM, requires_grad=True)
        g = torch.randn(rows, HEADS, length, HEAD_DIM)
        mask = torch.ones(length, t_len, dtype=torch.bool).tril(prefix)
        out = []
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH):
            with sdpa_kernel(backend):
                if prefix == 0:
                    f = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(g)
                else:
                    f = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).backward(g)
                ms = bench(f, max(3, a.reps // 2))
            out.append(f"{backend.name.lower()} {ms:6.1f} ({ms * LAYERS / 1e3:.2f} s per micro-batch)")
        what = f"{rows} causal rows of {length}" if prefix == 0 else f"{rows} rows of {length} after a shared prefix of {prefix} (mask)"
        print(f"  {what}: " + ", ".join(out))


if __name__ == "__main__":
    main()
