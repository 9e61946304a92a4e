//! End to end: the real `reward-server` and `rollout-worker` binaries on ephemeral loopback ports,
//! `learner train` against them for a few MAGRPO steps on a tiny model (CoopHumanEval prompts, the
//! real two-agent code reward in the sandbox), then `learner eval` on the checkpoint it left.

use std::process::Command;
use std::time::Duration;

use cotrain_tests::{binaries, start_service, tiny_model_dir};

#[test]
fn learner_trains_against_real_services_and_leaves_metrics_and_a_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model_dir(tmp.path()).unwrap();
    let reward = start_service(
        "reward-server",
        &[
            "--grpc-addr".into(),
            "127.0.0.1:0".into(),
            "--http-addr".into(),
            "127.0.0.1:0".into(),
        ],
        Duration::from_secs(120),
    )
    .unwrap();
    // Two agents on the same model, trained as separate policies: `--separate-weights` gives each its
    // own copy (without it the worker shares one, and the learner's second weight push is refused).
    let worker = start_service(
        "rollout-worker",
        &[
            "serve".into(),
            "--grpc-addr".into(),
            "127.0.0.1:0".into(),
            "--http-addr".into(),
            "127.0.0.1:0".into(),
            "--agent".into(),
            format!("agent0={}", model.display()),
            "--agent".into(),
            format!("agent1={}", model.display()),
            "--separate-weights".into(),
        ],
        Duration::from_secs(120),
    )
    .unwrap();

    let out_dir = tmp.path().join("out");
    let config = tmp.path().join("e2e.yaml");
    std::fs::write(
        &config,
        format!(
            "model: {{name: '{model}', temperature: 1.0, top_p: 1.0, top_k: 0, max_length: 4096}}\n\
             dataset: {{name: coophumaneval, train_split: 'test[16:20]', eval_split: 'test[:2]'}}\n\
             seed: 3\n\
             output: {{base_dir: '{out}'}}\n\
             magrpo:\n  num_agents: 2\n  num_generations: 2\n  max_new_tokens: 6\n  learning_rate: 0.001\n  \
             num_train_epochs: 1\n  rollout_buffer_size: 2\n  eval_interval: 2\n  eval_num_samples: 2\n  save_steps: 1\n  logging_steps: 1\n\
             logging: {{run_name: e2e, progress: never}}\n\
             rollout: {{endpoints: ['http://{rollout}']}}\n\
             reward: {{endpoint: 'http://{reward}'}}\n",
            model = model.display(),
            out = out_dir.display(),
            rollout = worker.grpc,
            reward = reward.grpc,
        ),
    )
    .unwrap();

    let learner = binaries().unwrap().join("learner");
    let out = Command::new(&learner)
        .args(["train", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "learner train failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    let run_dir = out_dir.join("e2e");
    assert!(
        stdout.contains(&format!("run directory: {}", run_dir.display())),
        "{stdout}"
    );
    assert!(stdout.contains("checkpoint: "), "{stdout}");

    // metrics.jsonl: one line per step (4 rows, 2 per step), with the reward, loss and the time split.
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "{text}");
    for (i, m) in lines.iter().enumerate() {
        assert_eq!(m["step"], i as u64 + 1);
        for k in [
            "reward/mean",
            "reward/std",
            "loss",
            "entropy",
            "completion_len/mean",
            "tokens_per_s",
            "time/generate",
            "time/reward",
            "time/train",
            "time/weight_sync",
        ] {
            assert!(m[k].is_number(), "step {}: {k} missing in {m}", i + 1);
        }
        let len = m["completion_len/mean"].as_f64().unwrap();
        assert!(len > 0.0 && len <= 6.0, "{m}");
    }
    // Every optimiser round pushed a new policy version to the worker.
    let v1 = lines[0]["policy_version"].as_f64().unwrap();
    assert_eq!(lines[1]["policy_version"].as_f64().unwrap(), v1 + 1.0);
    assert!(
        lines[1]["eval/reward/mean"].is_number(),
        "evaluation at step 2: {}",
        lines[1]
    );
    assert!(
        lines[1]["eval/pass@1"].is_number() && lines[1]["eval/maxcoop@1"].is_number(),
        "{}",
        lines[1]
    );
    assert!(std::fs::read_dir(&run_dir).unwrap().any(|e| {
        e.unwrap()
            .file_name()
            .to_string_lossy()
            .starts_with("events.out.tfevents.")
    }));

    // The checkpoint: both agents' weights and optimiser state, and the train state.
    let ckpt = run_dir.join("checkpoints/step-2");
    assert_eq!(
        std::fs::read_to_string(run_dir.join("checkpoints/latest"))
            .unwrap()
            .trim(),
        "step-2"
    );
    for f in [
        "agent-0/model.safetensors",
        "agent-0/optimizer.safetensors",
        "agent-1/model.safetensors",
        "agent-1/optimizer.safetensors",
    ] {
        assert!(ckpt.join(f).metadata().unwrap().len() > 1000, "{f}");
    }
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ckpt.join("state.json")).unwrap()).unwrap();
    assert_eq!(state["step"], 2);
    assert_eq!(state["optimizer_steps"], serde_json::json!([2, 2]));

    // `learner eval` on that checkpoint, against the same services.
    let out = Command::new(&learner)
        .args(["eval", "--config"])
        .arg(&config)
        .arg("--checkpoint")
        .arg(&ckpt)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "learner eval failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let metrics: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(metrics["eval/reward/mean"].is_number(), "{metrics}");
    assert!(ckpt.join("eval.json").is_file());
    drop(worker);
    drop(reward);
}

/// A worker that serves both agents from one shared model (`--share agent0,agent1`) is refused by a
/// learner that trains them as separate policies (each push would overwrite the other policy).
#[test]
fn learner_refuses_a_worker_that_shares_weights_it_trains_separately() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model_dir(tmp.path()).unwrap();
    let reward = start_service(
        "reward-server",
        &[
            "--grpc-addr".into(),
            "127.0.0.1:0".into(),
            "--http-addr".into(),
            "127.0.0.1:0".into(),
        ],
        Duration::from_secs(120),
    )
    .unwrap();
    let worker = start_service(
        "rollout-worker",
        &[
            "serve".into(),
            "--grpc-addr".into(),
            "127.0.0.1:0".into(),
            "--http-addr".into(),
            "127.0.0.1:0".into(),
            "--agent".into(),
            format!("agent0={}", model.display()),
            "--agent".into(),
            format!("agent1={}", model.display()),
            "--share".into(),
            "agent0,agent1".into(),
        ],
        Duration::from_secs(120),
    )
    .unwrap();
    let config = tmp.path().join("shared.yaml");
    std::fs::write(
        &config,
        format!(
            "model: {{name: '{model}', max_length: 4096}}\n\
             dataset: {{name: coophumaneval, train_split: 'test[16:18]'}}\n\
             output: {{base_dir: '{out}'}}\n\
             magrpo: {{num_agents: 2, num_generations: 2, max_new_tokens: 4, rollout_buffer_size: 2}}\n\
             logging: {{run_name: shared, progress: never}}\n\
             rollout: {{endpoints: ['http://{rollout}']}}\n\
             reward: {{endpoint: 'http://{reward}'}}\n",
            model = model.display(),
            out = tmp.path().join("out").display(),
            rollout = worker.grpc,
            reward = reward.grpc,
        ),
    )
    .unwrap();
    let learner = binaries().unwrap().join("learner");
    let out = Command::new(&learner)
        .args(["train", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "training must be refused\nstderr:\n{stderr}"
    );
    assert!(
        stderr.contains("--share") && stderr.contains("agent0"),
        "{stderr}"
    );
}

/// LoRA agents (`model.lora`) served unmerged by the learner's embedded worker
/// (`rollout.lora_serving: unmerged`: both agents' adapters on one base and one engine): `learner
/// train` pushes adapter updates that the worker swaps in per agent, each agent's samples carry its
/// own version (the learner checks every sample's), the checkpoint holds the adapters, and `learner
/// eval` and `learner export --merged` read it back.
#[test]
fn learner_trains_lora_agents_served_unmerged_by_its_embedded_worker() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model_dir(tmp.path()).unwrap();
    let out_dir = tmp.path().join("out");
    let config = tmp.path().join("lora.yaml");
    std::fs::write(
        &config,
        format!(
            "model: {{name: '{model}', temperature: 1.0, top_p: 1.0, top_k: 0, max_length: 4096, lora: {{r: 4, lora_alpha: 8, lora_dropout: 0.0}}}}\n\
             dataset: {{name: coophumaneval, train_split: 'test[16:18]', eval_split: 'test[:1]'}}\n\
             seed: 3\n\
             output: {{base_dir: '{out}'}}\n\
             magrpo:\n  num_agents: 2\n  num_generations: 2\n  max_new_tokens: 6\n  learning_rate: 0.01\n  \
             num_train_epochs: 1\n  rollout_buffer_size: 1\n  eval_interval: 100\n  save_steps: 1\n  logging_steps: 1\n\
             rollout: {{lora_serving: unmerged}}\n\
             logging: {{run_name: lora, progress: never}}\n",
            model = model.display(),
            out = out_dir.display(),
        ),
    )
    .unwrap();
    let learner = binaries().unwrap().join("learner");
    let args = Command::new(&learner)
        .args(["worker-args", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&args.stdout)
            .lines()
            .filter(|l| *l == "agent0,agent1")
            .count(),
        1,
        "{}",
        String::from_utf8_lossy(&args.stdout)
    );

    let out = Command::new(&learner)
        .args(["train", "--config"])
        .arg(&config)
        .env("RUST_LOG", "info,cotrain_rollout_worker::batcher=debug")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "learner train failed\nstderr:\n{stderr}"
    );
    // The worker swapped adapters (unmerged), never merged weights, for both agents.
    for agent in ["agent0", "agent1"] {
        assert!(stderr.lines().any(|l| l.contains("adapter swapped") && l.contains(&format!("agent=\"{agent}\""))), "{agent}: {stderr}");
    }
    assert!(!stderr.contains("weights swapped"), "{stderr}");
    let run_dir = out_dir.join("lora");
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    assert_eq!(text.lines().count(), 2, "{text}");

    let ckpt = run_dir.join("checkpoints/step-2");
    let weights = std::fs::metadata(ckpt.join("agent-0/model.safetensors"))
        .unwrap()
        .len();
    let base = std::fs::metadata(model.join("model.safetensors"))
        .unwrap()
        .len();
    assert!(
        weights * 4 < base,
        "the checkpoint holds the adapter ({weights} bytes), not the model ({base} bytes)"
    );
    let out = Command::new(&learner)
        .args(["eval", "--config"])
        .arg(&config)
        .arg("--checkpoint")
        .arg(&ckpt)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "learner eval failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let exported = tmp.path().join("exported");
    let out = Command::new(&learner)
        .args(["export", "--checkpoint"])
        .arg(&ckpt)
        .arg("--out")
        .arg(&exported)
        .arg("--merged")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "learner export failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    for d in [
        "agent-0/adapter_config.json",
        "agent-1/adapter_model.safetensors",
        "agent-0-merged/model.safetensors",
    ] {
        assert!(exported.join(d).is_file(), "{d}");
    }
}
