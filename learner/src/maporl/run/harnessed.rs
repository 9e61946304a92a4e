//! MaPoRL in the run harness ([`crate::harness`]): every epoch a fresh seeded order of the
//! questions, `questions_per_step` of them a step, evaluation before every `eval_interval`-th step
//! and at the end, the final policies in PEFT's layout and the accuracy-per-turn plot.

use std::path::{Path, PathBuf};

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use tracing::info;

use super::{MaporlTrainer, TAG_ORDER};
use crate::config::CheckedConfig;
use crate::dist::Collective;
use crate::error::TrainError;
use crate::harness::{Algorithm, Cursor, EvalRule, Headline, RunSummary, Scalars, Schedule};
use crate::prompts::items::TrainItem;
use crate::seeds::derive_seed;

impl MaporlTrainer {
    /// The whole run, in the harness.
    pub fn run(&mut self) -> Result<RunSummary, TrainError> {
        crate::harness::drive(self)
    }

    /// The evaluation, kept for the accuracy plot when it has scalars.
    fn evaluate_and_keep(&mut self) -> Result<Scalars, TrainError> {
        let e = self.evaluate()?;
        if !e.is_empty() {
            self.evals.push((self.step, e.clone()));
        }
        Ok(e)
    }
}

impl Algorithm for MaporlTrainer {
    fn config(&self) -> &CheckedConfig {
        &self.s.cfg
    }

    fn run_dir(&self) -> &Path {
        &self.s.run_dir
    }

    fn dist(&self) -> &dyn Collective {
        self.dist.as_ref()
    }

    fn schedule(&self) -> Schedule {
        Schedule {
            items: self.s.train_items.len() as u64,
            batch: self.m.questions_per_step() as u64,
            epochs: self.m.num_train_epochs as u64,
            eval: EvalRule::EverySteps(self.m.eval_interval as u64),
            save_steps: self.m.save_steps as u64,
            logging_steps: self.m.logging_steps as u64,
            checksum_steps: self.s.cfg.raw.learner.checksum_steps,
            stop_after_steps: None,
        }
    }

    /// Every epoch its own seeded order, as MaPoRL shuffles its questions.
    fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.s.train_items.len()).collect();
        order.shuffle(&mut ChaCha8Rng::seed_from_u64(derive_seed(&[
            self.s.cfg.raw.seed,
            TAG_ORDER,
            epoch,
        ])));
        order
    }

    /// A MaPoRL checkpoint keeps the step; the place in the epoch follows from it.
    fn cursor(&self) -> Cursor {
        self.schedule().cursor_at(self.step)
    }

    fn set_cursor(&mut self, c: Cursor) {
        self.step = c.step;
    }

    fn resume_from(&mut self, run_dir: &Path) -> Result<PathBuf, TrainError> {
        self.resume(run_dir)
    }

    fn prepare(&mut self) -> Result<(), TrainError> {
        self.sync_ranks()?;
        self.sync_all()?;
        info!(run_dir = %self.s.run_dir.display(), rollout = %self.s.rollout.describe(), reward = %self.s.reward.describe(),
            steps = self.total_steps(), start_step = self.step, adapters = self.s.adapters.policies.len(),
            critics = self.s.adapters.critics.len(), "MaPoRL training");
        Ok(())
    }

    fn scheduled_eval(&mut self) -> Result<Scalars, TrainError> {
        self.evaluate_and_keep()
    }

    fn run_step(&mut self, rows: &[usize], _next: Option<&[usize]>) -> Result<Scalars, TrainError> {
        let items: Vec<TrainItem> = rows
            .iter()
            .map(|&k| self.s.train_items[k].clone())
            .collect();
        let refs: Vec<&TrainItem> = items.iter().collect();
        let total = self.total_steps();
        self.train_step(&refs, total)
    }

    fn record(&mut self, values: &Scalars) -> Result<(), TrainError> {
        self.log(values)
    }

    fn headline(&self, values: &Scalars) -> Headline {
        let acc_last = values
            .get(&format!("accuracy/turn{}", self.m.round_num - 1))
            .copied()
            .unwrap_or(f64::NAN);
        let kl = values.get("objective/kl").copied().unwrap_or(f64::NAN);
        Headline {
            text: format!("last-turn accuracy {acc_last:.3}, kl {kl:.4}"),
            reward: Some(acc_last),
        }
    }

    fn served_versions(&self) -> Vec<(String, u64)> {
        self.versions().into_iter().collect()
    }

    fn checkpoint(&mut self) -> Result<PathBuf, TrainError> {
        let dir = self.save_checkpoint()?;
        crate::checkpoint::apply_save_total_limit(
            &self.s.run_dir,
            self.s.cfg.raw.output.save_total_limit,
        );
        self.last_checkpoint = Some(dir.clone());
        Ok(dir)
    }

    fn last_checkpoint(&self) -> Option<PathBuf> {
        self.last_checkpoint.clone()
    }

    fn check_ranks(&self) -> Result<(), TrainError> {
        if self.dist.world() == 1 {
            return Ok(());
        }
        for (key, p) in &self.s.adapters.policies {
            crate::dist::check_same(
                self.dist.as_ref(),
                &format!("adapter `{key}` after step {}", self.step),
                &p.optimizer.parameters(),
            )?;
        }
        Ok(())
    }

    /// The final evaluation (logged as one more line of `metrics.jsonl`) and the final policies.
    fn finish(&mut self) -> Result<Vec<PathBuf>, TrainError> {
        let e = self.evaluate_and_keep()?;
        if !e.is_empty() {
            self.log(&e)?;
        }
        if !self.s.cfg.raw.output.save_final_model {
            return Ok(Vec::new());
        }
        let name = if self.m.full_finetune {
            "final_model"
        } else {
            "adapters"
        };
        Ok(vec![self.save_policies(&self.s.run_dir.join(name))?])
    }

    fn extra_plots(&self) -> Vec<PathBuf> {
        crate::maporl::plot::accuracy_per_turn(&self.s.run_dir, &self.evals, self.m.round_num)
            .into_iter()
            .collect()
    }

    /// The policies saved under `path` (a run directory, its `adapters/` or `final_model/`, or a
    /// `checkpoints/step-N/`), evaluated at the step they were saved at.
    fn load_saved(&mut self, path: &Path) -> Result<PathBuf, TrainError> {
        let dir = super::saved::saved_policies_dir(path)?;
        self.load_saved_policies(&dir)?;
        info!(policies = %dir.display(), "evaluating saved MaPoRL policies");
        Ok(dir)
    }

    /// One discussion per question, as the run evaluates (`ks` does not apply).
    fn evaluate_saved(&mut self, _ks: &[usize]) -> Result<Scalars, TrainError> {
        self.evaluate_loaded()
    }

    fn history(&self) -> &[Scalars] {
        &self.history
    }

    fn evals(&self) -> Vec<(u64, Scalars)> {
        self.evals.clone()
    }
}
