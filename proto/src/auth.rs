//! The cluster token: a shared secret that every call changing a service's state (weight and adapter
//! updates) must carry as `authorization: Bearer <token>` metadata. Every binary reads it from a file
//! named by `--cluster-token-file PATH` or the environment variable `COTRAIN_CLUSTER_TOKEN_FILE`,
//! never from the command line itself (where `ps` would show it). Services compare it in constant time.

use std::path::Path;
use std::sync::Arc;

/// The environment variable naming the token file.
pub const TOKEN_FILE_ENV: &str = "COTRAIN_CLUSTER_TOKEN_FILE";
/// The gRPC metadata key the token travels in.
pub const METADATA_KEY: &str = "authorization";

/// See the module docs. `Debug` never prints the secret.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterToken(Arc<str>);

impl std::fmt::Debug for ClusterToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterToken(<redacted>)")
    }
}

impl ClusterToken {
    /// The token in `path` (surrounding whitespace removed; at least 16 characters, printable ASCII).
    pub fn from_file(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cluster token file {}: {e}", path.display()))?;
        let token = text.trim();
        if token.len() < 16 {
            return Err(format!(
                "cluster token file {}: the token must have at least 16 characters, it has {}",
                path.display(),
                token.len()
            ));
        }
        if !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(format!(
                "cluster token file {}: the token must be printable ASCII without spaces",
                path.display()
            ));
        }
        Ok(Self(Arc::from(token)))
    }

    /// The token of `--cluster-token-file` if given, else of `COTRAIN_CLUSTER_TOKEN_FILE` if set,
    /// else none.
    pub fn from_flag_or_env(flag: Option<&Path>) -> Result<Option<Self>, String> {
        match flag {
            Some(p) => Self::from_file(p).map(Some),
            None => match std::env::var_os(TOKEN_FILE_ENV) {
                Some(p) if !p.is_empty() => Self::from_file(Path::new(&p)).map(Some),
                _ => Ok(None),
            },
        }
    }

    /// A fresh random token (192 bits from the system's random source, in hex): a process's own
    /// secret for a service only it talks to (the learner's embedded rollout worker).
    pub fn random() -> Result<Self, String> {
        use std::io::Read as _;
        let mut bytes = [0u8; 24];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut bytes))
            .map_err(|e| format!("/dev/urandom: {e}"))?;
        Ok(Self(Arc::from(
            bytes.iter().map(|b| format!("{b:02x}")).collect::<String>(),
        )))
    }

    /// The metadata value a client sends.
    pub fn bearer(&self) -> String {
        format!("Bearer {}", self.0)
    }

    /// Whether a request's `authorization` value carries this token (constant time in the token).
    pub fn verify(&self, header: Option<&str>) -> bool {
        let Some(given) = header.and_then(|h| h.strip_prefix("Bearer ")) else {
            return false;
        };
        constant_time_eq(given.as_bytes(), self.0.as_bytes())
    }
}

/// Byte equality whose time depends only on the lengths, not on where the bytes differ.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u8 | ((a.len() ^ b.len()) >> 8) as u8;
    for (i, &y) in b.iter().enumerate() {
        diff |= a.get(i).copied().unwrap_or(0) ^ y;
    }
    diff == 0 && a.len() == b.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_read_checked_and_compared() {
        let dir = std::env::temp_dir().join(format!("cotrain-token-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good");
        std::fs::write(&good, "0123456789abcdef-secret\n").unwrap();
        let t = ClusterToken::from_file(&good).unwrap();
        assert!(t.verify(Some("Bearer 0123456789abcdef-secret")));
        assert!(!t.verify(Some("Bearer 0123456789abcdef-secreT")));
        assert!(!t.verify(Some("Bearer 0123456789abcdef-secre")));
        assert!(!t.verify(Some("0123456789abcdef-secret")));
        assert!(!t.verify(None));
        assert_eq!(format!("{t:?}"), "ClusterToken(<redacted>)");
        let short = dir.join("short");
        std::fs::write(&short, "abc").unwrap();
        assert!(
            ClusterToken::from_file(&short)
                .unwrap_err()
                .contains("at least 16")
        );
        assert!(
            ClusterToken::from_file(&dir.join("missing"))
                .unwrap_err()
                .contains("missing")
        );
        assert_eq!(
            ClusterToken::from_flag_or_env(Some(&good)).unwrap(),
            Some(t)
        );
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(constant_time_eq(b"", b""));
        assert!(!constant_time_eq(b"a", b""));
    }
}
