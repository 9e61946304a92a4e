//! LoRA adapters (Hu et al. 2021, arXiv 2106.09685) on a frozen base model, in the layout PEFT uses
//! so that saved adapters load in transformers/PEFT and vLLM.
//!
//! An adapter holds, for every targeted projection `W` (out × in) of every decoder layer, a pair
//! `A` (r × in) and `B` (out × r); the adapted projection is `y = x·Wᵀ + scaling · dropout(x)·Aᵀ·Bᵀ`
//! with `scaling = alpha / r`. `A` starts as PEFT's Kaiming-uniform (bound 1/√in) and `B` as zeros,
//! so a fresh adapter changes nothing.
//!
//! The base model never changes: `CausalLm::set_adapter` points the projections at an adapter's
//! tensors for the forwards that follow (the learner switches adapters per turn and removes them for
//! the reference policy, which is the base itself), and [`merge_into`] gives `W + scaling·B·A` for
//! servers that decode with merged weights.
//!
//! Names: inside an adapter's `VarStore` a tensor is `model.layers.{i}.self_attn.q_proj.lora_A.weight`;
//! PEFT's files prefix that with `base_model.model.` ([`LoraAdapter::peft_tensors`]).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor, nn, nn::VarStore};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};

/// The projections an adapter can target, with the sub-module that holds each.
pub const PROJECTIONS: [(&str, &str); 7] = [
    ("self_attn", "q_proj"),
    ("self_attn", "k_proj"),
    ("self_attn", "v_proj"),
    ("self_attn", "o_proj"),
    ("mlp", "gate_proj"),
    ("mlp", "up_proj"),
    ("mlp", "down_proj"),
];

/// PEFT's prefix of a causal LM's adapter tensor names.
pub const PEFT_PREFIX: &str = "base_model.model.";

/// An adapter's shape: rank, scale, dropout and targeted projections.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraConfig {
    /// Rank r of `A` and `B`.
    pub r: usize,
    /// `alpha`; the update is scaled by alpha / r.
    pub alpha: f64,
    /// Dropout on the adapter's input during training forwards.
    pub dropout: f64,
    /// Projection names (`q_proj`, ..., `down_proj`).
    pub target_modules: Vec<String>,
}

impl Default for LoraConfig {
    /// MaPoRL's adapters: r 8, alpha 16, dropout 0.05 on every attention and MLP projection.
    fn default() -> Self {
        Self {
            r: 8,
            alpha: 16.0,
            dropout: 0.05,
            target_modules: PROJECTIONS.iter().map(|(_, m)| m.to_string()).collect(),
        }
    }
}

impl LoraConfig {
    /// alpha / r.
    pub fn scaling(&self) -> f64 {
        self.alpha / self.r as f64
    }

    /// Checks the rank, dropout and module names.
    pub fn validate(&self) -> Result<()> {
        if self.r == 0 {
            return Err(ModelError::InvalidConfig(
                "lora r must be at least 1".into(),
            ));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(ModelError::InvalidConfig(format!(
                "lora dropout {} is not in [0, 1)",
                self.dropout
            )));
        }
        if self.target_modules.is_empty() {
            return Err(ModelError::InvalidConfig(
                "lora target_modules is empty".into(),
            ));
        }
        for m in &self.target_modules {
            if m == "qkv_proj" || m == "gate_up_proj" {
                return Err(ModelError::InvalidConfig(format!(
                    "lora target module `{m}`: LoRA on Phi-3's fused projections is not built (`o_proj` and `down_proj` are)"
                )));
            }
            if !PROJECTIONS.iter().any(|(_, p)| p == m) {
                let known: Vec<&str> = PROJECTIONS.iter().map(|(_, p)| *p).collect();
                return Err(ModelError::InvalidConfig(format!(
                    "lora target module `{m}` is not one of {known:?}"
                )));
            }
        }
        Ok(())
    }
}

impl LoraConfig {
    /// The targets as PEFT resolves them on a `family` model, where names match modules by
    /// suffix and names that match none are skipped. Phi-3 has `qkv_proj` and `gate_up_proj`
    /// where the others have q/k/v and gate/up, so of the seven names only `o_proj` and
    /// `down_proj` reach a module: MaPoRL's list of all seven trains those two on Phi-3, and so
    /// does this. A list that reaches none is refused, as PEFT refuses it.
    pub fn for_family(&self, family: crate::config::Family) -> Result<LoraConfig> {
        if family != crate::config::Family::Phi3 {
            return Ok(self.clone());
        }
        const ON_PHI3: [&str; 2] = ["o_proj", "down_proj"];
        let kept: Vec<String> = self
            .target_modules
            .iter()
            .filter(|m| ON_PHI3.contains(&m.as_str()))
            .cloned()
            .collect();
        if kept.is_empty() {
            return Err(ModelError::InvalidConfig(format!(
                "lora target_modules {:?} name no Phi-3 projection: Phi-3 fuses q/k/v into `qkv_proj` and gate/up into \
                 `gate_up_proj` (LoRA on those is not built), so of these names PEFT matches only `o_proj` and `down_proj`",
                self.target_modules
            )));
        }
        if kept.len() < self.target_modules.len() {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                tracing::info!(
                    kept = ?kept,
                    "LoRA on Phi-3: as PEFT, the target names without a Phi-3 module (q/k/v, gate/up: fused there) are skipped"
                )
            });
        }
        Ok(LoraConfig {
            target_modules: kept,
            ..self.clone()
        })
    }
}

/// One projection's pair, as the model's linear layers read it.
#[derive(Debug)]
pub(crate) struct LoraSlot {
    pub a: Tensor,
    pub b: Tensor,
    pub scaling: f64,
    /// Dropout probability applied to the input (0 outside training forwards).
    pub dropout: f64,
}

/// A trainable adapter for one base model; see the module docs.
#[derive(Debug)]
pub struct LoraAdapter {
    pub config: LoraConfig,
    /// The adapter's own parameters (the optimiser's only variables).
    pub vs: VarStore,
    /// (layer, projection) → (A, B), shallow handles of `vs`'s variables.
    pairs: BTreeMap<(usize, &'static str), (Tensor, Tensor)>,
    /// Decoder layers of the base it was made for.
    layers: usize,
}

impl LoraConfig {
    /// The config of an adapter update's tensors (`lora_A`/`lora_B` pairs under `VarStore` or PEFT
    /// names) scaled by `scaling`: the rank read from the `A` shapes, the targets from the names in
    /// their canonical order (equal adapters get equal configs), alpha `scaling · r`, no dropout.
    pub fn of_tensors(tensors: &HashMap<String, Tensor>, scaling: f64) -> Result<Self> {
        let bad = |m: String| ModelError::InvalidConfig(m);
        let mut targets: Vec<String> = Vec::new();
        let mut rank: Option<i64> = None;
        for (name, t) in tensors {
            let key = name.strip_prefix(PEFT_PREFIX).unwrap_or(name);
            let Some(stem) = key.strip_suffix(".lora_A.weight") else {
                if key.ends_with(".lora_B.weight") {
                    continue;
                }
                return Err(bad(format!(
                    "`{name}` is not a LoRA tensor (X.lora_A.weight / X.lora_B.weight)"
                )));
            };
            let proj = stem.rsplit('.').next().unwrap_or_default();
            if !targets.iter().any(|p| p == proj) {
                targets.push(proj.to_string());
            }
            let r = t.size().first().copied().unwrap_or(0);
            match rank {
                None => rank = Some(r),
                Some(r0) if r0 != r => {
                    return Err(bad(format!("`{name}` has rank {r}, other pairs {r0}")));
                }
                _ => {}
            }
        }
        let r = rank.ok_or_else(|| bad("an adapter update with no lora_A tensor".into()))? as usize;
        targets.sort_by_key(|p| {
            PROJECTIONS
                .iter()
                .position(|(_, q)| q == p)
                .unwrap_or(usize::MAX)
        });
        Ok(LoraConfig {
            r,
            alpha: scaling * r as f64,
            dropout: 0.0,
            target_modules: targets,
        })
    }
}

/// Writes an adapter in PEFT's layout into `dir` (`adapter_config.json` with `config`, and
/// `adapter_model.safetensors` with `tensors` under PEFT names, on the CPU), as PEFT and vLLM read
/// it. `base_model` is recorded as `base_model_name_or_path`.
pub fn write_peft(
    dir: &Path,
    config: &LoraConfig,
    tensors: &BTreeMap<String, Tensor>,
    base_model: &str,
) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).map_err(|source| ModelError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let json = serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.r,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": config.target_modules,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "modules_to_save": null,
    });
    let path = dir.join("adapter_config.json");
    let text = serde_json::to_string_pretty(&json).expect("a json value serialises");
    std::fs::write(&path, text).map_err(|source| ModelError::Io {
        path: path.clone(),
        source,
    })?;
    let tensors: Vec<(String, Tensor)> = tensors
        .iter()
        .map(|(k, v)| {
            let key = k.strip_prefix(PEFT_PREFIX).unwrap_or(k);
            (
                format!("{PEFT_PREFIX}{key}"),
                v.detach().to_device(Device::Cpu).contiguous(),
            )
        })
        .collect();
    let path = dir.join("adapter_model.safetensors");
    Tensor::write_safetensors(&tensors, &path)?;
    Ok(dir.to_path_buf())
}

/// The `(group, projection)` of a projection name.
fn projection(name: &str) -> Option<(&'static str, &'static str)> {
    PROJECTIONS.iter().copied().find(|(_, p)| *p == name)
}

/// What an adapter needs to know of the model it adapts (the families' `CausalLm` implements it):
/// so that this module sits below the model families that apply adapters.
pub trait AdapterBase {
    fn config(&self) -> &ModelConfig;
    fn device(&self) -> Device;
    fn kind(&self) -> Kind;
    /// `(out, in)` of a projection's weight (`q_proj`, ..., `down_proj`).
    fn projection_shape(&self, projection: &str) -> (i64, i64);
}

impl LoraAdapter {
    /// A fresh adapter for `model` (A Kaiming-uniform from libtorch's generator, B zeros), in the
    /// model's dtype and on its device. Seed libtorch (`tch::manual_seed`) first for a reproducible A.
    pub fn new(model: &dyn AdapterBase, config: LoraConfig) -> Result<Self> {
        Self::build(model, config, true)
    }

    /// An adapter of zeros, for tensors that are loaded next: no draw from libtorch's generator,
    /// which a worker loading adapters shares with whatever else the process seeds.
    fn zeros(model: &dyn AdapterBase, config: LoraConfig) -> Result<Self> {
        Self::build(model, config, false)
    }

    fn build(model: &dyn AdapterBase, config: LoraConfig, random_a: bool) -> Result<Self> {
        config.validate()?;
        let cfg = model.config();
        let config = config.for_family(cfg.family)?;
        let mut vs = VarStore::new(model.device());
        let root = vs.root();
        let mut pairs = BTreeMap::new();
        for layer in 0..cfg.num_hidden_layers {
            for m in &config.target_modules {
                let (group, proj) = projection(m).expect("validated");
                let (out_dim, in_dim) = model.projection_shape(proj);
                let p = &root / "model" / "layers" / layer / group / proj;
                let bound = 1.0 / (in_dim as f64).sqrt();
                let init = if random_a {
                    nn::Init::Uniform {
                        lo: -bound,
                        up: bound,
                    }
                } else {
                    nn::Init::Const(0.0)
                };
                let a = (&p / "lora_A").var("weight", &[config.r as i64, in_dim], init);
                let b = (&p / "lora_B").var(
                    "weight",
                    &[out_dim, config.r as i64],
                    nn::Init::Const(0.0),
                );
                pairs.insert((layer, proj), (a, b));
            }
        }
        if model.kind() != Kind::Float {
            vs.set_kind(model.kind());
            // set_kind replaces the variables; take fresh handles.
            let vars = vs.variables();
            for ((layer, proj), (a, b)) in pairs.iter_mut() {
                let (group, _) = projection(proj).expect("known");
                let base = format!("model.layers.{layer}.{group}.{proj}");
                *a = vars[&format!("{base}.lora_A.weight")].shallow_clone();
                *b = vars[&format!("{base}.lora_B.weight")].shallow_clone();
            }
        }
        Ok(Self {
            config,
            vs,
            pairs,
            layers: cfg.num_hidden_layers,
        })
    }

    /// An adapter for `model` holding `tensors` (an adapter update: `lora_A`/`lora_B` pairs under
    /// `VarStore` or PEFT names) scaled by `scaling`: its rank is read from the `A` shapes, its
    /// targets from the names, alpha is `scaling · r`, no dropout. Every layer must carry every
    /// targeted projection's pair.
    pub fn from_tensors(
        model: &dyn AdapterBase,
        tensors: &HashMap<String, Tensor>,
        scaling: f64,
    ) -> Result<Self> {
        let config = LoraConfig::of_tensors(tensors, scaling)?;
        let adapter = Self::zeros(model, config)?;
        adapter.load_tensors(tensors)?;
        Ok(adapter)
    }

    /// Decoder layers of the base model it fits.
    pub fn num_layers(&self) -> usize {
        self.layers
    }

    /// The (A, B) pairs by (layer, projection).
    pub(crate) fn pairs(&self) -> impl Iterator<Item = (usize, &'static str, &Tensor, &Tensor)> {
        self.pairs.iter().map(|((l, p), (a, b))| (*l, *p, a, b))
    }

    /// The adapter's tensors under their `VarStore` names (`model.layers.0.self_attn.q_proj.lora_A.weight`).
    pub fn named_tensors(&self) -> BTreeMap<String, Tensor> {
        self.vs.variables().into_iter().collect()
    }

    /// The adapter's tensors under PEFT's names (`base_model.model.` + the `VarStore` name).
    pub fn peft_tensors(&self) -> BTreeMap<String, Tensor> {
        self.vs
            .variables()
            .into_iter()
            .map(|(k, v)| (format!("{PEFT_PREFIX}{k}"), v))
            .collect()
    }

    /// Copies tensors (`VarStore` or PEFT names) into the adapter; every tensor of the adapter must
    /// be given, with its shape.
    pub fn load_tensors(&self, tensors: &HashMap<String, Tensor>) -> Result<()> {
        let vars = self.vs.variables();
        if tensors.len() != vars.len() {
            return Err(ModelError::InvalidConfig(format!(
                "an adapter of {} tensors was given {}",
                vars.len(),
                tensors.len()
            )));
        }
        let _guard = tch::no_grad_guard();
        for (name, src) in tensors {
            let key = name.strip_prefix(PEFT_PREFIX).unwrap_or(name);
            let mut dst = vars
                .get(key)
                .ok_or_else(|| {
                    ModelError::InvalidConfig(format!(
                        "adapter tensor `{name}` does not belong to this adapter"
                    ))
                })?
                .shallow_clone();
            if dst.size() != src.size() {
                return Err(ModelError::InvalidConfig(format!(
                    "adapter tensor `{name}`: shape {:?}, expected {:?}",
                    src.size(),
                    dst.size()
                )));
            }
            dst.copy_(&src.to_kind(dst.kind()).to_device(dst.device()));
        }
        Ok(())
    }

    /// Bytes of the adapter's tensors (what a weight update of it sends in its dtype).
    pub fn num_bytes(&self) -> usize {
        self.vs
            .variables()
            .values()
            .map(|t| t.numel() * t.kind().elt_size_in_bytes())
            .sum()
    }

    /// Writes PEFT's layout into `dir`: `adapter_config.json` and `adapter_model.safetensors`.
    /// `base_model` is recorded as `base_model_name_or_path`.
    pub fn save_peft(&self, dir: &Path, base_model: &str) -> Result<PathBuf> {
        write_peft(dir, &self.config, &self.peft_tensors(), base_model)
    }

    /// Reads an adapter saved in PEFT's layout (by [`LoraAdapter::save_peft`] or by PEFT) for `model`.
    pub fn load_peft(dir: &Path, model: &dyn AdapterBase) -> Result<Self> {
        let path = dir.join("adapter_config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io {
            path: path.clone(),
            source,
        })?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| ModelError::InvalidFile {
                path: path.clone(),
                message: e.to_string(),
            })?;
        let bad = |what: &str| ModelError::InvalidFile {
            path: path.clone(),
            message: what.to_string(),
        };
        let targets = match &v["target_modules"] {
            serde_json::Value::Array(a) => a
                .iter()
                .filter_map(|m| m.as_str().map(str::to_string))
                .collect(),
            serde_json::Value::String(s) if s == "all-linear" => {
                PROJECTIONS.iter().map(|(_, p)| p.to_string()).collect()
            }
            _ => return Err(bad("target_modules must be a list of projection names")),
        };
        let config = LoraConfig {
            r: v["r"].as_u64().ok_or_else(|| bad("r is missing"))? as usize,
            alpha: v["lora_alpha"]
                .as_f64()
                .ok_or_else(|| bad("lora_alpha is missing"))?,
            dropout: v["lora_dropout"].as_f64().unwrap_or(0.0),
            target_modules: targets,
        };
        let adapter = Self::zeros(model, config)?;
        let file = dir.join("adapter_model.safetensors");
        let tensors: HashMap<String, Tensor> =
            Tensor::read_safetensors(&file)?.into_iter().collect();
        adapter.load_tensors(&tensors)?;
        Ok(adapter)
    }

    /// `W + scaling·B·A` for every targeted projection, under the base's parameter names
    /// (`model.layers.{i}.self_attn.q_proj.weight`), from the base's `parameters`.
    pub fn merged(
        &self,
        parameters: &BTreeMap<String, Tensor>,
    ) -> Result<BTreeMap<String, Tensor>> {
        merge_into(
            |n| parameters.get(n).map(Tensor::shallow_clone),
            &self.named_tensors(),
            self.config.scaling(),
        )
    }
}

/// Merges adapter tensors (`X.lora_A.weight`, `X.lora_B.weight`, with or without PEFT's prefix) into
/// the base weights `X.weight` that `base` looks up by name: returns `X.weight + scaling · B·A` for every pair, under the
/// base's names, in the base tensor's dtype and device. Unpaired or unknown tensors, and shapes that
/// do not fit, are errors.
pub fn merge_into(
    base: impl Fn(&str) -> Option<Tensor>,
    adapter: &BTreeMap<String, Tensor>,
    scaling: f64,
) -> Result<BTreeMap<String, Tensor>> {
    let _guard = tch::no_grad_guard();
    let mut out = BTreeMap::new();
    for (name, a) in adapter {
        let key = name.strip_prefix(PEFT_PREFIX).unwrap_or(name);
        let Some(stem) = key.strip_suffix(".lora_A.weight") else {
            if key.ends_with(".lora_B.weight") {
                continue;
            }
            return Err(ModelError::InvalidConfig(format!(
                "`{name}` is not a LoRA tensor (X.lora_A.weight / X.lora_B.weight)"
            )));
        };
        let b_name = name.replace(".lora_A.weight", ".lora_B.weight");
        let b = adapter
            .get(&b_name)
            .ok_or_else(|| ModelError::InvalidConfig(format!("`{name}` has no `{b_name}`")))?;
        let w_name = format!("{stem}.weight");
        let w = base(&w_name).ok_or_else(|| {
            ModelError::InvalidConfig(format!(
                "`{name}` adapts `{w_name}`, which the model does not have"
            ))
        })?;
        let (ws, as_, bs) = (w.size(), a.size(), b.size());
        if as_.len() != 2
            || bs.len() != 2
            || ws.len() != 2
            || as_[0] != bs[1]
            || as_[1] != ws[1]
            || bs[0] != ws[0]
        {
            return Err(ModelError::InvalidConfig(format!(
                "`{stem}`: lora_A {as_:?} and lora_B {bs:?} do not fit the weight {ws:?} (A is r × in, B is out × r)"
            )));
        }
        let delta = b
            .to_kind(Kind::Float)
            .to_device(w.device())
            .matmul(&a.to_kind(Kind::Float).to_device(w.device()))
            * scaling;
        out.insert(w_name, (w.to_kind(Kind::Float) + delta).to_kind(w.kind()));
    }
    for name in adapter.keys() {
        let key = name.strip_prefix(PEFT_PREFIX).unwrap_or(name);
        if let Some(stem) = key.strip_suffix(".lora_B.weight")
            && !out.contains_key(&format!("{stem}.weight"))
        {
            return Err(ModelError::InvalidConfig(format!(
                "`{name}` has no lora_A partner"
            )));
        }
    }
    Ok(out)
}
