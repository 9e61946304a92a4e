//! MaPoRL's learned verifier, the learner's side (`learner verifier ...`; algorithms.md "MaPoRL"):
//!
//! - [`data`]: MaPoRL's data file (question → original answer, generated answers, 0/1 rewards),
//!   read and written in the file's own question order;
//! - [`balance`]: the same number of correct and incorrect answers per question;
//! - [`stats`]: held-out accuracy, AUC and calibration;
//! - [`train`]: training a [`cotrain_model::verifier::Verifier`] and saving the directory the rollout
//!   workers serve (`rollout-worker serve --verifier NAME=DIR`).

pub mod balance;
pub mod data;
pub mod stats;
pub mod train;

pub use data::{Example, QuestionEntry, VerifierData};

/// The user message the verifier reads for `question` (the `verifier.user_template`).
pub fn user_message(template: &str, question: &str) -> Result<String, String> {
    let env = minijinja::Environment::new();
    env.render_str(template, minijinja::context! { question => question }).map_err(|e| format!("verifier.user_template: {e}"))
}
