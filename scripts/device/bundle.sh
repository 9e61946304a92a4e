#!/usr/bin/env bash
# `make gpu-bundle`: the binaries a GPU machine without a Rust toolchain needs, in one .tar.xz:
# the release `learner` built for CUDA without Open MPI (`--no-default-features --features cuda,embedded`:
# NCCL ranks; GPU images have no libmpi), `rollout-worker`, `reward-server`, and this machine's
# `bwrap` (the reward sandbox), all stripped. They link libtorch 2.11.0 by name: on the GPU machine,
# put its PyTorch's torch/lib on LD_LIBRARY_PATH (scripts/device/check.sh does).
#
#   bash scripts/device/bundle.sh [OUT.tar.xz]      default .gpu/cotrain-gpu.tar.xz (and .gpu/wheels/)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
OUT=${1:-$ROOT/.gpu/cotrain-gpu.tar.xz}
LIMIT_MIB=20
CARGO=${CARGO:-cargo}
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT

$CARGO build --release -p cotrain-learner --no-default-features --features cuda,embedded --bin learner
cp target/release/learner "$W/learner"
$CARGO build --release -p cotrain-rollout-worker --bin rollout-worker -p cotrain-reward-server --bin reward-server
cp target/release/rollout-worker target/release/reward-server "$W/"
if readelf -d "$W/learner" | grep -q 'NEEDED.*libmpi'; then
  echo "error: the bundle's learner links libmpi" >&2; exit 1
fi
strip "$W/learner" "$W/rollout-worker" "$W/reward-server"
if command -v bwrap >/dev/null; then cp "$(command -v bwrap)" "$W/bwrap"; else echo "note: no bwrap here; the bundle has none" >&2; fi
mkdir -p "$(dirname "$OUT")"
# PEFT for the MaPoRL reference (scripts/bench/maporl_reference.py) in check.sh's `maporl` step, in
# case the GPU machine's Python lacks it: its wheels for that Python (3.12), unpacked there. Optional:
# without network here the step reports cotrain's side only.
WHEELS=$(dirname "$OUT")/wheels
if [ ! -f "$WHEELS/.complete" ]; then
  rm -rf "$WHEELS"
  if python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
      -d "$WHEELS" peft==0.21.2 accelerate==1.15.0 psutil==7.2.2; then
    touch "$WHEELS/.complete"
  else
    echo "note: no PEFT wheels downloaded; the device check's maporl step will need the machine's own peft" >&2
  fi
fi
tar -C "$W" -cf - $(cd "$W" && ls) | xz -9 -T2 > "$OUT.tmp"
mv "$OUT.tmp" "$OUT"
size=$(stat -c %s "$OUT")
ls -l "$W" | awk 'NR > 1 { printf "  %-16s %6.1f MiB stripped\n", $9, $5 / 1048576 }'
awk -v s="$size" -v f="$OUT" 'BEGIN { printf "%s: %.1f MiB\n", f, s / 1048576 }'
if [ "$size" -gt $((LIMIT_MIB << 20)) ]; then
  echo "error: the bundle is over $LIMIT_MIB MiB (at most 64 MiB travel to the GPU machine, the tracked tree takes ~25)" >&2; exit 1
fi
