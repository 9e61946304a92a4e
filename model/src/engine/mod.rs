//! The generation engine: a step-wise scheduler over a preallocated KV cache.
//!
//! [`Engine::add`] queues a request (prompt ids, `n` samples, sampling params, seed, stop
//! conditions) and returns a handle; each [`Engine::step`] first prefills queued requests (one
//! forward per prompt, whose cache is then copied to the request's `n` rows) and then decodes
//! one token for every running sequence in a single batched forward. Rows hold sequences of
//! different lengths: each row writes its keys/values at its own position and attends only to
//! its own prefix (a per-row mask), so no padding is ever computed. A finished sequence's row is
//! refilled by the last row (a copy of that row's cache prefix), so finished sequences stop
//! costing compute. Requests can be added and cancelled between steps (continuous batching), and
//! parameters can be swapped by name between steps.
//!
//! Adapters: LoRA adapters registered by id ([`Engine::set_adapter`]) are served on top of the
//! base without merging; a request names one ([`Engine::add_with_adapter`]) and the batches mix
//! them: each forward adds every adapter's low-rank product to its own rows
//! ([`crate::families::CausalLm::set_row_adapters`]), so N adapters cost one base plus N adapters
//! of memory, not N models.
//!
//! Reproducibility: sample `i` of a request draws its uniforms from a ChaCha8 stream seeded by
//! `(seed, i)`, and sampling orders the CDF by vocabulary index, so a sample's tokens depend on
//! the model, prompt, params, seed and `i` only — not on the other requests in the batch — up to
//! floating-point differences of batched matmuls, which can flip a draw only when a uniform
//! lands within ~1e-6 of a CDF boundary.

pub mod sampling;
pub mod threads;

use std::collections::{HashMap, VecDeque};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tch::Tensor;

pub use sampling::{LogprobMode, SamplingParams};
pub use threads::DecodeThreads;

use crate::error::{ModelError, Result};
use crate::families::KvCache;
use crate::loader::LoadedModel;
use crate::lora::LoraAdapter;
use crate::tokenizer::{IncrementalDecoder, Tokenizer};
use sampling::RowSpec;

/// When a sample stops.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopConditions {
    /// At most this many new tokens.
    pub max_new_tokens: usize,
    /// Extra token ids that end the sample (kept in the output, like EOS).
    pub stop_token_ids: Vec<u32>,
    /// Strings that end the sample when they appear in the decoded completion; the text is cut
    /// before the stop string (the token ids keep the token that completed it).
    pub stop_strings: Vec<String>,
    /// Do not stop on the model's EOS tokens.
    pub ignore_eos: bool,
}

impl Default for StopConditions {
    fn default() -> Self {
        StopConditions {
            max_new_tokens: 256,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            ignore_eos: false,
        }
    }
}

/// One generation request: a prompt and how to sample `n` completions of it.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// Prompt token ids (chat template already applied).
    pub prompt: Vec<u32>,
    /// Number of samples; they share one prefill.
    pub n: usize,
    /// Sampling parameters.
    pub params: SamplingParams,
    /// Seed; sample `i` uses the stream `(seed, i)`.
    pub seed: u64,
    /// Stop conditions.
    pub stop: StopConditions,
    /// Which log-probs to report.
    pub logprobs: LogprobMode,
    /// How many most likely tokens (under the raw logits) to report at each position beside the
    /// sampled one, as OpenAI's `top_logprobs`; 0: none, and no cost.
    pub top_logprobs: usize,
}

impl Request {
    /// A request with default sampling (temperature 1), one sample, seed 0.
    pub fn new(prompt: Vec<u32>) -> Self {
        Request {
            prompt,
            n: 1,
            params: SamplingParams::default(),
            seed: 0,
            stop: StopConditions::default(),
            logprobs: LogprobMode::Raw,
            top_logprobs: 0,
        }
    }
}

/// Why a sample ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An EOS/stop token or a stop string.
    Stop,
    /// `max_new_tokens` or the end of the model's context.
    Length,
}

impl FinishReason {
    /// `"stop"` or `"length"`, as in OpenAI-style APIs.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Identifies a request added to an [`Engine`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestHandle(pub u64);

/// One finished completion.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// The request it belongs to.
    pub request: RequestHandle,
    /// Its index among the request's `n` samples.
    pub index: usize,
    /// Generated token ids (including a final EOS/stop token).
    pub token_ids: Vec<u32>,
    /// Decoded text (special tokens skipped; cut before a stop string).
    pub text: String,
    /// Log-prob of each generated token (see [`LogprobMode`]).
    pub logprobs: Vec<f32>,
    /// With [`Request::top_logprobs`] > 0: at each position, the most likely tokens and their raw
    /// log-probs, most likely first; empty otherwise.
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
}

/// A token produced by a step (for streaming).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenEvent {
    /// The request.
    pub request: RequestHandle,
    /// The sample index within the request.
    pub index: usize,
    /// The token.
    pub token: u32,
    /// Its log-prob.
    pub logprob: f32,
    /// The position's most likely tokens (see [`Sample::top_logprobs`]).
    pub top: Vec<(u32, f32)>,
}

/// What one [`Engine::step`] produced.
#[derive(Debug, Clone, Default)]
pub struct StepOutput {
    /// Every token generated in this step.
    pub tokens: Vec<TokenEvent>,
    /// Samples that finished in this step.
    pub finished: Vec<Sample>,
}

/// Counters since the engine was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Prompt tokens prefilled.
    pub prefill_tokens: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Batched decode forwards run.
    pub decode_steps: u64,
}

/// Limits of an [`Engine`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// Most sequences decoded together; queued requests wait for rows to free up.
    pub max_batch_rows: usize,
    /// The thread count of CPU decode steps ([`threads`]).
    pub decode_threads: DecodeThreads,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_batch_rows: 256,
            decode_threads: DecodeThreads::Adaptive,
        }
    }
}

/// A running sequence, occupying one cache row.
struct Seq {
    request: RequestHandle,
    /// The adapter it decodes with (an id of [`Engine::set_adapter`]); `None`: the base.
    adapter: Option<u32>,
    index: usize,
    rng: ChaCha8Rng,
    params: SamplingParams,
    logprob_mode: LogprobMode,
    stop_ids: std::sync::Arc<Vec<u32>>,
    stop_strings: std::sync::Arc<Vec<String>>,
    max_new_tokens: usize,
    prompt_len: usize,
    /// Positions filled in the cache (the last generated token is not yet in it).
    cached: usize,
    generated: Vec<u32>,
    logprobs: Vec<f32>,
    top_logprobs: usize,
    tops: Vec<Vec<(u32, f32)>>,
    decoder: Option<IncrementalDecoder>,
    finished: Option<(FinishReason, Option<usize>)>,
}

/// A decode step's thread count, and the count to restore after it where it differs.
struct StepThreads {
    used: usize,
    restore: Option<usize>,
}

/// The generation engine; owns the model (see the module docs).
pub struct Engine {
    loaded: LoadedModel,
    config: EngineConfig,
    cache: Option<KvCache>,
    /// Row `i` of the cache belongs to `active[i]`.
    active: Vec<Seq>,
    pending: VecDeque<(RequestHandle, Request)>,
    next_id: u64,
    eos_ids: Vec<u32>,
    stats: EngineStats,
    /// Adapters served unmerged, by id.
    adapters: HashMap<u32, LoraAdapter>,
    /// The adapter of each queued request that names one.
    pending_adapter: HashMap<RequestHandle, u32>,
    /// Chooses decode steps' thread count under [`DecodeThreads::Adaptive`], from the first step.
    governor: Option<threads::Adaptive>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("active", &self.active.len())
            .field("pending", &self.pending.len())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// An engine with default limits.
    pub fn new(loaded: LoadedModel) -> Self {
        Self::with_config(loaded, EngineConfig::default())
    }

    /// An engine with the given limits.
    pub fn with_config(loaded: LoadedModel, config: EngineConfig) -> Self {
        let eos_ids = loaded.stop_token_ids();
        Engine {
            loaded,
            config,
            cache: None,
            active: Vec::new(),
            pending: VecDeque::new(),
            next_id: 0,
            eos_ids,
            stats: EngineStats::default(),
            adapters: HashMap::new(),
            pending_adapter: HashMap::new(),
            governor: None,
        }
    }

    /// Registers (or replaces) adapter `id`, served unmerged to the requests that name it; `None`
    /// removes it, which is refused while a queued or running request uses it. A replaced adapter
    /// serves its running sequences' next tokens, as a weight update does.
    pub fn set_adapter(&mut self, id: u32, adapter: Option<LoraAdapter>) -> Result<()> {
        match adapter {
            Some(a) => {
                self.loaded.model.check_adapter(&a)?;
                self.adapters.insert(id, a);
            }
            None => {
                let in_use = self.pending_adapter.values().any(|&x| x == id)
                    || self.active.iter().any(|s| s.adapter == Some(id));
                if in_use {
                    return Err(ModelError::InvalidRequest(format!(
                        "adapter {id} is in use by a queued or running request"
                    )));
                }
                self.adapters.remove(&id);
            }
        }
        Ok(())
    }

    /// The ids of the registered adapters.
    pub fn adapter_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self.adapters.keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// [`Engine::add`] for adapter `adapter` (registered with [`Engine::set_adapter`]) on the base.
    pub fn add_with_adapter(
        &mut self,
        request: Request,
        adapter: Option<u32>,
    ) -> Result<RequestHandle> {
        if let Some(id) = adapter
            && !self.adapters.contains_key(&id)
        {
            return Err(ModelError::InvalidRequest(format!(
                "no adapter {id} is registered on this engine"
            )));
        }
        let handle = self.add(request)?;
        if let Some(id) = adapter {
            self.pending_adapter.insert(handle, id);
        }
        Ok(handle)
    }

    /// Sets the per-row adapters of a forward whose row `i` belongs to adapter `row_adapters[i]`.
    fn set_row_adapters(&self, row_adapters: impl Iterator<Item = Option<u32>>) {
        let mut groups: std::collections::BTreeMap<u32, Vec<i64>> =
            std::collections::BTreeMap::new();
        for (row, a) in row_adapters.enumerate() {
            if let Some(id) = a {
                groups.entry(id).or_default().push(row as i64);
            }
        }
        if groups.is_empty() {
            return;
        }
        let list: Vec<(&LoraAdapter, &[i64])> = groups
            .iter()
            .map(|(id, rows)| (&self.adapters[id], rows.as_slice()))
            .collect();
        self.loaded.model.set_row_adapters(&list);
    }

    /// The model, tokenizer and metadata.
    pub fn loaded(&self) -> &LoadedModel {
        &self.loaded
    }

    /// Gives the model back.
    pub fn into_loaded(self) -> LoadedModel {
        self.loaded
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.loaded.tokenizer
    }

    /// Counters.
    pub fn stats(&self) -> EngineStats {
        self.stats
    }

    /// Whether nothing is queued or running.
    pub fn is_idle(&self) -> bool {
        self.active.is_empty() && self.pending.is_empty()
    }

    /// Sequences currently decoding.
    pub fn num_running(&self) -> usize {
        self.active.len()
    }

    /// Requests waiting for prefill.
    pub fn num_pending(&self) -> usize {
        self.pending.len()
    }

    /// Replaces parameters by name between steps, all or nothing (see
    /// [`crate::loader::load_named_tensors`]). Running sequences continue with the new weights
    /// on top of the keys/values the old ones cached.
    pub fn load_named_tensors(&mut self, tensors: &HashMap<String, Tensor>) -> Result<()> {
        self.loaded.load_named_tensors(tensors)
    }

    /// Validates and queues a request; it starts at the next [`Engine::step`].
    pub fn add(&mut self, request: Request) -> Result<RequestHandle> {
        let cfg = self.loaded.model.config();
        if request.prompt.is_empty() {
            return Err(ModelError::InvalidRequest("empty prompt".into()));
        }
        if request.n == 0 {
            return Err(ModelError::InvalidRequest("n must be at least 1".into()));
        }
        if request.n > self.config.max_batch_rows {
            return Err(ModelError::InvalidRequest(format!(
                "n = {} exceeds the engine's {} batch rows",
                request.n, self.config.max_batch_rows
            )));
        }
        if request.prompt.len() >= cfg.max_position_embeddings {
            return Err(ModelError::InvalidRequest(format!(
                "prompt of {} tokens does not fit the model's context of {} tokens",
                request.prompt.len(),
                cfg.max_position_embeddings
            )));
        }
        if let Some(&bad) = request
            .prompt
            .iter()
            .find(|&&t| t as usize >= cfg.vocab_size)
        {
            return Err(ModelError::InvalidRequest(format!(
                "prompt token {bad} is outside the vocabulary of {}",
                cfg.vocab_size
            )));
        }
        if request.stop.max_new_tokens == 0 {
            return Err(ModelError::InvalidRequest(
                "max_new_tokens must be at least 1".into(),
            ));
        }
        request.params.validate()?;
        let handle = RequestHandle(self.next_id);
        self.next_id += 1;
        self.pending.push_back((handle, request));
        Ok(handle)
    }

    /// Drops a queued or running request; returns whether it was found.
    pub fn cancel(&mut self, handle: RequestHandle) -> bool {
        let before = self.pending.len();
        self.pending.retain(|(h, _)| *h != handle);
        self.pending_adapter.remove(&handle);
        let mut found = self.pending.len() != before;
        let mut i = self.active.len();
        while i > 0 {
            i -= 1;
            if self.active[i].request == handle {
                self.remove_row(i);
                found = true;
            }
        }
        found
    }

    /// Runs requests to completion: samples per request, in request order and sample order.
    pub fn generate(&mut self, requests: &[Request]) -> Result<Vec<Vec<Sample>>> {
        let requests: Vec<(Request, Option<u32>)> =
            requests.iter().map(|r| (r.clone(), None)).collect();
        self.generate_with_adapters(&requests)
    }

    /// [`Engine::generate`] with each request's adapter (`None`: the base), all in one batch.
    pub fn generate_with_adapters(
        &mut self,
        requests: &[(Request, Option<u32>)],
    ) -> Result<Vec<Vec<Sample>>> {
        let mut handles = Vec::with_capacity(requests.len());
        for (r, adapter) in requests {
            match self.add_with_adapter(r.clone(), *adapter) {
                Ok(h) => handles.push(h),
                Err(e) => {
                    // All or nothing: withdraw the requests queued so far.
                    for h in handles {
                        self.cancel(h);
                    }
                    return Err(e);
                }
            }
        }
        let mut out: HashMap<RequestHandle, Vec<Sample>> = HashMap::new();
        let mut missing: usize = requests.iter().map(|(r, _)| r.n).sum();
        while missing > 0 {
            if self.is_idle() {
                return Err(ModelError::InvalidRequest(
                    "engine went idle before finishing".into(),
                ));
            }
            for s in self.step()?.finished {
                if handles.contains(&s.request) {
                    missing -= 1;
                    out.entry(s.request).or_default().push(s);
                }
            }
        }
        Ok(handles
            .iter()
            .map(|h| {
                let mut v = out.remove(h).unwrap_or_default();
                v.sort_by_key(|s| s.index);
                v
            })
            .collect())
    }

    /// Admits queued requests (prefill) and decodes one token for every running sequence.
    pub fn step(&mut self) -> Result<StepOutput> {
        let _guard = tch::no_grad_guard();
        let mut out = StepOutput::default();
        self.admit(&mut out)?;
        // A request can finish on its first token (EOS, a stop string, `max_new_tokens` of 1, the
        // end of the context): it must not decode another.
        self.collect_finished(&mut out)?;
        if !self.active.is_empty() {
            self.decode(&mut out)?;
        }
        self.collect_finished(&mut out)?;
        Ok(out)
    }

    /// Prefills queued requests while rows are free, several prompts per forward
    /// ([`PREFILL_GROUP_TOKENS`]).
    fn admit(&mut self, out: &mut StepOutput) -> Result<()> {
        let mut rows = self.active.len();
        let mut group: Vec<(RequestHandle, Request)> = Vec::new();
        while let Some((_, req)) = self.pending.front() {
            let (n, len) = (req.n, req.prompt.len());
            if rows + n > self.config.max_batch_rows {
                break;
            }
            if !group.is_empty() && !prefill_group_fits(&group, len) {
                self.prefill(std::mem::take(&mut group), out)?;
            }
            rows += n;
            group.push(self.pending.pop_front().expect("front exists"));
        }
        if !group.is_empty() {
            self.prefill(group, out)?;
        }
        Ok(())
    }

    /// One forward over the right-padded prompts of `group` (padding after a prompt cannot reach
    /// its positions under causal attention), then each request's last-position logits sample its
    /// first tokens and its cache rows are copied in, one per sample.
    fn prefill(
        &mut self,
        group: Vec<(RequestHandle, Request)>,
        out: &mut StepOutput,
    ) -> Result<()> {
        let model = &self.loaded.model;
        let device = model.device();
        let lens: Vec<usize> = group.iter().map(|(_, r)| r.prompt.len()).collect();
        let width = lens.iter().copied().max().unwrap_or(0);
        let mut ids = vec![0i64; group.len() * width];
        for (i, (_, r)) in group.iter().enumerate() {
            for (j, &t) in r.prompt.iter().enumerate() {
                ids[i * width + j] = t as i64;
            }
        }
        let ids = Tensor::from_slice(&ids)
            .to_device(device)
            .view([group.len() as i64, width as i64]);
        let mut prompt_cache = KvCache::new(model, group.len(), width);
        self.set_row_adapters(
            group
                .iter()
                .map(|(h, _)| self.pending_adapter.get(h).copied()),
        );
        let hidden = model.forward_hidden_cached(&ids, &vec![0; group.len()], &mut prompt_cache);
        model.clear_row_adapters();
        if hidden.is_err() {
            // The group's requests are dropped: so is their hold on their adapters.
            for (h, _) in &group {
                self.pending_adapter.remove(h);
            }
        }
        let hidden = hidden?;
        // Only each prompt's last position is needed: (G, L, H) -> (G, H) -> (G, V).
        let last: Vec<i64> = lens
            .iter()
            .enumerate()
            .map(|(i, &l)| (i * width + l - 1) as i64)
            .collect();
        let hidden = hidden.reshape([(group.len() * width) as i64, -1]);
        let logits =
            model.lm_head(&hidden.index_select(0, &Tensor::from_slice(&last).to_device(device)));
        self.stats.prefill_tokens += lens.iter().sum::<usize>() as u64;
        for (i, (handle, req)) in group.into_iter().enumerate() {
            self.start_request(
                handle,
                req,
                &prompt_cache,
                i,
                &logits.narrow(0, i as i64, 1),
                out,
            )?;
        }
        Ok(())
    }

    /// Gives `req` its rows: copies its prompt's keys and values (row `src` of `prompt_cache`) into
    /// one cache row per sample and samples the first tokens from its prompt's `logits` (1, V).
    fn start_request(
        &mut self,
        handle: RequestHandle,
        req: Request,
        prompt_cache: &KvCache,
        src: usize,
        logits: &Tensor,
        out: &mut StepOutput,
    ) -> Result<()> {
        let adapter = self.pending_adapter.remove(&handle);
        let model = &self.loaded.model;
        let len = req.prompt.len();
        let first_row = self.active.len();
        let rows_needed = first_row + req.n;
        let cap_needed = self.max_cached().max(len + 1);
        let cache = self
            .cache
            .get_or_insert_with(|| KvCache::new(model, rows_needed, cap_needed));
        let keep_len = self.active.iter().map(|s| s.cached).max().unwrap_or(0);
        cache.reserve(rows_needed, cap_needed, first_row, keep_len);
        for i in 0..req.n {
            cache.copy_row_from(prompt_cache, src, first_row + i, len);
        }
        let mut stop_ids: Vec<u32> = req.stop.stop_token_ids.clone();
        if !req.stop.ignore_eos {
            stop_ids.extend(&self.eos_ids);
        }
        let stop_ids = std::sync::Arc::new(stop_ids);
        let stop_strings = std::sync::Arc::new(req.stop.stop_strings.clone());
        let context_left = model.config().max_position_embeddings - len;
        let mut specs = Vec::with_capacity(req.n);
        for i in 0..req.n {
            let mut rng = ChaCha8Rng::seed_from_u64(req.seed);
            rng.set_stream(i as u64);
            let uniform: f32 = rng.random();
            specs.push(RowSpec {
                params: req.params,
                logprobs: req.logprobs,
                uniform,
            });
            self.active.push(Seq {
                request: handle,
                adapter,
                index: i,
                rng,
                params: req.params,
                logprob_mode: req.logprobs,
                stop_ids: stop_ids.clone(),
                stop_strings: stop_strings.clone(),
                max_new_tokens: req.stop.max_new_tokens.min(context_left),
                prompt_len: len,
                cached: len,
                generated: Vec::new(),
                logprobs: Vec::new(),
                top_logprobs: req.top_logprobs,
                tops: Vec::new(),
                decoder: (!req.stop.stop_strings.is_empty()).then(|| IncrementalDecoder::new(true)),
                finished: None,
            });
        }
        let logits = logits.expand([req.n as i64, -1], false).contiguous();
        let (tokens, lps) = sampling::sample(&logits, &specs)?;
        let mut tops = sampling::top_logprobs(&logits, &vec![req.top_logprobs; req.n])?.into_iter();
        for (i, (t, lp)) in tokens.into_iter().zip(lps).enumerate() {
            self.push_token(
                first_row + i,
                t as u32,
                lp,
                tops.next().unwrap_or_default(),
                out,
            )?;
        }
        Ok(())
    }

    fn max_cached(&self) -> usize {
        self.active.iter().map(|s| s.cached).max().unwrap_or(0)
    }

    /// One batched forward over every running sequence's last token.
    fn decode(&mut self, out: &mut StepOutput) -> Result<()> {
        let b = self.active.len();
        let ids: Vec<i64> = self
            .active
            .iter()
            .map(|s| *s.generated.last().expect("has a token") as i64)
            .collect();
        let starts: Vec<i64> = self.active.iter().map(|s| s.cached as i64).collect();
        let need = self.max_cached() + 1;
        let keep_len = self.max_cached();
        let cache = self.cache.as_mut().expect("prefill created the cache");
        cache.reserve(b, need, b, keep_len);
        let model = &self.loaded.model;
        let ids = Tensor::from_slice(&ids)
            .to_device(model.device())
            .unsqueeze(1);
        let row_adapters: Vec<Option<u32>> = self.active.iter().map(|s| s.adapter).collect();
        self.set_row_adapters(row_adapters.into_iter());
        let threads = self.decode_threads_for(b);
        let started = std::time::Instant::now();
        let model = &self.loaded.model;
        let cache = self.cache.as_mut().expect("prefill created the cache");
        let hidden = model.forward_hidden_cached(&ids, &starts, cache);
        model.clear_row_adapters();
        // (B, 1, H) -> (B, V)
        let specs: Vec<RowSpec> = self
            .active
            .iter_mut()
            .map(|s| RowSpec {
                params: s.params,
                logprobs: s.logprob_mode,
                uniform: s.rng.random(),
            })
            .collect();
        let ks: Vec<usize> = self.active.iter().map(|s| s.top_logprobs).collect();
        // Sampling runs at the step's count too: its work is split by rows.
        let sampled = hidden.and_then(|h| {
            let logits = model.lm_head(&h.squeeze_dim(1));
            Ok((
                sampling::sample(&logits, &specs)?,
                sampling::top_logprobs(&logits, &ks)?,
            ))
        });
        self.end_step_threads(threads, b, started.elapsed());
        let ((tokens, lps), tops) = sampled?;
        let mut tops = tops.into_iter();
        self.stats.decode_steps += 1;
        for (row, (t, lp)) in tokens.into_iter().zip(lps).enumerate() {
            self.active[row].cached += 1;
            self.push_token(row, t as u32, lp, tops.next().unwrap_or_default(), out)?;
        }
        Ok(())
    }

    /// The thread count of a decode step of `rows` rows, set on the calling thread (see
    /// [`threads`]); `None` where it stays as configured: [`DecodeThreads::Fixed`] of 0, or a step
    /// whose result could depend on it ([`crate::families::CausalLm::decode_is_thread_invariant`]).
    fn decode_threads_for(&mut self, rows: usize) -> Option<StepThreads> {
        let cache = self.cache.as_ref()?;
        if !self.loaded.model.decode_is_thread_invariant(rows, cache) {
            return None;
        }
        let configured = tch::get_num_threads().max(1) as usize;
        let used = match self.config.decode_threads {
            DecodeThreads::Fixed(0) => return None,
            DecodeThreads::Fixed(n) => n,
            DecodeThreads::Adaptive => {
                // The configured count can change between steps (a worker's engines sharing cores):
                // what was measured under the old one no longer applies.
                let g = self
                    .governor
                    .get_or_insert_with(|| threads::Adaptive::new(configured));
                if g.max() != configured {
                    *g = threads::Adaptive::new(configured);
                }
                g.threads(rows)
            }
        };
        let changed = used != configured && crate::kernels::omp::set_threads_of_this_thread(used);
        Some(StepThreads {
            used,
            restore: changed.then_some(configured),
        })
    }

    /// Undoes [`Engine::decode_threads_for`] and reports the step's time to the governor.
    fn end_step_threads(
        &mut self,
        threads: Option<StepThreads>,
        rows: usize,
        elapsed: std::time::Duration,
    ) {
        let Some(t) = threads else { return };
        if let Some(configured) = t.restore {
            crate::kernels::omp::set_threads_of_this_thread(configured);
        }
        if let Some(g) = &mut self.governor {
            g.record(t.used, rows, elapsed);
        }
    }

    fn push_token(
        &mut self,
        row: usize,
        token: u32,
        lp: f32,
        top: Vec<(u32, f32)>,
        out: &mut StepOutput,
    ) -> Result<()> {
        self.stats.generated_tokens += 1;
        let tokenizer = &self.loaded.tokenizer;
        let seq = &mut self.active[row];
        seq.generated.push(token);
        seq.logprobs.push(lp);
        if seq.top_logprobs > 0 {
            seq.tops.push(top.clone());
        }
        out.tokens.push(TokenEvent {
            request: seq.request,
            index: seq.index,
            token,
            logprob: lp,
            top,
        });
        if seq.stop_ids.contains(&token) {
            seq.finished = Some((FinishReason::Stop, None));
            return Ok(());
        }
        if let Some(dec) = &mut seq.decoder {
            let before = dec.text().len();
            dec.push(tokenizer, token)
                .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
            let text = dec.text();
            let longest = seq.stop_strings.iter().map(String::len).max().unwrap_or(0);
            let mut from = before.saturating_sub(longest);
            while !text.is_char_boundary(from) {
                from -= 1;
            }
            let hit = seq
                .stop_strings
                .iter()
                .filter_map(|s| text[from..].find(s.as_str()).map(|p| from + p))
                .min();
            if let Some(pos) = hit {
                seq.finished = Some((FinishReason::Stop, Some(pos)));
                return Ok(());
            }
        }
        if seq.generated.len() >= seq.max_new_tokens {
            seq.finished = Some((FinishReason::Length, None));
        }
        Ok(())
    }

    /// Turns finished rows into samples and compacts the batch.
    fn collect_finished(&mut self, out: &mut StepOutput) -> Result<()> {
        let mut row = self.active.len();
        while row > 0 {
            row -= 1;
            let Some((reason, cut)) = self.active[row].finished else {
                continue;
            };
            let seq = self.remove_row(row);
            let text = match cut {
                Some(pos) => seq
                    .decoder
                    .as_ref()
                    .map(|d| d.text()[..pos].to_string())
                    .unwrap_or_default(),
                None => self
                    .loaded
                    .tokenizer
                    .decode(&seq.generated, true)
                    .map_err(|e| ModelError::Tokenizer(e.to_string()))?,
            };
            out.finished.push(Sample {
                request: seq.request,
                index: seq.index,
                token_ids: seq.generated,
                text,
                logprobs: seq.logprobs,
                top_logprobs: seq.tops,
                finish_reason: reason,
                prompt_tokens: seq.prompt_len,
            });
        }
        Ok(())
    }

    /// Removes row `row`, moving the last row into its place.
    fn remove_row(&mut self, row: usize) -> Seq {
        let last = self.active.len() - 1;
        if row != last {
            let len = self.active[last].cached;
            if let Some(cache) = &mut self.cache {
                cache.copy_row(last, row, len);
            }
        }
        self.active.swap_remove(row)
    }
}
/// Most prompt positions (padding included) one prefill forward takes: enough for dozens of short
/// prompts (a batch of 32 twenty-token prompts prefilled in one forward instead of 32 saved 0.4 s
/// of a 5.4 s batch-32 generation here), small enough to bound the prompt cache.
const PREFILL_GROUP_TOKENS: usize = 4096;

/// Whether a prompt of `len` tokens may join `group`'s prefill forward: within
/// [`PREFILL_GROUP_TOKENS`], and padding at most as many positions as the prompts have.
fn prefill_group_fits(group: &[(RequestHandle, Request)], len: usize) -> bool {
    let rows = group.len() + 1;
    let width = group
        .iter()
        .map(|(_, r)| r.prompt.len())
        .max()
        .unwrap_or(0)
        .max(len);
    let real: usize = group.iter().map(|(_, r)| r.prompt.len()).sum::<usize>() + len;
    rows * width <= PREFILL_GROUP_TOKENS && rows * width <= 2 * real
}
