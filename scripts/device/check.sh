#!/usr/bin/env bash
# The GPU path in one run: do cotrain's binaries, built against libtorch 2.11.0 (tch 0.24), run on a
# GPU machine's own PyTorch 2.11.0, on its GPU, and how fast? From the repository root:
#
#   bash scripts/device/check.sh BINS OUT          # on the GPU machine (about 8 minutes, estimated)
#   STEPS=libs,cuda,greedy,speed bash ...; STEPS=step,ranks bash ...   # the same in two shorter runs
#   bash scripts/device/check.sh --cpu BINS OUT    # the CPU dry run (CI: `make test`), ~1 minute
#   BUDGET=440 bash scripts/device/check.sh ...    # skip (NOTE) what would start after 440 s, so a
#                                                  # lease's time limit ends the run with its summary
#
# BINS is a directory or the .tar.xz of `make gpu-bundle` holding `learner`, `rollout-worker` and
# optionally `reward-server` and `bwrap`; OUT is a folder for summary.txt, figures.json and logs.
# Nothing but the tracked files and BINS is needed: the seed-shaped models are built on the machine
# from scripts/device/models/*/config.json with transformers (random weights; never downloaded).
#
# Steps, in the order they run (STEPS=libs,cuda,greedy,step,ranks,speed picks some; each step is PASS/FAIL/NOTE in the summary):
#   libs    every library the binaries need resolves; the bundle's learner has no libmpi
#   cuda    the CUDA backend registers without LD_PRELOAD (GPU); asking for CUDA without one is an
#           error that says why, from `rollout-worker generate` and from the learner (CPU)
#   greedy  greedy token ids of the tiny fixture model equal on cpu and cuda:0; the Qwen3-1.7B shape's
#           16 greedy tokens in f32 on both (random weights: a mismatch is a NOTE with where it starts)
#   speed   generation against transformers' `generate` on the same GPU: Qwen3-1.7B and
#           Qwen2.5-Coder-3B shapes, bf16, the seeds' sampling (T 0.7, top-p 0.9, top-k 50), batch
#           1/8/32/128 x 256 new tokens: tokens/s both sides, GPU memory, and the roofline (GPU only)
#   step    two MAGRPO steps (the second measured) at the seed config's shape (2 agents, G 4, 256 tokens, f32 master weights and
#           AdamW state with bf16 products): seconds split into generate/train/sync, peak GPU memory,
#           model FLOP utilisation of the update. On the CPU: the same steps on the tiny model.
#   ranks   two learner ranks against one: rewards, losses and final weights agree. GPU: NCCL, both
#           ranks on the one GPU (`learner launch --nccl-one-gpu-test`); CPU: Open MPI.
#   maporl  (GPU: only when asked for, STEPS=maporl) two MaPoRL steps at the original's batch (32 GSM8K questions, 4 PPO epochs x 8 mini-batches of
#           4, 2 agents, 2 turns, 64 new tokens, the Qwen3-1.7B shape in f32) through `learner train`,
#           against scripts/bench/maporl_reference.py (transformers + PEFT, TRL-style) on the same GPU:
#           seconds per phase of the second step, both sides. PEFT comes from the machine's Python or,
#           failing that, from wheels in .gpu/wheels (`make gpu-bundle` downloads them). On the CPU:
#           the learner's steps on the tiny model only (the reference needs torch; a NOTE).
#   vllm    (GPU: only when asked for, STEPS=vllm) `rollout-worker serve --engine vllm` against
#           `--engine cotrain` on the Qwen3-1.7B shape in bf16, batch 1/8/32/128 x 256 tokens, when the
#           machine's Python has vLLM (a NOTE when it has not); on the CPU a NOTE.
set -uo pipefail

MODE=gpu
[ "${1:-}" = --cpu ] && { MODE=cpu; shift; }
[ $# -eq 2 ] || { echo "usage: $0 [--cpu] BINS OUT" >&2; exit 2; }
SRC=$1
mkdir -p "$2" && O=$(cd "$2" && pwd) || { echo "cannot create $2" >&2; exit 2; }
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HERE=$ROOT/scripts/device
# The GPU default fits one 10-minute device call; `maporl` (about 5 minutes there) is its own call:
# STEPS=maporl. The CPU dry run covers every step.
if [ "$MODE" = gpu ]; then STEPS=${STEPS:-libs,cuda,greedy,step,ranks,speed}; else STEPS=${STEPS:-libs,cuda,greedy,step,ranks,maporl,speed,vllm}; fi
BATCHES=${BATCHES:-1,8,32,128}
W=$(mktemp -d "${TMPDIR:-/tmp}/cotrain-check.XXXXXX")
trap 'jobs -p | xargs -r kill 2>/dev/null; rm -rf "$W"' EXIT

# --- the binaries ---------------------------------------------------------------------------------
mkdir -p "$W/bin"
if [ -d "$SRC" ]; then
  for b in learner rollout-worker reward-server bwrap; do [ -e "$SRC/$b" ] && ln -s "$(cd "$SRC" && pwd)/$b" "$W/bin/$b"; done
else
  tar -xJf "$SRC" -C "$W/bin" || { echo "cannot unpack $SRC" >&2; exit 2; }
fi
BIN=$W/bin
for b in learner rollout-worker; do [ -x "$BIN/$b" ] || { echo "$SRC has no $b" >&2; exit 2; }; done

SUMMARY=()
# Each verdict also lands in summary.txt at once, so a run stopped from outside keeps what it found.
say() { SUMMARY+=("$*"); printf '%s\n' "$*" >> "$O/summary.txt"; echo "== $*"; }
pass() { say "PASS  $*"; }
fail() { say "FAIL  $*"; }
note() { say "NOTE  $*"; }
T0=$SECONDS
BUDGET=${BUDGET:-0}
# The step NAME runs if asked for and, under BUDGET, if at least SECS (its rough cost) are left.
want() {
  [[ ",$STEPS," == *",$1,"* ]] || return 1
  local need=${2:-0}
  if [ "$BUDGET" -gt 0 ] && [ $((SECONDS - T0 + need)) -gt "$BUDGET" ]; then
    note "$1: skipped, $((BUDGET - SECONDS + T0)) s of BUDGET=$BUDGET left and it needs about $need"; return 1
  fi
}
: > "$O/summary.txt"

# --- the machine ----------------------------------------------------------------------------------
if [ "$MODE" = gpu ]; then
  PY=${PYTHON:-$( [ -x /opt/torch/.venv/bin/python3 ] && echo /opt/torch/.venv/bin/python3 || echo python3)}
  TORCH_DIR=$("$PY" -c 'import os, torch; print(os.path.dirname(torch.__file__))') || { echo "no torch in $PY" >&2; exit 2; }
  { "$PY" -c 'import torch, transformers; print("torch", torch.__version__, torch.version.git_version, "cuda", torch.version.cuda, "transformers", transformers.__version__); print("gpu", torch.cuda.get_device_name(0))'
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; grep PRETTY /etc/os-release; echo "cores: $(nproc)"; } 2>&1 | tee "$O/env.txt"
  # The binaries link the PyTorch they were built against by name; here it is this machine's.
  # NCCL: pip ships only libnccl.so.2, the NCCL backend loads libnccl.so (see scripts/setup.sh).
  mkdir -p "$W/nccl"
  NCCL2=$(ls "$TORCH_DIR"/../nvidia/nccl/lib/libnccl.so.2 2>/dev/null | head -1)
  [ -n "$NCCL2" ] && ln -s "$NCCL2" "$W/nccl/libnccl.so"
  echo "libnccl: ${NCCL2:-none}" | tee -a "$O/env.txt"
  export LD_LIBRARY_PATH=$TORCH_DIR/lib:$W/nccl${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  DEV=cuda:0
else
  PY=${PYTHON:-python3}
  { lscpu | grep -E 'Model name|CPU family'; echo "cores: $(nproc)"; } 2>&1 | tee "$O/env.txt"
  DEV=cpu
fi
export COTRAIN_DATA_DIR=$ROOT/data PATH=$BIN:$PATH
GPUMEM=()
# Samples used GPU memory every 100 ms into $1 until stopped with `stop_gpumem`.
start_gpumem() {
  [ "$MODE" = gpu ] || return 0
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$1" 2>/dev/null & GPUMEM+=($!)
}
stop_gpumem() { for p in "${GPUMEM[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done; GPUMEM=(); }
peak_mib() { sort -n "$1" 2>/dev/null | tail -1; }

# Builds the seed-shaped model SHAPE once (random weights, bf16) and prints its directory.
ensure_model() {
  local m=$W/models/$1
  if [ ! -f "$m/config.json" ]; then
    timeout 150 "$PY" "$HERE/hf_generate.py" build "$HERE/models/$1" "$ROOT/model/tests/fixtures/tokenizers/qwen3" "$m" > "$O/build-$1.log" 2>&1 \
      || { rm -rf "$m"; return 1; }
  fi
  echo "$m"
}

# --- 1. libraries -----------------------------------------------------------------------------------
if want libs; then
  for b in learner rollout-worker reward-server; do
    [ -x "$BIN/$b" ] || continue
    if ldd "$BIN/$b" > "$O/ldd-$b.txt" 2>&1 && ! grep -q "not found" "$O/ldd-$b.txt"; then
      pass "libs $b: $(grep -o 'lib\(torch\|c10\)[a-z_]*\.so' "$O/ldd-$b.txt" | sort -u | tr '\n' ' ')"
    else fail "libs $b: $(grep 'not found' "$O/ldd-$b.txt" | tr -s ' \t' ' ' | tr '\n' ';')"; fi
  done
  if [ "$MODE" = gpu ]; then
    if readelf -d "$BIN/learner" | grep -q 'NEEDED.*libmpi'; then fail "libs: the learner links libmpi (build it --no-default-features --features cuda,embedded)"
    else pass "libs: the learner needs no libmpi"; fi
  fi
fi

# --- the tiny model: the committed tiny Llama with a word-level tokenizer --------------------------
TINY=$W/tiny
mkdir -p "$TINY" && cp "$ROOT"/model/tests/fixtures/tiny/llama/{model.safetensors,config.json,generation_config.json} "$TINY"/
"$PY" "$HERE/tools.py" word-tokenizer "$TINY/tokenizer.json"
GEN=(rollout-worker generate --model "$TINY" --prompt "w3 w4xxxx w5xxxxx" --max-new-tokens 8 --ignore-eos --json)

# --- 2. the CUDA backend ----------------------------------------------------------------------------
learner_cfg() { # NAME [extra yaml]: the tiny 3-step run (12 TLDR rows, 4 per step)
  cat > "$W/$1.yaml" <<YAML
model: {name: '$TINY', dtype: f32, temperature: 1.0, top_p: 1.0, top_k: 0, max_length: 512, device: '${DEVICE_OVERRIDE:-$DEV}'}
dataset: {name: tldr, train_split: 'train[:12]'}
seed: 3
output: {base_dir: '$W/runs', save_final_model: true}
magrpo: {num_agents: 2, num_generations: 3, max_new_tokens: 8, learning_rate: 0.0005, num_train_epochs: 1, rollout_buffer_size: 4, save_steps: 100, logging_steps: 1}
logging: {run_name: $1, progress: never}
${REWARD:-}
${2:-}
YAML
}
if want cuda; then
  if [ "$MODE" = gpu ]; then
    if timeout 60 "${GEN[@]}" --device cuda:0 > "$O/gen-cuda.json" 2> "$O/gen-cuda.err"; then
      pass "cuda: generate on cuda:0 with no LD_PRELOAD (the binary loads libtorch_cuda itself)"
    else fail "cuda: generate on cuda:0: $(tail -2 "$O/gen-cuda.err" | tr '\n' ' ')"; fi
    if timeout 30 "${GEN[@]}" --device cuda:7 > /dev/null 2> "$O/gen-cuda7.err"; then fail "cuda: --device cuda:7 ran on a one-GPU machine"
    else grep -q "no device 7" "$O/gen-cuda7.err" && pass "cuda: --device cuda:7 refused: $(tail -1 "$O/gen-cuda7.err")" || fail "cuda: cuda:7 error unclear: $(tail -1 "$O/gen-cuda7.err")"; fi
  else
    # No GPU: asking for one stops at once and says why, from the worker and from the learner.
    if timeout 60 "${GEN[@]}" --device cuda > /dev/null 2> "$O/gen-cuda.err"; then fail "cuda: generate --device cuda ran without a GPU"
    elif grep -q "CUDA is unavailable for device cuda" "$O/gen-cuda.err"; then pass "cuda: generate --device cuda refused: $(tail -1 "$O/gen-cuda.err" | cut -c1-220)"
    else fail "cuda: generate --device cuda failed without saying why: $(tail -2 "$O/gen-cuda.err" | tr '\n' ' ')"; fi
    DEVICE_OVERRIDE=cuda learner_cfg want-cuda
    if timeout 120 learner train --config "$W/want-cuda.yaml" > "$O/learner-want-cuda.log" 2>&1; then fail "cuda: the learner trained with model.device cuda and no GPU"
    elif grep -q "model.device: CUDA is unavailable" "$O/learner-want-cuda.log"; then pass "cuda: learner with model.device cuda refused: $(grep -o 'model.device: CUDA[^"]*' "$O/learner-want-cuda.log" | head -1 | cut -c1-200)"
    else fail "cuda: the learner's refusal does not say why: $(tail -2 "$O/learner-want-cuda.log" | tr '\n' ' ')"; fi
  fi
fi

# --- 3. greedy tokens on cpu and cuda ---------------------------------------------------------------
if want greedy; then
  timeout 60 "${GEN[@]}" --device cpu > "$O/gen-cpu.json" 2> "$O/gen-cpu.err"
  if [ "$MODE" = gpu ]; then
    [ -s "$O/gen-cuda.json" ] || timeout 60 "${GEN[@]}" --device cuda:0 > "$O/gen-cuda.json" 2> "$O/gen-cuda.err"
    "$PY" "$HERE/tools.py" same-tokens "$O/gen-cpu.json" "$O/gen-cuda.json" > "$O/greedy.txt" 2>&1 \
      && pass "greedy: token ids equal on cpu and cuda:0 ($(head -1 "$O/greedy.txt"))" || fail "greedy: $(cat "$O/greedy.txt" | tr '\n' ' ')"
    # The Qwen3-1.7B shape in f32 on both sides: random weights, so a near tie between the top two
    # logits could flip a token; a mismatch is reported with where it starts, not failed.
    if M=$(ensure_model qwen3-1.7b); then
      BIG=(rollout-worker generate --model "$M" --dtype f32 --prompt "$(cat "$HERE/prompt.txt")" --max-new-tokens 16 --ignore-eos --json)
      timeout 120 "${BIG[@]}" --device cpu > "$O/gen-1.7b-cpu.json" 2> "$O/gen-1.7b-cpu.err"
      timeout 120 "${BIG[@]}" --device cuda:0 > "$O/gen-1.7b-cuda.json" 2> "$O/gen-1.7b-cuda.err"
      "$PY" "$HERE/tools.py" same-tokens "$O/gen-1.7b-cpu.json" "$O/gen-1.7b-cuda.json" > "$O/greedy-1.7b.txt" 2>&1 \
        && pass "greedy: Qwen3-1.7B shape, f32, 16 tokens equal on cpu and cuda:0" || note "greedy: Qwen3-1.7B shape: $(tr '\n' ' ' < "$O/greedy-1.7b.txt" | cut -c1-300)"
    else fail "greedy: building the Qwen3-1.7B shape: $(tail -2 "$O/build-qwen3-1.7b.log" | tr '\n' ' ')"; fi
  else
    timeout 60 "${GEN[@]}" --device cpu > "$O/gen-cpu2.json" 2>> "$O/gen-cpu.err"
    "$PY" "$HERE/tools.py" same-tokens "$O/gen-cpu.json" "$O/gen-cpu2.json" > "$O/greedy.txt" 2>&1 \
      && pass "greedy: two cpu runs give the same tokens ($(head -1 "$O/greedy.txt"))" || fail "greedy: $(cat "$O/greedy.txt" | tr '\n' ' ')"
  fi
fi

# --- rewards: a reward server of the bundle's, sandboxed if its start-up self-test passes here ------
# (the self-test is the one the learner's embedded server runs; a VM may refuse what bwrap needs)
REWARD=""
start_reward_server() { # extra flags...
  reward-server "$@" --grpc-addr 127.0.0.1:0 --http-addr 127.0.0.1:0 > "$W/rs.out" 2>> "$O/reward-server.log" & RS=$!
  for _ in $(seq 300); do grep -q '^listening' "$W/rs.out" && break; kill -0 $RS 2>/dev/null || break; sleep 0.2; done
  EP=$(sed -n 's/^listening grpc=\([^ ]*\).*/\1/p' "$W/rs.out"); [ -n "$EP" ]
}
if want step || want ranks || want maporl; then
  if [ ! -x "$BIN/reward-server" ]; then
    note "rewards: the learner's embedded reward server (no reward-server in $SRC)"
  elif [ -z "${NO_BWRAP:-}" ] && start_reward_server; then
    REWARD="reward: {endpoint: 'http://$EP'}"; note "rewards: a sandboxed reward-server at $EP"
  elif why=${NO_BWRAP:+NO_BWRAP is set}; why=${why:-$(grep -m1 -i error "$O/reward-server.log" | cut -c1-200)}; start_reward_server --insecure-no-sandbox; then
    REWARD="reward: {endpoint: 'http://$EP'}"
    note "rewards: no sandbox here ($why); a reward-server --insecure-no-sandbox at $EP (TLDR rewards run no code)"
  else fail "rewards: reward-server does not start: $(tail -2 "$O/reward-server.log" | tr '\n' ' ')"; fi
fi

# --- 4. MAGRPO steps at the seed shape ---------------------------------------------------------------
if want step 90; then
  if [ "$MODE" = gpu ]; then
    M=$(ensure_model qwen3-1.7b) || M=$W/models/qwen3-1.7b
    STEP_OVERRIDES=(model.name="$M" model.dtype=f32 model.matmul_dtype=bf16 model.device=cuda)
  else
    M=$TINY
    STEP_OVERRIDES=(model.name="$M" model.dtype=f32 model.device=cpu magrpo.max_new_tokens=16 model.max_length=512)
  fi
  start_gpumem "$O/gpumem-step.txt"
  timeout 420 learner train --config "$ROOT/configs/magrpo_tldr_config.yaml" --override "${STEP_OVERRIDES[@]}" \
    'dataset.train_split=train[:2]' magrpo.num_train_epochs=1 magrpo.eval_interval=0 magrpo.save_steps=1000 \
    output.base_dir="$W/runs" output.save_final_model=false logging.run_name=step logging.progress=never \
    $( [ -n "$REWARD" ] && echo "reward.endpoint=http://$EP" ) > "$O/learner-step.log" 2>&1
  rc=$?; stop_gpumem
  if [ $rc = 0 ] && [ -s "$W/runs/step/metrics.jsonl" ]; then
    cp "$W/runs/step/metrics.jsonl" "$O/step-metrics.jsonl"
    "$PY" "$HERE/tools.py" step-figures "$O/step-metrics.jsonl" "$M/config.json" "$(peak_mib "$O/gpumem-step.txt")" "$MODE" > "$O/step.txt" 2>&1 \
      && pass "step: MAGRPO at the seed shape ($MODE):"$'\n'"$(cat "$O/step.txt")" || fail "step: figures: $(cat "$O/step.txt")"
  else fail "step: the learner failed (rc $rc): $(grep -i -m3 'error\|panic' "$O/learner-step.log" | tr '\n' ' ' | cut -c1-400)"; fi
fi

# --- 5. two ranks against one --------------------------------------------------------------------------
if want ranks 45; then
  learner_cfg one; learner_cfg two
  if timeout 200 learner train --config "$W/one.yaml" > "$O/learner-one.log" 2>&1; then
    if [ "$MODE" = gpu ]; then LAUNCH=(--nccl-one-gpu-test); else LAUNCH=(--backend mpi); fi
    if timeout 300 learner launch --nproc-per-node 2 "${LAUNCH[@]}" -- train --config "$W/two.yaml" > "$O/learner-two.log" 2>&1; then
      "$PY" "$HERE/tools.py" same-runs "$W/runs/one" "$W/runs/two" > "$O/ranks.txt" 2>&1 \
        && pass "ranks: two ranks ($([ "$MODE" = gpu ] && echo 'NCCL, one GPU' || echo 'Open MPI')) equal one:"$'\n'"$(tail -3 "$O/ranks.txt")" \
        || fail "ranks: two ranks differ from one: $(grep -m3 differs "$O/ranks.txt" | tr '\n' ' ')"
    else fail "ranks: two ranks: $(grep -h -i -m4 'error\|nccl warn\|panic' "$O/learner-two.log" | tr '\n' ' ' | cut -c1-400)"; fi
  else fail "ranks: one rank: $(grep -i -m2 'error\|panic' "$O/learner-one.log" | tr '\n' ' ' | cut -c1-300)"; fi
fi

# --- 6. MaPoRL at the original's batch, against the transformers + PEFT reference ---------------------
if want maporl 360; then
  if [ "$MODE" = gpu ]; then
    M=$(ensure_model qwen3-1.7b) || M=$W/models/qwen3-1.7b
    MP_MODEL=(model.name="$M" model.dtype=f32 model.device=cuda); Q=32 MB=8 TOK=64
  else
    M=$TINY
    MP_MODEL=(model.name="$M" model.dtype=f32 model.device=cpu model.chat_template=false); Q=2 MB=2 TOK=8
  fi
  # The bench's shape (learner/examples/maporl_step_bench.rs): 1 question per micro-batch, Q/MB per
  # mini-batch, two steps on rows 0..Q and Q..2Q, the second reported.
  MP=(maporl.round_num=2 maporl.max_output_length=$TOK maporl.max_input_length=$((1024 - TOK))
      maporl.per_device_train_batch_size=1 maporl.gradient_accumulation_steps=$((Q / MB)) maporl.num_mini_batches=$MB
      maporl.num_ppo_epochs=4 maporl.num_train_epochs=1 maporl.eval_interval=0 "dataset.train_split=train[:$((2 * Q))]"
      'dataset.eval_split=test[:1]' output.base_dir="$W/runs" output.save_final_model=false logging.run_name=maporl
      logging.progress=never logging.plots=false)
  start_gpumem "$O/gpumem-maporl.txt"
  timeout 420 learner train --config "$ROOT/configs/maporl_gsm8k_config.yaml" --override "${MP_MODEL[@]}" "${MP[@]}" \
    $( [ -n "$REWARD" ] && echo "reward.endpoint=http://$EP" ) > "$O/learner-maporl.log" 2>&1
  rc=$?; stop_gpumem
  if [ $rc = 0 ] && [ -s "$W/runs/maporl/metrics.jsonl" ]; then
    cp "$W/runs/maporl/metrics.jsonl" "$O/maporl-metrics.jsonl"
    # cotrain's side lands in the summary now, so a lease that ends during the reference keeps it.
    "$PY" "$HERE/tools.py" maporl-table "$O/maporl-metrics.jsonl" > "$O/maporl-cotrain.txt" 2>&1
    note "maporl: cotrain's two steps done ($MODE, $Q questions):"$'\n'"$(head -5 "$O/maporl-cotrain.txt")"
    REF_JSON=""
    # The reference gets what is left of BUDGET (420 s without one).
    left=420; [ "$BUDGET" -gt 0 ] && left=$((BUDGET - (SECONDS - T0) - 15))
    if [ "$MODE" = gpu ] && [ "$left" -lt 60 ]; then
      note "maporl: the reference skipped, ${left} s of BUDGET left"
    elif [ "$MODE" = gpu ]; then
      if ! "$PY" -c 'import peft' 2>/dev/null && ls "$ROOT"/.gpu/wheels/*.whl >/dev/null 2>&1; then
        # A wheel is a zip of the installed layout: unpacked, it imports (no pip needed there).
        for whl in "$ROOT"/.gpu/wheels/*.whl; do "$PY" -m zipfile -e "$whl" "$W/pylib"; done > "$O/wheels.log" 2>&1 \
          && export PYTHONPATH=$W/pylib${PYTHONPATH:+:$PYTHONPATH}
      fi
      if "$PY" -c 'import peft' 2>/dev/null; then
        timeout "$left" "$PY" "$ROOT/scripts/bench/maporl_reference.py" --model-dir "$M" --device cuda --questions $Q \
          --num-mini-batches $MB --tokens $TOK --turns 2 > "$O/maporl-reference.json" 2> "$O/maporl-reference.log" \
          && REF_JSON=$O/maporl-reference.json \
          || note "maporl: the reference failed: $(tail -2 "$O/maporl-reference.log" | tr '\n' ' ' | cut -c1-300)"
      else note "maporl: no peft in $PY and no wheels in .gpu/wheels: cotrain's side only"; fi
    else note "maporl: CPU dry run, cotrain's side only (the reference needs torch, transformers and peft)"; fi
    pk=$(peak_mib "$O/gpumem-maporl.txt")
    "$PY" "$HERE/tools.py" maporl-table "$O/maporl-metrics.jsonl" $REF_JSON > "$O/maporl.txt" 2>&1 \
      && pass "maporl: two MaPoRL steps ($MODE, $Q questions, peak GPU memory ${pk:-n/a} MiB):"$'\n'"$(cat "$O/maporl.txt")" \
      || fail "maporl: figures: $(cat "$O/maporl.txt")"
  else fail "maporl: the learner failed (rc $rc): $(grep -i -m3 'error\|panic' "$O/learner-maporl.log" | tr '\n' ' ' | cut -c1-400)"; fi
fi

# --- 7. generation speed against transformers (last: it takes the time that is left) -----------
SAMPLING=(--temperature 0.7 --top-p 0.9 --top-k 50)
if [ "$MODE" = gpu ] && want speed 150; then
  for shape in qwen3-1.7b qwen2.5-coder-3b; do
    [ "$shape" = qwen3-1.7b ] || want speed 100 || break
    if ! M=$(ensure_model "$shape"); then
      fail "speed $shape: building the model: $(tail -2 "$O/build-$shape.log" | tr '\n' ' ')"; continue
    fi
    timeout 200 "$PY" "$HERE/hf_generate.py" bench "$M" --batches "$BATCHES" --new-tokens 256 --out "$O/hf-$shape.json" > "$O/hf-$shape.log" 2>&1 \
      || note "speed $shape: transformers: $(tail -1 "$O/hf-$shape.log")"
    for b in ${BATCHES//,/ }; do
      [ "${slow:-}" = "$shape" ] && break  # a smaller batch ran out of time: larger ones would too
      start_gpumem "$O/gpumem-gen-$shape-$b.txt"
      timeout 120 rollout-worker generate --model "$M" --device cuda:0 --dtype bf16 --prompt "$(cat "$HERE/prompt.txt")" --n "$b" \
        --max-new-tokens 256 --ignore-eos "${SAMPLING[@]}" --seed 1 --json > "$W/gen-$shape-$b.json" 2> "$O/gen-$shape-$b.err"
      rc=$?; stop_gpumem
      [ $rc = 124 ] && slow=$shape
      "$PY" "$HERE/tools.py" gen-figure "$W/gen-$shape-$b.json" "$shape" "$b" "$(peak_mib "$O/gpumem-gen-$shape-$b.txt")" "$rc" >> "$O/cotrain-gen.jsonl"
    done
    "$PY" "$HERE/tools.py" speed-table "$shape" "$O/hf-$shape.json" "$O/cotrain-gen.jsonl" "$HERE/models/$shape/config.json" > "$O/speed-$shape.txt" 2>&1
    note "speed $shape (tok/s, cotrain vs transformers, same GPU):"$'\n'"$(cat "$O/speed-$shape.txt")"
  done
fi

# --- 8. vLLM behind the worker (GPU, only when asked for: STEPS=vllm) ----------------------------
# `rollout-worker serve --engine vllm` against `--engine cotrain` on the Qwen3-1.7B shape, bf16, the
# same prompt and batches, through scripts/bench/vllm_vs_cotrain.py; vLLM must be in the machine's
# Python (nothing larger than the bundle can be brought to it). On the CPU: a NOTE (the CPU
# figures come from the same script, run on the build machine).
if want vllm 300; then
  if [ "$MODE" = cpu ]; then
    note "vllm: GPU only (on CPUs: python3 scripts/bench/vllm_vs_cotrain.py after COTRAIN_VLLM=cpu make setup)"
  elif ! v=$("$PY" -c 'import vllm; print(vllm.__version__)' 2>/dev/null | tail -1); then
    note "vllm: $PY has no vLLM; nothing measured (COTRAIN_VLLM=system needs a machine whose Python has it)"
  elif ! M=$(ensure_model qwen3-1.7b); then
    fail "vllm: building the Qwen3-1.7B shape: $(tail -2 "$O/build-qwen3-1.7b.log" | tr '\n' ' ')"
  else
    COTRAIN_VLLM_PYTHON=$(command -v "$PY") timeout 280 python3 "$ROOT/scripts/bench/vllm_vs_cotrain.py" --bin "$BIN" \
      --model "$M" --device cuda:0 --dtype bf16 --sizes "$BATCHES" --tokens 256 --skip-magrpo \
      --prompt "$(cat "$HERE/prompt.txt")" > "$O/vllm.txt" 2>&1
    rc=$?
    if [ $rc = 0 ]; then note "vllm $v (tok/s, cotrain's engine vs vLLM, same GPU):"$'\n'"$(grep '^|' "$O/vllm.txt")"
    else fail "vllm $v: exit $rc: $(tail -3 "$O/vllm.txt" | tr '\n' ' ')"; fi
  fi
fi

echo; echo "================ summary ($MODE, $((SECONDS - T0)) s)"
echo "($MODE, $((SECONDS - T0)) s)" >> "$O/summary.txt"
printf '%s\n' "${SUMMARY[@]}"
! grep -q '^FAIL' "$O/summary.txt"
