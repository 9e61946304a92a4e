//! Namespace isolation with bubblewrap: the argument list for one run.
//!
//! Every run gets new user, PID, network, IPC, UTS, cgroup and mount namespaces
//! (`--unshare-all`), dies with its parent, runs in a new session (no terminal to inject input
//! into), and sees only: `/usr` and the top-level links into it, the Python installation if it
//! lives elsewhere, the dynamic loader cache, a minimal `/dev`, its own `/proc`, and two private
//! size-capped tmpfs (`/sandbox`, the working directory, and `/tmp`). No home directory, no
//! project checkout, no `/etc` beyond the loader cache.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use super::environment::{WORKDIR, minimal_env};

/// Where the harness is mounted inside the sandbox.
pub const HARNESS_PATH: &str = "/cotrain/harness.py";

/// What the mount layout depends on; computed once at start-up.
#[derive(Debug, Clone)]
pub struct Layout {
    pub bwrap: PathBuf,
    /// The interpreter, by its real (symlink-free) path.
    pub python: PathBuf,
    /// Extra read-only trees the interpreter needs (its prefix when outside `/usr`).
    pub extra_ro: Vec<PathBuf>,
    /// The harness file on the host.
    pub harness: PathBuf,
}

fn push<S: Into<OsString>>(args: &mut Vec<OsString>, items: impl IntoIterator<Item = S>) {
    args.extend(items.into_iter().map(Into::into));
}

/// Top-level entries of `/` that python's loader may need; links are recreated as links.
const ROOT_ENTRIES: [&str; 6] = ["/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32"];

impl Layout {
    /// bwrap's arguments up to and including the command (python running the harness).
    pub fn bwrap_args(&self, tmpfs_size_mb: u64) -> Vec<OsString> {
        let mut a: Vec<OsString> = Vec::new();
        push(
            &mut a,
            ["--unshare-all", "--die-with-parent", "--new-session"],
        );
        push(&mut a, ["--hostname", "sandbox"]);
        push(&mut a, ["--ro-bind", "/usr", "/usr"]);
        for entry in ROOT_ENTRIES {
            let p = Path::new(entry);
            match std::fs::read_link(p) {
                Ok(target) => {
                    a.push("--symlink".into());
                    a.push(target.into_os_string());
                    a.push(entry.into());
                }
                Err(_) if p.is_dir() => push(&mut a, ["--ro-bind", entry, entry]),
                Err(_) => {}
            }
        }
        for dir in &self.extra_ro {
            a.push("--ro-bind".into());
            a.push(dir.clone().into_os_string());
            a.push(dir.clone().into_os_string());
        }
        push(
            &mut a,
            ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"],
        );
        push(&mut a, ["--proc", "/proc", "--dev", "/dev"]);
        let size = (tmpfs_size_mb * 1024 * 1024).to_string();
        push(&mut a, ["--size", &size, "--tmpfs", "/tmp"]);
        push(&mut a, ["--size", &size, "--tmpfs", WORKDIR]);
        a.push("--ro-bind".into());
        a.push(self.harness.clone().into_os_string());
        a.push(HARNESS_PATH.into());
        // bwrap's root is a tmpfs without a size limit: make it read-only so the only writable
        // places are the two size-capped ones.
        push(&mut a, ["--remount-ro", "/"]);
        push(&mut a, ["--chdir", WORKDIR, "--clearenv"]);
        for (key, value) in minimal_env(WORKDIR) {
            push(&mut a, ["--setenv".to_string(), key.to_string(), value]);
        }
        a.push("--".into());
        a.push(self.python.clone().into_os_string());
        push(&mut a, ["-I", "-B", HARNESS_PATH]);
        a
    }
}

/// True if `path` is inside one of the trees every layout binds anyway.
pub fn covered_by_base(path: &Path) -> bool {
    path.starts_with("/usr")
        || ROOT_ENTRIES
            .iter()
            .any(|e| path.starts_with(e) && std::fs::read_link(e).is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_isolate_and_hide_the_host() {
        let layout = Layout {
            bwrap: "bwrap".into(),
            python: "/usr/bin/python3.11".into(),
            extra_ro: vec![],
            harness: "/tmp/h/harness.py".into(),
        };
        let args: Vec<String> = layout
            .bwrap_args(64)
            .into_iter()
            .map(|s| s.into_string().unwrap())
            .collect();
        let joined = args.join(" ");
        for needed in [
            "--unshare-all",
            "--die-with-parent",
            "--new-session",
            "--clearenv",
        ] {
            assert!(args.iter().any(|a| a == needed), "missing {needed}");
        }
        assert!(!joined.contains("--share-net"));
        assert!(
            !joined.contains("/root") && !joined.contains("/home") && !joined.contains("/work")
        );
        assert!(joined.ends_with("/usr/bin/python3.11 -I -B /cotrain/harness.py"));
    }
}
