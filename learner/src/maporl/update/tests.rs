//! How the update cuts a step's samples: questions into units, units into the first phase's
//! length batches, epochs into mini-batches in each permutation's order, mini-batches into
//! micro-batches of whole questions.

use super::PpoSample;
use super::epochs::epoch_mini_batches;
use super::inputs::length_batches;
use super::minibatch::{MicroBatches, rank_micro_batches};
use super::rows::question_units;
use crate::config::MaporlSection;
use crate::dist::SingleRank;

fn sample(question: usize, agent: usize, response: usize) -> PpoSample {
    PpoSample {
        policy: "shared.later".into(),
        critic: "critic.turn1".into(),
        turn: 1,
        agent,
        question,
        prompt: vec![1; 10],
        value_prompt: vec![1; 5],
        response: vec![2; response],
        score_slot_after: true,
        score: 0.0,
        behaviour_logprobs: None,
    }
}

#[test]
fn batches_cover_every_sample_once_and_pad_at_most_a_sixteenth() {
    let lens = [420usize, 95, 431, 300, 96, 410, 700, 99, 305, 100, 415, 298];
    let idx: Vec<usize> = (0..lens.len()).collect();
    let idx: Vec<Vec<usize>> = idx.iter().map(|&k| vec![k]).collect();
    let batches = length_batches(&idx, |k| lens[k], 3);
    let mut seen: Vec<usize> = batches.iter().flatten().copied().collect();
    seen.sort_unstable();
    assert_eq!(seen, (0..lens.len()).collect::<Vec<_>>());
    for b in &batches {
        assert!(!b.is_empty() && b.len() <= 3, "{batches:?}");
        let real: usize = b.iter().map(|&k| lens[k]).sum();
        let longest = b.iter().map(|&k| lens[k]).max().unwrap();
        assert!(b.len() * longest * 16 <= real * 17, "{b:?} pads too much");
    }
    // Similar lengths share a batch; the 700-token outlier runs alone.
    assert!(batches.contains(&vec![6]), "{batches:?}");
    assert_eq!(batches.len(), 6, "{batches:?}");
    // One row per batch at most, or one batch of everything when lengths are equal.
    assert_eq!(length_batches(&idx, |_| 50, 1).len(), lens.len());
    assert_eq!(length_batches(&idx, |_| 50, usize::MAX).len(), 1);
}

#[test]
fn a_questions_answers_stay_together_in_batches_and_micro_batches() {
    // Questions 0..4, both agents each, in rollout order (question-major) but listed agent
    // by agent, as a layout with per-turn keys may list them.
    let samples: Vec<PpoSample> = (0..2)
        .flat_map(|a| (0..4).map(move |q| sample(q, a, 3 + q + a)))
        .collect();
    let idx: Vec<usize> = (0..samples.len()).collect();
    let units = question_units(&idx, &samples);
    assert_eq!(units, vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]);
    let len = |k: usize| samples[k].prompt.len() + samples[k].response.len();
    for rows in [2, 3, 4, 16] {
        for b in length_batches(&units, len, rows) {
            assert!(b.len() <= rows.max(2), "{b:?}");
            for u in &units {
                assert!(
                    u.iter().all(|k| b.contains(k)) || !u.iter().any(|k| b.contains(k)),
                    "{b:?} splits {u:?}"
                );
            }
        }
    }
    // A mini-batch of all four questions in 2 micro-batches: two questions each, shares of
    // the response tokens summing to one.
    let micro = rank_micro_batches(&units, &samples, &SingleRank, MicroBatches::Count(2), |s| {
        s.response.len()
    });
    assert_eq!(
        micro.iter().map(|(m, _)| m.clone()).collect::<Vec<_>>(),
        vec![vec![0, 4, 1, 5], vec![2, 6, 3, 7]]
    );
    let total: usize = samples.iter().map(|s| s.response.len()).sum();
    assert!((micro[0].1 - (3 + 4 + 4 + 5) as f64 / total as f64).abs() < 1e-12);
    assert!((micro.iter().map(|m| m.1).sum::<f64>() - 1.0).abs() < 1e-12);
    // `micro_batch_positions`: consecutive questions up to 60 positions (27, 29, 31, 33 each),
    // and a budget below every question runs each alone.
    let positions = |most| MicroBatches::Positions {
        most,
        positions: |s: &PpoSample| s.prompt.len() + s.response.len(),
    };
    let split = |most| {
        rank_micro_batches(&units, &samples, &SingleRank, positions(most), |s| {
            s.response.len()
        })
        .into_iter()
        .map(|(m, _)| m)
        .collect::<Vec<_>>()
    };
    assert_eq!(split(60), vec![vec![0, 4, 1, 5], vec![2, 6], vec![3, 7]]);
    assert_eq!(split(1).len(), 4);
    assert_eq!(split(1000).len(), 1);
}

#[test]
fn every_job_follows_the_epochs_permutation_of_questions() {
    // Six questions; the policy has both agents' answers to each, the critic none of question 4.
    let samples: Vec<PpoSample> = (0..6)
        .flat_map(|q| (0..2).map(move |a| sample(q, a, 3)))
        .collect();
    let policy: Vec<usize> = (0..samples.len()).collect();
    let critic: Vec<usize> = policy
        .iter()
        .copied()
        .filter(|&k| samples[k].question != 4)
        .collect();
    let mut m: MaporlSection = serde_json::from_str("{}").expect("defaults");
    m.num_mini_batches = 3;
    let perms = vec![vec![4, 1, 5, 0, 3, 2], vec![2, 3, 0, 1, 4, 5]];
    let p = epoch_mini_batches(&question_units(&policy, &samples), &samples, &perms, &m);
    let c = epoch_mini_batches(&question_units(&critic, &samples), &samples, &perms, &m);
    let questions = |mb: &Vec<Vec<usize>>| {
        mb.iter()
            .map(|u| samples[u[0]].question)
            .collect::<Vec<_>>()
    };
    let of = |epochs: &Vec<Vec<Vec<Vec<usize>>>>, e: usize| {
        epochs[e].iter().map(questions).collect::<Vec<_>>()
    };
    assert_eq!(of(&p, 0), vec![vec![4, 1], vec![5, 0], vec![3, 2]]);
    assert_eq!(of(&c, 0), vec![vec![1], vec![5, 0], vec![3, 2]]);
    assert_eq!(of(&p, 1), vec![vec![2, 3], vec![0, 1], vec![4, 5]]);
    assert_eq!(of(&c, 1), vec![vec![2, 3], vec![0, 1], vec![5]]);
    // Each question's unit holds both agents' answers.
    assert_eq!(p[0][0][0], vec![8, 9]);
}
