#!/usr/bin/env bash
# The Python reference environment (full torch 2.11 + transformers + gguf, about 5 GB).
# Needed only to regenerate committed test fixtures and to run the reference side of benchmarks;
# never by `make test`. Cached under the user cache directory.
set -euo pipefail
CACHE=${COTRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cotrain}
VENV="$CACHE/pyref"
if [ ! -f "$VENV/.complete" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
  "$VENV/bin/pip" install --quiet "torch==2.11.0" "transformers>=5,<6" gguf safetensors numpy jinja2 accelerate
  touch "$VENV/.complete"
fi
echo "$VENV/bin/python"
