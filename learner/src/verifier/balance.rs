//! `learner verifier balance`: every kept question gets exactly `per_type` correct and `per_type`
//! incorrect answers, so that the verifier learns correctness rather than question difficulty
//! (MaPoRL balances to 10 of each). A question with more keeps the first `per_type` of each kind in
//! file order; a question short of one kind is dropped (or kept with what it has, `keep_short`),
//! and the report says which and why.

use super::data::{QuestionEntry, VerifierData};

/// What happened to one question.
#[derive(Debug, Clone, PartialEq)]
pub struct QuestionReport {
    pub question: String,
    pub correct: usize,
    pub incorrect: usize,
    /// `balanced`, `kept short`, or `dropped: ...`.
    pub outcome: String,
}

/// What happened to the file.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BalanceReport {
    pub questions: Vec<QuestionReport>,
    pub kept: usize,
    pub dropped: usize,
    pub answers_in: usize,
    pub answers_out: usize,
}

/// Balances `data` to `per_type` answers of each kind per question.
pub fn balance(data: &VerifierData, per_type: usize, keep_short: bool) -> (VerifierData, BalanceReport) {
    let mut out = VerifierData::default();
    let mut report = BalanceReport::default();
    for (q, e) in &data.questions {
        report.answers_in += e.generated_answers.len();
        let correct: Vec<usize> = (0..e.generated_answers.len()).filter(|&i| e.correct(i)).collect();
        let incorrect: Vec<usize> = (0..e.generated_answers.len()).filter(|&i| !e.correct(i)).collect();
        let short = correct.len() < per_type || incorrect.len() < per_type;
        let outcome = match (short, keep_short) {
            (false, _) => "balanced".to_string(),
            (true, true) => "kept short".to_string(),
            (true, false) => format!(
                "dropped: {} correct and {} incorrect, {per_type} of each needed",
                correct.len(),
                incorrect.len()
            ),
        };
        report.questions.push(QuestionReport { question: q.clone(), correct: correct.len(), incorrect: incorrect.len(), outcome: outcome.clone() });
        if short && !keep_short {
            report.dropped += 1;
            continue;
        }
        let take: Vec<usize> = correct.iter().take(per_type).chain(incorrect.iter().take(per_type)).copied().collect();
        let pick = |v: &[String]| -> Vec<String> { if v.is_empty() { Vec::new() } else { take.iter().map(|&i| v[i].clone()).collect() } };
        let entry = QuestionEntry {
            original_answer: e.original_answer.clone(),
            generated_answers: pick(&e.generated_answers),
            rewards: take.iter().map(|&i| e.rewards[i]).collect(),
            generated_label: pick(&e.generated_label),
            row: e.row,
        };
        report.answers_out += entry.generated_answers.len();
        report.kept += 1;
        out.questions.push((q.clone(), entry));
    }
    (out, report)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(rewards: &[f64]) -> QuestionEntry {
        QuestionEntry {
            original_answer: "ref".into(),
            generated_answers: (0..rewards.len()).map(|i| format!("a{i}")).collect(),
            rewards: rewards.to_vec(),
            ..Default::default()
        }
    }

    #[test]
    fn balancing_counts_on_a_hand_made_file() {
        let data = VerifierData {
            questions: vec![
                ("easy".into(), entry(&[1.0, 1.0, 1.0, 0.0, 1.0, 0.0])),
                ("hard".into(), entry(&[0.0, 0.0, -1.0, 1.0])),
                ("impossible".into(), entry(&[0.0, 0.0, 0.0])),
            ],
        };
        let (out, r) = balance(&data, 2, false);
        assert_eq!((r.kept, r.dropped, r.answers_in, r.answers_out), (1, 2, 13, 4));
        assert_eq!(out.questions.len(), 1);
        let (q, e) = &out.questions[0];
        assert_eq!(q, "easy");
        assert_eq!(e.generated_answers, ["a0", "a1", "a3", "a5"], "the first two of each kind, correct first");
        assert_eq!(e.rewards, [1.0, 1.0, 0.0, 0.0]);
        assert_eq!((r.questions[1].correct, r.questions[1].incorrect), (1, 3), "-1 counts as incorrect");
        assert!(r.questions[2].outcome.starts_with("dropped: 0 correct and 3 incorrect"));

        let (out, r) = balance(&data, 2, true);
        assert_eq!((r.kept, r.dropped), (3, 0));
        assert_eq!(out.questions[1].1.rewards, [1.0, 0.0, 0.0]);
    }
}
