//! The loop of one model served by vLLM: it takes the same commands as the cotrain engine's loop
//! (`crate::batcher`) and keeps the same promises about versions, on a thread of its own with a
//! small async runtime for the engine calls.
//!
//! - Jobs: every sample of a job is one completion request (its own seed), sent concurrently;
//!   vLLM batches them with everything else in flight.
//! - Updates: when one is waiting, new jobs wait; once the jobs already sent have finished on the
//!   old weights, the update is written as a safetensors file on a node-local tmpfs and reloaded
//!   in place, the prefix cache is dropped, the learner's probe is checked, and only then does the
//!   version change and do the waiting jobs go out. So no sample mixes two versions and each
//!   reports the version that produced it. A probe that fails puts the previous weights back and
//!   refuses the version.
//! - Restarts: an engine that exits is started again and given every tensor pushed since the
//!   worker started (the loop keeps their latest values) before any job is sent to it; the jobs it
//!   was serving are sent again, with the same seeds.
//! - Adapter groups (`serve --adapters`): one engine with vLLM's multi-LoRA serves every agent as
//!   an adapter of the base. An agent's update is written as a PEFT directory and loaded under a
//!   name of its own per version (`agent@vN`), checked with the probe under that name, and only
//!   then does the agent's previous adapter go. Jobs name their agent's current adapter, so each
//!   sample reports its agent's version.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use cotrain_model::config::ModelConfig;
use cotrain_model::engine::{LogprobMode, Request, RequestHandle, Sample};
use tch::Tensor;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use tracing::{error, info, warn};

use super::api::{self, EngineSample, SampleRequest};
use super::http::CallError;
use super::process::EngineProcess;
use super::{EngineError, LaunchSpec};
use crate::batcher::{Command, JobOutput, LoopState, StagedUpdate, StreamToken};
use crate::error::{Result, WorkerError};
use crate::metrics::Metrics;
use crate::probe::Probe;
use crate::seeds::prompt_seed;

/// Longest a single sample or probe may take before the engine is considered stuck.
const CALL_TIMEOUT: Duration = Duration::from_secs(3600);

/// A job sent to the engine.
struct Running {
    requests: Vec<Request>,
    adapter: Option<u32>,
    version: u64,
    reply: oneshot::Sender<Result<JobOutput>>,
    stream: Option<mpsc::UnboundedSender<StreamToken>>,
    abort: tokio::task::AbortHandle,
    resent: u32,
}

impl Running {
    fn into_waiting(self, id: u64) -> Waiting {
        self.abort.abort();
        Waiting {
            id,
            requests: self.requests,
            adapter: self.adapter,
            reply: self.reply,
            stream: self.stream,
            resent: self.resent + 1,
        }
    }
}

/// A job waiting to be sent (an update is pending, or the engine is restarting).
struct Waiting {
    id: u64,
    requests: Vec<Request>,
    /// In an adapter group: the agent's adapter id.
    adapter: Option<u32>,
    reply: oneshot::Sender<Result<JobOutput>>,
    stream: Option<mpsc::UnboundedSender<StreamToken>>,
    /// Times it was sent again after the engine died under it.
    resent: u32,
}

/// A job whose engine died under it twice fails rather than going a third time: a request that
/// kills the engine must not do so forever.
const MAX_RESENDS: u32 = 2;

/// Failed restarts in a row after which the jobs and updates waiting are failed (the restarts go on).
const RESTARTS_BEFORE_FAILING_WAITERS: u32 = 5;

/// Samples in flight to one engine at most (each is one connection to its socket).
const MAX_SAMPLES_IN_FLIGHT: usize = 512;

/// An agent of an adapter group, served as an adapter of the base.
struct AgentAdapter {
    agent: String,
    version: u64,
    /// The served name of its current adapter; `None`: the base, before its first update.
    served: Option<String>,
    /// The PEFT directory of its current adapter (loaded again into a restarted engine), and
    /// whether the loop wrote it (and removes it once replaced).
    dir: Option<(PathBuf, bool)>,
    /// The probe that passed for the current adapter, checked again after a restart.
    probe: Option<Probe>,
}

/// What a job's task returns.
type JobResult = (u64, std::result::Result<Vec<Vec<EngineSample>>, CallError>);

/// Owns one engine; runs until every sender of its channel is gone.
pub(crate) struct VllmLoop {
    spec: LaunchSpec,
    model_id: String,
    agents: Vec<String>,
    cfg: ModelConfig,
    rx: mpsc::UnboundedReceiver<Command>,
    state: Arc<LoopState>,
    metrics: Metrics,
    engine: Option<EngineProcess>,
    version: u64,
    /// The latest value of every tensor pushed since the start, replayed into a restarted engine.
    current: BTreeMap<String, Tensor>,
    /// The last probe that passed, checked again after a replay.
    last_probe: Option<Probe>,
    /// Where update files are written: a private directory on a node-local tmpfs.
    weights_dir: tempfile::TempDir,
    running: HashMap<u64, Running>,
    tasks: JoinSet<JobResult>,
    waiting: VecDeque<Waiting>,
    updates: VecDeque<(StagedUpdate, oneshot::Sender<Result<u64>>)>,
    default_tolerance: f32,
    /// Bounds the samples (connections) in flight to the engine.
    in_flight: Arc<tokio::sync::Semaphore>,
    /// An adapter group's agents, by adapter id; `None`: one model.
    adapters: Option<Vec<AgentAdapter>>,
}

/// A tmpfs for update files: /dev/shm where it exists (node-local memory, no disk write), else
/// the temporary directory.
fn weights_tmp() -> std::io::Result<tempfile::TempDir> {
    use super::scratch::private_dir;
    let shm = std::path::Path::new("/dev/shm");
    let tmp = std::env::temp_dir();
    if shm.is_dir() {
        private_dir(shm, "weights").or_else(|_| private_dir(&tmp, "weights"))
    } else {
        private_dir(&tmp, "weights")
    }
}

impl VllmLoop {
    /// Starts the engine and waits until it is ready; the loop then runs on a thread of its own.
    /// Returns the thread once the engine answered, or why it could not start.
    #[allow(
        clippy::too_many_arguments,
        reason = "the slot's parts, each moved into the loop's thread"
    )]
    pub(crate) fn start(
        spec: LaunchSpec,
        model_id: String,
        agents: Vec<String>,
        cfg: ModelConfig,
        rx: mpsc::UnboundedReceiver<Command>,
        state: Arc<LoopState>,
        metrics: Metrics,
        lora_modules: Vec<(u32, PathBuf)>,
    ) -> Result<std::thread::JoinHandle<()>> {
        let adapters = spec.adapters.map(|_| {
            agents
                .iter()
                .map(|a| AgentAdapter {
                    agent: a.clone(),
                    version: 0,
                    served: None,
                    dir: None,
                    probe: None,
                })
                .collect::<Vec<_>>()
        });
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<()>>();
        super::scratch::sweep_once();
        let weights_dir = weights_tmp()
            .map_err(|e| WorkerError::Internal(format!("a directory for weight files: {e}")))?;
        let default_tolerance = spec
            .options
            .probe_tolerance
            .unwrap_or_else(|| crate::probe::default_tolerance(spec.dtype));
        let thread = std::thread::Builder::new()
            .name(format!("vllm-{}", agents[0]))
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(WorkerError::Internal(format!(
                            "a runtime for the engine loop: {e}"
                        ))));
                        return;
                    }
                };
                rt.block_on(async move {
                    let mut lp = VllmLoop {
                        spec,
                        model_id,
                        agents,
                        cfg,
                        rx,
                        state,
                        metrics,
                        engine: None,
                        version: 0,
                        current: BTreeMap::new(),
                        last_probe: None,
                        weights_dir,
                        running: HashMap::new(),
                        tasks: JoinSet::new(),
                        waiting: VecDeque::new(),
                        updates: VecDeque::new(),
                        default_tolerance,
                        in_flight: Arc::new(tokio::sync::Semaphore::new(MAX_SAMPLES_IN_FLIGHT)),
                        adapters,
                    };
                    let started = async {
                        lp.start_engine().await?;
                        lp.smoke_test().await?;
                        lp.load_lora_modules(lora_modules).await
                    }
                    .await;
                    match started {
                        Ok(()) => {
                            let _ = ready_tx.send(Ok(()));
                            lp.run().await;
                        }
                        Err(e) => {
                            let _ = ready_tx.send(Err(e.into()));
                        }
                    }
                });
            })
            .map_err(|e| WorkerError::Internal(format!("cannot start the engine thread: {e}")))?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(thread),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => Err(WorkerError::Internal(
                "the engine thread ended while starting".into(),
            )),
        }
    }

    async fn start_engine(&mut self) -> std::result::Result<(), EngineError> {
        if let Some(old) = self.engine.take() {
            old.kill().await;
        }
        let mut engine = EngineProcess::spawn(&self.spec, &self.model_id)?;
        engine.wait_ready(self.spec.options.start_timeout).await?;
        self.engine = Some(engine);
        Ok(())
    }

    /// One short forward before the engine is announced: vLLM loads models whose shapes its kernels
    /// cannot run (a CPU attention kernel's head size, say) and fails only at the first request, by
    /// killing itself. Better to stop the worker at start with the engine's own reason.
    async fn smoke_test(&mut self) -> std::result::Result<(), EngineError> {
        let http = self.http().clone();
        match api::sequence_logprobs(&http, super::SERVED_NAME, &[0, 1], Duration::from_secs(600))
            .await
        {
            Ok(_) => Ok(()),
            Err(e) => {
                // The engine's exception reaches its log a moment after the failed answer.
                let engine = self.engine.as_mut().expect("started");
                for _ in 0..50 {
                    if engine.last_error().is_some() && engine.exited().is_some() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                let why = engine.last_error().unwrap_or_else(|| e.to_string());
                Err(EngineError::Unsupported(format!(
                    "vLLM loaded `{}` but cannot run it: {why}",
                    self.spec.model_dir.display()
                )))
            }
        }
    }

    /// `serve --lora-module AGENT=DIR`: each directory loaded as its agent's adapter, version 1.
    async fn load_lora_modules(
        &mut self,
        modules: Vec<(u32, PathBuf)>,
    ) -> std::result::Result<(), EngineError> {
        for (id, dir) in modules {
            let http = self.http().clone();
            let a = self
                .adapters
                .as_mut()
                .and_then(|v| v.get_mut(id as usize))
                .ok_or_else(|| {
                    EngineError::Unsupported(format!(
                        "--lora-module: adapter id {id} is not an agent of an adapter group"
                    ))
                })?;
            let name = api::adapter_name(&a.agent, 1);
            api::load_adapter(&http, &name, &dir, CALL_TIMEOUT)
                .await
                .map_err(|e| {
                    EngineError::Unsupported(format!(
                        "--lora-module {}={}: vLLM did not load it: {e}",
                        a.agent,
                        dir.display()
                    ))
                })?;
            a.version = 1;
            a.served = Some(name);
            a.dir = Some((dir, false));
            self.state.agent_versions[id as usize].store(1, Ordering::SeqCst);
            self.state.policy_version.store(1, Ordering::SeqCst);
            self.metrics
                .policy_version
                .with_label_values(&[a.agent.as_str()])
                .set(1);
        }
        Ok(())
    }

    fn http(&self) -> &super::http::EngineHttp {
        self.engine
            .as_ref()
            .expect("an engine while the loop runs")
            .http()
    }

    async fn run(mut self) {
        info!(model = %self.model_id, engine = "vllm", "engine loop started");
        let mut watch = tokio::time::interval(Duration::from_millis(500));
        let mut closed = false;
        loop {
            if closed
                && self.running.is_empty()
                && self.waiting.is_empty()
                && self.updates.is_empty()
            {
                break;
            }
            tokio::select! {
                cmd = self.rx.recv(), if !closed => match cmd {
                    Some(cmd) => self.handle(cmd),
                    None => closed = true,
                },
                Some(done) = self.tasks.join_next(), if !self.tasks.is_empty() => {
                    if let Ok((id, result)) = done {
                        self.finish(id, result).await;
                    }
                }
                _ = watch.tick() => {
                    self.drop_abandoned();
                    if self.engine_exited() {
                        self.restart().await;
                    }
                }
            }
            if !self.updates.is_empty() && self.running.is_empty() {
                self.apply_updates().await;
            }
            if self.updates.is_empty() {
                while let Some(w) = self.waiting.pop_front() {
                    self.send(w);
                }
            }
            self.publish();
        }
        if let Some(engine) = self.engine.take() {
            engine.kill().await;
        }
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
                    resent: 0,
                };
                if self.updates.is_empty() {
                    self.send(w);
                } else {
                    self.waiting.push_back(w);
                }
            }
            Command::Cancel { id } => {
                if let Some(job) = self.running.remove(&id) {
                    job.abort.abort();
                }
                self.waiting.retain(|w| w.id != id);
            }
            Command::Update { update, reply } => self.updates.push_back((update, reply)),
        }
    }

    /// Sends every sample of a job to the engine, concurrently.
    fn send(&mut self, w: Waiting) {
        if w.reply.is_closed() {
            return;
        }
        if w.resent > MAX_RESENDS {
            let _ = w.reply.send(Err(WorkerError::Unavailable(format!(
                "the vllm engine of `{}` died {} times while serving this job",
                self.model_id, w.resent
            ))));
            return;
        }
        if w.requests
            .iter()
            .any(|r| r.logprobs == LogprobMode::Sampling)
        {
            let _ = w.reply.send(Err(WorkerError::invalid(
                "sampling.sampling_logprobs",
                "--engine vllm reports the model's raw log-probs only (vLLM's log-prob mode is engine-wide); \
                 use --engine cotrain for the sampling distribution's",
            )));
            return;
        }
        // An agent of an adapter group samples from its current adapter (the base before its first).
        let agent = w
            .adapter
            .and_then(|id| self.adapters.as_ref().and_then(|v| v.get(id as usize)));
        let (model, version) = match agent {
            Some(a) => (
                a.served
                    .clone()
                    .unwrap_or_else(|| super::SERVED_NAME.into()),
                a.version,
            ),
            None => (super::SERVED_NAME.to_string(), self.version),
        };
        let http = self.http().clone();
        let requests = w.requests.clone();
        let slots = self.in_flight.clone();
        let max_model_len = self.spec.max_model_len;
        let abort = self.tasks.spawn(async move {
            let mut all = Vec::with_capacity(requests.len());
            for r in &requests {
                let samples = (0..r.n).map(|i| {
                    let http = http.clone();
                    let slots = slots.clone();
                    let model = model.as_str();
                    async move {
                        let _slot = slots
                            .acquire()
                            .await
                            .expect("the semaphore is never closed");
                        let req = SampleRequest {
                            model,
                            prompt: &r.prompt,
                            params: &r.params,
                            stop: &r.stop,
                            // Sample i's seed depends on the request's seed and i only, as the
                            // cotrain engine's streams do.
                            seed: prompt_seed(r.seed, i),
                            top_logprobs: r.top_logprobs,
                            max_model_len,
                        };
                        api::sample(&http, &req, CALL_TIMEOUT).await
                    }
                });
                all.push(futures::future::join_all(samples));
            }
            let answers = futures::future::join_all(all).await;
            let samples: std::result::Result<Vec<Vec<EngineSample>>, CallError> = answers
                .into_iter()
                .map(|per| per.into_iter().collect())
                .collect();
            (w.id, samples)
        });
        self.running.insert(
            w.id,
            Running {
                requests: w.requests,
                adapter: w.adapter,
                version,
                reply: w.reply,
                stream: w.stream,
                abort,
                resent: w.resent,
            },
        );
    }

    async fn finish(
        &mut self,
        id: u64,
        result: std::result::Result<Vec<Vec<EngineSample>>, CallError>,
    ) {
        let Some(job) = self.running.remove(&id) else {
            return;
        };
        match result {
            Ok(samples) => {
                let model = self.model_id.as_str();
                let mut out = Vec::with_capacity(samples.len());
                for (pi, (per, r)) in samples.into_iter().zip(&job.requests).enumerate() {
                    self.metrics
                        .prompt_tokens
                        .with_label_values(&[model])
                        .inc_by(r.prompt.len() as u64);
                    let mut v = Vec::with_capacity(per.len());
                    for (index, s) in per.into_iter().enumerate() {
                        self.metrics
                            .generated_tokens
                            .with_label_values(&[model])
                            .inc_by(s.token_ids.len() as u64);
                        if let Some(stream) = &job.stream {
                            for (k, (&token, &logprob)) in
                                s.token_ids.iter().zip(&s.logprobs).enumerate()
                            {
                                let top = s.top_logprobs.get(k).cloned().unwrap_or_default();
                                let _ = stream.send(StreamToken {
                                    prompt: pi,
                                    index,
                                    token,
                                    logprob,
                                    top,
                                });
                            }
                        }
                        v.push(Sample {
                            request: RequestHandle(pi as u64),
                            index,
                            token_ids: s.token_ids,
                            text: s.text,
                            logprobs: s.logprobs,
                            top_logprobs: s.top_logprobs,
                            finish_reason: s.finish_reason,
                            prompt_tokens: r.prompt.len(),
                        });
                    }
                    out.push(v);
                }
                let _ = job.reply.send(Ok(JobOutput {
                    samples: out,
                    policy_version: job.version,
                }));
            }
            Err(e @ (CallError::Unreachable(_) | CallError::Status { status: 500.., .. }))
                if !self.engine_healthy().await =>
            {
                // The engine died under the job (a dropped connection, or vLLM's 500 as its engine
                // core died): it goes again once the engine is back, on the same weights (the
                // version cannot change while a job is out).
                warn!(model = %self.model_id, job = id, error = %e, "the engine died under a job; it will be sent again");
                self.waiting.push_front(job.into_waiting(id));
                self.restart().await;
            }
            Err(
                e @ CallError::Status {
                    status: 400..=499, ..
                },
            ) => {
                let _ = job.reply.send(Err(WorkerError::invalid(
                    "request",
                    format!("vllm refused it: {e}"),
                )));
            }
            Err(e) => {
                let _ = job
                    .reply
                    .send(Err(WorkerError::Internal(format!("vllm engine: {e}"))));
            }
        }
    }

    /// Whether the engine process runs and answers `/health` with 200.
    async fn engine_healthy(&mut self) -> bool {
        if self.engine_exited() {
            return false;
        }
        matches!(
            self.http().get("/health", Duration::from_secs(5)).await,
            Ok((200, _))
        )
    }

    fn drop_abandoned(&mut self) {
        let gone: Vec<u64> = self
            .running
            .iter()
            .filter(|(_, j)| j.reply.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            if let Some(job) = self.running.remove(&id) {
                job.abort.abort();
            }
        }
        self.waiting.retain(|w| !w.reply.is_closed());
    }

    fn engine_exited(&mut self) -> bool {
        match self.engine.as_mut() {
            Some(e) => match e.exited() {
                Some(status) => {
                    error!(model = %self.model_id, %status, "the vllm engine exited");
                    true
                }
                None => false,
            },
            None => true,
        }
    }

    /// Starts the engine again and replays the current weights, until it works. Jobs that were
    /// out are sent again by the caller; nothing is sent meanwhile.
    async fn restart(&mut self) {
        // Jobs still out on the dead engine go again on the new one; their tasks' results (finished
        // or not) are drained first, so that none is taken for the answer of a job sent again.
        let ids: Vec<u64> = self.running.keys().copied().collect();
        for id in ids {
            let job = self.running.remove(&id).expect("listed");
            self.waiting.push_front(job.into_waiting(id));
        }
        self.tasks.abort_all();
        while self.tasks.join_next().await.is_some() {}
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            if attempt.is_multiple_of(RESTARTS_BEFORE_FAILING_WAITERS) {
                let why = format!(
                    "the vllm engine of `{}` failed to restart {attempt} times",
                    self.model_id
                );
                for w in self.waiting.drain(..) {
                    let _ = w.reply.send(Err(WorkerError::Unavailable(why.clone())));
                }
                for (_, reply) in self.updates.drain(..) {
                    let _ = reply.send(Err(WorkerError::Unavailable(why.clone())));
                }
            }
            let started = Instant::now();
            let result = async {
                self.start_engine().await.map_err(|e| e.to_string())?;
                self.replay().await
            }
            .await;
            match result {
                Ok(()) => {
                    self.metrics
                        .weight_updates
                        .with_label_values(&[self.model_id.as_str(), "replayed"])
                        .inc();
                    info!(model = %self.model_id, version = self.version, attempt,
                        secs = started.elapsed().as_secs_f64(), "vllm engine restarted with the current weights");
                    return;
                }
                Err(e) => {
                    error!(model = %self.model_id, attempt, error = %e, "restarting the vllm engine failed, trying again");
                    tokio::time::sleep(Duration::from_secs(u64::from(attempt.min(6)) * 5)).await;
                }
            }
        }
    }

    /// Gives a fresh engine every tensor pushed so far and every agent's current adapter, and
    /// checks the last probes again.
    async fn replay(&mut self) -> std::result::Result<(), String> {
        self.replay_weights().await?;
        for a in self.adapters.iter().flatten() {
            let (Some(name), Some((dir, _))) = (&a.served, &a.dir) else {
                continue;
            };
            api::load_adapter(self.http(), name, dir, CALL_TIMEOUT)
                .await
                .map_err(|e| {
                    format!("replaying the adapter of {} (v{}): {e}", a.agent, a.version)
                })?;
            if let Some(probe) = &a.probe {
                let check = self.check_probe(name, probe).await?;
                if !check.passed() {
                    return Err(format!(
                        "after the replay of {}'s adapter v{} the probe differs by {} at position {}",
                        a.agent, a.version, check.max_abs_diff, check.position
                    ));
                }
            }
        }
        Ok(())
    }

    async fn replay_weights(&mut self) -> std::result::Result<(), String> {
        if self.current.is_empty() {
            return Ok(());
        }
        let path = self.write_file("replay", &self.current)?;
        let loaded = api::reload_weights(self.http(), &path, CALL_TIMEOUT).await;
        let _ = std::fs::remove_file(&path);
        loaded.map_err(|e| format!("replaying the current weights: {e}"))?;
        if let Some(probe) = self.last_probe.clone() {
            let check = self.check_probe(super::SERVED_NAME, &probe).await?;
            if !check.passed() {
                return Err(format!(
                    "after the replay of v{} the probe differs by {} at position {}",
                    self.version, check.max_abs_diff, check.position
                ));
            }
        }
        Ok(())
    }

    fn write_file(
        &self,
        name: &str,
        tensors: &BTreeMap<String, Tensor>,
    ) -> std::result::Result<PathBuf, String> {
        let path = self.weights_dir.path().join(format!("{name}.safetensors"));
        if let Err(e) = cotrain_model::export::write_weights_file(&path, tensors, &self.cfg) {
            let _ = std::fs::remove_file(&path);
            return Err(format!("writing {}: {e}", path.display()));
        }
        Ok(path)
    }

    /// Scores the probe on the served model `model` (the base or an adapter) and compares it.
    async fn check_probe(
        &self,
        model: &str,
        probe: &Probe,
    ) -> std::result::Result<crate::probe::ProbeCheck, String> {
        let engine = api::sequence_logprobs(self.http(), model, &probe.token_ids, CALL_TIMEOUT)
            .await
            .map_err(|e| format!("scoring the probe: {e}"))?;
        Ok(probe.check(&engine, self.default_tolerance))
    }

    async fn apply_updates(&mut self) {
        while let Some((update, reply)) = self.updates.pop_front() {
            let result = self.apply(update).await;
            let label = if result.is_ok() {
                "applied"
            } else {
                "rejected"
            };
            self.metrics
                .weight_updates
                .with_label_values(&[self.model_id.as_str(), label])
                .inc();
            let _ = reply.send(result);
        }
    }

    async fn apply(&mut self, update: StagedUpdate) -> Result<u64> {
        if let Some((id, scaling)) = update.adapter {
            return self.apply_adapter(id, scaling, update).await;
        }
        if update.version <= self.version {
            return Err(WorkerError::VersionNotNewer {
                current: self.version,
                offered: update.version,
            });
        }
        let started = Instant::now();
        let tensors: BTreeMap<String, Tensor> = update.tensors.into_iter().collect();
        let path = self
            .write_file(&format!("v{}", update.version), &tensors)
            .map_err(WorkerError::BadUpdate)?;
        let bytes = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        let written = started.elapsed();
        let loaded = api::reload_weights(self.http(), &path, CALL_TIMEOUT).await;
        let _ = std::fs::remove_file(&path);
        if let Err(e) = loaded {
            // A reload that failed half-way leaves the engine in an unknown state: start it again
            // from the weights it had.
            warn!(model = %self.model_id, error = %e, "reload failed; restoring the previous weights");
            self.restart().await;
            return Err(WorkerError::BadUpdate(format!(
                "vllm did not load v{}: {e}",
                update.version
            )));
        }
        if let Some(probe) = &update.probe {
            let check = match self.check_probe(super::SERVED_NAME, probe).await {
                Ok(c) => c,
                Err(e) => {
                    self.restore().await;
                    return Err(WorkerError::BadUpdate(format!(
                        "agent {} v{}: {e}",
                        self.agents.join("+"),
                        update.version
                    )));
                }
            };
            if !check.passed() {
                self.restore().await;
                return Err(WorkerError::BadUpdate(format!(
                    "agent {} v{}: after loading, the engine's log-prob of probe token {} differs from the learner's \
                     by {:.4} (tolerance {}); the previous weights (v{}) are back in place",
                    self.agents.join("+"),
                    update.version,
                    check.position,
                    check.max_abs_diff,
                    check.tolerance,
                    self.version
                )));
            }
            tracing::debug!(model = %self.model_id, version = update.version, max_abs_diff = check.max_abs_diff, "probe check passed");
        }
        // The probe of the weights now served, or none: an older probe does not describe them.
        self.last_probe = update.probe.clone();
        for (k, t) in tensors {
            self.current.insert(k, t);
        }
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
        tracing::debug!(model = %self.model_id, version = self.version, bytes, write_ms = written.as_millis() as u64,
            total_ms = started.elapsed().as_millis() as u64, "weights reloaded into vllm");
        Ok(self.version)
    }

    /// Replaces agent `id`'s adapter (an adapter group, nothing in flight): the update's pairs are
    /// written as a PEFT directory, loaded under the version's own name beside the current adapter,
    /// checked with the probe under that name, and only then does the previous adapter go. A
    /// refused adapter leaves the agent's current one serving.
    async fn apply_adapter(&mut self, id: u32, scaling: f64, update: StagedUpdate) -> Result<u64> {
        let (agent, current) = match self.adapters.as_ref().and_then(|v| v.get(id as usize)) {
            Some(a) => (a.agent.clone(), a.version),
            None => {
                return Err(WorkerError::BadUpdate(format!(
                    "adapter id {id} is not an agent of model `{}`",
                    self.model_id
                )));
            }
        };
        if update.version <= current {
            return Err(WorkerError::VersionNotNewer {
                current,
                offered: update.version,
            });
        }
        let started = Instant::now();
        let config = cotrain_model::lora::LoraConfig::of_tensors(&update.tensors, scaling)
            .map_err(|e| WorkerError::BadUpdate(e.to_string()))?;
        if config.r > self.spec.options.max_lora_rank {
            return Err(WorkerError::BadUpdate(format!(
                "{agent} v{}: an adapter of rank {} and the engine takes rank {} at most (--vllm-max-lora-rank)",
                update.version, config.r, self.spec.options.max_lora_rank
            )));
        }
        let name = api::adapter_name(&agent, update.version);
        let dir = self.weights_dir.path().join(&name);
        let tensors: BTreeMap<String, Tensor> = update.tensors.into_iter().collect();
        let base = self.spec.model_dir.to_string_lossy().into_owned();
        cotrain_model::lora::write_peft(&dir, &config, &tensors, &base)
            .map_err(|e| WorkerError::BadUpdate(format!("writing {}: {e}", dir.display())))?;
        let refuse = |why: String| {
            let _ = std::fs::remove_dir_all(&dir);
            WorkerError::BadUpdate(format!(
                "agent {agent} v{}: {why}; v{current} keeps serving",
                update.version
            ))
        };
        if let Err(e) = api::load_adapter(self.http(), &name, &dir, CALL_TIMEOUT).await {
            return Err(refuse(format!("vllm did not load the adapter: {e}")));
        }
        if let Some(probe) = &update.probe {
            let check = self.check_probe(&name, probe).await;
            let failed = match check {
                Ok(c) if c.passed() => {
                    tracing::debug!(model = %self.model_id, agent, version = update.version, max_abs_diff = c.max_abs_diff, "probe check passed");
                    None
                }
                Ok(c) => Some(format!(
                    "after loading, the engine's log-prob of probe token {} differs from the learner's by {:.4} (tolerance {})",
                    c.position, c.max_abs_diff, c.tolerance
                )),
                Err(e) => Some(e),
            };
            if let Some(why) = failed {
                if let Err(e) = api::unload_adapter(self.http(), &name, CALL_TIMEOUT).await {
                    warn!(model = %self.model_id, adapter = name, error = %e, "unloading a refused adapter failed");
                }
                return Err(refuse(why));
            }
        }
        let http = self.http().clone();
        let a = &mut self.adapters.as_mut().expect("checked above")[id as usize];
        if let Some(old) = a.served.take()
            && let Err(e) = api::unload_adapter(&http, &old, CALL_TIMEOUT).await
        {
            warn!(model = %self.model_id, adapter = old, error = %e, "unloading the replaced adapter failed");
        }
        if let Some((old, true)) = a.dir.take() {
            let _ = std::fs::remove_dir_all(old);
        }
        a.version = update.version;
        a.served = Some(name);
        a.dir = Some((dir, true));
        a.probe = update.probe;
        self.state.agent_versions[id as usize].store(update.version, Ordering::SeqCst);
        let newest = self
            .adapters
            .iter()
            .flatten()
            .map(|a| a.version)
            .max()
            .unwrap_or(0);
        self.state.policy_version.store(newest, Ordering::SeqCst);
        self.metrics
            .policy_version
            .with_label_values(&[agent.as_str()])
            .set(update.version as i64);
        tracing::debug!(model = %self.model_id, agent, version = update.version, rank = config.r, tensors = tensors.len(),
            total_ms = started.elapsed().as_millis() as u64, "adapter loaded into vllm");
        Ok(update.version)
    }

    /// Puts the weights of the current version back after an update that failed its check: the
    /// engine reloads its model directory in place and gets every tensor pushed before (a restart
    /// if that fails).
    async fn restore(&mut self) {
        // A tied model's head is a tensor of its own after a reload, and the model directory has
        // none: only a fresh engine restores it when no push was accepted yet.
        if self.cfg.tie_word_embeddings && self.current.is_empty() {
            self.restart().await;
            return;
        }
        let quick = async {
            api::reload_from_model_dir(self.http(), CALL_TIMEOUT)
                .await
                .map_err(|e| e.to_string())?;
            self.replay().await
        }
        .await;
        if let Err(e) = quick {
            warn!(model = %self.model_id, error = %e, "restoring in place failed; restarting the engine");
            self.restart().await;
        }
    }

    fn publish(&self) {
        let model = self.model_id.as_str();
        let queued = self.waiting.len();
        self.state.running_sequences.store(
            self.running
                .values()
                .map(|j| j.requests.iter().map(|r| r.n).sum::<usize>())
                .sum(),
            Ordering::SeqCst,
        );
        self.state.queued_jobs.store(queued, Ordering::SeqCst);
        self.state
            .pending_updates
            .store(self.updates.len(), Ordering::SeqCst);
        self.metrics
            .queue_depth
            .with_label_values(&[model])
            .set(queued as i64);
    }
}
