//! The engine loop of one model: a dedicated thread that owns the [`Engine`] and is fed by a
//! channel.
//!
//! Between two decode steps the loop takes every waiting command: new jobs join the running batch
//! (continuous batching), cancelled jobs leave it, weight updates queue up. A job is one generate
//! request; all of its prompts enter the engine together and its answer is sent when its last
//! sample finishes.
//!
//! Weight swaps and versions: when an update is waiting, the loop stops admitting jobs, lets the
//! jobs already in the engine finish on the old weights, swaps the weights while the engine is
//! empty, bumps the version, and then admits the jobs that arrived meanwhile. So every token of a
//! sample comes from one version, and the version reported with it is exactly that one: jobs
//! admitted before the update finish on the old version, later jobs run on the new one.
//!
//! An adapter loop (`serve --adapters`) serves each of its agents as a LoRA adapter on one base,
//! unmerged: a job names its agent's adapter, the batches mix agents, each agent has its own
//! version, and an update replaces one agent's adapter (after the engine drains, as above).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use cotrain_model::engine::{Engine, Request, RequestHandle, Sample};
use tch::Tensor;
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, error, info, warn};

use crate::error::{Result, WorkerError};
use crate::metrics::Metrics;

/// The samples of one job: per request (prompt) in order, per sample index in order, and the
/// policy version that produced all of them.
#[derive(Debug)]
pub(crate) struct JobOutput {
    pub samples: Vec<Vec<Sample>>,
    pub policy_version: u64,
}

/// A weight update, converted to the model's dtype and device, waiting for its swap.
pub(crate) struct StagedUpdate {
    pub version: u64,
    pub tensors: HashMap<String, Tensor>,
    /// In an adapter loop: the agent's adapter id and the update's LoRA scaling; the tensors are
    /// the adapter's pairs, which replace that agent's adapter.
    pub adapter: Option<(u32, f64)>,
    /// Where the tensors go once copied into the parameters (`None`: dropped), for the next
    /// update to read into.
    pub keep: Option<crate::weights::Staging>,
    /// The sender's probe of these weights; engines that can score it check it after the swap.
    pub probe: Option<crate::probe::Probe>,
}

/// One generated token of a streamed job, sent as the engine produces it.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamToken {
    /// The prompt (request) of the job it belongs to, by position.
    pub prompt: usize,
    /// The sample index within that prompt's `n`.
    pub index: usize,
    /// The token.
    pub token: u32,
    /// Its raw log-prob.
    pub logprob: f32,
    /// The position's most likely tokens, when the job asked for them.
    pub top: Vec<(u32, f32)>,
}

pub(crate) enum Command {
    /// A job; with `stream`, every token it generates is also sent there as it is produced.
    /// `adapter`: in an adapter loop, the agent's adapter id.
    Submit {
        id: u64,
        requests: Vec<Request>,
        adapter: Option<u32>,
        reply: oneshot::Sender<Result<JobOutput>>,
        stream: Option<mpsc::UnboundedSender<StreamToken>>,
    },
    Cancel {
        id: u64,
    },
    Update {
        update: StagedUpdate,
        reply: oneshot::Sender<Result<u64>>,
    },
}

/// How many CPU threads an engine steps on.
#[derive(Clone, Debug, Default)]
pub enum EngineThreads {
    /// libtorch's default (every core).
    #[default]
    Default,
    /// A fixed count (`serve --threads-per-engine`).
    Fixed(usize),
    /// `total` threads split evenly between the engines that have work at the time (`busy` counts
    /// them; every engine of a worker holds the same counter): an engine decoding alone steps on
    /// every core, two at once on half each. Faster when engines take turns (MaPoRL's turns decode
    /// on one adapter's engine at a time), but the counts follow timing and the products' sums
    /// follow the counts: samples are not reproducible from their seeds, so the learner's embedded
    /// worker does not use it.
    Shared {
        total: usize,
        busy: Arc<AtomicUsize>,
    },
}

impl EngineThreads {
    /// Shared between engines: `total` threads.
    pub fn shared(total: usize) -> Self {
        EngineThreads::Shared {
            total: total.max(1),
            busy: Arc::new(AtomicUsize::new(0)),
        }
    }
}

/// What the rest of the worker can read about a running loop without asking it.
#[derive(Debug, Default)]
pub(crate) struct LoopState {
    pub policy_version: AtomicU64,
    pub running_sequences: AtomicUsize,
    /// Jobs admitted by the loop but with sequences not yet decoding (waiting for an update or
    /// for batch rows).
    pub queued_jobs: AtomicUsize,
    /// Updates waiting for the engine to drain.
    pub pending_updates: AtomicUsize,
    /// In an adapter loop: each agent's version, by adapter id (`policy_version` is their most
    /// recent).
    pub agent_versions: Vec<AtomicU64>,
}

impl LoopState {
    /// The state of an adapter loop serving `agents` adapters.
    pub(crate) fn for_adapters(agents: usize) -> Self {
        Self {
            agent_versions: (0..agents).map(|_| AtomicU64::new(0)).collect(),
            ..Self::default()
        }
    }
}

struct Job {
    handles: Vec<RequestHandle>,
    samples: HashMap<RequestHandle, Vec<Sample>>,
    remaining: usize,
    version: u64,
    reply: oneshot::Sender<Result<JobOutput>>,
    stream: Option<mpsc::UnboundedSender<StreamToken>>,
}

struct Waiting {
    id: u64,
    requests: Vec<Request>,
    adapter: Option<u32>,
    reply: oneshot::Sender<Result<JobOutput>>,
    stream: Option<mpsc::UnboundedSender<StreamToken>>,
}

/// Owns the engine; runs until every sender of its channel is gone.
pub(crate) struct EngineLoop {
    engine: Engine,
    model_id: String,
    rx: mpsc::UnboundedReceiver<Command>,
    state: Arc<LoopState>,
    metrics: Metrics,
    agents: Vec<String>,
    max_rows: usize,
    version: u64,
    /// An adapter loop's per-agent versions, by adapter id (`None`: one model, one version).
    adapter_versions: Option<Vec<u64>>,
    /// Jobs in the engine, by job id.
    running: HashMap<u64, Job>,
    /// Engine handle → job id.
    owner: HashMap<RequestHandle, u64>,
    /// Jobs not yet in the engine (an update is waiting).
    waiting: VecDeque<Waiting>,
    updates: VecDeque<(StagedUpdate, oneshot::Sender<Result<u64>>)>,
    window_start: Instant,
    window_tokens: u64,
    /// CPU threads for this engine's steps (`WorkerConfig::engine_threads`).
    threads: EngineThreads,
    /// Whether this loop counts itself in a shared thread budget's `busy` now.
    counted_busy: bool,
}

impl Drop for EngineLoop {
    /// Leaves a shared thread budget however the loop ends (a panic in a step included), so the
    /// other engines are not left on a share for an engine that is gone.
    fn drop(&mut self) {
        self.set_busy(false);
    }
}

impl EngineLoop {
    pub(crate) fn new(
        engine: Engine,
        model_id: String,
        agents: Vec<String>,
        max_rows: usize,
        rx: mpsc::UnboundedReceiver<Command>,
        state: Arc<LoopState>,
        metrics: Metrics,
    ) -> Self {
        Self {
            engine,
            model_id,
            rx,
            state,
            metrics,
            agents,
            max_rows,
            version: 0,
            adapter_versions: None,
            running: HashMap::new(),
            owner: HashMap::new(),
            waiting: VecDeque::new(),
            updates: VecDeque::new(),
            window_start: Instant::now(),
            window_tokens: 0,
            threads: EngineThreads::Default,
            counted_busy: false,
        }
    }

    /// Serves each of its agents as an unmerged LoRA adapter on the base, by adapter id (the
    /// agent's position), starting at `versions` (0: the base itself until its first update; the
    /// engine holds the adapters of the others).
    pub(crate) fn with_adapters(mut self, versions: Vec<u64>) -> Self {
        self.adapter_versions = Some(versions);
        self
    }

    /// Steps on `threads` CPU threads.
    pub(crate) fn with_threads(mut self, threads: EngineThreads) -> Self {
        self.threads = threads;
        self
    }

    /// Counts this loop in (or out of) a shared thread budget's busy engines.
    fn set_busy(&mut self, busy_now: bool) {
        if let EngineThreads::Shared { busy, .. } = &self.threads
            && busy_now != self.counted_busy
        {
            if busy_now {
                busy.fetch_add(1, Ordering::SeqCst);
            } else {
                busy.fetch_sub(1, Ordering::SeqCst);
            }
            self.counted_busy = busy_now;
        }
    }

    /// Runs the loop on the current thread until the channel closes.
    pub(crate) fn run(mut self) {
        info!(model = %self.model_id, "engine loop started");
        loop {
            let idle = self.engine.is_idle() && self.waiting.is_empty() && self.updates.is_empty();
            if idle {
                self.set_busy(false);
                self.publish();
                match self.rx.blocking_recv() {
                    Some(cmd) => self.handle(cmd),
                    None => break,
                }
            }
            loop {
                match self.rx.try_recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => {
                        if self.engine.is_idle() && self.waiting.is_empty() {
                            self.set_busy(false);
                            info!(model = %self.model_id, "engine loop stopped");
                            return;
                        }
                        break;
                    }
                }
            }
            self.drop_abandoned();
            self.apply_updates();
            if self.updates.is_empty() {
                while let Some(w) = self.waiting.pop_front() {
                    self.admit(w);
                }
            }
            if !self.engine.is_idle() {
                self.step();
            }
            self.publish();
        }
        self.set_busy(false);
        info!(model = %self.model_id, "engine loop stopped");
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit {
                id,
                requests,
                adapter,
                reply,
                stream,
            } => {
                let w = Waiting {
                    id,
                    requests,
                    adapter,
                    reply,
                    stream,
                };
                if self.updates.is_empty() {
                    self.admit(w);
                } else {
                    self.waiting.push_back(w);
                }
            }
            Command::Cancel { id } => self.cancel(id),
            Command::Update { update, reply } => self.updates.push_back((update, reply)),
        }
    }

    fn admit(&mut self, w: Waiting) {
        if w.reply.is_closed() {
            return;
        }
        let mut handles = Vec::with_capacity(w.requests.len());
        let remaining = w.requests.iter().map(|r| r.n).sum();
        // An agent without an adapter yet is the base itself.
        let adapter = w
            .adapter
            .filter(|id| self.engine.adapter_ids().contains(id));
        let version = match (&self.adapter_versions, w.adapter) {
            (Some(v), Some(id)) => v.get(id as usize).copied().unwrap_or(0),
            _ => self.version,
        };
        for r in w.requests {
            match self.engine.add_with_adapter(r, adapter) {
                Ok(h) => handles.push(h),
                Err(e) => {
                    for h in handles {
                        self.engine.cancel(h);
                    }
                    let _ = w.reply.send(Err(e.into()));
                    return;
                }
            }
        }
        for &h in &handles {
            self.owner.insert(h, w.id);
        }
        debug!(
            job = w.id,
            requests = handles.len(),
            version,
            "job admitted"
        );
        self.running.insert(
            w.id,
            Job {
                handles,
                samples: HashMap::new(),
                remaining,
                version,
                reply: w.reply,
                stream: w.stream,
            },
        );
    }

    fn cancel(&mut self, id: u64) {
        if let Some(job) = self.running.remove(&id) {
            for h in &job.handles {
                self.engine.cancel(*h);
                self.owner.remove(h);
            }
            debug!(job = id, "job cancelled");
        }
        self.waiting.retain(|w| w.id != id);
    }

    /// Cancels jobs whose caller is gone (a dropped client, a passed deadline).
    fn drop_abandoned(&mut self) {
        let gone: Vec<u64> = self
            .running
            .iter()
            .filter(|(_, j)| j.reply.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            self.cancel(id);
        }
        self.waiting.retain(|w| !w.reply.is_closed());
    }

    /// Swaps weights while the engine is empty, oldest update first.
    fn apply_updates(&mut self) {
        while !self.updates.is_empty() && self.engine.is_idle() {
            let (update, reply) = self.updates.pop_front().expect("not empty");
            if let Some((id, scaling)) = update.adapter {
                let _ = reply.send(self.swap_adapter(id, scaling, update));
                continue;
            }
            if update.version <= self.version {
                let _ = reply.send(Err(WorkerError::VersionNotNewer {
                    current: self.version,
                    offered: update.version,
                }));
                continue;
            }
            let started = Instant::now();
            match self.engine.load_named_tensors(&update.tensors) {
                Ok(()) => {
                    self.version = update.version;
                    self.state
                        .policy_version
                        .store(self.version, Ordering::SeqCst);
                    for a in &self.agents {
                        self.metrics
                            .policy_version
                            .with_label_values(&[a.as_str()])
                            .set(self.version as i64);
                    }
                    self.metrics
                        .weight_updates
                        .with_label_values(&[self.model_id.as_str(), "applied"])
                        .inc();
                    // Per push, beside the service's own line: detail.
                    debug!(model = %self.model_id, version = self.version, tensors = update.tensors.len(),
                        swap_ms = started.elapsed().as_millis() as u64, "weights swapped");
                    let _ = reply.send(Ok(self.version));
                    if let Some(staging) = update.keep {
                        staging.keep(update.tensors);
                    }
                }
                Err(e) => {
                    self.metrics
                        .weight_updates
                        .with_label_values(&[self.model_id.as_str(), "rejected"])
                        .inc();
                    warn!(model = %self.model_id, error = %e, "weight swap rejected");
                    let _ = reply.send(Err(WorkerError::BadUpdate(e.to_string())));
                }
            }
        }
    }

    /// Replaces the adapter of agent `id` (an adapter loop, engine empty).
    fn swap_adapter(&mut self, id: u32, scaling: f64, update: StagedUpdate) -> Result<u64> {
        let current = self
            .adapter_versions
            .as_ref()
            .and_then(|v| v.get(id as usize).copied());
        let Some(current) = current else {
            return Err(WorkerError::BadUpdate(format!(
                "adapter id {id} is not an agent of model `{}`",
                self.model_id
            )));
        };
        if update.version <= current {
            return Err(WorkerError::VersionNotNewer {
                current,
                offered: update.version,
            });
        }
        let started = Instant::now();
        let adapter = cotrain_model::lora::LoraAdapter::from_tensors(
            &self.engine.loaded().model,
            &update.tensors,
            scaling,
        )
        .and_then(|a| self.engine.set_adapter(id, Some(a)));
        let agent = self.agents[id as usize].clone();
        match adapter {
            Ok(()) => {
                let versions = self.adapter_versions.as_mut().expect("checked above");
                versions[id as usize] = update.version;
                self.state.agent_versions[id as usize].store(update.version, Ordering::SeqCst);
                let newest = versions.iter().copied().max().unwrap_or(0);
                self.state.policy_version.store(newest, Ordering::SeqCst);
                self.metrics
                    .policy_version
                    .with_label_values(&[agent.as_str()])
                    .set(update.version as i64);
                self.metrics
                    .weight_updates
                    .with_label_values(&[self.model_id.as_str(), "applied"])
                    .inc();
                debug!(model = %self.model_id, agent, version = update.version, tensors = update.tensors.len(),
                    swap_ms = started.elapsed().as_millis() as u64, "adapter swapped");
                Ok(update.version)
            }
            Err(e) => {
                self.metrics
                    .weight_updates
                    .with_label_values(&[self.model_id.as_str(), "rejected"])
                    .inc();
                warn!(model = %self.model_id, agent, error = %e, "adapter swap rejected");
                Err(WorkerError::BadUpdate(e.to_string()))
            }
        }
    }

    fn step(&mut self) {
        self.set_busy(true);
        // Per step, not once: libtorch may reset a thread's count when it first parallelises, and a
        // shared budget changes as other engines start and finish.
        match &self.threads {
            EngineThreads::Default => {}
            EngineThreads::Fixed(n) => {
                cotrain_model::kernels::set_threads_of_this_thread(*n);
            }
            EngineThreads::Shared { total, busy } => {
                let n = (*total / busy.load(Ordering::SeqCst).max(1)).max(1);
                cotrain_model::kernels::set_threads_of_this_thread(n);
            }
        }
        let out = match self.engine.step() {
            Ok(out) => out,
            Err(e) => {
                error!(model = %self.model_id, error = %e, "engine step failed, failing its jobs");
                let ids: Vec<u64> = self.running.keys().copied().collect();
                for id in ids {
                    if let Some(job) = self.running.remove(&id) {
                        for h in &job.handles {
                            self.engine.cancel(*h);
                            self.owner.remove(h);
                        }
                        let _ = job.reply.send(Err(WorkerError::Internal(format!(
                            "engine step failed: {e}"
                        ))));
                    }
                }
                return;
            }
        };
        let model = self.model_id.as_str();
        self.metrics.decode_steps.with_label_values(&[model]).inc();
        self.metrics
            .generated_tokens
            .with_label_values(&[model])
            .inc_by(out.tokens.len() as u64);
        self.window_tokens += out.tokens.len() as u64;
        for t in out.tokens {
            let Some(job) = self
                .owner
                .get(&t.request)
                .and_then(|id| self.running.get(id))
            else {
                continue;
            };
            if let Some(stream) = &job.stream {
                let prompt = job
                    .handles
                    .iter()
                    .position(|&h| h == t.request)
                    .unwrap_or(0);
                // A closed receiver is a client that left; the job is dropped through its reply.
                let _ = stream.send(StreamToken {
                    prompt,
                    index: t.index,
                    token: t.token,
                    logprob: t.logprob,
                    top: t.top,
                });
            }
        }
        for s in out.finished {
            let Some(&id) = self.owner.get(&s.request) else {
                continue;
            };
            let job = self.running.get_mut(&id).expect("owner implies running");
            if s.index == 0 {
                self.metrics
                    .prompt_tokens
                    .with_label_values(&[model])
                    .inc_by(s.prompt_tokens as u64);
            }
            job.samples.entry(s.request).or_default().push(s);
            job.remaining -= 1;
            if job.remaining == 0 {
                let mut job = self.running.remove(&id).expect("present");
                let samples = job
                    .handles
                    .iter()
                    .map(|h| {
                        self.owner.remove(h);
                        let mut v = job.samples.remove(h).unwrap_or_default();
                        v.sort_by_key(|s| s.index);
                        v
                    })
                    .collect();
                let _ = job.reply.send(Ok(JobOutput {
                    samples,
                    policy_version: job.version,
                }));
            }
        }
    }

    fn publish(&mut self) {
        let model = self.model_id.as_str();
        let running = self.engine.num_running();
        let queued = self.engine.num_pending() + self.waiting.len();
        self.state
            .running_sequences
            .store(running, Ordering::SeqCst);
        self.state.queued_jobs.store(queued, Ordering::SeqCst);
        self.state
            .pending_updates
            .store(self.updates.len(), Ordering::SeqCst);
        self.metrics
            .running_sequences
            .with_label_values(&[model])
            .set(running as i64);
        self.metrics
            .queue_depth
            .with_label_values(&[model])
            .set(queued as i64);
        self.metrics
            .batch_occupancy
            .with_label_values(&[model])
            .set(running as f64 / self.max_rows.max(1) as f64);
        let elapsed = self.window_start.elapsed().as_secs_f64();
        if elapsed >= 1.0 || running == 0 {
            let rate = if elapsed > 0.0 {
                self.window_tokens as f64 / elapsed
            } else {
                0.0
            };
            self.metrics
                .tokens_per_second
                .with_label_values(&[model])
                .set(rate);
            self.window_start = Instant::now();
            self.window_tokens = 0;
        }
    }
}
