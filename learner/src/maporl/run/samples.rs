//! A step's discussions as PPO samples: every trained answer (turns ≥ 1, and turn 0 with
//! `task_training`) with its training score R(t, i), its trained tokens and where the score lands.

use super::super::agents::critic_key;
use super::super::rollout::Discussion;
use super::super::update::{PpoSample, training_response};
use crate::algo::discussion_score::{Incentives, ScoreRule, shaped_training_scores};
use crate::config::MaporlSection;
use crate::error::TrainError;

/// Where a sample came from: (question, turn, agent).
pub(super) type Place = (usize, usize, usize);

/// A step's trained answers.
pub(super) struct StepSamples {
    pub(super) samples: Vec<PpoSample>,
    /// Where each sample came from.
    pub(super) where_from: Vec<Place>,
    /// Every answer's training score R(t, i) by question (`[q][t][i]`, trained or not).
    pub(super) training_scores: Vec<Vec<Vec<f64>>>,
}

/// The samples of `discussions`. `ends[i]`: agent `i`'s stop tokens and pad token, which place
/// its answers' trained tokens and score ([`training_response`]).
pub(super) fn ppo_samples(
    discussions: &[Discussion],
    m: &MaporlSection,
    ends: &[(Vec<u32>, Option<u32>)],
    rule: &ScoreRule,
    inc: &Incentives,
) -> Result<StepSamples, TrainError> {
    let mut samples = Vec::new();
    let mut where_from = Vec::new();
    let mut training_scores = Vec::new();
    for (q, d) in discussions.iter().enumerate() {
        let r = shaped_training_scores(&d.scores(), &d.correct(), rule, inc)
            .map_err(|e| TrainError::Data(e.to_string()))?;
        for (t, row) in d.answers.iter().enumerate() {
            for (i, a) in row.iter().enumerate() {
                let (stops, pad) = &ends[i];
                let (response, score_slot_after) = training_response(
                    &a.tokens,
                    m.max_output_length,
                    stops,
                    *pad,
                    m.score_position,
                );
                // An answer with no token to train (an EOS-as-pad first token) is left out.
                if (t > 0 || m.task_training) && !response.is_empty() {
                    // The response is a prefix of the sampled tokens (see `training_response`).
                    let behaviour_logprobs =
                        (!a.logprobs.is_empty()).then(|| a.logprobs[..response.len()].to_vec());
                    samples.push(PpoSample {
                        policy: m.adapter_layout.adapter_key(i, t),
                        critic: critic_key(m, i, t),
                        turn: t,
                        agent: i,
                        question: q,
                        prompt: a.prompt.clone(),
                        value_prompt: a.value_prompt.clone(),
                        response,
                        behaviour_logprobs,
                        score_slot_after,
                        score: r[t][i],
                    });
                    where_from.push((q, t, i));
                }
            }
        }
        training_scores.push(r);
    }
    Ok(StepSamples {
        samples,
        where_from,
        training_scores,
    })
}
