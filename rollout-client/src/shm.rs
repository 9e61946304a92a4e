//! The client side of the shared-memory weight transport: [`ShmFile`] writes one update's tensors
//! into a file under [`SHM_DIR`] and names it in a [`ShmWeights`] message; the worker
//! (`cotrain_rollout_worker::shm`) checks and reads it. A client that pushes every step keeps one
//! file per agent and overwrites it ([`ShmFile::rewind`]) once every worker has answered the
//! previous push (the worker reads the file before it answers). [`ShmFile`] deletes the file when
//! dropped, and files of processes that died without dropping theirs are removed by the next
//! [`ShmFile::create`].

use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use cotrain_proto::rollout::{ShmTensor, ShmWeights};

use crate::wire::WireDType;

/// The naming rules the worker checks, defined in `cotrain-proto` so that the worker does not
/// depend on the client; re-exported for the client's users.
pub use cotrain_proto::shm::{SHM_DIR, SHM_FLAG, SHM_PREFIX};

/// An update file being written in [`SHM_DIR`]; the file is deleted when this is dropped.
#[derive(Debug)]
pub struct ShmFile {
    path: PathBuf,
    file: File,
    size: u64,
    tensors: Vec<ShmTensor>,
}

impl ShmFile {
    /// Creates a new, empty file (mode 0600, `O_EXCL`) named after this process, the agent, the
    /// version and a random suffix.
    pub fn create(agent: &str, version: u64) -> std::io::Result<Self> {
        Self::create_in(Path::new(SHM_DIR), agent, version)
    }

    /// As [`Self::create`], in another directory (tests of the refusals).
    pub fn create_in(dir: &Path, agent: &str, version: u64) -> std::io::Result<Self> {
        remove_stale(dir);
        let agent: String = agent
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                    c
                } else {
                    '_'
                }
            })
            .take(64)
            .collect();
        let name = format!(
            "{SHM_PREFIX}{}-{agent}-v{version}-{}",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        );
        let path = dir.join(name);
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)?;
        Ok(Self {
            path,
            file,
            size: 0,
            tensors: Vec::new(),
        })
    }

    /// Where the file is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one tensor's little-endian, row-major bytes (`data.len()` must be numel times the
    /// dtype's size; the worker checks it).
    pub fn write_tensor(
        &mut self,
        name: &str,
        dtype: WireDType,
        shape: &[i64],
        data: &[u8],
    ) -> std::io::Result<()> {
        self.file.write_all(data)?;
        self.tensors.push(ShmTensor {
            name: name.to_string(),
            dtype: dtype.to_proto() as i32,
            shape: shape.to_vec(),
            offset: self.size,
        });
        self.size += data.len() as u64;
        Ok(())
    }

    /// Starts the file over for the next update, overwriting the same pages. Only once every
    /// reader of the previous contents is done: workers read the file before answering the push.
    pub fn rewind(&mut self) -> std::io::Result<()> {
        self.file.seek(SeekFrom::Start(0))?;
        self.size = 0;
        self.tensors.clear();
        Ok(())
    }

    /// Cuts the file to what was written since it was created or rewound (a smaller update after
    /// a larger one would otherwise leave the old tail and fail the worker's size check).
    pub fn finish(&mut self) -> std::io::Result<()> {
        self.file.set_len(self.size)
    }

    /// Tensors written so far.
    pub fn tensor_count(&self) -> usize {
        self.tensors.len()
    }

    /// The message naming the file and its tensors.
    pub fn message(&self) -> ShmWeights {
        ShmWeights {
            path: self.path.display().to_string(),
            size: self.size,
            tensors: self.tensors.clone(),
        }
    }
}

impl Drop for ShmFile {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(path = %self.path.display(), error = %e, "cannot delete the shared-memory weight file");
        }
    }
}

/// Deletes update files in `dir` left by processes that are gone (killed before their [`ShmFile`]
/// dropped): the file name carries the writer's pid. Best effort, once per process and directory.
fn remove_stale(dir: &Path) {
    use std::collections::HashSet;
    use std::sync::Mutex;
    static SWEPT: Mutex<Option<HashSet<PathBuf>>> = Mutex::new(None);
    {
        let mut swept = SWEPT.lock().unwrap_or_else(|e| e.into_inner());
        if !swept
            .get_or_insert_with(HashSet::new)
            .insert(dir.to_path_buf())
        {
            return;
        }
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(SHM_PREFIX))
            .and_then(|r| r.split('-').next())
        else {
            continue;
        };
        let Ok(pid) = pid.parse::<u32>() else {
            continue;
        };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            match std::fs::remove_file(entry.path()) {
                Ok(()) => {
                    tracing::info!(path = %entry.path().display(), "removed a weight file left by a dead process")
                }
                Err(e) => {
                    tracing::debug!(path = %entry.path().display(), error = %e, "cannot remove a stale weight file")
                }
            }
        }
    }
}
