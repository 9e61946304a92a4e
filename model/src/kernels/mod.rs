//! Hand-written CPU kernels for the spots where libtorch's own are far from the machine's limits.
//!
//! [`gemm_f32`]: the decode-step matmuls `x · wᵀ` with a handful of rows of `x` (one per sequence
//! in the batch), where MKL (through libtorch 2.13) is neither bandwidth- nor compute-bound.
//! [`decode_f32`]: the rest of a decode step (norms, RoPE, the cache write, attention), where
//! libtorch's per-op overhead outweighs the arithmetic. Both compute in f32 and read weights and
//! caches in f32 or bf16 ([`elem`]). [`adamw_f32`]: the optimiser update in one pass. [`omp`]:
//! libtorch's OpenMP team, which they run on. [`dispatch`]: which of the kernels and libtorch's
//! route ([`libtorch_route`]) serves the products on this CPU.

pub mod adamw_f32;
#[cfg(target_arch = "x86_64")]
pub mod decode_f32;
pub mod dispatch;
#[cfg(target_arch = "x86_64")]
pub mod elem;
#[cfg(target_arch = "x86_64")]
pub mod gemm_bf16dot;
mod gemm_broadcast;
#[cfg(target_arch = "x86_64")]
pub mod gemm_f32;
pub mod libtorch_route;
pub(crate) mod omp;

pub use omp::set_threads_of_this_thread;

#[cfg_attr(not(target_arch = "x86_64"), allow(unused_imports))]
use tch::{Device, Kind, Tensor};

/// `xs · wᵀ` for `xs` (..., K) and `w` (N, K) through [`gemm_f32::matmul_nt`], or `None` where
/// libtorch serves it: where [`dispatch`] keeps libtorch on this CPU, or the kernel does not apply
/// (see [`kernel_linear_nt`]).
#[cfg(target_arch = "x86_64")]
pub fn linear_nt(xs: &Tensor, w: &Tensor) -> Option<Tensor> {
    if !dispatch::own_kernels(w.kind()) {
        return None;
    }
    kernel_linear_nt(xs, w)
}

/// As [`linear_nt`] whatever the dispatch decided, or `None` where the kernel does not apply: no
/// AVX-512F, not f32 or bf16 on CPU, a weight that is not a contiguous matrix of matching width, or
/// an input that autograd would record (it requires grad and grad mode is on: training stays with
/// libtorch). A non-contiguous `xs` is copied first. The product is computed in f32 (a bf16 `xs`
/// is widened first) and returned in `xs`'s dtype: f32 rows against bf16 weights give f32.
#[cfg(target_arch = "x86_64")]
pub fn kernel_linear_nt(xs: &Tensor, w: &Tensor) -> Option<Tensor> {
    let float_or_bf16 = |k: Kind| matches!(k, Kind::Float | Kind::BFloat16);
    if !gemm_f32::is_available()
        || xs.device() != Device::Cpu
        || w.device() != Device::Cpu
        || !float_or_bf16(xs.kind())
        || !float_or_bf16(w.kind())
        || w.dim() != 2
        || !w.is_contiguous()
        || xs.dim() == 0
        || recorded(xs)
        || recorded(w)
    {
        return None;
    }
    let (n, k) = (w.size()[0], w.size()[1]);
    let mut shape = xs.size();
    let last = shape.last_mut().expect("xs has at least one axis");
    if *last != k {
        return None;
    }
    *last = n;
    let out_kind = xs.kind();
    let xs = xs.to_kind(Kind::Float).contiguous();
    let m = if k > 0 { xs.numel() as i64 / k } else { 0 };
    if k == 0 {
        return Some(Tensor::zeros(shape.as_slice(), (out_kind, Device::Cpu)));
    }
    let ys = Tensor::empty(shape.as_slice(), (Kind::Float, Device::Cpu));
    if m == 0 || n == 0 {
        return Some(ys.to_kind(out_kind));
    }
    let (m, n, k) = (m as usize, n as usize, k as usize);
    let threads = tch::get_num_threads().max(1) as usize;
    // SAFETY: `xs` is a contiguous f32 CPU tensor of m·k elements, `w` a contiguous CPU tensor of
    // n·k elements of the type it is read as (its kind, checked), and `ys` a fresh f32 one of m·n
    // that nothing else references; all three live until the end of this function.
    unsafe {
        let x = std::slice::from_raw_parts(xs.data_ptr() as *const f32, m * k);
        let y = std::slice::from_raw_parts_mut(ys.data_ptr() as *mut f32, m * n);
        match w.kind() {
            Kind::BFloat16 => {
                let w = std::slice::from_raw_parts(w.data_ptr() as *const half::bf16, n * k);
                gemm_f32::matmul_nt(x, w, y, m, n, k, threads);
            }
            _ => {
                let w = std::slice::from_raw_parts(w.data_ptr() as *const f32, n * k);
                gemm_f32::matmul_nt(x, w, y, m, n, k, threads);
            }
        }
    }
    Some(if out_kind == Kind::Float {
        ys
    } else {
        ys.to_kind(out_kind)
    })
}

/// Elsewhere there is no kernel: always `None`.
#[cfg(not(target_arch = "x86_64"))]
pub fn linear_nt(_xs: &Tensor, _w: &Tensor) -> Option<Tensor> {
    None
}

/// Elsewhere there is no kernel: always `None`.
#[cfg(not(target_arch = "x86_64"))]
pub fn kernel_linear_nt(_xs: &Tensor, _w: &Tensor) -> Option<Tensor> {
    None
}

/// Whether autograd would record an op on `t`: it requires grad and grad mode is on. tch does not
/// expose the grad mode, and a view would not tell (it inherits the flag even under `no_grad`),
/// so this asks an op on no elements.
#[cfg(target_arch = "x86_64")]
fn recorded(t: &Tensor) -> bool {
    t.requires_grad() && t.narrow(0, 0, 0).neg().requires_grad()
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    fn check(b: i64, n: i64, k: i64) {
        let x = Tensor::randn([b, k], (Kind::Float, Device::Cpu));
        let w = Tensor::randn([n, k], (Kind::Float, Device::Cpu)) * 0.05;
        let want = x.linear::<Tensor>(&w, None);
        let got = kernel_linear_nt(&x, &w).expect("kernel applies");
        assert_eq!(got.size(), want.size(), "b={b} n={n} k={k}");
        let diff = (got - want).abs().max().double_value(&[]);
        assert!(diff <= 1e-4, "b={b} n={n} k={k}: max |diff| {diff}");
    }

    #[test]
    fn matches_torch_on_ragged_shapes() {
        if !gemm_f32::is_available() {
            return;
        }
        // Both paths, whatever `COTRAIN_BROADCAST_MIN_ROWS` says.
        gemm_f32::set_broadcast_min_rows(gemm_f32::BROADCAST_MIN_ROWS);
        tch::manual_seed(0);
        for b in [1, 2, 3, 5, 6, 7, 8, 13, 16, 31, 32, 64, 70] {
            for (n, k) in [
                (1, 1),
                (3, 15),
                (4, 16),
                (5, 17),
                (17, 33),
                (193, 600),
                (576, 576),
            ] {
                check(b, n, k);
            }
        }
        for b in 1..=70 {
            check(b, 66, 40);
        }
    }

    /// bf16 weights are widened exactly, so the kernel equals libtorch's f32 product with the
    /// widened weight; a bf16 input gives a bf16 result.
    #[test]
    fn bf16_weights_match_the_product_with_their_f32_widening() {
        if !gemm_f32::is_available() {
            return;
        }
        tch::manual_seed(5);
        gemm_f32::set_broadcast_min_rows(gemm_f32::BROADCAST_MIN_ROWS);
        // Below and above the rows where bf16 takes the broadcast path (`gemm_f32::BROADCAST_MIN_ROWS`).
        for (b, n, k) in [
            (1, 17, 33),
            (4, 193, 600),
            (8, 576, 576),
            (16, 193, 600),
            (33, 66, 40),
            (70, 17, 33),
        ] {
            let x = Tensor::randn([b, k], (Kind::Float, Device::Cpu));
            let w =
                (Tensor::randn([n, k], (Kind::Float, Device::Cpu)) * 0.05).to_kind(Kind::BFloat16);
            let got = kernel_linear_nt(&x, &w).expect("kernel applies");
            assert_eq!(got.kind(), Kind::Float);
            let want = x.linear::<Tensor>(&w.to_kind(Kind::Float), None);
            let diff = (got - want).abs().max().double_value(&[]);
            assert!(diff <= 1e-4, "b={b} n={n} k={k}: max |diff| {diff}");
            let xb = x.to_kind(Kind::BFloat16);
            let got = kernel_linear_nt(&xb, &w).expect("kernel applies");
            assert_eq!(got.kind(), Kind::BFloat16);
        }
    }

    /// The AVX512_BF16 path (`gemm_bf16dot`) computes the product of the rows rounded to bf16 with
    /// the bf16 weights: libtorch's f32 product of both widened, up to the order of the sums, on
    /// both of its layouts (dot tiles below `BROADCAST_MIN_ROWS` rows, pairs broadcast from there),
    /// ragged widths included.
    #[test]
    #[cfg_attr(not(host_avx512_bf16), ignore = "this CPU has no AVX512_BF16")]
    fn bf16_dot_products_equal_the_product_of_the_rounded_rows() {
        if !gemm_bf16dot::is_available() {
            eprintln!("skipped: no AVX512_BF16");
            return;
        }
        tch::manual_seed(9);
        for (b, n, k) in [
            (1, 17, 34),
            (3, 5, 2),
            (4, 193, 600),
            (7, 66, 40),
            (8, 576, 576),
            (13, 9, 62),
            (16, 193, 600),
            (32, 64, 1536),
            (33, 66, 40),
            (70, 17, 34),
        ] {
            let x = Tensor::randn([b, k], (Kind::Float, Device::Cpu));
            let w =
                (Tensor::randn([n, k], (Kind::Float, Device::Cpu)) * 0.05).to_kind(Kind::BFloat16);
            let want = x
                .to_kind(Kind::BFloat16)
                .to_kind(Kind::Float)
                .linear::<Tensor>(&w.to_kind(Kind::Float), None);
            let (m, n, k) = (b as usize, n as usize, k as usize);
            let xs = Vec::<f32>::try_from(x.flatten(0, -1)).unwrap();
            let ws: Vec<half::bf16> = Vec::<f32>::try_from(w.to_kind(Kind::Float).flatten(0, -1))
                .unwrap()
                .into_iter()
                .map(half::bf16::from_f32)
                .collect();
            for threads in [1, 2] {
                let mut y = vec![f32::NAN; m * n];
                gemm_f32::matmul_nt_bf16_dot(&xs, &ws, &mut y, m, n, k, threads);
                let got = Tensor::from_slice(&y).view([b, n as i64]);
                let diff = (&got - &want).abs().max().double_value(&[]);
                assert!(
                    diff <= 1e-4,
                    "b={b} n={n} k={k} threads={threads}: max |diff| {diff}"
                );
            }
            // Rounding the rows is what sets the path apart: against the unrounded product the
            // difference is that of bf16's 8-bit mantissa, not of the sums' order.
            let exact = x.linear::<Tensor>(&w.to_kind(Kind::Float), None);
            let off = (&exact - &want).abs().max().double_value(&[]);
            assert!(
                k < 8 || off > 1e-4,
                "b={b} n={n} k={k}: rounding the rows changed nothing ({off})"
            );
        }
    }

    #[test]
    fn keeps_leading_axes_and_copies_non_contiguous_input() {
        if !gemm_f32::is_available() {
            return;
        }
        let x = Tensor::randn([3, 5, 24], (Kind::Float, Device::Cpu));
        let w = Tensor::randn([10, 24], (Kind::Float, Device::Cpu));
        let got = kernel_linear_nt(&x, &w).unwrap();
        assert_eq!(got.size(), [3, 5, 10]);
        assert!(
            (got - x.linear::<Tensor>(&w, None))
                .abs()
                .max()
                .double_value(&[])
                <= 1e-4
        );
        let xt = Tensor::randn([24, 7], (Kind::Float, Device::Cpu)).tr();
        assert!(!xt.is_contiguous());
        let diff = (kernel_linear_nt(&xt, &w).unwrap() - xt.linear::<Tensor>(&w, None))
            .abs()
            .max();
        assert!(diff.double_value(&[]) <= 1e-4);
    }

    #[test]
    fn declines_what_it_cannot_serve() {
        let x = Tensor::randn([2, 8], (Kind::Float, Device::Cpu));
        let w = Tensor::randn([4, 8], (Kind::Float, Device::Cpu));
        assert!(kernel_linear_nt(&x.set_requires_grad(true), &w).is_none());
        assert!(kernel_linear_nt(&x, &w.set_requires_grad(true)).is_none());
        {
            // Frozen for inference: parameters that require grad, under `no_grad`, are served.
            let _guard = tch::no_grad_guard();
            let wg = w.copy().set_requires_grad(true);
            let xg = x.copy().set_requires_grad(true);
            // (Without AVX-512F the kernel serves nothing: libtorch's route everywhere.)
            assert_eq!(
                kernel_linear_nt(&xg, &wg).map(|y| y.requires_grad()),
                gemm_f32::is_available().then_some(false)
            );
        }
        assert!(kernel_linear_nt(&x.to_kind(Kind::Double), &w.to_kind(Kind::Double)).is_none());
        assert!(kernel_linear_nt(&x, &w.to_kind(Kind::Half)).is_none());
        assert!(
            kernel_linear_nt(&x, &Tensor::randn([8, 4], (Kind::Float, Device::Cpu)).tr()).is_none()
        );
        assert!(kernel_linear_nt(&Tensor::randn([2, 7], (Kind::Float, Device::Cpu)), &w).is_none());
    }

    #[test]
    fn zero_rows_and_zero_width() {
        if !gemm_f32::is_available() {
            return;
        }
        let w = Tensor::randn([4, 8], (Kind::Float, Device::Cpu));
        assert_eq!(
            kernel_linear_nt(&Tensor::zeros([0, 8], (Kind::Float, Device::Cpu)), &w)
                .unwrap()
                .size(),
            [0, 4]
        );
        let y = kernel_linear_nt(
            &Tensor::ones([2, 0], (Kind::Float, Device::Cpu)),
            &Tensor::ones([4, 0], (Kind::Float, Device::Cpu)),
        );
        assert_eq!(y.unwrap().abs().sum(Kind::Float).double_value(&[]), 0.0);
    }
}
