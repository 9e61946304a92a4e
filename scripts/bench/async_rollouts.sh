#!/usr/bin/env bash
# Asynchronous rollouts against synchronous on-policy training, on this machine, one after the other:
# a rollout worker pinned to core 0 and the learner (with its embedded reward server) pinned to core 1
# (taskset), the demo's MAGRPO run (TLDR, SmolLM2-135M-Instruct, 2 agents, G = 4, 96 new tokens,
# temperature 0.8, top-p 0.95) with rollout.max_off_policy_steps = 0 and then = 1. Prints steps per
# hour of both and draws their reward curves into one chart.
#
#   bash scripts/bench/async_rollouts.sh
#
# Knobs (environment):
#   STEPS=8           training steps per run (one post per step, as the demo)
#   PROFILE=dev       cargo profile of the binaries: dev (this workspace's dev profile is optimised) or release
#   OUT_DIR=target/bench/async_rollouts
set -euo pipefail
cd "$(dirname "$0")/../.."
STEPS=${STEPS:-8}
PROFILE=${PROFILE:-dev}
OUT_DIR=${OUT_DIR:-target/bench/async_rollouts}
case "$PROFILE" in
  release) BIN=target/release; PROFILE_ARGS=(--release) ;;
  dev) BIN=target/debug; PROFILE_ARGS=() ;;
  *) echo "PROFILE must be dev or release" >&2; exit 2 ;;
esac
[[ $(nproc) -ge 2 ]] || { echo "this benchmark pins the worker and the learner to one core each: it needs 2 cores" >&2; exit 2; }
command -v taskset >/dev/null || { echo "taskset (util-linux) is needed" >&2; exit 2; }
rm -rf "$OUT_DIR"; mkdir -p "$OUT_DIR"

model=$(LC_ALL=C lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -1)
family=$(LC_ALL=C lscpu | sed -n 's/^CPU family:[[:space:]]*//p' | head -1)
cpu_model=$(LC_ALL=C lscpu | sed -n 's/^Model:[[:space:]]*//p' | head -1)
echo "CPU: $model (family $family, model $cpu_model), $(nproc) cores; rollout worker on core 0, learner on core 1"
echo "settings: configs/demo.yaml (MAGRPO, TLDR, 2 agents, G 4, 96 new tokens, temperature 0.8, top-p 0.95), $STEPS steps per run"
echo

cargo build "${PROFILE_ARGS[@]}" -q -p cotrain-rollout-worker -p cotrain-learner --bins >&2

run() {
  local k=$1
  local log="$OUT_DIR/worker-k$k.log"
  # A fresh worker per run, so that both start from the same served weights.
  taskset -c 0 "$BIN/rollout-worker" serve --grpc-addr 127.0.0.1:0 --http-addr 127.0.0.1:0 --threads 1 \
    --agent agent0=default --agent agent1=default --allow-shm-weights >"$log" 2>&1 &
  local worker=$!
  local grpc=""
  for _ in $(seq 1 600); do
    grpc=$(sed -n 's/^listening grpc=\([^ ]*\) .*/\1/p' "$log" | head -1)
    [[ -n "$grpc" ]] && break
    sleep 0.5
  done
  [[ -n "$grpc" ]] || { echo "the rollout worker did not start; see $log" >&2; kill $worker; exit 1; }
  echo "k=$k: training ($STEPS steps) against the worker at $grpc..." >&2
  taskset -c 1 "$BIN/learner" train --config configs/demo.yaml --override \
    "rollout.endpoints=['http://$grpc']" "rollout.max_off_policy_steps=$k" \
    "dataset.train_split=train[:$STEPS]" magrpo.eval_interval=0 logging.progress=never logging.plots=false \
    "output.base_dir=$OUT_DIR" "logging.run_name=k$k" output.save_final_model=false >"$OUT_DIR/learner-k$k.log" 2>&1 \
    || { echo "the learner failed; see $OUT_DIR/learner-k$k.log" >&2; kill $worker; exit 1; }
  kill $worker; wait $worker 2>/dev/null || true
}

run 0
run 1

python3 - "$OUT_DIR" <<'PY'
import json, sys
out = sys.argv[1]
rows = {}
for k in (0, 1):
    recs = [json.loads(l) for l in open(f"{out}/k{k}/metrics.jsonl")]
    # Steps per hour between the end of step 1 (model loads and the first rollout behind) and the last.
    span = recs[-1]["time"] - recs[0]["time"]
    rows[k] = dict(
        steps_per_hour=3600 * (len(recs) - 1) / span,
        step=span / (len(recs) - 1),
        gen=sum(r["time/generate"] for r in recs[1:]) / (len(recs) - 1),
        train=sum(r["time/train"] for r in recs[1:]) / (len(recs) - 1),
        overlap=sum(r.get("async/overlap_secs", 0.0) for r in recs[1:]) / (len(recs) - 1),
        reward=[round(r["reward/mean"], 2) for r in recs],
        stale=max(r.get("async/staleness_max", 0.0) for r in recs),
    )
print(f"{'':24}{'k = 0 (sync)':>16}{'k = 1 (async)':>16}")
print(f"{'steps per hour':24}{rows[0]['steps_per_hour']:16.1f}{rows[1]['steps_per_hour']:16.1f}")
print(f"{'s per step (2..N)':24}{rows[0]['step']:16.2f}{rows[1]['step']:16.2f}")
print(f"{'  generate on the step':24}{rows[0]['gen']:16.2f}{rows[1]['gen']:16.2f}")
print(f"{'  train':24}{rows[0]['train']:16.2f}{rows[1]['train']:16.2f}")
print(f"{'  overlapped':24}{rows[0]['overlap']:16.2f}{rows[1]['overlap']:16.2f}")
print(f"{'max staleness':24}{rows[0]['stale']:16.0f}{rows[1]['stale']:16.0f}")
print(f"speed-up k=1 / k=0: {rows[1]['steps_per_hour'] / rows[0]['steps_per_hour']:.2f}x (target 1.3x)")
print("reward per step, k=0:", rows[0]["reward"])
print("reward per step, k=1:", rows[1]["reward"])
PY
"$BIN/learner" plot "$OUT_DIR/k0" "$OUT_DIR/k1" --key reward/mean --out "$OUT_DIR/reward.png" >/dev/null
echo "reward curves: $OUT_DIR/reward.png"
