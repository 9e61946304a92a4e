//! The decode step through cotrain's own CPU kernels (`families/transformer/decode_cpu.rs`) against
//! the generic libtorch path of `forward_hidden_cached`, on every f32 tiny family (GQA, q/k/v
//! biases, q/k norm, llama3 and linear RoPE, tied embeddings): hidden states and cache contents
//! after a ragged prefill and several decode steps at different positions per row; and bf16
//! models' kernel decode against the f32 model.

mod support;

use cotrain_model::KvCache;
use cotrain_model::loader::LoadOptions;
use support::*;
use tch::{Kind, Tensor};

const PROMPT_LENS: [i64; 3] = [5, 2, 9];

/// These tests check the kernels themselves, so they run them whatever this machine's pinned
/// dispatch decided (a debug build's kernels, or a loaded machine's first measurement, may have
/// pinned libtorch): `COTRAIN_CPU_KERNELS=on`, the product's own switch, set once before any test
/// of this binary decodes.
fn kernels_on() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    // SAFETY: every test of this binary calls this first, so the variable is set before any of
    // them reads it, and nothing else in the process reads the environment meanwhile.
    ONCE.call_once(|| unsafe { std::env::set_var(cotrain_model::kernels::dispatch::ENV, "on") });
}
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
    kernels_on();
    let loaded = tiny(name, &LoadOptions::default());
    let model = &loaded.model;
    let kernels = cotrain_model::kernels::dispatch::fused_decode();
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

/// A bf16 model decodes through the kernels too (bf16 weights and cache read widened, f32
/// activations). Against the f32 model's generic path, its hidden states are within a stated
/// tolerance (4% of their largest magnitude; libtorch's own bf16 path, which rounds every
/// activation to bf16, measured 0.9–2.8% on these models, the kernels 0.7–2.0%), and no further off
/// than that path. With the AVX512_BF16 option on (`gemm_bf16dot`, which rounds each product's
/// rows to bf16 as libtorch's bf16 path does), the same bounds hold, and the hidden states move (the
/// option took effect). The option is process-wide but only reads bf16 weights, which no other
/// test of this binary decodes.
#[test]
fn bf16_models_decode_in_kernels_within_tolerance_of_f32() {
    kernels_on();
    let bf16 = LoadOptions {
        kind: Kind::BFloat16,
        ..Default::default()
    };
    for name in ["llama", "qwen2", "qwen3"] {
        let f32_model = tiny(name, &LoadOptions::default());
        let bf16_model = tiny(name, &bf16);
        let kernels = cotrain_model::kernels::dispatch::fused_decode();
        let (reference, _) = run(&f32_model.model, true, false);
        let (libtorch, _) = run(&bf16_model.model, true, false);
        let (got, cache) = run(&bf16_model.model, false, kernels);
        assert_eq!(cache.layer(0).0.kind(), Kind::BFloat16);
        for (step, ((g, l), r)) in got.iter().zip(&libtorch).zip(&reference).enumerate() {
            let scale = r.abs().max().double_value(&[]);
            let err =
                |t: &Tensor| (t.to_kind(Kind::Float) - r).abs().max().double_value(&[]) / scale;
            let (e_got, e_lib) = (err(g), err(l));
            assert!(
                e_got < 0.04,
                "{name}, step {step}: bf16 decode {e_got} of the f32 scale off"
            );
            assert!(
                e_got <= 1.5 * e_lib + 1e-3,
                "{name}, step {step}: kernels {e_got} vs libtorch bf16 {e_lib}"
            );
        }
        if kernels && cotrain_model::kernels::gemm_bf16dot::is_available() {
            cotrain_model::kernels::gemm_bf16dot::enable_for(
                Kind::BFloat16,
                tch::Device::Cpu,
                "test",
            )
            .unwrap();
            let (dot, _) = run(&bf16_model.model, false, true);
            cotrain_model::kernels::gemm_bf16dot::set_enabled(false).unwrap();
            let mut moved = 0f64;
            for (step, ((d, g), (l, r))) in dot
                .iter()
                .zip(&got)
                .zip(libtorch.iter().zip(&reference))
                .enumerate()
            {
                let scale = r.abs().max().double_value(&[]);
                let err =
                    |t: &Tensor| (t.to_kind(Kind::Float) - r).abs().max().double_value(&[]) / scale;
                let (e_dot, e_lib) = (err(d), err(l));
                assert!(
                    e_dot < 0.04,
                    "{name}, step {step}: bf16 dot products {e_dot} of the f32 scale off"
                );
                assert!(
                    e_dot <= 1.5 * e_lib + 1e-3,
                    "{name}, step {step}: bf16 dot products {e_dot} vs libtorch bf16 {e_lib}"
                );
                moved = moved.max((d - g).abs().max().double_value(&[]));
            }
            assert!(
                moved > 0.0,
                "{name}: the bf16 dot products changed nothing (did the path run?)"
            );
        }
    }
}
