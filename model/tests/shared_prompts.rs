//! Prompt sharing in the training kernel: sequences with the same prompt run it once
//! (`CausalLm::forward_hidden_prefixed`) and must give the per-sequence kernel's log-probs,
//! entropies, hidden states and parameter gradients, in the caller's order.

mod support;

use cotrain_model::loader::{LoadOptions, LoadedModel};
use cotrain_model::logprobs::{
    LogProbOptions, Sequence, TokenLogProbs, completion_logprobs_with_sharing, sequence_hidden,
};
use support::*;
use tch::{Kind, Tensor};

fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 3 + (i * 31 + salt * 13) % 250)
        .collect()
}

/// Two prompts with 3 and 2 completions of different lengths (one of a single token),
/// interleaved, a singleton, and a prompt that is a prefix of another one (a different prompt).
fn batch() -> Vec<Sequence> {
    let (a, b, c) = (tokens(6, 1), tokens(3, 2), tokens(9, 3));
    let seq = |prompt: &Vec<u32>, len: usize, salt: u32| Sequence {
        prompt: prompt.clone(),
        completion: tokens(len, salt),
    };
    vec![
        seq(&a, 5, 10),
        seq(&b, 7, 11),
        seq(&a, 9, 12),
        seq(&c, 6, 13),
        seq(&b, 4, 14),
        seq(&a, 1, 15),
        seq(&a[..4].to_vec(), 3, 16),
    ]
}

/// MaPoRL's shape: no two prompts alike, but each agent's prompt begins with its question's
/// message (and every question with the same template tokens), then its own history: prompts
/// that share a common prefix rather than the whole prompt. Sequence 3 is the shortest, so its
/// position 20 is padding.
fn common_prefix_batch() -> Vec<Sequence> {
    let q1 = tokens(10, 1);
    let q2: Vec<u32> = q1[..3].iter().copied().chain(tokens(6, 5)).collect();
    let seq = |parts: &[&[u32]], len: usize, salt: u32| Sequence {
        prompt: parts.concat(),
        completion: tokens(len, salt),
    };
    let (x, y, z, w) = (tokens(5, 20), tokens(7, 21), tokens(3, 22), tokens(6, 23));
    vec![
        seq(&[&q1, &x], 4, 10),
        seq(&[&q2, &z], 5, 11),
        seq(&[&q1, &y], 6, 12),
        seq(&[&q2, &w], 2, 13),
        seq(&[&q1, &x[..3], &tokens(2, 24)], 3, 14),
    ]
}

/// Two prompts of 18 and 20 tokens, each with two completions: every sequence but the third
/// passes `phi3_longrope`'s original context of 24 positions, so both kernels rotate with the long
/// factors. Sequence 2 (21 tokens) is the shortest: its position 22 is padding.
fn long_batch() -> Vec<Sequence> {
    let (a, b) = (tokens(18, 1), tokens(20, 2));
    let seq = |prompt: &Vec<u32>, len: usize, salt: u32| Sequence {
        prompt: prompt.clone(),
        completion: tokens(len, salt),
    };
    vec![
        seq(&a, 9, 10),
        seq(&b, 7, 11),
        seq(&a, 3, 12),
        seq(&b, 5, 13),
    ]
}

fn take_grads(loaded: &LoadedModel) -> Vec<(String, Tensor)> {
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

/// (B, L, 1) weights on the real positions of `hidden()` (a stand-in for a value head), zero on
/// padding.
fn hidden_weights(batch: &[Sequence], l: i64) -> Tensor {
    let mut w = vec![0f32; batch.len() * l as usize];
    for (b, s) in batch.iter().enumerate() {
        for i in 0..s.prompt.len() + s.completion.len() {
            w[b * l as usize + i] = 0.01 * ((b * 7 + i) % 5) as f32 - 0.02;
        }
    }
    Tensor::from_slice(&w).view([batch.len() as i64, l, 1])
}

/// Runs the kernel with a loss on log-probs, entropies and hidden states, back-propagates it,
/// and returns the outputs with the parameter gradients.
fn run(
    loaded: &LoadedModel,
    batch: &[Sequence],
    share: bool,
) -> (TokenLogProbs, Vec<f64>, Vec<(String, Tensor)>) {
    let opts = LogProbOptions {
        chunk_size: 4,
        with_grad: true,
        temperature: 1.0,
    };
    let out = completion_logprobs_with_sharing(&loaded.model, batch, &opts, share).unwrap();
    let n = out.logprobs.size()[0];
    let w = Tensor::arange(n, (Kind::Float, tch::Device::Cpu)) * 0.1 - 1.3;
    let hidden = out.hidden().unwrap();
    let l = hidden.size()[1];
    let hidden_vals = values(&(hidden * hidden_weights(batch, l)));
    let loss = (&out.logprobs * &w).sum(Kind::Float)
        + out.entropy.sum(Kind::Float) * 0.3
        + (hidden * hidden_weights(batch, l)).sum(Kind::Float);
    out.backward(&loss).unwrap();
    (out, hidden_vals, take_grads(loaded))
}

fn check(name: &str) {
    check_batch(name, &batch(), (5, 7));
}

/// The shared and per-sequence kernels agree on `batch`; position `pad.1` of sequence `pad.0`
/// is padding, which the shared kernel's hidden view reads as zeros.
fn check_batch(name: &str, batch: &[Sequence], pad: (i64, i64)) {
    let loaded = tiny(name, &LoadOptions::default());
    let (plain, plain_hidden, g_plain) = run(&loaded, batch, false);
    let (shared, shared_hidden, g_shared) = run(&loaded, batch, true);

    assert_eq!(shared.offsets, plain.offsets);
    let wv = worst(
        &values(&shared.logprobs),
        &values(&plain.logprobs),
        1e-5,
        1e-5,
    );
    assert!(wv <= 1.0, "{name}: log-probs off by {wv} x tolerance");
    let we = worst(
        &values(&shared.entropy),
        &values(&plain.entropy),
        1e-5,
        1e-5,
    );
    assert!(we <= 1.0, "{name}: entropies off by {we} x tolerance");
    let (hs, hp) = (shared.hidden().unwrap(), plain.hidden().unwrap());
    assert_eq!(hs.size(), hp.size());
    let wh = worst(&shared_hidden, &plain_hidden, 1e-5, 1e-5);
    assert!(wh <= 1.0, "{name}: hidden states off by {wh} x tolerance");
    // Sharing really ran: its hidden view reads padding as zeros, the per-sequence one does not.
    let padding = hs.get(pad.0).narrow(0, pad.1, 1);
    assert_eq!(padding.abs().sum(Kind::Float).double_value(&[]), 0.0);
    assert!(
        hp.get(pad.0)
            .narrow(0, pad.1, 1)
            .abs()
            .sum(Kind::Float)
            .double_value(&[])
            > 0.0
    );

    assert_eq!(g_shared.len(), g_plain.len());
    for ((n1, a), (n2, b)) in g_shared.iter().zip(&g_plain) {
        assert_eq!(n1, n2);
        assert!(a.defined() && b.defined(), "{name}: {n1} has no gradient");
        let scale = values(b)
            .iter()
            .fold(0.0f64, |m, x| m.max(x.abs()))
            .max(1e-6);
        let wg = worst(&values(a), &values(b), 1e-5 * scale, 1e-5);
        assert!(
            wg <= 1.0,
            "{name}: gradient of {n1} off by {wg} x tolerance"
        );
    }
}

#[test]
fn shared_prompts_equal_per_sequence_kernel_gqa_untied() {
    check("llama");
}

#[test]
fn shared_prompts_equal_per_sequence_kernel_tied_qk_norm() {
    check("qwen3");
}

#[test]
fn shared_prompts_equal_per_sequence_kernel_biases() {
    check("qwen2");
}

#[test]
fn shared_prompts_equal_per_sequence_kernel_llama3_rope() {
    check("llama3_rope");
}

/// Phi-3's sliding window (8 positions) binds in the prefix pass and across prefix and
/// continuation.
#[test]
fn shared_prompts_equal_per_sequence_kernel_sliding_window() {
    check("phi3");
    check_batch("phi3", &common_prefix_batch(), (3, 20));
}

/// LongRoPE: the prefix pass rotates with the table of the whole rows (long factors here).
#[test]
fn shared_prompts_equal_per_sequence_kernel_longrope() {
    check_batch("phi3_longrope", &long_batch(), (2, 22));
}

#[test]
fn common_prompt_prefixes_equal_per_sequence_kernel_gqa_untied() {
    check_batch("llama", &common_prefix_batch(), (3, 20));
}

#[test]
fn common_prompt_prefixes_equal_per_sequence_kernel_tied_qk_norm() {
    check_batch("qwen3", &common_prefix_batch(), (3, 20));
}

/// `sequence_hidden` (the critic's trunk) gives the plain forward's hidden states on every real
/// position of prompts that share a common prefix, and carries gradients back through the shared
/// prefix to the parameters as the plain forward does.
#[test]
fn sequence_hidden_with_common_prefixes_equals_plain_forward() {
    let loaded = tiny("llama", &LoadOptions::default());
    let batch = common_prefix_batch();
    let shared = sequence_hidden(&loaded.model, &batch, None).unwrap();
    let l = shared.size()[1];
    let w = hidden_weights(&batch, l);
    (&shared * &w).sum(Kind::Float).backward();
    // The trunk's parameters (the LM head gets no gradient here).
    let grads = |loaded: &LoadedModel| {
        let mut g: Vec<(String, Option<Tensor>)> = loaded
            .named_parameters()
            .into_iter()
            .map(|(n, t)| {
                let mut gr = t.grad();
                let out = gr.defined().then(|| gr.copy());
                if gr.defined() {
                    let _ = gr.zero_();
                }
                (n, out)
            })
            .collect();
        g.sort_by(|a, b| a.0.cmp(&b.0));
        g
    };
    let g_shared = grads(&loaded);
    for (b, s) in batch.iter().enumerate() {
        let h = full_hidden(&loaded, &s.prompt, &s.completion);
        let n = h.size()[0];
        let worst_row = worst(
            &values(&h),
            &values(&shared.get(b as i64).narrow(0, 0, n)),
            1e-5,
            1e-5,
        );
        assert!(
            worst_row <= 1.0,
            "sequence {b}: hidden states off by {worst_row} x tolerance"
        );
    }
    let mut plain_loss = Tensor::zeros([], (Kind::Float, tch::Device::Cpu));
    for (b, s) in batch.iter().enumerate() {
        let ids = Tensor::from_slice(
            &s.prompt
                .iter()
                .chain(&s.completion)
                .map(|&t| t as i64)
                .collect::<Vec<_>>(),
        )
        .view([1, -1]);
        let h = loaded.model.forward_hidden(&ids).unwrap().squeeze_dim(0);
        let n = h.size()[0];
        plain_loss += (h * w.get(b as i64).narrow(0, 0, n)).sum(Kind::Float);
    }
    plain_loss.backward();
    let g_plain = grads(&loaded);
    assert!(g_shared.iter().filter(|(_, g)| g.is_some()).count() > 10);
    for ((n1, a), (_, b)) in g_shared.iter().zip(&g_plain) {
        let (Some(a), Some(b)) = (a, b) else {
            assert!(
                a.is_none() && b.is_none(),
                "{n1}: a gradient in one forward only"
            );
            continue;
        };
        let scale = values(b)
            .iter()
            .fold(0.0f64, |m, x| m.max(x.abs()))
            .max(1e-6);
        let wg = worst(&values(a), &values(b), 1e-5 * scale, 1e-5);
        assert!(wg <= 1.0, "gradient of {n1} off by {wg} x tolerance");
    }
    // The prefixes were shared: padding reads as zeros.
    assert_eq!(
        shared
            .get(3)
            .narrow(0, 20, 1)
            .abs()
            .sum(Kind::Float)
            .double_value(&[]),
        0.0
    );
}

#[test]
fn shared_prompts_without_grad_equal_per_sequence_kernel() {
    let loaded = tiny("qwen3", &LoadOptions::default());
    let batch = batch();
    let opts = LogProbOptions {
        chunk_size: 5,
        with_grad: false,
        temperature: 1.0,
    };
    let plain = completion_logprobs_with_sharing(&loaded.model, &batch, &opts, false).unwrap();
    let shared = completion_logprobs_with_sharing(&loaded.model, &batch, &opts, true).unwrap();
    assert!(!shared.logprobs.requires_grad() && shared.hidden().is_none());
    let (lp_s, mask_s) = shared.padded();
    let (lp_p, mask_p) = plain.padded();
    assert!(mask_s.equal(&mask_p));
    let w = worst(&values(&lp_s), &values(&lp_p), 1e-5, 1e-5);
    assert!(w <= 1.0, "log-probs off by {w} x tolerance");
}

/// Hidden states of `prompt ++ completion` rows from the plain forward, one row at a time.
fn full_hidden(loaded: &LoadedModel, prompt: &[u32], completion: &[u32]) -> Tensor {
    let ids: Vec<i64> = prompt.iter().chain(completion).map(|&t| t as i64).collect();
    let n = ids.len() as i64;
    let _guard = tch::no_grad_guard();
    loaded
        .model
        .forward_hidden(&Tensor::from_slice(&ids).view([1, n]))
        .unwrap()
        .get(0)
}

fn ids_2d(rows: &[Vec<u32>]) -> Tensor {
    let l = rows.iter().map(Vec::len).max().unwrap();
    let mut flat = vec![0i64; rows.len() * l];
    for (r, row) in rows.iter().enumerate() {
        for (j, &t) in row.iter().enumerate() {
            flat[r * l + j] = t as i64;
        }
    }
    Tensor::from_slice(&flat).view([rows.len() as i64, l as i64])
}

fn check_prefixed(loaded: &LoadedModel, prefixes: &[Vec<u32>], conts: &[(usize, Vec<u32>)]) {
    let lens: Vec<i64> = prefixes.iter().map(|p| p.len() as i64).collect();
    let of: Vec<i64> = conts.iter().map(|c| c.0 as i64).collect();
    let cont_rows: Vec<Vec<u32>> = conts.iter().map(|c| c.1.clone()).collect();
    let (hp, hc) = {
        let _guard = tch::no_grad_guard();
        loaded
            .model
            .forward_hidden_prefixed(&ids_2d(prefixes), &lens, &ids_2d(&cont_rows), &of)
            .unwrap()
    };
    assert_eq!(hp.size()[0], prefixes.len() as i64);
    assert_eq!(hc.size()[0], conts.len() as i64);
    for (b, (g, cont)) in conts.iter().enumerate() {
        let prefix = &prefixes[*g];
        let (p, c) = (prefix.len() as i64, cont.len() as i64);
        let full = full_hidden(loaded, prefix, cont);
        let w = worst(
            &values(&hp.get(*g as i64).narrow(0, 0, p)),
            &values(&full.narrow(0, 0, p)),
            1e-5,
            1e-5,
        );
        assert!(w <= 1.0, "prefix {g}: hidden states off by {w} x tolerance");
        let w = worst(
            &values(&hc.get(b as i64).narrow(0, 0, c)),
            &values(&full.narrow(0, p, c)),
            1e-5,
            1e-5,
        );
        assert!(
            w <= 1.0,
            "continuation {b}: hidden states off by {w} x tolerance"
        );
    }
}

#[test]
fn prefixed_forward_matches_full_forward_hidden_states() {
    for name in ["llama", "qwen3", "qwen2_linear_rope"] {
        let loaded = tiny(name, &LoadOptions::default());
        // One prefix, broadcast to its continuations.
        check_prefixed(
            &loaded,
            &[tokens(7, 1)],
            &[(0, tokens(4, 2)), (0, tokens(9, 3)), (0, tokens(1, 4))],
        );
        // Prefixes of different lengths (padding masked), continuations in mixed order.
        check_prefixed(
            &loaded,
            &[tokens(3, 5), tokens(8, 6), tokens(1, 7)],
            &[
                (1, tokens(5, 8)),
                (0, tokens(6, 9)),
                (2, tokens(2, 10)),
                (1, tokens(3, 11)),
            ],
        );
    }
}

#[test]
fn prefixed_forward_rejects_bad_indices() {
    let loaded = tiny("llama", &LoadOptions::default());
    let (p, c) = (ids_2d(&[tokens(3, 1)]), ids_2d(&[tokens(2, 2)]));
    let m = &loaded.model;
    assert!(m.forward_hidden_prefixed(&p, &[3], &c, &[1]).is_err());
    assert!(m.forward_hidden_prefixed(&p, &[4], &c, &[0]).is_err());
    assert!(m.forward_hidden_prefixed(&p, &[3], &c, &[0, 0]).is_err());
    assert!(m.forward_hidden_prefixed(&p, &[3], &c, &[0]).is_ok());
}
