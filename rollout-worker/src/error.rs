//! The rollout worker's error type and the one place that maps it to gRPC status codes and to
//! OpenAI-style HTTP errors.

use tonic::{Code, Status};

/// What can go wrong serving a generation or a weight update.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// A request field has a value the worker cannot serve; `field` is the request's path to it
    /// (`sampling.temperature`, `prompts[3]`).
    #[error("invalid {field}: {message}")]
    InvalidArgument {
        /// Dotted path of the offending field in the request.
        field: String,
        /// What is wrong with it.
        message: String,
    },
    /// The admission queue is full; the client should retry later or elsewhere.
    #[error("worker overloaded: {queued} requests in flight, at most {max}")]
    Overloaded {
        /// Requests admitted and not answered.
        queued: usize,
        /// The configured bound.
        max: usize,
    },
    /// The request asked for a newer policy than the worker has.
    #[error("agent `{agent}` is at policy version {current}, request needs at least {required}")]
    StalePolicy {
        /// The agent asked for.
        agent: String,
        /// Its current version.
        current: u64,
        /// The version the request required.
        required: u64,
    },
    /// A weight update was rejected; the old weights stay in place.
    #[error("weight update rejected: {0}")]
    BadUpdate(String),
    /// A weight update's version is not newer than the model's.
    #[error("weight update version {offered} is not newer than the current version {current}")]
    VersionNotNewer {
        /// The model's version.
        current: u64,
        /// The version the update carried.
        offered: u64,
    },
    /// A shared-memory weight update cannot be served here: the transport is not enabled, or the
    /// named file is not there (the client is on another host); the client should send chunks.
    #[error("weight update refused: {0}")]
    ShmUnavailable(String),
    /// The client's stream broke before the update was complete; the old weights stay in place.
    #[error("weight update stream broken: {0}")]
    StreamBroken(String),
    /// The worker is shutting down or its engine loop has stopped.
    #[error("worker unavailable: {0}")]
    Unavailable(String),
    /// An error from the model layer while generating.
    #[error("model error: {0}")]
    Model(#[from] cotrain_model::ModelError),
    /// A vLLM engine could not be started or used (`serve --engine vllm`).
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// A failure inside the worker that is not the client's fault.
    #[error("internal error: {0}")]
    Internal(String),
}

/// Why a vLLM engine could not be started or used (`serve --engine vllm`, `crate::vllm`).
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// No usable vLLM: the interpreter is missing or cannot import vllm.
    #[error(
        "--engine vllm needs vLLM: {0}. Install it with `COTRAIN_VLLM=cpu make setup` (vLLM's CPU build, in its \
         own environment under the cache) or `COTRAIN_VLLM=system make setup` (the vLLM of the machine's Python), \
         or point COTRAIN_VLLM_PYTHON at an interpreter that has it"
    )]
    Missing(String),
    /// The engine did not start or did not become ready.
    #[error("vllm engine: {0}")]
    Start(String),
    /// What the worker was asked cannot be mapped onto a vLLM engine.
    #[error("--engine vllm: {0}")]
    Unsupported(String),
}

impl WorkerError {
    /// Shorthand for [`WorkerError::InvalidArgument`].
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::InvalidArgument {
            field: field.into(),
            message: message.into(),
        }
    }

    /// The gRPC status code this error maps to.
    pub fn code(&self) -> Code {
        match self {
            Self::InvalidArgument { .. } | Self::BadUpdate(_) => Code::InvalidArgument,
            Self::Overloaded { .. } => Code::ResourceExhausted,
            Self::StalePolicy { .. } | Self::VersionNotNewer { .. } | Self::ShmUnavailable(_) => {
                Code::FailedPrecondition
            }
            Self::StreamBroken(_) => Code::Aborted,
            Self::Unavailable(_) => Code::Unavailable,
            Self::Model(cotrain_model::ModelError::InvalidRequest(_)) => Code::InvalidArgument,
            Self::Engine(_) => Code::Unavailable,
            Self::Model(_) | Self::Internal(_) => Code::Internal,
        }
    }

    /// HTTP status and OpenAI error `type` for the HTTP API.
    pub fn http_status(&self) -> (http::StatusCode, &'static str) {
        match self.code() {
            Code::InvalidArgument => (http::StatusCode::BAD_REQUEST, "invalid_request_error"),
            Code::ResourceExhausted => (http::StatusCode::TOO_MANY_REQUESTS, "rate_limit_error"),
            Code::FailedPrecondition => (http::StatusCode::CONFLICT, "invalid_request_error"),
            Code::Unavailable => (http::StatusCode::SERVICE_UNAVAILABLE, "server_error"),
            _ => (http::StatusCode::INTERNAL_SERVER_ERROR, "server_error"),
        }
    }

    /// The offending field, for errors about one.
    pub fn field(&self) -> Option<&str> {
        match self {
            Self::InvalidArgument { field, .. } => Some(field),
            _ => None,
        }
    }
}

impl From<WorkerError> for Status {
    fn from(e: WorkerError) -> Self {
        use cotrain_proto::refusal::Refusal;
        let status = Status::new(e.code(), e.to_string());
        // The refusals a client's failover acts on are typed in the metadata (never read from the text).
        match e {
            WorkerError::StalePolicy { current, .. } => {
                Refusal::StalePolicy.mark(status, Some(current))
            }
            WorkerError::VersionNotNewer { current, .. } => {
                Refusal::VersionNotNewer.mark(status, Some(current))
            }
            WorkerError::InvalidArgument { ref field, .. } if field == "verifier" => {
                Refusal::UnknownVerifier.mark(status, None)
            }
            _ => status,
        }
    }
}

/// Shorthand for results of the rollout worker.
pub type Result<T, E = WorkerError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_argument_names_the_field() {
        let status: Status =
            WorkerError::invalid("sampling.top_p", "must be in (0, 1], got 1.5").into();
        assert_eq!(status.code(), Code::InvalidArgument);
        assert!(
            status.message().contains("sampling.top_p"),
            "{}",
            status.message()
        );
    }

    #[test]
    fn overload_is_resource_exhausted() {
        let status: Status = WorkerError::Overloaded { queued: 8, max: 8 }.into();
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert_eq!(
            WorkerError::Overloaded { queued: 8, max: 8 }
                .http_status()
                .0,
            429
        );
    }
}
