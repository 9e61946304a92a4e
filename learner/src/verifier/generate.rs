//! `learner verifier generate`: the verifier's training data, sampled through the rollout workers
//! (embedded or remote, as `learner train` finds them) and labelled by the reward server. Per
//! question of the train split: `verifier.samples_per_question` answers to the verifier's user
//! message at one temperature drawn from U(`temperature_min`, `temperature_max`) (MaPoRL: 1.3–1.5),
//! top-p `verifier.top_p`, at most `max_new_tokens`; each answer's correctness (1/0) from the task's
//! reward. The file (MaPoRL's layout, [`super::data`]) is rewritten atomically after every batch of
//! questions, and a rerun skips the questions it already holds, so an interrupted run resumes.

use std::path::Path;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tracing::info;

use super::data::{QuestionEntry, VerifierData};
use crate::config::{CheckedConfig, VerifierSection};
use crate::data::{DatasetKind, load_split};
use crate::trainer::items::{encode_text, item_json, reward_task};
use crate::trainer::{GenRequest, SamplingSpec, ScoreAction, TrainError, connect_services, derive_seed};

/// The worker agent that samples the answers (remote workers: `--agent agent0=MODEL`).
pub const AGENT: &str = "agent0";
/// Questions per generate/score round (and per rewrite of the file).
const QUESTIONS_PER_ROUND: usize = 8;
const TAG_GENERATE: u64 = 31;

/// What a generation run did.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateSummary {
    /// Questions sampled by this run.
    pub questions: usize,
    /// Questions the file already held (resumed).
    pub resumed: usize,
    pub answers: usize,
    pub correct: usize,
    pub seconds: f64,
}

/// Samples and labels answers for every question of the config's train split into `out`.
pub fn generate(cfg: &CheckedConfig, out: &Path) -> Result<GenerateSummary, TrainError> {
    let v: VerifierSection = cfg.raw.verifier.clone().unwrap_or_default();
    let kind = DatasetKind::resolve(&cfg.raw.dataset).map_err(|e| TrainError::Data(format!("{}: dataset: {e}", cfg.source.display())))?;
    let task = reward_task(kind);
    if !matches!(kind, DatasetKind::Gsm8k | DatasetKind::Anli) {
        return Err(TrainError::Config(format!("verifier data needs right/wrong answers: GSM8K or ANLI, not {}", kind.name())));
    }
    let user_template = v.template(task);
    let split = load_split(&cfg.raw.dataset, &cfg.train_split).map_err(|e| TrainError::Data(e.to_string()))?;
    let spec = cfg.raw.model.name.clone();
    let (tokenizer, template) = cotrain_model::loader::load_text_side(&spec).map_err(|e| TrainError::Model(format!("loading `{spec}`: {e}")))?;
    let mut data = if out.exists() { VerifierData::read(out).map_err(TrainError::Data)? } else { VerifierData::default() };
    let done: std::collections::HashSet<String> = data.questions.iter().map(|(q, _)| q.clone()).collect();
    let todo: Vec<(usize, serde_json::Value, String)> = split
        .items
        .iter()
        .enumerate()
        .map(|(i, it)| {
            let item = item_json(it);
            let q = super::question_text(task, &item);
            (split.row_offset + i, item, q)
        })
        .filter(|(_, _, q)| !done.contains(q))
        .collect();
    let resumed = split.items.len() - todo.len();
    if resumed > 0 {
        info!(resumed, remaining = todo.len(), file = %out.display(), "resuming: questions already in the file are skipped");
    }
    let services = connect_services(cfg, &[(AGENT.to_string(), spec.clone())])?;
    let (mut rollout, mut reward) = (services.rollout, services.reward);
    let pb = crate::trainer::run::progress_bar(cfg.raw.logging.progress, todo.len() as u64, 0);
    let started = Instant::now();
    let mut summary = GenerateSummary { questions: 0, resumed, answers: 0, correct: 0, seconds: 0.0 };
    for round in todo.chunks(QUESTIONS_PER_ROUND) {
        let mut requests = Vec::with_capacity(round.len());
        for (row, _, q) in round {
            let user = super::user_message(&user_template, q).map_err(TrainError::Config)?;
            let text = match (&template, cfg.raw.model.chat_template) {
                (Some(t), true) => t
                    .render(&[cotrain_model::chat_template::ChatMessage::user(user)], true, &serde_json::Value::Null)
                    .map_err(|e| TrainError::Model(format!("chat template: {e}")))?,
                (None, true) => return Err(TrainError::Config("model.chat_template is true but the model has no chat template".into())),
                (_, false) => user,
            };
            // One temperature per question, drawn from its own seeded stream.
            let mut rng = ChaCha8Rng::seed_from_u64(derive_seed(&[cfg.raw.seed, TAG_GENERATE, *row as u64]));
            let temperature = if v.temperature_max > v.temperature_min { rng.random_range(v.temperature_min..=v.temperature_max) } else { v.temperature_min };
            requests.push(GenRequest {
                agent: AGENT.into(),
                prompt: encode_text(&tokenizer, &text)?,
                n: v.samples_per_question,
                sampling: SamplingSpec { temperature, top_p: v.top_p, top_k: 0, max_new_tokens: v.max_new_tokens, ignore_eos: false },
                seed: rng.random(),
                min_policy_version: 0,
            });
        }
        let samples = rollout.generate(&requests)?;
        let actions: Vec<ScoreAction> = round
            .iter()
            .zip(&samples)
            .flat_map(|((_, item, _), got)| {
                got.iter().map(move |s| ScoreAction { completions: vec![s.text.clone()], completion_ids: vec![s.token_ids.clone()], item: item.clone() })
            })
            .collect();
        let scores = reward.score(task, &actions)?;
        let mut at = 0;
        for ((row, item, q), got) in round.iter().zip(&samples) {
            let sc = &scores[at..at + got.len()];
            at += got.len();
            let rewards: Vec<f64> = sc.iter().map(|s| if s.reward > 0.5 { 1.0 } else { 0.0 }).collect();
            summary.correct += rewards.iter().filter(|&&r| r > 0.5).count();
            summary.answers += got.len();
            let original = item.get("answer").or_else(|| item.get("label")).map(|a| a.as_str().map_or_else(|| a.to_string(), str::to_string)).unwrap_or_default();
            data.questions.push((
                q.clone(),
                QuestionEntry {
                    original_answer: original,
                    generated_answers: got.iter().map(|s| s.text.clone()).collect(),
                    rewards,
                    generated_label: sc.iter().map(|s| s.details.get("answer").and_then(|a| a.as_str().map(str::to_string)).unwrap_or_default()).collect(),
                    row: Some(*row),
                },
            ));
            summary.questions += 1;
        }
        data.write(out).map_err(TrainError::Io)?;
        if let Some(pb) = &pb {
            pb.set_position(summary.questions as u64);
            pb.set_message(format!("{} answers, {} correct", summary.answers, summary.correct));
        }
    }
    if let Some(pb) = pb {
        pb.finish_and_clear();
    }
    if todo.is_empty() {
        data.write(out).map_err(TrainError::Io)?;
    }
    summary.seconds = started.elapsed().as_secs_f64();
    drop(rollout);
    drop(reward);
    drop(services.guard);
    Ok(summary)
}
