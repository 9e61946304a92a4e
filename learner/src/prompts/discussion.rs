//! MaPoRL discussion prompts for GSM8K and ANLI: turn 0 answers the question; later turns show the
//! agent its own history plus the other agents' answers from the previous turn only, optionally with
//! the verifier's score and a short verbal reading of it.

use super::ChatMessage;
use crate::data::TaskItem;

fn question_text(item: &TaskItem) -> String {
    match item {
        TaskItem::Gsm8k(g) => format!(
            "Solve the following math problem step by step. Put the final answer, an integer, in \\boxed{{}}.\n\n\
             Problem: {}",
            g.question.trim()
        ),
        TaskItem::Anli(a) => format!(
            "Decide whether the hypothesis follows from the premise. Reason step by step, then end with one word as \
             the final answer: entailment, neutral, or contradiction.\n\nPremise: {}\nHypothesis: {}",
            a.premise.trim(),
            a.hypothesis.trim()
        ),
        TaskItem::Code(c) => c.prompt.clone(),
        TaskItem::Arxiv(a) => a.abstract_text.clone(),
        TaskItem::Tldr(t) => t.prompt.clone(),
    }
}

/// Turn 0: every agent answers the question on its own.
pub fn discussion_first_turn(item: &TaskItem) -> Vec<ChatMessage> {
    vec![ChatMessage::user(question_text(item))]
}

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
    use crate::data::Gsm8kItem;

    #[test]
    fn followup_keeps_history_and_reads_scores() {
        let item = TaskItem::Gsm8k(Gsm8kItem { question: "1+1?".into(), answer: "#### 2".into(), final_answer: "2".into() });
        let mut history = discussion_first_turn(&item);
        assert!(history[0].content.contains("\\boxed{}"));
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
