//! Which gRPC failures a later attempt may not see. The learner's reward client retries these against
//! the same server; the rollout pool retries them (and a few more, see
//! `cotrain_rollout_client::pool`) on another worker.

use tonic::{Code, Status};

/// The server restarting, overloaded, or late: the same call may succeed later.
pub fn is_transient(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::Unavailable
            | Code::Unknown
            | Code::ResourceExhausted
            | Code::DeadlineExceeded
            | Code::Aborted
            | Code::Cancelled
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_not_transient() {
        assert!(is_transient(&Status::unavailable("restarting")));
        assert!(is_transient(&Status::deadline_exceeded("late")));
        for refused in [
            Status::invalid_argument("bad"),
            Status::unauthenticated("token"),
            Status::internal("model error"),
            Status::failed_precondition("version"),
        ] {
            assert!(!is_transient(&refused), "{refused:?}");
        }
    }
}
