//! Run metrics: one JSON object per step in `metrics.jsonl`, and the same scalars in a TensorBoard
//! event file.

pub mod progress;
mod tfevents;

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

pub use tfevents::{EventWriter, crc32c, masked_crc32c};

/// The metrics file of a run directory.
pub const METRICS_FILE: &str = "metrics.jsonl";

/// One step's scalars.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MetricsRecord {
    pub step: u64,
    /// Seconds since the Unix epoch.
    pub time: f64,
    #[serde(flatten)]
    pub values: BTreeMap<String, f64>,
}

/// Drops the lines of a JSONL log (`metrics.jsonl`, `rollouts.jsonl`) whose `step` is after `step`
/// (and unreadable ones: a line cut by a kill), so that a run resumed from the checkpoint of `step`
/// logs each step once. Rewritten through a temporary file and a rename, so a kill leaves the old
/// or the new file; a missing file has nothing to drop. Returns the number of lines dropped.
pub fn truncate_jsonl_after(path: &std::path::Path, step: u64) -> std::io::Result<usize> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    let keep: Vec<&str> = text
        .lines()
        .filter(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .ok()
                .and_then(|v| v.get("step").and_then(|s| s.as_u64()))
                .is_some_and(|s| s <= step)
        })
        .collect();
    let dropped = text.lines().count() - keep.len();
    if dropped > 0 {
        let tmp = path.with_extension("jsonl.tmp");
        let mut body = keep.join("\n");
        if !body.is_empty() {
            body.push('\n');
        }
        std::fs::write(&tmp, body)?;
        File::open(&tmp)?.sync_all()?;
        std::fs::rename(&tmp, path)?;
    }
    Ok(dropped)
}

/// Writes `metrics.jsonl` (appending, so a resumed run continues the same file) and, optionally, a
/// TensorBoard event file in the run directory.
pub struct MetricsWriter {
    jsonl: File,
    events: Option<EventWriter>,
    path: PathBuf,
}

impl MetricsWriter {
    pub fn create(run_dir: &Path, tensorboard: bool) -> std::io::Result<Self> {
        std::fs::create_dir_all(run_dir)?;
        let path = run_dir.join(METRICS_FILE);
        let jsonl = OpenOptions::new().create(true).append(true).open(&path)?;
        let events = if tensorboard {
            Some(EventWriter::create(run_dir)?)
        } else {
            None
        };
        Ok(Self {
            jsonl,
            events,
            path,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Drops the records of steps after `step` (and a torn last line): a run resumed from the
    /// checkpoint of `step` logs those steps again, and the file must hold each step once. The file
    /// is rewritten through a temporary file and a rename, so a kill leaves the old or the new one.
    pub fn truncate_after(&mut self, step: u64) -> std::io::Result<usize> {
        let dropped = truncate_jsonl_after(&self.path, step)?;
        if dropped > 0 {
            self.jsonl = OpenOptions::new().append(true).open(&self.path)?;
        }
        Ok(dropped)
    }

    /// Appends one step. Non-finite values are written as JSON null in the JSONL file (JSON has no NaN)
    /// and skipped in TensorBoard.
    pub fn log(&mut self, step: u64, values: &BTreeMap<String, f64>) -> std::io::Result<()> {
        let time = now_secs();
        let mut obj = serde_json::Map::new();
        obj.insert("step".into(), step.into());
        obj.insert(
            "time".into(),
            serde_json::Number::from_f64(time)
                .map(Into::into)
                .unwrap_or(serde_json::Value::Null),
        );
        for (k, v) in values {
            obj.insert(
                k.clone(),
                serde_json::Number::from_f64(*v)
                    .map(Into::into)
                    .unwrap_or(serde_json::Value::Null),
            );
        }
        writeln!(self.jsonl, "{}", serde_json::Value::Object(obj))?;
        self.jsonl.flush()?;
        if let Some(ev) = &mut self.events {
            let finite: Vec<(&str, f32)> = values
                .iter()
                .filter(|(_, v)| v.is_finite())
                .map(|(k, v)| (k.as_str(), *v as f32))
                .collect();
            ev.write_scalars(step as i64, time, &finite)?;
        }
        Ok(())
    }
}

pub(crate) fn now_secs() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Reads a `metrics.jsonl` back (nulls are dropped from a record's values).
pub fn read_metrics(path: &Path) -> std::io::Result<Vec<MetricsRecord>> {
    let file = File::open(path)?;
    let mut out = Vec::new();
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(&line).map_err(|e| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{}: line {}: {e}", path.display(), i + 1),
            )
        })?;
        let Some(obj) = v.as_object() else { continue };
        let step = obj.get("step").and_then(|s| s.as_u64()).unwrap_or(i as u64);
        let time = obj.get("time").and_then(|s| s.as_f64()).unwrap_or(0.0);
        let values = obj
            .iter()
            .filter(|(k, _)| *k != "step" && *k != "time")
            .filter_map(|(k, v)| v.as_f64().map(|x| (k.clone(), x)))
            .collect();
        out.push(MetricsRecord { step, time, values });
    }
    Ok(out)
}

/// The mean of `v` (0 when empty).
pub fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_round_trip_and_nan_becomes_null() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = MetricsWriter::create(dir.path(), true).unwrap();
        let mut v = BTreeMap::new();
        v.insert("reward/mean".to_string(), 1.5);
        v.insert("loss".to_string(), f64::NAN);
        w.log(3, &v).unwrap();
        drop(w);
        let text = std::fs::read_to_string(dir.path().join(METRICS_FILE)).unwrap();
        assert!(
            text.contains("\"loss\":null") && text.contains("\"reward/mean\":1.5"),
            "{text}"
        );
        let back = read_metrics(&dir.path().join(METRICS_FILE)).unwrap();
        assert_eq!(back.len(), 1);
        assert_eq!(back[0].step, 3);
        assert_eq!(back[0].values.get("reward/mean"), Some(&1.5));
        assert!(!back[0].values.contains_key("loss"));
        let events: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with("events.out.tfevents.")
            })
            .collect();
        assert_eq!(events.len(), 1);
    }

    #[test]
    fn a_resumed_run_drops_the_steps_after_its_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = MetricsWriter::create(dir.path(), false).unwrap();
        let v: BTreeMap<String, f64> = [("reward/mean".to_string(), 1.0)].into();
        for step in 1..=5 {
            w.log(step, &v).unwrap();
        }
        drop(w);
        let path = dir.path().join(METRICS_FILE);
        // A kill in the middle of a line.
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b"{\"step\":6,\"ti")
            .unwrap();
        let mut w = MetricsWriter::create(dir.path(), false).unwrap();
        assert_eq!(w.truncate_after(3).unwrap(), 3);
        w.log(4, &v).unwrap();
        let steps: Vec<u64> = read_metrics(&path)
            .unwrap()
            .iter()
            .map(|r| r.step)
            .collect();
        assert_eq!(steps, vec![1, 2, 3, 4]);
    }
}
