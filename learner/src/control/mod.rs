//! The learner's control plane (`learner.control_addr`): one port serving gRPC
//! (`cotrain.control.v1.LearnerControl`) and HTTP (`/status`, `/checkpoint`, `/stop`, `/metrics`,
//! `/healthz`).
//!
//! - Rollout workers started with `--register URL` register, heartbeat and deregister here; the
//!   learner adds them to its pool, which brings them to the current policy before they get
//!   requests ([`state::ControlState::register`]).
//! - Operators ask for the run's status (`learner status --addr`), a checkpoint now, or a graceful
//!   stop (checkpoint, then a clean exit); SIGTERM and SIGINT ask for the same stop.
//!
//! When the learner has a cluster token, every call but `/metrics` and `/healthz` must carry it.
//! The trainer reads the requests between steps ([`state::ControlState::between_steps`]).

pub mod client;
pub mod server;
pub mod state;

use std::sync::{Arc, OnceLock};

pub use server::ControlServer;
pub use state::{ControlState, StepReport};

static CURRENT: OnceLock<Arc<ControlState>> = OnceLock::new();

/// Makes this process's control state (one learner process runs one job); the `train` command
/// calls it before training, and only then does a run listen on `learner.control_addr` and react
/// to SIGTERM. Later calls return the same state.
pub fn install() -> Arc<ControlState> {
    CURRENT
        .get_or_init(|| Arc::new(ControlState::new()))
        .clone()
}

/// The state [`install`] made, if any.
pub fn current() -> Option<Arc<ControlState>> {
    CURRENT.get().cloned()
}

/// Turns the first SIGTERM or SIGINT into a graceful stop (a checkpoint at the end of the current
/// step, then a clean exit) when a trainer is listening for it, and exits at once otherwise or on
/// a second signal. For binaries: call once, from `main`'s thread, before the runtime starts.
pub fn handle_signals(state: Arc<ControlState>) -> std::io::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()?;
    std::thread::Builder::new().name("cotrain-signals".into()).spawn(move || {
        rt.block_on(async move {
            use tokio::signal::unix::{SignalKind, signal};
            let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
                tracing::warn!("cannot listen for SIGTERM/SIGINT; they stop the learner at once");
                return;
            };
            let mut count = 0;
            loop {
                let name = tokio::select! {
                    _ = term.recv() => "SIGTERM",
                    _ = int.recv() => "SIGINT",
                };
                count += 1;
                if count > 1 || !state.trainer_listening() {
                    eprintln!("{name}: exiting now");
                    std::process::exit(if name == "SIGTERM" { 143 } else { 130 });
                }
                tracing::warn!(signal = name, "stopping after the current step with a checkpoint (send it again to exit at once)");
                state.request_stop(name);
            }
        })
    })?;
    Ok(())
}
