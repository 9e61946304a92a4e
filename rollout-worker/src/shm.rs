//! The shared-memory weight transport, for a client on the worker's host: the worker's side.
//!
//! Instead of streaming a 0.5 GB update as gRPC chunks, the client writes the tensors' raw bytes
//! into one file directly under [`SHM_DIR`] (named [`SHM_PREFIX`]`*`, see
//! `cotrain_rollout_client::shm::ShmFile`) and sends a
//! [`ShmWeights`] message naming it, with each tensor's name, dtype, shape and offset. The worker
//! ([`read_update`]) accepts it only when started with `--allow-shm-weights`, only from a regular
//! file directly in that directory (opened with `O_NOFOLLOW`, so a symlink is refused), checks the
//! file's size against the message and every tensor's range against the file, and loads the
//! tensors through the same [`UpdateAssembler`] checks as chunks (known names, same shapes,
//! supported dtype, complete coverage). The worker reads the file before it answers, so the client
//! may overwrite it for its next push once every worker has answered.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use cotrain_proto::rollout::ShmWeights;

use cotrain_proto::shm::{SHM_DIR, SHM_FLAG, SHM_PREFIX};

use crate::error::{Result, WorkerError};
use crate::weights::{CompleteUpdate, UpdateAssembler};

/// Whether and from where a worker accepts shared-memory updates.
#[derive(Clone, Debug)]
pub struct ShmPolicy {
    /// Off unless the worker was started with `--allow-shm-weights`.
    pub allowed: bool,
    /// The directory files must lie directly in ([`SHM_DIR`] outside tests).
    pub dir: PathBuf,
}

impl ShmPolicy {
    /// The policy of a worker started with or without the opt-in.
    pub fn new(allowed: bool) -> Self {
        Self {
            allowed,
            dir: PathBuf::from(SHM_DIR),
        }
    }
}

fn refuse(msg: impl std::fmt::Display) -> WorkerError {
    WorkerError::BadUpdate(format!("shm: {msg}"))
}

/// Checks `path` names a file directly in the policy's directory with the [`SHM_PREFIX`], and
/// opens it without following a symlink; the open file must be a regular file.
fn open_checked(policy: &ShmPolicy, path: &str) -> Result<File> {
    let p = Path::new(path);
    let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if !p.is_absolute() || p.parent() != Some(policy.dir.as_path()) || path.contains("/../") {
        return Err(refuse(format!(
            "path `{path}` is not directly in {}",
            policy.dir.display()
        )));
    }
    if !name.starts_with(SHM_PREFIX) || name.len() == SHM_PREFIX.len() {
        return Err(refuse(format!(
            "file name `{name}` does not start with `{SHM_PREFIX}`"
        )));
    }
    // O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below).
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(p)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => refuse(format!("`{path}` is a symlink")),
            Some(libc::ENOENT) => WorkerError::ShmUnavailable(format!(
                "`{path}` does not exist (is the client on this worker's host, with the same {SHM_DIR}?)"
            )),
            _ => WorkerError::ShmUnavailable(format!("cannot open `{path}`: {e}")),
        })?;
    let meta = file
        .metadata()
        .map_err(|e| WorkerError::ShmUnavailable(format!("cannot stat `{path}`: {e}")))?;
    if !meta.file_type().is_file() {
        return Err(refuse(format!("`{path}` is not a regular file")));
    }
    Ok(file)
}

/// Loads a shared-memory update into `assembler` (whose header came first in the stream) and
/// finishes it; see the module docs for every check.
pub fn read_update(
    policy: &ShmPolicy,
    msg: &ShmWeights,
    mut assembler: UpdateAssembler,
) -> Result<CompleteUpdate> {
    if !policy.allowed {
        return Err(WorkerError::ShmUnavailable(format!(
            "shared-memory weight updates are disabled on this worker (start it with {SHM_FLAG})"
        )));
    }
    let file = open_checked(policy, &msg.path)?;
    let actual = file
        .metadata()
        .map_err(|e| WorkerError::ShmUnavailable(format!("cannot stat `{}`: {e}", msg.path)))?
        .len();
    if actual != msg.size {
        return Err(refuse(format!(
            "`{}` has {actual} bytes, the message declares {}",
            msg.path, msg.size
        )));
    }
    let mut ranges: Vec<(u64, u64, &str)> = Vec::with_capacity(msg.tensors.len());
    for t in &msg.tensors {
        assembler.push_whole(&t.name, t.dtype, &t.shape, |buf| {
            let end = t
                .offset
                .checked_add(buf.len() as u64)
                .filter(|&e| e <= actual)
                .ok_or_else(|| {
                    refuse(format!(
                        "tensor `{}`: bytes {}..{} run past the file's {actual} bytes",
                        t.name,
                        t.offset,
                        t.offset as u128 + buf.len() as u128
                    ))
                })?;
            ranges.push((t.offset, end, &t.name));
            file.read_exact_at(buf, t.offset).map_err(|e| {
                refuse(format!(
                    "tensor `{}`: reading bytes {}..{end}: {e}",
                    t.name, t.offset
                ))
            })
        })?;
    }
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(refuse(format!(
                "tensors `{}` and `{}` overlap in the file",
                w[0].2, w[1].2
            )));
        }
    }
    assembler.finish()
}

#[cfg(test)]
mod tests {
    use cotrain_proto::wire::WireDType;
    // The client's writer, a dev-dependency: the worker itself does not depend on the client.
    use cotrain_rollout_client::shm::ShmFile;
    use std::collections::HashMap;

    use cotrain_proto::rollout::UpdateHeader;

    use super::*;

    fn params() -> HashMap<String, Vec<i64>> {
        HashMap::from([("a".to_string(), vec![2, 3]), ("b".to_string(), vec![4])])
    }

    fn assembler(tensor_count: u32, partial: bool) -> UpdateAssembler {
        let header = UpdateHeader {
            agent: "x".into(),
            version: 1,
            tensor_count,
            partial,
            lora_scaling: 0.0,
            probe: None,
        };
        UpdateAssembler::new(header, params(), 0).unwrap()
    }

    fn policy(dir: &Path) -> ShmPolicy {
        ShmPolicy {
            allowed: true,
            dir: dir.to_path_buf(),
        }
    }

    fn full_file(dir: &Path) -> (ShmFile, Vec<u8>, Vec<u8>) {
        let a: Vec<u8> = (0..24).collect();
        let b: Vec<u8> = (100..116).collect();
        let mut f = ShmFile::create_in(dir, "x", 1).unwrap();
        f.write_tensor("a", WireDType::F32, &[2, 3], &a).unwrap();
        f.write_tensor("b", WireDType::F32, &[4], &b).unwrap();
        (f, a, b)
    }

    fn err(r: Result<CompleteUpdate>) -> WorkerError {
        match r {
            Ok(_) => panic!("expected a refusal"),
            Err(e) => e,
        }
    }

    #[test]
    fn file_round_trips_and_is_deleted_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let (f, a, b) = full_file(dir.path());
        let name = f.path().file_name().unwrap().to_str().unwrap().to_string();
        assert!(
            name.starts_with(&format!("{SHM_PREFIX}{}-x-v1-", std::process::id())),
            "{name}"
        );
        let msg = f.message();
        assert_eq!(msg.size, 40);
        assert_eq!(msg.tensors[1].offset, 24);
        let done = read_update(&policy(dir.path()), &msg, assembler(2, false)).unwrap();
        assert_eq!(done.version, 1);
        assert_eq!(done.bytes_received, 40);
        assert!(done.tensors.is_empty(), "whole tensors come as `loaded`");
        let bytes = |t: &tch::Tensor| {
            let mut v = vec![0u8; t.numel() * 4];
            t.copy_data_u8(&mut v, t.numel());
            v
        };
        assert_eq!(
            (done.loaded[0].0.as_str(), bytes(&done.loaded[0].1)),
            ("a", a)
        );
        assert_eq!(
            (done.loaded[1].0.as_str(), bytes(&done.loaded[1].1)),
            ("b", b)
        );
        assert_eq!(done.loaded[0].1.size(), vec![2, 3]);
        assert_eq!(done.len(), 2);
        let converted = done.into_tensors(tch::Kind::BFloat16, tch::Device::Cpu);
        assert_eq!(converted["b"].kind(), tch::Kind::BFloat16);
        let path = f.path().to_path_buf();
        drop(f);
        assert!(!path.exists(), "the file outlived its guard");
    }

    #[test]
    fn a_rewound_file_carries_only_the_new_update() {
        let dir = tempfile::tempdir().unwrap();
        let (mut f, _, _) = full_file(dir.path());
        let path = f.path().to_path_buf();
        f.rewind().unwrap();
        let a2: Vec<u8> = (50..74).collect();
        f.write_tensor("a", WireDType::F32, &[2, 3], &a2).unwrap();
        f.finish().unwrap();
        assert_eq!(f.path(), path, "rewinding must keep the file");
        let msg = f.message();
        assert_eq!((msg.size, msg.tensors.len()), (24, 1));
        assert_eq!(
            std::fs::metadata(&path).unwrap().len(),
            24,
            "the old tail must be cut"
        );
        let header = UpdateHeader {
            agent: "x".into(),
            version: 2,
            tensor_count: 1,
            partial: true,
            lora_scaling: 0.0,
            probe: None,
        };
        let done = read_update(
            &policy(dir.path()),
            &msg,
            UpdateAssembler::new(header, params(), 1).unwrap(),
        )
        .unwrap();
        let mut v = vec![0u8; 24];
        done.loaded[0].1.copy_data_u8(&mut v, 6);
        assert_eq!(v, a2, "the worker read stale bytes");
    }

    #[test]
    fn files_of_dead_processes_are_removed_and_live_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        // Above Linux's largest pid_max, so no process has it.
        let dead = dir
            .path()
            .join(format!("{SHM_PREFIX}4194305-agent0-v3-0123"));
        let alive = dir.path().join(format!("{SHM_PREFIX}1-agent0-v3-4567"));
        let other = dir.path().join("unrelated-4194305");
        for p in [&dead, &alive, &other] {
            std::fs::write(p, b"x").unwrap();
        }
        let f = ShmFile::create_in(dir.path(), "agent1", 1).unwrap();
        assert!(!dead.exists(), "a dead process's file was kept");
        assert!(
            alive.exists() && other.exists() && f.path().exists(),
            "a live or foreign file was removed"
        );
    }

    #[test]
    fn partial_update_through_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let mut f = ShmFile::create_in(dir.path(), "x", 1).unwrap();
        f.write_tensor("b", WireDType::Bf16, &[4], &[1; 8]).unwrap();
        let done = read_update(&policy(dir.path()), &f.message(), assembler(1, true)).unwrap();
        assert_eq!(done.loaded[0].1.kind(), tch::Kind::BFloat16);
    }

    #[test]
    fn refused_without_the_opt_in_naming_the_flag() {
        let dir = tempfile::tempdir().unwrap();
        let (f, ..) = full_file(dir.path());
        let p = ShmPolicy {
            allowed: false,
            dir: dir.path().to_path_buf(),
        };
        let e = err(read_update(&p, &f.message(), assembler(2, false)));
        assert!(e.to_string().contains(SHM_FLAG), "{e}");
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    }

    #[test]
    fn refuses_files_outside_the_directory_or_without_the_prefix() {
        let dir = tempfile::tempdir().unwrap();
        let other = tempfile::tempdir().unwrap();
        let (f, ..) = full_file(other.path());
        let e = err(read_update(
            &policy(dir.path()),
            &f.message(),
            assembler(2, false),
        ));
        assert!(e.to_string().contains("is not directly in"), "{e}");
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        let mut msg = f.message();
        let (other_name, file_name) = (
            other.path().file_name().unwrap(),
            f.path().file_name().unwrap(),
        );
        msg.path = format!(
            "{}/../{}/{}",
            dir.path().display(),
            other_name.to_str().unwrap(),
            file_name.to_str().unwrap()
        );
        assert!(
            err(read_update(&policy(dir.path()), &msg, assembler(2, false)))
                .to_string()
                .contains("not directly in")
        );
        msg.path = dir.path().join("weights.bin").display().to_string();
        std::fs::write(&msg.path, [0u8; 40]).unwrap();
        let e = err(read_update(&policy(dir.path()), &msg, assembler(2, false)));
        assert!(e.to_string().contains("does not start with"), "{e}");
        msg.path = "cotrain-weights-relative".into();
        assert!(
            err(read_update(&policy(dir.path()), &msg, assembler(2, false)))
                .to_string()
                .contains("not directly in")
        );
    }

    #[test]
    fn refuses_symlinks_and_non_regular_files() {
        let dir = tempfile::tempdir().unwrap();
        let other = tempfile::tempdir().unwrap();
        let (f, ..) = full_file(other.path());
        let mut msg = f.message();
        let link = dir.path().join(format!("{SHM_PREFIX}link"));
        std::os::unix::fs::symlink(f.path(), &link).unwrap();
        msg.path = link.display().to_string();
        let e = err(read_update(&policy(dir.path()), &msg, assembler(2, false)));
        assert!(e.to_string().contains("is a symlink"), "{e}");
        let sub = dir.path().join(format!("{SHM_PREFIX}dir"));
        std::fs::create_dir(&sub).unwrap();
        msg.path = sub.display().to_string();
        let e = err(read_update(&policy(dir.path()), &msg, assembler(2, false)));
        assert!(e.to_string().contains("not a regular file"), "{e}");
        msg.path = dir
            .path()
            .join(format!("{SHM_PREFIX}missing"))
            .display()
            .to_string();
        let e = err(read_update(&policy(dir.path()), &msg, assembler(2, false)));
        assert!(e.to_string().contains("does not exist"), "{e}");
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    }

    #[test]
    fn refuses_truncated_files_and_ranges_past_the_end() {
        let dir = tempfile::tempdir().unwrap();
        let (f, ..) = full_file(dir.path());
        std::fs::OpenOptions::new()
            .write(true)
            .open(f.path())
            .unwrap()
            .set_len(30)
            .unwrap();
        let e = err(read_update(
            &policy(dir.path()),
            &f.message(),
            assembler(2, false),
        ));
        assert!(
            e.to_string()
                .contains("has 30 bytes, the message declares 40"),
            "{e}"
        );
        let mut msg = f.message();
        msg.size = 30;
        let e = err(read_update(&policy(dir.path()), &msg, assembler(2, false)));
        assert!(
            e.to_string()
                .contains("tensor `b`: bytes 24..40 run past the file's 30 bytes"),
            "{e}"
        );
        msg.tensors[1].offset = u64::MAX;
        assert!(
            err(read_update(&policy(dir.path()), &msg, assembler(2, false)))
                .to_string()
                .contains("run past")
        );
    }

    #[test]
    fn refuses_wrong_shapes_unknown_names_overlaps_and_missing_tensors() {
        let dir = tempfile::tempdir().unwrap();
        let (f, ..) = full_file(dir.path());
        let p = policy(dir.path());
        let mut msg = f.message();
        msg.tensors[1].shape = vec![2, 2];
        let e = err(read_update(&p, &msg, assembler(2, false)));
        assert!(
            e.to_string()
                .contains("tensor `b`: shape [2, 2] does not match the model's [4]"),
            "{e}"
        );
        let mut msg = f.message();
        msg.tensors[1].name = "nope".into();
        assert!(
            err(read_update(&p, &msg, assembler(2, false)))
                .to_string()
                .contains("no parameter")
        );
        let mut msg = f.message();
        msg.tensors[0].dtype = 0;
        assert!(
            err(read_update(&p, &msg, assembler(2, false)))
                .to_string()
                .contains("unsupported dtype")
        );
        let mut msg = f.message();
        msg.tensors[1].offset = 16;
        let e = err(read_update(&p, &msg, assembler(2, false)));
        assert!(e.to_string().contains("overlap in the file"), "{e}");
        let mut msg = f.message();
        msg.tensors.pop();
        let e = err(read_update(&p, &msg, assembler(2, false)));
        assert!(
            e.to_string().contains("after 1 of header.tensor_count = 2"),
            "{e}"
        );
        let mut msg = f.message();
        msg.tensors[1] = msg.tensors[0].clone();
        assert!(
            err(read_update(&p, &msg, assembler(2, false)))
                .to_string()
                .contains("overlap")
        );
    }
}
