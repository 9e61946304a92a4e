//! CoMLRL's actor-critic trainers (IAC, MAAC) in cotrain:
//! - the math against values recorded by running comlrl 1.4.3's own methods
//!   (`fixtures/actor_critic/upstream.json`, `scripts/reference/actor_critic_fixtures.py`);
//! - the upstream experiment configs load unmodified with upstream's meaning;
//! - a two-turn run whose `rollouts.jsonl` values, TD targets and advantages are recomputed here;
//! - learning: on a cooperative toy task both trainers raise the reward and lower the critic's loss,
//!   and the sign-flipped reward does not learn;
//! - a resumed run (critics and the partial buffer in the checkpoint) equals an uninterrupted one.

mod train_common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use cotrain_learner::algo::actor_critic::{critic_input, normalized_advantages, td_targets, undiscounted_returns, value_loss};
use cotrain_learner::algo::{LossOptions, PolicyBatch, policy_loss};
use cotrain_learner::config::{Algorithm, CriticType, LegacyFlags, load_config};
use serde_json::Value;
use tch::{Kind, Tensor};
use train_common::{TokenRule, config, config_trainer, tiny_model_dir};

fn fixture() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/actor_critic/upstream.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn f64s(v: &Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

fn close(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: {got:?} vs {want:?}");
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "{what}: {got:?} vs {want:?}");
    }
}

#[test]
fn advantages_targets_critic_input_and_losses_match_upstream() {
    let f = fixture();
    for case in f["advantages"].as_array().unwrap() {
        let (adv, norm) = normalized_advantages(&f64s(&case["targets"]), &f64s(&case["old_values"]), case["normalize"].as_bool().unwrap());
        close(&adv, &f64s(&case["advantages"]), "advantages");
        close(&norm, &f64s(&case["normalized"]), "normalized advantages");
    }
    for case in f["td_targets"].as_array().unwrap() {
        let shift = case["reward_shift"].as_f64().unwrap();
        let gamma = case["discount"].as_f64().unwrap();
        let rewards: Vec<f64> = case["raw_rewards"].as_array().unwrap().iter().map(|r| f64s(r)[0] + shift).collect();
        let values: Vec<Vec<f64>> = case["values"].as_array().unwrap().iter().map(f64s).collect();
        assert_eq!(rewards.len(), case["turns_played"].as_u64().unwrap() as usize);
        for a in 0..case["num_agents"].as_u64().unwrap() as usize {
            let v: Vec<f64> = values.iter().map(|t| t[a]).collect();
            close(&td_targets(&rewards, &v, gamma), &f64s(&case["value_target"][a]), &format!("{} targets, agent {a}", case["trainer"]));
            close(&td_targets(&rewards, &v, gamma), &f64s(&case["adv_target"][a]), "advantage targets");
            close(&undiscounted_returns(&rewards), &f64s(&case["returns"][a]), "returns");
        }
    }
    for case in f["critic_input"].as_array().unwrap() {
        let prompts: Vec<&str> = case["prompts"].as_array().unwrap().iter().map(|p| p.as_str().unwrap()).collect();
        let actions: Option<Vec<&str>> = case["completions"].as_array().map(|c| c.iter().map(|p| p.as_str().unwrap()).collect());
        let actions = if case["critic_type"] == "q" { actions } else { None };
        assert_eq!(critic_input(&prompts, actions.as_deref()), case["text"].as_str().unwrap());
    }
    // One mini-batch's losses and gradients, through the actor's loss (MAGRPO's, original options)
    // and the critic's squared error, against upstream's `_ac_step`: the separate-critic and MAAC
    // cases (a value head shared with the actor is not built; its clipped cases are recorded).
    let mut checked = 0;
    for case in f["ac_step"].as_array().unwrap() {
        if case["use_separate_critic"] == false {
            continue;
        }
        let samples = case["samples"].as_array().unwrap();
        let pick = |k: &str| Tensor::from_slice(&samples.iter().map(|s| s[k].as_f64().unwrap()).collect::<Vec<_>>());
        let lp = pick("logprob_sum").view([-1, 1]).set_requires_grad(true);
        let mask = Tensor::ones([samples.len() as i64, 1], (Kind::Double, tch::Device::Cpu));
        let adv = pick("normalized_advantage");
        let batch = PolicyBatch { logprobs: &lp, mask: &mask, advantages: &adv, old_logprobs: None, proximal_logprobs: None, ref_logprobs: None, weights: None };
        let terms = policy_loss(&batch, &LossOptions::original()).unwrap();
        close(&[terms.loss.double_value(&[])], &[case["policy_loss"].as_f64().unwrap()], "policy loss");
        terms.loss.backward();
        close(&Vec::<f64>::try_from(lp.grad().view([-1])).unwrap(), &f64s(&case["grad_logprob_sum"]), "d loss / d log-prob sum");
        let v = pick("value").set_requires_grad(true);
        let l = value_loss(&v, &pick("value_target"));
        close(&[l.double_value(&[])], &[case["value_loss"].as_f64().unwrap()], "value loss");
        (l * case["value_loss_coef"].as_f64().unwrap()).backward();
        close(&Vec::<f64>::try_from(v.grad()).unwrap(), &f64s(&case["grad_value"]), "d loss / d value");
        checked += 1;
    }
    assert!(checked >= 2, "the fixture's separate-critic and MAAC steps");
}

fn upstream(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/actor_critic/upstream").join(name)
}

#[test]
fn the_upstream_configs_load_unmodified_with_upstreams_meaning() {
    let load = |name: &str| load_config(&upstream(name), &[], &LegacyFlags::default()).unwrap();
    let he = load("iac_he_config.yaml");
    assert_eq!(he.algorithm, Algorithm::Iac);
    let ac = he.actor_critic.as_ref().unwrap();
    assert!(!ac.centralised && ac.critic_type == CriticType::V && ac.value_loss_coef == 0.6 && ac.critic_learning_rate == 5e-6);
    assert_eq!(ac.critic_models, vec!["Qwen/Qwen2.5-Coder-3B".to_string(); 2]);
    let t = &he.trainer;
    assert_eq!((t.num_turns, t.num_generations, t.rollout_buffer_size, t.train_batch_size), (2, 1, 4, Some(4)));
    assert_eq!((t.discount, t.termination_threshold, t.advantage_normalization, t.weight_decay), (1.0, Some(-0.2), true, 0.01));
    assert_eq!(he.raw.reward_processor.shift, -4.0);
    assert_eq!((he.sampling.temperature, he.sampling.top_p), (0.6, 0.6));
    let maac = load("maac_he_config.yaml");
    assert_eq!(maac.algorithm, Algorithm::Maac);
    assert!(maac.actor_critic.as_ref().unwrap().centralised);
    assert_eq!(maac.actor_critic.as_ref().unwrap().critic_models.len(), 1);
    assert_eq!(maac.trainer.discount, 0.9);
    for name in ["iac_tldr_config.yaml", "maac_tldr_config.yaml"] {
        let c = load(name);
        assert_eq!((c.trainer.num_turns, c.trainer.num_generations, c.num_agents), (1, 1, 2), "{name}");
        assert_eq!((c.sampling.temperature, c.sampling.top_p), (0.7, 0.9), "{name}");
    }
    // A MAGRPO config naming critics, and a shared value head, are refused by name.
    let e = load_config(&upstream("iac_he_config.yaml"), &["iac.use_separate_critic=false".into()], &LegacyFlags::default()).unwrap_err().to_string();
    assert!(e.contains("iac.use_separate_critic") && e.contains("not built"), "{e}");
    let e = load_config(&upstream("iac_he_config.yaml"), &["iac.num_generations=2".into()], &LegacyFlags::default()).unwrap_err().to_string();
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
    let overrides: Vec<String> = if flip { vec!["reward_processor={enabled: true, scale_factor: -1.0, shift: 0.0}".into()] } else { vec![] };
    let cfg = config(&yaml(section, &model, 24, ""), &overrides);
    let mut trainer = config_trainer(&cfg, &tmp.path().join("run"), Box::new(TokenRule { rule: same_class }), 4);
    trainer.run().unwrap().history
}

fn window(h: &[BTreeMap<String, f64>], key: &str, from_end: bool, k: usize) -> f64 {
    let v: Vec<f64> = h.iter().map(|m| m[key]).collect();
    let part = if from_end { &v[v.len() - k..] } else { &v[..k] };
    part.iter().sum::<f64>() / k as f64
}

#[test]
fn iac_and_maac_learn_the_cooperative_task_and_the_flipped_sign_does_not() {
    for section in ["iac", "maac"] {
        let h = run(section, false);
        let (first, last) = (h[0]["reward/mean"], window(&h, "reward/mean", true, 5));
        let (loss_first, loss_last) = (window(&h, "critic/value_loss", false, 5), window(&h, "critic/value_loss", true, 5));
        eprintln!("{section}: reward {first:.3} -> {last:.3}, value loss {loss_first:.4} -> {loss_last:.4}, explained variance {:.3}", h[h.len() - 1]["critic/explained_variance"]);
        assert!(first < 0.5, "{section}: the first step samples near chance (0.25), got {first}");
        assert!(last >= 0.8, "{section}: the reward rises to at least 0.8, got {last}");
        assert!(loss_last < loss_first, "{section}: the critic's loss falls ({loss_first} -> {loss_last})");
        for key in ["critic/explained_variance", "critic/value_mean", "critic/target_mean", "critic/turn1/expected_return", "agent1/value_loss"] {
            assert!(h[h.len() - 1].contains_key(key), "{section}: metric {key}");
        }
        let flipped = run(section, true);
        let last_flipped = window(&flipped, "reward/mean", true, 5);
        eprintln!("{section} flipped: reward -> {last_flipped:.3}");
        assert!(last_flipped < 0.5, "{section}: the flipped sign must not learn, got {last_flipped}");
    }
}
