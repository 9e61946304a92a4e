//! The external transition (rewards.md, "Feedback for the next turn"): from a node's joint action to
//! the next turn's prompt of every agent.
//!
//! The feedback text comes from the reward server's analysis (`level_feedback`, `level_passed`,
//! `passed`, `plain`: one batched `Analyze` call for every child of a depth) or from an expert model
//! (`expert_edits`: any OpenAI-compatible chat API, requests in flight together). The prompt around it
//! is composed here ([`crate::prompts::multiturn`]) and fitted into the context by leaving out the
//! oldest history first.

use cotrain_model::loader::LoadedModel;

use super::tree::AgentPrompt;
use crate::config::{ExternalConfig, ExternalMode, SandboxSlice};
use crate::error::TrainError;
use crate::external::expert::{
    ExpertClient, ExpertEdits, ExpertFailure, ExpertRequest, FailureKind,
};
use crate::prompts::comlrl::LevelReport;
use crate::prompts::items::{PromptEncoding, encode_text};
use crate::prompts::multiturn::{AgentTurn, NextTurnPrompter, TurnRecord};
use crate::sources::{FeedbackSpec, RewardSource, ScoreAction};

/// One child to build prompts for: the dataset row and, per agent, the completion carried on.
#[derive(Debug, Clone)]
pub struct TransitionInput<'a> {
    pub item: &'a serde_json::Value,
    /// Per agent, the completion text handed to the next turn.
    pub completions: Vec<String>,
    /// Per agent, the completion token ids (for reward sources that read tokens).
    pub completion_ids: Vec<Vec<u32>>,
}

/// `external.sandbox_slice` as the reward server reads it (`None`: all tests).
pub fn sandbox_slice(ext: &ExternalConfig) -> Option<i64> {
    match ext.sandbox_slice {
        Some(SandboxSlice::Count(n)) if n != 0 => Some(n),
        _ => None,
    }
}

/// The feedback for every child of a depth.
#[derive(Debug, Default)]
pub struct Feedback {
    /// Per child, per agent: the text (ending with the request to revise).
    pub texts: Vec<Vec<String>>,
    /// Per child: why the expert gave no edits (the agents then see only the request to revise).
    pub expert_failures: Vec<Option<String>>,
    /// Per child: the reward server's diagnostics in the original's words (what the `comlrl_*`
    /// next-turn wordings print); `None` where the source has no diagnostics.
    pub reports: Vec<Option<LevelReport>>,
}

/// The feedback for every child. With `expert_edits`, an expert that refuses requests (a 4xx: the
/// model name, key or URL is wrong) or that answers none of a depth's requests (down) stops the
/// run with the reason: degrading every prompt to a plain "revise" would train on a different task
/// without saying so. Single requests that fail, or replies without edits, degrade that child only
/// and are counted (`expert_failures` in the step's metrics, `expert_failure` in rollouts.jsonl).
pub fn feedback_texts(
    reward: &mut dyn RewardSource,
    expert: Option<&ExpertClient>,
    task: &str,
    ext: &ExternalConfig,
    inputs: &[TransitionInput<'_>],
) -> Result<Feedback, TrainError> {
    if inputs.is_empty() {
        return Ok(Feedback::default());
    }
    if ext.mode == ExternalMode::ExpertEdits {
        let expert = expert.ok_or_else(|| {
            TrainError::Config(
                "external.mode is expert_edits but no expert client was set up".into(),
            )
        })?;
        let requests: Vec<ExpertRequest> = inputs.iter().map(expert_request).collect();
        let edits = expert.edits_batch(&requests);
        check_expert(expert.url(), &edits)?;
        return Ok(Feedback {
            texts: inputs
                .iter()
                .zip(&edits)
                .map(|(input, e)| expert_feedback(input, e))
                .collect(),
            expert_failures: edits
                .iter()
                .map(|e| e.failure.as_ref().map(|f| f.reason.clone()))
                .collect(),
            reports: vec![None; inputs.len()],
        });
    }
    let actions: Vec<ScoreAction> = inputs
        .iter()
        .map(|i| ScoreAction {
            completions: i.completions.clone(),
            completion_ids: i.completion_ids.clone(),
            item: i.item.clone(),
        })
        .collect();
    let spec = FeedbackSpec {
        mode: ext.mode,
        sandbox_slice: sandbox_slice(ext),
    };
    let analyses = reward.analyze(task, &actions, &spec)?;
    if analyses.len() != inputs.len()
        || analyses
            .iter()
            .zip(inputs)
            .any(|(a, i)| a.feedback.len() != i.completions.len())
    {
        return Err(TrainError::Reward(format!(
            "{}: feedback does not match the {} joint actions asked about",
            reward.describe(),
            inputs.len()
        )));
    }
    let reports = analyses
        .iter()
        .map(|a| a.diagnostics.as_ref().map(LevelReport::from_diagnostics))
        .collect();
    Ok(Feedback {
        expert_failures: vec![None; analyses.len()],
        texts: analyses.into_iter().map(|a| a.feedback).collect(),
        reports,
    })
}

/// Refuses a batch whose requests the expert refused, or of which it answered none.
fn check_expert(url: &str, edits: &[ExpertEdits]) -> Result<(), TrainError> {
    let failures: Vec<&ExpertFailure> = edits.iter().filter_map(|e| e.failure.as_ref()).collect();
    if let Some(f) = failures.iter().find(|f| f.kind == FailureKind::Refused) {
        return Err(TrainError::External(format!(
            "the expert at {url} refused a request: {} (check external.expert_model, external.expert_base_url and the key in external.expert_api_key_env)",
            f.reason
        )));
    }
    if !edits.is_empty()
        && failures.len() == edits.len()
        && failures.iter().all(|f| f.kind == FailureKind::Unreachable)
    {
        return Err(TrainError::External(format!(
            "the expert at {url} answered none of {} requests after retries: {}",
            edits.len(),
            failures[0].reason
        )));
    }
    Ok(())
}

fn entry_point(item: &serde_json::Value) -> String {
    item.get("entry_point")
        .and_then(|v| v.as_str())
        .unwrap_or("main")
        .to_string()
}

fn expert_request(input: &TransitionInput<'_>) -> ExpertRequest {
    let problem = input
        .item
        .get("prompt")
        .and_then(|v| v.as_str())
        .unwrap_or_default()
        .to_string();
    let (aux, main) = match input.completions.as_slice() {
        [main] => (None, main.clone()),
        [aux, main, ..] => (Some(aux.clone()), main.clone()),
        [] => (None, String::new()),
    };
    ExpertRequest {
        problem,
        entry_point: entry_point(input.item),
        aux,
        main,
    }
}

/// Each agent's text for `expert_edits`: its function's suggested edit (or that none was suggested)
/// and the request to revise. An expert that failed after its retries leaves a plain request.
fn expert_feedback(input: &TransitionInput<'_>, edits: &ExpertEdits) -> Vec<String> {
    let n = input.completions.len();
    (0..n)
        .map(|agent| {
            let is_aux = n > 1 && agent == 0;
            let (function, edit) = if is_aux { ("aux".to_string(), &edits.aux) } else { (entry_point(input.item), &edits.main) };
            let mut s = String::new();
            if edits.failure.is_none() {
                if edit.trim().is_empty() {
                    s.push_str("An expert reviewer suggests no changes to this function.\n\n");
                } else {
                    s.push_str(&format!("An expert reviewer suggests these edits:\n{}\n\n", edit.trim_end()));
                }
            }
            s.push_str(&format!("Revise your function `{function}` and output only its Python code, without explanations, tests or markdown fences."));
            if !is_aux && n > 1 {
                s.push_str(" Do not redefine `aux`; call it where it helps.");
            }
            s
        })
        .collect()
}

/// One agent's next-turn prompt: composed (`external.next_turn_prompt`), rendered as the model reads
/// it, tokenised, and fitted into `max_tokens` by leaving out the oldest history first. Returns the
/// prompt (its text: what the history records) and how many history entries were left out; an
/// error when even the problem and the feedback alone do not fit.
pub fn fit_prompt(
    turn: &AgentTurn<'_>,
    prompter: &NextTurnPrompter,
    model: &LoadedModel,
    encoding: &PromptEncoding,
    max_tokens: usize,
) -> Result<(AgentPrompt, usize), TrainError> {
    let droppable = prompter.droppable(turn);
    let mut last_len = 0;
    for drop in 0..=droppable {
        let text = prompter
            .compose(turn, drop)
            .map_err(|e| TrainError::Config(e.to_string()))?;
        let model_text = encoding.model_text(model.chat_template.as_ref(), &text.user_text)?;
        let ids = encode_text(&model.tokenizer, &model_text)?;
        if ids.len() <= max_tokens {
            return Ok((
                AgentPrompt {
                    text: text.recorded,
                    ids,
                },
                drop,
            ));
        }
        last_len = ids.len();
    }
    Err(TrainError::Data(format!(
        "a next-turn prompt has {last_len} tokens without any history, more than model.max_length - max_new_tokens = {max_tokens}; \
         raise model.max_length, lower max_new_tokens (or the agent's model.agents[i].max_new_tokens), or set external.original_prompt: false / a smaller external.sandbox_slice"
    )))
}

/// The history of one agent after a turn: its earlier turns plus this one.
pub fn extend_history(history: &[TurnRecord], prompt: &str, response: &str) -> Vec<TurnRecord> {
    let mut h = history.to_vec();
    h.push(TurnRecord {
        prompt: prompt.to_string(),
        response: response.to_string(),
    });
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandbox_slice_forms() {
        let ext = |s: Option<SandboxSlice>| ExternalConfig {
            sandbox_slice: s,
            ..ExternalConfig::default()
        };
        assert_eq!(sandbox_slice(&ext(Some(SandboxSlice::Count(2)))), Some(2));
        assert_eq!(sandbox_slice(&ext(Some(SandboxSlice::Count(-1)))), Some(-1));
        assert_eq!(sandbox_slice(&ext(Some(SandboxSlice::Count(0)))), None);
        assert_eq!(sandbox_slice(&ext(None)), None);
        assert_eq!(
            sandbox_slice(&ext(Some(SandboxSlice::Keyword(
                crate::config::AllKeyword::All
            )))),
            None
        );
    }

    #[test]
    fn expert_feedback_shows_each_agent_its_edit() {
        let item = serde_json::json!({"prompt": "def add(a, b):", "entry_point": "add"});
        let input = TransitionInput {
            item: &item,
            completions: vec![
                "def aux(x): return x".into(),
                "def add(a, b): return a".into(),
            ],
            completion_ids: vec![vec![], vec![]],
        };
        let e = ExpertEdits {
            aux: String::new(),
            main: "return a + b".into(),
            failure: None,
            attempts: 1,
        };
        let t = expert_feedback(&input, &e);
        assert!(t[0].contains("suggests no changes") && t[0].contains("`aux`"));
        assert!(
            t[1].contains("return a + b")
                && t[1].contains("`add`")
                && t[1].contains("Do not redefine `aux`")
        );
        let failed = ExpertEdits {
            failure: Some(ExpertFailure {
                kind: FailureKind::Unusable,
                reason: "no JSON".into(),
            }),
            ..ExpertEdits::default()
        };
        let t = expert_feedback(&input, &failed);
        assert!(t[1].starts_with("Revise your function `add`"));
        let r = expert_request(&input);
        assert_eq!(
            (r.aux.as_deref(), r.main.as_str(), r.entry_point.as_str()),
            (
                Some("def aux(x): return x"),
                "def add(a, b): return a",
                "add"
            )
        );
    }

    #[test]
    fn an_expert_that_refuses_or_answers_nothing_stops_the_run_and_single_failures_degrade() {
        let fail = |kind| ExpertEdits {
            failure: Some(ExpertFailure {
                kind,
                reason: format!("{kind:?}"),
            }),
            ..ExpertEdits::default()
        };
        let ok = ExpertEdits {
            main: "x".into(),
            ..ExpertEdits::default()
        };
        let e = check_expert(
            "http://e/v1/chat/completions",
            &[ok.clone(), fail(FailureKind::Refused)],
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("refused a request") && e.contains("external.expert_model"),
            "{e}"
        );
        let e = check_expert(
            "http://e",
            &[
                fail(FailureKind::Unreachable),
                fail(FailureKind::Unreachable),
            ],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("answered none of 2 requests"), "{e}");
        assert!(check_expert("http://e", &[ok.clone(), fail(FailureKind::Unreachable)]).is_ok());
        assert!(
            check_expert(
                "http://e",
                &[fail(FailureKind::Unusable), fail(FailureKind::Unusable)]
            )
            .is_ok()
        );
    }
}
