//! Tokenizer tests: parity with llama.cpp's GPT-2 and Qwen2 test vectors, the GGUF-built
//! SmolLM2 tokenizer against transformers' tokenization, special ids and incremental decoding.

use std::path::{Path, PathBuf};

use cotrain_model::gguf::writer::GgufWriter;
use cotrain_model::gguf::{GgufFile, MetaValue};
use cotrain_model::tokenizer::{IncrementalDecoder, Tokenizer, TokenizerError};
use serde_json::Value;

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tokenizers")
        .join(rel)
}

/// llama.cpp's `.inp`/`.out` pairs: inputs separated by `\n__ggml_vocab_test__\n` (the file also
/// ends with one), one line of space-separated ids per input.
fn vectors(stem: &str) -> Vec<(String, Vec<u32>)> {
    let inp = std::fs::read_to_string(fixture(&format!("gguf-llama.cpp/{stem}.inp"))).unwrap();
    let out = std::fs::read_to_string(fixture(&format!("gguf-llama.cpp/{stem}.out"))).unwrap();
    let sep = "\n__ggml_vocab_test__\n";
    let inputs: Vec<String> = inp
        .strip_suffix(sep)
        .unwrap()
        .split(sep)
        .map(str::to_string)
        .collect();
    let outputs: Vec<Vec<u32>> = out
        .strip_suffix('\n')
        .unwrap_or(&out)
        .split('\n')
        .map(|l| l.split_whitespace().map(|t| t.parse().unwrap()).collect())
        .collect();
    assert_eq!(inputs.len(), 46);
    assert_eq!(inputs.len(), outputs.len());
    inputs.into_iter().zip(outputs).collect()
}

fn check_vectors(tok: &Tokenizer, stem: &str) {
    let mut failures = Vec::new();
    for (text, want) in vectors(stem) {
        let got = tok.encode(&text, false).unwrap();
        if got != want {
            failures.push(format!("{text:?}: got {got:?}, want {want:?}"));
        }
        // Byte-level BPE is lossless.
        assert_eq!(tok.decode(&got, false).unwrap(), text);
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn gpt2_gguf_matches_llama_cpp_vectors() {
    let gguf = GgufFile::open(fixture("gguf-llama.cpp/ggml-vocab-gpt-2.gguf")).unwrap();
    let tok = Tokenizer::from_gguf(&gguf).unwrap();
    assert_eq!(tok.vocab_size(), 50257);
    assert_eq!(tok.bos_id(), Some(50256));
    assert_eq!(tok.eos_id(), Some(50256));
    assert_eq!(tok.encode("Hello world", false).unwrap(), vec![15496, 995]);
    check_vectors(&tok, "ggml-vocab-gpt-2.gguf");
}

#[test]
fn qwen_tokenizer_json_matches_llama_cpp_qwen2_vectors() {
    let tok = Tokenizer::from_file(fixture("qwen3/tokenizer.json")).unwrap();
    check_vectors(&tok, "ggml-vocab-qwen2.gguf");
}

/// Writes Qwen's vocabulary as GGUF tokenizer metadata, the way llama.cpp's converter does.
fn qwen_as_gguf() -> GgufFile {
    let json: Value =
        serde_json::from_slice(&std::fs::read(fixture("qwen3/tokenizer.json")).unwrap()).unwrap();
    let vocab = json["model"]["vocab"].as_object().unwrap();
    let added = json["added_tokens"].as_array().unwrap();
    let n = vocab.len() + added.len();
    let mut tokens = vec![String::new(); n];
    let mut types = vec![1i32; n];
    for (tok, id) in vocab {
        tokens[id.as_u64().unwrap() as usize] = tok.clone();
    }
    for a in added {
        let id = a["id"].as_u64().unwrap() as usize;
        tokens[id] = a["content"].as_str().unwrap().to_string();
        types[id] = if a["special"].as_bool().unwrap() {
            3
        } else {
            4
        };
    }
    let merges: Vec<MetaValue> = json["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            MetaValue::String(format!(
                "{} {}",
                m[0].as_str().unwrap(),
                m[1].as_str().unwrap()
            ))
        })
        .collect();
    let mut w = GgufWriter::new();
    w.metadata("general.architecture", MetaValue::String("qwen2".into()))
        .metadata("tokenizer.ggml.model", MetaValue::String("gpt2".into()))
        .metadata("tokenizer.ggml.pre", MetaValue::String("qwen2".into()))
        .metadata(
            "tokenizer.ggml.tokens",
            MetaValue::Array(tokens.into_iter().map(MetaValue::String).collect()),
        )
        .metadata(
            "tokenizer.ggml.token_type",
            MetaValue::Array(types.into_iter().map(MetaValue::I32).collect()),
        )
        .metadata("tokenizer.ggml.merges", MetaValue::Array(merges))
        .metadata("tokenizer.ggml.eos_token_id", MetaValue::U32(151645))
        .metadata("tokenizer.ggml.padding_token_id", MetaValue::U32(151643))
        .metadata("tokenizer.ggml.bos_token_id", MetaValue::U32(151643))
        .metadata("tokenizer.ggml.add_bos_token", MetaValue::Bool(false));
    GgufFile::from_bytes(w.to_bytes()).unwrap()
}

#[test]
fn qwen2_gguf_metadata_tokenizer_matches_llama_cpp_vectors() {
    let tok = Tokenizer::from_gguf(&qwen_as_gguf()).unwrap();
    assert_eq!(tok.vocab_size(), 151669);
    assert_eq!(tok.eos_id(), Some(151645));
    assert_eq!(tok.pad_id(), Some(151643));
    check_vectors(&tok, "ggml-vocab-qwen2.gguf");
    // Control tokens are matched whole in text.
    assert_eq!(
        tok.encode("<|im_start|>user", false).unwrap(),
        vec![151644, 872]
    );
    assert!(tok.is_stop_token(151645) && tok.is_stop_token(151643));
}

#[test]
fn unknown_pre_tokenizer_is_a_clear_error() {
    let gpt2 = std::fs::read(fixture("gguf-llama.cpp/ggml-vocab-gpt-2.gguf")).unwrap();
    let src = GgufFile::from_bytes(gpt2).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in src.metadata() {
        let v = if k == "tokenizer.ggml.pre" {
            MetaValue::String("mystery".into())
        } else {
            v.clone()
        };
        w.metadata(k.clone(), v);
    }
    let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
    let err = Tokenizer::from_gguf(&f).unwrap_err();
    assert!(
        matches!(&err, TokenizerError::UnsupportedPreTokenizer(p) if p == "mystery"),
        "{err}"
    );
    assert!(err.to_string().contains("mystery"));
}

#[test]
fn add_bos_token_is_applied_only_with_special_tokens() {
    let gpt2 = std::fs::read(fixture("gguf-llama.cpp/ggml-vocab-gpt-2.gguf")).unwrap();
    let src = GgufFile::from_bytes(gpt2).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in src.metadata() {
        if k != "tokenizer.ggml.add_bos_token" {
            w.metadata(k.clone(), v.clone());
        }
    }
    w.metadata("tokenizer.ggml.add_bos_token", MetaValue::Bool(true));
    let tok = Tokenizer::from_gguf(&GgufFile::from_bytes(w.to_bytes()).unwrap()).unwrap();
    assert_eq!(
        tok.encode("Hello world", true).unwrap(),
        vec![50256, 15496, 995]
    );
    assert_eq!(tok.encode("Hello world", false).unwrap(), vec![15496, 995]);
}

fn smollm2() -> Option<Tokenizer> {
    let path = PathBuf::from(std::env::var_os("COTRAIN_DEFAULT_MODEL")?);
    if !path.exists() {
        return None;
    }
    Some(Tokenizer::from_gguf(&GgufFile::open(path).unwrap()).unwrap())
}

#[test]
fn smollm2_gguf_tokenizer_matches_transformers() {
    let Some(tok) = smollm2() else {
        eprintln!("skipping: COTRAIN_DEFAULT_MODEL not set or missing");
        return;
    };
    let fx: Value =
        serde_json::from_slice(&std::fs::read(fixture("smollm2_ids.json")).unwrap()).unwrap();
    let meta = &fx["tokenizer"];
    assert_eq!(
        tok.vocab_size() as u64,
        meta["vocab_size"].as_u64().unwrap()
    );
    assert_eq!(tok.bos_id().map(u64::from), meta["bos_token_id"].as_u64());
    assert_eq!(tok.eos_id().map(u64::from), meta["eos_token_id"].as_u64());
    assert_eq!(tok.pad_id().map(u64::from), meta["pad_token_id"].as_u64());
    assert_eq!(tok.bos_token().as_deref(), meta["bos_token"].as_str());
    assert_eq!(tok.eos_token().as_deref(), meta["eos_token"].as_str());
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|i| i.as_u64().unwrap() as u32)
            .collect()
    };
    let mut differs_from_transformers_gguf = Vec::new();
    for case in fx["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        // `ids` use SmolLM2's own pre-tokenizer (numerics isolated, as `pre = smollm` says);
        // transformers' GGUF loader drops that rule, which matters only for non-ASCII numerics.
        let want = ids(&case["ids"]);
        assert_eq!(tok.encode(text, false).unwrap(), want, "{text:?}");
        if want != ids(&case["ids_transformers_gguf"]) {
            differs_from_transformers_gguf.push(text);
        }
        assert_eq!(
            tok.encode(text, true).unwrap(),
            ids(&case["ids_special"]),
            "{text:?} with specials"
        );
        assert_eq!(
            tok.decode(&want, false).unwrap(),
            case["decoded"].as_str().unwrap()
        );
        assert_eq!(
            tok.decode(&want, true).unwrap(),
            case["decoded_skip_special"].as_str().unwrap()
        );
    }
    assert_eq!(
        differs_from_transformers_gguf,
        vec!["Führer naïve café — “quotes” ½ €100"]
    );
    // End-of-turn specials stop generation: <|im_end|> (eos) and <|endoftext|>.
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(2));
    assert_eq!(tok.token_to_id("<|endoftext|>"), Some(0));
    assert!(tok.is_stop_token(2) && tok.is_stop_token(0));
    assert!(
        !tok.is_stop_token(1),
        "<|im_start|> must not stop generation"
    );
    assert_eq!(tok.id_to_token(905).as_deref(), Some("Ġworld"));
}

#[test]
fn hf_dir_reads_special_tokens_and_generation_config() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture("qwen3/tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    std::fs::copy(
        fixture("qwen3/tokenizer_config.json"),
        dir.path().join("tokenizer_config.json"),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("generation_config.json"),
        r#"{"eos_token_id": [151645, 151643, 7]}"#,
    )
    .unwrap();
    let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
    assert_eq!(tok.eos_id(), Some(151645));
    assert_eq!(tok.pad_id(), Some(151643));
    assert_eq!(tok.bos_id(), None, "qwen3 has no bos token");
    assert!(
        tok.is_stop_token(7),
        "generation_config eos ids are stop ids"
    );
    assert!(tok.is_stop_token(151645));
    assert!(!tok.is_stop_token(151644));
    assert_eq!(tok.encode("Hello world", true).unwrap(), vec![9707, 1879]);
}

#[test]
fn incremental_decoder_holds_back_partial_utf8() {
    let tok = Tokenizer::from_file(fixture("qwen3/tokenizer.json")).unwrap();
    let text = "Grüße 🦙 — 日本語 ok";
    let ids = tok.encode(text, false).unwrap();
    // Some ids must carry a partial character for this test to mean anything.
    assert!(
        ids.iter()
            .any(|&id| tok.decode(&[id], false).unwrap().contains('\u{FFFD}'))
    );
    let mut dec: IncrementalDecoder = tok.incremental_decoder(false);
    let mut pieces = Vec::new();
    for &id in &ids {
        let piece = dec.push(&tok, id).unwrap();
        assert!(
            !piece.contains('\u{FFFD}'),
            "released a partial character: {piece:?}"
        );
        pieces.push(piece);
    }
    pieces.push(dec.finish(&tok).unwrap());
    assert_eq!(pieces.concat(), text);
    assert_eq!(dec.text(), text);
    // Prefixes are released as soon as complete: a stop string can be found before the end.
    let upto = pieces.iter().position(|p| p.contains("🦙")).unwrap();
    assert!(upto < ids.len() - 1);
}

#[test]
fn incremental_decoder_skips_specials_when_asked() {
    let tok = Tokenizer::from_file(fixture("qwen3/tokenizer.json")).unwrap();
    let ids = tok
        .encode("<|im_start|>assistant\nHi there<|im_end|>", false)
        .unwrap();
    let mut keep = tok.incremental_decoder(false);
    let mut skip = tok.incremental_decoder(true);
    for &id in &ids {
        keep.push(&tok, id).unwrap();
        skip.push(&tok, id).unwrap();
    }
    assert_eq!(keep.text(), "<|im_start|>assistant\nHi there<|im_end|>");
    assert_eq!(skip.text(), "assistant\nHi there");
}

/// A byte-level vocabulary of the 256 byte symbols plus a few digit merges, as GGUF metadata.
fn digits_gguf(pre: &str) -> GgufFile {
    let mut tokens: Vec<String> = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet()
        .into_iter()
        .map(String::from)
        .collect();
    tokens.sort();
    let merges = ["1 2", "12 3", "4 5", "3 4", "123 45"];
    for m in merges {
        tokens.push(m.replace(' ', ""));
    }
    let mut w = GgufWriter::new();
    w.metadata("tokenizer.ggml.model", MetaValue::String("gpt2".into()))
        .metadata("tokenizer.ggml.pre", MetaValue::String(pre.into()))
        .metadata(
            "tokenizer.ggml.tokens",
            MetaValue::Array(tokens.into_iter().map(MetaValue::String).collect()),
        )
        .metadata(
            "tokenizer.ggml.merges",
            MetaValue::Array(
                merges
                    .iter()
                    .map(|m| MetaValue::String(m.to_string()))
                    .collect(),
            ),
        );
    GgufFile::from_bytes(w.to_bytes()).unwrap()
}

#[test]
fn pre_tokenizers_split_digits_as_their_models_do() {
    let pieces = |pre: &str| -> Vec<String> {
        let tok = Tokenizer::from_gguf(&digits_gguf(pre)).unwrap();
        let ids = tok.encode("12345", false).unwrap();
        ids.iter().map(|&id| tok.id_to_token(id).unwrap()).collect()
    };
    // Llama 3: runs of at most three digits, merged inside each run only.
    assert_eq!(pieces("llama-bpe"), vec!["123", "45"]);
    // SmolLM2 and Qwen2: every digit on its own.
    assert_eq!(pieces("smollm"), vec!["1", "2", "3", "4", "5"]);
    assert_eq!(pieces("qwen2"), vec!["1", "2", "3", "4", "5"]);
    // GPT-2: one digit run, merged freely.
    assert_eq!(pieces("gpt-2"), vec!["12345"]);
}
