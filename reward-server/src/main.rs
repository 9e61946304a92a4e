//! `reward-server`: sandboxed code execution and every seed reward over gRPC and HTTP.
//!
//! Prints one line `listening grpc=ADDR http=ADDR` on stdout once both listeners are bound
//! (ports resolved, so `127.0.0.1:0` works), then serves until SIGINT or SIGTERM.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use cotrain_reward_server::config::{ConfigFile, Overrides, ServerConfig};

/// cotrain's reward server.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// gRPC listen address (default 127.0.0.1:50051; port 0 picks a free port).
    #[arg(long)]
    grpc_addr: Option<SocketAddr>,
    /// HTTP listen address (default 127.0.0.1:8000; port 0 picks a free port).
    #[arg(long)]
    http_addr: Option<SocketAddr>,
    /// Sandboxed runs at once (default: number of CPU cores).
    #[arg(long)]
    max_concurrency: Option<usize>,
    /// Sandboxed runs allowed to wait for a slot; beyond that requests get 429 / RESOURCE_EXHAUSTED.
    #[arg(long)]
    queue_limit: Option<usize>,
    /// Configuration file (YAML or JSON); flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Run code WITHOUT the bubblewrap sandbox (plain subprocesses with rlimits). Never use this
    /// with untrusted code; every run logs a warning.
    #[arg(long)]
    insecure_no_sandbox: bool,
    /// The gRPC address of a rollout worker serving a learned verifier (`rollout-worker serve
    /// --verifier NAME=DIR`); enables MaPoRL's `POST /predict` and `POST /v1/verify`.
    #[arg(long, value_name = "URL")]
    verifier_endpoint: Option<String>,
    /// Serve gRPC and HTTP over TLS with this PEM certificate chain (with --tls-key).
    #[arg(long, value_name = "PATH", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, value_name = "PATH", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received"),
        _ = term.recv() => tracing::info!("SIGTERM received"),
    }
}

fn main() {
    if let Err(err) = run() {
        eprintln!("reward-server: error: {err:#}");
        std::process::exit(1);
    }
}

fn run() -> anyhow::Result<()> {
    let args = Args::parse();
    cotrain_proto::logging::init("info");
    let file = match &args.config {
        Some(path) => Some((path.as_path(), ConfigFile::load(path)?)),
        None => None,
    };
    let cfg = ServerConfig::resolve(
        file,
        Overrides {
            grpc_addr: args.grpc_addr,
            http_addr: args.http_addr,
            max_concurrency: args.max_concurrency,
            queue_limit: args.queue_limit,
            insecure_no_sandbox: args.insecure_no_sandbox,
            verifier_endpoint: args.verifier_endpoint,
            tls: cotrain_proto::tls::ServerTls::from_flags(
                args.tls_cert.as_deref(),
                args.tls_key.as_deref(),
            )
            .map_err(anyhow::Error::msg)?,
        },
    )?;
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    runtime.block_on(cotrain_reward_server::server::serve(
        cfg,
        shutdown_signal(),
        |bound| {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "listening grpc={} http={}", bound.grpc, bound.http);
            let _ = out.flush();
        },
    ))
}
