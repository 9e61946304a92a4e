//! Serving several LoRA adapters on one base, unmerged, against merged copies: decoding throughput
//! and resident memory on SmolLM2-135M (the embedded default, f32), with the seeds' sampling
//! (temperature 0.7, top-p 0.9, top-k 50), EOS ignored.
//!
//! Three ways to serve `--adapters N` agents (rank `--rank`, every projection, random B so that
//! each adapter changes the model), each with `--rows R` sequences per agent:
//! - `merged, one model`: one engine on one merged copy decoding all N×R rows in one batch (the
//!   fastest a single model goes at that batch; what the rows would cost if every agent were the
//!   same model);
//! - `merged, N copies`: one engine per agent, each on its own merged copy, decoding its R rows,
//!   one engine after another (what a worker serving N merged agents does with its cores);
//! - `unmerged, one base`: one engine, N adapters registered, all N×R rows in one batch, each row
//!   adding its adapter's low-rank product (`Engine::add_with_adapter`).
//!
//! Memory: each setup runs in a process of its own (the example runs itself with `--setup S`), and
//! its resident set is read before the setup's models load and after: the merged copies, or one
//! base plus the adapters.
//!
//!     cargo run --release -p cotrain-model --example bench_adapters [-- --adapters 8 --rows 4 --new-tokens 64]

use std::collections::HashMap;
use std::time::Instant;

use cotrain_model::engine::{Engine, Request, SamplingParams, StopConditions};
use cotrain_model::loader::{self, LoadOptions, LoadedModel};
use cotrain_model::lora::{LoraAdapter, LoraConfig};
use tch::{Kind, Tensor};

const PROMPT: &str =
    "Write a short story about a robot who learns to paint, in the style of a fairy tale:";

fn rss_gb() -> f64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: f64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    pages * 4096.0 / 1e9
}

fn flag(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| v.parse().expect("an integer"))
        .unwrap_or(default)
}

/// Adapter `i`: A Kaiming-uniform, B random (std 0.02), seeded by `i`.
fn adapter(model: &LoadedModel, rank: usize, i: usize) -> LoraAdapter {
    tch::manual_seed(100 + i as i64);
    let config = LoraConfig {
        r: rank,
        alpha: 2.0 * rank as f64,
        dropout: 0.0,
        ..LoraConfig::default()
    };
    let a = LoraAdapter::new(&model.model, config).expect("a valid adapter");
    let _g = tch::no_grad_guard();
    for (name, mut t) in a.named_tensors() {
        if name.contains("lora_B") {
            t.copy_(&(Tensor::randn(t.size(), (Kind::Float, t.device())) * 0.02));
        }
    }
    a
}

fn load() -> LoadedModel {
    loader::load("default", &LoadOptions::default())
        .expect("the default model loads (run `make setup`)")
}

fn merged(base: &LoadedModel, a: &LoraAdapter) -> LoadedModel {
    let m = load();
    let w: HashMap<String, Tensor> = a
        .merged(&base.named_parameters())
        .expect("merge")
        .into_iter()
        .collect();
    m.load_named_tensors(&w).expect("merged weights load");
    m
}

fn request(prompt: &[u32], rows: usize, seed: u64, new_tokens: usize) -> Request {
    Request {
        n: rows,
        params: SamplingParams {
            temperature: 0.7,
            top_k: 50,
            top_p: 0.9,
            min_p: 0.0,
        },
        seed,
        stop: StopConditions {
            max_new_tokens: new_tokens,
            ignore_eos: true,
            ..Default::default()
        },
        ..Request::new(prompt.to_vec())
    }
}

fn main() {
    // SAFETY: first thing in `main`, before any other thread and any libtorch call.
    unsafe { cotrain_model::mkl_dispatch::prefer_avx512() };
    cotrain_model::allocator::tune_for_tensors();
    tch::set_num_threads(2);
    let args: Vec<String> = std::env::args().collect();
    let setup = args
        .iter()
        .position(|a| a == "--setup")
        .and_then(|i| args.get(i + 1))
        .cloned();
    let Some(setup) = setup else {
        // Each setup in its own process, so that one's freed memory does not hide the next's.
        println!("cpu: {}", cotrain_model::cpu::CpuFacts::probe().summary());
        let me = std::env::current_exe().expect("the example's path");
        let mut times = HashMap::new();
        for s in ["merged-one", "merged-copies", "unmerged"] {
            let out = std::process::Command::new(&me)
                .args(&args[1..])
                .args(["--setup", s])
                .output()
                .expect("the example runs");
            let text = String::from_utf8_lossy(&out.stdout);
            print!("{text}");
            assert!(
                out.status.success(),
                "{s}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let secs: f64 = text
                .lines()
                .find_map(|l| l.strip_prefix("secs "))
                .and_then(|v| v.trim().parse().ok())
                .expect("a time");
            times.insert(s, secs);
        }
        let n = flag("--adapters", 8);
        println!(
            "unmerged vs one merged model: {:.2}x the time; vs {n} merged copies: {:.2}x the time",
            times["unmerged"] / times["merged-one"],
            times["unmerged"] / times["merged-copies"]
        );
        return;
    };
    run(&setup);
}

fn run(setup: &str) {
    let (n, rows, new_tokens, rank) = (
        flag("--adapters", 8),
        flag("--rows", 4),
        flag("--new-tokens", 64),
        flag("--rank", 8),
    );
    let base = load();
    let prompt = base
        .tokenizer
        .encode(PROMPT, true)
        .expect("the prompt encodes");
    let adapters: Vec<LoraAdapter> = (0..n).map(|i| adapter(&base, rank, i)).collect();
    let adapter_mb = adapters.iter().map(|a| a.num_bytes()).sum::<usize>() as f64 / 1e6;
    let model_mb = base
        .named_parameters()
        .values()
        .map(|t| t.numel() * 4)
        .sum::<usize>() as f64
        / 1e6;
    if setup == "merged-one" {
        println!(
            "{n} adapters of rank {rank} ({adapter_mb:.1} MB together) on SmolLM2-135M ({model_mb:.0} MB f32); {rows} rows per agent, {new_tokens} new tokens, prompt {} tokens",
            prompt.len()
        );
    }
    let tokens = (n * rows * new_tokens) as f64;
    let before = rss_gb();
    let (label, secs) = match setup {
        "merged-one" => {
            // All rows on one merged copy.
            let mut engine = Engine::new(merged(&base, &adapters[0]));
            let _ = engine
                .generate(&[request(&prompt, 2, 0, 4)])
                .expect("warm-up");
            let t = Instant::now();
            let reqs: Vec<Request> = (0..n)
                .map(|i| request(&prompt, rows, i as u64, new_tokens))
                .collect();
            let _ = engine.generate(&reqs).expect("generate");
            (
                "merged, one model:  ".to_string(),
                t.elapsed().as_secs_f64(),
            )
        }
        "merged-copies" => {
            // One engine per agent on its own merged copy, one after another.
            let mut engines: Vec<Engine> = adapters
                .iter()
                .map(|a| Engine::new(merged(&base, a)))
                .collect();
            for e in engines.iter_mut() {
                let _ = e.generate(&[request(&prompt, 2, 0, 4)]).expect("warm-up");
            }
            let t = Instant::now();
            for (i, e) in engines.iter_mut().enumerate() {
                let _ = e
                    .generate(&[request(&prompt, rows, i as u64, new_tokens)])
                    .expect("generate");
            }
            (format!("merged, {n} copies:"), t.elapsed().as_secs_f64())
        }
        "unmerged" => {
            // One base, every agent's rows in one batch, each with its adapter.
            let mut engine = Engine::new(load());
            for (i, a) in adapters.iter().enumerate() {
                let copy =
                    LoraAdapter::new(&engine.loaded().model, a.config.clone()).expect("adapter");
                let tensors: HashMap<String, Tensor> = a.named_tensors().into_iter().collect();
                copy.load_tensors(&tensors).expect("adapter tensors");
                engine
                    .set_adapter(i as u32, Some(copy))
                    .expect("the adapter fits");
            }
            let _ = engine
                .generate_with_adapters(&[(request(&prompt, 2, 0, 4), Some(0))])
                .expect("warm-up");
            let t = Instant::now();
            let reqs: Vec<(Request, Option<u32>)> = (0..n)
                .map(|i| (request(&prompt, rows, i as u64, new_tokens), Some(i as u32)))
                .collect();
            let _ = engine.generate_with_adapters(&reqs).expect("generate");
            (
                "unmerged, one base: ".to_string(),
                t.elapsed().as_secs_f64(),
            )
        }
        other => panic!("--setup must be merged-one, merged-copies or unmerged, got {other}"),
    };
    let grew = rss_gb() - before;
    println!(
        "{label} {:7.1} tok/s  ({secs:.1} s)  resident +{grew:.2} GB",
        tokens / secs
    );
    println!("secs {secs}");
}
