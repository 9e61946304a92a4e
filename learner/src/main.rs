//! `learner`: parses arguments, starts tracing and calls into the library.

use clap::Parser;

fn main() -> anyhow::Result<()> {
    // SAFETY: first thing in `main`, before any other thread and any libtorch call.
    unsafe { cotrain_model::mkl_dispatch::prefer_avx512() };
    cotrain_model::allocator::tune_for_tensors();
    // The embedded rollout worker's line per weight update is a standalone worker's record; in the
    // learner's own output each step's line says enough (RUST_LOG brings it back).
    cotrain_proto::logging::init("info,cotrain_rollout_worker::service=warn");
    // Before any device query: libtorch's CUDA backend is loaded at run time (see cotrain_model::cuda).
    let _ = cotrain_model::cuda::load();
    cotrain_learner::cli::run(cotrain_learner::cli::Cli::parse())
}
