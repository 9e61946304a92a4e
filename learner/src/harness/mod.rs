//! The run harness: what every trainer shares, written once. A trainer implements [`Algorithm`]
//! (its step, its evaluation, its checkpoints); [`drive`] runs it: epochs of the seeded item order,
//! evaluations and checkpoints on their schedule, the control plane and a graceful stop, rank
//! agreement, the end of the run (final models, plots, the `finished` marker) and the summary.
//!
//! - [`schedule`]: where a run stands ([`Cursor`]), which rows a step takes, when evaluations fall;
//! - [`drive`]: the loop;
//! - this module: the trait a trainer implements and what a run returns.
//!
//! GRPO/MAGRPO with IAC/MAAC ([`crate::trainer::Trainer`]) and MaPoRL
//! ([`crate::maporl::MaporlTrainer`]) implement it; `crate::trainers` picks one for a config.

mod drive;
pub mod schedule;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub use drive::drive;
pub use schedule::{Cursor, EvalRule, Schedule, eval_due};

use crate::config::CheckedConfig;
use crate::dist::Collective;
use crate::error::TrainError;

/// One step's (or one evaluation's) scalars, by their `metrics.jsonl` names.
pub type Scalars = BTreeMap<String, f64>;

/// What the harness shows of a step: the line a person reads (progress bar message and the
/// periodic log line), and the figure the control plane reports as the run's reward.
#[derive(Debug, Clone, PartialEq)]
pub struct Headline {
    /// E.g. `reward 0.512, loss 0.0132`.
    pub text: String,
    pub reward: Option<f64>,
}

/// A trainer the harness can run. Implementations keep their own state (weights, optimisers,
/// generators, the metrics file); the harness keeps the order of work.
///
/// A new trainer implements the methods below and adds one arm to `crate::trainers::build`; the
/// loop, the control plane, the schedules and the CLI come with it.
pub trait Algorithm {
    fn config(&self) -> &CheckedConfig;
    fn run_dir(&self) -> &Path;
    fn dist(&self) -> &dyn Collective;
    /// Rows, batch, epochs and the step schedules of this run.
    fn schedule(&self) -> Schedule;
    /// The train split's rows in epoch `epoch`'s order: a pure function of (seed, epoch), so a
    /// resumed run sees the order the uninterrupted one saw.
    fn epoch_order(&self, epoch: u64) -> Vec<usize>;
    /// Where the run stands (after a resume: where its checkpoint stood).
    fn cursor(&self) -> Cursor;
    /// Moves the run on; the harness calls it after every completed step.
    fn set_cursor(&mut self, cursor: Cursor);
    /// Continues the run in `run_dir` from its latest checkpoint (rank 0; [`Algorithm::prepare`]
    /// hands the state to the other ranks); returns the checkpoint.
    fn resume_from(&mut self, run_dir: &Path) -> Result<PathBuf, TrainError>;
    /// Before the first step: every rank holds rank 0's state and the rollout workers serve the
    /// learner's weights. Logs the run's start.
    fn prepare(&mut self) -> Result<(), TrainError>;
    /// The scheduled evaluation (rank 0 only), logged with the step it precedes.
    fn scheduled_eval(&mut self) -> Result<Scalars, TrainError>;
    /// One training step on `rows` of the train split. `next` is the following step's rows
    /// (`None` after the last), for trainers that draw ahead.
    fn run_step(&mut self, rows: &[usize], next: Option<&[usize]>) -> Result<Scalars, TrainError>;
    /// A step failed: the error to return, after whatever the trainer keeps of its state (a
    /// checkpoint of the state before the step, where nothing was updated yet).
    fn step_failed(&mut self, error: TrainError) -> TrainError {
        error
    }
    /// Writes a step's scalars (`metrics.jsonl` on rank 0) and keeps them for the summary.
    fn record(&mut self, values: &Scalars) -> Result<(), TrainError>;
    fn headline(&self, values: &Scalars) -> Headline;
    /// The policy version each served agent (or adapter) is at.
    fn served_versions(&self) -> Vec<(String, u64)>;
    /// Writes `checkpoints/step-N` of the current state (rank 0).
    fn checkpoint(&mut self) -> Result<PathBuf, TrainError>;
    fn last_checkpoint(&self) -> Option<PathBuf>;
    /// Fails when the ranks' trained weights differ.
    fn check_ranks(&self) -> Result<(), TrainError>;
    /// Rank 0, after the last step: what the trainer does at the end of a run (a final
    /// evaluation, final models); returns the model directories written.
    fn finish(&mut self) -> Result<Vec<PathBuf>, TrainError>;
    /// Plots of this trainer's own, drawn after the run's standard ones.
    fn extra_plots(&self) -> Vec<PathBuf> {
        Vec::new()
    }
    /// `learner eval`: loads the weights saved under `path` (a checkpoint, or what the trainer
    /// writes at the end) and serves them; returns the directory `eval.json` goes to.
    fn load_saved(&mut self, path: &Path) -> Result<PathBuf, TrainError>;
    /// `learner eval`: the evaluation of the loaded weights; `ks` are the k of the @k metrics
    /// (trainers without them ignore `ks`).
    fn evaluate_saved(&mut self, ks: &[usize]) -> Result<Scalars, TrainError>;
    /// Every recorded step's scalars, in order.
    fn history(&self) -> &[Scalars];
    /// Evaluations as (step they preceded, scalars), for trainers that keep them apart.
    fn evals(&self) -> Vec<(u64, Scalars)> {
        Vec::new()
    }
}

/// What a finished (or stopped) run leaves behind.
#[derive(Debug, Clone, PartialEq)]
pub struct RunSummary {
    pub run_dir: PathBuf,
    pub steps: u64,
    pub metrics_path: PathBuf,
    pub checkpoint: Option<PathBuf>,
    /// The model directories written at the end (`output.save_final_model`): Hugging Face model
    /// or PEFT adapter directories, MaPoRL's `adapters/` or `final_model/`.
    pub final_models: Vec<PathBuf>,
    pub plots: Vec<PathBuf>,
    /// Every logged step's scalars, in order (what `metrics.jsonl` got).
    pub history: Vec<Scalars>,
    /// Evaluations as (step they preceded, scalars), where the trainer keeps them apart (MaPoRL).
    pub evals: Vec<(u64, Scalars)>,
    /// Stopped on a request (SIGTERM, the control plane) after a checkpoint, before the end.
    pub stopped: bool,
}
