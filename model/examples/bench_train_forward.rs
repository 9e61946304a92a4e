//! Times the training kernel's trunk forward and backward on SmolLM2-135M (f32, CPU) for the shapes
//! of a multi-turn MAGRPO update (one prompt of P tokens, 4 completions of 128 by default), against one plain
//! `forward_hidden` of the same tokens as a single sequence.
//!
//! ```sh
//! cargo run --release -p cotrain-model --example bench_train_forward [-- --prompt 280 --completion 128 --chunk 512 --threads 1]
//! ```
//! `--completion` is each of the 4 completions' length (the seed configs' `max_new_tokens` is 256);
//! `--chunk` is the kernel's LM-head chunk (the trainer's is 512); `--threads` the libtorch threads
//! (1: one of two policies updated at the same time on a 2-core machine).
use std::time::Instant;

use cotrain_model::logprobs::{LogProbOptions, Sequence, completion_logprobs};
use tch::{Kind, Tensor};

fn main() -> anyhow::Result<()> {
    // SAFETY: first thing in `main`, before any other thread and any libtorch call.
    unsafe { cotrain_model::mkl_dispatch::prefer_avx512() };
    cotrain_model::allocator::tune_for_tensors();
    println!("cpu: {}", cotrain_model::cpu::CpuFacts::probe().summary());
    println!(
        "roofline: {}",
        cotrain_model::cpu::Roofline::measure().summary()
    );
    let args: Vec<String> = std::env::args().collect();
    let p: usize = args
        .iter()
        .position(|a| a == "--prompt")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(280);
    let c: u32 = args
        .iter()
        .position(|a| a == "--completion")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(128);
    let chunk: usize = args
        .iter()
        .position(|a| a == "--chunk")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(512);
    if let Some(threads) = args
        .iter()
        .position(|a| a == "--threads")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse().ok())
    {
        tch::set_num_threads(threads);
    }
    let m = cotrain_model::loader::load("default", &cotrain_model::loader::LoadOptions::default())?;
    let prompt: Vec<u32> = (0..p as u32).map(|i| 100 + i * 7 % 40000).collect();
    let seqs: Vec<Sequence> = (0..4)
        .map(|k| Sequence {
            prompt: prompt.clone(),
            completion: (0..c).map(|i| 200 + (i * 13 + k * 101) % 40000).collect(),
        })
        .collect();
    for _ in 0..3 {
        let t = Instant::now();
        let tlp = completion_logprobs(
            &m.model,
            &seqs,
            &LogProbOptions {
                chunk_size: chunk,
                with_grad: true,
                temperature: 1.0,
            },
        )?;
        let fwd = t.elapsed().as_secs_f64();
        let (lp, _) = tlp.padded();
        let t = Instant::now();
        lp.sum(Kind::Float).backward();
        tlp.propagate()?;
        let bwd = t.elapsed().as_secs_f64();
        m.vs.variables().values().for_each(|v| {
            let mut g = v.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        });
        let ids = Tensor::from_slice(
            &[prompt.as_slice(), seqs[0].completion.as_slice()]
                .concat()
                .iter()
                .map(|&x| x as i64)
                .collect::<Vec<_>>(),
        )
        .unsqueeze(0);
        let t = Instant::now();
        let h = m.model.forward_hidden(&ids)?;
        let single = t.elapsed().as_secs_f64();
        let t = Instant::now();
        h.sum(Kind::Float).backward();
        let single_bwd = t.elapsed().as_secs_f64();
        println!(
            "kernel (1 prompt x {p} + 4 x {c}, chunk {chunk}): forward {fwd:.2} s, backward {bwd:.2} s | one sequence of {} tokens: trunk forward {single:.2} s, backward {single_bwd:.2} s",
            p + c as usize
        );
    }
    Ok(())
}
