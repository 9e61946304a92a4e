//! Datasets by name: the seed benchmarks shipped in the repo's `data/`, local files (jsonl, json, csv,
//! optionally gzip-compressed) and the local Hugging Face hub cache, mapped into typed task items and
//! sliced with split expressions such as `test[16:]`.

mod source;
mod split;

use std::io::Read;
use std::path::{Path, PathBuf};

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

type Rows = Vec<Map<String, Value>>;

/// The full split's rows as JSON objects, with the file they came from and the row number of the
/// first one in that file (TLDR's test split starts mid-file).
fn raw_rows(
    cfg: &DatasetConfig,
    kind: DatasetKind,
    split: &str,
) -> Result<(PathBuf, Rows, usize), DataError> {
    let local = Path::new(&cfg.name);
    if local.exists() {
        let file = if local.is_dir() {
            find_split_file(local, split, &cfg.name)?
        } else {
            single_file_split(local, split, &cfg.name)?
        };
        let rows = read_rows(&file)?;
        return Ok((file, rows, 0));
    }
    let dir = data_dir(cfg);
    let shipped = shipped_file(kind, split, &dir, &cfg.name);
    match shipped {
        Ok(Some((file, range))) => {
            let rows = read_rows(&file)?;
            let (rows, first) = match range {
                Some((a, b)) => {
                    let b = b.min(rows.len());
                    (rows[a.min(b)..b].to_vec(), a)
                }
                None => (rows, 0),
            };
            Ok((file, rows, first))
        }
        Ok(None) => match hf_cache_file(&cfg.name, split)? {
            Some(file) => {
                let rows = read_rows(&file)?;
                Ok((file, rows, 0))
            }
            None => Err(DataError::NotAvailable {
                dataset: cfg.name.clone(),
                message: format!(
                    "it is not shipped in {} and not in the local Hugging Face cache; point dataset.name at a local \
                     directory with `{split}.jsonl` (or .json/.csv) in the {} schema",
                    dir.display(),
                    kind.name()
                ),
            }),
        },
        Err(e) => Err(e),
    }
}

/// The shipped file for a split and, for TLDR's deterministic division, the row range in it.
/// `Ok(None)` when the dataset is not shipped at all.
#[allow(clippy::type_complexity)]
fn shipped_file(
    kind: DatasetKind,
    split: &str,
    dir: &Path,
    dataset: &str,
) -> Result<Option<(PathBuf, Option<(usize, usize)>)>, DataError> {
    let unknown = |available: &str| DataError::UnknownSplit {
        dataset: dataset.to_string(),
        split: split.to_string(),
        available: available.to_string(),
    };
    let one = |rel: &str| Ok(Some((dir.join(rel), None)));
    match kind {
        DatasetKind::HumanEval => match split {
            "test" => one("humaneval/HumanEval.jsonl.gz"),
            _ => Err(unknown("test")),
        },
        // One split of 82 problems: the September 2025 configs call it `test`, the 2026 ones `train`.
        DatasetKind::CoopHumanEval => match split {
            "test" | "train" => one("coophumaneval/che_raw.json"),
            _ => Err(unknown("test (also named train)")),
        },
        DatasetKind::Mbpp => match split {
            "test" => one("mbpp/mbpp_raw.json"),
            _ => Err(unknown("test")),
        },
        DatasetKind::Gsm8k => match split {
            "train" => one("gsm8k/train.jsonl.gz"),
            "test" => one("gsm8k/test.jsonl.gz"),
            _ => Err(unknown("train, test")),
        },
        DatasetKind::Anli => {
            let (part, round) = match split {
                "dev" => ("dev", "R3"),
                "test" => ("test", "R3"),
                "dev_r1" => ("dev", "R1"),
                "dev_r2" => ("dev", "R2"),
                "dev_r3" => ("dev", "R3"),
                "test_r1" => ("test", "R1"),
                "test_r2" => ("test", "R2"),
                "test_r3" => ("test", "R3"),
                s if s.starts_with("train") => {
                    return Err(DataError::NotAvailable {
                        dataset: dataset.to_string(),
                        message: format!(
                            "split `{s}`: the ANLI train splits are not shipped (not obtainable offline); use dev_r1..3 / \
                             test_r1..3 or a local file"
                        ),
                    });
                }
                _ => {
                    return Err(unknown(
                        "dev, test (round 3), dev_r1, dev_r2, dev_r3, test_r1, test_r2, test_r3",
                    ));
                }
            };
            one(&format!("anli/{round}/{part}.jsonl.gz"))
        }
        DatasetKind::Tldr => {
            let file = dir.join("tldr/oai1b_tldr_subset.csv.gz");
            match split {
                "train" => Ok(Some((file, Some((0, TLDR_TRAIN_ROWS))))),
                "test" => Ok(Some((file, Some((TLDR_TRAIN_ROWS, usize::MAX))))),
                _ => Err(unknown("train, test")),
            }
        }
        DatasetKind::Arxiv => Ok(None),
    }
}

/// The shipped TLDR subset has no recorded split: its first rows are `train`, the rest `test`.
pub const TLDR_TRAIN_ROWS: usize = 1445;

/// In a local directory: `{split}.jsonl[.gz]`, `.json`, `.csv`, or HF's `data/{split}-*.{ext}` layout.
fn find_split_file(dir: &Path, split: &str, dataset: &str) -> Result<PathBuf, DataError> {
    let exts = [
        "jsonl", "jsonl.gz", "json", "json.gz", "csv", "csv.gz", "parquet",
    ];
    let mut seen = Vec::new();
    for sub in [dir.to_path_buf(), dir.join("data")] {
        let Ok(entries) = std::fs::read_dir(&sub) else {
            continue;
        };
        let mut names: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file())
            .collect();
        names.sort();
        for p in names {
            let fname = p
                .file_name()
                .and_then(|f| f.to_str())
                .unwrap_or_default()
                .to_string();
            seen.push(fname.clone());
            let matches_split = exts.iter().any(|e| fname == format!("{split}.{e}"))
                || (fname.starts_with(&format!("{split}-"))
                    && exts.iter().any(|e| fname.ends_with(&format!(".{e}"))));
            if matches_split {
                return Ok(p);
            }
        }
    }
    Err(DataError::UnknownSplit {
        dataset: dataset.to_string(),
        split: split.to_string(),
        available: if seen.is_empty() {
            "no data files".into()
        } else {
            format!("files {}", seen.join(", "))
        },
    })
}

/// A single local file holds one split, `train` (as HF's `load_dataset("json", data_files=...)`).
fn single_file_split(file: &Path, split: &str, dataset: &str) -> Result<PathBuf, DataError> {
    if split == "train" {
        Ok(file.to_path_buf())
    } else {
        Err(DataError::UnknownSplit {
            dataset: dataset.to_string(),
            split: split.to_string(),
            available:
                "train (a single file is one split; use a directory with {split}.jsonl for more)"
                    .into(),
        })
    }
}

/// A split file of `name` (an `org/name` HF id) in the local hub cache, if one is there.
fn hf_cache_file(name: &str, split: &str) -> Result<Option<PathBuf>, DataError> {
    let Some((org, repo)) = name.split_once('/') else {
        return Ok(None);
    };
    let hub = match std::env::var("HF_HUB_CACHE") {
        Ok(p) if !p.is_empty() => PathBuf::from(p),
        _ => match std::env::var("HF_HOME") {
            Ok(h) if !h.is_empty() => PathBuf::from(h).join("hub"),
            _ => match std::env::var("HOME") {
                Ok(h) => PathBuf::from(h).join(".cache/huggingface/hub"),
                Err(_) => return Ok(None),
            },
        },
    };
    let snapshots = hub
        .join(format!("datasets--{org}--{repo}"))
        .join("snapshots");
    let Ok(entries) = std::fs::read_dir(&snapshots) else {
        return Ok(None);
    };
    let mut revs: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    revs.sort();
    for rev in revs {
        if let Ok(p) = find_split_file(&rev, split, name) {
            return Ok(Some(p));
        }
    }
    Ok(None)
}

/// Reads a file of rows: JSON Lines, a JSON array, or CSV with a header; `.gz` is decompressed.
pub fn read_rows(path: &Path) -> Result<Rows, DataError> {
    let name = path
        .file_name()
        .and_then(|f| f.to_str())
        .unwrap_or_default()
        .to_ascii_lowercase();
    let (base, gz) = match name.strip_suffix(".gz") {
        Some(b) => (b.to_string(), true),
        None => (name.clone(), false),
    };
    let ext = base
        .rsplit_once('.')
        .map(|(_, e)| e.to_string())
        .unwrap_or_default();
    if ext == "parquet" {
        return Err(DataError::UnsupportedFormat {
            path: path.to_path_buf(),
            format: "parquet".into(),
            hint: "parquet is not supported yet; convert it to jsonl, e.g. with pandas `read_parquet(...).to_json(..., orient='records', lines=True)`".into(),
        });
    }
    let io = |source| DataError::Io {
        path: path.to_path_buf(),
        source,
    };
    let bytes = std::fs::read(path).map_err(io)?;
    let text = if gz {
        let mut s = String::new();
        flate2::read::GzDecoder::new(&bytes[..])
            .read_to_string(&mut s)
            .map_err(io)?;
        s
    } else {
        String::from_utf8(bytes).map_err(|e| DataError::Parse {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?
    };
    let parse = |message: String| DataError::Parse {
        path: path.to_path_buf(),
        message,
    };
    match ext.as_str() {
        "jsonl" | "ndjson" => text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(i, l)| match serde_json::from_str::<Value>(l) {
                Ok(Value::Object(m)) => Ok(m),
                Ok(_) => Err(parse(format!("line {}: not a JSON object", i + 1))),
                Err(e) => Err(parse(format!("line {}: {e}", i + 1))),
            })
            .collect(),
        "json" => match serde_json::from_str::<Value>(&text).map_err(|e| parse(e.to_string()))? {
            Value::Array(a) => a
                .into_iter()
                .enumerate()
                .map(|(i, v)| match v {
                    Value::Object(m) => Ok(m),
                    _ => Err(parse(format!("element {i} is not a JSON object"))),
                })
                .collect(),
            // HF-style `{"data": [...]}` or a column-less single object are not row lists.
            Value::Object(mut m) => match m.remove("data") {
                Some(Value::Array(a)) => a
                    .into_iter()
                    .map(|v| match v {
                        Value::Object(m) => Ok(m),
                        _ => Err(parse("`data` element is not a JSON object".into())),
                    })
                    .collect(),
                _ => Err(parse(
                    "expected a JSON array of objects (or {\"data\": [...]})".into(),
                )),
            },
            _ => Err(parse("expected a JSON array of objects".into())),
        },
        "csv" => {
            let mut reader = csv::ReaderBuilder::new()
                .has_headers(true)
                .from_reader(text.as_bytes());
            let headers = reader.headers().map_err(|e| parse(e.to_string()))?.clone();
            reader
                .records()
                .map(|r| {
                    let r = r.map_err(|e| parse(e.to_string()))?;
                    Ok(headers
                        .iter()
                        .zip(r.iter())
                        .map(|(h, v)| (h.to_string(), Value::String(v.to_string())))
                        .collect())
                })
                .collect()
        }
        other => Err(DataError::UnsupportedFormat {
            path: path.to_path_buf(),
            format: other.to_string(),
            hint: "supported: jsonl, json, csv (optionally .gz)".into(),
        }),
    }
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
