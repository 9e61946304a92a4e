//! The reward server's `Score` and `Analyze` (next-turn feedback) over gRPC.
//!
//! A server that is overloaded or late is retried `reward.max_retries` times; one that cannot be
//! reached at all (down, restarting) is waited out for up to `reward.outage_timeout` seconds,
//! retried every few seconds, and the time spent waiting is reported per step. Every request carries
//! an id that its retries repeat, so that a batch whose answer was lost is scored once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cotrain_proto::reward::reward_client::RewardClient;
use cotrain_proto::reward::{AnalyzeRequest, JointAction, ScoreRequest};
use tokio::runtime::Runtime;
use tonic::transport::Channel;

use crate::error::TrainError;
use crate::sources::{Analysis, CodeOutcome, FeedbackSpec, RewardSource, Score, ScoreAction};

/// See the module docs.
pub struct GrpcReward {
    rt: Arc<Runtime>,
    client: RewardClient<Channel>,
    endpoint: String,
    timeout: Duration,
    /// The scoring options every request carries (empty: the server's defaults).
    options_json: String,
    /// Retries of a call the server could not answer in time (overloaded, late).
    retries: u32,
    /// How long an unreachable server is waited out.
    outage_timeout: Duration,
    /// Seconds spent waiting for an unreachable server since [`RewardSource::take_outage_secs`]
    /// last asked.
    outage_secs: std::cell::Cell<f64>,
}

impl GrpcReward {
    /// Connects to `endpoint` (`host:port` or `http://host:port`; over TLS with `tls`).
    pub fn connect(
        rt: Arc<Runtime>,
        endpoint: &str,
        timeout: Duration,
        tls: Option<&cotrain_proto::tls::ClientTls>,
    ) -> Result<Self, TrainError> {
        let ep = cotrain_proto::tls::endpoint(endpoint, tls)
            .map_err(|e| TrainError::Reward(format!("reward.endpoint: {e}")))?;
        let uri = ep.uri().to_string();
        let channel = rt
            .block_on(ep.connect_timeout(Duration::from_secs(10)).connect())
            .map_err(|e| {
                TrainError::Reward(format!("cannot reach the reward server at {uri}: {e}"))
            })?;
        let client = RewardClient::new(channel)
            .max_decoding_message_size(usize::MAX)
            .max_encoding_message_size(usize::MAX);
        Ok(Self {
            rt,
            client,
            endpoint: uri,
            timeout,
            options_json: String::new(),
            retries: 5,
            outage_timeout: Duration::from_secs(300),
            outage_secs: std::cell::Cell::new(0.0),
        })
    }

    /// Waits out an unreachable server this long (`reward.outage_timeout`).
    pub fn with_outage_timeout(mut self, timeout: Duration) -> Self {
        self.outage_timeout = timeout;
        self
    }

    /// Retries transient failures this many times (`reward.max_retries`).
    pub fn with_retries(mut self, retries: u32) -> Self {
        self.retries = retries;
        self
    }

    /// Runs `call` with the timeout: a server that cannot be reached is waited out (see the module
    /// docs), other transient failures are retried with exponential backoff; the error names the
    /// server, the call, and how many attempts or seconds failed.
    fn call<Req: Clone, Resp, F, Fut>(
        &self,
        what: &str,
        req: Req,
        mut call: F,
    ) -> Result<Resp, TrainError>
    where
        F: FnMut(RewardClient<Channel>, tonic::Request<Req>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
    {
        let mut wait = Duration::from_millis(500);
        let mut failed = 0u32;
        let mut outage: Option<Instant> = None;
        loop {
            let mut request = tonic::Request::new(req.clone());
            request.set_timeout(self.timeout);
            let status = match self.rt.block_on(call(self.client.clone(), request)) {
                Ok(r) => {
                    if let Some(since) = outage {
                        tracing::info!(server = %self.endpoint, call = what, waited_secs = since.elapsed().as_secs_f64(), "the reward server answers again");
                    }
                    return Ok(r.into_inner());
                }
                Err(s) => s,
            };
            if status.code() == tonic::Code::Unavailable {
                // Down or restarting: wait it out, up to the outage timeout.
                let since = *outage.get_or_insert_with(|| {
                    tracing::warn!(server = %self.endpoint, call = what, message = status.message(), timeout_secs = self.outage_timeout.as_secs_f64(),
                        "the reward server cannot be reached; waiting for it (reward.outage_timeout)");
                    Instant::now()
                });
                if since.elapsed() < self.outage_timeout {
                    let pause = Duration::from_secs(2)
                        .min(self.outage_timeout.saturating_sub(since.elapsed()));
                    std::thread::sleep(pause);
                    self.outage_secs
                        .set(self.outage_secs.get() + pause.as_secs_f64());
                    continue;
                }
                return Err(TrainError::Reward(format!(
                    "{}: {what} failed: the reward server could not be reached for {:.0} s (reward.outage_timeout): {} ({:?})",
                    self.endpoint,
                    since.elapsed().as_secs_f64(),
                    status.message(),
                    status.code()
                )));
            }
            failed += 1;
            if cotrain_proto::retry::is_transient(&status) && failed <= self.retries {
                tracing::warn!(server = %self.endpoint, call = what, attempt = failed, code = ?status.code(), message = status.message(), retry_in = ?wait, "reward server call failed, retrying");
                std::thread::sleep(wait);
                wait = (wait * 2).min(Duration::from_secs(8));
                continue;
            }
            let tries = if cotrain_proto::retry::is_transient(&status) {
                format!(" after {failed} attempts")
            } else {
                String::new()
            };
            return Err(TrainError::Reward(format!(
                "{}: {what} failed{tries}: {} ({:?})",
                self.endpoint,
                status.message(),
                status.code()
            )));
        }
    }

    /// Sends `options` with every scoring request (the config's `reward.options`).
    pub fn with_options(mut self, options: &cotrain_proto::reward_options::ScoreOptions) -> Self {
        self.options_json = serde_json::to_string(options).unwrap_or_default();
        self
    }
}

impl RewardSource for GrpcReward {
    fn score(&mut self, task: &str, actions: &[ScoreAction]) -> Result<Vec<Score>, TrainError> {
        let req = ScoreRequest {
            task: task.to_string(),
            actions: actions
                .iter()
                .map(|a| JointAction {
                    completions: a.completions.clone(),
                    item_json: a.item.to_string(),
                })
                .collect(),
            options_json: self.options_json.clone(),
            request_id: uuid::Uuid::new_v4().to_string(),
        };
        let resp = self.call("Score", req, |mut c, r| async move { c.score(r).await })?;
        // Callers index the scores by joint action: a short or long answer is the server's error.
        if resp.results.len() != actions.len() {
            return Err(TrainError::Reward(format!(
                "{}: {} scores for {} joint actions",
                self.endpoint,
                resp.results.len(),
                actions.len()
            )));
        }
        Ok(resp
            .results
            .into_iter()
            .map(|r| {
                let details =
                    serde_json::from_str(&r.details_json).unwrap_or(serde_json::Value::Null);
                Score {
                    reward: r.reward,
                    levels: r.levels.into_iter().collect(),
                    code: (task == "code")
                        .then(|| CodeOutcome::from_details(&details))
                        .flatten(),
                    details,
                }
            })
            .collect())
    }

    fn feedback(
        &mut self,
        task: &str,
        actions: &[ScoreAction],
        spec: &FeedbackSpec,
    ) -> Result<Vec<Vec<String>>, TrainError> {
        Ok(self
            .analyze(task, actions, spec)?
            .into_iter()
            .map(|a| a.feedback)
            .collect())
    }

    fn analyze(
        &mut self,
        task: &str,
        actions: &[ScoreAction],
        spec: &FeedbackSpec,
    ) -> Result<Vec<Analysis>, TrainError> {
        let score: serde_json::Value = if self.options_json.is_empty() {
            serde_json::json!({})
        } else {
            serde_json::from_str(&self.options_json).unwrap_or_else(|_| serde_json::json!({}))
        };
        let mode = serde_json::to_value(spec.mode).unwrap_or(serde_json::Value::Null);
        // The server reads 0 as "all tests".
        let options = serde_json::json!({ "sandbox_slice": spec.sandbox_slice.unwrap_or(0), "feedback_mode": mode, "score": score });
        let req = AnalyzeRequest {
            task: task.to_string(),
            actions: actions
                .iter()
                .map(|a| JointAction {
                    completions: a.completions.clone(),
                    item_json: a.item.to_string(),
                })
                .collect(),
            options_json: options.to_string(),
            request_id: uuid::Uuid::new_v4().to_string(),
        };
        let resp = self.call("Analyze", req, |mut c, r| async move { c.analyze(r).await })?;
        if resp.results.len() != actions.len() {
            return Err(TrainError::Reward(format!(
                "{}: {} analyses for {} joint actions",
                self.endpoint,
                resp.results.len(),
                actions.len()
            )));
        }
        resp.results
            .iter()
            .map(|r| {
                #[derive(serde::Deserialize)]
                struct Wire {
                    feedback: Option<Vec<String>>,
                    #[serde(default)]
                    diagnostics: Option<cotrain_reward_server::rewards::CodeDiagnostics>,
                }
                let a: Wire = serde_json::from_str(&r.analysis_json).map_err(|e| {
                    TrainError::Reward(format!("{}: unreadable analysis: {e}", self.endpoint))
                })?;
                let feedback = a.feedback.ok_or_else(|| {
                    TrainError::Reward(format!(
                        "{}: the analysis carries no feedback text",
                        self.endpoint
                    ))
                })?;
                Ok(Analysis {
                    feedback,
                    diagnostics: a.diagnostics,
                })
            })
            .collect()
    }

    fn take_outage_secs(&mut self) -> f64 {
        self.outage_secs.replace(0.0)
    }

    fn describe(&self) -> String {
        format!("reward server at {}", self.endpoint)
    }
}
