//! The learning test: on a cooperative task whose reward depends on both agents' outputs, MAGRPO
//! raises the mean joint reward from chance (0.25) to at least 0.8 of the maximum within a fixed
//! seeded budget, and the same run with the advantage sign flipped does not; likewise GRPO with one
//! agent. Tiny model (the committed 2-layer Llama fixture), the in-process engine and a token-level
//! reward behind the trainer's own `RolloutSource` / `RewardSource` traits; the end-to-end test in
//! `tests/` covers the real services.

mod train_common;

use train_common::{TokenRule, config, tiny_model_dir, tiny_trainer};

/// Each agent emits one token from the whole vocabulary (256); reward 1 when both tokens fall in the
/// same class mod 4 (chance 0.25).
fn same_class(t: &[u32]) -> bool {
    t[0] % 4 == t[1] % 4
}

/// One agent: reward 1 for a token ≡ 0 mod 4 (chance 0.25).
fn class_zero(t: &[u32]) -> bool {
    t[0].is_multiple_of(4)
}

fn yaml(section: &str, agents: usize, epochs: usize) -> String {
    format!(
        "model: {{name: unused, temperature: 1.0, top_p: 1.0, top_k: 0, max_length: 64}}\n\
         dataset: {{name: gsm8k, train_split: 'train[:4]'}}\n\
         seed: 11\n\
         {section}:\n  num_agents: {agents}\n  num_generations: 8\n  max_new_tokens: 1\n  learning_rate: 0.002\n  \
         num_train_epochs: {epochs}\n  rollout_buffer_size: 4\n  eval_interval: 1000\n  save_steps: 100000\n  logging_steps: 1\n\
         logging: {{tensorboard: false, plots: false, progress: never}}\n"
    )
}

/// The reward of the first step (sampled before any update: chance) and the mean of the last 5.
fn run(section: &str, agents: usize, rule: fn(&[u32]) -> bool, flip: bool) -> (f64, f64) {
    let overrides: Vec<String> = if flip {
        vec!["reward_processor={enabled: true, scale_factor: -1.0, shift: 0.0}".into()]
    } else {
        vec![]
    };
    let (first, last, _) = run_with(section, agents, rule, &overrides);
    (first, last)
}

/// As [`run`], with config overrides; also returns the metrics of every step.
fn run_with(
    section: &str,
    agents: usize,
    rule: fn(&[u32]) -> bool,
    overrides: &[String],
) -> (f64, f64, Vec<std::collections::BTreeMap<String, f64>>) {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model_dir(tmp.path());
    let cfg = config(&yaml(section, agents, 30), overrides);
    let mut trainer = tiny_trainer(
        &cfg,
        &model,
        &tmp.path().join("run"),
        Box::new(TokenRule { rule }),
        4,
    );
    let summary = trainer.run().unwrap();
    let r: Vec<f64> = summary.history.iter().map(|m| m["reward/mean"]).collect();
    assert_eq!(r.len(), 30);
    let k = 5;
    let first = r[0];
    let last = r[r.len() - k..].iter().sum::<f64>() / k as f64;
    eprintln!(
        "{section} agents={agents} {overrides:?}: first {first:.3} last {last:.3} curve {:?}",
        r.iter()
            .map(|x| (x * 100.0).round() / 100.0)
            .collect::<Vec<_>>()
    );
    (first, last, summary.history)
}

#[test]
fn magrpo_learns_a_cooperative_task_and_the_flipped_sign_does_not() {
    let (first, last) = run("magrpo", 2, same_class, false);
    assert!(first < 0.5, "starts near chance (0.25), got {first}");
    assert!(
        last >= 0.8,
        "MAGRPO should reach >= 0.8 of the maximum reward, got {last}"
    );
    let (_, flipped) = run("magrpo", 2, same_class, true);
    assert!(
        flipped < 0.4,
        "with the advantage sign flipped the reward must not rise, got {flipped}"
    );
}

#[test]
fn grpo_learns_with_one_agent_and_the_flipped_sign_does_not() {
    let (first, last) = run("grpo", 1, class_zero, false);
    assert!(first < 0.5, "starts near chance (0.25), got {first}");
    assert!(
        last >= 0.8,
        "GRPO should reach >= 0.8 of the maximum reward, got {last}"
    );
    let (_, flipped) = run("grpo", 1, class_zero, true);
    assert!(
        flipped < 0.4,
        "with the advantage sign flipped the reward must not rise, got {flipped}"
    );
}

/// Rollouts drawn by bf16 engines for f32 policies (`rollout.dtype: bf16`): the run learns as the
/// f32 one does, the rollout/training log-prob mismatch is measured every step (small, and not
/// zero), and the truncated importance weights correct for it.
#[test]
fn magrpo_learns_with_bf16_rollouts_and_reports_the_precision_gap() {
    let (first, last, h) = run_with("magrpo", 2, same_class, &["rollout.dtype=bf16".into()]);
    assert!(first < 0.5, "starts near chance (0.25), got {first}");
    assert!(
        last >= 0.8,
        "MAGRPO with bf16 rollouts should reach >= 0.8 of the maximum reward, got {last}"
    );
    for m in &h {
        let gap = m["logprob_gap"];
        assert!(
            gap > 0.0 && gap < 0.05,
            "mean |Δ log-prob| per token between bf16 rollout and f32 training: {gap}"
        );
        let w = m["is/weight_mean"];
        assert!(
            w > 0.9 && w <= 1.1,
            "importance weights near 1 for a precision-only mismatch: {w}"
        );
    }
}

/// Training with bf16 products of the f32 master weights (`model.matmul_dtype: bf16`) reaches the
/// reward the f32 run reaches; rollouts stay f32, so the mismatch is measured and corrected.
#[test]
fn magrpo_learns_with_bf16_products_and_f32_master_weights() {
    let (first, last, h) = run_with("magrpo", 2, same_class, &["model.matmul_dtype=bf16".into()]);
    assert!(first < 0.5, "starts near chance (0.25), got {first}");
    assert!(
        last >= 0.8,
        "MAGRPO with bf16 products should reach >= 0.8 of the maximum reward, got {last}"
    );
    assert!(
        h.iter()
            .all(|m| m["logprob_gap"] > 0.0 && m["logprob_gap"] < 0.05),
        "{:?}",
        h.iter().map(|m| m["logprob_gap"]).collect::<Vec<_>>()
    );
}
