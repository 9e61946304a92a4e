//! The server's configuration: an optional file (YAML or JSON) overridden by command-line flags,
//! checked once into a [`ServerConfig`].
//!
//! ```yaml
//! grpc_addr: 127.0.0.1:50051
//! http_addr: 127.0.0.1:8000
//! max_body_bytes: 16777216
//! sandbox:
//!   max_concurrency: 4
//!   queue_limit: 64
//!   limits: { cpu_time_secs: 10, memory_mb: 1024, wall_timeout_ms: 10000 }
//! ```

use std::net::SocketAddr;
use std::path::Path;

use serde::Deserialize;

use crate::sandbox::SandboxConfig;

/// The file as written; every key optional.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConfigFile {
    pub grpc_addr: Option<SocketAddr>,
    pub http_addr: Option<SocketAddr>,
    pub max_body_bytes: Option<usize>,
    pub sandbox: SandboxConfig,
}

/// Settings from the command line that override the file.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub grpc_addr: Option<SocketAddr>,
    pub http_addr: Option<SocketAddr>,
    pub max_concurrency: Option<usize>,
    pub queue_limit: Option<usize>,
    pub insecure_no_sandbox: bool,
    pub verifier_endpoint: Option<String>,
    /// Serve both listeners over TLS (`--tls-cert`, `--tls-key`).
    pub tls: Option<cotrain_proto::tls::ServerTls>,
}

/// The checked configuration the server runs with.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub grpc_addr: SocketAddr,
    pub http_addr: SocketAddr,
    /// Largest accepted request body (HTTP) or message (gRPC).
    pub max_body_bytes: usize,
    pub sandbox: SandboxConfig,
    /// The rollout worker hosting the learned verifier (`--verifier-endpoint`), for `/predict`.
    pub verifier_endpoint: Option<String>,
    /// Serve both listeners over TLS (`--tls-cert`, `--tls-key`).
    pub tls: Option<cotrain_proto::tls::ServerTls>,
}

/// A configuration that cannot be used; names the key and the file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    /// The file is not valid YAML/JSON for this schema (unknown key, wrong type).
    #[error("config file {path}: {message}")]
    Parse { path: String, message: String },
    /// A value is out of range.
    #[error("config{}: {message}", .path.as_deref().map(|p| format!(" file {p}")).unwrap_or_default())]
    Invalid {
        path: Option<String>,
        message: String,
    },
}

pub const DEFAULT_GRPC_ADDR: &str = "127.0.0.1:50051";
pub const DEFAULT_HTTP_ADDR: &str = "127.0.0.1:8000";
pub const DEFAULT_MAX_BODY_BYTES: usize = 16 << 20;

impl ConfigFile {
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: shown.clone(),
            source,
        })?;
        Self::parse(&text).map_err(|message| ConfigError::Parse {
            path: shown,
            message,
        })
    }

    /// YAML (a superset of JSON for these files).
    pub fn parse(text: &str) -> Result<Self, String> {
        serde_yaml_ng::from_str(text).map_err(|e| e.to_string())
    }
}

impl ServerConfig {
    /// Merges the file (if any) with the overrides and validates the result.
    pub fn resolve(
        file: Option<(&Path, ConfigFile)>,
        overrides: Overrides,
    ) -> Result<Self, ConfigError> {
        let path = file.as_ref().map(|(p, _)| p.display().to_string());
        let file = file.map(|(_, f)| f).unwrap_or_default();
        let invalid = |message: String| ConfigError::Invalid {
            path: path.clone(),
            message,
        };
        let mut sandbox = file.sandbox;
        if let Some(n) = overrides.max_concurrency {
            sandbox.max_concurrency = Some(n);
        }
        if let Some(n) = overrides.queue_limit {
            sandbox.queue_limit = n;
        }
        sandbox.insecure_no_sandbox |= overrides.insecure_no_sandbox;
        if sandbox.max_concurrency == Some(0) {
            return Err(invalid("sandbox.max_concurrency must be at least 1".into()));
        }
        sandbox.limits.validate().map_err(invalid)?;
        let max_body_bytes = file.max_body_bytes.unwrap_or(DEFAULT_MAX_BODY_BYTES);
        if max_body_bytes < 1024 {
            return Err(invalid(format!(
                "max_body_bytes must be at least 1024, got {max_body_bytes}"
            )));
        }
        Ok(Self {
            grpc_addr: overrides
                .grpc_addr
                .or(file.grpc_addr)
                .unwrap_or_else(|| DEFAULT_GRPC_ADDR.parse().expect("valid default")),
            http_addr: overrides
                .http_addr
                .or(file.http_addr)
                .unwrap_or_else(|| DEFAULT_HTTP_ADDR.parse().expect("valid default")),
            max_body_bytes,
            sandbox,
            verifier_endpoint: overrides.verifier_endpoint,
            tls: overrides.tls,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_keys_are_named() {
        let err = ConfigFile::parse("grpc_adr: 127.0.0.1:1\n").unwrap_err();
        assert!(err.contains("grpc_adr"), "{err}");
        let err = ConfigFile::parse("sandbox:\n  limits:\n    memory_megs: 3\n").unwrap_err();
        assert!(err.contains("memory_megs"), "{err}");
    }

    #[test]
    fn wrong_values_are_named_with_the_file() {
        let file = ConfigFile::parse("sandbox:\n  limits:\n    max_processes: 0\n").unwrap();
        let err = ServerConfig::resolve(Some((Path::new("rs.yaml"), file)), Overrides::default())
            .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("rs.yaml") && msg.contains("sandbox.max_processes"),
            "{msg}"
        );
    }

    #[test]
    fn flags_override_the_file_and_defaults_are_loopback() {
        let file =
            ConfigFile::parse("http_addr: 127.0.0.1:9000\nsandbox:\n  queue_limit: 5\n").unwrap();
        let cfg = ServerConfig::resolve(
            Some((Path::new("f"), file)),
            Overrides {
                queue_limit: Some(7),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(cfg.sandbox.queue_limit, 7);
        assert_eq!(cfg.http_addr.port(), 9000);
        assert!(cfg.grpc_addr.ip().is_loopback());
    }
}
