//! Where a run stands and what comes next: the rows of each step in the epoch's order, the step
//! after it, and when evaluations, checkpoints and rank checks fall. Pure arithmetic, shared by
//! every trainer, so that two trainers cannot count epochs differently.

/// A run's place: steps done, and the next step's epoch and first position in that epoch's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Cursor {
    pub step: u64,
    pub epoch: u64,
    pub position: u64,
}

/// When a trainer evaluates during training (always on rank 0, before the step it is logged with).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvalRule {
    /// Before training on item i of an epoch when i is a multiple of the interval (CoMLRL's rule:
    /// before the first item too); a step of several items evaluates once when its items contain
    /// such an i. 0: never.
    BeforeItems(u64),
    /// Before every step whose number is a multiple of the interval (MaPoRL's rule). 0: never.
    EverySteps(u64),
}

/// A run's shape and rhythm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Schedule {
    /// Rows of the train split.
    pub items: u64,
    /// Rows per step (the last step of an epoch may take fewer).
    pub batch: u64,
    pub epochs: u64,
    pub eval: EvalRule,
    /// A checkpoint every this many steps (0: none on a schedule).
    pub save_steps: u64,
    /// The periodic log line every this many steps (without a progress bar).
    pub logging_steps: u64,
    /// Rank agreement checked every this many steps (0: at the end only).
    pub checksum_steps: u64,
    /// Stop (as if killed: no end-of-run work) after this many steps; for resume tests.
    pub stop_after_steps: Option<u64>,
}

/// Whether a step over the epoch's items `[start, end)` contains an item whose index is a multiple of
/// `interval` (0: never).
pub fn eval_due(interval: u64, start: u64, end: u64) -> bool {
    interval > 0 && (start..end).any(|i| i.is_multiple_of(interval))
}

impl Schedule {
    pub fn steps_per_epoch(&self) -> u64 {
        self.items.div_ceil(self.batch.max(1))
    }

    pub fn total_steps(&self) -> u64 {
        self.steps_per_epoch() * self.epochs
    }

    /// The cursor of a run that has done `step` steps.
    pub fn cursor_at(&self, step: u64) -> Cursor {
        let per_epoch = self.steps_per_epoch().max(1);
        Cursor {
            step,
            epoch: step / per_epoch,
            position: (step % per_epoch) * self.batch,
        }
    }

    /// Whether the run has steps left at `c`.
    pub fn has_step(&self, c: Cursor) -> bool {
        c.epoch < self.epochs && self.stop_after_steps.is_none_or(|s| c.step < s)
    }

    /// The end (exclusive) of the step starting at `c` in its epoch's order.
    pub fn step_end(&self, c: Cursor) -> u64 {
        (c.position + self.batch).min(self.items)
    }

    /// The cursor after the step starting at `c`.
    pub fn advance(&self, c: Cursor) -> Cursor {
        let end = self.step_end(c);
        if end >= self.items {
            Cursor {
                step: c.step + 1,
                epoch: c.epoch + 1,
                position: 0,
            }
        } else {
            Cursor {
                step: c.step + 1,
                epoch: c.epoch,
                position: end,
            }
        }
    }

    /// Whether the scheduled evaluation falls before the step starting at `c`.
    pub fn eval_before(&self, c: Cursor) -> bool {
        match self.eval {
            EvalRule::BeforeItems(interval) => eval_due(interval, c.position, self.step_end(c)),
            EvalRule::EverySteps(interval) => interval > 0 && c.step.is_multiple_of(interval),
        }
    }

    /// Whether a checkpoint is scheduled after `step` steps.
    pub fn save_after(&self, step: u64) -> bool {
        self.save_steps > 0 && step.is_multiple_of(self.save_steps)
    }

    /// Whether the ranks compare their weights after `step` steps.
    pub fn check_after(&self, step: u64) -> bool {
        self.checksum_steps > 0 && step.is_multiple_of(self.checksum_steps)
    }

    /// Whether the periodic log line is due after `step` steps.
    pub fn log_after(&self, step: u64) -> bool {
        step.is_multiple_of(self.logging_steps.max(1)) || step == self.total_steps()
    }
}

/// The rows of the step starting at `c`, from its epoch's order.
pub fn rows(order: &[usize], schedule: &Schedule, c: Cursor) -> Vec<usize> {
    order[c.position as usize..schedule.step_end(c) as usize].to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(items: u64, batch: u64, epochs: u64) -> Schedule {
        Schedule {
            items,
            batch,
            epochs,
            eval: EvalRule::BeforeItems(0),
            save_steps: 0,
            logging_steps: 1,
            checksum_steps: 0,
            stop_after_steps: None,
        }
    }

    #[test]
    fn evaluation_rhythm_follows_the_items_of_an_epoch() {
        // One item per step (the original): items 0, 4, 8.
        let due: Vec<u64> = (0..10).filter(|&i| eval_due(4, i, i + 1)).collect();
        assert_eq!(due, vec![0, 4, 8]);
        // Three items per step: steps [0,3) [3,6) [6,9) [9,10) → the first three contain 0, 4, 8.
        let steps: Vec<bool> = [(0, 3), (3, 6), (6, 9), (9, 10)]
            .iter()
            .map(|&(a, b)| eval_due(4, a, b))
            .collect();
        assert_eq!(steps, vec![true, true, true, false]);
        assert!(!eval_due(0, 0, 10));
    }

    #[test]
    fn advancing_walks_every_row_of_every_epoch_once() {
        let s = schedule(7, 3, 2);
        let mut c = Cursor::default();
        let mut seen = Vec::new();
        while s.has_step(c) {
            seen.push((c.epoch, c.position, s.step_end(c)));
            assert_eq!(s.cursor_at(c.step), c, "a resumed run finds the same place");
            c = s.advance(c);
        }
        assert_eq!(
            seen,
            vec![
                (0, 0, 3),
                (0, 3, 6),
                (0, 6, 7),
                (1, 0, 3),
                (1, 3, 6),
                (1, 6, 7)
            ]
        );
        assert_eq!(c.step, s.total_steps());
    }

    #[test]
    fn a_stop_after_steps_ends_the_run_early() {
        let s = Schedule {
            stop_after_steps: Some(2),
            ..schedule(10, 1, 1)
        };
        assert!(s.has_step(s.cursor_at(1)));
        assert!(!s.has_step(s.cursor_at(2)));
    }

    #[test]
    fn maporl_evaluates_on_step_multiples() {
        let s = Schedule {
            eval: EvalRule::EverySteps(2),
            ..schedule(10, 3, 1)
        };
        let due: Vec<u64> = (0..4).filter(|&k| s.eval_before(s.cursor_at(k))).collect();
        assert_eq!(due, vec![0, 2]);
    }
}
