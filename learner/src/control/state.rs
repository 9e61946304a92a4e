//! What the control plane knows and asks: the run's progress (written by the trainer after every
//! step), the workers that registered, and pending checkpoint and stop requests.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use cotrain_rollout_client::pool::RolloutPool;
use tokio::sync::oneshot;
use tracing::{info, warn};

/// The trainer's report after a step.
#[derive(Clone, Debug, Default)]
pub struct StepReport {
    pub step: u64,
    pub total_steps: u64,
    pub epoch: u64,
    pub total_epochs: u64,
    pub reward: Option<f64>,
    /// Seconds the step took.
    pub step_secs: f64,
    /// `(worker agent, version)` of every policy the learner pushed.
    pub policy_versions: Vec<(String, u64)>,
}

/// The run's progress as the control plane reports it.
#[derive(Clone, Debug, Default)]
pub struct Progress {
    pub run_dir: Option<PathBuf>,
    pub state: &'static str,
    pub last: StepReport,
    /// Steps run by this process and their total time (for the ETA).
    pub steps_here: u64,
    pub secs_here: f64,
    pub last_checkpoint_step: Option<u64>,
}

impl Progress {
    /// Seconds to the end of the run at this process's mean step time.
    pub fn eta_secs(&self) -> Option<f64> {
        (self.steps_here > 0).then(|| {
            self.secs_here / self.steps_here as f64
                * self.last.total_steps.saturating_sub(self.last.step) as f64
        })
    }
}

/// What the trainer must do at the end of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Requests {
    pub checkpoint: bool,
    pub stop: bool,
}

impl Requests {
    /// Packed for a broadcast to the other learner ranks.
    pub fn to_bits(self) -> u64 {
        u64::from(self.checkpoint) | (u64::from(self.stop) << 1)
    }

    pub fn from_bits(b: u64) -> Self {
        Self {
            checkpoint: b & 1 != 0,
            stop: b & 2 != 0,
        }
    }
}

/// A written checkpoint's step and directory, or why none was written.
pub type CheckpointOutcome = Result<(u64, PathBuf), String>;
type CheckpointReply = oneshot::Sender<CheckpointOutcome>;

/// The most workers that may be registered at once: each is a pool member with its own health
/// checks, connections and metric series, so the registry is bounded.
pub const MAX_REGISTERED: usize = 1024;

/// See the module docs; shared by the trainer, the control server and the signal handler.
pub struct ControlState {
    started: Instant,
    progress: Mutex<Progress>,
    stop: AtomicBool,
    stop_reason: Mutex<Option<String>>,
    checkpoint_waiters: Mutex<Vec<CheckpointReply>>,
    /// Set by a trainer that reads requests between steps (signals wait for it).
    listening: AtomicBool,
    /// Registered workers and their last heartbeat.
    registered: Mutex<HashMap<String, Instant>>,
    pool: OnceLock<Arc<RolloutPool>>,
    /// How often registered workers heartbeat; three missed intervals drop one.
    pub heartbeat: Duration,
}

impl Default for ControlState {
    fn default() -> Self {
        Self::new()
    }
}

impl ControlState {
    pub fn new() -> Self {
        Self {
            started: Instant::now(),
            progress: Mutex::new(Progress {
                state: "starting",
                ..Progress::default()
            }),
            stop: AtomicBool::new(false),
            stop_reason: Mutex::new(None),
            checkpoint_waiters: Mutex::new(Vec::new()),
            listening: AtomicBool::new(false),
            registered: Mutex::new(HashMap::new()),
            pool: OnceLock::new(),
            heartbeat: Duration::from_secs(2),
        }
    }

    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    pub fn progress(&self) -> Progress {
        self.progress.lock().expect("control lock").clone()
    }

    pub fn set_state(&self, state: &'static str) {
        self.progress.lock().expect("control lock").state = state;
    }

    pub fn set_run_dir(&self, dir: PathBuf) {
        self.progress.lock().expect("control lock").run_dir = Some(dir);
    }

    /// A trainer reads requests between its steps from now on (until [`Self::trainer_done`]).
    pub fn trainer_started(&self) {
        self.listening.store(true, Ordering::SeqCst);
        self.set_state("training");
    }

    /// The trainer returned (`state`: `finished`, `stopped` or `failed`); pending checkpoint
    /// requests get an error.
    pub fn trainer_done(&self, state: &'static str) {
        self.listening.store(false, Ordering::SeqCst);
        self.set_state(state);
        for w in self
            .checkpoint_waiters
            .lock()
            .expect("control lock")
            .drain(..)
        {
            let _ = w.send(Err(format!("the run is {state}")));
        }
    }

    pub fn trainer_listening(&self) -> bool {
        self.listening.load(Ordering::SeqCst)
    }

    /// Asks the trainer to checkpoint at the end of its current step and exit.
    pub fn request_stop(&self, reason: &str) {
        *self.stop_reason.lock().expect("control lock") = Some(reason.to_string());
        self.stop.store(true, Ordering::SeqCst);
        self.set_state("stopping");
    }

    pub fn stop_requested(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    pub fn stop_reason(&self) -> Option<String> {
        self.stop_reason.lock().expect("control lock").clone()
    }

    /// Asks for a checkpoint at the end of the current step; the receiver gets its step and path.
    pub fn request_checkpoint(&self) -> Result<oneshot::Receiver<CheckpointOutcome>, String> {
        if !self.trainer_listening() {
            return Err(format!(
                "no checkpoint can be written now: the run is {}",
                self.progress().state
            ));
        }
        let (tx, rx) = oneshot::channel();
        self.checkpoint_waiters
            .lock()
            .expect("control lock")
            .push(tx);
        Ok(rx)
    }

    /// Called by the trainer after each step: records its report and returns what was asked.
    pub fn between_steps(&self, report: StepReport) -> Requests {
        let mut p = self.progress.lock().expect("control lock");
        p.steps_here += 1;
        p.secs_here += report.step_secs;
        p.last = report;
        drop(p);
        Requests {
            checkpoint: !self
                .checkpoint_waiters
                .lock()
                .expect("control lock")
                .is_empty(),
            stop: self.stop_requested(),
        }
    }

    /// The trainer wrote a checkpoint (requested or scheduled): answers every waiting request.
    pub fn checkpoint_written(&self, step: u64, path: &std::path::Path) {
        self.progress
            .lock()
            .expect("control lock")
            .last_checkpoint_step = Some(step);
        for w in self
            .checkpoint_waiters
            .lock()
            .expect("control lock")
            .drain(..)
        {
            let _ = w.send(Ok((step, path.to_path_buf())));
        }
    }

    /// A checkpoint requested through the control plane failed.
    pub fn checkpoint_failed(&self, why: &str) {
        for w in self
            .checkpoint_waiters
            .lock()
            .expect("control lock")
            .drain(..)
        {
            let _ = w.send(Err(why.to_string()));
        }
    }

    /// The pool registered workers join; those that registered before it existed are added now.
    pub async fn attach_pool(&self, pool: Arc<RolloutPool>) {
        if self.pool.set(pool.clone()).is_err() {
            return;
        }
        let early: Vec<String> = self
            .registered
            .lock()
            .expect("control lock")
            .keys()
            .cloned()
            .collect();
        for address in early {
            if let Err(e) = pool.add_endpoint(&address).await {
                warn!(worker = address, error = %e, "registered worker cannot join the pool");
            }
        }
    }

    pub fn pool(&self) -> Option<&Arc<RolloutPool>> {
        self.pool.get()
    }

    /// A worker registers (again): it joins the pool, which brings it to the current policy
    /// first; returns whether it is in rotation.
    pub async fn register(&self, address: &str) -> Result<bool, String> {
        let address = normalise(address)?;
        let new = {
            let mut registered = self.registered.lock().expect("control lock");
            if !registered.contains_key(&address) && registered.len() >= MAX_REGISTERED {
                return Err(format!(
                    "this learner already has {MAX_REGISTERED} registered workers, its bound; {address} is refused until one leaves \
                     or misses its heartbeats"
                ));
            }
            registered.insert(address.clone(), Instant::now()).is_none()
        };
        if new {
            info!(worker = address, "rollout worker registered");
        }
        match self.pool.get() {
            Some(pool) => pool.add_endpoint(&address).await.map_err(|e| e.to_string()),
            None => Ok(false),
        }
    }

    /// Whether the worker is registered; refreshes its heartbeat.
    pub fn heartbeat(&self, address: &str) -> bool {
        let Ok(address) = normalise(address) else {
            return false;
        };
        match self
            .registered
            .lock()
            .expect("control lock")
            .get_mut(&address)
        {
            Some(t) => {
                *t = Instant::now();
                true
            }
            None => false,
        }
    }

    /// A worker leaves: out of the registry and the pool (requests in flight finish or fail over).
    pub fn deregister(&self, address: &str) -> bool {
        let Ok(address) = normalise(address) else {
            return false;
        };
        let known = self
            .registered
            .lock()
            .expect("control lock")
            .remove(&address)
            .is_some();
        if known {
            info!(worker = address, "rollout worker deregistered");
            if let Some(pool) = self.pool.get() {
                pool.remove_endpoint(&address);
            }
        }
        known
    }

    /// Drops registered workers that missed three heartbeats.
    pub fn reap(&self) {
        let limit = self.heartbeat * 3;
        let gone: Vec<String> = {
            let mut r = self.registered.lock().expect("control lock");
            let gone: Vec<String> = r
                .iter()
                .filter(|(_, t)| t.elapsed() > limit)
                .map(|(a, _)| a.clone())
                .collect();
            for a in &gone {
                r.remove(a);
            }
            gone
        };
        for a in gone {
            warn!(
                worker = a,
                "registered rollout worker missed its heartbeats, dropped"
            );
            if let Some(pool) = self.pool.get() {
                pool.remove_endpoint(&a);
            }
        }
    }

    pub fn registered(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .registered
            .lock()
            .expect("control lock")
            .keys()
            .cloned()
            .collect();
        v.sort();
        v
    }
}

/// `host:port` or `http://host:port` as the pool names it; anything else is refused.
fn normalise(address: &str) -> Result<String, String> {
    let a = address.trim();
    let rest = a.strip_prefix("http://").unwrap_or(a);
    let ok = rest
        .rsplit_once(':')
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p != 0));
    if !ok || rest.contains('/') {
        return Err(format!(
            "worker address `{address}` is not host:port (or http://host:port) with a non-zero port"
        ));
    }
    Ok(format!("http://{rest}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_checked_and_normalised() {
        assert_eq!(
            normalise("10.0.0.7:50061").unwrap(),
            "http://10.0.0.7:50061"
        );
        assert_eq!(normalise("http://[::1]:1").unwrap(), "http://[::1]:1");
        for bad in ["", "host", "host:0", "host:x", "http://h:1/path", ":5"] {
            assert!(normalise(bad).is_err(), "{bad}");
        }
    }

    /// Registration is bounded: past MAX_REGISTERED a new address is refused by name, a known one
    /// may register again, and a departure makes room.
    #[test]
    fn the_registry_is_bounded() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let s = ControlState::new();
        rt.block_on(async {
            for i in 0..MAX_REGISTERED {
                assert_eq!(
                    s.register(&format!("10.0.{}.{}:5000", i / 250, i % 250 + 1))
                        .await,
                    Ok(false)
                );
            }
            let e = s.register("10.9.9.9:5000").await.unwrap_err();
            assert!(
                e.contains("1024 registered workers") && e.contains("10.9.9.9"),
                "{e}"
            );
            assert_eq!(
                s.register("10.0.0.1:5000").await,
                Ok(false),
                "a registered worker re-registers"
            );
            assert!(s.deregister("10.0.0.1:5000"));
            assert_eq!(s.register("10.9.9.9:5000").await, Ok(false));
        });
    }

    #[test]
    fn requests_round_trip_and_checkpoints_answer_waiters() {
        for r in [
            Requests::default(),
            Requests {
                checkpoint: true,
                stop: false,
            },
            Requests {
                checkpoint: true,
                stop: true,
            },
        ] {
            assert_eq!(Requests::from_bits(r.to_bits()), r);
        }
        let s = ControlState::new();
        assert!(s.request_checkpoint().is_err(), "no trainer yet");
        s.trainer_started();
        let mut rx = s.request_checkpoint().unwrap();
        let asked = s.between_steps(StepReport {
            step: 3,
            total_steps: 10,
            step_secs: 2.0,
            ..StepReport::default()
        });
        assert_eq!(
            asked,
            Requests {
                checkpoint: true,
                stop: false
            }
        );
        s.checkpoint_written(3, std::path::Path::new("/runs/x/checkpoints/step-3"));
        assert_eq!(rx.try_recv().unwrap().unwrap().0, 3);
        assert_eq!(s.progress().eta_secs(), Some(14.0));
        s.request_stop("test");
        assert!(s.between_steps(StepReport::default()).stop);
        assert_eq!(s.progress().state, "stopping");
    }

    #[test]
    fn workers_that_miss_heartbeats_are_reaped() {
        let s = ControlState {
            heartbeat: Duration::from_millis(10),
            ..ControlState::new()
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        assert!(!rt.block_on(s.register("127.0.0.1:7")).unwrap());
        assert!(s.heartbeat("http://127.0.0.1:7"));
        std::thread::sleep(Duration::from_millis(40));
        s.reap();
        assert!(!s.heartbeat("127.0.0.1:7"));
        assert!(rt.block_on(s.register("bad")).is_err());
    }
}
