//! The learned verifier end to end, every piece a real process: `learner verifier balance` and
//! `learner verifier train` on a toy data file (an answer is correct when it contains the word
//! `h`), a `rollout-worker` serving the trained directory (`--verifier toy=DIR`), and a
//! `reward-server --verifier-endpoint` answering MaPoRL's `POST /predict` to a plain HTTP client:
//! the scores equal the directory's own scores, correct answers score higher, bad bodies get 400
//! with MaPoRL's error shape, concurrent clients get the same scores, OpenRLHF's `/get_reward` with
//! verifier labels and the native `/v1/verify` agree, and a dead worker gives 503. Then the whole
//! pipeline on GSM8K with the default model, ending in a MaPoRL run scored by the verifier.

use std::io::{Read, Write};
use std::process::Command;
use std::time::Duration;

use cotrain_tests::{binaries, start_service, workspace_root};
use serde_json::{Value, json};

const WORDS: [&str; 12] = [
    "<pad>", "<s>", "</s>", "a", "b", "c", "d", "e", "f", "g", "h", "q",
];

/// The committed tiny Llama cut to the 12 words above, with a word-level tokenizer.
fn word_model(dir: &std::path::Path) -> std::path::PathBuf {
    let src = workspace_root().join("model/tests/fixtures/tiny/llama");
    let out = dir.join("word-llama");
    std::fs::create_dir_all(&out).unwrap();
    let vocab = 16i64;
    let tensors: Vec<(String, tch::Tensor)> =
        tch::Tensor::read_safetensors(src.join("model.safetensors"))
            .unwrap()
            .into_iter()
            .map(|(k, t)| {
                if k.contains("embed_tokens") || k.contains("lm_head") {
                    (k, t.narrow(0, 0, vocab).contiguous())
                } else {
                    (k, t)
                }
            })
            .collect();
    tch::Tensor::write_safetensors(&tensors, out.join("model.safetensors")).unwrap();
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    config["vocab_size"] = json!(vocab);
    std::fs::write(out.join("config.json"), config.to_string()).unwrap();
    std::fs::write(
        out.join("generation_config.json"),
        r#"{"bos_token_id": 1, "eos_token_id": 2}"#,
    )
    .unwrap();
    let vocab_json: serde_json::Map<String, Value> = WORDS
        .iter()
        .enumerate()
        .map(|(i, w)| (w.to_string(), json!(i)))
        .collect();
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": 2, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab_json, "unk_token": "q"}
    });
    std::fs::write(out.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    out
}

/// `n` questions with 10 answers each (six space-separated letters a–h), correct iff one is `h`.
fn toy_data(n: usize) -> Value {
    let mut state = 12345u64;
    let mut next = || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) as usize
    };
    let mut obj = serde_json::Map::new();
    for q in 0..n {
        let answers: Vec<String> = (0..10)
            .map(|_| {
                (0..6)
                    .map(|_| WORDS[3 + next() % 8])
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect();
        let rewards: Vec<i32> = answers.iter().map(|a| i32::from(a.contains('h'))).collect();
        obj.insert(
            format!("q {q}"),
            json!({"original_answer": "", "generated_answers": answers, "rewards": rewards}),
        );
    }
    Value::Object(obj)
}

/// POSTs `body` to `http://addr/path` with a plain HTTP/1.0 client; (status, JSON body).
fn post(addr: &str, path: &str, body: &str) -> (u16, Value) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(s, "POST {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out.split(' ').nth(1).unwrap().parse().unwrap();
    let json = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| serde_json::from_str(b).unwrap_or(Value::Null))
        .unwrap();
    (status, json)
}

fn get(addr: &str, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

fn learner(args: &[&str]) -> String {
    let out = Command::new(binaries().unwrap().join("learner"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "learner {args:?} failed\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_trained_verifier_is_served_on_predict() {
    let tmp = tempfile::tempdir().unwrap();
    let model = word_model(tmp.path());
    let raw = tmp.path().join("raw.json");
    std::fs::write(&raw, serde_json::to_string(&toy_data(48)).unwrap()).unwrap();

    // Balance to 3 + 3 per question, then train.
    let balanced = tmp.path().join("balanced.json");
    let report = learner(&[
        "verifier",
        "balance",
        "--in",
        raw.to_str().unwrap(),
        "--out",
        balanced.to_str().unwrap(),
        "--per-type",
        "3",
    ]);
    assert!(report.contains("questions kept"), "{report}");
    let config = tmp.path().join("v.yaml");
    std::fs::write(
        &config,
        format!(
            "model: {{name: '{}', chat_template: false}}\ndataset: {{name: gsm8k, type: gsm8k}}\nseed: 3\nmaporl: {{}}\n\
             logging: {{progress: never, tensorboard: false}}\n\
             verifier: {{user_template: '{{{{ question }}}}', test_questions: 8, num_train_epochs: 12, learning_rate: 0.003, \
             per_device_train_batch_size: 8, gradient_accumulation_steps: 1, warmup_steps: 1, max_length: 32}}\n",
            model.display()
        ),
    )
    .unwrap();
    let vdir = tmp.path().join("verifier");
    let printed = learner(&[
        "verifier",
        "train",
        "--config",
        config.to_str().unwrap(),
        "--data",
        balanced.to_str().unwrap(),
        "--out",
        vdir.to_str().unwrap(),
    ]);
    println!("{printed}");

    let worker_args: Vec<String> = [
        "serve",
        "--grpc-addr",
        "127.0.0.1:0",
        "--http-addr",
        "127.0.0.1:0",
        "--agent",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([
        format!("a={}", model.display()),
        "--verifier".into(),
        format!("toy={}", vdir.display()),
    ])
    .collect();
    let worker = start_service("rollout-worker", &worker_args, Duration::from_secs(120)).unwrap();
    let reward_args: Vec<String> = [
        "--grpc-addr",
        "127.0.0.1:0",
        "--http-addr",
        "127.0.0.1:0",
        "--verifier-endpoint",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([format!("http://{}", worker.grpc)])
    .collect();
    let reward = start_service("reward-server", &reward_args, Duration::from_secs(60)).unwrap();

    // MaPoRL's request: [user, assistant] message pairs.
    let answers = [
        "a b c d e f",
        "a h c d e f",
        "g g g g g g",
        "h b h d h f",
        "b c d e f g",
        "h a a a a a",
    ];
    let body = json!({"query_responses": answers.iter().map(|a| json!([{"role": "user", "content": "q"}, {"role": "assistant", "content": a}])).collect::<Vec<_>>()});
    let (status, reply) = post(&reward.http, "/predict", &body.to_string());
    assert_eq!(status, 200, "{reply}");
    let scores: Vec<f64> = reply["result"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    assert_eq!(scores.len(), answers.len());
    assert!(scores.iter().all(|s| (0.0..=1.0).contains(s)), "{scores:?}");
    // The same numbers as the directory scores itself.
    let v = cotrain_model::verifier::Verifier::load(
        &vdir,
        &cotrain_model::loader::LoadOptions::default(),
    )
    .unwrap();
    let enc: Vec<_> = answers.iter().map(|a| v.encode("q", a).unwrap()).collect();
    let direct = v.score(&enc.iter().collect::<Vec<_>>()).unwrap();
    for (s, d) in scores.iter().zip(&direct) {
        assert!((s - f64::from(*d)).abs() < 1e-5, "{scores:?} vs {direct:?}");
    }
    let with_h = |want: bool| {
        scores
            .iter()
            .zip(&answers)
            .filter(move |(_, a)| a.contains('h') == want)
            .map(|(s, _)| *s)
    };
    let min_h = with_h(true).fold(f64::MAX, f64::min);
    let max_no = with_h(false).fold(f64::MIN, f64::max);
    assert!(
        min_h > max_no,
        "every answer with h scores above every answer without: {scores:?}"
    );

    // Bad bodies: 400 with MaPoRL's {"error": "..."}.
    for (bad, says) in [
        ("not json", "not JSON"),
        (r#"{"queries": []}"#, "query_responses"),
        (r#"{"query_responses": []}"#, "non-empty"),
        (
            r#"{"query_responses": [[{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]]}"#,
            "query_responses[0][0].role",
        ),
        (
            r#"{"query_responses": [[{"role": "user", "content": "x"}]]}"#,
            "[user, assistant]",
        ),
    ] {
        let (status, reply) = post(&reward.http, "/predict", bad);
        assert_eq!(status, 400, "{bad}: {reply}");
        assert!(
            reply["error"].as_str().unwrap().contains(says),
            "{bad}: {reply}"
        );
    }

    // Concurrent clients get what a lone client gets.
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let (addr, body) = (reward.http.clone(), body.to_string());
            std::thread::spawn(move || post(&addr, "/predict", &body))
        })
        .collect();
    for t in threads {
        let (status, r) = t.join().unwrap();
        assert_eq!(status, 200);
        let got: Vec<f64> = r["result"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert!(
            got.iter().zip(&scores).all(|(a, b)| (a - b).abs() < 1e-6),
            "{got:?} vs {scores:?}"
        );
    }
    // OpenRLHF's /get_reward with verifier labels: the query minus its prompt is the answer.
    let queries: Vec<String> = answers.iter().map(|a| format!("PROMPT {a}")).collect();
    let labels: Vec<String> = answers
        .iter()
        .map(|_| json!({"task": "verifier", "item": {"user": "q"}}).to_string())
        .collect();
    let (status, r) = post(
        &reward.http,
        "/get_reward",
        &json!({"query": queries, "prompts": vec!["PROMPT "; answers.len()], "labels": labels})
            .to_string(),
    );
    assert_eq!(status, 200, "{r}");
    let rewards: Vec<f64> = r["rewards"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    assert!(
        rewards
            .iter()
            .zip(&scores)
            .all(|(a, b)| (a - b).abs() < 1e-6),
        "{rewards:?} vs {scores:?}"
    );
    // The native form names the verifier.
    let (status, r) = post(
        &reward.http,
        "/v1/verify",
        &json!({"conversations": [{"user": "q", "assistant": "h h"}]}).to_string(),
    );
    assert_eq!((status, r["verifier"].as_str()), (200, Some("toy")), "{r}");
    assert!(get(&reward.http, "/metrics").contains("http.predict"));
    assert!(
        get(&worker.http, "/metrics")
            .contains("cotrain_rollout_verifier_conversations_total{verifier=\"toy\"} ")
    );

    // The worker dies: 503.
    drop(worker);
    let (status, r) = post(&reward.http, "/predict", &body.to_string());
    assert_eq!(status, 503, "{r}");
    assert!(
        r["error"].as_str().unwrap().contains("cannot be reached"),
        "{r}"
    );
}

/// The issue's pipeline on a few GSM8K questions with the embedded default model, every step the
/// `learner` binary as a user runs it: generate (and resume), balance, train, then a short MaPoRL
/// run whose s(t, i) is the verifier's probability, served by the embedded rollout worker.
#[test]
fn generate_balance_train_and_a_maporl_run_scored_by_the_verifier() {
    let tmp = tempfile::tempdir().unwrap();
    let root = workspace_root();
    let cfg = root.join("configs/maporl_gsm8k_config.yaml");
    let raw = tmp.path().join("raw.json");
    let common = [
        "model.name=default",
        "verifier.samples_per_question=4",
        "verifier.max_new_tokens=16",
        "logging.progress=never",
    ];
    let generate = |split: &str| {
        let mut args = vec![
            "verifier",
            "generate",
            "--config",
            cfg.to_str().unwrap(),
            "--out",
            raw.to_str().unwrap(),
            "--override",
        ];
        let split = format!("dataset.train_split={split}");
        args.extend(common.iter().copied());
        args.push(&split);
        learner(&args)
    };
    let first = generate("train[:3]");
    assert!(
        first.contains("3 questions sampled (0 already in the file), 12 answers"),
        "{first}"
    );
    // Interrupted and rerun on a larger split: only the new question is sampled.
    let second = generate("train[:4]");
    assert!(
        second.contains("1 questions sampled (3 already in the file), 4 answers"),
        "{second}"
    );
    let data: Value = serde_json::from_str(&std::fs::read_to_string(&raw).unwrap()).unwrap();
    let entries = data.as_object().unwrap();
    assert_eq!(entries.len(), 4);
    for (q, e) in entries {
        assert!(
            !q.is_empty() && e["original_answer"].as_str().unwrap().contains("####"),
            "{q}: {e}"
        );
        assert_eq!(e["generated_answers"].as_array().unwrap().len(), 4);
        assert!(
            e["rewards"]
                .as_array()
                .unwrap()
                .iter()
                .all(|r| r == 0.0 || r == 1.0),
            "{e}"
        );
    }

    // Balance with filling: one question is made to hold only its reference solution (no wrong
    // answer), so filling must sample a wrong one; the others get their reference as the correct one.
    let mut edited = data.clone();
    let first = edited.as_object_mut().unwrap().values_mut().next().unwrap();
    let reference = first["original_answer"].clone();
    first["generated_answers"] = json!([reference]);
    first["rewards"] = json!([1]);
    first.as_object_mut().unwrap().remove("generated_label");
    let edited_path = tmp.path().join("edited.json");
    std::fs::write(&edited_path, edited.to_string()).unwrap();
    let balanced = tmp.path().join("balanced.json");
    let report = learner(&[
        "verifier",
        "balance",
        "--in",
        edited_path.to_str().unwrap(),
        "--out",
        balanced.to_str().unwrap(),
        "--per-type",
        "1",
        "--config",
        cfg.to_str().unwrap(),
        "--override",
        "model.name=default",
        "verifier.max_new_tokens=24",
        "logging.progress=never",
    ]);
    println!("{report}");
    assert!(report.contains("filled: 3 reference solutions"), "{report}");
    assert!(report.contains("4 questions kept, 0 dropped"), "{report}");
    let filled: Value = serde_json::from_str(&std::fs::read_to_string(&balanced).unwrap()).unwrap();
    for (q, e) in filled.as_object().unwrap() {
        let r: Vec<f64> = e["rewards"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(r, [1.0, 0.0], "{q}: one correct and one incorrect answer");
    }
    let vdir = tmp.path().join("verifier");
    learner(&[
        "verifier",
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--data",
        balanced.to_str().unwrap(),
        "--out",
        vdir.to_str().unwrap(),
        "--override",
        "model.name=default",
        "verifier.test_questions=1",
        "verifier.max_length=160",
        "logging.progress=never",
    ]);
    assert!(
        vdir.join("verifier.json").is_file() && vdir.join("adapter/adapter_config.json").is_file()
    );

    let out_dir = tmp.path().join("runs");
    let out = Command::new(binaries().unwrap().join("learner"))
        .current_dir(&root)
        .args([
            "train",
            "--config",
            cfg.to_str().unwrap(),
            "--override",
            "model.name=default",
            "maporl.score=verifier",
        ])
        .arg(format!("maporl.verifier_path={}", vdir.display()))
        .args([
            "dataset.train_split=train[:1]",
            "dataset.eval_split=test[:1]",
            "maporl.round_num=2",
            "maporl.max_output_length=12",
            "maporl.invalid_penalty=false",
            "maporl.gradient_accumulation_steps=1",
            "maporl.num_train_epochs=1",
            "maporl.num_ppo_epochs=1",
            "maporl.num_mini_batches=1",
            "maporl.eval_interval=1000",
            "maporl.eval_num_samples=1",
            "logging.rollouts=true",
            "logging.progress=never",
            "logging.run_name=scored",
            // The verifier scores the answers as sampled, so that this test can score the logged text
            // itself (by default it scores MaPoRL's rewrite, which learner/tests/maporl_prompts.rs checks).
            "maporl.rewrite_answers=false",
            "output.save_final_model=false",
        ])
        .arg(format!("output.base_dir={}", out_dir.display()))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "learner train failed\n{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // s(t, i) of every answer is the verifier's probability for (user message, answer); the user
    // message is the answering agent's turn-0 question message, as the original sends it (the
    // message text `learner show-prompts` prints without the chat template).
    let v = cotrain_model::verifier::Verifier::load(
        &vdir,
        &cotrain_model::loader::LoadOptions::default(),
    )
    .unwrap();
    let lines: Vec<Value> = std::fs::read_to_string(out_dir.join("scored/rollouts.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2 * 2);
    let shown = learner(&[
        "show-prompts",
        "--config",
        cfg.to_str().unwrap(),
        "--limit",
        "1",
        "--override",
        "model.name=default",
        "model.chat_template=false",
        "dataset.train_split=train[:1]",
    ]);
    let users: Vec<String> = shown
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(users.len(), 2, "{shown}");
    let question = entries
        .iter()
        .find(|(_, e)| e["row"] == 0)
        .map(|(q, _)| q)
        .unwrap();
    assert!(
        users
            .iter()
            .all(|u| u.contains(question.as_str()) && u.contains("\\boxed{XX}")),
        "the seed's turn-0 message: {users:?}"
    );
    // The worker scores a turn's answers (one per agent) in one batch: score them the same way.
    for turn in 0..2 {
        let row: Vec<&Value> = (0..2)
            .map(|a| {
                lines
                    .iter()
                    .find(|l| l["turn"] == turn && l["agent"] == a)
                    .unwrap()
            })
            .collect();
        let enc: Vec<_> = row
            .iter()
            .enumerate()
            .map(|(a, l)| v.encode(&users[a], l["text"].as_str().unwrap()).unwrap())
            .collect();
        let want = v.score(&enc.iter().collect::<Vec<_>>()).unwrap();
        for (l, w) in row.iter().zip(&want) {
            let score = l["score"].as_f64().unwrap();
            assert!(
                (score - f64::from(*w)).abs() < 1e-5,
                "logged s(t, i) {score}, the verifier says {w}: {l}"
            );
            assert!(
                score > 0.0 && score < 1.0,
                "a probability, not 0/1 correctness: {score}"
            );
        }
    }
}

/// Regression: the shipped MaPoRL config asks 100 answers per question, which went to the rollout
/// worker as one request with n = 100 and was refused (the worker takes at most 64). The answers
/// now come in requests a worker takes, all 100 of them, the same on a rerun.
#[test]
fn generate_asks_for_more_answers_per_question_than_a_worker_takes_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = workspace_root().join("configs/maporl_gsm8k_config.yaml");
    let generate = |out: &std::path::Path| {
        let printed = learner(&[
            "verifier",
            "generate",
            "--config",
            cfg.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--override",
            "model.name=default",
            "dataset.train_split=train[:1]",
            "verifier.max_new_tokens=2",
            "logging.progress=never",
        ]);
        assert!(
            printed.contains("1 questions sampled (0 already in the file), 100 answers"),
            "{printed}"
        );
        let data: Value = serde_json::from_str(&std::fs::read_to_string(out).unwrap()).unwrap();
        let (_, entry) = data.as_object().unwrap().iter().next().unwrap();
        let answers: Vec<String> = entry["generated_answers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_string())
            .collect();
        assert_eq!(
            (answers.len(), entry["rewards"].as_array().unwrap().len()),
            (100, 100)
        );
        answers
    };
    let first = generate(&tmp.path().join("a.json"));
    assert_eq!(
        first,
        generate(&tmp.path().join("b.json")),
        "seeded: a rerun samples the same answers"
    );
}
