//! The gRPC transport: the update serialised once as wire tensors and streamed in chunks to every
//! healthy worker; what the workers' answers mean for the run.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use cotrain_proto::rollout as pb;
use cotrain_rollout_client::wire::{UpdatedTensor, WireDType};
use tch::Tensor;
use tracing::warn;

use super::{update_kind, wire_tensor};
use crate::error::TrainError;
use crate::services::pool_source::PoolRollout;

impl PoolRollout {
    /// Pushes as gRPC chunks to every healthy worker not in `skip`; `lora_scaling` is set for an
    /// adapter (see [`update_header`]).
    pub(super) fn push_grpc(
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
