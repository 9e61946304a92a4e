//! Why a service refused a call, in gRPC metadata rather than in the message text, so that a
//! client's failover does not change when an error is reworded: `cotrain-refusal` names the reason
//! and, for version refusals, `cotrain-current-version` carries the server's version.

use tonic::Status;
use tonic::metadata::MetadataValue;

/// The metadata key naming the reason.
pub const REASON_KEY: &str = "cotrain-refusal";
/// The metadata key with the server's current policy version (version refusals).
pub const CURRENT_VERSION_KEY: &str = "cotrain-current-version";

/// The refusals a client acts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The worker's policy is older than the request needs (retry elsewhere or after a push).
    StalePolicy,
    /// A weight update's version is not newer than the worker's (see the current version).
    VersionNotNewer,
    /// The worker serves no verifier of that name (another worker may).
    UnknownVerifier,
}

impl Refusal {
    fn as_str(self) -> &'static str {
        match self {
            Self::StalePolicy => "stale-policy",
            Self::VersionNotNewer => "version-not-newer",
            Self::UnknownVerifier => "unknown-verifier",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        [
            Self::StalePolicy,
            Self::VersionNotNewer,
            Self::UnknownVerifier,
        ]
        .into_iter()
        .find(|r| r.as_str() == s)
    }

    /// Marks `status` with this reason and, if given, the server's current version.
    pub fn mark(self, mut status: Status, current_version: Option<u64>) -> Status {
        let md = status.metadata_mut();
        md.insert(REASON_KEY, MetadataValue::from_static(self.as_str()));
        if let Some(v) = current_version {
            md.insert(CURRENT_VERSION_KEY, MetadataValue::from(v));
        }
        status
    }

    /// The reason `status` carries, if any.
    pub fn of(status: &Status) -> Option<Self> {
        status
            .metadata()
            .get(REASON_KEY)
            .and_then(|v| v.to_str().ok())
            .and_then(Self::parse)
    }
}

/// The server's current version that a version refusal carries.
pub fn current_version(status: &Status) -> Option<u64> {
    status
        .metadata()
        .get(CURRENT_VERSION_KEY)
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_marked_status_reads_back_whatever_its_message() {
        let s =
            Refusal::VersionNotNewer.mark(Status::failed_precondition("reworded at will"), Some(7));
        assert_eq!(Refusal::of(&s), Some(Refusal::VersionNotNewer));
        assert_eq!(current_version(&s), Some(7));
        let plain = Status::failed_precondition(
            "weight update version 3 is not newer than the current version 3",
        );
        assert_eq!(Refusal::of(&plain), None, "the message text is never read");
    }
}
