#!/usr/bin/env bash
# One MaPoRL step, cotrain next to a reference written the way MaPoRL's trainer works (transformers
# generate, PEFT LoRA, per-agent forward passes for reference log-probs and values, TRL PPOv2-style
# epochs), on this machine, one after the other; prints a table of the phases side by side.
#
#   bash scripts/bench/maporl_step.sh
#
# Knobs (environment):
#   QUESTIONS=32       questions per PPO update (2 steps run on rows 0..Q and Q..2Q; the second is reported)
#   MINI_BATCHES=8     mini-batches per PPO epoch (MaPoRL: 32 questions in 8 mini-batches of 4)
#   TOKENS=64          maporl.max_output_length (exactly this many new tokens, EOS ignored)
#   TURNS=2            maporl.round_num (turn 0 is not trained)
#   PROFILE=auto       cargo profile of the example: release, dev, or auto (release if
#                      target/release/examples/maporl_step_bench exists, else dev: this workspace's dev
#                      profile is optimised, opt-level 1 for its crates and 2 for dependencies)
#   BUILD=1            0: do not run cargo, use the binary that is there
#   REF_PY=~/.cache/cotrain/bench-venv/bin/python   python with torch 2.13, transformers, peft, gguf
#   REF_TUNED=1        run the reference with the process tuning cotrain applies to itself
#                      (cotrain_model::tune_process: MKL's AVX-512 path on AMD CPUs via the preloaded
#                      shim of scripts/reference/mkl-avx512-shim.sh, glibc malloc thresholds); 0: plain
#   REF_ARGS=          extra arguments for maporl_reference.py (e.g. --old-logprobs forward)
#   COTRAIN_ARGS=      extra arguments for the example (e.g. --override maporl.num_mini_batches=4)
#   SKIP_COTRAIN=1 / SKIP_REFERENCE=1   reuse the last JSON in $OUT_DIR for that side
#   REFERENCE_JSON=FILE                 the reference side from another run (default $OUT_DIR/reference.json)
#   OUT_DIR=target/bench/maporl_step   where the JSON lines and logs go
set -euo pipefail
cd "$(dirname "$0")/../.."
QUESTIONS=${QUESTIONS:-32}
MINI_BATCHES=${MINI_BATCHES:-8}
TOKENS=${TOKENS:-64}
TURNS=${TURNS:-2}
PROFILE=${PROFILE:-auto}
BUILD=${BUILD:-1}
REF_PY=${REF_PY:-$HOME/.cache/cotrain/bench-venv/bin/python}
REF_TUNED=${REF_TUNED:-1}
OUT_DIR=${OUT_DIR:-target/bench/maporl_step}
mkdir -p "$OUT_DIR"

if [[ "$PROFILE" == auto ]]; then
  if [[ -x target/release/examples/maporl_step_bench ]]; then PROFILE=release; else PROFILE=dev; fi
fi
case "$PROFILE" in
  release) BIN=target/release/examples/maporl_step_bench; CARGO_PROFILE=(--release) ;;
  dev) BIN=target/debug/examples/maporl_step_bench; CARGO_PROFILE=() ;;
  *) echo "PROFILE must be release, dev or auto" >&2; exit 2 ;;
esac

model=$(LC_ALL=C lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -1)
family=$(LC_ALL=C lscpu | sed -n 's/^CPU family:[[:space:]]*//p' | head -1)
echo "CPU: $model (family $family), $(nproc) cores available"
echo "settings: 2 agents, $TURNS turns, $QUESTIONS questions/step, max_output_length $TOKENS (EOS ignored), temperature 0.7, top_k 0, top_p 1,"
echo "          LoRA r 8 / alpha 16 on 7 projections, 4 PPO epochs x $MINI_BATCHES mini-batches, kl_coef 0.002, vf_coef 0.1, turn 0 not trained,"
echo "          MaPoRL's layout: turn-0 and later-turn adapters shared by the agents, one critic per trained turn,"
echo "          SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to f32), 2 threads; step 2 of 2 (rows $QUESTIONS..$((2 * QUESTIONS))) reported"
echo

if [[ "${SKIP_COTRAIN:-0}" != 1 ]]; then
  if [[ "$BUILD" == 1 ]]; then
    echo "building the example ($PROFILE profile)..." >&2
    cargo build "${CARGO_PROFILE[@]}" -q -p cotrain-learner --example maporl_step_bench >&2
  fi
  echo "running cotrain ($BIN)..." >&2
  # shellcheck disable=SC2086
  # The reference never cuts a prompt; cotrain refuses one over maporl.max_input_length (600 in the
  # seed config, which a discussion of 32 questions' longer rows passes): the whole context here.
  "$BIN" --questions "$QUESTIONS" --mini-batches "$MINI_BATCHES" --tokens "$TOKENS" --turns "$TURNS" \
    --override "maporl.max_input_length=$((1024 - TOKENS))" ${COTRAIN_ARGS:-} \
    2> >(tee "$OUT_DIR/cotrain.log" >&2) | tail -1 > "$OUT_DIR/cotrain.json"
fi

if [[ "${SKIP_REFERENCE:-0}" != 1 ]]; then
  [[ -x "$REF_PY" ]] || { echo "no reference python at $REF_PY (python3 -m venv ~/.cache/cotrain/bench-venv; pip install torch==2.13.0 'transformers>=5,<6' peft gguf accelerate)" >&2; exit 1; }
  env_tuned=()
  if [[ "$REF_TUNED" == 1 ]]; then
    env_tuned=(MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824 MALLOC_MMAP_MAX_=0)
    if grep -q avx512f /proc/cpuinfo && ! grep -q GenuineIntel /proc/cpuinfo; then
      env_tuned+=(LD_PRELOAD="$(bash scripts/reference/mkl-avx512-shim.sh)")
    fi
  fi
  echo "running the reference ($REF_PY scripts/bench/maporl_reference.py, ${env_tuned[*]:-untuned})..." >&2
  # shellcheck disable=SC2086
  env "${env_tuned[@]}" "$REF_PY" scripts/bench/maporl_reference.py --questions "$QUESTIONS" --num-mini-batches "$MINI_BATCHES" --tokens "$TOKENS" --turns "$TURNS" ${REF_ARGS:-} \
    2> >(tee "$OUT_DIR/reference.log" >&2) | tail -1 > "$OUT_DIR/reference.json"
fi

python3 - "$OUT_DIR/cotrain.json" "${REFERENCE_JSON:-$OUT_DIR/reference.json}" <<'EOF'
import json, os, sys
c = json.load(open(sys.argv[1]))
if os.path.exists(sys.argv[2]):
    r = json.load(open(sys.argv[2]))
else:
    # SKIP_REFERENCE=1 without a reference of an earlier run (REFERENCE_JSON=...): cotrain's column only.
    print(f"(no reference figures at {sys.argv[2]}: cotrain's side only)")
    r = {k: None for k in ("rollout", "ppo_prepare", "ppo_epochs", "update", "step", "generated_tokens",
                           "trained_response_tokens", "first_step", "threads", "torch", "transformers", "peft",
                           "old_logprobs", "micro_batch")}
rows = [
    ("rollout: 2 turns of generation + scoring", c["rollout"], r["rollout"]),
    ("PPO inputs: old/ref log-probs, values, GAE", c["ppo_prepare"], r["ppo_prepare"]),
    ("PPO epochs: policy + value fwd/bwd, AdamW", c["ppo_policy"] + c["ppo_value"], r["ppo_epochs"]),
    ("  of which policy (cotrain only)", c["ppo_policy"], None),
    ("  of which value (cotrain only)", c["ppo_value"], None),
    ("update total", c["update"], r["update"]),
    ("adapter push to the rollout worker", c["weight_sync"], None),
    ("whole step", c["step"], r["step"]),
]
fmt = lambda x: "-" if x is None else f"{x:.2f}"
print(f"{'phase':<46} {'cotrain s':>10} {'reference s':>12} {'speed-up':>9}")
print("-" * 80)
for name, a, b in rows:
    sp = f"{b / a:.2f}x" if (a and b is not None) else "-"
    print(f"{name:<46} {fmt(a):>10} {fmt(b):>12} {sp:>9}")
print("-" * 80)
print(f"generated tokens per step: cotrain {c['generated_tokens']}, reference {r['generated_tokens']}; "
      f"trained response tokens: cotrain {int(c['trained_response_tokens'])}, reference {r['trained_response_tokens']}")
print(f"first step (lazy init, not compared): cotrain {c['first_step']:.2f} s, reference {fmt(r['first_step'])} s")
print(f"threads: cotrain {c['threads']}, reference {r['threads']} (torch {r['torch']}, transformers {r['transformers']}, peft {r['peft']}); "
      f"reference old log-probs from {r['old_logprobs']}, micro-batch {r['micro_batch']}")
if "policy_positions" in c:
    # The decoder's projections of SmolLM2-135M (30 layers x 3,538,944 weights): 2 FLOP per weight
    # per position forward, and as many for the input gradient backward (the base is frozen).
    # Attention, LoRA and the LM head come on top; this is the bulk, to set against the roofline.
    # `*_positions_run`: the positions the forwards run once common prompt prefixes are shared.
    per_pos = 4 * 30 * 3_538_944
    for name, secs in (("policy", c["ppo_policy"]), ("value", c["ppo_value"])):
        pos = c[f"{name}_positions"]
        run = c.get(f"{name}_positions_run", pos)
        flop = run * c["num_ppo_epochs"] * per_pos
        print(f"{name} epochs: {int(pos)} positions read, {int(run)} run (prefixes shared) x {c['num_ppo_epochs']} epochs, "
              f"{flop / 1e12:.1f} TFLOP in the projections, {flop / secs / 1e9:.0f} GFLOP/s")
if r["step"] is not None:
    print(f"step speed-up: {r['step'] / c['step']:.2f}x")
EOF
