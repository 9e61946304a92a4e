//! `learner verifier generate`: the verifier's training data, sampled through the rollout workers
//! (embedded or remote, as `learner train` finds them) and labelled by the reward server. Per
//! question of the train split: `verifier.samples_per_question` answers to the verifier's user
//! message at one temperature drawn from U(`temperature_min`, `temperature_max`) (MaPoRL: 1.3–1.5),
//! top-p `verifier.top_p`, at most `max_new_tokens`; each answer's correctness (1/0) from the task's
//! reward. The file (MaPoRL's layout, [`super::data`]) is rewritten atomically after every batch of
//! questions, and a rerun skips the questions it already holds, so an interrupted run resumes.
//!
//! [`Sampler`] is the part `verifier balance --config` reuses to fill short questions.

use std::path::Path;
use std::time::Instant;

use cotrain_model::chat_template::{ChatMessage, ChatTemplate};
use cotrain_model::tokenizer::Tokenizer;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tracing::info;

use super::data::{QuestionEntry, VerifierData};
use crate::config::{CheckedConfig, VerifierSection};
use crate::data::{DatasetKind, load_split};
use crate::error::TrainError;
use crate::prompts::items::{encode_text, item_json, reward_task};
use crate::seeds::derive_seed;
use crate::services::connect::{ServiceGuard, connect_services};
use crate::sources::{GenRequest, RewardSource, RolloutSource, SamplingSpec, ScoreAction};

/// The worker agent that samples the answers (remote workers: `--agent agent0=MODEL`).
pub const AGENT: &str = "agent0";
/// Questions per generate/score round (and per rewrite of the file).
const QUESTIONS_PER_ROUND: usize = 8;
/// Samples per request when the workers do not say how many they take (a rollout worker's default
/// `--max-batch-size`). A worker refuses an `n` above its `--max-batch-size`, so a larger ask
/// (MaPoRL's 100 per question) becomes several requests of at most what every worker takes.
const MAX_SAMPLES_PER_REQUEST: usize = cotrain_proto::wire::DEFAULT_MAX_BATCH_SIZE;
const TAG_GENERATE: u64 = 31;

/// One request for answers: the dataset row, the user message, how many, and a seed tag.
#[derive(Debug, Clone)]
pub struct Ask {
    pub item: serde_json::Value,
    pub user: String,
    pub n: usize,
    /// Distinguishes the seeds of different asks about the same row.
    pub seed_parts: Vec<u64>,
    /// `None`: drawn from the section's range.
    pub temperature: Option<f64>,
}

/// One labelled answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Labelled {
    pub text: String,
    pub correct: bool,
    /// The final answer the reward read (empty when none).
    pub label: String,
}

/// Samples answers through the rollout workers and labels them with the reward server.
pub struct Sampler {
    pub task: String,
    section: VerifierSection,
    seed: u64,
    chat: bool,
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    // Declared before `_guard`: fields drop in order, so the clients close before the embedded
    // services they talk to stop.
    rollout: Box<dyn RolloutSource>,
    reward: Box<dyn RewardSource>,
    _guard: ServiceGuard,
}

impl Sampler {
    /// Connects to (or starts) the services `cfg` names, serving `model.name` as [`AGENT`].
    pub fn connect(cfg: &CheckedConfig) -> Result<Self, TrainError> {
        let kind = DatasetKind::resolve(&cfg.raw.dataset)
            .map_err(|e| TrainError::Data(format!("{}: dataset: {e}", cfg.source.display())))?;
        if !matches!(kind, DatasetKind::Gsm8k | DatasetKind::Anli) {
            return Err(TrainError::Config(format!(
                "verifier data needs right/wrong answers: GSM8K or ANLI, not {}",
                kind.name()
            )));
        }
        let spec = cfg.raw.model.name.clone();
        let (tokenizer, template) = cotrain_model::loader::load_text_side(&spec)
            .map_err(|e| TrainError::Model(format!("loading `{spec}`: {e}")))?;
        if cfg.raw.model.chat_template && template.is_none() {
            return Err(TrainError::Config(
                "model.chat_template is true but the model has no chat template".into(),
            ));
        }
        let services = connect_services(cfg, &[(AGENT.to_string(), spec)])?;
        Ok(Self {
            task: reward_task(kind).to_string(),
            section: cfg.raw.verifier.clone().unwrap_or_default(),
            seed: cfg.raw.seed,
            chat: cfg.raw.model.chat_template,
            tokenizer,
            template,
            rollout: services.rollout,
            reward: services.reward,
            _guard: services.guard,
        })
    }

    /// The verifier's user message for `question`.
    pub fn user_message(&self, question: &str) -> Result<String, TrainError> {
        super::user_message(&self.section.template(&self.task), question)
            .map_err(TrainError::Config)
    }

    fn prompt(&self, user: &str) -> Result<Vec<u32>, TrainError> {
        let text = match (&self.template, self.chat) {
            (Some(t), true) => t
                .render(&[ChatMessage::user(user)], true, &serde_json::Value::Null)
                .map_err(|e| TrainError::Model(format!("chat template: {e}")))?,
            _ => user.to_string(),
        };
        encode_text(&self.tokenizer, &text)
    }

    /// Samples every ask (one concurrent batch; an ask for more than a worker takes at once is
    /// split, see `request_sizes`) and labels every answer (one reward call).
    pub fn sample(&mut self, asks: &[Ask]) -> Result<Vec<Vec<Labelled>>, TrainError> {
        let max_n = self
            .rollout
            .max_samples_per_request(AGENT)
            .unwrap_or(MAX_SAMPLES_PER_REQUEST);
        let v = &self.section;
        let mut requests = Vec::with_capacity(asks.len());
        // Requests per ask, in order.
        let mut spans = Vec::with_capacity(asks.len());
        for a in asks {
            let mut parts = vec![self.seed, TAG_GENERATE];
            parts.extend(&a.seed_parts);
            let mut rng = ChaCha8Rng::seed_from_u64(derive_seed(&parts));
            let drawn = if v.temperature_max > v.temperature_min {
                rng.random_range(v.temperature_min..=v.temperature_max)
            } else {
                v.temperature_min
            };
            let prompt = self.prompt(&a.user)?;
            // One temperature per ask (MaPoRL draws one per question); each request its own seed
            // from the ask's stream, the first the seed an unsplit ask had, so asks a worker takes
            // at once sample what they always did.
            let sampling = SamplingSpec {
                temperature: a.temperature.unwrap_or(drawn),
                top_p: v.top_p,
                top_k: 0,
                max_new_tokens: v.max_new_tokens,
                ignore_eos: false,
                stop: Vec::new(),
                sampling_logprobs: false,
            };
            let before = requests.len();
            for n in request_sizes(a.n, max_n) {
                requests.push(GenRequest {
                    agent: AGENT.into(),
                    prompt: prompt.clone(),
                    n,
                    sampling: sampling.clone(),
                    seed: rng.random(),
                    min_policy_version: 0,
                });
            }
            spans.push(requests.len() - before);
        }
        let mut samples = self.rollout.generate(&requests)?.into_iter();
        let texts: Vec<Vec<String>> = spans
            .iter()
            .map(|&k| samples.by_ref().take(k).flatten().map(|s| s.text).collect())
            .collect();
        self.label(&asks.iter().map(|a| &a.item).collect::<Vec<_>>(), &texts)
    }

    /// Labels `texts[k]` (answers to `items[k]`) with the task's reward: correct above 0.5.
    pub fn label(
        &mut self,
        items: &[&serde_json::Value],
        texts: &[Vec<String>],
    ) -> Result<Vec<Vec<Labelled>>, TrainError> {
        let actions: Vec<ScoreAction> = items
            .iter()
            .zip(texts)
            .flat_map(|(item, got)| {
                got.iter().map(move |t| ScoreAction {
                    completions: vec![t.clone()],
                    completion_ids: vec![Vec::new()],
                    item: (*item).clone(),
                })
            })
            .collect();
        let scores = if actions.is_empty() {
            Vec::new()
        } else {
            self.reward.score(&self.task, &actions)?
        };
        let mut at = 0;
        Ok(texts
            .iter()
            .map(|got| {
                let out = got
                    .iter()
                    .zip(&scores[at..at + got.len()])
                    .map(|(t, s)| Labelled {
                        text: t.clone(),
                        correct: s.reward > 0.5,
                        label: s
                            .details
                            .get("answer")
                            .and_then(|a| a.as_str().map(str::to_string))
                            .unwrap_or_default(),
                    })
                    .collect();
                at += got.len();
                out
            })
            .collect())
    }
}

/// The `n` of each request that asks for `n` samples when a worker takes at most `max` at once:
/// full requests, then the rest (`100, 64` → 64, 36).
fn request_sizes(n: usize, max: usize) -> impl Iterator<Item = usize> {
    (0..n.div_ceil(max)).map(move |k| max.min(n - k * max))
}

/// The dataset's reference answer of a row (GSM8K's worked solution, ANLI's label).
pub fn reference_answer(item: &serde_json::Value) -> String {
    item.get("answer")
        .or_else(|| item.get("label"))
        .map(|a| a.as_str().map_or_else(|| a.to_string(), str::to_string))
        .unwrap_or_default()
}

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
    let split = load_split(&cfg.raw.dataset, &cfg.train_split)
        .map_err(|e| TrainError::Data(e.to_string()))?;
    let mut data = if out.exists() {
        VerifierData::read(out).map_err(TrainError::Data)?
    } else {
        VerifierData::default()
    };
    let mut sampler = Sampler::connect(cfg)?;
    let done: std::collections::HashSet<String> =
        data.questions.iter().map(|(q, _)| q.clone()).collect();
    let todo: Vec<(usize, serde_json::Value, String)> = split
        .items
        .iter()
        .enumerate()
        .map(|(i, it)| {
            let item = item_json(it);
            let q = super::question_text(&sampler.task, &item);
            (split.row_offset + i, item, q)
        })
        .filter(|(_, _, q)| !done.contains(q))
        .collect();
    let resumed = split.items.len() - todo.len();
    if resumed > 0 {
        info!(resumed, remaining = todo.len(), file = %out.display(), "resuming: questions already in the file are skipped");
    }
    let pb = crate::metrics::progress::progress_bar(cfg.raw.logging.progress, todo.len() as u64, 0);
    let started = Instant::now();
    let mut summary = GenerateSummary {
        questions: 0,
        resumed,
        answers: 0,
        correct: 0,
        seconds: 0.0,
    };
    for round in todo.chunks(QUESTIONS_PER_ROUND) {
        let asks = round
            .iter()
            .map(|(row, item, q)| {
                Ok(Ask {
                    item: item.clone(),
                    user: sampler.user_message(q)?,
                    n: v.samples_per_question,
                    seed_parts: vec![*row as u64],
                    temperature: None,
                })
            })
            .collect::<Result<Vec<_>, TrainError>>()?;
        let answers = sampler.sample(&asks)?;
        for ((row, item, q), got) in round.iter().zip(answers) {
            summary.correct += got.iter().filter(|a| a.correct).count();
            summary.answers += got.len();
            data.questions.push((
                q.clone(),
                QuestionEntry {
                    original_answer: reference_answer(item),
                    rewards: got
                        .iter()
                        .map(|a| if a.correct { 1.0 } else { 0.0 })
                        .collect(),
                    generated_label: got.iter().map(|a| a.label.clone()).collect(),
                    generated_answers: got.into_iter().map(|a| a.text).collect(),
                    row: Some(*row),
                },
            ));
            summary.questions += 1;
        }
        data.write(out).map_err(TrainError::Io)?;
        if let Some(pb) = &pb {
            pb.set_position(summary.questions as u64);
            pb.set_message(format!(
                "{} answers, {} correct",
                summary.answers, summary.correct
            ));
        }
    }
    if let Some(pb) = pb {
        pb.finish_and_clear();
    }
    if todo.is_empty() {
        data.write(out).map_err(TrainError::Io)?;
    }
    summary.seconds = started.elapsed().as_secs_f64();
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ask_above_the_worker_limit_becomes_full_requests_then_the_rest() {
        let sizes = |n, max| request_sizes(n, max).collect::<Vec<_>>();
        assert_eq!(sizes(100, 64), [64, 36]);
        assert_eq!(sizes(128, 64), [64, 64]);
        assert_eq!(sizes(129, 64), [64, 64, 1]);
        assert_eq!(sizes(64, 64), [64]);
        assert_eq!(sizes(4, 64), [4]);
        assert!(sizes(0, 64).is_empty());
    }
}
