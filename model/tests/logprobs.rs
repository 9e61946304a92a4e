//! The chunked log-prob kernel against the naive full-logits computation: values, entropies,
//! the padded layout, and parameter gradients (chunked two-phase backward vs plain autograd),
//! for tied (Qwen3) and untied (Qwen2 with biases) heads.

mod support;

use cotrain_model::loader::LoadOptions;
use cotrain_model::logprobs::{
    LogProbOptions, Sequence, completion_logprobs, naive_completion_logprobs,
    naive_completion_logprobs_at,
};
use support::*;
use tch::{Kind, Tensor};

fn batch() -> Vec<Sequence> {
    let mk = |p: usize, c: usize, salt: u32| Sequence {
        prompt: (0..p as u32).map(|i| 3 + (i * 31 + salt) % 250).collect(),
        completion: (0..c as u32)
            .map(|i| 3 + (i * 17 + salt * 7) % 250)
            .collect(),
    };
    vec![mk(5, 7, 1), mk(2, 12, 2), mk(9, 3, 3), mk(1, 1, 4)]
}

/// Weights per token so the loss is not symmetric in the tokens.
fn weights(n: i64) -> Tensor {
    Tensor::arange(n, (Kind::Float, tch::Device::Cpu)) * 0.1 - 0.7
}

fn grads(loaded: &cotrain_model::loader::LoadedModel) -> Vec<(String, Tensor)> {
    let mut g: Vec<(String, Tensor)> = loaded
        .named_parameters()
        .into_iter()
        .map(|(n, t)| (n, t.grad().copy()))
        .collect();
    g.sort_by(|a, b| a.0.cmp(&b.0));
    for (_, t) in loaded.named_parameters() {
        let mut gr = t.grad();
        if gr.defined() {
            let _ = gr.zero_();
        }
    }
    g
}

fn check(name: &str) {
    // Chunk 4: several chunks, one crossing sequence boundaries; all but the last recomputed in
    // the backward.
    check_at(name, 4, 1.0);
}

/// The kernel at `chunk_size` and `temperature` against the naive computation, values and
/// parameter gradients of a loss on both the log-probs and the entropies.
fn check_at(name: &str, chunk_size: usize, temperature: f64) {
    let loaded = tiny(name, &LoadOptions::default());
    let model = &loaded.model;
    let batch = batch();
    let n: usize = batch.iter().map(|s| s.completion.len()).sum();

    // Naive: full logits, plain autograd.
    let (lp_ref, ent_ref, offsets_ref) = if temperature == 1.0 {
        naive_completion_logprobs(model, &batch).unwrap()
    } else {
        naive_completion_logprobs_at(model, &batch, temperature).unwrap()
    };
    let w = weights(n as i64);
    let loss_ref = (&lp_ref * &w).sum(Kind::Float) + ent_ref.sum(Kind::Float) * 0.3;
    loss_ref.backward();
    let g_ref = grads(&loaded);

    let out = completion_logprobs(
        model,
        &batch,
        &LogProbOptions {
            chunk_size,
            with_grad: true,
            temperature,
        },
    )
    .unwrap();
    assert_eq!(out.offsets, offsets_ref);
    assert_eq!(out.logprobs.size(), vec![n as i64]);
    let wv = worst(&values(&out.logprobs), &values(&lp_ref), 1e-5, 1e-5);
    assert!(wv <= 1.0, "{name}: log-probs off by {wv} x tolerance");
    let we = worst(&values(&out.entropy), &values(&ent_ref), 1e-5, 1e-5);
    assert!(we <= 1.0, "{name}: entropies off by {we} x tolerance");
    let loss = (&out.logprobs * &w).sum(Kind::Float) + out.entropy.sum(Kind::Float) * 0.3;
    out.backward(&loss).unwrap();
    let g = grads(&loaded);

    assert_eq!(g.len(), g_ref.len());
    for ((n1, a), (n2, b)) in g.iter().zip(&g_ref) {
        assert_eq!(n1, n2);
        assert!(b.defined() && a.defined(), "{name}: {n1} has no gradient");
        let scale = values(b)
            .iter()
            .fold(0.0f64, |m, x| m.max(x.abs()))
            .max(1e-6);
        let wg = worst(&values(a), &values(b), 1e-5 * scale, 1e-4);
        assert!(
            wg <= 1.0,
            "{name}: gradient of {n1} off by {wg} x tolerance"
        );
    }
}

#[test]
fn chunked_kernel_equals_naive_tied_head() {
    check("qwen3");
}

/// One chunk for the whole batch (GRPO's usual case): its backward is the closed-form one, never
/// a recomputation; at a sampling temperature (MaPoRL) too, tied and untied heads.
#[test]
fn closed_form_head_backward_equals_naive_at_temperatures() {
    for name in ["qwen3", "qwen2"] {
        check_at(name, 512, 1.0);
        check_at(name, 512, 0.7);
        check_at(name, 5, 1.3);
    }
}

#[test]
fn chunked_kernel_equals_naive_untied_head_with_biases() {
    check("qwen2");
}

#[test]
fn padded_layout_and_mask() {
    let loaded = tiny("llama", &LoadOptions::default());
    let batch = batch();
    let out = completion_logprobs(
        &loaded.model,
        &batch,
        &LogProbOptions {
            chunk_size: 3,
            with_grad: false,
            temperature: 1.0,
        },
    )
    .unwrap();
    let (padded, mask) = out.padded();
    assert_eq!(padded.size(), vec![4, 12]);
    let flat = values(&out.logprobs);
    for (b, s) in batch.iter().enumerate() {
        let row = values(&padded.get(b as i64));
        let m: Vec<bool> = Vec::<bool>::try_from(&mask.get(b as i64)).unwrap();
        for j in 0..12 {
            assert_eq!(m[j], j < s.completion.len());
            if j < s.completion.len() {
                assert_eq!(row[j], flat[out.offsets[b] + j]);
            } else {
                assert_eq!(row[j], 0.0);
            }
        }
    }
    // Without grad nothing requires grad, and backward is refused.
    assert!(!out.logprobs.requires_grad());
    assert!(out.propagate().is_err());
}

#[test]
fn a_value_head_on_the_shared_hidden_states_gets_gradients_through_the_trunk() {
    let loaded = tiny("llama", &LoadOptions::default());
    let out = completion_logprobs(&loaded.model, &batch(), &LogProbOptions::default()).unwrap();
    let hidden = out.hidden().unwrap();
    let value_loss = hidden.mean(Kind::Float);
    let loss = out.logprobs.sum(Kind::Float) + value_loss;
    out.backward(&loss).unwrap();
    let g = loaded.named_parameters()["model.layers.0.self_attn.q_proj.weight"].grad();
    assert!(g.defined() && g.abs().sum(Kind::Float).double_value(&[]) > 0.0);
}

#[test]
fn bad_batches_are_rejected() {
    let loaded = tiny("llama", &LoadOptions::default());
    let ctx = loaded.model.config().max_position_embeddings;
    let opts = LogProbOptions::default();
    let empty = Sequence {
        prompt: vec![1],
        completion: vec![],
    };
    assert!(completion_logprobs(&loaded.model, &[empty], &opts).is_err());
    let long = Sequence {
        prompt: vec![1; ctx],
        completion: vec![2],
    };
    let e = completion_logprobs(&loaded.model, &[long], &opts)
        .unwrap_err()
        .to_string();
    assert!(e.contains("beyond the model's context"), "{e}");
    assert!(completion_logprobs(&loaded.model, &[], &opts).is_err());
}

/// bf16 products of f32 master weights (`set_matmul_kind`): the chunked kernel's log-probs are
/// within bf16 rounding of the f32 ones, its gradients land on the f32 parameters in f32 and point
/// the same way as the f32 gradients (cosine > 0.99 for every parameter), and `None` restores the
/// f32 products exactly.
#[test]
fn bf16_products_give_f32_gradients_close_to_the_f32_ones() {
    for name in ["qwen3", "qwen2"] {
        let loaded = tiny(name, &LoadOptions::default());
        let model = &loaded.model;
        let batch = batch();
        let opts = LogProbOptions {
            chunk_size: 4,
            with_grad: true,
            temperature: 1.0,
        };
        let run = || {
            let out = completion_logprobs(model, &batch, &opts).unwrap();
            let w = weights(out.logprobs.size()[0]);
            let loss = (&out.logprobs * &w).sum(Kind::Float) + out.entropy.sum(Kind::Float) * 0.3;
            out.backward(&loss).unwrap();
            (out.logprobs.detach(), grads(&loaded))
        };
        let (lp32, g32) = run();
        model.set_matmul_kind(Some(Kind::BFloat16));
        assert_eq!(model.matmul_kind(), Some(Kind::BFloat16));
        let (lp16, g16) = run();
        let gap = (&lp16 - &lp32).abs().max().double_value(&[]);
        assert!(
            gap > 0.0 && gap < 0.05,
            "{name}: bf16 products move log-probs by {gap}"
        );
        for ((n, a), (_, b)) in g16.iter().zip(&g32) {
            assert_eq!(a.kind(), Kind::Float, "{name}: {n}'s gradient is f32");
            let cos = (a * b).sum(Kind::Double).double_value(&[])
                / (a.norm().double_value(&[]) * b.norm().double_value(&[])).max(1e-30);
            assert!(
                cos > 0.99 || b.norm().double_value(&[]) < 1e-12,
                "{name}: {n}: cosine {cos}"
            );
        }
        model.set_matmul_kind(None);
        let (lp_back, _) = run();
        assert_eq!(
            (&lp_back - &lp32).abs().max().double_value(&[]),
            0.0,
            "{name}"
        );
    }
}
