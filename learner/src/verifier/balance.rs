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
pub fn balance(
    data: &VerifierData,
    per_type: usize,
    keep_short: bool,
) -> (VerifierData, BalanceReport) {
    let mut out = VerifierData::default();
    let mut report = BalanceReport::default();
    for (q, e) in &data.questions {
        report.answers_in += e.generated_answers.len();
        let correct: Vec<usize> = (0..e.generated_answers.len())
            .filter(|&i| e.correct(i))
            .collect();
        let incorrect: Vec<usize> = (0..e.generated_answers.len())
            .filter(|&i| !e.correct(i))
            .collect();
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
        report.questions.push(QuestionReport {
            question: q.clone(),
            correct: correct.len(),
            incorrect: incorrect.len(),
            outcome: outcome.clone(),
        });
        if short && !keep_short {
            report.dropped += 1;
            continue;
        }
        let take: Vec<usize> = correct
            .iter()
            .take(per_type)
            .chain(incorrect.iter().take(per_type))
            .copied()
            .collect();
        let pick = |v: &[String]| -> Vec<String> {
            if v.is_empty() {
                Vec::new()
            } else {
                take.iter().map(|&i| v[i].clone()).collect()
            }
        };
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
        assert_eq!(
            (r.kept, r.dropped, r.answers_in, r.answers_out),
            (1, 2, 13, 4)
        );
        assert_eq!(out.questions.len(), 1);
        let (q, e) = &out.questions[0];
        assert_eq!(q, "easy");
        assert_eq!(
            e.generated_answers,
            ["a0", "a1", "a3", "a5"],
            "the first two of each kind, correct first"
        );
        assert_eq!(e.rewards, [1.0, 1.0, 0.0, 0.0]);
        assert_eq!(
            (r.questions[1].correct, r.questions[1].incorrect),
            (1, 3),
            "-1 counts as incorrect"
        );
        assert!(
            r.questions[2]
                .outcome
                .starts_with("dropped: 0 correct and 3 incorrect")
        );

        let (out, r) = balance(&data, 2, true);
        assert_eq!((r.kept, r.dropped), (3, 0));
        assert_eq!(out.questions[1].1.rewards, [1.0, 0.0, 0.0]);
    }
}

/// What filling added to the questions short of one kind.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FillReport {
    /// Reference solutions added as correct answers.
    pub references: usize,
    /// Correct rewrites added.
    pub correct_added: usize,
    /// Plausible wrong answers added.
    pub incorrect_added: usize,
    /// Short questions that are not in the config's train split (nothing to score against).
    pub not_found: usize,
}

/// Fills questions short of `per_type` answers of one kind before [`balance`] (MaPoRL's balancing
/// step): the dataset's reference solution counts as a correct answer when the reward agrees;
/// missing correct answers are sampled as rewrites of a correct one (a correct sample, else the
/// reference), missing incorrect ones as plausible but wrong solutions; every new answer is labelled
/// by the reward server and kept only on the side it was asked for. Up to `rounds` rounds of
/// `2 × per_type` samples per short question; the sampler's questions are the config's train split.
pub fn fill(
    data: &mut VerifierData,
    per_type: usize,
    rounds: usize,
    sampler: &mut super::generate::Sampler,
    items: &std::collections::HashMap<String, serde_json::Value>,
) -> Result<FillReport, crate::error::TrainError> {
    use super::generate::Ask;
    let mut report = FillReport::default();
    let count = |e: &QuestionEntry, want: bool| {
        (0..e.rewards.len())
            .filter(|&i| e.correct(i) == want)
            .count()
    };
    // The reference solution first.
    let short: Vec<usize> = (0..data.questions.len())
        .filter(|&k| count(&data.questions[k].1, true) < per_type)
        .collect();
    let mut refs = Vec::new();
    for &k in &short {
        let (q, e) = &data.questions[k];
        if let Some(item) = items.get(q)
            && !e.original_answer.is_empty()
            && !e.generated_answers.contains(&e.original_answer)
        {
            refs.push((k, item, e.original_answer.clone()));
        }
    }
    let labelled = sampler.label(
        &refs.iter().map(|(_, item, _)| *item).collect::<Vec<_>>(),
        &refs
            .iter()
            .map(|(_, _, a)| vec![a.clone()])
            .collect::<Vec<_>>(),
    )?;
    for ((k, _, answer), l) in refs.iter().zip(labelled) {
        if l[0].correct {
            push(&mut data.questions[*k].1, answer.clone(), &l[0]);
            report.references += 1;
        }
    }
    for round in 0..rounds {
        let mut asks = Vec::new();
        let mut wants = Vec::new();
        for (k, (q, e)) in data.questions.iter().enumerate() {
            let Some(item) = items.get(q) else { continue };
            let short_of: Vec<bool> = [true, false]
                .into_iter()
                .filter(|&want| count(e, want) < per_type)
                .collect();
            if short_of.is_empty() {
                continue;
            }
            let user = sampler.user_message(q)?;
            for want in short_of {
                let prompt = if want {
                    let solution = (0..e.rewards.len())
                        .find(|&i| e.correct(i))
                        .map_or(e.original_answer.as_str(), |i| {
                            e.generated_answers[i].as_str()
                        });
                    if solution.is_empty() {
                        continue;
                    }
                    format!(
                        "{user}\n\nA correct solution:\n{solution}\n\nWrite your own solution that reaches the same final answer, in different words, and end with it in the same format."
                    )
                } else {
                    format!(
                        "{user}\n\nWrite a solution that sounds convincing but reaches a WRONG final answer, and end with that wrong answer in the requested format."
                    )
                };
                asks.push(Ask {
                    item: item.clone(),
                    user: prompt,
                    n: 2 * per_type,
                    seed_parts: vec![k as u64, round as u64, u64::from(want), 77],
                    temperature: Some(0.9),
                });
                wants.push((k, want));
            }
        }
        if asks.is_empty() {
            break;
        }
        for ((k, want), got) in wants.into_iter().zip(sampler.sample(&asks)?) {
            for a in got.iter().filter(|a| a.correct == want) {
                let e = &mut data.questions[k].1;
                if count(e, want) >= per_type || e.generated_answers.contains(&a.text) {
                    continue;
                }
                push(e, a.text.clone(), a);
                if want {
                    report.correct_added += 1;
                } else {
                    report.incorrect_added += 1;
                }
            }
        }
    }
    report.not_found = data
        .questions
        .iter()
        .filter(|(q, e)| {
            !items.contains_key(q) && (count(e, true) < per_type || count(e, false) < per_type)
        })
        .count();
    Ok(report)
}

fn push(e: &mut QuestionEntry, text: String, l: &super::generate::Labelled) {
    let has_labels = e.generated_label.len() == e.generated_answers.len();
    e.generated_answers.push(text);
    e.rewards.push(if l.correct { 1.0 } else { 0.0 });
    if has_labels {
        e.generated_label.push(l.label.clone());
    }
}
