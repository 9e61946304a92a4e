//! The environment a sandboxed program sees: cleared, then a handful of harmless variables, so
//! nothing from the server's environment (tokens, keys) can leak in.

/// Working directory inside the sandbox (a private tmpfs).
pub const WORKDIR: &str = "/sandbox";

/// The only variables set for sandboxed programs.
pub fn minimal_env(workdir: &str) -> Vec<(&'static str, String)> {
    vec![
        ("PATH", "/usr/local/bin:/usr/bin:/bin".to_string()),
        ("HOME", workdir.to_string()),
        // bwrap sets it on --chdir anyway; listed so the probe knows it is expected.
        ("PWD", workdir.to_string()),
        ("TMPDIR", "/tmp".to_string()),
        ("LANG", "C.UTF-8".to_string()),
        ("LC_ALL", "C.UTF-8".to_string()),
    ]
}
