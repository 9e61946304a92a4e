//! `rollout-worker generate` end to end with the embedded SmolLM2 (needs `make setup`): a greedy
//! chat answer, the `--json` schema, seeded reproducibility, and clear errors for bad input.

use std::process::{Command, Output};

fn run(args: &[&str]) -> Output {
    let default = std::env::var_os("COTRAIN_DEFAULT_MODEL")
        .expect("COTRAIN_DEFAULT_MODEL is not set: run `make setup`");
    assert!(
        std::path::Path::new(&default).exists(),
        "default model missing: run `make setup`"
    );
    Command::new(env!("CARGO_BIN_EXE_rollout-worker"))
        .arg("generate")
        .args(args)
        .env("COTRAIN_DEFAULT_MODEL", default)
        .output()
        .expect("the binary runs")
}

fn json(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("stdout is one JSON object")
}

#[test]
fn greedy_chat_answers_a_factual_question() {
    let out = run(&[
        "--model",
        "default",
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--max-new-tokens",
        "32",
    ]);
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("Paris"), "answer: {text}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("tokens/s"));
}

#[test]
fn json_output_has_the_documented_schema_and_is_reproducible() {
    let args = [
        "--prompt",
        "Once upon a time",
        "--temperature",
        "0.8",
        "--top-p",
        "0.95",
        "--n",
        "2",
        "--seed",
        "7",
        "--max-new-tokens",
        "6",
        "--ignore-eos",
        "--json",
    ];
    let a = json(&run(&args));
    let prompt = a["prompt_token_ids"].as_array().unwrap();
    assert!(!prompt.is_empty());
    let samples = a["samples"].as_array().unwrap();
    assert_eq!(samples.len(), 2);
    for s in samples {
        assert_eq!(s["token_ids"].as_array().unwrap().len(), 6);
        assert_eq!(s["logprobs"].as_array().unwrap().len(), 6);
        assert!(
            s["logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .all(|x| x.as_f64().unwrap() <= 0.0)
        );
        assert_eq!(s["finish_reason"], "length");
        assert!(s["text"].is_string());
    }
    assert_eq!(a["generated_tokens"], 12);
    assert!(a["seconds"].as_f64().unwrap() > 0.0 && a["load_seconds"].as_f64().unwrap() > 0.0);
    assert_eq!(a["device"], "cpu");
    let b = json(&run(&args));
    for key in ["prompt_token_ids", "samples", "generated_tokens", "device"] {
        assert_eq!(a[key], b[key], "same seed, same {key}");
    }
}

#[test]
fn bad_input_gets_a_clear_error() {
    for (args, needle) in [
        (
            vec!["--model", "/no/such/model.gguf", "--prompt", "x"],
            "missing file /no/such/model.gguf",
        ),
        (
            vec!["--prompt", "x", "--dtype", "int3"],
            "unknown dtype `int3`",
        ),
        (
            vec!["--prompt", "x", "--device", "tpu"],
            "unknown device `tpu`",
        ),
        (
            vec!["--prompt", "x", "--bf16-dot-products"],
            "--bf16-dot-products applies to bf16 weights only, and the model is loaded as f32",
        ),
        (
            vec!["--model", "no-org/no-model", "--prompt", "x"],
            "local Hugging Face cache",
        ),
    ] {
        let out = run(&args);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

/// Asking for a GPU on a machine without a usable one stops at once and says why (here: the CPU
/// set-up's libtorch has no loadable CUDA library, or the library loads and finds no driver),
/// from `generate` and from `serve`, for the worker's device and for one agent's; `serve` also
/// refuses a placement of an agent it does not serve.
#[test]
fn a_cuda_device_without_a_gpu_is_refused_with_the_reason() {
    if cotrain_model::cuda::device_count() > 0 {
        return;
    }
    let reason = |err: &str| err.contains("libtorch_cuda.so") || err.contains("no GPU is usable");
    for device in ["cuda", "cuda:1", "gpu"] {
        let out = run(&["--prompt", "x", "--device", device]);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("CUDA is unavailable for device") && reason(&err),
            "{device}: {err}"
        );
    }
    let serve = |extra: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_rollout-worker"))
            .args([
                "serve",
                "--grpc-addr",
                "127.0.0.1:0",
                "--http-addr",
                "127.0.0.1:0",
                "--agent",
                "a=default",
            ])
            .args(extra)
            .output()
            .expect("the binary runs");
        assert!(!out.status.success(), "{extra:?} served");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = serve(&["--device", "cuda:0"]);
    assert!(
        err.contains("--device")
            && err.contains("CUDA is unavailable for device cuda:0")
            && reason(&err),
        "{err}"
    );
    let err = serve(&["--agent-device", "a=cuda"]);
    assert!(
        err.contains("--agent-device a=cuda")
            && err.contains("CUDA is unavailable")
            && reason(&err),
        "{err}"
    );
    let err = serve(&["--agent-device", "b=cpu"]);
    assert!(err.contains("`b` is not an agent of this worker"), "{err}");
}
