//! `rollout-worker generate` end to end with the embedded SmolLM2 (needs `make setup`): a greedy
//! chat answer, the `--json` schema, seeded reproducibility, and clear errors for bad input.

use std::process::{Command, Output};

fn run(args: &[&str]) -> Output {
    let default = std::env::var_os("COTRAIN_DEFAULT_MODEL")
        .expect("COTRAIN_DEFAULT_MODEL is not set: run `make setup`");
    assert!(std::path::Path::new(&default).exists(), "default model missing: run `make setup`");
    Command::new(env!("CARGO_BIN_EXE_rollout-worker"))
        .arg("generate")
        .args(args)
        .env("COTRAIN_DEFAULT_MODEL", default)
        .output()
        .expect("the binary runs")
}

fn json(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("stdout is one JSON object")
}

#[test]
fn greedy_chat_answers_a_factual_question() {
    let out = run(&["--model", "default", "--chat", "--prompt", "What is the capital of France?", "--max-new-tokens", "32"]);
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("Paris"), "answer: {text}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("tokens/s"));
}

#[test]
fn json_output_has_the_documented_schema_and_is_reproducible() {
    let args = ["--prompt", "Once upon a time", "--temperature", "0.8", "--top-p", "0.95", "--n", "2",
        "--seed", "7", "--max-new-tokens", "6", "--ignore-eos", "--json"];
    let a = json(&run(&args));
    let prompt = a["prompt_token_ids"].as_array().unwrap();
    assert!(!prompt.is_empty());
    let samples = a["samples"].as_array().unwrap();
    assert_eq!(samples.len(), 2);
    for s in samples {
        assert_eq!(s["token_ids"].as_array().unwrap().len(), 6);
        assert_eq!(s["logprobs"].as_array().unwrap().len(), 6);
        assert!(s["logprobs"].as_array().unwrap().iter().all(|x| x.as_f64().unwrap() <= 0.0));
        assert_eq!(s["finish_reason"], "length");
        assert!(s["text"].is_string());
    }
    let b = json(&run(&args));
    assert_eq!(a, b, "same seed, same output");
}

#[test]
fn bad_input_gets_a_clear_error() {
    for (args, needle) in [
        (vec!["--model", "/no/such/model.gguf", "--prompt", "x"], "missing file /no/such/model.gguf"),
        (vec!["--prompt", "x", "--dtype", "int3"], "unknown dtype `int3`"),
        (vec!["--prompt", "x", "--device", "tpu"], "unknown device `tpu`"),
        (vec!["--prompt", "x", "--bf16-dot-products"], "--bf16-dot-products applies to bf16 weights only, and the model is loaded as f32"),
        (vec!["--model", "no-org/no-model", "--prompt", "x"], "local Hugging Face cache"),
    ] {
        let out = run(&args);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}
