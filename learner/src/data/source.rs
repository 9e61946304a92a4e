//! The `dataset` section of the config: which task and which rows. It lives here, with the loader
//! that reads it, so that the config module depends on `data` and not the other way round.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// `dataset`: which task and which rows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DatasetConfig {
    /// A dataset name (`humaneval`, `openai/openai_humaneval`, `OpenMLRL/CoopHumanEval`, ...) or a local
    /// file / directory.
    pub name: String,
    /// The task type (`humaneval`, `coophumaneval`, `mbpp`, `arxiv`, `tldr`, `gsm8k`, `anli`); inferred
    /// from `name` when absent.
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    /// The rows trained on: a split name with an optional slice (`train`, `test[16:20]`).
    #[serde(default = "default_train_split")]
    pub train_split: String,
    /// The rows evaluated on, written like `train_split`; no evaluation when unset.
    #[serde(default)]
    pub eval_split: Option<String>,
    /// Directory with the shipped datasets; overrides `COTRAIN_DATA_DIR` and the repo's `data/`.
    #[serde(default)]
    pub data_dir: Option<String>,
    /// Beside the original: a fresh seeded order of the train rows every epoch. The original keeps
    /// the dataset's order (the default).
    #[serde(default)]
    pub shuffle: bool,
}

fn default_train_split() -> String {
    "train".to_string()
}
