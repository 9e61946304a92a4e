//! The reward server's learned-verifier backend. Model weights stay out of this process (it builds
//! without libtorch, beside the sandbox): a rollout worker started with `--verifier NAME=DIR`
//! hosts the verifier, and this client forwards (user, assistant) conversations to its
//! `ScoreVerifier` RPC. At most [`MAX_IN_FLIGHT`] calls are forwarded at once; more wait for a
//! slot up to the call timeout. An endpoint that cannot be reached is `Unavailable` (503 /
//! UNAVAILABLE), a worker's refusal of the conversations is `InvalidArgument` (400).

use std::sync::Arc;
use std::time::Duration;

use cotrain_proto::rollout::rollout_client::RolloutClient;
use cotrain_proto::rollout::{Conversation, ScoreVerifierRequest};
use tokio::sync::Semaphore;
use tonic::transport::{Channel, Endpoint};

use super::error::ApiError;

/// Calls forwarded to the worker at once.
pub const MAX_IN_FLIGHT: usize = 64;
/// Longest a call waits for a slot and the worker's answer.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(120);
/// Largest message either way (a batch of long conversations).
const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// A connection to the rollout worker that hosts the verifier.
#[derive(Clone)]
pub struct VerifierClient {
    pub endpoint: String,
    channel: Channel,
    slots: Arc<Semaphore>,
}

impl VerifierClient {
    /// A lazily connecting client for `endpoint` (`http://HOST:PORT`, the worker's gRPC address;
    /// a bare `HOST:PORT` gets `http://`).
    pub fn new(endpoint: &str) -> Result<Self, String> {
        let url = if endpoint.contains("://") {
            endpoint.to_string()
        } else {
            format!("http://{endpoint}")
        };
        let channel = Endpoint::from_shared(url.clone())
            .map_err(|e| format!("--verifier-endpoint {endpoint}: {e}"))?
            .connect_timeout(Duration::from_secs(5))
            .timeout(CALL_TIMEOUT)
            .connect_lazy();
        Ok(Self {
            endpoint: url,
            channel,
            slots: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
        })
    }

    /// Scores conversations with the worker's verifier `name` (empty: its only one); returns the
    /// verifier's name and one probability per conversation.
    pub async fn score(
        &self,
        name: &str,
        conversations: Vec<(String, String)>,
    ) -> Result<(String, Vec<f32>), ApiError> {
        let n = conversations.len();
        let permit = tokio::time::timeout(CALL_TIMEOUT, self.slots.acquire())
            .await
            .map_err(|_| {
                ApiError::Overloaded(format!(
                    "{MAX_IN_FLIGHT} verifier calls in flight for {}s",
                    CALL_TIMEOUT.as_secs()
                ))
            })?
            .map_err(|_| ApiError::Unavailable("the verifier client is closed".into()))?;
        let mut client = RolloutClient::new(self.channel.clone())
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        let request = ScoreVerifierRequest {
            verifier: name.to_string(),
            conversations: conversations
                .into_iter()
                .map(|(user, assistant)| Conversation { user, assistant })
                .collect(),
        };
        let reply = client.score_verifier(request).await;
        drop(permit);
        let reply = reply.map_err(|s| match s.code() {
            tonic::Code::InvalidArgument => {
                ApiError::invalid("conversations", s.message().to_string())
            }
            tonic::Code::ResourceExhausted => {
                ApiError::Overloaded(format!("the verifier worker: {}", s.message()))
            }
            tonic::Code::Unavailable
            | tonic::Code::DeadlineExceeded
            | tonic::Code::Cancelled
            | tonic::Code::Unknown => ApiError::Unavailable(format!(
                "the verifier at {} cannot be reached: {}",
                self.endpoint,
                s.message()
            )),
            _ => ApiError::Internal(format!(
                "the verifier at {}: {}",
                self.endpoint,
                s.message()
            )),
        })?;
        let r = reply.into_inner();
        if r.scores.len() != n {
            return Err(ApiError::Internal(format!(
                "the verifier answered {} scores for {n} conversations",
                r.scores.len()
            )));
        }
        Ok((r.verifier, r.scores))
    }
}
