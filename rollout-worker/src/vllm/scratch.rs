//! The worker's private directories for its engines (sockets, the worker extension, weight and
//! adapter files), named after the worker's pid so that a later worker can remove what a killed one
//! left behind: a SIGKILL gives no chance to clean up, and weight files on /dev/shm hold memory
//! (a model's worth each) until someone removes them.

use std::path::Path;

/// A fresh private (0700) directory in `parent`, named `cotrain-vllm-{kind}-{pid}-…`.
pub(crate) fn private_dir(parent: &Path, kind: &str) -> std::io::Result<tempfile::TempDir> {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::Builder::new()
        .prefix(&format!("cotrain-vllm-{kind}-{}-", std::process::id()))
        .tempdir_in(parent)?;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700))?;
    Ok(dir)
}

/// Removes this user's `cotrain-vllm-{kind}-{pid}-…` directories in `parent` whose worker is no
/// longer running; returns how many. A pid in use again keeps its directories (a later sweep gets
/// them), so a running worker's are never touched.
pub(crate) fn sweep_dead(parent: &Path, kind: &str) -> usize {
    use std::os::unix::fs::MetadataExt;
    let prefix = format!("cotrain-vllm-{kind}-");
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let Ok(entries) = std::fs::read_dir(parent) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(&prefix))
            .and_then(|rest| rest.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        let ours = entry.metadata().is_ok_and(|m| m.is_dir() && m.uid() == me);
        if ours
            && !Path::new(&format!("/proc/{pid}")).exists()
            && std::fs::remove_dir_all(entry.path()).is_ok()
        {
            removed += 1;
        }
    }
    removed
}

/// Sweeps the directories of dead workers once per process, before the first engine starts.
pub(crate) fn sweep_once() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let tmp = std::env::temp_dir();
        let mut removed = sweep_dead(&tmp, "engine") + sweep_dead(&tmp, "weights");
        let shm = Path::new("/dev/shm");
        if shm.is_dir() {
            removed += sweep_dead(shm, "weights");
        }
        if removed > 0 {
            tracing::info!(
                removed,
                "removed the vllm scratch directories of workers no longer running"
            );
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_dead_workers_directories_go() {
        let parent = tempfile::tempdir().unwrap();
        let mine = private_dir(parent.path(), "weights").unwrap();
        // A pid above the kernel's maximum is never running.
        let dead = parent.path().join("cotrain-vllm-weights-4294967-abc");
        std::fs::create_dir(&dead).unwrap();
        std::fs::write(dead.join("v3.safetensors"), b"x").unwrap();
        let other_kind = parent.path().join("cotrain-vllm-engine-4294967-abc");
        std::fs::create_dir(&other_kind).unwrap();
        assert_eq!(sweep_dead(parent.path(), "weights"), 1);
        assert!(!dead.exists());
        assert!(mine.path().exists() && other_kind.exists());
    }
}
