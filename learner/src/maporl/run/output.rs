//! What a MaPoRL run writes besides its metrics: `rollouts.jsonl` (every answer with its PPO
//! inputs) and the policies and critics of a checkpoint or of the end.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use super::super::rollout::Discussion;
use super::super::update::PpoRecord;
use super::MaporlTrainer;
use super::samples::Place;
use crate::error::TrainError;
use crate::prompts::items::TrainItem;

impl MaporlTrainer {
    /// One line per (step, turn, agent, sample) with the PPO inputs (docs/src/trainers/maporl.md).
    pub(super) fn log_rollouts(
        &self,
        items: &[&TrainItem],
        discussions: &[Discussion],
        training_scores: &[Vec<Vec<f64>>],
        where_from: &[Place],
        records: &[PpoRecord],
    ) -> std::io::Result<()> {
        let by_place: BTreeMap<Place, &PpoRecord> =
            where_from.iter().copied().zip(records).collect();
        let path = self.s.run_dir.join("rollouts.jsonl");
        let mut f = std::io::BufWriter::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)?,
        );
        for (q, d) in discussions.iter().enumerate() {
            for (t, row) in d.answers.iter().enumerate() {
                for (i, a) in row.iter().enumerate() {
                    let rec = by_place.get(&(q, t, i));
                    let line = serde_json::json!({
                        "step": self.step + 1,
                        "row": items[q].index,
                        "turn": t,
                        "agent": i,
                        "sample": 0,
                        "adapter": a.adapter,
                        "prompt_tokens": a.prompt.len(),
                        "text": a.text,
                        "tokens": a.tokens,
                        "correct": a.correct,
                        "answer": a.extracted,
                        "invalid": a.invalid.map(|r| r.to_string()),
                        "score": a.score,
                        "training_score": training_scores[q][t][i],
                        "trained": rec.is_some(),
                        "logprobs": rec.map(|r| &r.logprobs),
                        "ref_logprobs": rec.map(|r| &r.ref_logprobs),
                        "values": rec.map(|r| &r.values),
                        "rewards": rec.map(|r| &r.rewards),
                        "advantages": rec.map(|r| &r.advantages),
                        "returns": rec.map(|r| &r.returns),
                    });
                    writeln!(f, "{line}")?;
                }
            }
        }
        f.flush()
    }

    /// Writes every policy (`DIR/<key>/`: PEFT's layout, or a model directory with
    /// `full_finetune`) and the critics (`DIR/<critic key>/` adapter plus `value_head.safetensors`).
    pub fn save_policies(&self, dir: &Path) -> Result<PathBuf, TrainError> {
        for (key, p) in &self.s.adapters.policies {
            p.save(&dir.join(key), &self.s.bases.specs[p.base])?;
        }
        for (key, c) in &self.s.adapters.critics {
            c.save(&dir.join(key), &self.s.bases.specs[c.base])?;
        }
        // Last, so that a directory cut short by a killed process is never taken for a saved one.
        let manifest = crate::export::MaporlManifest {
            policies: self.s.adapters.policies.keys().cloned().collect(),
            critics: self.s.adapters.critics.keys().cloned().collect(),
            full_finetune: self.m.full_finetune,
        };
        let text = serde_json::to_string_pretty(&manifest).expect("a manifest serialises");
        std::fs::write(dir.join(crate::export::MAPORL_MANIFEST), text)
            .map_err(|e| TrainError::Checkpoint(format!("{}: {e}", dir.display())))?;
        Ok(dir.to_path_buf())
    }
}
