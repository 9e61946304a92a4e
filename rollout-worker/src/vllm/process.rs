//! One vLLM engine process: started with its own Unix socket in a private directory, its output
//! forwarded to this process's log, waited for until it answers `/health`, and killed with every
//! process it started when dropped.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tracing::{info, warn};

use super::http::EngineHttp;
use super::{EngineError, LaunchSpec};

/// The worker extension vLLM loads into its model workers (`--worker-extension-cls`): the
/// methods the worker calls through `/collective_rpc` (loading a weights file). Written into the
/// engine's private directory at each start, so the binary needs no install path.
const EXTENSION_PY: &str = include_str!("../../python/cotrain_vllm_ext.py");

/// A running (or starting) engine.
pub struct EngineProcess {
    child: Child,
    /// The engine's process group (vLLM starts an engine-core process beside its API server).
    pgid: i32,
    /// The private directory holding the socket and the extension; held so that it lives as long
    /// as the engine, removed on drop.
    _dir: tempfile::TempDir,
    http: EngineHttp,
    /// Which engine this is in the logs.
    label: String,
    /// The engine's last output lines, for errors that must say why it failed.
    recent: Recent,
}

/// The last lines an engine printed.
type Recent = std::sync::Arc<std::sync::Mutex<std::collections::VecDeque<String>>>;

/// Lines of engine output kept for error messages.
const RECENT_LINES: usize = 200;

impl EngineProcess {
    /// Starts an engine for `spec`; returns once the process is started (not yet ready).
    pub fn spawn(spec: &LaunchSpec, label: &str) -> Result<Self, EngineError> {
        let dir = super::scratch::private_dir(&std::env::temp_dir(), "engine")
            .map_err(|e| EngineError::Start(format!("a private directory for the engine: {e}")))?;
        std::fs::write(dir.path().join("cotrain_vllm_ext.py"), EXTENSION_PY)
            .map_err(|e| EngineError::Start(format!("writing the worker extension: {e}")))?;
        let socket = dir.path().join("api.sock");
        let mut cmd = Command::new(&spec.python);
        cmd.args(["-m", "vllm.entrypoints.openai.api_server"])
            .arg("--model")
            .arg(&spec.model_dir)
            .arg("--uds")
            .arg(&socket)
            .args(spec.engine_args())
            .env("PYTHONPATH", python_path(dir.path()))
            // The pause, reload and collective-RPC endpoints; reachable only through the socket.
            .env("VLLM_SERVER_DEV_MODE", "1")
            .env("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
            .env("VLLM_NO_USAGE_STATS", "1")
            .env("VLLM_DO_NOT_TRACK", "1")
            .env("HF_HUB_OFFLINE", "1")
            .env("TRANSFORMERS_OFFLINE", "1")
            .envs(spec.env.iter().cloned())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        // SAFETY: between fork and exec, only async-signal-safe calls: a new process group (so the
        // engine's children can be killed with it) and SIGTERM when this process dies: vLLM's API
        // server then stops its engine-core process (a SIGKILL would orphan it, still computing).
        unsafe {
            cmd.pre_exec(|| {
                if libc::setpgid(0, 0) != 0
                    || libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM, 0, 0, 0) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().map_err(|e| {
            EngineError::Start(format!(
                "cannot run {} ({e}); set COTRAIN_VLLM and run `make setup`",
                spec.python.display()
            ))
        })?;
        let pgid = child.id().map(|p| p as i32).unwrap_or(0);
        let recent = Recent::default();
        forward_lines(child.stdout.take(), label, recent.clone());
        forward_lines(child.stderr.take(), label, recent.clone());
        info!(engine = label, pid = pgid, model = %spec.model_dir.display(), "vllm engine starting");
        Ok(Self {
            child,
            pgid,
            http: EngineHttp::new(&socket),
            _dir: dir,
            label: label.to_string(),
            recent,
        })
    }

    /// The engine's API.
    pub fn http(&self) -> &EngineHttp {
        &self.http
    }

    /// The last error the engine printed (a Python exception's message line), if any; vLLM's
    /// wrappers that only point at an earlier trace ("EngineCore encountered an issue") are
    /// passed over for the cause they wrap.
    pub fn last_error(&self) -> Option<String> {
        let recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        let is_error = |l: &&String| l.contains("Error: ") || l.contains("Exception: ");
        let is_wrapper =
            |l: &&String| l.contains("EngineDeadError") || l.contains("See stack trace");
        recent
            .iter()
            .rev()
            .filter(is_error)
            .find(|l| !is_wrapper(l))
            .or_else(|| recent.iter().rev().find(is_error))
            .map(|l| {
                // vLLM prefixes its lines with the process and the source line; keep the message.
                let msg = l.rsplit_once("] ").map_or(l.as_str(), |(_, m)| m);
                msg.trim().to_string()
            })
    }

    /// The exit status once the process has ended.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Waits until the engine answers `/health` with 200, or fails when it exits first or
    /// `timeout` passes.
    pub async fn wait_ready(&mut self, timeout: Duration) -> Result<Duration, EngineError> {
        let started = Instant::now();
        let mut poll = Duration::from_millis(50);
        loop {
            if let Some(status) = self.exited() {
                return Err(EngineError::Start(format!(
                    "the vllm engine ({}) exited while starting ({status}): {}",
                    self.label,
                    self.last_error()
                        .unwrap_or_else(|| "its log lines above say why".into())
                )));
            }
            if let Ok((200, _)) = self.http.get("/health", Duration::from_secs(5)).await {
                info!(engine = %self.label, secs = started.elapsed().as_secs_f64(), "vllm engine ready");
                return Ok(started.elapsed());
            }
            if started.elapsed() > timeout {
                return Err(EngineError::Start(format!(
                    "the vllm engine ({}) did not become ready within {} s",
                    self.label,
                    timeout.as_secs()
                )));
            }
            tokio::time::sleep(poll).await;
            poll = (poll * 2).min(Duration::from_millis(500));
        }
    }

    /// Kills the engine and every process it started, and waits for it.
    pub async fn kill(mut self) {
        self.kill_group();
        let _ = self.child.wait().await;
    }

    fn kill_group(&mut self) {
        if self.pgid > 0 {
            // SAFETY: plain syscall on the group this process created.
            unsafe { libc::killpg(self.pgid, libc::SIGKILL) };
        }
    }
}

impl Drop for EngineProcess {
    fn drop(&mut self) {
        self.kill_group();
    }
}

/// The extension's directory ahead of any `PYTHONPATH` the worker was given.
fn python_path(dir: &Path) -> std::ffi::OsString {
    let mut p = dir.as_os_str().to_os_string();
    if let Some(old) = std::env::var_os("PYTHONPATH").filter(|o| !o.is_empty()) {
        p.push(":");
        p.push(old);
    }
    p
}

/// Forwards the engine's output to the log, a line at a time, as it comes.
fn forward_lines<R: tokio::io::AsyncRead + Unpin + Send + 'static>(
    from: Option<R>,
    label: &str,
    recent: Recent,
) {
    let Some(from) = from else { return };
    let label = label.to_string();
    tokio::spawn(async move {
        let mut lines = BufReader::new(from).lines();
        loop {
            match lines.next_line().await {
                Ok(Some(line)) => {
                    info!(target: "vllm", engine = %label, "{line}");
                    let mut r = recent.lock().unwrap_or_else(|e| e.into_inner());
                    if r.len() == RECENT_LINES {
                        r.pop_front();
                    }
                    r.push_back(line);
                }
                Ok(None) => break,
                Err(e) => {
                    warn!(engine = %label, error = %e, "reading the engine's output");
                    break;
                }
            }
        }
    });
}

/// The interpreter of the vLLM environment: `COTRAIN_VLLM_PYTHON`, else the one `make setup` with
/// `COTRAIN_VLLM` recorded in the cache, else `None`.
pub fn find_python() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("COTRAIN_VLLM_PYTHON").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    let cache = cotrain_model::cache_dir()?;
    let recorded = std::fs::read_to_string(cache.join("vllm-python")).ok()?;
    let p = PathBuf::from(recorded.trim());
    p.is_file().then_some(p)
}
