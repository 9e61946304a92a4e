//! Parity with Hugging Face transformers on the committed tiny fixtures: full-forward logits,
//! greedy continuations through the cached engine, and per-token log-probs / entropies through
//! the chunked kernel, for every family (Llama, Llama 3 RoPE tied, Qwen2 with biases, Qwen2
//! linear RoPE, sharded Qwen2, Qwen3 with q/k norm, bf16 Llama, Phi-3 with a sliding window and
//! with LongRoPE).

mod support;

use cotrain_model::engine::{Engine, Request, SamplingParams, StopConditions};
use cotrain_model::loader::LoadOptions;
use cotrain_model::logprobs::{LogProbOptions, Sequence, completion_logprobs};
use support::*;
use tch::{Kind, Tensor};

fn check_family(name: &str) {
    let reference = reference(name);
    let bf16 = reference["dtype"].as_str().unwrap() == "bfloat16";
    let kind = if bf16 { Kind::BFloat16 } else { Kind::Float };
    let loaded = tiny(
        name,
        &LoadOptions {
            kind,
            ..Default::default()
        },
    );
    // f32 should agree to rounding; bf16 runs in bf16 on both sides with different kernels.
    let (atol, rtol) = if bf16 { (6e-2, 3e-2) } else { (2e-4, 2e-4) };
    let new_tokens = reference["new_tokens"].as_u64().unwrap() as usize;
    let cases = reference["cases"].as_array().unwrap();

    let mut engine = Engine::new(loaded);
    for (c, case) in cases.iter().enumerate() {
        let input = ids(&case["input_ids"]);
        let model = &engine.loaded().model;

        // Full-forward logits.
        let x =
            Tensor::from_slice(&input.iter().map(|&t| t as i64).collect::<Vec<_>>()).unsqueeze(0);
        let logits = tch::no_grad(|| model.forward(&x)).unwrap();
        let want: Vec<f64> = case["logits"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(floats)
            .collect();
        let w = worst(&values(&logits), &want, atol, rtol);
        assert!(w <= 1.0, "{name} case {c}: logits off by {w} x tolerance");

        // Log-probs and entropies through the chunked kernel (chunk 5 forces several chunks).
        let seq = Sequence {
            prompt: input[..1].to_vec(),
            completion: input[1..].to_vec(),
        };
        let lp = completion_logprobs(
            model,
            &[seq],
            &LogProbOptions {
                chunk_size: 5,
                with_grad: false,
                temperature: 1.0,
            },
        )
        .unwrap();
        let w = worst(
            &values(&lp.logprobs),
            &floats(&case["token_logprobs"]),
            atol,
            rtol,
        );
        assert!(
            w <= 1.0,
            "{name} case {c}: token log-probs off by {w} x tolerance"
        );
        let ent = floats(&case["entropy"]);
        let w = worst(&values(&lp.entropy), &ent[..input.len() - 1], atol, rtol);
        assert!(
            w <= 1.0,
            "{name} case {c}: entropies off by {w} x tolerance"
        );

        // Greedy continuation through the KV-cached engine.
        let want_ids = ids(&case["greedy_new_ids"]);
        let margins = floats(&case["greedy_top2_margin"]);
        let request = Request {
            params: SamplingParams::greedy(),
            stop: StopConditions {
                max_new_tokens: new_tokens,
                ignore_eos: true,
                ..Default::default()
            },
            ..Request::new(input.clone())
        };
        let got = engine
            .generate(&[request])
            .unwrap()
            .remove(0)
            .remove(0)
            .token_ids;
        if bf16 {
            // Compare up to the first near-tie, where bf16 rounding may legitimately pick the
            // other token.
            let safe = margins
                .iter()
                .position(|&m| m < 0.25)
                .unwrap_or(margins.len());
            assert_eq!(
                got[..safe],
                want_ids[..safe],
                "{name} case {c}: greedy tokens"
            );
        } else {
            assert_eq!(got, want_ids, "{name} case {c}: greedy tokens");
        }
    }
}

#[test]
fn llama_matches_transformers() {
    check_family("llama");
}

#[test]
fn llama3_rope_tied_matches_transformers() {
    check_family("llama3_rope");
}

#[test]
fn llama_bf16_matches_transformers() {
    check_family("llama_bf16");
}

#[test]
fn qwen2_matches_transformers() {
    check_family("qwen2");
}

#[test]
fn qwen2_linear_rope_matches_transformers() {
    check_family("qwen2_linear_rope");
}

#[test]
fn qwen2_sharded_matches_transformers() {
    check_family("qwen2_sharded");
}

#[test]
fn qwen3_matches_transformers() {
    check_family("qwen3");
}

/// Fused q/k/v and gate/up in the checkpoint, and a sliding window of 8 positions that every case
/// but the shortest prompt outgrows (in the full forward, the prefill and the cached decode).
#[test]
fn phi3_sliding_window_matches_transformers() {
    check_family("phi3");
}

/// LongRoPE with its attention factor: short factors for two cases, long ones for the third.
#[test]
fn phi3_longrope_matches_transformers() {
    check_family("phi3_longrope");
}

#[test]
fn f16_runs_and_stays_close_to_f32() {
    let x = Tensor::from_slice(&[1i64, 40, 7, 200, 13, 99]).unsqueeze(0);
    let f32_model = tiny("qwen2", &LoadOptions::default());
    let f16_model = tiny(
        "qwen2",
        &LoadOptions {
            kind: Kind::Half,
            ..Default::default()
        },
    );
    assert_eq!(f16_model.model.kind(), Kind::Half);
    let a = tch::no_grad(|| f32_model.model.forward(&x)).unwrap();
    let b = tch::no_grad(|| f16_model.model.forward(&x)).unwrap();
    let w = worst(&values(&b), &values(&a), 3e-2, 3e-2);
    assert!(w <= 1.0, "f16 logits off by {w} x tolerance");
}
