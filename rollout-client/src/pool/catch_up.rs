//! Catch-up: bringing a worker that joined, came back or fell behind to the current version of
//! every agent by replaying the kept updates (see [`super::replay`]) to it alone, then putting it in
//! rotation.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cotrain_proto::refusal::{self, Refusal};
use tracing::{info, warn};

use super::Inner;
use super::member::Worker;
use super::replay::Body;

impl Inner {
    /// Brings `w` to the latest version of every agent it serves and puts it in rotation; on
    /// failure it stays out and is retried after its backoff.
    pub(super) async fn catch_up(self: Arc<Self>, w: Arc<Worker>) {
        if w.catching_up.swap(true, Ordering::SeqCst) {
            return;
        }
        // Cleared however this ends, a dropped future included.
        struct Running<'a>(&'a AtomicBool);
        impl Drop for Running<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::SeqCst);
            }
        }
        let _running = Running(&w.catching_up);
        let result = self.replay_to(&w).await;
        match result {
            Ok(replayed) => {
                w.backoff.lock().expect("backoff lock").reset();
                *w.catch_up_error.lock().expect("worker lock") = None;
                if replayed > 0 {
                    w.catch_ups.fetch_add(1, Ordering::SeqCst);
                    self.catch_ups.fetch_add(1, Ordering::SeqCst);
                }
                if !w.in_rotation.swap(true, Ordering::SeqCst) {
                    info!(worker = %w.address, replayed, "rollout worker at the current policy, in rotation");
                }
                self.changed.notify_waiters();
            }
            Err(why) => {
                let wait = w
                    .backoff
                    .lock()
                    .expect("backoff lock")
                    .fail(self.cfg.health_interval, self.cfg.max_backoff);
                warn!(worker = %w.address, why, retry_in = ?wait, "cannot bring rollout worker to the current policy");
                *w.catch_up_error.lock().expect("worker lock") = Some(why);
            }
        }
    }

    /// Replays the kept updates `w` is behind on; returns how many. Goes round again when a push
    /// recorded a newer update meanwhile.
    async fn replay_to(&self, w: &Worker) -> Result<usize, String> {
        let mut replayed = 0;
        for _round in 0..5 {
            let generation = self.replay.generation();
            let latest = self.replay.all();
            let (_, info) = self.info(w).await;
            let info = info.map_err(|s| format!("Info failed: {}", s.message()))?;
            *w.agents.lock().expect("worker lock") =
                Some(info.agents.iter().map(|a| a.name.clone()).collect());
            if latest.is_empty() && self.expected.lock().expect("pool lock").is_empty() {
                return Ok(replayed);
            }
            // Agents the pool updates separately must have weights of their own on the worker: a
            // shared model would take the second agent's push as "not newer" and serve the first's.
            let pushed: HashSet<&str> = latest.iter().map(|l| l.header.agent.as_str()).collect();
            for m in info.models.iter().filter(|m| !m.unmerged_adapters) {
                let shared: Vec<&String> = m
                    .agents
                    .iter()
                    .filter(|a| pushed.contains(a.as_str()))
                    .collect();
                if shared.len() > 1 {
                    return Err(format!(
                        "it serves {shared:?} from one shared model (--share), but they are updated separately"
                    ));
                }
            }
            // Versions requests have asked for that this pool has nothing to replay for (another
            // learner rank pushes them): the worker waits until it has them.
            for (agent, &want) in self.expected.lock().expect("pool lock").iter() {
                let served = info
                    .agents
                    .iter()
                    .find(|a| &a.name == agent)
                    .map(|a| a.policy_version);
                if !pushed.contains(agent.as_str()) && served.is_some_and(|v| v < want) {
                    return Err(format!(
                        "`{agent}` is at v{} and requests need v{want}, which this pool does not hold",
                        served.unwrap_or(0)
                    ));
                }
            }
            for l in latest {
                let Some(served) = info
                    .agents
                    .iter()
                    .find(|a| a.name == l.header.agent)
                    .map(|a| a.policy_version)
                else {
                    continue;
                };
                // A worker with weights newer than any this pool pushed was updated by someone else:
                // it is not at this pool's policy.
                let pushed = self
                    .replay
                    .announced(&l.header.agent)
                    .unwrap_or(l.header.version)
                    .max(l.header.version);
                if served > pushed {
                    return Err(format!(
                        "it serves `{}` v{served}, newer than this pool's v{pushed}: another learner updates it",
                        l.header.agent
                    ));
                }
                if served >= l.header.version {
                    continue;
                }
                let (_, answer) = match &l.body {
                    Body::File(file) => self.send_file(w, &l.header, file.clone()).await,
                    Body::Lost(why) => {
                        return Err(format!(
                            "`{}` v{} was not kept: {why}",
                            l.header.agent, l.header.version
                        ));
                    }
                    Body::Shm(shm) => {
                        let lock = self.replay.lock(&l.header.agent);
                        let _reading = lock.lock().await;
                        self.send_shm(w, &l.header, shm).await
                    }
                };
                match answer {
                    Ok(_) => replayed += 1,
                    // A push of a newer version reached the worker meanwhile: fine, go round again.
                    Err(s)
                        if Refusal::of(&s) == Some(Refusal::VersionNotNewer)
                            && refusal::current_version(&s).is_some_and(|v| {
                                v >= l.header.version
                                    && v <= self.replay.announced(&l.header.agent).unwrap_or(v)
                            }) => {}
                    Err(s) => {
                        return Err(format!(
                            "replaying `{}` v{}: {}",
                            l.header.agent,
                            l.header.version,
                            s.message()
                        ));
                    }
                }
            }
            if self.replay.generation() == generation {
                return Ok(replayed);
            }
        }
        Err("updates kept arriving while catching up".into())
    }
}
