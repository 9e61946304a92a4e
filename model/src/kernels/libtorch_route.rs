//! The plain libtorch route for the weight products `x · wᵀ + b`: what the transformer falls back
//! to where cotrain's kernel does not serve a product, and what [`super::dispatch`] times the
//! kernel against. It lives here, below both, so that the dispatch does not reach up into
//! [`crate::families`] (which itself calls into the kernels).

use tch::{Device, Kind, Tensor};

/// Rows up to which [`libtorch_linear`] takes the transposed MKL route on CPU in f32 (when the
/// AVX-512 kernel cannot serve them).
const SMALL_LINEAR_ROWS: i64 = 16;

/// `out = x · wᵀ (+ b)` for `rows` f32 rows on flat buffers, through libtorch's route for a model of
/// `w`'s dtype (the rows rounded to it, as libtorch's own decode step would have them): how the
/// fused decode step runs its products when the dispatch keeps libtorch, and what the dispatch's
/// probe times the kernel against.
pub(crate) fn libtorch_product_into(
    x: &[f32],
    rows: usize,
    w: &Tensor,
    b: Option<&Tensor>,
    out: &mut [f32],
) {
    let (n, k) = (w.size()[0] as usize, w.size()[1] as usize);
    let xs = Tensor::from_slice(&x[..rows * k])
        .view([rows as i64, k as i64])
        .to_kind(w.kind());
    let y = libtorch_linear(&xs, w, b).to_kind(Kind::Float).contiguous();
    // SAFETY: a fresh contiguous f32 CPU tensor of rows·n elements, only read while `y` lives.
    out[..rows * n].copy_from_slice(unsafe {
        std::slice::from_raw_parts(y.data_ptr() as *const f32, rows * n)
    });
}

/// `xs · wᵀ + b` by libtorch alone: what the transformer's `linear` falls back to where cotrain's
/// kernel does not serve the product. Up to `SMALL_LINEAR_ROWS` (16) rows in f32 on CPU it computes
/// `(w · xsᵀ)ᵀ`, which libtorch's MKL serves faster than `Tensor::linear` (see `linear` in
/// `crate::families::transformer`); everything else is `Tensor::linear`.
pub fn libtorch_linear(xs: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Tensor {
    let (n, k) = (w.size()[0], w.size()[1]);
    let rows = if k > 0 { xs.numel() as i64 / k } else { 0 };
    if xs.kind() != w.kind() {
        // f32 hidden states of a bf16 model's kernel decode step (see
        // `families/transformer/decode_cpu.rs`), where the kernel did not serve the head: libtorch
        // wants one dtype.
        return xs.to_kind(w.kind()).linear(w, b);
    }
    if xs.device() != Device::Cpu
        || xs.kind() != Kind::Float
        || rows == 0
        || rows > SMALL_LINEAR_ROWS
    {
        return xs.linear(w, b);
    }
    let mut shape = xs.size();
    *shape.last_mut().expect("linear input has a feature axis") = n;
    let x2 = xs.reshape([rows, k]);
    let y = if rows == 1 {
        w.matmul(&x2.repeat([2, 1]).tr()).tr().narrow(0, 0, 1)
    } else {
        w.matmul(&x2.tr()).tr()
    };
    let y = y.reshape(shape.as_slice());
    match b {
        Some(b) => y + b,
        None => y,
    }
}
