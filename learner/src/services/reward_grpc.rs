//! The reward server's `Score` and `Analyze` (next-turn feedback) over gRPC.

use std::sync::Arc;
use std::time::Duration;

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
    /// Retries of a call the server could not answer (down, overloaded, late).
    retries: u32,
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
        })
    }

    /// Retries transient failures this many times (`reward.max_retries`).
    pub fn with_retries(mut self, retries: u32) -> Self {
        self.retries = retries;
        self
    }

    /// Runs `call` with the timeout, retrying transient failures with exponential backoff; the
    /// error names the server, the call and how many attempts failed.
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
        for attempt in 0..=self.retries {
            let mut request = tonic::Request::new(req.clone());
            request.set_timeout(self.timeout);
            match self.rt.block_on(call(self.client.clone(), request)) {
                Ok(r) => return Ok(r.into_inner()),
                Err(s) if cotrain_proto::retry::is_transient(&s) && attempt < self.retries => {
                    tracing::warn!(server = %self.endpoint, call = what, attempt = attempt + 1, code = ?s.code(), message = s.message(), retry_in = ?wait, "reward server call failed, retrying");
                    std::thread::sleep(wait);
                    wait = (wait * 2).min(Duration::from_secs(8));
                }
                Err(s) => {
                    let tries = if cotrain_proto::retry::is_transient(&s) {
                        format!(" after {} attempts", attempt + 1)
                    } else {
                        String::new()
                    };
                    return Err(TrainError::Reward(format!(
                        "{}: {what} failed{tries}: {} ({:?})",
                        self.endpoint,
                        s.message(),
                        s.code()
                    )));
                }
            }
        }
        unreachable!("the last attempt returns")
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

    fn describe(&self) -> String {
        format!("reward server at {}", self.endpoint)
    }
}
