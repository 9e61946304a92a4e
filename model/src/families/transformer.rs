//! The decoder-only transformer the Llama, Qwen2 and Qwen3 families share: rotary embedding,
//! RMSNorm, SwiGLU MLP, grouped-query attention (with Qwen2's q/k/v biases and Qwen3's per-head
//! q/k norm as switches), decoder layer, model and causal-LM head.
//!
//! Parameters live in the caller's `VarStore` under the Hugging Face tensor names
//! (`model.layers.{i}.self_attn.q_proj.weight`), so checkpoints load without a renaming table and
//! the learner can save them by name. The KV cache is an explicit argument: training runs the
//! same code with `None`.

use std::cell::RefCell;

use tch::{Device, Kind, Tensor, nn, nn::Init};

#[cfg(target_arch = "x86_64")]
mod decode_cpu;

use crate::config::{ModelConfig, RopeScaling};
use crate::lora::{LoraAdapter, LoraSlot};
use crate::error::{ModelError, Result};

/// How fresh parameters are initialised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightInit {
    /// Normal(0, 0.02) matrices and unit norms, as transformers initialises a new model.
    Random,
    /// Zeros (and unit norms): for parameters about to be overwritten by a checkpoint.
    Zeros,
}

fn param(vs: &nn::Path, name: &str, dims: &[i64], init: WeightInit) -> Tensor {
    match init {
        WeightInit::Random => vs.var(
            name,
            dims,
            Init::Randn {
                mean: 0.0,
                stdev: 0.02,
            },
        ),
        WeightInit::Zeros => vs.var(name, dims, Init::Const(0.0)),
    }
}

// ---------------------------------------------------------------------------------------------
// Rotary embedding

/// RoPE cos/sin tables, computed once for a length and grown (doubling) when a longer position
/// is needed, so decoding never recomputes them.
#[derive(Debug)]
pub(crate) struct Rotary {
    inv_freq: Vec<f32>,
    device: Device,
    /// (T, D) cos and sin in f32, and T.
    table: RefCell<(Tensor, Tensor, i64)>,
}

impl Rotary {
    fn new(cfg: &ModelConfig, device: Device) -> Self {
        let dim = cfg.head_dim;
        // As transformers: inv_freq = 1 / base^(2i/dim), in f32.
        let mut inv_freq: Vec<f32> = (0..dim / 2)
            .map(|i| 1.0 / (cfg.rope_theta as f32).powf((2 * i) as f32 / dim as f32))
            .collect();
        match cfg.rope_scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => {
                for f in &mut inv_freq {
                    *f /= factor as f32;
                }
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old_ctx,
            } => {
                let low_wavelen = old_ctx / low_freq_factor;
                let high_wavelen = old_ctx / high_freq_factor;
                for f in &mut inv_freq {
                    let wavelen = 2.0 * std::f64::consts::PI / *f as f64;
                    let freq = *f as f64;
                    let scaled = if wavelen > low_wavelen {
                        freq / factor
                    } else if wavelen < high_wavelen {
                        freq
                    } else {
                        let smooth = (old_ctx / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * freq / factor + smooth * freq
                    };
                    *f = scaled as f32;
                }
            }
        }
        let empty = Tensor::zeros([0, dim as i64], (Kind::Float, device));
        Rotary {
            inv_freq,
            device,
            table: RefCell::new((empty.shallow_clone(), empty, 0)),
        }
    }

    /// Another handle on the same table (a copy that grows on its own from here).
    fn share(&self) -> Self {
        let t = self.table.borrow();
        Rotary {
            inv_freq: self.inv_freq.clone(),
            device: self.device,
            table: RefCell::new((t.0.shallow_clone(), t.1.shallow_clone(), t.2)),
        }
    }

    /// Makes sure positions `0..len` are in the table.
    fn ensure(&self, len: i64) {
        let mut table = self.table.borrow_mut();
        if table.2 >= len {
            return;
        }
        let new_len = len.max(2 * table.2).max(256);
        let inv = Tensor::from_slice(&self.inv_freq).to_device(self.device);
        let pos = Tensor::arange(new_len, (Kind::Float, self.device));
        // (T, 1) * (1, D/2) -> (T, D/2) -> (T, D)
        let freqs = pos.unsqueeze(1) * inv.unsqueeze(0);
        let emb = Tensor::cat(&[&freqs, &freqs], -1);
        *table = (emb.cos(), emb.sin(), new_len);
    }

    /// cos/sin for positions `0..len`: (1, 1, L, D) each.
    fn prefix(&self, len: i64, kind: Kind) -> (Tensor, Tensor) {
        self.ensure(len);
        let t = self.table.borrow();
        let f = |x: &Tensor| x.narrow(0, 0, len).to_kind(kind).unsqueeze(0).unsqueeze(0);
        (f(&t.0), f(&t.1))
    }

    /// cos/sin for per-row positions (B, L): (B, 1, L, D) each.
    fn gather(&self, positions: &Tensor, max_pos: i64, kind: Kind) -> (Tensor, Tensor) {
        self.ensure(max_pos + 1);
        let t = self.table.borrow();
        let (b, l) = positions.size2().expect("positions are (B, L)");
        let flat = positions.reshape([-1]);
        let f = |x: &Tensor| x.index_select(0, &flat).to_kind(kind).view([b, 1, l, -1]);
        (f(&t.0), f(&t.1))
    }
}

/// Rotates each head's halves: (x1, x2) -> (-x2, x1), the Hugging Face layout.
fn rotate_half(x: &Tensor) -> Tensor {
    let half = x.size()[x.dim() - 1] / 2;
    let x1 = x.narrow(-1, 0, half);
    let x2 = x.narrow(-1, half, half);
    Tensor::cat(&[&x2.neg(), &x1], -1)
}

fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    x * cos + rotate_half(x) * sin
}

// ---------------------------------------------------------------------------------------------
// Norm, linear, MLP

#[derive(Debug)]
pub(crate) struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    fn new(vs: nn::Path, dim: usize, eps: f64) -> Self {
        RmsNorm {
            weight: vs.var("weight", &[dim as i64], Init::Const(1.0)),
            eps,
        }
    }

    fn share(&self) -> Self {
        RmsNorm { weight: self.weight.shallow_clone(), eps: self.eps }
    }

    fn forward(&self, xs: &Tensor) -> Tensor {
        if xs.kind() == Kind::Float {
            let dim = self.weight.size()[0];
            xs.rms_norm([dim], Some(&self.weight), self.eps)
        } else {
            // As transformers: normalise in f32, cast back, then scale.
            let kind = xs.kind();
            let x = xs.to_kind(Kind::Float);
            let var = x.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
            let x = x * (var + self.eps).rsqrt();
            &self.weight * x.to_kind(kind)
        }
    }
}

#[derive(Debug)]
pub(crate) struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
    /// The LoRA pair the next forwards add (see [`CausalLm::set_adapter`]).
    lora: RefCell<Option<LoraSlot>>,
    /// The dtype products run in when it is not the weight's (see [`CausalLm::set_matmul_kind`]).
    matmul_kind: std::cell::Cell<Option<Kind>>,
}

impl Linear {
    fn new(vs: nn::Path, in_dim: usize, out_dim: usize, bias: bool, init: WeightInit) -> Self {
        let weight = param(&vs, "weight", &[out_dim as i64, in_dim as i64], init);
        let bias = bias.then(|| vs.var("bias", &[out_dim as i64], Init::Const(0.0)));
        Linear { weight, bias, lora: RefCell::new(None), matmul_kind: std::cell::Cell::new(None) }
    }

    /// The same weights, without an adapter set.
    fn share(&self) -> Self {
        Linear {
            weight: self.weight.shallow_clone(),
            bias: self.bias.as_ref().map(Tensor::shallow_clone),
            lora: RefCell::new(None),
            matmul_kind: std::cell::Cell::new(self.matmul_kind.get()),
        }
    }

    fn forward(&self, xs: &Tensor) -> Tensor {
        let y = match self.matmul_kind.get() {
            Some(kind) => linear_in(kind, xs, &self.weight, self.bias.as_ref()),
            None => linear(xs, &self.weight, self.bias.as_ref()),
        };
        match &*self.lora.borrow() {
            None => y,
            // y + scaling · dropout(x)·Aᵀ·Bᵀ (LoRA, Hu et al. 2021), never materialising B·A.
            Some(s) => {
                let x = if s.dropout > 0.0 { xs.dropout(s.dropout, true) } else { xs.shallow_clone() };
                y + x.linear::<&Tensor>(&s.a, None).linear::<&Tensor>(&s.b, None) * s.scaling
            }
        }
    }
}

/// `xs · wᵀ + b` with the operands rounded to `kind` (bf16 products of f32 master weights) and the
/// result back in `xs`'s dtype. Autograd runs through the casts, so the gradients reach the f32
/// weights in f32 (each cast's backward is the cast back).
pub(crate) fn linear_in(kind: Kind, xs: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Tensor {
    let b = b.map(|b| b.to_kind(kind));
    xs.to_kind(kind).linear(&w.to_kind(kind), b.as_ref()).to_kind(xs.kind())
}

/// Rows up to which [`linear`] takes the transposed MKL route on CPU in f32 (when the AVX-512 kernel
/// cannot serve them).
const SMALL_LINEAR_ROWS: i64 = 16;

/// `xs · wᵀ + b` for `xs` (..., K) and `w` (N, K), by the fastest route measured for the shape:
/// - 1–64 rows with nothing for autograd to record (decoding), on an AVX-512 CPU in f32 or bf16: cotrain's
///   own kernel ([`crate::kernels`]), which streams the weights once; 1.2× to 2.2× faster than the
///   MKL routes below over SmolLM2's 211 weight matrices.
/// - Otherwise up to 16 rows in f32 on CPU: `(w · xsᵀ)ᵀ`, the same product, because libtorch's MKL
///   serves a short *second* operand far faster than the short first operand `Tensor::linear` hands
///   it (3.3× at 2 rows, 1.4× at 8, 1.16× at 16; even at 32–64, slower beyond). One row is padded to
///   two, which MKL also serves faster than its matrix-vector path. Autograd goes through it.
/// - Everything else (training batches, other devices and dtypes): `Tensor::linear`.
pub(crate) fn linear(xs: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Tensor {
    let k = w.size()[1];
    let rows = if k > 0 { xs.numel() as i64 / k } else { 0 };
    const KERNEL_ROWS: i64 = 64;
    if (1..=KERNEL_ROWS).contains(&rows)
        && let Some(mut y) = crate::kernels::linear_nt(xs, w)
    {
        if let Some(b) = b {
            y += b;
        }
        return y;
    }
    libtorch_linear(xs, w, b)
}

/// `out = x · wᵀ (+ b)` for `rows` f32 rows on flat buffers, through libtorch's route for a model of
/// `w`'s dtype (the rows rounded to it, as libtorch's own decode step would have them): how the
/// fused decode step runs its products when the dispatch keeps libtorch, and what the dispatch's
/// probe times the kernel against.
pub(crate) fn libtorch_product_into(x: &[f32], rows: usize, w: &Tensor, b: Option<&Tensor>, out: &mut [f32]) {
    let (n, k) = (w.size()[0] as usize, w.size()[1] as usize);
    let xs = Tensor::from_slice(&x[..rows * k]).view([rows as i64, k as i64]).to_kind(w.kind());
    let y = libtorch_linear(&xs, w, b).to_kind(Kind::Float).contiguous();
    // SAFETY: a fresh contiguous f32 CPU tensor of rows·n elements, only read while `y` lives.
    out[..rows * n].copy_from_slice(unsafe { std::slice::from_raw_parts(y.data_ptr() as *const f32, rows * n) });
}

/// [`linear`] without cotrain's kernel: the plain libtorch route.
pub fn libtorch_linear(xs: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Tensor {
    let (n, k) = (w.size()[0], w.size()[1]);
    let rows = if k > 0 { xs.numel() as i64 / k } else { 0 };
    if xs.kind() != w.kind() {
        // f32 hidden states of a bf16 model's kernel decode step (see `decode_cpu`), where the
        // kernel did not serve the head: libtorch wants one dtype.
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

#[derive(Debug)]
struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl Mlp {
    fn new(cfg: &ModelConfig, vs: nn::Path, init: WeightInit) -> Self {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        Mlp {
            gate_proj: Linear::new(&vs / "gate_proj", h, i, false, init),
            up_proj: Linear::new(&vs / "up_proj", h, i, false, init),
            down_proj: Linear::new(&vs / "down_proj", i, h, false, init),
        }
    }

    fn share(&self) -> Self {
        Mlp { gate_proj: self.gate_proj.share(), up_proj: self.up_proj.share(), down_proj: self.down_proj.share() }
    }

    fn forward(&self, xs: &Tensor) -> Tensor {
        self.down_proj
            .forward(&(self.gate_proj.forward(xs).silu() * self.up_proj.forward(xs)))
    }
}

// ---------------------------------------------------------------------------------------------
// KV cache and the per-forward context

/// A preallocated key/value cache: per layer, keys and values of shape
/// (rows, kv_heads, capacity, head_dim). Rows are sequences; a row's entries beyond its length
/// are stale and masked out. It grows by doubling (rarely), never by a per-step `cat`.
#[derive(Debug)]
pub struct KvCache {
    layers: Vec<(Tensor, Tensor)>,
    rows: i64,
    capacity: i64,
    kv_heads: i64,
    head_dim: i64,
    kind: Kind,
    device: Device,
}

impl KvCache {
    /// A cache for `rows` sequences of up to `capacity` positions, in the model's dtype/device.
    pub fn new(model: &CausalLm, rows: usize, capacity: usize) -> Self {
        let cfg = model.config();
        let (kind, device) = (model.kind(), model.device());
        let (kv_heads, head_dim) = (cfg.num_key_value_heads as i64, cfg.head_dim as i64);
        let (rows, capacity) = (rows.max(1) as i64, capacity.max(1) as i64);
        let layers = (0..cfg.num_hidden_layers)
            .map(|_| {
                let shape = [rows, kv_heads, capacity, head_dim];
                (
                    Tensor::zeros(shape, (kind, device)),
                    Tensor::zeros(shape, (kind, device)),
                )
            })
            .collect();
        KvCache {
            layers,
            rows,
            capacity,
            kv_heads,
            head_dim,
            kind,
            device,
        }
    }

    /// Number of sequence rows.
    pub fn rows(&self) -> usize {
        self.rows as usize
    }

    /// Positions per row.
    pub fn capacity(&self) -> usize {
        self.capacity as usize
    }

    /// Layer `i`'s keys and values, each (rows, kv_heads, capacity, head_dim).
    pub fn layer(&self, i: usize) -> (&Tensor, &Tensor) {
        let (k, v) = &self.layers[i];
        (k, v)
    }

    /// Grows (copying the live prefix `0..keep_len` of the first `keep_rows` rows) so that it has
    /// at least `rows` rows of `capacity` positions; doubles to keep growth amortised.
    pub fn reserve(&mut self, rows: usize, capacity: usize, keep_rows: usize, keep_len: usize) {
        let (rows, capacity) = (rows as i64, capacity as i64);
        if rows <= self.rows && capacity <= self.capacity {
            return;
        }
        let new_rows = if rows > self.rows {
            rows.max(2 * self.rows)
        } else {
            self.rows
        };
        let new_cap = if capacity > self.capacity {
            capacity.max(2 * self.capacity)
        } else {
            self.capacity
        };
        let (kr, kl) = (keep_rows as i64, keep_len as i64);
        let shape = [new_rows, self.kv_heads, new_cap, self.head_dim];
        let _guard = tch::no_grad_guard();
        for (k, v) in &mut self.layers {
            let nk = Tensor::zeros(shape, (self.kind, self.device));
            let nv = Tensor::zeros(shape, (self.kind, self.device));
            if kr > 0 && kl > 0 {
                nk.narrow(0, 0, kr)
                    .narrow(2, 0, kl)
                    .copy_(&k.narrow(0, 0, kr).narrow(2, 0, kl));
                nv.narrow(0, 0, kr)
                    .narrow(2, 0, kl)
                    .copy_(&v.narrow(0, 0, kr).narrow(2, 0, kl));
            }
            *k = nk;
            *v = nv;
        }
        self.rows = new_rows;
        self.capacity = new_cap;
    }

    /// Copies positions `0..len` of row `src` of `from` into row `dst` of `self`.
    pub fn copy_row_from(&mut self, from: &KvCache, src: usize, dst: usize, len: usize) {
        let (src, dst, len) = (src as i64, dst as i64, len as i64);
        if len == 0 {
            return;
        }
        let _guard = tch::no_grad_guard();
        for ((k, v), (fk, fv)) in self.layers.iter_mut().zip(&from.layers) {
            k.narrow(0, dst, 1)
                .narrow(2, 0, len)
                .copy_(&fk.narrow(0, src, 1).narrow(2, 0, len));
            v.narrow(0, dst, 1)
                .narrow(2, 0, len)
                .copy_(&fv.narrow(0, src, 1).narrow(2, 0, len));
        }
    }

    /// Copies positions `0..len` of row `src` into row `dst` of the same cache.
    pub fn copy_row(&mut self, src: usize, dst: usize, len: usize) {
        if src == dst || len == 0 {
            return;
        }
        let (src, dst, len) = (src as i64, dst as i64, len as i64);
        let _guard = tch::no_grad_guard();
        for (k, v) in &mut self.layers {
            let sk = k.narrow(0, src, 1).narrow(2, 0, len).copy();
            k.narrow(0, dst, 1).narrow(2, 0, len).copy_(&sk);
            let sv = v.narrow(0, src, 1).narrow(2, 0, len).copy();
            v.narrow(0, dst, 1).narrow(2, 0, len).copy_(&sv);
        }
    }
}

/// Where a forward writes into the cache and what each query may attend to.
struct CacheStep<'a> {
    cache: &'a mut KvCache,
    /// (B, Hkv, L, D) scatter index along the position axis.
    write_index: Tensor,
    /// Keys attended: positions `0..kv_len` of rows `0..B`.
    kv_len: i64,
}

struct AttnInputs<'a> {
    cos: Tensor,
    sin: Tensor,
    /// (B, 1, L, T) boolean (or broadcastable to it), `true` = may attend; `None` means plain
    /// causal.
    mask: Option<Tensor>,
    cache: Option<CacheStep<'a>>,
    /// Keys/values of a shared prefix, recorded or attended to (training with shared prompts).
    prefix: PrefixKv,
}

/// A shared prefix's per-layer keys and values, for [`CausalLm::forward_hidden_prefixed`].
enum PrefixKv {
    /// No shared prefix.
    None,
    /// The prefix pass: each layer appends its rotated keys and values (G, Hkv, P, D).
    Record(Vec<(Tensor, Tensor)>),
    /// The continuation pass: layer `i` attends to `kv[i]` (B, Hkv, P, D) before its own keys.
    Attend(Vec<(Tensor, Tensor)>),
}

// ---------------------------------------------------------------------------------------------
// Attention and decoder layer

#[derive(Debug)]
struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    heads: i64,
    kv_heads: i64,
    head_dim: i64,
}

impl Attention {
    fn share(&self) -> Self {
        Attention {
            q_proj: self.q_proj.share(),
            k_proj: self.k_proj.share(),
            v_proj: self.v_proj.share(),
            o_proj: self.o_proj.share(),
            q_norm: self.q_norm.as_ref().map(RmsNorm::share),
            k_norm: self.k_norm.as_ref().map(RmsNorm::share),
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
        }
    }

    fn new(cfg: &ModelConfig, vs: nn::Path, init: WeightInit) -> Self {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let (nq, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let bias = cfg.attention_bias;
        Attention {
            q_proj: Linear::new(&vs / "q_proj", h, nq * d, bias, init),
            k_proj: Linear::new(&vs / "k_proj", h, nkv * d, bias, init),
            v_proj: Linear::new(&vs / "v_proj", h, nkv * d, bias, init),
            o_proj: Linear::new(&vs / "o_proj", nq * d, h, false, init),
            q_norm: cfg
                .qk_norm
                .then(|| RmsNorm::new(&vs / "q_norm", d, cfg.rms_norm_eps)),
            k_norm: cfg
                .qk_norm
                .then(|| RmsNorm::new(&vs / "k_norm", d, cfg.rms_norm_eps)),
            heads: nq as i64,
            kv_heads: nkv as i64,
            head_dim: d as i64,
        }
    }

    fn forward(&self, xs: &Tensor, layer: usize, inp: &mut AttnInputs) -> Tensor {
        let (b, l, _) = xs.size3().expect("hidden states are (B, L, H)");
        let d = self.head_dim;
        // (B, L, H*D) -> (B, L, H, D)
        let q = self.q_proj.forward(xs).view([b, l, self.heads, d]);
        let k = self.k_proj.forward(xs).view([b, l, self.kv_heads, d]);
        let v = self.v_proj.forward(xs).view([b, l, self.kv_heads, d]);
        let (q, k) = match (&self.q_norm, &self.k_norm) {
            (Some(qn), Some(kn)) => (qn.forward(&q), kn.forward(&k)),
            _ => (q, k),
        };
        // (B, L, H, D) -> (B, H, L, D)
        let q = apply_rope(&q.transpose(1, 2), &inp.cos, &inp.sin);
        let k = apply_rope(&k.transpose(1, 2), &inp.cos, &inp.sin);
        let v = v.transpose(1, 2);
        let (k, v) = match &mut inp.prefix {
            PrefixKv::None => (k, v),
            PrefixKv::Record(kv) => {
                kv.push((k.shallow_clone(), v.shallow_clone()));
                (k, v)
            }
            // (B, Hkv, P, D) ++ (B, Hkv, L, D) -> (B, Hkv, P + L, D); the prefix's rows are views
            // of the one prefix forward, so their gradients accumulate there.
            PrefixKv::Attend(kv) => {
                let (pk, pv) = &kv[layer];
                (Tensor::cat(&[pk, &k], 2), Tensor::cat(&[pv, &v], 2))
            }
        };
        let (k, v) = match &mut inp.cache {
            None => (k, v),
            Some(step) => {
                let (ck, cv) = &mut step.cache.layers[layer];
                let mut ck_rows = ck.narrow(0, 0, b);
                let mut cv_rows = cv.narrow(0, 0, b);
                let _ = ck_rows.scatter_(2, &step.write_index, &k);
                let _ = cv_rows.scatter_(2, &step.write_index, &v);
                // (B, Hkv, T, D): the rows' live prefix, strided within the preallocated cache.
                (
                    ck_rows.narrow(2, 0, step.kv_len),
                    cv_rows.narrow(2, 0, step.kv_len),
                )
            }
        };
        let is_causal = inp.mask.is_none();
        let y = Tensor::scaled_dot_product_attention(
            &q,
            &k,
            &v,
            inp.mask.as_ref(),
            0.0,
            is_causal,
            None,
            self.kv_heads != self.heads,
        );
        // (B, H, L, D) -> (B, L, H*D)
        let y = y.transpose(1, 2).reshape([b, l, self.heads * d]);
        self.o_proj.forward(&y)
    }
}

#[derive(Debug)]
struct DecoderLayer {
    self_attn: Attention,
    mlp: Mlp,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
}

impl DecoderLayer {
    fn share(&self) -> Self {
        DecoderLayer {
            self_attn: self.self_attn.share(),
            mlp: self.mlp.share(),
            input_layernorm: self.input_layernorm.share(),
            post_attention_layernorm: self.post_attention_layernorm.share(),
        }
    }

    fn new(cfg: &ModelConfig, vs: nn::Path, init: WeightInit) -> Self {
        let eps = cfg.rms_norm_eps;
        DecoderLayer {
            self_attn: Attention::new(cfg, &vs / "self_attn", init),
            mlp: Mlp::new(cfg, &vs / "mlp", init),
            input_layernorm: RmsNorm::new(&vs / "input_layernorm", cfg.hidden_size, eps),
            post_attention_layernorm: RmsNorm::new(
                &vs / "post_attention_layernorm",
                cfg.hidden_size,
                eps,
            ),
        }
    }

    fn forward(&self, xs: &Tensor, layer: usize, inp: &mut AttnInputs) -> Tensor {
        let h = xs
            + self
                .self_attn
                .forward(&self.input_layernorm.forward(xs), layer, inp);
        &h + self.mlp.forward(&self.post_attention_layernorm.forward(&h))
    }
}

// ---------------------------------------------------------------------------------------------
// Model and causal-LM head

/// A causal language model of any supported family: embeddings, decoder layers, final norm and
/// LM head (tied to the embeddings or not).
#[derive(Debug)]
pub struct CausalLm {
    cfg: ModelConfig,
    embed_tokens: Tensor,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    /// `None` when tied to `embed_tokens`.
    lm_head: Option<Tensor>,
    rotary: Rotary,
    kind: Kind,
    device: Device,
    /// Whether a LoRA adapter is set (cotrain's decode kernels read the base weights only).
    adapter_active: std::cell::Cell<bool>,
    /// The dtype of the products of forwards that autograd records (training), when it is not
    /// the parameters' (see [`CausalLm::set_matmul_kind`]).
    matmul_kind: std::cell::Cell<Option<Kind>>,
}

impl CausalLm {
    /// Builds a freshly initialised model (Normal(0, 0.02) weights) in `vs`, whose dtype and
    /// device it uses. Parameters are trainable and named as in Hugging Face checkpoints.
    pub fn new(cfg: &ModelConfig, vs: nn::Path) -> Result<Self> {
        Self::new_with_init(cfg, vs, WeightInit::Random)
    }

    /// As [`CausalLm::new`], choosing the initialisation.
    pub fn new_with_init(cfg: &ModelConfig, vs: nn::Path, init: WeightInit) -> Result<Self> {
        cfg.validate()?;
        let kind = vs.kind();
        if !matches!(
            kind,
            Kind::Float | Kind::BFloat16 | Kind::Half | Kind::Double
        ) {
            return Err(ModelError::InvalidConfig(format!(
                "parameter kind {kind:?} is not a float"
            )));
        }
        let device = vs.device();
        let m = &vs / "model";
        let (v, h) = (cfg.vocab_size as i64, cfg.hidden_size as i64);
        let embed_tokens = param(&(&m / "embed_tokens"), "weight", &[v, h], init);
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| DecoderLayer::new(cfg, &m / "layers" / i, init))
            .collect();
        let norm = RmsNorm::new(&m / "norm", cfg.hidden_size, cfg.rms_norm_eps);
        let lm_head =
            (!cfg.tie_word_embeddings).then(|| param(&(&vs / "lm_head"), "weight", &[v, h], init));
        Ok(CausalLm {
            cfg: cfg.clone(),
            embed_tokens,
            layers,
            norm,
            lm_head,
            rotary: Rotary::new(cfg, device),
            kind,
            device,
            adapter_active: std::cell::Cell::new(false),
            matmul_kind: std::cell::Cell::new(None),
        })
    }

    /// A second network on the same weight tensors (shallow clones: no copy, and anything written
    /// into the weights is seen by both), with its own adapter slot and without an adapter set. One
    /// thread can set its adapter and run forwards on it while another does the same on this one:
    /// a model's adapter slots and caches are its own, the weights they share only read. The matmul
    /// kind is carried over.
    pub fn share_weights(&self) -> CausalLm {
        CausalLm {
            cfg: self.cfg.clone(),
            embed_tokens: self.embed_tokens.shallow_clone(),
            layers: self.layers.iter().map(DecoderLayer::share).collect(),
            norm: self.norm.share(),
            lm_head: self.lm_head.as_ref().map(Tensor::shallow_clone),
            rotary: self.rotary.share(),
            kind: self.kind,
            device: self.device,
            adapter_active: std::cell::Cell::new(false),
            matmul_kind: std::cell::Cell::new(self.matmul_kind.get()),
        }
    }

    /// Runs the matrix products of the decoder's projections and of the LM head in `kind` (bf16:
    /// mixed precision with the parameters as f32 master weights; autograd casts the gradients
    /// back to f32), or in the parameters' own dtype with `None` or `kind` equal to it. Norms,
    /// attention, softmax and log-probs stay in the parameters' dtype. Decoding under `no_grad`
    /// is unaffected where cotrain's decode kernels serve it.
    pub fn set_matmul_kind(&self, kind: Option<Kind>) {
        let kind = kind.filter(|&k| k != self.kind);
        self.matmul_kind.set(kind);
        for l in &self.layers {
            let a = &l.self_attn;
            for lin in [&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj, &l.mlp.gate_proj, &l.mlp.up_proj, &l.mlp.down_proj] {
                lin.matmul_kind.set(kind);
            }
        }
    }

    /// The dtype of the products when it is not the parameters' ([`CausalLm::set_matmul_kind`]).
    pub fn matmul_kind(&self) -> Option<Kind> {
        self.matmul_kind.get()
    }

    /// (out, in) of a decoder projection (`q_proj`, ..., `down_proj`); panics on another name.
    pub fn projection_shape(&self, projection: &str) -> (i64, i64) {
        let w = &self.projection(0, projection).expect("a known projection").weight;
        (w.size()[0], w.size()[1])
    }

    fn projection(&self, layer: usize, name: &str) -> Option<&Linear> {
        let l = self.layers.get(layer)?;
        Some(match name {
            "q_proj" => &l.self_attn.q_proj,
            "k_proj" => &l.self_attn.k_proj,
            "v_proj" => &l.self_attn.v_proj,
            "o_proj" => &l.self_attn.o_proj,
            "gate_proj" => &l.mlp.gate_proj,
            "up_proj" => &l.mlp.up_proj,
            "down_proj" => &l.mlp.down_proj,
            _ => return None,
        })
    }

    /// Makes the following forwards add `adapter`'s updates to its projections, or, with `None`,
    /// run the base alone (the reference policy). `training` turns the adapter's dropout on (for
    /// forwards that are trained on). The base's weights are never written.
    pub fn set_adapter(&self, adapter: Option<&LoraAdapter>, training: bool) -> Result<()> {
        if let Some(a) = adapter {
            if a.num_layers() != self.layers.len() {
                return Err(ModelError::InvalidConfig(format!(
                    "an adapter for {} layers cannot be set on a model of {}",
                    a.num_layers(),
                    self.layers.len()
                )));
            }
            for (layer, proj, la, lb) in a.pairs() {
                let (out_dim, in_dim) = self.projection_shape(proj);
                if la.size()[1] != in_dim || lb.size()[0] != out_dim {
                    return Err(ModelError::InvalidConfig(format!(
                        "adapter of layer {layer} {proj}: A {:?} / B {:?} do not fit the model's ({out_dim}, {in_dim}) projection",
                        la.size(),
                        lb.size()
                    )));
                }
            }
        }
        for layer in &self.layers {
            let a = &layer.self_attn;
            for lin in [&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj, &layer.mlp.gate_proj, &layer.mlp.up_proj, &layer.mlp.down_proj] {
                *lin.lora.borrow_mut() = None;
            }
        }
        self.adapter_active.set(adapter.is_some());
        if let Some(ad) = adapter {
            let dropout = if training { ad.config.dropout } else { 0.0 };
            for (layer, proj, a, b) in ad.pairs() {
                let lin = self.projection(layer, proj).expect("validated against the config");
                *lin.lora.borrow_mut() =
                    Some(LoraSlot { a: a.shallow_clone(), b: b.shallow_clone(), scaling: ad.config.scaling(), dropout });
            }
        }
        Ok(())
    }

    /// Whether an adapter is set.
    pub fn has_adapter(&self) -> bool {
        self.adapter_active.get()
    }

    /// The model's config.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The parameters' dtype.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// The device the parameters live on.
    pub fn device(&self) -> Device {
        self.device
    }

    fn embed(&self, input_ids: &Tensor) -> Result<Tensor> {
        let ids = input_ids.to_device(self.device);
        Ok(Tensor::f_embedding(
            &self.embed_tokens,
            &ids,
            -1,
            false,
            false,
        )?)
    }

    /// Final hidden states (after the last norm) for token ids (B, L), without a cache: every row
    /// starts at position 0 and attention is causal. Right-padded batches are fine: padding at
    /// the end cannot influence earlier positions. Returns (B, L, hidden).
    pub fn forward_hidden(&self, input_ids: &Tensor) -> Result<Tensor> {
        let (_, l) = input_ids.size2().map_err(|e| {
            ModelError::InvalidBatch(format!("input ids must be (batch, length): {e}"))
        })?;
        let (cos, sin) = self.rotary.prefix(l, self.kind);
        let mut inp = AttnInputs {
            cos,
            sin,
            mask: None,
            cache: None,
            prefix: PrefixKv::None,
        };
        let mut xs = self.embed(input_ids)?;
        for (i, layer) in self.layers.iter().enumerate() {
            xs = layer.forward(&xs, i, &mut inp);
        }
        Ok(self.norm.forward(&xs))
    }

    /// Final hidden states of continuations after shared prefixes, each prefix computed once:
    /// the same values as [`CausalLm::forward_hidden`] on every (prefix, continuation) row, for
    /// GRPO's G samples of one prompt at the cost of one prompt. `prefix_ids` (G, P) holds G
    /// right-padded prefixes of lengths `prefix_lens`; `cont_ids` (B, L) holds B right-padded
    /// continuations, row `b` continuing prefix `prefix_of[b]`. Each continuation token attends
    /// to its prefix's real positions and causally to its own row, at RoPE positions from the
    /// prefix's length on. Returns (G, P, hidden) and (B, L, hidden). Under autograd the prefix
    /// keys/values are shared by the rows (selected, not recomputed), so gradients from all
    /// continuations sum into the one prefix forward.
    pub fn forward_hidden_prefixed(
        &self,
        prefix_ids: &Tensor,
        prefix_lens: &[i64],
        cont_ids: &Tensor,
        prefix_of: &[i64],
    ) -> Result<(Tensor, Tensor)> {
        let (g, p) = prefix_ids.size2().map_err(|e| {
            ModelError::InvalidBatch(format!("prefix ids must be (prefixes, length): {e}"))
        })?;
        let (b, l) = cont_ids.size2().map_err(|e| {
            ModelError::InvalidBatch(format!("continuation ids must be (batch, length): {e}"))
        })?;
        if prefix_lens.len() as i64 != g || prefix_lens.iter().any(|&n| n < 1 || n > p) {
            return Err(ModelError::InvalidBatch(format!(
                "prefix lengths {prefix_lens:?} do not fit {g} prefixes of {p} positions"
            )));
        }
        if prefix_of.len() as i64 != b || prefix_of.iter().any(|&i| i < 0 || i >= g) {
            return Err(ModelError::InvalidBatch(format!(
                "{} prefix indices for {b} continuations of {g} prefixes",
                prefix_of.len()
            )));
        }
        // The prefixes: a plain causal forward that records each layer's keys and values.
        let (cos, sin) = self.rotary.prefix(p, self.kind);
        let mut pre = AttnInputs {
            cos,
            sin,
            mask: None,
            cache: None,
            prefix: PrefixKv::Record(Vec::with_capacity(self.layers.len())),
        };
        let mut xp = self.embed(prefix_ids)?;
        for (i, layer) in self.layers.iter().enumerate() {
            xp = layer.forward(&xp, i, &mut pre);
        }
        let PrefixKv::Record(kv) = pre.prefix else {
            unreachable!("the prefix pass records")
        };
        // Each continuation row's view of its prefix's keys/values: (G, ..) -> (B, Hkv, P, D).
        let rows = Tensor::from_slice(prefix_of).to_device(self.device);
        let select = |t: &Tensor| {
            if g == 1 {
                let mut shape = t.size();
                shape[0] = b;
                t.expand(shape.as_slice(), false)
            } else {
                t.index_select(0, &rows)
            }
        };
        let kv = kv.iter().map(|(k, v)| (select(k), select(v))).collect();

        // (B, 1) prefix length of each row; (B, L) absolute positions of the continuation.
        let lens: Vec<i64> = prefix_of.iter().map(|&i| prefix_lens[i as usize]).collect();
        let lens = Tensor::from_slice(&lens)
            .to_device(self.device)
            .unsqueeze(1);
        let positions = &lens + Tensor::arange(l, (Kind::Int64, self.device)).unsqueeze(0);
        let max_pos = prefix_lens.iter().copied().max().unwrap_or(0) + l - 1;
        let (cos, sin) = self.rotary.gather(&positions, max_pos, self.kind);
        // (B, 1, L, P + L): a prefix key counts up to the row's prefix length (its padding
        // never), a continuation key causally.
        let prefix_keys = Tensor::arange(p, (Kind::Int64, self.device))
            .view([1, 1, 1, p])
            .lt_tensor(&lens.view([b, 1, 1, 1]))
            .expand([b, 1, l, p], false);
        let own_keys = Tensor::ones([l, l], (Kind::Bool, self.device))
            .tril(0)
            .view([1, 1, l, l])
            .expand([b, 1, l, l], false);
        let mask = Tensor::cat(&[prefix_keys, own_keys], 3);
        let mut cont = AttnInputs {
            cos,
            sin,
            mask: Some(mask),
            cache: None,
            prefix: PrefixKv::Attend(kv),
        };
        let mut xc = self.embed(cont_ids)?;
        for (i, layer) in self.layers.iter().enumerate() {
            xc = layer.forward(&xc, i, &mut cont);
        }
        Ok((self.norm.forward(&xp), self.norm.forward(&xc)))
    }

    /// Logits (B, L, vocab) for token ids (B, L), without a cache.
    pub fn forward(&self, input_ids: &Tensor) -> Result<Tensor> {
        Ok(self.lm_head(&self.forward_hidden(input_ids)?))
    }

    /// Applies the LM head to hidden states (..., hidden) -> (..., vocab).
    pub fn lm_head(&self, hidden: &Tensor) -> Tensor {
        match self.matmul_kind.get() {
            Some(kind) => linear_in(kind, hidden, self.lm_head_weight(), None),
            None => linear(hidden, self.lm_head_weight(), None),
        }
    }

    /// The LM head's weight (the embedding matrix when tied): (vocab, hidden).
    pub fn lm_head_weight(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }

    /// Whether a one-token step of [`CausalLm::forward_hidden_cached`] on this model and cache runs
    /// through cotrain's own CPU kernels ([`crate::kernels`]) instead of libtorch ops: f32 or bf16
    /// on CPU with AVX-512F, contiguous weights, and nothing for autograd to record (under
    /// `no_grad`, or with frozen parameters). Both compute the same values (for bf16, the kernels
    /// keep the activations in f32 where libtorch rounds them to bf16), and the kernels' hidden
    /// states are f32.
    pub fn decodes_in_kernels(&self, cache: &KvCache) -> bool {
        #[cfg(target_arch = "x86_64")]
        return self.fast_decode_applies(cache);
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    /// Runs token ids (B, L) through the model with a KV cache: row `b` of the input continues
    /// cache row `b`, whose first `starts[b]` positions are already filled. The new keys/values
    /// are written at positions `starts[b]..starts[b]+L`, and each query attends to its row's
    /// positions up to and including its own. Returns hidden states (B, L, hidden).
    pub fn forward_hidden_cached(
        &self,
        input_ids: &Tensor,
        starts: &[i64],
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let (b, l) = input_ids.size2().map_err(|e| {
            ModelError::InvalidBatch(format!("input ids must be (batch, length): {e}"))
        })?;
        if starts.len() as i64 != b || b > cache.rows {
            return Err(ModelError::InvalidBatch(format!(
                "{} start positions and {} cache rows for a batch of {b}",
                starts.len(),
                cache.rows
            )));
        }
        let max_start = starts.iter().copied().max().unwrap_or(0);
        let kv_len = max_start + l;
        if kv_len > cache.capacity {
            return Err(ModelError::InvalidBatch(format!(
                "cache holds {} positions, {kv_len} needed",
                cache.capacity
            )));
        }
        #[cfg(target_arch = "x86_64")]
        if l == 1
            && let Some(hidden) = self.decode_step_cpu(input_ids, starts, cache)
        {
            return hidden;
        }
        // (B, L) absolute positions of the new tokens.
        let offsets = Tensor::arange(l, (Kind::Int64, self.device)).unsqueeze(0);
        let starts_t = Tensor::from_slice(starts)
            .to_device(self.device)
            .unsqueeze(1);
        let positions = &starts_t + &offsets;
        let (cos, sin) = self.rotary.gather(&positions, kv_len - 1, self.kind);
        let all_zero = starts.iter().all(|&s| s == 0);
        let mask = if all_zero {
            None
        } else {
            // (1, 1, 1, T) <= (B, 1, L, 1) -> (B, 1, L, T)
            let keys = Tensor::arange(kv_len, (Kind::Int64, self.device)).view([1, 1, 1, kv_len]);
            Some(keys.le_tensor(&positions.view([b, 1, l, 1])))
        };
        let (kvh, d) = (cache.kv_heads, cache.head_dim);
        let write_index = positions.view([b, 1, l, 1]).expand([b, kvh, l, d], false);
        let mut inp = AttnInputs {
            cos,
            sin,
            mask,
            cache: Some(CacheStep {
                cache,
                write_index,
                kv_len,
            }),
            prefix: PrefixKv::None,
        };
        let mut xs = self.embed(input_ids)?;
        for (i, layer) in self.layers.iter().enumerate() {
            xs = layer.forward(&xs, i, &mut inp);
        }
        Ok(self.norm.forward(&xs))
    }
}
