//! Generation benchmark: cotrain's engine against transformers' `generate` on the same SmolLM2
//! weights (f32, pure sampling at temperature 1 unless `--temperature/--top-p/--top-k` say
//! otherwise, 128 new tokens, EOS ignored, batch 1/8/32). `--dtypes f32,bf16` runs cotrain with
//! each parameter dtype (bf16: bf16 weights and cache read by the decode kernels, f32 activations;
//! `bf16dot`: bf16 weights with the rows rounded to bf16 and AVX512_BF16 dot products, the worker's
//! `--bf16-dot-products`); transformers runs in f32, as the originals do on a CPU.
//!
//!     cargo run --release -p cotrain-model --example bench_generate [-- --batches 1,8,32]
//!     cargo run --release -p cotrain-model --example bench_generate -- --temperature 0.7 --top-p 0.9 --dtypes f32,bf16
//!
//! The transformers side runs `scripts/reference/bench_generate.py` with the pyref Python
//! (`~/.cache/cotrain/pyref/bin/python`, or `$COTRAIN_PYREF`); it is skipped with a note when
//! that environment is absent. The roofline is measured in the same run: weight bytes over the
//! machine's read bandwidth (a 1 GiB `sum`) bounds batch-1 decoding, model FLOPs over its f32
//! matmul rate (2048³ `matmul`) bounds large batches, min(B × the first, the second) in between.
//! `notes/toolchain.md` derives 42 and 670 tokens/s from single-stream figures; two threads reading
//! the weights measure faster than its 22–25 GB/s, so this run's own figures are used.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use cotrain_model::cpu::Roofline;
use cotrain_model::engine::{Engine, Request, SamplingParams, StopConditions};
use cotrain_model::loader::{self, LoadOptions};

const PROMPT: &str =
    "Write a short story about a robot who learns to paint, in the style of a fairy tale:";

struct Args {
    batches: Vec<usize>,
    new_tokens: usize,
    threads: i32,
    skip_transformers: bool,
    /// cotrain's parameter dtypes, each run in turn.
    dtypes: Vec<String>,
    /// Sampling settings, the same on both sides (pure sampling by default; the seeds use e.g.
    /// `--temperature 0.7 --top-p 0.9`).
    sampling: SamplingParams,
}

fn parse_args() -> Args {
    let mut args = Args {
        batches: vec![1, 8, 32],
        new_tokens: 128,
        threads: 2,
        skip_transformers: false,
        dtypes: vec!["f32".into()],
        sampling: SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
        },
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--batches" => {
                args.batches = it
                    .next()
                    .expect("--batches needs a list")
                    .split(',')
                    .map(|b| b.parse().expect("batch sizes are integers"))
                    .collect()
            }
            "--new-tokens" => args.new_tokens = it.next().unwrap().parse().unwrap(),
            "--threads" => args.threads = it.next().unwrap().parse().unwrap(),
            "--skip-transformers" => args.skip_transformers = true,
            "--dtypes" => {
                args.dtypes = it
                    .next()
                    .expect("--dtypes needs a list")
                    .split(',')
                    .map(String::from)
                    .collect()
            }
            "--temperature" => args.sampling.temperature = it.next().unwrap().parse().unwrap(),
            "--top-p" => args.sampling.top_p = it.next().unwrap().parse().unwrap(),
            "--top-k" => args.sampling.top_k = it.next().unwrap().parse().unwrap(),
            "--bench" => {}
            other => panic!("unknown argument {other}"),
        }
    }
    args
}

/// Tokens/s bound at a batch size for a model of `params` parameters of `bytes` bytes each: every
/// step streams the weights once and does 2 · params FLOPs per row at the f32 matmul rate (the
/// kernels compute in f32).
fn tokens_per_s(roof: &Roofline, params: f64, batch: usize, bytes: f64) -> f64 {
    let memory = roof.read_bytes_per_s / (bytes * params);
    let compute = roof.f32_flops / (2.0 * params);
    (batch as f64 * memory).min(compute)
}

/// The roofline `notes/toolchain.md` gives for SmolLM2-135M in f32 on this machine: at most ~42
/// tokens/s per sequence (22–25 GB/s of weight streaming) and ~670 tokens/s at large batch (180
/// GFLOP/s). Its bandwidth figure is below what this benchmark measures, so fractions above 100% occur.
fn notes_roofline(batch: usize) -> f64 {
    (42.0 * batch as f64).min(670.0)
}

fn run_cotrain(
    engine: &mut Engine,
    prompt: &[u32],
    batch: usize,
    new_tokens: usize,
    params: SamplingParams,
) -> f64 {
    let requests: Vec<Request> = (0..batch)
        .map(|i| Request {
            params,
            seed: i as u64,
            stop: StopConditions {
                max_new_tokens: new_tokens,
                ignore_eos: true,
                ..Default::default()
            },
            ..Request::new(prompt.to_vec())
        })
        .collect();
    let start = Instant::now();
    let out = engine.generate(&requests).expect("generation runs");
    let secs = start.elapsed().as_secs_f64();
    let tokens: usize = out.iter().flatten().map(|s| s.token_ids.len()).sum();
    assert_eq!(tokens, batch * new_tokens);
    tokens as f64 / secs
}

fn run_transformers(args: &Args) -> Result<Vec<(usize, f64)>, String> {
    let python = std::env::var_os("COTRAIN_PYREF")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/cotrain/pyref/bin/python")
        });
    if !python.exists() {
        return Err(format!(
            "{} not found (run scripts/reference/setup-pyref.sh)",
            python.display()
        ));
    }
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/reference/bench_generate.py");
    let mut cmd = Command::new(&python);
    cmd.arg(&script)
        .args(args.batches.iter().map(|b| b.to_string()))
        .args([
            "--new-tokens",
            &args.new_tokens.to_string(),
            "--threads",
            &args.threads.to_string(),
            "--temperature",
            &args.sampling.temperature.to_string(),
            "--top-p",
            &args.sampling.top_p.to_string(),
            "--top-k",
            &args.sampling.top_k.to_string(),
        ]);
    let out = cmd
        .output()
        .map_err(|e| format!("cannot run {}: {e}", python.display()))?;
    if !out.status.success() {
        return Err(format!(
            "bench_generate.py failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let mut rows = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("{e}: {line}"))?;
        rows.push((
            v["batch"].as_u64().unwrap() as usize,
            v["tokens_per_s"].as_f64().unwrap(),
        ));
    }
    Ok(rows)
}

fn main() {
    let args = parse_args();
    // SAFETY: first thing in `main`, before any other thread and any libtorch call.
    unsafe { cotrain_model::mkl_dispatch::prefer_avx512() };
    cotrain_model::allocator::tune_for_tensors();
    println!("cpu: {}", cotrain_model::cpu::CpuFacts::probe().summary());
    tch::set_num_threads(args.threads);
    let mut ours = Vec::new();
    let mut roof = None;
    for dtype in &args.dtypes {
        let dot = dtype == "bf16dot";
        let kind = if dot {
            tch::Kind::BFloat16
        } else {
            cotrain_model::config::parse_dtype(dtype).expect("--dtypes: f32, bf16 or bf16dot")
        };
        if let Err(e) = cotrain_model::kernels::gemm_bf16dot::set_enabled(dot) {
            eprintln!("{dtype}: skipped ({e})");
            continue;
        }
        let loaded = loader::load(
            "default",
            &LoadOptions {
                kind,
                ..LoadOptions::default()
            },
        )
        .expect("the default model loads (run `make setup`)");
        let prompt = loaded.tokenizer.encode(PROMPT, true).unwrap();
        let params: f64 = loaded
            .named_parameters()
            .values()
            .map(|t| t.numel() as f64)
            .sum();
        let r = *roof.get_or_insert_with(|| {
            let r = Roofline::measure();
            println!("roofline: {}", r.summary());
            eprintln!(
                "f32 roofline {:.0} tokens/s at batch 1, {:.0} at large batch",
                tokens_per_s(&r, params, 1, 4.0),
                tokens_per_s(&r, params, usize::MAX >> 8, 4.0)
            );
            r
        });
        let bytes = if kind == tch::Kind::Float { 4.0 } else { 2.0 };
        let mut engine = Engine::new(loaded);
        eprintln!("{dtype}: prompt {} tokens; warm-up", prompt.len());
        run_cotrain(&mut engine, &prompt, 2, 16, args.sampling);
        for &b in &args.batches {
            let tps = run_cotrain(&mut engine, &prompt, b, args.new_tokens, args.sampling);
            eprintln!("cotrain {dtype} batch {b}: {tps:.1} tokens/s");
            ours.push((dtype.clone(), b, tps, tokens_per_s(&r, params, b, bytes)));
        }
    }
    let roof = roof.expect("at least one dtype");
    let theirs = if args.skip_transformers {
        Err("skipped (--skip-transformers)".to_string())
    } else {
        eprintln!("running transformers (scripts/reference/bench_generate.py)...");
        run_transformers(&args)
    };
    if let Err(note) = &theirs {
        eprintln!("transformers: {note}");
    }
    let s = args.sampling;
    println!(
        "SmolLM2-135M on the CPU above, sampling (temperature {}, top-p {}, top-k {}), {} new tokens, EOS ignored, {} threads; roofline from this run: read {:.1} GB/s, matmul {:.0} GFLOP/s",
        s.temperature,
        s.top_p,
        s.top_k,
        args.new_tokens,
        args.threads,
        roof.read_bytes_per_s / 1e9,
        roof.f32_flops / 1e9
    );
    println!(
        "| cotrain dtype | batch | cotrain tok/s | transformers f32 tok/s | ratio | fraction of roofline | of toolchain.md's f32 roofline |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    for (dtype, b, tps, bound) in ours {
        let t = theirs
            .as_ref()
            .ok()
            .and_then(|rows| rows.iter().find(|r| r.0 == b).map(|r| r.1));
        let (t_str, ratio) = match t {
            Some(t) => (format!("{t:.1}"), format!("{:.2}x", tps / t)),
            None => ("n/a".into(), "n/a".into()),
        };
        let notes = notes_roofline(b);
        println!(
            "| {dtype} | {b} | {tps:.1} | {t_str} | {ratio} | {:.0}% of {bound:.0} | {:.0}% of {notes:.0} |",
            100.0 * tps / bound,
            100.0 * tps / notes
        );
    }
}
