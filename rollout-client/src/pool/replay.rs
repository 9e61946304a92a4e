//! The latest weight update of every agent, kept so that a worker that joins or restarts mid-run
//! can be brought to the current policy before it gets training requests.
//!
//! A full update (or an adapter, which workers merge into their own base weights) replaces the
//! previous one; a partial update of parameters is merged into the last full one, so the kept
//! update always takes a fresh worker to the current weights.
//!
//! Chunked updates are kept **on disk**, one file per agent in the pool's replay directory, not in
//! memory: a second copy of every policy in the learner's memory for the whole run would cost as
//! much as the policy itself (about 12 GB for a 3B policy in f32). The file is written while the
//! push streams the same tensors to the workers, and a catch-up streams it back chunk by chunk, so
//! memory holds one chunk, not one policy. Each version gets a file of its own; the previous one is
//! removed once no catch-up still reads it.
//!
//! A shared-memory update is kept as its file message; its writer holds [`Replay::lock`] while it
//! rewrites the file, and a catch-up holds it while a worker reads the file, so no worker reads a
//! half-written file.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cotrain_proto::rollout::{
    ShmWeights, TensorChunk, UpdateHeader, UpdateWeightsRequest, update_weights_request::Item,
};

use crate::wire::{UpdatedTensor, WireDType};

/// The payload of a kept update.
#[derive(Clone, Debug)]
pub(super) enum Body {
    /// A chunked update, in a file of the replay directory.
    File(Arc<SpillFile>),
    /// A shared-memory update: the file message workers are sent.
    Shm(ShmWeights),
    /// The update could not be written to disk; a worker behind it cannot be caught up.
    Lost(String),
}

/// The latest update of one agent.
#[derive(Clone, Debug)]
pub(super) struct Latest {
    pub(super) header: UpdateHeader,
    pub(super) body: Body,
}

/// A kept update's file; removed when the last holder (the store, or a catch-up reading it) lets go.
#[derive(Debug)]
pub(super) struct SpillFile {
    path: PathBuf,
}

impl Drop for SpillFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The replay directory, removed with the pool.
struct SpillDir {
    path: PathBuf,
    /// Made on the first write, so a pool that never pushes leaves nothing behind.
    made: std::sync::Once,
}

impl Drop for SpillDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

pub(super) struct Replay {
    dir: SpillDir,
    latest: Mutex<HashMap<String, Latest>>,
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Serialises the writes of one agent's file (pushes of one agent do not overlap, but a merge
    /// must read the file the previous write left).
    writing: Mutex<HashMap<String, Arc<Mutex<()>>>>,
    /// Bumped by every record: a catch-up that raced a push sees it and goes round again.
    generation: AtomicU64,
    files: AtomicU64,
    /// The highest version pushed of each agent, from the moment its push starts (before it is
    /// kept): a worker that took a push still being kept is not "ahead" of the pool.
    announced: Mutex<HashMap<String, u64>>,
}

impl Replay {
    /// A store whose files go in a new directory under `parent` (the system's temporary directory
    /// when `None`).
    pub(super) fn new(parent: Option<&Path>) -> Self {
        let parent = parent
            .map(Path::to_path_buf)
            .unwrap_or_else(std::env::temp_dir);
        remove_orphans(&parent);
        let path = parent.join(format!(
            ".cotrain-replay-{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        ));
        Self {
            dir: SpillDir {
                path,
                made: std::sync::Once::new(),
            },
            latest: Mutex::default(),
            locks: Mutex::default(),
            writing: Mutex::default(),
            generation: AtomicU64::new(0),
            files: AtomicU64::new(0),
            announced: Mutex::default(),
        }
    }

    /// Says a push of `agent`'s `version` is starting.
    pub(super) fn announce(&self, agent: &str, version: u64) {
        let mut a = self.announced.lock().expect("replay lock");
        let v = a.entry(agent.to_string()).or_default();
        *v = (*v).max(version);
    }

    /// The highest version of `agent` this pool has pushed or is pushing.
    pub(super) fn announced(&self, agent: &str) -> Option<u64> {
        self.announced
            .lock()
            .expect("replay lock")
            .get(agent)
            .copied()
    }

    /// The lock a shared-memory writer and readers of `agent`'s file hold.
    pub(super) fn lock(&self, agent: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.locks
            .lock()
            .expect("replay lock")
            .entry(agent.to_string())
            .or_default()
            .clone()
    }

    pub(super) fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// Keeps a shared-memory update (a version older than the kept one is ignored).
    pub(super) fn record_shm(&self, header: &UpdateHeader, shm: &ShmWeights) {
        self.install(header.clone(), Body::Shm(shm.clone()));
    }

    /// Writes a chunked update to the replay directory and keeps it (a version older than the kept
    /// one is ignored). Blocking: file I/O. A partial update of parameters is merged with the kept
    /// full one as the file is written, one tensor in memory at a time. A failed write is kept as
    /// [`Body::Lost`] (catch-ups then say why they cannot proceed) and returned.
    pub(super) fn record_chunks(
        &self,
        header: &UpdateHeader,
        tensors: &[UpdatedTensor],
    ) -> Result<(), String> {
        let guard = self
            .writing
            .lock()
            .expect("replay lock")
            .entry(header.agent.clone())
            .or_default()
            .clone();
        let _writing = guard.lock().expect("replay write lock");
        let base = {
            let latest = self.latest.lock().expect("replay lock");
            match latest.get(&header.agent) {
                Some(l) if l.header.version > header.version => return Ok(()),
                Some(Latest {
                    header: old,
                    body: Body::File(file),
                }) if header.partial
                    && header.lora_scaling == 0.0
                    && old.lora_scaling == 0.0
                    && !old.partial =>
                {
                    Some(file.clone())
                }
                _ => None,
            }
        };
        match self.write(header, tensors, base.as_deref()) {
            Ok((file, count)) => {
                let partial = header.partial && base.is_none();
                let header = UpdateHeader {
                    partial,
                    tensor_count: count,
                    ..header.clone()
                };
                self.install(header, Body::File(Arc::new(file)));
                Ok(())
            }
            Err(e) => {
                let why = format!(
                    "writing the kept update to {}: {e}",
                    self.dir.path.display()
                );
                self.install(header.clone(), Body::Lost(why.clone()));
                Err(why)
            }
        }
    }

    fn install(&self, header: UpdateHeader, body: Body) {
        let mut latest = self.latest.lock().expect("replay lock");
        if latest
            .get(&header.agent)
            .is_some_and(|l| l.header.version > header.version)
        {
            return;
        }
        latest.insert(header.agent.clone(), Latest { header, body });
        self.generation.fetch_add(1, Ordering::SeqCst);
    }

    /// Writes `tensors` (over `base`'s, when merging) to a new file; returns it and its tensor count.
    fn write(
        &self,
        header: &UpdateHeader,
        tensors: &[UpdatedTensor],
        base: Option<&SpillFile>,
    ) -> std::io::Result<(SpillFile, u32)> {
        let mut made = Ok(());
        self.dir
            .made
            .call_once(|| made = std::fs::create_dir_all(&self.dir.path));
        made?;
        let n = self.files.fetch_add(1, Ordering::SeqCst);
        let safe: String = header
            .agent
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let path = self
            .dir
            .path
            .join(format!("{safe}-v{}-{n}.weights", header.version));
        // Removed if anything below fails.
        let file = SpillFile { path };
        let mut out = BufWriter::with_capacity(1 << 20, File::create(&file.path)?);
        out.write_all(MAGIC)?;
        let mut count = 0u32;
        let mut written: HashSet<&str> = HashSet::new();
        if let Some(base) = base {
            let by_name: HashMap<&str, &UpdatedTensor> =
                tensors.iter().map(|t| (t.name.as_str(), t)).collect();
            let mut reader = SpillReader::open(&base.path)?;
            while let Some(old) = reader.next_tensor()? {
                match by_name.get(old.name.as_str()) {
                    Some(new) => {
                        write_tensor(&mut out, new)?;
                        written.insert(new.name.as_str());
                    }
                    None => write_tensor(&mut out, &old)?,
                }
                count += 1;
            }
        }
        for t in tensors
            .iter()
            .filter(|t| !written.contains(t.name.as_str()))
        {
            write_tensor(&mut out, t)?;
            count += 1;
        }
        out.into_inner().map_err(|e| e.into_error())?;
        Ok((file, count))
    }

    /// Removes the replay directory now. A write still in flight then fails (and is kept as
    /// [`Body::Lost`]); the pool calls this as it is dropped.
    pub(super) fn remove_dir(&self) {
        let _ = std::fs::remove_dir_all(&self.dir.path);
    }

    /// Every agent's latest update.
    pub(super) fn all(&self) -> Vec<Latest> {
        self.latest
            .lock()
            .expect("replay lock")
            .values()
            .cloned()
            .collect()
    }
}

/// Removes replay directories in `parent` left by processes that no longer run (killed before
/// their pool could remove its own): each holds a copy of a policy.
fn remove_orphans(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(".cotrain-replay-")
            .and_then(|rest| rest.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() && Path::new("/proc/self").exists() {
            tracing::info!(dir = %e.path().display(), "removing the weight replay directory of a process that ended");
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

const MAGIC: &[u8; 8] = b"CTRPLY1\n";

/// One tensor: name length (u32), name, dtype (u8: 0 f32, 1 bf16), rank (u32), dims (i64 each),
/// byte length (u64), bytes; little-endian.
fn write_tensor(out: &mut impl Write, t: &UpdatedTensor) -> std::io::Result<()> {
    out.write_all(&(t.name.len() as u32).to_le_bytes())?;
    out.write_all(t.name.as_bytes())?;
    out.write_all(&[match t.dtype {
        WireDType::F32 => 0,
        WireDType::Bf16 => 1,
    }])?;
    out.write_all(&(t.shape.len() as u32).to_le_bytes())?;
    for d in &t.shape {
        out.write_all(&d.to_le_bytes())?;
    }
    out.write_all(&(t.data.len() as u64).to_le_bytes())?;
    out.write_all(&t.data)
}

/// Where a reader stands in the current tensor.
struct Current {
    name: String,
    dtype: WireDType,
    shape: Vec<i64>,
    len: u64,
    offset: u64,
}

/// Reads a kept update's file back, a tensor or a chunk at a time.
pub(super) struct SpillReader {
    input: BufReader<File>,
    current: Option<Current>,
}

fn invalid(why: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, why.to_string())
}

impl SpillReader {
    fn open(path: &Path) -> std::io::Result<Self> {
        let mut input = BufReader::with_capacity(1 << 20, File::open(path)?);
        let mut magic = [0u8; 8];
        input.read_exact(&mut magic)?;
        if &magic != MAGIC {
            return Err(invalid("not a cotrain replay file"));
        }
        Ok(Self {
            input,
            current: None,
        })
    }

    fn u32(&mut self) -> std::io::Result<u32> {
        let mut b = [0u8; 4];
        self.input.read_exact(&mut b)?;
        Ok(u32::from_le_bytes(b))
    }

    fn u64(&mut self) -> std::io::Result<u64> {
        let mut b = [0u8; 8];
        self.input.read_exact(&mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    /// The next tensor's description, or None at the end of the file.
    fn next_header(&mut self) -> std::io::Result<Option<Current>> {
        let mut b = [0u8; 4];
        match self.input.read_exact(&mut b) {
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            r => r?,
        }
        let mut name = vec![0u8; u32::from_le_bytes(b) as usize];
        self.input.read_exact(&mut name)?;
        let name = String::from_utf8(name).map_err(|_| invalid("tensor name is not UTF-8"))?;
        let mut dtype = [0u8; 1];
        self.input.read_exact(&mut dtype)?;
        let dtype = match dtype[0] {
            0 => WireDType::F32,
            1 => WireDType::Bf16,
            _ => return Err(invalid("unknown dtype")),
        };
        let rank = self.u32()?;
        let shape = (0..rank)
            .map(|_| self.u64().map(|d| d as i64))
            .collect::<std::io::Result<Vec<i64>>>()?;
        let len = self.u64()?;
        Ok(Some(Current {
            name,
            dtype,
            shape,
            len,
            offset: 0,
        }))
    }

    /// The next whole tensor.
    fn next_tensor(&mut self) -> std::io::Result<Option<UpdatedTensor>> {
        let Some(c) = self.next_header()? else {
            return Ok(None);
        };
        let mut data = vec![0u8; c.len as usize];
        self.input.read_exact(&mut data)?;
        Ok(Some(UpdatedTensor {
            name: c.name,
            dtype: c.dtype,
            shape: c.shape,
            data,
        }))
    }

    /// The next chunk message of at most `chunk_bytes` payload bytes, or None at the end.
    fn next_chunk(&mut self, chunk_bytes: usize) -> std::io::Result<Option<TensorChunk>> {
        loop {
            if self.current.as_ref().is_none_or(|c| c.offset == c.len) {
                // An empty tensor still travels as one empty chunk, as the in-memory stream sends none:
                // skip it like that stream does.
                match self.next_header()? {
                    Some(c) => self.current = Some(c),
                    None => return Ok(None),
                }
                if self.current.as_ref().is_some_and(|c| c.len == 0) {
                    continue;
                }
            }
            let c = self.current.as_mut().expect("set above");
            let n = (c.len - c.offset).min(chunk_bytes.max(1) as u64) as usize;
            let mut data = vec![0u8; n];
            self.input.read_exact(&mut data)?;
            let chunk = TensorChunk {
                name: c.name.clone(),
                dtype: c.dtype.to_proto() as i32,
                shape: c.shape.clone(),
                offset: c.offset,
                data,
            };
            c.offset += n as u64;
            return Ok(Some(chunk));
        }
    }
}

/// The update in `file` as the message stream of a push (header first, then its chunks, read from
/// disk one at a time). A read error ends the stream early; the worker then refuses the update as
/// incomplete (its tensor count is not reached), which fails the catch-up with the worker's reason.
pub(super) fn file_update_stream(
    header: UpdateHeader,
    file: Arc<SpillFile>,
    chunk_bytes: usize,
) -> impl futures::Stream<Item = UpdateWeightsRequest> + Send + 'static {
    let head = futures::stream::once(async move {
        UpdateWeightsRequest {
            item: Some(Item::Header(header)),
        }
    });
    let state: Option<(Option<SpillReader>, Arc<SpillFile>)> = Some((None, file));
    let body = futures::stream::unfold(state, move |state| async move {
        let (reader, file) = state?;
        let step = tokio::task::spawn_blocking(move || {
            let mut reader = match reader {
                Some(r) => r,
                None => SpillReader::open(&file.path)?,
            };
            let chunk = reader.next_chunk(chunk_bytes)?;
            Ok::<_, std::io::Error>((chunk, reader, file))
        })
        .await;
        match step {
            Ok(Ok((Some(chunk), reader, file))) => Some((
                UpdateWeightsRequest {
                    item: Some(Item::Chunk(chunk)),
                },
                Some((Some(reader), file)),
            )),
            Ok(Ok((None, ..))) => None,
            // A read error or a panicked read task: the stream ends short, so the worker rejects
            // the incomplete update and the catch-up is counted as failed.
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "reading a kept weight update back from disk");
                None
            }
            Err(e) => {
                tracing::warn!(error = %e, "the task reading a kept weight update back from disk failed");
                None
            }
        }
    });
    head.chain(body)
}

use futures::StreamExt as _;

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(name: &str, byte: u8) -> UpdatedTensor {
        UpdatedTensor {
            name: name.into(),
            dtype: WireDType::F32,
            shape: vec![1],
            data: vec![byte; 4],
        }
    }

    fn header(version: u64, partial: bool, lora_scaling: f64) -> UpdateHeader {
        UpdateHeader {
            agent: "a".into(),
            version,
            tensor_count: 0,
            partial,
            lora_scaling,
            probe: None,
        }
    }

    fn kept(r: &Replay) -> (UpdateHeader, Vec<(String, u8)>) {
        let l = r.all().remove(0);
        let Body::File(f) = &l.body else {
            panic!("expected a file")
        };
        let mut reader = SpillReader::open(&f.path).unwrap();
        let mut out = Vec::new();
        while let Some(t) = reader.next_tensor().unwrap() {
            out.push((t.name, t.data[0]));
        }
        (l.header, out)
    }

    #[test]
    fn partial_updates_merge_into_the_last_full_one_on_disk_and_old_versions_are_ignored() {
        let tmp =
            std::env::temp_dir().join(format!("replay-test-{}", uuid::Uuid::new_v4().simple()));
        let r = Replay::new(Some(&tmp));
        r.record_chunks(&header(1, false, 0.0), &[tensor("x", 1), tensor("y", 1)])
            .unwrap();
        r.record_chunks(&header(2, true, 0.0), &[tensor("y", 2), tensor("z", 2)])
            .unwrap();
        let (h, t) = kept(&r);
        assert_eq!((h.version, h.partial, h.tensor_count), (2, false, 3));
        assert_eq!(t, vec![("x".into(), 1), ("y".into(), 2), ("z".into(), 2)]);
        r.record_chunks(&header(1, false, 0.0), &[tensor("x", 9)])
            .unwrap();
        assert_eq!(kept(&r).0.version, 2);
        // An adapter replaces what was kept: workers merge it into their own base weights.
        r.record_chunks(&header(3, true, 2.0), &[tensor("x.lora_A.weight", 3)])
            .unwrap();
        assert_eq!(kept(&r).1, vec![("x.lora_A.weight".into(), 3)]);
        assert_eq!(r.generation(), 3);
        // One file per agent on disk: the superseded versions were removed.
        let dir = std::fs::read_dir(&tmp)
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path();
        // A directory left by a process that is gone is removed by the next pool there.
        let orphan = tmp.join(".cotrain-replay-4194304999-0");
        std::fs::create_dir_all(&orphan).unwrap();
        let other = Replay::new(Some(&tmp));
        assert!(!orphan.exists());
        drop(other);
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        drop(r);
        assert!(!dir.exists(), "the replay directory goes with the pool");
        let _ = std::fs::remove_dir_all(&tmp);
    }

    #[test]
    fn the_file_streams_back_as_the_chunks_a_push_sends() {
        let r = Replay::new(None);
        let tensors = vec![
            UpdatedTensor {
                name: "a".into(),
                dtype: WireDType::Bf16,
                shape: vec![5],
                data: (0..10).collect(),
            },
            UpdatedTensor {
                name: "b".into(),
                dtype: WireDType::F32,
                shape: vec![1],
                data: vec![2; 4],
            },
        ];
        r.record_chunks(&header(1, false, 0.0), &tensors).unwrap();
        let l = r.all().remove(0);
        let Body::File(f) = l.body else {
            panic!("expected a file")
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let from_disk: Vec<UpdateWeightsRequest> =
            rt.block_on(file_update_stream(l.header.clone(), f, 4).collect());
        let from_memory: Vec<UpdateWeightsRequest> =
            rt.block_on(super::super::update_stream(l.header, Arc::new(tensors), 4).collect());
        assert_eq!(from_disk, from_memory);
    }

    #[test]
    fn a_write_that_fails_is_kept_as_lost_with_the_reason() {
        let blocker =
            std::env::temp_dir().join(format!("replay-blocker-{}", uuid::Uuid::new_v4().simple()));
        std::fs::write(&blocker, b"a file, not a directory").unwrap();
        let r = Replay::new(Some(&blocker));
        let err = r
            .record_chunks(&header(1, false, 0.0), &[tensor("x", 1)])
            .unwrap_err();
        assert!(err.contains("writing the kept update"), "{err}");
        assert!(matches!(r.all()[0].body, Body::Lost(_)));
        let _ = std::fs::remove_file(&blocker);
    }
}
