//! The run: epochs of seeded item order, steps, evaluations and checkpoints on their schedule,
//! a stop on request, and what the run leaves behind.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use tracing::{info, warn};

use super::evaluate::eval_due;
use super::setup::{RunSummary, TAG_ORDER, Trainer};
use crate::config::CheckedConfig;
use crate::error::TrainError;
use crate::metrics::progress::progress_bar;
use crate::seeds::derive_seed;

impl Trainer {
    /// The rows of one epoch in training order: the dataset's order (as the original), or with
    /// `dataset.shuffle` a seeded permutation that is a pure function of (seed, epoch).
    pub fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.s.train_items.len()).collect();
        if self.s.cfg.raw.dataset.shuffle {
            order.shuffle(&mut ChaCha8Rng::seed_from_u64(derive_seed(&[self.s.cfg.raw.seed, TAG_ORDER, epoch])));
        }
        order
    }

    /// The rows of the step after the one ending at `end` of the current epoch's order (the next
    /// epoch's first step at the end of an epoch), or `None` after the last step of the run.
    pub(super) fn rows_after(&self, end: u64) -> Option<Vec<usize>> {
        let (n, b) = (self.s.train_items.len() as u64, self.b() as u64);
        if self.stop_after_steps.is_some_and(|s| self.step + 1 >= s) {
            return None;
        }
        let (epoch, start) = if end >= n { (self.epoch + 1, 0) } else { (self.epoch, end) };
        if epoch >= self.s.cfg.trainer.num_train_epochs as u64 {
            return None;
        }
        let order = self.epoch_order(epoch);
        Some(order[start as usize..(start + b).min(n) as usize].to_vec())
    }

    /// Runs to the end of the last epoch (or `stop_after_steps`): steps, metrics, checkpoints every
    /// `save_steps` and at the end, evaluation every `eval_interval`, plots at the end.
    pub fn run(&mut self) -> Result<RunSummary, TrainError> {
        let cfg = self.s.cfg.clone();
        let total = self.total_steps();
        let root = self.dist.is_root();
        self.sync_ranks()?;
        let t_sync = self.sync_all_weights()?;
        info!(run_dir = %self.s.run_dir.display(), rollout = %self.s.rollout.describe(), reward = %self.s.reward.describe(),
            steps = total, start_step = self.step, sync_secs = t_sync, rank = self.dist.rank(), ranks = self.dist.world(), "training");
        if root && cfg.raw.model.agents.iter().flatten().any(|a| a.has_overrides()) {
            for (a, s) in cfg.agents.iter().enumerate() {
                info!(agent = a, model = %cfg.agent_models[a], temperature = s.sampling.temperature, top_p = s.sampling.top_p, top_k = s.sampling.top_k,
                    max_new_tokens = s.sampling.max_new_tokens, stop = ?s.stop, learning_rate = s.learning_rate, "per-agent settings");
            }
        }
        let bar = if root { progress_bar(cfg.raw.logging.progress, total, self.step) } else { None };
        let mut stopped_early = false;
        // The control plane (rank 0): status after every step, checkpoints and stops between steps.
        // Every rank's process listens (a SIGTERM does not kill it at once): the other ranks stop
        // when rank 0 says so after the step.
        let installed = crate::control::current();
        if let Some(c) = &installed {
            c.set_run_dir(self.s.run_dir.clone());
            c.trainer_started();
        }
        let control = if root { installed.clone() } else { None };
        let result = self.run_steps(&cfg, total, control.as_deref(), bar.as_ref(), &mut stopped_early);
        if let Some(c) = &installed {
            c.trainer_done(match &result {
                Err(_) => "failed",
                Ok(true) => "stopped",
                Ok(false) => "finishing",
            });
        }
        let stopped_by_request = result?;
        if let Some(pb) = &bar {
            pb.finish();
        }
        if stopped_by_request {
            info!(step = self.step, reason = control.as_ref().and_then(|c| c.stop_reason()).unwrap_or_default(), run_dir = %self.s.run_dir.display(),
                "stopped on request after a checkpoint; continue with `learner train --config ... --resume RUN_DIR`");
            return Ok(self.summary(Vec::new(), Vec::new(), true));
        }
        let mut plots = Vec::new();
        let mut final_models = Vec::new();
        if self.dist.world() > 1 && !stopped_early {
            // The ranks end agreeing, or the run says they did not.
            self.check_ranks_agree()?;
        }
        if !stopped_early && root {
            let saved_now = self.last_checkpoint.as_ref().is_some_and(|d| d.ends_with(format!("step-{}", self.step)));
            if cfg.raw.output.save_final_model {
                // The checkpoint (for resuming) and the models users load, as the original's save_pretrained.
                if !saved_now {
                    self.save_checkpoint()?;
                }
                final_models = self.save_final_models()?;
                for dir in &final_models {
                    info!(model = %dir.display(), "final model saved");
                }
            }
            if cfg.raw.logging.plots {
                match crate::plot::plot_run(&self.s.run_dir) {
                    Ok(p) => plots = p,
                    Err(e) => warn!(error = %e, "plots not drawn"),
                }
            }
        }
        if root {
            crate::run_state::mark_finished(&self.s.run_dir, self.step)?;
        }
        if let Some(c) = &control {
            c.set_state("finished");
        }
        Ok(self.summary(final_models, plots, false))
    }

    pub(super) fn summary(&self, final_models: Vec<PathBuf>, plots: Vec<PathBuf>, stopped: bool) -> RunSummary {
        RunSummary {
            run_dir: self.s.run_dir.clone(),
            steps: self.step,
            metrics_path: self.s.run_dir.join(crate::metrics::METRICS_FILE),
            checkpoint: self.last_checkpoint.clone(),
            final_models,
            plots,
            history: self.history.clone(),
            stopped,
        }
    }

    /// The step loop of [`Self::run`]; returns whether it stopped on a request (after a checkpoint).
    pub(super) fn run_steps(
        &mut self,
        cfg: &CheckedConfig,
        total: u64,
        control: Option<&crate::control::ControlState>,
        bar: Option<&indicatif::ProgressBar>,
        stopped_early: &mut bool,
    ) -> Result<bool, TrainError> {
        let root = self.dist.is_root();
        let checksum_steps = cfg.raw.learner.checksum_steps;
        let n_items = self.s.train_items.len() as u64;
        let b = self.b() as u64;
        while self.epoch < cfg.trainer.num_train_epochs as u64 {
            if self.stop_after_steps.is_some_and(|s| self.step >= s) {
                *stopped_early = true;
                break;
            }
            let step_started = Instant::now();
            // The epoch's order is a pure function of (seed, epoch): a resumed run sees the same one.
            let order = self.epoch_order(self.epoch);
            let end = (self.position + b).min(n_items);
            let rows: Vec<usize> = order[self.position as usize..end as usize].to_vec();
            // The original evaluates before training on item i of an epoch when i is a multiple of
            // eval_interval (so also before the first item); a step of several items evaluates once
            // when its items contain such an i.
            // Rank 0 evaluates; the other ranks go on to their share of the step.
            let step = (|| {
                let eval = if root && eval_due(cfg.trainer.eval_interval as u64, self.position, end) { Some(self.evaluate(1, &[1])?) } else { None };
                let mut values = if cfg.raw.rollout.max_off_policy_steps > 0 {
                    let next = self.rows_after(end);
                    self.train_step_async(&rows, next.as_deref())?
                } else {
                    self.train_step(&rows)?
                };
                values.extend(eval.unwrap_or_default());
                Ok(values)
            })();
            let values = match step {
                Ok(v) => v,
                // The reward server fails before the step updates anything (rewards come before the
                // update), so the state is still the previous step's: keep it in a checkpoint. (Not
                // when items train one after another and an earlier item of the step updated.)
                Err(e @ TrainError::Reward(_)) if self.dist.world() == 1 && cfg.raw.rollout.max_off_policy_steps == 0 && !self.updated_mid_step => {
                    return Err(self.checkpoint_before_failing(e));
                }
                Err(e) => return Err(e),
            };
            self.position = end;
            self.step += 1;
            if self.position >= n_items {
                self.epoch += 1;
                self.position = 0;
            }
            if checksum_steps > 0 && self.step.is_multiple_of(checksum_steps) {
                self.check_ranks_agree()?;
            }
            // Rank 0 logs, reports and checkpoints, then tells every rank whether the job goes
            // on, stops on request, or stops because rank 0 failed (so that no rank waits in a
            // collective for a rank that has left).
            let finished = if root { self.finish_step_on_root(cfg, total, control, bar, &values, step_started) } else { Ok(false) };
            let code = match &finished {
                Ok(false) => 0,
                Ok(true) => 1,
                Err(_) => 2,
            };
            match (self.dist.broadcast_u64(code, 0)?, finished) {
                (_, Err(e)) => return Err(e),
                (0, _) => {}
                (1, _) => return Ok(true),
                (_, _) => return Err(TrainError::Dist(format!("rank 0 failed after step {}; its log says why", self.step))),
            }
        }
        Ok(false)
    }

    /// Rank 0's end of a step: metrics, progress, the control plane's report and requests,
    /// checkpoints; returns whether a stop was asked.
    pub(super) fn finish_step_on_root(
        &mut self,
        cfg: &CheckedConfig,
        total: u64,
        control: Option<&crate::control::ControlState>,
        bar: Option<&indicatif::ProgressBar>,
        values: &BTreeMap<String, f64>,
        step_started: Instant,
    ) -> Result<bool, TrainError> {
        self.log(values)?;
        let reward = values.get("reward/mean").copied().unwrap_or(f64::NAN);
        let loss = values.get("loss").copied().unwrap_or(f64::NAN);
        match bar {
            Some(pb) => {
                pb.set_position(self.step);
                pb.set_message(format!("reward {reward:.3} loss {loss:.3}"));
            }
            None => {
                if self.step.is_multiple_of(cfg.trainer.logging_steps.max(1) as u64) || self.step == total {
                    // One line a person reads; every scalar of the step at debug (and in metrics.jsonl).
                    let secs = values.get("time/step").copied().unwrap_or(0.0);
                    info!("step {}/{total}: reward {reward:.3}, loss {loss:.4}, {secs:.1} s", self.step);
                    tracing::debug!(step = self.step, scalars = ?values, "step scalars");
                }
            }
        }
        let scheduled = cfg.trainer.save_steps > 0 && self.step.is_multiple_of(cfg.trainer.save_steps as u64);
        let asked = match control {
            Some(c) => c.between_steps(crate::control::StepReport {
                step: self.step,
                total_steps: total,
                epoch: self.epoch,
                total_epochs: cfg.trainer.num_train_epochs as u64,
                reward: reward.is_finite().then_some(reward),
                step_secs: step_started.elapsed().as_secs_f64(),
                policy_versions: self.s.policies.iter().map(|p| (p.worker_agent.clone(), p.wire_version)).collect(),
            }),
            None => Default::default(),
        };
        if scheduled || asked.checkpoint || asked.stop {
            match self.save_checkpoint() {
                Ok(dir) => {
                    info!(step = self.step, checkpoint = %dir.display(), requested = asked.checkpoint || asked.stop, "checkpoint saved");
                    if let Some(c) = control {
                        c.checkpoint_written(self.step, &dir);
                    }
                }
                Err(e) => {
                    if let Some(c) = control {
                        c.checkpoint_failed(&e.to_string());
                    }
                    return Err(e);
                }
            }
        }
        Ok(asked.stop)
    }
}
