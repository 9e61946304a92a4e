//! The discussion turns of MaPoRL (docs/src/trainers/maporl.md): at turn t ≥ 1 an agent's history gets one more user
//! message showing the other agents' answers of turn t − 1, optionally each with its verifier score
//! and the verbal reading of that score. The message is a minijinja template, chosen by
//! `maporl.followup_style` (`original`: `configs/prompts/discussion_followup.j2`, MaPoRL's own text
//! byte for byte; `cotrain`: `discussion_followup_cotrain.j2`) or replaced by
//! `maporl.followup_template`. A template sees:
//! - `others`: one `{answer, score, band, reading}` per other agent, in agent order (`score` is `none`
//!   unless scores are shown; written with 3 decimals in the original style, 2 in cotrain's; `band`
//!   0–3 is the reading band below 0.3 / 0.6 / 0.8 / above, `reading` cotrain's words for it);
//! - `own`: `{score, band}` of the agent's own previous answer (original style with scores shown,
//!   else `none`): MaPoRL appends it as a user message after each answer, so the chat template sees
//!   it merged in front of the next follow-up;
//! - `feedback`: whether scores are shown; `question`: the agent's first-turn user message.

use minijinja::Environment;
use serde::Serialize;

use super::ChatMessage;
use crate::config::FollowupStyle;

const ORIGINAL_FOLLOWUP: &str = include_str!("../../../configs/prompts/discussion_followup.j2");
const COTRAIN_FOLLOWUP: &str =
    include_str!("../../../configs/prompts/discussion_followup_cotrain.j2");

/// The reading band of a verifier score: 0 below 0.3, 1 below 0.6, 2 below 0.8, else 3 (MaPoRL's
/// own-score message, trainer lines 1420-1432).
pub fn reading_band(score: f64) -> u8 {
    if score < 0.3 {
        0
    } else if score < 0.6 {
        1
    } else if score < 0.8 {
        2
    } else {
        3
    }
}

/// cotrain's short verbal reading of a verifier score (the `cotrain` style).
pub fn verifier_reading(score: f64) -> &'static str {
    [
        "likely wrong",
        "might be wrong",
        "seems right",
        "likely right",
    ][usize::from(reading_band(score))]
}

#[derive(Serialize)]
struct Other<'a> {
    answer: &'a str,
    score: Option<String>,
    band: Option<u8>,
    reading: Option<&'static str>,
}

#[derive(Serialize)]
struct Own {
    score: String,
    band: u8,
}

/// One other agent's previous answer as the next turn shows it.
#[derive(Debug, Clone, Copy)]
pub struct Shown<'a> {
    /// The answer's text (MaPoRL's rewrite of it by default, `maporl::rewrite`).
    pub text: &'a str,
    /// Its score when scores are shown.
    pub score: Option<f64>,
}

/// The next-turn message template.
pub struct Followup {
    env: Environment<'static>,
    style: FollowupStyle,
}

impl std::fmt::Debug for Followup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Followup")
            .field("style", &self.style)
            .finish_non_exhaustive()
    }
}

impl Followup {
    /// `template`, or the `style`'s default when `None`; a syntax error is reported here.
    pub fn new(style: FollowupStyle, template: Option<&str>) -> Result<Self, String> {
        let default = match style {
            FollowupStyle::Original => ORIGINAL_FOLLOWUP,
            FollowupStyle::Cotrain => COTRAIN_FOLLOWUP,
        };
        let mut env = Environment::new();
        env.set_keep_trailing_newline(false);
        env.add_template_owned("followup", template.unwrap_or(default).to_string())
            .map_err(|e| format!("maporl.followup_template: invalid template: {e}"))?;
        Ok(Self { env, style })
    }

    pub fn style(&self) -> FollowupStyle {
        self.style
    }

    /// The follow-up user message for an agent whose first-turn user message was `question`.
    /// `own_score` (the agent's own previous score) is shown only in the original style. The
    /// original style keeps every text as it is; cotrain's trims the answers and the message.
    pub fn message(
        &self,
        question: &str,
        own_score: Option<f64>,
        others: &[Shown<'_>],
    ) -> Result<String, String> {
        let original = self.style == FollowupStyle::Original;
        let decimals = if original { 3 } else { 2 };
        let others: Vec<Other<'_>> = others
            .iter()
            .map(|o| Other {
                answer: if original { o.text } else { o.text.trim() },
                score: o.score.map(|s| format!("{s:.decimals$}")),
                band: o.score.map(reading_band),
                reading: o.score.map(verifier_reading),
            })
            .collect();
        let own = own_score.filter(|_| original).map(|s| Own {
            score: format!("{s:.3}"),
            band: reading_band(s),
        });
        let feedback = others.iter().any(|o| o.score.is_some()) || own.is_some();
        let text = self
            .env
            .get_template("followup")
            .and_then(|t| t.render(minijinja::context! { others => others, own => own, feedback => feedback, question => question }))
            .map_err(|e| format!("maporl.followup_template: cannot render: {e}"))?;
        Ok(if original {
            text
        } else {
            text.trim().to_string()
        })
    }

    /// `own_history` plus the follow-up user message ([`Followup::message`]).
    pub fn next_turn(
        &self,
        own_history: &[ChatMessage],
        question: &str,
        own_score: Option<f64>,
        others: &[Shown<'_>],
    ) -> Result<Vec<ChatMessage>, String> {
        let mut messages = own_history.to_vec();
        messages.push(ChatMessage::user(
            self.message(question, own_score, others)?,
        ));
        Ok(messages)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shown<'a>(texts: &[&'a str], scores: Option<&[f64]>) -> Vec<Shown<'a>> {
        texts
            .iter()
            .enumerate()
            .map(|(i, t)| Shown {
                text: t,
                score: scores.map(|s| s[i]),
            })
            .collect()
    }

    #[test]
    fn the_cotrain_style_keeps_history_and_reads_scores() {
        let mut history = vec![ChatMessage::user("1+1? Put the answer in \\boxed{}.")];
        history.push(ChatMessage::assistant("\\boxed{2}"));
        let f = Followup::new(FollowupStyle::Cotrain, None).unwrap();
        let next = f
            .next_turn(
                &history,
                "q",
                Some(0.9),
                &shown(&["\\boxed{3}"], Some(&[0.25])),
            )
            .unwrap();
        assert_eq!(next.len(), 3);
        assert_eq!(next[..2], history[..]);
        assert!(
            next[2].content.contains("Agent 1 solution: \\boxed{3}"),
            "{}",
            next[2].content
        );
        assert!(
            next[2]
                .content
                .contains("0.25 out of 1: it is likely wrong"),
            "{}",
            next[2].content
        );
        assert!(
            !next[2].content.contains("0.90"),
            "no own score in cotrain's style: {}",
            next[2].content
        );
        let plain = f
            .next_turn(&history, "q", None, &shown(&["a", "b"], None))
            .unwrap();
        assert!(
            plain[2].content.contains("Agent 2 solution: b")
                && !plain[2].content.contains("verifier"),
            "{}",
            plain[2].content
        );
        assert_eq!(verifier_reading(0.3), "might be wrong");
        assert_eq!(verifier_reading(0.79), "seems right");
        assert_eq!(verifier_reading(0.8), "likely right");
    }

    #[test]
    fn the_original_style_words_every_band_for_the_own_and_the_other_agents() {
        let f = Followup::new(FollowupStyle::Original, None).unwrap();
        for (s, own, other) in [
            (
                0.1,
                "Your answer is highly likely wrong.",
                "Agent 1's answer is highly likely wrong.",
            ),
            (
                0.3,
                "Your answer might be wrong, or your reasoning needs to have a stronger argument.",
                "Agent 1's answer might be wrong, or agent 1's reasoning needs",
            ),
            (
                0.6,
                "Your answer seems right, but check your reasoning again, there might be some room for improvement.",
                "Agent 1's answer seems right, but check agent 1's reasoning again",
            ),
            (
                0.8,
                "Your answer is likely right with high probability.",
                "Agent 1's answer is likely right with high probability.",
            ),
        ] {
            let m = f
                .message("Q", Some(s), &shown(&["A "], Some(&[s])))
                .unwrap();
            assert!(m.starts_with(&format!("Reward from a verifier of your answer: {s:.3} out of 1.0, which means {own}\n\nThese are")), "{m}");
            assert!(m.contains(&format!("```A ```\n\n Reward associated with agent 1's solution calculated by verifier:  {s:.3} out of 1.0, which means {other}")), "{m}");
            assert!(m.ends_with("Once again, the question is: Q"), "{m}");
        }
    }

    #[test]
    fn a_custom_template_replaces_the_default_and_bad_syntax_is_named() {
        let f = Followup::new(
            FollowupStyle::Original,
            Some("Others said: {% for o in others %}[{{ o.answer }}]{% endfor %}"),
        )
        .unwrap();
        let next = f
            .next_turn(&[], "q", None, &shown(&["x", "y"], None))
            .unwrap();
        assert_eq!(next[0].content, "Others said: [x][y]");
        let err = Followup::new(FollowupStyle::Cotrain, Some("{% for %}")).unwrap_err();
        assert!(err.contains("maporl.followup_template"), "{err}");
    }
}
