# cotrain: the two commands of the README, plus the pieces they are made of.
#   make demo   run the main job on the embedded default model (sets up first if needed)
#   make test   run the whole test suite (sets up first if needed)
#   make docs   build the book under docs/ into target/book (the README's links point into it)
.PHONY: setup setup-tests demo test build docs bench-generate gpu-bundle clean-runs

CARGO ?= cargo

# Idempotent and cheap when everything is already cached (see scripts/setup.sh).
setup:
	@bash scripts/setup.sh

# What only the tests and the book need as well (mdBook, the openai client).
setup-tests:
	@COTRAIN_SETUP_TESTS=1 bash scripts/setup.sh

build: setup
	$(CARGO) build --release --workspace

# The learner alone, built once and run as built: `cargo run` after a workspace build would compile
# crates again with the features the learner alone unifies.
TARGET_DIR ?= target
demo: setup
	$(CARGO) build --release -p cotrain-learner --bin learner
	$(TARGET_DIR)/release/learner train --config configs/demo.yaml

# The book, then its links (relative links and #anchors of docs/src/*.md and README.md); the
# configuration reference in it is checked against the config structs by the learner's unit tests.
docs: setup-tests
	mdbook build docs
	python3 scripts/check_docs_links.py

# The style checks (rustfmt's defaults, clippy with every warning an error) and the book with its
# link check come first, so that a formatting slip or a broken doc fails fast.
# The service binaries are built next: the workspace integration tests start them as processes.
# deploy/test.sh then runs the deploy scripts for real: a Slurm cluster of three nodes on this
# machine (slurm-wlm, installed by the script) and the Kubernetes manifests through kustomize and a
# schema validator.
# The NCCL backend (the `cuda` feature, CUDA loaded at run time) is compiled too, so that it keeps
# building on machines without a GPU; its GPU-only test needs `--features cuda` and two GPUs. So is the
# learner without its default features (no Open MPI, no embedded rollout worker or reward server).
# scripts/device/check.sh --cpu is the GPU check's dry run on this machine (so that it cannot rot):
# CUDA refused with its reason, greedy tokens, MAGRPO steps on the tiny model, two MPI ranks.
# The suite runs cotrain's decode kernels wherever the CPU has AVX-512F (COTRAIN_CPU_KERNELS=on)
# rather than the route measured and pinned for this CPU: the seeded learning tests' thresholds were
# set on the kernels' rounding, and a measurement taken while the suite loads the machine (and of a
# debug build's kernels) may pin libtorch. The measured dispatch has its own unit tests.
# vLLM's CPU build (a venv under the cache, ~4.5 GB, ~3 minutes once) for the --engine vllm tests.
test: export COTRAIN_VLLM ?= cpu
test: setup-tests
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	mdbook build docs && python3 scripts/check_docs_links.py
	$(CARGO) build --workspace --bins
	$(CARGO) build -p cotrain-learner --features cuda --lib
	$(CARGO) build -p cotrain-learner --no-default-features --lib
	COTRAIN_CPU_KERNELS=on $(CARGO) test --workspace --no-fail-fast
	bash scripts/device/check.sh --cpu target/debug target/device-check-cpu
	COTRAIN_BIN=target/debug bash deploy/test.sh

# The binaries for a GPU machine without a Rust toolchain (scripts/device/bundle.sh): the CUDA
# learner without Open MPI, the rollout worker, the reward server and bwrap, stripped, in
# .gpu/cotrain-gpu.tar.xz; scripts/device/check.sh runs them there.
gpu-bundle: setup
	bash scripts/device/bundle.sh

bench-generate: setup
	$(CARGO) run --release -p cotrain-model --example bench_generate

clean-runs:
	rm -rf runs
