//! Helpers shared by the model crate's integration tests: fixture paths, tiny models loaded
//! from the committed fixtures, and a word-level tokenizer for models that ship none.

#![allow(dead_code)]

use std::path::PathBuf;

use cotrain_model::loader::{self, GenerationDefaults, LoadOptions, LoadedModel, ModelSource};
use cotrain_model::tokenizer::Tokenizer;
use tch::Tensor;

/// `model/tests/fixtures/<rel>`.
pub fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(rel)
}

/// The committed reference values of a tiny model.
pub fn reference(name: &str) -> serde_json::Value {
    let path = fixture(&format!("tiny/{name}/reference.json"));
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// `tokenizer.json` text of a word-level tokenizer over `t0 .. t{vocab-1}`.
pub fn word_tokenizer_json(vocab: usize) -> String {
    let vocab_json: serde_json::Map<String, serde_json::Value> = (0..vocab)
        .map(|i| (format!("t{i}"), serde_json::json!(i)))
        .collect();
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab_json, "unk_token": "t0"}
    })
    .to_string()
}

/// A word-level tokenizer over `t0 .. t{vocab-1}`; decoding joins tokens with spaces.
pub fn word_tokenizer(vocab: usize) -> Tokenizer {
    let inner: tokenizers::Tokenizer = word_tokenizer_json(vocab).parse().unwrap();
    Tokenizer::from_inner(inner)
}

/// A tiny fixture model (`tiny/<name>`) with a word-level tokenizer.
pub fn tiny(name: &str, opts: &LoadOptions) -> LoadedModel {
    let dir = fixture(&format!("tiny/{name}"));
    let (vs, model) = loader::load_hf_weights(&dir, opts).unwrap();
    let generation: GenerationDefaults =
        loader::hf_generation_defaults(&dir, model.config()).unwrap();
    let tokenizer = word_tokenizer(model.config().vocab_size);
    LoadedModel {
        model,
        vs,
        tokenizer,
        chat_template: None,
        generation,
        source: ModelSource::HfDir(dir),
    }
}

/// JSON array of numbers -> Vec<f64>.
pub fn floats(v: &serde_json::Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

/// JSON array of integers -> Vec<u32>.
pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// A tensor's values as f64.
pub fn values(t: &Tensor) -> Vec<f64> {
    Vec::<f64>::try_from(&t.to_kind(tch::Kind::Double).flatten(0, -1)).unwrap()
}

/// Largest |a - b| / (atol + rtol |b|); <= 1 means within tolerance.
pub fn worst(a: &[f64], b: &[f64], atol: f64, rtol: f64) -> f64 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / (atol + rtol * y.abs()))
        .fold(0.0, f64::max)
}

/// The embedded SmolLM2 GGUF; a missing file is a setup error.
pub fn smollm2_path() -> PathBuf {
    let p = std::env::var_os("COTRAIN_DEFAULT_MODEL")
        .map(PathBuf::from)
        .expect("COTRAIN_DEFAULT_MODEL is not set: run `make setup`");
    assert!(p.exists(), "{} is missing: run `make setup`", p.display());
    p
}
