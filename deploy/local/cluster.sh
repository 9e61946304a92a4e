#!/usr/bin/env bash
# Runs a whole cotrain cluster as separate processes on this machine: one reward server,
# N rollout workers, and the learner (one rank, or several under `learner launch`) driving them over
# gRPC on loopback. The workers serve the agents and models of the learner's config: their
# `--agent` arguments come from `learner worker-args` with the same config and overrides.
# The workers accept weight updates through /dev/shm (--allow-shm-weights): every process is on this host.
#
#   deploy/local/cluster.sh [--workers N] [--learner-ranks N] [--restarts N] -- <learner train args...>
#   deploy/local/cluster.sh --workers 2 -- --config configs/demo.yaml
#   deploy/local/cluster.sh --workers 1 --worker-arg --engine --worker-arg vllm -- --config configs/demo.yaml
#   deploy/local/cluster.sh --workers 1 --learner-ranks 2 -- --config configs/demo.yaml --override magrpo.max_new_tokens=32
#
# Every process logs to $RUN_LOGS (default runs/cluster-logs/). Ctrl-C stops them all.
# Every process is supervised: one that dies is started again (up to --restarts N times each, default
# 3): the reward server and the workers on the addresses they first bound (the pool catches a
# restarted worker up before it gets requests), the learner with `--resume auto` (logging.run_name is
# the config's, or cluster-<time>), so the run continues from its newest checkpoint; give --resume DIR
# to continue another run instead.
# COTRAIN_BIN picks the binaries (default target/release); COTRAIN_CLUSTER_TOKEN_FILE, if set, is
# required by the workers and sent by the learner.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BIN=${COTRAIN_BIN:-$ROOT/target/release}
WORKERS=2
RANKS=1
RESTARTS=3
WORKER_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --workers) WORKERS=$2; shift 2 ;;
    --learner-ranks) RANKS=$2; shift 2 ;;
    --restarts) RESTARTS=$2; shift 2 ;;
    # One more argument for every worker, e.g. `--worker-arg --engine --worker-arg vllm`.
    --worker-arg) WORKER_ARGS+=("$2"); shift 2 ;;
    --model|--agents) echo "error: $1 is gone: the workers serve the config's agents (learner worker-args); change the model with -- --override model.name=MODEL" >&2; exit 2 ;;
    --) shift; break ;;
    *) echo "unknown option $1 (learner arguments go after --)" >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "usage: $0 [--workers N] [--learner-ranks N] -- --config FILE [learner train args...]" >&2; exit 2; }
for b in reward-server rollout-worker learner; do
  [ -x "$BIN/$b" ] || { echo "error: $BIN/$b not found; run 'make build' first" >&2; exit 1; }
done
LOGS=${RUN_LOGS:-$ROOT/runs/cluster-logs}
mkdir -p "$LOGS"
pids=()
cleanup() {
  # A supervisor first (so that it starts nothing again), then what it runs.
  for p in "${pids[@]}"; do
    kids=$(pgrep -P "$p" || true)
    kill "$p" 2>/dev/null || true
    for k in $kids; do kill "$k" 2>/dev/null || true; done
  done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# The learner arguments that describe the config (all but --resume) give the workers' agents.
config_args=()
skip=0
for a in "$@"; do
  if [ $skip = 1 ]; then skip=0; continue; fi
  case "$a" in
    --resume) skip=1 ;;
    --resume=*) ;;
    *) config_args+=("$a") ;;
  esac
done
agent_out=$("$BIN/learner" worker-args "${config_args[@]}") || {
  echo "error: '$BIN/learner worker-args' failed (an old binary without it? run 'make build')" >&2; exit 1; }
mapfile -t agent_args <<<"$agent_out"
echo "workers serve: ${agent_args[*]}"

# Wait until a process prints its "listening grpc=... http=..." line and echo the grpc address.
wait_listening() {
  local log=$1 name=$2 pid=$3
  # Up to 15 minutes: a worker on vLLM (--worker-arg --engine --worker-arg vllm) starts an engine
  # process per model first.
  for _ in $(seq 1 1800); do
    if line=$(grep -m1 '^listening ' "$log" 2>/dev/null); then
      sed -E 's/.*grpc=([^ ]+).*/\1/' <<<"$line"; return 0
    fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  echo "error: $name did not start; see $log" >&2; tail -n 20 "$log" >&2; return 1
}

# supervise LOG CMD...: runs CMD --grpc-addr ADDR (port 0 the first time, then the port it bound)
# and starts it again when it dies, up to $RESTARTS times; in the background.
supervise() {
  local log=$1; shift
  (
    addr=127.0.0.1:0
    n=0
    while :; do
      "$@" --grpc-addr "$addr" >>"$log" 2>&1 && exit 0
      n=$((n + 1))
      if [ "$n" -gt "$RESTARTS" ]; then echo "[cluster] exited $n times; not started again" >>"$log"; exit 1; fi
      if line=$(grep -m1 '^listening ' "$log"); then addr=$(sed -E 's/.*grpc=([^ ]+).*/\1/' <<<"$line"); fi
      echo "[cluster] exited; starting it again on $addr ($n of $RESTARTS)" >>"$log"
      sleep 1
    done
  ) &
}

: >"$LOGS/reward-server.log"
supervise "$LOGS/reward-server.log" "$BIN/reward-server" --http-addr 127.0.0.1:0
reward_pid=$!
pids+=("$reward_pid")
reward=$(wait_listening "$LOGS/reward-server.log" reward-server "$reward_pid")
echo "reward server at $reward"

endpoints=()
worker_pids=()
for w in $(seq 1 "$WORKERS"); do
  : >"$LOGS/rollout-worker-$w.log"
  supervise "$LOGS/rollout-worker-$w.log" "$BIN/rollout-worker" serve --http-addr 127.0.0.1:0 --allow-shm-weights \
    "${agent_args[@]}" ${WORKER_ARGS[@]+"${WORKER_ARGS[@]}"}
  pids+=($!)
  worker_pids+=($!)
done
for w in $(seq 1 "$WORKERS"); do
  ep=$(wait_listening "$LOGS/rollout-worker-$w.log" "rollout-worker-$w" "${worker_pids[$((w - 1))]}")
  echo "rollout worker $w at $ep"
  endpoints+=("http://$ep")
done
list=$(IFS=,; echo "${endpoints[*]}")
services=(--override "rollout.endpoints=[$list]" --override "reward.endpoint=http://$reward")
resume=()
if [ ${#config_args[@]} = $# ]; then   # no --resume given: the run resumes itself after a failure
  resume=(--resume auto)
  run_name=$("$BIN/learner" check-config "${config_args[@]}" | sed -n 's/^  run_name: //p')
  if [ -z "$run_name" ] || [ "$run_name" = null ]; then
    run_name=cluster-$(date +%Y%m%d-%H%M%S)
    resume+=(--override "logging.run_name=$run_name")
  fi
  echo "run: $run_name (resumed automatically when the learner is started again)"
fi
n=0
while :; do
  if [ "$RANKS" -gt 1 ]; then
    echo "learner: $RANKS ranks (learner launch)"
    "$BIN/learner" launch --nproc-per-node "$RANKS" -- train "$@" ${resume[@]+"${resume[@]}"} "${services[@]}" && break
  else
    "$BIN/learner" train "$@" ${resume[@]+"${resume[@]}"} "${services[@]}" && break
  fi
  n=$((n + 1))
  if [ ${#resume[@]} = 0 ] || [ "$n" -gt "$RESTARTS" ]; then echo "error: the learner failed" >&2; exit 1; fi
  echo "the learner failed; starting it again ($n of $RESTARTS), resuming its run"
  sleep 2
done
