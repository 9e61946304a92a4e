//! Datasets by name: the seed benchmarks shipped in the repo's `data/`, local files (jsonl, json, csv,
//! optionally gzip-compressed) and the local Hugging Face hub cache, mapped into typed task items and
//! sliced with split expressions such as `test[16:]`.

mod files;
mod source;
mod split;

use std::path::{Path, PathBuf};

use files::raw_rows;
pub use files::{Rows, read_rows};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
pub use source::DatasetConfig;
pub use split::{Bound, SplitError, SplitSpec};

/// Why a dataset could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// The dataset name or type is not one the learner knows.
    #[error(
        "unknown dataset `{0}` (known: humaneval, coophumaneval, mbpp, arxiv, tldr, gsm8k, anli, or a local file/directory with dataset.type)"
    )]
    UnknownDataset(String),
    /// The dataset has no such split.
    #[error("dataset `{dataset}` has no split `{split}` (available: {available})")]
    UnknownSplit {
        dataset: String,
        split: String,
        available: String,
    },
    /// The split expression is invalid or out of range.
    #[error("dataset `{dataset}`: {source}")]
    Split { dataset: String, source: SplitError },
    /// The data is not available on this machine.
    #[error("dataset `{dataset}` is not available: {message}")]
    NotAvailable { dataset: String, message: String },
    /// A file format the learner cannot read.
    #[error("{path}: unsupported data format `{format}` ({hint})")]
    UnsupportedFormat {
        path: PathBuf,
        format: String,
        hint: String,
    },
    /// Reading a file failed.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A file's content does not parse.
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    /// A row lacks a field the task needs, or has one of the wrong type.
    #[error("{path}: row {row}: {message}")]
    Row {
        path: PathBuf,
        row: usize,
        message: String,
    },
}

/// The task a dataset feeds; decides the item schema, the prompts and the reward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DatasetKind {
    HumanEval,
    CoopHumanEval,
    Mbpp,
    Arxiv,
    Tldr,
    Gsm8k,
    Anli,
}

impl DatasetKind {
    /// The canonical short name.
    pub fn name(self) -> &'static str {
        match self {
            DatasetKind::HumanEval => "humaneval",
            DatasetKind::CoopHumanEval => "coophumaneval",
            DatasetKind::Mbpp => "mbpp",
            DatasetKind::Arxiv => "arxiv",
            DatasetKind::Tldr => "tldr",
            DatasetKind::Gsm8k => "gsm8k",
            DatasetKind::Anli => "anli",
        }
    }

    /// Parses a short name or a known Hugging Face id (case-insensitive).
    pub fn from_name(name: &str) -> Option<Self> {
        let n = name.trim().to_ascii_lowercase();
        Some(match n.as_str() {
            "humaneval"
            | "he"
            | "openai_humaneval"
            | "openai/openai_humaneval"
            | "openai/humaneval" => Self::HumanEval,
            "coophumaneval" | "che" | "openmlrl/coophumaneval" => Self::CoopHumanEval,
            "mbpp" | "google-research-datasets/mbpp" | "openmlrl/mbpp" => Self::Mbpp,
            "arxiv" | "arxiv_abstract" | "openmlrl/arxiv_abstract" => Self::Arxiv,
            "tldr" | "trl-lib/tldr" => Self::Tldr,
            "gsm8k" | "openai/gsm8k" => Self::Gsm8k,
            "anli" | "facebook/anli" => Self::Anli,
            _ => return None,
        })
    }

    /// The kind a `dataset` section asks for: `dataset.type` if given, else inferred from `dataset.name`.
    pub fn resolve(cfg: &DatasetConfig) -> Result<Self, String> {
        if let Some(kind) = &cfg.kind {
            return Self::from_name(kind).ok_or_else(|| {
                format!("`{kind}` is not a known task type (humaneval, coophumaneval, mbpp, arxiv, tldr, gsm8k, anli)")
            });
        }
        Self::from_name(&cfg.name).ok_or_else(|| {
            format!(
                "`{}` is not a known dataset; name a known one or set dataset.type for local files",
                cfg.name
            )
        })
    }

    /// Code tasks share the HumanEval schema and the code reward.
    pub fn is_code(self) -> bool {
        matches!(self, Self::HumanEval | Self::CoopHumanEval | Self::Mbpp)
    }
}

/// A code problem in the HumanEval schema.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CodeItem {
    pub task_id: String,
    pub prompt: String,
    /// Defines `check(candidate)` with asserts.
    pub test: String,
    pub entry_point: String,
}

/// An arXiv abstract (OpenMLRL/arXiv_abstract schema).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArxivItem {
    pub article_id: String,
    pub abstract_text: String,
    pub token_count: Option<u64>,
}

/// A Reddit post in trl-lib/tldr's `prompt` format.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TldrItem {
    /// `SUBREDDIT: r/...\n\nTITLE: ...\n\nPOST: ...\n\nTL;DR:`
    pub prompt: String,
    /// A human reference summary, when the data has one.
    pub reference: Option<String>,
}

/// A GSM8K question.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Gsm8kItem {
    pub question: String,
    /// The full worked solution.
    pub answer: String,
    /// The number after `####`, commas removed.
    pub final_answer: String,
}

/// An NLI label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NliLabel {
    Entailment,
    Neutral,
    Contradiction,
}

impl NliLabel {
    /// Dataset ids 0/1/2, letters e/n/c, or the words.
    pub fn parse(v: &Value) -> Option<Self> {
        match v {
            Value::Number(n) => match n.as_u64()? {
                0 => Some(Self::Entailment),
                1 => Some(Self::Neutral),
                2 => Some(Self::Contradiction),
                _ => None,
            },
            Value::String(s) => match s.trim().to_ascii_lowercase().as_str() {
                "e" | "entailment" | "0" => Some(Self::Entailment),
                "n" | "neutral" | "1" => Some(Self::Neutral),
                "c" | "contradiction" | "2" => Some(Self::Contradiction),
                _ => None,
            },
            _ => None,
        }
    }

    pub fn word(self) -> &'static str {
        match self {
            Self::Entailment => "entailment",
            Self::Neutral => "neutral",
            Self::Contradiction => "contradiction",
        }
    }
}

/// An ANLI example.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AnliItem {
    pub uid: String,
    pub premise: String,
    pub hypothesis: String,
    pub label: NliLabel,
}

/// One dataset row, typed by task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "task", rename_all = "lowercase")]
pub enum TaskItem {
    Code(CodeItem),
    Arxiv(ArxivItem),
    Tldr(TldrItem),
    Gsm8k(Gsm8kItem),
    Anli(AnliItem),
}

/// The selected rows of one split.
#[derive(Debug, Clone, PartialEq)]
pub struct Dataset {
    pub kind: DatasetKind,
    /// The split expression as written (`test[16:]`).
    pub split: String,
    /// The rows' indices in the full split (for data positions in checkpoints and logs).
    pub row_offset: usize,
    pub items: Vec<TaskItem>,
}

impl Dataset {
    pub fn len(&self) -> usize {
        self.items.len()
    }
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

/// The directory holding the shipped datasets: `dataset.data_dir`, else `$COTRAIN_DATA_DIR`, else the
/// repo's `data/` next to this crate.
pub fn data_dir(cfg: &DatasetConfig) -> PathBuf {
    if let Some(d) = &cfg.data_dir {
        return PathBuf::from(d);
    }
    if let Ok(d) = std::env::var("COTRAIN_DATA_DIR")
        && !d.is_empty()
    {
        return PathBuf::from(d);
    }
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("data")
}

/// Loads the rows `split` selects from the dataset `cfg` names.
pub fn load_split(cfg: &DatasetConfig, split: &SplitSpec) -> Result<Dataset, DataError> {
    let kind =
        DatasetKind::resolve(cfg).map_err(|_| DataError::UnknownDataset(cfg.name.clone()))?;
    let (path, rows, extra) = raw_rows(cfg, kind, &split.name)?;
    let range = split
        .resolve(rows.len())
        .map_err(|source| DataError::Split {
            dataset: cfg.name.clone(),
            source,
        })?;
    let items = rows[range.clone()]
        .iter()
        .enumerate()
        .map(|(i, row)| {
            to_item(kind, row).map_err(|message| DataError::Row {
                path: path.clone(),
                row: extra + range.start + i,
                message,
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Dataset {
        kind,
        split: split.to_string(),
        row_offset: range.start,
        items,
    })
}

fn str_field(row: &Map<String, Value>, names: &[&str]) -> Result<String, String> {
    for n in names {
        match row.get(*n) {
            Some(Value::String(s)) => return Ok(s.clone()),
            Some(Value::Number(x)) => return Ok(x.to_string()),
            Some(Value::Null) | None => continue,
            Some(other) => return Err(format!("field `{n}` should be a string, got {other}")),
        }
    }
    Err(format!("missing field `{}`", names.join("` / `")))
}

/// Maps one raw row into the task's item.
pub fn to_item(kind: DatasetKind, row: &Map<String, Value>) -> Result<TaskItem, String> {
    Ok(match kind {
        DatasetKind::HumanEval | DatasetKind::CoopHumanEval | DatasetKind::Mbpp => {
            if !row.contains_key("test") && row.contains_key("test_list") {
                return Err("this looks like original MBPP (`test_list`); the learner needs the HumanEval schema \
                            (prompt, test, entry_point), as in data/mbpp"
                    .into());
            }
            TaskItem::Code(CodeItem {
                task_id: str_field(row, &["task_id"])?,
                prompt: str_field(row, &["prompt"])?,
                test: str_field(row, &["test"])?,
                entry_point: str_field(row, &["entry_point"])?,
            })
        }
        DatasetKind::Arxiv => TaskItem::Arxiv(ArxivItem {
            article_id: str_field(row, &["article_id"]).unwrap_or_default(),
            abstract_text: str_field(row, &["abstract_text"])?,
            token_count: row
                .get("token_count")
                .and_then(|v| v.as_u64().or_else(|| v.as_str()?.trim().parse().ok())),
        }),
        DatasetKind::Tldr => TaskItem::Tldr(TldrItem {
            prompt: str_field(row, &["prompt", "query"])?,
            reference: str_field(row, &["completion", "reference_responses"])
                .ok()
                .map(|s| s.trim().to_string()),
        }),
        DatasetKind::Gsm8k => {
            let answer = str_field(row, &["answer"])?;
            let final_answer = answer
                .rsplit_once("####")
                .map(|(_, a)| a.trim().replace(',', ""))
                .ok_or_else(|| "field `answer` has no `####` final answer".to_string())?;
            TaskItem::Gsm8k(Gsm8kItem {
                question: str_field(row, &["question"])?,
                answer,
                final_answer,
            })
        }
        DatasetKind::Anli => {
            let label_value = row.get("label").ok_or("missing field `label`")?;
            let label = NliLabel::parse(label_value)
                .ok_or_else(|| format!("unknown label {label_value}"))?;
            TaskItem::Anli(AnliItem {
                uid: str_field(row, &["uid"]).unwrap_or_default(),
                premise: str_field(row, &["premise", "context"])?,
                hypothesis: str_field(row, &["hypothesis"])?,
                label,
            })
        }
    })
}
