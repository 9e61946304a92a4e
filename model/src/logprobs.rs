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

use std::sync::OnceLock;

use tch::{Kind, Tensor};

use crate::error::{ModelError, Result};
use crate::families::CausalLm;

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

/// Per-token log-probs and entropies of a batch of completions.
#[derive(Debug)]
pub struct TokenLogProbs {
    /// (N,) f32 log-prob of each completion token; a leaf requiring grad when built with grad.
    pub logprobs: Tensor,
    /// (N,) f32 entropy of the model's distribution at each completion position; a leaf
    /// requiring grad when built with grad.
    pub entropy: Tensor,
    /// Sequence `b` occupies `offsets[b]..offsets[b + 1]` of the flat tensors.
    pub offsets: Vec<usize>,
    /// State for the chunked backward (absent without grad).
    backward_state: Option<BackwardState>,
    /// The LM head weight (shares storage with the model's parameter).
    head: Option<Tensor>,
    /// [`LogProbOptions::temperature`], for the backward's recomputation.
    temperature: f64,
    /// The dtype of the head's products when it is not the weight's
    /// ([`crate::CausalLm::set_matmul_kind`]), for the backward's recomputation.
    matmul_kind: Option<Kind>,
}

#[derive(Debug)]
struct BackwardState {
    /// The trunk output, attached to the graph: (B, L, H), or (R, H) rows with shared prompts.
    trunk: Tensor,
    /// Detached copy of `trunk` that collects gradients, of the same shape.
    hidden_leaf: Tensor,
    /// How [`TokenLogProbs::hidden`] sees `hidden_leaf` as (B, L, H).
    view: HiddenView,
    /// (N,) flat indices into the trunk's rows of the positions predicting each completion token.
    positions: Tensor,
    /// (N,) target token ids.
    targets: Tensor,
    chunk_size: i64,
    /// The last [`KEPT_CHUNKS`] chunks' log-softmax (C, V) from the forward, each with the first
    /// position it covers and its entropies: their backward needs no recomputation.
    kept: Vec<KeptChunk>,
}

#[derive(Debug)]
struct KeptChunk {
    start: i64,
    logp: Tensor,
    entropy: Tensor,
}

/// The per-sequence (B, L, H) hidden states in terms of the trunk's rows.
#[derive(Debug)]
enum HiddenView {
    /// The trunk is (B, L, H) already.
    Padded,
    /// The trunk is (R, H) rows of shared prompts and completions: sequence position `i` of the
    /// (B, L) layout is row `rows[i]`, and padding (`valid[i] == 0`) reads as zeros. Built on
    /// first use.
    Gathered {
        rows: Tensor,
        valid: Tensor,
        b: i64,
        l: i64,
        hidden: OnceLock<Tensor>,
    },
}

impl TokenLogProbs {
    /// Number of sequences.
    pub fn num_sequences(&self) -> usize {
        self.offsets.len() - 1
    }

    /// The hidden states (B, L, H) the log-probs were computed from, detached into a leaf whose
    /// gradient [`TokenLogProbs::backward`] propagates through the trunk (for value heads).
    /// `None` without grad.
    ///
    /// With shared prompts this is a differentiable gather from that leaf (zeros at padding),
    /// so each prompt position's gradient still reaches the one shared forward.
    pub fn hidden(&self) -> Option<&Tensor> {
        let st = self.backward_state.as_ref()?;
        Some(match &st.view {
            HiddenView::Padded => &st.hidden_leaf,
            HiddenView::Gathered {
                rows,
                valid,
                b,
                l,
                hidden,
            } => hidden
                .get_or_init(|| (st.hidden_leaf.index_select(0, rows) * valid).view([*b, *l, -1])),
        })
    }

    /// Scatters a flat (N,) tensor into (B, Cmax) (zeros beyond each completion), differentiably.
    pub fn pad(&self, flat: &Tensor) -> Tensor {
        let b = self.num_sequences() as i64;
        let cmax = self
            .offsets
            .windows(2)
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or(0) as i64;
        let idx = self.padded_index(cmax);
        let out = Tensor::zeros([b * cmax], (flat.kind(), flat.device()));
        out.index_put(&[Some(idx)], flat, false).view([b, cmax])
    }

    /// Log-probs as (B, Cmax) and a (B, Cmax) boolean mask of real tokens.
    pub fn padded(&self) -> (Tensor, Tensor) {
        let b = self.num_sequences() as i64;
        let cmax = self
            .offsets
            .windows(2)
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or(0) as i64;
        let mask = Tensor::zeros([b * cmax], (Kind::Bool, self.logprobs.device()))
            .index_fill(0, &self.padded_index(cmax), 1)
            .view([b, cmax]);
        (self.pad(&self.logprobs), mask)
    }

    fn padded_index(&self, cmax: i64) -> Tensor {
        let mut idx = Vec::with_capacity(*self.offsets.last().unwrap_or(&0));
        for (b, w) in self.offsets.windows(2).enumerate() {
            for j in 0..(w[1] - w[0]) {
                idx.push(b as i64 * cmax + j as i64);
            }
        }
        Tensor::from_slice(&idx).to_device(self.logprobs.device())
    }

    /// Back-propagates `loss` (a scalar built from `logprobs`, `entropy`, [`Self::hidden`] and
    /// anything else) into the model's parameters: `loss.backward()`, then the chunked
    /// recomputation, then one trunk backward. Gradients accumulate as with `backward()`.
    pub fn backward(&self, loss: &Tensor) -> Result<()> {
        loss.f_backward()?;
        self.propagate()
    }

    /// The second half of [`Self::backward`], for callers that ran `loss.backward()` themselves
    /// (for instance one loss over several kernels' outputs): pushes the gradients that reached
    /// `logprobs`, `entropy` and [`Self::hidden`] through the LM head and the trunk.
    pub fn propagate(&self) -> Result<()> {
        let st = self.backward_state.as_ref().ok_or_else(|| {
            ModelError::InvalidBatch("log-probs were computed without grad".into())
        })?;
        let g_lp = self.logprobs.grad();
        let g_ent = self.entropy.grad();
        let (has_lp, has_ent) = (g_lp.defined(), g_ent.defined());
        let n = st.positions.size()[0];
        let hidden = rows(&st.hidden_leaf);
        if has_lp || has_ent {
            let mut start = 0;
            while start < n {
                let len = st.chunk_size.min(n - start);
                let pos = st.positions.narrow(0, start, len);
                let tgt = st.targets.narrow(0, start, len);
                let h = hidden.index_select(0, &pos);
                if let Some(kept) = st.kept.iter().find(|k| k.start == start) {
                    let grad = |g: &Tensor, defined: bool| defined.then(|| g.narrow(0, start, len));
                    self.kept_chunk_backward(&h, &tgt, kept, grad(&g_lp, has_lp), grad(&g_ent, has_ent))?;
                    start += len;
                    continue;
                }
                let (lp, ent) = self.head_chunk(&h, &tgt);
                let mut surrogate = Tensor::zeros([], (Kind::Float, lp.device()));
                if has_lp {
                    surrogate += (lp * g_lp.narrow(0, start, len)).sum(Kind::Float);
                }
                if has_ent {
                    surrogate += (ent * g_ent.narrow(0, start, len)).sum(Kind::Float);
                }
                surrogate.f_backward()?;
                start += len;
            }
        }
        let g_h = st.hidden_leaf.grad();
        if g_h.defined() {
            (&st.trunk * g_h.to_kind(st.trunk.kind()))
                .sum(Kind::Float)
                .f_backward()?;
        }
        Ok(())
    }

    /// The backward of the kept chunk in closed form (module docs): the logits' gradient from the
    /// forward's log-softmax, then `∂h = ∂z · W` and `∂W += ∂zᵀ · h` in the head's product dtype,
    /// handed to autograd as one surrogate so they accumulate where the recomputation's would.
    fn kept_chunk_backward(
        &self,
        h: &Tensor,
        targets: &Tensor,
        kept: &KeptChunk,
        g_lp: Option<Tensor>,
        g_ent: Option<Tensor>,
    ) -> Result<()> {
        let head = self
            .head
            .as_ref()
            .expect("the head is kept whenever backward state is");
        let t = self.temperature;
        let grad_logits = tch::no_grad(|| {
            // −p·(g_lp + g_ent·(logp + ent)) / T, in as few passes over the (C, V) chunk as the
            // gradients present allow (a loss on the log-probs alone: two).
            let mut grad = kept.logp.exp();
            match (&g_lp, &g_ent) {
                (Some(g_lp), None) => {
                    let _ = grad.g_mul_(&(g_lp * (-1.0 / t)).unsqueeze(1));
                }
                (g_lp, Some(g_ent)) => {
                    let mut weight = (&kept.logp + kept.entropy.unsqueeze(1)) * (g_ent * (-1.0 / t)).unsqueeze(1);
                    if let Some(g) = g_lp {
                        let _ = weight.g_add_(&(g * (-1.0 / t)).unsqueeze(1));
                    }
                    let _ = grad.g_mul_(&weight);
                }
                (None, None) => unreachable!("called with at least one incoming gradient"),
            }
            if let Some(g) = &g_lp {
                let _ = grad.scatter_add_(1, &targets.unsqueeze(1), &(g.unsqueeze(1) / t));
            }
            grad
        });
        // The dtype the forward multiplied in (`head_logits`): the matmul kind, else the head's.
        let kind = self.matmul_kind.unwrap_or(head.kind());
        let product = |t: &Tensor| t.to_kind(kind);
        let (grad_hidden, grad_head) = tch::no_grad(|| {
            let g = product(&grad_logits);
            let grad_hidden = g.mm(&product(head)).to_kind(h.kind());
            let grad_head = head.requires_grad().then(|| g.tr().mm(&product(h)).to_kind(head.kind()));
            (grad_hidden, grad_head)
        });
        let mut surrogate = (h * grad_hidden).sum(Kind::Float);
        if let Some(gw) = grad_head {
            surrogate += (head * gw).sum(Kind::Float);
        }
        surrogate.f_backward()?;
        Ok(())
    }

    fn head_chunk(&self, h: &Tensor, targets: &Tensor) -> (Tensor, Tensor) {
        let head = self
            .head
            .as_ref()
            .expect("the head is kept whenever backward state is");
        chunk_logprobs(&head_logits(h, head, self.matmul_kind), targets, self.temperature)
    }
}

/// Logits of hidden rows `h` under the LM head weight, the product in `matmul_kind` if given.
fn head_logits(h: &Tensor, head: &Tensor, matmul_kind: Option<Kind>) -> Tensor {
    match matmul_kind {
        Some(kind) => crate::families::transformer::linear_in(kind, h, head, None),
        None => h.linear::<&Tensor>(head, None),
    }
}

/// Hidden states of any layout as rows (R, H).
fn rows(hidden: &Tensor) -> Tensor {
    let h = hidden.size().last().copied().unwrap_or(0);
    hidden.reshape([-1, h])
}

/// log-prob of `targets` and entropy from logits (C, V), computed in f32.
fn chunk_logprobs(logits: &Tensor, targets: &Tensor, temperature: f64) -> (Tensor, Tensor) {
    let (lp, ent, _) = chunk_logprobs_keeping(logits, targets, temperature);
    (lp, ent)
}

/// [`chunk_logprobs`] and the log-softmax (C, V) they came from.
fn chunk_logprobs_keeping(logits: &Tensor, targets: &Tensor, temperature: f64) -> (Tensor, Tensor, Tensor) {
    let logits = logits.to_kind(Kind::Float);
    let logits = if temperature == 1.0 { logits } else { logits / temperature };
    let logp = logits.log_softmax(-1, Kind::Float);
    let lp = logp.gather(1, &targets.unsqueeze(1), false).squeeze_dim(1);
    let ent = -(logp.exp() * &logp).sum_dim_intlist(-1, false, Kind::Float);
    (lp, ent, logp)
}

/// A batch laid out for one forward.
struct Layout {
    /// Right-padded ids (B, L).
    ids: Tensor,
    /// Flat (B*L) positions whose logits predict each completion token.
    positions: Vec<i64>,
    /// The completion tokens.
    targets: Vec<i64>,
    /// Sequence `b` owns `offsets[b]..offsets[b + 1]`.
    offsets: Vec<usize>,
}

/// Checks that every sequence has a prompt and a completion, fits the context and the
/// vocabulary.
fn validate(model: &CausalLm, batch: &[Sequence]) -> Result<()> {
    let cfg = model.config();
    if batch.is_empty() {
        return Err(ModelError::InvalidBatch("empty batch".into()));
    }
    for (i, s) in batch.iter().enumerate() {
        if s.prompt.is_empty() || s.completion.is_empty() {
            return Err(ModelError::InvalidBatch(format!(
                "sequence {i} needs a non-empty prompt and completion"
            )));
        }
        let len = s.prompt.len() + s.completion.len();
        if len > cfg.max_position_embeddings {
            return Err(ModelError::InvalidBatch(format!(
                "sequence {i} has {len} tokens, beyond the model's context of {}",
                cfg.max_position_embeddings
            )));
        }
        if let Some(&t) = s
            .prompt
            .iter()
            .chain(&s.completion)
            .find(|&&t| t as usize >= cfg.vocab_size)
        {
            return Err(ModelError::InvalidBatch(format!(
                "sequence {i} has token {t}, outside the vocabulary of {}",
                cfg.vocab_size
            )));
        }
    }
    Ok(())
}

fn offsets_of(batch: &[Sequence]) -> Vec<usize> {
    let mut offsets = vec![0usize];
    for s in batch {
        offsets.push(offsets.last().copied().unwrap_or(0) + s.completion.len());
    }
    offsets
}

fn layout(model: &CausalLm, batch: &[Sequence]) -> Result<Layout> {
    validate(model, batch)?;
    let lmax = batch
        .iter()
        .map(|s| s.prompt.len() + s.completion.len())
        .max()
        .unwrap_or(0);
    let l = lmax as i64;
    let mut ids = vec![0i64; batch.len() * lmax];
    let (mut positions, mut targets) = (Vec::new(), Vec::new());
    for (b, s) in batch.iter().enumerate() {
        let row = &mut ids[b * lmax..(b + 1) * lmax];
        for (j, &t) in s.prompt.iter().chain(&s.completion).enumerate() {
            row[j] = t as i64;
        }
        let p = s.prompt.len();
        for (j, &t) in s.completion.iter().enumerate() {
            // The logits at position p + j - 1 predict completion token j.
            positions.push(b as i64 * l + (p + j - 1) as i64);
            targets.push(t as i64);
        }
    }
    let ids = Tensor::from_slice(&ids).view([batch.len() as i64, l]);
    Ok(Layout {
        ids,
        positions,
        targets,
        offsets: offsets_of(batch),
    })
}

/// A batch laid out for [`CausalLm::forward_hidden_prefixed`]: each shared prefix once, then every
/// sequence's continuation (the rest of its prompt, then its completion). The trunk's rows are
/// the prefixes' (G*P) followed by the continuations' (B*C).
struct SharedLayout {
    /// Right-padded distinct prefixes (G, P).
    prompt_ids: Tensor,
    prompt_lens: Vec<i64>,
    /// Right-padded continuations (B, C), in the caller's order.
    completion_ids: Tensor,
    /// The prefix of each sequence.
    prompt_of: Vec<i64>,
    /// Rows predicting each completion token: the row of the position before it, a prefix row
    /// when that position lies in the prefix (the first token after a whole shared prompt), else
    /// the sequence's own continuation row.
    positions: Vec<i64>,
    targets: Vec<i64>,
    offsets: Vec<usize>,
    /// The (B, L) per-sequence layout (L = longest prompt + completion) as trunk rows, and 1
    /// where a position is real.
    view_rows: Vec<i64>,
    view_valid: Vec<f32>,
    view_len: i64,
}

/// How a batch shares prompt positions: `prefixes` (the distinct shared prefixes, each a prefix
/// of its sequences' prompts) and `prefix_of` (each sequence's prefix), or `None` when sharing
/// saves too little to pay for itself.
///
/// Sequences with the same prompt share all of it (GRPO's G samples of one prompt). Sequences whose
/// prompts differ but begin alike share their longest common prefix: MaPoRL's two agents answer a
/// question after the same question message, each after its own history, and its critic values
/// both answers after the same turn-0 prompt. The grouping maximises the positions saved over
/// groups of prompts adjacent in sorted order (a group of m prompts with common prefix ℓ saves
/// (m − 1)·ℓ): one DP over the sorted batch, so that a short prefix common to everything (a chat
/// template's system turn) never swallows groups that share more. With `within`, only sequences
/// of the same group (`within[b]`) share: a trainer whose rows must be computed the same way
/// whichever other rows share their batch (MaPoRL's ranks, each with its own questions).
fn group_prefixes<'b>(batch: &'b [Sequence], within: Option<&[usize]>) -> Option<(Vec<&'b [u32]>, Vec<i64>)> {
    let n = batch.len();
    if n < 2 {
        return None;
    }
    let group = |b: usize| within.map_or(0, |g| g[b]);
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| {
        (group(a), &batch[a].prompt, a).cmp(&(group(b), &batch[b].prompt, b))
    });
    let lcp = |a: &[u32], b: &[u32]| a.iter().zip(b).take_while(|(x, y)| x == y).count();
    // adjacent[k]: common prefix of the k-th and (k+1)-th prompts in sorted order (none across
    // groups).
    let adjacent: Vec<usize> = order
        .windows(2)
        .map(|w| {
            if group(w[0]) == group(w[1]) {
                lcp(&batch[w[0]].prompt, &batch[w[1]].prompt)
            } else {
                0
            }
        })
        .collect();
    // best[j]: the most positions saved by groups covering sorted[..j]; start[j]: where the last
    // of those groups starts.
    let mut best = vec![0usize; n + 1];
    let mut start = vec![0usize; n + 1];
    for j in 1..=n {
        best[j] = best[j - 1];
        start[j] = j - 1;
        let mut common = usize::MAX;
        for i in (0..j - 1).rev() {
            common = common.min(adjacent[i]);
            if common == 0 {
                break;
            }
            let saved = best[i] + (j - 1 - i) * common;
            if saved > best[j] {
                best[j] = saved;
                start[j] = i;
            }
        }
    }
    let total: usize = batch.iter().map(|s| s.prompt.len() + s.completion.len()).sum();
    let repeated = order
        .windows(2)
        .any(|w| group(w[0]) == group(w[1]) && batch[w[0]].prompt == batch[w[1]].prompt);
    // A shared forward attends through an explicit mask where the plain one is causal: prompts
    // that only begin alike share when that saves at least a sixteenth of the positions.
    if best[n] == 0 || !repeated && best[n] * 16 < total {
        return None;
    }
    let mut prefixes: Vec<&[u32]> = Vec::new();
    let mut prefix_of = vec![0i64; n];
    let mut j = n;
    let mut groups = Vec::new();
    while j > 0 {
        groups.push(start[j]..j);
        j = start[j];
    }
    for g in groups.into_iter().rev() {
        let members = &order[g.clone()];
        let len = if members.len() == 1 {
            batch[members[0]].prompt.len()
        } else {
            adjacent[g.start..g.end - 1].iter().copied().min().unwrap_or(0)
        };
        for &m in members {
            prefix_of[m] = prefixes.len() as i64;
        }
        prefixes.push(&batch[members[0]].prompt[..len]);
    }
    Some((prefixes, prefix_of))
}

fn shared_layout(batch: &[Sequence], prefixes: &[&[u32]], prompt_of: Vec<i64>) -> SharedLayout {
    let g = prefixes.len();
    let p = prefixes.iter().map(|x| x.len()).max().unwrap_or(0);
    let prefix_len = |b: usize| prefixes[prompt_of[b] as usize].len();
    let c = batch
        .iter()
        .enumerate()
        .map(|(b, s)| s.prompt.len() - prefix_len(b) + s.completion.len())
        .max()
        .unwrap_or(0);
    let lmax = batch
        .iter()
        .map(|s| s.prompt.len() + s.completion.len())
        .max()
        .unwrap_or(0);
    let mut prompt_ids = vec![0i64; g * p];
    for (k, prefix) in prefixes.iter().enumerate() {
        for (j, &t) in prefix.iter().enumerate() {
            prompt_ids[k * p + j] = t as i64;
        }
    }
    let base = (g * p) as i64;
    let mut completion_ids = vec![0i64; batch.len() * c];
    let (mut positions, mut targets) = (Vec::new(), Vec::new());
    let mut view_rows = vec![0i64; batch.len() * lmax];
    let mut view_valid = vec![0f32; batch.len() * lmax];
    for (b, s) in batch.iter().enumerate() {
        let (k, pl) = (prompt_of[b], prefix_len(b));
        // The trunk row of the sequence's position `i`.
        let row = |i: usize| {
            if i < pl {
                k * p as i64 + i as i64
            } else {
                base + (b * c + i - pl) as i64
            }
        };
        for (j, &t) in s.prompt[pl..].iter().chain(&s.completion).enumerate() {
            completion_ids[b * c + j] = t as i64;
        }
        for (j, &t) in s.completion.iter().enumerate() {
            positions.push(row(s.prompt.len() + j - 1));
            targets.push(t as i64);
        }
        for i in 0..s.prompt.len() + s.completion.len() {
            view_rows[b * lmax + i] = row(i);
            view_valid[b * lmax + i] = 1.0;
        }
    }
    SharedLayout {
        prompt_ids: Tensor::from_slice(&prompt_ids).view([g as i64, p as i64]),
        prompt_lens: prefixes.iter().map(|x| x.len() as i64).collect(),
        completion_ids: Tensor::from_slice(&completion_ids).view([batch.len() as i64, c as i64]),
        prompt_of,
        positions,
        targets,
        offsets: offsets_of(batch),
        view_rows,
        view_valid,
        view_len: lmax as i64,
    }
}

/// What the kernel runs the trunk on.
enum Plan {
    PerSequence(Layout),
    Shared(SharedLayout),
}

impl Plan {
    fn new(model: &CausalLm, batch: &[Sequence], share_prompts: bool, within: Option<&[usize]>) -> Result<Plan> {
        if within.is_some_and(|g| g.len() != batch.len()) {
            return Err(ModelError::InvalidBatch(format!(
                "{} sharing groups for {} sequences",
                within.map_or(0, <[usize]>::len),
                batch.len()
            )));
        }
        if share_prompts {
            validate(model, batch)?;
            if let Some((prefixes, prefix_of)) = group_prefixes(batch, within) {
                return Ok(Plan::Shared(shared_layout(batch, &prefixes, prefix_of)));
            }
        }
        Ok(Plan::PerSequence(layout(model, batch)?))
    }

    /// The trunk's hidden states (autograd as the caller's mode): (B, L, H) or (R, H) rows.
    fn trunk(&self, model: &CausalLm) -> Result<Tensor> {
        let device = model.device();
        match self {
            Plan::PerSequence(lay) => model.forward_hidden(&lay.ids.to_device(device)),
            Plan::Shared(lay) => {
                let (xp, xc) = model.forward_hidden_prefixed(
                    &lay.prompt_ids.to_device(device),
                    &lay.prompt_lens,
                    &lay.completion_ids.to_device(device),
                    &lay.prompt_of,
                )?;
                Ok(Tensor::cat(&[rows(&xp), rows(&xc)], 0))
            }
        }
    }

    /// (positions, targets, offsets).
    fn outputs(&self) -> (&[i64], &[i64], &[usize]) {
        match self {
            Plan::PerSequence(l) => (&l.positions, &l.targets, &l.offsets),
            Plan::Shared(l) => (&l.positions, &l.targets, &l.offsets),
        }
    }

    fn view(&self, model: &CausalLm) -> HiddenView {
        match self {
            Plan::PerSequence(_) => HiddenView::Padded,
            Plan::Shared(lay) => {
                let device = model.device();
                let n = lay.view_valid.len() as i64;
                HiddenView::Gathered {
                    rows: Tensor::from_slice(&lay.view_rows).to_device(device),
                    valid: Tensor::from_slice(&lay.view_valid)
                        .to_device(device)
                        .to_kind(model.kind())
                        .view([n, 1]),
                    b: lay.prompt_of.len() as i64,
                    l: lay.view_len,
                    hidden: OnceLock::new(),
                }
            }
        }
    }
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
        return Err(ModelError::InvalidBatch(format!("temperature {} must be positive", opts.temperature)));
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
        let kept_from = ((n as usize).div_ceil(chunk as usize).saturating_sub(KEPT_CHUNKS) as i64) * chunk;
        let mut start = 0;
        while start < n {
            let len = chunk.min(n - start);
            let h = flat.index_select(0, &positions.narrow(0, start, len));
            let logits = head_logits(&h, head, matmul_kind);
            let targets = targets.narrow(0, start, len);
            let (lp, ent, logp) = chunk_logprobs_keeping(&logits, &targets, opts.temperature);
            if keep_last && start >= kept_from {
                kept.push(KeptChunk { start, logp, entropy: ent.shallow_clone() });
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
pub fn sequence_hidden(model: &CausalLm, batch: &[Sequence], within: Option<&[usize]>) -> Result<Tensor> {
    let plan = Plan::new(model, batch, true, within)?;
    let trunk = plan.trunk(model)?;
    Ok(match plan.view(model) {
        HiddenView::Padded => trunk,
        HiddenView::Gathered { rows: r, valid, b, l, .. } => {
            (rows(&trunk).index_select(0, &r) * valid).view([b, l, -1])
        }
    })
}

/// The positions the trunk runs for `batch` in [`completion_logprobs`] and [`sequence_hidden`]:
/// every prompt and completion, less what shared prefixes save (for arithmetic figures).
///
/// # Panics
/// If `within` does not give one group per sequence (the kernels refuse such a batch with an error).
pub fn trunk_positions(batch: &[Sequence], within: Option<&[usize]>) -> usize {
    if let Some(g) = within {
        assert_eq!(g.len(), batch.len(), "trunk_positions: one sharing group per sequence");
    }
    let all: usize = batch.iter().map(|s| s.prompt.len() + s.completion.len()).sum();
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

#[cfg(test)]
mod prefix_grouping_tests {
    use super::{Sequence, group_prefixes};

    fn seq(prompt: Vec<u32>, completion: usize) -> Sequence {
        Sequence { prompt, completion: vec![7; completion] }
    }

    #[test]
    fn each_question_shares_its_message_not_the_template_common_to_all() {
        // Two questions after the same 3-token template, each answered by two agents after their
        // own histories, in an order that interleaves the questions.
        let template = vec![1u32, 2, 3];
        let q = |k: u32| [template.clone(), vec![10 + k; 20]].concat();
        let own = |a: u32| vec![50 + a; 15];
        let batch = vec![
            seq([q(0), own(0)].concat(), 5),
            seq([q(1), own(0)].concat(), 5),
            seq([q(0), own(1)].concat(), 5),
            seq([q(1), own(1)].concat(), 5),
        ];
        let (prefixes, of) = group_prefixes(&batch, None).expect("shares");
        assert_eq!(prefixes.len(), 2);
        assert_eq!(of[0], of[2]);
        assert_eq!(of[1], of[3]);
        assert_ne!(of[0], of[1]);
        assert_eq!(prefixes[of[0] as usize], q(0).as_slice());
        assert_eq!(prefixes[of[1] as usize], q(1).as_slice());
        // Sharing only within groups: the same prompts in different groups run apart.
        let (prefixes, of) = group_prefixes(&batch, Some(&[0, 1, 2, 1])).expect("shares");
        assert_eq!(prefixes.len(), 3);
        assert_eq!(of[1], of[3]);
        assert_eq!(prefixes[of[1] as usize], q(1).as_slice());
        assert!(of[0] != of[2] && prefixes[of[0] as usize].len() == batch[0].prompt.len());
    }

    #[test]
    fn repeated_prompts_share_whole_and_a_tiny_common_prefix_does_not() {
        let batch = vec![seq(vec![1, 2, 3], 90), seq(vec![1, 2, 3], 90), seq(vec![4, 5], 3)];
        let (prefixes, of) = group_prefixes(&batch, None).expect("GRPO's repeated prompt shares");
        assert_eq!(prefixes[of[0] as usize], &[1, 2, 3]);
        assert_eq!(of[0], of[1]);
        assert_eq!(prefixes[of[2] as usize], &[4, 5]);
        // A 2-token common prefix of 200 positions saves too little.
        let batch = vec![seq(vec![1, 2, 3], 100), seq(vec![1, 2, 4], 100)];
        assert!(group_prefixes(&batch, None).is_none());
        assert!(group_prefixes(&batch[..1], None).is_none());
    }
}
