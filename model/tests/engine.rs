//! The generation engine on a tiny Llama fixture: cached batched decoding equals a full forward,
//! seeded sampling reproduces and does not depend on batch composition, `n` samples share one
//! prefill, stop tokens / stop strings / max_new_tokens, cancellation, weight swaps, bad requests.

mod support;

use std::collections::HashMap;

use cotrain_model::engine::{
    Engine, FinishReason, LogprobMode, Request, SamplingParams, StopConditions,
};
use cotrain_model::loader::LoadOptions;
use support::*;
use tch::{Kind, Tensor};

fn engine() -> Engine {
    Engine::new(tiny("llama", &LoadOptions::default()))
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 3 + (i * 37 + salt * 11) % 250)
        .collect()
}

fn req(prompt: Vec<u32>, params: SamplingParams, seed: u64, max_new: usize) -> Request {
    Request {
        params,
        seed,
        stop: StopConditions {
            max_new_tokens: max_new,
            ignore_eos: true,
            ..Default::default()
        },
        ..Request::new(prompt)
    }
}

/// Greedy decoding by repeated full forwards (no cache), with the raw log-probs.
fn greedy_full_forward(engine: &Engine, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<f64>) {
    let model = &engine.loaded().model;
    let mut ids: Vec<i64> = prompt.iter().map(|&t| t as i64).collect();
    let (mut out, mut lps) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let logits =
            tch::no_grad(|| model.forward(&Tensor::from_slice(&ids).unsqueeze(0))).unwrap();
        let last = logits
            .get(0)
            .get(ids.len() as i64 - 1)
            .log_softmax(-1, Kind::Float);
        let t = last.argmax(-1, false).int64_value(&[]);
        lps.push(last.double_value(&[t]));
        out.push(t as u32);
        ids.push(t);
    }
    (out, lps)
}

#[test]
fn cached_batched_decoding_equals_full_forward() {
    let mut e = engine();
    // Prompts of different lengths decoded together, finishing at different steps.
    let prompts = [prompt(3, 1), prompt(17, 2), prompt(9, 3)];
    let max_new = [10, 6, 14];
    let requests: Vec<Request> = prompts
        .iter()
        .zip(max_new)
        .map(|(p, m)| req(p.clone(), SamplingParams::greedy(), 0, m))
        .collect();
    let out = e.generate(&requests).unwrap();
    for (i, p) in prompts.iter().enumerate() {
        let (want, want_lp) = greedy_full_forward(&e, p, max_new[i]);
        let s = &out[i][0];
        assert_eq!(s.token_ids, want, "request {i}");
        assert_eq!(s.finish_reason, FinishReason::Length);
        let got_lp: Vec<f64> = s.logprobs.iter().map(|&x| x as f64).collect();
        assert!(
            worst(&got_lp, &want_lp, 1e-4, 1e-4) <= 1.0,
            "request {i} log-probs"
        );
    }
    assert!(e.is_idle());
}

#[test]
fn seeded_sampling_reproduces_and_ignores_batch_composition() {
    let params = SamplingParams {
        temperature: 1.0,
        top_k: 20,
        top_p: 0.9,
        min_p: 0.0,
    };
    let target = req(prompt(7, 5), params, 1234, 12);
    let alone = engine()
        .generate(std::slice::from_ref(&target))
        .unwrap()
        .remove(0)
        .remove(0);
    let again = engine()
        .generate(std::slice::from_ref(&target))
        .unwrap()
        .remove(0)
        .remove(0);
    assert_eq!(alone, again, "same seed, same tokens");

    // Other requests with other params, lengths and seeds around it.
    let mut e = engine();
    let others = vec![
        req(prompt(20, 9), SamplingParams::default(), 1, 20),
        req(prompt(2, 4), SamplingParams::greedy(), 2, 3),
        req(
            prompt(11, 6),
            SamplingParams {
                min_p: 0.1,
                ..Default::default()
            },
            3,
            30,
        ),
    ];
    let mut batch = others.clone();
    batch.insert(1, target.clone());
    let mixed = e.generate(&batch).unwrap();
    assert_eq!(mixed[1][0].token_ids, alone.token_ids);

    // Joining a batch that is already running (continuous batching) changes nothing either.
    let mut e = engine();
    for r in &others {
        e.add(r.clone()).unwrap();
    }
    e.step().unwrap();
    e.step().unwrap();
    let h = e.add(target.clone()).unwrap();
    let mut found = None;
    while !e.is_idle() {
        for s in e.step().unwrap().finished {
            if s.request == h {
                found = Some(s);
            }
        }
    }
    assert_eq!(found.unwrap().token_ids, alone.token_ids);

    let other_seed = engine()
        .generate(&[Request { seed: 99, ..target }])
        .unwrap();
    assert_ne!(
        other_seed[0][0].token_ids, alone.token_ids,
        "another seed samples differently"
    );
}

#[test]
fn n_samples_share_one_prefill_and_match_separate_requests() {
    let p = prompt(13, 8);
    let params = SamplingParams {
        temperature: 0.8,
        ..Default::default()
    };
    let mut e = engine();
    let together = e
        .generate(&[Request {
            n: 4,
            ..req(p.clone(), params, 77, 9)
        }])
        .unwrap()
        .remove(0);
    assert_eq!(
        e.stats().prefill_tokens,
        p.len() as u64,
        "one prefill for four samples"
    );
    assert_eq!(together.len(), 4);
    assert_eq!(
        together.iter().map(|s| s.index).collect::<Vec<_>>(),
        vec![0, 1, 2, 3]
    );
    // Sample 0 of an n-request is the n = 1 request with the same seed.
    let single = engine()
        .generate(&[req(p.clone(), params, 77, 9)])
        .unwrap()
        .remove(0)
        .remove(0);
    assert_eq!(together[0].token_ids, single.token_ids);
    // The samples differ from one another (distinct streams).
    assert!(
        together
            .iter()
            .any(|s| s.token_ids != together[0].token_ids)
    );
    // And the whole group reproduces when run beside another request.
    let mut e = engine();
    let mixed = e
        .generate(&[
            req(prompt(5, 1), SamplingParams::default(), 5, 15),
            Request {
                n: 4,
                ..req(p, params, 77, 9)
            },
        ])
        .unwrap();
    for (a, b) in mixed[1].iter().zip(&together) {
        assert_eq!(a.token_ids, b.token_ids);
    }
}

#[test]
fn stops_on_tokens_strings_and_length() {
    let p = prompt(6, 2);
    let (greedy, _) = greedy_full_forward(&engine(), &p, 8);
    let mut e = engine();

    // A stop token: generation ends with it, included.
    let stop_tok = greedy[3];
    let first = greedy.iter().position(|&t| t == stop_tok).unwrap();
    let r = Request {
        stop: StopConditions {
            max_new_tokens: 8,
            stop_token_ids: vec![stop_tok],
            ..Default::default()
        },
        ..req(p.clone(), SamplingParams::greedy(), 0, 8)
    };
    let s = e.generate(&[r]).unwrap().remove(0).remove(0);
    assert_eq!(s.token_ids, greedy[..=first].to_vec());
    assert_eq!(s.finish_reason, FinishReason::Stop);
    assert_eq!(s.logprobs.len(), s.token_ids.len());

    // A stop string: text cut before it; tokens up to the one completing it.
    let stop_str = format!("t{}", greedy[2]);
    let first = greedy.iter().position(|&t| t == greedy[2]).unwrap();
    let r = Request {
        stop: StopConditions {
            max_new_tokens: 8,
            stop_strings: vec![stop_str.clone()],
            ignore_eos: true,
            ..Default::default()
        },
        ..req(p.clone(), SamplingParams::greedy(), 0, 8)
    };
    let s = e.generate(&[r]).unwrap().remove(0).remove(0);
    assert_eq!(s.finish_reason, FinishReason::Stop);
    assert_eq!(s.token_ids, greedy[..=first].to_vec());
    assert!(
        !s.text.contains(&stop_str),
        "text {:?} keeps the stop string",
        s.text
    );

    // max_new_tokens.
    let s = e
        .generate(&[req(p.clone(), SamplingParams::greedy(), 0, 5)])
        .unwrap()
        .remove(0)
        .remove(0);
    assert_eq!(s.token_ids.len(), 5);
    assert_eq!(s.finish_reason, FinishReason::Length);
    assert_eq!(s.text, e.tokenizer().decode(&s.token_ids, true).unwrap());
}

#[test]
fn eos_stops_unless_ignored() {
    let p = prompt(6, 2);
    let (greedy, _) = greedy_full_forward(&engine(), &p, 8);
    // Declare the 3rd greedy token the model's EOS.
    let mut loaded = tiny("llama", &LoadOptions::default());
    loaded.generation.eos_token_ids = vec![greedy[2]];
    let mut e = Engine::new(loaded);
    let r = Request {
        stop: StopConditions {
            max_new_tokens: 8,
            ..Default::default()
        },
        ..req(p.clone(), SamplingParams::greedy(), 0, 8)
    };
    let s = e
        .generate(std::slice::from_ref(&r))
        .unwrap()
        .remove(0)
        .remove(0);
    let first = greedy.iter().position(|&t| t == greedy[2]).unwrap();
    assert_eq!(s.token_ids.len(), first + 1);
    let mut ignoring = r;
    ignoring.stop.ignore_eos = true;
    let s = e.generate(&[ignoring]).unwrap().remove(0).remove(0);
    assert_eq!(s.token_ids, greedy);
}

#[test]
fn sampling_logprob_mode_reports_the_filtered_distribution() {
    let p = prompt(6, 2);
    let params = SamplingParams {
        temperature: 1.0,
        top_k: 5,
        ..Default::default()
    };
    let raw = engine()
        .generate(&[req(p.clone(), params, 3, 6)])
        .unwrap()
        .remove(0)
        .remove(0);
    let samp = engine()
        .generate(&[Request {
            logprobs: LogprobMode::Sampling,
            ..req(p, params, 3, 6)
        }])
        .unwrap()
        .remove(0)
        .remove(0);
    assert_eq!(
        raw.token_ids, samp.token_ids,
        "the mode does not change the draw"
    );
    for (r, s) in raw.logprobs.iter().zip(&samp.logprobs) {
        // Renormalising over the top 5 can only make a kept token more likely.
        assert!(s >= r, "sampling log-prob {s} < raw {r}");
        assert!(*s <= 0.0);
    }
}

#[test]
fn cancel_removes_a_running_request() {
    let mut e = engine();
    let a = e
        .add(req(prompt(4, 1), SamplingParams::default(), 1, 50))
        .unwrap();
    let b = e
        .add(req(prompt(8, 2), SamplingParams::default(), 2, 6))
        .unwrap();
    e.step().unwrap();
    assert_eq!(e.num_running(), 2);
    assert!(e.cancel(a));
    assert!(!e.cancel(a));
    assert_eq!(e.num_running(), 1);
    let mut done = Vec::new();
    while !e.is_idle() {
        done.extend(e.step().unwrap().finished);
    }
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].request, b);
    assert_eq!(done[0].token_ids.len(), 6);
}

#[test]
fn weight_swap_is_validated_and_all_or_nothing() {
    let mut e = engine();
    let p = prompt(5, 3);
    let before = e
        .generate(&[req(p.clone(), SamplingParams::greedy(), 0, 6)])
        .unwrap();
    let name = "model.layers.0.mlp.down_proj.weight";
    let shape = e.loaded().named_parameters()[name].size();
    let mut bad = HashMap::new();
    bad.insert(
        name.to_string(),
        Tensor::zeros(shape.as_slice(), (Kind::Float, tch::Device::Cpu)),
    );
    bad.insert(
        "model.layers.0.no_such.weight".to_string(),
        Tensor::zeros([1], (Kind::Float, tch::Device::Cpu)),
    );
    let err = e.load_named_tensors(&bad).unwrap_err().to_string();
    assert!(err.contains("no_such"), "{err}");
    let unchanged = e
        .generate(&[req(p.clone(), SamplingParams::greedy(), 0, 6)])
        .unwrap();
    assert_eq!(
        before[0][0].token_ids, unchanged[0][0].token_ids,
        "a rejected update changes nothing"
    );

    let mut wrong_shape = HashMap::new();
    wrong_shape.insert(
        name.to_string(),
        Tensor::zeros([3, 3], (Kind::Float, tch::Device::Cpu)),
    );
    assert!(
        e.load_named_tensors(&wrong_shape)
            .unwrap_err()
            .to_string()
            .contains("shape")
    );

    // A bf16 update of every parameter to random values changes the output.
    let mut update = HashMap::new();
    for (n, t) in e.loaded().named_parameters() {
        update.insert(n, (t.randn_like() * 0.5).to_kind(Kind::BFloat16));
    }
    e.load_named_tensors(&update).unwrap();
    let after = e
        .generate(&[req(p, SamplingParams::greedy(), 0, 6)])
        .unwrap();
    assert_ne!(before[0][0].token_ids, after[0][0].token_ids);
}

#[test]
fn bad_requests_get_clear_errors() {
    let mut e = engine();
    let ctx = e.loaded().model.config().max_position_embeddings;
    let too_long = e.add(Request::new(vec![5; ctx])).unwrap_err().to_string();
    assert!(
        too_long.contains("does not fit the model's context"),
        "{too_long}"
    );
    assert!(
        e.add(Request::new(vec![]))
            .unwrap_err()
            .to_string()
            .contains("empty prompt")
    );
    let oov = e.add(Request::new(vec![100_000])).unwrap_err().to_string();
    assert!(oov.contains("outside the vocabulary"), "{oov}");
    let bad_p = Request {
        params: SamplingParams {
            top_p: 0.0,
            ..Default::default()
        },
        ..Request::new(vec![5])
    };
    assert!(e.add(bad_p).unwrap_err().to_string().contains("top_p"));
    assert!(e.is_idle());
}

#[test]
fn generation_stops_at_the_end_of_the_context() {
    let mut e = engine();
    let ctx = e.loaded().model.config().max_position_embeddings;
    let s = e
        .generate(&[req(vec![7; ctx - 3], SamplingParams::greedy(), 0, 100)])
        .unwrap()
        .remove(0)
        .remove(0);
    assert_eq!(s.token_ids.len(), 3);
    assert_eq!(s.finish_reason, FinishReason::Length);
}

/// Requests admitted together share prefill forwards (right-padded prompts); each still gets what it
/// gets alone: the same greedy tokens, log-probs within rounding.
#[test]
fn prompts_prefilled_together_match_prompts_prefilled_alone() {
    let requests: Vec<Request> = [3usize, 9, 4, 16, 1, 8]
        .iter()
        .enumerate()
        .map(|(i, &len)| req(prompt(len, i as u32), SamplingParams::greedy(), 0, 6))
        .collect();
    let together = engine().generate(&requests).unwrap();
    for (i, r) in requests.iter().enumerate() {
        let alone = engine()
            .generate(std::slice::from_ref(r))
            .unwrap()
            .remove(0)
            .remove(0);
        let got = &together[i][0];
        assert_eq!(got.token_ids, alone.token_ids, "request {i}");
        for (a, b) in got.logprobs.iter().zip(&alone.logprobs) {
            assert!((a - b).abs() < 1e-5, "request {i}: log-prob {a} vs {b}");
        }
    }
}

/// A request that finishes on its first token (here `max_new_tokens` = 1, or its first token being a
/// stop token) gets exactly that token, also when other rows keep decoding beside it.
#[test]
fn a_request_finishing_on_its_first_token_gets_no_second() {
    let one = req(prompt(5, 1), SamplingParams::greedy(), 0, 1);
    let long = req(prompt(6, 2), SamplingParams::greedy(), 0, 8);
    let out = engine().generate(&[one.clone(), long]).unwrap();
    assert_eq!(out[0][0].token_ids.len(), 1, "{:?}", out[0][0].token_ids);
    assert_eq!(out[1][0].token_ids.len(), 8);

    let first = out[0][0].token_ids[0];
    let mut stopping = req(prompt(5, 1), SamplingParams::greedy(), 0, 8);
    stopping.stop.stop_token_ids = vec![first];
    let alone = engine().generate(&[stopping]).unwrap().remove(0).remove(0);
    assert_eq!(alone.token_ids, vec![first]);
    assert_eq!(
        alone.finish_reason,
        cotrain_model::engine::FinishReason::Stop
    );
}
