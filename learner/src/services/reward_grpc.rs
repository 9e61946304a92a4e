//! The reward server's `Score` and `Analyze` (next-turn feedback) over gRPC.

use std::sync::Arc;
use std::time::Duration;

use cotrain_proto::reward::reward_client::RewardClient;
use cotrain_proto::reward::{AnalyzeRequest, JointAction, ScoreRequest};
use tokio::runtime::Runtime;
use tonic::transport::{Channel, Endpoint};

use crate::trainer::{CodeOutcome, FeedbackSpec, RewardSource, Score, ScoreAction, TrainError};

/// See the module docs.
pub struct GrpcReward {
    rt: Arc<Runtime>,
    client: RewardClient<Channel>,
    endpoint: String,
    timeout: Duration,
    /// The scoring options every request carries (empty: the server's defaults).
    options_json: String,
}

impl GrpcReward {
    /// Connects to `endpoint` (`host:port` or `http://host:port`).
    pub fn connect(rt: Arc<Runtime>, endpoint: &str, timeout: Duration) -> Result<Self, TrainError> {
        let uri = if endpoint.contains("://") { endpoint.to_string() } else { format!("http://{endpoint}") };
        let ep = Endpoint::from_shared(uri.clone()).map_err(|e| TrainError::Reward(format!("reward.endpoint `{endpoint}`: {e}")))?;
        let channel = rt
            .block_on(ep.connect_timeout(Duration::from_secs(10)).connect())
            .map_err(|e| TrainError::Reward(format!("cannot reach the reward server at {uri}: {e}")))?;
        let client = RewardClient::new(channel).max_decoding_message_size(usize::MAX).max_encoding_message_size(usize::MAX);
        Ok(Self { rt, client, endpoint: uri, timeout, options_json: String::new() })
    }

    /// Sends `options` with every scoring request (the config's `reward.options`).
    pub fn with_options(mut self, options: &cotrain_reward_server::rewards::ScoreOptions) -> Self {
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
                .map(|a| JointAction { completions: a.completions.clone(), item_json: a.item.to_string() })
                .collect(),
            options_json: self.options_json.clone(),
        };
        let mut request = tonic::Request::new(req);
        request.set_timeout(self.timeout);
        let mut client = self.client.clone();
        let resp = self
            .rt
            .block_on(client.score(request))
            .map_err(|s| TrainError::Reward(format!("{}: Score failed: {} ({:?})", self.endpoint, s.message(), s.code())))?
            .into_inner();
        Ok(resp
            .results
            .into_iter()
            .map(|r| {
                let details = serde_json::from_str(&r.details_json).unwrap_or(serde_json::Value::Null);
                Score {
                    reward: r.reward,
                    levels: r.levels.into_iter().collect(),
                    code: (task == "code").then(|| CodeOutcome::from_details(&details)).flatten(),
                    details,
                }
            })
            .collect())
    }

    fn feedback(&mut self, task: &str, actions: &[ScoreAction], spec: &FeedbackSpec) -> Result<Vec<Vec<String>>, TrainError> {
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
                .map(|a| JointAction { completions: a.completions.clone(), item_json: a.item.to_string() })
                .collect(),
            options_json: options.to_string(),
        };
        let mut request = tonic::Request::new(req);
        request.set_timeout(self.timeout);
        let mut client = self.client.clone();
        let resp = self
            .rt
            .block_on(client.analyze(request))
            .map_err(|s| TrainError::Reward(format!("{}: Analyze failed: {} ({:?})", self.endpoint, s.message(), s.code())))?
            .into_inner();
        if resp.results.len() != actions.len() {
            return Err(TrainError::Reward(format!("{}: {} analyses for {} joint actions", self.endpoint, resp.results.len(), actions.len())));
        }
        resp.results
            .iter()
            .map(|r| {
                #[derive(serde::Deserialize)]
                struct Analysis {
                    feedback: Option<Vec<String>>,
                }
                let a: Analysis = serde_json::from_str(&r.analysis_json)
                    .map_err(|e| TrainError::Reward(format!("{}: unreadable analysis: {e}", self.endpoint)))?;
                a.feedback.ok_or_else(|| TrainError::Reward(format!("{}: the analysis carries no feedback text", self.endpoint)))
            })
            .collect()
    }

    fn describe(&self) -> String {
        format!("reward server at {}", self.endpoint)
    }
}
