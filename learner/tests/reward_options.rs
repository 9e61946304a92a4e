//! The reward options a learner config names reach the reward server with every scoring call:
//! the embedded reward server (the same gRPC client and server the trainer uses) scores the same
//! joint actions differently when the config's `reward` section changes.

use std::path::Path;
use std::time::Duration;

use cotrain_learner::config::{CheckedConfig, LegacyFlags, merged_value};
use cotrain_learner::services::{GrpcReward, embedded::EmbeddedReward};
use cotrain_learner::trainer::{RewardSource, Score, ScoreAction};

fn config(extra: &str) -> CheckedConfig {
    let yaml = format!("model: {{name: m}}\ndataset: {{name: humaneval}}\nmagrpo: {{}}\n{extra}");
    CheckedConfig::from_value(
        merged_value(&yaml, "t.yaml", &[], &LegacyFlags::default()).unwrap(),
        Path::new("t.yaml"),
    )
    .unwrap()
}

/// Scores one joint action through a client that sends `cfg`'s reward options, as the trainer's does.
fn score(
    reward: &EmbeddedReward,
    rt: &std::sync::Arc<tokio::runtime::Runtime>,
    cfg: &CheckedConfig,
    task: &str,
    action: ScoreAction,
) -> Score {
    let mut client = GrpcReward::connect(
        rt.clone(),
        &reward.grpc.to_string(),
        Duration::from_secs(60),
        None,
    )
    .unwrap()
    .with_options(&cfg.score_options);
    client.score(task, &[action]).unwrap().remove(0)
}

#[test]
fn config_reward_options_change_what_the_reward_server_computes() {
    let rt = cotrain_learner::services::runtime().unwrap();
    let server = EmbeddedReward::start(rt.clone()).unwrap();

    // arXiv length ratio ρ ≈ 1.40 (both texts 150 words): the newest table gives level 2 = 1.0,
    // the earlier one 1 − (ρ − 1.3)/0.2.
    let words = |n: usize, w: &str| vec![w; n].join(" ");
    // 150 words of 4 and of 6 characters: ρ = (150·7 − 1)/(150·5 − 1) ≈ 1.40.
    let first = words(150, "aaaa");
    let second = words(150, "bbbbbb");
    let rho = second.chars().count() as f64 / first.chars().count() as f64;
    assert!((1.3..1.5).contains(&rho), "{rho}");
    let arxiv = || ScoreAction {
        completions: vec![first.clone(), second.clone()],
        completion_ids: vec![vec![], vec![]],
        item: serde_json::json!({"article_id": "1", "abstract_text": "x"}),
    };
    let level2 = |cfg: &CheckedConfig| score(&server, &rt, cfg, "arxiv", arxiv()).levels["level_2"];
    assert_eq!(level2(&config("")), 1.0);
    let earlier = 1.0 - (rho - 1.3) / 0.2;
    assert!((level2(&config("reward: {writing_ratio_version: earlier}\n")) - earlier).abs() < 1e-9);
    assert!(
        (level2(&config("reward: {options: {arxiv_ratio: earlier}}\n")) - earlier).abs() < 1e-9
    );

    // Code: a single agent's solution whose outer `return` follows a nested helper. The original's
    // line rules lose everything after the nested def (main returns None: 0.6 + 0.5 = 1.1); the
    // structural reading keeps the whole function (all tests pass: 2.1).
    let item = serde_json::json!({
        "task_id": "t/0",
        "prompt": "def double(x):\n    \"\"\"Twice x.\"\"\"\n",
        "test": "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(3) == 6\n",
        "entry_point": "double",
    });
    let main = "def double(x):\n    def helper(y):\n        return y * 2\n    r = helper(x)\n    return r\n";
    let action = || ScoreAction {
        completions: vec![main.to_string()],
        completion_ids: vec![vec![]],
        item: item.clone(),
    };
    assert!((score(&server, &rt, &config(""), "code", action()).reward - 1.1).abs() < 1e-9);
    let structural = config("reward: {options: {code_functions: structural}}\n");
    assert!((score(&server, &rt, &structural, "code", action()).reward - 2.1).abs() < 1e-9);
}
