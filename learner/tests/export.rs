//! A model users can load: `learner export` turns a checkpoint's policies into Hugging Face model
//! directories whose weights are the checkpoint's, bit for bit (f32 and bf16), with clear errors for
//! a missing checkpoint, a bad `--policy` and a base model that cannot be found; and a finished run
//! with `output.save_final_model` leaves `final_model/agent-{i}` (or `final_model/shared`).

mod train_common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use clap::Parser;
use cotrain_learner::algo::{AdamW, AdamWConfig};
use cotrain_learner::checkpoint::{TrainState, read_weights, save_checkpoint};
use cotrain_learner::cli::{self, Cli};
use cotrain_learner::services::EngineRollout;
use cotrain_learner::trainer::{Policy, Trainer, TrainerSetup};
use cotrain_model::loader::{self, LoadOptions, LoadedModel};
use tch::{Kind, Tensor};
use train_common::{TokenRule, config, items, tiny_model_dir, tiny_trainer};

fn export(args: &[&str]) -> anyhow::Result<()> {
    let mut argv = vec!["learner", "export"];
    argv.extend_from_slice(args);
    cli::run(Cli::try_parse_from(argv)?)
}

fn perturb(model: &LoadedModel, seed: i64) {
    tch::manual_seed(seed);
    let _guard = tch::no_grad_guard();
    for t in model.vs.variables().values() {
        let noise = t.randn_like() * 0.05;
        let _ = t.shallow_clone().f_add_(&noise).unwrap();
    }
}

/// A checkpoint of `specs.len()` policies, each its base model (named as given in state.json)
/// with its own noise, written by the trainer's `save_checkpoint`.
fn write_checkpoint(run_dir: &Path, base: &Path, specs: &[&str], kind: Kind) -> PathBuf {
    let opts = LoadOptions {
        kind,
        ..Default::default()
    };
    let models: Vec<LoadedModel> = (0..specs.len())
        .map(|i| {
            let m = loader::load(base.to_str().unwrap(), &opts).unwrap();
            perturb(&m, 100 + i as i64);
            m
        })
        .collect();
    let optimizers: Vec<AdamW> = models
        .iter()
        .map(|m| AdamW::new(&m.vs, AdamWConfig::new(1e-3, 0.0, None)))
        .collect();
    let pairs: Vec<_> = models
        .iter()
        .zip(&optimizers)
        .map(|(m, o)| (&m.vs, o))
        .collect();
    let state = TrainState {
        step: 3,
        epoch: 0,
        data_position: 3,
        rng_seed: 1,
        rng_word_pos: "0".into(),
        optimizer_steps: vec![3; specs.len()],
        served_versions: Default::default(),
        extra: serde_json::json!({
            "agent_policy": (0..specs.len()).collect::<Vec<_>>(),
            "policies": specs.iter().enumerate().map(|(i, s)| serde_json::json!({"worker_agent": format!("agent{i}"), "model": s})).collect::<Vec<_>>(),
        }),
    };
    save_checkpoint(run_dir, &pairs, &state).unwrap()
}

fn assert_weights_equal(dir: &Path, want: &BTreeMap<String, Tensor>, kind: Kind) {
    let back = loader::load(
        dir.to_str().unwrap(),
        &LoadOptions {
            kind,
            ..Default::default()
        },
    )
    .unwrap();
    let got = back.named_parameters();
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "{}",
        dir.display()
    );
    for (name, t) in want {
        assert_eq!(got[name].kind(), kind, "{name}");
        assert!(
            got[name].equal(t),
            "{}: {name} differs from the checkpoint",
            dir.display()
        );
    }
}

#[test]
fn export_writes_every_policy_of_a_checkpoint_as_a_loadable_model() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tiny_model_dir(tmp.path());
    let spec = base.display().to_string();
    let run = tmp.path().join("run");
    let ckpt = write_checkpoint(&run, &base, &[&spec, &spec], Kind::Float);
    let out = tmp.path().join("export");
    export(&[
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ])
    .unwrap();
    for i in 0..2 {
        let dir = out.join(format!("agent-{i}"));
        assert_weights_equal(&dir, &read_weights(&ckpt, i).unwrap(), Kind::Float);
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(cfg["architectures"][0], "LlamaForCausalLM");
        assert_eq!(cfg["torch_dtype"], "float32");
        for f in [
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "generation_config.json",
        ] {
            assert!(dir.join(f).is_file(), "{f}");
        }
    }
    assert!(
        !read_weights(&ckpt, 0).unwrap()["model.norm.weight"]
            .equal(&read_weights(&ckpt, 1).unwrap()["model.norm.weight"]),
        "the policies differ"
    );

    // One policy, from the run directory (its latest checkpoint), into `--out` itself.
    let single = tmp.path().join("agent1-model");
    export(&[
        "--checkpoint",
        run.to_str().unwrap(),
        "--policy",
        "1",
        "--out",
        single.to_str().unwrap(),
    ])
    .unwrap();
    assert_weights_equal(&single, &read_weights(&ckpt, 1).unwrap(), Kind::Float);
}

#[test]
fn a_bf16_checkpoint_exports_in_bf16() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tiny_model_dir(tmp.path());
    let ckpt = write_checkpoint(
        &tmp.path().join("run"),
        &base,
        &[base.to_str().unwrap()],
        Kind::BFloat16,
    );
    let out = tmp.path().join("bf16");
    export(&[
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--policy",
        "0",
        "--out",
        out.to_str().unwrap(),
    ])
    .unwrap();
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["torch_dtype"], "bfloat16");
    let stored = Tensor::read_safetensors(out.join("model.safetensors")).unwrap();
    assert!(
        stored.iter().all(|(_, t)| t.kind() == Kind::BFloat16),
        "stored in the training dtype"
    );
    assert_weights_equal(&out, &read_weights(&ckpt, 0).unwrap(), Kind::BFloat16);
}

#[test]
fn export_errors_name_the_problem() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tiny_model_dir(tmp.path());
    let spec = base.display().to_string();
    let ckpt = write_checkpoint(&tmp.path().join("run"), &base, &[&spec, &spec], Kind::Float);
    let out = tmp.path().join("out");
    let err = |args: &[&str]| format!("{:#}", export(args).unwrap_err());

    let e = err(&[
        "--checkpoint",
        "/nonexistent/step-1",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(
        e.contains("--checkpoint /nonexistent/step-1: no such checkpoint directory"),
        "{e}"
    );
    let e = err(&[
        "--checkpoint",
        base.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(e.contains("not a checkpoint (no state.json"), "{e}");
    let e = err(&[
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--policy",
        "5",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(
        e.contains("--policy 5: the checkpoint has 2 policies (indices 0 to 1)"),
        "{e}"
    );
    assert!(!out.exists(), "nothing written on an error");

    let gone = write_checkpoint(
        &tmp.path().join("run2"),
        &base,
        &["/nonexistent/tiny-llama"],
        Kind::Float,
    );
    let e = err(&[
        "--checkpoint",
        gone.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(
        e.contains("policy 0: cannot load its base model `/nonexistent/tiny-llama`"),
        "{e}"
    );
    assert!(e.contains("missing file /nonexistent/tiny-llama"), "{e}");

    // A checkpoint whose tensors do not fit the base model it names.
    let other = tmp.path().join("qwen3");
    std::fs::create_dir_all(&other).unwrap();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/tiny/qwen3");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture.join(f), other.join(f)).unwrap();
    }
    std::fs::copy(base.join("tokenizer.json"), other.join("tokenizer.json")).unwrap();
    let state_path = ckpt.join("state.json");
    let text = std::fs::read_to_string(&state_path)
        .unwrap()
        .replace(&spec, other.to_str().unwrap());
    std::fs::write(&state_path, text).unwrap();
    let e = err(&[
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--policy",
        "0",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(
        e.contains("policy 0: the checkpoint's weights do not fit base model"),
        "{e}"
    );
}

const YAML: &str = "model: {name: unused, temperature: 1.0, top_p: 1.0, top_k: 0, max_length: 64}\n\
dataset: {name: gsm8k, train_split: 'train[:2]'}\n\
seed: 3\n\
magrpo:\n  num_agents: 2\n  num_generations: 2\n  max_new_tokens: 2\n  learning_rate: 0.01\n  num_train_epochs: 1\n  \
rollout_buffer_size: 2\n  train_batch_size: 2\n  eval_interval: 1000\n  save_steps: 1000\n  logging_steps: 1\n\
logging: {tensorboard: false, plots: false, progress: never}\n";

fn any_first(_: &[u32]) -> bool {
    true
}

fn first_token_even(t: &[u32]) -> bool {
    t[0].is_multiple_of(2)
}

#[test]
fn a_finished_run_saves_one_final_model_per_agent() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tiny_model_dir(tmp.path());
    let run = tmp.path().join("run");
    let mut trainer = tiny_trainer(
        &config(YAML, &[]),
        &base,
        &run,
        Box::new(TokenRule {
            rule: first_token_even,
        }),
        2,
    );
    let summary = trainer.run().unwrap();
    assert_eq!(
        summary.final_models,
        vec![
            run.join("final_model/agent-0"),
            run.join("final_model/agent-1")
        ]
    );
    let ckpt = summary
        .checkpoint
        .clone()
        .expect("the final checkpoint is still written, for resuming");
    assert!(ckpt.ends_with("step-1"), "{}", ckpt.display());
    for (i, dir) in summary.final_models.iter().enumerate() {
        let trained = trainer.policies()[i].parameters();
        assert_weights_equal(dir, &trained, Kind::Float);
        assert_weights_equal(dir, &read_weights(&ckpt, i).unwrap(), Kind::Float);
    }

    // Without save_final_model: neither a final checkpoint nor final models.
    let run = tmp.path().join("run-nosave");
    let cfg = config(YAML, &["output.save_final_model=false".into()]);
    let summary = tiny_trainer(
        &cfg,
        &base,
        &run,
        Box::new(TokenRule { rule: any_first }),
        2,
    )
    .run()
    .unwrap();
    assert!(summary.final_models.is_empty());
    assert!(!run.join("final_model").exists());
}

#[test]
fn shared_parameters_give_one_shared_final_model() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tiny_model_dir(tmp.path());
    let run = tmp.path().join("run");
    let spec = base.display().to_string();
    let opts = LoadOptions::default();
    let cfg = config(YAML, &[]);
    let policy = Policy::new(
        "shared",
        &spec,
        loader::load(&spec, &opts).unwrap(),
        None,
        AdamWConfig::new(0.01, 0.0, None),
    );
    let mut trainer = Trainer::new(TrainerSetup {
        cfg: cfg.clone(),
        run_dir: run.clone(),
        task: "token_rule".into(),
        is_code: false,
        policies: vec![policy],
        agent_policy: vec![0, 0],
        rollout: Box::new(EngineRollout::new(vec![(
            "shared".into(),
            loader::load(&spec, &opts).unwrap(),
        )])),
        reward: Box::new(TokenRule {
            rule: first_token_even,
        }),
        train_items: items(2, 2),
        eval_items: items(1, 2),
    })
    .unwrap();
    let summary = trainer.run().unwrap();
    assert_eq!(summary.final_models, vec![run.join("final_model/shared")]);
    assert_weights_equal(
        &summary.final_models[0],
        &trainer.policies()[0].parameters(),
        Kind::Float,
    );
}

/// A MaPoRL run directory: a trained-looking policy adapter (B non-zero) and a critic, saved in
/// PEFT's layout by the adapter's own writer, with the manifest, as the trainer saves them (the
/// end-to-end MaPoRL test exports a real run's).
fn write_maporl_adapters(run: &Path, base: &Path) -> PathBuf {
    use cotrain_model::lora::{LoraAdapter, LoraConfig};
    let model = loader::load(base.to_str().unwrap(), &LoadOptions::default()).unwrap();
    let dir = run.join("adapters");
    for (i, key) in ["agent0.turn0", "critic.agent0"].iter().enumerate() {
        tch::manual_seed(7 + i as i64);
        let ad = LoraAdapter::new(&model.model, LoraConfig::default()).unwrap();
        let _g = tch::no_grad_guard();
        for (name, mut t) in ad.named_tensors() {
            if name.contains("lora_B") {
                t.copy_(&(Tensor::randn(t.size(), (Kind::Float, t.device())) * 0.05));
            }
        }
        ad.save_peft(&dir.join(key), base.to_str().unwrap())
            .unwrap();
    }
    let manifest = cotrain_learner::export::MaporlManifest {
        policies: vec!["agent0.turn0".into()],
        critics: vec!["critic.agent0".into()],
        full_finetune: false,
    };
    std::fs::write(
        dir.join(cotrain_learner::export::MAPORL_MANIFEST),
        serde_json::to_string(&manifest).unwrap(),
    )
    .unwrap();
    dir
}

#[test]
fn a_maporl_run_exports_its_policy_adapters_and_the_merged_models() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tiny_model_dir(tmp.path());
    let run = tmp.path().join("run");
    let adapters = write_maporl_adapters(&run, &base);
    let out = tmp.path().join("export");
    export(&[
        "--checkpoint",
        run.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--merged",
    ])
    .unwrap();

    // The policy adapter is copied as PEFT wrote it; the critic is not a policy and stays behind.
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        assert_eq!(
            std::fs::read(out.join("agent0.turn0").join(f)).unwrap(),
            std::fs::read(adapters.join("agent0.turn0").join(f)).unwrap(),
            "{f}"
        );
    }
    assert!(!out.join("critic.agent0").exists() && !out.join("critic.agent0-merged").exists());

    // The merged model holds W + (alpha / r)·B·A for every targeted projection, computed here from
    // the two files alone, and the base's other tensors unchanged.
    let merged: BTreeMap<String, Tensor> =
        Tensor::read_safetensors(out.join("agent0.turn0-merged/model.safetensors"))
            .unwrap()
            .into_iter()
            .collect();
    let base_w: BTreeMap<String, Tensor> = Tensor::read_safetensors(base.join("model.safetensors"))
        .unwrap()
        .into_iter()
        .collect();
    let lora: BTreeMap<String, Tensor> =
        Tensor::read_safetensors(adapters.join("agent0.turn0/adapter_model.safetensors"))
            .unwrap()
            .into_iter()
            .collect();
    let mut adapted = 0;
    for (name, w) in &base_w {
        let stem = name.strip_suffix(".weight").unwrap_or(name);
        let a = lora.get(&format!("base_model.model.{stem}.lora_A.weight"));
        let b = lora.get(&format!("base_model.model.{stem}.lora_B.weight"));
        let want = match (a, b) {
            (Some(a), Some(b)) => {
                adapted += 1;
                w.to_kind(Kind::Float) + b.matmul(a) * (16.0 / 8.0)
            }
            _ => w.to_kind(Kind::Float),
        };
        let got = merged
            .get(name)
            .unwrap_or_else(|| panic!("{name} missing from the merged model"))
            .to_kind(Kind::Float);
        let diff = (&got - &want).abs().max().double_value(&[]);
        assert!(
            diff < 1e-6,
            "{name}: merged differs from W + scaling·B·A by {diff}"
        );
    }
    let layers = loader::load(base.to_str().unwrap(), &LoadOptions::default())
        .unwrap()
        .model
        .config()
        .num_hidden_layers;
    assert_eq!(
        adapted,
        7 * layers,
        "every attention and MLP projection of every layer is adapted"
    );
    // A user loads the merged directory like any model.
    loader::load(
        out.join("agent0.turn0-merged").to_str().unwrap(),
        &LoadOptions::default(),
    )
    .unwrap();

    // `--policy` belongs to MAGRPO checkpoints; `--merged` to adapters.
    let e = export(&[
        "--checkpoint",
        run.to_str().unwrap(),
        "--policy",
        "0",
        "--out",
        out.to_str().unwrap(),
    ])
    .unwrap_err();
    assert!(
        e.to_string().contains("--policy selects a MAGRPO policy"),
        "{e}"
    );
}
