//! Multi-turn MAGRPO / GRPO (docs/src/trainers/multi-turn.md):
//! - the rollout math on hand-made trees (returns, advantages over siblings, aligned and cross, early
//!   stops, handoff picks, turn weights, the order of updates), against values computed by hand;
//! - a trainer run whose `rollouts.jsonl` is checked line by line against an independent
//!   recomputation of returns and advantages from the logged rewards;
//! - the learning test: a toy task where every item shows the same first-turn prompt but hides its
//!   own target, which only the turn-2 feedback reveals: turn 2 must learn to use the feedback while
//!   turn 1 stays at chance, and the flipped advantage sign must not learn.

mod train_common;

use std::collections::BTreeMap;

use cotrain_learner::algo::{AdamWConfig, AdvantageOptions};
use cotrain_learner::config::{AdvantageMode, Handoff, JointMode};
use cotrain_learner::services::EngineRollout;
use cotrain_learner::trainer::sources::FeedbackSpec;
use cotrain_learner::trainer::tree::{
    AgentPrompt, Expansion, Forest, Node, expand, handoff_picks, max_tree_nodes,
};
use cotrain_learner::trainer::{
    GenSample, Policy, RewardSource, RolloutSource, Score, ScoreAction, TrainError, TrainItem,
    Trainer, TrainerSetup,
};
use rand::SeedableRng;
use train_common::{config, tiny_model_dir};

fn sample(text: &str) -> GenSample {
    GenSample {
        token_ids: vec![1],
        text: text.into(),
        logprobs: vec![0.0],
        stopped: true,
        policy_version: 0,
    }
}

/// A scored node of `agents` agents with `g` samples each and the given processed rewards.
fn node(id: usize, turn: usize, agents: usize, g: usize, mode: JointMode, rewards: &[f64]) -> Node {
    let prompts = (0..agents)
        .map(|_| AgentPrompt {
            text: String::new(),
            ids: vec![1],
        })
        .collect();
    let mut n = Node::new(id, 0, id, turn, g, prompts, vec![Vec::new(); agents]);
    n.samples = (0..agents)
        .map(|a| (0..g).map(|k| sample(&format!("a{a}k{k}"))).collect())
        .collect();
    n.actions = cotrain_learner::algo::joint_actions(mode, agents, g);
    assert_eq!(n.actions.len(), rewards.len());
    n.rewards = rewards.to_vec();
    n.scores = rewards
        .iter()
        .map(|&r| Score {
            reward: r,
            ..Default::default()
        })
        .collect();
    n
}

fn link(forest: &mut Forest, parent: usize, joint: usize, child: usize) {
    forest.nodes[child].parent = Some(parent);
    forest.nodes[child].parent_joint = Some(joint);
    forest.nodes[parent].children.push(child);
}

fn close(a: &[f64], b: &[f64]) {
    assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() < 1e-12, "{a:?} vs {b:?}");
    }
}

fn mean_adv() -> AdvantageOptions {
    AdvantageOptions {
        joint_mode: JointMode::Aligned,
        mode: AdvantageMode::Mean,
        normalize: None,
        clamp: None,
    }
}

#[test]
fn tree_returns_and_advantages_by_hand_aligned_with_an_early_stop() {
    // One agent pair, G = 2, T = 2, γ = 0.5, termination threshold 0.9.
    // Root rewards [0, 1] (mean 0.5, not above 0.9: two children).
    // Child 0 (of joint 0): rewards [1, 1] → returns [1, 1]. Child 1 (of joint 1): rewards [0, 0.5].
    // Root returns: R_0 = 0 + 0.5·mean(1, 1) = 0.5; R_1 = 1 + 0.5·mean(0, 0.5) = 1.125.
    // Advantages (mean baseline, per agent, aligned: the joint's return): root [0.5 − 0.8125, 1.125 − 0.8125].
    let mut root = node(0, 0, 2, 2, JointMode::Aligned, &[0.0, 1.0]);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    let specs = expand(
        &mut root,
        2,
        Expansion::Tree {
            termination_threshold: Some(0.9),
        },
        &mut rng,
    );
    assert!(!root.leaf);
    assert_eq!(
        specs
            .iter()
            .map(|s| (s.parent_joint, s.picks.clone()))
            .collect::<Vec<_>>(),
        vec![(Some(0), vec![0, 0]), (Some(1), vec![1, 1])]
    );
    let mut forest = Forest {
        nodes: vec![
            root,
            node(1, 1, 2, 2, JointMode::Aligned, &[1.0, 1.0]),
            node(2, 1, 2, 2, JointMode::Aligned, &[0.0, 0.5]),
        ],
    };
    link(&mut forest, 0, 0, 1);
    link(&mut forest, 0, 1, 2);
    for id in [1, 2] {
        let specs = expand(
            &mut forest.nodes[id],
            2,
            Expansion::Tree {
                termination_threshold: Some(0.9),
            },
            &mut rng,
        );
        assert!(
            specs.is_empty() && forest.nodes[id].leaf && !forest.nodes[id].early_stop,
            "last-turn nodes are leaves, not early stops"
        );
    }
    forest.compute_returns(0.5, true);
    close(&forest.nodes[0].returns, &[0.5, 1.125]);
    close(&forest.nodes[1].returns, &[1.0, 1.0]);
    close(&forest.nodes[2].returns, &[0.0, 0.5]);
    forest.compute_advantages(2, &mean_adv(), None);
    for a in 0..2 {
        close(&forest.nodes[0].advantages[a], &[-0.3125, 0.3125]);
        close(&forest.nodes[1].advantages[a], &[0.0, 0.0]);
        close(&forest.nodes[2].advantages[a], &[-0.25, 0.25]);
    }
    // A first-turn node whose mean is above the threshold stops early, with no children.
    let mut good = node(3, 0, 2, 2, JointMode::Aligned, &[1.0, 0.9]);
    assert!(
        expand(
            &mut good,
            2,
            Expansion::Tree {
                termination_threshold: Some(0.9)
            },
            &mut rng
        )
        .is_empty()
    );
    assert!(good.leaf && good.early_stop);
    // Exactly at the threshold is not above it (the original's `>`).
    let mut edge = node(4, 0, 2, 2, JointMode::Aligned, &[0.9, 0.9]);
    assert_eq!(
        expand(
            &mut edge,
            2,
            Expansion::Tree {
                termination_threshold: Some(0.9)
            },
            &mut rng
        )
        .len(),
        2
    );
}

#[test]
fn tree_returns_and_credit_by_hand_in_cross_mode() {
    // Two agents, G = 2, cross: joint actions (0,0) (0,1) (1,0) (1,1) with rewards [1, 0, 0, 2];
    // a leaf (T = 1), so returns = rewards. Credit: agent 0 completion 0 = 1 + 0 = 1, completion 1 =
    // 0 + 2 = 2; agent 1 completion 0 = 1 + 0 = 1, completion 1 = 0 + 2 = 2. Mean baseline 1.5.
    let mut forest = Forest {
        nodes: vec![node(0, 0, 2, 2, JointMode::Cross, &[1.0, 0.0, 0.0, 2.0])],
    };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    let mut root = forest.nodes[0].clone();
    // Two turns: one child per joint action (G^N = 4).
    assert_eq!(
        expand(
            &mut root,
            2,
            Expansion::Tree {
                termination_threshold: None
            },
            &mut rng
        )
        .len(),
        4
    );
    forest.compute_returns(0.9, true);
    let opts = AdvantageOptions {
        joint_mode: JointMode::Cross,
        ..mean_adv()
    };
    forest.compute_advantages(2, &opts, None);
    close(&forest.nodes[0].advantages[0], &[-0.5, 0.5]);
    close(&forest.nodes[0].advantages[1], &[-0.5, 0.5]);
    // Growth bound: Σ_{t<T} (G^N)^t = 1 + 16 + 256 for G 4, N 2, T 3; aligned 1 + 4 + 16.
    assert_eq!(max_tree_nodes(JointMode::Cross, 2, 4, 3), 273);
    assert_eq!(max_tree_nodes(JointMode::Aligned, 2, 4, 3), 21);
}

#[test]
fn handoff_best_random_early_termination_and_turn_weights() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    // Best: the highest joint reward, the first on ties.
    let n = node(0, 0, 2, 4, JointMode::Aligned, &[0.5, 2.0, 2.0, 1.0]);
    assert_eq!(
        handoff_picks(&n, Handoff::Best, &mut rng),
        (Some(1), vec![1, 1])
    );
    // Random: each agent its own uniform pick; over many draws every index shows up for each agent.
    let mut seen = vec![[false; 4]; 2];
    for _ in 0..200 {
        let (joint, picks) = handoff_picks(&n, Handoff::Random, &mut rng);
        assert_eq!(joint, None);
        for a in 0..2 {
            seen[a][picks[a]] = true;
        }
    }
    assert!(seen.iter().all(|s| s.iter().all(|&x| x)), "{seen:?}");
    // Early termination at the turn's mean reward ≥ the threshold (inclusive, as the original).
    let how = Expansion::Handoff {
        handoff: Handoff::Best,
        early_termination_threshold: Some(1.375),
    };
    let mut first = node(0, 0, 2, 4, JointMode::Aligned, &[0.5, 2.0, 2.0, 1.0]); // mean 1.375
    assert!(expand(&mut first, 3, how, &mut rng).is_empty() && first.early_stop);
    let mut go_on = node(0, 0, 2, 4, JointMode::Aligned, &[0.5, 2.0, 2.0, 0.9]);
    let specs = expand(&mut go_on, 3, how, &mut rng);
    assert_eq!(
        (specs.len(), specs[0].picks.clone(), specs[0].g),
        (1, vec![1, 1], 4)
    );
    // Turn weights [1.2, 0.8, 1.0]: an episode that stopped early at turn 2 gets 0.8 · 2.0 there;
    // one that ran to its last turn gets no early-termination weight.
    let mut forest = Forest {
        nodes: vec![
            node(0, 0, 2, 4, JointMode::Aligned, &[0.0; 4]),
            node(1, 1, 2, 4, JointMode::Aligned, &[4.0; 4]),
            node(2, 2, 2, 4, JointMode::Aligned, &[0.0; 4]),
        ],
    };
    forest.nodes[1].leaf = true;
    forest.nodes[1].early_stop = true;
    forest.assign_turn_weights(&[1.2, 0.8, 1.0], 2.0, true);
    close(
        &forest
            .nodes
            .iter()
            .map(|n| n.turn_weight)
            .collect::<Vec<_>>(),
        &[1.2, 1.6, 1.0],
    );
    // The tree variant does not apply the early-termination weight.
    forest.assign_turn_weights(&[1.2, 0.8, 1.0], 2.0, false);
    close(
        &forest
            .nodes
            .iter()
            .map(|n| n.turn_weight)
            .collect::<Vec<_>>(),
        &[1.2, 0.8, 1.0],
    );
}

#[test]
fn update_groups_follow_the_original_buffer_order() {
    // Item 0: root 0 with children 1, 2; item 1: root 3 with child 4 (created in that order).
    let mut forest = Forest {
        nodes: (0..5)
            .map(|id| {
                node(
                    id,
                    [0, 1, 1, 0, 1][id],
                    1,
                    2,
                    JointMode::Aligned,
                    &[0.0, 0.0],
                )
            })
            .collect(),
    };
    for id in [3, 4] {
        forest.nodes[id].item = 1;
    }
    link(&mut forest, 0, 0, 1);
    link(&mut forest, 0, 1, 2);
    link(&mut forest, 3, 0, 4);
    assert_eq!(forest.preorder(0), vec![0, 1, 2]);
    // Buffer of 1 node: every node is its own update, in pre-order (CoMLRL's rollout_buffer_size 1).
    assert_eq!(
        forest.update_groups(2, 1, false),
        vec![vec![0], vec![1], vec![2], vec![3], vec![4]]
    );
    // Buffer of 2: [0, 1] → turn 1 then turn 2; [2, 3] → turn 1 (node 3) then turn 2 (node 2); [4].
    assert_eq!(
        forest.update_groups(2, 2, false),
        vec![vec![0], vec![1], vec![3], vec![2], vec![4]]
    );
    // Handoff: one update per turn over the step's items.
    assert_eq!(
        forest.update_groups(2, 1, true),
        vec![vec![0, 3], vec![1, 2, 4]]
    );
}

// ------------------------------------------------------------- trainer runs on the tiny model

/// Every item shows the same first-turn prompt and hides a target class (item field `target`, 0..4).
/// Reward: the mean over agents of [first token ≡ target (mod 4)]: chance 0.25. Feedback: one
/// character whose byte is ≡ target (mod 4), so that a policy that reads the last prompt token can
/// score 1 at turn 2.
struct HiddenTarget;

fn target(item: &serde_json::Value) -> u32 {
    item["target"].as_u64().unwrap() as u32
}

impl RewardSource for HiddenTarget {
    fn score(&mut self, _task: &str, actions: &[ScoreAction]) -> Result<Vec<Score>, TrainError> {
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
                Score {
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
        actions: &[ScoreAction],
        spec: &FeedbackSpec,
    ) -> Result<Vec<Vec<String>>, TrainError> {
        assert_eq!(
            spec.mode,
            cotrain_learner::config::ExternalMode::LevelFeedback
        );
        // 'd' = 100 ≡ 0, 'e' ≡ 1, 'f' ≡ 2, 'g' ≡ 3 (mod 4).
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

fn hidden_items(rows: usize, agents: usize) -> Vec<TrainItem> {
    (0..rows)
        .map(|i| TrainItem {
            index: i,
            // Targets cycle through the four classes: no class beats chance at turn 1.
            item: serde_json::json!({"target": (i * 3 + i / 4) % 4}),
            prompts: vec![vec![81, 58]; agents],
            texts: vec!["Q:".into(); agents],
        })
        .collect()
}

fn mt_yaml(agents: usize, rollout: &str, epochs: usize, extra: &str) -> String {
    format!(
        "model: {{name: unused, temperature: 1.0, top_p: 1.0, top_k: 0, max_length: 64}}\n\
         dataset: {{name: coophumaneval, train_split: 'test[:4]'}}\n\
         seed: 5\n\
         external: {{mode: level_feedback, previous_response: false}}\n\
         magrpo:\n  num_agents: {agents}\n  num_turns: 2\n  rollout: {rollout}\n  handoff: random\n  num_generations: 4\n  \
         max_new_tokens: 1\n  learning_rate: 0.003\n  num_train_epochs: {epochs}\n  rollout_buffer_size: 4\n  eval_interval: 1000\n  \
         save_steps: 100000\n  logging_steps: 1\n  discount: 0.9\n{extra}\
         logging: {{tensorboard: false, plots: false, progress: never, rollouts: true}}\n"
    )
}

fn mt_trainer(yaml: &str, overrides: &[String], dir: &std::path::Path, rows: usize) -> Trainer {
    let cfg = config(yaml, overrides);
    let model = tiny_model_dir(dir);
    let spec = model.display().to_string();
    let opts = cotrain_model::loader::LoadOptions::default();
    let adam = AdamWConfig::new(
        cfg.trainer.learning_rate,
        cfg.trainer.weight_decay,
        cfg.trainer.max_grad_norm,
    );
    let n = cfg.num_agents;
    let mut policies = Vec::new();
    let mut engines = Vec::new();
    for a in 0..n {
        let name = format!("agent{a}");
        policies.push(Policy::new(
            &name,
            &spec,
            cotrain_model::loader::load(&spec, &opts).unwrap(),
            None,
            adam,
        ));
        engines.push((name, cotrain_model::loader::load(&spec, &opts).unwrap()));
    }
    Trainer::new(TrainerSetup {
        cfg: cfg.clone(),
        run_dir: dir.join("run"),
        task: "hidden_target".into(),
        is_code: false,
        policies,
        agent_policy: (0..n).collect(),
        rollout: Box::new(EngineRollout::new(engines)),
        reward: Box::new(HiddenTarget),
        train_items: hidden_items(rows, n),
        eval_items: hidden_items(4, n),
    })
    .unwrap()
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

#[test]
fn rollouts_jsonl_matches_an_independent_recomputation() {
    let tmp = tempfile::tempdir().unwrap();
    let yaml = mt_yaml(
        2,
        "tree",
        1,
        "  termination_threshold: 0.7\n  turn_gradient_weights: [1.5, 0.5]\n",
    );
    let mut trainer = mt_trainer(&yaml, &[], tmp.path(), 4);
    let summary = trainer.run().unwrap();
    assert_eq!(summary.steps, 1);
    let m = &summary.history[0];
    let text = std::fs::read_to_string(tmp.path().join("run/rollouts.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let by_id: BTreeMap<u64, &serde_json::Value> = lines
        .iter()
        .map(|l| (l["node_id"].as_u64().unwrap(), l))
        .collect();
    let f = |v: &serde_json::Value| v.as_f64().unwrap();
    let floats = |v: &serde_json::Value| v.as_array().unwrap().iter().map(f).collect::<Vec<f64>>();
    assert_eq!(m["nodes_per_item"], lines.len() as f64 / 4.0);
    for l in &lines {
        for key in [
            "step",
            "item_index",
            "node_id",
            "parent_id",
            "parent_joint",
            "turn",
            "agents",
            "joint_actions",
            "rewards",
            "returns",
            "advantages",
            "leaf",
            "turn_weight",
        ] {
            assert!(l.get(key).is_some(), "missing {key} in {l}");
        }
        let rewards = floats(&l["rewards"]);
        let turn = l["turn"].as_u64().unwrap();
        let children: Vec<&&serde_json::Value> = by_id
            .values()
            .filter(|c| c["parent_id"].as_u64() == l["node_id"].as_u64())
            .collect();
        // Leaves: last turn, or a first-turn node whose mean reward is above 0.7.
        assert_eq!(l["leaf"].as_bool().unwrap(), children.is_empty());
        assert_eq!(
            children.is_empty(),
            turn == 2 || mean(&rewards) > 0.7,
            "{l}"
        );
        // R_j = r_j + 0.9 · mean(returns of child j).
        let expected: Vec<f64> = rewards
            .iter()
            .enumerate()
            .map(|(j, r)| {
                match children
                    .iter()
                    .find(|c| c["parent_joint"].as_u64() == Some(j as u64))
                {
                    Some(c) => r + 0.9 * mean(&floats(&c["returns"])),
                    None => *r,
                }
            })
            .collect();
        close(&floats(&l["returns"]), &expected);
        // Aligned: each agent's completion k is credited the return of joint action k; mean baseline.
        let mu = mean(&expected);
        for a in l["advantages"].as_array().unwrap() {
            close(
                &floats(a),
                &expected.iter().map(|r| r - mu).collect::<Vec<_>>(),
            );
        }
        assert_eq!(f(&l["turn_weight"]), if turn == 1 { 1.5 } else { 0.5 });
        // The turn-2 prompt is the feedback alone (previous_response: false): one character.
        if turn == 2 {
            let prompt = l["agents"][0]["prompt"].as_str().unwrap();
            assert_eq!(prompt.len(), 1, "{prompt:?}");
        } else {
            assert_eq!(l["agents"][1]["prompt"], "Q:");
        }
        assert_eq!(l["agents"][0]["completions"].as_array().unwrap().len(), 4);
    }
    assert!(
        m.contains_key("turn_1/reward/mean")
            && m.contains_key("turn_2/return/mean")
            && m.contains_key("early_terminations")
    );
    // One update per (buffer of 4 nodes, turn) per agent.
    assert!(m["optimizer_steps"] >= 2.0, "{m:?}");
}

/// Turn-1 and turn-2 mean rewards of the first step and of the last `k` steps.
fn learn(rollout: &str, flip: bool, epochs: usize) -> (f64, f64, f64) {
    let tmp = tempfile::tempdir().unwrap();
    let overrides: Vec<String> = if flip {
        vec!["reward_processor={enabled: true, scale_factor: -1.0, shift: 0.0}".into()]
    } else {
        vec![]
    };
    let mut trainer = mt_trainer(&mt_yaml(2, rollout, epochs, ""), &overrides, tmp.path(), 16);
    let summary = trainer.run().unwrap();
    let t1: Vec<f64> = summary
        .history
        .iter()
        .map(|m| m["turn_1/reward/mean"])
        .collect();
    let t2: Vec<f64> = summary
        .history
        .iter()
        .map(|m| m.get("turn_2/reward/mean").copied().unwrap_or(f64::NAN))
        .collect();
    let k = 6;
    let last = |v: &[f64]| v[v.len() - k..].iter().sum::<f64>() / k as f64;
    let round = |v: &[f64]| {
        v.iter()
            .map(|x| (x * 100.0).round() / 100.0)
            .collect::<Vec<_>>()
    };
    eprintln!(
        "{rollout} flip={flip}: turn 1 {:?}\nturn 2 {:?}",
        round(&t1),
        round(&t2)
    );
    (t2[0], last(&t1), last(&t2))
}

#[test]
fn only_the_turn_two_feedback_makes_the_task_learnable_handoff() {
    let (first2, last1, last2) = learn("handoff", false, 12);
    assert!(
        first2 < 0.5,
        "turn 2 starts near chance (0.25), got {first2}"
    );
    assert!(
        last2 >= 0.8,
        "turn 2 must learn to use the feedback: {last2}"
    );
    assert!(
        (0.1..=0.45).contains(&last1),
        "turn 1 cannot beat chance (0.25) on hidden targets: {last1}"
    );
    let (_, _, flipped2) = learn("handoff", true, 12);
    assert!(
        flipped2 < 0.4,
        "with the advantage sign flipped turn 2 must not learn: {flipped2}"
    );
}

#[test]
fn only_the_turn_two_feedback_makes_the_task_learnable_tree() {
    let (first2, last1, last2) = learn("tree", false, 5);
    assert!(
        first2 < 0.5,
        "turn 2 starts near chance (0.25), got {first2}"
    );
    assert!(
        last2 >= 0.8,
        "turn 2 must learn to use the feedback: {last2}"
    );
    assert!(
        (0.1..=0.45).contains(&last1),
        "turn 1 cannot beat chance (0.25) on hidden targets: {last1}"
    );
}

/// Several learner ranks: the handoff rollout splits by item and is allowed; the tree rollout (whose
/// update groups span items) is refused with the key named, and agent placement needs several
/// policies and a multiple of their count in ranks; one rank allows all.
#[test]
fn learner_ranks_refuse_what_they_cannot_reproduce() {
    use cotrain_learner::trainer::check_ranks;
    let tree = config(&mt_yaml(2, "tree", 1, ""), &[]);
    let handoff = config(&mt_yaml(2, "handoff", 1, ""), &[]);
    assert!(check_ranks(&tree, 1).is_ok());
    assert!(check_ranks(&handoff, 2).is_ok());
    let err = check_ranks(&tree, 2).unwrap_err().to_string();
    assert!(
        err.contains("tree") && err.contains("rollout: handoff"),
        "{err}"
    );
    let agent = config(
        &mt_yaml(2, "handoff", 1, ""),
        &["learner.placement=agent".to_string()],
    );
    assert!(check_ranks(&agent, 2).is_ok() && check_ranks(&agent, 4).is_ok());
    let err = check_ranks(&agent, 3).unwrap_err().to_string();
    assert!(err.contains("multiple of 2 ranks"), "{err}");
    let shared = config(
        &mt_yaml(2, "handoff", 1, ""),
        &[
            "learner.placement=agent".to_string(),
            "magrpo.shared_parameters=true".to_string(),
        ],
    );
    let err = check_ranks(&shared, 2).unwrap_err().to_string();
    assert!(
        err.contains("one policy") && err.contains("placement: data"),
        "{err}"
    );
    // 2026 mini-batches of nodes smaller than the buffer: one optimiser step each, one rank's schedule.
    let nodes = |batch: &str| {
        let o: Vec<String> = ["comlrl_era=2026", "magrpo.rollout_buffer_size=4", batch]
            .iter()
            .map(|s| s.to_string())
            .collect();
        config(&mt_yaml(2, "handoff", 1, ""), &o)
    };
    let err = check_ranks(&nodes("magrpo.train_batch_size=2"), 2)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("train_batch_size (2) below rollout_buffer_size (4)")
            && err.contains("one rank"),
        "{err}"
    );
    assert!(check_ranks(&nodes("magrpo.train_batch_size=4"), 2).is_ok());
}

// ------------------------------------------- CoMLRL 2026's buffer schedule, item after item

/// Rewards by the order items are first seen in (the original's item 0, 1, ...): -1 everywhere
/// (a root below the -0.2 threshold grows its 4 children), except that `leaf_item`'s root scores
/// 1 (a leaf).
struct ByFirstSeen {
    seen: Vec<usize>,
    leaf_item: Option<usize>,
}

impl RewardSource for ByFirstSeen {
    fn score(&mut self, _task: &str, actions: &[ScoreAction]) -> Result<Vec<Score>, TrainError> {
        Ok(actions
            .iter()
            .map(|a| {
                let row = a.item["row"].as_u64().unwrap() as usize;
                if !self.seen.contains(&row) {
                    self.seen.push(row);
                }
                let order = self.seen.iter().position(|&r| r == row).unwrap();
                let r = if Some(order) == self.leaf_item {
                    1.0
                } else {
                    -1.0
                };
                Score {
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
        actions: &[ScoreAction],
        _spec: &FeedbackSpec,
    ) -> Result<Vec<Vec<String>>, TrainError> {
        Ok(actions
            .iter()
            .map(|a| vec!["d".to_string(); a.completions.len()])
            .collect())
    }
    fn describe(&self) -> String {
        "by first seen".into()
    }
}

/// The in-process engine, writing `G` for each generation call and `P` for each weight push.
struct Events {
    inner: EngineRollout,
    log: std::sync::Arc<std::sync::Mutex<String>>,
}

impl RolloutSource for Events {
    fn generate(
        &mut self,
        requests: &[cotrain_learner::trainer::GenRequest],
    ) -> Result<Vec<Vec<GenSample>>, TrainError> {
        self.log.lock().unwrap().push('G');
        self.inner.generate(requests)
    }
    fn policy_version(&mut self, agent: &str) -> Result<u64, TrainError> {
        self.inner.policy_version(agent)
    }
    fn push_weights(
        &mut self,
        agent: &str,
        version: u64,
        params: &BTreeMap<String, tch::Tensor>,
    ) -> Result<(), TrainError> {
        self.log.lock().unwrap().push('P');
        self.inner.push_weights(agent, version, params)
    }
    fn describe(&self) -> String {
        "events".into()
    }
}

/// A 2-agent, 2-turn tree trainer on `rows` rows (`{"row": i}`) with the 2026 keys and
/// `overrides`, its rollouts written to the returned event log.
fn buffer_trainer(
    dir: &std::path::Path,
    overrides: &[&str],
    rows: usize,
    reward: Box<dyn RewardSource>,
) -> (Trainer, std::sync::Arc<std::sync::Mutex<String>>) {
    let yaml = mt_yaml(2, "tree", 1, "");
    let mut all: Vec<String> = [
        "magrpo.termination_threshold=-0.2",
        "magrpo.discount=1.0",
        "magrpo.advantage_normalization=true",
        "comlrl_era=2026",
    ]
    .iter()
    .chain(overrides)
    .map(|s| s.to_string())
    .collect();
    all.push(format!("dataset.train_split=test[:{rows}]"));
    let cfg = config(&yaml, &all);
    let model = tiny_model_dir(dir);
    let spec = model.display().to_string();
    let opts = cotrain_model::loader::LoadOptions::default();
    let adam = AdamWConfig::new(
        cfg.trainer.learning_rate,
        cfg.trainer.weight_decay,
        cfg.trainer.max_grad_norm,
    );
    let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let mut policies = Vec::new();
    let mut engines = Vec::new();
    for a in 0..2 {
        let name = format!("agent{a}");
        policies.push(Policy::new(
            &name,
            &spec,
            cotrain_model::loader::load(&spec, &opts).unwrap(),
            None,
            adam,
        ));
        engines.push((name, cotrain_model::loader::load(&spec, &opts).unwrap()));
    }
    let items: Vec<TrainItem> = (0..rows)
        .map(|i| TrainItem {
            index: i,
            item: serde_json::json!({"row": i}),
            prompts: vec![vec![81, 58]; 2],
            texts: vec!["Q:".into(); 2],
        })
        .collect();
    let trainer = Trainer::new(TrainerSetup {
        cfg: cfg.clone(),
        run_dir: dir.join("run"),
        task: "by_row".into(),
        is_code: false,
        policies,
        agent_policy: vec![0, 1],
        rollout: Box::new(Events {
            inner: EngineRollout::new(engines),
            log: log.clone(),
        }),
        reward,
        train_items: items.clone(),
        eval_items: items,
    })
    .unwrap();
    (trainer, log)
}

/// One step of 2 items (the whole epoch) under `overrides`: the step's optimiser steps and the
/// generation/push sequence, consecutive repeats folded (`GPGP`).
fn two_item_step(overrides: &[&str], leaf_item: Option<usize>) -> (f64, String) {
    let tmp = tempfile::tempdir().unwrap();
    let (mut trainer, log) = buffer_trainer(
        tmp.path(),
        overrides,
        2,
        Box::new(ByFirstSeen {
            seen: Vec::new(),
            leaf_item,
        }),
    );
    let m = trainer.train_step(&[1, 0]).unwrap();
    let mut folded = String::new();
    for c in log.lock().unwrap().chars() {
        if !folded.ends_with(c) {
            folded.push(c);
        }
    }
    (m["optimizer_steps"], folded)
}

/// The original's optimiser steps (both agents) in `batch_schedule.json`'s run `name`, written by
/// `scripts/reference/comlrl2026_fixtures.py` from CoMLRL 86d1bb9's `_train_step_returns` over two
/// items and the end-of-epoch drain.
fn original_steps(name: &str) -> f64 {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/comlrl2026/batch_schedule.json");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let run = v["runs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == name)
        .unwrap();
    run["optimizer_steps"].as_array().unwrap().len() as f64
}

#[test]
fn items_train_one_after_another_with_the_originals_optimiser_steps() {
    let he = ["magrpo.rollout_buffer_size=2", "magrpo.train_batch_size=2"];
    // Item by item: the second item is sampled after the first one's updates were pushed.
    let (steps, events) = two_item_step(&he, None);
    assert_eq!(steps, original_steps("he_buffer2_batch2"));
    assert_eq!(events, "GPGP");
    // The second item's root a leaf: its root trains with the first item's last child.
    let (steps, events) = two_item_step(&he, Some(1));
    assert_eq!(steps, original_steps("he_buffer2_batch2_early_stop_item1"));
    assert_eq!(events, "GPGP");
    // Buffer 4: the first item's last child waits for the second item (one push after each item).
    let (steps, _) = two_item_step(
        &["magrpo.rollout_buffer_size=4", "magrpo.train_batch_size=4"],
        None,
    );
    assert_eq!(steps, original_steps("che_buffer4_batch4"));
    // Mini-batches of 2 nodes in a buffer of 4: one optimiser step per mini-batch.
    let (steps, _) = two_item_step(
        &["magrpo.rollout_buffer_size=4", "magrpo.train_batch_size=2"],
        None,
    );
    assert_eq!(steps, original_steps("buffer4_batch2"));
    // The step-wise option samples both items first and trains once.
    let (_, events) = two_item_step(
        &[
            "magrpo.rollout_buffer_size=2",
            "magrpo.train_batch_size=2",
            "magrpo.train_between_items=false",
        ],
        None,
    );
    assert_eq!(events, "GP");
}

/// Row 0's nodes score from 1 (its root is a leaf), every other node's from -1 (below the
/// threshold: roots grow children), plus a tenth of agent 0's first token mod 5 (so that siblings
/// differ and updates have a gradient).
struct RowZeroLeaf;

impl RewardSource for RowZeroLeaf {
    fn score(&mut self, _task: &str, actions: &[ScoreAction]) -> Result<Vec<Score>, TrainError> {
        Ok(actions
            .iter()
            .map(|a| {
                let bonus = 0.1 * a.completion_ids[0].first().map_or(0, |t| t % 5) as f64;
                let r = if a.item["row"] == 0 { 1.0 } else { -1.0 } + bonus;
                Score {
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
        actions: &[ScoreAction],
        _spec: &FeedbackSpec,
    ) -> Result<Vec<Vec<String>>, TrainError> {
        Ok(actions
            .iter()
            .map(|a| vec!["d".to_string(); a.completions.len()])
            .collect())
    }
    fn describe(&self) -> String {
        "row zero leaf".into()
    }
}

#[test]
fn a_partial_buffer_waits_for_the_next_step_and_survives_a_checkpoint() {
    // G = 3, buffer 2: row 0 is a leaf (1 node), row 1 grows 3 children (4 nodes); the step's fifth
    // node waits for the next step, whose items are not the epoch's last.
    let settings = [
        "magrpo.num_generations=3",
        "magrpo.rollout_buffer_size=2",
        "magrpo.train_batch_size=2",
        "magrpo.learning_rate=0.0003",
    ];
    let tmp = tempfile::tempdir().unwrap();
    let (mut straight, _) =
        buffer_trainer(&tmp.path().join("a"), &settings, 6, Box::new(RowZeroLeaf));
    let first = straight.train_step(&[0, 1]).unwrap();
    // Nodes [root 0, root 1] (both turn 0: one update), [child, child] (one): 2 per agent.
    assert_eq!(first["optimizer_steps"], 4.0);
    let dir = straight.save_checkpoint().unwrap();
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("state.json")).unwrap()).unwrap();
    assert_eq!(
        state["extra"]["buffered_nodes"].as_array().unwrap().len(),
        1,
        "the waiting node is in the checkpoint"
    );
    let next = straight.train_step(&[2, 3]).unwrap();
    assert!(
        next["grad_norm"] > 0.0,
        "the second step has a gradient to compare: {next:?}"
    );

    // A new trainer resumed from the checkpoint trains the waiting node with the next step's.
    let (mut resumed, _) =
        buffer_trainer(&tmp.path().join("b"), &settings, 6, Box::new(RowZeroLeaf));
    resumed.restore(&dir).unwrap();
    // As `run` does first: the workers serve the restored weights.
    resumed.sync_all_weights().unwrap();
    let second = resumed.train_step(&[2, 3]).unwrap();
    // 1 waiting + 8 new nodes: [waiting child, root 2] (two updates: turn 0, then turn 1),
    // [child, child] (one), [child, root 3] (two), [child, child] (one); the last child waits again.
    assert_eq!(second["optimizer_steps"], 2.0 * 6.0);
    for (p, q) in straight.policies().iter().zip(resumed.policies()) {
        let (pa, qa) = (p.parameters(), q.parameters());
        for (name, t) in &pa {
            let diff = (t - &qa[name]).abs().max().double_value(&[]);
            assert!(diff <= 1e-6, "{name} differs by {diff}");
        }
    }
}

/// -1 or -0.5 everywhere (roots grow children), failing once the `fail_at`-th distinct row is scored.
struct FailsAtRow {
    seen: Vec<usize>,
    fail_at: usize,
}

impl RewardSource for FailsAtRow {
    fn score(&mut self, _task: &str, actions: &[ScoreAction]) -> Result<Vec<Score>, TrainError> {
        let mut out = Vec::new();
        for a in actions {
            let row = a.item["row"].as_u64().unwrap() as usize;
            if !self.seen.contains(&row) {
                self.seen.push(row);
            }
            if self.seen.len() >= self.fail_at {
                return Err(TrainError::Reward("the reward server went away".into()));
            }
            let r = -1.0
                + if a.completion_ids[0].first().is_some_and(|t| t % 2 == 1) {
                    0.5
                } else {
                    0.0
                };
            out.push(Score {
                reward: r,
                levels: BTreeMap::from([("level_1".to_string(), r)]),
                ..Default::default()
            });
        }
        Ok(out)
    }
    fn feedback(
        &mut self,
        _task: &str,
        actions: &[ScoreAction],
        _spec: &FeedbackSpec,
    ) -> Result<Vec<Vec<String>>, TrainError> {
        Ok(actions
            .iter()
            .map(|a| vec!["d".to_string(); a.completions.len()])
            .collect())
    }
    fn describe(&self) -> String {
        "fails at a row".into()
    }
}

#[test]
fn a_reward_failure_checkpoints_only_a_state_the_step_can_resume_from() {
    let settings = [
        "magrpo.rollout_buffer_size=2",
        "magrpo.train_batch_size=2",
        "magrpo.eval_interval=0",
    ];
    // The third row (step 2's first item) fails before step 2 updates anything: the run keeps
    // step 1's state in a checkpoint.
    let tmp = tempfile::tempdir().unwrap();
    let (mut trainer, _) = buffer_trainer(
        tmp.path(),
        &settings,
        4,
        Box::new(FailsAtRow {
            seen: Vec::new(),
            fail_at: 3,
        }),
    );
    let e = trainer.run().unwrap_err();
    assert!(
        matches!(e, TrainError::Reward(_)) && e.to_string().contains("resume with"),
        "{e}"
    );
    assert!(
        cotrain_learner::checkpoint::latest_checkpoint(&tmp.path().join("run"))
            .is_some_and(|c| c.ends_with("step-1"))
    );
    // The fourth row fails after step 2's first item trained: no checkpoint of that mixed state.
    let tmp = tempfile::tempdir().unwrap();
    let (mut trainer, _) = buffer_trainer(
        tmp.path(),
        &settings,
        4,
        Box::new(FailsAtRow {
            seen: Vec::new(),
            fail_at: 4,
        }),
    );
    let e = trainer.run().unwrap_err();
    assert!(
        matches!(e, TrainError::Reward(_)) && !e.to_string().contains("resume with"),
        "{e}"
    );
    assert!(cotrain_learner::checkpoint::latest_checkpoint(&tmp.path().join("run")).is_none());
}
