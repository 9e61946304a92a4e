//! `verifier`: MaPoRL's learned verifier (the book's "The learned verifier", docs/src/trainers/verifier.md): how
//! `learner verifier generate` samples answers and how `learner verifier train` trains. Defaults
//! are MaPoRL's (`config/reward_data_gen_config/config_gen.py`, `config/reward_config/*.py`):
//! answers sampled at a temperature drawn from U(1.3, 1.5) with top-p 0.9 and 300 new tokens; a
//! LoRA r 16 / alpha 32 / dropout 0.05 verifier on every projection, AdamW lr 2e-4 with betas
//! (0.9, 0.95), 5 warm-up steps then constant, 1 epoch of 4 × 2 answers per step, 550 tokens, the
//! last 100 questions held out.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::LoraSection;

/// `verifier`: see the module docs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct VerifierSection {
    /// The user message of every (question, answer) pair `learner verifier generate` samples and
    /// `verifier train` trains on, and of MaPoRL's scoring with `maporl.verifier_user_message:
    /// template` (minijinja; `question` is the dataset row's question or premise/hypothesis text;
    /// MaPoRL's default scoring sends each agent's turn-0 question message instead, as the
    /// original). Unset: cotrain's default for the task, asking for a reasoned answer ending in
    /// `\boxed{}` (a number for GSM8K, the relation for ANLI).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_template: Option<String>,
    /// Answers sampled per question by `verifier generate`.
    #[serde(default = "default_samples")]
    pub samples_per_question: usize,
    /// Each question's sampling temperature is drawn uniformly from [min, max].
    #[serde(default = "default_temp_min")]
    pub temperature_min: f64,
    /// See `temperature_min`.
    #[serde(default = "default_temp_max")]
    pub temperature_max: f64,
    /// Nucleus-sampling threshold of `verifier generate`.
    #[serde(default = "default_top_p")]
    pub top_p: f64,
    /// Most tokens of each answer `verifier generate` samples.
    #[serde(default = "default_max_new_tokens")]
    pub max_new_tokens: usize,
    /// Train every weight instead of a LoRA adapter.
    #[serde(default)]
    pub full_finetune: bool,
    /// The verifier's LoRA adapter (unless `full_finetune`).
    #[serde(default = "default_lora")]
    pub lora: LoraSection,
    /// AdamW learning rate (after the warm-up).
    #[serde(default = "default_lr")]
    pub learning_rate: f64,
    /// AdamW β1.
    #[serde(default = "default_beta1")]
    pub beta1: f64,
    /// AdamW β2.
    #[serde(default = "default_beta2")]
    pub beta2: f64,
    /// AdamW weight decay.
    #[serde(default)]
    pub weight_decay: f64,
    /// Linear warm-up from 0 over this many optimiser steps, then constant (DeepSpeed's WarmupLR).
    #[serde(default = "default_warmup")]
    pub warmup_steps: usize,
    /// Passes over the training answers.
    #[serde(default = "default_one")]
    pub num_train_epochs: usize,
    /// Answers per step = per_device_train_batch_size × gradient_accumulation_steps.
    #[serde(default = "default_batch")]
    pub per_device_train_batch_size: usize,
    /// See `per_device_train_batch_size`.
    #[serde(default = "default_accum")]
    pub gradient_accumulation_steps: usize,
    /// Longest (question, answer) encoding; longer ones keep their last tokens.
    #[serde(default = "default_max_length")]
    pub max_length: usize,
    /// The last this-many questions of the data file are held out for evaluation.
    #[serde(default = "default_test_questions")]
    pub test_questions: usize,
    /// Evaluate on the held-out answers every this-many optimiser steps (and at the end).
    #[serde(default = "default_eval_interval")]
    pub eval_interval: usize,
}

impl Default for VerifierSection {
    fn default() -> Self {
        serde_yaml_ng::from_str("{}").expect("every key has a default")
    }
}

impl VerifierSection {
    /// Checks ranges; `Err((key, message))`.
    pub fn validate(&self) -> Result<(), (String, String)> {
        let bad = |k: &str, m: String| Err((k.to_string(), m));
        if !(self.temperature_min > 0.0 && self.temperature_min <= self.temperature_max) {
            return bad(
                "temperature_min",
                format!(
                    "must be positive and at most temperature_max ({} > {})",
                    self.temperature_min, self.temperature_max
                ),
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", format!("must be in (0, 1], got {}", self.top_p));
        }
        for (k, v) in [
            ("samples_per_question", self.samples_per_question),
            ("max_new_tokens", self.max_new_tokens),
            ("num_train_epochs", self.num_train_epochs),
            (
                "per_device_train_batch_size",
                self.per_device_train_batch_size,
            ),
            (
                "gradient_accumulation_steps",
                self.gradient_accumulation_steps,
            ),
            ("max_length", self.max_length),
            ("eval_interval", self.eval_interval),
        ] {
            if v == 0 {
                return bad(k, "must be at least 1".into());
            }
        }
        if !(self.learning_rate.is_finite() && self.learning_rate > 0.0) {
            return bad(
                "learning_rate",
                format!("must be positive, got {}", self.learning_rate),
            );
        }
        if !self.full_finetune
            && let Err(e) = self.lora.to_model().validate()
        {
            return bad("lora", e.to_string());
        }
        Ok(())
    }

    /// The user-message template for `task` (the reward server's task name).
    pub fn template(&self, task: &str) -> String {
        if let Some(t) = &self.user_template {
            return t.clone();
        }
        match task {
            "anli" => "{{ question }}\n\nDoes the premise entail the hypothesis, contradict it, or neither? Reason briefly, then give \
                       \\boxed{entailment}, \\boxed{contradiction} or \\boxed{neutral}."
                .into(),
            _ => "Question: {{ question }}\n\nReason step by step, then give the final answer as \\boxed{ANSWER}.".into(),
        }
    }
}

fn default_samples() -> usize {
    100
}
fn default_temp_min() -> f64 {
    1.3
}
fn default_temp_max() -> f64 {
    1.5
}
fn default_top_p() -> f64 {
    0.9
}
fn default_max_new_tokens() -> usize {
    300
}
fn default_lora() -> LoraSection {
    LoraSection {
        r: 16,
        lora_alpha: 32.0,
        ..LoraSection::default()
    }
}
fn default_lr() -> f64 {
    2e-4
}
fn default_beta1() -> f64 {
    0.9
}
fn default_beta2() -> f64 {
    0.95
}
fn default_warmup() -> usize {
    5
}
fn default_one() -> usize {
    1
}
fn default_batch() -> usize {
    4
}
fn default_accum() -> usize {
    2
}
fn default_max_length() -> usize {
    550
}
fn default_test_questions() -> usize {
    100
}
fn default_eval_interval() -> usize {
    50
}
