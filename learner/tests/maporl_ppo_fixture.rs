//! MaPoRL's PPO arithmetic and critic head against the ORIGINAL trainer's numbers
//! (`tests/fixtures/maporl/*.json`, written by `scripts/reference/maporl_fixtures.py` from
//! chanwoo-park-official/MAPoRL @ c204c2c): the fixture's raw responses, log-probs and values go
//! through the functions the trainer calls (`cut_at_eos`, `training_response`,
//! `shaped_training_scores`, `ppo_targets`) and what comes out is compared with the original's
//! per-token rewards, GAE advantages, returns and per-(turn, agent) whitened advantages; and a PPO
//! step through `ppo_update` leaves a `frozen_random` value head as it was while the critic's
//! adapter trains.

use std::path::{Path, PathBuf};

use cotrain_learner::algo::discussion_score::{
    IncentiveRule, Incentives, ScoreRule, shaped_training_scores,
};
use cotrain_learner::config::{
    AdapterLayout, CriticHead, LegacyFlags, MaporlSection, ScorePosition, load_config,
};
use cotrain_learner::maporl::agents::{Adapters, Bases, VALUE_HEAD_FILE, frozen_head_weights};
use cotrain_learner::maporl::rollout::cut_at_eos;
use cotrain_learner::maporl::update::{
    PpoRecord, PpoSample, ppo_targets, ppo_update, training_response,
};
use rand::SeedableRng;
use serde_json::Value;
use tch::Tensor;

/// Named tensors (an adapter's or a critic's), in order.
type Named = Vec<(String, Tensor)>;

fn fixture(name: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/maporl")
        .join(name);
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn f64s(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn usize_of(v: &Value) -> usize {
    v.as_u64().unwrap() as usize
}

/// `got` against the original's length-L row `want`: equal on `got`'s positions, and the original
/// holds 0 on the masked positions beyond them.
fn assert_row(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert!(got.len() <= want.len(), "{what}: {got:?} vs {want:?}");
    for (j, w) in want.iter().enumerate() {
        let g = got.get(j).copied().unwrap_or(0.0);
        assert!(
            (g - w).abs() < tol,
            "{what} at {j}: {g} vs the original's {w} (row {got:?} vs {want:?})"
        );
    }
}

/// The `maporl` section with MaPoRL's defaults and the fixture's constants.
fn section(constants: &Value) -> MaporlSection {
    let mut m: MaporlSection = serde_json::from_str("{}").unwrap();
    m.kl_coef = constants["kl_coef"].as_f64().unwrap();
    m.gamma = constants["gamma"].as_f64().unwrap();
    m.lam = constants["lam"].as_f64().unwrap();
    m.rule_discount = constants["rule_discount"].as_f64().unwrap();
    assert!(!constants["whiten_rewards"].as_bool().unwrap() && !m.whiten_rewards);
    m
}

/// Every (turn, agent, question) of the fixture through cotrain's PPO targets, for both incentive
/// settings: token positions and masks, training scores R(t, i) + bonus, per-token rewards, GAE
/// advantages and returns before whitening, and the advantages whitened per (turn, agent) over
/// the questions, all as the original computed them. The original's inputs are f64 and cotrain
/// holds log-probs and values in f32, hence the 1e-6.
#[test]
#[allow(clippy::needless_range_loop)] // (turn, agent, question) index several parallel tables
fn ppo_targets_match_the_original_rewards_gae_returns_and_whitening() {
    let f = fixture("rewards_gae.json");
    let c = &f["constants"];
    let m = section(c);
    let (turns, agents, questions, l) = (
        usize_of(&c["turns"]),
        usize_of(&c["agents"]),
        usize_of(&c["questions"]),
        usize_of(&c["response_length"]),
    );
    let stops = u32s(&c["stop_token_ids"]);
    let pad = Some(c["pad_token_id"].as_u64().unwrap() as u32);
    let inputs = f["inputs"].as_array().unwrap();
    let input = |t: usize, i: usize| {
        inputs
            .iter()
            .find(|x| usize_of(&x["turn"]) == t && usize_of(&x["agent"]) == i)
            .unwrap()
    };

    for case in f["cases"].as_array().unwrap() {
        let alpha: Vec<f64> = f64s(&case["alpha"]);
        let expected = |t: usize, i: usize| {
            case["per_turn_agent"]
                .as_array()
                .unwrap()
                .iter()
                .find(|x| usize_of(&x["turn"]) == t && usize_of(&x["agent"]) == i)
                .unwrap()
        };

        // R(t, i) + bonus per question, through the score rule and incentives the trainer uses
        // (the released code's rule: the fixture is the original).
        let rule = ScoreRule {
            horizon: m.rule_horizon,
            agent_share: m.rule_agent_share,
            gamma: m.rule_discount,
            lookahead: None,
        };
        let inc = Incentives {
            alpha: [alpha[0], alpha[1], alpha[2], alpha[3]],
            rule: IncentiveRule::ReleasedCode,
        };
        let shaped: Vec<Vec<Vec<f64>>> = (0..questions)
            .map(|b| {
                let s: Vec<Vec<f64>> = (0..turns)
                    .map(|t| {
                        (0..agents)
                            .map(|i| f64s(&input(t, i)["score"])[b])
                            .collect()
                    })
                    .collect();
                let correct: Vec<Vec<bool>> = (0..turns)
                    .map(|t| {
                        (0..agents)
                            .map(|i| input(t, i)["correct"][b].as_u64().unwrap() == 1)
                            .collect()
                    })
                    .collect();
                shaped_training_scores(&s, &correct, &rule, &inc).unwrap()
            })
            .collect();

        let (mut samples, mut records, mut place) = (Vec::new(), Vec::new(), Vec::new());
        for t in 0..turns {
            for i in 0..agents {
                let (x, e) = (input(t, i), expected(t, i));
                for b in 0..questions {
                    let training_score = f64s(&e["training_score"])[b];
                    // Every turn, turn 0 included (no bonus there, as the original's bonus_rule).
                    assert!(
                        (shaped[b][t][i] - training_score).abs() < 1e-6,
                        "alpha {alpha:?} (t {t}, i {i}, q {b}): R {} vs {training_score}",
                        shaped[b][t][i]
                    );
                    let sampled = u32s(&x["responses"][b]);
                    assert_eq!(sampled.len(), l);
                    let (kept, _) = cut_at_eos(&sampled, &stops);
                    let (response, score_slot_after) =
                        training_response(&kept, l, &stops, pad, ScorePosition::Trl);
                    let sample = PpoSample {
                        policy: format!("agent{i}.later"),
                        critic: format!("critic.agent{i}"),
                        turn: t,
                        agent: i,
                        question: b,
                        prompt: vec![1],
                        value_prompt: vec![1],
                        response,
                        score_slot_after,
                        score: training_score,
                        behaviour_logprobs: None,
                    };
                    // The original's positions: the policy's tokens 0..=sequence_length (~padding_mask),
                    // the value positions 0..=actual_end (~padding_mask_p1), the score on actual_end.
                    let (p, v) = (sample.response.len(), sample.value_len());
                    assert_eq!(
                        p as i64 - 1,
                        x["sequence_lengths"][b].as_i64().unwrap(),
                        "t {t}, i {i}, q {b}"
                    );
                    assert_eq!(v - 1, usize_of(&e["actual_end"][b]), "t {t}, i {i}, q {b}");
                    for j in 0..l {
                        assert_eq!(
                            x["padding_mask"][b][j].as_bool().unwrap(),
                            j >= p,
                            "t {t}, i {i}, q {b}, position {j}"
                        );
                        assert_eq!(
                            x["padding_mask_p1"][b][j].as_bool().unwrap(),
                            j >= v,
                            "t {t}, i {i}, q {b}, position {j}"
                        );
                    }
                    let f32s = |key: &str, n: usize| {
                        f64s(&x[key][b])[..n]
                            .iter()
                            .map(|&y| y as f32)
                            .collect::<Vec<f32>>()
                    };
                    records.push(PpoRecord {
                        logprobs: f32s("logprobs_raw", p),
                        ref_logprobs: f32s("ref_logprobs_raw", p),
                        values: f32s("values_raw", v),
                        ..Default::default()
                    });
                    samples.push(sample);
                    place.push((t, i, b));
                }
            }
        }

        let (whitened, stats) = ppo_targets(&m, &samples, &mut records);
        assert!(stats["objective/kl"].is_finite());
        for (k, &(t, i, b)) in place.iter().enumerate() {
            let e = expected(t, i);
            let what = |key: &str| format!("alpha {alpha:?}, t {t}, i {i}, q {b}: {key}");
            assert_row(
                &what("rewards"),
                &records[k].rewards,
                &f64s(&e["rewards"][b]),
                1e-6,
            );
            assert_row(
                &what("advantages"),
                &records[k].advantages,
                &f64s(&e["advantages_unwhitened"][b]),
                1e-6,
            );
            assert_row(
                &what("returns"),
                &records[k].returns,
                &f64s(&e["returns"][b]),
                1e-6,
            );
            assert_row(
                &what("whitened advantages"),
                &whitened[k],
                &f64s(&e["advantages_whitened"][b]),
                1e-6,
            );
        }
    }
}

/// `score_position: last_token` keeps cotrain's earlier placement: every kept token trained, the
/// stop token included even as the pad token, and no slot after it.
#[test]
fn last_token_placement_trains_every_kept_token_and_scores_the_last() {
    let stops = [0, 3];
    for kept in [vec![5u32, 6, 3], vec![5, 6, 0], vec![5, 6, 7, 8]] {
        assert_eq!(
            training_response(&kept, 6, &stops, Some(0), ScorePosition::LastToken),
            (kept.clone(), false)
        );
    }
    // The original's: a non-pad stop token is trained and scored after; an eos-as-pad one is not
    // trained and holds the score; a stop on the last sampled token holds it.
    assert_eq!(
        training_response(&[5, 6, 3], 6, &stops, Some(0), ScorePosition::Trl),
        (vec![5, 6, 3], true)
    );
    assert_eq!(
        training_response(&[5, 6, 0], 6, &stops, Some(0), ScorePosition::Trl),
        (vec![5, 6], true)
    );
    assert_eq!(
        training_response(&[5, 6, 7, 3], 4, &stops, Some(0), ScorePosition::Trl),
        (vec![5, 6, 7, 3], false)
    );
    assert_eq!(
        training_response(&[5, 6, 7, 8], 4, &stops, Some(0), ScorePosition::Trl),
        (vec![5, 6, 7, 8], false)
    );
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The seed GSM8K config on the committed tiny model, one PPO epoch of one mini-batch.
fn tiny_run(critic_head: &str) -> (cotrain_learner::config::CheckedConfig, Bases, Adapters) {
    tiny_run_with(critic_head, &[])
}

fn tiny_run_with(
    critic_head: &str,
    extra: &[&str],
) -> (cotrain_learner::config::CheckedConfig, Bases, Adapters) {
    let overrides: Vec<String> = [
        "model.name=default",
        "model.chat_template=false",
        "maporl.num_ppo_epochs=1",
        "maporl.num_mini_batches=1",
        "maporl.learning_rate=1.0e-3",
        "maporl.max_output_length=8",
        "maporl.min_output_length=1",
        "maporl.max_input_length=32",
        "model.max_length=64",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([format!("maporl.critic_head={critic_head}")])
    .chain(extra.iter().map(|s| s.to_string()))
    .collect();
    let cfg = load_config(
        &repo().join("configs/maporl_gsm8k_config.yaml"),
        &overrides,
        &LegacyFlags::default(),
    )
    .unwrap();
    let m = cfg.raw.maporl.clone().unwrap();
    let bases = Bases::load(
        &cfg,
        &cotrain_learner::model_options::load_options(&cfg).unwrap(),
    )
    .unwrap();
    let adapters = Adapters::new(&cfg, &m, &bases).unwrap();
    (cfg, bases, adapters)
}

/// Samples of the seed config's layout, as the trainer keys them: the shared later-turn adapter
/// (`shared.later`) and the critic of each sample's turn (`critic.turn1`, `critic.turn2`), from
/// both agents; two with the score slot after the response and one without.
fn samples() -> Vec<PpoSample> {
    [
        (vec![5u32, 6, 7], true, 1.0),
        (vec![8, 9, 10, 11], true, 0.0),
        (vec![12, 13], false, 1.0),
    ]
    .into_iter()
    .enumerate()
    .map(|(k, (response, score_slot_after, score))| PpoSample {
        policy: AdapterLayout::SharedByTurn.adapter_key(k % 2, 1 + k % 2),
        critic: format!("critic.turn{}", 1 + k % 2),
        turn: 1 + k % 2,
        agent: k % 2,
        question: k / 2,
        prompt: vec![1, 20, 21, 22 + k as u32],
        value_prompt: vec![1, 20, 21],
        response,
        score_slot_after,
        score,
        behaviour_logprobs: None,
    })
    .collect()
}

fn snapshot(vs: &tch::nn::VarStore) -> Vec<(String, Tensor)> {
    let mut v: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .map(|(k, t)| (k, t.detach().copy()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn changed(before: &[(String, Tensor)], vs: &tch::nn::VarStore) -> bool {
    let now = snapshot(vs);
    before
        .iter()
        .zip(&now)
        .any(|((_, a), (_, b))| a.f_sub(b).unwrap().abs().max().double_value(&[]) > 0.0)
}

/// `critic_head: frozen_random` (the default, MaPoRL's): the head is U(±1/√hidden), out of every
/// optimiser, unchanged by a PPO step through the real update while the critic's LoRA adapter
/// moves, and saved so that it reads back bit for bit. `trained` starts at zero and moves.
#[test]
fn frozen_random_value_head_is_not_trained_while_the_critic_adapter_is() {
    let (cfg, bases, mut adapters) = tiny_run("frozen_random");
    let m = cfg.raw.maporl.clone().unwrap();
    assert_eq!(m.critic_head, CriticHead::FrozenRandom, "the default");
    // The seed config's layout (MaPoRL's): two policy adapters shared by both agents, one critic per
    // trained turn shared by both agents (turn 0 is the base and trains nothing).
    assert_eq!(
        adapters.policies.keys().collect::<Vec<_>>(),
        ["shared.later", "shared.turn0"]
    );
    assert_eq!(
        adapters.critics.keys().collect::<Vec<_>>(),
        ["critic.turn1", "critic.turn2"]
    );
    let hidden = bases.models[0].model.config().hidden_size;
    let bound = 1.0 / (hidden as f64).sqrt();
    let c = &adapters.critics["critic.turn1"];
    let head: Vec<f32> = Vec::try_from(c.head.reshape([-1])).unwrap();
    assert_eq!(head.len(), hidden);
    assert!(
        head.iter().all(|w| f64::from(w.abs()) <= bound),
        "U(±1/√{hidden}): {head:?}"
    );
    assert!(head.iter().any(|w| *w != 0.0));
    assert!(
        !c.head.requires_grad() && c.head_opt.parameters().is_empty(),
        "the frozen head is in no optimiser"
    );
    let other: Vec<f32> =
        Vec::try_from(adapters.critics["critic.turn2"].head.reshape([-1])).unwrap();
    assert_ne!(head, other, "each critic draws its own head");
    let (head_before, lora_before) = (c.head.detach().copy(), snapshot(&c.adapter.vs));

    let samples = samples();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let (records, stats) = ppo_update(
        &m,
        &bases,
        &mut adapters,
        &samples,
        &mut rng,
        &cotrain_learner::dist::SingleRank,
        false,
    )
    .unwrap();
    assert!(stats["loss/value_avg"] > 0.0, "{stats:?}");
    for (s, r) in samples.iter().zip(&records) {
        assert_eq!(
            (r.logprobs.len(), r.values.len(), r.returns.len()),
            (s.response.len(), s.value_len(), s.value_len())
        );
    }
    let c = &adapters.critics["critic.turn1"];
    assert!(c.head.equal(&head_before), "a frozen head is not trained");
    assert!(
        changed(&lora_before, &c.adapter.vs),
        "the critic's adapter is trained"
    );

    let dir = tempfile::tempdir().unwrap();
    c.save(dir.path(), "default").unwrap();
    let read = Tensor::read_safetensors(dir.path().join(VALUE_HEAD_FILE)).unwrap();
    assert_eq!(read.len(), 1);
    assert_eq!(read[0].0, "v_head.weight");
    assert!(
        read[0].1.equal(&c.head.detach()),
        "value_head.safetensors round-trips the head"
    );

    // `trained`: cotrain's earlier head, zero at the start, in the head's optimiser, moved by the step.
    let (cfg, bases, mut adapters) = tiny_run("trained");
    let m = cfg.raw.maporl.clone().unwrap();
    let c = &adapters.critics["critic.turn1"];
    assert_eq!(c.head.abs().max().double_value(&[]), 0.0);
    assert_eq!(c.head_opt.parameters().len(), 1);
    ppo_update(
        &m,
        &bases,
        &mut adapters,
        &samples,
        &mut rng,
        &cotrain_learner::dist::SingleRank,
        false,
    )
    .unwrap();
    // (Its adapter gets no gradient through a zero head in this first step.)
    let c = &adapters.critics["critic.turn1"];
    assert!(
        c.head.abs().max().double_value(&[]) > 0.0,
        "a trained head moves"
    );
}

/// The frozen head's draw is PyTorch's default `nn.Linear` init: U(−1/√H, 1/√H) (the fixture's
/// bound for H = 8), spread over the whole range, the same for the same seed.
#[test]
fn frozen_head_init_is_uniform_within_one_over_root_hidden() {
    let f = fixture("value_head.json");
    let h = usize_of(&f["hidden_size"]);
    let bound = f["bound"].as_f64().unwrap();
    assert!((bound - 1.0 / (h as f64).sqrt()).abs() < 1e-12);
    // The original's own draw lies in the same range.
    assert!(f64s(&f["weight"][0]).iter().all(|w| w.abs() <= bound));
    let draws: Vec<f32> = (0..500)
        .flat_map(|seed| frozen_head_weights(h, seed))
        .collect();
    let (lo, hi) = draws.iter().fold((f64::MAX, f64::MIN), |(lo, hi), &w| {
        (lo.min(f64::from(w)), hi.max(f64::from(w)))
    });
    assert!(
        lo >= -bound && hi <= bound && lo < -0.99 * bound && hi > 0.99 * bound,
        "{lo}..{hi} vs ±{bound}"
    );
    let mean = draws.iter().map(|&w| f64::from(w)).sum::<f64>() / draws.len() as f64;
    let var = draws
        .iter()
        .map(|&w| (f64::from(w) - mean).powi(2))
        .sum::<f64>()
        / draws.len() as f64;
    assert!(
        mean.abs() < 0.02 && (var - bound * bound / 3.0).abs() < 0.05 * bound * bound / 3.0,
        "mean {mean}, var {var}"
    );
    assert_eq!(frozen_head_weights(h, 3), frozen_head_weights(h, 3));
    assert_ne!(frozen_head_weights(h, 3), frozen_head_weights(h, 4));
}

/// Every adapter's and critic's variables, by adapter key then variable name.
fn all_variables(a: &Adapters) -> Vec<(String, Tensor)> {
    let mut out = Vec::new();
    for (key, p) in &a.policies {
        out.extend(
            p.optimizer
                .parameters()
                .iter()
                .enumerate()
                .map(|(i, t)| (format!("{key}/{i}"), t.detach().copy())),
        );
    }
    for (key, c) in &a.critics {
        out.extend(
            c.adapter_opt
                .parameters()
                .iter()
                .enumerate()
                .map(|(i, t)| (format!("{key}/{i}"), t.detach().copy())),
        );
        out.push((format!("{key}/head"), c.head.detach().copy()));
    }
    out
}

/// Copies `values` (from [`all_variables`] of adapters of the same layout) into `a`'s variables.
fn set_variables(a: &Adapters, values: &[(String, Tensor)]) {
    let mut targets: Vec<Tensor> = Vec::new();
    for p in a.policies.values() {
        targets.extend(p.optimizer.parameters());
    }
    for c in a.critics.values() {
        targets.extend(c.adapter_opt.parameters());
        targets.push(c.head.shallow_clone());
    }
    assert_eq!(targets.len(), values.len());
    tch::no_grad(|| {
        for (mut t, (_, v)) in targets.into_iter().zip(values) {
            t.copy_(v);
        }
    });
}

/// `gradient_accumulation_steps` forwards each mini-batch in that many micro-batches (TRL's
/// arithmetic; the memory of one micro-batch rather than the mini-batch's), their losses weighted by
/// token share: the update is the one of the whole mini-batch at once.
#[test]
fn micro_batches_accumulate_to_the_update_of_the_whole_mini_batch() {
    // (LoRA dropout off: its masks are drawn per forward, so they differ between the two batchings.)
    let samples = samples();
    let mut runs: Vec<(Named, Named, Vec<_>)> = Vec::new();
    // One micro-batch; three (as many as questions: each question alone); micro-batches of at
    // most one position (`micro_batch_positions`: each question alone again).
    for (steps, positions) in [(1, "null"), (3, "null"), (1, "1")] {
        let (cfg, bases, mut adapters) = tiny_run_with(
            "frozen_random",
            &[
                &format!("maporl.gradient_accumulation_steps={steps}"),
                &format!("maporl.micro_batch_positions={positions}"),
                "maporl.learning_rate=0.5",
                "maporl.lora.lora_dropout=0",
            ],
        );
        let m = cfg.raw.maporl.clone().unwrap();
        assert_eq!(m.gradient_accumulation_steps, steps);
        // Both runs start from the first run's adapters (each run draws its own LoRA A).
        if let Some((first, _, _)) = runs.first() {
            let first: &[(String, Tensor)] = first;
            set_variables(&adapters, first);
        }
        // Adam's eps set large: the steps are then nearly linear in the gradients (p −= lr·g/(|g| + 1)),
        // so the weights compare the gradients themselves, not their signs.
        for p in adapters.policies.values_mut() {
            p.optimizer.cfg.eps = 1.0;
        }
        for c in adapters.critics.values_mut() {
            c.adapter_opt.cfg.eps = 1.0;
            c.head_opt.cfg.eps = 1.0;
        }
        let before = all_variables(&adapters);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        // One update (a second would start from policies that already differ by float noise and
        // whose KL then shapes the critics' returns).
        let stats = vec![
            ppo_update(
                &m,
                &bases,
                &mut adapters,
                &samples,
                &mut rng,
                &cotrain_learner::dist::SingleRank,
                false,
            )
            .unwrap()
            .1,
        ];
        runs.push((before, all_variables(&adapters), stats));
    }
    let (before, whole, s1) = &runs[0];
    for (before3, micro, s3) in &runs[1..] {
        for ((n, a), (_, b)) in before.iter().zip(before3) {
            assert!(a.equal(b), "{n}: both runs start from the same adapters");
        }
        let mut moved = 0;
        for (((name, w), (_, x)), (_, b)) in whole.iter().zip(micro).zip(before) {
            let diff = (w - x).abs().max().double_value(&[]);
            let step = (w - b).abs().max().double_value(&[]);
            moved += (step > 0.0) as usize;
            // The critics' losses are plain means: equal to float precision (plus a few float steps of
            // the weights themselves). The policy loss with whitened advantages is a sum of cancelling
            // terms, where the forwards' batching (padding, kernel paths: log-probs equal to ~1e-5) shows
            // more (up to 1% here); a micro-batch weighted wrongly moves it by tens of percent.
            let tol = if name.starts_with("critic") {
                1e-3
            } else {
                5e-2
            };
            assert!(
                diff <= tol * step + 1e-8,
                "{name}: the micro-batched update differs by {diff} (update size {step})"
            );
        }
        assert!(
            moved >= 4,
            "the updates moved the adapters ({moved} tensors)"
        );
        for (a, b) in s1.iter().zip(s3) {
            for key in [
                "loss/policy_avg",
                "loss/value_avg",
                "policy/clipfrac_avg",
                "policy/entropy_avg",
            ] {
                assert!(
                    (a[key] - b[key]).abs() <= 1e-5 * a[key].abs().max(1.0),
                    "{key}: {} vs {}",
                    a[key],
                    b[key]
                );
            }
        }
    }
}

/// `model.matmul_dtype: bf16` (taken by the maporl trainer too): every forward of the update runs
/// its products in bf16 (the behaviour, reference and trained log-probs and the critics' values
/// move off the f32 ones, by rounding only), the old log-probs are taken in the precision the
/// epochs train in (the first mini-batch's ratio is 1), and the f32 adapters and critics step.
#[test]
fn bf16_products_run_every_update_forward_and_keep_the_first_ratio_at_one() {
    let samples = samples();
    let mut runs: Vec<(Named, Vec<PpoRecord>, Option<tch::Kind>)> = Vec::new();
    for extra in [&[][..], &["model.matmul_dtype=bf16"][..]] {
        let (cfg, bases, mut adapters) = tiny_run_with(
            "frozen_random",
            &[&["maporl.lora.lora_dropout=0"][..], extra].concat(),
        );
        let m = cfg.raw.maporl.clone().unwrap();
        let kind = bases.models[0].model.matmul_kind();
        assert_eq!(
            kind,
            cotrain_learner::model_options::matmul_kind(&cfg),
            "the bases take model.matmul_dtype"
        );
        if let Some((first, _, _)) = runs.first() {
            set_variables(&adapters, first);
        }
        let before = all_variables(&adapters);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let (records, stats) = ppo_update(
            &m,
            &bases,
            &mut adapters,
            &samples,
            &mut rng,
            &cotrain_learner::dist::SingleRank,
            false,
        )
        .unwrap();
        assert!(
            (stats["val/ratio"] - 1.0).abs() < 1e-4,
            "{kind:?}: the first mini-batch's ratio is {}",
            stats["val/ratio"]
        );
        assert!(
            stats["loss/policy_avg"].is_finite() && stats["loss/value_avg"] > 0.0,
            "{kind:?}: {stats:?}"
        );
        let after = all_variables(&adapters);
        let moved = before
            .iter()
            .zip(&after)
            .filter(|((_, a), (_, b))| !a.equal(b))
            .count();
        assert!(moved >= 4, "{kind:?}: the update moved {moved} tensors");
        assert!(
            after.iter().all(|(_, t)| t.kind() == tch::Kind::Float),
            "{kind:?}: the adapters stay f32"
        );
        runs.push((before, records, kind));
    }
    let ((_, f32_records, f32_kind), (_, bf16_records, bf16_kind)) = (&runs[0], &runs[1]);
    assert_eq!((*f32_kind, *bf16_kind), (None, Some(tch::Kind::BFloat16)));
    let gap = |get: fn(&PpoRecord) -> &Vec<f32>| {
        f32_records
            .iter()
            .zip(bf16_records)
            .flat_map(|(a, b)| {
                get(a)
                    .iter()
                    .zip(get(b))
                    .map(|(x, y)| f64::from((x - y).abs()))
            })
            .fold(0.0, f64::max)
    };
    for (what, g) in [
        ("behaviour log-probs", gap(|r| &r.logprobs)),
        ("reference log-probs", gap(|r| &r.ref_logprobs)),
        ("values", gap(|r| &r.values)),
    ] {
        assert!(
            g > 1e-6 && g < 0.5,
            "{what}: bf16 products moved them by {g} (rounding: more than nothing, less than 0.5)"
        );
    }
}
