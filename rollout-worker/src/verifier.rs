//! Learned verifiers served by the worker (`serve --verifier NAME=DIR`; MaPoRL's reward model,
//! [`cotrain_model::verifier`]). Each verifier lives on its own thread, which owns the model; calls
//! queue on a bounded channel (a full queue answers RESOURCE_EXHAUSTED), and the thread takes every
//! call waiting when it wakes and scores their conversations together in batches of
//! `batch_size`, so that concurrent clients share forwards. A call whose conversation cannot be
//! encoded is refused alone, naming the conversation.

use std::path::PathBuf;
use std::sync::mpsc;
use std::thread::JoinHandle;

use cotrain_model::loader::LoadOptions;
use cotrain_model::verifier::{Encoded, Verifier};
use tokio::sync::oneshot;
use tracing::info;

use crate::error::WorkerError;
use crate::metrics::Metrics;

/// Calls waiting per verifier before RESOURCE_EXHAUSTED.
pub const QUEUE_BOUND: usize = 256;

/// One call: its conversations and where the answer goes.
struct Job {
    conversations: Vec<(String, String)>,
    reply: oneshot::Sender<Result<Vec<f32>, WorkerError>>,
}

/// A loaded verifier and its thread.
pub struct VerifierHost {
    pub name: String,
    pub dir: PathBuf,
    tx: Option<mpsc::SyncSender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl VerifierHost {
    /// Loads `dir` on a new thread and returns once it is loaded (or failed to load).
    pub fn start(
        name: &str,
        dir: PathBuf,
        opts: LoadOptions,
        batch_size: usize,
        metrics: Metrics,
    ) -> Result<Self, WorkerError> {
        let (tx, rx) = mpsc::sync_channel::<Job>(QUEUE_BOUND);
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(), WorkerError>>();
        let (thread_name, label, load_dir) =
            (format!("verifier-{name}"), name.to_string(), dir.clone());
        let thread = std::thread::Builder::new()
            .name(thread_name)
            .spawn(move || {
                let t = std::time::Instant::now();
                let v = match Verifier::load(&load_dir, &opts) {
                    Ok(v) => v,
                    Err(e) => {
                        let _ = ready_tx.send(Err(WorkerError::invalid("verifier", format!("{}: {e}", load_dir.display()))));
                        return;
                    }
                };
                info!(verifier = %label, dir = %load_dir.display(), base = %v.manifest.base_model, weights = %v.manifest.weights, load_ms = t.elapsed().as_millis() as u64, "verifier loaded");
                let _ = ready_tx.send(Ok(()));
                serve(&v, &label, &rx, batch_size.max(1), &metrics);
            })
            .map_err(|e| WorkerError::Internal(format!("verifier thread: {e}")))?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(Self {
                name: name.to_string(),
                dir,
                tx: Some(tx),
                thread: Some(thread),
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => Err(WorkerError::Internal(format!(
                "verifier `{name}`: its thread died while loading"
            ))),
        }
    }

    /// Queues a call; the receiver answers with one score per conversation.
    pub fn submit(
        &self,
        conversations: Vec<(String, String)>,
    ) -> Result<oneshot::Receiver<Result<Vec<f32>, WorkerError>>, WorkerError> {
        let (reply, rx) = oneshot::channel();
        let tx = self
            .tx
            .as_ref()
            .ok_or_else(|| WorkerError::Unavailable("the verifier is shutting down".into()))?;
        match tx.try_send(Job {
            conversations,
            reply,
        }) {
            Ok(()) => Ok(rx),
            Err(mpsc::TrySendError::Full(_)) => Err(WorkerError::Overloaded {
                queued: QUEUE_BOUND,
                max: QUEUE_BOUND,
            }),
            Err(mpsc::TrySendError::Disconnected(_)) => Err(WorkerError::Unavailable(format!(
                "verifier `{}` has stopped",
                self.name
            ))),
        }
    }
}

impl Drop for VerifierHost {
    fn drop(&mut self) {
        // Closing the channel ends the thread's loop.
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The thread's loop: every waiting call at once, scored in batches.
fn serve(v: &Verifier, name: &str, rx: &mpsc::Receiver<Job>, batch_size: usize, metrics: &Metrics) {
    while let Ok(first) = rx.recv() {
        let mut jobs = vec![first];
        while let Ok(j) = rx.try_recv() {
            jobs.push(j);
        }
        // Encode per call; a call with a bad conversation is answered alone.
        let mut ok: Vec<(Job, Vec<Encoded>)> = Vec::new();
        for job in jobs {
            let enc: Result<Vec<Encoded>, WorkerError> = job
                .conversations
                .iter()
                .enumerate()
                .map(|(i, (u, a))| {
                    v.encode(u, a).map_err(|e| {
                        WorkerError::invalid(format!("conversations[{i}]"), e.to_string())
                    })
                })
                .collect();
            match enc {
                Ok(e) => ok.push((job, e)),
                Err(e) => {
                    let label = format!("verifier:{name}");
                    metrics
                        .requests
                        .with_label_values(&[label.as_str(), "invalid"])
                        .inc();
                    let _ = job.reply.send(Err(e));
                }
            }
        }
        let all: Vec<&Encoded> = ok.iter().flat_map(|(_, e)| e.iter()).collect();
        let mut scores = Vec::with_capacity(all.len());
        let mut failed = None;
        for part in all.chunks(batch_size) {
            match v.score(part) {
                Ok(s) => scores.extend(s),
                Err(e) => {
                    failed = Some(e.to_string());
                    break;
                }
            }
        }
        let mut at = 0;
        for (job, enc) in ok {
            let n = enc.len();
            let outcome = match &failed {
                Some(e) => Err(WorkerError::Internal(format!("verifier `{name}`: {e}"))),
                None => Ok(scores[at..at + n].to_vec()),
            };
            at += n;
            let label = format!("verifier:{name}");
            metrics
                .requests
                .with_label_values(&[label.as_str(), if outcome.is_ok() { "ok" } else { "error" }])
                .inc();
            metrics
                .verifier_conversations
                .with_label_values(&[name])
                .inc_by(n as u64);
            let _ = job.reply.send(outcome);
        }
    }
}
