//! On-policy means on-policy: every sample's policy version is checked against the version the
//! learner pushed. A stale batch is redrawn once after re-pushing the weights; a second stale batch
//! stops the run with an error naming both versions.

mod train_common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use cotrain_learner::services::EngineRollout;
use cotrain_learner::trainer::{
    GenRequest, GenSample, RolloutSource, TrainError, Trainer, TrainerSetup,
};
use tch::Tensor;
use train_common::{TokenRule, config, tiny_model_dir};

/// Wraps the engine and reports a stale version on the first `stale_calls` generate calls.
struct Lagging {
    inner: EngineRollout,
    stale_calls: usize,
    pushes: Arc<Mutex<Vec<u64>>>,
}

impl RolloutSource for Lagging {
    fn generate(&mut self, requests: &[GenRequest]) -> Result<Vec<Vec<GenSample>>, TrainError> {
        let mut out = self.inner.generate(requests)?;
        if self.stale_calls > 0 {
            self.stale_calls -= 1;
            for s in out.iter_mut().flatten() {
                s.policy_version = s.policy_version.saturating_sub(1);
            }
        }
        Ok(out)
    }
    fn policy_version(&mut self, agent: &str) -> Result<u64, TrainError> {
        self.inner.policy_version(agent)
    }
    fn push_weights(
        &mut self,
        agent: &str,
        version: u64,
        params: &BTreeMap<String, Tensor>,
    ) -> Result<(), TrainError> {
        self.pushes.lock().unwrap().push(version);
        self.inner.push_weights(agent, version, params)
    }
    fn describe(&self) -> String {
        "lagging engine".into()
    }
}

const YAML: &str = "model: {name: unused, temperature: 1.0, top_p: 1.0, top_k: 0, max_length: 64}\n\
dataset: {name: gsm8k, train_split: 'train[:2]'}\n\
grpo:\n  num_generations: 2\n  max_new_tokens: 2\n  num_train_epochs: 1\n  rollout_buffer_size: 2\n  save_steps: 1000\n  eval_interval: 1000\n\
logging: {tensorboard: false, plots: false, progress: never}\n";

fn class_zero(t: &[u32]) -> bool {
    t[0].is_multiple_of(4)
}

fn trainer(tmp: &std::path::Path, stale_calls: usize, pushes: Arc<Mutex<Vec<u64>>>) -> Trainer {
    let model = tiny_model_dir(tmp);
    let cfg = config(YAML, &[]);
    let spec = model.display().to_string();
    let opts = cotrain_model::loader::LoadOptions::default();
    let adam = cotrain_learner::algo::AdamWConfig::new(1e-3, 0.0, None);
    let policy = cotrain_learner::trainer::Policy::new(
        "agent0",
        &spec,
        cotrain_model::loader::load(&spec, &opts).unwrap(),
        None,
        adam,
    );
    let engine = EngineRollout::new(vec![(
        "agent0".into(),
        cotrain_model::loader::load(&spec, &opts).unwrap(),
    )]);
    Trainer::new(TrainerSetup {
        cfg,
        run_dir: tmp.join("run"),
        task: "t".into(),
        is_code: false,
        policies: vec![policy],
        agent_policy: vec![0],
        rollout: Box::new(Lagging {
            inner: engine,
            stale_calls,
            pushes,
        }),
        reward: Box::new(TokenRule { rule: class_zero }),
        train_items: train_common::items(2, 1),
        eval_items: Vec::new(),
    })
    .unwrap()
}

#[test]
fn a_stale_batch_is_redrawn_once_after_re_pushing_the_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let pushes = Arc::new(Mutex::new(Vec::new()));
    let mut t = trainer(tmp.path(), 1, pushes.clone());
    let summary = t.run().unwrap();
    assert_eq!(summary.steps, 1);
    // v1 at start, v1 again for the redraw, v2 after the update.
    assert_eq!(*pushes.lock().unwrap(), vec![1, 1, 2]);
}

#[test]
fn stale_samples_twice_in_a_row_stop_the_run() {
    let tmp = tempfile::tempdir().unwrap();
    let mut t = trainer(tmp.path(), 2, Arc::new(Mutex::new(Vec::new())));
    let err = t.run().unwrap_err();
    assert!(
        matches!(
            err,
            TrainError::StaleSample {
                expected: 1,
                got: 0,
                ..
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string().contains("policy version 0") && err.to_string().contains("pushed 1"),
        "{err}"
    );
}
