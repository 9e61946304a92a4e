//! The gRPC `Reward` service: a thin adapter over [`RewardApi`].

use std::sync::Arc;
use std::time::Instant;

use cotrain_proto::reward as pb;
use tonic::{Request, Response, Status};

use super::core::{JointAction, RewardApi};
use super::error::ApiError;
use super::once::AnsweredOnce;
use crate::sandbox::ExecStatus;

pub struct RewardGrpc {
    api: Arc<RewardApi>,
    queue_limit: usize,
    /// Scoring and analysis requests that carry an id are answered once.
    scored: AnsweredOnce<pb::ScoreResponse>,
    analysed: AnsweredOnce<pb::AnalyzeResponse>,
}

impl RewardGrpc {
    pub fn new(api: Arc<RewardApi>, queue_limit: usize) -> Self {
        Self {
            api,
            queue_limit,
            scored: AnsweredOnce::default(),
            analysed: AnsweredOnce::default(),
        }
    }

    fn observe<T>(&self, endpoint: &str, started: Instant, r: &Result<T, ApiError>) {
        let outcome = match r {
            Ok(_) => "ok",
            Err(e) => e.kind(),
        };
        self.api
            .metrics
            .observe_request(endpoint, outcome, started.elapsed().as_secs_f64());
    }
}

fn actions(actions: Vec<pb::JointAction>) -> Result<Vec<JointAction>, ApiError> {
    actions
        .into_iter()
        .enumerate()
        .map(|(i, a)| {
            let item = if a.item_json.trim().is_empty() {
                return Err(ApiError::invalid(
                    format!("actions[{i}].item_json"),
                    "missing (a JSON object is required)",
                ));
            } else {
                serde_json::from_str::<serde_json::Value>(&a.item_json).map_err(|e| {
                    ApiError::invalid(format!("actions[{i}].item_json"), e.to_string())
                })?
            };
            if !item.is_object() {
                return Err(ApiError::invalid(
                    format!("actions[{i}].item_json"),
                    "must be a JSON object",
                ));
            }
            Ok(JointAction {
                completions: a.completions,
                item,
            })
        })
        .collect()
}

fn options(json: &str) -> Result<Option<serde_json::Value>, ApiError> {
    if json.trim().is_empty() {
        return Ok(None);
    }
    serde_json::from_str(json)
        .map(Some)
        .map_err(|e| ApiError::invalid("options_json", e.to_string()))
}

#[tonic::async_trait]
impl pb::reward_server::Reward for RewardGrpc {
    #[tracing::instrument(skip_all, fields(task = %request.get_ref().task, n = request.get_ref().actions.len()))]
    async fn score(
        &self,
        request: Request<pb::ScoreRequest>,
    ) -> Result<Response<pb::ScoreResponse>, Status> {
        let started = Instant::now();
        let req = request.into_inner();
        let id = req.request_id.clone();
        let score = || async {
            let result = async {
                let acts = actions(req.actions)?;
                let opts = options(&req.options_json)?;
                self.api.score(&req.task, acts, opts, "actions").await
            }
            .await;
            self.observe("grpc.score", started, &result);
            let results = result?
                .into_iter()
                .map(|s| pb::ScoreResult {
                    reward: s.result.reward,
                    levels: s.result.levels.into_iter().collect(),
                    details_json: s.result.details.to_string(),
                    elapsed_ms: s.elapsed_ms,
                })
                .collect();
            Ok::<_, Status>(pb::ScoreResponse {
                results,
                elapsed_ms: started.elapsed().as_millis() as u64,
            })
        };
        let (response, earlier) = self.scored.answer(&id, score).await?;
        if earlier {
            tracing::info!(request_id = %id, "a scoring request seen before: answered with its first result");
        }
        Ok(Response::new(response))
    }

    #[tracing::instrument(skip_all, fields(task = %request.get_ref().task, n = request.get_ref().actions.len()))]
    async fn analyze(
        &self,
        request: Request<pb::AnalyzeRequest>,
    ) -> Result<Response<pb::AnalyzeResponse>, Status> {
        let started = Instant::now();
        let req = request.into_inner();
        let id = req.request_id.clone();
        let analyse = || async {
            let result = async {
                let acts = actions(req.actions)?;
                let opts = options(&req.options_json)?;
                self.api.analyze(&req.task, acts, opts, "actions").await
            }
            .await;
            self.observe("grpc.analyze", started, &result);
            let results = result?
                .into_iter()
                .map(|a| pb::AnalyzeResult {
                    analysis_json: serde_json::to_string(&a.analysis).unwrap_or_default(),
                    elapsed_ms: a.elapsed_ms,
                })
                .collect();
            Ok::<_, Status>(pb::AnalyzeResponse {
                results,
                elapsed_ms: started.elapsed().as_millis() as u64,
            })
        };
        let (response, earlier) = self.analysed.answer(&id, analyse).await?;
        if earlier {
            tracing::info!(request_id = %id, "an analysis request seen before: answered with its first result");
        }
        Ok(Response::new(response))
    }

    #[tracing::instrument(skip_all, fields(n = request.get_ref().conversations.len()))]
    async fn verify(
        &self,
        request: Request<pb::VerifyRequest>,
    ) -> Result<Response<pb::VerifyResponse>, Status> {
        let started = Instant::now();
        let req = request.into_inner();
        let conversations = req
            .conversations
            .into_iter()
            .map(|c| (c.user, c.assistant))
            .collect();
        let result = self.api.verify(&req.verifier, conversations).await;
        self.observe("grpc.verify", started, &result);
        let (verifier, scores) = result?;
        Ok(Response::new(pb::VerifyResponse { scores, verifier }))
    }

    #[tracing::instrument(skip_all, fields(code_bytes = request.get_ref().code.len()))]
    async fn execute(
        &self,
        request: Request<pb::ExecuteRequest>,
    ) -> Result<Response<pb::ExecuteResponse>, Status> {
        let started = Instant::now();
        let req = request.into_inner();
        let timeout = (req.timeout_secs != 0.0).then_some(req.timeout_secs);
        let memory = (req.memory_mb != 0).then_some(req.memory_mb);
        let stdin = (!req.stdin.is_empty()).then_some(req.stdin.as_str());
        let result = self.api.execute(&req.code, stdin, timeout, memory).await;
        self.observe("grpc.execute", started, &result);
        let out = result?;
        let (status, exit_code, signal) = match out.status {
            ExecStatus::Finished { exit_code } => ("finished", Some(exit_code), None),
            ExecStatus::Killed { signal } => ("killed", None, Some(signal)),
            ExecStatus::CpuTimeExceeded { .. } => ("cpu_time_exceeded", None, None),
            ExecStatus::TimedOut { .. } => ("timed_out", None, None),
            ExecStatus::OutputLimit { .. } => ("output_limit", None, None),
        };
        Ok(Response::new(pb::ExecuteResponse {
            status: status.into(),
            exit_code,
            signal,
            stdout: out.stdout,
            stderr: out.stderr,
            stdout_truncated: out.stdout_truncated,
            stderr_truncated: out.stderr_truncated,
            wall_time_ms: out.wall_time_ms,
            sandboxed: out.sandboxed,
        }))
    }

    async fn info(
        &self,
        _request: Request<pb::InfoRequest>,
    ) -> Result<Response<pb::InfoResponse>, Status> {
        Ok(Response::new(pb::InfoResponse {
            version: env!("CARGO_PKG_VERSION").into(),
            sandboxed: self.api.sandbox.is_sandboxed(),
            max_concurrency: self.api.sandbox.max_concurrency() as u32,
            queue_limit: self.queue_limit as u32,
            tasks: ["code", "arxiv", "tldr", "gsm8k", "anli"]
                .map(String::from)
                .to_vec(),
        }))
    }
}
