//! `learner`: parses arguments, starts tracing and calls into the library.

use clap::Parser;

fn main() -> anyhow::Result<()> {
    cotrain_model::tune_process();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    cotrain_learner::cli::run(cotrain_learner::cli::Cli::parse())
}
