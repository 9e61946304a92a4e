//! LoRA in the GRPO/MAGRPO trainer (`model.lora`), through the policies `learner train` loads
//! (`load_policies`): two agents train their own adapters on one frozen base held once, the base
//! never changes, the cooperative task is learned, the workers are sent adapters only and serve
//! base + scaling·B·A, checkpoints hold the adapters only and resume to the same adapter, and
//! `learner export` writes a PEFT adapter directory and, with `--merged`, the merged model.

mod train_common;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use clap::Parser;
use cotrain_learner::cli::{self, Cli};
use cotrain_learner::trainer::{GenRequest, GenSample, RolloutSource, TrainError};
use cotrain_model::loader::{self, LoadOptions};
use cotrain_model::lora::LoraAdapter;
use tch::{Kind, Tensor};
use train_common::{TokenRule, config, config_trainer, tiny_model_dir};

/// Both agents' first tokens in the same class mod 4 (chance 0.25).
fn same_class(t: &[u32]) -> bool {
    t[0] % 4 == t[1] % 4
}

fn yaml(model: &str, epochs: usize, lr: f64) -> String {
    format!(
        "model: {{name: '{model}', temperature: 1.0, top_p: 1.0, top_k: 0, max_length: 64,\n        \
         lora: {{r: 8, lora_alpha: 16, lora_dropout: 0.0}}}}\n\
         dataset: {{name: gsm8k, train_split: 'train[:4]'}}\n\
         seed: 11\n\
         magrpo:\n  num_agents: 2\n  num_generations: 8\n  max_new_tokens: 1\n  learning_rate: {lr}\n  \
         num_train_epochs: {epochs}\n  rollout_buffer_size: 4\n  eval_interval: 1000\n  save_steps: 1\n  logging_steps: 1\n\
         output: {{save_final_model: true}}\n\
         logging: {{tensorboard: false, plots: false, progress: never}}\n"
    )
}

/// The tests of this file run one at a time: LoRA draws (A's start, dropout masks) come from
/// libtorch's one generator, which tests running in parallel threads would share.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_kind(Kind::Double) - b.to_kind(Kind::Double))
        .abs()
        .max()
        .double_value(&[])
}

/// (agent, version, tensor names, Some(scaling) for an adapter update)
type Push = (String, u64, Vec<String>, Option<f64>);

/// Every push the trainer makes, with what it carried.
struct PushLog {
    inner: cotrain_learner::services::EngineRollout,
    /// (agent, version, tensor names, Some(scaling) for an adapter update)
    pushes: Arc<Mutex<Vec<Push>>>,
}

impl RolloutSource for PushLog {
    fn generate(&mut self, requests: &[GenRequest]) -> Result<Vec<Vec<GenSample>>, TrainError> {
        self.inner.generate(requests)
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
        self.pushes.lock().unwrap().push((
            agent.into(),
            version,
            params.keys().cloned().collect(),
            None,
        ));
        self.inner.push_weights(agent, version, params)
    }
    fn push_adapter(
        &mut self,
        agent: &str,
        version: u64,
        adapter: &BTreeMap<String, Tensor>,
        scaling: f64,
    ) -> Result<(), TrainError> {
        self.pushes.lock().unwrap().push((
            agent.into(),
            version,
            adapter.keys().cloned().collect(),
            Some(scaling),
        ));
        self.inner.push_adapter(agent, version, adapter, scaling)
    }
    fn describe(&self) -> String {
        "push log".into()
    }
}

#[test]
fn magrpo_with_lora_learns_on_one_frozen_base_and_pushes_adapters_only() {
    let _serial = serial();
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model_dir(tmp.path());
    let spec = model.display().to_string();
    let cfg = config(&yaml(&spec, 30, 0.02), &[]);
    let pushes = Arc::new(Mutex::new(Vec::new()));
    let (policies, agent_policy) = cotrain_learner::trainer::load_policies(&cfg).unwrap();
    let engines = policies
        .iter()
        .map(|p| {
            (
                p.worker_agent.clone(),
                loader::load(&spec, &LoadOptions::default()).unwrap(),
            )
        })
        .collect();
    let mut trainer =
        cotrain_learner::trainer::Trainer::new(cotrain_learner::trainer::TrainerSetup {
            cfg: cfg.clone(),
            run_dir: tmp.path().join("run"),
            task: "token_rule".into(),
            is_code: false,
            policies,
            agent_policy,
            rollout: Box::new(PushLog {
                inner: cotrain_learner::services::EngineRollout::new(engines),
                pushes: pushes.clone(),
            }),
            reward: Box::new(TokenRule { rule: same_class }),
            train_items: train_common::items(4, 2),
            eval_items: train_common::items(2, 2),
        })
        .unwrap();

    // One base in memory: both policies' networks read the same storage.
    let p = trainer.policies();
    assert_eq!(p.len(), 2);
    let name = "model.layers.0.self_attn.q_proj.weight";
    let ptr = |vs: &tch::nn::VarStore| vs.variables()[name].data_ptr();
    assert_eq!(
        ptr(&p[0].model.vs),
        ptr(&p[1].model.vs),
        "the two agents must share one base"
    );
    // AdamW holds state for the adapters only: 2 layers × 7 projections × (A, B).
    for policy in p {
        let trained = policy.parameters();
        assert_eq!(
            trained.len(),
            28,
            "{:?}",
            trained.keys().take(3).collect::<Vec<_>>()
        );
        assert!(
            trained
                .keys()
                .all(|k| k.contains(".lora_A.") || k.contains(".lora_B."))
        );
        assert_eq!(policy.optimizer.parameters().len(), 28);
    }
    let summary = trainer.run().unwrap();
    let r: Vec<f64> = summary.history.iter().map(|m| m["reward/mean"]).collect();
    let last = r[r.len() - 5..].iter().sum::<f64>() / 5.0;
    eprintln!(
        "lora magrpo: first {:.3} last {last:.3} curve {:?}",
        r[0],
        r.iter()
            .map(|x| (x * 100.0).round() / 100.0)
            .collect::<Vec<_>>()
    );
    assert!(r[0] < 0.5, "starts near chance (0.25), got {}", r[0]);
    assert!(
        last >= 0.8,
        "MAGRPO with LoRA should reach >= 0.8 of the maximum reward, got {last}"
    );

    // Every push was an adapter update (alpha / r = 2) of the adapters' tensors alone.
    let pushes = pushes.lock().unwrap();
    assert!(pushes.len() >= 30, "{} pushes", pushes.len());
    for (agent, version, names, scaling) in pushes.iter() {
        assert_eq!(*scaling, Some(2.0), "{agent} v{version}");
        assert_eq!(names.len(), 28, "{agent} v{version}");
    }

    // The base never changed: bit for bit the file's weights.
    let fresh = loader::load(&spec, &LoadOptions::default()).unwrap();
    let p = trainer.policies();
    for (name, t) in fresh.named_parameters() {
        assert_eq!(
            max_diff(&t, &p[0].model.vs.variables()[&name]),
            0.0,
            "base weight {name} changed"
        );
    }
    // The adapters trained (B left zero), and differently for the two agents.
    let b = "model.layers.1.mlp.down_proj.lora_B.weight";
    let (b0, b1) = (&p[0].parameters()[b], &p[1].parameters()[b]);
    assert!(b0.abs().max().double_value(&[]) > 0.0);
    assert!(max_diff(b0, b1) > 0.0);

    // The policy (base + adapter, unmerged) and the merged weights the workers serve give the
    // same logits.
    let ids = Tensor::from_slice(&[65i64, 97, 48, 66]).view([1, 4]);
    let unmerged = p[0].model.model.forward(&ids).unwrap();
    let merged_weights: HashMap<String, Tensor> = p[0]
        .adapter
        .as_ref()
        .unwrap()
        .merged(&fresh.named_parameters())
        .unwrap()
        .into_iter()
        .collect();
    fresh.load_named_tensors(&merged_weights).unwrap();
    let merged = fresh.model.forward(&ids).unwrap();
    assert!(
        max_diff(&unmerged, &merged) < 1e-4,
        "unmerged vs merged logits differ by {}",
        max_diff(&unmerged, &merged)
    );

    // The final models are PEFT adapter directories.
    let run = trainer.run_dir().to_path_buf();
    for a in 0..2 {
        let dir = run.join(format!("final_model/agent-{a}"));
        assert!(
            dir.join("adapter_config.json").is_file()
                && dir.join("adapter_model.safetensors").is_file(),
            "{}",
            dir.display()
        );
        assert!(!dir.join("model.safetensors").exists());
    }
}

fn export(args: &[&str]) -> anyhow::Result<()> {
    let mut argv = vec!["learner", "export"];
    argv.extend_from_slice(args);
    cli::run(Cli::try_parse_from(argv)?)
}

#[test]
fn lora_checkpoints_hold_adapters_resume_to_them_and_export_for_peft() {
    let _serial = serial();
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model_dir(tmp.path());
    let spec = model.display().to_string();
    let cfg = config(
        &yaml(&spec, 1, 0.02),
        &["model.lora.lora_dropout=0.1".into()],
    );
    let mut trainer = config_trainer(
        &cfg,
        &tmp.path().join("run"),
        Box::new(TokenRule { rule: same_class }),
        4,
    );
    trainer.run().unwrap();
    let run = trainer.run_dir().to_path_buf();
    let ckpt = cotrain_learner::checkpoint::latest_checkpoint(&run).expect("a checkpoint");

    // The checkpoint's tensors are the adapters', and state.json says so.
    let weights = cotrain_learner::checkpoint::read_weights(&ckpt, 0).unwrap();
    assert_eq!(weights.len(), 28);
    assert!(
        weights.keys().all(|k| k.contains(".lora_")),
        "{:?}",
        weights.keys().next()
    );
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ckpt.join("state.json")).unwrap()).unwrap();
    assert_eq!(state["extra"]["policies"][1]["lora"]["r"], 8);
    assert_eq!(state["extra"]["policies"][1]["lora"]["dropout"], 0.1);

    // A new trainer resumed from it holds the same adapters (and the untouched base).
    let mut resumed = config_trainer(
        &cfg,
        &tmp.path().join("run-b"),
        Box::new(TokenRule { rule: same_class }),
        4,
    );
    resumed.restore(&ckpt).unwrap();
    for (a, b) in trainer.policies().iter().zip(resumed.policies()) {
        for (name, t) in a.parameters() {
            assert_eq!(max_diff(&t, &b.parameters()[&name]), 0.0, "{name}");
        }
    }

    // `learner export --merged`: a PEFT adapter directory per agent and the merged model beside it.
    let out = tmp.path().join("out");
    export(&[
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--merged",
    ])
    .unwrap();
    let base = loader::load(&spec, &LoadOptions::default()).unwrap();
    for a in 0..2 {
        let dir = out.join(format!("agent-{a}"));
        let config: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("adapter_config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(config["base_model_name_or_path"], spec.as_str());
        assert_eq!(config["lora_dropout"], 0.1);
        let adapter = LoraAdapter::load_peft(&dir, &base.model).unwrap();
        for (name, t) in adapter.named_tensors() {
            assert_eq!(
                max_diff(&t, &trainer.policies()[a].parameters()[&name]),
                0.0,
                "agent {a} {name}"
            );
        }
        let merged = loader::load(
            out.join(format!("agent-{a}-merged")).to_str().unwrap(),
            &LoadOptions::default(),
        )
        .unwrap();
        let ids = Tensor::from_slice(&[66i64, 98, 49]).view([1, 3]);
        let want = trainer.policies()[a].model.model.forward(&ids).unwrap();
        let got = merged.model.forward(&ids).unwrap();
        assert!(
            max_diff(&want, &got) < 1e-4,
            "agent {a}: merged export vs policy logits differ by {}",
            max_diff(&want, &got)
        );
    }
}

#[test]
fn lora_settings_are_checked_and_shared_parameters_need_one_adapter() {
    let _serial = serial();
    let base = "model: {name: m, lora: {r: 4}}\ndataset: {name: gsm8k}\nmagrpo: {num_agents: 2}\n";
    let v = |yaml: &str, o: &[&str]| {
        let o: Vec<String> = o.iter().map(|s| s.to_string()).collect();
        cotrain_learner::config::merged_value(yaml, "t.yaml", &o, &Default::default()).unwrap()
    };
    let check = |yaml: &str, o: &[&str]| {
        cotrain_learner::config::CheckedConfig::from_value(
            v(yaml, o),
            std::path::Path::new("t.yaml"),
        )
    };
    let cfg = check(base, &[]).unwrap();
    assert_eq!(cfg.agents[0].lora.as_ref().unwrap().r, 4);
    assert_eq!(cfg.agents[1].lora.as_ref().unwrap().alpha, 16.0);
    // One agent's own adapter replaces the shared one.
    let cfg = check(base, &["model.agents=[{lora: {r: 16}}, {}]"]).unwrap();
    assert_eq!(
        (
            cfg.agents[0].lora.as_ref().unwrap().r,
            cfg.agents[1].lora.as_ref().unwrap().r
        ),
        (16, 4)
    );
    let e = check(base, &["model.lora.target_modules=[qproj]"])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("model.lora") && e.contains("`qproj` is not one of"),
        "{e}"
    );
    let e = check(base, &["model.lora.r=0"]).unwrap_err().to_string();
    assert!(
        e.contains("model.lora") && e.contains("r must be at least 1"),
        "{e}"
    );
    let e = check(base, &["model.lora.rank=8"]).unwrap_err().to_string();
    assert!(e.contains("rank"), "{e}");
    let e = check(
        base,
        &[
            "magrpo.shared_parameters=true",
            "model.agents=[{lora: {r: 16}}, {}]",
        ],
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("model.agents[1].lora") && e.contains("one adapter"),
        "{e}"
    );
}

/// LoRA dropout draws masks from libtorch's one generator: seeded per policy and optimiser step,
/// with the policies updated in turn, a seeded run repeats exactly and a run resumed from its
/// checkpoint ends on the same adapters as the uninterrupted one.
#[test]
fn lora_dropout_runs_repeat_and_resume_exactly() {
    let _serial = serial();
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model_dir(tmp.path());
    let cfg = config(
        &yaml(&model.display().to_string(), 3, 0.02),
        &["model.lora.lora_dropout=0.3".into()],
    );
    let run = |dir: &str| {
        let mut t = config_trainer(
            &cfg,
            &tmp.path().join(dir),
            Box::new(TokenRule { rule: same_class }),
            4,
        );
        t.run().unwrap();
        t
    };
    let (a, b) = (run("a"), run("b"));
    for (pa, pb) in a.policies().iter().zip(b.policies()) {
        assert!(pa.draws_dropout());
        for (name, t) in pa.parameters() {
            assert_eq!(
                max_diff(&t, &pb.parameters()[&name]),
                0.0,
                "a repeated run differs at {name}"
            );
        }
    }
    let mut resumed = config_trainer(
        &cfg,
        &tmp.path().join("a"),
        Box::new(TokenRule { rule: same_class }),
        4,
    );
    resumed
        .restore(&a.run_dir().join("checkpoints/step-2"))
        .unwrap();
    resumed.run().unwrap();
    assert_eq!(resumed.step(), 3);
    for (pa, pr) in a.policies().iter().zip(resumed.policies()) {
        for (name, t) in pa.parameters() {
            assert_eq!(
                max_diff(&t, &pr.parameters()[&name]),
                0.0,
                "the resumed run differs at {name}"
            );
        }
    }
}
