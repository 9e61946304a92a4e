//! CoMLRL's actor-critic trainers (IAC, MAAC) in cotrain:
//! - the math against values recorded by running comlrl 1.4.3's own methods
//!   (`fixtures/actor_critic/upstream.json`, `scripts/reference/actor_critic_fixtures.py`);
//! - the upstream experiment configs load unmodified with upstream's meaning;
//! - a two-turn run whose `rollouts.jsonl` values, TD targets and advantages are recomputed here;
//! - learning: on a cooperative toy task both trainers raise the reward and lower the critic's loss,
//!   and the sign-flipped reward does not learn;
//! - one drain's actor steps, recomputed by hand from the logged values and targets;
//! - a resumed run (critics and the partial buffer in the checkpoint) equals an uninterrupted one.

mod train_common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use cotrain_learner::algo::actor_critic::{
    critic_input, normalized_advantages, td_targets, undiscounted_returns, value_loss,
};
use cotrain_learner::algo::{LossOptions, PolicyBatch, policy_loss};
use cotrain_learner::config::{Algorithm, CriticType, LegacyFlags, load_config};
use serde_json::Value;
use tch::nn::OptimizerConfig;
use tch::{Kind, Tensor};
use train_common::{TokenRule, config, config_trainer, tiny_model_dir};

fn fixture() -> Value {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/actor_critic/upstream.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn f64s(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

fn close(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: {got:?} vs {want:?}");
    for (g, w) in got.iter().zip(want) {
        assert!(
            (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
            "{what}: {got:?} vs {want:?}"
        );
    }
}

#[test]
fn advantages_targets_critic_input_and_losses_match_upstream() {
    let f = fixture();
    for case in f["advantages"].as_array().unwrap() {
        let (adv, norm) = normalized_advantages(
            &f64s(&case["targets"]),
            &f64s(&case["old_values"]),
            case["normalize"].as_bool().unwrap(),
        );
        close(&adv, &f64s(&case["advantages"]), "advantages");
        close(&norm, &f64s(&case["normalized"]), "normalized advantages");
    }
    for case in f["td_targets"].as_array().unwrap() {
        let shift = case["reward_shift"].as_f64().unwrap();
        let gamma = case["discount"].as_f64().unwrap();
        let rewards: Vec<f64> = case["raw_rewards"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| f64s(r)[0] + shift)
            .collect();
        let values: Vec<Vec<f64>> = case["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(f64s)
            .collect();
        assert_eq!(
            rewards.len(),
            case["turns_played"].as_u64().unwrap() as usize
        );
        for a in 0..case["num_agents"].as_u64().unwrap() as usize {
            let v: Vec<f64> = values.iter().map(|t| t[a]).collect();
            close(
                &td_targets(&rewards, &v, gamma),
                &f64s(&case["value_target"][a]),
                &format!("{} targets, agent {a}", case["trainer"]),
            );
            close(
                &td_targets(&rewards, &v, gamma),
                &f64s(&case["adv_target"][a]),
                "advantage targets",
            );
            close(
                &undiscounted_returns(&rewards),
                &f64s(&case["returns"][a]),
                "returns",
            );
        }
    }
    for case in f["critic_input"].as_array().unwrap() {
        let prompts: Vec<&str> = case["prompts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_str().unwrap())
            .collect();
        let actions: Option<Vec<&str>> = case["completions"]
            .as_array()
            .map(|c| c.iter().map(|p| p.as_str().unwrap()).collect());
        let actions = if case["critic_type"] == "q" {
            actions
        } else {
            None
        };
        assert_eq!(
            critic_input(&prompts, actions.as_deref()),
            case["text"].as_str().unwrap()
        );
    }
    // One mini-batch's losses and gradients, through the actor's loss (MAGRPO's, original options)
    // and the critic's squared error, against upstream's `_ac_step`: separate critics (no clip),
    // MAAC, and a value head on the actor with and without the value clip.
    let mut checked = 0;
    for case in f["ac_step"].as_array().unwrap() {
        let shared_head = case["use_separate_critic"] == false;
        let samples = case["samples"].as_array().unwrap();
        let pick = |k: &str| {
            Tensor::from_slice(
                &samples
                    .iter()
                    .map(|s| s[k].as_f64().unwrap())
                    .collect::<Vec<_>>(),
            )
        };
        let lp = pick("logprob_sum").view([-1, 1]).set_requires_grad(true);
        let mask = Tensor::ones([samples.len() as i64, 1], (Kind::Double, tch::Device::Cpu));
        let adv = pick("normalized_advantage");
        let batch = PolicyBatch {
            logprobs: &lp,
            mask: &mask,
            advantages: &adv,
            old_logprobs: None,
            proximal_logprobs: None,
            ref_logprobs: None,
            weights: None,
        };
        let terms = policy_loss(&batch, &LossOptions::original()).unwrap();
        close(
            &[terms.loss.double_value(&[])],
            &[case["policy_loss"].as_f64().unwrap()],
            "policy loss",
        );
        terms.loss.backward();
        close(
            &Vec::<f64>::try_from(lp.grad().view([-1])).unwrap(),
            &f64s(&case["grad_logprob_sum"]),
            "d loss / d log-prob sum",
        );
        let v = pick("value").set_requires_grad(true);
        let old = pick("old_value");
        let clip = case["value_clip_range"]
            .as_f64()
            .filter(|_| shared_head)
            .map(|eps| (&old, eps));
        let l = value_loss(&v, &pick("value_target"), clip);
        close(
            &[l.double_value(&[])],
            &[case["value_loss"].as_f64().unwrap()],
            "value loss",
        );
        (l * case["value_loss_coef"].as_f64().unwrap()).backward();
        close(
            &Vec::<f64>::try_from(v.grad()).unwrap(),
            &f64s(&case["grad_value"]),
            "d loss / d value",
        );
        checked += 1;
    }
    assert!(
        checked >= 4,
        "the fixture's separate-critic, MAAC and value-head steps"
    );
}

fn upstream(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/actor_critic/upstream")
        .join(name)
}

#[test]
fn the_upstream_configs_load_unmodified_with_upstreams_meaning() {
    let load = |name: &str| load_config(&upstream(name), &[], &LegacyFlags::default()).unwrap();
    let he = load("iac_he_config.yaml");
    assert_eq!(he.algorithm, Algorithm::Iac);
    let ac = he.actor_critic.as_ref().unwrap();
    assert!(
        !ac.centralised
            && ac.critic_type == CriticType::V
            && ac.value_loss_coef == 0.6
            && ac.critic_learning_rate == 5e-6
    );
    assert_eq!(
        ac.critic_models,
        vec!["Qwen/Qwen2.5-Coder-3B".to_string(); 2]
    );
    let t = &he.trainer;
    assert_eq!(
        (
            t.num_turns,
            t.num_generations,
            t.rollout_buffer_size,
            t.train_batch_size
        ),
        (2, 1, 4, Some(4))
    );
    assert_eq!(
        (
            t.discount,
            t.termination_threshold,
            t.advantage_normalization,
            t.weight_decay
        ),
        (1.0, Some(-0.2), true, 0.01)
    );
    assert_eq!(he.raw.reward_processor.shift, -4.0);
    assert_eq!((he.sampling.temperature, he.sampling.top_p), (0.6, 0.6));
    let maac = load("maac_he_config.yaml");
    assert_eq!(maac.algorithm, Algorithm::Maac);
    assert!(maac.actor_critic.as_ref().unwrap().centralised);
    assert_eq!(maac.actor_critic.as_ref().unwrap().critic_models.len(), 1);
    assert_eq!(maac.trainer.discount, 0.9);
    for name in ["iac_tldr_config.yaml", "maac_tldr_config.yaml"] {
        let c = load(name);
        assert_eq!(
            (c.trainer.num_turns, c.trainer.num_generations, c.num_agents),
            (1, 1, 2),
            "{name}"
        );
        assert_eq!(
            (c.sampling.temperature, c.sampling.top_p),
            (0.7, 0.9),
            "{name}"
        );
    }
    // A value head on the actor takes no critic model (upstream refuses both at once) and keeps
    // upstream's value clip.
    let e = load_config(
        &upstream("iac_he_config.yaml"),
        &["iac.use_separate_critic=false".into()],
        &LegacyFlags::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("critic_model") && e.contains("use_separate_critic"),
        "{e}"
    );
    let shared = load_config(
        &upstream("iac_he_config.yaml"),
        &[
            "iac.use_separate_critic=false".into(),
            "critic_model=null".into(),
        ],
        &LegacyFlags::default(),
    )
    .unwrap();
    let ac = shared.actor_critic.as_ref().unwrap();
    assert!(ac.value_head_on_actor && ac.critic_models.is_empty() && ac.value_clip == Some(0.2));
    let e = load_config(
        &upstream("iac_he_config.yaml"),
        &["iac.num_generations=2".into()],
        &LegacyFlags::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("iac.num_generations"), "{e}");
}

fn same_class(t: &[u32]) -> bool {
    t[0] % 4 == t[1] % 4
}

fn yaml(section: &str, model: &Path, epochs: usize, extra: &str) -> String {
    format!(
        "model: {{name: '{}', temperature: 1.0, top_p: 1.0, top_k: 0, max_length: 64}}\n\
         dataset: {{name: gsm8k, train_split: 'train[:4]'}}\n\
         seed: 11\n\
         {section}:\n  num_agents: 2\n  num_generations: 8\n  max_new_tokens: 1\n  learning_rate: 0.002\n  critic_learning_rate: 0.002\n  \
         num_train_epochs: {epochs}\n  rollout_buffer_size: 4\n  eval_interval: 1000\n  save_steps: 100000\n  logging_steps: 1\n{extra}\
         logging: {{tensorboard: false, plots: false, progress: never, rollouts: true}}\n",
        model.display()
    )
}

fn run(section: &str, flip: bool) -> Vec<BTreeMap<String, f64>> {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model_dir(tmp.path());
    let mut overrides: Vec<String> = if flip {
        vec!["reward_processor={enabled: true, scale_factor: -1.0, shift: 0.0}".into()]
    } else {
        vec![]
    };
    // `iac-head`: IAC with the value head on each actor.
    let section = match section {
        "iac-head" => {
            overrides.push("iac.use_separate_critic=false".into());
            "iac"
        }
        s => s,
    };
    let cfg = config(&yaml(section, &model, 24, ""), &overrides);
    let mut trainer = config_trainer(
        &cfg,
        &tmp.path().join("run"),
        Box::new(TokenRule { rule: same_class }),
        4,
    );
    trainer.run().unwrap().history
}

fn window(h: &[BTreeMap<String, f64>], key: &str, from_end: bool, k: usize) -> f64 {
    let v: Vec<f64> = h.iter().map(|m| m[key]).collect();
    let part = if from_end { &v[v.len() - k..] } else { &v[..k] };
    part.iter().sum::<f64>() / k as f64
}

/// The critic's step through the trainer: with a buffer of one item's samples (4 per agent) each
/// item is drained right after its rollout, before the critic changes, so every drain's value loss
/// is mean (y − V)² over the logged rollout-time values and targets; the step's `critic/value_loss`
/// is the mean over its drains (one per agent and item, each of 4 samples). MAAC's one critic takes
/// agent 0's mini-batch first and agent 1's after that step, as upstream: there agent 0's loss is
/// checked (`agent0/value_loss`).
#[test]
fn the_logged_critic_loss_is_the_squared_td_error_of_the_logged_values() {
    for section in ["iac", "maac", "iac-head"] {
        let tmp = tempfile::tempdir().unwrap();
        let model = tiny_model_dir(tmp.path());
        let sec = if section == "maac" { "maac" } else { "iac" };
        let mut overrides = vec![
            format!("{sec}.num_generations=4"),
            format!("{sec}.num_train_epochs=2"),
        ];
        if section == "iac-head" {
            overrides.push("iac.use_separate_critic=false".into());
        }
        let cfg = config(&yaml(sec, &model, 2, ""), &overrides);
        let mut trainer = config_trainer(
            &cfg,
            &tmp.path().join("run"),
            Box::new(TokenRule { rule: same_class }),
            4,
        );
        let summary = trainer.run().unwrap();
        let text = std::fs::read_to_string(tmp.path().join("run/rollouts.jsonl")).unwrap();
        for (i, m) in summary.history.iter().enumerate() {
            let step = i as u64 + 1;
            let mut squares = Vec::new();
            let agents: &[usize] = if section == "maac" { &[0] } else { &[0, 1] };
            for l in text
                .lines()
                .map(|l| serde_json::from_str::<Value>(l).unwrap())
                .filter(|l| l["step"] == step)
            {
                for &a in agents {
                    for (v, y) in f64s(&l["values"][a])
                        .iter()
                        .zip(f64s(&l["value_targets"][a]))
                    {
                        squares.push((y - v).powi(2));
                    }
                }
            }
            assert_eq!(
                squares.len(),
                4 * 4 * agents.len(),
                "{section}: 4 items, 4 samples per agent"
            );
            let want = squares.iter().sum::<f64>() / squares.len() as f64;
            let key = if section == "maac" {
                "agent0/value_loss"
            } else {
                "critic/value_loss"
            };
            close(&[m[key]], &[want], &format!("{section} step {step} {key}"));
        }
    }
}

#[test]
fn iac_and_maac_learn_the_cooperative_task_and_the_flipped_sign_does_not() {
    for section in ["iac", "maac", "iac-head"] {
        let h = run(section, false);
        let (first, last) = (h[0]["reward/mean"], window(&h, "reward/mean", true, 5));
        let (loss_first, loss_last) = (
            window(&h, "critic/value_loss", false, 5),
            window(&h, "critic/value_loss", true, 5),
        );
        eprintln!(
            "{section}: reward {first:.3} -> {last:.3}, value loss {loss_first:.4} -> {loss_last:.4}, explained variance {:.3}",
            h[h.len() - 1]["critic/explained_variance"]
        );
        assert!(
            first < 0.5,
            "{section}: the first step samples near chance (0.25), got {first}"
        );
        assert!(
            last >= 0.8,
            "{section}: the reward rises to at least 0.8, got {last}"
        );
        assert!(
            loss_last < loss_first,
            "{section}: the critic's loss falls ({loss_first} -> {loss_last})"
        );
        for key in [
            "critic/explained_variance",
            "critic/value_mean",
            "critic/target_mean",
            "critic/turn1/expected_return",
            "agent1/value_loss",
        ] {
            assert!(h[h.len() - 1].contains_key(key), "{section}: metric {key}");
        }
        let flipped = run(section, true);
        let last_flipped = window(&flipped, "reward/mean", true, 5);
        eprintln!("{section} flipped: reward -> {last_flipped:.3}");
        assert!(
            last_flipped < 0.5,
            "{section}: the flipped sign must not learn, got {last_flipped}"
        );
    }
}

/// The toy of the multi-turn tests: each item hides a target class; the turn-2 prompt (the
/// feedback) is a character of that class. Reward: the share of agents whose first token is in it.
struct HiddenTarget;

fn target(item: &Value) -> u32 {
    item["target"].as_u64().unwrap() as u32
}

impl cotrain_learner::trainer::RewardSource for HiddenTarget {
    fn score(
        &mut self,
        _task: &str,
        actions: &[cotrain_learner::trainer::ScoreAction],
    ) -> Result<Vec<cotrain_learner::trainer::Score>, cotrain_learner::trainer::TrainError> {
        Ok(actions
            .iter()
            .map(|a| {
                let t = target(&a.item);
                let hits: Vec<f64> = a
                    .completion_ids
                    .iter()
                    .map(|c| (c.first().is_some_and(|x| x % 4 == t)) as u8 as f64)
                    .collect();
                let r = hits.iter().sum::<f64>() / hits.len() as f64;
                cotrain_learner::trainer::Score {
                    reward: r,
                    levels: BTreeMap::from([("level_1".to_string(), r)]),
                    ..Default::default()
                }
            })
            .collect())
    }
    fn feedback(
        &mut self,
        _task: &str,
        actions: &[cotrain_learner::trainer::ScoreAction],
        _spec: &cotrain_learner::trainer::FeedbackSpec,
    ) -> Result<Vec<Vec<String>>, cotrain_learner::trainer::TrainError> {
        Ok(actions
            .iter()
            .map(|a| {
                vec![char::from(b'd' + target(&a.item) as u8).to_string(); a.completions.len()]
            })
            .collect())
    }
    fn describe(&self) -> String {
        "hidden target".into()
    }
}

fn hidden_trainer(section: &str, dir: &Path, rows: usize) -> cotrain_learner::trainer::Trainer {
    let model = tiny_model_dir(dir);
    let yaml = format!(
        "model: {{name: '{}', temperature: 1.0, top_p: 1.0, top_k: 0, max_length: 64}}\n\
         dataset: {{name: coophumaneval, train_split: 'test[:4]'}}\n\
         seed: 5\n\
         external: {{mode: level_feedback, previous_response: false}}\n\
         {section}:\n  num_agents: 2\n  num_turns: 2\n  max_new_tokens: 1\n  learning_rate: 0.003\n  num_train_epochs: 1\n  \
         rollout_buffer_size: 4\n  eval_interval: 1000\n  save_steps: 100000\n  logging_steps: 1\n  discount: 0.9\n  early_termination_threshold: 0.4\n\
         logging: {{tensorboard: false, plots: true, progress: never, rollouts: true}}\n",
        model.display()
    );
    let cfg = config(&yaml, &[]);
    let (policies, agent_policy) = cotrain_learner::trainer::load_policies(&cfg).unwrap();
    let engines = policies
        .iter()
        .map(|p| {
            (
                p.worker_agent.clone(),
                cotrain_model::loader::load(&p.model_spec, &Default::default()).unwrap(),
            )
        })
        .collect();
    let items = (0..rows)
        .map(|i| cotrain_learner::trainer::TrainItem {
            index: i,
            item: serde_json::json!({"target": (i * 3 + i / 4) % 4}),
            prompts: vec![vec![81, 58]; 2],
            texts: vec!["Q:".into(); 2],
        })
        .collect::<Vec<_>>();
    cotrain_learner::trainer::Trainer::new(cotrain_learner::trainer::TrainerSetup {
        cfg,
        run_dir: dir.join("run"),
        task: "hidden_target".into(),
        is_code: false,
        policies,
        agent_policy,
        rollout: Box::new(cotrain_learner::services::EngineRollout::new(engines)),
        reward: Box::new(HiddenTarget),
        train_items: items.clone(),
        eval_items: items,
    })
    .unwrap()
}

/// Every logged node of a two-turn run: the chain (one sample per agent, a leaf when the mean
/// reward is above the threshold or at turn 2), each completion's TD target from its own reward and
/// the next turn's value of the same agent (γ 0.9), advantage = target − value; MAAC's one value per
/// node for every agent.
#[test]
fn two_turn_rollouts_log_values_targets_and_advantages_as_recomputed() {
    for section in ["iac", "maac"] {
        let tmp = tempfile::tempdir().unwrap();
        let mut trainer = hidden_trainer(section, tmp.path(), 8);
        let summary = trainer.run().unwrap();
        assert_eq!(summary.steps, 2);
        let text = std::fs::read_to_string(tmp.path().join("run/rollouts.jsonl")).unwrap();
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let key = |l: &Value| (l["step"].as_u64().unwrap(), l["node_id"].as_u64().unwrap());
        let by_id: BTreeMap<(u64, u64), &Value> = lines.iter().map(|l| (key(l), l)).collect();
        let (mut continued, mut stopped) = (0, 0);
        for l in &lines {
            let reward = l["rewards"][0].as_f64().unwrap();
            let turn = l["turn"].as_u64().unwrap();
            let child = by_id.values().find(|c| {
                c["step"] == l["step"] && c["parent_id"].as_u64() == l["node_id"].as_u64()
            });
            assert_eq!(child.is_none(), turn == 2 || reward > 0.4, "{section}: {l}");
            if turn == 1 {
                if child.is_some() {
                    continued += 1
                } else {
                    stopped += 1
                }
            }
            for a in 0..2 {
                let v = l["values"][a][0].as_f64().unwrap();
                let y = l["value_targets"][a][0].as_f64().unwrap();
                let expected = match child {
                    Some(c) => reward + 0.9 * c["values"][a][0].as_f64().unwrap(),
                    None => reward,
                };
                close(&[y], &[expected], &format!("{section} target"));
                close(
                    &[l["advantages"][a][0].as_f64().unwrap()],
                    &[y - v],
                    &format!("{section} advantage"),
                );
            }
            if section == "maac" {
                assert_eq!(
                    l["values"][0], l["values"][1],
                    "MAAC: one joint value per node"
                );
            }
            // The logged return is this turn's reward plus the next turn's return (undiscounted).
            let expected_return = reward + child.map_or(0.0, |c| c["returns"][0].as_f64().unwrap());
            close(
                &[l["returns"][0].as_f64().unwrap()],
                &[expected_return],
                &format!("{section} return"),
            );
        }
        assert!(
            continued > 0 && stopped > 0,
            "{section}: chains both continued ({continued}) and stopped early ({stopped})"
        );
        let m = &summary.history[summary.history.len() - 1];
        assert!(
            m.contains_key("critic/turn2/expected_return") && m.contains_key("critic/value_loss"),
            "{m:?}"
        );
        for png in ["critic.png", "returns.png"] {
            assert!(
                summary.plots.iter().any(|p| p.ends_with(png)),
                "{section}: plots/{png} in {:?}",
                summary.plots
            );
        }
    }
}

const COMPARED: &[&str] = &[
    "reward/mean",
    "loss",
    "critic/value_loss",
    "critic/value_mean",
    "epoch",
];

/// 6 steps straight (5 rows, 3 items per step, 3 epochs) equal 3 steps, a stop, and 3 resumed from the checkpoint: the critics' weights
/// and optimiser state and the partly filled buffer (3 samples per drain, 2 per item) come back.
#[test]
fn a_resumed_actor_critic_run_equals_an_uninterrupted_one() {
    for variant in ["iac", "maac", "iac-head"] {
        resume_equals_straight(variant);
    }
}

fn resume_equals_straight(variant: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model_dir(tmp.path());
    let extra = "  train_batch_size: 3\n";
    let section = if variant == "maac" { "maac" } else { "iac" };
    let mut overrides: Vec<String> = vec![
        format!("{section}.num_generations=2"),
        format!("{section}.rollout_buffer_size=3"),
        format!("{section}.save_steps=3"),
    ];
    if variant == "iac-head" {
        overrides.push("iac.use_separate_critic=false".into());
    }
    let cfg = config(&yaml(section, &model, 3, extra), &overrides);
    let trainer =
        |dir: &Path| config_trainer(&cfg, dir, Box::new(TokenRule { rule: same_class }), 5);
    let mut straight = trainer(&tmp.path().join("straight"));
    let full = straight.run().unwrap();
    assert_eq!(full.steps, 6);
    let split = tmp.path().join("split");
    let mut first = trainer(&split);
    first.stop_after_steps = Some(3);
    let part1 = first.run().unwrap();
    drop(first);
    let ckpt = cotrain_learner::checkpoint::latest_checkpoint(&split).unwrap();
    // After the two policies: each critic's backbone and head, or each actor's value head.
    let parts = match variant {
        "iac" => 4,
        "maac" => 2,
        _ => 2,
    };
    for i in 2..2 + parts {
        assert!(
            ckpt.join(format!("agent-{i}/optimizer.safetensors"))
                .is_file(),
            "{variant}: part {i} of the checkpoint"
        );
    }
    assert!(
        !ckpt.join(format!("agent-{}", 2 + parts)).exists(),
        "{variant}"
    );
    // `learner export` writes the two policies and leaves the critics.
    let exported =
        cotrain_learner::export::export_checkpoint(&ckpt, None, &tmp.path().join("export"), false)
            .unwrap();
    assert_eq!(exported.len(), 2, "{variant}");
    let state: Value =
        serde_json::from_str(&std::fs::read_to_string(ckpt.join("state.json")).unwrap()).unwrap();
    assert!(
        !state["extra"]["actor_critic_buffer"]
            .as_array()
            .unwrap()
            .is_empty(),
        "a partly filled buffer at step 3 (the first step of an epoch)"
    );
    let mut second = trainer(&split);
    second.resume(&split).unwrap();
    let part2 = second.run().unwrap();
    let resumed: Vec<_> = part1.history.iter().chain(&part2.history).collect();
    assert_eq!(resumed.len(), full.history.len());
    for (i, (a, b)) in full.history.iter().zip(&resumed).enumerate() {
        for k in COMPARED {
            match (a.get(*k), b.get(*k)) {
                (Some(x), Some(y)) => assert!(
                    (x - y).abs() <= 1e-6 * (1.0 + x.abs()),
                    "{variant} step {}: {k} straight {x} vs resumed {y}",
                    i + 1
                ),
                (None, None) => {}
                (x, y) => panic!(
                    "{variant} step {}: {k} straight {x:?} vs resumed {y:?}",
                    i + 1
                ),
            }
        }
    }
}

/// log π(y_t | prompt, y_<t) summed over a completion's tokens: one plain forward of prompt +
/// completion (the trainer's chunked kernel is not used).
fn summed_logprob(
    model: &cotrain_model::loader::LoadedModel,
    prompt: &[u32],
    completion: &[u32],
) -> Tensor {
    let ids: Vec<i64> = prompt.iter().chain(completion).map(|&t| t as i64).collect();
    let logits = model
        .model
        .forward(&Tensor::from_slice(&ids).unsqueeze(0))
        .unwrap()
        .squeeze_dim(0);
    let (p, c) = (prompt.len() as i64, completion.len() as i64);
    let lp = logits.narrow(0, p - 1, c).log_softmax(-1, Kind::Float);
    let targets = Tensor::from_slice(&completion.iter().map(|&t| t as i64).collect::<Vec<_>>());
    lp.gather(1, &targets.unsqueeze(1), false).sum(Kind::Float)
}

/// One drain of IAC recomputed by hand: one item, 4 single-turn samples per agent (Q critics, so
/// that each sample has its own value), a buffer of 4
/// and mini-batches of 4, so the step drains once, and each actor takes one AdamW step. After the step
/// each actor must equal a fresh copy of the model stepped once by libtorch's AdamW on
/// −mean_k Â_k Σ_t log π(c_k,t), where Â is y − V from the logged targets and values, centred and
/// divided by its population std. AdamW's ε is 1 here, so the step is close to linear in the
/// gradient and tells advantages of another scale apart; the same step on the raw y − V lands
/// elsewhere.
#[test]
fn one_drain_steps_each_actor_on_its_normalised_advantages_as_recomputed_by_hand() {
    const LR: f64 = 0.05;
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model_dir(tmp.path());
    let yaml = format!(
        "model: {{name: '{}', temperature: 1.0, top_p: 1.0, top_k: 0, max_length: 64}}\n\
         dataset: {{name: gsm8k, train_split: 'train[:1]'}}\n\
         seed: 7\n\
         iac:\n  num_agents: 2\n  num_generations: 4\n  max_new_tokens: 3\n  learning_rate: {LR}\n  critic_learning_rate: 0.01\n  critic_type: q\n  \
         weight_decay: 0.0\n  num_train_epochs: 1\n  rollout_buffer_size: 4\n  train_batch_size: 4\n  eval_interval: 1000\n  \
         save_steps: 100000\n  logging_steps: 1\n\
         logging: {{tensorboard: false, plots: false, progress: never, rollouts: true}}\n",
        model.display()
    );
    let cfg = config(&yaml, &[]);
    let (mut policies, agent_policy) = cotrain_learner::trainer::load_policies(&cfg).unwrap();
    let adam = cotrain_learner::algo::AdamWConfig {
        eps: 1.0,
        ..cotrain_learner::algo::AdamWConfig::new(LR, 0.0, None)
    };
    for p in &mut policies {
        p.optimizer = cotrain_learner::algo::AdamW::new(p.trained_vs(), adam);
    }
    let engines = policies
        .iter()
        .map(|p| {
            (
                p.worker_agent.clone(),
                cotrain_model::loader::load(&p.model_spec, &Default::default()).unwrap(),
            )
        })
        .collect();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let rollout = train_common::Recording {
        inner: cotrain_learner::services::EngineRollout::new(engines),
        seen: seen.clone(),
    };
    let rows = train_common::items(1, 2);
    let mut trainer =
        cotrain_learner::trainer::Trainer::new(cotrain_learner::trainer::TrainerSetup {
            cfg: cfg.clone(),
            run_dir: tmp.path().join("run"),
            task: "token_rule".into(),
            is_code: false,
            policies,
            agent_policy,
            rollout: Box::new(rollout),
            reward: Box::new(TokenRule { rule: same_class }),
            train_items: rows,
            // No evaluation: every request is the step's.
            eval_items: Vec::new(),
        })
        .unwrap();
    let summary = trainer.run().unwrap();
    assert_eq!(summary.steps, 1);
    let log: Vec<Value> = std::fs::read_to_string(tmp.path().join("run/rollouts.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(log.len(), 1, "one node: one item, one turn");
    let requests = train_common::taken(&seen);
    let mut moved_apart = 0.0f64;
    for (a, policy) in trainer.policies().iter().enumerate() {
        // The agent's 4 samples, in the order drawn (a request may carry one or several).
        let own: Vec<&train_common::Seen> = requests
            .iter()
            .filter(|r| r.agent == policy.worker_agent)
            .collect();
        let prompt = own[0].prompt.clone();
        assert!(own.iter().all(|r| r.prompt == prompt));
        let completions: Vec<Vec<u32>> = own.iter().flat_map(|r| r.completions.clone()).collect();
        let drawn: Vec<&str> = own
            .iter()
            .flat_map(|r| r.texts.iter().map(String::as_str))
            .collect();
        assert_eq!(completions.len(), 4);
        let texts: Vec<&str> = log[0]["agents"][a]["completions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap())
            .collect();
        assert_eq!(texts, drawn, "the log's samples are the requests'");
        let (v, y) = (
            f64s(&log[0]["values"][a]),
            f64s(&log[0]["value_targets"][a]),
        );
        let raw: Vec<f64> = y.iter().zip(&v).map(|(y, v)| y - v).collect();
        let m = raw.iter().sum::<f64>() / 4.0;
        let std = (raw.iter().map(|x| (x - m).powi(2)).sum::<f64>() / 4.0)
            .sqrt()
            .max(1e-6);
        let normalised: Vec<f64> = raw.iter().map(|x| (x - m) / std).collect();
        assert!(
            normalised.iter().any(|x| x.abs() > 0.1),
            "the rewards or values must vary: {raw:?}"
        );
        let step = |adv: &[f64]| {
            let fresh =
                cotrain_model::loader::load(&policy.model_spec, &Default::default()).unwrap();
            let mut opt = tch::nn::AdamW {
                beta1: 0.9,
                beta2: 0.999,
                wd: 0.0,
                eps: 1.0,
                amsgrad: false,
            }
            .build(&fresh.vs, LR)
            .unwrap();
            opt.zero_grad();
            let loss = completions
                .iter()
                .zip(adv)
                .map(|(c, &adv_k)| summed_logprob(&fresh, &prompt, c) * (-adv_k / 4.0))
                .reduce(|x, y| x + y)
                .unwrap();
            loss.backward();
            opt.step();
            fresh
        };
        let (by_hand, unnormalised) = (step(&normalised), step(&raw));
        let trained = policy.model.named_parameters();
        let base = cotrain_model::loader::load(&policy.model_spec, &Default::default())
            .unwrap()
            .named_parameters();
        let (hand, raw_step) = (by_hand.named_parameters(), unnormalised.named_parameters());
        for (name, t) in &trained {
            let diff = (t - &hand[name]).abs().max().double_value(&[]);
            let update = (&hand[name] - &base[name]).abs().max().double_value(&[]);
            assert!(
                diff <= 1e-3 * update + 1e-6,
                "agent {a}: {name} differs from the hand computation by {diff} (update {update})"
            );
            moved_apart = moved_apart.max((t - &raw_step[name]).abs().max().double_value(&[]));
        }
    }
    assert!(
        moved_apart > 1e-4,
        "a step on the raw advantages must land elsewhere (largest difference {moved_apart})"
    );
}
