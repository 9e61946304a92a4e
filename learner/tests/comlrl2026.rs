//! CoMLRL 2026 beside the September 2025 trainer: the upstream 2026 configs load unmodified with their
//! 2026 meaning, cotrain's `configs/comlrl2026/` files carry the same values, and the 2026 advantage
//! normalisation and reference-KL return shaping match values computed by the original's code
//! (`tests/fixtures/comlrl2026/`, made by `scripts/reference/comlrl2026_fixtures.py`).

use std::path::{Path, PathBuf};

use cotrain_learner::algo::{LossOptions, advantages, kl_shaped_returns};
use cotrain_learner::config::{
    AdvantageMode, BatchUnit, CheckedConfig, Era, KlEstimator, KlPlacement, LegacyFlags,
    NormalizationForm, load_config,
};

fn here() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

fn load(path: &Path) -> CheckedConfig {
    load_config(path, &[], &LegacyFlags::default())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// What every 2026 code config means, whichever file it comes from.
fn assert_2026_tree(cfg: &CheckedConfig, name: &str) {
    let t = &cfg.trainer;
    assert_eq!(cfg.raw.era(), Era::Comlrl2026, "{name}");
    assert_eq!((cfg.num_agents, t.num_turns), (2, 2), "{name}");
    assert_eq!(
        t.termination_threshold,
        Some(-0.2),
        "{name}: the tree's leaf threshold"
    );
    assert_eq!(
        t.early_termination_threshold, None,
        "{name}: no handoff threshold"
    );
    assert_eq!(t.train_batch_unit, Some(BatchUnit::Nodes), "{name}");
    assert!(t.advantage_normalization, "{name}");
    assert_eq!(
        t.advantage_normalization_form,
        Some(NormalizationForm::Centred),
        "{name}"
    );
    assert_eq!(t.eval_all_turns, Some(true), "{name}");
    assert_eq!(t.num_generations, 4, "{name}");
    assert_eq!(t.max_new_tokens, 256, "{name}");
    assert!(
        cfg.raw.reward_processor.enabled && cfg.raw.reward_processor.shift == -4.0,
        "{name}"
    );
}

#[test]
fn upstream_2026_configs_load_unmodified_with_their_2026_meaning() {
    let dir = here().join("tests/fixtures/comlrl2026/upstream");
    for (file, buffer, lr, discount, temperature, top_p) in [
        ("magrpo_he_config.yaml", 2, 2e-5, 1.0, 0.6, 0.6),
        ("magrpo_che_config.yaml", 4, 2e-5, 1.0, 0.6, 0.6),
        ("magrpo_mbpp_config.yaml", 2, 3e-5, 0.9, 0.8, 0.95),
    ] {
        let cfg = load(&dir.join(file));
        assert_2026_tree(&cfg, file);
        let t = &cfg.trainer;
        assert_eq!(
            (t.rollout_buffer_size, t.train_batch_size),
            (buffer, Some(buffer)),
            "{file}"
        );
        assert_eq!((t.learning_rate, t.discount), (lr, discount), "{file}");
        assert_eq!(
            (cfg.sampling.temperature, cfg.sampling.top_p),
            (temperature, top_p),
            "{file}"
        );
        // top_k null upstream: not passed to generate, which then uses its default of 50.
        assert_eq!(cfg.sampling.top_k, 50, "{file}");
    }
}

#[test]
fn shipped_2026_configs_carry_the_upstream_values() {
    let upstream = here().join("tests/fixtures/comlrl2026/upstream");
    let ours = here().join("../configs/comlrl2026");
    for (mine, theirs) in [
        ("magrpo_he_config.yaml", "magrpo_he_config.yaml"),
        ("magrpo_che_config.yaml", "magrpo_che_config.yaml"),
        ("magrpo_mbpp_config.yaml", "magrpo_mbpp_config.yaml"),
    ] {
        let (a, b) = (load(&ours.join(mine)), load(&upstream.join(theirs)));
        assert_2026_tree(&a, mine);
        assert_eq!(
            a.trainer, b.trainer,
            "{mine}: the trainer section means what upstream's does"
        );
        assert_eq!(a.sampling, b.sampling, "{mine}");
        assert_eq!(a.raw.dataset.name, b.raw.dataset.name, "{mine}");
        assert_eq!(a.raw.external, b.raw.external, "{mine}");
    }
}

#[test]
fn a_2025_09_config_keeps_its_meaning() {
    let cfg = load(&here().join("../configs/mt_magrpo_he_config.yaml"));
    assert_eq!(cfg.raw.era(), Era::September2025);
    assert_eq!(
        cfg.trainer.early_termination_threshold,
        Some(4.0),
        "the handoff threshold"
    );
    assert_eq!(cfg.trainer.train_batch_unit, Some(BatchUnit::Completions));
    assert_eq!(
        cfg.trainer.advantage_normalization_form,
        Some(NormalizationForm::Uncentred)
    );
    assert_eq!(cfg.trainer.eval_all_turns, Some(false));
}

#[test]
fn centred_normalisation_matches_the_original_in_every_mode() {
    let text =
        std::fs::read_to_string(here().join("tests/fixtures/comlrl2026/advantages.json")).unwrap();
    let fixture: serde_json::Value = serde_json::from_str(&text).unwrap();
    let (mut checked, mut shaped_cases) = (0, 0);
    for case in fixture["cases"].as_array().unwrap() {
        let mut returns: Vec<f64> = serde_json::from_value(case["returns"].clone()).unwrap();
        if case["reference_kl_enabled"].as_bool().unwrap() {
            // The reference KL as return shaping (`reference_kl.placement: returns`). Given fewer KLs
            // than returns (the `one_winner` case), upstream shapes the first ones only; cotrain
            // always has one per completion, so the missing ones are 0 here.
            let mut kls: Vec<f64> = serde_json::from_value(case["reference_kls"].clone()).unwrap();
            kls.resize(returns.len(), 0.0);
            returns =
                kl_shaped_returns(&returns, &kls, case["reference_kl_coef"].as_f64().unwrap());
            let shaped: Vec<f64> =
                serde_json::from_value(case["kl_shaped_returns"].clone()).unwrap();
            for (g, e) in returns.iter().zip(&shaped) {
                assert!(
                    (g - e).abs() < 1e-6 * (1.0 + e.abs()),
                    "{}: shaped returns {returns:?} vs {shaped:?}",
                    case["group"]
                );
            }
            shaped_cases += 1;
        }
        let expected: Vec<f64> =
            serde_json::from_value(case["advantages_in_loss"].clone()).unwrap();
        let mode: AdvantageMode = serde_json::from_value(case["advantage_mode"].clone()).unwrap();
        let form = case["advantage_normalization"]
            .as_bool()
            .unwrap()
            .then_some(NormalizationForm::Centred);
        let got = advantages(&returns, mode, form, None);
        for (g, e) in got.iter().zip(&expected) {
            // The original computes in float32.
            assert!(
                (g - e).abs() < 1e-5 * (1.0 + e.abs()),
                "{}: {got:?} vs {expected:?}",
                case["group"]
            );
        }
        assert_eq!(got.len(), expected.len());
        checked += 1;
    }
    assert_eq!(
        (checked, shaped_cases),
        (44, 4),
        "every case of the fixture, the reference-KL ones among them"
    );
}

/// A 2026 config that turns upstream's reference KL on (`reference_kl_enabled`, v1.3.8+) loads into
/// cotrain's `reference_kl` with `placement: returns`; `reference_devices` (where upstream puts the
/// reference models) changes nothing.
#[test]
fn a_2026_reference_kl_loads_as_return_shaping() {
    let upstream = std::fs::read_to_string(
        here().join("tests/fixtures/comlrl2026/upstream/magrpo_he_config.yaml"),
    )
    .unwrap();
    let text = upstream.replacen("magrpo:\n", "magrpo:\n  reference_kl_enabled: true\n  reference_kl_coef: 0.05\n  reference_devices:\n  - cuda:1\n", 1);
    assert_ne!(text, upstream);
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("magrpo_he_kl_config.yaml");
    std::fs::write(&path, &text).unwrap();
    let cfg = load(&path);
    assert_2026_tree(&cfg, "magrpo_he_kl_config.yaml");
    let kl = &cfg.trainer.reference_kl;
    assert_eq!(
        (kl.enabled, kl.placement, kl.coef, kl.estimator),
        (true, KlPlacement::Returns, 0.05, KlEstimator::K3)
    );
    // The loss gets no KL term.
    assert_eq!(LossOptions::from_section(&cfg.trainer).kl, None);

    // Without a coefficient, upstream's default 0.1; a negative one is refused, naming the key.
    let without = text.replacen("  reference_kl_coef: 0.05\n", "", 1);
    std::fs::write(&path, &without).unwrap();
    assert_eq!(load(&path).trainer.reference_kl.coef, 0.1);
    std::fs::write(
        &path,
        text.replacen("reference_kl_coef: 0.05", "reference_kl_coef: -0.5", 1),
    )
    .unwrap();
    let e = load_config(&path, &[], &LegacyFlags::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("reference_kl.coef") && e.contains(">= 0"), "{e}");
}
