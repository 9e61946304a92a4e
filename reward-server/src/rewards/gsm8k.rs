//! GSM8K (MaPoRL): 1 if the completion's answer equals the reference, else 0.
//!
//! Parsing, exactly:
//! - reference: the text after the LAST `####` of the item's `answer` (a JSON number is also
//!   accepted), normalised as below;
//! - completion: the content of its last `\boxed{...}` (braces balanced); inside it, the last
//!   number. Without any `\boxed{`, the last number of the whole text. A box without a number
//!   is no answer (reward 0): the model committed to something that is not a number;
//! - a number is `-?` then digits with optional thousands commas (`1,234`) and an optional
//!   decimal part; `$`, spaces and other text around it are ignored;
//! - normalisation: commas removed, leading zeros dropped, a zero decimal part dropped
//!   (`18.0` and `18.00` are 18), `-0` is 0; a non-zero decimal part is kept, trailing zeros
//!   trimmed, so `18.5` never equals 18.

use std::sync::LazyLock;

use regex::Regex;
use serde_json::json;

use super::{RewardError, ScoreResult, TaskKind, json_type};

static NUMBER_RE: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?").expect("valid regex"));

/// Canonical text of a number matched by the number pattern.
pub fn normalize_number(s: &str) -> Option<String> {
    let s: String = s.chars().filter(|c| *c != ',').collect();
    let (neg, s) = match s.strip_prefix('-') {
        Some(rest) => (true, rest.to_string()),
        None => (false, s),
    };
    let (int, frac) = match s.split_once('.') {
        Some((i, f)) => (i.to_string(), f.trim_end_matches('0').to_string()),
        None => (s.clone(), String::new()),
    };
    if int.is_empty()
        || !int.chars().all(|c| c.is_ascii_digit())
        || !frac.chars().all(|c| c.is_ascii_digit())
    {
        return None;
    }
    let int = int.trim_start_matches('0');
    let int = if int.is_empty() { "0" } else { int };
    let mut out = String::new();
    if neg && !(int == "0" && frac.is_empty()) {
        out.push('-');
    }
    out.push_str(int);
    if !frac.is_empty() {
        out.push('.');
        out.push_str(&frac);
    }
    Some(out)
}

/// The last number in a text, normalised.
pub fn last_number(text: &str) -> Option<String> {
    NUMBER_RE
        .find_iter(text)
        .last()
        .and_then(|m| normalize_number(m.as_str()))
}

/// Content of the last `\boxed{...}` (balanced braces; an unclosed box runs to the end).
pub fn last_boxed(text: &str) -> Option<&str> {
    let start = text.rfind("\\boxed{")? + "\\boxed{".len();
    let mut depth = 1usize;
    for (i, c) in text[start..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(&text[start..start + i]);
                }
            }
            _ => {}
        }
    }
    Some(&text[start..])
}

/// The completion's answer and where it came from (`boxed` or `last_number`).
pub fn completion_answer(text: &str) -> (Option<String>, &'static str) {
    match last_boxed(text) {
        Some(content) => (last_number(content), "boxed"),
        None => (last_number(text), "last_number"),
    }
}

/// The reference answer of an item's `answer` field.
pub fn reference_answer(item: &serde_json::Value) -> Result<String, RewardError> {
    let field = "answer";
    match item.get(field) {
        None | Some(serde_json::Value::Null) => Err(RewardError::MissingField {
            task: TaskKind::Gsm8k,
            field,
        }),
        Some(serde_json::Value::Number(n)) => {
            normalize_number(&n.to_string()).ok_or_else(|| RewardError::InvalidField {
                field,
                reason: format!("`{n}` is not a plain number"),
            })
        }
        Some(serde_json::Value::String(s)) => {
            let (_, after) = s
                .rsplit_once("####")
                .ok_or_else(|| RewardError::InvalidField {
                    field,
                    reason: "no `####` followed by the final answer".to_string(),
                })?;
            let after = after.trim();
            NUMBER_RE
                .find(after)
                .and_then(|m| normalize_number(m.as_str()))
                .ok_or_else(|| RewardError::InvalidField {
                    field,
                    reason: format!("no number after `####` (found `{after}`)"),
                })
        }
        Some(other) => Err(RewardError::InvalidField {
            field,
            reason: format!("expected a string, got {}", json_type(other)),
        }),
    }
}

/// Scores one GSM8K completion.
pub fn score(completions: &[String], item: &serde_json::Value) -> Result<ScoreResult, RewardError> {
    let [completion] = completions else {
        return Err(RewardError::WrongCompletionCount {
            task: TaskKind::Gsm8k,
            expected: "1",
            got: completions.len(),
        });
    };
    let reference = reference_answer(item)?;
    let (answer, source) = completion_answer(completion);
    let correct = answer.as_deref() == Some(reference.as_str());
    let reward = if correct { 1.0 } else { 0.0 };
    Ok(ScoreResult {
        reward,
        levels: [("correct".to_string(), reward)].into_iter().collect(),
        details: json!({
            "reference": reference,
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

    fn s(c: &str, answer: &str) -> f64 {
        score(&[c.to_string()], &json!({"answer": answer}))
            .unwrap()
            .reward
    }

    #[test]
    fn boxed_answer_with_formatting_matches() {
        assert_eq!(s("so the total is \\boxed{1,234}", "steps\n#### 1234"), 1.0);
        assert_eq!(s("\\boxed{\\$18.00}", "#### 18"), 1.0);
        assert_eq!(s("\\boxed{-5}", "#### -5"), 1.0);
        assert_eq!(s("\\boxed{18.5}", "#### 18"), 0.0);
        assert_eq!(s("first \\boxed{3} then \\boxed{x = 7}", "#### 7"), 1.0);
    }

    #[test]
    fn fallback_is_the_last_number_and_an_empty_box_is_no_answer() {
        assert_eq!(s("3 apples plus 4 apples is 7 apples.", "#### 7"), 1.0);
        assert_eq!(s("it is 7, not 8", "#### 7"), 0.0);
        assert_eq!(s("7 is it: \\boxed{seven}", "#### 7"), 0.0);
        assert_eq!(s("", "#### 0"), 0.0);
    }

    #[test]
    fn normalisation() {
        assert_eq!(normalize_number("0018.0").as_deref(), Some("18"));
        assert_eq!(normalize_number("-0.00").as_deref(), Some("0"));
        assert_eq!(normalize_number("1,000.50").as_deref(), Some("1000.5"));
        assert_eq!(
            last_boxed("a \\boxed{\\frac{1}{2}} b"),
            Some("\\frac{1}{2}")
        );
    }

    #[test]
    fn item_errors_name_the_field() {
        let e = score(&["1".into()], &json!({"question": "q"})).unwrap_err();
        assert_eq!(e.field().as_deref(), Some("item.answer"));
        let e = score(&["1".into()], &json!({"answer": "no marker"})).unwrap_err();
        assert!(e.to_string().contains("####"));
        let e = score(&["1".into(), "2".into()], &json!({"answer": "#### 1"})).unwrap_err();
        assert_eq!(e.field().as_deref(), Some("completions"));
    }
}
