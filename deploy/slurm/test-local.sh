#!/usr/bin/env bash
# Runs deploy/slurm/cotrain.sbatch for real on a private Slurm cluster on this one machine and checks
# that it trained. Debian's Slurm packages are installed if missing (slurmctld, slurmd, slurm-client);
# one slurmctld and three slurmd (nodes n1-n3, all on 127.0.0.1, each on its own port: Debian's
# slurmd runs several nodes per host with -N) run in the foreground from a state directory under
# /tmp with their own slurm.conf (SLURM_CONF) and are stopped on exit; the script configures and starts
# nothing system-wide (it leaves the packages' own services alone). Two jobs, each `sbatch --wait` on a tiny CPU run of configs/demo.yaml
# (the tiny Llama fixture with a word-level tokenizer, 4 TLDR posts, G = 2, 8 new tokens):
#   1. 2 nodes: reward server and one learner rank on n1, a rollout worker on n2;
#   2. 3 nodes: 2 learner ranks on n1 and n2 (srun --mpi=pmix, the MPI backend), a rollout worker on n3.
# Each must exit 0, write 4 steps of metrics (with `ranks` 2 in job 2), and its worker must have
# answered generate requests for both agents (its Prometheus counters) and required the cluster token.
#
#   deploy/slurm/test-local.sh                        # binaries from target/release
#   COTRAIN_BIN=target/debug deploy/slurm/test-local.sh
#   COTRAIN_ALLOW_SKIP=1 deploy/slurm/test-local.sh   # SKIP (exit 0) where Slurm cannot be installed
#   KEEP=1 ...                                        # keep the state directory (kept anyway on failure)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
BIN=${COTRAIN_BIN:-target/release}
case "$BIN" in /*) ;; *) BIN=$ROOT/$BIN ;; esac
export COTRAIN_BIN=$BIN
START=$(date +%s)

fail() { echo "FAIL: slurm test: $*" >&2; exit 1; }
skip_or_fail() {
  if [ "${COTRAIN_ALLOW_SKIP:-0}" = 1 ]; then echo "SKIP: slurm test: $*"; exit 0; fi
  fail "$* (set COTRAIN_ALLOW_SKIP=1 to skip instead)"
}

for b in reward-server rollout-worker learner; do
  [ -x "$BIN/$b" ] || fail "$BIN/$b not found (build first: make build, or cargo build --workspace --bins)"
done
"$BIN/learner" worker-args --help >/dev/null 2>&1 || fail "$BIN/learner has no worker-args subcommand: the binary is older than the deploy scripts; rebuild it"
"$BIN/rollout-worker" serve --help 2>/dev/null | grep -- --cluster-token-file >/dev/null \
  || fail "$BIN/rollout-worker has no --cluster-token-file: the binary is older than the deploy scripts; rebuild it"
command -v python3 >/dev/null || fail "python3 is needed to write the tiny model's tokenizer"

# --- Slurm from Debian's packages --------------------------------------------------------------
have_slurm() { for c in slurmctld slurmd sbatch srun scontrol sinfo; do command -v "$c" >/dev/null || return 1; done; }
if ! have_slurm; then
  SUDO=
  [ "$(id -u)" = 0 ] || SUDO="sudo -n"
  command -v apt-get >/dev/null || skip_or_fail "Slurm is not installed and there is no apt-get to install it"
  $SUDO true 2>/dev/null || skip_or_fail "Slurm is not installed and installing it needs root (or password-less sudo)"
  echo "installing Slurm (slurmctld slurmd slurm-client) with apt-get..."
  pkgs=(slurmctld slurmd slurm-client)
  export DEBIAN_FRONTEND=noninteractive
  if ! $SUDO apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/tmp/cotrain-slurm-apt.log 2>&1; then
    $SUDO apt-get update -qq >>/tmp/cotrain-slurm-apt.log 2>&1 || true
    $SUDO apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >>/tmp/cotrain-slurm-apt.log 2>&1 \
      || skip_or_fail "apt-get could not install ${pkgs[*]} (see /tmp/cotrain-slurm-apt.log)"
  fi
  have_slurm || skip_or_fail "Slurm's commands are still missing after apt-get"
fi

# --- a private cluster ------------------------------------------------------------------------
for v in $(compgen -e | grep '^SLURM_' || true); do unset "$v"; done
STATE=$(mktemp -d /tmp/cotrain-slurm.XXXXXX)
export SLURM_CONF=$STATE/slurm.conf
daemons=()
jobs_submitted=()
ok=0
cleanup() {
  set +e
  for j in "${jobs_submitted[@]}"; do scancel "$j" 2>/dev/null; done
  for p in "${daemons[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${daemons[@]}"; do wait "$p" 2>/dev/null; done
  if [ $ok = 1 ] && [ "${KEEP:-0}" != 1 ]; then rm -rf "$STATE"; else echo "slurm test state, logs and runs kept in $STATE"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# pick_port VAR: a TCP port nothing accepts connections on at 127.0.0.1, counting up from a random start.
next_port=$(( 20000 + RANDOM % 20000 ))
pick_port() {
  while (exec 3<>"/dev/tcp/127.0.0.1/$next_port") 2>/dev/null; do next_port=$((next_port + 1)); done
  printf -v "$1" %s "$next_port"
  next_port=$((next_port + 1))
}
pick_port CTLD_PORT
HOST=$(uname -n | cut -d. -f1)
mkdir -p "$STATE/state" "$STATE/log"
{
  echo "ClusterName=cotraintest"
  echo "SlurmctldHost=$HOST(127.0.0.1)"
  echo "SlurmctldPort=$CTLD_PORT"
  echo "SlurmUser=$(id -un)"
  echo "SlurmdUser=$(id -un)"
  echo "AuthType=auth/none"
  echo "CredType=cred/none"
  echo "MpiDefault=none"
  echo "ProctrackType=proctrack/linuxproc"
  echo "TaskPlugin=task/none"
  echo "SelectType=select/linear"
  echo "JobAcctGatherType=jobacct_gather/none"
  echo "AccountingStorageType=accounting_storage/none"
  echo "MailProg=/bin/true"
  echo "ReturnToService=2"
  echo "SlurmdParameters=config_overrides"
  echo "KillWait=5"
  echo "StateSaveLocation=$STATE/state"
  echo "SlurmctldPidFile=$STATE/slurmctld.pid"
  echo "SlurmctldLogFile=$STATE/log/slurmctld.log"
  # %n: each node's own spool, pid file, log and TmpFS (pmix puts its per-step directories there).
  echo "SlurmdSpoolDir=$STATE/spool/%n"
  echo "SlurmdPidFile=$STATE/slurmd-%n.pid"
  echo "SlurmdLogFile=$STATE/log/slurmd-%n.log"
  echo "TmpFS=$STATE/tmp/%n"
  port=
  for n in 1 2 3; do
    mkdir -p "$STATE/spool/n$n" "$STATE/tmp/n$n"
    pick_port port
    echo "NodeName=n$n NodeAddr=127.0.0.1 NodeHostname=$HOST Port=$port CPUs=2 RealMemory=1000 State=UNKNOWN"
  done
  echo "PartitionName=test Nodes=n[1-3] Default=YES MaxTime=30 State=UP"
} >"$SLURM_CONF"

slurmctld -D -f "$SLURM_CONF" >"$STATE/log/slurmctld.out" 2>&1 &
daemons+=($!)
for n in 1 2 3; do
  slurmd -D -f "$SLURM_CONF" -N "n$n" >"$STATE/log/slurmd-n$n.out" 2>&1 &
  daemons+=($!)
done
for _ in $(seq 1 60); do
  idle=$(sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l || true)
  [ "$idle" = 3 ] && break
  sleep 1
done
[ "$idle" = 3 ] || { sinfo -N >&2 || true; tail -n 20 "$STATE"/log/*.log >&2; fail "the private Slurm cluster did not come up (logs in $STATE/log)"; }
srun --mpi=list 2>&1 | grep -w pmix >/dev/null || fail "srun --mpi=list does not offer pmix"
echo "private Slurm cluster up: $(sinfo -h -o '%D nodes %N, %P') (slurmctld port $CTLD_PORT, state $STATE)"

# --- a tiny model and config ------------------------------------------------------------------
MODEL=$STATE/tiny-llama-words
python3 - "$ROOT/model/tests/fixtures/tiny/llama" "$MODEL" <<'EOF'
# The tests' tiny_word_model_dir (tests/src/lib.rs): the tiny Llama with a word-level tokenizer.
import json, os, shutil, sys
src, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
for f in ["model.safetensors", "generation_config.json", "config.json"]:
    shutil.copy(os.path.join(src, f), os.path.join(out, f))
special = ["[UNK]", "<s>", "</s>"]
vocab = {s: i for i, s in enumerate(special)}
for i in range(3, 256):
    vocab["w%d%s" % (i, "x" * (i % 60))] = i
added = [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
          "normalized": False, "special": True} for i, c in enumerate(special)]
json.dump({"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
           "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
           "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}},
          open(os.path.join(out, "tokenizer.json"), "w"))
EOF
STEPS=4
tiny_overrides() {
  echo --override
  printf '%s\n' "model.name=$MODEL" model.chat_template=false model.temperature=1.0 model.top_p=1.0 \
    "dataset.train_split=train[:$STEPS]" dataset.eval_split=null magrpo.num_generations=2 magrpo.max_new_tokens=8 \
    magrpo.eval_interval=0 "output.base_dir=$STATE/out" output.save_final_model=false \
    logging.progress=never logging.plots=false logging.tensorboard=false "logging.run_name=$1"
}

# --- the jobs ---------------------------------------------------------------------------------
# Open MPI's TCP transport between the ranks on loopback only: every "node" is this host, and Open MPI
# otherwise tries every interface, among them Docker's docker0 bridge where Docker is installed (a
# two-rank job hung in its first collective with docker0 present). Exported to the job (sbatch passes
# the environment on), and given to cotrain.sbatch's own setting, which exports the same.
export OMPI_MCA_btl_tcp_if_include=lo OMPI_MCA_oob_tcp_if_include=lo LEARNER_MPI_IF=lo
# ok_requests FILE LABEL: the generate requests a worker answered (its Prometheus counter), summed
# over the series whose labels contain LABEL.
ok_requests() {
  awk -v want="$2" 'index($0, "cotrain_rollout_requests_total{") == 1 && index($0, "outcome=\"ok\"") && index($0, want) { s += $NF }
                   END { printf "%d\n", s }' "$1"
}
# run_job NAME NODES RANKS LEARNER_NODES
run_job() {
  local name=$1 nodes=$2 ranks=$3 lnodes=$4 t0 rc=0 rp rhp wp whp
  t0=$(date +%s)
  local logs=$STATE/logs-$name
  mapfile -t overrides < <(tiny_overrides "$name")
  pick_port rp; pick_port rhp; pick_port wp; pick_port whp
  echo "job $name: sbatch --wait --nodes=$nodes (learner: $ranks rank(s) on $lnodes node(s))"
  env RUN_LOGS="$logs" LEARNER_RANKS="$ranks" LEARNER_NODES="$lnodes" WAIT_SECS=120 \
    REWARD_PORT="$rp" REWARD_HTTP_PORT="$rhp" WORKER_PORT="$wp" WORKER_HTTP_PORT="$whp" \
    timeout 600 sbatch --parsable --wait --nodes="$nodes" --time=10 --output="$STATE/job-$name.out" \
      deploy/slurm/cotrain.sbatch configs/demo.yaml "${overrides[@]}" >"$STATE/job-$name.id" &
  local spid=$!
  for _ in $(seq 1 100); do [ -s "$STATE/job-$name.id" ] && break; sleep 0.2; done
  [ -s "$STATE/job-$name.id" ] && jobs_submitted+=("$(head -n1 "$STATE/job-$name.id" | cut -d';' -f1)")
  wait "$spid" || rc=$?
  local problems=()
  [ $rc = 0 ] || problems+=("the job exited with $rc")
  local metrics=$STATE/out/$name/metrics.jsonl
  if [ -f "$metrics" ]; then
    local n
    n=$(wc -l <"$metrics")
    [ "$n" = "$STEPS" ] || problems+=("$metrics has $n lines, not $STEPS")
    python3 - "$metrics" "$ranks" "$STEPS" <<'EOF' || problems+=("the metrics do not show the training run (see above)")
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
ranks, steps = int(sys.argv[2]), int(sys.argv[3])
assert [r["step"] for r in rows] == list(range(1, steps + 1)), [r["step"] for r in rows]
assert all(r["optimizer_steps"] > 0 for r in rows), "no optimiser step"
assert rows[-1]["policy_version"] >= steps, rows[-1]["policy_version"]
assert all(r.get("ranks", 1) == ranks for r in rows), [r.get("ranks") for r in rows]
assert any(r["reward/std"] > 0 for r in rows) or any(r["grad_norm"] > 0 for r in rows), "nothing to learn from"
EOF
  else
    problems+=("no $metrics")
  fi
  local prom
  prom=$(ls "$logs"/worker-*.prom 2>/dev/null | head -n1 || true)
  if [ -n "$prom" ]; then
    for agent in agent0 agent1; do
      local c
      c=$(ok_requests "$prom" "agent=\"$agent\"")
      [ "$c" -gt 0 ] || problems+=("the worker answered no generate request for $agent ($prom)")
    done
  else
    problems+=("no worker metrics in $logs")
  fi
  sed 's/\x1b\[[0-9;]*m//g' "$logs"/worker-*.log 2>/dev/null | grep 'rollout worker serving.*cluster_token=true' >/dev/null \
    || problems+=("the worker did not run with the cluster token")
  [ "$(grep -c 'weight update applied' "$logs"/worker-*.log 2>/dev/null | awk -F: '{s += $NF} END {print s + 0}')" -ge $((2 * STEPS)) ] \
    || problems+=("the worker did not apply a weight update per agent and step")
  if [ "$ranks" -gt 1 ]; then
    grep -q "world=$ranks" "$logs/learner.log" || problems+=("the learner did not run $ranks ranks")
  fi
  local secs=$(( $(date +%s) - t0 ))
  if [ ${#problems[@]} -gt 0 ]; then
    {
      echo "--- job output ($STATE/job-$name.out), its errors, then its end:"
      grep -i -m 10 'error' "$STATE/job-$name.out" || true
      echo "..."
      tail -n 20 "$STATE/job-$name.out" || true
      for f in "$logs"/*.log; do [ -f "$f" ] && { echo "--- $f:"; tail -n 10 "$f"; }; done
    } >&2 2>/dev/null || true
    fail "job $name: $(printf '%s; ' "${problems[@]}")"
  fi
  local reqs
  reqs=$(ok_requests "$prom" "")
  echo "job $name: ok in ${secs}s ($STEPS steps in $metrics, $reqs generate requests answered by the worker, ranks $ranks)"
}

run_job two-nodes 2 1 1
run_job ranks 3 2 2
ok=1
echo "PASS: slurm test: cotrain.sbatch trained on a 3-node private Slurm cluster (1 rank; 2 ranks over srun --mpi=pmix) in $(( $(date +%s) - START ))s"
