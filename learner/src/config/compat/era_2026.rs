//! The 2026 layout of CoMLRL's configs (v1.3–1.4 and the code-generation scripts' configs of 2026):
//! recognised by its top-level keys, marked `comlrl_era: 2026`, and mapped onto cotrain's keys. The
//! keys whose meaning changed (`train_batch_size`, `advantage_normalization`, evaluation) keep their
//! names; `comlrl_era` decides what they mean (see `TrainerSection`).

use serde_yaml_ng::{Mapping, Value};

use super::CompatReport;
use crate::config::ConfigError;

/// Top-level keys only the 2026 layout has (`agents` counts when it is a list or null: the August
/// 2025 writing configs have an `agents: {num_agents}` mapping).
fn has_2026_layout(root: &Mapping) -> bool {
    ["agent_model", "critic_model", "critics"]
        .iter()
        .any(|k| root.contains_key(*k))
        || matches!(root.get("agents"), Some(Value::Null | Value::Sequence(_)))
}

/// Marks and maps a 2026 config in place; a config of the other era is left alone.
pub(super) fn apply(
    root: &mut Mapping,
    file: &str,
    report: &mut CompatReport,
) -> Result<(), ConfigError> {
    let invalid = |key: &str, message: &str| ConfigError::Invalid {
        file: file.to_string(),
        key: key.to_string(),
        message: message.to_string(),
    };
    if has_2026_layout(root) && !root.contains_key("comlrl_era") {
        root.insert(Value::from("comlrl_era"), Value::from("2026"));
        report.mapped.push((
            "agent_model/agents/critics (the 2026 layout)".into(),
            "comlrl_era: 2026".into(),
        ));
    }
    if root.get("comlrl_era").and_then(era_text).as_deref() != Some("2026") {
        return Ok(());
    }

    if let Some(am) = root.remove("agent_model") {
        if root.contains_key("model") {
            return Err(invalid(
                "agent_model",
                "and model are both present; keep one (agent_model is the 2026 name of model)",
            ));
        }
        let Value::Mapping(mut m) = am else {
            return Err(invalid(
                "agent_model",
                "must be a mapping with at least `name`",
            ));
        };
        match m.remove("special_tokens") {
            None | Some(Value::Null) => {}
            Some(Value::Mapping(t)) if t.is_empty() => {}
            Some(_) => {
                return Err(invalid(
                    "agent_model.special_tokens",
                    "adding special tokens to the tokenizer is not built; leave it empty",
                ));
            }
        }
        if let Some(d) = m.remove("torch_dtype") {
            m.insert(Value::from("dtype"), d);
        }
        root.insert(Value::from("model"), Value::Mapping(m));
        report.mapped.push(("agent_model".into(), "model".into()));
    }
    match root.remove("agents") {
        None => {}
        Some(Value::Null) => report
            .mapped
            .push(("agents: null".into(), "model.name for every agent".into())),
        Some(Value::Sequence(names)) => {
            let model = root
                .entry(Value::from("model"))
                .or_insert_with(|| Value::Mapping(Mapping::new()));
            if let Some(m) = model.as_mapping_mut() {
                if m.get("agents").is_some_and(|a| !a.is_null()) {
                    return Err(invalid(
                        "agents",
                        "and model.agents are both present; keep one (agents is the 2026 name of model.agents)",
                    ));
                }
                m.insert(Value::from("agents"), Value::Sequence(names));
            }
            report.mapped.push(("agents".into(), "model.agents".into()));
        }
        // The August 2025 `agents: {num_agents}` is the general pass's.
        Some(other) => {
            root.insert(Value::from("agents"), other);
        }
    }
    let actor_critic = root.contains_key("iac") || root.contains_key("maac");
    for key in ["critic_model", "critics"] {
        match root.remove(key) {
            None => {}
            Some(Value::Null) => report
                .ignored
                .push((key.to_string(), "null: no critic named")),
            Some(v) if actor_critic => {
                let v = if key == "critic_model" {
                    critic_model(v, &invalid, report)?
                } else {
                    v
                };
                root.insert(Value::from(key), v);
            }
            Some(_) => {
                return Err(invalid(
                    key,
                    "names critics, which only CoMLRL's actor-critic trainers (iac, maac sections) train; MAGRPO takes none (leave it null)",
                ));
            }
        }
    }

    for section in ["magrpo", "grpo", "iac", "maac"] {
        let Some(s) = root.get_mut(section).and_then(Value::as_mapping_mut) else {
            continue;
        };
        let handoff = s.get("rollout").and_then(Value::as_str) == Some("handoff");
        // 2026 renamed the tree's leaf threshold; the September handoff threshold of the same name
        // no longer exists.
        if !handoff
            && !s.contains_key("termination_threshold")
            && let Some(v) = s.remove("early_termination_threshold")
        {
            s.insert(Value::from("termination_threshold"), v);
            report.mapped.push((
                format!("{section}.early_termination_threshold"),
                format!("{section}.termination_threshold (tree leaf threshold)"),
            ));
        }
        // CoMLRL 2026 subtracts coef·Σk3 from each completion's return before the group baseline:
        // cotrain's `reference_kl` with `placement: returns`.
        match s.remove("reference_kl_enabled") {
            None | Some(Value::Bool(false)) => {
                if s.remove("reference_kl_coef").is_some() {
                    report.ignored.push((
                        format!("{section}.reference_kl_coef"),
                        "the reference KL is off (reference_kl_enabled false)",
                    ));
                }
            }
            Some(Value::Bool(true)) => {
                if s.contains_key("reference_kl") {
                    return Err(invalid(
                        &format!("{section}.reference_kl_enabled"),
                        "and reference_kl are both present; keep one (reference_kl_enabled: true is reference_kl with placement: returns)",
                    ));
                }
                let coef = match s.remove("reference_kl_coef") {
                    None => Value::from(0.1),
                    Some(v @ Value::Number(_)) => v,
                    Some(_) => {
                        return Err(invalid(
                            &format!("{section}.reference_kl_coef"),
                            "must be a number (>= 0)",
                        ));
                    }
                };
                let mut kl = Mapping::new();
                kl.insert(Value::from("enabled"), Value::from(true));
                kl.insert(Value::from("placement"), Value::from("returns"));
                kl.insert(Value::from("coef"), coef);
                kl.insert(Value::from("estimator"), Value::from("k3"));
                s.insert(Value::from("reference_kl"), Value::Mapping(kl));
                report.mapped.push((
                    format!("{section}.reference_kl_enabled/reference_kl_coef"),
                    format!("{section}.reference_kl {{enabled: true, placement: returns, estimator: k3}}"),
                ));
            }
            Some(_) => {
                return Err(invalid(
                    &format!("{section}.reference_kl_enabled"),
                    "must be true or false",
                ));
            }
        }
        if s.remove("reference_devices").is_some() {
            report.ignored.push((
                format!("{section}.reference_devices"),
                "device placement of the reference model; cotrain keeps each reference beside its policy on the learner",
            ));
        }
    }
    Ok(())
}

/// A 2026 `critic_model` section as cotrain's: its `name` (and the checkpoint's dtype, which cotrain
/// takes from `model.dtype` for every model it trains); the sampling and length keys, which the
/// critic does not use upstream either, are dropped.
fn critic_model(
    v: Value,
    invalid: &dyn Fn(&str, &str) -> ConfigError,
    report: &mut CompatReport,
) -> Result<Value, ConfigError> {
    let Value::Mapping(mut m) = v else {
        return Err(invalid("critic_model", "must be a mapping with `name`"));
    };
    for key in [
        "type",
        "max_length",
        "temperature",
        "top_p",
        "top_k",
        "torch_dtype",
        "dtype",
    ] {
        if m.remove(key).is_some() {
            report.ignored.push((
                format!("critic_model.{key}"),
                "the critic loads like the agents (model.dtype); upstream's critic does not sample",
            ));
        }
    }
    Ok(Value::Mapping(m))
}

/// `comlrl_era` as written (`2026` may be typed as a number).
fn era_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mapped(yaml: &str) -> Result<(Value, CompatReport), ConfigError> {
        let mut v: Value = serde_yaml_ng::from_str(yaml).unwrap();
        let mut r = CompatReport::default();
        apply(v.as_mapping_mut().unwrap(), "f.yaml", &mut r)?;
        Ok((v, r))
    }

    #[test]
    fn the_2026_layout_is_marked_and_mapped() {
        let (v, _) = mapped(
            "agent_model: {name: m, temperature: 0.6, top_p: 0.6, top_k: null, special_tokens: {}, torch_dtype: bfloat16}\n\
             agents: null\ncritic_model: null\ncritics: null\n\
             magrpo: {num_turns: 2, early_termination_threshold: -0.2, train_batch_size: 2}\n",
        )
        .unwrap();
        assert_eq!(v["comlrl_era"], Value::from("2026"));
        assert_eq!(v["model"]["name"], Value::from("m"));
        assert_eq!(v["model"]["dtype"], Value::from("bfloat16"));
        assert!(
            v["model"].get("special_tokens").is_none()
                && v.get("agents").is_none()
                && v.get("critics").is_none()
        );
        assert_eq!(v["magrpo"]["termination_threshold"], Value::from(-0.2));
        assert!(v["magrpo"].get("early_termination_threshold").is_none());
    }

    #[test]
    fn september_configs_keep_their_handoff_threshold() {
        let (v, r) = mapped("magrpo: {num_turns: 2, rollout: handoff, early_termination_threshold: 4.0}\nagents: {num_agents: 2}\n").unwrap();
        assert!(v.get("comlrl_era").is_none() && r.mapped.is_empty());
        assert_eq!(v["magrpo"]["early_termination_threshold"], Value::from(4.0));
        assert_eq!(v["agents"]["num_agents"], Value::from(2));
    }

    #[test]
    fn the_2026_reference_kl_is_return_shaping() {
        let (v, r) = mapped("agent_model: {name: m}\nmagrpo: {reference_kl_enabled: true, reference_kl_coef: 0.05, reference_devices: [cuda:1]}\n").unwrap();
        let kl = &v["magrpo"]["reference_kl"];
        assert_eq!(kl["enabled"], Value::from(true));
        assert_eq!(kl["placement"], Value::from("returns"));
        assert_eq!(kl["coef"], Value::from(0.05));
        assert_eq!(kl["estimator"], Value::from("k3"));
        let m = &v["magrpo"];
        assert!(
            [
                "reference_kl_enabled",
                "reference_kl_coef",
                "reference_devices"
            ]
            .iter()
            .all(|k| m.get(*k).is_none()),
            "{m:?}"
        );
        assert!(
            r.mapped
                .iter()
                .any(|(from, to)| from.contains("reference_kl_enabled")
                    && to.contains("placement: returns")),
            "{:?}",
            r.mapped
        );
        assert!(
            r.ignored
                .iter()
                .any(|(key, _)| key == "magrpo.reference_devices"),
            "{:?}",
            r.ignored
        );
        // Upstream's default coefficient; off, the coefficient is reported as ignored.
        let (v, _) =
            mapped("agent_model: {name: m}\ngrpo: {reference_kl_enabled: true}\n").unwrap();
        assert_eq!(v["grpo"]["reference_kl"]["coef"], Value::from(0.1));
        let (v, r) = mapped("agent_model: {name: m}\nmagrpo: {reference_kl_enabled: false, reference_kl_coef: 0.3}\n").unwrap();
        assert!(
            v["magrpo"].get("reference_kl").is_none()
                && v["magrpo"].get("reference_kl_coef").is_none()
        );
        assert!(
            r.ignored
                .iter()
                .any(|(key, _)| key == "magrpo.reference_kl_coef"),
            "{:?}",
            r.ignored
        );
    }

    #[test]
    fn what_cotrain_lacks_is_refused_by_name() {
        let e = mapped("agent_model: {name: m}\ncritics: [c]\nmagrpo: {}\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("critics") && e.contains("actor-critic"), "{e}");
        let e = mapped("agent_model: {name: m}\nmagrpo: {reference_kl_enabled: true, reference_kl: {enabled: true}}\n").unwrap_err().to_string();
        assert!(
            e.contains("magrpo.reference_kl_enabled") && e.contains("both present"),
            "{e}"
        );
        let e = mapped("agent_model: {name: m}\nmagrpo: {reference_kl_enabled: true, reference_kl_coef: high}\n").unwrap_err().to_string();
        assert!(e.contains("magrpo.reference_kl_coef"), "{e}");
        let e = mapped(
            "agents: [a, b]\nmodel: {name: m, agents: [{temperature: 0.5}, {}]}\nmagrpo: {}\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("agents and model.agents are both present"),
            "{e}"
        );
        let e = mapped("agent_model: {name: m, special_tokens: {pad: x}}\nmagrpo: {}\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("agent_model.special_tokens"), "{e}");
    }
}
