//! Weight pushes: streaming an update (chunked or as a shared-memory file) to every healthy
//! worker, settling who took it, and waiting until the workers in rotation serve it.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cotrain_proto::refusal::{self, Refusal};
use cotrain_proto::rollout::{
    ShmWeights, UpdateHeader, UpdateWeightsRequest, UpdateWeightsResponse,
    update_weights_request::Item,
};
use futures::StreamExt as _;
use tonic::Status;
use tracing::warn;

use super::member::Worker;
use super::replay;
use super::route::worker_failed;
use super::{Inner, PoolError, RolloutPool};
use crate::wire::UpdatedTensor;

/// A weight update of `version` refused because the worker already serves exactly that version
/// (a re-push). A worker that serves a *newer* one is not current: it has weights this pool never
/// sent, and leaves rotation.
fn already_current(status: &Status, version: u64) -> bool {
    Refusal::of(status) == Some(Refusal::VersionNotNewer)
        && refusal::current_version(status) == Some(version)
}

impl RolloutPool {
    /// Streams a weight update (all or some parameters of `agent`'s model, as `version`) to every
    /// healthy worker at once; returns each worker's answer.
    pub async fn push_weights(
        &self,
        agent: &str,
        version: u64,
        partial: bool,
        tensors: Arc<Vec<UpdatedTensor>>,
    ) -> Vec<(String, Result<UpdateWeightsResponse, Status>)> {
        self.push_weights_except(agent, version, partial, tensors, &HashSet::new())
            .await
    }

    /// As [`Self::push_weights`], to every healthy worker but those in `skip` (the ones that
    /// already took this version another way).
    pub async fn push_weights_except(
        &self,
        agent: &str,
        version: u64,
        partial: bool,
        tensors: Arc<Vec<UpdatedTensor>>,
        skip: &HashSet<String>,
    ) -> Vec<(String, Result<UpdateWeightsResponse, Status>)> {
        let header = UpdateHeader {
            agent: agent.to_string(),
            version,
            partial,
            ..UpdateHeader::default()
        };
        self.push_update_except(header, tensors, skip).await
    }

    /// Streams an update with the given header (agent, version, `partial`, `lora_scaling` for an
    /// adapter; its `tensor_count` is set here from `tensors`) to every healthy worker but those
    /// in `skip`; returns each worker's answer. The update is kept for workers that join later;
    /// workers that refuse it leave rotation until they are caught up.
    pub async fn push_update_except(
        &self,
        mut header: UpdateHeader,
        tensors: Arc<Vec<UpdatedTensor>>,
        skip: &HashSet<String>,
    ) -> Vec<(String, Result<UpdateWeightsResponse, Status>)> {
        header.tensor_count = tensors.len() as u32;
        self.inner.replay.announce(&header.agent, header.version);
        // The update is written to the replay directory while it streams to the workers.
        let keep = {
            let (inner, header, tensors) = (self.inner.clone(), header.clone(), tensors.clone());
            tokio::task::spawn_blocking(move || inner.replay.record_chunks(&header, &tensors))
        };
        let workers: Vec<Arc<Worker>> = self
            .inner
            .push_targets(&header.agent)
            .into_iter()
            .filter(|w| !skip.contains(&w.address))
            .collect();
        let calls = workers
            .iter()
            .map(|w| self.inner.send_chunks(w, &header, &tensors));
        let (answers, kept) = futures::future::join(futures::future::join_all(calls), keep).await;
        match kept {
            Ok(Ok(())) => {}
            Ok(Err(why)) => {
                warn!(agent = %header.agent, version = header.version, why, "workers that join later cannot be caught up")
            }
            Err(e) => {
                warn!(agent = %header.agent, version = header.version, error = %e, "keeping the update for workers that join later failed")
            }
        }
        self.inner
            .clone()
            .settle_push(&workers, answers, header.version)
    }

    /// Sends a weight update whose tensors are in a shared-memory file (see [`crate::shm`]) to
    /// every healthy worker at once; returns each worker's answer. The caller keeps the file until
    /// this returns.
    pub async fn push_weights_shm(
        &self,
        agent: &str,
        version: u64,
        partial: bool,
        shm: &ShmWeights,
    ) -> Vec<(String, Result<UpdateWeightsResponse, Status>)> {
        let header = UpdateHeader {
            agent: agent.to_string(),
            version,
            partial,
            ..UpdateHeader::default()
        };
        let lock = self.shm_lock(agent);
        let _writing = lock.lock().await;
        self.push_update_shm(header, shm).await
    }

    /// As [`Self::push_weights_shm`], with the given header (as for [`Self::push_update_except`];
    /// its `tensor_count` is set here from `shm`). The caller holds [`Self::shm_lock`] from before
    /// it writes the file until this returns, and keeps the file (it is replayed to workers that
    /// fall behind) until it next writes it under the lock.
    pub async fn push_update_shm(
        &self,
        mut header: UpdateHeader,
        shm: &ShmWeights,
    ) -> Vec<(String, Result<UpdateWeightsResponse, Status>)> {
        header.tensor_count = shm.tensors.len() as u32;
        self.inner.replay.announce(&header.agent, header.version);
        self.inner.replay.record_shm(&header, shm);
        let workers: Vec<Arc<Worker>> = self.inner.push_targets(&header.agent);
        let calls = workers.iter().map(|w| self.inner.send_shm(w, &header, shm));
        let answers = futures::future::join_all(calls).await;
        self.inner
            .clone()
            .settle_push(&workers, answers, header.version)
    }

    /// The lock a writer of `agent`'s shared-memory weight file holds while it rewrites the file
    /// and pushes it (catch-ups replaying that file to a worker hold it too).
    pub fn shm_lock(&self, agent: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.inner.replay.lock(agent)
    }

    /// Whether every healthy worker (at least one) is on a loopback address and accepts
    /// shared-memory weight updates (`InfoResponse.shm_weights`); if not, why not.
    pub async fn shm_capable(&self) -> Result<(), String> {
        let infos = self.info_all().await;
        if infos.is_empty() {
            return Err("no healthy worker".into());
        }
        for (addr, info) in infos {
            if !is_loopback(&addr) {
                return Err(format!("worker {addr} is not on a loopback address"));
            }
            match info {
                Ok(i) if i.shm_weights => {}
                Ok(_) => {
                    return Err(format!(
                        "worker {addr} was not started with {}",
                        crate::shm::SHM_FLAG
                    ));
                }
                Err(s) => return Err(format!("worker {addr}: Info failed: {}", s.message())),
            }
        }
        Ok(())
    }

    /// Waits until every worker in rotation reports at least `version` for `agent` (workers that
    /// refused the push are out of rotation and not waited on).
    pub async fn wait_for_version(
        &self,
        agent: &str,
        version: u64,
        timeout: Duration,
    ) -> Result<(), PoolError> {
        let start = Instant::now();
        loop {
            let mut laggards = Vec::new();
            let serving: Vec<Arc<Worker>> = self
                .inner
                .healthy()
                .into_iter()
                .filter(|w| w.serving() && w.serves(agent))
                .collect();
            for (addr, info) in self.inner.info_of(serving).await {
                // A worker that answers and does not serve the agent (a verifier-only worker) is not waited on.
                if info
                    .as_ref()
                    .is_ok_and(|i| !i.agents.iter().any(|a| a.name == agent))
                {
                    continue;
                }
                let v = info.ok().and_then(|i| {
                    i.agents
                        .iter()
                        .find(|a| a.name == agent)
                        .map(|a| a.policy_version)
                });
                match v {
                    // Weights this pool never sent (another learner, a stale pool): not this policy.
                    Some(v) if v > version => {
                        return Err(PoolError::VersionAhead {
                            agent: agent.into(),
                            version,
                            worker: addr,
                            served: v,
                        });
                    }
                    Some(v) if v == version => {}
                    _ => laggards.push((addr, v)),
                }
            }
            if laggards.is_empty() {
                return Ok(());
            }
            if start.elapsed() >= timeout {
                return Err(PoolError::VersionTimeout {
                    agent: agent.into(),
                    version,
                    waited: start.elapsed(),
                    laggards,
                });
            }
            // Polling: a worker exposes its version through Info only.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Whether a worker address (`http://host:port`) is a loopback IP or `localhost`.
pub fn is_loopback(address: &str) -> bool {
    let rest = address.split_once("://").map_or(address, |(_, r)| r);
    let host_port = rest.split('/').next().unwrap_or(rest);
    if let Ok(sa) = host_port.parse::<SocketAddr>() {
        return sa.ip().is_loopback();
    }
    let host = host_port.rsplit_once(':').map_or(host_port, |(h, _)| h);
    host.eq_ignore_ascii_case("localhost")
}

/// The messages of one weight-update stream: the header, then every tensor in chunks of at most
/// `chunk_bytes` payload bytes. Chunks are built as the stream is polled, so a large update is
/// never copied whole.
pub fn update_stream(
    header: UpdateHeader,
    tensors: Arc<Vec<UpdatedTensor>>,
    chunk_bytes: usize,
) -> impl futures::Stream<Item = UpdateWeightsRequest> + Send + 'static {
    let chunk_bytes = chunk_bytes.max(1);
    let plan: Vec<(usize, usize)> = tensors
        .iter()
        .enumerate()
        .flat_map(|(i, t)| {
            (0..t.data.len().div_ceil(chunk_bytes)).map(move |c| (i, c * chunk_bytes))
        })
        .collect();
    let head = futures::stream::once(async move {
        UpdateWeightsRequest {
            item: Some(Item::Header(header)),
        }
    });
    let body = futures::stream::iter(plan).map(move |(i, start)| {
        let t = &tensors[i];
        let end = (start + chunk_bytes).min(t.data.len());
        UpdateWeightsRequest {
            item: Some(Item::Chunk(cotrain_proto::rollout::TensorChunk {
                name: t.name.clone(),
                dtype: t.dtype.to_proto() as i32,
                shape: t.shape.clone(),
                offset: start as u64,
                data: t.data[start..end].to_vec(),
            })),
        }
    });
    head.chain(body)
}

impl Inner {
    /// The healthy workers a push of `agent` goes to: those that serve it; when none does, all
    /// (their refusals name the unknown agent, so the push fails rather than reaching nobody).
    pub(super) fn push_targets(&self, agent: &str) -> Vec<Arc<Worker>> {
        let healthy = self.healthy();
        let serving: Vec<Arc<Worker>> = healthy
            .iter()
            .filter(|w| w.serves(agent))
            .cloned()
            .collect();
        if serving.is_empty() { healthy } else { serving }
    }

    /// A weight-update request carrying the cluster token, when the pool has one.
    fn authorised<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        if let Some(token) = &self.cfg.cluster_token
            && let Ok(value) = token.bearer().parse()
        {
            request
                .metadata_mut()
                .insert(cotrain_proto::auth::METADATA_KEY, value);
        }
        request
    }

    async fn send_chunks(
        &self,
        w: &Worker,
        header: &UpdateHeader,
        tensors: &Arc<Vec<UpdatedTensor>>,
    ) -> (String, Result<UpdateWeightsResponse, Status>) {
        let mut request = self.authorised(update_stream(
            header.clone(),
            tensors.clone(),
            self.cfg.weight_chunk_bytes,
        ));
        request.set_timeout(self.cfg.push_timeout);
        let mut c = w.client.clone();
        (
            w.address.clone(),
            w.unless_lost(c.update_weights(request))
                .await
                .map(|r| r.into_inner()),
        )
    }

    pub(super) async fn send_file(
        &self,
        w: &Worker,
        header: &UpdateHeader,
        file: Arc<replay::SpillFile>,
    ) -> (String, Result<UpdateWeightsResponse, Status>) {
        let mut request = self.authorised(replay::file_update_stream(
            header.clone(),
            file,
            self.cfg.weight_chunk_bytes,
        ));
        request.set_timeout(self.cfg.push_timeout);
        let mut c = w.client.clone();
        (
            w.address.clone(),
            w.unless_lost(c.update_weights(request))
                .await
                .map(|r| r.into_inner()),
        )
    }

    pub(super) async fn send_shm(
        &self,
        w: &Worker,
        header: &UpdateHeader,
        shm: &ShmWeights,
    ) -> (String, Result<UpdateWeightsResponse, Status>) {
        let msgs = vec![
            UpdateWeightsRequest {
                item: Some(Item::Header(header.clone())),
            },
            UpdateWeightsRequest {
                item: Some(Item::Shm(shm.clone())),
            },
        ];
        let mut request = self.authorised(futures::stream::iter(msgs));
        request.set_timeout(self.cfg.push_timeout);
        let mut c = w.client.clone();
        (
            w.address.clone(),
            w.unless_lost(c.update_weights(request))
                .await
                .map(|r| r.into_inner()),
        )
    }

    /// After a push of `version`: a worker that already serves exactly that version (a re-push)
    /// counts as having taken it; workers that refused it leave rotation (failed ones also lose
    /// their health until a check passes); those that took it and were out of rotation are checked
    /// for rotation.
    fn settle_push(
        self: Arc<Self>,
        workers: &[Arc<Worker>],
        answers: Vec<(String, Result<UpdateWeightsResponse, Status>)>,
        version: u64,
    ) -> Vec<(String, Result<UpdateWeightsResponse, Status>)> {
        let answers: Vec<_> = answers
            .into_iter()
            .map(|(addr, answer)| match answer {
                Err(status) if already_current(&status, version) => (
                    addr,
                    Ok(UpdateWeightsResponse {
                        version,
                        ..Default::default()
                    }),
                ),
                other => (addr, other),
            })
            .collect();
        for (w, (_, answer)) in workers.iter().zip(&answers) {
            match answer {
                Ok(_) if !w.serving() => {
                    tokio::spawn(self.clone().catch_up(w.clone()));
                }
                Ok(_) => {}
                Err(status) => {
                    warn!(worker = %w.address, code = ?status.code(), message = status.message(), "weight update refused, worker out of rotation");
                    if worker_failed(status) {
                        self.mark_failed(w);
                    } else {
                        w.bench();
                    }
                }
            }
        }
        answers
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::WireDType;

    #[test]
    fn update_stream_chunks_every_tensor() {
        let tensors = Arc::new(vec![
            UpdatedTensor {
                name: "a".into(),
                dtype: WireDType::Bf16,
                shape: vec![5],
                data: vec![1; 10],
            },
            UpdatedTensor {
                name: "b".into(),
                dtype: WireDType::F32,
                shape: vec![1],
                data: vec![2; 4],
            },
        ]);
        let header = UpdateHeader {
            agent: "x".into(),
            version: 1,
            tensor_count: 2,
            partial: true,
            lora_scaling: 0.0,
            probe: None,
        };
        let msgs: Vec<UpdateWeightsRequest> =
            futures::executor::block_on(update_stream(header, tensors, 4).collect());
        assert_eq!(msgs.len(), 1 + 3 + 1);
        assert!(matches!(msgs[0].item, Some(Item::Header(_))));
        let Some(Item::Chunk(c)) = &msgs[3].item else {
            panic!("expected a chunk")
        };
        assert_eq!((c.name.as_str(), c.offset, c.data.len()), ("a", 8, 2));
    }

    #[test]
    fn loopback_addresses() {
        assert!(is_loopback("http://127.0.0.1:50061"));
        assert!(is_loopback("http://127.3.2.1:1"));
        assert!(is_loopback("http://[::1]:50061"));
        assert!(is_loopback("http://localhost:50061"));
        assert!(!is_loopback("http://10.0.0.7:50061"));
        assert!(!is_loopback("http://worker-0.rollout:50061"));
        assert!(!is_loopback("http://[::2]:50061"));
    }
}
