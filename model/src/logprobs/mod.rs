//! The training kernel: per-token log-probs (and entropies) of given completion tokens after
//! given prompts, for a batch of sequences of different lengths, differentiable with respect to
//! the model's parameters, without ever holding the (tokens × vocab) logits of more than one
//! chunk of positions.
//!
//! # How the memory bound is kept
//!
//! Plain autograd through `log_softmax(lm_head(h)).gather(..)` keeps every chunk's
//! (chunk × vocab) softmax alive until backward, i.e. the full logits. Instead the kernel works
//! in two phases, the way activation checkpointing does:
//!
//! 1. Forward ([`completion_logprobs`]): one trunk forward gives hidden states (B, L, H). Their
//!    values are detached into a leaf `h` (gradients w.r.t. `h` are collected there); the
//!    completion positions' rows of `h` go through the LM head one chunk at a time *without
//!    autograd*, keeping only the per-token log-prob and entropy. These are returned as leaf
//!    tensors that require grad, so the learner builds its loss from them as usual.
//! 2. Backward ([`TokenLogProbs::backward`]): `loss.backward()` fills the gradients of those
//!    leaves; then each chunk is recomputed with autograd and back-propagated with the incoming
//!    gradients as weights (`sum(g_lp * lp + g_ent * ent)`), which accumulates into the LM head
//!    weight and into `h.grad` and frees the chunk's graph; finally the trunk is
//!    back-propagated once with `h.grad`.
//!
//! The last two chunks are not recomputed: phase 1 keeps their log-softmax, and phase 2 writes
//! each one's gradient with respect to the logits in closed form (below) and multiplies it out
//! against the head and the hidden rows. That saves the head's forward product and the softmax
//! of two chunks — with GRPO's usual `G × max_new_tokens ≤ 2 × chunk_size` (4 × 128 and the seed
//! configs' 4 × 256 at the trainers' 512), the whole head recompute (a sixth of SmolLM2's training
//! arithmetic per completion token).
//!
//! Peak memory: the trunk's usual activations plus three chunks' logits/softmax (the two kept ones
//! and the one being computed or recomputed, with its gradient) — `chunk_size × vocab` floats
//! each — never `tokens × vocab`.
//!
//! # The closed-form chunk gradient
//!
//! With `u = z / T` the logits `z` over the temperature, `logp = log_softmax(u)`, `p = exp(logp)`,
//! the token's log-prob `lp = logp[t]` and the entropy `ent = -Σ p·logp`:
//! `∂lp/∂z_j = (δ_jt − p_j) / T` and `∂ent/∂z_j = −p_j (logp_j + ent) / T`, so with the incoming
//! gradients `g_lp`, `g_ent` the logits' gradient is
//! `(g_lp·δ_jt − p_j (g_lp + g_ent (logp_j + ent))) / T`. [`TokenLogProbs::hidden`]
//! exposes the detached hidden states so a value head on the same forward composes: its
//! gradient lands in `h.grad` and flows through the same single trunk backward.
//!
//! # Shared prompts
//!
//! GRPO draws G completions of one prompt, and under causal attention the prompt's hidden
//! states and keys/values do not depend on what follows. When some sequences of a batch share
//! their prompt, the trunk runs [`CausalLm::forward_hidden_prefixed`]: each distinct prompt once
//! (batch = distinct prompts), then all completions as one batch attending to their prompt's
//! keys/values. The first completion token's log-prob comes from the prompt's last hidden
//! state, the others from the completion rows. Prompts that differ but begin alike (MaPoRL's
//! agents after the same question message) share their longest common prefix the same way, the
//! rest of each prompt running with its completion (`group_prefixes` says when). The values,
//! entropies and gradients are those of the per-sequence forward up to float rounding; a
//! prefix's backward runs once, with the gradients of all its continuations summed. A batch
//! that shares too little takes the per-sequence path; [`completion_logprobs_with_sharing`] can
//! turn sharing off, and [`sequence_hidden`] gives the trunk's hidden states alone (value heads).
//!
//! # Layout
//!
//! Sequences are right-padded (prompt then completion, padding after), so positions start at 0
//! for every row and padding cannot influence real tokens under causal attention. Log-probs
//! come back flat, `(N,)` with `N` = total completion tokens, sequence `b` occupying
//! `offsets[b]..offsets[b + 1]` in the caller's order; [`TokenLogProbs::padded`] gives
//! `(B, Cmax)` plus a mask.
//!
//! # Files
//!
//! This file holds the entry points and the forward; `layout` lays a batch out for the trunk
//! (padded rows or shared prefixes), `token_logprobs` holds the result and its chunked backward.

mod layout;
mod token_logprobs;

use tch::Tensor;

use crate::error::{ModelError, Result};
use crate::families::CausalLm;
use layout::{Layout, Plan, group_prefixes, layout};
pub use token_logprobs::TokenLogProbs;
use token_logprobs::{
    BackwardState, HiddenView, KeptChunk, chunk_logprobs, chunk_logprobs_keeping, head_logits, rows,
};

/// The LM-head chunk the trainers use. GRPO's usual 4 × 128 completion positions fit one chunk,
/// and the seed configs' 4 × 256 two; both are kept ([`KEPT_CHUNKS`]), so their backward is the
/// closed-form one (no head recompute); at most three chunks of logits are alive, 3 × 512 × vocab
/// floats (300 MB for SmolLM2's 49k vocabulary, 930 MB for Qwen2.5's 152k).
pub const TRAINING_CHUNK: usize = 512;

/// How many of the last LM-head chunks keep their log-softmax from the forward for the closed-form
/// backward. Two: the seed configs' 4 × 256 completions (two chunks of 512) need no head recompute
/// (one agent's backward on one core 7.03–7.21 s against 7.27–7.64 s keeping one,
/// `bench_train_forward -- --prompt 122 --completion 256 --threads 1`), for one more chunk of
/// memory than keeping one.
const KEPT_CHUNKS: usize = 2;

/// One (prompt, completion) pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sequence {
    /// Prompt token ids (at least one).
    pub prompt: Vec<u32>,
    /// Completion token ids whose log-probs are wanted (at least one).
    pub completion: Vec<u32>,
}

/// Options of the kernel.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogProbOptions {
    /// Completion positions per LM-head chunk (bounds the logits held at once).
    pub chunk_size: usize,
    /// Build for training (gradients via [`TokenLogProbs::backward`]); `false` runs under
    /// `no_grad` (behaviour / reference policy log-probs).
    pub with_grad: bool,
    /// Log-probs of `softmax(logits / temperature)`: 1 for the plain model; MaPoRL scores its
    /// samples under the sampling temperature.
    pub temperature: f64,
}

impl Default for LogProbOptions {
    fn default() -> Self {
        LogProbOptions {
            chunk_size: 512,
            with_grad: true,
            temperature: 1.0,
        }
    }
}

/// `log p(tokens[i + 1] | tokens[..=i])` at every position of one sequence, without gradients:
/// the probe a weight push carries (`UpdateHeader.probe`), so that an engine that loaded the
/// pushed weights can show that it computes the same.
pub fn sequence_logprobs(model: &CausalLm, tokens: &[u32]) -> Result<Vec<f32>> {
    if tokens.len() < 2 {
        return Err(crate::ModelError::InvalidBatch(format!(
            "a probe needs two tokens or more, got {}",
            tokens.len()
        )));
    }
    let seq = Sequence {
        prompt: tokens[..1].to_vec(),
        completion: tokens[1..].to_vec(),
    };
    let opts = LogProbOptions {
        with_grad: false,
        ..LogProbOptions::default()
    };
    let out = completion_logprobs(model, &[seq], &opts)?;
    let flat = out
        .logprobs
        .to_kind(tch::Kind::Float)
        .to_device(tch::Device::Cpu);
    Ok(Vec::<f32>::try_from(&flat)?)
}

/// Computes per-token log-probs and entropies of each sequence's completion (see the module
/// docs for the memory behaviour, the shared prompts and the layout).
pub fn completion_logprobs(
    model: &CausalLm,
    batch: &[Sequence],
    opts: &LogProbOptions,
) -> Result<TokenLogProbs> {
    completion_logprobs_with_sharing(model, batch, opts, true)
}

/// [`completion_logprobs`] where only sequences of the same group (`within[b]`) share prompt
/// positions.
pub fn completion_logprobs_within(
    model: &CausalLm,
    batch: &[Sequence],
    within: &[usize],
    opts: &LogProbOptions,
) -> Result<TokenLogProbs> {
    logprobs_kernel(model, batch, opts, true, Some(within))
}

/// [`completion_logprobs`], choosing whether sequences with the same prompt share its forward
/// and backward (`share_prompts`; the same values up to float rounding either way), for tests
/// and benchmarks.
pub fn completion_logprobs_with_sharing(
    model: &CausalLm,
    batch: &[Sequence],
    opts: &LogProbOptions,
    share_prompts: bool,
) -> Result<TokenLogProbs> {
    logprobs_kernel(model, batch, opts, share_prompts, None)
}

fn logprobs_kernel(
    model: &CausalLm,
    batch: &[Sequence],
    opts: &LogProbOptions,
    share_prompts: bool,
    within: Option<&[usize]>,
) -> Result<TokenLogProbs> {
    if !(opts.temperature > 0.0 && opts.temperature.is_finite()) {
        return Err(ModelError::InvalidBatch(format!(
            "temperature {} must be positive",
            opts.temperature
        )));
    }
    if opts.chunk_size == 0 {
        return Err(ModelError::InvalidBatch(
            "chunk_size must be positive".into(),
        ));
    }
    let device = model.device();
    let plan = Plan::new(model, batch, share_prompts, within)?;
    let (positions, targets, offsets) = plan.outputs();
    let positions = Tensor::from_slice(positions).to_device(device);
    let targets = Tensor::from_slice(targets).to_device(device);
    let offsets = offsets.to_vec();
    let chunk = opts.chunk_size as i64;

    let head = model.lm_head_weight();
    let matmul_kind = model.matmul_kind();
    // The log-probs and entropies of every chunk, and with `keep_last` the last chunks'
    // log-softmax for the closed-form backward.
    let run_chunks = |hidden: &Tensor, keep_last: bool| -> (Tensor, Tensor, Vec<KeptChunk>) {
        let _guard = tch::no_grad_guard();
        let n = positions.size()[0];
        let flat = rows(hidden);
        let (mut lps, mut ents, mut kept) = (Vec::new(), Vec::new(), Vec::new());
        // Chunks starting here or later are kept.
        let kept_from = ((n as usize)
            .div_ceil(chunk as usize)
            .saturating_sub(KEPT_CHUNKS) as i64)
            * chunk;
        let mut start = 0;
        while start < n {
            let len = chunk.min(n - start);
            let h = flat.index_select(0, &positions.narrow(0, start, len));
            let logits = head_logits(&h, head, matmul_kind);
            let targets = targets.narrow(0, start, len);
            let (lp, ent, logp) = chunk_logprobs_keeping(&logits, &targets, opts.temperature);
            if keep_last && start >= kept_from {
                kept.push(KeptChunk {
                    start,
                    logp,
                    entropy: ent.shallow_clone(),
                });
            }
            lps.push(lp);
            ents.push(ent);
            start += len;
        }
        (Tensor::cat(&lps, 0), Tensor::cat(&ents, 0), kept)
    };

    if !opts.with_grad {
        let _guard = tch::no_grad_guard();
        let hidden = plan.trunk(model)?;
        let (logprobs, entropy, _) = run_chunks(&hidden, false);
        return Ok(TokenLogProbs {
            logprobs,
            entropy,
            offsets,
            backward_state: None,
            head: None,
            temperature: opts.temperature,
            matmul_kind,
        });
    }
    let trunk = plan.trunk(model)?;
    let hidden_leaf = trunk.detach().set_requires_grad(true);
    let (lp, ent, kept) = run_chunks(&hidden_leaf, true);
    Ok(TokenLogProbs {
        logprobs: lp.set_requires_grad(true),
        entropy: ent.set_requires_grad(true),
        offsets,
        backward_state: Some(BackwardState {
            trunk,
            hidden_leaf,
            view: plan.view(model),
            positions,
            targets,
            chunk_size: chunk,
            kept,
        }),
        head: Some(head.shallow_clone()),
        temperature: opts.temperature,
        matmul_kind,
    })
}

/// The final hidden states (B, L, H) of right-padded `prompt ++ completion` rows (zeros at
/// padding when prefixes were shared), with autograd as the caller's mode: one trunk forward,
/// sharing common prompt prefixes as [`completion_logprobs`] does. For value heads, which read
/// every position and need no LM head. With `within`, only sequences of the same group share.
pub fn sequence_hidden(
    model: &CausalLm,
    batch: &[Sequence],
    within: Option<&[usize]>,
) -> Result<Tensor> {
    let plan = Plan::new(model, batch, true, within)?;
    let trunk = plan.trunk(model)?;
    Ok(match plan.view(model) {
        HiddenView::Padded => trunk,
        HiddenView::Gathered {
            rows: r,
            valid,
            b,
            l,
            ..
        } => (rows(&trunk).index_select(0, &r) * valid).view([b, l, -1]),
    })
}

/// The positions the trunk runs for `batch` in [`completion_logprobs`] and [`sequence_hidden`]:
/// every prompt and completion, less what shared prefixes save (for arithmetic figures).
///
/// # Panics
/// If `within` does not give one group per sequence (the kernels refuse such a batch with an error).
pub fn trunk_positions(batch: &[Sequence], within: Option<&[usize]>) -> usize {
    if let Some(g) = within {
        assert_eq!(
            g.len(),
            batch.len(),
            "trunk_positions: one sharing group per sequence"
        );
    }
    let all: usize = batch
        .iter()
        .map(|s| s.prompt.len() + s.completion.len())
        .sum();
    match group_prefixes(batch, within) {
        Some((prefixes, prefix_of)) => {
            let shared: usize = prefix_of.iter().map(|&k| prefixes[k as usize].len()).sum();
            all - shared + prefixes.iter().map(|p| p.len()).sum::<usize>()
        }
        None => all,
    }
}

/// The straightforward computation — full (B, L, V) logits, autograd throughout — as a reference
/// for tests and for small batches: returns flat (N,) log-probs and entropies and the offsets.
pub fn naive_completion_logprobs(
    model: &CausalLm,
    batch: &[Sequence],
) -> Result<(Tensor, Tensor, Vec<usize>)> {
    naive_completion_logprobs_at(model, batch, 1.0)
}

/// [`naive_completion_logprobs`] of `softmax(logits / temperature)`.
pub fn naive_completion_logprobs_at(
    model: &CausalLm,
    batch: &[Sequence],
    temperature: f64,
) -> Result<(Tensor, Tensor, Vec<usize>)> {
    let device = model.device();
    let Layout {
        ids,
        positions,
        targets,
        offsets,
    } = layout(model, batch)?;
    let logits = model.forward(&ids.to_device(device))?;
    let flat = logits.flatten(0, 1);
    let pos = Tensor::from_slice(&positions).to_device(device);
    let tgt = Tensor::from_slice(&targets).to_device(device);
    let (lp, ent) = chunk_logprobs(&flat.index_select(0, &pos), &tgt, temperature);
    Ok((lp, ent, offsets))
}
