#!/usr/bin/env python3
"""cotrain's engine on cores it shares with other busy processes: the fixed thread count against
the adaptive one (`--decode-threads fixed` / `adaptive`, model/src/engine/threads.rs), side by side.

For each competing load (that many single-threaded busy loops started beside it, 0 = a quiet
machine) and each sample count, `rollout-worker generate` decodes n samples of 128 tokens of the
embedded default model (SmolLM2-135M-Instruct) at the seeds' sampling (temperature 0.8, top-p
0.95, EOS ignored), alternating fixed and adaptive runs `--repeat` times; the medians are printed
with the time a fair share of the cores would give: with L busy loops beside the engine's C
threads on C cores, the engine gets C / (L + C) of the machine, so the quiet time × (L + C) / C.
The two counts' outputs are also compared: they must be the same tokens.

Usage (from the repository root, after `make setup` and `cargo build --release -p cotrain-rollout-worker`):
    python3 scripts/bench/shared_cores.py [--bin target/release] [--loads 0,1,4] [--sizes 1,32] [--repeat 3] [--dtype f32]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

PROMPT = "Write a Python function that returns the running sums of a list of numbers."
BUSY = "while True: pass"


def cpu():
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(l.split(":", 1) for l in out.splitlines() if ":" in l)
    return f"{fields.get('Model name', '?').strip()}, family {fields.get('CPU family', '?').strip()}, {os.cpu_count()} CPUs"


def generate(binary, n, dtype, mode):
    """Seconds of decoding (the engine's own figure, model load excluded) and the token ids."""
    out = subprocess.run(
        [binary, "generate", "--prompt", PROMPT, "--n", str(n), "--max-new-tokens", "128",
         "--temperature", "0.8", "--top-p", "0.95", "--ignore-eos", "--seed", "1",
         "--dtype", dtype, "--decode-threads", mode, "--json"],
        capture_output=True, text=True, check=True).stdout
    result = json.loads(out)
    return result["seconds"], [s["token_ids"] for s in result["samples"]]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bin", default="target/release")
    p.add_argument("--loads", default="0,1,4")
    p.add_argument("--sizes", default="1,32")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dtype", default="f32")
    args = p.parse_args()
    binary = os.path.join(args.bin, "rollout-worker")
    cores = os.cpu_count()
    print(f"CPU: {cpu()}; SmolLM2-135M {args.dtype}, 128 tokens per sample, median of {args.repeat}")
    print(f"{'busy loops':>10} {'n':>4} {'fixed s':>9} {'adaptive s':>11} {'fixed/adaptive':>15} {'fair share s':>13} {'same tokens':>12}")
    quiet = {}
    for load in [int(x) for x in args.loads.split(",")]:
        busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(load)]
        try:
            for n in [int(x) for x in args.sizes.split(",")]:
                times = {"fixed": [], "adaptive": []}
                tokens = {}
                for _ in range(args.repeat):
                    for mode in ("fixed", "adaptive"):
                        secs, ids = generate(binary, n, args.dtype, mode)
                        times[mode].append(secs)
                        tokens[mode] = ids
                fixed, adaptive = (statistics.median(times[m]) for m in ("fixed", "adaptive"))
                if load == 0:
                    quiet[n] = fixed
                fair = f"{quiet[n] * (load + cores) / cores:.2f}" if n in quiet else "-"
                same = "yes" if tokens["fixed"] == tokens["adaptive"] else "NO"
                print(f"{load:>10} {n:>4} {fixed:>9.2f} {adaptive:>11.2f} {fixed / adaptive:>15.2f} {fair:>13} {same:>12}", flush=True)
        finally:
            for b in busy:
                b.kill()
                b.wait()


if __name__ == "__main__":
    main()
