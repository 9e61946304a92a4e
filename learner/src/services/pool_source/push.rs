//! Weight pushes to the pool's workers: gRPC chunks to every healthy worker, or one shared-memory
//! file per agent for the workers on this host that accept it (`rollout.weight_transport`), with
//! `auto` falling back to gRPC for good once shared memory fails; a LoRA adapter is a partial
//! update whose header carries its scaling.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use cotrain_proto::rollout as pb;
use cotrain_rollout_client::shm::ShmFile;
use cotrain_rollout_client::wire::{UpdatedTensor, WireDType};
use tch::Tensor;
use tracing::{debug, warn};

use super::PoolRollout;
use crate::config::WeightTransport;
use crate::error::TrainError;
use crate::sources::{PushStats, WeightPush};

impl PoolRollout {
    /// Pushes as gRPC chunks to every healthy worker not in `skip`; `lora_scaling` is set for an
    /// adapter (see [`update_header`]).
    fn push_grpc(
        &self,
        agent: &str,
        version: u64,
        params: &BTreeMap<String, Tensor>,
        lora_scaling: Option<f64>,
        skip: &HashSet<String>,
    ) -> Result<(), TrainError> {
        let tensors = Arc::new(wire_tensors(params, self.wire));
        let header = self.update_header(agent, version, lora_scaling);
        let answers = self
            .rt
            .block_on(self.pool.push_update_except(header, tensors, skip));
        if answers.is_empty() && skip.is_empty() {
            // The pool keeps the update: workers that join get it before any request.
            warn!(
                agent,
                version,
                "no healthy rollout worker to push to; the update waits for the next worker that joins"
            );
            return Ok(());
        }
        // Workers that refused are out of rotation until the pool catches them up.
        let what = update_kind(lora_scaling);
        let refused = settle_grpc_push(&answers, !skip.is_empty()).map_err(|refusals| {
            TrainError::Rollout(format!(
                "{what} of `{agent}` to v{version} refused by every worker: {refusals}"
            ))
        })?;
        for r in refused {
            warn!(
                refusal = r,
                "{what} of `{agent}` to v{version} refused; that worker is out of rotation until it catches up"
            );
        }
        Ok(())
    }

    /// Writes the parameters (or an adapter, with `lora_scaling`) into the agent's /dev/shm file
    /// (created on the first push, overwritten after) and names it to every healthy worker. On
    /// failure, returns the workers that took the update anyway with the error, and drops the file.
    fn push_shm(
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
    fn take_shm_file(&mut self, agent: &str, version: u64) -> Result<ShmFile, String> {
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
    fn settle_shm_answers(
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

    /// Sends the parameters (or an adapter, with `lora_scaling`) by the configured transport, falling
    /// back from shared memory to gRPC under `auto`, and waits until every worker serves `version`.
    pub(super) fn push(
        &mut self,
        agent: &str,
        version: u64,
        params: &BTreeMap<String, Tensor>,
        lora_scaling: Option<f64>,
    ) -> Result<(), TrainError> {
        let started = std::time::Instant::now();
        self.push_once(agent, version, params, lora_scaling)?;
        let bytes: u64 = params
            .values()
            .map(|t| (t.numel() * self.wire.size()) as u64)
            .sum();
        let stats = PushStats {
            bytes,
            workers: self.pool.workers().iter().filter(|w| w.healthy).count(),
            secs: started.elapsed().as_secs_f64(),
        };
        debug!(
            agent,
            version,
            bytes = stats.bytes,
            workers = stats.workers,
            secs = stats.secs,
            "weights pushed"
        );
        self.last_push = Some(stats);
        Ok(())
    }

    fn push_once(
        &mut self,
        agent: &str,
        version: u64,
        params: &BTreeMap<String, Tensor>,
        lora_scaling: Option<f64>,
    ) -> Result<(), TrainError> {
        let none = HashSet::new();
        match self.transport {
            WeightTransport::Grpc => self.push_grpc(agent, version, params, lora_scaling, &none)?,
            WeightTransport::Shm => self
                .push_shm(agent, version, params, lora_scaling)
                .map_err(|(_, e)| {
                    TrainError::Rollout(format!(
                        "{}: {} of `{agent}` to v{version} through shared memory \
                     (rollout.weight_transport: shm) failed: {e}",
                        self.label,
                        update_kind(lora_scaling)
                    ))
                })?,
            WeightTransport::Auto if self.shm_failed => {
                self.push_grpc(agent, version, params, lora_scaling, &none)?
            }
            WeightTransport::Auto => match self.rt.block_on(self.pool.shm_capable()) {
                Err(why) => {
                    debug!(why, "weights go over gRPC");
                    self.push_grpc(agent, version, params, lora_scaling, &none)?
                }
                Ok(()) => {
                    if let Err((accepted, e)) = self.push_shm(agent, version, params, lora_scaling)
                    {
                        warn!(
                            error = e,
                            "shared-memory weight update failed, sending it over gRPC"
                        );
                        self.push_grpc(agent, version, params, lora_scaling, &accepted)?;
                        // Only when gRPC carried what shared memory did not was the transport the
                        // problem; an update refused for its content (a failed probe check, say)
                        // is refused over gRPC too and leaves shared memory in use.
                        warn!("weight updates go over gRPC from now on");
                        self.shm_failed = true;
                    }
                }
            },
        }
        self.rt
            .block_on(
                self.pool
                    .wait_for_version(agent, version, self.version_timeout),
            )
            .map_err(|e| TrainError::Rollout(e.to_string()))
    }

    /// Whether weight pushes go through shared memory now (`shm`, or `auto` with every worker able
    /// to take them and no failure yet).
    pub(super) fn shm_transport(&self) -> bool {
        match self.transport {
            WeightTransport::Shm => true,
            WeightTransport::Grpc => false,
            WeightTransport::Auto => {
                !self.shm_failed && self.rt.block_on(self.pool.shm_capable()).is_ok()
            }
        }
    }

    /// [`RolloutSource::push_weights_all`] through shared memory: the agents' files are written at
    /// the same time (one thread each: the copy is the learner's share of a push), the updates
    /// announced at the same time (each worker swaps each model on that model's own thread), and
    /// the versions awaited together. An agent whose file could not be written, or whose update a
    /// worker refused, takes the one-agent path afterwards ([`Self::push`]), with its fallbacks.
    pub(super) fn push_all_shm(&mut self, updates: &[WeightPush<'_>]) -> Result<(), TrainError> {
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

impl PoolRollout {
    /// The header of a push of `agent` as `version`: a full update of every parameter, or, with
    /// `lora_scaling`, an adapter (a partial update the workers merge into their base weights),
    /// with the agent's probe. `tensor_count` is left to the pool, which counts the tensors it sends.
    fn update_header(
        &self,
        agent: &str,
        version: u64,
        lora_scaling: Option<f64>,
    ) -> pb::UpdateHeader {
        let probe = self.probes.get(agent).map(|p| pb::WeightProbe {
            // Weights rounded to bf16 on the wire move the log-probs by up to ~0.1 nat: the
            // half-precision tolerance, not the f32 one.
            tolerance: if p.tolerance == 0.0 && self.wire != WireDType::F32 {
                0.25
            } else {
                p.tolerance
            },
            ..p.clone()
        });
        pb::UpdateHeader {
            agent: agent.to_string(),
            version,
            tensor_count: 0,
            partial: lora_scaling.is_some(),
            lora_scaling: lora_scaling.unwrap_or(0.0),
            probe,
        }
    }
}

/// What a gRPC push's answers mean for the run: the refusals to warn about, or (as `Err`, the
/// refusals joined) a push that no worker took. The run goes on while one worker took the update
/// (or took it another way: `took_elsewhere`). Workers that could not be reached (one that
/// deregistered or died as the push began: its connection is refused) are gone rather than
/// refusing, so when no worker was reached the update waits for the next one that joins or comes
/// back, as with an empty pool. Only refusals by workers that were reached say the update itself is
/// wrong.
fn settle_grpc_push(
    answers: &[(String, Result<pb::UpdateWeightsResponse, tonic::Status>)],
    took_elsewhere: bool,
) -> Result<Vec<String>, String> {
    let refused: Vec<String> = answers
        .iter()
        .filter_map(|(w, a)| a.as_ref().err().map(|s| format!("{w}: {s}")))
        .collect();
    if refused.len() < answers.len() || took_elsewhere {
        return Ok(refused);
    }
    if answers.iter().all(|(_, a)| {
        a.as_ref()
            .err()
            .is_some_and(cotrain_rollout_client::pool::worker_failed)
    }) {
        warn!(
            refusals = refused.join("; "),
            "no rollout worker could be reached for the update; it waits for the next worker that joins"
        );
        return Ok(Vec::new());
    }
    Err(refused.join("; "))
}

/// What a push is, for errors.
fn update_kind(lora_scaling: Option<f64>) -> &'static str {
    if lora_scaling.is_some() {
        "adapter update"
    } else {
        "weight update"
    }
}

/// A parameter as a contiguous CPU tensor of the wire's element type.
fn wire_tensor(t: &Tensor, wire: WireDType) -> Tensor {
    t.detach()
        .to_device(tch::Device::Cpu)
        .to_kind(wire.kind())
        .contiguous()
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

/// Parameters as wire tensors, serialised once for every worker (f32 keeps the workers' policy
/// bit-identical to the learner's; bf16 halves the bytes).
fn wire_tensors(params: &BTreeMap<String, Tensor>, wire: WireDType) -> Vec<UpdatedTensor> {
    params
        .iter()
        .map(|(name, t)| {
            let t = wire_tensor(t, wire);
            let len = t.numel() * wire.size();
            let mut data = vec![0u8; len];
            t.copy_data_u8(&mut data, t.numel());
            UpdatedTensor {
                name: name.clone(),
                dtype: wire,
                shape: t.size(),
                data,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(
        worker: &str,
        status: Option<tonic::Status>,
    ) -> (String, Result<pb::UpdateWeightsResponse, tonic::Status>) {
        (
            worker.to_string(),
            status.map_or(Ok(pb::UpdateWeightsResponse::default()), Err),
        )
    }

    /// The push that failed a run on a loaded machine: its only worker deregistered as the push
    /// began, so the connection was refused. The update waits for the next worker; a worker that
    /// was reached and refused still fails the push when no one took it.
    #[test]
    fn a_push_that_reaches_no_worker_waits_and_one_refused_by_every_reached_worker_fails() {
        let gone = || tonic::Status::unavailable("tcp connect error");
        let died = || tonic::Status::unknown("transport error");
        let refusal = || {
            tonic::Status::invalid_argument(
                "tensor `lm_head.weight`: shape [64, 256, 1] does not match the model's [256, 64]",
            )
        };
        assert_eq!(
            settle_grpc_push(&[answer("a", Some(gone()))], false),
            Ok(Vec::new())
        );
        assert_eq!(
            settle_grpc_push(
                &[answer("a", Some(gone())), answer("b", Some(died()))],
                false
            ),
            Ok(Vec::new())
        );
        let e = settle_grpc_push(
            &[answer("a", Some(gone())), answer("b", Some(refusal()))],
            false,
        )
        .unwrap_err();
        assert!(e.contains("b: ") && e.contains("does not match"), "{e}");
        assert!(settle_grpc_push(&[answer("a", Some(refusal()))], false).is_err());
        // One worker took it: the others' refusals are warnings.
        assert_eq!(
            settle_grpc_push(&[answer("a", None), answer("b", Some(refusal()))], false)
                .map(|r| r.len()),
            Ok(1)
        );
        // Every worker here refused, but the others took it through shared memory.
        assert_eq!(
            settle_grpc_push(&[answer("a", Some(refusal()))], true).map(|r| r.len()),
            Ok(1)
        );
    }
}
