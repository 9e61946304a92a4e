//! Generation benchmark: cotrain's engine against transformers' `generate` on the same SmolLM2
//! weights (f32, pure sampling at temperature 1, 128 new tokens, EOS ignored, batch 1/8/32).
//!
//!     cargo run --release -p cotrain-model --example bench_generate [-- --batches 1,8,32]
//!
//! The transformers side runs `scripts/reference/bench_generate.py` with the pyref Python
//! (`~/.cache/cotrain/pyref/bin/python`, or `$COTRAIN_PYREF`); it is skipped with a note when
//! that environment is absent. The roofline is `notes/toolchain.md`'s: 42 tokens/s at batch 1
//! (memory bound), 670 at large batch (compute bound), min(B * 42, 670) in between.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use cotrain_model::engine::{Engine, Request, SamplingParams, StopConditions};
use cotrain_model::loader::{self, LoadOptions};

const PROMPT: &str =
    "Write a short story about a robot who learns to paint, in the style of a fairy tale:";

struct Args {
    batches: Vec<usize>,
    new_tokens: usize,
    threads: i32,
    skip_transformers: bool,
}

fn parse_args() -> Args {
    let mut args = Args {
        batches: vec![1, 8, 32],
        new_tokens: 128,
        threads: 2,
        skip_transformers: false,
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
            "--bench" => {}
            other => panic!("unknown argument {other}"),
        }
    }
    args
}

fn roofline(batch: usize) -> f64 {
    (batch as f64 * 42.0).min(670.0)
}

fn run_cotrain(engine: &mut Engine, prompt: &[u32], batch: usize, new_tokens: usize) -> f64 {
    let requests: Vec<Request> = (0..batch)
        .map(|i| Request {
            params: SamplingParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
            },
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
    cotrain_model::allocator::tune_for_tensors();
    tch::set_num_threads(args.threads);
    let loaded = loader::load("default", &LoadOptions::default())
        .expect("the default model loads (run `make setup`)");
    let prompt = loaded.tokenizer.encode(PROMPT, true).unwrap();
    let mut engine = Engine::new(loaded);
    eprintln!("prompt: {} tokens; warm-up", prompt.len());
    run_cotrain(&mut engine, &prompt, 2, 16);
    let mut ours = Vec::new();
    for &b in &args.batches {
        let tps = run_cotrain(&mut engine, &prompt, b, args.new_tokens);
        eprintln!("cotrain batch {b}: {tps:.1} tokens/s");
        ours.push((b, tps));
    }
    drop(engine);
    let theirs = if args.skip_transformers {
        Err("skipped (--skip-transformers)".to_string())
    } else {
        eprintln!("running transformers (scripts/reference/bench_generate.py)...");
        run_transformers(&args)
    };
    if let Err(note) = &theirs {
        eprintln!("transformers: {note}");
    }
    println!(
        "SmolLM2-135M f32, sampling (T=1), {} new tokens, EOS ignored, {} threads",
        args.new_tokens, args.threads
    );
    println!("| batch | cotrain tok/s | transformers tok/s | ratio | fraction of roofline |");
    println!("| ---: | ---: | ---: | ---: | ---: |");
    for (b, tps) in ours {
        let t = theirs
            .as_ref()
            .ok()
            .and_then(|rows| rows.iter().find(|r| r.0 == b).map(|r| r.1));
        let (t_str, ratio) = match t {
            Some(t) => (format!("{t:.1}"), format!("{:.2}x", tps / t)),
            None => ("n/a".into(), "n/a".into()),
        };
        println!(
            "| {b} | {tps:.1} | {t_str} | {ratio} | {:.0}% of {:.0} |",
            100.0 * tps / roofline(b),
            roofline(b)
        );
    }
}
