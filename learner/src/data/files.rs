//! Finding and reading a dataset's files: a local path, the shipped `data/` folder, or the local
//! Hugging Face hub cache; jsonl, json and csv, optionally gzip-compressed.

use std::io::Read;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::{DataError, DatasetConfig, DatasetKind, data_dir};

/// A split's rows as JSON objects.
pub type Rows = Vec<Map<String, Value>>;

/// The full split's rows as JSON objects, with the file they came from and the row number of the
/// first one in that file (TLDR's test split starts mid-file).
pub(super) fn raw_rows(
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
