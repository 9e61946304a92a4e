//! The loop every trainer runs in: steps over the epochs' orders, the scheduled evaluations,
//! metrics and progress, the control plane's requests and checkpoints between steps, rank 0
//! telling the other ranks whether the job goes on, and the end of the run.

use std::time::Instant;

use tracing::{debug, info, warn};

use super::schedule::{Schedule, rows};
use super::{Algorithm, RunSummary, Scalars};
use crate::control::{ControlState, StepReport};
use crate::error::TrainError;
use crate::metrics::progress::progress_bar;

/// How the steps ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ended {
    /// The last step of the last epoch is done.
    Complete,
    /// `stop_after_steps` (as if the process were killed: no end-of-run work).
    Cut,
    /// A stop was asked (a signal, `learner control stop`), after a checkpoint.
    Requested,
}

/// What rank 0 tells the other ranks after every step.
const GO_ON: u64 = 0;
const STOP_REQUESTED: u64 = 1;
const ROOT_FAILED: u64 = 2;

/// Runs `alg` from where it stands to the end of its last epoch (or a stop): see the module docs.
pub fn drive(alg: &mut dyn Algorithm) -> Result<RunSummary, TrainError> {
    let schedule = alg.schedule();
    let root = alg.dist().is_root();
    alg.prepare()?;
    let bar = if root {
        progress_bar(
            alg.config().raw.logging.progress,
            schedule.total_steps(),
            alg.cursor().step,
        )
    } else {
        None
    };
    // The control plane: status after every step, checkpoints and stops between steps (rank 0).
    // Every rank's process listens (a SIGTERM does not kill it at once): the other ranks stop when
    // rank 0 says so after the step.
    let installed = crate::control::current();
    if let Some(c) = &installed {
        c.set_run_dir(alg.run_dir().to_path_buf());
        c.trainer_started();
    }
    let control = if root { installed.clone() } else { None };
    let result = run_steps(alg, &schedule, control.as_deref(), bar.as_ref());
    if let Some(c) = &installed {
        c.trainer_done(match &result {
            Err(_) => "failed",
            Ok(Ended::Requested) => "stopped",
            Ok(_) => "finishing",
        });
    }
    let ended = result?;
    if let Some(pb) = &bar {
        pb.finish();
    }
    let step = alg.cursor().step;
    if ended == Ended::Requested {
        let reason = control
            .as_ref()
            .and_then(|c| c.stop_reason())
            .unwrap_or_default();
        info!(step, reason, run_dir = %alg.run_dir().display(),
            "stopped on request after a checkpoint; continue with `learner train --config ... --resume RUN_DIR`");
        return Ok(summary(alg, Vec::new(), Vec::new(), true));
    }
    let (mut final_models, mut plots) = (Vec::new(), Vec::new());
    if ended == Ended::Complete {
        if alg.dist().world() > 1 {
            // The ranks end agreeing, or the run says they did not.
            alg.check_ranks()?;
        }
        if root {
            final_models = alg.finish()?;
            for dir in &final_models {
                info!(model = %dir.display(), "final model saved");
            }
            if alg.config().raw.logging.plots {
                match crate::plot::plot_run(alg.run_dir()) {
                    Ok(p) => plots = p,
                    Err(e) => warn!(error = %e, "plots not drawn"),
                }
                plots.extend(alg.extra_plots());
            }
            crate::run_state::mark_finished(alg.run_dir(), step)?;
        }
        if let Some(c) = &control {
            c.set_state("finished");
        }
    }
    Ok(summary(alg, final_models, plots, false))
}

fn summary(
    alg: &dyn Algorithm,
    final_models: Vec<std::path::PathBuf>,
    plots: Vec<std::path::PathBuf>,
    stopped: bool,
) -> RunSummary {
    RunSummary {
        run_dir: alg.run_dir().to_path_buf(),
        steps: alg.cursor().step,
        metrics_path: alg.run_dir().join(crate::metrics::METRICS_FILE),
        checkpoint: alg.last_checkpoint(),
        final_models,
        plots,
        history: alg.history().to_vec(),
        evals: alg.evals(),
        stopped,
    }
}

/// The steps from the cursor on.
fn run_steps(
    alg: &mut dyn Algorithm,
    s: &Schedule,
    control: Option<&ControlState>,
    bar: Option<&indicatif::ProgressBar>,
) -> Result<Ended, TrainError> {
    let root = alg.dist().is_root();
    loop {
        let at = alg.cursor();
        if at.epoch >= s.epochs {
            return Ok(Ended::Complete);
        }
        if !s.has_step(at) {
            return Ok(Ended::Cut);
        }
        let started = Instant::now();
        // The epoch's order is a pure function of (seed, epoch): a resumed run sees the same one.
        let this = rows(&alg.epoch_order(at.epoch), s, at);
        let after = s.advance(at);
        let step = (|| {
            // Rank 0 evaluates; the other ranks go on to their share of the step.
            let eval = if root && s.eval_before(at) {
                Some(alg.scheduled_eval()?)
            } else {
                None
            };
            let next = s
                .has_step(after)
                .then(|| rows(&alg.epoch_order(after.epoch), s, after));
            let mut values = alg.run_step(&this, next.as_deref())?;
            values.extend(eval.unwrap_or_default());
            Ok(values)
        })();
        let values = step.map_err(|e| alg.step_failed(e))?;
        alg.set_cursor(after);
        if s.check_after(after.step) {
            alg.check_ranks()?;
        }
        // Rank 0 logs, reports and checkpoints, then tells every rank whether the job goes on,
        // stops on request, or stops because rank 0 failed (so that no rank waits in a collective
        // for a rank that has left).
        let finished = if root {
            finish_step_on_root(alg, s, control, bar, &values, started)
        } else {
            Ok(false)
        };
        let code = match &finished {
            Ok(false) => GO_ON,
            Ok(true) => STOP_REQUESTED,
            Err(_) => ROOT_FAILED,
        };
        match (alg.dist().broadcast_u64(code, 0)?, finished) {
            (_, Err(e)) => return Err(e),
            (GO_ON, _) => {}
            (STOP_REQUESTED, _) => return Ok(Ended::Requested),
            (_, _) => {
                return Err(TrainError::Dist(format!(
                    "rank 0 failed after step {}; its log says why",
                    after.step
                )));
            }
        }
    }
}

/// Rank 0's end of a step: metrics, progress, the control plane's report and requests,
/// checkpoints; returns whether a stop was asked.
fn finish_step_on_root(
    alg: &mut dyn Algorithm,
    s: &Schedule,
    control: Option<&ControlState>,
    bar: Option<&indicatif::ProgressBar>,
    values: &Scalars,
    started: Instant,
) -> Result<bool, TrainError> {
    alg.record(values)?;
    let at = alg.cursor();
    let total = s.total_steps();
    let head = alg.headline(values);
    match bar {
        Some(pb) => {
            pb.set_position(at.step);
            pb.set_message(head.text.clone());
        }
        None if s.log_after(at.step) => {
            // One line a person reads; every scalar of the step at debug (and in metrics.jsonl).
            let secs = values.get("time/step").copied().unwrap_or(0.0);
            info!("step {}/{total}: {}, {secs:.1} s", at.step, head.text);
            debug!(step = at.step, scalars = ?values, "step scalars");
        }
        None => {}
    }
    let asked = match control {
        Some(c) => c.between_steps(StepReport {
            step: at.step,
            total_steps: total,
            epoch: at.epoch,
            total_epochs: s.epochs,
            reward: head.reward.filter(|r| r.is_finite()),
            step_secs: started.elapsed().as_secs_f64(),
            policy_versions: alg.served_versions(),
        }),
        None => Default::default(),
    };
    if s.save_after(at.step) || asked.checkpoint || asked.stop {
        match alg.checkpoint() {
            Ok(dir) => {
                info!(step = at.step, checkpoint = %dir.display(), requested = asked.checkpoint || asked.stop, "checkpoint saved");
                if let Some(c) = control {
                    c.checkpoint_written(at.step, &dir);
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
