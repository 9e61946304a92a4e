//! The latest weight update of every agent, kept so that a worker that joins or restarts mid-run
//! can be brought to the current policy before it gets training requests.
//!
//! A full update (or an adapter, which workers merge into their own base weights) replaces the
//! previous one; a partial update of parameters is merged into the last full one, so the kept
//! update always takes a fresh worker to the current weights. Chunked updates are kept as the
//! already-serialised wire tensors the push sent (an `Arc`, no copy). A shared-memory update is kept
//! as its file message; its writer holds [`Latest::lock`] while it rewrites the file, and a
//! catch-up holds it while a worker reads the file, so no worker reads a half-written file.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use cotrain_proto::rollout::{ShmWeights, UpdateHeader};

use crate::wire::UpdatedTensor;

/// The payload of a kept update.
#[derive(Clone, Debug)]
pub(super) enum Body {
    Chunks(Arc<Vec<UpdatedTensor>>),
    Shm(ShmWeights),
}

/// The latest update of one agent.
#[derive(Clone, Debug)]
pub(super) struct Latest {
    pub(super) header: UpdateHeader,
    pub(super) body: Body,
}

#[derive(Default)]
pub(super) struct Replay {
    latest: Mutex<HashMap<String, Latest>>,
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Bumped by every record: a catch-up that raced a push sees it and goes round again.
    generation: std::sync::atomic::AtomicU64,
}

impl Replay {
    /// The lock a shared-memory writer and readers of `agent`'s file hold.
    pub(super) fn lock(&self, agent: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.locks.lock().expect("replay lock").entry(agent.to_string()).or_default().clone()
    }

    pub(super) fn generation(&self) -> u64 {
        self.generation.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Keeps `header`'s update (a version older than the kept one is ignored).
    pub(super) fn record(&self, header: &UpdateHeader, body: Body) {
        let mut latest = self.latest.lock().expect("replay lock");
        if latest.get(&header.agent).is_some_and(|l| l.header.version > header.version) {
            return;
        }
        let adapter = header.lora_scaling != 0.0;
        let merged = match (&body, latest.get(&header.agent)) {
            (Body::Chunks(new), Some(Latest { header: old_header, body: Body::Chunks(old) }))
                if header.partial && !adapter && old_header.lora_scaling == 0.0 && !old_header.partial =>
            {
                let mut by_name: BTreeMap<&str, &UpdatedTensor> = old.iter().map(|t| (t.name.as_str(), t)).collect();
                for t in new.iter() {
                    by_name.insert(&t.name, t);
                }
                let tensors: Vec<UpdatedTensor> = by_name.into_values().cloned().collect();
                let header = UpdateHeader { partial: false, tensor_count: tensors.len() as u32, ..header.clone() };
                Latest { header, body: Body::Chunks(Arc::new(tensors)) }
            }
            _ => Latest { header: header.clone(), body },
        };
        latest.insert(header.agent.clone(), merged);
        self.generation.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }

    /// Every agent's latest update.
    pub(super) fn all(&self) -> Vec<Latest> {
        self.latest.lock().expect("replay lock").values().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::WireDType;

    fn tensor(name: &str, byte: u8) -> UpdatedTensor {
        UpdatedTensor { name: name.into(), dtype: WireDType::F32, shape: vec![1], data: vec![byte; 4] }
    }

    fn header(version: u64, partial: bool, lora_scaling: f64) -> UpdateHeader {
        UpdateHeader { agent: "a".into(), version, tensor_count: 0, partial, lora_scaling }
    }

    fn chunks(l: &Latest) -> Vec<(String, u8)> {
        let Body::Chunks(t) = &l.body else { panic!("expected chunks") };
        t.iter().map(|t| (t.name.clone(), t.data[0])).collect()
    }

    #[test]
    fn partial_updates_merge_into_the_last_full_one_and_old_versions_are_ignored() {
        let r = Replay::default();
        r.record(&header(1, false, 0.0), Body::Chunks(Arc::new(vec![tensor("x", 1), tensor("y", 1)])));
        r.record(&header(2, true, 0.0), Body::Chunks(Arc::new(vec![tensor("y", 2)])));
        let l = &r.all()[0];
        assert_eq!((l.header.version, l.header.partial, l.header.tensor_count), (2, false, 2));
        assert_eq!(chunks(l), vec![("x".into(), 1), ("y".into(), 2)]);
        r.record(&header(1, false, 0.0), Body::Chunks(Arc::new(vec![tensor("x", 9)])));
        assert_eq!(r.all()[0].header.version, 2);
        // An adapter replaces what was kept: workers merge it into their own base weights.
        r.record(&header(3, true, 2.0), Body::Chunks(Arc::new(vec![tensor("x.lora_A.weight", 3)])));
        assert_eq!(chunks(&r.all()[0]), vec![("x.lora_A.weight".into(), 3)]);
        assert_eq!(r.generation(), 3);
    }
}
