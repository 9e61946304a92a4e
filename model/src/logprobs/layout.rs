//! How a batch is laid out for the trunk: right-padded rows (prompt, then completion), or with
//! common prompt prefixes run once and the continuations attending to them ([`Plan`]).

use std::sync::OnceLock;

use tch::Tensor;

use super::Sequence;
use super::token_logprobs::{HiddenView, rows};
use crate::error::{ModelError, Result};
use crate::families::CausalLm;

/// A batch laid out for one forward.
pub(super) struct Layout {
    /// Right-padded ids (B, L).
    pub(super) ids: Tensor,
    /// Flat (B*L) positions whose logits predict each completion token.
    pub(super) positions: Vec<i64>,
    /// The completion tokens.
    pub(super) targets: Vec<i64>,
    /// Sequence `b` owns `offsets[b]..offsets[b + 1]`.
    pub(super) offsets: Vec<usize>,
}

/// Checks that every sequence has a prompt and a completion, fits the context and the
/// vocabulary.
pub(super) fn validate(model: &CausalLm, batch: &[Sequence]) -> Result<()> {
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

pub(super) fn offsets_of(batch: &[Sequence]) -> Vec<usize> {
    let mut offsets = vec![0usize];
    for s in batch {
        offsets.push(offsets.last().copied().unwrap_or(0) + s.completion.len());
    }
    offsets
}

pub(super) fn layout(model: &CausalLm, batch: &[Sequence]) -> Result<Layout> {
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
pub(super) struct SharedLayout {
    /// Right-padded distinct prefixes (G, P).
    pub(super) prompt_ids: Tensor,
    pub(super) prompt_lens: Vec<i64>,
    /// Right-padded continuations (B, C), in the caller's order.
    pub(super) completion_ids: Tensor,
    /// The prefix of each sequence.
    pub(super) prompt_of: Vec<i64>,
    /// Rows predicting each completion token: the row of the position before it, a prefix row
    /// when that position lies in the prefix (the first token after a whole shared prompt), else
    /// the sequence's own continuation row.
    pub(super) positions: Vec<i64>,
    pub(super) targets: Vec<i64>,
    pub(super) offsets: Vec<usize>,
    /// The (B, L) per-sequence layout (L = longest prompt + completion) as trunk rows, and 1
    /// where a position is real.
    pub(super) view_rows: Vec<i64>,
    pub(super) view_valid: Vec<f32>,
    pub(super) view_len: i64,
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
pub(super) fn group_prefixes<'b>(
    batch: &'b [Sequence],
    within: Option<&[usize]>,
) -> Option<(Vec<&'b [u32]>, Vec<i64>)> {
    let n = batch.len();
    if n < 2 {
        return None;
    }
    let group = |b: usize| within.map_or(0, |g| g[b]);
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| (group(a), &batch[a].prompt, a).cmp(&(group(b), &batch[b].prompt, b)));
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
    let total: usize = batch
        .iter()
        .map(|s| s.prompt.len() + s.completion.len())
        .sum();
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
            adjacent[g.start..g.end - 1]
                .iter()
                .copied()
                .min()
                .unwrap_or(0)
        };
        for &m in members {
            prefix_of[m] = prefixes.len() as i64;
        }
        prefixes.push(&batch[members[0]].prompt[..len]);
    }
    Some((prefixes, prefix_of))
}

pub(super) fn shared_layout(
    batch: &[Sequence],
    prefixes: &[&[u32]],
    prompt_of: Vec<i64>,
) -> SharedLayout {
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
pub(super) enum Plan {
    PerSequence(Layout),
    Shared(SharedLayout),
}

impl Plan {
    pub(super) fn new(
        model: &CausalLm,
        batch: &[Sequence],
        share_prompts: bool,
        within: Option<&[usize]>,
    ) -> Result<Plan> {
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
                let lay = shared_layout(batch, &prefixes, prefix_of);
                // The prefixed forward picks LongRoPE's table by its padded extent (longest prefix
                // plus widest continuation), the plain one by the longest sequence; where those
                // fall on either side of the original context, the plain forward is the faithful one.
                let longest = batch
                    .iter()
                    .map(|s| (s.prompt.len() + s.completion.len()) as i64)
                    .max()
                    .unwrap_or(0);
                let extent = lay.prompt_lens.iter().copied().max().unwrap_or(0)
                    + lay.completion_ids.size().get(1).copied().unwrap_or(0);
                if model.rope_table_agrees(longest, extent) {
                    return Ok(Plan::Shared(lay));
                }
            }
        }
        Ok(Plan::PerSequence(layout(model, batch)?))
    }

    /// The trunk's hidden states (autograd as the caller's mode): (B, L, H) or (R, H) rows.
    pub(super) fn trunk(&self, model: &CausalLm) -> Result<Tensor> {
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
    pub(super) fn outputs(&self) -> (&[i64], &[i64], &[usize]) {
        match self {
            Plan::PerSequence(l) => (&l.positions, &l.targets, &l.offsets),
            Plan::Shared(l) => (&l.positions, &l.targets, &l.offsets),
        }
    }

    pub(super) fn view(&self, model: &CausalLm) -> HiddenView {
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

#[cfg(test)]
mod prefix_grouping_tests {
    use super::super::Sequence;
    use super::group_prefixes;

    fn seq(prompt: Vec<u32>, completion: usize) -> Sequence {
        Sequence {
            prompt,
            completion: vec![7; completion],
        }
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
        let batch = vec![
            seq(vec![1, 2, 3], 90),
            seq(vec![1, 2, 3], 90),
            seq(vec![4, 5], 3),
        ];
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
