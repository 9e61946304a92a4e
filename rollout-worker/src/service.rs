//! The gRPC adapter: converts `cotrain.rollout.v1` messages to and from the [`Worker`]'s types.

use std::sync::Arc;

use cotrain_model::chat_template::ChatMessage;
use cotrain_model::engine::{FinishReason as EngineFinish, SamplingParams, StopConditions};
use cotrain_proto::rollout::rollout_server::Rollout;
use cotrain_proto::rollout::{
    AgentInfo, Completion, FinishReason, GenerateRequest, GenerateResponse, InfoRequest,
    InfoResponse, ListParametersRequest, ListParametersResponse, ModelInfo, ParameterInfo, Sample,
    ScoreVerifierRequest, ScoreVerifierResponse, UpdateWeightsRequest, UpdateWeightsResponse,
    prompt, update_weights_request::Item,
};
use futures::StreamExt;
use tonic::{Request, Response, Status, Streaming};
use tracing::{info, warn};

use crate::error::WorkerError;
use crate::shm::{self, ShmPolicy};
use crate::weights::UpdateAssembler;
use crate::worker::{GenerateJob, GenerateOutput, PromptInput, Worker};

/// The tonic service over a shared [`Worker`].
#[derive(Clone)]
pub struct RolloutService {
    worker: Arc<Worker>,
    shm: ShmPolicy,
    /// Weight updates must carry it, when set.
    token: Option<cotrain_proto::auth::ClusterToken>,
}

impl RolloutService {
    /// Wraps a worker; shared-memory weight updates are refused.
    pub fn new(worker: Arc<Worker>) -> Self {
        Self {
            worker,
            shm: ShmPolicy::new(false),
            token: None,
        }
    }

    /// Requires the cluster token on weight updates (none: updates are not authenticated).
    pub fn with_cluster_token(mut self, token: Option<cotrain_proto::auth::ClusterToken>) -> Self {
        self.token = token;
        self
    }

    /// Accepts (or refuses) shared-memory weight updates from [`SHM_DIR`](cotrain_proto::shm::SHM_DIR).
    pub fn with_shm_weights(mut self, allowed: bool) -> Self {
        self.shm = ShmPolicy::new(allowed);
        self
    }
}

/// Converts a protocol request into a job, checking what the protocol leaves open.
pub fn job_from_proto(req: GenerateRequest) -> Result<GenerateJob, WorkerError> {
    let mut prompts = Vec::with_capacity(req.prompts.len());
    for (i, p) in req.prompts.into_iter().enumerate() {
        let field = format!("prompts[{i}]");
        prompts.push(match p.kind {
            Some(prompt::Kind::Text(t)) => PromptInput::Text(t),
            Some(prompt::Kind::Chat(c)) => PromptInput::Chat(
                c.messages
                    .into_iter()
                    .map(|m| ChatMessage::new(m.role, m.content))
                    .collect(),
            ),
            Some(prompt::Kind::TokenIds(t)) => PromptInput::Tokens(t.ids),
            None => {
                return Err(WorkerError::invalid(
                    field,
                    "empty prompt (none of text, chat, token_ids)",
                ));
            }
        });
    }
    let s = req.sampling.unwrap_or_default();
    let stop = req.stop.unwrap_or_default();
    Ok(GenerateJob {
        agent: req.agent,
        prompts,
        n: if req.n == 0 { 1 } else { req.n as usize },
        sampling: SamplingParams {
            temperature: s.temperature.map_or(1.0, f64::from),
            top_k: s.top_k as usize,
            top_p: s.top_p.map_or(1.0, f64::from),
            min_p: s.min_p.map_or(0.0, f64::from),
        },
        stop: StopConditions {
            max_new_tokens: s.max_new_tokens as usize,
            stop_token_ids: stop.stop_token_ids,
            stop_strings: stop.stop_strings,
            ignore_eos: stop.ignore_eos,
        },
        seed: req.seed,
        min_policy_version: req.min_policy_version,
        top_logprobs: 0,
        logprobs: if s.sampling_logprobs {
            cotrain_model::engine::LogprobMode::Sampling
        } else {
            cotrain_model::engine::LogprobMode::Raw
        },
    })
}

/// Converts an answer into its protocol form.
pub fn response_to_proto(
    out: GenerateOutput,
    agent: String,
    worker_id: String,
    request_id: String,
) -> GenerateResponse {
    GenerateResponse {
        completions: out
            .completions
            .into_iter()
            .map(|c| Completion {
                prompt_token_ids: c.prompt_token_ids,
                samples: c
                    .samples
                    .into_iter()
                    .map(|s| Sample {
                        token_ids: s.token_ids,
                        text: s.text,
                        logprobs: s.logprobs,
                        finish_reason: match s.finish_reason {
                            EngineFinish::Stop => FinishReason::Stop,
                            EngineFinish::Length => FinishReason::Length,
                        } as i32,
                        policy_version: s.policy_version,
                    })
                    .collect(),
            })
            .collect(),
        agent,
        model: out.model,
        worker_id,
        request_id,
    }
}

#[tonic::async_trait]
impl Rollout for RolloutService {
    #[tracing::instrument(skip_all, fields(agent = %request.get_ref().agent, request_id = %request.get_ref().request_id))]
    async fn generate(
        &self,
        request: Request<GenerateRequest>,
    ) -> Result<Response<GenerateResponse>, Status> {
        let req = request.into_inner();
        let (agent, request_id) = (req.agent.clone(), req.request_id.clone());
        let job = job_from_proto(req)?;
        let result = self.worker.generate(job).await;
        let outcome = match &result {
            Ok(_) => "ok",
            Err(WorkerError::InvalidArgument { .. }) => "invalid",
            Err(WorkerError::Overloaded { .. }) => "overloaded",
            Err(_) => "error",
        };
        self.worker
            .metrics()
            .requests
            .with_label_values(&[agent.as_str(), outcome])
            .inc();
        let out = result?;
        Ok(Response::new(response_to_proto(
            out,
            agent,
            self.worker.id().to_string(),
            request_id,
        )))
    }

    #[tracing::instrument(skip_all)]
    async fn update_weights(
        &self,
        request: Request<Streaming<UpdateWeightsRequest>>,
    ) -> Result<Response<UpdateWeightsResponse>, Status> {
        if let Some(token) = &self.token {
            let given = request
                .metadata()
                .get(cotrain_proto::auth::METADATA_KEY)
                .and_then(|v| v.to_str().ok());
            if !token.verify(given) {
                let why = if given.is_none() {
                    "the request carried none"
                } else {
                    "the request carried another one"
                };
                warn!(why, "weight update refused: no valid cluster token");
                return Err(Status::unauthenticated(format!(
                    "this rollout worker requires the cluster token for weight updates and {why}: give the learner the worker's token file \
                     (--cluster-token-file PATH or {})",
                    cotrain_proto::auth::TOKEN_FILE_ENV
                )));
            }
        }
        let mut stream = request.into_inner();
        let header = match stream.next().await {
            Some(Ok(UpdateWeightsRequest {
                item: Some(Item::Header(h)),
            })) => h,
            Some(Ok(_)) => {
                return Err(
                    WorkerError::BadUpdate("the first message must be the header".into()).into(),
                );
            }
            Some(Err(e)) => return Err(WorkerError::StreamBroken(e.to_string()).into()),
            None => return Err(WorkerError::BadUpdate("empty stream".into()).into()),
        };
        let agent = header.agent.clone();
        let (params, current, staging) = self.worker.update_target(&agent)?;
        let mut assembler = UpdateAssembler::new(header, params, current)?.with_staging(staging);
        let started = std::time::Instant::now();
        let mut shm = None;
        let mut chunks = 0usize;
        while let Some(msg) = stream.next().await {
            let msg = msg.map_err(|e| {
                warn!(agent, error = %e, "weight update stream broke, old weights kept");
                WorkerError::StreamBroken(e.to_string())
            })?;
            if shm.is_some() {
                return Err(
                    WorkerError::BadUpdate("a message after the shm message".into()).into(),
                );
            }
            match msg.item {
                Some(Item::Chunk(c)) => {
                    let n = c.data.len() as u64;
                    assembler.push(c)?;
                    chunks += 1;
                    self.worker.metrics().weight_update_bytes.inc_by(n);
                }
                Some(Item::Shm(m)) if chunks == 0 => shm = Some(m),
                Some(Item::Shm(_)) => {
                    return Err(WorkerError::BadUpdate("an shm message after chunks".into()).into());
                }
                Some(Item::Header(_)) => {
                    return Err(WorkerError::BadUpdate("a second header".into()).into());
                }
                None => {
                    return Err(WorkerError::BadUpdate(
                        "a message with neither header nor chunk".into(),
                    )
                    .into());
                }
            }
        }
        let update = match shm {
            None => assembler.finish()?,
            Some(m) => {
                let policy = self.shm.clone();
                let update = tokio::task::spawn_blocking(move || {
                    shm::read_update(&policy, &m, assembler)
                })
                .await
                .map_err(|e| {
                    WorkerError::Internal(format!("reading the shm update panicked: {e}"))
                })?
                .inspect_err(
                    |e| warn!(agent, error = %e, "shm weight update refused, old weights kept"),
                )?;
                self.worker
                    .metrics()
                    .weight_update_bytes
                    .inc_by(update.bytes_received);
                update
            }
        };
        let bytes = update.bytes_received;
        let adapter = update.lora_scaling.is_some();
        // The parameters replaced: for an adapter, one per (A, B) pair.
        let tensors = if adapter {
            update.len() / 2
        } else {
            update.len()
        } as u32;
        let (model, version, agents) = self.worker.apply_update(update).await?;
        info!(
            agent,
            model,
            version,
            tensors,
            bytes,
            adapter,
            secs = started.elapsed().as_secs_f64(),
            "weight update applied"
        );
        Ok(Response::new(UpdateWeightsResponse {
            agent,
            model,
            version,
            tensors_updated: tensors,
            bytes_received: bytes,
            agents,
        }))
    }

    #[tracing::instrument(skip_all)]
    async fn info(&self, _request: Request<InfoRequest>) -> Result<Response<InfoResponse>, Status> {
        let w = &self.worker;
        let models = w.models();
        let agents = w
            .agent_names()
            .iter()
            .map(|a| {
                let m = models
                    .iter()
                    .find(|m| m.agents.contains(a))
                    .expect("every agent has a model");
                // An adapter group's agents each have their own version.
                AgentInfo {
                    name: a.clone(),
                    model: m.id.clone(),
                    policy_version: w.policy_version(a).unwrap_or(m.policy_version),
                }
            })
            .collect();
        let cfg = w.config();
        Ok(Response::new(InfoResponse {
            worker_id: w.id().to_string(),
            device: format!("{:?}", cfg.device).to_lowercase(),
            dtype: match cfg.kind {
                tch::Kind::BFloat16 => "bf16".into(),
                tch::Kind::Half => "f16".into(),
                _ => "f32".into(),
            },
            agents,
            models: models
                .into_iter()
                .map(|m| ModelInfo {
                    id: m.id,
                    agents: m.agents,
                    policy_version: m.policy_version,
                    parameter_count: m.parameter_count,
                    context_length: m.context_length as u32,
                    vocab_size: m.vocab_size as u32,
                    running_sequences: m.running_sequences as u32,
                    max_batch_size: cfg.max_batch_size as u32,
                    queued_requests: m.queued_requests as u32,
                    pending_weight_updates: m.pending_weight_updates as u32,
                    unmerged_adapters: m.unmerged_adapters,
                })
                .collect(),
            max_queued_requests: cfg.max_queued_requests as u32,
            in_flight_requests: w.in_flight() as u32,
            server_version: env!("CARGO_PKG_VERSION").to_string(),
            shm_weights: self.shm.allowed,
            verifiers: w.verifier_names(),
        }))
    }

    #[tracing::instrument(skip_all)]
    async fn score_verifier(
        &self,
        request: Request<ScoreVerifierRequest>,
    ) -> Result<Response<ScoreVerifierResponse>, Status> {
        let req = request.into_inner();
        let conversations = req
            .conversations
            .into_iter()
            .map(|c| (c.user, c.assistant))
            .collect();
        let (verifier, scores) = self
            .worker
            .score_verifier(&req.verifier, conversations)
            .await?;
        Ok(Response::new(ScoreVerifierResponse { scores, verifier }))
    }

    #[tracing::instrument(skip_all)]
    async fn list_parameters(
        &self,
        request: Request<ListParametersRequest>,
    ) -> Result<Response<ListParametersResponse>, Status> {
        let (model, params) = self.worker.parameters(&request.get_ref().agent)?;
        Ok(Response::new(ListParametersResponse {
            model,
            parameters: params
                .into_iter()
                .map(|(name, shape)| ParameterInfo { name, shape })
                .collect(),
        }))
    }
}
