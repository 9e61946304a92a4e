//! `learner.collective_timeout_secs`: a collective that never completes (a rank died or hangs, or
//! the ranks' network is wrong, e.g. Open MPI over a Docker bridge) would otherwise hang the whole
//! job for ever, every rank spinning in the library. [`Watched`] times every collective of its
//! inner backend; a watchdog thread stops the process with a message naming this rank, the call and
//! how long it waited. The launcher (mpirun, srun, torchrun) then stops the other ranks.

use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use tch::{Device, Tensor};

use super::{Collective, DistError};

/// The call in progress: what it is and since when.
type InFlight = Mutex<Option<(String, Instant)>>;

/// A collective whose every call must finish within `timeout` (see the module docs).
pub struct Watched {
    inner: Box<dyn Collective>,
    in_flight: Arc<InFlight>,
}

impl Watched {
    /// Wraps `inner` and starts its watchdog thread (which ends with the wrapper).
    pub fn new(inner: Box<dyn Collective>, timeout: Duration) -> Self {
        let in_flight: Arc<InFlight> = Arc::new(Mutex::new(None));
        let watched = Arc::downgrade(&in_flight);
        let (rank, world, backend) = (inner.rank(), inner.world(), inner.backend());
        std::thread::Builder::new()
            .name("collective-watchdog".into())
            .spawn(move || watch(watched, timeout, rank, world, backend))
            .expect("spawning the collective watchdog");
        Self { inner, in_flight }
    }

    fn timed<T>(&self, what: String, call: impl FnOnce(&dyn Collective) -> T) -> T {
        *self.in_flight.lock().unwrap_or_else(|p| p.into_inner()) = Some((what, Instant::now()));
        let out = call(self.inner.as_ref());
        *self.in_flight.lock().unwrap_or_else(|p| p.into_inner()) = None;
        out
    }
}

fn watch(in_flight: Weak<InFlight>, timeout: Duration, rank: usize, world: usize, backend: &str) {
    let tick = (timeout / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
    while let Some(slot) = in_flight.upgrade() {
        let late = slot
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .filter(|(_, since)| since.elapsed() >= timeout)
            .map(|(w, s)| (w.clone(), s.elapsed()));
        drop(slot);
        if let Some((what, waited)) = late {
            let msg = format!(
                "learner rank {rank} of {world} ({backend}): {what} did not complete after {:.0} s (learner.collective_timeout_secs \
                 {}): another rank died, hangs or is still busy, or the ranks cannot reach each other (pin their network with \
                 `learner launch --network-interface IF`); stopping this rank",
                waited.as_secs_f64(),
                timeout.as_secs()
            );
            tracing::error!("{msg}");
            eprintln!("error: {msg}");
            // Not `exit`: it runs destructors and atexit handlers, which may wait on the very
            // collective that hangs (MPI's finalisation, NCCL's communicator teardown).
            // SAFETY: `_exit` ends the process at once; nothing after it runs.
            unsafe { libc::_exit(75) };
        }
        std::thread::sleep(tick);
    }
}

impl Collective for Watched {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world(&self) -> usize {
        self.inner.world()
    }
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn device(&self) -> Device {
        self.inner.device()
    }
    fn all_reduce_sum(&self, t: &mut Tensor) -> Result<(), DistError> {
        self.timed(format!("an all-reduce of {} elements", t.numel()), |c| {
            c.all_reduce_sum(t)
        })
    }
    fn broadcast(&self, t: &mut Tensor, root: usize) -> Result<(), DistError> {
        self.timed(
            format!("a broadcast of {} elements from rank {root}", t.numel()),
            |c| c.broadcast(t, root),
        )
    }
    fn all_gather(&self, t: &Tensor) -> Result<Tensor, DistError> {
        self.timed(format!("an all-gather of {} elements", t.numel()), |c| {
            c.all_gather(t)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A backend whose all-reduce never returns, as a rank waiting for a dead peer.
    struct Stuck;
    impl Collective for Stuck {
        fn rank(&self) -> usize {
            1
        }
        fn world(&self) -> usize {
            2
        }
        fn backend(&self) -> &'static str {
            "stuck"
        }
        fn device(&self) -> Device {
            Device::Cpu
        }
        fn all_reduce_sum(&self, _: &mut Tensor) -> Result<(), DistError> {
            loop {
                std::thread::sleep(Duration::from_secs(60));
            }
        }
        fn broadcast(&self, _: &mut Tensor, _: usize) -> Result<(), DistError> {
            Ok(())
        }
        fn all_gather(&self, t: &Tensor) -> Result<Tensor, DistError> {
            Ok(t.unsqueeze(0))
        }
    }

    /// Run in a child process (the watchdog exits the process): a hung all-reduce stops the rank
    /// with a message naming it, the call and the key; a quick call passes untouched.
    #[test]
    fn a_collective_that_never_completes_stops_the_rank_by_name() {
        if std::env::var_os("COTRAIN_WATCHDOG_CHILD").is_some() {
            let w = Watched::new(Box::new(Stuck), Duration::from_millis(300));
            let mut t = Tensor::zeros([3], (tch::Kind::Float, Device::Cpu));
            w.broadcast(&mut t, 0).unwrap();
            let _ = w.all_reduce_sum(&mut t);
            unreachable!("the watchdog stops the process");
        }
        let exe = std::env::current_exe().unwrap();
        let out = std::process::Command::new(exe)
            .args([
                "--exact",
                "dist::watchdog::tests::a_collective_that_never_completes_stops_the_rank_by_name",
                "--nocapture",
            ])
            .env("COTRAIN_WATCHDOG_CHILD", "1")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(75), "{err}");
        assert!(
            err.contains(
                "learner rank 1 of 2 (stuck): an all-reduce of 3 elements did not complete"
            ) && err.contains("collective_timeout_secs"),
            "{err}"
        );
    }
}
