#!/usr/bin/env bash
# Runs a whole cotrain cluster as separate processes on this machine: one reward server,
# N rollout workers, and the learner driving them over gRPC on loopback.
# The workers accept weight updates through /dev/shm (--allow-shm-weights): every process is on this host.
#
#   deploy/local/cluster.sh [--workers N] [--model MODEL] -- <learner train args...>
#   deploy/local/cluster.sh --workers 2 -- --config configs/demo.yaml
#
# Every process logs to $RUN_LOGS (default runs/cluster-logs/). Ctrl-C stops them all.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BIN=${COTRAIN_BIN:-$ROOT/target/release}
WORKERS=2
MODEL=default
AGENTS=2
while [ $# -gt 0 ]; do
  case "$1" in
    --workers) WORKERS=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --agents) AGENTS=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "unknown option $1 (learner arguments go after --)" >&2; exit 2 ;;
  esac
done
for b in reward-server rollout-worker learner; do
  [ -x "$BIN/$b" ] || { echo "error: $BIN/$b not found; run 'make build' first" >&2; exit 1; }
done
LOGS=${RUN_LOGS:-$ROOT/runs/cluster-logs}
mkdir -p "$LOGS"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM

# Wait until a process prints its "listening grpc=... http=..." line and echo the grpc address.
wait_listening() {
  local log=$1 name=$2
  for _ in $(seq 1 600); do
    if line=$(grep -m1 '^listening ' "$log" 2>/dev/null); then
      sed -E 's/.*grpc=([^ ]+).*/\1/' <<<"$line"; return 0
    fi
    sleep 0.5
  done
  echo "error: $name did not start; see $log" >&2; exit 1
}

"$BIN/reward-server" --grpc-addr 127.0.0.1:0 --http-addr 127.0.0.1:0 >"$LOGS/reward-server.log" 2>&1 &
pids+=($!)
reward=$(wait_listening "$LOGS/reward-server.log" reward-server)
echo "reward server at $reward"

agent_args=()
for i in $(seq 0 $((AGENTS - 1))); do agent_args+=(--agent "agent$i=$MODEL"); done
endpoints=()
for w in $(seq 1 "$WORKERS"); do
  "$BIN/rollout-worker" serve --grpc-addr 127.0.0.1:0 --http-addr 127.0.0.1:0 --separate-weights --allow-shm-weights "${agent_args[@]}" \
    >"$LOGS/rollout-worker-$w.log" 2>&1 &
  pids+=($!)
done
for w in $(seq 1 "$WORKERS"); do
  ep=$(wait_listening "$LOGS/rollout-worker-$w.log" "rollout-worker-$w")
  echo "rollout worker $w at $ep"
  endpoints+=("http://$ep")
done
list=$(IFS=,; echo "${endpoints[*]}")
"$BIN/learner" train "$@" \
  --override "rollout.endpoints=[$list]" \
  --override "reward.endpoint=http://$reward"
