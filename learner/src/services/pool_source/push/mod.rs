//! Weight pushes to the pool's workers: gRPC chunks to every healthy worker ([`grpc`]), or one
//! shared-memory file per agent for the workers on this host that accept it ([`shm`]), chosen by
//! `rollout.weight_transport` here, with `auto` falling back to gRPC for good once shared memory
//! fails; a LoRA adapter is a partial update whose header carries its scaling. (vLLM engines behind
//! a worker take either; the worker loads the update into its engine.)

mod grpc;
mod shm;

use std::collections::{BTreeMap, HashSet};

use cotrain_proto::rollout as pb;
use cotrain_rollout_client::wire::WireDType;
use tch::Tensor;
use tracing::{debug, warn};

use super::PoolRollout;
use crate::config::WeightTransport;
use crate::error::TrainError;
use crate::sources::PushStats;

impl PoolRollout {
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
