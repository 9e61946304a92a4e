//! LoRA adapters on a frozen base: the base stays bit-identical, the on-the-fly adapter equals the
//! merged model, adapter gradients (through the chunked log-prob kernel the learner trains with)
//! match finite differences, PEFT files round-trip, and an adapter is a small fraction of the model.

mod support;

use std::collections::HashMap;

use cotrain_model::loader::LoadOptions;
use cotrain_model::logprobs::{LogProbOptions, Sequence, completion_logprobs};
use cotrain_model::lora::{LoraAdapter, LoraConfig};
use support::*;
use tch::{Kind, Tensor};

fn input() -> Tensor {
    Tensor::from_slice(&[3i64, 17, 42, 9, 101, 7, 55, 12]).view([1, 8])
}

fn logits(m: &cotrain_model::families::CausalLm) -> Tensor {
    let _g = tch::no_grad_guard();
    m.forward(&input()).unwrap()
}

/// An adapter whose B is random too (a fresh adapter changes nothing, by design).
fn trained_like(model: &cotrain_model::families::CausalLm, cfg: LoraConfig) -> LoraAdapter {
    trained_like_seeded(model, cfg, 7)
}

fn trained_like_seeded(
    model: &cotrain_model::families::CausalLm,
    cfg: LoraConfig,
    seed: i64,
) -> LoraAdapter {
    tch::manual_seed(seed);
    let ad = LoraAdapter::new(model, cfg).unwrap();
    let _g = tch::no_grad_guard();
    for (name, mut t) in ad.named_tensors() {
        if name.contains("lora_B") {
            t.copy_(&(Tensor::randn(t.size(), (Kind::Float, t.device())) * 0.05));
        }
    }
    ad
}

fn no_dropout() -> LoraConfig {
    LoraConfig {
        dropout: 0.0,
        ..LoraConfig::default()
    }
}

fn batch() -> Vec<Sequence> {
    vec![
        Sequence {
            prompt: vec![5, 9, 13],
            completion: vec![40, 41, 77, 2],
        },
        Sequence {
            prompt: vec![5, 9, 13],
            completion: vec![8, 8],
        },
        Sequence {
            prompt: vec![100, 3],
            completion: vec![60, 61, 62],
        },
    ]
}

fn weighted_loss(
    model: &cotrain_model::families::CausalLm,
    with_grad: bool,
) -> (Tensor, cotrain_model::logprobs::TokenLogProbs) {
    let opts = LogProbOptions {
        chunk_size: 3,
        with_grad,
        temperature: 0.7,
    };
    let tlp = completion_logprobs(model, &batch(), &opts).unwrap();
    let n = tlp.logprobs.size()[0];
    let w = Tensor::arange(n, (Kind::Float, tch::Device::Cpu)) * 0.3 - 1.0;
    ((&tlp.logprobs * w).sum(Kind::Float), tlp)
}

#[test]
fn a_fresh_adapter_changes_nothing_and_removing_one_restores_the_base_exactly() {
    let loaded = tiny("qwen2", &LoadOptions::default());
    let m = &loaded.model;
    let base = logits(m);
    let fresh = LoraAdapter::new(m, no_dropout()).unwrap();
    m.set_adapter(Some(&fresh), false).unwrap();
    assert!(m.has_adapter());
    assert!(
        logits(m).allclose(&base, 1e-6, 1e-6, false),
        "B = 0 must leave outputs unchanged"
    );
    let ad = trained_like(m, no_dropout());
    m.set_adapter(Some(&ad), false).unwrap();
    let adapted = logits(m);
    assert!(
        !adapted.allclose(&base, 1e-4, 1e-4, false),
        "a non-zero adapter must change the outputs"
    );
    m.set_adapter(None, false).unwrap();
    assert!(!m.has_adapter());
    assert!(
        logits(m).equal(&base),
        "without the adapter the base's outputs must come back bit for bit"
    );
}

#[test]
fn training_the_adapter_leaves_the_base_bit_identical() {
    let loaded = tiny("llama", &LoadOptions::default());
    let m = &loaded.model;
    let before: Vec<(String, Tensor)> = loaded
        .named_parameters()
        .into_iter()
        .map(|(k, v)| (k, v.copy()))
        .collect();
    let ad = trained_like(m, LoraConfig::default());
    use tch::nn::OptimizerConfig as _;
    let mut opt = tch::nn::Adam::default().build(&ad.vs, 1e-2).unwrap();
    let adapter_before: HashMap<String, Tensor> = ad
        .named_tensors()
        .into_iter()
        .map(|(k, v)| (k, v.copy()))
        .collect();
    for _ in 0..3 {
        m.set_adapter(Some(&ad), true).unwrap();
        let (loss, tlp) = weighted_loss(m, true);
        opt.zero_grad();
        tlp.backward(&loss).unwrap();
        opt.step();
    }
    m.set_adapter(None, false).unwrap();
    for (name, t) in &before {
        assert!(
            loaded.named_parameters()[name].equal(t),
            "base parameter `{name}` changed"
        );
    }
    let moved = ad
        .named_tensors()
        .iter()
        .filter(|(k, v)| !v.equal(&adapter_before[*k]))
        .count();
    assert_eq!(
        moved,
        ad.named_tensors().len(),
        "every adapter tensor must have been trained"
    );
}

#[test]
fn on_the_fly_adapter_equals_the_merged_model() {
    for family in ["qwen2", "llama", "qwen3"] {
        let loaded = tiny(family, &LoadOptions::default());
        let m = &loaded.model;
        let ad = trained_like(m, no_dropout());
        m.set_adapter(Some(&ad), false).unwrap();
        let on_the_fly = logits(m);
        let (on_the_fly_lp, _) = weighted_loss(m, false);
        m.set_adapter(None, false).unwrap();

        let merged_model = tiny(family, &LoadOptions::default());
        let merged: HashMap<String, Tensor> = ad
            .merged(&loaded.named_parameters())
            .unwrap()
            .into_iter()
            .collect();
        assert_eq!(
            merged.len(),
            7 * m.config().num_hidden_layers,
            "{family}: one merged weight per projection"
        );
        merged_model.load_named_tensors(&merged).unwrap();
        let merged_logits = logits(&merged_model.model);
        let diff = f64::try_from((&on_the_fly - &merged_logits).abs().max()).unwrap();
        assert!(
            diff < 2e-5,
            "{family}: on-the-fly vs merged logits differ by {diff}"
        );
        let (merged_lp, _) = weighted_loss(&merged_model.model, false);
        let d = f64::try_from((on_the_fly_lp - merged_lp).abs()).unwrap();
        assert!(d < 1e-4, "{family}: log-prob loss differs by {d}");
    }
}

#[test]
fn adapter_gradients_match_finite_differences() {
    let loaded = tiny("qwen2", &LoadOptions::default());
    let m = &loaded.model;
    let mut vs = loaded.vs;
    vs.freeze();
    let ad = trained_like(m, no_dropout());
    m.set_adapter(Some(&ad), false).unwrap();
    let (loss, tlp) = weighted_loss(m, true);
    tlp.backward(&loss).unwrap();
    let tensors = ad.named_tensors();
    let base_grads: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .filter(|(_, t)| t.grad().defined())
        .collect();
    assert!(
        base_grads.is_empty(),
        "the frozen base must get no gradient: {:?}",
        base_grads.iter().map(|(k, _)| k).collect::<Vec<_>>()
    );
    let mut checked = 0;
    for name in [
        "model.layers.0.self_attn.q_proj.lora_A.weight",
        "model.layers.1.mlp.down_proj.lora_B.weight",
        "model.layers.0.self_attn.v_proj.lora_B.weight",
    ] {
        let t = &tensors[name];
        let grad = t.grad().flatten(0, -1);
        // The three entries with the largest gradient: finite differences in f32 are only
        // meaningful well above the rounding noise.
        let (_, idx) = grad.abs().topk(3, 0, true, true);
        for i in Vec::<i64>::try_from(&idx).unwrap() {
            let analytic = f64::try_from(grad.get(i)).unwrap();
            let eps = 1e-2;
            let mut flat = t.flatten(0, -1);
            let orig = f64::try_from(flat.get(i)).unwrap();
            let eval = |v: f64, flat: &mut Tensor| {
                let _g = tch::no_grad_guard();
                let _ = flat.get(i).fill_(v);
                f64::try_from(weighted_loss(m, false).0).unwrap()
            };
            let numeric = (eval(orig + eps, &mut flat) - eval(orig - eps, &mut flat)) / (2.0 * eps);
            eval(orig, &mut flat);
            let tol = 0.02 * analytic.abs().max(1e-2);
            assert!(
                (numeric - analytic).abs() < tol,
                "{name}[{i}]: autograd {analytic} vs finite difference {numeric}"
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 9);
}

#[test]
fn peft_files_round_trip_and_an_adapter_is_a_small_fraction_of_the_model() {
    let loaded = tiny("qwen2", &LoadOptions::default());
    let m = &loaded.model;
    let ad = trained_like(m, no_dropout());
    let dir = tempfile::tempdir().unwrap();
    ad.save_peft(dir.path(), "tiny/qwen2").unwrap();
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(config["r"], 8);
    assert_eq!(config["lora_alpha"], 16.0);
    assert_eq!(config["peft_type"], "LORA");
    let names: Vec<String> = Tensor::read_safetensors(dir.path().join("adapter_model.safetensors"))
        .unwrap()
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert!(
        names
            .iter()
            .all(|n| n.starts_with("base_model.model.model.layers.")),
        "PEFT names: {names:?}"
    );
    let back = LoraAdapter::load_peft(dir.path(), m).unwrap();
    for (k, v) in ad.named_tensors() {
        assert!(
            back.named_tensors()[&k].equal(&v),
            "{k} changed through the files"
        );
    }
    let full: usize = loaded
        .named_parameters()
        .values()
        .map(|t| t.numel() * 4)
        .sum();
    println!(
        "tiny qwen2: adapter {} bytes, full model {full} bytes ({:.1}%)",
        ad.num_bytes(),
        100.0 * ad.num_bytes() as f64 / full as f64
    );
    assert!(ad.num_bytes() < full);
}

/// PEFT, given MaPoRL's seven target names on Phi-3, adapts `o_proj` and `down_proj` only (the
/// others are fused there) and refuses a list that names neither
/// (scripts/reference/phi3_lora_targets.py); so does cotrain, and the adapted model still equals
/// its merged one.
#[test]
fn on_phi3_lora_targets_what_peft_targets() {
    let loaded = tiny("phi3", &LoadOptions::default());
    let m = &loaded.model;
    let ad = trained_like(m, no_dropout());
    assert_eq!(ad.config.target_modules, ["o_proj", "down_proj"]);
    let dir = tempfile::tempdir().unwrap();
    ad.save_peft(dir.path(), "tiny/phi3").unwrap();
    let names: Vec<String> = Tensor::read_safetensors(dir.path().join("adapter_model.safetensors"))
        .unwrap()
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(
        names.len(),
        2 * 2 * m.config().num_hidden_layers,
        "{names:?}"
    );
    assert!(
        names
            .iter()
            .all(|n| n.contains(".o_proj.") || n.contains(".down_proj.")),
        "{names:?}"
    );
    m.set_adapter(Some(&ad), false).unwrap();
    let adapted = logits(m);
    m.set_adapter(None, false).unwrap();
    let merged_model = tiny("phi3", &LoadOptions::default());
    let merged: HashMap<String, Tensor> = ad
        .merged(&loaded.named_parameters())
        .unwrap()
        .into_iter()
        .collect();
    merged_model.load_named_tensors(&merged).unwrap();
    let diff = f64::try_from((&adapted - logits(&merged_model.model)).abs().max()).unwrap();
    assert!(
        diff < 2e-5,
        "Phi-3: on-the-fly vs merged logits differ by {diff}"
    );

    let err = LoraAdapter::new(
        m,
        LoraConfig {
            target_modules: vec!["q_proj".into(), "v_proj".into()],
            ..LoraConfig::default()
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("qkv_proj"), "{err}");
}

#[test]
fn bad_adapter_configs_are_refused_by_name() {
    let loaded = tiny("qwen2", &LoadOptions::default());
    let err = LoraAdapter::new(
        &loaded.model,
        LoraConfig {
            target_modules: vec!["qkv".into()],
            ..LoraConfig::default()
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("`qkv`"), "{err}");
    let err = LoraAdapter::new(
        &loaded.model,
        LoraConfig {
            r: 0,
            ..LoraConfig::default()
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("r must be"), "{err}");
    let other = tiny("llama", &LoadOptions::default());
    let ad = LoraAdapter::new(&other.model, LoraConfig::default()).unwrap();
    let same_shapes = other.model.config().num_hidden_layers
        == loaded.model.config().num_hidden_layers
        && other.model.projection_shape("q_proj") == loaded.model.projection_shape("q_proj")
        && other.model.projection_shape("up_proj") == loaded.model.projection_shape("up_proj");
    assert_eq!(
        loaded.model.set_adapter(Some(&ad), false).is_ok(),
        same_shapes,
        "an adapter must fit the model it is set on"
    );
}

/// `share_weights`: a second network on the same weight tensors, with its own adapter slot. Two
/// threads, each with an adapter set on its own handle, train at the same time and get what each
/// gets alone; the base is not copied and stays bit-identical.
#[test]
fn shared_weight_handles_carry_their_own_adapters_across_threads() {
    let loaded = tiny("qwen2", &LoadOptions::default());
    let m = &loaded.model;
    let (a, b) = (
        trained_like(m, no_dropout()),
        trained_like_seeded(m, no_dropout(), 11),
    );
    let before: HashMap<String, Tensor> = loaded
        .vs
        .variables()
        .into_iter()
        .map(|(k, v)| (k, v.copy()))
        .collect();
    // Each adapter alone on the original handle: its logits and its adapter gradients.
    let alone = |ad: &LoraAdapter| {
        m.set_adapter(Some(ad), true).unwrap();
        let (loss, tlp) = weighted_loss(m, true);
        tlp.backward(&loss).unwrap();
        let grads: Vec<Tensor> = ad
            .named_tensors()
            .into_values()
            .map(|t| t.grad().copy())
            .collect();
        ad.named_tensors().into_iter().for_each(|(_, t)| {
            let _ = t.grad().zero_();
        });
        let out = logits(m);
        m.set_adapter(None, false).unwrap();
        (out, grads)
    };
    let (logits_a, grads_a) = alone(&a);
    let (logits_b, grads_b) = alone(&b);
    assert!(
        !logits_a.allclose(&logits_b, 1e-4, 1e-4, false),
        "the two adapters must differ"
    );

    let (ha, hb) = (m.share_weights(), m.share_weights());
    assert!(!ha.has_adapter() && !hb.has_adapter());
    assert_eq!(
        m.lm_head_weight().data_ptr(),
        ha.lm_head_weight().data_ptr(),
        "the handle reads the same storage"
    );
    let run = |h: cotrain_model::families::CausalLm, ad: &LoraAdapter| {
        h.set_adapter(Some(ad), true).unwrap();
        let mut grads = Vec::new();
        let mut out = Tensor::new();
        for _ in 0..3 {
            let (loss, tlp) = weighted_loss(&h, true);
            tlp.backward(&loss).unwrap();
            grads = ad
                .named_tensors()
                .into_values()
                .map(|t| t.grad().copy())
                .collect();
            ad.named_tensors().into_iter().for_each(|(_, t)| {
                let _ = t.grad().zero_();
            });
            out = logits(&h);
        }
        (out, grads)
    };
    let ((ta, ga), (tb, gb)) = std::thread::scope(|s| {
        let ja = s.spawn(move || run(ha, &a));
        let jb = s.spawn(move || run(hb, &b));
        (ja.join().unwrap(), jb.join().unwrap())
    });
    assert!(
        !m.has_adapter(),
        "setting an adapter on a handle leaves the original without one"
    );
    for (label, (t, g), (t0, g0)) in [
        ("a", (&ta, &ga), (&logits_a, &grads_a)),
        ("b", (&tb, &gb), (&logits_b, &grads_b)),
    ] {
        assert!(
            t.allclose(t0, 1e-5, 1e-5, false),
            "adapter {label}: logits on its own thread differ from alone"
        );
        for (x, y) in g.iter().zip(g0) {
            assert!(
                x.allclose(y, 1e-4, 1e-6, false),
                "adapter {label}: gradients on its own thread differ from alone"
            );
        }
    }
    for (k, v) in loaded.vs.variables() {
        assert!(
            v.equal(&before[&k]),
            "{k}: the base must stay bit-identical"
        );
    }
}

/// One engine serving three adapters unmerged on one base, their requests and a base request mixed
/// in every batch (prefill and decode), gives each request the greedy tokens (and log-probs) of a
/// model with that adapter merged in; an unknown adapter is refused, and one in use cannot be removed.
#[test]
fn one_engine_serves_several_adapters_unmerged_as_their_merged_models() {
    use cotrain_model::engine::{Engine, Request, SamplingParams, StopConditions};
    let greedy = |prompt: Vec<u32>| Request {
        params: SamplingParams {
            temperature: 0.0,
            ..Default::default()
        },
        stop: StopConditions {
            max_new_tokens: 12,
            ignore_eos: true,
            ..Default::default()
        },
        ..Request::new(prompt)
    };
    for family in ["qwen2", "llama"] {
        let base = tiny(family, &LoadOptions::default());
        let qv = LoraConfig {
            r: 4,
            alpha: 8.0,
            dropout: 0.0,
            target_modules: vec!["q_proj".into(), "v_proj".into()],
        };
        let adapters = [
            trained_like_seeded(&base.model, no_dropout(), 7),
            trained_like_seeded(&base.model, qv, 8),
            trained_like_seeded(
                &base.model,
                LoraConfig {
                    alpha: 64.0,
                    ..no_dropout()
                },
                9,
            ),
        ];
        let merged = |id: usize| {
            let m = tiny(family, &LoadOptions::default());
            let w: HashMap<String, Tensor> = adapters[id]
                .merged(&base.named_parameters())
                .unwrap()
                .into_iter()
                .collect();
            m.load_named_tensors(&w).unwrap();
            m
        };
        // Requests: (prompt, adapter); the batch mixes all three adapters and the base.
        let asks: Vec<(Vec<u32>, Option<u32>)> = vec![
            (vec![3, 17, 42, 9], Some(0)),
            (vec![101, 7, 55], Some(1)),
            (vec![3, 17, 42, 9], None),
            (vec![12, 99, 5, 5, 8], Some(2)),
            (vec![101, 7, 55], Some(0)),
        ];
        let mut engine = Engine::new(tiny(family, &LoadOptions::default()));
        for (id, ad) in adapters.iter().enumerate() {
            let copy = LoraAdapter::new(&engine.loaded().model, ad.config.clone()).unwrap();
            let tensors: HashMap<String, Tensor> = ad.named_tensors().into_iter().collect();
            copy.load_tensors(&tensors).unwrap();
            engine.set_adapter(id as u32, Some(copy)).unwrap();
        }
        assert_eq!(engine.adapter_ids(), vec![0, 1, 2]);
        let requests: Vec<(Request, Option<u32>)> =
            asks.iter().map(|(p, a)| (greedy(p.clone()), *a)).collect();
        let mixed = engine.generate_with_adapters(&requests).unwrap();
        let mut differs_from_base = 0;
        for ((prompt, adapter), got) in asks.iter().zip(&mixed) {
            let mut alone = match adapter {
                Some(id) => Engine::new(merged(*id as usize)),
                None => Engine::new(tiny(family, &LoadOptions::default())),
            };
            let want = &alone.generate(&[greedy(prompt.clone())]).unwrap()[0][0];
            assert_eq!(
                got[0].token_ids, want.token_ids,
                "{family} adapter {adapter:?}: unmerged vs merged greedy tokens"
            );
            for (a, b) in got[0].logprobs.iter().zip(&want.logprobs) {
                assert!(
                    (a - b).abs() < 1e-4,
                    "{family} adapter {adapter:?}: log-probs {a} vs {b}"
                );
            }
            if adapter.is_some() {
                let mut plain = Engine::new(tiny(family, &LoadOptions::default()));
                let base_tokens =
                    &plain.generate(&[greedy(prompt.clone())]).unwrap()[0][0].token_ids;
                differs_from_base += (base_tokens != &got[0].token_ids) as usize;
            }
        }
        assert!(
            differs_from_base >= 2,
            "{family}: the adapters must change the output (only {differs_from_base} of 4 did)"
        );

        let e = engine
            .add_with_adapter(greedy(vec![1, 2]), Some(9))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no adapter 9"), "{e}");
        let h = engine
            .add_with_adapter(greedy(vec![1, 2]), Some(1))
            .unwrap();
        let e = engine.set_adapter(1, None).unwrap_err().to_string();
        assert!(e.contains("adapter 1 is in use"), "{e}");
        assert!(engine.cancel(h));
        engine.set_adapter(1, None).unwrap();
        assert_eq!(engine.adapter_ids(), vec![0, 2]);
    }
}
