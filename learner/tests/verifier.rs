//! The learned verifier through `learner verifier train` (the CLI's code path): on a toy signal (an
//! answer is correct when it contains the letter `h`, which the score at the last token can only
//! see through attention), the held-out AUC after training is above 0.9, the directory loads back
//! and scores the held-out answers the way the run's last evaluation did; bad data is refused.

mod train_common;

use std::path::Path;

use clap::Parser;
use cotrain_learner::cli::{self, Cli};
use cotrain_learner::verifier::{QuestionEntry, VerifierData};
use cotrain_model::loader::LoadOptions;
use cotrain_model::verifier::{Encoded, Verifier};
use rand::{Rng, SeedableRng};
use train_common::tiny_model_dir;

fn run(args: &[&str]) -> anyhow::Result<()> {
    let mut argv = vec!["learner"];
    argv.extend_from_slice(args);
    cli::run(Cli::try_parse_from(argv)?)
}

/// `questions` questions with `per` answers each: six letters from a–h; correct iff one is `h`.
fn toy_data(questions: usize, per: usize, seed: u64) -> VerifierData {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let letters = b"abcdefgh";
    VerifierData {
        questions: (0..questions)
            .map(|q| {
                let answers: Vec<String> = (0..per)
                    .map(|_| {
                        (0..6)
                            .map(|_| letters[rng.random_range(0..8)] as char)
                            .collect()
                    })
                    .collect();
                let rewards = answers
                    .iter()
                    .map(|a| if a.contains('h') { 1.0 } else { 0.0 })
                    .collect();
                (
                    format!("q{q}"),
                    QuestionEntry {
                        original_answer: String::new(),
                        generated_answers: answers,
                        rewards,
                        ..Default::default()
                    },
                )
            })
            .collect(),
    }
}

fn write_config(dir: &Path, model: &Path) -> std::path::PathBuf {
    let path = dir.join("verifier.yaml");
    std::fs::write(
        &path,
        format!(
            "model: {{name: '{}'}}\ndataset: {{name: gsm8k, type: gsm8k}}\nseed: 5\nmaporl: {{}}\n\
             logging: {{progress: never, tensorboard: false}}\n\
             verifier:\n  user_template: '{{{{ question }}}}'\n  test_questions: 10\n  num_train_epochs: 6\n  learning_rate: 0.003\n  \
             per_device_train_batch_size: 8\n  gradient_accumulation_steps: 1\n  warmup_steps: 1\n  eval_interval: 1000\n  max_length: 32\n",
            model.display()
        ),
    )
    .unwrap();
    path
}

#[test]
fn training_on_a_toy_signal_reaches_a_high_heldout_auc() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model_dir(tmp.path());
    let data = tmp.path().join("data.json");
    toy_data(50, 8, 1).write(&data).unwrap();
    let config = write_config(tmp.path(), &model);
    let out = tmp.path().join("verifier");
    run(&[
        "verifier",
        "train",
        "--config",
        config.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ])
    .unwrap();

    let lines: Vec<serde_json::Value> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let last = lines.last().unwrap();
    let auc = last["heldout/auc"].as_f64().unwrap();
    println!("held-out after training: {last}");
    assert!(auc > 0.9, "held-out AUC {auc}");
    assert!(out.join("plots/calibration.png").is_file() && out.join("plots/loss.png").is_file());

    // The directory loads back and gives the held-out answers the scores the last evaluation saw.
    let v = Verifier::load(&out, &LoadOptions::default()).unwrap();
    let heldout = VerifierData {
        questions: VerifierData::read(&data).unwrap().questions[40..].to_vec(),
    };
    let examples = heldout.examples();
    let enc: Vec<Encoded> = examples
        .iter()
        .map(|e| v.encode(&e.question, &e.answer).unwrap())
        .collect();
    let scores = v.score(&enc.iter().collect::<Vec<_>>()).unwrap();
    let labels: Vec<f32> = examples.iter().map(|e| e.label).collect();
    let again = cotrain_learner::verifier::stats::auc(&scores, &labels).unwrap();
    assert!(
        (again - auc).abs() < 1e-6,
        "reloaded AUC {again} vs logged {auc}"
    );
}

#[test]
fn bad_data_and_settings_are_refused_with_the_reason() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model_dir(tmp.path());
    let config = write_config(tmp.path(), &model);
    let out = tmp.path().join("v");
    let data = tmp.path().join("few.json");
    toy_data(10, 2, 2).write(&data).unwrap();
    let e = run(&[
        "verifier",
        "train",
        "--config",
        config.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ])
    .unwrap_err();
    assert!(
        format!("{e:#}").contains("test_questions is 10 but the data has 10 questions"),
        "{e:#}"
    );
    let missing = tmp.path().join("nope.json");
    let e = run(&[
        "verifier",
        "train",
        "--config",
        config.to_str().unwrap(),
        "--data",
        missing.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ])
    .unwrap_err();
    assert!(format!("{e:#}").contains("nope.json"), "{e:#}");
    let e = run(&[
        "verifier",
        "train",
        "--config",
        config.to_str().unwrap(),
        "--override",
        "verifier.top_p=2",
        "--data",
        data.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ])
    .unwrap_err();
    assert!(format!("{e:#}").contains("verifier.top_p"), "{e:#}");
}

#[test]
fn balance_writes_the_balanced_file() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data.json");
    toy_data(20, 12, 3).write(&data).unwrap();
    let out = tmp.path().join("balanced.json");
    run(&[
        "verifier",
        "balance",
        "--in",
        data.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--per-type",
        "3",
    ])
    .unwrap();
    let balanced = VerifierData::read(&out).unwrap();
    assert!(!balanced.questions.is_empty());
    for (_, e) in &balanced.questions {
        let correct = e.rewards.iter().filter(|&&r| r > 0.5).count();
        assert_eq!((correct, e.rewards.len() - correct), (3, 3));
    }
}
