"""Helpers of scripts/device/check.sh, standard library only (CI's Python has no torch).

    tools.py word-tokenizer OUT.json                     a word-level tokenizer for the tiny fixture model
    tools.py same-tokens A.json B.json                   two `rollout-worker generate --json` outputs agree
    tools.py gen-figure GEN.json SHAPE BATCH PEAK_MIB RC one JSON line: cotrain's generation figures
    tools.py speed-table SHAPE HF.json COTRAIN.jsonl CONFIG.json
    tools.py step-figures METRICS.jsonl CONFIG.json PEAK_MIB MODE
    tools.py same-runs RUN_ONE RUN_TWO                   metrics and final weights of two runs agree
    tools.py maporl-table METRICS.jsonl [REFERENCE.json] a MaPoRL step's phases, cotrain against the reference
"""

import json
import math
import os
import struct
import sys
from array import array

# Dense bf16 tensor-core peak (FLOP/s) and memory bandwidth (bytes/s) of the GPUs we run on, from
# NVIDIA's data sheets (SXM parts): H100 989 TFLOP/s and 3.35 TB/s, H200 989 TFLOP/s and 4.8 TB/s.
GPUS = {"H100": (989e12, 3.35e12), "H200": (989e12, 4.8e12)}


def gpu_peaks():
    """(bf16 FLOP/s, bytes/s) of this machine's GPU, or None."""
    name = os.popen("nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null").read()
    for key, peaks in GPUS.items():
        if key in name:
            return peaks
    return None


def word_tokenizer(out):
    special = ["[UNK]", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(special)}
    vocab.update({f"w{i}" + "x" * (i % 60): i for i in range(3, 256)})
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, t in enumerate(special)]
    json.dump({"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
               "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None,
               "decoder": None, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}},
              open(out, "w"))


def same_tokens(a, b):
    ids = lambda p: [s["token_ids"] for s in json.load(open(p))["samples"]]
    try:
        x, y = ids(a), ids(b)
    except (OSError, ValueError, KeyError) as e:
        print(f"no tokens to compare ({e.__class__.__name__}: {e}); see the .err files beside them")
        return 1
    print(f"{sum(len(s) for s in x)} tokens, {x[0][:8]}")
    if not x or x != y:
        print(f"differ:\n{a}: {x}\n{b}: {y}")
        return 1
    return 0


def params_of(config):
    """Parameter count of a Llama/Qwen2/Qwen3 config (tied or not)."""
    c = json.load(open(config))
    h, f, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    heads, kv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    hd = c.get("head_dim") or h // heads
    attn = h * heads * hd * 2 + h * kv * hd * 2
    if c.get("model_type") == "qwen2":
        attn += heads * hd + 2 * kv * hd  # q/k/v biases
    if c.get("model_type") == "qwen3":
        attn += 2 * hd  # q/k norms
    per_layer = attn + 3 * h * f + 2 * h
    emb = vocab * h * (1 if c.get("tie_word_embeddings") else 2)
    return layers * per_layer + emb + h


def gen_figure(path, shape, batch, peak, rc):
    row = {"shape": shape, "batch": int(batch), "peak_mib": int(peak) if peak.strip() else None, "rc": int(rc)}
    try:
        g = json.load(open(path))
        row.update(tokens=g["generated_tokens"], seconds=g["seconds"], tok_s=g["generated_tokens"] / g["seconds"])
    except (OSError, ValueError, KeyError) as e:
        row["error"] = f"no output ({e.__class__.__name__})"
    print(json.dumps(row))


def speed_table(shape, hf_path, ours_path, config):
    try:
        hf = {r["batch"]: r for r in json.load(open(hf_path))["runs"]}
    except (OSError, ValueError, KeyError):
        hf = {}
    ours = {}
    for line in open(ours_path):
        r = json.loads(line)
        if r["shape"] == shape:
            ours[r["batch"]] = r
    peaks = gpu_peaks()
    weight_bytes = 2 * params_of(config)
    print(f"{'batch':>5} {'cotrain tok/s':>14} {'transformers':>13} {'ratio':>6} {'roofline':>9} {'cotrain MiB':>12} {'hf MiB':>8}")
    for b in sorted(set(hf) | set(ours)):
        o, h = ours.get(b, {}), hf.get(b, {})
        # Decoding reads every weight once per step for the whole batch: B x bandwidth / weight bytes.
        roof = b * peaks[1] / weight_bytes if peaks else float("nan")
        ratio = o.get("tok_s", math.nan) / h.get("tok_s", math.nan) if h.get("tok_s") else math.nan
        print(f"{b:>5} {o.get('tok_s', math.nan):>14.1f} {h.get('tok_s', math.nan):>13.1f} {ratio:>6.2f} {roof:>9.0f} "
              f"{str(o.get('peak_mib')):>12} {str(h.get('peak_mib')):>8}" + (f"  cotrain: {o['error']}" if "error" in o else ""))


def step_figures(metrics, config, peak, mode):
    rows = [json.loads(l) for l in open(metrics) if l.strip()]
    if not rows:
        print("no steps in", metrics)
        return 1
    last = rows[-1]  # the first step also warms up (allocator, kernels)
    t = lambda k: float(last.get(k, math.nan))
    n = params_of(config)
    # The learner's trained (completion) tokens per second of the update; prompt tokens, which the
    # forward also runs, are not counted, so the utilisation below is a lower bound.
    tps = last.get("train_tokens_per_s")
    tokens = tps * t("time/train") if tps else None
    print(f"steps {len(rows)}; last step {t('time/step'):.2f} s: generate {t('time/generate'):.2f}, reward {t('time/reward'):.2f}, "
          f"train {t('time/train'):.2f} (forward {t('time/train_forward'):.2f}, backward {t('time/train_backward'):.2f}, "
          f"optimizer {t('time/train_optimizer'):.2f}), weight sync {t('time/weight_sync'):.2f}")
    print(f"peak GPU memory {peak or 'n/a'} MiB; {n / 1e6:.1f} M parameters per agent; {tps or 0:.0f} trained tokens/s; reward/mean {last.get('reward/mean'):.4g}")
    peaks = gpu_peaks()
    if tokens and mode == "gpu" and peaks:
        # Model FLOPs of the update: 6 x parameters x trained tokens (forward 2, backward 4).
        # Each trained token (summed over the policies) passes through one policy of n parameters.
        mfu = 6 * n * tps / peaks[0]
        print(f"update MFU {100 * mfu:.1f}% ({tokens:.0f} trained tokens of all policies at {tps:.0f}/s, {peaks[0] / 1e12:.0f} TFLOP/s bf16 peak)")
    elif not tokens:
        print("(no trained-token count in the metrics: MFU not computed)")
    return 0


def read_safetensors(path):
    """{name: list of floats} for f32/bf16/f16 tensors."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        raw = data[a:b]
        if meta["dtype"] == "F32":
            v = array("f"); v.frombytes(raw)
        elif meta["dtype"] == "BF16":
            h = array("H"); h.frombytes(raw)
            v = array("f"); v.frombytes(array("I", (x << 16 for x in h)).tobytes())
        elif meta["dtype"] == "F16":
            v = [struct.unpack("<e", raw[i:i + 2])[0] for i in range(0, len(raw), 2)]
        else:
            continue
        out[name] = v
    return out


def same_runs(one, two):
    m = lambda d: [json.loads(l) for l in open(os.path.join(d, "metrics.jsonl")) if l.strip()]
    m1, m2 = m(one), m(two)
    ok = len(m1) == len(m2) > 0
    print(f"steps: one {len(m1)}, two {len(m2)}")
    for a, b in zip(m1, m2):
        for k in ["reward/mean", "reward/std", "loss", "grad_norm"]:
            if k not in a:
                continue
            good = abs(a[k] - b[k]) <= 1e-5 * max(abs(a[k]), 1.0)
            ok &= good
            print(f"step {a.get('step')} {k}: one {a[k]:.6g} two {b[k]:.6g}" + ("" if good else "  <-- differs"))
    final = os.path.join(one, "final_model")
    agents = sorted(os.listdir(final)) if os.path.isdir(final) else []
    ok &= bool(agents)
    for agent in agents:
        A = read_safetensors(os.path.join(one, "final_model", agent, "model.safetensors"))
        B = read_safetensors(os.path.join(two, "final_model", agent, "model.safetensors"))
        ok &= A.keys() == B.keys()
        worst = 0.0
        for k in A:
            num = math.sqrt(sum((x - y) ** 2 for x, y in zip(A[k], B[k])))
            den = max(math.sqrt(sum(x * x for x in A[k])), 1e-12)
            worst = max(worst, num / den)
        good = worst <= 1e-5
        ok &= good
        print(f"{agent}: largest relative weight difference {worst:.2e}" + ("" if good else "  <-- differs"))
    return 0 if ok else 1

def maporl_table(metrics, reference=None):
    """The second MaPoRL step of `learner train` (the first warms up) against the second step of
    scripts/bench/maporl_reference.py, phase by phase, as scripts/bench/maporl_step.sh prints them."""
    steps = [r for r in (json.loads(l) for l in open(metrics) if l.strip()) if "time/step" in r]
    if len(steps) < 2:
        print(f"{len(steps)} timed steps in {metrics}; two are needed (the first warms up)")
        return 1
    ours = steps[1]
    ref = {}
    if reference:
        try:
            ref = json.loads(open(reference).read().strip().splitlines()[-1])
        except (OSError, ValueError, IndexError):
            ref = {}
    rows = [("rollout", "time/rollout", "rollout"), ("PPO inputs", "time/ppo_prepare", "ppo_prepare"),
            ("PPO epochs", "time/ppo_epochs", "ppo_epochs"), ("whole step", "time/step", "step")]
    print(f"{'phase':<12} {'cotrain s':>10} {'reference s':>12} {'speed-up':>9}")
    for name, ours_key, ref_key in rows:
        o, r = float(ours.get(ours_key, math.nan)), float(ref.get(ref_key, math.nan))
        print(f"{name:<12} {o:>10.2f} {r:>12.2f} {r / o if o > 0 else math.nan:>8.2f}x")
    print(f"trained response tokens: cotrain {ours.get('train/response_tokens', math.nan):.0f}, reference "
          f"{ref.get('trained_response_tokens', math.nan)}; cotrain policy/value positions read "
          f"{ours.get('train/policy_positions', math.nan):.0f}/{ours.get('train/value_positions', math.nan):.0f}, "
          f"run {ours.get('train/policy_positions_run', math.nan):.0f}/{ours.get('train/value_positions_run', math.nan):.0f}")
    return 0


def main():
    cmd, args = sys.argv[1], sys.argv[2:]
    fn = {"word-tokenizer": word_tokenizer, "same-tokens": same_tokens, "gen-figure": gen_figure,
          "speed-table": speed_table, "step-figures": step_figures, "same-runs": same_runs,
          "maporl-table": maporl_table}[cmd]
    sys.exit(fn(*args) or 0)


if __name__ == "__main__":
    main()
