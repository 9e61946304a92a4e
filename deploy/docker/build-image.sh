#!/usr/bin/env bash
# Builds cotrain's images from PREBUILT binaries: assembles a small build context in a staging
# directory (the binaries, configs/, data/, the default model and, for the CPU image, the CPU
# libtorch) and runs `docker build` on it with deploy/docker/Dockerfile (cpu) or Dockerfile.cuda.
# Nothing is compiled in a container and nothing comes from Docker Hub.
#
#   deploy/docker/build-image.sh                         # cpu: binaries from target/release -> cotrain:cpu
#   COTRAIN_BIN=target/debug deploy/docker/build-image.sh
#   COTRAIN_CUDA_BASE=registry.example/pytorch:2.11.0-cu130 deploy/docker/build-image.sh cuda   # -> cotrain:cuda
#
# Environment:
#   COTRAIN_BIN         the binaries (default target/release; relative to the repository root)
#   COTRAIN_IMAGE       the tag (default cotrain:cpu, cotrain:cuda)
#   COTRAIN_BASE_IMAGE  cpu: the base (default cotrain-base:bookworm, built by base-image.sh if missing)
#   COTRAIN_CUDA_BASE   cuda: an image holding Python and PyTorch 2.11.0+cu130 (see Dockerfile.cuda)
#   COTRAIN_CACHE       where scripts/setup.sh put the torch wheel and the model (~/.cache/cotrain)
#   DOCKER              the docker client (default: /usr/bin/docker where Debian's docker.io put it)
#   STRIP=0             copy the binaries with their debug information (default: strip --strip-debug)
#   KEEP=1              keep the staging directory
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
FLAVOUR=${1:-cpu}
BIN=${COTRAIN_BIN:-target/release}
case "$BIN" in /*) ;; *) BIN=$ROOT/$BIN ;; esac
CACHE=${COTRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cotrain}
TORCH_PREFIX=${COTRAIN_TORCH_PREFIX:-$CACHE/torch-2.11.0-cpu}
MODEL=$CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -z "${DOCKER:-}" ]; then
  if [ -x /usr/bin/docker ]; then DOCKER=/usr/bin/docker; else DOCKER=docker; fi
fi
export DOCKER
say() { echo "[build-image] $*" >&2; }
die() { echo "[build-image] error: $*" >&2; exit 1; }

case "$FLAVOUR" in
  cpu)
    IMAGE=${COTRAIN_IMAGE:-cotrain:cpu}
    BASE=${COTRAIN_BASE_IMAGE:-cotrain-base:bookworm}
    DOCKERFILE=deploy/docker/Dockerfile
    ;;
  cuda)
    IMAGE=${COTRAIN_IMAGE:-cotrain:cuda}
    BASE=${COTRAIN_CUDA_BASE:?cuda: set COTRAIN_CUDA_BASE to an image holding PyTorch 2.11.0+cu130 (see deploy/docker/Dockerfile.cuda)}
    DOCKERFILE=deploy/docker/Dockerfile.cuda
    ;;
  *) die "usage: $0 [cpu|cuda]" ;;
esac

for b in learner rollout-worker reward-server; do
  [ -x "$BIN/$b" ] || die "$BIN/$b not found (build first: make build, or cargo build --workspace --bins)"
done
[ -f "$MODEL" ] || die "no default model at $MODEL (run scripts/setup.sh)"
TORCH_LIBS=(torch/lib/libtorch_cpu.so torch/lib/libc10.so torch/lib/libgomp.so.1
            nvidia/cu13/lib/libcudart.so.13 nvidia/cu13/lib/libcupti.so.13)
if [ "$FLAVOUR" = cpu ]; then
  for l in "${TORCH_LIBS[@]}"; do
    [ -f "$TORCH_PREFIX/$l" ] || die "no $TORCH_PREFIX/$l (the CPU torch wheel scripts/setup.sh installs)"
  done
  COTRAIN_BASE_IMAGE=$BASE bash "$ROOT/deploy/docker/base-image.sh"   # nothing to do when it exists
fi

CTX=$(mktemp -d /var/tmp/cotrain-docker-context.XXXXXX)
cleanup() { if [ "${KEEP:-0}" = 1 ]; then say "staging directory kept: $CTX"; else rm -rf "$CTX"; fi; }
trap cleanup EXIT
# Large files are hard-linked into the context where they share a filesystem, else copied.
put() { mkdir -p "$(dirname "$2")"; ln -f "$1" "$2" 2>/dev/null || cp "$1" "$2"; }
t0=$(date +%s)
mkdir -p "$CTX/bin"
# The binaries are copied (not linked: a rebuild while docker reads them must not change them),
# without their debug information where `strip` is at hand (a debug build's learner: 200 MB -> 38 MB;
# symbols stay, so backtraces still name functions). STRIP=0 copies them as they are.
for b in learner rollout-worker reward-server; do
  if [ "${STRIP:-1}" = 1 ] && command -v strip >/dev/null; then
    strip --strip-debug -o "$CTX/bin/$b" "$BIN/$b"
  else
    cp "$BIN/$b" "$CTX/bin/$b"
  fi
done
put "$MODEL" "$CTX/models/$(basename "$MODEL")"
cp -r configs data "$CTX/"
if [ "$FLAVOUR" = cpu ]; then
  # libtorch_cpu.so finds libcudart/libcupti through its RPATH $ORIGIN/../../nvidia/cu13/lib: the
  # wheel's layout is kept. libtorch.so is not taken: the binaries do not link it (it needs libtorch_cuda.so).
  for l in "${TORCH_LIBS[@]}"; do put "$TORCH_PREFIX/$l" "$CTX/torch/$l"; done
fi
cp "$DOCKERFILE" "$CTX/Dockerfile"
say "context $CTX: $(du -sh --apparent-size "$CTX" | cut -f1) ($FLAVOUR, binaries from $BIN)"
"$DOCKER" build --build-arg "BASE=$BASE" -t "$IMAGE" "$CTX" >"$CTX.build.log" 2>&1 || {
  tail -n 30 "$CTX.build.log" >&2; die "docker build failed (log: $CTX.build.log)"; }
grep -E 'warning: ' "$CTX.build.log" | sed 's/^/[build-image] /' >&2 || true   # Dockerfile.cuda's checks
rm -f "$CTX.build.log"
say "$IMAGE built in $(( $(date +%s) - t0 ))s ($("$DOCKER" image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%d MB", $1 / 1e6}'))"
