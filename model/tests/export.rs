//! Exporting a model as a Hugging Face directory: every tiny family (tied and untied, RoPE
//! scalings, biases, q/k norms, bf16) with changed weights loads back through `loader::load` with
//! bit-identical parameters and the same greedy tokens; a GGUF model's tokenizer, special tokens
//! and chat template survive the trip; an existing directory that is not a model is never replaced.

mod support;

use std::collections::BTreeMap;

use cotrain_model::chat_template::ChatMessage;
use cotrain_model::engine::{Engine, Request, SamplingParams, StopConditions};
use cotrain_model::export::{ExportError, save_pretrained};
use cotrain_model::loader::{self, LoadOptions, LoadedModel};
use support::*;
use tch::{Kind, Tensor};

/// Adds seeded noise to every parameter, so that a test cannot pass by reloading the fixture.
fn perturb(model: &LoadedModel, seed: i64) {
    tch::manual_seed(seed);
    let _guard = tch::no_grad_guard();
    for t in model.vs.variables().values() {
        let noise = t.randn_like() * 0.05;
        let _ = t.shallow_clone().f_add_(&noise).unwrap();
    }
}

fn greedy(model: LoadedModel, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut engine = Engine::new(model);
    let request = Request {
        params: SamplingParams::greedy(),
        stop: StopConditions {
            max_new_tokens: n,
            ignore_eos: true,
            ..Default::default()
        },
        ..Request::new(prompt.to_vec())
    };
    engine
        .generate(&[request])
        .unwrap()
        .remove(0)
        .remove(0)
        .token_ids
}

fn assert_same_parameters(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>, what: &str) {
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "{what}: parameter names"
    );
    for (name, t) in a {
        assert_eq!(t.kind(), b[name].kind(), "{what}: {name} dtype");
        assert!(
            t.equal(&b[name]),
            "{what}: {name} differs after the round trip"
        );
    }
}

fn safetensors_names(path: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = Tensor::read_safetensors(path)
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    names.sort();
    names
}

#[test]
fn exported_tiny_models_load_back_with_the_same_parameters_and_greedy_tokens() {
    let dir = tempfile::tempdir().unwrap();
    for (name, kind) in [
        ("llama", Kind::Float),
        ("llama3_rope", Kind::Float),
        ("qwen2", Kind::Float),
        ("qwen2_linear_rope", Kind::Float),
        ("qwen3", Kind::Float),
        ("llama_bf16", Kind::BFloat16),
        ("phi3", Kind::Float),
        ("phi3_longrope", Kind::Float),
    ] {
        let opts = LoadOptions {
            kind,
            ..Default::default()
        };
        let model = tiny(name, &opts);
        perturb(&model, 7);
        let out = dir.path().join(name);
        assert_eq!(save_pretrained(&model, &out).unwrap(), out);

        let back = loader::load(out.to_str().unwrap(), &opts).unwrap();
        assert_eq!(back.model.config(), model.model.config(), "{name}: config");
        assert_same_parameters(&model.named_parameters(), &back.named_parameters(), name);
        assert_eq!(
            back.stop_token_ids(),
            model.stop_token_ids(),
            "{name}: stop ids"
        );

        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap())
                .unwrap();
        let dtype = if kind == Kind::BFloat16 {
            "bfloat16"
        } else {
            "float32"
        };
        assert_eq!(cfg["torch_dtype"], dtype, "{name}");
        let stored = safetensors_names(&out.join("model.safetensors"));
        assert_eq!(
            stored.contains(&"lm_head.weight".to_string()),
            !model.model.config().tie_word_embeddings,
            "{name}: lm_head.weight is stored exactly when untied"
        );

        // Phi-3's checkpoints keep q/k/v and gate/up fused, and so does its export.
        let phi3 = model.model.config().family == cotrain_model::Family::Phi3;
        for fused in [
            "model.layers.1.self_attn.qkv_proj.weight",
            "model.layers.1.mlp.gate_up_proj.weight",
        ] {
            assert_eq!(stored.contains(&fused.to_string()), phi3, "{name}: {fused}");
        }
        assert_eq!(
            stored.contains(&"model.layers.1.self_attn.q_proj.weight".to_string()),
            !phi3,
            "{name}"
        );
        let prompt = [1u32, 17, 99, 3, 250, 42];
        let tokens = model.tokenizer.encode("t5 t17 t200", true).unwrap();
        assert_eq!(
            back.tokenizer.encode("t5 t17 t200", true).unwrap(),
            tokens,
            "{name}"
        );
        let want = greedy(model, &prompt, 12);
        assert_eq!(greedy(back, &prompt, 12), want, "{name}: greedy tokens");
    }
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

const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a tiny model.<|im_end|>\n' }}{% endif %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// The tiny Llama as a GGUF file with a SmolLM2-style tokenizer: byte-level BPE with the
/// `smollm` pre-tokenizer, `<|endoftext|>`/`<|im_start|>`/`<|im_end|>` as control tokens 0–2
/// (bos 1, eos 2, pad 2, bos added when encoding) and a ChatML template.
fn write_tiny_gguf(path: &std::path::Path) {
    use cotrain_model::gguf::{MetaValue as M, writer::GgufWriter};
    let (vs, model) =
        loader::load_hf_weights(&fixture("tiny/llama"), &LoadOptions::default()).unwrap();
    let cfg = model.config();
    let mut w = GgufWriter::new();
    let u = |v: usize| M::U32(v as u32);
    w.metadata("general.architecture", M::String("llama".into()))
        .metadata("llama.block_count", u(cfg.num_hidden_layers))
        .metadata("llama.context_length", u(cfg.max_position_embeddings))
        .metadata("llama.embedding_length", u(cfg.hidden_size))
        .metadata("llama.feed_forward_length", u(cfg.intermediate_size))
        .metadata("llama.attention.head_count", u(cfg.num_attention_heads))
        .metadata("llama.attention.head_count_kv", u(cfg.num_key_value_heads))
        .metadata("llama.rope.freq_base", M::F32(cfg.rope_theta as f32))
        .metadata(
            "llama.attention.layer_norm_rms_epsilon",
            M::F32(cfg.rms_norm_eps as f32),
        );
    let mut tokens = byte_tokens();
    let mut types = vec![1i32; 256];
    for (id, special) in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .iter()
        .enumerate()
    {
        tokens[id] = special.to_string();
        types[id] = 3;
    }
    tokens[255] = "ĠĠ".into();
    w.metadata("tokenizer.ggml.model", M::String("gpt2".into()))
        .metadata("tokenizer.ggml.pre", M::String("smollm".into()))
        .metadata(
            "tokenizer.ggml.tokens",
            M::Array(tokens.into_iter().map(M::String).collect()),
        )
        .metadata(
            "tokenizer.ggml.token_type",
            M::Array(types.into_iter().map(M::I32).collect()),
        )
        .metadata(
            "tokenizer.ggml.merges",
            M::Array(vec![M::String("Ġ Ġ".into())]),
        )
        .metadata("tokenizer.ggml.bos_token_id", M::U32(1))
        .metadata("tokenizer.ggml.eos_token_id", M::U32(2))
        .metadata("tokenizer.ggml.padding_token_id", M::U32(2))
        .metadata("tokenizer.ggml.add_bos_token", M::Bool(true))
        .metadata("tokenizer.chat_template", M::String(CHATML.into()));
    for (hf, t) in vs.variables() {
        let shape: Vec<usize> = t.size().iter().map(|&d| d as usize).collect();
        let mut data = Vec::<f32>::try_from(&t.detach().flatten(0, -1)).unwrap();
        let g = gguf_name(&hf);
        if g.contains(".attn_q.") || g.contains(".attn_k.") {
            let heads = if g.contains(".attn_q.") {
                cfg.num_attention_heads
            } else {
                cfg.num_key_value_heads
            };
            data = cotrain_model::gguf::permute_qk_rows(&data, heads, shape[0], shape[1]).unwrap();
        }
        w.tensor_f32(g, &shape, &data).unwrap();
    }
    w.write(path).unwrap();
}

fn gguf_name(hf: &str) -> String {
    match hf {
        "model.embed_tokens.weight" => return "token_embd.weight".into(),
        "model.norm.weight" => return "output_norm.weight".into(),
        "lm_head.weight" => return "output.weight".into(),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.").unwrap();
    let (layer, rest) = rest.split_once('.').unwrap();
    let (module, param) = rest.rsplit_once('.').unwrap();
    let g = match module {
        "input_layernorm" => "attn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "post_attention_layernorm" => "ffn_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        other => panic!("unmapped {other}"),
    };
    format!("blk.{layer}.{g}.{param}")
}

#[test]
fn a_gguf_model_exports_its_tokenizer_special_tokens_and_chat_template() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("tiny.gguf");
    write_tiny_gguf(&gguf);
    let opts = LoadOptions::default();
    let model = loader::load(gguf.to_str().unwrap(), &opts).unwrap();
    perturb(&model, 11);
    let out = dir.path().join("exported");
    save_pretrained(&model, &out).unwrap();
    let back = loader::load(out.to_str().unwrap(), &opts).unwrap();

    assert_eq!(back.model.config(), model.model.config());
    assert_same_parameters(&model.named_parameters(), &back.named_parameters(), "gguf");

    let (a, b) = (&model.tokenizer, &back.tokenizer);
    assert_eq!(
        (b.bos_id(), b.eos_id(), b.pad_id()),
        (a.bos_id(), a.eos_id(), a.pad_id())
    );
    assert_eq!((a.bos_id(), a.eos_id()), (Some(1), Some(2)));
    assert_eq!(b.stop_token_ids(), a.stop_token_ids());
    assert_eq!(back.stop_token_ids(), model.stop_token_ids());
    for text in [
        "hello world",
        "  two  spaces and 12345 digits",
        "<|im_start|>user\nhi<|im_end|>\n",
        "",
    ] {
        for special in [true, false] {
            assert_eq!(
                b.encode(text, special).unwrap(),
                a.encode(text, special).unwrap(),
                "{text:?} (add_special_tokens {special})"
            );
        }
    }
    assert_eq!(a.encode("a", true).unwrap()[0], 1, "the gguf asks for bos");

    let messages = [
        ChatMessage::user("What is 2 + 2?"),
        ChatMessage::assistant("4"),
    ];
    let render = |m: &LoadedModel, generation_prompt: bool| {
        m.chat_template
            .as_ref()
            .unwrap()
            .render(&messages, generation_prompt, &serde_json::Value::Null)
            .unwrap()
    };
    for generation_prompt in [true, false] {
        assert_eq!(
            render(&back, generation_prompt),
            render(&model, generation_prompt)
        );
    }

    let read = |f: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(out.join(f)).unwrap()).unwrap()
    };
    let tc = read("tokenizer_config.json");
    assert_eq!(tc["chat_template"], CHATML);
    assert_eq!(tc["bos_token"], "<|im_start|>");
    assert_eq!(tc["eos_token"], "<|im_end|>");
    assert_eq!(tc["pad_token"], "<|im_end|>");
    assert_eq!(tc["add_bos_token"], true);
    assert_eq!(tc["add_eos_token"], false);
    assert_eq!(tc["model_max_length"], 512);
    assert_eq!(read("special_tokens_map.json")["bos_token"], "<|im_start|>");
    let gc = read("generation_config.json");
    assert_eq!(gc["bos_token_id"], 1);
    assert_eq!(
        gc["eos_token_id"],
        serde_json::json!([0, 2]),
        "eos and <|endoftext|>"
    );

    let prompt = a.encode("hello", true).unwrap();
    let want = greedy(model, &prompt, 12);
    assert_eq!(greedy(back, &prompt, 12), want);
}

#[test]
fn an_earlier_export_is_replaced_but_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny("qwen3", &LoadOptions::default());
    let out = dir.path().join("model");
    save_pretrained(&model, &out).unwrap();
    perturb(&model, 3);
    save_pretrained(&model, &out).unwrap();
    let back = loader::load(out.to_str().unwrap(), &LoadOptions::default()).unwrap();
    assert_same_parameters(
        &model.named_parameters(),
        &back.named_parameters(),
        "re-export",
    );
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        leftovers,
        vec![std::ffi::OsString::from("model")],
        "no temporary directories left"
    );

    let precious = dir.path().join("notes");
    std::fs::create_dir(&precious).unwrap();
    std::fs::write(precious.join("todo.txt"), "keep me").unwrap();
    let err = save_pretrained(&model, &precious).unwrap_err();
    assert!(matches!(err, ExportError::NotAModelDir(_)), "{err:?}");
    assert!(
        err.to_string().contains("is not a model directory"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(precious.join("todo.txt")).unwrap(),
        "keep me"
    );
}
