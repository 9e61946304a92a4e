//! A learned verifier (MaPoRL's reward model, docs/src/trainers/verifier.md): a causal LM trunk with a
//! linear head without bias and a sigmoid on every token. Trained with binary cross-entropy on every
//! response token against the answer's 0/1 label; an answer's score is the last token's output, the
//! probability that the answer is correct.
//!
//! The trunk is a frozen base with a LoRA adapter (MaPoRL's setting, r 16 / alpha 32) or a fully
//! fine-tuned copy. A conversation (user message, assistant message) is encoded the same way for
//! training and for scoring ([`Verifier::encode`]): the chat template's rendering of the user turn
//! with the generation prompt, then the rest of the two-turn rendering (the answer and its end of
//! turn) as the response. (MaPoRL's server renders with a generation prompt after the answer, a
//! position its training never scored; cotrain scores the position it trained.)
//!
//! A saved verifier is a directory: `verifier.json` ([`VerifierManifest`], written last),
//! `v_head.safetensors` (`v_head.weight`, (1, hidden)), and `adapter/` (PEFT's layout, naming its
//! base) or `model/` (a Hugging Face model directory).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor, nn, nn::VarStore};

use crate::chat_template::ChatMessage;
use crate::error::{ModelError, Result};
use crate::loader::{LoadOptions, LoadedModel};
use crate::lora::{LoraAdapter, LoraConfig};

/// The manifest's file name.
pub const MANIFEST: &str = "verifier.json";
/// The manifest's `format`.
pub const FORMAT: &str = "cotrain-verifier/1";

/// `verifier.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VerifierManifest {
    pub format: String,
    /// The base model spec (LoRA: what `adapter/` applies to; full: where `model/` came from).
    pub base_model: String,
    /// `lora` (`adapter/`) or `full` (`model/`).
    pub weights: String,
    /// Longest encoded conversation; longer ones keep their last tokens.
    pub max_length: usize,
}

/// One encoded conversation: token ids and where the response starts.
#[derive(Debug, Clone, PartialEq)]
pub struct Encoded {
    pub ids: Vec<u32>,
    /// Index of the first response token; every token from here on is trained on.
    pub response_start: usize,
}

/// The trunk's trained weights.
pub enum Trunk {
    /// A frozen base and an adapter set on it for every forward.
    Lora {
        base: Box<LoadedModel>,
        adapter: LoraAdapter,
    },
    /// A whole trainable model.
    Full(Box<LoadedModel>),
}

/// A verifier in memory; see the module docs.
pub struct Verifier {
    pub trunk: Trunk,
    /// The head's own store (`v_head.weight`), separate so that optimisers can tell it apart.
    pub head_vs: VarStore,
    pub head: Tensor,
    pub manifest: VerifierManifest,
}

impl Verifier {
    /// A fresh verifier on `base` (loaded from `base_spec`): with `lora`, the base frozen and a new
    /// adapter; without, the base itself trains. The head is drawn as torch's `nn.Linear` draws
    /// it (uniform in ±1/√hidden); seed libtorch first for reproducible weights.
    pub fn new(
        mut base: LoadedModel,
        base_spec: &str,
        lora: Option<LoraConfig>,
        max_length: usize,
    ) -> Result<Self> {
        let hidden = base.model.config().hidden_size as i64;
        let device = base.model.device();
        let (trunk, weights) = match lora {
            Some(cfg) => {
                base.vs.freeze();
                let adapter = LoraAdapter::new(&base.model, cfg)?;
                (
                    Trunk::Lora {
                        base: Box::new(base),
                        adapter,
                    },
                    "lora",
                )
            }
            None => (Trunk::Full(Box::new(base)), "full"),
        };
        let head_vs = VarStore::new(device);
        let bound = 1.0 / (hidden as f64).sqrt();
        let head = (head_vs.root() / "v_head").var(
            "weight",
            &[1, hidden],
            nn::Init::Uniform {
                lo: -bound,
                up: bound,
            },
        );
        let manifest = VerifierManifest {
            format: FORMAT.into(),
            base_model: base_spec.into(),
            weights: weights.into(),
            max_length,
        };
        Ok(Self {
            trunk,
            head_vs,
            head,
            manifest,
        })
    }

    /// Loads a saved verifier directory.
    pub fn load(dir: &Path, opts: &LoadOptions) -> Result<Self> {
        let path = dir.join(MANIFEST);
        let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io {
            path: path.clone(),
            source,
        })?;
        let manifest: VerifierManifest =
            serde_json::from_str(&text).map_err(|e| ModelError::InvalidFile {
                path: path.clone(),
                message: e.to_string(),
            })?;
        if manifest.format != FORMAT {
            return Err(ModelError::InvalidFile {
                path,
                message: format!("format `{}`, expected `{FORMAT}`", manifest.format),
            });
        }
        let trunk = match manifest.weights.as_str() {
            "lora" => {
                let mut base = crate::loader::load(&manifest.base_model, opts)?;
                base.vs.freeze();
                let adapter = LoraAdapter::load_peft(&dir.join("adapter"), &base.model)?;
                Trunk::Lora {
                    base: Box::new(base),
                    adapter,
                }
            }
            "full" => Trunk::Full(Box::new(crate::loader::load(
                dir.join("model").to_str().unwrap_or_default(),
                opts,
            )?)),
            other => {
                return Err(ModelError::InvalidFile {
                    path,
                    message: format!("weights `{other}`, expected `lora` or `full`"),
                });
            }
        };
        let model = trunk.loaded();
        let hidden = model.model.config().hidden_size as i64;
        let head_path = dir.join("v_head.safetensors");
        let stored = Tensor::read_safetensors(&head_path).map_err(|e| ModelError::InvalidFile {
            path: head_path.clone(),
            message: e.to_string(),
        })?;
        let w = stored
            .into_iter()
            .find(|(k, _)| k == "v_head.weight")
            .map(|(_, t)| t)
            .ok_or_else(|| ModelError::InvalidFile {
                path: head_path.clone(),
                message: "no `v_head.weight`".into(),
            })?;
        if w.size() != [1, hidden] {
            return Err(ModelError::InvalidFile {
                path: head_path,
                message: format!(
                    "v_head.weight {:?}, the trunk needs [1, {hidden}]",
                    w.size()
                ),
            });
        }
        let head_vs = VarStore::new(model.model.device());
        let mut head =
            (head_vs.root() / "v_head").var("weight", &[1, hidden], nn::Init::Const(0.0));
        tch::no_grad(|| head.copy_(&w.to_kind(Kind::Float).to_device(head.device())));
        Ok(Self {
            trunk,
            head_vs,
            head,
            manifest,
        })
    }

    /// Writes the directory (the manifest last: a directory without it was cut short).
    pub fn save(&self, dir: &Path) -> Result<PathBuf> {
        std::fs::create_dir_all(dir).map_err(|source| ModelError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        match &self.trunk {
            Trunk::Lora { adapter, .. } => {
                adapter.save_peft(&dir.join("adapter"), &self.manifest.base_model)?;
            }
            Trunk::Full(m) => {
                crate::export::save_pretrained(m, &dir.join("model"))
                    .map_err(|e| ModelError::InvalidConfig(format!("{}: {e}", dir.display())))?;
            }
        }
        Tensor::write_safetensors(
            &[(
                "v_head.weight",
                self.head.detach().to_device(Device::Cpu).contiguous(),
            )],
            dir.join("v_head.safetensors"),
        )?;
        let path = dir.join(MANIFEST);
        let text = serde_json::to_string_pretty(&self.manifest).expect("a manifest serialises");
        std::fs::write(&path, text).map_err(|source| ModelError::Io { path, source })?;
        Ok(dir.to_path_buf())
    }

    /// The model whose tokenizer, template and network the trunk uses.
    pub fn model(&self) -> &LoadedModel {
        self.trunk.loaded()
    }

    /// Encodes (user message, assistant message). With a chat template: the user turn rendered with
    /// the generation prompt, then what the two-turn rendering adds after it; without one: the two
    /// texts one after the other. Over `max_length` tokens, the first tokens are dropped.
    pub fn encode(&self, user: &str, assistant: &str) -> Result<Encoded> {
        let m = self.model();
        let (prompt, response) = match &m.chat_template {
            Some(t) => {
                let none = serde_json::Value::Null;
                let render_err = |e: crate::chat_template::ChatTemplateError| {
                    ModelError::InvalidConfig(format!("chat template: {e}"))
                };
                let prompt = t
                    .render(&[ChatMessage::user(user)], true, &none)
                    .map_err(render_err)?;
                let full = t
                    .render(
                        &[ChatMessage::user(user), ChatMessage::assistant(assistant)],
                        false,
                        &none,
                    )
                    .map_err(render_err)?;
                let rest = full.strip_prefix(prompt.as_str()).ok_or_else(|| {
                    ModelError::InvalidConfig("the chat template's two-turn rendering does not start with its one-turn rendering with the generation prompt; the verifier cannot tell where the answer starts".into())
                })?;
                (encode(m, &prompt, false)?, encode(m, rest, false)?)
            }
            None => (encode(m, user, true)?, encode(m, assistant, false)?),
        };
        if response.is_empty() {
            return Err(ModelError::InvalidBatch(
                "the assistant message encodes to no token".into(),
            ));
        }
        let mut ids = prompt;
        let mut response_start = ids.len();
        ids.extend(response);
        let max = self.manifest.max_length.max(1);
        if ids.len() > max {
            let cut = ids.len() - max;
            ids.drain(..cut);
            response_start = response_start.saturating_sub(cut);
        }
        Ok(Encoded {
            ids,
            response_start,
        })
    }

    /// Per-token logits (B, L) (before the sigmoid) of right-padded rows of `batch`, and the (B, L)
    /// f32 mask of response tokens. With `training`, LoRA dropout is on and autograd records.
    pub fn token_logits(&self, batch: &[&Encoded], training: bool) -> Result<(Tensor, Tensor)> {
        if batch.is_empty() {
            return Err(ModelError::InvalidBatch("no conversation to score".into()));
        }
        let l = batch.iter().map(|e| e.ids.len()).max().unwrap_or(1);
        let (mut ids, mut mask) = (vec![0i64; batch.len() * l], vec![0f32; batch.len() * l]);
        for (b, e) in batch.iter().enumerate() {
            for (j, &t) in e.ids.iter().enumerate() {
                ids[b * l + j] = i64::from(t);
                mask[b * l + j] = if j >= e.response_start { 1.0 } else { 0.0 };
            }
        }
        let device = self.head.device();
        let ids = Tensor::from_slice(&ids)
            .view([batch.len() as i64, l as i64])
            .to_device(device);
        let mask = Tensor::from_slice(&mask)
            .view([batch.len() as i64, l as i64])
            .to_device(device);
        let _guard = (!training).then(tch::no_grad_guard);
        let hidden = match &self.trunk {
            Trunk::Lora { base, adapter } => {
                base.model.set_adapter(Some(adapter), training)?;
                let h = base.model.forward_hidden(&ids);
                base.model.set_adapter(None, false)?;
                h?
            }
            Trunk::Full(m) => m.model.forward_hidden(&ids)?,
        };
        let logits = hidden
            .to_kind(Kind::Float)
            .matmul(&self.head.transpose(0, 1))
            .squeeze_dim(-1);
        Ok((logits, mask))
    }

    /// Scores (probability of being correct, the sigmoid at each conversation's last token).
    pub fn score(&self, batch: &[&Encoded]) -> Result<Vec<f32>> {
        let (logits, _) = self.token_logits(batch, false)?;
        last_token_scores(&logits, batch)
    }

    /// The loss of `batch` with `labels` (0 or 1): per conversation the mean binary cross-entropy
    /// of every response token's sigmoid against the label, then the mean over conversations.
    /// Returns the loss and each conversation's score. `training`: LoRA dropout on and autograd
    /// recording (for an optimiser step); off for held-out evaluation.
    pub fn loss(
        &self,
        batch: &[&Encoded],
        labels: &[f32],
        training: bool,
    ) -> Result<(Tensor, Vec<f32>)> {
        if labels.len() != batch.len() {
            return Err(ModelError::InvalidBatch(format!(
                "{} labels for {} conversations",
                labels.len(),
                batch.len()
            )));
        }
        let (logits, mask) = self.token_logits(batch, training)?;
        let y = Tensor::from_slice(labels)
            .to_device(logits.device())
            .unsqueeze(1)
            .expand_as(&logits);
        // log σ(x) and log(1 − σ(x)) = log σ(−x), stable for large |x|.
        let pos: Tensor = &y * logits.log_sigmoid();
        let neg: Tensor = (1.0 - &y) * logits.neg().log_sigmoid();
        let bce = (pos + neg).neg();
        let per_row = (bce * &mask).sum_dim_intlist([1i64].as_slice(), false, Kind::Float)
            / mask.sum_dim_intlist([1i64].as_slice(), false, Kind::Float);
        let loss = per_row.mean(Kind::Float);
        Ok((loss, last_token_scores(&logits.detach(), batch)?))
    }

    /// The trainable stores: the adapter's (LoRA) or the whole model's (full), and the head's.
    pub fn trainable(&self) -> (&VarStore, &VarStore) {
        match &self.trunk {
            Trunk::Lora { adapter, .. } => (&adapter.vs, &self.head_vs),
            Trunk::Full(m) => (&m.vs, &self.head_vs),
        }
    }
}

impl Trunk {
    fn loaded(&self) -> &LoadedModel {
        match self {
            Trunk::Lora { base, .. } => base.as_ref(),
            Trunk::Full(m) => m.as_ref(),
        }
    }
}

/// The sigmoid of each row's logit at its last real token (rows are right-padded).
fn last_token_scores(logits: &Tensor, batch: &[&Encoded]) -> Result<Vec<f32>> {
    let last: Vec<i64> = batch.iter().map(|e| e.ids.len() as i64 - 1).collect();
    let index = Tensor::from_slice(&last)
        .to_device(logits.device())
        .unsqueeze(1);
    let s = logits
        .gather(1, &index, false)
        .squeeze_dim(1)
        .sigmoid()
        .to_device(Device::Cpu);
    Vec::<f32>::try_from(s).map_err(|e| ModelError::InvalidBatch(e.to_string()))
}

fn encode(m: &LoadedModel, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
    m.tokenizer
        .encode(text, add_special_tokens)
        .map_err(|e| ModelError::InvalidConfig(format!("tokenizer: {e}")))
}
