//! The embedded default model, SmolLM2-135M-Instruct (GGUF, Q4_1/Q8_0), against transformers'
//! own GGUF dequantisation: last-position logits (top-20 and fixed ids), per-token log-probs and
//! entropies, and greedy continuations through the cached engine. Needs `make setup`.

mod support;

use cotrain_model::engine::{Engine, Request, SamplingParams, StopConditions};
use cotrain_model::loader::{self, LoadOptions};
use cotrain_model::logprobs::{LogProbOptions, Sequence, completion_logprobs};
use support::*;
use tch::Tensor;

fn reference() -> serde_json::Value {
    let path = fixture("smollm2/reference.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn smollm2_gguf_matches_transformers() {
    let path = smollm2_path();
    let loaded = loader::load(path.to_str().unwrap(), &LoadOptions::default()).unwrap();
    let cfg = loaded.model.config().clone();
    assert_eq!(
        (
            cfg.num_hidden_layers,
            cfg.hidden_size,
            cfg.num_key_value_heads
        ),
        (30, 576, 3)
    );
    assert!(cfg.tie_word_embeddings);
    let reference = reference();
    let new_tokens: usize = reference["new_tokens"].as_u64().unwrap() as usize;
    let mut engine = Engine::new(loaded);
    for case in reference["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let input = ids(&case["input_ids"]);
        // The tokenizer from the GGUF reproduces transformers' ids for the case's text.
        let encoded = engine
            .tokenizer()
            .encode(case["text"].as_str().unwrap(), false)
            .unwrap();
        assert_eq!(encoded, input, "{name}: tokenizer ids");

        let model = &engine.loaded().model;
        let x =
            Tensor::from_slice(&input.iter().map(|&t| t as i64).collect::<Vec<_>>()).unsqueeze(0);
        let logits = tch::no_grad(|| model.forward(&x)).unwrap();
        let last = logits.get(0).get(input.len() as i64 - 1);
        for (ids_key, logits_key) in [
            ("last_top_ids", "last_top_logits"),
            ("last_fixed_ids", "last_fixed_logits"),
        ] {
            let sel: Vec<i64> = ids(&case[ids_key]).iter().map(|&t| t as i64).collect();
            let got = values(&last.index_select(0, &Tensor::from_slice(&sel)));
            let w = worst(&got, &floats(&case[logits_key]), 2e-3, 1e-3);
            assert!(w <= 1.0, "{name}: {logits_key} off by {w} x tolerance");
        }

        let seq = Sequence {
            prompt: input[..1].to_vec(),
            completion: input[1..].to_vec(),
        };
        let lp = completion_logprobs(
            model,
            &[seq],
            &LogProbOptions {
                chunk_size: 8,
                with_grad: false,
                temperature: 1.0,
            },
        )
        .unwrap();
        let w = worst(
            &values(&lp.logprobs),
            &floats(&case["token_logprobs"]),
            2e-3,
            1e-3,
        );
        assert!(w <= 1.0, "{name}: token log-probs off by {w} x tolerance");

        let request = Request {
            params: SamplingParams::greedy(),
            stop: StopConditions {
                max_new_tokens: new_tokens,
                ignore_eos: true,
                ..Default::default()
            },
            ..Request::new(input.clone())
        };
        let sample = engine.generate(&[request]).unwrap().remove(0).remove(0);
        assert_eq!(
            sample.token_ids,
            ids(&case["greedy_new_ids"]),
            "{name}: greedy tokens"
        );
    }
}

#[test]
fn smollm2_chat_answers_capital_of_france() {
    let loaded = loader::load("default", &LoadOptions::default()).unwrap();
    let template = loaded
        .chat_template
        .as_ref()
        .expect("the GGUF carries a chat template");
    let text = template
        .render(
            &[cotrain_model::chat_template::ChatMessage::user(
                "What is the capital of France?",
            )],
            true,
            &serde_json::Value::Null,
        )
        .unwrap();
    let prompt = loaded.tokenizer.encode(&text, false).unwrap();
    let mut engine = Engine::new(loaded);
    let request = Request {
        params: SamplingParams::greedy(),
        stop: StopConditions {
            max_new_tokens: 32,
            ..Default::default()
        },
        ..Request::new(prompt)
    };
    let sample = engine.generate(&[request]).unwrap().remove(0).remove(0);
    assert!(sample.text.contains("Paris"), "answer: {:?}", sample.text);
    assert_eq!(
        sample.finish_reason,
        cotrain_model::engine::FinishReason::Stop,
        "stops at <|im_end|>"
    );
}
