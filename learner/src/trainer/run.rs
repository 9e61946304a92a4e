//! The trainer in the run harness ([`crate::harness`]): its epoch order, schedule, start, steps and
//! end. The loop itself is the harness's.

use std::path::{Path, PathBuf};

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use tracing::info;

use super::setup::{TAG_ORDER, Trainer};
use crate::config::CheckedConfig;
use crate::dist::Collective;
use crate::error::TrainError;
use crate::harness::{Algorithm, Cursor, EvalRule, Headline, RunSummary, Scalars, Schedule};
use crate::seeds::derive_seed;

impl Trainer {
    /// The rows of one epoch in training order: the dataset's order (as the original), or with
    /// `dataset.shuffle` a seeded permutation that is a pure function of (seed, epoch).
    pub fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.s.train_items.len()).collect();
        if self.s.cfg.raw.dataset.shuffle {
            order.shuffle(&mut ChaCha8Rng::seed_from_u64(derive_seed(&[
                self.s.cfg.raw.seed,
                TAG_ORDER,
                epoch,
            ])));
        }
        order
    }

    /// Runs to the end of the last epoch (or `stop_after_steps`) in the harness: steps, metrics,
    /// checkpoints every `save_steps` and at the end, evaluation every `eval_interval`, plots at
    /// the end.
    pub fn run(&mut self) -> Result<RunSummary, TrainError> {
        crate::harness::drive(self)
    }
}

impl Algorithm for Trainer {
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
        let t = &self.s.cfg.trainer;
        Schedule {
            items: self.s.train_items.len() as u64,
            batch: self.b() as u64,
            epochs: t.num_train_epochs as u64,
            eval: EvalRule::BeforeItems(t.eval_interval as u64),
            save_steps: t.save_steps as u64,
            logging_steps: t.logging_steps as u64,
            checksum_steps: self.s.cfg.raw.learner.checksum_steps,
            stop_after_steps: self.stop_after_steps,
        }
    }

    fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        Trainer::epoch_order(self, epoch)
    }

    fn cursor(&self) -> Cursor {
        Cursor {
            step: self.step,
            epoch: self.epoch,
            position: self.position,
        }
    }

    fn set_cursor(&mut self, c: Cursor) {
        (self.step, self.epoch, self.position) = (c.step, c.epoch, c.position);
    }

    fn resume_from(&mut self, run_dir: &Path) -> Result<PathBuf, TrainError> {
        self.resume(run_dir)
    }

    fn prepare(&mut self) -> Result<(), TrainError> {
        self.sync_ranks()?;
        let t_sync = self.sync_all_weights()?;
        let cfg = &self.s.cfg;
        info!(run_dir = %self.s.run_dir.display(), rollout = %self.s.rollout.describe(), reward = %self.s.reward.describe(),
            steps = self.total_steps(), start_step = self.step, sync_secs = t_sync, rank = self.dist.rank(), ranks = self.dist.world(), "training");
        if self.dist.is_root()
            && cfg
                .raw
                .model
                .agents
                .iter()
                .flatten()
                .any(|a| a.has_overrides())
        {
            for (a, s) in cfg.agents.iter().enumerate() {
                info!(agent = a, model = %cfg.agent_models[a], temperature = s.sampling.temperature, top_p = s.sampling.top_p, top_k = s.sampling.top_k,
                    max_new_tokens = s.sampling.max_new_tokens, stop = ?s.stop, learning_rate = s.learning_rate, "per-agent settings");
            }
        }
        Ok(())
    }

    fn scheduled_eval(&mut self) -> Result<Scalars, TrainError> {
        self.evaluate(1, &[1])
    }

    fn run_step(&mut self, rows: &[usize], next: Option<&[usize]>) -> Result<Scalars, TrainError> {
        if self.s.cfg.raw.rollout.max_off_policy_steps > 0 {
            self.train_step_async(rows, next)
        } else {
            self.train_step(rows)
        }
    }

    fn step_failed(&mut self, e: TrainError) -> TrainError {
        // The reward server fails before the step updates anything (rewards come before the
        // update), so the state is still the previous step's: keep it in a checkpoint. (Not when
        // items train one after another and an earlier item of the step updated.)
        match e {
            TrainError::Reward(_)
                if self.dist.world() == 1
                    && self.s.cfg.raw.rollout.max_off_policy_steps == 0
                    && !self.updated_mid_step =>
            {
                self.checkpoint_before_failing(e)
            }
            e => e,
        }
    }

    fn record(&mut self, values: &Scalars) -> Result<(), TrainError> {
        self.log(values)
    }

    fn headline(&self, values: &Scalars) -> Headline {
        let reward = values.get("reward/mean").copied().unwrap_or(f64::NAN);
        let loss = values.get("loss").copied().unwrap_or(f64::NAN);
        Headline {
            text: format!("reward {reward:.3}, loss {loss:.4}"),
            reward: Some(reward),
        }
    }

    fn served_versions(&self) -> Vec<(String, u64)> {
        self.s
            .policies
            .iter()
            .map(|p| (p.worker_agent.clone(), p.wire_version))
            .collect()
    }

    fn checkpoint(&mut self) -> Result<PathBuf, TrainError> {
        self.save_checkpoint()
    }

    fn last_checkpoint(&self) -> Option<PathBuf> {
        self.last_checkpoint.clone()
    }

    fn check_ranks(&self) -> Result<(), TrainError> {
        self.check_ranks_agree()
    }

    fn finish(&mut self) -> Result<Vec<PathBuf>, TrainError> {
        if !self.s.cfg.raw.output.save_final_model {
            return Ok(Vec::new());
        }
        // The checkpoint (for resuming) and the models users load, as the original's save_pretrained.
        let saved_now = self
            .last_checkpoint
            .as_ref()
            .is_some_and(|d| d.ends_with(format!("step-{}", self.step)));
        if !saved_now {
            self.save_checkpoint()?;
        }
        self.save_final_models()
    }

    /// A checkpoint's weights into fresh policies (no optimiser state is read), pushed to the
    /// workers.
    fn load_saved(&mut self, path: &Path) -> Result<PathBuf, TrainError> {
        self.restore_weights(path)?;
        self.sync_all_weights()?;
        Ok(path.to_path_buf())
    }

    /// max(ks) joint samples per item of the eval split, and the @k metrics of each k.
    fn evaluate_saved(&mut self, ks: &[usize]) -> Result<Scalars, TrainError> {
        let samples = ks.iter().copied().max().unwrap_or(1).max(1);
        self.evaluate(samples, ks)
    }

    fn history(&self) -> &[Scalars] {
        &self.history
    }
}
