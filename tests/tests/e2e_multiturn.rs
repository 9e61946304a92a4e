//! End to end, multi-turn: the real `reward-server` and two real `rollout-worker`s on loopback ports
//! (one serving the two trained agents, one serving an "expert" model on its OpenAI-compatible HTTP
//! API), and `learner train` running a 2-turn MAGRPO step on CoopHumanEval rows with each external
//! mode: `level_feedback`, `level_passed`, `passed`, `plain` (feedback from the reward server's
//! sandboxed analysis) and `expert_edits` (edits asked of the expert worker). Each run's
//! `rollouts.jsonl` must show turn-2 prompts built by that mode.

use std::process::Command;
use std::time::Duration;

use cotrain_tests::{binaries, start_service, tiny_model_dir};

fn worker(agents: &[(&str, &std::path::Path)]) -> cotrain_tests::Service {
    let mut args: Vec<String> = [
        "serve",
        "--grpc-addr",
        "127.0.0.1:0",
        "--http-addr",
        "127.0.0.1:0",
        "--separate-weights",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for (name, dir) in agents {
        args.push("--agent".into());
        args.push(format!("{name}={}", dir.display()));
    }
    start_service("rollout-worker", &args, Duration::from_secs(120)).unwrap()
}

/// A plain HTTP/1.0 GET (the body).
fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or(out)
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn every_external_mode_builds_turn_two_prompts_through_the_real_services() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model_dir(tmp.path()).unwrap();
    // The expert: the same tiny model with a chat template, so that /v1/chat/completions serves it.
    let expert_dir = tmp.path().join("expert");
    std::fs::create_dir_all(&expert_dir).unwrap();
    for f in [
        "model.safetensors",
        "generation_config.json",
        "config.json",
        "tokenizer.json",
    ] {
        std::fs::copy(model.join(f), expert_dir.join(f)).unwrap();
    }
    std::fs::write(
        expert_dir.join("tokenizer_config.json"),
        r#"{"chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "}"#,
    )
    .unwrap();
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
    let agents = worker(&[("agent0", &model), ("agent1", &model)]);
    let expert = worker(&[("expert", &expert_dir)]);
    let expert_http = expert.http.clone();
    let learner = binaries().unwrap().join("learner");

    // (mode, rollout variant, what every turn-2 prompt must contain, what it must not), in cotrain's
    // wording (`next_turn_prompt: cotrain`); the originals' wordings are checked byte for byte against
    // their fixtures in learner/tests/next_turn_prompts.rs.
    let cases = [
        (
            "level_feedback",
            "tree",
            "Feedback:\n- Helper function `aux`",
            "- Implementation:",
        ),
        ("level_passed", "handoff", "- Implementation: ", "Feedback:"),
        ("passed", "handoff", "levels passed.", "Feedback:"),
        ("plain", "handoff", "Your previous response:\n", "Feedback:"),
        (
            "expert_edits",
            "tree",
            "Revise your function `",
            "Feedback:",
        ),
    ];
    for (mode, variant, must, must_not) in cases {
        let out_dir = tmp.path().join(format!("out-{mode}"));
        let config = tmp.path().join(format!("{mode}.yaml"));
        std::fs::write(
            &config,
            format!(
                "model: {{name: '{model}', temperature: 1.0, top_p: 1.0, top_k: 0, max_length: 4096}}\n\
                 dataset: {{name: coophumaneval, train_split: 'test[16:18]', eval_split: 'test[:1]'}}\n\
                 seed: 3\n\
                 output: {{base_dir: '{out}'}}\n\
                 external: {{mode: {mode}, next_turn_prompt: cotrain, sandbox_slice: 1, original_prompt: false, previous_response: true, \
                 expert_model: expert, expert_base_url: 'http://{expert_http}/v1', expert_max_tokens: 8, expert_timeout_secs: 60}}\n\
                 magrpo:\n  num_agents: 2\n  num_turns: 2\n  rollout: {variant}\n  handoff: best\n  num_generations: 2\n  max_new_tokens: 6\n  \
                 learning_rate: 0.001\n  num_train_epochs: 1\n  rollout_buffer_size: 2\n  eval_interval: 1000\n  save_steps: 100\n  logging_steps: 1\n  \
                 turn_gradient_weights: [1.2, 0.8]\n  early_termination_threshold: 4.0\n\
                 logging: {{run_name: mt, progress: never, rollouts: true, plots: false}}\n\
                 rollout: {{endpoints: ['http://{rollout}']}}\n\
                 reward: {{endpoint: 'http://{reward}'}}\n",
                model = model.display(),
                out = out_dir.display(),
                rollout = agents.grpc,
                reward = reward.grpc,
            ),
        )
        .unwrap();
        let out = Command::new(&learner)
            .args(["train", "--config"])
            .arg(&config)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "{mode}: learner train failed\n{stderr}"
        );
        // Logs that go to a pipe or a file carry no colour codes.
        assert!(
            !stderr.contains('\u{1b}'),
            "{mode}: ANSI escape codes in the learner's piped log:\n{stderr}"
        );
        let run_dir = out_dir.join("mt");
        let metrics: serde_json::Value = serde_json::from_str(
            std::fs::read_to_string(run_dir.join("metrics.jsonl"))
                .unwrap()
                .lines()
                .next()
                .unwrap(),
        )
        .unwrap();
        for k in [
            "turn_1/reward/mean",
            "turn_2/reward/mean",
            "turn_2/nodes",
            "nodes_per_item",
            "early_terminations",
            "prompt_truncations",
            "time/transition",
        ] {
            assert!(metrics[k].is_number(), "{mode}: {k} missing in {metrics}");
        }
        let nodes: Vec<serde_json::Value> = std::fs::read_to_string(run_dir.join("rollouts.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let turn2: Vec<&serde_json::Value> = nodes.iter().filter(|n| n["turn"] == 2).collect();
        // Tree: one child per joint action (G = 2) per item; handoff: one per item (no early stop: the
        // tiny model's code never reaches reward 4).
        let per_item = if variant == "tree" { 2 } else { 1 };
        assert_eq!(
            turn2.len(),
            2 * per_item,
            "{mode}: {} turn-2 nodes",
            turn2.len()
        );
        assert_eq!(
            metrics["turn_2/nodes"].as_f64().unwrap(),
            turn2.len() as f64,
            "{mode}"
        );
        for n in &turn2 {
            for a in 0..2 {
                let prompt = n["agents"][a]["prompt"].as_str().unwrap();
                assert!(
                    prompt.contains(must),
                    "{mode}: agent {a}'s turn-2 prompt lacks {must:?}:\n{prompt}"
                );
                assert!(
                    !prompt.contains(must_not),
                    "{mode}: agent {a}'s turn-2 prompt has {must_not:?}:\n{prompt}"
                );
                assert!(
                    prompt.trim_end().ends_with("call it where it helps.") == (a == 1),
                    "{mode}: {prompt}"
                );
            }
            assert_eq!(n["turn_weight"].as_f64().unwrap(), 0.8, "{mode}");
            assert!(n["parent_id"].is_u64(), "{mode}");
            // The tiny expert writes no JSON: every turn-2 prompt went without edits, and says why.
            assert_eq!(
                n["expert_failure"].is_string(),
                mode == "expert_edits",
                "{mode}: {}",
                n["expert_failure"]
            );
        }
        let failures = if mode == "expert_edits" {
            turn2.len() as f64
        } else {
            0.0
        };
        assert_eq!(
            metrics["expert_failures"].as_f64(),
            Some(failures),
            "{mode}: {metrics}"
        );
    }
    // An expert that refuses the requests (here: a model it does not serve) stops the run, naming the
    // keys to check, rather than training every turn on plain "revise" prompts.
    let config = tmp.path().join("expert_edits.yaml");
    let refused = std::fs::read_to_string(&config)
        .unwrap()
        .replace("expert_model: expert,", "expert_model: nosuch,");
    std::fs::write(&config, refused).unwrap();
    let out = Command::new(&learner)
        .args(["train", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a refusing expert did not stop the run\n{stderr}"
    );
    assert!(
        stderr.contains("refused a request") && stderr.contains("external.expert_model"),
        "{stderr}"
    );
    // The expert worker was asked (the tiny model's replies are no JSON, so the learner retried and
    // then carried on with a plain request to revise, as it must).
    let text = http_get(&expert_http, "/metrics");
    assert!(
        metric(&text, "cotrain_rollout_generated_tokens_total") > 0.0,
        "the expert worker generated nothing:\n{text}"
    );
    drop(expert);
    drop(agents);
    drop(reward);
}
