//! How every cotrain binary logs: to stderr, filtered by `RUST_LOG` (else the binary's default
//! level), with colours only on a terminal and never when `NO_COLOR` is set (no-color.org), so that
//! logs written to a file or read by a test carry no escape codes.

use std::io::IsTerminal;

/// Whether log lines may carry ANSI colours: stderr is a terminal and `NO_COLOR` is unset or empty.
pub fn colours() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// Starts logging (a second call does nothing).
pub fn init(default_filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colours())
        .try_init();
}
