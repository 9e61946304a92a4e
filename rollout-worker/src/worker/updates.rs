//! Weight updates: where an agent's update lands (its model's parameter shapes, version and staging
//! buffers), and swapping a complete update in, merged or as an unmerged adapter.

use std::collections::{BTreeMap, HashMap};

use tch::{Kind, Tensor};
use tokio::sync::oneshot;

use super::Worker;
use crate::batcher::{Command, StagedUpdate};
use crate::error::{Result, WorkerError};
use crate::weights::{CompleteUpdate, Staging};

impl Worker {
    /// Parameter shapes, current version and staging buffers of `agent`'s model, to start
    /// assembling an update.
    pub fn update_target(&self, agent: &str) -> Result<(HashMap<String, Vec<i64>>, u64, Staging)> {
        let slot = self.slot(agent).map_err(|e| match e {
            WorkerError::InvalidArgument { message, .. } => {
                WorkerError::invalid("header.agent", message)
            }
            e => e,
        })?;
        Ok((
            slot.params.clone(),
            slot.version_of(agent),
            slot.staging.clone(),
        ))
    }

    /// Swaps in a validated update between decode steps (after the jobs in the engine finish on
    /// the old weights). Returns the model id, the new version and the agents it changed.
    ///
    /// An adapter update is merged per adapter: the worker holds one copy of the base per model
    /// slot for merging ([`super::slot::BaseWeights`]), and the merged projections are swapped in like a
    /// partial update, so every parameter the adapter does not name keeps its current value.
    pub async fn apply_update(&self, update: CompleteUpdate) -> Result<(String, u64, Vec<String>)> {
        let slot = self.slot(&update.agent)?;
        let (kind, device) = (slot.kind, slot.device);
        let version = update.version;
        let probe = update.probe.clone();
        if let Some(id) = slot.adapter_id(&update.agent) {
            // An adapter slot keeps the adapter as sent (in the model's dtype) and serves it unmerged.
            let Some(scaling) = update.lora_scaling else {
                return Err(WorkerError::BadUpdate(format!(
                    "agent `{}` is served as a LoRA adapter on a shared base (serve --adapters): it takes adapter updates \
                     (header.lora_scaling > 0), not parameters",
                    update.agent
                )));
            };
            let agent = update.agent.clone();
            let tensors = tokio::task::spawn_blocking(move || update.into_tensors(kind, device))
                .await
                .map_err(|e| WorkerError::Internal(format!("tensor conversion panicked: {e}")))?;
            let (reply, rx) = oneshot::channel();
            slot.tx
                .send(Command::Update {
                    update: StagedUpdate {
                        version,
                        tensors,
                        keep: None,
                        adapter: Some((id, scaling)),
                        probe,
                    },
                    reply,
                })
                .map_err(|_| WorkerError::Unavailable("engine loop stopped".into()))?;
            let version = rx
                .await
                .map_err(|_| WorkerError::Unavailable("engine loop stopped".into()))??;
            return Ok((slot.id.clone(), version, vec![agent]));
        }
        // Conversion to the model's dtype and device (and any merge) happens here, off the engine
        // loop, so the loop pauses only for the copy into the parameters.
        // A plain update's tensors are the assembler's buffers (or their conversion): the slot keeps
        // them for the next update. A merged adapter's are not, they may share the base's storage.
        let keep = update.lora_scaling.is_none().then(|| slot.staging.clone());
        let tensors = match update.lora_scaling {
            None => tokio::task::spawn_blocking(move || update.into_tensors(kind, device))
                .await
                .map_err(|e| WorkerError::Internal(format!("tensor conversion panicked: {e}")))?,
            Some(scaling) => {
                let base = slot.base.clone();
                tokio::task::spawn_blocking(move || {
                    // f32 whatever the model's dtype: the merge computes in f32 and rounds once.
                    let adapter: BTreeMap<String, Tensor> = update
                        .into_tensors(Kind::Float, device)
                        .into_iter()
                        .collect();
                    base.merge(&adapter, scaling)
                })
                .await
                .map_err(|e| {
                    WorkerError::Internal(format!("merging the adapter panicked: {e}"))
                })??
            }
        };
        let (reply, rx) = oneshot::channel();
        slot.tx
            .send(Command::Update {
                update: StagedUpdate {
                    version,
                    tensors,
                    keep,
                    adapter: None,
                    probe,
                },
                reply,
            })
            .map_err(|_| WorkerError::Unavailable("engine loop stopped".into()))?;
        let version = rx
            .await
            .map_err(|_| WorkerError::Unavailable("engine loop stopped".into()))??;
        Ok((slot.id.clone(), version, slot.agents.clone()))
    }
}
