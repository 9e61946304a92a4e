//! The layers of the shared decoder ([`super`]): rotary embedding, RMSNorm, the linear
//! projections (with an optional LoRA pair and product dtype) and the routes their products take,
//! the SwiGLU MLP, grouped-query attention (with Qwen2's q/k/v biases and Qwen3's per-head q/k norm
//! as switches) and the decoder layer. [`super::CausalLm`] stacks them; its fused CPU decode step
//! (`decode_cpu.rs`) reads their weights directly, hence the `pub(super)` fields.
//!
//! Parameters are created under the Hugging Face tensor names (`self_attn.q_proj.weight`), so
//! checkpoints load without a renaming table. Attention takes the KV cache as the per-layer
//! key/value tensors it writes ([`CacheStep`]), not the cache itself, so these layers depend on
//! nothing of the model that holds them.

use std::cell::RefCell;

use tch::{Device, Kind, Tensor, nn, nn::Init};

use crate::config::{ModelConfig, RopeScaling};
use crate::kernels::libtorch_route::libtorch_linear;
use crate::lora::LoraSlot;

/// How fresh parameters are initialised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightInit {
    /// Normal(0, 0.02) matrices and unit norms, as transformers initialises a new model.
    Random,
    /// Zeros (and unit norms): for parameters about to be overwritten by a checkpoint.
    Zeros,
}

pub(super) fn param(vs: &nn::Path, name: &str, dims: &[i64], init: WeightInit) -> Tensor {
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
    /// LongRoPE: the frequencies of forwards that reach beyond the original context, and that
    /// context's length.
    long: Option<(Vec<f32>, i64)>,
    /// cos/sin multiplier (LongRoPE's attention factor; 1 otherwise).
    scale: f64,
    device: Device,
    /// (T, D) cos and sin in f32, and T.
    table: RefCell<(Tensor, Tensor, i64)>,
    /// The same for `long`'s frequencies.
    long_table: RefCell<(Tensor, Tensor, i64)>,
}

impl Rotary {
    pub(super) fn new(cfg: &ModelConfig, device: Device) -> Self {
        let dim = cfg.head_dim;
        // As transformers: inv_freq = 1 / base^(2i/dim), in f32.
        let base = |i: usize| (cfg.rope_theta as f32).powf((2 * i) as f32 / dim as f32);
        let mut inv_freq: Vec<f32> = (0..dim / 2).map(|i| 1.0 / base(i)).collect();
        let (mut long, mut scale) = (None, 1.0);
        match &cfg.rope_scaling {
            RopeScaling::None => {}
            // As transformers: inv_freq = 1 / (factor_i · base^(2i/dim)), in f32.
            RopeScaling::LongRope {
                short_factor,
                long_factor,
                original_max_position_embeddings,
                attention_factor,
            } => {
                let divided = |f: &[f64]| {
                    (0..dim / 2)
                        .map(|i| 1.0 / (f[i] as f32 * base(i)))
                        .collect::<Vec<f32>>()
                };
                inv_freq = divided(short_factor);
                long = Some((
                    divided(long_factor),
                    *original_max_position_embeddings as i64,
                ));
                scale = *attention_factor;
            }
            RopeScaling::Linear { factor } => {
                for f in &mut inv_freq {
                    *f /= *factor as f32;
                }
            }
            &RopeScaling::Llama3 {
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
        let empty = || {
            RefCell::new((
                Tensor::zeros([0, dim as i64], (Kind::Float, device)),
                Tensor::zeros([0, dim as i64], (Kind::Float, device)),
                0,
            ))
        };
        Rotary {
            inv_freq,
            long,
            scale,
            device,
            table: empty(),
            long_table: empty(),
        }
    }

    /// Another handle on the same table (a copy that grows on its own from here).
    pub(super) fn share(&self) -> Self {
        let copy = |t: &RefCell<(Tensor, Tensor, i64)>| {
            let t = t.borrow();
            RefCell::new((t.0.shallow_clone(), t.1.shallow_clone(), t.2))
        };
        Rotary {
            inv_freq: self.inv_freq.clone(),
            long: self.long.clone(),
            scale: self.scale,
            device: self.device,
            table: copy(&self.table),
            long_table: copy(&self.long_table),
        }
    }

    /// The (T ≥ `len`, D) f32 cos/sin table for a forward whose positions are `0..len` at most:
    /// LongRoPE's long table when `len` passes the original context (as transformers decides per
    /// forward, from its largest position), else the one table.
    pub(super) fn table_for(&self, len: i64) -> std::cell::Ref<'_, (Tensor, Tensor, i64)> {
        let (cell, inv_freq) = match &self.long {
            Some((long, original)) if len > *original => (&self.long_table, long),
            _ => (&self.table, &self.inv_freq),
        };
        {
            let mut table = cell.borrow_mut();
            if table.2 < len {
                let new_len = len.max(2 * table.2).max(256);
                let inv = Tensor::from_slice(inv_freq).to_device(self.device);
                let pos = Tensor::arange(new_len, (Kind::Float, self.device));
                // (T, 1) * (1, D/2) -> (T, D/2) -> (T, D)
                let freqs = pos.unsqueeze(1) * inv.unsqueeze(0);
                let emb = Tensor::cat(&[&freqs, &freqs], -1);
                *table = if self.scale == 1.0 {
                    (emb.cos(), emb.sin(), new_len)
                } else {
                    (emb.cos() * self.scale, emb.sin() * self.scale, new_len)
                };
            }
        }
        cell.borrow()
    }

    /// Whether forwards over `a` and `b` positions use the same table.
    pub(super) fn same_table(&self, a: i64, b: i64) -> bool {
        self.long
            .as_ref()
            .is_none_or(|(_, original)| (a > *original) == (b > *original))
    }

    /// cos/sin for positions `0..len` of a forward whose positions reach `longest - 1`: (1, 1, L,
    /// D) each.
    pub(super) fn prefix(&self, len: i64, longest: i64, kind: Kind) -> (Tensor, Tensor) {
        let t = self.table_for(longest.max(len));
        let f = |x: &Tensor| x.narrow(0, 0, len).to_kind(kind).unsqueeze(0).unsqueeze(0);
        (f(&t.0), f(&t.1))
    }

    /// cos/sin for per-row positions (B, L): (B, 1, L, D) each.
    pub(super) fn gather(&self, positions: &Tensor, max_pos: i64, kind: Kind) -> (Tensor, Tensor) {
        let t = self.table_for(max_pos + 1);
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
    pub(super) weight: Tensor,
    pub(super) eps: f64,
}

impl RmsNorm {
    pub(super) fn new(vs: nn::Path, dim: usize, eps: f64) -> Self {
        RmsNorm {
            weight: vs.var("weight", &[dim as i64], Init::Const(1.0)),
            eps,
        }
    }

    pub(super) fn share(&self) -> Self {
        RmsNorm {
            weight: self.weight.shallow_clone(),
            eps: self.eps,
        }
    }

    pub(super) fn forward(&self, xs: &Tensor) -> Tensor {
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
    pub(super) weight: Tensor,
    pub(super) bias: Option<Tensor>,
    /// The LoRA pair the next forwards add (see [`super::CausalLm::set_adapter`]).
    pub(super) lora: RefCell<Option<LoraSlot>>,
    /// Per-row adapters the next forwards add, each to its own rows of the batch (see
    /// [`super::CausalLm::set_row_adapters`]).
    pub(super) row_loras: RefCell<Vec<RowLora>>,
    /// The dtype products run in when it is not the weight's (see [`super::CausalLm::set_matmul_kind`]).
    pub(super) matmul_kind: std::cell::Cell<Option<Kind>>,
}

/// One adapter of a mixed batch: its pair and the batch rows it applies to.
#[derive(Debug)]
pub(crate) struct RowLora {
    pub a: Tensor,
    pub b: Tensor,
    pub scaling: f64,
    /// Row indices (i64, on the model's device).
    pub rows: Tensor,
    /// The same row indices, for the fused CPU decode step.
    pub row_list: Vec<usize>,
}

impl Linear {
    pub(super) fn new(
        vs: nn::Path,
        in_dim: usize,
        out_dim: usize,
        bias: bool,
        init: WeightInit,
    ) -> Self {
        let weight = param(&vs, "weight", &[out_dim as i64, in_dim as i64], init);
        let bias = bias.then(|| vs.var("bias", &[out_dim as i64], Init::Const(0.0)));
        Linear {
            weight,
            bias,
            lora: RefCell::new(None),
            row_loras: RefCell::new(Vec::new()),
            matmul_kind: std::cell::Cell::new(None),
        }
    }

    /// The same weights, without an adapter set.
    pub(super) fn share(&self) -> Self {
        Linear {
            weight: self.weight.shallow_clone(),
            bias: self.bias.as_ref().map(Tensor::shallow_clone),
            lora: RefCell::new(None),
            row_loras: RefCell::new(Vec::new()),
            matmul_kind: std::cell::Cell::new(self.matmul_kind.get()),
        }
    }

    pub(super) fn forward(&self, xs: &Tensor) -> Tensor {
        let y = match self.matmul_kind.get() {
            Some(kind) => linear_in(kind, xs, &self.weight, self.bias.as_ref()),
            None => linear(xs, &self.weight, self.bias.as_ref()),
        };
        let y = match &*self.lora.borrow() {
            None => y,
            // y + scaling · dropout(x)·Aᵀ·Bᵀ (LoRA, Hu et al. 2021), never materialising B·A. The
            // scaling goes on B (out × r) rather than on the (tokens × out) product, and the sum
            // into y is the second product's own accumulate (addmm): two passes over the
            // activations fewer per projection, forward and backward.
            Some(s) => {
                let x = if s.dropout > 0.0 {
                    xs.dropout(s.dropout, true)
                } else {
                    xs.shallow_clone()
                };
                let xa = x.linear::<&Tensor>(&s.a, None);
                let shape = y.size();
                let (out, r) = (shape[shape.len() - 1], s.a.size()[0]);
                y.reshape([-1, out])
                    .addmm(&xa.reshape([-1, r]), &(&s.b * s.scaling).tr())
                    .view(shape.as_slice())
            }
        };
        let groups = self.row_loras.borrow();
        if groups.is_empty() {
            return y;
        }
        // Several adapters in one batch: each group's rows (batch dimension 0) gather, take their
        // adapter's low-rank product and add it back in place; rows of no group get the base alone.
        let mut y = y;
        for g in groups.iter() {
            let x = xs.index_select(0, &g.rows);
            let delta = x
                .linear::<&Tensor>(&g.a, None)
                .linear::<&Tensor>(&g.b, None)
                * g.scaling;
            y = y.index_add(0, &g.rows, &delta.to_kind(y.kind()));
        }
        y
    }
}

/// `xs · wᵀ + b` with the operands rounded to `kind` (bf16 products of f32 master weights) and the
/// result back in `xs`'s dtype. Autograd runs through the casts, so the gradients reach the f32
/// weights in f32 (each cast's backward is the cast back).
pub(crate) fn linear_in(kind: Kind, xs: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Tensor {
    let b = b.map(|b| b.to_kind(kind));
    xs.to_kind(kind)
        .linear(&w.to_kind(kind), b.as_ref())
        .to_kind(xs.kind())
}

/// `xs · wᵀ + b` for `xs` (..., K) and `w` (N, K), by the fastest route measured for the shape:
/// - 1–64 rows with nothing for autograd to record (decoding), on an AVX-512 CPU in f32 or bf16: cotrain's
///   own kernel ([`crate::kernels`]), which streams the weights once; 1.2× to 2.2× faster than the
///   MKL routes below over SmolLM2's 211 weight matrices.
/// - Otherwise up to 16 rows in f32 on CPU: `(w · xsᵀ)ᵀ`, the same product, because libtorch's MKL
///   serves a short *second* operand far faster than the short first operand `Tensor::linear` hands
///   it (3.3× at 2 rows, 1.4× at 8, 1.16× at 16; even at 32–64, slower beyond). One row is padded to
///   two, which MKL also serves faster than its matrix-vector path. Autograd goes through it.
/// - Everything else (training batches, other devices and dtypes): `Tensor::linear`.
///
/// The last two are [`libtorch_linear`].
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

#[derive(Debug)]
pub(super) struct Mlp {
    pub(super) gate_proj: Linear,
    pub(super) up_proj: Linear,
    pub(super) down_proj: Linear,
}

impl Mlp {
    pub(super) fn new(cfg: &ModelConfig, vs: nn::Path, init: WeightInit) -> Self {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        Mlp {
            gate_proj: Linear::new(&vs / "gate_proj", h, i, false, init),
            up_proj: Linear::new(&vs / "up_proj", h, i, false, init),
            down_proj: Linear::new(&vs / "down_proj", i, h, false, init),
        }
    }

    pub(super) fn share(&self) -> Self {
        Mlp {
            gate_proj: self.gate_proj.share(),
            up_proj: self.up_proj.share(),
            down_proj: self.down_proj.share(),
        }
    }

    pub(super) fn forward(&self, xs: &Tensor) -> Tensor {
        self.down_proj
            .forward(&(self.gate_proj.forward(xs).silu() * self.up_proj.forward(xs)))
    }
}

// ---------------------------------------------------------------------------------------------
// The per-forward context

/// Where a forward writes into the cache and what each query may attend to.
pub(super) struct CacheStep<'a> {
    /// The cache's per-layer keys and values, each (rows, Hkv, capacity, D) ([`super::KvCache`]).
    pub(super) layers: &'a mut [(Tensor, Tensor)],
    /// (B, Hkv, L, D) scatter index along the position axis.
    pub(super) write_index: Tensor,
    /// Keys attended: positions `0..kv_len` of rows `0..B`.
    pub(super) kv_len: i64,
}

pub(super) struct AttnInputs<'a> {
    pub(super) cos: Tensor,
    pub(super) sin: Tensor,
    /// (B, 1, L, T) boolean (or broadcastable to it), `true` = may attend; `None` means plain
    /// causal.
    pub(super) mask: Option<Tensor>,
    pub(super) cache: Option<CacheStep<'a>>,
    /// Keys/values of a shared prefix, recorded or attended to (training with shared prompts).
    pub(super) prefix: PrefixKv,
}

/// A shared prefix's per-layer keys and values, for [`super::CausalLm::forward_hidden_prefixed`].
pub(super) enum PrefixKv {
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
pub(super) struct Attention {
    pub(super) q_proj: Linear,
    pub(super) k_proj: Linear,
    pub(super) v_proj: Linear,
    pub(super) o_proj: Linear,
    pub(super) q_norm: Option<RmsNorm>,
    pub(super) k_norm: Option<RmsNorm>,
    heads: i64,
    kv_heads: i64,
    head_dim: i64,
}

impl Attention {
    pub(super) fn share(&self) -> Self {
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

    pub(super) fn new(cfg: &ModelConfig, vs: nn::Path, init: WeightInit) -> Self {
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

    pub(super) fn forward(&self, xs: &Tensor, layer: usize, inp: &mut AttnInputs) -> Tensor {
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
                let (ck, cv) = &mut step.layers[layer];
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
pub(super) struct DecoderLayer {
    pub(super) self_attn: Attention,
    pub(super) mlp: Mlp,
    pub(super) input_layernorm: RmsNorm,
    pub(super) post_attention_layernorm: RmsNorm,
}

impl DecoderLayer {
    pub(super) fn share(&self) -> Self {
        DecoderLayer {
            self_attn: self.self_attn.share(),
            mlp: self.mlp.share(),
            input_layernorm: self.input_layernorm.share(),
            post_attention_layernorm: self.post_attention_layernorm.share(),
        }
    }

    pub(super) fn new(cfg: &ModelConfig, vs: nn::Path, init: WeightInit) -> Self {
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

    pub(super) fn forward(&self, xs: &Tensor, layer: usize, inp: &mut AttnInputs) -> Tensor {
        let h = xs
            + self
                .self_attn
                .forward(&self.input_layernorm.forward(xs), layer, inp);
        &h + self.mlp.forward(&self.post_attention_layernorm.forward(&h))
    }
}
