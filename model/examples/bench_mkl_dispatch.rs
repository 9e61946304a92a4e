//! MKL's f32 matmul rate on its AVX2 path against its AVX-512 path (the `mkl_dispatch` patch), side
//! by side, over the products of one SmolLM2-135M training step on ~612 tokens.
//!
//!     cargo run --release -p cotrain-model --example bench_mkl_dispatch [-- --reps 5 --rounds 2]
//!
//! MKL picks its code path once per process, so the benchmark runs itself as a child, with
//! `COTRAIN_MKL_AVX512=0` (MKL's own choice: AVX2 on AMD) and `=1` (the patch), alternating for
//! `--rounds` rounds so that a passing load on the machine hits both sides alike. It prints one table:
//! GFLOP/s per product shape (best over rounds of the best of `--reps` after a warm-up, output
//! preallocated so only the GEMM is timed), then the time of one step's products (30 layers + LM
//! head), both ways.

use std::process::Command;
use std::time::Instant;

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

/// Marks the child's one machine-readable line among whatever else libtorch may print.
const REPORT_PREFIX: &str = "MKL_BENCH_REPORT ";
/// Work per timed sample, so the smallest products are not measured at timer resolution.
const SAMPLE_FLOPS: f64 = 2e9;
const LAYERS: i64 = 30;

/// A weight matrix (out × in), the rows of activations it sees, and how many such matrices a step has.
struct Weight {
    out: i64,
    inp: i64,
    rows: i64,
    per_step: i64,
}

/// SmolLM2-135M: hidden 576, 3 KV heads of 64, MLP 1536, vocabulary 49152; the head sees 512 tokens.
#[rustfmt::skip]
const WEIGHTS: [Weight; 5] = [
    Weight { out: 576, inp: 576, rows: 612, per_step: 2 * LAYERS },  // q, o
    Weight { out: 192, inp: 576, rows: 612, per_step: 2 * LAYERS },  // k, v
    Weight { out: 1536, inp: 576, rows: 612, per_step: 2 * LAYERS }, // gate, up
    Weight { out: 576, inp: 1536, rows: 612, per_step: LAYERS },     // down
    Weight { out: 49152, inp: 576, rows: 512, per_step: 1 },         // LM head
];

/// The three products a linear layer costs in training, as (label, left operand, right operand).
fn products(w: &Weight) -> [(String, Tensor, Tensor); 3] {
    let opts = (Kind::Float, Device::Cpu);
    let weight = Tensor::randn([w.out, w.inp], opts);
    let x = Tensor::randn([w.rows, w.inp], opts);
    let dy = Tensor::randn([w.rows, w.out], opts);
    let (r, i, o) = (w.rows, w.inp, w.out);
    // `tr()` is a view: MKL gets a transposed operand, as in `linear` and autograd.
    [
        (label("x·Wᵀ ", r, i, o), x.shallow_clone(), weight.tr()),
        (label("dY·W ", r, o, i), dy.shallow_clone(), weight),
        (label("dYᵀ·X", o, r, i), dy.tr(), x),
    ]
}

/// "op (m×k)·(k×n)"
fn label(op: &str, m: i64, k: i64, n: i64) -> String {
    format!("{op} ({m}×{k})·({k}×{n})")
}

#[derive(Serialize, Deserialize)]
struct Timing {
    label: String,
    flops: f64,
    best_s: f64,
    per_step: i64,
}

#[derive(Serialize, Deserialize)]
struct ChildReport {
    dispatch: String,
    threads: i64,
    timings: Vec<Timing>,
}

/// Best time of one `a·b` into a preallocated output, over `reps` samples after one warm-up sample.
fn best_seconds(a: &Tensor, b: &Tensor, flops: f64, reps: usize) -> f64 {
    let out = Tensor::empty([a.size()[0], b.size()[1]], (Kind::Float, Device::Cpu));
    let iters = (SAMPLE_FLOPS / flops).ceil().max(1.0) as usize;
    let sample = || {
        let t = Instant::now();
        for _ in 0..iters {
            let _ = a.mm_out(&out, b);
        }
        t.elapsed().as_secs_f64() / iters as f64
    };
    sample();
    (0..reps).map(|_| sample()).fold(f64::INFINITY, f64::min)
}

fn run_child(reps: usize) -> anyhow::Result<()> {
    // Before any tensor work: MKL fixes its code path at its first call.
    // SAFETY: first thing in this child process, before any other thread and any libtorch call.
    let dispatch = format!("{:?}", unsafe {
        cotrain_model::mkl_dispatch::prefer_avx512()
    });
    cotrain_model::allocator::tune_for_tensors();
    let _guard = tch::no_grad_guard();
    let mut timings = Vec::new();
    for w in &WEIGHTS {
        let flops = 2.0 * (w.rows * w.inp * w.out) as f64;
        for (label, a, b) in products(w) {
            let best_s = best_seconds(&a, &b, flops, reps);
            timings.push(Timing {
                label,
                flops,
                best_s,
                per_step: w.per_step,
            });
        }
    }
    let report = ChildReport {
        dispatch,
        threads: tch::get_num_threads() as i64,
        timings,
    };
    println!("{REPORT_PREFIX}{}", serde_json::to_string(&report)?);
    Ok(())
}

/// Runs this executable as a child with `COTRAIN_MKL_AVX512=<switch>` and parses its report.
fn spawn_child(switch: &str, reps: usize) -> anyhow::Result<ChildReport> {
    let exe = std::env::current_exe().context("locating this benchmark's executable")?;
    let output = Command::new(&exe)
        .args(["--child", "--reps", &reps.to_string()])
        .env(cotrain_model::mkl_dispatch::ENV_SWITCH, switch)
        .output()
        .with_context(|| format!("starting {}", exe.display()))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        bail!(
            "child with COTRAIN_MKL_AVX512={switch} failed ({}):\n{stdout}{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix(REPORT_PREFIX))
        .with_context(|| {
            format!("child with COTRAIN_MKL_AVX512={switch} printed no report:\n{stdout}")
        })?;
    serde_json::from_str(line).context("parsing the child's report")
}

/// Milliseconds of one step's products: each shape's best time × how many of it a step has.
fn step_ms(report: &ChildReport) -> f64 {
    report
        .timings
        .iter()
        .map(|t| t.best_s * t.per_step as f64)
        .sum::<f64>()
        * 1e3
}

fn print_table(avx2: &ChildReport, avx512: &ChildReport) {
    for (switch, r) in [("0", avx2), ("1", avx512)] {
        println!(
            "COTRAIN_MKL_AVX512={switch}: {}, {} threads",
            r.dispatch, r.threads
        );
    }
    if avx512.dispatch != "Patched" {
        println!("(the patch did not apply here, so both columns take MKL's own path)");
    }
    println!();
    println!("| product | per step | AVX2 path GFLOP/s | AVX-512 path GFLOP/s | speed-up |");
    println!("|---|---:|---:|---:|---:|");
    for (slow, fast) in avx2.timings.iter().zip(&avx512.timings) {
        let rate = |t: &Timing| t.flops / t.best_s / 1e9;
        println!(
            "| {} | {} | {:.0} | {:.0} | {:.2}× |",
            slow.label,
            slow.per_step,
            rate(slow),
            rate(fast),
            slow.best_s / fast.best_s
        );
    }
    let (slow, fast) = (step_ms(avx2), step_ms(avx512));
    println!(
        "| **one step ({LAYERS} layers + head)** | | {slow:.0} ms | {fast:.0} ms | {:.2}× |",
        slow / fast
    );
}

fn main() -> anyhow::Result<()> {
    let mut reps = 5;
    let mut rounds = 2;
    let mut child = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--reps" => reps = args.next().context("--reps needs a number")?.parse()?,
            "--rounds" => rounds = args.next().context("--rounds needs a number")?.parse()?,
            "--child" => child = true,
            "--bench" => {} // passed by `cargo bench`
            other => bail!("unknown argument {other} (expected --reps N, --rounds N)"),
        }
    }
    if reps == 0 || rounds == 0 {
        bail!("--reps and --rounds must be at least 1");
    }
    if child {
        return run_child(reps);
    }
    println!("cpu: {}", cotrain_model::cpu::CpuFacts::probe().summary());
    println!(
        "roofline: {}",
        cotrain_model::cpu::Roofline::measure().summary()
    );
    let (mut avx2, mut avx512) = (spawn_child("0", reps)?, spawn_child("1", reps)?);
    for _ in 1..rounds {
        keep_best(&mut avx2, spawn_child("0", reps)?)?;
        keep_best(&mut avx512, spawn_child("1", reps)?)?;
    }
    if avx2.timings.len() != avx512.timings.len() {
        bail!("the two children timed different product lists");
    }
    print_table(&avx2, &avx512);
    Ok(())
}

/// Folds another round's report into `best`, shape by shape.
fn keep_best(best: &mut ChildReport, round: ChildReport) -> anyhow::Result<()> {
    if best.timings.len() != round.timings.len() || best.dispatch != round.dispatch {
        bail!(
            "two rounds of the same child disagree ({} vs {})",
            best.dispatch,
            round.dispatch
        );
    }
    for (b, r) in best.timings.iter_mut().zip(round.timings) {
        b.best_s = b.best_s.min(r.best_s);
    }
    Ok(())
}
