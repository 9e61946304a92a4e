//! The update's rows: which tokens a policy or critic forward reads for a sample (its prompt, then
//! its response), grouped by question, and the critic's values read back at the response's
//! positions. Every phase of the update builds its model inputs here.

use std::collections::BTreeMap;

use cotrain_model::families::CausalLm;
use cotrain_model::logprobs::Sequence;
use tch::{Kind, Tensor};

use super::super::agents::Critic;
use super::PpoSample;
use crate::error::TrainError;

pub(super) fn model_err(what: &str) -> impl Fn(cotrain_model::ModelError) -> TrainError + '_ {
    move |e| TrainError::Update(format!("{what}: {e}"))
}

/// Which tokens of a sample a forward reads before its response.
pub(super) type Prompt = fn(&PpoSample) -> &Vec<u32>;
/// How many positions of a sample count for something (read by a forward, or averaged by a loss).
pub(super) type Positions = fn(&PpoSample) -> usize;

/// The policy's input: a sample's prompt.
pub(super) const POLICY_PROMPT: Prompt = |s| &s.prompt;
/// The critic's input: a sample's value prompt.
pub(super) const VALUE_PROMPT: Prompt = |s| &s.value_prompt;

/// Samples `part` as the model's rows (`prompt` then the response) and each row's question: the
/// kernels share prompt prefixes within a question only, so that a row's arithmetic is the same
/// whichever questions share its batch (one rank or several).
pub(super) fn rows_of(
    samples: &[PpoSample],
    part: &[usize],
    prompt: Prompt,
) -> (Vec<Sequence>, Vec<usize>) {
    part.iter()
        .map(|&k| {
            let row = Sequence {
                prompt: prompt(&samples[k]).clone(),
                completion: samples[k].response.clone(),
            };
            (row, samples[k].question)
        })
        .unzip()
}

/// Values (B, Cmax) of samples `part` at the first `value_len()` positions predicting each
/// response token (prompt_len − 1 + t; t = len(response) is the state after the response), zero
/// beyond, and those counts.
pub(super) fn response_values(
    critic: &Critic,
    base: &CausalLm,
    samples: &[PpoSample],
    part: &[usize],
    with_grad: bool,
) -> Result<(Tensor, Vec<usize>), TrainError> {
    let (rows, questions) = rows_of(samples, part, VALUE_PROMPT);
    let counts: Vec<usize> = part.iter().map(|&k| samples[k].value_len()).collect();
    let v = critic.values(base, &rows, &questions, with_grad)?;
    let l = v.size()[1];
    let cmax = counts.iter().copied().max().unwrap_or(0) as i64;
    let (mut src, mut dst) = (Vec::new(), Vec::new());
    for (b, row) in rows.iter().enumerate() {
        assert!(
            counts[b] <= row.completion.len() + 1,
            "at most one value position past the response"
        );
        for t in 0..counts[b] {
            src.push(b as i64 * l + (row.prompt.len() + t - 1) as i64);
            dst.push(b as i64 * cmax + t as i64);
        }
    }
    let device = v.device();
    let flat = v
        .reshape([-1])
        .index_select(0, &Tensor::from_slice(&src).to_device(device));
    let out = Tensor::zeros([rows.len() as i64 * cmax], (Kind::Float, device));
    let values = out
        .index_put(
            &[Some(Tensor::from_slice(&dst).to_device(device))],
            &flat,
            false,
        )
        .view([rows.len() as i64, cmax]);
    Ok((values, counts))
}

/// Per-sample vectors padded into (B, Cmax) f32.
pub(super) fn pad(rows: &[&[f64]], cmax: usize) -> Tensor {
    let mut out = vec![0f32; rows.len() * cmax];
    for (b, r) in rows.iter().enumerate() {
        for (j, x) in r.iter().enumerate() {
            out[b * cmax + j] = *x as f32;
        }
    }
    Tensor::from_slice(&out).view([rows.len() as i64, cmax as i64])
}

/// The samples `idx` grouped by question (in order of first appearance): the unit the update
/// batches, shuffles and splits. MaPoRL's trainer permutes the questions of a step and forwards
/// every (turn, agent) answer of a question in the same micro-batch, and those answers begin alike
/// (the question's message; for the critic the whole turn-0 prompt), so their forwards share that
/// prefix ([`cotrain_model::logprobs::completion_logprobs_within`], [`Critic::values`]).
pub(super) fn question_units(idx: &[usize], samples: &[PpoSample]) -> Vec<Vec<usize>> {
    let mut units: Vec<Vec<usize>> = Vec::new();
    let mut unit_of: BTreeMap<usize, usize> = BTreeMap::new();
    for &k in idx {
        let u = *unit_of.entry(samples[k].question).or_insert_with(|| {
            units.push(Vec::new());
            units.len() - 1
        });
        units[u].push(k);
    }
    units
}

/// The positions the policy loss averages over: the response tokens.
pub(super) const POLICY_LEN: Positions = |s| s.response.len();
/// The positions a policy forward runs: the prompt and the response.
pub(super) const POLICY_POSITIONS: Positions = |s| s.prompt.len() + s.response.len();
/// The positions a critic forward runs: the value prompt and the response.
pub(super) const VALUE_POSITIONS: Positions = |s| s.value_prompt.len() + s.response.len();
