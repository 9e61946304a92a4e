//! Starting one sandboxed process and supervising it: job and report pipes, capped output,
//! the wall-clock timeout, and killing everything when it fires.

use std::ffi::OsString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use super::rlimits::{ChildSetup, Rlimits};

/// Everything needed to start one run.
#[derive(Debug)]
pub struct Spawn {
    pub program: OsString,
    pub args: Vec<OsString>,
    /// Working directory on the host (insecure mode only; bwrap sets its own).
    pub cwd: Option<PathBuf>,
    /// Environment after clearing (insecure mode; bwrap gets `--clearenv` and `--setenv`).
    pub env: Vec<(&'static str, String)>,
    pub limits: Rlimits,
    pub drop_to_uid: Option<u32>,
    /// Written to fd 3 of the child.
    pub job: Vec<u8>,
    /// Fed to the child's stdin (closed when written); `None` gives it /dev/null.
    pub stdin: Option<Vec<u8>>,
    pub wall_timeout: Duration,
    pub max_output_bytes: usize,
}

/// How the run ended, as seen from outside.
#[derive(Debug)]
pub enum Ended {
    Exited(ExitStatus),
    /// The wall-clock limit fired; everything was killed.
    TimedOut,
    /// stdout or stderr went past the cap; everything was killed.
    OutputLimit,
}

/// Raw results of one run.
#[derive(Debug)]
pub struct Finished {
    pub ended: Ended,
    pub stdout: Vec<u8>,
    pub stdout_truncated: bool,
    pub stderr: Vec<u8>,
    pub stderr_truncated: bool,
    /// Everything the harness wrote on fd 4.
    pub report: Vec<u8>,
    pub wall: Duration,
}

/// The harness's report is small; anything this large is broken or hostile.
const MAX_REPORT_BYTES: usize = 8 << 20;

fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just created and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Reads up to `cap` bytes; reports (once) on `over` when more arrives, then stops reading.
async fn read_capped<R: AsyncRead + Unpin>(
    mut r: R,
    cap: usize,
    over: Option<mpsc::Sender<()>>,
) -> (Vec<u8>, bool) {
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        match r.read(&mut chunk).await {
            Ok(0) | Err(_) => return (buf, false),
            Ok(n) => {
                let room = cap - buf.len();
                if n > room {
                    buf.extend_from_slice(&chunk[..room]);
                    if let Some(tx) = over {
                        let _ = tx.try_send(());
                    }
                    return (buf, true);
                }
                buf.extend_from_slice(&chunk[..n]);
            }
        }
    }
}

fn kill_group(pgid: Option<u32>) {
    if let Some(pid) = pgid {
        // SAFETY: signalling a process group we created; ESRCH is fine.
        unsafe { libc::kill(-(pid as libc::pid_t), libc::SIGKILL) };
    }
}

/// Starts the process and supervises it to the end.
pub async fn run(spec: Spawn) -> std::io::Result<Finished> {
    let started = Instant::now();
    let (job_r, job_w) = pipe()?;
    let (report_r, report_w) = pipe()?;
    let setup = ChildSetup {
        limits: spec.limits,
        drop_to_uid: spec.drop_to_uid,
        fd_moves: [(job_r.as_raw_fd(), 3), (report_w.as_raw_fd(), 4)],
    };
    let mut cmd = tokio::process::Command::new(&spec.program);
    cmd.args(&spec.args)
        .env_clear()
        .envs(spec.env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(if spec.stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    if let Some(cwd) = &spec.cwd {
        cmd.current_dir(cwd);
    }
    // SAFETY: `apply` only makes raw syscalls, which is what is allowed between fork and exec.
    unsafe {
        cmd.pre_exec(move || setup.apply());
    }
    let mut child = cmd.spawn()?;
    // The child has its copies; holding ours would keep the pipes open forever.
    drop(job_r);
    drop(report_w);
    let pgid = child.id();

    let job_tx = tokio::net::unix::pipe::Sender::from_owned_fd(job_w)?;
    let job = spec.job;
    let job_task = tokio::spawn(async move {
        let mut tx = job_tx;
        let _ = tx.write_all(&job).await;
    });
    let stdin_task = match (child.stdin.take(), spec.stdin) {
        (Some(mut w), Some(data)) => Some(tokio::spawn(async move {
            let _ = w.write_all(&data).await;
        })),
        _ => None,
    };
    let (over_tx, mut over_rx) = mpsc::channel::<()>(2);
    let stdout = child.stdout.take().expect("stdout is piped");
    let stderr = child.stderr.take().expect("stderr is piped");
    let cap = spec.max_output_bytes;
    let out_task = tokio::spawn(read_capped(stdout, cap, Some(over_tx.clone())));
    let err_task = tokio::spawn(read_capped(stderr, cap, Some(over_tx)));
    let report_rx = tokio::net::unix::pipe::Receiver::from_owned_fd(report_r)?;
    let report_task = tokio::spawn(read_capped(report_rx, MAX_REPORT_BYTES, None));

    let ended = tokio::select! {
        status = child.wait() => Ended::Exited(status?),
        _ = tokio::time::sleep(spec.wall_timeout) => Ended::TimedOut,
        Some(()) = over_rx.recv() => Ended::OutputLimit,
    };
    if !matches!(ended, Ended::Exited(_)) {
        let _ = child.start_kill();
        let _ = child.wait().await;
    }
    // Whatever the program left behind in its group goes too (the PID namespace already took
    // care of that under bwrap).
    kill_group(pgid);
    job_task.abort();
    if let Some(t) = stdin_task {
        t.abort();
    }
    // The pipes close once every process holding them is dead; bound the wait all the same.
    let grace = Duration::from_secs(2);
    let (stdout, stdout_truncated) = join_or_empty(out_task, grace).await;
    let (stderr, stderr_truncated) = join_or_empty(err_task, grace).await;
    let (report, _) = join_or_empty(report_task, grace).await;
    Ok(Finished {
        ended,
        stdout,
        stdout_truncated,
        stderr,
        stderr_truncated,
        report,
        wall: started.elapsed(),
    })
}

async fn join_or_empty(
    task: tokio::task::JoinHandle<(Vec<u8>, bool)>,
    grace: Duration,
) -> (Vec<u8>, bool) {
    let abort = task.abort_handle();
    match tokio::time::timeout(grace, task).await {
        Ok(Ok(v)) => v,
        Ok(Err(_)) => (Vec::new(), false),
        Err(_) => {
            abort.abort();
            (Vec::new(), true)
        }
    }
}
