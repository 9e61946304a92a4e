//! `learner plot RUN_DIR`: reward, loss and throughput curves from `metrics.jsonl` as PNG files.
//!
//! Text needs a TrueType font: plotters' `ab_glyph` backend is given one found on the system
//! (`COTRAIN_PLOT_FONT`, or common DejaVu / Liberation paths). Without any font the curves are still
//! drawn, without titles, tick labels or legends.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::prelude::*;

use crate::metrics::{METRICS_FILE, MetricsRecord, read_metrics};

/// Why a plot could not be drawn.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// The metrics file could not be read.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The run has no numeric metrics to draw.
    #[error("{0}: no metrics to plot")]
    Empty(PathBuf),
    /// The drawing backend failed.
    #[error("{path}: {message}")]
    Draw { path: PathBuf, message: String },
}

const FONT_CANDIDATES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation/LiberationSans-Regular.ttf",
];

/// Registers a system font once; false when none was found.
fn font_available() -> bool {
    static FONT: OnceLock<bool> = OnceLock::new();
    *FONT.get_or_init(|| {
        let mut candidates: Vec<PathBuf> = std::env::var_os("COTRAIN_PLOT_FONT")
            .map(PathBuf::from)
            .into_iter()
            .collect();
        candidates.extend(FONT_CANDIDATES.iter().map(PathBuf::from));
        for path in candidates {
            if let Ok(bytes) = std::fs::read(&path) {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return true;
                }
            }
        }
        tracing::warn!(
            "no truetype font found; plots are drawn without text (set COTRAIN_PLOT_FONT)"
        );
        false
    })
}

/// Which metrics go into which picture.
/// Each entry lists key prefixes in order of priority: a chart holds at most eight lines, so the
/// headline series (training reward mean) must come before the many per-level and eval keys.
const GROUPS: &[(&str, &str, &[&str])] = &[
    (
        "reward.png",
        "reward",
        &[
            "reward/mean",
            "reward/max",
            "eval/reward/mean",
            "reward/level_",
        ],
    ),
    (
        "loss.png",
        "loss and kl",
        &["loss", "kl", "policy", "objective/kl"],
    ),
    (
        "accuracy.png",
        "accuracy per turn",
        &["eval/accuracy/turn", "accuracy/turn"],
    ),
    // The actor-critic trainers' critics.
    (
        "critic.png",
        "critic: value loss, explained variance",
        &[
            "critic/value_loss",
            "critic/explained_variance",
            "critic/value_mean",
            "critic/target_mean",
        ],
    ),
    (
        "returns.png",
        "return per turn",
        &[
            "critic/turn1/expected_return",
            "critic/turn2/expected_return",
            "critic/turn3/expected_return",
            "critic/turn4/expected_return",
            "critic/turn5/expected_return",
        ],
    ),
    (
        "throughput.png",
        "throughput",
        &["tokens_per_s", "train_tokens_per_s", "throughput", "time/"],
    ),
];

/// Draws every group that has data to `RUN_DIR/plots/*.png`; returns the files written.
pub fn plot_run(run_dir: &Path) -> Result<Vec<PathBuf>, PlotError> {
    let metrics_path = run_dir.join(METRICS_FILE);
    let records = read_metrics(&metrics_path).map_err(|source| PlotError::Io {
        path: metrics_path.clone(),
        source,
    })?;
    let out_dir = run_dir.join("plots");
    std::fs::create_dir_all(&out_dir).map_err(|source| PlotError::Io {
        path: out_dir.clone(),
        source,
    })?;
    let mut written = Vec::new();
    for (file, title, prefixes) in GROUPS {
        let series = collect(&records, prefixes);
        if series.is_empty() {
            continue;
        }
        let path = out_dir.join(file);
        draw(&path, title, "step", &series, font_available()).map_err(|message| {
            PlotError::Draw {
                path: path.clone(),
                message,
            }
        })?;
        written.push(path);
    }
    if written.is_empty() {
        return Err(PlotError::Empty(metrics_path));
    }
    Ok(written)
}

type Series = Vec<(String, Vec<(f64, f64)>)>;

fn collect(records: &[MetricsRecord], prefixes: &[&str]) -> Series {
    let mut all: Vec<&String> = records.iter().flat_map(|r| r.values.keys()).collect();
    all.sort();
    all.dedup();
    // Prefix order is priority order; within one prefix, keys sort alphabetically.
    let mut keys: Vec<String> = Vec::new();
    for prefix in prefixes {
        for k in &all {
            if k.starts_with(prefix) && !keys.iter().any(|x| x == *k) {
                keys.push((*k).clone());
            }
        }
    }
    keys.truncate(8);
    keys.into_iter()
        .map(|k| {
            let pts = records
                .iter()
                .filter_map(|r| r.values.get(&k).map(|v| (r.step as f64, *v)))
                .filter(|(_, v)| v.is_finite())
                .collect();
            (k, pts)
        })
        .filter(|(_, p): &(String, Vec<(f64, f64)>)| !p.is_empty())
        .collect()
}

/// Draws one chart; `text` = false leaves out every piece of text (for machines without fonts).
/// Draws `series` (name, points) as lines into the PNG `path`, with `x_desc` under the x axis.
pub fn draw_lines(
    path: &Path,
    title: &str,
    x_desc: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> Result<(), PlotError> {
    let text = font_available();
    let series: Series = series.to_vec();
    draw(path, title, x_desc, &series, text).map_err(|message| PlotError::Draw {
        path: path.to_path_buf(),
        message,
    })
}

fn draw(path: &Path, title: &str, x_desc: &str, series: &Series, text: bool) -> Result<(), String> {
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for (_, pts) in series {
        for (x, y) in pts {
            x0 = x0.min(*x);
            x1 = x1.max(*x);
            y0 = y0.min(*y);
            y1 = y1.max(*y);
        }
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    if y1 <= y0 {
        y1 = y0 + 1.0;
    }
    let pad = (y1 - y0) * 0.05;
    let root = BitMapBackend::new(path, (900, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let mut builder = ChartBuilder::on(&root);
    builder.margin(16);
    if text {
        builder
            .caption(title, ("sans-serif", 24))
            .x_label_area_size(36)
            .y_label_area_size(64);
    }
    let mut chart = builder
        .build_cartesian_2d(x0..x1, (y0 - pad)..(y1 + pad))
        .map_err(|e| e.to_string())?;
    let mut mesh = chart.configure_mesh();
    let integer_label = |x: &f64| format!("{x:.0}");
    if text {
        mesh.x_desc(x_desc);
        // Steps and turns are whole numbers: label them so (1, 2, 3 rather than 1.0, 1.5, 2.0).
        if let Some(n) = integer_x_labels(series) {
            mesh.x_labels(n).x_label_formatter(&integer_label);
        }
    } else {
        mesh.x_labels(0).y_labels(0);
    }
    mesh.draw().map_err(|e| e.to_string())?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let drawn = chart
            .draw_series(LineSeries::new(pts.iter().cloned(), color.stroke_width(2)))
            .map_err(|e| e.to_string())?;
        if text {
            drawn.label(name.clone()).legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        }
    }
    if text {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| e.to_string())?;
    }
    root.present().map_err(|e| e.to_string())?;
    Ok(())
}

/// How many x labels to ask plotters for when every x is a whole number (steps, turns), so that
/// its ticks land on whole numbers: at most one per integer of the range, and its default 10.
/// `None` when some x has a fraction (then plotters' own labels stay).
fn integer_x_labels(series: &Series) -> Option<usize> {
    let xs = || {
        series
            .iter()
            .flat_map(|(_, pts)| pts.iter().map(|(x, _)| *x))
    };
    if xs().next().is_none() || xs().any(|x| !x.is_finite() || x.fract() != 0.0) {
        return None;
    }
    let (lo, hi) = xs().fold((f64::MAX, f64::MIN), |(lo, hi), x| (lo.min(x), hi.max(x)));
    Some(((hi - lo) as usize + 1).clamp(2, 10))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// Regression (issue 33): the step axis read 2.0, 4.0; whole-number x values get whole-number
    /// ticks, at most one per step.
    #[test]
    fn integer_steps_get_integer_ticks() {
        let series = |xs: &[f64]| -> Series {
            vec![("reward".to_string(), xs.iter().map(|x| (*x, 0.5)).collect())]
        };
        assert_eq!(integer_x_labels(&series(&[1.0, 2.0, 3.0, 4.0])), Some(4));
        assert_eq!(integer_x_labels(&series(&[0.0, 500.0])), Some(10));
        assert_eq!(integer_x_labels(&series(&[3.0])), Some(2));
        assert_eq!(integer_x_labels(&series(&[0.25, 0.5])), None);
        assert_eq!(integer_x_labels(&Vec::new()), None);
    }

    #[test]
    fn plot_writes_pngs_for_groups_with_data() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = crate::metrics::MetricsWriter::create(dir.path(), false).unwrap();
        for step in 0..5u64 {
            let mut v = BTreeMap::new();
            v.insert("reward/mean".into(), step as f64 * 0.5);
            v.insert("loss".into(), 1.0 / (1.0 + step as f64));
            w.log(step, &v).unwrap();
        }
        drop(w);
        let files = plot_run(dir.path()).unwrap();
        let names: Vec<String> = files
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["reward.png", "loss.png"]);
        // Without a font the same curves are drawn, textless.
        let bare = dir.path().join("bare.png");
        draw(
            &bare,
            "reward",
            "step",
            &vec![("r".to_string(), vec![(0.0, 1.0), (1.0, 2.0)])],
            false,
        )
        .unwrap();
        assert_eq!(&std::fs::read(&bare).unwrap()[1..4], b"PNG");
        for f in files {
            let bytes = std::fs::read(f).unwrap();
            assert_eq!(&bytes[1..4], b"PNG");
        }
    }

    /// Regression: eval keys sort before `reward/` ones and used to push the training reward
    /// mean out of the eight lines a chart holds.
    #[test]
    fn reward_chart_keeps_training_mean_when_eval_keys_abound() {
        let mut values = BTreeMap::new();
        for k in [
            "reward/mean",
            "reward/max",
            "reward/std",
            "reward/level_1",
            "reward/level_2",
        ] {
            values.insert(k.to_string(), 1.0);
        }
        for i in 0..12 {
            values.insert(format!("eval/reward/level_{i}"), 1.0);
        }
        values.insert("eval/reward/mean".to_string(), 1.0);
        let records = vec![MetricsRecord {
            step: 1,
            time: 0.0,
            values,
        }];
        let keys: Vec<String> = collect(&records, GROUPS[0].2)
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        assert_eq!(
            &keys[..3],
            ["reward/mean", "reward/max", "eval/reward/mean"]
        );
        assert!(keys.len() <= 8);
    }
}
