//! The trainer options beside the original, run through the paths the trainer itself runs
//! (`Policy::update`, `Trainer::train_step`), against hand computations: every expected update is
//! recomputed here from scratch, with one plain forward per sequence (no prompt sharing, no chunked
//! kernel), the loss written out term by term, and libtorch's own AdamW (not cotrain's).
//!
//! - shared parameters: both agents' losses scaled by 1/N, one optimiser step per round;
//! - `cross` joint mode: G^N joint actions scored, each completion credited with the sum of the
//!   returns of its joint actions, then the update;
//! - PPO-style ratio clipping over several epochs on the same samples, and decoupled PPO when the
//!   samples carry importance weights;
//! - the KL penalty to a frozen reference (k3, and k1 in its score-function form), and the KL as
//!   return shaping (`reference_kl.placement: returns`, CoMLRL 2026).

mod train_common;

use std::sync::{Arc, Mutex};

use cotrain_learner::algo::{AdamWConfig, LossOptions};
use cotrain_learner::config::{KlEstimator, LossNormalization};
use cotrain_learner::services::EngineRollout;
use cotrain_learner::trainer::{
    AgentBatches, GenRequest, GenSample, Policy, RewardSource, RolloutSource, Score, ScoreAction,
    TrainError, TrainSample, Trainer, TrainerSetup,
};
use cotrain_model::loader::{LoadOptions, LoadedModel, load};
use tch::nn::OptimizerConfig;
use tch::{Kind, Tensor};
use train_common::{config, items, tiny_model_dir};

/// Adam's eps is set large in these tests so that the first steps are nearly linear in the gradient
/// (p −= lr·g/(|g| + eps)): parameters then compare to tight tolerances even where a gradient is
/// tiny and its sign depends on summation order.
const EPS: f64 = 1.0;
const LR: f64 = 0.5;

fn adam() -> AdamWConfig {
    AdamWConfig {
        eps: EPS,
        ..AdamWConfig::new(LR, 0.0, None)
    }
}

fn tiny(dir: &std::path::Path) -> (String, LoadedModel) {
    let spec = tiny_model_dir(dir).display().to_string();
    let m = load(&spec, &LoadOptions::default()).unwrap();
    (spec, m)
}

/// log π(y_t | prompt, y_<t) for each completion token: one full forward of prompt + completion.
fn naive_logprobs(model: &LoadedModel, s: &TrainSample) -> Tensor {
    let ids: Vec<i64> = s
        .prompt
        .iter()
        .chain(&s.completion)
        .map(|&t| t as i64)
        .collect();
    let logits = model
        .model
        .forward(&Tensor::from_slice(&ids).unsqueeze(0))
        .unwrap()
        .squeeze_dim(0);
    let p = s.prompt.len() as i64;
    let c = s.completion.len() as i64;
    // The logits at position i predict token i + 1.
    let lp = logits.narrow(0, p - 1, c).log_softmax(-1, Kind::Float);
    let targets = Tensor::from_slice(&s.completion.iter().map(|&t| t as i64).collect::<Vec<_>>());
    lp.gather(1, &targets.unsqueeze(1), false).squeeze_dim(1)
}

/// The reference update: `epochs` × (zero grads, `loss(model)`.backward(), libtorch AdamW step).
fn reference_update(model: &LoadedModel, epochs: usize, loss: impl Fn(&LoadedModel) -> Tensor) {
    let mut opt = tch::nn::AdamW {
        beta1: 0.9,
        beta2: 0.999,
        wd: 0.0,
        eps: EPS,
        amsgrad: false,
    }
    .build(&model.vs, LR)
    .unwrap();
    for _ in 0..epochs {
        opt.zero_grad();
        loss(model).backward();
        opt.step();
    }
}

/// `a` and `b` moved from `base` by the same update: per tensor, they differ by at most 0.1% of the
/// largest change (float summation orders differ between the two computations) plus 1e-6.
fn assert_same_weights(a: &LoadedModel, b: &LoadedModel, base: &LoadedModel, what: &str) {
    let (pa, pb, p0) = (
        a.named_parameters(),
        b.named_parameters(),
        base.named_parameters(),
    );
    for (name, t) in &pa {
        let diff = (t - &pb[name]).abs().max().double_value(&[]);
        let moved = (&pb[name] - &p0[name]).abs().max().double_value(&[]);
        assert!(
            diff <= 1e-3 * moved + 1e-6,
            "{what}: {name} differs from the hand computation by {diff} (update size {moved})"
        );
    }
}

fn assert_moved(before: &LoadedModel, after: &LoadedModel) {
    let (pa, pb) = (before.named_parameters(), after.named_parameters());
    let max = pa
        .iter()
        .map(|(n, t)| (t - &pb[n]).abs().max().double_value(&[]))
        .fold(0.0, f64::max);
    assert!(
        max > 1e-4,
        "the update must move the weights (max change {max})"
    );
}

fn sample(prompt: &[u32], completion: &[u32], advantage: f64) -> TrainSample {
    TrainSample {
        prompt: prompt.to_vec(),
        completion: completion.to_vec(),
        advantage,
        weight: 1.0,
        old_logprobs: Vec::new(),
    }
}

#[test]
fn shared_parameters_scale_each_agent_by_one_over_n_and_step_once_per_round() {
    let tmp = tempfile::tempdir().unwrap();
    let (spec, model) = tiny(tmp.path());
    let reference = load(&spec, &LoadOptions::default()).unwrap();
    let untouched = load(&spec, &LoadOptions::default()).unwrap();
    let mut policy = Policy::new("shared", &spec, model, None, adam());
    // Agent 0: two samples, one mini-batch; agent 1: three samples in two mini-batches.
    let a0 = vec![
        sample(&[65, 97, 48], &[120, 121, 10], 1.0),
        sample(&[65, 97, 48], &[33, 34], -1.0),
    ];
    let a1 = vec![
        sample(&[66, 98], &[40, 41, 42, 43], 0.5),
        sample(&[66, 98], &[7], -0.25),
        sample(&[66, 99], &[200, 201], -0.25),
    ];
    let batches = [
        AgentBatches {
            minibatches: vec![a0.clone()],
            scale: 0.5,
        },
        AgentBatches {
            minibatches: vec![a1[..2].to_vec(), a1[2..].to_vec()],
            scale: 0.5,
        },
    ];
    let stats = policy
        .update(&batches, &LossOptions::original(), 1)
        .unwrap();
    assert_eq!(
        (stats.steps, policy.optimizer.step),
        (1, 1),
        "exactly one optimiser step for the round of both agents"
    );

    // By hand: L = Σ_agents (1/N) · (1/K_agent) Σ_k −A_k · Σ_t log π_t.
    reference_update(&reference, 1, |m| {
        let agent = |samples: &[TrainSample]| {
            let k = samples.len() as f64;
            samples
                .iter()
                .map(|s| naive_logprobs(m, s).sum(Kind::Float) * (-s.advantage / k))
                .fold(Tensor::from(0.0f32), |a, b| a + b)
        };
        (agent(&a0) + agent(&a1)) * 0.5
    });
    assert_same_weights(&policy.model, &reference, &untouched, "shared parameters");
    assert_moved(&untouched, &policy.model);
}

#[test]
fn ratio_clipping_runs_every_epoch_on_the_same_samples() {
    let tmp = tempfile::tempdir().unwrap();
    let (spec, model) = tiny(tmp.path());
    let reference = load(&spec, &LoadOptions::default()).unwrap();
    let base = load(&spec, &LoadOptions::default()).unwrap();
    let mut samples = vec![
        sample(&[65, 97, 48], &[120, 121, 10], 1.5),
        sample(&[65, 97, 48], &[33, 34, 35], -1.5),
    ];
    // Behaviour log-probs: the initial policy's, shifted on some tokens so that clipping bites.
    for (s, shift) in samples
        .iter_mut()
        .zip([[0.3f32, -0.3, 0.0], [-0.25, 0.0, 0.4]])
    {
        let lp: Vec<f32> = Vec::try_from(naive_logprobs(&model, s).detach()).unwrap();
        s.old_logprobs = lp.iter().zip(shift).map(|(x, d)| x + d).collect();
    }
    let mut policy = Policy::new("agent0", &spec, model, None, adam());
    let opts = LossOptions {
        clip: Some((0.2, 0.28)),
        ..LossOptions::original()
    };
    let stats = policy
        .update(
            &[AgentBatches {
                minibatches: vec![samples.clone()],
                scale: 1.0,
            }],
            &opts,
            3,
        )
        .unwrap();
    assert_eq!(
        (stats.steps, policy.optimizer.step),
        (3, 3),
        "one optimiser step per epoch"
    );
    assert!(
        stats.clip_fraction > 0.0,
        "some tokens are clipped in the last epoch"
    );

    // By hand, per epoch: L = (1/K) Σ_k Σ_t −min(A·ρ_t, A·clip(ρ_t, 0.8, 1.28)), ρ_t = exp(lp − old).
    reference_update(&reference, 3, |m| {
        let k = samples.len() as f64;
        samples
            .iter()
            .map(|s| {
                let lp = naive_logprobs(m, s);
                let ratio = (&lp - Tensor::from_slice(&s.old_logprobs)).exp();
                let a = s.advantage;
                let unclipped = &ratio * a;
                let clipped = ratio.clamp(0.8, 1.28) * a;
                unclipped.minimum(&clipped).sum(Kind::Float) * (-1.0 / k)
            })
            .fold(Tensor::from(0.0f32), |a, b| a + b)
    });
    assert_same_weights(
        &policy.model,
        &reference,
        &base,
        "clipped multi-epoch update",
    );
}

/// Clipping with truncated importance weights (asynchronous or bf16 rollouts): decoupled PPO. The
/// ratio is clipped against the proximal policy (the weights at the start of the step) and each
/// token is weighted by min(π_prox/μ, cap) against the behaviour policy μ, so the ratio is not
/// counted twice (clipping against μ and weighting by π/μ again gives about ρ²·A).
#[test]
fn clipping_with_importance_weights_is_decoupled_ppo_against_the_proximal_policy() {
    let tmp = tempfile::tempdir().unwrap();
    let (spec, model) = tiny(tmp.path());
    let reference = load(&spec, &LoadOptions::default()).unwrap();
    let base = load(&spec, &LoadOptions::default()).unwrap();
    let mut samples = vec![
        sample(&[65, 97, 48], &[120, 121, 10], 1.5),
        sample(&[65, 97, 48], &[33, 34, 35], -1.5),
    ];
    // Behaviour log-probs: the initial policy's shifted, some beyond the cap (e^0.9 > 2).
    let mut proximal = Vec::new();
    for (s, shift) in samples
        .iter_mut()
        .zip([[-0.5f32, 0.3, -0.9], [0.4, -0.6, 0.1]])
    {
        let lp = naive_logprobs(&model, s).detach();
        let v: Vec<f32> = Vec::try_from(&lp).unwrap();
        s.old_logprobs = v.iter().zip(shift).map(|(x, d)| x + d).collect();
        proximal.push(lp);
    }
    let mut policy = Policy::new("agent0", &spec, model, None, adam());
    let opts = LossOptions {
        clip: Some((0.2, 0.28)),
        truncated_is: Some(2.0),
        measure_gap: true,
        ..LossOptions::original()
    };
    let stats = policy
        .update(
            &[AgentBatches {
                minibatches: vec![samples.clone()],
                scale: 1.0,
            }],
            &opts,
            3,
        )
        .unwrap();
    assert_eq!(stats.steps, 3);
    assert!(
        stats.is_truncated_fraction > 0.0,
        "some weights are cut to the cap"
    );

    // By hand, per epoch: L = (1/K) Σ_k Σ_t −w_t · min(A·r_t, A·clip(r_t, 0.8, 1.28)),
    // r_t = exp(lp − lp_prox), w_t = min(exp(lp_prox − μ), 2), lp_prox fixed at the start.
    reference_update(&reference, 3, |m| {
        let k = samples.len() as f64;
        samples
            .iter()
            .zip(&proximal)
            .map(|(s, prox)| {
                let lp = naive_logprobs(m, s);
                let ratio = (&lp - prox).exp();
                let w = (prox - Tensor::from_slice(&s.old_logprobs))
                    .exp()
                    .clamp_max(2.0);
                let a = s.advantage;
                let term = (&ratio * a).minimum(&(ratio.clamp(0.8, 1.28) * a));
                (term * w).sum(Kind::Float) * (-1.0 / k)
            })
            .fold(Tensor::from(0.0f32), |a, b| a + b)
    });
    assert_same_weights(&policy.model, &reference, &base, "decoupled PPO");
    assert_moved(&base, &policy.model);
}

/// A sample whose behaviour log-probs are fewer than its completion tokens is refused by name: the
/// ratio against zero-padded log-probs would be silently wrong.
#[test]
fn behaviour_logprobs_must_cover_every_completion_token() {
    let tmp = tempfile::tempdir().unwrap();
    let (spec, model) = tiny(tmp.path());
    let mut s = sample(&[65, 97, 48], &[120, 121, 10], 1.0);
    s.old_logprobs = vec![-1.0, -2.0];
    let mut policy = Policy::new("agent0", &spec, model, None, adam());
    let opts = LossOptions {
        clip: Some((0.2, 0.2)),
        ..LossOptions::original()
    };
    let e = policy
        .update(
            &[AgentBatches {
                minibatches: vec![vec![s]],
                scale: 1.0,
            }],
            &opts,
            1,
        )
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("2 behaviour log-probs for its 3 completion tokens"),
        "{e}"
    );
    assert_eq!(policy.optimizer.step, 0, "nothing was trained");
}

#[test]
fn reference_kl_penalties_match_their_formulas() {
    for (estimator, normalization) in [
        (KlEstimator::K3, LossNormalization::Sum),
        (KlEstimator::K1, LossNormalization::TokenMean),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let (spec, model) = tiny(tmp.path());
        let hand = load(&spec, &LoadOptions::default()).unwrap();
        let base = load(&spec, &LoadOptions::default()).unwrap();
        // The frozen reference: the same model with its weights perturbed, so that KL ≠ 0.
        let frozen = perturbed(&spec, 3);
        let samples = vec![
            sample(&[65, 97, 48], &[120, 121, 10], 1.0),
            sample(&[65, 97, 48], &[33, 34], -1.0),
        ];
        let ref_lp: Vec<Tensor> = samples
            .iter()
            .map(|s| tch::no_grad(|| naive_logprobs(&frozen, s)))
            .collect();
        let mut policy = Policy::new("agent0", &spec, model, Some(frozen), adam());
        let coef = 0.7;
        let opts = LossOptions {
            kl: Some((coef, estimator)),
            normalization,
            ..LossOptions::original()
        };
        let stats = policy
            .update(
                &[AgentBatches {
                    minibatches: vec![samples.clone()],
                    scale: 1.0,
                }],
                &opts,
                1,
            )
            .unwrap();
        assert!(
            stats.kl.abs() > 1e-4,
            "{estimator:?}: the perturbed reference gives a non-zero KL, got {}",
            stats.kl
        );

        let reduce = |x: Tensor, n: usize| match normalization {
            LossNormalization::Sum => x.sum(Kind::Float),
            LossNormalization::TokenMean => x.sum(Kind::Float) / n as f64,
        };
        reference_update(&hand, 1, |m| {
            let k = samples.len() as f64;
            let mut total = Tensor::from(0.0f32);
            for (s, lr) in samples.iter().zip(&ref_lp) {
                let lp = naive_logprobs(m, s);
                let n = s.completion.len();
                let policy_term = reduce(lp.shallow_clone(), n) * (-s.advantage);
                let kl_term = match estimator {
                    // k3 per token: exp(lr − lp) − (lr − lp) − 1, differentiated directly.
                    KlEstimator::K3 => {
                        let d = lr - &lp;
                        reduce(d.exp() - &d - 1.0, n)
                    }
                    // k1 in score-function form: sg(reduce(lp − lr)) · reduce(lp).
                    KlEstimator::K1 => {
                        let kl1 = reduce(&lp - lr, n).detach();
                        kl1 * reduce(lp.shallow_clone(), n)
                    }
                };
                total += (policy_term + kl_term * coef) / k;
            }
            total
        });
        assert_same_weights(
            &policy.model,
            &hand,
            &base,
            &format!("{estimator:?} penalty"),
        );
    }
}

/// Wraps a rollout source and keeps every sample it returned.
struct Recording {
    inner: EngineRollout,
    seen: Arc<Mutex<Vec<Vec<GenSample>>>>,
    /// Make each request's first sample end on the tiny model's EOS (id 2), with a made-up
    /// log-prob of 0 for it.
    first_ends_on_eos: bool,
}

impl RolloutSource for Recording {
    fn generate(&mut self, requests: &[GenRequest]) -> Result<Vec<Vec<GenSample>>, TrainError> {
        let mut out = self.inner.generate(requests)?;
        if self.first_ends_on_eos {
            for s in out.iter_mut().filter_map(|samples| samples.first_mut()) {
                s.token_ids.push(2);
                s.logprobs.push(0.0);
                s.stopped = true;
            }
        }
        self.seen.lock().unwrap().extend(out.iter().cloned());
        Ok(out)
    }
    fn policy_version(&mut self, agent: &str) -> Result<u64, TrainError> {
        self.inner.policy_version(agent)
    }
    fn push_weights(
        &mut self,
        agent: &str,
        version: u64,
        params: &std::collections::BTreeMap<String, Tensor>,
    ) -> Result<(), TrainError> {
        self.inner.push_weights(agent, version, params)
    }
    fn describe(&self) -> String {
        "recording".into()
    }
}

/// Reward of a joint action = 1 + its index in the order the trainer sent it (so each joint action
/// has a distinct, known reward); records how many actions each call carried.
struct IndexReward {
    calls: Arc<Mutex<Vec<usize>>>,
}

impl RewardSource for IndexReward {
    fn score(&mut self, _task: &str, actions: &[ScoreAction]) -> Result<Vec<Score>, TrainError> {
        self.calls.lock().unwrap().push(actions.len());
        Ok((0..actions.len())
            .map(|j| Score {
                reward: 1.0 + j as f64,
                ..Default::default()
            })
            .collect())
    }
    fn describe(&self) -> String {
        "index reward".into()
    }
}

#[test]
fn cross_mode_scores_every_combination_and_credits_each_completion_with_its_sum() {
    cross_mode_credits(true);
}

/// The same update with the two policies trained in turn rather than at the same time.
#[test]
fn policies_updated_in_turn_reach_the_same_weights() {
    cross_mode_credits(false);
}

/// One cross-mode step of two policies (`learner.concurrent_policies` as given), checked against a
/// hand-written update of each.
fn cross_mode_credits(concurrent: bool) {
    let tmp = tempfile::tempdir().unwrap();
    let spec = tiny_model_dir(tmp.path()).display().to_string();
    let opts = LoadOptions::default();
    let cfg = config(
        "model: {name: unused, temperature: 1.0, top_p: 1.0, top_k: 0, max_length: 64}\n\
         dataset: {name: gsm8k, train_split: 'train[:1]'}\n\
         seed: 9\n\
         magrpo:\n  num_agents: 2\n  num_generations: 3\n  max_new_tokens: 3\n  learning_rate: 0.5\n  joint_mode: cross\n  \
         num_train_epochs: 1\n  rollout_buffer_size: 1\n  eval_interval: 0\n  save_steps: 100000\n\
         logging: {tensorboard: false, plots: false, progress: never}\n",
        &[format!("learner.concurrent_policies={concurrent}")],
    );
    let seen = Arc::new(Mutex::new(Vec::new()));
    let calls = Arc::new(Mutex::new(Vec::new()));
    let mut policies = Vec::new();
    let mut engines = Vec::new();
    for a in 0..2 {
        let name = format!("agent{a}");
        policies.push(Policy::new(
            &name,
            &spec,
            load(&spec, &opts).unwrap(),
            None,
            adam(),
        ));
        engines.push((name, load(&spec, &opts).unwrap()));
    }
    let train_items = items(1, 2);
    let prompts = train_items[0].prompts.clone();
    let mut trainer = Trainer::new(TrainerSetup {
        cfg: cfg.clone(),
        run_dir: tmp.path().join("run"),
        task: "index".into(),
        is_code: false,
        policies,
        agent_policy: vec![0, 1],
        rollout: Box::new(Recording {
            inner: EngineRollout::new(engines),
            seen: seen.clone(),
            first_ends_on_eos: false,
        }),
        reward: Box::new(IndexReward {
            calls: calls.clone(),
        }),
        train_items,
        eval_items: Vec::new(),
    })
    .unwrap();
    trainer.sync_all_weights().unwrap();
    let metrics = trainer.train_step(&[0]).unwrap();
    assert_eq!(
        *calls.lock().unwrap(),
        vec![9],
        "G^N = 3^2 joint actions scored in one call"
    );
    // Joint action (i, j) is index 3i + j, reward r = 1 + 3i + j; mean over the nine = 5.
    assert!((metrics["reward/mean"] - 5.0).abs() < 1e-12);
    // With two OpenMP threads or more, the two policies train at the same time, each on its own.
    let together = if concurrent && tch::get_num_threads() >= 2 {
        2.0
    } else {
        1.0
    };
    assert_eq!(
        metrics["concurrent_policies"], together,
        "policies updated at the same time"
    );

    // Credit: agent 0's completion i gets Σ_j r(i, j) = 3 + 9i + 3 = 6 + 9i → [6, 15, 24];
    // agent 1's completion j gets Σ_i r(i, j) = 3 + 9 + 3j = 12 + 3j → [12, 15, 18].
    // Mean advantages: agent 0 [−9, 0, 9], agent 1 [−3, 0, 3].
    let samples = seen.lock().unwrap().clone();
    assert_eq!(samples.len(), 2, "one request per agent");
    let advantages = [[-9.0, 0.0, 9.0], [-3.0, 0.0, 3.0]];
    let base = load(&spec, &opts).unwrap();
    for a in 0..2 {
        let hand = load(&spec, &opts).unwrap();
        let train: Vec<TrainSample> = samples[a]
            .iter()
            .zip(advantages[a])
            .map(|(s, adv)| TrainSample {
                prompt: prompts[a].clone(),
                completion: s.token_ids.clone(),
                advantage: adv,
                weight: 1.0,
                old_logprobs: Vec::new(),
            })
            .collect();
        reference_update(&hand, 1, |m| {
            let k = train.len() as f64;
            train
                .iter()
                .map(|s| naive_logprobs(m, s).sum(Kind::Float) * (-s.advantage / k))
                .fold(Tensor::from(0.0f32), |x, y| x + y)
        });
        assert_same_weights(
            &trainer.policies()[a].model,
            &hand,
            &base,
            &format!("cross mode, agent {a}"),
        );
    }
}

/// The tiny model with its weights perturbed (seeded), so that its KL to the unperturbed one is not 0.
fn perturbed(spec: &str, seed: i64) -> LoadedModel {
    let m = load(spec, &LoadOptions::default()).unwrap();
    tch::no_grad(|| {
        tch::manual_seed(seed);
        for (_, mut t) in m.named_parameters() {
            let noise = t.randn_like() * 0.05;
            let _ = t.g_add_(&noise);
        }
    });
    m
}

/// `reference_kl.placement: returns` (CoMLRL 2026) through `Trainer::train_step`: each completion's
/// return less coef·Σ_t k3_t against the frozen reference (the final EOS left out), before the
/// group baseline, and no KL term in the loss.
#[test]
fn reference_kl_on_the_returns_shapes_each_completions_return_before_the_baseline() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = tiny_model_dir(tmp.path()).display().to_string();
    let opts = LoadOptions::default();
    let coef = 0.1;
    let cfg = config(
        "model: {name: unused, temperature: 1.0, top_p: 1.0, top_k: 0, max_length: 64}\n\
         dataset: {name: gsm8k, train_split: 'train[:1]'}\n\
         seed: 9\n\
         magrpo:\n  num_agents: 2\n  num_generations: 3\n  max_new_tokens: 4\n  learning_rate: 0.5\n  \
         num_train_epochs: 1\n  rollout_buffer_size: 1\n  eval_interval: 0\n  save_steps: 100000\n  \
         reference_kl: {enabled: true, placement: returns, coef: 0.1}\n\
         logging: {tensorboard: false, plots: false, progress: never}\n",
        &[],
    );
    assert_eq!(
        LossOptions::from_section(&cfg.trainer).kl,
        None,
        "no KL term in the loss"
    );
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut policies = Vec::new();
    let mut engines = Vec::new();
    for a in 0..2 {
        let name = format!("agent{a}");
        policies.push(Policy::new(
            &name,
            &spec,
            load(&spec, &opts).unwrap(),
            Some(perturbed(&spec, 3 + a as i64)),
            adam(),
        ));
        engines.push((name, load(&spec, &opts).unwrap()));
    }
    let train_items = items(1, 2);
    let prompts = train_items[0].prompts.clone();
    let mut trainer = Trainer::new(TrainerSetup {
        cfg: cfg.clone(),
        run_dir: tmp.path().join("run"),
        task: "index".into(),
        is_code: false,
        policies,
        agent_policy: vec![0, 1],
        rollout: Box::new(Recording {
            inner: EngineRollout::new(engines),
            seen: seen.clone(),
            first_ends_on_eos: true,
        }),
        reward: Box::new(IndexReward {
            calls: Arc::new(Mutex::new(Vec::new())),
        }),
        train_items,
        eval_items: Vec::new(),
    })
    .unwrap();
    trainer.sync_all_weights().unwrap();
    let metrics = trainer.train_step(&[0]).unwrap();

    // By hand: joint action j has reward (= return) 1 + j. Agent a's completion k: KL = Σ_t k3_t
    // with d_t = log π_ref,a − log π_0 (the policy that sampled: the initial weights) over its tokens
    // but a final EOS; R' = 1 + k − coef·KL; A = R' − mean R'. Each agent's first completion ends on
    // an EOS whose made-up log-prob (0) would change its KL if it were counted.
    let base = load(&spec, &opts).unwrap();
    let stop = base.stop_token_ids();
    let samples = seen.lock().unwrap().clone();
    assert_eq!(samples.len(), 2, "one request per agent");
    assert!(
        samples
            .iter()
            .all(|s| s[0].stopped && stop.contains(s[0].token_ids.last().unwrap()))
    );
    let mut all_kls = Vec::new();
    for a in 0..2 {
        let reference = perturbed(&spec, 3 + a as i64);
        let mut train: Vec<TrainSample> = samples[a]
            .iter()
            .map(|s| TrainSample {
                prompt: prompts[a].clone(),
                completion: s.token_ids.clone(),
                advantage: 0.0,
                weight: 1.0,
                old_logprobs: Vec::new(),
            })
            .collect();
        let shaped: Vec<f64> = train
            .iter()
            .zip(&samples[a])
            .enumerate()
            .map(|(k, (t, s))| {
                let counted = t.completion.len()
                    - (s.stopped && stop.contains(t.completion.last().unwrap())) as usize;
                let (lp, lr) =
                    tch::no_grad(|| (naive_logprobs(&base, t), naive_logprobs(&reference, t)));
                let d = (lr - lp).narrow(0, 0, counted as i64);
                let kl = (d.exp() - &d - 1.0).sum(Kind::Double).double_value(&[]);
                all_kls.push(kl);
                1.0 + k as f64 - coef * kl
            })
            .collect();
        let mean = shaped.iter().sum::<f64>() / shaped.len() as f64;
        for (t, r) in train.iter_mut().zip(&shaped) {
            t.advantage = r - mean;
        }
        // The shaping matters: without it the advantages would be [−1, 0, 1].
        let moved = train
            .iter()
            .enumerate()
            .map(|(k, t)| (t.advantage - (k as f64 - 1.0)).abs())
            .fold(0.0, f64::max);
        assert!(
            moved > 0.05,
            "agent {a}: the KL changes the advantages ({train:?})"
        );

        let hand = load(&spec, &opts).unwrap();
        reference_update(&hand, 1, |m| {
            let k = train.len() as f64;
            train
                .iter()
                .map(|s| naive_logprobs(m, s).sum(Kind::Float) * (-s.advantage / k))
                .fold(Tensor::from(0.0f32), |x, y| x + y)
        });
        assert_same_weights(
            &trainer.policies()[a].model,
            &hand,
            &base,
            &format!("return-shaped KL, agent {a}"),
        );
    }
    // The step logs the mean KL per completion and the mean taken off the returns.
    let kl = all_kls.iter().sum::<f64>() / all_kls.len() as f64;
    assert!(
        metrics["kl"].is_finite() && (metrics["kl"] - kl).abs() < 1e-4 * (1.0 + kl),
        "kl {} vs {kl}",
        metrics["kl"]
    );
    assert!((metrics["kl/return_penalty"] - coef * metrics["kl"]).abs() < 1e-12);
}

/// A group whose samples all got the same reward has all advantages 0: its loss, and so its
/// gradient, is zero. The original still back-propagates it and steps AdamW, which moves the
/// weights by their momentum; cotrain skips the backward and must land on the same weights.
#[test]
fn a_minibatch_without_gradient_is_not_back_propagated_and_the_weights_move_as_the_originals() {
    let tmp = tempfile::tempdir().unwrap();
    let (spec, model) = tiny(tmp.path());
    let hand = load(&spec, &LoadOptions::default()).unwrap();
    let base = load(&spec, &LoadOptions::default()).unwrap();
    let mut policy = Policy::new("agent0", &spec, model, None, adam());
    let learning = vec![
        sample(&[65, 97, 48], &[120, 121, 10], 1.0),
        sample(&[65, 97, 48], &[33, 34], -1.0),
    ];
    let flat = vec![
        sample(&[66, 98], &[40, 41, 42], 0.0),
        sample(&[66, 98], &[7, 8], 0.0),
    ];
    let rounds: [Vec<Vec<TrainSample>>; 3] = [
        vec![learning.clone()],
        vec![flat.clone()],
        vec![flat.clone(), learning.clone()],
    ];

    let mut after_first = None;
    for (r, minibatches) in rounds.iter().enumerate() {
        let stats = policy
            .update(
                &[AgentBatches {
                    minibatches: minibatches.clone(),
                    scale: 1.0,
                }],
                &LossOptions::original(),
                1,
            )
            .unwrap();
        let flat_count = minibatches
            .iter()
            .filter(|mb| mb.iter().all(|s| s.advantage == 0.0))
            .count() as u64;
        assert_eq!(stats.minibatches_without_gradient, flat_count, "round {r}");
        assert_eq!(
            stats.steps, 1,
            "round {r}: the optimiser steps even without a gradient, as the original's"
        );
        assert!(
            stats.entropy > 0.0 && stats.tokens > 0.0,
            "round {r}: the statistics still cover every mini-batch: {stats:?}"
        );
        if r == 0 {
            after_first = Some(
                policy
                    .model
                    .named_parameters()
                    .into_iter()
                    .map(|(n, t)| (n, t.detach().copy()))
                    .collect::<std::collections::BTreeMap<_, _>>(),
            );
        }
        if r == 1 {
            // Momentum alone moves the weights in the round without a gradient.
            let before = after_first.as_ref().unwrap();
            let moved = policy
                .model
                .named_parameters()
                .iter()
                .map(|(n, t)| (t - &before[n]).abs().max().double_value(&[]))
                .fold(0.0, f64::max);
            assert!(
                moved > 1e-4,
                "a round without gradient must still step AdamW (max change {moved})"
            );
        }
    }

    // By hand: three rounds of (1/K) Σ_k −A_k · Σ_t log π_t over all the round's samples, each a full
    // backward (zero gradients where every advantage is 0) and a libtorch AdamW step.
    let mut opt = tch::nn::AdamW {
        beta1: 0.9,
        beta2: 0.999,
        wd: 0.0,
        eps: EPS,
        amsgrad: false,
    }
    .build(&hand.vs, LR)
    .unwrap();
    for minibatches in &rounds {
        let all: Vec<&TrainSample> = minibatches.iter().flatten().collect();
        let k = all.len() as f64;
        opt.zero_grad();
        all.iter()
            .map(|s| naive_logprobs(&hand, s).sum(Kind::Float) * (-s.advantage / k))
            .fold(Tensor::from(0.0f32), |a, b| a + b)
            .backward();
        opt.step();
    }
    assert_same_weights(
        &policy.model,
        &hand,
        &base,
        "rounds with and without gradient",
    );

    // With the KL penalty on, zero advantages still leave a gradient: nothing is skipped.
    let tmp2 = tempfile::tempdir().unwrap();
    let (spec2, model2) = tiny(tmp2.path());
    let frozen = load(&spec2, &LoadOptions::default()).unwrap();
    let mut with_kl = Policy::new("agent0", &spec2, model2, Some(frozen), adam());
    let opts = LossOptions {
        kl: Some((0.1, KlEstimator::K3)),
        ..LossOptions::original()
    };
    let stats = with_kl
        .update(
            &[AgentBatches {
                minibatches: vec![flat],
                scale: 1.0,
            }],
            &opts,
            1,
        )
        .unwrap();
    assert_eq!(stats.minibatches_without_gradient, 0);
}

#[test]
fn a_non_finite_loss_skips_the_update_and_leaves_the_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let (spec, model) = tiny(tmp.path());
    let untouched = load(&spec, &LoadOptions::default()).unwrap();
    let mut policy = Policy::new("agent0", &spec, model, None, adam());
    let batch = AgentBatches {
        minibatches: vec![vec![sample(&[65, 97], &[120, 121], f64::NAN)]],
        scale: 1.0,
    };
    let stats = policy
        .update(&[batch], &LossOptions::original(), 1)
        .unwrap();
    assert_eq!(stats.steps, 0);
    assert!(
        stats
            .skipped
            .as_deref()
            .is_some_and(|r| r.contains("non-finite")),
        "{stats:?}"
    );
    assert_eq!(policy.optimizer.step, 0);
    assert_same_weights(&policy.model, &untouched, &untouched, "skipped update");
}

#[test]
fn data_order_and_evaluation_rhythm_follow_the_original() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model_dir(tmp.path());
    let yaml = "model: {name: unused, temperature: 1.0, top_p: 1.0, top_k: 0, max_length: 64}\n\
                dataset: {name: gsm8k, train_split: 'train[:10]'}\n\
                seed: 3\n\
                magrpo:\n  num_agents: 2\n  num_generations: 2\n  max_new_tokens: 2\n  learning_rate: 0.001\n  \
                num_train_epochs: 1\n  rollout_buffer_size: 1\n  eval_interval: 4\n  eval_num_samples: 2\n  save_steps: 100000\n\
                logging: {tensorboard: false, plots: false, progress: never}\n";
    let reward = || {
        Box::new(train_common::TokenRule {
            rule: |t: &[u32]| t[0].is_multiple_of(2),
        })
    };
    // The dataset's order, as the original's DataLoader(shuffle=False); a seeded permutation only
    // when asked.
    let cfg = config(yaml, &[]);
    let mut trainer = train_common::tiny_trainer(&cfg, &model, &tmp.path().join("a"), reward(), 10);
    assert_eq!(trainer.epoch_order(0), (0..10).collect::<Vec<_>>());
    let shuffled = train_common::tiny_trainer(
        &config(yaml, &["dataset.shuffle=true".into()]),
        &model,
        &tmp.path().join("b"),
        reward(),
        10,
    );
    let order = shuffled.epoch_order(0);
    assert_ne!(order, (0..10).collect::<Vec<_>>());
    assert_eq!(order, shuffled.epoch_order(0), "seeded");
    // Evaluation before items 0, 4 and 8 of the epoch (steps 1, 5, 9 with one item per step), one
    // joint sample on each of the first eval_num_samples eval items.
    let summary = trainer.run().unwrap();
    let evaluated: Vec<usize> = summary
        .history
        .iter()
        .enumerate()
        .filter(|(_, m)| m.contains_key("eval/reward/mean"))
        .map(|(i, _)| i + 1)
        .collect();
    assert_eq!(evaluated, vec![1, 5, 9]);
    assert_eq!(summary.history[0]["eval/items"], 2.0);
}
