//! ANLI (MaPoRL): 1 if the completion's final answer word equals the label, else 0.
//!
//! Parsing, exactly:
//! - the item's `label`: 0 / 1 / 2 (number or numeric string: the dataset ids), `e` / `n` / `c`
//!   (the official files), or the words `entailment` / `neutral` / `contradiction`
//!   (case-insensitive);
//! - the completion's answer: if it contains `\boxed{...}`, the last box's content, read as a
//!   label word, or a lone letter e / n / c; otherwise the LAST whole word `entailment`,
//!   `neutral` or `contradiction` in the text (case-insensitive). Inflections such as "entails"
//!   are not answers.

use std::fmt;
use std::sync::LazyLock;

use regex::Regex;
use serde::Serialize;
use serde_json::json;

use super::gsm8k::last_boxed;
use super::{RewardError, ScoreResult, TaskKind, json_type};

/// The three NLI labels, in dataset-id order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum NliLabel {
    Entailment,
    Neutral,
    Contradiction,
}

impl fmt::Display for NliLabel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NliLabel::Entailment => "entailment",
            NliLabel::Neutral => "neutral",
            NliLabel::Contradiction => "contradiction",
        })
    }
}

static WORD_RE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i)\b(entailment|neutral|contradiction)\b").expect("valid regex")
});

fn from_word(w: &str) -> Option<NliLabel> {
    match w.trim().to_ascii_lowercase().as_str() {
        "entailment" | "e" | "0" => Some(NliLabel::Entailment),
        "neutral" | "n" | "1" => Some(NliLabel::Neutral),
        "contradiction" | "c" | "2" => Some(NliLabel::Contradiction),
        _ => None,
    }
}

/// The item's label.
pub fn item_label(item: &serde_json::Value) -> Result<NliLabel, RewardError> {
    let field = "label";
    let bad = |reason: String| RewardError::InvalidField { field, reason };
    match item.get(field) {
        None | Some(serde_json::Value::Null) => Err(RewardError::MissingField {
            task: TaskKind::Anli,
            field,
        }),
        Some(serde_json::Value::Number(n)) => match n.as_u64() {
            Some(0) => Ok(NliLabel::Entailment),
            Some(1) => Ok(NliLabel::Neutral),
            Some(2) => Ok(NliLabel::Contradiction),
            _ => Err(bad(format!("`{n}` is not 0, 1 or 2"))),
        },
        Some(serde_json::Value::String(s)) => from_word(s)
            .ok_or_else(|| bad(format!("`{s}` is not a label (0/1/2, e/n/c or the words)"))),
        Some(other) => Err(bad(format!(
            "expected a number or a string, got {}",
            json_type(other)
        ))),
    }
}

/// The completion's answer, and whether it came from a box.
pub fn completion_label(text: &str) -> (Option<NliLabel>, &'static str) {
    if let Some(content) = last_boxed(text) {
        let content = content.replace("\\text{", "").replace('}', "");
        let label = WORD_RE
            .find_iter(&content)
            .last()
            .and_then(|m| from_word(m.as_str()))
            .or_else(|| {
                let t = content.trim();
                (t.len() == 1 && t != "0" && t != "1" && t != "2")
                    .then(|| from_word(t))
                    .flatten()
            });
        return (label, "boxed");
    }
    (
        WORD_RE
            .find_iter(text)
            .last()
            .and_then(|m| from_word(m.as_str())),
        "last_word",
    )
}

/// Scores one ANLI completion.
pub fn score(completions: &[String], item: &serde_json::Value) -> Result<ScoreResult, RewardError> {
    let [completion] = completions else {
        return Err(RewardError::WrongCompletionCount {
            task: TaskKind::Anli,
            expected: "1",
            got: completions.len(),
        });
    };
    let label = item_label(item)?;
    let (answer, source) = completion_label(completion);
    let correct = answer == Some(label);
    let reward = if correct { 1.0 } else { 0.0 };
    Ok(ScoreResult {
        reward,
        levels: [("correct".to_string(), reward)].into_iter().collect(),
        details: json!({
            "label": label,
            "answer": answer,
            "answer_source": source,
            "correct": correct,
            "total": reward,
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(c: &str, label: serde_json::Value) -> f64 {
        score(&[c.to_string()], &json!({ "label": label }))
            .unwrap()
            .reward
    }

    #[test]
    fn labels_in_every_form() {
        assert_eq!(s("The answer is neutral.", json!(1)), 1.0);
        assert_eq!(s("The answer is neutral.", json!("n")), 1.0);
        assert_eq!(s("The answer is neutral.", json!("Neutral")), 1.0);
        assert_eq!(s("The answer is neutral.", json!("2")), 0.0);
    }

    #[test]
    fn the_last_word_or_the_box_decides() {
        assert_eq!(s("Not entailment; I say Contradiction", json!("c")), 1.0);
        assert_eq!(
            s("contradiction? no: \\boxed{\\text{entailment}}", json!(0)),
            1.0
        );
        assert_eq!(s("\\boxed{e}", json!("e")), 1.0);
        assert_eq!(s("\\boxed{maybe}", json!("e")), 0.0);
        assert_eq!(s("it entails the hypothesis", json!("e")), 0.0);
    }

    #[test]
    fn bad_labels_are_errors() {
        let e = score(&["x".into()], &json!({"label": 5})).unwrap_err();
        assert_eq!(e.field().as_deref(), Some("item.label"));
        let e = score(&["x".into()], &json!({})).unwrap_err();
        assert_eq!(e.field().as_deref(), Some("item.label"));
    }
}
