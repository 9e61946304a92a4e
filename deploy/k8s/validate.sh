#!/usr/bin/env bash
# Renders deploy/k8s with kustomize and checks the result; exits non-zero on any problem.
#  1. Render with every kustomize at hand: `kubectl kustomize` of the kubectl on PATH (if any) and
#     Debian's kubernetes-client (kubectl 1.20, kustomize v2.0.3), unpacked under the cache with
#     `apt-get download` + `dpkg-deb -x` (nothing installed system-wide).
#  2. Validate every rendered object against the Kubernetes OpenAPI schemas of K8S_VERSIONS in strict
#     mode (unknown fields are errors) with kubernetes-validate from PyPI (it bundles the schemas),
#     in a venv under $COTRAIN_CACHE (default ~/.cache/cotrain). A kind without a schema is an error.
#  3. Check the wiring: learner and workers mount the same ConfigMap and read the same config file;
#     both get COTRAIN_CLUSTER_TOKEN_FILE inside a mounted Secret; the config's rollout.dns_name
#     and reward.endpoint name the Services and ports of the manifests.
#  4. With the binaries (COTRAIN_BIN, default target/release): the config passes `learner
#     check-config`, and the workers' shell command, run here with the rendered config and a
#     stand-in for `rollout-worker`, passes the config's agents (`learner worker-args`).
#
#   deploy/k8s/validate.sh
#   COTRAIN_ALLOW_SKIP=1 deploy/k8s/validate.sh   # SKIP (exit 0) where no kustomize or validator can be had
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
K8S=deploy/k8s
CACHE=${COTRAIN_CACHE:-$HOME/.cache/cotrain}
K8S_VERSIONS=${K8S_VERSIONS:-1.30.0 1.37.0}
VALIDATOR_VERSION=1.37.0
BIN=${COTRAIN_BIN:-target/release}
case "$BIN" in /*) ;; *) BIN=$ROOT/$BIN ;; esac

fail() { echo "FAIL: k8s validation: $*" >&2; exit 1; }
skip_or_fail() {
  if [ "${COTRAIN_ALLOW_SKIP:-0}" = 1 ]; then echo "SKIP: k8s validation: $*"; exit 0; fi
  fail "$* (set COTRAIN_ALLOW_SKIP=1 to skip instead)"
}
WORK=$(mktemp -d /tmp/cotrain-k8s.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

# --- kustomize ------------------------------------------------------------------------------
renderers=()
if command -v kubectl >/dev/null && kubectl kustomize --help >/dev/null 2>&1; then
  renderers+=("$(command -v kubectl)")
fi
DEB_KUBECTL=$CACHE/kubernetes-client/usr/bin/kubectl
if [ ! -x "$DEB_KUBECTL" ] && command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null; then
  get_deb() { (cd "$WORK" && apt-get download -q kubernetes-client >"$WORK/apt.log" 2>&1); }
  if ! get_deb && [ "$(id -u)" = 0 ]; then apt-get update -qq >/dev/null 2>&1 || true; get_deb || true; fi
  deb=$(ls "$WORK"/kubernetes-client_*.deb 2>/dev/null | head -n1 || true)
  if [ -n "$deb" ]; then
    mkdir -p "$CACHE/kubernetes-client"
    dpkg-deb -x "$deb" "$CACHE/kubernetes-client"
  fi
fi
[ -x "$DEB_KUBECTL" ] && renderers+=("$DEB_KUBECTL")
[ ${#renderers[@]} -gt 0 ] || skip_or_fail "no kustomize: no kubectl on PATH, and Debian's kubernetes-client could not be downloaded"

# --- the validator --------------------------------------------------------------------------
VENV=$CACHE/k8s-venv
if ! "$VENV/bin/kubernetes-validate" --version 2>/dev/null | grep "$VALIDATOR_VERSION" >/dev/null; then
  command -v python3 >/dev/null || skip_or_fail "no python3 for the validator's venv"
  echo "installing kubernetes-validate==$VALIDATOR_VERSION into $VENV..."
  { python3 -m venv "$VENV" && "$VENV/bin/pip" install -q "kubernetes-validate==$VALIDATOR_VERSION"; } >"$WORK/pip.log" 2>&1 \
    || { cat "$WORK/pip.log" >&2; skip_or_fail "could not install kubernetes-validate into $VENV"; }
fi

# --- render and validate --------------------------------------------------------------------
i=0
for r in "${renderers[@]}"; do
  i=$((i + 1))
  out=$WORK/rendered-$i.yaml
  "$r" kustomize "$K8S" >"$out" 2>"$WORK/render-$i.err" || { cat "$WORK/render-$i.err" >&2; fail "$r kustomize $K8S failed"; }
  version=$("$r" version --client 2>/dev/null | grep -oE 'v1\.[0-9]+\.[0-9]+' | head -n1 || true)
  objects=$(grep -c '^kind:' "$out" || true)
  for v in $K8S_VERSIONS; do
    "$VENV/bin/kubernetes-validate" --strict -k "$v" "$out" >"$WORK/validate.log" 2>&1 || { cat "$WORK/validate.log" >&2; fail "objects rendered by $r do not validate against Kubernetes $v"; }
    if grep -v '^INFO' "$WORK/validate.log" | grep . >/dev/null; then cat "$WORK/validate.log" >&2; fail "kubernetes-validate warned (a kind without a schema?) for Kubernetes $v"; fi
    passed=$(grep -c '^INFO .* passed ' "$WORK/validate.log" || true)
    [ "$passed" = "$objects" ] || { cat "$WORK/validate.log" >&2; fail "$passed of $objects objects passed against Kubernetes $v"; }
  done
  echo "rendered with kubectl ${version:-?} ($r): $objects objects, valid against Kubernetes ${K8S_VERSIONS// /, } (strict)"
done

# --- the wiring -----------------------------------------------------------------------------
"$VENV/bin/python" - "$WORK/rendered-1.yaml" "$WORK" <<'EOF' || fail "the manifests are not wired together (above)"
import os, re, sys, yaml
objs = [o for o in yaml.safe_load_all(open(sys.argv[1])) if o]
work = sys.argv[2]
by = {(o["kind"], o["metadata"]["name"].rsplit("-", 1)[0] if o["kind"] == "ConfigMap" else o["metadata"]["name"]): o for o in objs}
def pod(kind, name):
    return by[(kind, name)]["spec"]["template"]["spec"]
def container(spec):
    assert len(spec["containers"]) == 1
    return spec["containers"][0]
problems = []
def check(ok, msg):
    if not ok:
        problems.append(msg)

learner, worker = pod("Job", "cotrain-learner"), pod("Deployment", "cotrain-rollout-worker")
cm = by[("ConfigMap", "cotrain-config")]
config_name = "cotrain.yaml"
check(config_name in cm["data"], f"the ConfigMap has no {config_name}")
for what, spec in [("learner", learner), ("rollout worker", worker)]:
    c = container(spec)
    vols = {v["name"]: v for v in spec.get("volumes") or []}
    mounts = {m["mountPath"]: m for m in c.get("volumeMounts") or []}
    env = {e["name"]: e.get("value") for e in c.get("env") or []}
    # The config: a mount of the generated ConfigMap, and the command reads the file there.
    cfg_mounts = [m for m in mounts.values() if "configMap" in vols.get(m["name"], {})]
    check(len(cfg_mounts) == 1 and vols[cfg_mounts[0]["name"]]["configMap"]["name"] == cm["metadata"]["name"],
          f"{what}: does not mount the ConfigMap {cm['metadata']['name']}")
    command = " ".join((c.get("command") or []) + (c.get("args") or []))
    if cfg_mounts:
        path = os.path.join(cfg_mounts[0]["mountPath"], config_name)
        check(f"--config {path}" in command, f"{what}: the command does not read --config {path}: {command!r}")
    # The cluster token: env naming a file inside a mounted Secret.
    token = env.get("COTRAIN_CLUSTER_TOKEN_FILE")
    check(token is not None, f"{what}: no COTRAIN_CLUSTER_TOKEN_FILE")
    if token:
        m = mounts.get(os.path.dirname(token))
        check(m is not None and "secret" in vols.get(m["name"], {}), f"{what}: {token} is not in a mounted Secret")
        if m is not None and "secret" in vols.get(m["name"], {}):
            secret = vols[m["name"]]["secret"]
            check(secret["secretName"] == "cotrain-cluster-token", f"{what}: the token comes from {secret['secretName']}")
    if what == "learner":
        check(c["args"][:2] == ["learner", "train"], f"learner: runs {c['args']}")
    else:
        check("learner worker-args --config" in command,
              "rollout worker: its agents do not come from `learner worker-args`")
        open(os.path.join(work, "worker-command.sh"), "w").write(c["args"][-1])
        open(os.path.join(work, "worker-config-dir"), "w").write(cfg_mounts[0]["mountPath"] if cfg_mounts else "")

# The config points at the Services of these manifests.
config = yaml.safe_load(cm["data"][config_name])
def service_port(name, port_name):
    s = by.get(("Service", name))
    if s is None:
        return None
    return {p["name"]: p["port"] for p in s["spec"]["ports"]}.get(port_name)
dns = config.get("rollout", {}).get("dns_name") or ""
host, _, port = dns.rpartition(":")
check(service_port(host, "grpc") == int(port or 0), f"rollout.dns_name {dns!r} is not a Service's grpc port")
check(by.get(("Service", host), {}).get("spec", {}).get("clusterIP") == "None", f"{host} is not headless (one DNS record per worker)")
reward = config.get("reward", {}).get("endpoint") or ""
m = re.fullmatch(r"https?://([^:/]+):(\d+)", reward)
check(m is not None and service_port(m.group(1), "grpc") == int(m.group(2)), f"reward.endpoint {reward!r} is not the reward Service's grpc port")
svc_sel = by[("Service", host)]["spec"]["selector"] if ("Service", host) in by else {}
labels = by[("Deployment", "cotrain-rollout-worker")]["spec"]["template"]["metadata"]["labels"]
check(all(labels.get(k) == v for k, v in svc_sel.items()), "the workers' Service does not select the worker pods")
for p in problems:
    print("  -", p, file=sys.stderr)
sys.exit(1 if problems else 0)
EOF
echo "wiring: learner and workers read the same ConfigMap, the cluster token comes from Secret cotrain-cluster-token, the config names the Services"

# --- the config and the workers' command, with the binaries ---------------------------------
if [ -x "$BIN/learner" ] && "$BIN/learner" worker-args --help >/dev/null 2>&1; then
  cfg_dir=$WORK/etc-cotrain
  mkdir -p "$cfg_dir" "$WORK/path"
  "$VENV/bin/python" -c 'import sys, yaml
objs = [o for o in yaml.safe_load_all(open(sys.argv[1])) if o and o["kind"] == "ConfigMap"]
open(sys.argv[2], "w").write(objs[0]["data"]["cotrain.yaml"])' "$WORK/rendered-1.yaml" "$cfg_dir/cotrain.yaml"
  "$BIN/learner" check-config --config "$cfg_dir/cotrain.yaml" >/dev/null 2>"$WORK/check.err" || { cat "$WORK/check.err" >&2; fail "learner check-config rejects the ConfigMap's config"; }
  ln -s "$BIN/learner" "$WORK/path/learner"
  printf '#!/bin/sh\nprintf "%%s\\n" "$@" >"%s"\n' "$WORK/worker-args.out" >"$WORK/path/rollout-worker"
  chmod +x "$WORK/path/rollout-worker"
  script=$(sed "s#$(cat "$WORK/worker-config-dir")/#$cfg_dir/#g" "$WORK/worker-command.sh")
  PATH=$WORK/path:$PATH COTRAIN_DEVICE=cuda bash -c "$script" 2>"$WORK/worker.err" || { cat "$WORK/worker.err" >&2; fail "the workers' command failed here"; }
  expected=$({ echo serve; echo --grpc-addr; echo 0.0.0.0:50061; echo --http-addr; echo 0.0.0.0:8001
               "$BIN/learner" worker-args --config "$cfg_dir/cotrain.yaml"; echo --device; echo cuda; })
  [ "$(cat "$WORK/worker-args.out")" = "$expected" ] || { diff <(echo "$expected") "$WORK/worker-args.out" >&2 || true; fail "the workers' command does not start 'rollout-worker serve' with the config's agents"; }
  echo "config: learner check-config passes; the workers' command starts: rollout-worker $(tr '\n' ' ' <"$WORK/worker-args.out")"
else
  echo "config: not checked with the binaries ($BIN/learner with worker-args not found)"
fi
echo "PASS: k8s validation: deploy/k8s renders with ${#renderers[@]} kustomize version(s) and validates against Kubernetes ${K8S_VERSIONS// /, }"
