//! `magrpo.eval_decoding`, run through `Trainer::evaluate` on the tiny model and the in-process
//! engine: `greedy` (the September 2025 original's evaluation with its base models) asks the rollout
//! workers for argmax completions when an evaluation draws one joint sample per item, so the same
//! weights evaluate to the same completions under any seed; `sampled` (the default) keeps the
//! training sampling parameters; training rollouts sample either way.

mod train_common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use cotrain_learner::algo::AdamWConfig;
use cotrain_learner::services::EngineRollout;
use cotrain_learner::trainer::{Policy, SamplingSpec, Trainer, TrainerSetup};
use cotrain_model::loader::{LoadOptions, load};
use tch::Tensor;
use train_common::{Recording, Seen, TokenRule, config, items, taken, tiny_model_dir};

const YAML: &str = "model: {name: unused, temperature: 0.7, top_p: 0.9, top_k: 20, max_length: 64}\n\
dataset: {name: gsm8k, train_split: 'train[:2]'}\n\
magrpo:\n  num_agents: 2\n  num_generations: 2\n  max_new_tokens: 4\n  learning_rate: 0.001\n  num_train_epochs: 1\n  \
rollout_buffer_size: 1\n  eval_interval: 0\n  eval_num_samples: 2\n  save_steps: 100000\n\
logging: {tensorboard: false, plots: false, progress: never}\n";

/// The training sampling parameters of [`YAML`].
const TRAINING: (f64, f64, u32) = (0.7, 0.9, 20);

fn trainer(
    model: &std::path::Path,
    run: &std::path::Path,
    overrides: &[&str],
) -> (Trainer, Arc<Mutex<Vec<Seen>>>) {
    let cfg = config(
        YAML,
        &overrides.iter().map(|o| o.to_string()).collect::<Vec<_>>(),
    );
    let spec = model.display().to_string();
    let mut policies = Vec::new();
    let mut engines = Vec::new();
    for a in 0..2 {
        let name = format!("agent{a}");
        policies.push(Policy::new(
            &name,
            &spec,
            load(&spec, &LoadOptions::default()).unwrap(),
            None,
            AdamWConfig::new(1e-3, 0.0, None),
        ));
        engines.push((name, load(&spec, &LoadOptions::default()).unwrap()));
    }
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut trainer = Trainer::new(TrainerSetup {
        cfg,
        run_dir: run.to_path_buf(),
        task: "token_rule".into(),
        is_code: false,
        policies,
        agent_policy: vec![0, 1],
        rollout: Box::new(Recording {
            inner: EngineRollout::new(engines),
            seen: seen.clone(),
        }),
        reward: Box::new(TokenRule {
            rule: |t: &[u32]| t[0].is_multiple_of(2),
        }),
        train_items: items(2, 2),
        eval_items: items(2, 2),
    })
    .unwrap();
    trainer.sync_all_weights().unwrap();
    (trainer, seen)
}

fn training_parameters(s: &SamplingSpec) -> (f64, f64, u32) {
    (s.temperature, s.top_p, s.top_k)
}

/// The evaluation's metrics without its wall-clock time.
fn scores(mut m: BTreeMap<String, f64>) -> BTreeMap<String, f64> {
    m.remove("eval/time");
    m
}

#[test]
fn greedy_evaluation_draws_argmax_completions_whatever_the_seed() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model_dir(tmp.path());
    let mut runs = Vec::new();
    for seed in [1, 2] {
        let (mut t, seen) = trainer(
            &model,
            &tmp.path().join(format!("greedy{seed}")),
            &["magrpo.eval_decoding=greedy", &format!("seed={seed}")],
        );
        let m = t.evaluate(1, &[1]).unwrap();
        let requests = taken(&seen);
        assert_eq!(requests.len(), 4, "two eval items, two agents");
        assert!(
            requests
                .iter()
                .all(|r| r.sampling.temperature == 0.0 && r.completions.len() == 1),
            "{requests:?}"
        );

        // Several samples per item (`learner eval --k 3`) still sample, with the training parameters.
        t.evaluate(3, &[1, 3]).unwrap();
        assert!(
            taken(&seen)
                .iter()
                .all(|r| training_parameters(&r.sampling) == TRAINING && r.completions.len() == 3)
        );
        // Training rollouts are untouched.
        t.train_step(&[0]).unwrap();
        let train = taken(&seen);
        assert!(
            !train.is_empty()
                && train
                    .iter()
                    .all(|r| training_parameters(&r.sampling) == TRAINING),
            "{train:?}"
        );
        runs.push((scores(m), requests));
    }
    let (a, b) = (&runs[0], &runs[1]);
    assert_eq!(
        a.0, b.0,
        "greedy evaluations of the same weights score the same under any seed"
    );
    let completions = |r: &[Seen]| r.iter().map(|s| s.completions.clone()).collect::<Vec<_>>();
    assert_eq!(completions(&a.1), completions(&b.1));

    // Every token is the argmax of the model's next-token logits (one plain forward per sequence).
    let reference = load(&model.display().to_string(), &LoadOptions::default()).unwrap();
    for r in &a.1 {
        let completion = &r.completions[0];
        assert!(!completion.is_empty());
        let ids: Vec<i64> = r
            .prompt
            .iter()
            .chain(completion)
            .map(|&t| t as i64)
            .collect();
        let logits = reference
            .model
            .forward(&Tensor::from_slice(&ids).unsqueeze(0))
            .unwrap()
            .squeeze_dim(0);
        // The logits at position i predict token i + 1.
        let argmax = logits
            .narrow(0, r.prompt.len() as i64 - 1, completion.len() as i64)
            .argmax(-1, false);
        let argmax: Vec<u32> = Vec::<i64>::try_from(&argmax)
            .unwrap()
            .into_iter()
            .map(|t| t as u32)
            .collect();
        assert_eq!(&argmax, completion, "prompt {:?}", r.prompt);
    }
}

#[test]
fn sampled_evaluation_keeps_the_training_sampling_parameters() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model_dir(tmp.path());
    let mut drawn = Vec::new();
    for seed in [1, 2] {
        let (mut t, seen) = trainer(
            &model,
            &tmp.path().join(format!("sampled{seed}")),
            &[&format!("seed={seed}")],
        );
        t.evaluate(1, &[1]).unwrap();
        let requests = taken(&seen);
        assert!(
            requests
                .iter()
                .all(|r| training_parameters(&r.sampling) == TRAINING),
            "{requests:?}"
        );
        drawn.push(
            requests
                .into_iter()
                .map(|r| r.completions)
                .collect::<Vec<_>>(),
        );
    }
    assert_ne!(drawn[0], drawn[1], "sampled evaluations depend on the seed");
}
