//! The decoder-only transformer the Llama, Qwen2 and Qwen3 families share: the model and
//! causal-LM head ([`CausalLm`]) over the decoder layers of `layers.rs` (rotary embedding,
//! RMSNorm, SwiGLU MLP, grouped-query attention with Qwen2's q/k/v biases and Qwen3's per-head
//! q/k norm as switches), and the KV cache ([`KvCache`]) decoding writes.
//!
//! Parameters live in the caller's `VarStore` under the Hugging Face tensor names
//! (`model.layers.{i}.self_attn.q_proj.weight`), so checkpoints load without a renaming table and
//! the learner can save them by name. The KV cache is an explicit argument: training runs the
//! same code with `None`.

use tch::{Device, Kind, Tensor, nn};

#[cfg(target_arch = "x86_64")]
mod decode_cpu;
mod layers;

pub use layers::WeightInit;
pub(crate) use layers::linear_in;
use layers::{
    AttnInputs, CacheStep, DecoderLayer, Linear, PrefixKv, RmsNorm, Rotary, RowLora, linear, param,
};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
/// The plain libtorch route, re-exported from its old home here; it lives in
/// [`crate::kernels::libtorch_route`] so that the kernels' dispatch can time it without depending
/// on this module.
pub use crate::kernels::libtorch_route::libtorch_linear;
use crate::lora::{LoraAdapter, LoraSlot};

// ---------------------------------------------------------------------------------------------
// KV cache

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
    /// Whether per-row adapters are set ([`CausalLm::set_row_adapters`]).
    row_adapters_active: std::cell::Cell<bool>,
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
            row_adapters_active: std::cell::Cell::new(false),
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
            row_adapters_active: std::cell::Cell::new(false),
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
            for lin in [
                &a.q_proj,
                &a.k_proj,
                &a.v_proj,
                &a.o_proj,
                &l.mlp.gate_proj,
                &l.mlp.up_proj,
                &l.mlp.down_proj,
            ] {
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
        let w = &self
            .projection(0, projection)
            .expect("a known projection")
            .weight;
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
            self.check_adapter(a)?;
        }
        for layer in &self.layers {
            let a = &layer.self_attn;
            for lin in [
                &a.q_proj,
                &a.k_proj,
                &a.v_proj,
                &a.o_proj,
                &layer.mlp.gate_proj,
                &layer.mlp.up_proj,
                &layer.mlp.down_proj,
            ] {
                *lin.lora.borrow_mut() = None;
            }
        }
        self.adapter_active.set(adapter.is_some());
        if let Some(ad) = adapter {
            let dropout = if training { ad.config.dropout } else { 0.0 };
            for (layer, proj, a, b) in ad.pairs() {
                let lin = self
                    .projection(layer, proj)
                    .expect("validated against the config");
                *lin.lora.borrow_mut() = Some(LoraSlot {
                    a: a.shallow_clone(),
                    b: b.shallow_clone(),
                    scaling: ad.config.scaling(),
                    dropout,
                });
            }
        }
        Ok(())
    }

    /// Checks that `adapter` fits this model: its layer count, every pair's shape, and the
    /// model's dtype and device.
    pub fn check_adapter(&self, a: &LoraAdapter) -> Result<()> {
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
            if la.kind() != self.kind || la.device() != self.device {
                return Err(ModelError::InvalidConfig(format!(
                    "adapter of layer {layer} {proj}: {:?} on {:?}, the model is {:?} on {:?}",
                    la.kind(),
                    la.device(),
                    self.kind,
                    self.device
                )));
            }
        }
        Ok(())
    }

    /// Makes the following forwards serve several adapters in one batch, unmerged: `groups[i] =
    /// (adapter, rows)` adds that adapter's update (no dropout) to the given rows of the batch
    /// (dimension 0 of the input ids); rows in no group run the base alone. Replaces any earlier
    /// groups; [`CausalLm::clear_row_adapters`] removes them. Each adapter must have passed
    /// [`CausalLm::check_adapter`] (the engine checks when an adapter is registered).
    pub fn set_row_adapters(&self, groups: &[(&LoraAdapter, &[i64])]) {
        self.clear_row_adapters();
        for (adapter, rows) in groups {
            if rows.is_empty() {
                continue;
            }
            let idx = Tensor::from_slice(rows).to_device(self.device);
            for (layer, proj, a, b) in adapter.pairs() {
                let lin = self
                    .projection(layer, proj)
                    .expect("checked against the config");
                lin.row_loras.borrow_mut().push(RowLora {
                    a: a.shallow_clone(),
                    b: b.shallow_clone(),
                    scaling: adapter.config.scaling(),
                    rows: idx.shallow_clone(),
                    row_list: rows.iter().map(|&r| r as usize).collect(),
                });
            }
            self.row_adapters_active.set(true);
        }
    }

    /// Removes the per-row adapters of [`CausalLm::set_row_adapters`].
    pub fn clear_row_adapters(&self) {
        if !self.row_adapters_active.replace(false) {
            return;
        }
        for layer in &self.layers {
            let a = &layer.self_attn;
            for lin in [
                &a.q_proj,
                &a.k_proj,
                &a.v_proj,
                &a.o_proj,
                &layer.mlp.gate_proj,
                &layer.mlp.up_proj,
                &layer.mlp.down_proj,
            ] {
                lin.row_loras.borrow_mut().clear();
            }
        }
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
        let (cos, sin) = self.rotary.prefix(l, l, self.kind);
        let mut inp = AttnInputs {
            cos,
            sin,
            mask: self.window_mask(l),
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
        // The prefixes: a plain causal forward that records each layer's keys and values. Their
        // RoPE table is the one a forward of the whole rows would use (LongRoPE picks it by the
        // longest position).
        let max_pos = prefix_lens.iter().copied().max().unwrap_or(0) + l - 1;
        let (cos, sin) = self.rotary.prefix(p, max_pos + 1, self.kind);
        let mut pre = AttnInputs {
            cos,
            sin,
            mask: self.window_mask(p),
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
        let mut mask = Tensor::cat(&[prefix_keys, own_keys], 3);
        if let Some(w) = self.cfg.sliding_window.filter(|&w| max_pos >= w as i64) {
            // Positions of the keys (B, 1, 1, P + L) and of the queries (B, 1, L, 1).
            let key_pos = Tensor::cat(
                &[
                    Tensor::arange(p, (Kind::Int64, self.device))
                        .view([1, p])
                        .expand([b, p], false),
                    positions.shallow_clone(),
                ],
                1,
            )
            .view([b, 1, 1, p + l]);
            let near = (positions.view([b, 1, l, 1]) - key_pos).lt(w as i64);
            mask = mask.logical_and(&near);
        }
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

    /// Whether forwards over `a` and over `b` positions rotate with the same RoPE table (always,
    /// except LongRoPE on either side of its original context).
    pub fn rope_table_agrees(&self, a: i64, b: i64) -> bool {
        self.rotary.same_table(a, b)
    }

    /// The (1, 1, L, L) mask of `L` positions from 0 under the sliding window, or `None` (plain
    /// causal) when the window does not bind.
    fn window_mask(&self, l: i64) -> Option<Tensor> {
        let w = self.cfg.sliding_window.filter(|&w| l > w as i64)? as i64;
        // Key j is seen by query i when i - w < j <= i.
        let band = Tensor::ones([l, l], (Kind::Bool, self.device))
            .tril(0)
            .triu(1 - w);
        Some(band.view([1, 1, l, l]))
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

    /// Whether a decode step of `rows` rows (the forward and [`CausalLm::lm_head`]) gives the same
    /// bits at any thread count: it runs entirely in cotrain's kernels, which split outputs, never
    /// a sum, between threads. libtorch's MKL products may block their sums by thread count, so
    /// steps through them (the dispatch kept libtorch, a product dtype of its own, more than 64 rows
    /// for the head) do not qualify. [`crate::engine`] varies the count only where this holds.
    pub fn decode_is_thread_invariant(&self, rows: usize, cache: &KvCache) -> bool {
        self.decodes_in_kernels(cache)
            && crate::kernels::dispatch::own_kernels(self.kind)
            && self.matmul_kind.get().is_none()
            && (1..=64).contains(&rows)
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
        let window = self.cfg.sliding_window.filter(|&w| kv_len > w as i64);
        let mask = if all_zero && window.is_none() {
            None
        } else {
            // (1, 1, 1, T) <= (B, 1, L, 1) -> (B, 1, L, T)
            let keys = Tensor::arange(kv_len, (Kind::Int64, self.device)).view([1, 1, 1, kv_len]);
            let queries = positions.view([b, 1, l, 1]);
            let causal = keys.le_tensor(&queries);
            Some(match window {
                Some(w) => causal.logical_and(&(queries - &keys).lt(w as i64)),
                None => causal,
            })
        };
        let (kvh, d) = (cache.kv_heads, cache.head_dim);
        let write_index = positions.view([b, 1, l, 1]).expand([b, kvh, l, d], false);
        let mut inp = AttnInputs {
            cos,
            sin,
            mask,
            cache: Some(CacheStep {
                layers: &mut cache.layers,
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

impl crate::lora::AdapterBase for CausalLm {
    fn config(&self) -> &ModelConfig {
        CausalLm::config(self)
    }

    fn device(&self) -> Device {
        CausalLm::device(self)
    }

    fn kind(&self) -> Kind {
        CausalLm::kind(self)
    }

    fn projection_shape(&self, projection: &str) -> (i64, i64) {
        CausalLm::projection_shape(self, projection)
    }
}
