//! The one error type of the service and the one place it becomes a gRPC status or an HTTP
//! response.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use crate::code_runner::RunnerError;
use crate::rewards::RewardError;

/// Everything a request can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The request is wrong; `field` names what (`items[2].item.test`, `task`, `body`).
    #[error("invalid {field}: {message}")]
    InvalidArgument { field: String, message: String },
    /// The sandbox queue is full: retry later.
    #[error("overloaded: {0}")]
    Overloaded(String),
    /// The server is shutting down.
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// The endpoint exists in the protocol but its backend is not part of this build.
    #[error("not implemented: {0}")]
    NotImplemented(String),
    /// The sandbox or the server itself failed.
    #[error("internal error: {0}")]
    Internal(String),
}

impl ApiError {
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::InvalidArgument {
            field: field.into(),
            message: message.into(),
        }
    }

    /// A reward error for the joint action at `prefix` (e.g. `items[3]`).
    pub fn from_reward(err: RewardError, prefix: &str) -> Self {
        if let RewardError::Runner(r) = err {
            return r.into();
        }
        let field = match err.field() {
            Some(f) if f == "task" || f.starts_with("options.") => f,
            Some(f) if prefix.is_empty() => f,
            Some(f) => format!("{prefix}.{f}"),
            None => prefix.to_string(),
        };
        ApiError::InvalidArgument {
            field,
            message: err.to_string(),
        }
    }

    /// Short label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            ApiError::InvalidArgument { .. } => "invalid_argument",
            ApiError::Overloaded(_) => "overloaded",
            ApiError::Unavailable(_) => "unavailable",
            ApiError::NotImplemented(_) => "not_implemented",
            ApiError::Internal(_) => "internal",
        }
    }
}

impl From<RunnerError> for ApiError {
    fn from(err: RunnerError) -> Self {
        match err {
            RunnerError::Overloaded { .. } => ApiError::Overloaded(err.to_string()),
            RunnerError::Sandbox(m) if m.contains("shutting down") => ApiError::Unavailable(m),
            RunnerError::Sandbox(m) => ApiError::Internal(format!("sandbox failure: {m}")),
        }
    }
}

impl From<ApiError> for tonic::Status {
    fn from(err: ApiError) -> Self {
        let msg = err.to_string();
        match err {
            ApiError::InvalidArgument { .. } => tonic::Status::invalid_argument(msg),
            ApiError::Overloaded(_) => tonic::Status::resource_exhausted(msg),
            ApiError::Unavailable(_) => tonic::Status::unavailable(msg),
            ApiError::NotImplemented(_) => tonic::Status::unimplemented(msg),
            ApiError::Internal(_) => tonic::Status::internal(msg),
        }
    }
}

impl ApiError {
    pub fn http_status(&self) -> StatusCode {
        match self {
            ApiError::InvalidArgument { .. } => StatusCode::BAD_REQUEST,
            ApiError::Overloaded(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::NotImplemented(_) => StatusCode::NOT_IMPLEMENTED,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.http_status();
        let field = match &self {
            ApiError::InvalidArgument { field, .. } => Some(field.clone()),
            _ => None,
        };
        let body = serde_json::json!({
            "error": { "code": self.kind(), "message": self.to_string(), "field": field }
        });
        let mut resp = (status, Json(body)).into_response();
        if status == StatusCode::TOO_MANY_REQUESTS {
            resp.headers_mut().insert(
                http::header::RETRY_AFTER,
                http::HeaderValue::from_static("1"),
            );
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_error_maps_to_its_grpc_code_and_http_status() {
        let cases = [
            (
                ApiError::invalid("task", "x"),
                tonic::Code::InvalidArgument,
                400,
            ),
            (
                RunnerError::Overloaded { queued: 3 }.into(),
                tonic::Code::ResourceExhausted,
                429,
            ),
            (
                ApiError::NotImplemented("v".into()),
                tonic::Code::Unimplemented,
                501,
            ),
            (
                RunnerError::Sandbox("boom".into()).into(),
                tonic::Code::Internal,
                500,
            ),
        ];
        for (err, code, http) in cases {
            assert_eq!(err.http_status().as_u16(), http);
            assert_eq!(tonic::Status::from(err).code(), code);
        }
    }

    #[test]
    fn item_field_errors_name_the_joint_action() {
        let err = RewardError::MissingField {
            task: crate::rewards::TaskKind::Code,
            field: "test",
        };
        match ApiError::from_reward(err, "items[2]") {
            ApiError::InvalidArgument { field, .. } => assert_eq!(field, "items[2].item.test"),
            other => panic!("unexpected {other:?}"),
        }
    }
}
