//! One decode step (one new token per row) of an f32 or bf16 model on an AVX-512 CPU, outside
//! libtorch: the weight matmuls through [`crate::kernels::gemm_f32`] and everything between them
//! through [`crate::kernels::decode_f32`], on flat buffers in the layout the matmuls produce, so no
//! transposes, views or per-op tensors are made. The arithmetic and the residual stream are f32
//! whatever the weights' type; a bf16 model reads its bf16 weights and bf16 KV cache widened, which
//! halves the bytes a step streams. It computes what the generic path of
//! [`CausalLm::forward_hidden_cached`] computes (the tests compare the two; for bf16 within the
//! rounding of that path's bf16 activations), and serves that method when it applies: f32 or bf16
//! on CPU, AVX-512F, nothing for autograd to record, contiguous weights. Whether the weight
//! products inside it run in cotrain's matrix kernel or in libtorch is the dispatch's measured
//! decision for the dtype ([`crate::kernels::dispatch`]); the rest of the step is plain loops either
//! way, which do the same arithmetic as libtorch's ops with none of their per-op overhead.
//! Its writes to the cache go through raw pointers and so do not bump libtorch's version counters;
//! that is sound because decoding runs with nothing recorded (no graph has saved the cache).

use half::bf16;
use tch::{Device, Kind, Tensor};

use super::layers::{DecoderLayer, Linear, RmsNorm};
use super::{CausalLm, KvCache};
use crate::error::Result;
use crate::kernels::decode_f32::{self as ops, CacheShape};
use crate::kernels::elem::Elem;
use crate::kernels::gemm_f32;
use crate::kernels::libtorch_route::libtorch_product_into;

/// Borrowed contents of a contiguous CPU tensor of `E`s.
///
/// # Safety
/// `t` must be a contiguous CPU tensor of kind `E::KIND` that nothing writes to while the slice
/// lives.
unsafe fn elems<E: Elem>(t: &Tensor) -> &[E] {
    debug_assert_eq!(t.kind(), E::KIND);
    if t.numel() == 0 {
        // An empty tensor's data pointer may be null, which a slice may not be.
        return &[];
    }
    // SAFETY: forwarded from the contract; `numel` elements start at `data_ptr`.
    unsafe { std::slice::from_raw_parts(t.data_ptr() as *const E, t.numel()) }
}

/// As [`elems`], writable.
///
/// # Safety
/// As for [`elems`], and nothing else may read or write `t` while the slice lives.
#[allow(clippy::mut_from_ref)] // the tensor is a handle; exclusivity is the caller's contract
unsafe fn elems_mut<E: Elem>(t: &Tensor) -> &mut [E] {
    debug_assert_eq!(t.kind(), E::KIND);
    if t.numel() == 0 {
        return &mut [];
    }
    // SAFETY: forwarded from the contract.
    unsafe { std::slice::from_raw_parts_mut(t.data_ptr() as *mut E, t.numel()) }
}

/// Contiguous `kind` on CPU, and not to be recorded: with grad mode on (`grad_mode`), a tensor that
/// requires grad would be. Only property reads: this runs for every weight at every step.
fn servable(t: &Tensor, kind: Kind, grad_mode: bool) -> bool {
    t.kind() == kind
        && t.device() == Device::Cpu
        && t.is_contiguous()
        && !(grad_mode && t.requires_grad())
}

/// Whether autograd is recording (tch does not expose the grad mode): one op on no elements.
fn grad_mode_on() -> bool {
    Tensor::zeros([0], (Kind::Float, Device::Cpu))
        .set_requires_grad(true)
        .neg()
        .requires_grad()
}

/// Per-step buffers, each rows × width.
struct Scratch {
    normed: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    out: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
}

impl CausalLm {
    /// Whether [`CausalLm::decode_step_cpu`] can serve a step on this model and cache.
    pub(super) fn fast_decode_applies(&self, cache: &KvCache) -> bool {
        if self.adapter_active.get()
            || !matches!(self.kind, Kind::Float | Kind::BFloat16)
            || self.device != Device::Cpu
            || cache.kind != self.kind
            || !crate::kernels::dispatch::fused_decode()
        {
            return false;
        }
        let grad_mode = grad_mode_on();
        let kind = self.kind;
        let servable = |t: &Tensor| servable(t, kind, grad_mode);
        let linears = |l: &DecoderLayer| {
            let a = &l.self_attn;
            [
                &a.q_proj,
                &a.k_proj,
                &a.v_proj,
                &a.o_proj,
                &l.mlp.gate_proj,
                &l.mlp.up_proj,
                &l.mlp.down_proj,
            ]
            .into_iter()
            .all(|lin: &Linear| {
                servable(&lin.weight)
                    && lin.bias.as_ref().is_none_or(&servable)
                    && lin
                        .row_loras
                        .borrow()
                        .iter()
                        .all(|g| servable(&g.a) && servable(&g.b))
            })
        };
        let norms = |l: &DecoderLayer| {
            let a = &l.self_attn;
            [
                Some(&l.input_layernorm),
                Some(&l.post_attention_layernorm),
                a.q_norm.as_ref(),
                a.k_norm.as_ref(),
            ]
            .into_iter()
            .flatten()
            .all(|n: &RmsNorm| servable(&n.weight))
        };
        servable(&self.embed_tokens)
            && servable(&self.norm.weight)
            && cache
                .layers
                .iter()
                .all(|(k, v)| k.is_contiguous() && v.is_contiguous())
            && self.layers.iter().all(|l| linears(l) && norms(l))
    }

    /// The decode step of [`CausalLm::forward_hidden_cached`] for one token per row (`input_ids`
    /// (B, 1), row `b` at position `starts[b]`), or `None` when it does not apply (then nothing has
    /// been written). The caller has checked the shapes against the cache.
    /// The hidden states are f32 whatever the model's dtype.
    pub(super) fn decode_step_cpu(
        &self,
        input_ids: &Tensor,
        starts: &[i64],
        cache: &mut KvCache,
    ) -> Option<Result<Tensor>> {
        // The kernels attend to every cached position: a sliding window that binds goes through
        // libtorch's masked attention instead.
        let window_binds = self
            .cfg
            .sliding_window
            .is_some_and(|w| starts.iter().any(|&s| s >= w as i64));
        if starts.is_empty() || window_binds || !self.fast_decode_applies(cache) {
            return None;
        }
        Some(match self.kind {
            Kind::BFloat16 => self.decode_step_with::<bf16>(input_ids, starts, cache),
            _ => self.decode_step_with::<f32>(input_ids, starts, cache),
        })
    }

    /// [`CausalLm::decode_step_cpu`] for weights and cache of `W`s (`fast_decode_applies` holds).
    fn decode_step_with<W: Elem>(
        &self,
        input_ids: &Tensor,
        starts: &[i64],
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let cfg = &self.cfg;
        let rows = starts.len();
        let (hidden, heads, kvh, d) = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let threads = tch::get_num_threads().max(1) as usize;
        let own_products = crate::kernels::dispatch::own_kernels(self.kind);
        let project = |lin: &Linear, x: &[f32], rows: usize, out: &mut [f32]| {
            project::<W>(lin, x, rows, out, threads, own_products)
        };
        let positions: Vec<usize> = starts.iter().map(|&s| s as usize).collect();
        let lens: Vec<usize> = positions.iter().map(|p| p + 1).collect();
        let max_pos = positions.iter().copied().max().unwrap_or(0);
        let table = self.rotary.table_for(max_pos as i64 + 1);
        let embedded = self.embed(input_ids)?.to_kind(Kind::Float).contiguous();
        // SAFETY: f32 CPU tensors, contiguous (`embedded` by construction, the rotary tables, f32
        // whatever the model's dtype, as built by `Rotary::table_for`); nothing writes them during
        // this step.
        let (mut x, cos, sin) = unsafe {
            (
                elems::<f32>(&embedded).to_vec(),
                elems::<f32>(&table.0),
                elems::<f32>(&table.1),
            )
        };
        let mut s = Scratch {
            normed: vec![0.0; rows * hidden],
            q: vec![0.0; rows * heads * d],
            k: vec![0.0; rows * kvh * d],
            v: vec![0.0; rows * kvh * d],
            attn: vec![0.0; rows * heads * d],
            out: vec![0.0; rows * hidden],
            gate: vec![0.0; rows * cfg.intermediate_size],
            up: vec![0.0; rows * cfg.intermediate_size],
        };
        let shape = CacheShape {
            kv_heads: kvh,
            capacity: cache.capacity as usize,
            dim: d,
        };
        let scale = 1.0 / (d as f32).sqrt();
        for (layer, (ck, cv)) in self.layers.iter().zip(&cache.layers) {
            let a = &layer.self_attn;
            norm::<W>(&layer.input_layernorm, &x, &mut s.normed);
            project(&a.q_proj, &s.normed, rows, &mut s.q);
            project(&a.k_proj, &s.normed, rows, &mut s.k);
            project(&a.v_proj, &s.normed, rows, &mut s.v);
            if let (Some(qn), Some(kn)) = (&a.q_norm, &a.k_norm) {
                norm_in_place::<W>(qn, &mut s.q);
                norm_in_place::<W>(kn, &mut s.k);
            }
            ops::rope(&mut s.q, heads, d, &positions, cos, sin);
            ops::rope(&mut s.k, kvh, d, &positions, cos, sin);
            // SAFETY: the cache's tensors are contiguous, of the model's kind (checked), and
            // borrowed mutably through `cache` for the whole step, so nothing else touches them.
            let (kc, vc) = unsafe { (elems_mut::<W>(ck), elems_mut::<W>(cv)) };
            ops::write_cache(kc, vc, shape, &s.k, &s.v, &positions);
            ops::attend(
                &s.q,
                kc,
                vc,
                shape,
                heads,
                &lens,
                scale,
                &mut s.attn,
                threads,
            );
            project(&a.o_proj, &s.attn, rows, &mut s.out);
            ops::add_assign(&mut x, &s.out);
            norm::<W>(&layer.post_attention_layernorm, &x, &mut s.normed);
            project(&layer.mlp.gate_proj, &s.normed, rows, &mut s.gate);
            project(&layer.mlp.up_proj, &s.normed, rows, &mut s.up);
            ops::silu_mul(&mut s.gate, &s.up);
            project(&layer.mlp.down_proj, &s.gate, rows, &mut s.out);
            ops::add_assign(&mut x, &s.out);
        }
        norm::<W>(&self.norm, &x, &mut s.normed);
        Ok(Tensor::from_slice(&s.normed).view([rows as i64, 1, hidden as i64]))
    }
}

/// `out = x · wᵀ (+ b)` for `rows` rows: through cotrain's matrix kernel when `own_products` (the
/// dispatch's measured decision for this dtype), else through libtorch's route for a model of this
/// dtype (the rows rounded to it, as libtorch's own decode step would have them).
fn project<W: Elem>(
    lin: &Linear,
    x: &[f32],
    rows: usize,
    out: &mut [f32],
    threads: usize,
    own_products: bool,
) {
    let (n, k) = (lin.weight.size()[0] as usize, lin.weight.size()[1] as usize);
    if !own_products {
        libtorch_product_into(x, rows, &lin.weight, lin.bias.as_ref(), out);
        add_row_adapters::<W>(lin, x, out, k, n);
        return;
    }
    // SAFETY: `fast_decode_applies` checked the weight and bias: contiguous, of the model's kind,
    // on CPU, not written during the step.
    let w = unsafe { elems::<W>(&lin.weight) };
    gemm_f32::matmul_nt(&x[..rows * k], w, &mut out[..rows * n], rows, n, k, threads);
    if let Some(b) = &lin.bias {
        // SAFETY: as above.
        ops::add_bias(&mut out[..rows * n], unsafe { elems::<W>(b) });
    }
    add_row_adapters::<W>(lin, x, out, k, n);
}

/// Adds each per-row adapter's update to its rows of `out` (rows × n) from `x` (rows × k):
/// `out[row] += scaling · B·(A·x[row])`, the low-rank product row by row (rank r: r·(k + n)
/// multiply-adds per row, against n·k for the projection itself).
fn add_row_adapters<W: Elem>(lin: &Linear, x: &[f32], out: &mut [f32], k: usize, n: usize) {
    for g in lin.row_loras.borrow().iter() {
        let r = g.a.size()[0] as usize;
        // SAFETY: `fast_decode_applies` checked the pairs: contiguous, of the model's kind, on CPU,
        // not written during the step.
        let (a, b) = unsafe { (elems::<W>(&g.a), elems::<W>(&g.b)) };
        let mut t = vec![0f32; r];
        for &row in &g.row_list {
            let xr = &x[row * k..(row + 1) * k];
            for (j, tj) in t.iter_mut().enumerate() {
                *tj = a[j * k..(j + 1) * k]
                    .iter()
                    .zip(xr)
                    .map(|(w, v)| w.to_f32() * v)
                    .sum::<f32>()
                    * g.scaling as f32;
            }
            let orow = &mut out[row * n..(row + 1) * n];
            for (i, o) in orow.iter_mut().enumerate() {
                *o += b[i * r..(i + 1) * r]
                    .iter()
                    .zip(&t)
                    .map(|(w, v)| w.to_f32() * v)
                    .sum::<f32>();
            }
        }
    }
}

fn norm<W: Elem>(n: &RmsNorm, x: &[f32], out: &mut [f32]) {
    // SAFETY: `fast_decode_applies` checked the weight.
    ops::rms_norm(x, unsafe { elems::<W>(&n.weight) }, n.eps, out);
}

fn norm_in_place<W: Elem>(n: &RmsNorm, x: &mut [f32]) {
    let copy = x.to_vec();
    norm::<W>(n, &copy, x);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loader::{LoadOptions, load_hf_weights};

    /// Both routes of the fused step's products give the same projection (qwen2: with biases):
    /// exactly the same arithmetic for f32 up to summation order, and for bf16 up to libtorch
    /// rounding the rows to bf16.
    #[test]
    fn products_through_the_kernel_and_through_libtorch_agree() {
        if !gemm_f32::is_available() {
            return;
        }
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny/qwen2");
        for (kind, tol) in [(Kind::Float, 1e-5f32), (Kind::BFloat16, 2e-2)] {
            let (_vs, model) = load_hf_weights(
                &dir,
                &LoadOptions {
                    kind,
                    ..Default::default()
                },
            )
            .unwrap();
            let lin = &model.layers[0].self_attn.q_proj;
            assert!(lin.bias.is_some());
            let (n, k) = (lin.weight.size()[0] as usize, lin.weight.size()[1] as usize);
            let rows = 5;
            let x: Vec<f32> = (0..rows * k)
                .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
                .collect();
            let (mut ours, mut theirs) = (vec![0f32; rows * n], vec![0f32; rows * n]);
            let _guard = tch::no_grad_guard();
            match kind {
                Kind::Float => {
                    project::<f32>(lin, &x, rows, &mut ours, 2, true);
                    project::<f32>(lin, &x, rows, &mut theirs, 2, false);
                }
                _ => {
                    project::<bf16>(lin, &x, rows, &mut ours, 2, true);
                    project::<bf16>(lin, &x, rows, &mut theirs, 2, false);
                }
            }
            let scale = theirs.iter().fold(0f32, |m, v| m.max(v.abs()));
            let diff = ours
                .iter()
                .zip(&theirs)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                scale > 0.0 && diff <= tol * scale.max(1.0),
                "{kind:?}: max |diff| {diff} at scale {scale}"
            );
        }
    }
}
