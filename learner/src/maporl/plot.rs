//! MaPoRL's main figure: accuracy against the discussion turn, one line per evaluation (the first,
//! the last, and up to three between), from the evaluations' `eval/accuracy/turn{t}` scalars.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tracing::warn;

/// Draws `RUN_DIR/plots/accuracy_per_turn.png`; `None` (with a warning on failure) when there is no
/// evaluation to draw.
pub fn accuracy_per_turn(
    run_dir: &Path,
    evals: &[(u64, BTreeMap<String, f64>)],
    turns: usize,
) -> Option<PathBuf> {
    if evals.is_empty() {
        return None;
    }
    let pick: Vec<usize> = if evals.len() <= 5 {
        (0..evals.len()).collect()
    } else {
        let last = evals.len() - 1;
        vec![0, last / 4, last / 2, 3 * last / 4, last]
    };
    let series: Vec<(String, Vec<(f64, f64)>)> = pick
        .iter()
        .map(|&k| {
            let (step, m) = &evals[k];
            let pts = (0..turns)
                .filter_map(|t| {
                    m.get(&format!("eval/accuracy/turn{t}"))
                        .map(|a| (t as f64, *a))
                })
                .collect();
            (format!("step {step}"), pts)
        })
        .collect();
    let dir = run_dir.join("plots");
    if let Err(e) = std::fs::create_dir_all(&dir) {
        warn!(error = %e, "accuracy plot not drawn");
        return None;
    }
    let path = dir.join("accuracy_per_turn.png");
    match crate::plot::draw_lines(&path, "eval accuracy per discussion turn", "turn", &series) {
        Ok(()) => Some(path),
        Err(e) => {
            warn!(error = %e, "accuracy plot not drawn");
            None
        }
    }
}
