//! One batch of discussions (docs/src/trainers/maporl.md): at turn 0 every agent answers its question
//! alone; at turn t ≥ 1 each agent reads its own history plus the other agents' answers of turn
//! t − 1 (and their scores with `reward_feedback`) and answers again. Every (question, agent) of a
//! turn goes to the rollout workers in one concurrent batch, served by the adapter of the layout's
//! key; answers are sampled for exactly `max_output_length` tokens with EOS ignored and cut after the
//! first EOS; each answer is scored by the reward server, and invalid answers get the penalty.
//! With `maporl.rewrite_answers` (the default) every GSM8K/ANLI answer is first rewritten as MaPoRL
//! does ([`super::rewrite`]): the rewrite is what the agents read next turn, what the verifier scores
//! and what correctness is read from; the invalid-answer check reads the answer as sampled.

use std::collections::BTreeMap;

use cotrain_model::chat_template::ChatMessage as TemplateMessage;

use super::agents::Bases;
use super::rewrite::{self, Rewritten};
use crate::algo::discussion_score::{
    InvalidOutputRule, InvalidReason, apply_invalid_penalty, boxed_required, invalid_reason,
};
use crate::config::{FollowupStyle, MaporlSection, OldLogprobs};
use crate::error::TrainError;
use crate::prompts::items::TrainItem;
use crate::prompts::items::{PromptEncoding, encode_text};
use crate::prompts::{ChatMessage, Followup, Shown};
use crate::seeds::derive_seed;
use crate::sources::{GenRequest, RewardSource, RolloutSource, SamplingSpec, ScoreAction};

/// One agent's answer at one turn.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Answer {
    /// The tokens the policy read (question and discussion so far).
    pub prompt: Vec<u32>,
    /// What the critic reads before the response (the turn-0 prompt with `value_simplification`).
    pub value_prompt: Vec<u32>,
    /// The response, cut after its first EOS (the EOS kept, as TRL's `truncate_response` does).
    pub tokens: Vec<u32>,
    /// The response text (without the EOS).
    pub text: String,
    /// The reward server's 0/1 correctness (the incentives and accuracy metrics read it).
    pub correct: bool,
    /// The extracted answer (`null` when none), for agreement and majority votes.
    pub extracted: serde_json::Value,
    /// s(t, i): correctness or the verifier's probability, or the penalty for an invalid answer.
    pub score: f64,
    /// s(t, i) before the invalid-answer penalty (what the original's score messages show).
    #[serde(default)]
    pub raw_score: f64,
    /// The text the discussion shows (the other agents' next prompts, the agent's own history):
    /// MaPoRL's rewrite of `text` with `maporl.rewrite_answers`, else `text`.
    #[serde(default)]
    pub shown: String,
    pub invalid: Option<InvalidReason>,
    pub adapter: String,
    /// With `maporl.old_logprobs: generation`: the worker's log-prob of each of `tokens` under the
    /// distribution it was sampled from; empty otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub logprobs: Vec<f32>,
}

/// One question's discussion: `answers[turn][agent]`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Discussion {
    /// Index into the items the batch was given.
    pub item: usize,
    pub answers: Vec<Vec<Answer>>,
}

impl Discussion {
    /// The scores table s(t, i).
    pub fn scores(&self) -> Vec<Vec<f64>> {
        self.answers
            .iter()
            .map(|row| row.iter().map(|a| a.score).collect())
            .collect()
    }

    /// The correctness table.
    pub fn correct(&self) -> Vec<Vec<bool>> {
        self.answers
            .iter()
            .map(|row| row.iter().map(|a| a.correct).collect())
            .collect()
    }
}

/// What a batch of discussions needs besides the services.
pub struct DiscussionSetup<'a> {
    pub m: &'a MaporlSection,
    pub num_agents: usize,
    /// The reward server's task (`gsm8k`, `anli`, ...).
    pub task: &'a str,
    pub bases: &'a Bases,
    pub encoding: &'a PromptEncoding,
    pub followup: &'a Followup,
    /// The policy version each adapter key is served at.
    pub versions: &'a BTreeMap<String, u64>,
    /// Longest prompt in tokens.
    pub max_prompt_tokens: usize,
    /// With `score: verifier`, the verifier that gives s(t, i).
    pub verifier: Option<VerifierScoring>,
}

/// How `score: verifier` asks the learned verifier: its name on the rollout workers and the user
/// message paired with each answer.
pub struct VerifierScoring {
    pub name: String,
    /// `verifier.user_template` (the one it was trained with), rendered over each row's question;
    /// `None`: each answering agent's own turn-0 question message, as the original sends it
    /// (`maporl.verifier_user_message`).
    pub user_template: Option<String>,
}

impl VerifierScoring {
    /// The user message for agent `agent`'s answer to `item`.
    fn user_message(
        &self,
        task: &str,
        item: &TrainItem,
        agent: usize,
    ) -> Result<String, TrainError> {
        match &self.user_template {
            Some(t) => {
                crate::verifier::user_message(t, &crate::verifier::question_text(task, &item.item))
                    .map_err(TrainError::Config)
            }
            None => Ok(item.texts[agent].clone()),
        }
    }
}

impl DiscussionSetup<'_> {
    /// The model text of a conversation: the model's chat template over the messages, or (raw
    /// prompts) the messages' texts separated by blank lines.
    fn render(&self, agent: usize, messages: &[ChatMessage]) -> Result<String, TrainError> {
        let base = &self.bases.models[self.bases.agent_base[agent]];
        if !self.encoding.chat_template {
            let mut text = messages
                .iter()
                .map(|m| m.content.as_str())
                .collect::<Vec<_>>()
                .join("\n\n");
            if messages.len() > 1 {
                text.push_str("\n\n");
            }
            return Ok(text);
        }
        let msgs: Vec<TemplateMessage> = messages
            .iter()
            .map(|m| TemplateMessage::new(m.role.as_str(), m.content.as_str()))
            .collect();
        self.encoding
            .render_chat(base.chat_template.as_ref(), &msgs)
    }

    fn sampling(&self) -> SamplingSpec {
        // MaPoRL samples exactly `max_output_length` tokens with top_k 0 and top_p 1, EOS ignored.
        SamplingSpec {
            temperature: self.m.temperature,
            top_p: 1.0,
            top_k: 0,
            max_new_tokens: self.m.max_output_length,
            ignore_eos: true,
            stop: Vec::new(),
            sampling_logprobs: self.m.old_logprobs == OldLogprobs::Generation,
        }
    }

    /// Runs the discussions of `items` through every turn. `seed` is the step's seed; each request's
    /// seed is derived from it, the item's row and the agent and turn.
    #[allow(clippy::needless_range_loop)] // (question, agent) index several parallel tables
    pub fn discuss(
        &self,
        items: &[&TrainItem],
        seed: u64,
        rollout: &mut dyn RolloutSource,
        reward: &mut dyn RewardSource,
    ) -> Result<Vec<Discussion>, TrainError> {
        let n = self.num_agents;
        let mut histories: Vec<Vec<Vec<ChatMessage>>> = items
            .iter()
            .map(|it| {
                (0..n)
                    .map(|i| vec![ChatMessage::user(it.texts[i].clone())])
                    .collect()
            })
            .collect();
        let mut discussions: Vec<Discussion> = (0..items.len())
            .map(|q| Discussion {
                item: q,
                answers: Vec::new(),
            })
            .collect();
        for turn in 0..self.m.round_num {
            // Prompts of this turn.
            let mut prompts = Vec::with_capacity(items.len() * n);
            for (q, it) in items.iter().enumerate() {
                for i in 0..n {
                    let ids = if turn == 0 {
                        it.prompts[i].clone()
                    } else {
                        let prev = &discussions[q].answers[turn - 1];
                        histories[q][i] = followup_chat(
                            self.followup,
                            self.m,
                            &histories[q][i],
                            &it.texts[i],
                            prev,
                            i,
                        )
                        .map_err(TrainError::Config)?;
                        let base = &self.bases.models[self.bases.agent_base[i]];
                        encode_text(&base.tokenizer, &self.render(i, &histories[q][i])?)?
                    };
                    if ids.len() > self.max_prompt_tokens {
                        return Err(TrainError::Data(format!(
                            "row {} turn {turn}: agent {i}'s prompt has {} tokens, more than the {} allowed (maporl.max_input_length, or \
                             model.max_length − max_output_length)",
                            it.index,
                            ids.len(),
                            self.max_prompt_tokens
                        )));
                    }
                    prompts.push(ids);
                }
            }
            let requests: Vec<GenRequest> = prompts
                .iter()
                .enumerate()
                .map(|(k, p)| {
                    let (q, i) = (k / n, k % n);
                    let key = self.m.adapter_layout.adapter_key(i, turn);
                    GenRequest {
                        min_policy_version: self.versions.get(&key).copied().unwrap_or(0),
                        agent: key,
                        prompt: p.clone(),
                        n: 1,
                        sampling: self.sampling(),
                        seed: derive_seed(&[seed, items[q].index as u64, i as u64, turn as u64]),
                    }
                })
                .collect();
            let samples = rollout.generate(&requests)?;
            let mut answers = Vec::with_capacity(requests.len());
            for (k, (req, got)) in requests.iter().zip(samples).enumerate() {
                let i = k % n;
                let sample = got
                    .into_iter()
                    .next()
                    .ok_or_else(|| TrainError::Rollout(format!("no sample for `{}`", req.agent)))?;
                if sample.policy_version != req.min_policy_version {
                    return Err(TrainError::StaleSample {
                        agent: i,
                        expected: req.min_policy_version,
                        got: sample.policy_version,
                    });
                }
                let base = &self.bases.models[self.bases.agent_base[i]];
                let stops = base.stop_token_ids();
                let (tokens, body) = cut_at_eos(&sample.token_ids, &stops);
                let text = base
                    .tokenizer
                    .decode(body, true)
                    .map_err(|e| TrainError::Model(format!("decode: {e}")))?;
                let logprobs = if req.sampling.sampling_logprobs {
                    sample
                        .logprobs
                        .get(..tokens.len())
                        .map(<[f32]>::to_vec)
                        .ok_or_else(|| {
                            TrainError::Rollout(format!(
                                "`{}`: {} log-probs for {} tokens",
                                req.agent,
                                sample.logprobs.len(),
                                tokens.len()
                            ))
                        })?
                } else {
                    Vec::new()
                };
                answers.push((req.agent.clone(), tokens, body.len(), text, logprobs));
            }
            let rewriting = self.m.rewrite_answers && rewrite::rewrites(self.task);
            let presented: Vec<Rewritten> = answers
                .iter()
                .map(|(_, _, _, text, _)| present(self.m, self.task, text))
                .collect();
            let actions: Vec<ScoreAction> = answers
                .iter()
                .enumerate()
                .map(|(k, (_, tokens, _, _, _))| ScoreAction {
                    completions: vec![presented[k].judged.clone()],
                    completion_ids: vec![tokens.clone()],
                    item: items[k / n].item.clone(),
                })
                .collect();
            let scores = reward.score(self.task, &actions)?;
            // s(t, i) from the learned verifier: (question message, answer as presented).
            let probabilities = match &self.verifier {
                Some(v) => {
                    let conversations = presented
                        .iter()
                        .enumerate()
                        .map(|(k, p)| {
                            Ok((
                                v.user_message(self.task, items[k / n], k % n)?,
                                p.judged.clone(),
                            ))
                        })
                        .collect::<Result<Vec<(String, String)>, TrainError>>()?;
                    Some(rollout.score_verifier(&v.name, &conversations)?)
                }
                None => None,
            };
            let rule = InvalidOutputRule {
                min_tokens: self.m.min_output_length,
                require_boxed: self.task == "gsm8k" && boxed_required(turn, self.m.task_training),
                penalty: self.m.penalty_reward_value,
                ..InvalidOutputRule::default()
            };
            for (q, d) in discussions.iter_mut().enumerate() {
                d.answers.push(Vec::with_capacity(n));
                for i in 0..n {
                    let k = q * n + i;
                    let (adapter, tokens, body_len, text, logprobs) = answers[k].clone();
                    let sc = &scores[k];
                    let judged = &presented[k].judged;
                    // The original reads correctness from the verifier's copy of the rewrite with its
                    // own extraction, against the reference the reward server read from the row.
                    let reference = sc
                        .details
                        .get("reference")
                        .or_else(|| sc.details.get("label"))
                        .and_then(|v| v.as_str());
                    let (correct, extracted) = match reference {
                        Some(reference) if rewriting => {
                            let e = rewrite::extract_answer(self.task, judged);
                            (
                                e.as_deref() == Some(reference),
                                e.map_or(serde_json::Value::Null, serde_json::Value::String),
                            )
                        }
                        _ => (
                            sc.reward > 0.5,
                            sc.details
                                .get("answer")
                                .cloned()
                                .unwrap_or(serde_json::Value::Null),
                        ),
                    };
                    // The box check of the penalty reads the answer as sampled, not the rewrite.
                    let invalid = if self.m.invalid_penalty {
                        invalid_reason(&text, body_len, &rule)
                    } else {
                        None
                    };
                    let value_prompt = if self.m.value_simplification {
                        items[q].prompts[i].clone()
                    } else {
                        prompts[k].clone()
                    };
                    let shown = presented[k].shown.clone();
                    histories[q][i].push(ChatMessage::assistant(shown.clone()));
                    let raw_score = probabilities
                        .as_ref()
                        .map_or(if correct { 1.0 } else { 0.0 }, |p| f64::from(p[k]));
                    d.answers[turn].push(Answer {
                        prompt: prompts[k].clone(),
                        value_prompt,
                        tokens,
                        text,
                        correct,
                        extracted,
                        score: apply_invalid_penalty(raw_score, invalid, &rule),
                        raw_score,
                        shown,
                        invalid,
                        adapter,
                        logprobs,
                    });
                }
            }
        }
        Ok(discussions)
    }
}

/// How the discussion presents a sampled answer: MaPoRL's rewrite with `maporl.rewrite_answers` (for
/// the tasks the original rewrites), else the text as sampled (shown and judged as it is).
pub fn present(m: &MaporlSection, task: &str, text: &str) -> Rewritten {
    if m.rewrite_answers && rewrite::rewrites(task) {
        rewrite::rewrite(task, text)
    } else {
        Rewritten {
            answer: rewrite::extract_answer(task, text),
            shown: text.to_string(),
            judged: text.to_string(),
        }
    }
}

/// The chat `agent` reads at a turn t ≥ 1: its `history` (its first-turn `question`, its answers and
/// follow-ups so far) plus the follow-up message showing the other agents' answers of `previous`
/// (every agent's answer of turn t − 1) and, with `reward_feedback`, the scores: the raw s(t − 1, ·)
/// in the original style (the agent's own in front), the penalised one floored at 0 in cotrain's.
pub fn followup_chat(
    followup: &Followup,
    m: &MaporlSection,
    history: &[ChatMessage],
    question: &str,
    previous: &[Answer],
    agent: usize,
) -> Result<Vec<ChatMessage>, String> {
    let shown_score = |a: &Answer| match followup.style() {
        FollowupStyle::Original => a.raw_score,
        FollowupStyle::Cotrain => a.score.max(0.0),
    };
    let others: Vec<Shown<'_>> = previous
        .iter()
        .enumerate()
        .filter(|(a, _)| *a != agent)
        .map(|(_, a)| Shown {
            text: &a.shown,
            score: m.reward_feedback.then(|| shown_score(a)),
        })
        .collect();
    let own = previous
        .get(agent)
        .filter(|_| m.reward_feedback)
        .map(shown_score);
    followup.next_turn(history, question, own, &others)
}

/// The response kept for training (through the first stop token, inclusive) and its body (before it).
pub fn cut_at_eos<'a>(tokens: &'a [u32], stops: &[u32]) -> (Vec<u32>, &'a [u32]) {
    match tokens.iter().position(|t| stops.contains(t)) {
        Some(p) => (tokens[..=p].to_vec(), &tokens[..p]),
        None => (tokens.to_vec(), tokens),
    }
}

/// Per-turn discussion metrics of a batch: accuracy of each agent and overall, majority-vote accuracy
/// (an answer given by more than half the agents, right), agreement (every agent gave the same
/// answer), answer transitions between consecutive turns, invalid fractions, mean score.
pub fn discussion_metrics(discussions: &[Discussion], prefix: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    let Some(first) = discussions.first() else {
        return out;
    };
    let (turns, n) = (
        first.answers.len(),
        first.answers.first().map_or(0, Vec::len),
    );
    let q = discussions.len() as f64;
    for t in 0..turns {
        let mut acc = 0.0;
        for i in 0..n {
            let a = discussions
                .iter()
                .filter(|d| d.answers[t][i].correct)
                .count() as f64
                / q;
            out.insert(format!("{prefix}accuracy/turn{t}/agent{i}"), a);
            acc += a / n as f64;
        }
        out.insert(format!("{prefix}accuracy/turn{t}"), acc);
        let (mut majority, mut agree, mut invalid, mut score) = (0.0, 0.0, 0.0, 0.0);
        for d in discussions {
            let row = &d.answers[t];
            let mut counts: BTreeMap<String, (usize, bool)> = BTreeMap::new();
            for a in row.iter().filter(|a| !a.extracted.is_null()) {
                let e = counts
                    .entry(a.extracted.to_string())
                    .or_insert((0, a.correct));
                e.0 += 1;
            }
            if counts.values().any(|(c, right)| 2 * c > n && *right) {
                majority += 1.0;
            }
            if counts.len() == 1 && counts.values().all(|(c, _)| *c == n) {
                agree += 1.0;
            }
            invalid += row.iter().filter(|a| a.invalid.is_some()).count() as f64 / n as f64;
            score += row.iter().map(|a| a.score).sum::<f64>() / n as f64;
        }
        out.insert(format!("{prefix}majority_accuracy/turn{t}"), majority / q);
        out.insert(format!("{prefix}agreement/turn{t}"), agree / q);
        out.insert(format!("{prefix}invalid/turn{t}"), invalid / q);
        out.insert(format!("{prefix}score/turn{t}"), score / q);
        if t >= 1 {
            let count = |from: bool, to: bool| {
                discussions
                    .iter()
                    .map(|d| {
                        (0..n)
                            .filter(|&i| {
                                d.answers[t - 1][i].correct == from && d.answers[t][i].correct == to
                            })
                            .count()
                    })
                    .sum::<usize>() as f64
                    / (q * n as f64)
            };
            out.insert(
                format!("{prefix}transitions/turn{t}/correct_to_wrong"),
                count(true, false),
            );
            out.insert(
                format!("{prefix}transitions/turn{t}/wrong_to_correct"),
                count(false, true),
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_response_is_cut_after_the_first_eos() {
        let (kept, body) = cut_at_eos(&[5, 6, 2, 7, 2], &[2]);
        assert_eq!(kept, vec![5, 6, 2]);
        assert_eq!(body, &[5, 6]);
        let (kept, body) = cut_at_eos(&[5, 6], &[2]);
        assert_eq!((kept.as_slice(), body), (&[5u32, 6][..], &[5u32, 6][..]));
    }

    fn answer(correct: bool, extracted: &str) -> Answer {
        Answer {
            prompt: vec![],
            value_prompt: vec![],
            tokens: vec![],
            text: String::new(),
            correct,
            extracted: serde_json::json!(extracted),
            score: if correct { 1.0 } else { 0.0 },
            raw_score: if correct { 1.0 } else { 0.0 },
            shown: String::new(),
            invalid: None,
            adapter: String::new(),
            logprobs: vec![],
        }
    }

    #[test]
    fn metrics_count_accuracy_majority_agreement_and_transitions() {
        let d1 = Discussion {
            item: 0,
            answers: vec![
                vec![answer(true, "7"), answer(false, "3"), answer(false, "4")],
                vec![answer(true, "7"), answer(true, "7"), answer(false, "4")],
            ],
        };
        let d2 = Discussion {
            item: 1,
            answers: vec![
                vec![answer(false, "1"), answer(false, "1"), answer(false, "1")],
                vec![answer(false, "1"), answer(false, "1"), answer(true, "2")],
            ],
        };
        let m = discussion_metrics(&[d1, d2], "");
        assert!((m["accuracy/turn0"] - 1.0 / 6.0).abs() < 1e-12);
        assert!((m["accuracy/turn1"] - 3.0 / 6.0).abs() < 1e-12);
        assert_eq!(m["accuracy/turn1/agent1"], 0.5);
        assert_eq!(m["majority_accuracy/turn0"], 0.0);
        assert_eq!(m["majority_accuracy/turn1"], 0.5);
        assert_eq!(m["agreement/turn0"], 0.5);
        assert_eq!(m["agreement/turn1"], 0.0);
        assert!((m["transitions/turn1/wrong_to_correct"] - 2.0 / 6.0).abs() < 1e-12);
        assert_eq!(m["transitions/turn1/correct_to_wrong"], 0.0);
    }
}
