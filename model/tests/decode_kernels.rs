//! The decode step through cotrain's own CPU kernels (`families/transformer/decode_cpu.rs`) against
//! the generic libtorch path of `forward_hidden_cached`, on every f32 tiny family (GQA, q/k/v
//! biases, q/k norm, llama3 and linear RoPE, tied embeddings): hidden states and cache contents
//! after a ragged prefill and several decode steps at different positions per row.

mod support;

use cotrain_model::KvCache;
use cotrain_model::loader::LoadOptions;
use support::*;
use tch::{Kind, Tensor};

const PROMPT_LENS: [i64; 3] = [5, 2, 9];
const STEPS: usize = 4;

/// Runs the prefill and the decode steps; returns the hidden states of the steps and the cache.
fn run(
    model: &cotrain_model::CausalLm,
    grad_mode: bool,
    expect_kernels: bool,
) -> (Vec<Tensor>, KvCache) {
    let vocab = model.config().vocab_size as i64;
    let rows = PROMPT_LENS.len();
    let width = *PROMPT_LENS.iter().max().unwrap();
    let mut cache = KvCache::new(model, rows, (width as usize) + STEPS + 3);
    let prompt = Tensor::arange(rows as i64 * width, (Kind::Int64, tch::Device::Cpu))
        .remainder(vocab)
        .view([rows as i64, width]);
    let body = |cache: &mut KvCache| {
        let _ = model
            .forward_hidden_cached(&prompt, &[0; 3], cache)
            .unwrap();
        assert_eq!(
            model.decodes_in_kernels(cache),
            expect_kernels,
            "grad mode {grad_mode}"
        );
        let mut starts = PROMPT_LENS.to_vec();
        (0..STEPS)
            .map(|step| {
                let ids = Tensor::from_slice(&[3 + step as i64, 7, (11 * step as i64) % vocab])
                    .view([3, 1]);
                let h = model
                    .forward_hidden_cached(&ids, &starts, cache)
                    .unwrap()
                    .detach();
                starts.iter_mut().for_each(|s| *s += 1);
                h
            })
            .collect::<Vec<_>>()
    };
    let hidden = if grad_mode {
        body(&mut cache)
    } else {
        tch::no_grad(|| body(&mut cache))
    };
    (hidden, cache)
}

fn check(name: &str) {
    let loaded = tiny(name, &LoadOptions::default());
    let model = &loaded.model;
    let kernels = cotrain_model::kernels::dispatch::own_kernels();
    // With grad mode on and trainable parameters, autograd would record: the generic path serves.
    let (want, want_cache) = run(model, true, false);
    let (got, got_cache) = run(model, false, kernels);
    for (step, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.size(), w.size());
        let diff = (g - w).abs().max().double_value(&[]);
        assert!(
            diff < 2e-5,
            "{name}, step {step}: hidden states differ by {diff}"
        );
    }
    // The live positions of every row hold the same keys and values.
    for (row, &len) in PROMPT_LENS.iter().enumerate() {
        let live = len + STEPS as i64;
        for layer in 0..model.config().num_hidden_layers {
            for (g, w) in [got_cache.layer(layer).0, got_cache.layer(layer).1]
                .iter()
                .zip([want_cache.layer(layer).0, want_cache.layer(layer).1])
            {
                let g = g.narrow(0, row as i64, 1).narrow(2, 0, live);
                let w = w.detach().narrow(0, row as i64, 1).narrow(2, 0, live);
                let diff = (g - w).abs().max().double_value(&[]);
                assert!(
                    diff < 2e-5,
                    "{name}, row {row}, layer {layer}: cache differs by {diff}"
                );
            }
        }
    }
}

#[test]
fn llama_decode_kernels_match_libtorch() {
    check("llama");
}

#[test]
fn llama3_rope_tied_decode_kernels_match_libtorch() {
    check("llama3_rope");
}

#[test]
fn qwen2_biases_decode_kernels_match_libtorch() {
    check("qwen2");
}

#[test]
fn qwen2_linear_rope_decode_kernels_match_libtorch() {
    check("qwen2_linear_rope");
}

#[test]
fn qwen3_qk_norm_decode_kernels_match_libtorch() {
    check("qwen3");
}

#[test]
fn bf16_models_stay_with_libtorch() {
    let loaded = tiny(
        "llama_bf16",
        &LoadOptions {
            kind: Kind::BFloat16,
            ..Default::default()
        },
    );
    let cache = KvCache::new(&loaded.model, 1, 8);
    assert!(!tch::no_grad(|| loaded.model.decodes_in_kernels(&cache)));
}
