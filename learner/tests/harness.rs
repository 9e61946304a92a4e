//! The run harness through `harness::drive`, with a trainer that has no model: the order of work a
//! new trainer (the preference trainers) gets by implementing `Algorithm`: every row of every
//! epoch once, evaluations and checkpoints on their schedules, the end of the run once, a cut run
//! resumed from its checkpoint doing exactly the uninterrupted run's remaining steps, and a failed
//! step reaching the trainer's `step_failed`.

use std::path::{Path, PathBuf};

use cotrain_learner::config::{CheckedConfig, LegacyFlags, load_config};
use cotrain_learner::dist::{Collective, SingleRank};
use cotrain_learner::error::TrainError;
use cotrain_learner::harness::{
    Algorithm, Cursor, EvalRule, Headline, RunSummary, Scalars, Schedule, drive,
};

fn config() -> CheckedConfig {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/demo.yaml");
    let overrides = [
        "logging.plots=false".to_string(),
        "logging.progress=never".to_string(),
    ];
    load_config(&path, &overrides, &LegacyFlags::default()).unwrap()
}

/// Seven rows, three a step, two epochs; the second epoch in reverse order.
struct Toy {
    cfg: CheckedConfig,
    run_dir: PathBuf,
    dist: SingleRank,
    schedule: Schedule,
    cursor: Cursor,
    /// (step, rows) of every step run.
    steps: Vec<(u64, Vec<usize>)>,
    /// The step each evaluation preceded.
    evals: Vec<u64>,
    checkpoints: Vec<u64>,
    finished: usize,
    history: Vec<Scalars>,
    fail_at_step: Option<u64>,
    failures_seen: usize,
}

impl Toy {
    fn new(run_dir: &Path) -> Self {
        Toy {
            cfg: config(),
            run_dir: run_dir.to_path_buf(),
            dist: SingleRank,
            schedule: Schedule {
                items: 7,
                batch: 3,
                epochs: 2,
                eval: EvalRule::BeforeItems(4),
                save_steps: 2,
                logging_steps: 1,
                checksum_steps: 0,
                stop_after_steps: None,
            },
            cursor: Cursor::default(),
            steps: Vec::new(),
            evals: Vec::new(),
            checkpoints: Vec::new(),
            finished: 0,
            history: Vec::new(),
            fail_at_step: None,
            failures_seen: 0,
        }
    }
}

impl Algorithm for Toy {
    fn config(&self) -> &CheckedConfig {
        &self.cfg
    }
    fn run_dir(&self) -> &Path {
        &self.run_dir
    }
    fn dist(&self) -> &dyn Collective {
        &self.dist
    }
    fn schedule(&self) -> Schedule {
        self.schedule
    }
    fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        let order: Vec<usize> = (0..7).collect();
        if epoch % 2 == 1 {
            order.into_iter().rev().collect()
        } else {
            order
        }
    }
    fn cursor(&self) -> Cursor {
        self.cursor
    }
    fn set_cursor(&mut self, c: Cursor) {
        self.cursor = c;
    }
    fn resume_from(&mut self, run_dir: &Path) -> Result<PathBuf, TrainError> {
        let step: u64 = std::fs::read_to_string(run_dir.join("toy-checkpoint"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        self.cursor = self.schedule.cursor_at(step);
        Ok(run_dir.join("toy-checkpoint"))
    }
    fn prepare(&mut self) -> Result<(), TrainError> {
        Ok(())
    }
    fn scheduled_eval(&mut self) -> Result<Scalars, TrainError> {
        self.evals.push(self.cursor.step);
        Ok([("eval/x".to_string(), 1.0)].into_iter().collect())
    }
    fn run_step(&mut self, rows: &[usize], _next: Option<&[usize]>) -> Result<Scalars, TrainError> {
        if self.fail_at_step == Some(self.cursor.step) {
            return Err(TrainError::Reward("the reward server is gone".into()));
        }
        self.steps.push((self.cursor.step, rows.to_vec()));
        Ok([("reward/mean".to_string(), rows.len() as f64)]
            .into_iter()
            .collect())
    }
    fn step_failed(&mut self, error: TrainError) -> TrainError {
        self.failures_seen += 1;
        error
    }
    fn record(&mut self, values: &Scalars) -> Result<(), TrainError> {
        self.history.push(values.clone());
        Ok(())
    }
    fn headline(&self, values: &Scalars) -> Headline {
        Headline {
            text: format!("rows {}", values["reward/mean"]),
            reward: values.get("reward/mean").copied(),
        }
    }
    fn served_versions(&self) -> Vec<(String, u64)> {
        vec![("toy".into(), self.cursor.step + 1)]
    }
    fn checkpoint(&mut self) -> Result<PathBuf, TrainError> {
        self.checkpoints.push(self.cursor.step);
        let path = self.run_dir.join("toy-checkpoint");
        std::fs::write(&path, self.cursor.step.to_string()).unwrap();
        Ok(path)
    }
    fn last_checkpoint(&self) -> Option<PathBuf> {
        self.checkpoints
            .last()
            .map(|_| self.run_dir.join("toy-checkpoint"))
    }
    fn check_ranks(&self) -> Result<(), TrainError> {
        Ok(())
    }
    fn finish(&mut self) -> Result<Vec<PathBuf>, TrainError> {
        self.finished += 1;
        Ok(vec![self.run_dir.join("toy-final")])
    }
    fn load_saved(&mut self, path: &Path) -> Result<PathBuf, TrainError> {
        Ok(path.to_path_buf())
    }
    fn evaluate_saved(&mut self, _ks: &[usize]) -> Result<Scalars, TrainError> {
        Ok(Scalars::new())
    }
    fn history(&self) -> &[Scalars] {
        &self.history
    }
}

fn run(toy: &mut Toy) -> Result<RunSummary, TrainError> {
    drive(toy)
}

#[test]
fn a_run_takes_every_row_once_per_epoch_on_its_schedules_and_ends_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut toy = Toy::new(dir.path());
    let summary = run(&mut toy).unwrap();
    let rows: Vec<Vec<usize>> = toy.steps.iter().map(|(_, r)| r.clone()).collect();
    assert_eq!(
        rows,
        vec![
            vec![0, 1, 2],
            vec![3, 4, 5],
            vec![6],
            vec![6, 5, 4],
            vec![3, 2, 1],
            vec![0]
        ]
    );
    // Before the steps whose items contain a multiple of 4 (0 and 4 of each epoch).
    assert_eq!(toy.evals, vec![0, 1, 3, 4]);
    assert_eq!(toy.checkpoints, vec![2, 4, 6]);
    assert_eq!(toy.finished, 1);
    assert_eq!(summary.steps, 6);
    assert!(!summary.stopped);
    assert_eq!(summary.final_models, vec![dir.path().join("toy-final")]);
    assert_eq!(summary.history.len(), 6);
    assert_eq!(
        summary.history[0]["eval/x"], 1.0,
        "an evaluation is logged with the step it precedes"
    );
    assert!(!summary.history[2].contains_key("eval/x"));
    assert!(
        dir.path().join("finished.json").is_file(),
        "a finished run is marked for --resume auto"
    );
}

#[test]
fn a_cut_run_resumed_from_its_checkpoint_does_the_remaining_steps_exactly() {
    let whole = tempfile::tempdir().unwrap();
    let mut straight = Toy::new(whole.path());
    run(&mut straight).unwrap();

    let dir = tempfile::tempdir().unwrap();
    let mut first = Toy::new(dir.path());
    first.schedule.stop_after_steps = Some(3);
    let cut = run(&mut first).unwrap();
    assert_eq!(cut.steps, 3);
    assert_eq!(first.finished, 0, "a cut run does no end-of-run work");
    assert!(
        !dir.path().join("finished.json").exists(),
        "a cut run is not marked finished"
    );

    let mut second = Toy::new(dir.path());
    second.resume_from(dir.path()).unwrap();
    assert_eq!(
        second.cursor(),
        Cursor {
            step: 2,
            epoch: 0,
            position: 6
        }
    );
    run(&mut second).unwrap();
    let mut steps = first.steps[..2].to_vec();
    steps.extend(second.steps.clone());
    assert_eq!(
        steps, straight.steps,
        "checkpoint at step 2, then the rest as the uninterrupted run"
    );
    assert_eq!(second.finished, 1);
}

#[test]
fn a_failed_step_goes_through_the_trainer_and_ends_the_run_without_its_end() {
    let dir = tempfile::tempdir().unwrap();
    let mut toy = Toy::new(dir.path());
    toy.fail_at_step = Some(1);
    let e = run(&mut toy).unwrap_err();
    assert!(e.to_string().contains("the reward server is gone"), "{e}");
    assert_eq!(toy.failures_seen, 1);
    assert_eq!(toy.steps.len(), 1);
    assert_eq!(toy.finished, 0);
    assert!(!dir.path().join("finished.json").exists());
}
