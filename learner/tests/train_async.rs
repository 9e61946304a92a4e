//! Asynchronous rollouts (`rollout.max_off_policy_steps: k`): the next step's rollout is drawn while
//! a step trains; a sample more than k versions older than the policy it would train is never
//! trained on (its item is redrawn, and counted); the loss is corrected with truncated importance
//! weights; and MAGRPO still learns the cooperative task of the learning test.

mod train_common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use cotrain_learner::services::EngineRollout;
use cotrain_learner::trainer::{
    GenRequest, GenSample, RolloutSource, TrainError, Trainer, TrainerSetup,
};
use tch::Tensor;
use train_common::{TokenRule, config, tiny_model_dir, tiny_trainer};

fn same_class(t: &[u32]) -> bool {
    t[0] % 4 == t[1] % 4
}

fn yaml(k: usize, epochs: usize) -> String {
    format!(
        "model: {{name: unused, temperature: 1.0, top_p: 1.0, top_k: 0, max_length: 64}}\n\
         dataset: {{name: gsm8k, train_split: 'train[:4]'}}\n\
         seed: 11\n\
         magrpo:\n  num_agents: 2\n  num_generations: 8\n  max_new_tokens: 1\n  learning_rate: 0.002\n  \
         num_train_epochs: {epochs}\n  rollout_buffer_size: 4\n  eval_interval: 1000\n  save_steps: 100000\n  logging_steps: 1\n\
         rollout: {{max_off_policy_steps: {k}}}\n\
         logging: {{tensorboard: false, plots: false, progress: never}}\n"
    )
}

#[test]
fn magrpo_learns_with_asynchronous_rollouts_one_version_behind() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model_dir(tmp.path());
    let cfg = config(&yaml(1, 30), &[]);
    let mut trainer = tiny_trainer(
        &cfg,
        &model,
        &tmp.path().join("run"),
        Box::new(TokenRule { rule: same_class }),
        4,
    );
    let summary = trainer.run().unwrap();
    let h = &summary.history;
    assert_eq!(h.len(), 30);
    let r: Vec<f64> = h.iter().map(|m| m["reward/mean"]).collect();
    let last = r[25..].iter().sum::<f64>() / 5.0;
    eprintln!(
        "async k=1 curve {:?}",
        r.iter()
            .map(|x| (x * 100.0).round() / 100.0)
            .collect::<Vec<_>>()
    );
    assert!(r[0] < 0.5, "starts near chance, got {}", r[0]);
    assert!(
        last >= 0.8,
        "MAGRPO with one-step-stale rollouts should still reach >= 0.8, got {last}"
    );
    // Step 1 trains on a fresh rollout; every later step on the one drawn while the previous step
    // trained, one version behind.
    assert_eq!(h[0]["async/staleness_max"], 0.0);
    for (i, m) in h.iter().enumerate().skip(1) {
        assert_eq!(m["async/staleness_mean"], 1.0, "{m:?}");
        assert_eq!(m["async/dropped_samples"], 0.0);
        // Every step but the last draws the next step's rollout while it trains.
        assert_eq!(
            m["async/overlap_secs"] > 0.0,
            i + 1 < h.len(),
            "step {}: {m:?}",
            i + 1
        );
        let w = m["is/weight_mean"];
        assert!(
            w > 0.0 && w <= 2.0,
            "importance weights are capped at 2: {w}"
        );
    }
    assert!(
        h.last()
            .unwrap()
            .get("time/generate_next")
            .is_some_and(|&t| t == 0.0),
        "nothing is drawn after the last step"
    );
}

/// Per generate call, its requests' (seed, min_policy_version).
type CallLog = Arc<Mutex<Vec<Vec<(u64, u64)>>>>;

/// Wraps the engine; the generate calls whose (0-based) number is in `age` report their samples
/// `by` versions older than they are, and every call's requests are recorded.
struct Aging {
    inner: EngineRollout,
    calls: usize,
    age: Vec<usize>,
    by: u64,
    log: CallLog,
}

impl RolloutSource for Aging {
    fn generate(&mut self, requests: &[GenRequest]) -> Result<Vec<Vec<GenSample>>, TrainError> {
        let mut out = self.inner.generate(requests)?;
        if self.age.contains(&self.calls) {
            for s in out.iter_mut().flatten() {
                s.policy_version = s.policy_version.saturating_sub(self.by);
            }
        }
        self.log.lock().unwrap().push(
            requests
                .iter()
                .map(|r| (r.seed, r.min_policy_version))
                .collect(),
        );
        self.calls += 1;
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
        self.inner.push_weights(agent, version, params)
    }
    fn describe(&self) -> String {
        "aging engine".into()
    }
}

#[test]
fn a_sample_staler_than_the_bound_never_reaches_the_loss_and_its_item_is_redrawn() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model_dir(tmp.path());
    let cfg = config(&yaml(1, 3), &[]);
    let spec = model.display().to_string();
    let opts = cotrain_model::loader::LoadOptions::default();
    let adam = cotrain_learner::algo::AdamWConfig::new(2e-3, 0.0, None);
    let load = || cotrain_model::loader::load(&spec, &opts).unwrap();
    let policies = (0..2)
        .map(|a| {
            cotrain_learner::trainer::Policy::new(&format!("agent{a}"), &spec, load(), None, adam)
        })
        .collect();
    let engine = EngineRollout::new((0..2).map(|a| (format!("agent{a}"), load())).collect());
    let log = Arc::new(Mutex::new(Vec::new()));
    // Call 0 draws step 1, call 1 step 2 (while step 1 trains): that one comes back 2 versions
    // older than drawn, 3 behind the policy step 2 trains, more than the bound of 1.
    let aging = Aging {
        inner: engine,
        calls: 0,
        age: vec![1],
        by: 2,
        log: log.clone(),
    };
    let mut trainer = Trainer::new(TrainerSetup {
        cfg,
        run_dir: tmp.path().join("run"),
        task: "t".into(),
        is_code: false,
        policies,
        agent_policy: vec![0, 1],
        rollout: Box::new(aging),
        reward: Box::new(TokenRule { rule: same_class }),
        train_items: train_common::items(4, 2),
        eval_items: Vec::new(),
    })
    .unwrap();
    let h = trainer.run().unwrap().history;
    assert_eq!(h.len(), 3);
    // Step 2: all 4 items × 2 agents × 8 samples were too stale; they were dropped and redrawn at
    // the current version, so what the loss saw is at most one version behind.
    assert_eq!(h[1]["async/dropped_samples"], 64.0, "{:?}", h[1]);
    assert_eq!(h[1]["async/redrawn_samples"], 64.0);
    assert_eq!(
        h[1]["async/staleness_max"], 0.0,
        "the redrawn samples come from the current policy"
    );
    assert_eq!(h[2]["async/dropped_samples"], 0.0);
    assert_eq!(h[2]["async/staleness_max"], 1.0);
    // The redraw asked again for step 2's seeds, at the version step 2 trains.
    let calls = log.lock().unwrap().clone();
    assert_eq!(
        calls.len(),
        4,
        "step 1, step 2 ahead, step 2 redrawn, step 3 ahead"
    );
    let seeds = |c: &Vec<(u64, u64)>| c.iter().map(|r| r.0).collect::<Vec<_>>();
    assert_eq!(seeds(&calls[2]), seeds(&calls[1]));
    assert!(
        calls[2].iter().all(|r| r.1 == calls[1][0].1 + 1),
        "{calls:?}"
    );
}

#[test]
fn asynchronous_rollouts_refuse_what_they_do_not_support() {
    let multi = config(
        &yaml(1, 1),
        &[
            "magrpo.num_turns=2".into(),
            "dataset.name=coophumaneval".into(),
            "dataset.train_split=test[:2]".into(),
        ],
    );
    let err = cotrain_learner::trainer::check_supported(&multi)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("max_off_policy_steps") && err.contains("single-turn"),
        "{err}"
    );
    let cap = config(&yaml(1, 1), &["rollout.importance_weight_cap=0".into()]);
    let err = cotrain_learner::trainer::check_supported(&cap)
        .unwrap_err()
        .to_string();
    assert!(err.contains("rollout.importance_weight_cap"), "{err}");
    let ranks = cotrain_learner::trainer::check_ranks(&config(&yaml(1, 1), &[]), 2)
        .unwrap_err()
        .to_string();
    assert!(ranks.contains("one rank"), "{ranks}");
}
