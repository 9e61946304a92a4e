//! The two seams between the trainers and the outside world: where samples come from
//! ([`RolloutSource`]) and where rewards come from ([`RewardSource`]).
//!
//! The real implementations talk gRPC ([`crate::services`]): the rollout-worker pool and the reward
//! server, remote or embedded in this process. The in-process engine implementation
//! ([`crate::services::EngineRollout`]) and test reward functions implement the same traits, so the
//! algorithm is tested on exactly the code path the services use.
//!
//! Both traits are synchronous on purpose: the trainer's thread owns the tensors and blocks on
//! network calls; the gRPC implementations run them on their own tokio runtime. An asynchronous
//! rollout mode (`rollout.max_off_policy_steps > 0`) would plug in as a `RolloutSource` that keeps
//! requests for the next steps in flight while the trainer updates, accepting samples whose
//! `policy_version` lags by at most that bound.

use std::collections::BTreeMap;

use tch::Tensor;

use crate::error::TrainError;

/// Sampling parameters of one request.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingSpec {
    pub temperature: f64,
    pub top_p: f64,
    /// 0 disables top-k.
    pub top_k: u32,
    pub max_new_tokens: usize,
    /// Keep sampling past EOS up to `max_new_tokens` (benchmarks; training stops at EOS).
    pub ignore_eos: bool,
    /// Strings that end a completion (cut from the text; the token that completed one is kept).
    pub stop: Vec<String>,
    /// Report the log-probs under the distribution sampled from (over the temperature, after the
    /// filters) rather than the raw logits' (see [`GenSample::logprobs`]).
    pub sampling_logprobs: bool,
}

impl SamplingSpec {
    /// The same limits with argmax decoding: temperature 0 is greedy in the engine and on the wire
    /// (top-k and top-p do not change an argmax).
    pub fn greedy(self) -> Self {
        Self {
            temperature: 0.0,
            ..self
        }
    }
}

/// `n` samples of one prompt for one worker agent.
#[derive(Debug, Clone, PartialEq)]
pub struct GenRequest {
    /// The agent name the rollout workers know (`agent0`, `agent1`, ...).
    pub agent: String,
    /// Prompt token ids (chat template applied).
    pub prompt: Vec<u32>,
    pub n: usize,
    pub sampling: SamplingSpec,
    /// Derived from (run seed, step, agent, item): the same request draws the same samples.
    pub seed: u64,
    /// Workers below this policy version must refuse the request.
    pub min_policy_version: u64,
}

/// One sampled completion.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GenSample {
    pub token_ids: Vec<u32>,
    pub text: String,
    /// Behaviour-policy log-prob of each token: under the raw logits (temperature 1), or with
    /// [`SamplingSpec::sampling_logprobs`] under the distribution sampled from.
    pub logprobs: Vec<f32>,
    /// Ended on EOS / a stop condition rather than the length limit.
    pub stopped: bool,
    /// The policy version that produced it.
    pub policy_version: u64,
}

/// Where samples come from.
/// What the last weight push cost.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PushStats {
    /// Payload bytes sent to each worker (one serialisation, streamed to all of them at once).
    pub bytes: u64,
    /// Workers that took it.
    pub workers: usize,
    /// Seconds from the start of serialising to every worker serving the new version.
    pub secs: f64,
}

/// The rollout worker pool as the trainer logs it (counters are cumulative over the run).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PoolStats {
    /// Workers the pool knows.
    pub workers: usize,
    /// Of those, healthy and at the current policy (getting requests).
    pub in_rotation: usize,
    /// Generate attempts that failed on a worker and were sent to another one.
    pub failed_attempts: u64,
    /// Times a joining, restarted or lagging worker was brought to the current policy.
    pub catch_ups: u64,
}

/// One agent's part of [`RolloutSource::push_weights_all`].
#[derive(Debug, Clone, Copy)]
pub struct WeightPush<'a> {
    pub agent: &'a str,
    pub version: u64,
    pub params: &'a BTreeMap<String, Tensor>,
    /// `Some(alpha / r)`: `params` are a LoRA adapter's pairs, which the workers merge into their
    /// base weights ([`RolloutSource::push_adapter`]); `None`: the parameters themselves.
    pub lora_scaling: Option<f64>,
    /// The policy's log-probs of a fixed sequence under these weights, for workers that check
    /// what their engine loaded (`serve --engine vllm`); `None`: no check.
    pub probe: Option<&'a cotrain_proto::rollout::WeightProbe>,
}

pub trait RolloutSource: Send {
    /// Runs every request; returns, per request and in order, its `n` samples.
    fn generate(&mut self, requests: &[GenRequest]) -> Result<Vec<Vec<GenSample>>, TrainError>;
    /// The highest policy version any worker reports for `agent` (0 when none was pushed).
    fn policy_version(&mut self, agent: &str) -> Result<u64, TrainError>;
    /// Replaces `agent`'s weights on every worker with `params` as `version`, and returns once every
    /// worker serves that version.
    fn push_weights(
        &mut self,
        agent: &str,
        version: u64,
        params: &BTreeMap<String, Tensor>,
    ) -> Result<(), TrainError>;
    /// Pushes several distinct agents' weights, each as [`Self::push_weights`], and returns once
    /// every worker serves every new version. Sources that can overlap the pushes do; by default
    /// they go one after another.
    fn push_weights_all(&mut self, updates: &[WeightPush<'_>]) -> Result<(), TrainError> {
        for u in updates {
            match u.lora_scaling {
                Some(scaling) => self.push_adapter(u.agent, u.version, u.params, scaling)?,
                None => self.push_weights(u.agent, u.version, u.params)?,
            }
        }
        Ok(())
    }
    /// The cost of the last push (all of the last [`Self::push_weights_all`]), when the source
    /// measures it.
    fn last_push(&self) -> Option<PushStats> {
        None
    }
    /// The worker pool's state, when generation goes through one.
    fn pool_stats(&self) -> Option<PoolStats> {
        None
    }
    /// The most samples one request for `agent` may ask for on every worker that serves it (their
    /// `--max-batch-size`), when the source knows; callers split larger asks.
    fn max_samples_per_request(&mut self, agent: &str) -> Option<usize> {
        let _ = agent;
        None
    }
    /// Sends only a LoRA adapter for `agent` as `version`, and returns once every worker serves that
    /// version. `adapter` holds pairs `X.lora_A.weight` (r × in) and `X.lora_B.weight` (out × r) for
    /// base parameters `X.weight` (names as `LoraAdapter::named_tensors` or `peft_tensors` give
    /// them); the workers serve `X.weight = W0 + scaling·B·A` with `W0` their base weights as loaded
    /// from the model spec, not the current ones, so each push replaces the previous adapter, and
    /// every parameter the adapter does not name keeps its value. A push of a few megabytes instead
    /// of the whole model when only the adapter trains. Sources that cannot merge refuse, naming
    /// themselves.
    fn push_adapter(
        &mut self,
        agent: &str,
        version: u64,
        adapter: &BTreeMap<String, Tensor>,
        scaling: f64,
    ) -> Result<(), TrainError> {
        let _ = (agent, version, adapter, scaling);
        Err(TrainError::Rollout(format!(
            "{} cannot take adapter-only weight updates",
            self.describe()
        )))
    }
    /// Scores (user, assistant) conversations with the learned verifier `name` (empty: a worker's
    /// only verifier) that a rollout worker serves: the probability each answer is correct.
    fn score_verifier(
        &mut self,
        name: &str,
        conversations: &[(String, String)],
    ) -> Result<Vec<f32>, TrainError> {
        let _ = (name, conversations);
        Err(TrainError::Rollout(format!(
            "{} serves no learned verifier",
            self.describe()
        )))
    }
    /// A short description for logs (`embedded worker at 127.0.0.1:41234`, ...).
    fn describe(&self) -> String;
}

/// One joint action to score: one completion per agent and the dataset row.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoreAction {
    pub completions: Vec<String>,
    pub completion_ids: Vec<Vec<u32>>,
    /// The dataset row as the reward server reads it.
    pub item: serde_json::Value,
}

/// The score of one joint action.
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct Score {
    pub reward: f64,
    /// Reward contributed by each level (`level_1`, ...).
    pub levels: BTreeMap<String, f64>,
    /// Task-specific measurements (tests passed, cooperation bonus, ...), as the server sent them.
    pub details: serde_json::Value,
    /// For code tasks: the test and cooperation figures the @k metrics read, typed once where the
    /// reward arrives (see [`CodeOutcome::from_details`]).
    pub code: Option<CodeOutcome>,
}

/// What the evaluation metrics need from a code reward.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct CodeOutcome {
    pub passed_tests: u64,
    pub total_tests: u64,
    /// Level 4: the cooperation bonus (0 for a single agent).
    pub cooperation_bonus: f64,
}

impl CodeOutcome {
    /// Reads the code reward's details (`passed_tests`, `total_tests`, `bonus.total`); `None` when
    /// they are not a code reward's.
    pub fn from_details(details: &serde_json::Value) -> Option<Self> {
        use serde::Deserialize;
        #[derive(serde::Deserialize)]
        struct Bonus {
            total: f64,
        }
        #[derive(serde::Deserialize)]
        struct Details {
            passed_tests: u64,
            total_tests: u64,
            bonus: Option<Bonus>,
        }
        let d = Details::deserialize(details).ok()?;
        Some(Self {
            passed_tests: d.passed_tests,
            total_tests: d.total_tests,
            cooperation_bonus: d.bonus.map_or(0.0, |b| b.total),
        })
    }

    /// Every test passed (an item without tests never counts as passed).
    pub fn all_passed(&self) -> bool {
        self.total_tests > 0 && self.passed_tests == self.total_tests
    }

    pub fn pass_rate(&self) -> f64 {
        if self.total_tests == 0 {
            0.0
        } else {
            self.passed_tests as f64 / self.total_tests as f64
        }
    }
}

/// What a next-turn feedback request asks for (`external.mode`, `external.sandbox_slice`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FeedbackSpec {
    /// `level_feedback`, `level_passed`, `passed` or `plain` (never `expert_edits`, which the
    /// learner builds with its expert client).
    pub mode: crate::config::ExternalMode,
    /// Tests shown: n > 0 the first n, n < 0 the last |n|, `None` all.
    pub sandbox_slice: Option<i64>,
}

/// The reward server's analysis of one joint action.
#[derive(Debug, Clone, Default)]
pub struct Analysis {
    /// One feedback text per agent, each ending with the request to revise.
    pub feedback: Vec<String>,
    /// The code diagnostics the texts were written from (code tasks on the reward server).
    pub diagnostics: Option<cotrain_reward_server::rewards::CodeDiagnostics>,
}

/// Where rewards come from.
pub trait RewardSource: Send {
    /// Scores a batch of joint actions of `task` (`code`, `arxiv`, `tldr`, `gsm8k`, `anli`, or a
    /// test task); results in request order.
    fn score(&mut self, task: &str, actions: &[ScoreAction]) -> Result<Vec<Score>, TrainError>;
    /// The next-turn feedback text of every agent of every joint action (the reward server's
    /// `Analyze`): per action, one text per agent, each ending with the request to revise. Sources
    /// without an analysis refuse, naming themselves.
    fn feedback(
        &mut self,
        task: &str,
        actions: &[ScoreAction],
        spec: &FeedbackSpec,
    ) -> Result<Vec<Vec<String>>, TrainError> {
        let _ = (actions, spec);
        Err(TrainError::Reward(format!(
            "{} gives no next-turn feedback for task `{task}`",
            self.describe()
        )))
    }
    /// The analysis behind [`Self::feedback`]: per action, the texts and, where the source has
    /// them, the structured code diagnostics (what the original's next-turn wordings print).
    /// Sources without diagnostics give the texts alone.
    fn analyze(
        &mut self,
        task: &str,
        actions: &[ScoreAction],
        spec: &FeedbackSpec,
    ) -> Result<Vec<Analysis>, TrainError> {
        Ok(self
            .feedback(task, actions, spec)?
            .into_iter()
            .map(|feedback| Analysis {
                feedback,
                diagnostics: None,
            })
            .collect())
    }
    /// Seconds spent waiting for an unreachable reward server since the last call (sources that
    /// cannot be unreachable: 0); reported per step as `reward/outage_secs`.
    fn take_outage_secs(&mut self) -> f64 {
        0.0
    }
    fn describe(&self) -> String;
}
