//! The learned verifier: its loss and scores against a hand computation from the trunk's hidden
//! states (head, sigmoid, per-token BCE over the response, mean per conversation then over the
//! batch, score at the last token), the chat-template encoding's response span, and a saved
//! directory that loads back to the same scores.

mod support;

use cotrain_model::chat_template::ChatTemplate;
use cotrain_model::loader::LoadOptions;
use cotrain_model::lora::LoraConfig;
use cotrain_model::verifier::{Encoded, Trunk, Verifier};
use support::*;
use tch::{Kind, Tensor};

fn tiny_verifier(lora: bool) -> Verifier {
    tch::manual_seed(3);
    let base = tiny("llama", &LoadOptions::default());
    // No dropout: the hand computation is deterministic.
    let v = Verifier::new(
        base,
        "tiny",
        lora.then(|| LoraConfig {
            dropout: 0.0,
            ..LoraConfig::default()
        }),
        64,
    )
    .unwrap();
    if let Trunk::Lora { adapter, .. } = &v.trunk {
        // A trained-looking adapter: B non-zero.
        let _g = tch::no_grad_guard();
        for (name, mut t) in adapter.named_tensors() {
            if name.contains("lora_B") {
                t.copy_(&(Tensor::randn(t.size(), (Kind::Float, t.device())) * 0.05));
            }
        }
    }
    v
}

/// Final hidden states of `ids` through the trunk (adapter set), as plain numbers.
fn hidden_rows(v: &Verifier, ids: &[u32]) -> Vec<Vec<f64>> {
    let _g = tch::no_grad_guard();
    let t = Tensor::from_slice(&ids.iter().map(|&x| i64::from(x)).collect::<Vec<_>>())
        .view([1, ids.len() as i64]);
    let h = match &v.trunk {
        Trunk::Lora { base, adapter } => {
            base.model.set_adapter(Some(adapter), false).unwrap();
            let h = base.model.forward_hidden(&t).unwrap();
            base.model.set_adapter(None, false).unwrap();
            h
        }
        Trunk::Full(m) => m.model.forward_hidden(&t).unwrap(),
    };
    let h = h.squeeze_dim(0).to_kind(Kind::Double);
    (0..ids.len() as i64).map(|i| values(&h.get(i))).collect()
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

#[test]
fn loss_and_scores_match_a_hand_computation() {
    for lora in [true, false] {
        let v = tiny_verifier(lora);
        let head = values(&v.head.detach().squeeze_dim(0).to_kind(Kind::Double));
        // Two conversations of different lengths (the shorter one is right-padded in the batch).
        let convs = [
            Encoded {
                ids: vec![5, 9, 2, 44, 17, 3],
                response_start: 3,
            },
            Encoded {
                ids: vec![8, 1, 12, 60],
                response_start: 1,
            },
        ];
        let labels = [1.0f32, 0.0];
        let mut want_loss = 0.0;
        let mut want_scores = Vec::new();
        for (c, &y) in convs.iter().zip(&labels) {
            let logits: Vec<f64> = hidden_rows(&v, &c.ids)
                .iter()
                .map(|h| h.iter().zip(&head).map(|(a, b)| a * b).sum())
                .collect();
            let bce: Vec<f64> = logits[c.response_start..]
                .iter()
                .map(|&x| {
                    -(f64::from(y) * sigmoid(x).ln()
                        + (1.0 - f64::from(y)) * (1.0 - sigmoid(x)).ln())
                })
                .collect();
            want_loss += bce.iter().sum::<f64>() / bce.len() as f64 / convs.len() as f64;
            want_scores.push(sigmoid(*logits.last().unwrap()));
        }
        let refs: Vec<&Encoded> = convs.iter().collect();
        let (loss, scores) = v.loss(&refs, &labels, true).unwrap();
        assert!(
            (loss.double_value(&[]) - want_loss).abs() < 1e-5,
            "lora {lora}: loss {} vs {want_loss}",
            loss.double_value(&[])
        );
        let served = v.score(&refs).unwrap();
        for k in 0..2 {
            assert!(
                (f64::from(scores[k]) - want_scores[k]).abs() < 1e-5,
                "lora {lora}: score {k}"
            );
            assert!(
                (f64::from(served[k]) - want_scores[k]).abs() < 1e-5,
                "lora {lora}: served score {k}"
            );
        }
        // The loss trains the trunk's trainable part and the head.
        loss.backward();
        let (trunk, head_vs) = v.trainable();
        assert!(
            head_vs.trainable_variables().iter().all(|t| t
                .grad()
                .abs()
                .sum(Kind::Float)
                .double_value(&[])
                > 0.0)
        );
        assert!(
            trunk
                .trainable_variables()
                .iter()
                .any(|t| t.grad().defined()
                    && t.grad().abs().sum(Kind::Float).double_value(&[]) > 0.0)
        );
    }
}

#[test]
fn the_response_span_starts_after_the_generation_prompt() {
    let mut v = tiny_verifier(true);
    let template = "{% for m in messages %}t1 {{ m.role }} {{ m.content }} t2 {% endfor %}{% if add_generation_prompt %}t1 assistant {% endif %}";
    match &mut v.trunk {
        Trunk::Lora { base, .. } => {
            base.chat_template = Some(ChatTemplate::new(template, None, None).unwrap())
        }
        Trunk::Full(_) => unreachable!(),
    }
    let e = v.encode("t7 t8", "t9 t10 t11").unwrap();
    let tok = &v.model().tokenizer;
    let prompt = tok.encode("t1 user t7 t8 t2 t1 assistant ", false).unwrap();
    assert_eq!(e.response_start, prompt.len());
    assert_eq!(&e.ids[..prompt.len()], prompt.as_slice());
    assert_eq!(
        tok.decode(&e.ids[e.response_start..], false).unwrap(),
        "t9 t10 t11 t2"
    );
    // Too long: the first tokens go, the response keeps its tokens.
    v.manifest.max_length = 6;
    let e = v.encode("t7 t8", "t9 t10 t11").unwrap();
    assert_eq!((e.ids.len(), e.response_start), (6, 2));
}

#[test]
fn a_saved_verifier_loads_back_to_the_same_scores() {
    let tmp = tempfile::tempdir().unwrap();
    let base_dir = tmp.path().join("tiny-llama");
    std::fs::create_dir_all(&base_dir).unwrap();
    for f in ["config.json", "model.safetensors", "generation_config.json"] {
        std::fs::copy(fixture("tiny/llama").join(f), base_dir.join(f)).unwrap();
    }
    std::fs::write(base_dir.join("tokenizer.json"), word_tokenizer_json(256)).unwrap();
    let convs = [
        Encoded {
            ids: vec![5, 9, 2, 44, 17, 3],
            response_start: 3,
        },
        Encoded {
            ids: vec![8, 1, 12, 60],
            response_start: 1,
        },
    ];
    let refs: Vec<&Encoded> = convs.iter().collect();
    for lora in [true, false] {
        tch::manual_seed(11);
        let base = cotrain_model::loader::load(base_dir.to_str().unwrap(), &LoadOptions::default())
            .unwrap();
        let v = Verifier::new(
            base,
            base_dir.to_str().unwrap(),
            lora.then(LoraConfig::default),
            64,
        )
        .unwrap();
        if let Trunk::Lora { adapter, .. } = &v.trunk {
            let _g = tch::no_grad_guard();
            for (name, mut t) in adapter.named_tensors() {
                if name.contains("lora_B") {
                    t.copy_(&(Tensor::randn(t.size(), (Kind::Float, t.device())) * 0.05));
                }
            }
        }
        let dir = tmp.path().join(if lora { "lora" } else { "full" });
        v.save(&dir).unwrap();
        assert!(
            dir.join(if lora {
                "adapter/adapter_config.json"
            } else {
                "model/config.json"
            })
            .is_file()
        );
        let back = Verifier::load(&dir, &LoadOptions::default()).unwrap();
        assert_eq!(back.manifest, v.manifest);
        let (a, b) = (v.score(&refs).unwrap(), back.score(&refs).unwrap());
        for k in 0..2 {
            assert!((a[k] - b[k]).abs() < 1e-6, "lora {lora}: {a:?} vs {b:?}");
        }
    }
    // A directory cut short (no manifest) is refused, naming the file.
    std::fs::remove_file(tmp.path().join("lora/verifier.json")).unwrap();
    let e = Verifier::load(&tmp.path().join("lora"), &LoadOptions::default())
        .err()
        .unwrap();
    assert!(e.to_string().contains("verifier.json"), "{e}");
}
