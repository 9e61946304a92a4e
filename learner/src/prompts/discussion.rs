//! MaPoRL discussion prompts for GSM8K and ANLI: turn 0 answers the question (the `gsm8k` / `anli`
//! templates); later turns show the agent its own history plus the other agents' answers from the
//! previous turn only, optionally with the verifier's score and a short verbal reading of it.

use super::ChatMessage;

/// The verbal reading of a verifier score in [0, 1] (MaPoRL's thresholds).
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

/// Turn t ≥ 1 for one agent: its own history (`own_history`, the messages of its earlier turns with its
/// answers) followed by the others' answers of turn t−1, each with its verifier score if given.
pub fn discussion_followup(
    own_history: &[ChatMessage],
    others_previous: &[String],
    others_scores: Option<&[f64]>,
) -> Vec<ChatMessage> {
    let mut text = String::from("These are the solutions to the problem from other agents:\n");
    for (i, answer) in others_previous.iter().enumerate() {
        text.push_str(&format!("\nAgent {} solution: {}\n", i + 1, answer.trim()));
        if let Some(score) = others_scores.and_then(|s| s.get(i)) {
            text.push_str(&format!(
                "A verifier rates this solution {score:.2} out of 1: it is {}.\n",
                verifier_reading(*score)
            ));
        }
    }
    text.push_str(
        "\nUsing the other agents' solutions as additional information, give an updated answer to the problem, \
         in the same answer format as before.",
    );
    let mut messages = own_history.to_vec();
    messages.push(ChatMessage::user(text));
    messages
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn followup_keeps_history_and_reads_scores() {
        let mut history = vec![ChatMessage::user("1+1? Put the answer in \\boxed{}.")];
        history.push(ChatMessage::assistant("\\boxed{2}"));
        let next = discussion_followup(&history, &["\\boxed{3}".into()], Some(&[0.25]));
        assert_eq!(next.len(), 3);
        assert!(next[2].content.contains("Agent 1 solution: \\boxed{3}"));
        assert!(next[2].content.contains("0.25 out of 1: it is likely wrong"));
        assert_eq!(verifier_reading(0.3), "might be wrong");
        assert_eq!(verifier_reading(0.79), "seems right");
        assert_eq!(verifier_reading(0.8), "likely right");
    }
}
