//! The MaPoRL loop: per step, `questions_per_step` questions of the epoch's seeded order are discussed
//! ([`super::rollout`]), their answers scored and shaped into training scores R(t, i) (score rule,
//! incentives, penalties: `crate::algo::discussion_score`), the adapters updated with PPO ([`super::update`]), and
//! the new adapters pushed to the rollout workers (adapter tensors only) as version v + 1 before
//! anything else is sampled. Evaluation discusses the eval split's first `eval_num_samples` questions
//! and reports accuracy per turn.
//!
//! Files: `samples` (a step's discussions as PPO samples), `ranks` (the learner's ranks: split
//! discussions, first synchronisation), `output` (`rollouts.jsonl`, saved policies), `saved`
//! (evaluating saved policies: `learner eval`), `resume` (checkpoints and `--resume`), `harnessed`
//! (the trainer in the run harness, [`crate::harness`], which runs the loop); this file holds the
//! trainer and its step.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::agents::{Adapters, Bases, scheduled_lr};
use super::rollout::{Discussion, DiscussionSetup, discussion_metrics};
use super::update::ppo_update;
use crate::algo::discussion_score::{Incentives, ScoreRule};
use crate::config::{CheckedConfig, MaporlSection, VerifierUserMessage};
use crate::dist::{Collective, SingleRank};
use crate::error::TrainError;
use crate::metrics::MetricsWriter;
use crate::prompts::Followup;
use crate::prompts::items::PromptEncoding;
use crate::prompts::items::TrainItem;
use crate::seeds::derive_seed;
use crate::sources::{RewardSource, RolloutSource};

mod harnessed;
mod output;
mod ranks;
mod resume;
mod samples;
pub mod saved;

/// Everything a MaPoRL run needs.
pub struct MaporlSetup {
    pub cfg: CheckedConfig,
    pub run_dir: PathBuf,
    pub task: String,
    pub bases: Bases,
    pub adapters: Adapters,
    pub rollout: Box<dyn RolloutSource>,
    pub reward: Box<dyn RewardSource>,
    pub train_items: Vec<TrainItem>,
    pub eval_items: Vec<TrainItem>,
}

/// The trainer; see the module docs.
pub struct MaporlTrainer {
    pub s: MaporlSetup,
    m: MaporlSection,
    encoding: PromptEncoding,
    followup: Followup,
    /// `None` on ranks other than 0: rank 0 alone writes the run's files.
    metrics: Option<MetricsWriter>,
    /// The learner's ranks (see [`crate::dist`]): questions are split between them, PPO's
    /// mini-batches too (see [`ppo_update`]).
    dist: Box<dyn Collective>,
    rng: ChaCha8Rng,
    step: u64,
    history: Vec<BTreeMap<String, f64>>,
    evals: Vec<(u64, BTreeMap<String, f64>)>,
    /// The verifier scoring s(t, i) (`score: verifier`), by name.
    verifier: Option<String>,
    last_checkpoint: Option<PathBuf>,
}

const TAG_ORDER: u64 = 11;
const TAG_SAMPLE: u64 = 12;
const TAG_EVAL: u64 = 13;
const TAG_PPO: u64 = 14;

impl MaporlTrainer {
    pub fn new(s: MaporlSetup) -> Result<Self, TrainError> {
        Self::new_ranked(s, Box::new(SingleRank))
    }

    /// A trainer that is one of the data-parallel ranks of `dist`.
    pub fn new_ranked(s: MaporlSetup, dist: Box<dyn Collective>) -> Result<Self, TrainError> {
        let m = s
            .cfg
            .raw
            .maporl
            .clone()
            .ok_or_else(|| TrainError::Config("the config has no maporl section".into()))?;
        if s.train_items.is_empty() {
            return Err(TrainError::Data("the train split selects no rows".into()));
        }
        let metrics = if dist.is_root() {
            std::fs::create_dir_all(&s.run_dir)
                .map_err(|e| TrainError::Io(format!("{}: {e}", s.run_dir.display())))?;
            Some(
                MetricsWriter::create(&s.run_dir, s.cfg.raw.logging.tensorboard)
                    .map_err(|e| TrainError::Io(format!("{}: {e}", s.run_dir.display())))?,
            )
        } else {
            None
        };
        let followup = Followup::new(m.followup_style, m.followup_template.as_deref())
            .map_err(TrainError::Config)?;
        let encoding = s.cfg.prompt_encoding();
        let rng = ChaCha8Rng::seed_from_u64(derive_seed(&[s.cfg.raw.seed, TAG_PPO]));
        let verifier = super::verifier_name(&s.cfg, &m)?;
        Ok(Self {
            m,
            encoding,
            followup,
            metrics,
            dist,
            rng,
            step: 0,
            history: Vec::new(),
            evals: Vec::new(),
            verifier,
            last_checkpoint: None,
            s,
        })
    }

    fn versions(&self) -> BTreeMap<String, u64> {
        self.s
            .adapters
            .policies
            .iter()
            .map(|(k, p)| (k.clone(), p.version))
            .collect()
    }

    fn max_prompt_tokens(&self) -> usize {
        let by_length = self
            .s
            .cfg
            .raw
            .model
            .max_length
            .saturating_sub(self.m.max_output_length);
        self.m
            .max_input_length
            .map_or(by_length, |l| l.min(by_length))
    }

    fn discuss(&mut self, items: &[&TrainItem], seed: u64) -> Result<Vec<Discussion>, TrainError> {
        let versions = self.versions();
        let setup = DiscussionSetup {
            m: &self.m,
            num_agents: self.s.cfg.num_agents,
            task: &self.s.task,
            bases: &self.s.bases,
            encoding: &self.encoding,
            followup: &self.followup,
            versions: &versions,
            max_prompt_tokens: self.max_prompt_tokens(),
            verifier: self
                .verifier
                .as_ref()
                .map(|name| super::rollout::VerifierScoring {
                    name: name.clone(),
                    user_template: match self.m.verifier_user_message {
                        VerifierUserMessage::FirstTurn => None,
                        VerifierUserMessage::Template => Some(
                            self.s
                                .cfg
                                .raw
                                .verifier
                                .clone()
                                .unwrap_or_default()
                                .template(&self.s.task),
                        ),
                    },
                }),
        };
        setup.discuss(items, seed, self.s.rollout.as_mut(), self.s.reward.as_mut())
    }

    /// Steps of one epoch and of the run.
    pub fn total_steps(&self) -> u64 {
        let per_epoch = self
            .s
            .train_items
            .len()
            .div_ceil(self.m.questions_per_step()) as u64;
        per_epoch * self.m.num_train_epochs as u64
    }

    /// Accuracy per turn (and the other discussion metrics) on the eval split's first
    /// `eval_num_samples` questions, one discussion each.
    pub fn evaluate(&mut self) -> Result<BTreeMap<String, f64>, TrainError> {
        let n = self.m.eval_num_samples.min(self.s.eval_items.len());
        if n == 0 {
            return Ok(BTreeMap::new());
        }
        let items: Vec<TrainItem> = self.s.eval_items[..n].to_vec();
        let refs: Vec<&TrainItem> = items.iter().collect();
        let seed = derive_seed(&[self.s.cfg.raw.seed, TAG_EVAL, self.step]);
        let d = self.discuss(&refs, seed)?;
        Ok(discussion_metrics(&d, "eval/"))
    }

    /// One training step over `items`.
    pub fn train_step(
        &mut self,
        items: &[&TrainItem],
        total_steps: u64,
    ) -> Result<BTreeMap<String, f64>, TrainError> {
        let t0 = Instant::now();
        let seed = derive_seed(&[self.s.cfg.raw.seed, TAG_SAMPLE, self.step]);
        let discussions = self.discuss_ranked(items, seed)?;
        let t_rollout = t0.elapsed().as_secs_f64();
        let rule = ScoreRule {
            horizon: self.m.rule_horizon,
            agent_share: self.m.rule_agent_share,
            gamma: self.m.rule_discount,
            lookahead: self.m.rule_lookahead,
        };
        let inc = Incentives {
            alpha: self.m.alpha,
            rule: self.m.incentive_rule,
        };
        // Per agent: its base's stop tokens and pad token (eos when the tokenizer has none, as
        // MaPoRL sets it), which place each answer's trained tokens and score.
        let ends: Vec<(Vec<u32>, Option<u32>)> = (0..self.s.cfg.num_agents)
            .map(|i| {
                let base = &self.s.bases.models[self.s.bases.agent_base[i]];
                (
                    base.stop_token_ids(),
                    base.tokenizer.pad_id().or(base.tokenizer.eos_id()),
                )
            })
            .collect();
        let samples::StepSamples {
            samples,
            where_from,
            training_scores,
        } = samples::ppo_samples(&discussions, &self.m, &ends, &rule, &inc)?;
        let lr = scheduled_lr(
            self.m.learning_rate,
            self.m.lr_end_factor,
            self.step,
            total_steps,
        );
        self.s.adapters.set_lr(lr);
        let t1 = Instant::now();
        let concurrent = self.s.cfg.raw.learner.concurrent_policies;
        let (records, mut values) = ppo_update(
            &self.m,
            &self.s.bases,
            &mut self.s.adapters,
            &samples,
            &mut self.rng,
            self.dist.as_ref(),
            concurrent,
        )?;
        let t_update = t1.elapsed().as_secs_f64();
        let t2 = Instant::now();
        let trained: std::collections::BTreeSet<&str> =
            samples.iter().map(|s| s.policy.as_str()).collect();
        let trained: Vec<String> = trained.into_iter().map(str::to_string).collect();
        self.push_next_versions(&trained)?;
        let t_sync = t2.elapsed().as_secs_f64();
        values.extend(discussion_metrics(&discussions, ""));
        let all_r: Vec<f64> = training_scores
            .iter()
            .flatten()
            .flatten()
            .copied()
            .collect();
        values.insert(
            "training_score/mean".into(),
            all_r.iter().sum::<f64>() / all_r.len().max(1) as f64,
        );
        values.insert("lr".into(), lr);
        values.insert("time/rollout".into(), t_rollout);
        values.insert("time/update".into(), t_update);
        values.insert("time/weight_sync".into(), t_sync);
        values.insert("time/step".into(), t0.elapsed().as_secs_f64());
        values.insert(
            "reward/outage_secs".into(),
            self.s.reward.take_outage_secs(),
        );
        if self.s.cfg.raw.logging.rollouts && self.dist.is_root() {
            self.log_rollouts(items, &discussions, &training_scores, &where_from, &records)
                .map_err(|e| TrainError::Io(format!("rollouts.jsonl: {e}")))?;
        }
        Ok(values)
    }

    fn log(&mut self, values: &BTreeMap<String, f64>) -> Result<(), TrainError> {
        if let Some(metrics) = &mut self.metrics {
            metrics
                .log(self.step, values)
                .map_err(|e| TrainError::Io(format!("metrics: {e}")))?;
        }
        self.history.push(values.clone());
        Ok(())
    }
}
