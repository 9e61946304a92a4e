//! `learner verifier train`: a [`Verifier`] on `model.name` trained on a data file's answers with
//! per-token binary cross-entropy (the model crate's [`Verifier::loss`]); the file's last
//! `verifier.test_questions` questions are held out and scored every `eval_interval` optimiser
//! steps and at the end (loss, accuracy at 0.5, AUC, expected calibration error). The output
//! directory is the verifier (loadable by the rollout workers) plus `metrics.jsonl` and
//! `plots/{loss,heldout,calibration}.png`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use cotrain_model::verifier::{Encoded, Verifier};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use tracing::{info, warn};

use super::data::{Example, VerifierData};
use super::stats;
use crate::algo::{AdamW, AdamWConfig};
use crate::config::{CheckedConfig, VerifierSection};
use crate::error::TrainError;
use crate::metrics::MetricsWriter;

/// What a finished training leaves.
#[derive(Debug, Clone)]
pub struct VerifierSummary {
    pub out_dir: PathBuf,
    pub optimizer_steps: u64,
    /// The last held-out evaluation (`heldout/{loss,accuracy,auc,ece}`).
    pub heldout: BTreeMap<String, f64>,
    pub plots: Vec<PathBuf>,
}

/// One encoded example.
struct Item {
    enc: Encoded,
    label: f32,
}

fn encode_all(v: &Verifier, template: &str, examples: &[Example]) -> Result<Vec<Item>, TrainError> {
    examples
        .iter()
        .map(|e| {
            let user = super::user_message(template, &e.question).map_err(TrainError::Config)?;
            let enc = v.encode(&user, &e.answer).map_err(|err| {
                TrainError::Data(format!(
                    "question {:?}: {err}",
                    e.question.chars().take(60).collect::<String>()
                ))
            })?;
            Ok(Item {
                enc,
                label: e.label,
            })
        })
        .collect()
}

/// Loss, accuracy, AUC and ECE of `items` (batches of `batch`, no gradient), plus the scores.
fn evaluate(
    v: &Verifier,
    items: &[Item],
    batch: usize,
) -> Result<(BTreeMap<String, f64>, Vec<f32>), TrainError> {
    let (mut scores, mut labels, mut loss) = (Vec::new(), Vec::new(), 0.0);
    for part in items.chunks(batch.max(1)) {
        let refs: Vec<&Encoded> = part.iter().map(|i| &i.enc).collect();
        let ls: Vec<f32> = part.iter().map(|i| i.label).collect();
        let (l, s) = v
            .loss(&refs, &ls, false)
            .map_err(|e| TrainError::Update(e.to_string()))?;
        loss += l.double_value(&[]) * part.len() as f64;
        scores.extend(s);
        labels.extend(ls);
    }
    let mut m = BTreeMap::new();
    m.insert("heldout/loss".into(), loss / items.len().max(1) as f64);
    m.insert("heldout/accuracy".into(), stats::accuracy(&scores, &labels));
    m.insert("heldout/ece".into(), stats::ece(&scores, &labels, 10));
    if let Some(a) = stats::auc(&scores, &labels) {
        m.insert("heldout/auc".into(), a);
    }
    m.insert(
        "heldout/positive_fraction".into(),
        labels.iter().map(|&y| f64::from(y)).sum::<f64>() / labels.len().max(1) as f64,
    );
    Ok((m, scores))
}

/// Trains a verifier on `data` as `cfg` says (`model.name`, `seed`, the `verifier` section) and
/// writes it to `out`.
pub fn train_verifier(
    cfg: &CheckedConfig,
    data: &VerifierData,
    out: &Path,
) -> Result<VerifierSummary, TrainError> {
    let vcfg: VerifierSection = cfg.raw.verifier.clone().unwrap_or_default();
    let (train_data, test_data) = data.split(vcfg.test_questions).map_err(TrainError::Data)?;
    let spec = cfg.raw.model.name.clone();
    let base = cotrain_model::loader::load(&spec, &crate::model_options::load_options(cfg)?)
        .map_err(|e| TrainError::Model(format!("loading `{spec}`: {e}")))?;
    tch::manual_seed(cfg.raw.seed as i64);
    let lora = (!vcfg.full_finetune).then(|| vcfg.lora.to_model());
    let v = Verifier::new(base, &spec, lora, vcfg.max_length)
        .map_err(|e| TrainError::Model(e.to_string()))?;
    let template = vcfg.template(&super::task_of(cfg)?);
    let train = encode_all(&v, &template, &train_data.examples())?;
    let test = encode_all(&v, &template, &test_data.examples())?;
    if train.is_empty() {
        return Err(TrainError::Data(
            "the training questions hold no answer".into(),
        ));
    }
    std::fs::create_dir_all(out).map_err(|e| TrainError::Io(format!("{}: {e}", out.display())))?;
    let mut metrics = MetricsWriter::create(out, cfg.raw.logging.tensorboard)
        .map_err(|e| TrainError::Io(format!("{}: {e}", out.display())))?;
    let adam = AdamWConfig {
        beta1: vcfg.beta1,
        beta2: vcfg.beta2,
        ..AdamWConfig::new(vcfg.learning_rate, vcfg.weight_decay, None)
    };
    let (trunk_vs, head_vs) = v.trainable();
    let mut opts = [AdamW::new(trunk_vs, adam), AdamW::new(head_vs, adam)];

    let micro = vcfg.per_device_train_batch_size;
    let per_step = micro * vcfg.gradient_accumulation_steps;
    let steps_per_epoch = train.len().div_ceil(per_step) as u64;
    let total = steps_per_epoch * vcfg.num_train_epochs as u64;
    info!(train_answers = train.len(), heldout_answers = test.len(), steps = total, weights = %v.manifest.weights, "training the verifier");
    let pb = crate::metrics::progress::progress_bar(cfg.raw.logging.progress, total, 0);
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.raw.seed);
    let (mut step, mut heldout) = (0u64, BTreeMap::new());
    let mut last_scores = Vec::new();
    for _epoch in 0..vcfg.num_train_epochs {
        let mut order: Vec<usize> = (0..train.len()).collect();
        order.shuffle(&mut rng);
        for chunk in order.chunks(per_step) {
            let lr =
                vcfg.learning_rate * ((step + 1) as f64 / vcfg.warmup_steps.max(1) as f64).min(1.0);
            for o in opts.iter_mut() {
                o.cfg.lr = lr;
                o.zero_grad();
            }
            let (mut loss_sum, mut scores, mut labels) = (0.0, Vec::new(), Vec::new());
            for mb in chunk.chunks(micro) {
                let refs: Vec<&Encoded> = mb.iter().map(|&k| &train[k].enc).collect();
                let ls: Vec<f32> = mb.iter().map(|&k| train[k].label).collect();
                let (loss, s) = v
                    .loss(&refs, &ls, true)
                    .map_err(|e| TrainError::Update(e.to_string()))?;
                // The step's loss is the mean over its answers.
                (&loss * (mb.len() as f64 / chunk.len() as f64)).backward();
                loss_sum += loss.double_value(&[]) * mb.len() as f64;
                scores.extend(s);
                labels.extend(ls);
            }
            let loss = loss_sum / chunk.len() as f64;
            if loss.is_finite() && opts.iter().all(AdamW::grads_finite) {
                for o in opts.iter_mut() {
                    o.step();
                }
            } else {
                warn!(
                    step = step + 1,
                    loss, "non-finite verifier loss or gradient: step skipped"
                );
            }
            step += 1;
            let mut m = BTreeMap::from([
                ("train/loss".to_string(), loss),
                (
                    "train/accuracy".to_string(),
                    stats::accuracy(&scores, &labels),
                ),
                ("lr".to_string(), lr),
            ]);
            if !test.is_empty() && (step.is_multiple_of(vcfg.eval_interval as u64) || step == total)
            {
                let (h, s) = evaluate(&v, &test, micro)?;
                info!(
                    step,
                    loss = h["heldout/loss"],
                    accuracy = h["heldout/accuracy"],
                    auc = h.get("heldout/auc").copied().unwrap_or(f64::NAN),
                    "held-out evaluation"
                );
                m.extend(h.clone());
                heldout = h;
                last_scores = s;
            }
            metrics
                .log(step, &m)
                .map_err(|e| TrainError::Io(format!("metrics: {e}")))?;
            if let Some(pb) = &pb {
                pb.set_position(step);
                pb.set_message(format!("loss {loss:.4}"));
            }
        }
    }
    if let Some(pb) = pb {
        pb.finish_and_clear();
    }
    v.save(out)
        .map_err(|e| TrainError::Checkpoint(format!("{}: {e}", out.display())))?;
    let plots = if cfg.raw.logging.plots {
        plot(
            out,
            &last_scores,
            &test.iter().map(|i| i.label).collect::<Vec<_>>(),
        )
    } else {
        Vec::new()
    };
    Ok(VerifierSummary {
        out_dir: out.to_path_buf(),
        optimizer_steps: step,
        heldout,
        plots,
    })
}

/// Loss and held-out curves from `metrics.jsonl`, and the final reliability diagram.
fn plot(out: &Path, scores: &[f32], labels: &[f32]) -> Vec<PathBuf> {
    let dir = out.join("plots");
    let mut written = Vec::new();
    let records = match crate::metrics::read_metrics(&out.join("metrics.jsonl")) {
        Ok(r) => r,
        Err(e) => {
            warn!("verifier plots: {e}");
            return written;
        }
    };
    let curve = |key: &str| -> (String, Vec<(f64, f64)>) {
        (
            key.to_string(),
            records
                .iter()
                .filter_map(|r| r.values.get(key).map(|v| (r.step as f64, *v)))
                .collect(),
        )
    };
    let _ = std::fs::create_dir_all(&dir);
    let mut charts = vec![
        (
            "loss.png",
            "verifier loss (binary cross-entropy)",
            vec![curve("train/loss"), curve("heldout/loss")],
        ),
        (
            "heldout.png",
            "held-out accuracy and AUC",
            vec![
                curve("heldout/accuracy"),
                curve("heldout/auc"),
                curve("heldout/ece"),
            ],
        ),
    ];
    if !scores.is_empty() {
        let bins = stats::calibration_bins(scores, labels, 10);
        let observed: Vec<(f64, f64)> = bins
            .iter()
            .filter(|b| b.count > 0)
            .map(|b| (b.mean_score, b.fraction_correct))
            .collect();
        charts.push((
            "calibration.png",
            "calibration: fraction correct against mean score",
            vec![
                ("held-out answers".into(), observed),
                ("perfect".into(), vec![(0.0, 0.0), (1.0, 1.0)]),
            ],
        ));
    }
    for (file, title, series) in charts {
        let series: Vec<(String, Vec<(f64, f64)>)> =
            series.into_iter().filter(|(_, p)| !p.is_empty()).collect();
        if series.is_empty() {
            continue;
        }
        let path = dir.join(file);
        match crate::plot::draw_lines(
            &path,
            title,
            if file == "calibration.png" {
                "mean score"
            } else {
                "step"
            },
            &series,
        ) {
            Ok(()) => written.push(path),
            Err(e) => warn!("verifier plots: {e}"),
        }
    }
    written
}
