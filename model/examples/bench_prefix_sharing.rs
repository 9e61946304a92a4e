//! Times the training kernel with and without common-prefix sharing on MaPoRL's shapes: the two
//! agents' turn-1 answers to one question (the policy: prompts that share the question's message,
//! then each agent's own history; the critic: the same turn-0 prompt, then each answer), with a
//! LoRA adapter (r 8 on the 7 projections) training, SmolLM2-135M f32, forward + backward.
//!
//! ```sh
//! cargo run --release -p cotrain-model --example bench_prefix_sharing [-- --shared 147 --own 367 --answer 45 --reps 5 --questions 1 --bf16]
//! ```
//! `--questions N` forwards N questions' rows at once (the seed configs' micro-batch is one);
//! `--bf16` runs the products in bf16 (`model.matmul_dtype: bf16`).
use std::time::Instant;

use cotrain_model::logprobs::{
    LogProbOptions, Sequence, completion_logprobs_with_sharing, sequence_hidden,
};
use cotrain_model::lora::{LoraAdapter, LoraConfig};
use tch::Kind;

fn arg(args: &[String], name: &str, default: usize) -> usize {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn main() -> anyhow::Result<()> {
    // SAFETY: first thing in `main`, before any other thread and any libtorch call.
    unsafe { cotrain_model::mkl_dispatch::prefer_avx512() };
    cotrain_model::allocator::tune_for_tensors();
    println!("cpu: {}", cotrain_model::cpu::CpuFacts::probe().summary());
    let args: Vec<String> = std::env::args().collect();
    let (shared, own, answer, reps) = (
        arg(&args, "--shared", 147),
        arg(&args, "--own", 367),
        arg(&args, "--answer", 45),
        arg(&args, "--reps", 5),
    );
    let questions = arg(&args, "--questions", 1) as u32;
    let m = cotrain_model::loader::load("default", &cotrain_model::loader::LoadOptions::default())?;
    if args.iter().any(|a| a == "--bf16") {
        m.model.set_matmul_kind(Some(Kind::BFloat16));
    }
    let adapter = LoraAdapter::new(
        &m.model,
        LoraConfig {
            r: 8,
            alpha: 16.0,
            dropout: 0.0,
            ..LoraConfig::default()
        },
    )?;
    m.model.set_adapter(Some(&adapter), true)?;
    let toks = |n: usize, salt: u32| -> Vec<u32> {
        (0..n as u32)
            .map(|i| 100 + (i * 7 + salt * 131) % 40000)
            .collect()
    };
    let policy: Vec<Sequence> = (0..questions)
        .flat_map(|q| {
            (0..2).map(move |a| Sequence {
                prompt: [toks(shared, 1 + q), toks(own, 10 + a + 2 * q)].concat(),
                completion: toks(answer, 20 + a + 2 * q),
            })
        })
        .collect();
    let critic: Vec<Sequence> = (0..questions)
        .flat_map(|q| {
            (0..2).map(move |a| Sequence {
                prompt: toks(shared, 1 + q),
                completion: toks(answer, 20 + a + 2 * q),
            })
        })
        .collect();
    let opts = LogProbOptions {
        chunk_size: 512,
        with_grad: true,
        temperature: 0.7,
    };
    println!(
        "{questions} question(s), each: policy 2 rows of {} + {answer} positions sharing {shared}; critic 2 rows of {shared} + {answer} sharing {shared}",
        shared + own
    );
    println!(
        "{:<8} {:>14} {:>14} {:>14} {:>14}",
        "rep", "policy plain s", "policy shared", "critic plain s", "critic shared"
    );
    for rep in 0..reps {
        let mut row = Vec::new();
        for share in [false, true] {
            let t = Instant::now();
            let out = completion_logprobs_with_sharing(&m.model, &policy, &opts, share)?;
            out.backward(&out.logprobs.sum(Kind::Float))?;
            row.push(t.elapsed().as_secs_f64());
        }
        for share in [false, true] {
            let t = Instant::now();
            let h = if share {
                sequence_hidden(&m.model, &critic, None)?
            } else {
                let l = (shared + answer) as i64;
                let ids: Vec<i64> = critic
                    .iter()
                    .flat_map(|s| s.prompt.iter().chain(&s.completion).map(|&t| t as i64))
                    .collect();
                m.model
                    .forward_hidden(&tch::Tensor::from_slice(&ids).view([critic.len() as i64, l]))?
            };
            h.sum(Kind::Float).backward();
            row.push(t.elapsed().as_secs_f64());
        }
        println!(
            "{rep:<8} {:>14.3} {:>14.3} {:>14.3} {:>14.3}",
            row[0], row[1], row[2], row[3]
        );
    }
    Ok(())
}
