//! The sandbox: every piece of model-written code runs here, never in the server.
//!
//! A run is a fresh bubblewrap sandbox ([`namespaces`]) started under resource limits
//! ([`rlimits`]) with a cleared environment ([`environment`]); inside it a small Python harness
//! ([`harness`]) runs either a raw program or a program plus its tests and reports back on a
//! private pipe. [`process`] supervises the run (wall-clock timeout that kills the whole PID
//! namespace, capped output) and [`queue`] bounds how many run at once and how many wait.
//!
//! Strict by default: [`BwrapSandbox::start`] probes that isolation really works and fails
//! otherwise. `insecure_no_sandbox` runs plain subprocesses (same rlimits, no namespaces) and logs
//! a warning on every run.

pub mod environment;
pub mod harness;
pub mod namespaces;
pub mod policy;
pub mod process;
pub mod queue;
pub mod rlimits;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::code_runner::{CodeRunner, ProgramReport, ProgramTests, RunnerError};
pub use policy::{ExecLimits, SandboxPolicy};

/// Sandbox settings (the `sandbox` section of the server config).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SandboxConfig {
    /// Python interpreter to run inside the sandbox. Default: `/usr/bin/python3` if present,
    /// else `python3` from `PATH`. Its installation is mounted read-only.
    pub python: Option<PathBuf>,
    /// The bubblewrap binary.
    pub bwrap: PathBuf,
    /// Unprivileged uid the sandbox runs as when the server runs as root (root is exempt from
    /// RLIMIT_NPROC). Default 65534 (`nobody`); ignored when the server is not root.
    pub sandbox_uid: u32,
    /// Runs at once; `None` = number of CPU cores.
    pub max_concurrency: Option<usize>,
    /// Runs allowed to wait for a slot; beyond that requests are rejected as overloaded.
    pub queue_limit: usize,
    /// Run code WITHOUT isolation (plain subprocess with rlimits). Never for untrusted code.
    pub insecure_no_sandbox: bool,
    /// Limits of every run.
    pub limits: SandboxPolicy,
}

impl Default for SandboxConfig {
    fn default() -> Self {
        Self {
            python: None,
            bwrap: "bwrap".into(),
            sandbox_uid: 65534,
            max_concurrency: None,
            queue_limit: 64,
            insecure_no_sandbox: false,
            limits: SandboxPolicy::default(),
        }
    }
}

/// Why the sandbox could not be set up (the server refuses to start).
#[derive(Debug, thiserror::Error)]
pub enum SandboxSetupError {
    /// The configured interpreter could not be run or questioned.
    #[error("python interpreter {python}: {reason}")]
    Python { python: String, reason: String },
    /// A file for the harness could not be written.
    #[error("cannot prepare the sandbox harness: {0}")]
    Harness(#[source] std::io::Error),
    /// A limit is unusable.
    #[error("invalid sandbox limit: {0}")]
    Policy(String),
    /// bwrap did not give the isolation we require.
    #[error(
        "sandbox isolation does not work: {0}; install bubblewrap and allow unprivileged user \
         namespaces, or start with --insecure-no-sandbox (NOT for untrusted code)"
    )]
    Isolation(String),
}

/// How a raw execution ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum ExecStatus {
    /// The program exited by itself.
    Finished { exit_code: i32 },
    /// The program was killed by a signal (its own doing, or RLIMIT_FSIZE's SIGXFSZ, ...).
    Killed { signal: i32 },
    /// The program used up its CPU time (RLIMIT_CPU).
    CpuTimeExceeded { cpu_time_secs: u64 },
    /// The wall-clock limit fired and the whole sandbox was killed.
    TimedOut { wall_timeout_ms: u64 },
    /// stdout or stderr went past the cap and the whole sandbox was killed.
    OutputLimit { max_output_bytes: usize },
}

/// The result of one raw execution.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecOutcome {
    #[serde(flatten)]
    pub status: ExecStatus,
    pub stdout: String,
    pub stderr: String,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
    pub wall_time_ms: u64,
    /// False only under `insecure_no_sandbox`.
    pub sandboxed: bool,
}

enum Mode {
    Bwrap {
        layout: namespaces::Layout,
        drop_to_uid: Option<u32>,
    },
    Insecure {
        python: PathBuf,
    },
}

struct Inner {
    mode: Mode,
    policy: SandboxPolicy,
    admission: queue::Admission,
    harness: PathBuf,
    // Holds the harness file for the sandbox's lifetime.
    _dir: tempfile::TempDir,
}

/// The bubblewrap sandbox. Cheap to clone (shared state).
#[derive(Clone)]
pub struct BwrapSandbox {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for BwrapSandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BwrapSandbox")
            .field("sandboxed", &self.is_sandboxed())
            .field("policy", &self.inner.policy)
            .finish()
    }
}

/// What the interpreter says about itself.
struct PythonInfo {
    executable: PathBuf,
    prefixes: Vec<PathBuf>,
}

fn question_python(python: &Path) -> Result<PythonInfo, SandboxSetupError> {
    let err = |reason: String| SandboxSetupError::Python {
        python: python.display().to_string(),
        reason,
    };
    let out = std::process::Command::new(python)
        .args([
            "-I",
            "-c",
            "import sys,json;print(json.dumps([sys.executable,sys.base_prefix,sys.prefix]))",
        ])
        .env_clear()
        .output()
        .map_err(|e| err(e.to_string()))?;
    if !out.status.success() {
        return Err(err(format!(
            "exited with {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    let paths: Vec<String> = serde_json::from_slice(&out.stdout).map_err(|e| err(e.to_string()))?;
    let executable = std::fs::canonicalize(&paths[0]).map_err(|e| err(e.to_string()))?;
    let prefixes = paths[1..].iter().map(PathBuf::from).collect();
    Ok(PythonInfo {
        executable,
        prefixes,
    })
}

fn default_python() -> PathBuf {
    let system = Path::new("/usr/bin/python3");
    if system.exists() {
        system.into()
    } else {
        "python3".into()
    }
}

fn write_harness(dir: &Path) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    // The sandbox may run as another uid: it must be able to read the harness, nothing else.
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
    let path = dir.join("harness.py");
    std::fs::write(&path, harness::SOURCE)?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644))?;
    Ok(path)
}

/// Printed by the probe run: what the sandbox can see.
const PROBE: &str = r#"import json, os, socket
print(json.dumps({"pid": os.getpid(), "ifaces": [n for _, n in socket.if_nameindex()],
                  "env": sorted(os.environ), "uid": os.getuid()}))"#;

impl BwrapSandbox {
    /// Sets the sandbox up and, unless insecure, proves that isolation works by running a probe.
    pub async fn start(config: &SandboxConfig) -> Result<Self, SandboxSetupError> {
        config
            .limits
            .validate()
            .map_err(SandboxSetupError::Policy)?;
        let python = config.python.clone().unwrap_or_else(default_python);
        let info = question_python(&python)?;
        let dir = tempfile::Builder::new()
            .prefix("cotrain-sandbox-")
            .tempdir()
            .map_err(SandboxSetupError::Harness)?;
        let harness = write_harness(dir.path()).map_err(SandboxSetupError::Harness)?;
        let mode = if config.insecure_no_sandbox {
            Mode::Insecure {
                python: info.executable.clone(),
            }
        } else {
            let mut extra_ro: Vec<PathBuf> = Vec::new();
            let exe_dir = info.executable.parent().map(Path::to_path_buf);
            for p in info.prefixes.iter().cloned().chain(exe_dir) {
                if !namespaces::covered_by_base(&p) && !extra_ro.iter().any(|e| p.starts_with(e)) {
                    extra_ro.push(p);
                }
            }
            let drop_to_uid = (rlimits::effective_uid() == 0).then_some(config.sandbox_uid);
            Mode::Bwrap {
                layout: namespaces::Layout {
                    bwrap: config.bwrap.clone(),
                    python: info.executable.clone(),
                    extra_ro,
                    harness: harness.clone(),
                },
                drop_to_uid,
            }
        };
        let max_concurrency = config.max_concurrency.unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        });
        let sandbox = Self {
            inner: Arc::new(Inner {
                mode,
                policy: config.limits.clone(),
                admission: queue::Admission::new(max_concurrency, config.queue_limit),
                harness,
                _dir: dir,
            }),
        };
        if sandbox.is_sandboxed() {
            sandbox.probe().await?;
        } else {
            tracing::warn!(
                "INSECURE: --insecure-no-sandbox is set; model-written code will run without isolation"
            );
        }
        Ok(sandbox)
    }

    async fn probe(&self) -> Result<(), SandboxSetupError> {
        let fail = SandboxSetupError::Isolation;
        let out = self
            .execute(PROBE, None, &ExecLimits::default())
            .await
            .map_err(|e| fail(e.to_string()))?;
        if out.status != (ExecStatus::Finished { exit_code: 0 }) {
            return Err(fail(format!(
                "probe run ended with {:?}: {}",
                out.status,
                out.stderr.trim()
            )));
        }
        let seen: serde_json::Value = serde_json::from_str(out.stdout.trim())
            .map_err(|e| fail(format!("unreadable probe output {:?}: {e}", out.stdout)))?;
        let pid = seen["pid"].as_u64().unwrap_or(u64::MAX);
        if pid > 8 {
            return Err(fail(format!("no PID namespace (probe saw pid {pid})")));
        }
        if seen["ifaces"] != serde_json::json!(["lo"]) {
            return Err(fail(format!(
                "network is not isolated (interfaces {})",
                seen["ifaces"]
            )));
        }
        let allowed: Vec<&str> = environment::minimal_env(environment::WORKDIR)
            .iter()
            .map(|(k, _)| *k)
            .collect();
        let leaked: Vec<String> = seen["env"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| v.as_str())
            .filter(|k| !allowed.contains(k))
            .map(String::from)
            .collect();
        if !leaked.is_empty() {
            return Err(fail(format!("environment not cleared: {leaked:?}")));
        }
        tracing::info!(uid = %seen["uid"], wall_ms = out.wall_time_ms, "sandbox isolation probe passed");
        Ok(())
    }

    /// False under `insecure_no_sandbox`.
    pub fn is_sandboxed(&self) -> bool {
        matches!(self.inner.mode, Mode::Bwrap { .. })
    }

    pub fn policy(&self) -> &SandboxPolicy {
        &self.inner.policy
    }

    /// Runs waiting for a slot.
    pub fn queue_depth(&self) -> usize {
        self.inner.admission.queue_depth()
    }

    /// Runs executing now.
    pub fn in_flight(&self) -> usize {
        self.inner.admission.in_flight()
    }

    pub fn max_concurrency(&self) -> usize {
        self.inner.admission.max_concurrency()
    }

    /// Stops admitting runs; queued callers get an error. Running ones finish.
    pub fn close(&self) {
        self.inner.admission.close();
    }

    fn spawn_spec(
        &self,
        policy: &SandboxPolicy,
        cpu_secs: u64,
        wall: Duration,
        job: Vec<u8>,
        stdin: Option<Vec<u8>>,
        run_dir: Option<&Path>,
    ) -> process::Spawn {
        let limits = rlimits::Rlimits {
            cpu_secs,
            address_space_bytes: policy.memory_mb * 1024 * 1024,
            file_size_bytes: policy.max_file_size_mb * 1024 * 1024,
            open_files: policy.max_open_files,
        };
        let (program, args, cwd, env, drop_to_uid) = match &self.inner.mode {
            Mode::Bwrap {
                layout,
                drop_to_uid,
            } => (
                layout.bwrap.clone().into_os_string(),
                layout.bwrap_args(policy.tmpfs_size_mb),
                None,
                vec![],
                *drop_to_uid,
            ),
            Mode::Insecure { python } => {
                tracing::warn!(
                    "INSECURE: running model-written code WITHOUT a sandbox (--insecure-no-sandbox)"
                );
                let dir = run_dir.map(Path::to_path_buf);
                let env = environment::minimal_env(
                    &dir.as_deref()
                        .unwrap_or(Path::new("/tmp"))
                        .display()
                        .to_string(),
                );
                (
                    python.clone().into_os_string(),
                    vec![
                        "-I".into(),
                        "-B".into(),
                        self.inner.harness.clone().into_os_string(),
                    ],
                    dir,
                    env,
                    None,
                )
            }
        };
        process::Spawn {
            program,
            args,
            cwd,
            env,
            limits,
            drop_to_uid,
            job,
            stdin,
            wall_timeout: wall,
            max_output_bytes: policy.max_output_bytes,
        }
    }

    /// The process-count limit the harness sets inside the sandbox (not meaningful outside a
    /// user namespace, where it would count every process of the server's user).
    fn max_processes(&self, policy: &SandboxPolicy) -> Option<u32> {
        self.is_sandboxed().then_some(policy.max_processes)
    }

    fn run_dir(&self) -> Result<Option<tempfile::TempDir>, RunnerError> {
        match self.inner.mode {
            Mode::Bwrap { .. } => Ok(None),
            Mode::Insecure { .. } => tempfile::Builder::new()
                .prefix("cotrain-run-")
                .tempdir()
                .map(Some)
                .map_err(|e| RunnerError::Sandbox(format!("cannot create a run directory: {e}"))),
        }
    }

    /// Runs `code` as a Python program with `stdin`, under the policy narrowed by `limits`.
    pub async fn execute(
        &self,
        code: &str,
        stdin: Option<&[u8]>,
        limits: &ExecLimits,
    ) -> Result<ExecOutcome, RunnerError> {
        let _slot = self.inner.admission.acquire().await?;
        let policy = self.inner.policy.narrowed(limits);
        let job = serde_json::to_vec(&harness::Job::Exec {
            code,
            max_processes: self.max_processes(&policy),
        })
        .map_err(|e| RunnerError::Sandbox(e.to_string()))?;
        let run_dir = self.run_dir()?;
        let spec = self.spawn_spec(
            &policy,
            policy.cpu_time_secs,
            Duration::from_millis(policy.wall_timeout_ms),
            job,
            Some(stdin.unwrap_or_default().to_vec()),
            run_dir.as_ref().map(|d| d.path()),
        );
        let run = process::run(spec)
            .await
            .map_err(|e| RunnerError::Sandbox(format!("cannot start the sandbox: {e}")))?;
        let status = match run.ended {
            process::Ended::TimedOut => ExecStatus::TimedOut {
                wall_timeout_ms: policy.wall_timeout_ms,
            },
            process::Ended::OutputLimit => ExecStatus::OutputLimit {
                max_output_bytes: policy.max_output_bytes,
            },
            process::Ended::Exited(outer) => {
                use std::os::unix::process::ExitStatusExt;
                let exit = harness::exec_exit(&run.report).unwrap_or_else(|| {
                    // The harness did not report (the program killed it): fall back on what bwrap
                    // passes on, 128 + signal for a signalled child.
                    match (outer.code(), outer.signal()) {
                        (Some(c), _) if c > 128 && self.is_sandboxed() => {
                            harness::ProgramExit::Signal(c - 128)
                        }
                        (Some(c), _) => harness::ProgramExit::Code(c),
                        (None, Some(s)) => harness::ProgramExit::Signal(s),
                        (None, None) => harness::ProgramExit::Code(-1),
                    }
                });
                match exit {
                    harness::ProgramExit::Signal(s) if s == libc::SIGXCPU => {
                        ExecStatus::CpuTimeExceeded {
                            cpu_time_secs: policy.cpu_time_secs,
                        }
                    }
                    harness::ProgramExit::Signal(signal) => ExecStatus::Killed { signal },
                    harness::ProgramExit::Code(exit_code) => ExecStatus::Finished { exit_code },
                }
            }
        };
        Ok(ExecOutcome {
            status,
            stdout: String::from_utf8_lossy(&run.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&run.stderr).into_owned(),
            stdout_truncated: run.stdout_truncated,
            stderr_truncated: run.stderr_truncated,
            wall_time_ms: run.wall.as_millis() as u64,
            sandboxed: self.is_sandboxed(),
        })
    }

    async fn run_program(&self, program: ProgramTests) -> Result<ProgramReport, RunnerError> {
        let per_test = program.per_test_timeout_secs;
        if !(per_test.is_finite() && per_test > 0.0) {
            return Err(RunnerError::Sandbox(format!(
                "per_test_timeout_secs must be positive, got {per_test}"
            )));
        }
        let _slot = self.inner.admission.acquire().await?;
        let policy = self.inner.policy.clone();
        // Every test and every setup (re-run after each timeout) is bounded inside the sandbox;
        // the outer limit is only a backstop covering all of them.
        let n = program.tests.len() as f64;
        // A timed-out test may take the harness's own backstop (1.5 × per_test + 1 s) plus a
        // re-run of the setup.
        let t = program.max_timeouts as f64;
        let backstop_secs = per_test * (n + 1.0 + 2.5 * t) + t + 5.0;
        let backstop = Duration::from_secs_f64(backstop_secs.min(24.0 * 3600.0));
        let job = serde_json::to_vec(&harness::Job::Tests {
            code: &program.code,
            tests: &program.tests,
            per_test_timeout_secs: per_test,
            setup_timeout_secs: per_test,
            max_timeouts: program.max_timeouts.max(1),
            max_processes: self.max_processes(&policy),
            double_call: program.double_call,
        })
        .map_err(|e| RunnerError::Sandbox(e.to_string()))?;
        let run_dir = self.run_dir()?;
        let spec = self.spawn_spec(
            &policy,
            backstop.as_secs().max(1),
            backstop,
            job,
            None,
            run_dir.as_ref().map(|d| d.path()),
        );
        let run = process::run(spec)
            .await
            .map_err(|e| RunnerError::Sandbox(format!("cannot start the sandbox: {e}")))?;
        let wall_ms = run.wall.as_millis() as u64;
        let cut_short = match run.ended {
            process::Ended::TimedOut => Some("the sandbox's wall-clock backstop fired"),
            process::Ended::OutputLimit => Some("the sandbox wrote more output than allowed"),
            process::Ended::Exited(_) => None,
        };
        let (report, aborted) = harness::program_report(&run.report, &program, wall_ms, cut_short)
            .ok_or_else(|| {
                RunnerError::Sandbox(format!(
                    "the harness produced no report ({:?}): {}",
                    run.ended,
                    String::from_utf8_lossy(&run.stderr).trim()
                ))
            })?;
        if let Some(reason) = aborted {
            tracing::debug!(
                reason,
                tests_run = report.tests.len(),
                "test run stopped early"
            );
        }
        Ok(report)
    }
}

impl CodeRunner for BwrapSandbox {
    async fn run_tests(&self, program: ProgramTests) -> Result<ProgramReport, RunnerError> {
        self.run_program(program).await
    }
}
