#!/usr/bin/env bash
# Builds cotrain's CPU image for real and trains through a cluster of its containers on this machine.
#   1. Docker: Debian's docker.io is installed with apt-get if there is no dockerd; if no daemon
#      answers, dockerd is started in the background (and stopped at the end; one that was already
#      running is left alone). No Docker Hub: nothing is pulled.
#   2. deploy/docker/base-image.sh: cotrain-base:bookworm, debootstrap of Debian 12 from this
#      machine's Debian mirror (skipped when the image exists: the cache is this machine's images).
#   3. deploy/docker/build-image.sh: cotrain:cpu from the PREBUILT binaries in $COTRAIN_BIN (the CPU
#      libtorch, the default model, configs/ and data/ beside them; the build itself checks `ldd`).
#   4. A user-defined Docker network and on it one reward-server container, two `rollout-worker
#      serve` containers (their `--agent` arguments from `learner worker-args` run in the image) and
#      the learner, every service bound to 0.0.0.0 in its container and reached by container name;
#      the workers require a cluster token (a file mounted read-only, COTRAIN_CLUSTER_TOKEN_FILE),
#      which the learner sends. The learner trains the first STEPS steps of configs/demo.yaml (the
#      embedded default model SmolLM2-135M-Instruct, G = 2, 16 new tokens, no evaluation).
# It checks: the learner exits 0 with STEPS steps of metrics; each worker answered generate requests
# (its Prometheus counters, read over the network), required the token and applied the weight
# updates; the reward server answered the learner's score requests; the reward server's sandbox works in its container (its start-up isolation probe, then a
# HumanEval-style completion scored through /v1/score, right and wrong, and a /v1/execute run that
# sees only its own PID namespace and loopback). Containers and the network are removed on exit.
#
# The sandbox's privileges. The reward server runs model-written code with bubblewrap, as an
# unprivileged user (here the container runs it as nobody, 65534), in new user, PID, network, IPC,
# UTS, cgroup and mount namespaces with its own /proc. In a container that needs exactly
#   --security-opt seccomp=unconfined --security-opt systempaths=unconfined
# and nothing else (no capability, no --privileged), tried in this order with Docker 20.10 (Debian's
# docker.io, runc 1.1, cgroup v1; this kernel has no AppArmor):
#   no flags                              "No permissions to create new namespace": Docker's default
#                                         seccomp profile refuses unshare/clone of a user namespace
#                                         (it allows them only with CAP_SYS_ADMIN)
#   seccomp=unconfined (+ apparmor=unconfined, a no-op here)
#                                         "Can't mount proc on /newroot/proc: Operation not permitted":
#                                         Docker masks parts of /proc (/proc/kcore, /proc/keys, ...
#                                         over-mounted, /proc/sys read-only), and the kernel refuses a
#                                         fresh procfs in a user namespace while the container's /proc
#                                         has such locked over-mounts (mount_too_revealing)
#   --cap-add SYS_ADMIN (with or without systempaths=unconfined)
#                                         "pivot_root: Operation not permitted": the capability widens
#                                         the seccomp profile for unshare and mount, but pivot_root is
#                                         not in Docker's default profile at all
#   seccomp=unconfined + systempaths=unconfined   works (sandboxed code sees PID 2-3 and only `lo`)
#   --privileged                          not needed (and refused by this VM's runc: "unable to apply caps")
# On a host with AppArmor, add --security-opt apparmor=unconfined (docker-default denies mount; not
# tried here). A custom seccomp profile (Docker's default plus unshare, mount, umount2, pivot_root)
# could replace seccomp=unconfined; not written.
# systempaths=unconfined unmasks /proc for the container's root: the reward server's container runs
# as nobody (--user 65534:65534), with no capabilities, so that exposes nothing writable.
#
#   deploy/docker/test-local.sh                        # binaries from target/release
#   COTRAIN_BIN=target/debug deploy/docker/test-local.sh
#   COTRAIN_ALLOW_SKIP=1 deploy/docker/test-local.sh   # SKIP (exit 0) where Docker cannot be had
#   KEEP=1 ...                                         # keep the state directory (kept anyway on failure)
# Measured on a 2-core Debian 12 VM without Docker or images, with the debug binaries, while a cargo build shared the
# cores: 4.3 min in all (installing docker.io 20 s, base image 95 s, image 65 s, the cluster 75 s:
# services up 23 s, the learner's 2 steps 48 s); 2 minutes with docker.io and the images there.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
BIN=${COTRAIN_BIN:-target/release}
case "$BIN" in /*) ;; *) BIN=$ROOT/$BIN ;; esac
export COTRAIN_BIN=$BIN
IMAGE=${COTRAIN_IMAGE:-cotrain:cpu}
STEPS=${STEPS:-2}
START=$(date +%s)

fail() { echo "FAIL: docker test: $*" >&2; exit 1; }
skip_or_fail() {
  if [ "${COTRAIN_ALLOW_SKIP:-0}" = 1 ]; then echo "SKIP: docker test: $*"; exit 0; fi
  fail "$* (set COTRAIN_ALLOW_SKIP=1 to skip instead)"
}
phase() { echo "docker test: $1 in $(( $(date +%s) - $2 ))s"; }

for b in reward-server rollout-worker learner; do
  [ -x "$BIN/$b" ] || fail "$BIN/$b not found (build first: make build, or cargo build --workspace --bins)"
done
"$BIN/learner" worker-args --help >/dev/null 2>&1 || fail "$BIN/learner has no worker-args subcommand: the binary is older than the deploy scripts; rebuild it"
"$BIN/rollout-worker" serve --help 2>/dev/null | grep -- --cluster-token-file >/dev/null \
  || fail "$BIN/rollout-worker has no --cluster-token-file: the binary is older than the deploy scripts; rebuild it"

SUDO=
[ "$(id -u)" = 0 ] || SUDO="sudo -n"
STATE=$(mktemp -d /tmp/cotrain-docker.XXXXXX)
P=cotrain-test-$$                 # the network's name and the containers' prefix
DOCKER=
containers=()
network=
dockerd_pid=
ok=0
cleanup() {
  set +e
  for c in "${containers[@]}"; do "$DOCKER" rm -f "$c" >/dev/null 2>&1; done
  [ -n "$network" ] && "$DOCKER" network rm "$network" >/dev/null 2>&1
  if [ -n "$dockerd_pid" ]; then
    $SUDO kill "$dockerd_pid" 2>/dev/null
    for _ in $(seq 1 30); do $SUDO kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 1; done
    echo "docker test: stopped the dockerd it started"
  fi
  if [ $ok = 1 ] && [ "${KEEP:-0}" != 1 ]; then rm -rf "$STATE"; else echo "docker test state and logs kept in $STATE"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- Docker -------------------------------------------------------------------------------------
pick_docker() {
  # The client packaged with the daemon (Debian's docker.io: /usr/bin/docker) before any other.
  if [ -n "${DOCKER_CLIENT:-}" ]; then DOCKER=$DOCKER_CLIENT
  elif [ -x /usr/bin/docker ]; then DOCKER=/usr/bin/docker
  else DOCKER=$(command -v docker || true); fi
}
pick_docker
daemon_up() { [ -n "$DOCKER" ] && "$DOCKER" info >/dev/null 2>&1; }
t0=$(date +%s)
if ! daemon_up; then
  if ! command -v dockerd >/dev/null || [ -z "$DOCKER" ]; then
    command -v apt-get >/dev/null || skip_or_fail "Docker is not installed and there is no apt-get to install it"
    $SUDO true 2>/dev/null || skip_or_fail "Docker is not installed and installing it needs root (or password-less sudo)"
    echo "installing Docker (Debian's docker.io) with apt-get..."
    export DEBIAN_FRONTEND=noninteractive
    if ! $SUDO apt-get install -y -qq --no-install-recommends docker.io >"$STATE/apt.log" 2>&1; then
      $SUDO apt-get update -qq >>"$STATE/apt.log" 2>&1 || true
      $SUDO apt-get install -y -qq --no-install-recommends docker.io >>"$STATE/apt.log" 2>&1 \
        || skip_or_fail "apt-get could not install docker.io (see $STATE/apt.log)"
    fi
    pick_docker
    command -v dockerd >/dev/null && [ -n "$DOCKER" ] || skip_or_fail "dockerd or docker still missing after apt-get install docker.io"
    phase "installed docker.io" "$t0"
  fi
  if ! daemon_up; then
    [ "$(id -u)" = 0 ] || skip_or_fail "no Docker daemon answers and starting dockerd needs root"
    echo "starting dockerd (log: $STATE/dockerd.log)..."
    dockerd >"$STATE/dockerd.log" 2>&1 &
    dockerd_pid=$!
    for _ in $(seq 1 60); do
      daemon_up && break
      kill -0 "$dockerd_pid" 2>/dev/null || break
      sleep 1
    done
    if ! daemon_up; then
      tail -n 15 "$STATE/dockerd.log" >&2 || true
      kill -0 "$dockerd_pid" 2>/dev/null || dockerd_pid=
      skip_or_fail "dockerd did not start (log above, in $STATE/dockerd.log)"
    fi
  fi
fi
export DOCKER
echo "docker: $("$DOCKER" version -f 'client {{.Client.Version}}, server {{.Server.Version}}' 2>/dev/null), $("$DOCKER" info -f '{{.Driver}}, cgroup v{{.CgroupVersion}}' 2>/dev/null)$([ -n "$dockerd_pid" ] && echo ", dockerd started by this test")"

# --- the images -----------------------------------------------------------------------------------
t0=$(date +%s)
bash deploy/docker/base-image.sh || fail "deploy/docker/base-image.sh failed"
phase "base image cotrain-base:bookworm" "$t0"
t0=$(date +%s)
COTRAIN_IMAGE=$IMAGE bash deploy/docker/build-image.sh cpu || fail "deploy/docker/build-image.sh failed"
phase "image $IMAGE" "$t0"

# --- the cluster ---------------------------------------------------------------------------------
t_cluster=$(date +%s)
dk() { "$DOCKER" "$@"; }
network=$P
dk network create "$network" >/dev/null
(umask 077; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$STATE/cluster-token")
chmod 644 "$STATE/cluster-token"   # read by the containers' users; the directory is private
TOKEN_MOUNT=(-v "$STATE/cluster-token:/run/cotrain/cluster-token:ro" -e COTRAIN_CLUSTER_TOKEN_FILE=/run/cotrain/cluster-token)
SANDBOX_PRIVS=(--security-opt seccomp=unconfined --security-opt systempaths=unconfined)

mkdir -p "$STATE/out" "$STATE/logs"
chmod 777 "$STATE/out"
OVERRIDES=(--override "dataset.train_split=train[:$STEPS]" dataset.eval_split=null magrpo.eval_interval=0
           magrpo.num_generations=2 magrpo.max_new_tokens=16 output.base_dir=/out output.save_final_model=false
           logging.progress=never logging.plots=false logging.tensorboard=false logging.run_name=docker)

# wait_listening NAME: until the container's "listening grpc=..." line; fails if it exits first.
wait_listening() {
  local c=$1
  for _ in $(seq 1 300); do
    dk logs "$c" 2>/dev/null | grep '^listening ' >/dev/null && return 0
    [ "$(dk inspect -f '{{.State.Running}}' "$c" 2>/dev/null)" = true ] || break
    sleep 1
  done
  dk logs "$c" 2>&1 | tail -n 20 >&2
  fail "$c did not start listening"
}
# run_py CODE ARGS...: python3 in a one-off container on the network (reaches the services by name).
run_py() {
  local code=$1; shift
  dk run --rm --network "$network" "$IMAGE" python3 -c "$code" "$@"
}

# What bwrap gets without the privileges (for the record; the server refuses to start).
unpriv=$(dk run --rm --network none --user 65534:65534 "$IMAGE" timeout 15 reward-server \
  --grpc-addr 127.0.0.1:0 --http-addr 127.0.0.1:0 2>&1 || true)
unpriv=$(grep -m1 -o 'bwrap: [^.]*' <<<"$unpriv" || grep -m1 -o 'error: .*' <<<"$unpriv" | cut -c1-160 || true)
echo "reward server in a container without the sandbox privileges: ${unpriv:-no error (it started)}"

containers+=("$P-reward")
dk run -d --restart on-failure:5 --name "$P-reward" --network "$network" --network-alias reward --user 65534:65534 \
  "${SANDBOX_PRIVS[@]}" "$IMAGE" reward-server --grpc-addr 0.0.0.0:50051 --http-addr 0.0.0.0:8000 >/dev/null
mapfile -t AGENT_ARGS < <(dk run --rm "$IMAGE" learner worker-args --config configs/demo.yaml "${OVERRIDES[@]}") \
  || fail "learner worker-args failed in the image"
[ ${#AGENT_ARGS[@]} -gt 0 ] || fail "learner worker-args printed nothing"
echo "workers serve: ${AGENT_ARGS[*]}"
for w in 1 2; do
  containers+=("$P-worker$w")
  dk run -d --restart on-failure:5 --name "$P-worker$w" --network "$network" --network-alias "worker$w" "${TOKEN_MOUNT[@]}" "$IMAGE" \
    rollout-worker serve --grpc-addr 0.0.0.0:50061 --http-addr 0.0.0.0:8001 "${AGENT_ARGS[@]}" --threads-per-engine 1 >/dev/null
done
wait_listening "$P-reward"
# grep without -q reads to the end: `grep -q` exits at the first match, `docker logs` then dies of
# SIGPIPE writing the rest, and pipefail turns that into a failure (it failed CI once).
dk logs "$P-reward" 2>&1 | grep 'sandbox isolation probe passed' >/dev/null || { dk logs "$P-reward" 2>&1 | tail -n 20 >&2; fail "the reward server did not log its sandbox probe"; }
wait_listening "$P-worker1"
wait_listening "$P-worker2"
echo "reward server and 2 rollout workers listening on network $network ($(( $(date +%s) - t_cluster ))s)"

# The sandbox, through the reward server's own code path, from another container.
run_py '
import json, sys, urllib.request
def post(path, body):
    req = urllib.request.Request("http://reward:8000" + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=60))
item = {"task_id": "Test/0", "entry_point": "add_two",
        "prompt": "def add_two(a: int, b: int) -> int:\n    \"\"\"Return a + b.\n    >>> add_two(1, 2)\n    3\n    \"\"\"\n",
        "canonical_solution": "    return a + b\n",
        "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n    assert candidate(10, 5) == 15\n"}
good = "def add_two(a: int, b: int) -> int:\n    return a + b\n"
bad = "def add_two(a: int, b: int) -> int:\n    return a - b\n"
r = post("/v1/score", {"task": "code", "items": [{"completions": [good], "item": item}, {"completions": [bad], "item": item}]})
g, b = r["results"][0]["reward"], r["results"][1]["reward"]
assert g > b, r
e = post("/v1/execute", {"code": "import os, socket\nprint(os.getpid(), os.getuid(), [n for _, n in socket.if_nameindex()])"})
assert e["status"] == "finished" and e["exit_code"] == 0, e
pid, uid, ifaces = e["stdout"].split(" ", 2)
assert int(pid) < 8 and ifaces.strip() == "[\x27lo\x27]", e
print("sandbox in the reward-server container: HumanEval-style completion scored %.2f (right) vs %.2f (wrong); "
      "/v1/execute ran as pid %s, uid %s, interfaces %s" % (g, b, pid, uid, ifaces.strip()))
' || { dk logs "$P-reward" 2>&1 | tail -n 20 >&2; fail "the reward server's sandbox did not work in its container"; }

# The learner, pointed at the workers and the reward server by name. Restarted by Docker when it
# fails, it resumes its run (`--resume auto`, logging.run_name: docker); `docker wait` returns at
# the first exit, so a failure still fails this test.
containers+=("$P-learner")
t0=$(date +%s)
dk run -d --restart on-failure:3 --name "$P-learner" --network "$network" "${TOKEN_MOUNT[@]}" -v "$STATE/out:/out" \
  --user "$(id -u):$(id -g)" -e HOME=/tmp "$IMAGE" \
  learner train --config configs/demo.yaml "${OVERRIDES[@]}" --resume auto \
  --override "rollout.endpoints=[http://worker1:50061,http://worker2:50061]" --override reward.endpoint=http://reward:50051 >/dev/null
rc=$(timeout "${LEARNER_TIMEOUT:-600}" "$DOCKER" wait "$P-learner" 2>/dev/null || echo timeout)
dk logs "$P-learner" >"$STATE/logs/learner.log" 2>&1 || true
echo "learner: exit $rc after $(( $(date +%s) - t0 ))s"

# The services' counters, read over the network before they stop.
for s in worker1:8001 worker2:8001 reward:8000; do
  run_py 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=30).read().decode())' \
    "http://$s/metrics" >"$STATE/logs/${s%:*}.prom" 2>/dev/null || true
done
for c in "${containers[@]}"; do dk logs "$c" >"$STATE/logs/${c#"$P-"}.log" 2>&1 || true; done

# --- the checks ------------------------------------------------------------------------------------
ok_requests() {
  awk -v want="$2" 'index($0, "cotrain_rollout_requests_total{") == 1 && index($0, "outcome=\"ok\"") && index($0, want) { s += $NF }
                   END { printf "%d\n", s }' "$1"
}
problems=()
[ "$rc" = 0 ] || problems+=("the learner exited with $rc")
metrics=$STATE/out/docker/metrics.jsonl
if [ -f "$metrics" ]; then
  python3 - "$metrics" "$STEPS" <<'EOF' || problems+=("the metrics do not show the training run (see above)")
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
steps = int(sys.argv[2])
assert [r["step"] for r in rows] == list(range(1, steps + 1)), [r["step"] for r in rows]
assert all(r["optimizer_steps"] > 0 for r in rows), "no optimiser step"
assert rows[-1]["policy_version"] >= steps, rows[-1]["policy_version"]
assert all(r["pool/workers"] == 2 for r in rows if "pool/workers" in r), [r.get("pool/workers") for r in rows]
EOF
else
  problems+=("no $metrics")
fi
total=0
agents=$(printf '%s\n' "${AGENT_ARGS[@]}" | grep = | cut -d= -f1)
for w in 1 2; do
  prom=$STATE/logs/worker$w.prom
  n=$( [ -s "$prom" ] && ok_requests "$prom" "" || echo 0)
  [ "$n" -gt 0 ] || problems+=("worker$w answered no generate request ($prom)")
  total=$((total + n))
  sed 's/\x1b\[[0-9;]*m//g' "$STATE/logs/worker$w.log" | grep 'rollout worker serving' | grep 'cluster_token=true' >/dev/null \
    || problems+=("worker$w did not run with the cluster token")
  updates=$(grep -c 'weight update applied' "$STATE/logs/worker$w.log" || true)
  [ "$updates" -ge $(( $(wc -w <<<"$agents") * STEPS )) ] || problems+=("worker$w applied $updates weight updates, not one per agent and step")
done
scores=$(awk 'index($0, "cotrain_reward_requests_total{") == 1 && index($0, "endpoint=\"grpc.score\"") && index($0, "outcome=\"ok\"") { s += $NF }
              END { printf "%d\n", s }' "$STATE/logs/reward.prom" 2>/dev/null || echo 0)
[ "$scores" -ge "$STEPS" ] || problems+=("the reward server answered $scores gRPC score requests, not one per step at least")
for a in $agents; do
  n=0
  for w in 1 2; do [ -s "$STATE/logs/worker$w.prom" ] && n=$((n + $(ok_requests "$STATE/logs/worker$w.prom" "agent=\"$a\""))); done
  [ "$n" -gt 0 ] || problems+=("no worker answered a generate request for $a")
done
if [ ${#problems[@]} -gt 0 ]; then
  for f in "$STATE"/logs/*.log; do echo "--- $f:"; tail -n 15 "$f"; done >&2
  fail "$(printf '%s; ' "${problems[@]}")"
fi
phase "cluster run (network, 4 containers, $STEPS steps)" "$t_cluster"
ok=1
echo "PASS: docker test: $IMAGE trained $STEPS steps of configs/demo.yaml across 4 containers (reward server: $scores score requests; 2 rollout workers: $total generate requests; learner) in $(( $(date +%s) - START ))s"
