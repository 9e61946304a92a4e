//! Loading: the sharded checkpoint equals the single-file one, parameters are trainable and
//! named as in HF, and bad inputs (missing files, corrupt or unsupported configs, unknown dtype
//! or device, missing default model, HF repo ids) get clear errors.

mod support;

use cotrain_model::config::{parse_device, parse_dtype};
use cotrain_model::loader::{self, LoadOptions, ModelSource};
use support::*;

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn sharded_and_single_file_checkpoints_load_the_same_names_and_shapes() {
    let (vs, model) = loader::load_hf_weights(&fixture("tiny/qwen2_sharded"), &LoadOptions::default()).unwrap();
    let (vs1, _) = loader::load_hf_weights(&fixture("tiny/qwen2"), &LoadOptions::default()).unwrap();
    let a = vs.variables();
    let b = vs1.variables();
    let mut names: Vec<&String> = a.keys().collect();
    names.sort();
    assert_eq!(names.len(), b.len());
    assert!(a.contains_key("model.layers.1.self_attn.q_proj.bias"));
    assert!(a.contains_key("lm_head.weight"));
    for n in names {
        assert_eq!(a[n].size(), b[n].size(), "{n}");
        assert!(a[n].requires_grad(), "{n} is trainable");
    }
    assert_eq!(model.config().family, cotrain_model::Family::Qwen2);
}

#[test]
fn bf16_loading_converts_parameters() {
    let (vs, model) = loader::load_hf_weights(
        &fixture("tiny/llama"),
        &LoadOptions { kind: tch::Kind::BFloat16, ..Default::default() },
    )
    .unwrap();
    assert_eq!(model.kind(), tch::Kind::BFloat16);
    assert!(vs.variables().values().all(|t| t.kind() == tch::Kind::BFloat16));
}

#[test]
fn missing_and_corrupt_files_are_named() {
    let dir = tempfile::tempdir().unwrap();
    // No config.json at all.
    let e = loader::load(dir.path().to_str().unwrap(), &LoadOptions::default()).unwrap_err().to_string();
    assert!(e.contains("config.json"), "{e}");

    // Corrupt config.json.
    copy_dir(&fixture("tiny/llama"), dir.path());
    std::fs::write(dir.path().join("config.json"), "{ not json").unwrap();
    let e = loader::load_hf_weights(dir.path(), &LoadOptions::default()).unwrap_err().to_string();
    assert!(e.contains("config.json"), "{e}");

    // An unsupported architecture is named.
    std::fs::write(dir.path().join("config.json"), r#"{"architectures": ["GPTNeoXForCausalLM"]}"#).unwrap();
    let e = loader::load_hf_weights(dir.path(), &LoadOptions::default()).unwrap_err().to_string();
    assert!(e.contains("GPTNeoXForCausalLM"), "{e}");

    // Missing weights.
    copy_dir(&fixture("tiny/llama"), dir.path());
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let e = loader::load_hf_weights(dir.path(), &LoadOptions::default()).unwrap_err().to_string();
    assert!(e.contains("model.safetensors"), "{e}");

    // Corrupt weights.
    std::fs::write(dir.path().join("model.safetensors"), b"garbage").unwrap();
    let e = loader::load_hf_weights(dir.path(), &LoadOptions::default()).unwrap_err().to_string();
    assert!(e.contains("safetensors"), "{e}");

    // No tokenizer in an otherwise valid directory.
    copy_dir(&fixture("tiny/llama"), dir.path());
    let e = loader::load(dir.path().to_str().unwrap(), &LoadOptions::default()).unwrap_err().to_string();
    assert!(e.contains("tokenizer"), "{e}");

    // A missing GGUF file.
    let e = loader::load("/no/such/model.gguf", &LoadOptions::default()).unwrap_err().to_string();
    assert!(e.contains("missing file /no/such/model.gguf"), "{e}");

    // A file that is not GGUF.
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"definitely not gguf").unwrap();
    let e = loader::load(junk.to_str().unwrap(), &LoadOptions::default()).unwrap_err().to_string();
    assert!(e.contains("gguf"), "{e}");
}

#[test]
fn a_checkpoint_with_wrong_shapes_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&fixture("tiny/llama"), dir.path());
    let cfg = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&cfg).unwrap();
    v["intermediate_size"] = serde_json::json!(v["intermediate_size"].as_u64().unwrap() * 2);
    std::fs::write(dir.path().join("config.json"), v.to_string()).unwrap();
    let e = loader::load_hf_weights(dir.path(), &LoadOptions::default()).unwrap_err().to_string();
    assert!(e.contains("shape"), "{e}");
}

#[test]
fn unknown_dtype_and_device_strings() {
    assert!(parse_dtype("fp8").unwrap_err().to_string().contains("unknown dtype `fp8`"));
    assert!(parse_device("npu:0").unwrap_err().to_string().contains("unknown device `npu:0`"));
}

#[test]
fn repo_ids_resolve_from_the_local_hub_cache() {
    let cache = tempfile::tempdir().unwrap();
    let snap = cache.path().join("models--tiny-org--tiny-llama/snapshots/abc123");
    copy_dir(&fixture("tiny/llama"), &snap);
    std::fs::create_dir_all(cache.path().join("models--tiny-org--tiny-llama/refs")).unwrap();
    std::fs::write(cache.path().join("models--tiny-org--tiny-llama/refs/main"), "abc123").unwrap();
    // SAFETY: this test binary's only environment mutation; no other thread reads HF_HUB_CACHE.
    unsafe { std::env::set_var("HF_HUB_CACHE", cache.path()) };
    assert_eq!(loader::resolve("tiny-org/tiny-llama").unwrap(), ModelSource::HfDir(snap));
    let e = loader::resolve("tiny-org/absent").unwrap_err().to_string();
    assert!(e.contains("not in the local Hugging Face cache"), "{e}");
}

#[test]
fn the_default_model_resolves_to_the_setup_gguf() {
    let path = smollm2_path();
    assert_eq!(loader::resolve("default").unwrap(), ModelSource::Gguf(path));
}
