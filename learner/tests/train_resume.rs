//! Resume: N steps straight equal N/2 steps, a stop (as if killed right after the checkpoint), and
//! N/2 steps resumed from that checkpoint: the same data order, the same samples, the same metrics
//! and the same final weights and optimiser state. Also: the checkpoint layout, and that an
//! interrupted write (a leftover temporary directory) leaves the previous checkpoint usable.

mod train_common;

use cotrain_learner::checkpoint::latest_checkpoint;
use train_common::{TokenRule, config, tiny_model_dir, tiny_trainer};

fn same_class(t: &[u32]) -> bool {
    t[0] % 4 == t[1] % 4
}

const YAML: &str = "model: {name: unused, temperature: 1.0, top_p: 1.0, top_k: 0, max_length: 64}\n\
dataset: {name: gsm8k, train_split: 'train[:5]'}\n\
seed: 5\n\
magrpo:\n  num_agents: 2\n  num_generations: 4\n  max_new_tokens: 3\n  learning_rate: 0.002\n  num_train_epochs: 3\n  \
rollout_buffer_size: 2\n  train_batch_size: 3\n  eval_interval: 1000\n  save_steps: 4\n  logging_steps: 1\n\
logging: {tensorboard: true, plots: false, progress: never, rollouts: true}\n";

const COMPARED: &[&str] = &[
    "reward/mean",
    "reward/std",
    "loss",
    "entropy",
    "grad_norm",
    "completion_len/mean",
    "epoch",
];

#[test]
fn resumed_run_equals_an_uninterrupted_one() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model_dir(tmp.path());
    let cfg = config(YAML, &[]);

    // 5 rows, 2 per step: 3 steps per epoch (the last one with a single row), 9 steps in 3 epochs.
    let straight_dir = tmp.path().join("straight");
    let mut straight = tiny_trainer(
        &cfg,
        &model,
        &straight_dir,
        Box::new(TokenRule { rule: same_class }),
        5,
    );
    assert_eq!(straight.total_steps(), 9);
    let full = straight.run().unwrap();
    assert_eq!(full.steps, 9);

    let split_dir = tmp.path().join("split");
    let mut first = tiny_trainer(
        &cfg,
        &model,
        &split_dir,
        Box::new(TokenRule { rule: same_class }),
        5,
    );
    first.stop_after_steps = Some(4);
    let part1 = first.run().unwrap();
    assert_eq!(part1.steps, 4);
    drop(first);
    let ckpt = latest_checkpoint(&split_dir).expect("checkpoint at step 4");
    assert!(ckpt.ends_with("step-4"), "{}", ckpt.display());
    for f in [
        "state.json",
        "agent-0/model.safetensors",
        "agent-0/optimizer.safetensors",
        "agent-1/model.safetensors",
    ] {
        assert!(ckpt.join(f).is_file(), "missing {f}");
    }
    // Killed after logging step 5's rollouts but before its checkpoint: the resumed run logs step 5
    // again, so the first copy must go.
    use std::io::Write as _;
    let mut log = std::fs::OpenOptions::new()
        .append(true)
        .open(split_dir.join("rollouts.jsonl"))
        .unwrap();
    writeln!(log, "{{\"step\":5,\"marker\":\"logged before the kill\"}}").unwrap();
    // A write killed half-way leaves a temporary directory behind; the latest complete one is used.
    std::fs::create_dir_all(split_dir.join("checkpoints/.tmp-step-8-999/agent-0")).unwrap();
    std::fs::write(
        split_dir.join("checkpoints/.tmp-step-8-999/agent-0/model.safetensors"),
        b"partial",
    )
    .unwrap();

    let mut second = tiny_trainer(
        &cfg,
        &model,
        &split_dir,
        Box::new(TokenRule { rule: same_class }),
        5,
    );
    assert!(
        !split_dir.join("checkpoints/.tmp-step-8-999").exists(),
        "the next run removes the partial checkpoint"
    );
    second.resume(&split_dir).unwrap();
    assert_eq!(second.step(), 4);
    let part2 = second.run().unwrap();
    assert_eq!(part2.steps, 9);

    let resumed: Vec<_> = part1.history.iter().chain(&part2.history).collect();
    assert_eq!(resumed.len(), full.history.len());
    for (i, (a, b)) in full.history.iter().zip(&resumed).enumerate() {
        for k in COMPARED {
            let (x, y) = (a[*k], b[*k]);
            assert!(
                (x - y).abs() <= 1e-6 * (1.0 + x.abs()),
                "step {}: {k} straight {x} vs resumed {y}",
                i + 1
            );
        }
    }
    // The learning actually moved the weights, and both runs end on the same ones.
    for (p, q) in straight.policies().iter().zip(second.policies()) {
        let (pa, qa) = (p.parameters(), q.parameters());
        for (name, t) in &pa {
            let diff = (t - &qa[name]).abs().max().double_value(&[]);
            assert!(diff <= 1e-6, "{name} differs by {diff}");
        }
        assert_eq!(p.optimizer.step, q.optimizer.step);
        assert_eq!(p.optimizer.step, 9);
    }
    // metrics.jsonl of the split run holds every step once, in order.
    let lines = cotrain_learner::metrics::read_metrics(&split_dir.join("metrics.jsonl")).unwrap();
    assert_eq!(
        lines.iter().map(|r| r.step).collect::<Vec<_>>(),
        (1..=9).collect::<Vec<_>>()
    );
    assert!(latest_checkpoint(&split_dir).unwrap().ends_with("step-9"));
    // rollouts.jsonl likewise: every step's nodes once, in order, as the uninterrupted run's.
    let steps = |dir: &std::path::Path| -> Vec<u64> {
        let text = std::fs::read_to_string(dir.join("rollouts.jsonl")).unwrap();
        assert!(
            !text.contains("logged before the kill"),
            "the resumed run kept a step logged after its checkpoint"
        );
        text.lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                    .as_u64()
                    .unwrap()
            })
            .collect()
    };
    assert_eq!(steps(&split_dir), steps(&straight_dir));
}

/// `output.save_total_limit` (Hugging Face's meaning): a 4-step run saving every step with a limit of
/// 2 leaves exactly the newest 2 checkpoints, and `latest` names the last.
#[test]
fn save_total_limit_keeps_the_newest_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model_dir(tmp.path());
    let yaml = YAML
        .replace("save_steps: 4", "save_steps: 1")
        .replace("num_train_epochs: 3", "num_train_epochs: 2");
    let cfg = config(&yaml, &["output.save_total_limit=2".into()]);
    let dir = tmp.path().join("run");
    let mut trainer = tiny_trainer(
        &cfg,
        &model,
        &dir,
        Box::new(TokenRule { rule: same_class }),
        5,
    );
    trainer.stop_after_steps = Some(4);
    assert_eq!(trainer.run().unwrap().steps, 4);
    let mut kept: Vec<String> = std::fs::read_dir(dir.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    kept.sort();
    assert_eq!(kept, ["step-3", "step-4"]);
    assert!(latest_checkpoint(&dir).unwrap().ends_with("step-4"));
    let v = cotrain_learner::config::merged_value(
        &yaml,
        "test.yaml",
        &["output.save_total_limit=0".into()],
        &Default::default(),
    )
    .unwrap();
    let e =
        cotrain_learner::config::CheckedConfig::from_value(v, std::path::Path::new("test.yaml"))
            .unwrap_err()
            .to_string();
    assert!(
        e.contains("output.save_total_limit") && e.contains("at least 1"),
        "{e}"
    );
}
