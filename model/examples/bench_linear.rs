//! Decode-step matmuls: libtorch against `kernels::gemm_f32`, over every weight matrix of the
//! default model (SmolLM2-135M: 211 of them), for a range of batch sizes.
//!
//!     cargo run --release -p cotrain-model --example bench_linear [-- --rows 1,2,8,16,32,64 --threads 2]
//!
//! Prints milliseconds per decode step (all matrices once, output contiguous), best of the
//! interleaved repetitions: `torch` is the route `linear()` took before the kernel (`(w·xᵀ)ᵀ` up to
//! 16 rows, `x.linear(w)` beyond), `mkldnn` is oneDNN's `mkldnn_linear` on a weight converted once,
//! `kernel` the AVX-512 kernel; then the same for bf16 weights (`torch bf16`: `x.linear(w)` with
//! both in bf16, as libtorch decodes a bf16 model; `kernel bf16`: f32 rows against the bf16
//! weights, as cotrain's decode step runs them); `dot` / `dot bf16` are the kernel with its
//! broadcast path turned off (dot-product tiles at every row count), to compare the two paths;
//! `bf16 avx512bf16` is the kernel's AVX512_BF16 path on the bf16 weights (the rows rounded to bf16,
//! `--bf16-dot-products`; `-` where the CPU lacks it); then the largest difference from
//! `x.linear(w)`.

use std::time::Instant;

use cotrain_model::kernels::kernel_linear_nt as linear_nt;
use cotrain_model::kernels::{gemm_bf16dot, gemm_f32};
use cotrain_model::loader;
use tch::{Kind, Tensor};

fn torch_route(x: &Tensor, w: &Tensor) -> Tensor {
    let rows = x.size()[0];
    if rows == 1 {
        w.matmul(&x.repeat([2, 1]).tr())
            .tr()
            .narrow(0, 0, 1)
            .contiguous()
    } else if rows <= 16 {
        w.matmul(&x.tr()).tr().contiguous()
    } else {
        x.linear::<Tensor>(w, None)
    }
}

fn time_step(
    ws: &[Tensor],
    xs: &dyn Fn(i64) -> Tensor,
    f: &dyn Fn(&Tensor, &Tensor) -> Tensor,
) -> f64 {
    let t = Instant::now();
    for w in ws {
        let _ = f(&xs(w.size()[1]), w);
    }
    t.elapsed().as_secs_f64() * 1e3
}

fn main() -> anyhow::Result<()> {
    // SAFETY: first thing in `main`, before any other thread and any libtorch call.
    unsafe { cotrain_model::mkl_dispatch::prefer_avx512() };
    cotrain_model::allocator::tune_for_tensors();
    println!("cpu: {}", cotrain_model::cpu::CpuFacts::probe().summary());
    println!(
        "roofline: {}",
        cotrain_model::cpu::Roofline::measure().summary()
    );
    let mut rows = vec![1i64, 2, 8, 16, 32, 64];
    let mut reps = 5;
    let mut mkldnn = true;
    let mut threads = 2;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--rows" => {
                rows = it
                    .next()
                    .unwrap()
                    .split(',')
                    .map(|r| r.parse().unwrap())
                    .collect()
            }
            "--reps" => reps = it.next().unwrap().parse()?,
            "--no-mkldnn" => mkldnn = false,
            // 1: as each engine of the learner's embedded worker runs (one per agent, the cores split).
            "--threads" => threads = it.next().unwrap().parse()?,
            "--bench" => {}
            other => anyhow::bail!("unknown argument {other}"),
        }
    }
    tch::set_num_threads(threads);
    let _guard = tch::no_grad_guard();
    let model = loader::load("default", &Default::default())?;
    let ws: Vec<Tensor> = model
        .named_parameters()
        .into_values()
        .filter(|t| t.dim() == 2 && t.kind() == Kind::Float)
        .map(|t| t.detach())
        .collect();
    let wk: Vec<Tensor> = if mkldnn {
        ws.iter().map(|w| w.to_mkldnn()).collect()
    } else {
        vec![]
    };
    let wb: Vec<Tensor> = ws.iter().map(|w| w.to_kind(Kind::BFloat16)).collect();
    let bytes: i64 = ws.iter().map(|w| w.numel() as i64 * 4).sum();
    println!(
        "{} matrices, {:.0} MB, kernel available: {}, threads: {}",
        ws.len(),
        bytes as f64 / 1e6,
        linear_nt(
            &Tensor::zeros([1, 1], (Kind::Float, tch::Device::Cpu)),
            &Tensor::zeros([1, 1], (Kind::Float, tch::Device::Cpu))
        )
        .is_some(),
        tch::get_num_threads()
    );
    println!(
        "{:>5} {:>10} {:>10} {:>10} {:>8} {:>15} {:>16} {:>13} {:>19} {:>12}",
        "rows",
        "torch ms",
        "mkldnn ms",
        "kernel ms",
        "dot ms",
        "torch bf16 ms",
        "kernel bf16 ms",
        "dot bf16 ms",
        "bf16 avx512bf16 ms",
        "max |diff|"
    );
    for &b in &rows {
        let x576 = Tensor::randn([b, 576], (Kind::Float, tch::Device::Cpu));
        let x1536 = Tensor::randn([b, 1536], (Kind::Float, tch::Device::Cpu));
        let xs = |k: i64| {
            if k == 576 {
                x576.shallow_clone()
            } else if k == 1536 {
                x1536.shallow_clone()
            } else {
                Tensor::randn([b, k], (Kind::Float, tch::Device::Cpu))
            }
        };
        let mut diff = 0f64;
        for w in &ws {
            let x = xs(w.size()[1]);
            let d = (linear_nt(&x, w).unwrap() - x.linear::<Tensor>(w, None))
                .abs()
                .max()
                .double_value(&[]);
            diff = diff.max(d);
        }
        let (mut tt, mut tm, mut tk) = (f64::MAX, f64::MAX, f64::MAX);
        let (mut tbt, mut tbk) = (f64::MAX, f64::MAX);
        let (mut td, mut tbd, mut tbb) = (f64::MAX, f64::MAX, f64::MAX);
        for _ in 0..reps {
            tt = tt.min(time_step(&ws, &xs, &torch_route));
            if mkldnn {
                let t = Instant::now();
                for w in &wk {
                    let x = xs(w.size()[1]).to_mkldnn();
                    let _ = x.mkldnn_linear::<Tensor>(w, None).to_dense(None, false);
                }
                tm = tm.min(t.elapsed().as_secs_f64() * 1e3);
            }
            tk = tk.min(time_step(&ws, &xs, &|x, w| linear_nt(x, w).unwrap()));
            tbt = tbt.min(time_step(
                &wb,
                &|k| xs(k).to_kind(Kind::BFloat16),
                &|x, w| x.linear::<Tensor>(w, None),
            ));
            tbk = tbk.min(time_step(&wb, &xs, &|x, w| linear_nt(x, w).unwrap()));
            // The kernel's dot-product tiles at every row count (the broadcast path off).
            gemm_f32::set_broadcast_min_rows([usize::MAX; 2]);
            td = td.min(time_step(&ws, &xs, &|x, w| linear_nt(x, w).unwrap()));
            tbd = tbd.min(time_step(&wb, &xs, &|x, w| linear_nt(x, w).unwrap()));
            gemm_f32::set_broadcast_min_rows(gemm_f32::BROADCAST_MIN_ROWS);
            if gemm_bf16dot::set_enabled(true).is_ok() {
                tbb = tbb.min(time_step(&wb, &xs, &|x, w| linear_nt(x, w).unwrap()));
                gemm_bf16dot::set_enabled(false).unwrap();
            }
        }
        println!(
            "{b:>5} {tt:>10.1} {:>10} {tk:>10.1} {td:>8.1} {tbt:>15.1} {tbk:>16.1} {tbd:>13.1} {:>19} {diff:>12.2e}",
            if mkldnn {
                format!("{tm:.1}")
            } else {
                "-".into()
            },
            if tbb < f64::MAX {
                format!("{tbb:.1}")
            } else {
                "-".into()
            }
        );
    }
    Ok(())
}
