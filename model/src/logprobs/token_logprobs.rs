//! The kernel's result and its two-phase backward: the log-probs and entropies as leaves, the
//! chunked LM-head recomputation (or the closed form for the kept chunks), then one trunk backward.

use std::sync::OnceLock;

use tch::{Kind, Tensor};

use crate::error::{ModelError, Result};

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
    pub(super) backward_state: Option<BackwardState>,
    /// The LM head weight (shares storage with the model's parameter).
    pub(super) head: Option<Tensor>,
    /// [`LogProbOptions::temperature`], for the backward's recomputation.
    pub(super) temperature: f64,
    /// The dtype of the head's products when it is not the weight's
    /// ([`crate::CausalLm::set_matmul_kind`]), for the backward's recomputation.
    pub(super) matmul_kind: Option<Kind>,
}

#[derive(Debug)]
pub(super) struct BackwardState {
    /// The trunk output, attached to the graph: (B, L, H), or (R, H) rows with shared prompts.
    pub(super) trunk: Tensor,
    /// Detached copy of `trunk` that collects gradients, of the same shape.
    pub(super) hidden_leaf: Tensor,
    /// How [`TokenLogProbs::hidden`] sees `hidden_leaf` as (B, L, H).
    pub(super) view: HiddenView,
    /// (N,) flat indices into the trunk's rows of the positions predicting each completion token.
    pub(super) positions: Tensor,
    /// (N,) target token ids.
    pub(super) targets: Tensor,
    pub(super) chunk_size: i64,
    /// The last [`super::KEPT_CHUNKS`] chunks' log-softmax (C, V) from the forward, each with the first
    /// position it covers and its entropies: their backward needs no recomputation.
    pub(super) kept: Vec<KeptChunk>,
}

#[derive(Debug)]
pub(super) struct KeptChunk {
    pub(super) start: i64,
    pub(super) logp: Tensor,
    pub(super) entropy: Tensor,
}

/// The per-sequence (B, L, H) hidden states in terms of the trunk's rows.
#[derive(Debug)]
pub(super) enum HiddenView {
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

    pub(super) fn padded_index(&self, cmax: i64) -> Tensor {
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
                    self.kept_chunk_backward(
                        &h,
                        &tgt,
                        kept,
                        grad(&g_lp, has_lp),
                        grad(&g_ent, has_ent),
                    )?;
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
    pub(super) fn kept_chunk_backward(
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
                    let mut weight = (&kept.logp + kept.entropy.unsqueeze(1))
                        * (g_ent * (-1.0 / t)).unsqueeze(1);
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
            let grad_head = head
                .requires_grad()
                .then(|| g.tr().mm(&product(h)).to_kind(head.kind()));
            (grad_hidden, grad_head)
        });
        let mut surrogate = (h * grad_hidden).sum(Kind::Float);
        if let Some(gw) = grad_head {
            surrogate += (head * gw).sum(Kind::Float);
        }
        surrogate.f_backward()?;
        Ok(())
    }

    pub(super) fn head_chunk(&self, h: &Tensor, targets: &Tensor) -> (Tensor, Tensor) {
        let head = self
            .head
            .as_ref()
            .expect("the head is kept whenever backward state is");
        chunk_logprobs(
            &head_logits(h, head, self.matmul_kind),
            targets,
            self.temperature,
        )
    }
}

/// Logits of hidden rows `h` under the LM head weight, the product in `matmul_kind` if given.
pub(super) fn head_logits(h: &Tensor, head: &Tensor, matmul_kind: Option<Kind>) -> Tensor {
    match matmul_kind {
        Some(kind) => crate::families::transformer::linear_in(kind, h, head, None),
        None => h.linear::<&Tensor>(head, None),
    }
}

/// Hidden states of any layout as rows (R, H).
pub(super) fn rows(hidden: &Tensor) -> Tensor {
    let h = hidden.size().last().copied().unwrap_or(0);
    hidden.reshape([-1, h])
}

/// log-prob of `targets` and entropy from logits (C, V), computed in f32.
pub(super) fn chunk_logprobs(
    logits: &Tensor,
    targets: &Tensor,
    temperature: f64,
) -> (Tensor, Tensor) {
    let (lp, ent, _) = chunk_logprobs_keeping(logits, targets, temperature);
    (lp, ent)
}

/// [`chunk_logprobs`] and the log-softmax (C, V) they came from.
pub(super) fn chunk_logprobs_keeping(
    logits: &Tensor,
    targets: &Tensor,
    temperature: f64,
) -> (Tensor, Tensor, Tensor) {
    let logits = logits.to_kind(Kind::Float);
    let logits = if temperature == 1.0 {
        logits
    } else {
        logits / temperature
    };
    let logp = logits.log_softmax(-1, Kind::Float);
    let lp = logp.gather(1, &targets.unsqueeze(1), false).squeeze_dim(1);
    let ent = -(logp.exp() * &logp).sum_dim_intlist(-1, false, Kind::Float);
    (lp, ent, logp)
}
