#!/usr/bin/env bash
# Builds (once) a tiny shared library that makes MKL take its AVX-512 path on non-Intel CPUs, and
# prints its path, for running the *reference* side of the benchmarks (PyTorch + transformers) with
# the same MKL dispatch cotrain applies to itself in-process (model/src/mkl_dispatch.rs):
#
#   LD_PRELOAD=$(scripts/reference/mkl-avx512-shim.sh) make bench-generate
#
# MKL asks `mkl_serv_intel_cpu_true()` whether the CPU is Intel before it considers its AVX-512
# kernels; PyTorch's libtorch_cpu.so exports that function, so a preloaded definition answers for it.
# Only use it on CPUs that have AVX-512 (F, CD, BW, DQ, VL).
set -euo pipefail
out="${XDG_CACHE_HOME:-$HOME/.cache}/cotrain/mkl-avx512-shim.so"
if [[ ! -f "$out" ]]; then
  mkdir -p "$(dirname "$out")"
  src="$(mktemp --suffix=.c)"
  trap 'rm -f "$src"' EXIT
  printf 'int mkl_serv_intel_cpu_true(void) { return 1; }\n' > "$src"
  cc -shared -fPIC -O2 -o "$out" "$src"
fi
echo "$out"
