//! The shared-memory transport: one `/dev/shm` file per agent, rewritten in place for every push
//! and named to the workers on this host, one agent at a time or every agent together.

use std::collections::{BTreeMap, HashSet};

use cotrain_proto::rollout as pb;
use cotrain_rollout_client::shm::ShmFile;
use cotrain_rollout_client::wire::WireDType;
use tch::Tensor;
use tracing::{debug, warn};

use super::wire_tensor;
use crate::error::TrainError;
use crate::services::pool_source::PoolRollout;
use crate::sources::WeightPush;

impl PoolRollout {
    /// Writes the parameters (or an adapter, with `lora_scaling`) into the agent's /dev/shm file
    /// (created on the first push, overwritten after) and names it to every healthy worker. On
    /// failure, returns the workers that took the update anyway with the error, and drops the file.
    pub(super) fn push_shm(
        &mut self,
        agent: &str,
        version: u64,
        params: &BTreeMap<String, Tensor>,
        lora_scaling: Option<f64>,
    ) -> Result<(), (HashSet<String>, String)> {
        let started = std::time::Instant::now();
        // Workers catching up read this agent's file: rewrite it only while holding its lock.
        let lock = self.pool.shm_lock(agent);
        let _writing = self.rt.block_on(lock.lock());
        let mut file = self
            .take_shm_file(agent, version)
            .map_err(|e| (HashSet::new(), e))?;
        fill_shm(&mut file, params, self.wire).map_err(|e| {
            (
                HashSet::new(),
                format!("writing the shared-memory file: {e}"),
            )
        })?;
        let written = started.elapsed();
        let message = file.message();
        self.shm_files.insert(agent.to_string(), file);
        let answers = self.rt.block_on(
            self.pool
                .push_update_shm(self.update_header(agent, version, lora_scaling), &message),
        );
        debug!(
            agent,
            version,
            write_secs = written.as_secs_f64(),
            total_secs = started.elapsed().as_secs_f64(),
            "weights pushed through shared memory"
        );
        self.settle_shm_answers(agent, answers)
    }
    /// The agent's shared-memory file, taken out of [`Self::shm_files`] (the caller puts it back
    /// once written; a file that failed is dropped, which unlinks it): the one of its last push,
    /// or a new one.
    pub(super) fn take_shm_file(&mut self, agent: &str, version: u64) -> Result<ShmFile, String> {
        match self.shm_files.remove(agent) {
            Some(file) => Ok(file),
            None => ShmFile::create(agent, version)
                .map_err(|e| format!("creating the shared-memory file: {e}")),
        }
    }
    /// Counts a shared-memory push every worker took; otherwise drops the agent's file and returns
    /// the workers that took it anyway with every refusal. A worker that failed (or timed out) may
    /// still be reading: the next push gets a fresh file, and this one is only unlinked, which open
    /// readers do not notice.
    pub(super) fn settle_shm_answers(
        &mut self,
        agent: &str,
        answers: Vec<(String, Result<pb::UpdateWeightsResponse, tonic::Status>)>,
    ) -> Result<(), (HashSet<String>, String)> {
        if answers.is_empty() {
            self.shm_files.remove(agent);
            return Err((HashSet::new(), "no healthy worker".to_string()));
        }
        let mut accepted = HashSet::new();
        let mut refused = Vec::new();
        for (worker, answer) in answers {
            match answer {
                Ok(_) => {
                    accepted.insert(worker);
                }
                Err(status) => refused.push(format!("{worker}: {status}")),
            }
        }
        if refused.is_empty() {
            self.shm_pushes += 1;
            Ok(())
        } else {
            self.shm_files.remove(agent);
            Err((accepted, refused.join("; ")))
        }
    }
    /// [`RolloutSource::push_weights_all`] through shared memory: the agents' files are written at
    /// the same time (one thread each: the copy is the learner's share of a push), the updates
    /// announced at the same time (each worker swaps each model on that model's own thread), and
    /// the versions awaited together. An agent whose file could not be written, or whose update a
    /// worker refused, takes the one-agent path afterwards ([`Self::push`]), with its fallbacks.
    pub(in crate::services::pool_source) fn push_all_shm(
        &mut self,
        updates: &[WeightPush<'_>],
    ) -> Result<(), TrainError> {
        let started = std::time::Instant::now();
        let locks: Vec<_> = updates
            .iter()
            .map(|u| self.pool.shm_lock(u.agent))
            .collect();
        let guards: Vec<_> = locks.iter().map(|l| self.rt.block_on(l.lock())).collect();
        // Each thread owns its agent's file and handles on the parameters (the same storage).
        let mut jobs = Vec::new();
        let mut retry: Vec<usize> = Vec::new();
        for (i, u) in updates.iter().enumerate() {
            match self.take_shm_file(u.agent, u.version) {
                Ok(file) => {
                    let params: BTreeMap<String, Tensor> = u
                        .params
                        .iter()
                        .map(|(k, t)| (k.clone(), t.shallow_clone()))
                        .collect();
                    jobs.push((i, file, params));
                }
                Err(e) => {
                    warn!(agent = u.agent, error = e, "pushing this agent alone");
                    retry.push(i);
                }
            }
        }
        let wire = self.wire;
        let written: Vec<(usize, ShmFile, std::io::Result<()>)> = std::thread::scope(|s| {
            let handles: Vec<_> = jobs
                .into_iter()
                .map(|(i, mut file, params)| {
                    s.spawn(move || {
                        let r = fill_shm(&mut file, &params, wire);
                        (i, file, r)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a shared-memory writer panicked"))
                .collect()
        });
        let mut announced = Vec::new();
        for (i, file, r) in written {
            match r {
                Ok(()) => {
                    announced.push((i, file.message()));
                    self.shm_files.insert(updates[i].agent.to_string(), file);
                }
                Err(e) => {
                    warn!(agent = updates[i].agent, error = %e, "writing the shared-memory file failed; pushing this agent alone");
                    retry.push(i);
                }
            }
        }
        let write_secs = started.elapsed().as_secs_f64();
        let pool = self.pool.clone();
        let answers = self
            .rt
            .block_on(futures::future::join_all(announced.iter().map(
                |(i, message)| {
                    pool.push_update_shm(
                        self.update_header(updates[*i].agent, updates[*i].version, None),
                        message,
                    )
                },
            )));
        drop(guards);
        debug!(
            agents = updates.len(),
            write_secs,
            total_secs = started.elapsed().as_secs_f64(),
            "weights pushed through shared memory together"
        );
        let mut waits = Vec::new();
        for ((i, _), answers) in announced.iter().zip(answers) {
            match self.settle_shm_answers(updates[*i].agent, answers) {
                Ok(()) => waits.push(*i),
                Err((_, refused)) => {
                    warn!(
                        agent = updates[*i].agent,
                        refused,
                        "shared-memory update not taken everywhere; pushing this agent alone"
                    );
                    retry.push(*i);
                }
            }
        }
        let timeout = self.version_timeout;
        let waited =
            self.rt
                .block_on(futures::future::join_all(waits.iter().map(|&i| {
                    pool.wait_for_version(updates[i].agent, updates[i].version, timeout)
                })));
        for r in waited {
            r.map_err(|e| TrainError::Rollout(e.to_string()))?;
        }
        retry.sort_unstable();
        for i in retry {
            let u = &updates[i];
            self.push(u.agent, u.version, u.params, None)?;
        }
        Ok(())
    }
}

/// Overwrites `file` with the parameters in the wire's element type, straight from the tensors' memory.
fn fill_shm(
    file: &mut ShmFile,
    params: &BTreeMap<String, Tensor>,
    wire: WireDType,
) -> std::io::Result<()> {
    file.rewind()?;
    for (name, t) in params {
        let t = wire_tensor(t, wire);
        let len = t.numel() * wire.size();
        let bytes: &[u8] = if len == 0 {
            &[]
        } else {
            // SAFETY: `t` is a contiguous CPU tensor of `wire`'s element type that outlives
            // `bytes`; its data pointer points at its first element and `numel * size` bytes follow.
            unsafe { std::slice::from_raw_parts(t.data_ptr() as *const u8, len) }
        };
        file.write_tensor(name, wire, &t.size(), bytes)?;
    }
    file.finish()
}
