//! MaPoRL's learned verifier, the learner's side (`learner verifier ...`; docs/src/trainers/maporl.md):
//!
//! - [`data`]: MaPoRL's data file (question → original answer, generated answers, 0/1 rewards),
//!   read and written in the file's own question order;
//! - [`generate`]: answers sampled through the rollout workers and labelled by the reward server;
//! - [`balance`]: the same number of correct and incorrect answers per question;
//! - [`stats`]: held-out accuracy, AUC and calibration;
//! - [`train`]: training a [`cotrain_model::verifier::Verifier`] and saving the directory the rollout
//!   workers serve (`rollout-worker serve --verifier NAME=DIR`).

pub mod balance;
pub mod data;
pub mod generate;
pub mod stats;
pub mod train;

pub use data::{Example, QuestionEntry, VerifierData};

/// The reward server's task name of the config's dataset (`gsm8k`, `anli`, ...).
pub fn task_of(cfg: &crate::config::CheckedConfig) -> Result<String, crate::error::TrainError> {
    let kind = crate::data::DatasetKind::resolve(&cfg.raw.dataset).map_err(|e| {
        crate::error::TrainError::Data(format!("{}: dataset: {e}", cfg.source.display()))
    })?;
    Ok(crate::prompts::items::reward_task(kind).to_string())
}

/// The user message the verifier reads for `question` (the `verifier.user_template`).
pub fn user_message(template: &str, question: &str) -> Result<String, String> {
    let env = minijinja::Environment::new();
    env.render_str(template, minijinja::context! { question => question })
        .map_err(|e| format!("verifier.user_template: {e}"))
}

/// The question text of a dataset row as the verifier reads it: GSM8K's `question`, ANLI's premise
/// (`premise`, or the shipped files' `context`) and hypothesis; other rows as their JSON.
pub fn question_text(task: &str, item: &serde_json::Value) -> String {
    let field = |keys: &[&str]| {
        keys.iter()
            .find_map(|k| item.get(*k).and_then(|v| v.as_str()))
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    match task {
        "gsm8k" => field(&["question"]),
        "anli" => format!(
            "Premise: {}\nHypothesis: {}",
            field(&["premise", "context"]),
            field(&["hypothesis"])
        ),
        _ => item.to_string(),
    }
}
