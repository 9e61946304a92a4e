//! Integration tests of the learner's foundations: configs (every file in configs/, fixtures with
//! wrong keys and values, overrides and legacy flags), datasets, prompts, the exactness of the update
//! math, AdamW, the shared-parameter gradient, and checkpoints.

use std::path::{Path, PathBuf};

use cotrain_learner::algo::{
    self, AdamW, AdamWConfig, AdvantageOptions, LossOptions, PolicyBatch, RewardProcessor,
    node_advantages, policy_loss,
};
use cotrain_learner::config::{
    AdapterLayout, AdvantageMode, Algorithm, CheckedConfig, JointMode, KlEstimator, LegacyFlags,
    LossNormalization, load_config, merged_value,
};
use cotrain_learner::data::{DatasetKind, SplitSpec, TaskItem, load_split};
use tch::{Kind, Tensor, nn, nn::Module, nn::OptimizerConfig};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}
fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/configs")
        .join(name)
}
fn load_err(name: &str) -> String {
    load_config(&fixture(name), &[], &LegacyFlags::default())
        .unwrap_err()
        .to_string()
}

// ---------------------------------------------------------------- configs

#[test]
fn every_file_in_configs_loads_and_validates() {
    let mut n = 0;
    for entry in std::fs::read_dir(repo().join("configs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
            continue;
        }
        let cfg =
            load_config(&path, &[], &LegacyFlags::default()).unwrap_or_else(|e| panic!("{e}"));
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if name.starts_with("mt_") {
            assert!(cfg.is_multi_turn(), "{name}");
            assert_eq!(cfg.turn_gradient_weights, vec![1.2, 0.8]);
            assert_eq!(
                cfg.trainer.rollout,
                cotrain_learner::config::MultiTurnMode::Handoff,
                "{name}"
            );
        }
        cotrain_learner::cli::ensure_trainable(&cfg).unwrap_or_else(|e| panic!("{name}: {e}"));
        if name.starts_with("grpo_") {
            assert_eq!(
                (cfg.algorithm, cfg.num_agents),
                (Algorithm::Grpo, 1),
                "{name}"
            );
        }
        if name.starts_with("maporl_") {
            let m = cfg.raw.maporl.as_ref().unwrap();
            assert_eq!(
                (
                    cfg.algorithm,
                    m.agent_num,
                    m.round_num,
                    m.kl_coef,
                    m.vf_coef
                ),
                (Algorithm::Maporl, 2, 3, 0.002, 0.1),
                "{name}"
            );
        }
        n += 1;
    }
    assert_eq!(
        n, 13,
        "10 MAGRPO/GRPO seed configs, 2 MaPoRL seed configs and the demo"
    );
}

#[test]
fn seed_configs_carry_the_table_values() {
    let load = |n: &str| {
        load_config(
            &repo().join("configs").join(n),
            &[],
            &LegacyFlags::default(),
        )
        .unwrap()
    };
    let he = load("magrpo_he_config.yaml");
    assert_eq!(he.train_split.to_string(), "test[33:163]");
    assert_eq!(he.eval_split.as_ref().unwrap().to_string(), "test[:32]");
    assert_eq!(
        (
            he.num_agents,
            he.trainer.num_train_epochs,
            he.trainer.learning_rate
        ),
        (2, 8, 2e-5)
    );
    assert_eq!(
        (
            he.sampling.temperature,
            he.sampling.top_p,
            he.sampling.max_new_tokens
        ),
        (0.7, 0.9, 256)
    );
    assert_eq!(he.trainer.early_termination_threshold, Some(4.0));
    let che = load("grpo_che_config.yaml");
    assert_eq!(
        (
            che.trainer.num_train_epochs,
            che.trainer.learning_rate,
            che.sampling.temperature
        ),
        (16, 1e-5, 0.8)
    );
    assert_eq!(che.train_split.to_string(), "test[16:]");
    assert_eq!(
        (
            he.trainer.rollout_buffer_size,
            he.trainer.eval_interval,
            he.trainer.eval_num_samples
        ),
        (1, 4, 4)
    );
    assert!(
        !he.raw.model.chat_template && !he.raw.dataset.shuffle,
        "raw prompts in dataset order, as the original"
    );
    let arxiv = load("magrpo_arxiv_config.yaml");
    assert_eq!(arxiv.raw.model.name, "Qwen/Qwen3-1.7B");
    assert_eq!(arxiv.trainer.learning_rate, 5e-6);
    let grpo_arxiv = load("grpo_arxiv_config.yaml");
    assert_eq!(grpo_arxiv.sampling.max_new_tokens, 512);
    let demo = load("demo.yaml");
    assert_eq!(demo.raw.model.name, "default");
    assert_eq!(
        demo.sampling.top_k, 50,
        "the original's top_k default when unset"
    );
}

#[test]
fn the_original_projects_own_config_files_load() {
    let cfg = load_config(
        &fixture("original/mt_magrpo_he_sep2025.yaml"),
        &[],
        &LegacyFlags::default(),
    )
    .unwrap();
    assert_eq!((cfg.trainer.num_turns, cfg.num_agents), (2, 2));
    // `reward_shift: -4` is the reward processor's shift.
    assert!(cfg.raw.reward_processor.enabled);
    assert_eq!(cfg.raw.reward_processor.shift, -4.0);
    let cfg = load_config(
        &fixture("original/magrpo_tldr_aug2025.yaml"),
        &[],
        &LegacyFlags::default(),
    )
    .unwrap();
    assert_eq!(cfg.num_agents, 2);
    assert_eq!(cfg.trainer.learning_rate, 5e-6);
    // The original's keys also work as overrides; a key with no meaning is still an error.
    let cfg = load_config(
        &fixture("original/magrpo_tldr_aug2025.yaml"),
        &["magrpo.reward_shift=-3".into()],
        &LegacyFlags::default(),
    )
    .unwrap();
    assert_eq!(cfg.raw.reward_processor.shift, -3.0);
    let e = load_config(
        &fixture("original/magrpo_tldr_aug2025.yaml"),
        &["magrpo.reward_shfit=-3".into()],
        &LegacyFlags::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("magrpo_tldr_aug2025.yaml: unknown key magrpo.reward_shfit"),
        "{e}"
    );
}

#[test]
fn wrong_key_is_named_with_a_suggestion() {
    let e = load_err("unknown_key.yaml");
    assert!(
        e.ends_with(
            "unknown_key.yaml: unknown key magrpo.learnin_rate (did you mean learning_rate?)"
        ),
        "{e}"
    );
    let e = load_err("unknown_section.yaml");
    assert!(
        e.ends_with("unknown_section.yaml: unknown key modle (did you mean model?)"),
        "{e}"
    );
}

#[test]
fn wrong_type_and_wrong_variant_name_the_key() {
    let e = load_err("wrong_type.yaml");
    assert!(
        e.contains("wrong_type.yaml: magrpo.num_generations: invalid type: string \"four\""),
        "{e}"
    );
    let e = load_err("bad_enum.yaml");
    assert!(
        e.contains("bad_enum.yaml: magrpo.joint_mode: unknown variant `diagonal`"),
        "{e}"
    );
    assert!(e.contains("aligned") && e.contains("cross"), "{e}");
}

#[test]
fn bad_values_are_errors_naming_key_and_file() {
    // (fixture, what its error says)
    let cases = [
        (
            "bad_split.yaml",
            "bad_split.yaml: dataset.train_split is invalid: bad split syntax `test[16`",
        ),
        (
            "turn_weights_length.yaml",
            "turn_weights_length.yaml: magrpo.turn_gradient_weights has 3 values but magrpo.num_turns is 2",
        ),
        (
            "negative_lr.yaml",
            "magrpo.learning_rate must be a positive number",
        ),
        (
            "grpo_two_agents.yaml",
            "grpo.num_agents is 2 but grpo trains one agent",
        ),
        ("both_sections.yaml", "magrpo and grpo are both present"),
        (
            "unknown_dataset.yaml",
            "dataset.name `some/unknown_set` is not a known dataset",
        ),
        (
            "missing_model.yaml",
            "missing_model.yaml: missing key model",
        ),
    ];
    for (fixture, says) in cases {
        let e = load_err(fixture);
        assert!(e.contains(says), "{fixture}: {e}");
    }
    let e = load_err("turn_weights_length.yaml");
    assert!(
        e.ends_with("magrpo.num_turns is 2"),
        "nothing after the message: {e}"
    );
}

#[test]
fn overrides_are_typed_and_checked() {
    let base = fixture("base.yaml");
    let cfg = load_config(
        &base,
        &[
            "magrpo.num_turns=2".into(),
            "magrpo.turn_gradient_weights=[1.5,0.5]".into(),
            "dataset.train_split='test[16:]'".into(),
        ],
        &LegacyFlags::default(),
    )
    .unwrap();
    assert_eq!(cfg.turn_gradient_weights, vec![1.5, 0.5]);
    // (override, what its error says)
    let cases = [
        (
            "magrpo.turn_gradient_weights=[1.5,0.5]",
            "magrpo.turn_gradient_weights has 2 values but magrpo.num_turns is 1",
        ),
        (
            "magrpo.learning_rate",
            "bad override `magrpo.learning_rate`",
        ),
        ("magrpo.num_agents=two", "magrpo.num_agents: invalid type"),
    ];
    for (pair, says) in cases {
        let e = load_config(&base, &[pair.to_string()], &LegacyFlags::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains(says), "{pair}: {e}");
    }
}

/// `rollout.dtype` and `model.matmul_dtype`: values are checked naming the key, `auto` follows
/// `model.dtype`, a mismatch turns the behaviour-policy correction on; `rollout.bf16_dot_products`
/// is refused without bf16 rollouts. (The maporl trainer's bf16 products are tested in
/// `maporl_ppo_fixture.rs`.)
#[test]
fn precision_keys_are_checked() {
    let base = fixture("base.yaml");
    let load = |ov: &[&str]| {
        load_config(
            &base,
            &ov.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
            &LegacyFlags::default(),
        )
    };
    let e = load(&["rollout.dtype=fp8"]).unwrap_err().to_string();
    assert!(e.contains("rollout.dtype: unknown variant `fp8`"), "{e}");
    let e = load(&["model.matmul_dtype=f64"]).unwrap_err().to_string();
    assert!(
        e.contains("model.matmul_dtype: unknown variant `f64`"),
        "{e}"
    );
    let plain = load(&[]).unwrap();
    assert_eq!(cotrain_learner::trainer::rollout_kind(&plain), Kind::Float);
    assert!(
        cotrain_learner::trainer::matmul_kind(&plain).is_none()
            && !cotrain_learner::trainer::rollout_precision_differs(&plain)
    );
    let same = load(&["model.dtype=bf16", "rollout.dtype=bfloat16"]).unwrap();
    assert!(!cotrain_learner::trainer::rollout_precision_differs(&same));
    let rollouts = load(&["rollout.dtype=bf16"]).unwrap();
    assert_eq!(
        cotrain_learner::trainer::rollout_kind(&rollouts),
        Kind::BFloat16
    );
    assert!(cotrain_learner::trainer::rollout_precision_differs(
        &rollouts
    ));
    let products = load(&["model.matmul_dtype=bf16"]).unwrap();
    assert_eq!(
        cotrain_learner::trainer::matmul_kind(&products),
        Some(Kind::BFloat16)
    );
    assert!(cotrain_learner::trainer::rollout_precision_differs(
        &products
    ));

    // `rollout.bf16_dot_products` (off by default) needs bf16 rollouts.
    assert!(!plain.raw.rollout.bf16_dot_products);
    let e = load(&["rollout.bf16_dot_products=true"])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rollout.bf16_dot_products") && e.contains("set rollout.dtype: bf16"),
        "{e}"
    );
    assert!(
        load(&["rollout.dtype=bf16", "rollout.bf16_dot_products=true"])
            .unwrap()
            .raw
            .rollout
            .bf16_dot_products
    );
    assert!(load(&["model.dtype=bf16", "rollout.bf16_dot_products=true"]).is_ok());
}

/// `model.device`: parsed naming the key; `auto` (the default) trains on the CPU of a machine
/// without a GPU; `cuda` there stops `learner train` before anything is loaded, saying why, where the
/// learner used to train on the CPU without a word.
#[test]
fn a_cuda_device_without_a_gpu_stops_the_run_with_the_reason() {
    let base = fixture("base.yaml");
    let load = |ov: &[&str]| {
        load_config(
            &base,
            &ov.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
            &LegacyFlags::default(),
        )
    };
    let e = load(&["model.device=tpu"]).unwrap_err().to_string();
    assert!(
        e.contains("model.device") && e.contains("unknown device `tpu`"),
        "{e}"
    );
    let plain = load(&[]).unwrap();
    assert_eq!(
        plain.raw.model.device,
        cotrain_model::cuda::DeviceRequest::Auto
    );
    if cotrain_model::cuda::device_count() > 0 {
        return;
    }
    assert_eq!(
        cotrain_learner::trainer::load_options(&plain)
            .unwrap()
            .device,
        tch::Device::Cpu
    );
    for device in ["cuda", "cuda:1"] {
        let cfg = load(&[&format!("model.device={device}")]).unwrap();
        let started = std::time::Instant::now();
        let e = cotrain_learner::trainers::train(&cfg, None)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!(
                "model.device: CUDA is unavailable for device {device}"
            )),
            "{e}"
        );
        assert!(
            e.contains("libtorch_cuda.so") || e.contains("no GPU is usable"),
            "the reason is missing: {e}"
        );
        assert!(
            started.elapsed() < std::time::Duration::from_secs(30),
            "not refused at once"
        );
    }
}

/// `rollout.bf16_dot_products` through the learner's own start-up (`connect_services`): refused,
/// naming the worker flag, when every worker is remote; turned on before the embedded worker starts
/// otherwise (where the CPU has AVX512_BF16).
#[test]
fn bf16_dot_products_reach_the_embedded_worker_and_are_refused_for_remote_ones() {
    let base = fixture("base.yaml");
    let load = |ov: &[&str]| {
        load_config(
            &base,
            &ov.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
            &LegacyFlags::default(),
        )
        .unwrap()
    };
    let agents = [
        ("agent0".to_string(), "default".to_string()),
        ("agent1".to_string(), "default".to_string()),
    ];
    let remote = load(&[
        "rollout.dtype=bf16",
        "rollout.bf16_dot_products=true",
        "rollout.endpoints=['http://127.0.0.1:9']",
    ]);
    let e = match cotrain_learner::trainer::connect_services(&remote, &agents) {
        Ok(_) => panic!("remote workers only: the option must be refused"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("rollout-worker serve --dtype bf16 --bf16-dot-products"),
        "{e}"
    );
    if !cotrain_model::kernels::gemm_bf16dot::is_available() {
        eprintln!("skipped the embedded half: no AVX512_BF16");
        return;
    }
    assert!(!cotrain_model::kernels::gemm_bf16dot::enabled());
    let services = cotrain_learner::trainer::connect_services(
        &load(&["rollout.dtype=bf16", "rollout.bf16_dot_products=true"]),
        &agents,
    )
    .unwrap();
    assert!(
        cotrain_model::kernels::gemm_bf16dot::enabled(),
        "the config key did not turn the option on"
    );
    drop(services);
}

#[test]
fn each_legacy_flag_changes_the_config() {
    let base = fixture("base.yaml");
    let plain = load_config(&base, &[], &LegacyFlags::default()).unwrap();
    let flags = LegacyFlags {
        model_name: Some("Qwen/Qwen2.5-Coder-3B".into()),
        num_epochs: Some(3),
        num_turns: Some(2),
        turn_gradient_weights: Some(vec![1.2, 0.8]),
        output_base_dir: Some("/tmp/elsewhere".into()),
    };
    let cfg = load_config(&base, &[], &flags).unwrap();
    assert_ne!(plain.raw.model.name, cfg.raw.model.name);
    assert_eq!(cfg.raw.model.name, "Qwen/Qwen2.5-Coder-3B");
    assert_eq!(cfg.agent_models, vec!["Qwen/Qwen2.5-Coder-3B"; 2]);
    assert_eq!(cfg.trainer.num_train_epochs, 3);
    assert_eq!(cfg.trainer.num_turns, 2);
    assert_eq!(cfg.turn_gradient_weights, vec![1.2, 0.8]);
    assert_eq!(cfg.raw.output.base_dir, "/tmp/elsewhere");
    // Legacy flags apply after overrides, as the original scripts did.
    let cfg = load_config(&base, &["model.name=other".into()], &flags).unwrap();
    assert_eq!(cfg.raw.model.name, "Qwen/Qwen2.5-Coder-3B");
    // On a grpo config the trainer flags go to the grpo section.
    let v = merged_value(
        "model: {name: m}\ndataset: {name: humaneval}\ngrpo: {}\n",
        "g.yaml",
        &[],
        &LegacyFlags {
            num_epochs: Some(5),
            ..Default::default()
        },
    )
    .unwrap();
    let cfg = CheckedConfig::from_value(v, Path::new("g.yaml")).unwrap();
    assert_eq!(
        (cfg.algorithm, cfg.trainer.num_train_epochs),
        (Algorithm::Grpo, 5)
    );
}

#[test]
fn cli_parses_legacy_flags_and_check_config_prints_the_merged_yaml() {
    use clap::Parser;
    let cli = cotrain_learner::cli::Cli::try_parse_from([
        "learner",
        "check-config",
        "--config",
        fixture("base.yaml").to_str().unwrap(),
        "--override",
        "magrpo.learning_rate=3e-5",
        "--turn_gradient_weights",
        "1.2",
        "0.8",
        "--num_turns",
        "2",
    ])
    .unwrap();
    let cotrain_learner::cli::Command::CheckConfig { config } = &cli.command else {
        panic!()
    };
    let cfg = config.load().unwrap();
    assert_eq!(cfg.trainer.learning_rate, 3e-5);
    assert_eq!(cfg.turn_gradient_weights, vec![1.2, 0.8]);
    let yaml = cfg.to_yaml();
    assert!(
        yaml.contains("learning_rate:") && yaml.contains("turn_gradient_weights:"),
        "{yaml}"
    );
    let reparsed = CheckedConfig::from_value(
        serde_yaml_ng::from_str(&yaml).unwrap(),
        Path::new("re.yaml"),
    )
    .unwrap();
    assert_eq!(
        reparsed.raw, cfg.raw,
        "the printed config loads back to the same config"
    );
}

#[test]
fn one_override_flag_takes_several_pairs_as_the_seed_readme_types_them() {
    // `python train_grpo.py --config ... --override grpo.num_train_epochs=20 grpo.learning_rate=5e-6`
    use clap::Parser;
    let cli = cotrain_learner::cli::Cli::try_parse_from([
        "learner",
        "check-config",
        "--config",
        repo().join("configs/grpo_he_config.yaml").to_str().unwrap(),
        "--override",
        "grpo.num_train_epochs=20",
        "grpo.learning_rate=5e-6",
        "dataset.train_split='test[16:20]'",
        "--override",
        "grpo.termination_threshold=None",
        "--num_epochs",
        "3",
    ])
    .unwrap();
    let cotrain_learner::cli::Command::CheckConfig { config } = &cli.command else {
        panic!()
    };
    assert_eq!(config.overrides.len(), 4);
    let cfg = config.load().unwrap();
    assert_eq!(cfg.trainer.learning_rate, 5e-6);
    assert_eq!(cfg.raw.dataset.train_split, "test[16:20]");
    assert_eq!(cfg.trainer.termination_threshold, None);
    // Legacy flags are applied after the overrides, as in the original scripts.
    assert_eq!(cfg.trainer.num_train_epochs, 3);
}

#[test]
fn multi_turn_configs_that_cannot_run_are_refused_naming_the_key() {
    let mt = repo().join("configs/mt_magrpo_he_config.yaml");
    // A cross tree of 2 agents x G 4 over 3 turns: 1 + 16 + 256 nodes per item.
    let big = load_config(
        &mt,
        &[
            "magrpo.rollout=tree".into(),
            "magrpo.joint_mode=cross".into(),
            "magrpo.num_turns=3".into(),
            "magrpo.turn_gradient_weights=[1,1,1]".into(),
            "magrpo.max_nodes_per_item=100".into(),
        ],
        &LegacyFlags::default(),
    )
    .unwrap();
    let e = cotrain_learner::cli::ensure_trainable(&big)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("273 nodes") && e.contains("max_nodes_per_item = 100") && e.contains("G^(N*T)"),
        "{e}"
    );
    let expert = load_config(
        &mt,
        &["external.mode=expert_edits".into()],
        &LegacyFlags::default(),
    )
    .unwrap();
    let e = cotrain_learner::cli::ensure_trainable(&expert)
        .unwrap_err()
        .to_string();
    assert!(e.contains("external.expert_model is not set"), "{e}");
    let gsm = load_config(
        &repo().join("configs/magrpo_tldr_config.yaml"),
        &[
            "magrpo.num_turns=2".into(),
            "magrpo.turn_gradient_weights=[1,1]".into(),
        ],
        &LegacyFlags::default(),
    )
    .unwrap();
    let e = cotrain_learner::cli::ensure_trainable(&gsm)
        .unwrap_err()
        .to_string();
    assert!(e.contains("code tasks only"), "{e}");
}

#[test]
fn resume_refuses_a_config_that_changes_the_run_naming_each_key() {
    let dir = tempfile::tempdir().unwrap();
    let demo = repo().join("configs/demo.yaml");
    let started = load_config(&demo, &[], &LegacyFlags::default()).unwrap();
    std::fs::write(dir.path().join("config.yaml"), started.to_yaml()).unwrap();
    let changed = load_config(
        &demo,
        &[
            "magrpo.learning_rate=1e-3".into(),
            "model.temperature=0.5".into(),
            "magrpo.num_train_epochs=3".into(),
        ],
        &LegacyFlags::default(),
    )
    .unwrap();
    let Err(e) = cotrain_learner::trainers::train(&changed, Some(dir.path())) else {
        panic!("resume with a changed config must be refused")
    };
    let e = e.to_string();
    assert!(
        e.contains("magrpo.learning_rate: 0.00002 (run) -> 0.001 (given)"),
        "{e}"
    );
    assert!(e.contains("model.temperature"), "{e}");
    assert!(
        !e.contains("  magrpo.num_train_epochs:"),
        "epochs may change on resume: {e}"
    );
    // The run's own config is left as it was.
    assert_eq!(
        std::fs::read_to_string(dir.path().join("config.yaml")).unwrap(),
        started.to_yaml()
    );
}

// ---------------------------------------------------------------- datasets

fn ds(name: &str) -> cotrain_learner::config::DatasetConfig {
    cotrain_learner::config::DatasetConfig {
        name: name.into(),
        kind: None,
        train_split: "train".into(),
        eval_split: None,
        data_dir: Some(repo().join("data").display().to_string()),
        shuffle: false,
    }
}

#[test]
fn shipped_datasets_load_with_the_seed_splits() {
    let he = load_split(
        &ds("openai/openai_humaneval"),
        &SplitSpec::parse("test[33:163]").unwrap(),
    )
    .unwrap();
    assert_eq!(
        (he.kind, he.len(), he.row_offset),
        (DatasetKind::HumanEval, 130, 33)
    );
    let TaskItem::Code(first) = &he.items[0] else {
        panic!()
    };
    assert_eq!(first.task_id, "HumanEval/33");
    assert!(first.test.contains("def check(candidate)"));
    let che = load_split(
        &ds("OpenMLRL/CoopHumanEval"),
        &SplitSpec::parse("test[16:]").unwrap(),
    )
    .unwrap();
    assert_eq!(che.len(), 66);
    let mbpp = load_split(&ds("mbpp"), &SplitSpec::parse("test").unwrap()).unwrap();
    assert_eq!(mbpp.len(), 257);
    let TaskItem::Code(m) = &mbpp.items[0] else {
        panic!()
    };
    assert_eq!(m.entry_point, "remove_Occ");
    let gsm = load_split(&ds("gsm8k"), &SplitSpec::parse("test[:3]").unwrap()).unwrap();
    let TaskItem::Gsm8k(g) = &gsm.items[0] else {
        panic!()
    };
    assert_eq!(g.final_answer, "18");
    assert_eq!(
        load_split(&ds("gsm8k"), &SplitSpec::parse("train").unwrap())
            .unwrap()
            .len(),
        7473
    );
    let anli = load_split(&ds("anli"), &SplitSpec::parse("dev_r1[-10:]").unwrap()).unwrap();
    assert_eq!(anli.len(), 10);
    assert_eq!(
        load_split(&ds("facebook/anli"), &SplitSpec::parse("test").unwrap())
            .unwrap()
            .len(),
        1200
    );
    let tldr = load_split(&ds("tldr"), &SplitSpec::parse("train[:1000]").unwrap()).unwrap();
    let TaskItem::Tldr(t) = &tldr.items[0] else {
        panic!()
    };
    assert!(t.prompt.starts_with("SUBREDDIT: r/") && t.prompt.ends_with("TL;DR:"));
    assert!(t.reference.as_deref().is_some_and(|r| !r.starts_with(' ')));
    assert_eq!(
        load_split(&ds("tldr"), &SplitSpec::parse("test").unwrap())
            .unwrap()
            .len(),
        500
    );
}

#[test]
fn dataset_errors_name_the_problem() {
    let e = load_split(&ds("humaneval"), &SplitSpec::parse("train").unwrap())
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "dataset `humaneval` has no split `train` (available: test)"
    );
    let e = load_split(
        &ds("humaneval"),
        &SplitSpec::parse("test[100:200]").unwrap(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("out of range: split `test` has 164 rows"), "{e}");
    let e = load_split(&ds("nope"), &SplitSpec::parse("test").unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("unknown dataset `nope`"), "{e}");
    let e = load_split(&ds("anli"), &SplitSpec::parse("train_r3").unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("not shipped"), "{e}");
    let e = load_split(
        &ds("OpenMLRL/arXiv_abstract"),
        &SplitSpec::parse("train[:1000]").unwrap(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("not available"), "{e}");
}

#[test]
fn local_arxiv_files_load_in_every_supported_format() {
    let dir = tempfile::tempdir().unwrap();
    let rows = [
        ("a1", "First abstract.", 3),
        ("a2", "Second abstract.", 3),
        ("a3", "Third.", 1),
    ];
    let jsonl: String = rows
        .iter()
        .map(|(id, t, c)| {
            format!(
                "{{\"article_id\": \"{id}\", \"abstract_text\": \"{t}\", \"token_count\": {c}}}\n"
            )
        })
        .collect();
    std::fs::write(dir.path().join("train.jsonl"), &jsonl).unwrap();
    std::fs::write(
        dir.path().join("val.csv"),
        "article_id,abstract_text,token_count\nv1,\"Val, with comma.\",4\n",
    )
    .unwrap();
    std::fs::write(
        dir.path().join("test.json"),
        "[{\"article_id\": \"t1\", \"abstract_text\": \"T.\"}]",
    )
    .unwrap();
    std::fs::write(dir.path().join("bad.parquet"), b"PAR1").unwrap();
    let mut cfg = ds(dir.path().to_str().unwrap());
    cfg.kind = Some("arxiv".into());
    let train = load_split(&cfg, &SplitSpec::parse("train[1:]").unwrap()).unwrap();
    assert_eq!(train.len(), 2);
    let TaskItem::Arxiv(a) = &train.items[0] else {
        panic!()
    };
    assert_eq!((a.article_id.as_str(), a.token_count), ("a2", Some(3)));
    let val = load_split(&cfg, &SplitSpec::parse("val").unwrap()).unwrap();
    let TaskItem::Arxiv(v) = &val.items[0] else {
        panic!()
    };
    assert_eq!(
        (v.abstract_text.as_str(), v.token_count),
        ("Val, with comma.", Some(4))
    );
    assert_eq!(
        load_split(&cfg, &SplitSpec::parse("test").unwrap())
            .unwrap()
            .len(),
        1
    );
    let e = load_split(&cfg, &SplitSpec::parse("bad").unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("unsupported data format `parquet`"), "{e}");
    let e = load_split(&cfg, &SplitSpec::parse("other").unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("has no split `other`"), "{e}");
    // A missing field is an error naming the row.
    std::fs::write(dir.path().join("broken.jsonl"), "{\"article_id\": \"x\"}\n").unwrap();
    let e = load_split(&cfg, &SplitSpec::parse("broken").unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("row 0: missing field `abstract_text`"), "{e}");
}

#[test]
fn prompts_for_each_task_and_agent() {
    use cotrain_learner::prompts::Prompter;
    let che = load_split(&ds("coophumaneval"), &SplitSpec::parse("test[:1]").unwrap()).unwrap();
    let item = &che.items[0];
    let two = Prompter::defaults(2);
    let helper = two.render(item, 0, 0).unwrap();
    let main = two.render(item, 0, 1).unwrap();
    assert!(helper.contains("aux"));
    assert!(main.contains("def x_or_y(n, x, y):"), "{main}");
    assert!(Prompter::defaults(3).render(item, 0, 0).is_err());
    let gsm = load_split(&ds("gsm8k"), &SplitSpec::parse("test[:1]").unwrap()).unwrap();
    let p = Prompter::defaults(3).render(&gsm.items[0], 0, 1).unwrap();
    // MaPoRL's question text for models other than Phi-3 and Llama 3 (the Qwen2.5 wording).
    assert!(
        p.starts_with("Question: ") && p.contains("Answer: \\boxed{XX}"),
        "{p}"
    );
}

fn show_prompts(overrides: &[&str]) -> Vec<serde_json::Value> {
    let mut args = vec!["learner", "show-prompts", "--config"];
    let cfg = repo().join("configs/magrpo_che_config.yaml");
    args.push(cfg.to_str().unwrap());
    args.extend(["--limit", "2", "--override", "model.name=default"]);
    args.extend(overrides);
    use clap::Parser;
    let cli = cotrain_learner::cli::Cli::try_parse_from(args).unwrap();
    let cotrain_learner::cli::Command::ShowPrompts {
        config,
        split,
        limit,
        ..
    } = &cli.command
    else {
        panic!()
    };
    let mut out = Vec::new();
    cotrain_learner::cli::show_prompts(&config.load().unwrap(), *split, *limit, &mut out).unwrap();
    String::from_utf8(out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn show_prompts_prints_the_exact_text_and_token_count_per_item_and_agent() {
    let (tokenizer, _) = cotrain_model::loader::load_text_side("default").unwrap();
    let raw = show_prompts(&[]);
    assert_eq!(raw.len(), 4, "2 items x 2 agents");
    let keys: Vec<(u64, u64)> = raw
        .iter()
        .map(|l| {
            (
                l["item_index"].as_u64().unwrap(),
                l["agent"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(keys, vec![(0, 0), (0, 1), (1, 0), (1, 1)]);
    for l in &raw {
        let text = l["text"].as_str().unwrap();
        // The seed configs give the model the raw prompt text, as the original does.
        assert!(!text.contains("<|im_start|>"), "{text}");
        assert_eq!(
            l["tokens"].as_u64().unwrap() as usize,
            tokenizer.encode(text, false).unwrap().len()
        );
    }
    // The configured split starts at test[16]: the same rows the trainer would use.
    let che = load_split(
        &ds("coophumaneval"),
        &SplitSpec::parse("test[16:17]").unwrap(),
    )
    .unwrap();
    let expected = cotrain_learner::prompts::Prompter::defaults(2)
        .render(&che.items[0], 16, 1)
        .unwrap();
    assert_eq!(raw[1]["text"].as_str().unwrap(), expected);

    let chat = show_prompts(&[
        "model.chat_template=true",
        "prompts.agent0.template='Write aux for {{ entry_point }}.'",
    ]);
    let text = chat[0]["text"].as_str().unwrap();
    assert!(
        text.starts_with("<|im_start|>") && text.contains("Write aux for "),
        "{text}"
    );
    assert!(
        chat[1]["text"].as_str().unwrap().contains(&expected),
        "agent 1 keeps its default template inside the chat template"
    );
}

// ---------------------------------------------------------------- update math

fn close(a: f64, b: f64) {
    assert!((a - b).abs() < 1e-9, "{a} vs {b}");
}

/// Fixed samples for the exactness tests: 2 agents × G = 2 completions, with summed log-probs
/// S[agent][k]: agent 0: −1.0 (tokens −0.25, −0.75), −2.0 (tokens −2.0); agent 1: −0.5 (−0.5), −3.0
/// (−1.0, −2.0).
fn fixed_logprobs() -> [(Tensor, Tensor); 2] {
    let a0 = (
        Tensor::from_slice(&[-0.25, -0.75, -2.0, 0.0]).reshape([2, 2]),
        Tensor::from_slice(&[1.0, 1.0, 1.0, 0.0]).reshape([2, 2]),
    );
    let a1 = (
        Tensor::from_slice(&[-0.5, 0.0, -1.0, -2.0]).reshape([2, 2]),
        Tensor::from_slice(&[1.0, 0.0, 1.0, 1.0]).reshape([2, 2]),
    );
    [a0, a1]
}
const SUMS: [[f64; 2]; 2] = [[-1.0, -2.0], [-0.5, -3.0]];

fn loss_of(agent: usize, adv: &[f64]) -> f64 {
    let [a0, a1] = fixed_logprobs();
    let (lp, mask) = if agent == 0 { a0 } else { a1 };
    let adv = Tensor::from_slice(adv);
    let b = PolicyBatch {
        logprobs: &lp,
        mask: &mask,
        advantages: &adv,
        old_logprobs: None,
        proximal_logprobs: None,
        ref_logprobs: None,
        weights: None,
    };
    policy_loss(&b, &LossOptions::original())
        .unwrap()
        .loss
        .double_value(&[])
}

#[test]
fn aligned_advantages_and_loss_match_hand_computation_for_every_mode() {
    // Joint rewards of the aligned pairs (0,0) and (1,1): r = [3, 1]; processor 2·r − 1 → R = [5, 1].
    let proc = RewardProcessor {
        scale_factor: 2.0,
        shift: -1.0,
    };
    let r = [3.0, 1.0];
    // mean: R − 3 = [2, −2]; rloo: (2R − 6)/1 = [4, −4]; max: R − 5 = [0, −4]; raw: [5, 1].
    let expected = [
        (AdvantageMode::Mean, [2.0, -2.0]),
        (AdvantageMode::Rloo, [4.0, -4.0]),
        (AdvantageMode::Max, [0.0, -4.0]),
        (AdvantageMode::Raw, [5.0, 1.0]),
    ];
    for (mode, adv) in expected {
        let opts = AdvantageOptions {
            joint_mode: JointMode::Aligned,
            mode,
            normalize: None,
            clamp: None,
        };
        let a = node_advantages(&r, 2, 2, &proc, &opts);
        for agent in 0..2 {
            close(a[agent][0], adv[0]);
            close(a[agent][1], adv[1]);
            // L = (1/2)·Σ_k −A_k·S_k
            let hand = 0.5 * (-adv[0] * SUMS[agent][0] - adv[1] * SUMS[agent][1]);
            close(loss_of(agent, &a[agent]), hand);
        }
    }
    // mean, agent 0: (1/2)(−2·(−1) + 2·(−2)) = (2 − 4)/2 = −1.
    close(loss_of(0, &[2.0, -2.0]), -1.0);
    // normalised mean: std of R = [5, 1] (unbiased) = sqrt(8) → A = ±2/(sqrt(8) + 1e-8).
    let opts = AdvantageOptions {
        joint_mode: JointMode::Aligned,
        mode: AdvantageMode::Mean,
        normalize: Some(cotrain_learner::config::NormalizationForm::Uncentred),
        clamp: None,
    };
    let a = node_advantages(&r, 2, 2, &proc, &opts);
    close(a[0][0], 2.0 / (8f64.sqrt() + 1e-8));
}

#[test]
fn cross_advantages_and_loss_match_hand_computation_for_every_mode() {
    // Joint actions (0,0) (0,1) (1,0) (1,1) with rewards 1, 2, 3, 6 (identity processor).
    // Credit agent 0: k0 = 1+2 = 3, k1 = 3+6 = 9; agent 1: k0 = 1+3 = 4, k1 = 2+6 = 8.
    let r = [1.0, 2.0, 3.0, 6.0];
    let expected: [(AdvantageMode, [[f64; 2]; 2]); 4] = [
        // mean: agent 0 mean 6 → [−3, 3]; agent 1 mean 6 → [−2, 2]
        (AdvantageMode::Mean, [[-3.0, 3.0], [-2.0, 2.0]]),
        // rloo (G = 2): 2R − ΣR → agent 0 [6 − 12, 18 − 12] = [−6, 6]; agent 1 [8 − 12, 16 − 12] = [−4, 4]
        (AdvantageMode::Rloo, [[-6.0, 6.0], [-4.0, 4.0]]),
        // max: agent 0 [3 − 9, 0] ; agent 1 [4 − 8, 0]
        (AdvantageMode::Max, [[-6.0, 0.0], [-4.0, 0.0]]),
        (AdvantageMode::Raw, [[3.0, 9.0], [4.0, 8.0]]),
    ];
    for (mode, adv) in expected {
        let opts = AdvantageOptions {
            joint_mode: JointMode::Cross,
            mode,
            normalize: None,
            clamp: None,
        };
        let a = node_advantages(&r, 2, 2, &RewardProcessor::identity(), &opts);
        for agent in 0..2 {
            close(a[agent][0], adv[agent][0]);
            close(a[agent][1], adv[agent][1]);
            let hand = 0.5 * (-adv[agent][0] * SUMS[agent][0] - adv[agent][1] * SUMS[agent][1]);
            close(loss_of(agent, &a[agent]), hand);
        }
    }
    // cross mean, agent 1: (1/2)(2·(−0.5) − 2·(−3)) = (−1 + 6)/2 = 2.5
    close(loss_of(1, &[-2.0, 2.0]), 2.5);
}

#[test]
fn clipping_and_kl_options_match_hand_computation() {
    // One sample, two tokens: lp = [−1, −1], old = [−1.5, −0.8], A = 1.
    // ρ = [e^{0.5}, e^{−0.2}] = [1.6487, 0.8187]; clip to [0.8, 1.2]: [1.2, 0.8187].
    // −min(Aρ, A·clip(ρ)) = [−1.2, −0.8187], summed: −(1.2 + e^{−0.2}).
    let lp = Tensor::from_slice(&[-1.0f64, -1.0])
        .reshape([1, 2])
        .set_requires_grad(true);
    let old = Tensor::from_slice(&[-1.5f64, -0.8]).reshape([1, 2]);
    let rf = Tensor::from_slice(&[-0.9f64, -1.2]).reshape([1, 2]);
    let mask = Tensor::ones([1, 2], (Kind::Double, tch::Device::Cpu));
    let adv = Tensor::from_slice(&[1.0f64]);
    let b = PolicyBatch {
        logprobs: &lp,
        mask: &mask,
        advantages: &adv,
        old_logprobs: Some(&old),
        proximal_logprobs: None,
        ref_logprobs: Some(&rf),
        weights: None,
    };
    let clip = LossOptions {
        clip: Some((0.2, 0.2)),
        ..LossOptions::original()
    };
    let out = policy_loss(&b, &clip).unwrap();
    close(out.policy_loss, -(1.2 + (-0.2f64).exp()));
    close(out.clip_fraction, 0.5);
    // clip-higher 0.28: first token clips at 1.28.
    let hi = LossOptions {
        clip: Some((0.2, 0.28)),
        ..LossOptions::original()
    };
    close(
        policy_loss(&b, &hi).unwrap().policy_loss,
        -(1.28 + (-0.2f64).exp()),
    );
    // k3 with d = lr − lp = [0.1, −0.2]: Σ (e^d − d − 1) = (e^{0.1} − 1.1) + (e^{−0.2} − 0.8).
    let k3 = (0.1f64.exp() - 1.1) + ((-0.2f64).exp() - 0.8);
    let kl = LossOptions {
        kl: Some((0.1, KlEstimator::K3)),
        ..LossOptions::original()
    };
    let out = policy_loss(&b, &kl).unwrap();
    close(out.kl, k3);
    // policy part without clipping: −1·(−2) = 2; loss = 2 + 0.1·k3.
    close(out.loss.double_value(&[]), 2.0 + 0.1 * k3);
    // k1 = Σ (lp − lr) = (−1 + 0.9) + (−1 + 1.2) = 0.1
    let k1 = LossOptions {
        kl: Some((0.5, KlEstimator::K1)),
        normalization: LossNormalization::TokenMean,
        ..LossOptions::original()
    };
    let out = policy_loss(&b, &k1).unwrap();
    close(out.kl, 0.05);
    // k1 enters as a score-function penalty sg(KL1)·reduce(lp): token-mean reduce(lp) = −1, so the
    // loss is 1 + 0.5·(0.05·(−1)) = 0.975, and ∂L/∂lp_t = −A/2 + 0.5·0.05·(1/2) = −0.4875 per token
    // (a k1 added straight to the loss would give a constant 0.5·(1/2) there, zero in expectation).
    close(out.loss.double_value(&[]), 1.0 - 0.5 * 0.05);
    out.loss.backward();
    let g: Vec<f64> = Vec::try_from(lp.grad().reshape([-1])).unwrap();
    close(g[0], -0.4875);
    close(g[1], -0.4875);
    // Clipping without behaviour log-probs is an error, not a silent fallback.
    let b2 = PolicyBatch {
        old_logprobs: None,
        ..b
    };
    assert!(policy_loss(&b2, &clip).is_err());
}

#[test]
fn adamw_matches_libtorch_adamw() {
    tch::manual_seed(1);
    let make = || {
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let lin = nn::linear(vs.root() / "lin", 3, 5, Default::default());
        (vs, lin)
    };
    let (vs_a, lin_a) = make();
    let (mut vs_b, lin_b) = make();
    vs_b.copy(&vs_a).unwrap();
    let mut ours = AdamW::new(&vs_a, AdamWConfig::new(1e-2, 0.01, None));
    // No moment buffers until the first step: evaluation and export hold none.
    assert!(!ours.has_state());
    let mut theirs = nn::AdamW {
        beta1: 0.9,
        beta2: 0.999,
        wd: 0.01,
        eps: 1e-8,
        amsgrad: false,
    }
    .build(&vs_b, 1e-2)
    .unwrap();
    let x = Tensor::from_slice(&[0.5f32, -1.0, 2.0, 1.0, 0.0, -0.5]).reshape([2, 3]);
    for _ in 0..5 {
        ours.zero_grad();
        lin_a.forward(&x).square().sum(Kind::Float).backward();
        ours.step();
        theirs.zero_grad();
        lin_b.forward(&x).square().sum(Kind::Float).backward();
        theirs.step();
    }
    assert!(
        lin_a.ws.allclose(&lin_b.ws, 1e-5, 1e-6, false),
        "{} vs {}",
        lin_a.ws,
        lin_b.ws
    );
    assert!(ours.has_state());
}

/// `zero_grad` drops the gradients as torch.optim does by default (`set_to_none`): the next backward
/// writes them afresh, and a variable without a gradient in a step keeps its value through that
/// step's update (libtorch's AdamW, whose `zero_grad` also drops them, is the reference).
#[test]
fn zero_grad_drops_gradients_and_a_variable_without_one_is_left_alone() {
    tch::manual_seed(2);
    let make = || {
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let a = nn::linear(vs.root() / "a", 3, 4, Default::default());
        let b = nn::linear(vs.root() / "b", 3, 4, Default::default());
        (vs, a, b)
    };
    let (vs_a, a1, b1) = make();
    let (mut vs_b, a2, b2) = make();
    vs_b.copy(&vs_a).unwrap();
    let mut ours = AdamW::new(&vs_a, AdamWConfig::new(1e-2, 0.01, None));
    let mut theirs = nn::AdamW {
        beta1: 0.9,
        beta2: 0.999,
        wd: 0.01,
        eps: 1e-8,
        amsgrad: false,
    }
    .build(&vs_b, 1e-2)
    .unwrap();
    let x = Tensor::from_slice(&[0.5f32, -1.0, 2.0, 1.0, 0.0, -0.5]).reshape([2, 3]);
    // Step 1 trains both layers; steps 2 and 3 only `a`.
    for step in 0..3 {
        ours.zero_grad();
        theirs.zero_grad();
        if step > 0 {
            assert!(
                !b1.ws.grad().defined(),
                "step {step}: `b`'s gradient should have been dropped"
            );
        }
        let loss = |a: &nn::Linear, b: &nn::Linear| {
            let y = a.forward(&x).square().sum(Kind::Float);
            if step == 0 {
                y + b.forward(&x).sum(Kind::Float)
            } else {
                y
            }
        };
        loss(&a1, &b1).backward();
        if step > 0 {
            // Written afresh, not added to the previous step's gradient.
            let fresh = a1.ws.grad().copy();
            ours.zero_grad();
            loss(&a1, &b1).backward();
            assert!(a1.ws.grad().equal(&fresh));
        }
        let b_before = b1.ws.copy();
        ours.step();
        loss(&a2, &b2).backward();
        theirs.step();
        if step > 0 {
            assert!(
                b1.ws.equal(&b_before),
                "step {step}: `b` moved without a gradient"
            );
        }
    }
    for (ours, theirs) in [(&a1.ws, &a2.ws), (&b1.ws, &b2.ws)] {
        assert!(
            ours.allclose(theirs, 1e-5, 1e-6, false),
            "{ours} vs {theirs}"
        );
    }
}

#[test]
fn grad_norm_is_reported_before_clipping() {
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let lin = nn::linear(vs.root() / "lin", 3, 5, Default::default());
    let mut opt = AdamW::new(&vs, AdamWConfig::new(1e-2, 0.0, Some(1e-3)));
    (lin.forward(&Tensor::ones([1, 3], (Kind::Float, tch::Device::Cpu)))
        .sum(Kind::Float)
        * 1000.0)
        .backward();
    // libtorch's global norm over every gradient, in f64.
    let want = vs
        .trainable_variables()
        .iter()
        .map(|v| {
            v.grad()
                .norm_scalaropt_dtype(2.0, Kind::Double)
                .double_value(&[])
                .powi(2)
        })
        .sum::<f64>()
        .sqrt();
    assert!(
        (opt.grad_norm() - want).abs() <= 1e-12 * want,
        "{} against libtorch's {want}",
        opt.grad_norm()
    );
    let norm = opt.step();
    assert!(norm > 1.0);
    assert!(
        (norm - want).abs() <= 1e-12 * want,
        "the step reports {norm}, libtorch's norm is {want}"
    );
}

// ---------------------------------------------------------------- checkpoints

#[test]
fn checkpoint_round_trips_weights_optimiser_and_state() {
    use cotrain_learner::checkpoint::{
        TrainState, latest_checkpoint, load_checkpoint, save_checkpoint,
    };
    let dir = tempfile::tempdir().unwrap();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let lin = nn::linear(vs.root() / "lin", 3, 5, Default::default());
    let mut opt = AdamW::new(&vs, AdamWConfig::new(1e-2, 0.0, None));
    for _ in 0..2 {
        opt.zero_grad();
        lin.forward(&Tensor::ones([1, 3], (Kind::Float, tch::Device::Cpu)))
            .square()
            .sum(Kind::Float)
            .backward();
        opt.step();
    }
    let state = TrainState {
        step: 2,
        epoch: 0,
        data_position: 4,
        rng_seed: 42,
        rng_word_pos: "123".into(),
        optimizer_steps: vec![opt.step],
        served_versions: [("agent0".to_string(), 2)].into(),
        extra: serde_json::json!({"order": [3, 1, 2]}),
    };
    let saved = save_checkpoint(dir.path(), &[(&vs, &opt)], &state).unwrap();
    assert_eq!(latest_checkpoint(dir.path()).unwrap(), saved);
    assert!(
        !std::fs::read_dir(dir.path().join("checkpoints"))
            .unwrap()
            .any(|e| e.unwrap().file_name().to_string_lossy().starts_with(".tmp"))
    );

    let mut vs2 = nn::VarStore::new(tch::Device::Cpu);
    let lin2 = nn::linear(vs2.root() / "lin", 3, 5, Default::default());
    let mut opt2 = AdamW::new(&vs2, AdamWConfig::new(1e-2, 0.0, None));
    let back = load_checkpoint(&saved, &mut [(&mut vs2, &mut opt2)]).unwrap();
    assert_eq!(back, state);
    assert!(lin2.ws.equal(&lin.ws));
    assert_eq!(opt2.step, 2);
    // One more identical step on both gives identical weights: the moments were restored.
    for (l, o) in [(&lin, &mut opt), (&lin2, &mut opt2)] {
        o.zero_grad();
        l.forward(&Tensor::ones([1, 3], (Kind::Float, tch::Device::Cpu)))
            .square()
            .sum(Kind::Float)
            .backward();
        o.step();
    }
    assert!(lin2.ws.allclose(&lin.ws, 1e-7, 1e-8, false));
    // A half-written checkpoint (no state.json, not pointed at by `latest`) is never picked up.
    std::fs::create_dir_all(dir.path().join("checkpoints/.tmp-step-3-1/agent-0")).unwrap();
    assert_eq!(latest_checkpoint(dir.path()).unwrap(), saved);
}

#[test]
fn algo_reexports_are_usable() {
    // The joint-action enumeration that the trainer uses to ask the reward server.
    assert_eq!(algo::joint_actions(JointMode::Cross, 2, 2).len(), 4);
}

#[test]
fn sandbox_slice_accepts_counts_all_and_null() {
    let base = fixture("base.yaml");
    for (v, expect) in [
        ("1", 0..1),
        ("-2", 3..5),
        ("0", 0..5),
        ("all", 0..5),
        ("null", 0..5),
        ("10", 0..5),
    ] {
        let cfg = load_config(
            &base,
            &[format!("external.sandbox_slice={v}")],
            &LegacyFlags::default(),
        )
        .unwrap();
        assert_eq!(cfg.raw.external.feedback_tests(5), expect, "{v}");
    }
    let default = load_config(&base, &[], &LegacyFlags::default()).unwrap();
    assert_eq!(
        default.raw.external.feedback_tests(5),
        0..1,
        "default shows the first test"
    );
    let e = load_config(
        &base,
        &["external.sandbox_slice=some".into()],
        &LegacyFlags::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("external.sandbox_slice"), "{e}");
}

#[test]
fn hf_hub_cache_snapshots_are_found_by_dataset_id() {
    let hub = tempfile::tempdir().unwrap();
    let snap = hub
        .path()
        .join("datasets--cotrain-test--arxiv_copy/snapshots/0123abc/data");
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::write(
        snap.join("train-00000-of-00001.jsonl"),
        "{\"article_id\": \"x1\", \"abstract_text\": \"A.\", \"token_count\": 1}\n{\"article_id\": \"x2\", \"abstract_text\": \"B.\", \"token_count\": 1}\n",
    )
    .unwrap();
    std::fs::write(snap.join("val-00000-of-00001.parquet"), b"PAR1").unwrap();
    // SAFETY: tests of this binary only read HF_HUB_CACHE through `load_split`, and no other test uses
    // a dataset id that lives in a hub cache, so a concurrent reader sees either value harmlessly.
    unsafe { std::env::set_var("HF_HUB_CACHE", hub.path()) };
    let mut cfg = ds("cotrain-test/arxiv_copy");
    cfg.kind = Some("arxiv".into());
    let d = load_split(&cfg, &SplitSpec::parse("train[:1]").unwrap()).unwrap();
    assert_eq!(d.kind, DatasetKind::Arxiv);
    let TaskItem::Arxiv(a) = &d.items[0] else {
        panic!()
    };
    assert_eq!(a.article_id, "x1");
    let e = load_split(&cfg, &SplitSpec::parse("val").unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("unsupported data format `parquet`"), "{e}");
}

#[test]
fn agents_on_different_base_models_and_shared_parameters() {
    let base = fixture("base.yaml");
    let cfg = load_config(
        &base,
        &["model.agents=[Qwen/Qwen3-0.6B, Qwen/Qwen3-1.7B]".into()],
        &LegacyFlags::default(),
    )
    .unwrap();
    assert_eq!(cfg.agent_models, vec!["Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B"]);
    let e = load_config(&base, &["model.agents=[a]".into()], &LegacyFlags::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("model.agents has 1 entries but magrpo.num_agents is 2"),
        "{e}"
    );
    let e = load_config(
        &base,
        &[
            "model.agents=[a, b]".into(),
            "magrpo.shared_parameters=true".into(),
        ],
        &LegacyFlags::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("magrpo.shared_parameters is true but model.agents names different base models"),
        "{e}"
    );
    let shared = load_config(
        &base,
        &["magrpo.shared_parameters=true".into()],
        &LegacyFlags::default(),
    )
    .unwrap();
    assert!(shared.trainer.shared_parameters);
}

#[test]
fn options_beside_the_original_are_off_by_default_and_checked() {
    let base = fixture("base.yaml");
    let cfg = load_config(&base, &[], &LegacyFlags::default()).unwrap();
    let opts = LossOptions::from_section(&cfg.trainer);
    assert_eq!(
        opts,
        LossOptions::original(),
        "the original's loss by default"
    );
    assert_eq!(cfg.trainer.weight_decay, 0.0);
    assert_eq!(cfg.trainer.max_grad_norm, None);
    let cfg = load_config(
        &base,
        &[
            "magrpo.reference_kl={enabled: true, estimator: k1}".into(),
            "magrpo.ppo_clip={enabled: true, epochs: 4, clip_high: 0.28}".into(),
            "magrpo.loss_normalization=token_mean".into(),
        ],
        &LegacyFlags::default(),
    )
    .unwrap();
    let opts = LossOptions::from_section(&cfg.trainer);
    assert_eq!(
        opts.kl,
        Some((0.1, KlEstimator::K1)),
        "kl coef defaults to 0.1 when enabled"
    );
    assert_eq!(opts.clip, Some((0.2, 0.28)));
    assert_eq!(opts.normalization, LossNormalization::TokenMean);
    let e = load_config(
        &base,
        &["magrpo.ppo_clip={epochs: 3}".into()],
        &LegacyFlags::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("magrpo.ppo_clip.epochs is 3 but several passes"),
        "{e}"
    );
    let e = load_config(
        &base,
        &["magrpo.reference_kl={estimator: k2}".into()],
        &LegacyFlags::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("magrpo.reference_kl.estimator: unknown variant `k2`"),
        "{e}"
    );
}

/// MaPoRL's seed configs load, and `reward_feedback` (scores in the next turn's prompts) is refused
/// unless the scores come from a verifier: with correctness scores the prompts would show the other
/// agents' ground-truth labels, in training and in evaluation.
#[test]
fn maporl_reward_feedback_needs_a_verifier_and_the_seed_configs_show_no_labels() {
    for name in ["maporl_gsm8k_config.yaml", "maporl_anli_config.yaml"] {
        let cfg = load_config(
            &repo().join("configs").join(name),
            &[],
            &LegacyFlags::default(),
        )
        .unwrap();
        let m = cfg.raw.maporl.as_ref().expect("a maporl section");
        assert!(
            !m.reward_feedback,
            "{name}: the original without a verifier shows no scores"
        );
        // The original's layout and batch: one turn-0 and one later-turn adapter shared by the
        // agents, one critic per turn; 1 x 4 x 8 = 32 questions per PPO update in 8 mini-batches of
        // 4 questions; TrainingArguments' 3 epochs.
        assert_eq!(
            (m.adapter_layout, m.critic_per_turn, m.task_training),
            (AdapterLayout::SharedByTurn, true, false),
            "{name}"
        );
        assert_eq!(
            (
                m.questions_per_step(),
                m.questions_per_step() / m.num_mini_batches
            ),
            (32, 4),
            "{name}"
        );
        assert_eq!(m.num_train_epochs, 3, "{name}");
        let keys: Vec<String> = cotrain_learner::model_options::worker_agents(&cfg)
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        assert_eq!(
            keys,
            ["shared.later", "shared.turn0"],
            "{name}: the rollout workers serve the two shared adapters"
        );
        // ... on one base in one engine (serving only: the same policy as merged copies).
        assert_eq!(
            cfg.raw.rollout.lora_serving,
            cotrain_learner::config::LoraServing::Unmerged,
            "{name}"
        );
        assert_eq!(
            cotrain_learner::model_options::adapter_groups(&cfg),
            [vec!["shared.later".to_string(), "shared.turn0".to_string()]],
            "{name}: one adapter group"
        );
    }
    let gsm8k = repo().join("configs/maporl_gsm8k_config.yaml");
    let e = load_config(
        &gsm8k,
        &["maporl.reward_feedback=true".into()],
        &LegacyFlags::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("maporl.reward_feedback")
            && e.contains("maporl.score")
            && e.contains("label leak"),
        "{e}"
    );
    let with_verifier = [
        "maporl.reward_feedback=true".into(),
        "maporl.score=verifier".into(),
        "maporl.verifier_name=v".into(),
    ];
    let cfg = load_config(&gsm8k, &with_verifier, &LegacyFlags::default()).unwrap();
    assert!(cfg.raw.maporl.as_ref().unwrap().reward_feedback);
    // The incentives follow the paper unless asked otherwise; the key's earlier name still reads.
    use cotrain_learner::algo::discussion_score::IncentiveRule;
    let cfg = load_config(&gsm8k, &[], &LegacyFlags::default()).unwrap();
    assert_eq!(
        cfg.raw.maporl.as_ref().unwrap().incentive_rule,
        IncentiveRule::Paper
    );
    for key in ["incentive_rule", "influence_signs"] {
        let cfg = load_config(
            &gsm8k,
            &[format!("maporl.{key}=released_code")],
            &LegacyFlags::default(),
        )
        .unwrap();
        assert_eq!(
            cfg.raw.maporl.as_ref().unwrap().incentive_rule,
            IncentiveRule::ReleasedCode,
            "{key}"
        );
    }
}
