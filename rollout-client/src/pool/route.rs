//! Routing: which worker gets a request (in rotation, serving the agent, least loaded), and
//! sending it again elsewhere when a worker fails or refuses it as stale.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use cotrain_proto::refusal::Refusal;
use cotrain_proto::rollout::{
    GenerateRequest, GenerateResponse, ScoreVerifierRequest, ScoreVerifierResponse,
};
use tonic::{Code, Status};
use tracing::{debug, warn};

use super::member::{InFlight, Worker};
use super::{Inner, PoolError, RolloutPool};

/// Answers after which the same request goes to another worker: the transient failures, and two
/// that another worker may not give (a model error of this worker, a worker behind on versions).
fn retryable(status: &Status) -> bool {
    cotrain_proto::retry::is_transient(status)
        || matches!(status.code(), Code::Internal | Code::FailedPrecondition)
}

/// Errors that say the worker itself is in trouble, not just busy or behind.
pub fn worker_failed(status: &Status) -> bool {
    // Not `Internal`: a worker answers it for a model error one request caused, and is fine.
    matches!(
        status.code(),
        Code::Unavailable | Code::Unknown | Code::Cancelled
    )
}

/// A refusal because the worker's policy is older than the request needs (typed by the worker:
/// see [`cotrain_proto::refusal`]).
fn stale_refusal(status: &Status) -> bool {
    Refusal::of(status) == Some(Refusal::StalePolicy)
}

impl RolloutPool {
    /// Runs one generate request on the least-loaded healthy worker, retrying on another worker
    /// when one fails; returns exactly one answer.
    #[tracing::instrument(skip_all, fields(agent = %req.agent, request_id = %req.request_id))]
    pub async fn generate(&self, req: GenerateRequest) -> Result<GenerateResponse, PoolError> {
        if let Some(v) = req.min_policy_version {
            let mut expected = self.inner.expected.lock().expect("pool lock");
            let e = expected.entry(req.agent.clone()).or_default();
            *e = (*e).max(v);
        }
        let mut tried = HashSet::new();
        let mut last: Option<(String, Status)> = None;
        for attempt in 1..=self.inner.cfg.max_attempts {
            let worker = self.inner.pick(&tried, Some(&req.agent)).await?;
            if !tried.insert(worker.address.clone()) {
                // Every healthy worker has failed this request once (all busy, say): back off
                // before asking one of them again.
                tokio::time::sleep(Duration::from_millis(50 << attempt.min(6))).await;
            }
            let guard = InFlight::new(worker.clone());
            let mut request = tonic::Request::new(req.clone());
            if let Some(t) = self.inner.cfg.request_timeout {
                request.set_timeout(t);
            }
            let mut client = worker.client.clone();
            let result = worker.unless_lost(client.generate(request)).await;
            drop(guard);
            match result {
                Ok(resp) => {
                    worker.completed.fetch_add(1, Ordering::SeqCst);
                    return Ok(resp.into_inner());
                }
                Err(status) if retryable(&status) => {
                    worker.failed.fetch_add(1, Ordering::SeqCst);
                    self.inner.failed_attempts.fetch_add(1, Ordering::SeqCst);
                    if worker_failed(&status) {
                        self.inner.mark_failed(&worker);
                    } else if stale_refusal(&status) {
                        // Restarted, or missed a push: out of rotation until it is caught up.
                        worker.stale_refusals.fetch_add(1, Ordering::SeqCst);
                        worker.bench();
                        tokio::spawn(self.inner.clone().catch_up(worker.clone()));
                    }
                    warn!(worker = %worker.address, attempt, code = ?status.code(), message = status.message(), "generate attempt failed, retrying elsewhere");
                    last = Some((worker.address.clone(), status));
                }
                Err(status) => {
                    return Err(PoolError::Rejected {
                        worker: worker.address.clone(),
                        status,
                    });
                }
            }
        }
        let (worker, status) = last.expect("at least one attempt");
        Err(PoolError::AttemptsExhausted {
            attempts: self.inner.cfg.max_attempts,
            worker,
            status,
        })
    }

    /// Scores conversations with the learned verifier `name` on a healthy worker that serves it:
    /// workers are tried least-loaded first; one that does not serve it, or fails, passes the call on.
    pub async fn score_verifier(
        &self,
        req: ScoreVerifierRequest,
    ) -> Result<ScoreVerifierResponse, PoolError> {
        let mut tried = HashSet::new();
        let mut last: Option<(String, Status)> = None;
        while let Ok(worker) = self.inner.pick(&tried, None).await {
            if !tried.insert(worker.address.clone()) {
                break;
            }
            let guard = InFlight::new(worker.clone());
            let mut request = tonic::Request::new(req.clone());
            if let Some(t) = self.inner.cfg.request_timeout {
                request.set_timeout(t);
            }
            let mut client = worker.client.clone();
            let result = worker.unless_lost(client.score_verifier(request)).await;
            drop(guard);
            match result {
                Ok(resp) => return Ok(resp.into_inner()),
                Err(status) => {
                    let elsewhere = retryable(&status)
                        || Refusal::of(&status) == Some(Refusal::UnknownVerifier);
                    if !elsewhere {
                        return Err(PoolError::Rejected {
                            worker: worker.address.clone(),
                            status,
                        });
                    }
                    if worker_failed(&status) {
                        self.inner.mark_failed(&worker);
                    }
                    last = Some((worker.address.clone(), status));
                }
            }
        }
        match last {
            Some((worker, status)) => Err(PoolError::AttemptsExhausted {
                attempts: tried.len(),
                worker,
                status,
            }),
            None => Err(PoolError::NoWorker(self.inner.cfg.wait_for_worker)),
        }
    }
}

impl Inner {
    /// The least-loaded worker in rotation that serves `agent` (any, for None), preferring ones
    /// not yet tried for this request.
    async fn pick(
        &self,
        tried: &HashSet<String>,
        agent: Option<&str>,
    ) -> Result<Arc<Worker>, PoolError> {
        let deadline = Instant::now() + self.cfg.wait_for_worker;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let serving: Vec<Arc<Worker>> =
                self.healthy().into_iter().filter(|w| w.serving()).collect();
            // Workers that serve the agent; when none does, any (its refusal names the unknown agent).
            let with_agent: Vec<Arc<Worker>> = serving
                .iter()
                .filter(|w| agent.is_none_or(|a| w.serves(a)))
                .cloned()
                .collect();
            let serving = if with_agent.is_empty() {
                serving
            } else {
                with_agent
            };
            let untried: Vec<_> = serving
                .iter()
                .filter(|w| !tried.contains(&w.address))
                .cloned()
                .collect();
            let candidates = if untried.is_empty() { serving } else { untried };
            if !candidates.is_empty() {
                let turn = self.tie_breaker.fetch_add(1, Ordering::Relaxed);
                let n = candidates.len();
                let best = (0..n)
                    .map(|k| &candidates[(turn + k) % n])
                    .min_by_key(|w| w.in_flight.load(Ordering::SeqCst))
                    .expect("non-empty");
                return Ok(best.clone());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            debug!(?left, "no rollout worker in rotation, waiting");
            if left.is_zero() || tokio::time::timeout(left, notified).await.is_err() {
                return Err(PoolError::NoWorker(self.cfg.wait_for_worker));
            }
        }
    }
}
