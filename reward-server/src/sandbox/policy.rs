//! The resource policy every sandboxed run is held to, with units in the field names.

use serde::{Deserialize, Serialize};

/// Limits for one sandboxed run. Requests may lower these (see [`SandboxPolicy::narrowed`]) but
/// never raise them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SandboxPolicy {
    /// CPU time per process (RLIMIT_CPU) for raw executions; test runs get their own budget.
    pub cpu_time_secs: u64,
    /// Address space per process (RLIMIT_AS).
    pub memory_mb: u64,
    /// Wall-clock limit of a raw execution, after which the whole sandbox is killed.
    pub wall_timeout_ms: u64,
    /// Cap on captured stdout and on captured stderr (each); a run that writes more is killed.
    pub max_output_bytes: usize,
    /// Processes (and threads) the sandboxed program may have at once (RLIMIT_NPROC).
    pub max_processes: u32,
    /// Largest file the program may write (RLIMIT_FSIZE).
    pub max_file_size_mb: u64,
    /// Open file descriptors per process (RLIMIT_NOFILE).
    pub max_open_files: u64,
    /// Size of the private writable tmpfs working directory (and of /tmp).
    pub tmpfs_size_mb: u64,
}

impl Default for SandboxPolicy {
    fn default() -> Self {
        Self {
            cpu_time_secs: 10,
            memory_mb: 1024,
            wall_timeout_ms: 10_000,
            max_output_bytes: 1 << 20,
            max_processes: 32,
            max_file_size_mb: 16,
            max_open_files: 64,
            tmpfs_size_mb: 64,
        }
    }
}

/// Per-request limits; each `None` keeps the policy's value.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct ExecLimits {
    pub wall_timeout_ms: Option<u64>,
    pub memory_mb: Option<u64>,
}

impl SandboxPolicy {
    /// Checks that every limit is usable; names the offending key.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("cpu_time_secs", self.cpu_time_secs),
            ("memory_mb", self.memory_mb),
            ("wall_timeout_ms", self.wall_timeout_ms),
            ("max_output_bytes", self.max_output_bytes as u64),
            ("max_processes", self.max_processes as u64),
            ("max_file_size_mb", self.max_file_size_mb),
            ("max_open_files", self.max_open_files),
            ("tmpfs_size_mb", self.tmpfs_size_mb),
        ];
        for (key, value) in positive {
            if value == 0 {
                return Err(format!("sandbox.{key} must be greater than 0"));
            }
        }
        // The interpreter alone maps tens of megabytes and holds a dozen descriptors.
        if self.memory_mb < 64 {
            return Err("sandbox.memory_mb must be at least 64 (python needs it to start)".into());
        }
        if self.max_open_files < 16 {
            return Err("sandbox.max_open_files must be at least 16".into());
        }
        if self.max_processes < 4 {
            return Err(
                "sandbox.max_processes must be at least 4 (sandbox init, harness, program)".into(),
            );
        }
        Ok(())
    }

    /// This policy with a request's limits applied: a request may only tighten.
    pub fn narrowed(&self, limits: &ExecLimits) -> Self {
        let mut p = self.clone();
        if let Some(ms) = limits.wall_timeout_ms {
            p.wall_timeout_ms = ms.clamp(1, self.wall_timeout_ms);
            p.cpu_time_secs = p.cpu_time_secs.min(p.wall_timeout_ms.div_ceil(1000).max(1));
        }
        if let Some(mb) = limits.memory_mb {
            p.memory_mb = mb.clamp(64, self.memory_mb);
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_can_lower_but_not_raise_limits() {
        let p = SandboxPolicy::default();
        let lower = p.narrowed(&ExecLimits {
            wall_timeout_ms: Some(500),
            memory_mb: Some(128),
        });
        assert_eq!(lower.wall_timeout_ms, 500);
        assert_eq!(lower.cpu_time_secs, 1);
        assert_eq!(lower.memory_mb, 128);
        let higher = p.narrowed(&ExecLimits {
            wall_timeout_ms: Some(10_000_000),
            memory_mb: Some(1 << 30),
        });
        assert_eq!(higher.wall_timeout_ms, p.wall_timeout_ms);
        assert_eq!(higher.memory_mb, p.memory_mb);
    }

    #[test]
    fn validation_names_the_key() {
        let p = SandboxPolicy {
            max_processes: 0,
            ..Default::default()
        };
        assert!(p.validate().unwrap_err().contains("sandbox.max_processes"));
        assert!(SandboxPolicy::default().validate().is_ok());
    }

    #[test]
    fn unknown_policy_keys_are_rejected() {
        let err = serde_json::from_str::<SandboxPolicy>(r#"{"memory_megs": 5}"#).unwrap_err();
        assert!(err.to_string().contains("memory_megs"));
    }
}
