//! The discussion turns of MaPoRL (algorithms.md): at turn t ≥ 1 an agent's history gets one more user
//! message showing the other agents' answers of turn t − 1, optionally each with its score and the
//! verbal reading of that score. The message is a minijinja template (`configs/prompts/
//! discussion_followup.j2` by default, `maporl.followup_template` to replace it) that sees `others`, a
//! list of `{answer, score, reading}` (`score` is `none` unless scores are shown; it is written with
//! two decimals).

use minijinja::Environment;
use serde::Serialize;

use super::ChatMessage;

const DEFAULT_FOLLOWUP: &str = include_str!("../../../configs/prompts/discussion_followup.j2");

/// The verbal reading of a verifier score (algorithms.md bins).
pub fn verifier_reading(score: f64) -> &'static str {
    if score < 0.3 {
        "likely wrong"
    } else if score < 0.6 {
        "might be wrong"
    } else if score < 0.8 {
        "seems right"
    } else {
        "likely right"
    }
}

#[derive(Serialize)]
struct Other<'a> {
    answer: &'a str,
    score: Option<String>,
    reading: Option<&'static str>,
}

/// The next-turn message template.
pub struct Followup {
    env: Environment<'static>,
}

impl std::fmt::Debug for Followup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Followup").finish_non_exhaustive()
    }
}

impl Followup {
    /// `template`, or cotrain's default when `None`; a syntax error is reported here.
    pub fn new(template: Option<&str>) -> Result<Self, String> {
        let mut env = Environment::new();
        env.set_keep_trailing_newline(false);
        env.add_template_owned("followup", template.unwrap_or(DEFAULT_FOLLOWUP).to_string())
            .map_err(|e| format!("maporl.followup_template: invalid template: {e}"))?;
        Ok(Self { env })
    }

    /// `own_history` plus the user message showing `others_previous` (and their scores).
    pub fn next_turn(&self, own_history: &[ChatMessage], others_previous: &[String], others_scores: Option<&[f64]>) -> Result<Vec<ChatMessage>, String> {
        let others: Vec<Other<'_>> = others_previous
            .iter()
            .enumerate()
            .map(|(i, a)| {
                let score = others_scores.and_then(|s| s.get(i)).copied();
                Other { answer: a.trim(), score: score.map(|s| format!("{s:.2}")), reading: score.map(verifier_reading) }
            })
            .collect();
        let text = self
            .env
            .get_template("followup")
            .and_then(|t| t.render(minijinja::context! { others => others }))
            .map_err(|e| format!("maporl.followup_template: cannot render: {e}"))?;
        let mut messages = own_history.to_vec();
        messages.push(ChatMessage::user(text.trim().to_string()));
        Ok(messages)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn followup_keeps_history_and_reads_scores() {
        let mut history = vec![ChatMessage::user("1+1? Put the answer in \\boxed{}.")];
        history.push(ChatMessage::assistant("\\boxed{2}"));
        let f = Followup::new(None).unwrap();
        let next = f.next_turn(&history, &["\\boxed{3}".into()], Some(&[0.25])).unwrap();
        assert_eq!(next.len(), 3);
        assert_eq!(next[..2], history[..]);
        assert!(next[2].content.contains("Agent 1 solution: \\boxed{3}"), "{}", next[2].content);
        assert!(next[2].content.contains("0.25 out of 1: it is likely wrong"), "{}", next[2].content);
        let plain = f.next_turn(&history, &["a".into(), "b".into()], None).unwrap();
        assert!(plain[2].content.contains("Agent 2 solution: b") && !plain[2].content.contains("verifier"), "{}", plain[2].content);
        assert_eq!(verifier_reading(0.3), "might be wrong");
        assert_eq!(verifier_reading(0.79), "seems right");
        assert_eq!(verifier_reading(0.8), "likely right");
    }

    #[test]
    fn a_custom_template_replaces_the_default_and_bad_syntax_is_named() {
        let f = Followup::new(Some("Others said: {% for o in others %}[{{ o.answer }}]{% endfor %}")).unwrap();
        let next = f.next_turn(&[], &["x".into(), "y".into()], None).unwrap();
        assert_eq!(next[0].content, "Others said: [x][y]");
        let err = Followup::new(Some("{% for %}")).unwrap_err();
        assert!(err.contains("maporl.followup_template"), "{err}");
    }
}
