//! The rollout worker binary: `rollout-worker generate ...` runs a one-off generation (the kind of
//! thing `llama-cli` is). Parsing and printing live here; the work is in `cotrain-model`.

mod generate;

use clap::{Parser, Subcommand};

/// cotrain's rollout worker.
#[derive(Debug, Parser)]
#[command(name = "rollout-worker", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
#[allow(clippy::large_enum_variant, reason = "parsed once per process")]
enum Command {
    /// Generate completions for one prompt and print them.
    Generate(generate::GenerateArgs),
    /// Serve agents (and learned verifiers) over gRPC and an OpenAI-compatible HTTP API until
    /// SIGINT/SIGTERM.
    Serve(cotrain_rollout_worker::ServeArgs),
}

fn main() {
    let cli = Cli::parse();
    // SAFETY: first thing in `main`, before any other thread and any libtorch call.
    unsafe { cotrain_model::mkl_dispatch::prefer_avx512() };
    cotrain_model::allocator::tune_for_tensors();
    // Before any device query: libtorch's CUDA backend is loaded at run time (see cotrain_model::cuda).
    let _ = cotrain_model::cuda::load();
    let result = match cli.command {
        Command::Generate(args) => generate::run(args),
        Command::Serve(args) => cotrain_rollout_worker::server::run(args),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
