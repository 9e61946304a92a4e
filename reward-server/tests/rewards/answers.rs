//! GSM8K and ANLI through the public dispatcher.

use cotrain_reward_server::code_runner::{CodeRunner, ProgramReport, ProgramTests, RunnerError};
use cotrain_reward_server::rewards::{self, ScoreOptions, TaskKind};
use serde_json::json;

/// These tasks never run code: a runner that fails proves it.
struct NoRunner;

impl CodeRunner for NoRunner {
    async fn run_tests(&self, _: ProgramTests) -> Result<ProgramReport, RunnerError> {
        Err(RunnerError::Sandbox("no code may run for this task".into()))
    }
}

async fn score(task: &str, completion: &str, item: serde_json::Value) -> f64 {
    let task: TaskKind = task.parse().unwrap();
    rewards::score(
        task,
        &[completion.to_string()],
        &item,
        &NoRunner,
        &ScoreOptions::default(),
    )
    .await
    .unwrap()
    .reward
}

#[tokio::test]
async fn gsm8k_reference_after_hashes_and_boxed_answers() {
    let item =
        json!({"question": "q", "answer": "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 eggs.\n#### 18"});
    assert_eq!(
        score("gsm8k", "She makes 9 * 2 = $18. \\boxed{18}", item.clone()).await,
        1.0
    );
    assert_eq!(score("gsm8k", "\\boxed{18.0}", item.clone()).await, 1.0);
    assert_eq!(score("gsm8k", "\\boxed{\\$18}", item.clone()).await, 1.0);
    assert_eq!(
        score("gsm8k", "\\boxed{17} ... the answer is 18", item.clone()).await,
        0.0
    );
    assert_eq!(score("gsm8k", "so 9 * 2 = 18", item.clone()).await, 1.0);
    assert_eq!(score("gsm8k", "", item.clone()).await, 0.0);
    let big = json!({"answer": "#### 1,250,000"});
    assert_eq!(score("gsm8k", "\\boxed{1,250,000}", big.clone()).await, 1.0);
    assert_eq!(score("gsm8k", "\\boxed{1250000}", big).await, 1.0);
    let neg = json!({"answer": "#### -3"});
    assert_eq!(score("gsm8k", "a loss of \\boxed{-3}", neg).await, 1.0);
}

#[tokio::test]
async fn anli_labels_and_answers() {
    assert_eq!(
        score(
            "anli",
            "Therefore: \\boxed{contradiction}",
            json!({"label": 2})
        )
        .await,
        1.0
    );
    assert_eq!(
        score("anli", "The answer is entailment", json!({"label": "e"})).await,
        1.0
    );
    assert_eq!(
        score("anli", "The answer is entailment", json!({"label": "c"})).await,
        0.0
    );
    assert_eq!(
        score("anli", "No label here", json!({"label": "neutral"})).await,
        0.0
    );
}
