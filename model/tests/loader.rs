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
    let (vs, model) =
        loader::load_hf_weights(&fixture("tiny/qwen2_sharded"), &LoadOptions::default()).unwrap();
    let (vs1, _) =
        loader::load_hf_weights(&fixture("tiny/qwen2"), &LoadOptions::default()).unwrap();
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
        &LoadOptions {
            kind: tch::Kind::BFloat16,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(model.kind(), tch::Kind::BFloat16);
    assert!(
        vs.variables()
            .values()
            .all(|t| t.kind() == tch::Kind::BFloat16)
    );
}

#[test]
fn missing_and_corrupt_files_are_named() {
    let dir = tempfile::tempdir().unwrap();
    // No config.json at all.
    let e = loader::load(dir.path().to_str().unwrap(), &LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("config.json"), "{e}");

    // Corrupt config.json.
    copy_dir(&fixture("tiny/llama"), dir.path());
    std::fs::write(dir.path().join("config.json"), "{ not json").unwrap();
    let e = loader::load_hf_weights(dir.path(), &LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("config.json"), "{e}");

    // An unsupported architecture is named.
    std::fs::write(
        dir.path().join("config.json"),
        r#"{"architectures": ["GPTNeoXForCausalLM"]}"#,
    )
    .unwrap();
    let e = loader::load_hf_weights(dir.path(), &LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("GPTNeoXForCausalLM"), "{e}");

    // Missing weights.
    copy_dir(&fixture("tiny/llama"), dir.path());
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let e = loader::load_hf_weights(dir.path(), &LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("model.safetensors"), "{e}");

    // Corrupt weights.
    std::fs::write(dir.path().join("model.safetensors"), b"garbage").unwrap();
    let e = loader::load_hf_weights(dir.path(), &LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("safetensors"), "{e}");

    // No tokenizer in an otherwise valid directory.
    copy_dir(&fixture("tiny/llama"), dir.path());
    let e = loader::load(dir.path().to_str().unwrap(), &LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("tokenizer"), "{e}");

    // A missing GGUF file.
    let e = loader::load("/no/such/model.gguf", &LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("missing file /no/such/model.gguf"), "{e}");

    // A file that is not GGUF.
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"definitely not gguf").unwrap();
    let e = loader::load(junk.to_str().unwrap(), &LoadOptions::default())
        .unwrap_err()
        .to_string();
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
    let e = loader::load_hf_weights(dir.path(), &LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("shape"), "{e}");
}

#[test]
fn unknown_dtype_and_device_strings() {
    assert!(
        parse_dtype("fp8")
            .unwrap_err()
            .to_string()
            .contains("unknown dtype `fp8`")
    );
    assert!(
        parse_device("npu:0")
            .unwrap_err()
            .to_string()
            .contains("unknown device `npu:0`")
    );
}

#[test]
fn repo_ids_resolve_from_the_local_hub_cache() {
    let cache = tempfile::tempdir().unwrap();
    let snap = cache
        .path()
        .join("models--tiny-org--tiny-llama/snapshots/abc123");
    copy_dir(&fixture("tiny/llama"), &snap);
    std::fs::create_dir_all(cache.path().join("models--tiny-org--tiny-llama/refs")).unwrap();
    std::fs::write(
        cache.path().join("models--tiny-org--tiny-llama/refs/main"),
        "abc123",
    )
    .unwrap();
    // SAFETY: this test binary's only environment mutation; no other thread reads HF_HUB_CACHE.
    unsafe { std::env::set_var("HF_HUB_CACHE", cache.path()) };
    assert_eq!(
        loader::resolve("tiny-org/tiny-llama").unwrap(),
        ModelSource::HfDir(snap)
    );
    let e = loader::resolve("tiny-org/absent").unwrap_err().to_string();
    assert!(e.contains("not in the local Hugging Face cache"), "{e}");
}

#[test]
fn the_default_model_resolves_to_the_setup_gguf() {
    let path = smollm2_path();
    assert_eq!(loader::resolve("default").unwrap(), ModelSource::Gguf(path));
}

/// GPT-2's byte-to-unicode table: the token strings of a byte-level BPE vocabulary.
fn byte_tokens() -> Vec<String> {
    let mut printable: Vec<u32> = (33..=126).chain(161..=172).chain(174..=255).collect();
    let mut chars: Vec<u32> = printable.clone();
    let mut extra = 0;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            printable.push(b);
            chars.push(256 + extra);
            extra += 1;
        }
    }
    let mut tokens = vec![String::new(); 256];
    for (b, c) in printable.iter().zip(&chars) {
        tokens[*b as usize] = char::from_u32(*c).unwrap().to_string();
    }
    tokens
}

fn hf_to_gguf(name: &str) -> String {
    let fixed = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
    ];
    if let Some((_, g)) = fixed.iter().find(|(h, _)| *h == name) {
        return g.to_string();
    }
    let rest = name.strip_prefix("model.layers.").unwrap();
    let (layer, rest) = rest.split_once('.').unwrap();
    let (module, param) = rest.rsplit_once('.').unwrap();
    let g = match module {
        "input_layernorm" => "attn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "post_attention_layernorm" => "ffn_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        other => panic!("unmapped {other}"),
    };
    format!("blk.{layer}.{g}.{param}")
}

/// Writes a tiny HF fixture as a GGUF file the way llama.cpp's converter would (q/k rows
/// permuted for the llama architecture, no `output.weight` when tied).
fn write_gguf(name: &str, arch: &str, path: &std::path::Path) {
    use cotrain_model::gguf::{MetaValue as M, writer::GgufWriter};
    let (vs, model) =
        loader::load_hf_weights(&fixture(&format!("tiny/{name}")), &LoadOptions::default())
            .unwrap();
    let cfg = model.config();
    let mut w = GgufWriter::new();
    let key = |k: &str| format!("{arch}.{k}");
    w.metadata("general.architecture", M::String(arch.into()))
        .metadata(key("block_count"), M::U32(cfg.num_hidden_layers as u32))
        .metadata(
            key("context_length"),
            M::U32(cfg.max_position_embeddings as u32),
        )
        .metadata(key("embedding_length"), M::U32(cfg.hidden_size as u32))
        .metadata(
            key("feed_forward_length"),
            M::U32(cfg.intermediate_size as u32),
        )
        .metadata(
            key("attention.head_count"),
            M::U32(cfg.num_attention_heads as u32),
        )
        .metadata(
            key("attention.head_count_kv"),
            M::U32(cfg.num_key_value_heads as u32),
        )
        .metadata(key("attention.key_length"), M::U32(cfg.head_dim as u32))
        .metadata(key("rope.freq_base"), M::F32(cfg.rope_theta as f32))
        .metadata(
            key("attention.layer_norm_rms_epsilon"),
            M::F32(cfg.rms_norm_eps as f32),
        );
    let mut tokens = byte_tokens();
    tokens[255] = "ĠĠ".into();
    w.metadata("tokenizer.ggml.model", M::String("gpt2".into()))
        .metadata(
            "tokenizer.ggml.tokens",
            M::Array(tokens.into_iter().map(M::String).collect()),
        )
        .metadata(
            "tokenizer.ggml.merges",
            M::Array(vec![M::String("Ġ Ġ".into())]),
        )
        .metadata("tokenizer.ggml.eos_token_id", M::U32(2));
    let mut names: Vec<(String, tch::Tensor)> = vs.variables().into_iter().collect();
    names.sort_by(|a, b| a.0.cmp(&b.0));
    for (hf, t) in names {
        let shape: Vec<usize> = t.size().iter().map(|&d| d as usize).collect();
        let mut data = Vec::<f32>::try_from(&t.detach().flatten(0, -1)).unwrap();
        let g = hf_to_gguf(&hf);
        if arch == "llama" && (g.contains(".attn_q.") || g.contains(".attn_k.")) {
            let heads = if g.contains(".attn_q.") {
                cfg.num_attention_heads
            } else {
                cfg.num_key_value_heads
            };
            let cols = shape.get(1).copied().unwrap_or(1);
            data = cotrain_model::gguf::permute_qk_rows(&data, heads, shape[0], cols).unwrap();
        }
        w.tensor_f32(g, &shape, &data).unwrap();
    }
    w.write(path).unwrap();
}

#[test]
fn gguf_files_of_every_family_load_like_their_hf_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    for (name, arch) in [("llama", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3")] {
        let path = dir.path().join(format!("{name}.gguf"));
        write_gguf(name, arch, &path);
        let from_gguf = loader::load(path.to_str().unwrap(), &LoadOptions::default()).unwrap();
        let (_, from_hf) =
            loader::load_hf_weights(&fixture(&format!("tiny/{name}")), &LoadOptions::default())
                .unwrap();
        assert_eq!(
            from_gguf.model.config().family,
            from_hf.config().family,
            "{name}"
        );
        assert_eq!(
            from_gguf.model.config().tie_word_embeddings,
            from_hf.config().tie_word_embeddings,
            "{name}"
        );
        let ids = tch::Tensor::from_slice(&[1i64, 17, 99, 3, 250, 42]).unsqueeze(0);
        let a = tch::no_grad(|| from_gguf.model.forward(&ids)).unwrap();
        let b = tch::no_grad(|| from_hf.forward(&ids)).unwrap();
        let diff = (a - b).abs().max().double_value(&[]);
        assert!(diff < 1e-5, "{name}: gguf and hf logits differ by {diff}");
        let ids = from_gguf.tokenizer.encode("ab  c", false).unwrap();
        assert_eq!(
            from_gguf.tokenizer.decode(&ids, false).unwrap(),
            "ab  c",
            "{name}: tokenizer from gguf"
        );
    }
}

#[test]
fn unsupported_gguf_architecture_is_named() {
    use cotrain_model::gguf::{MetaValue as M, writer::GgufWriter};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("falcon.gguf");
    let mut w = GgufWriter::new();
    w.metadata("general.architecture", M::String("falcon".into()));
    w.write(&path).unwrap();
    let e = loader::load(path.to_str().unwrap(), &LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("falcon"), "{e}");
}
