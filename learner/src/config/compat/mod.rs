//! The original projects' config files load as they are: keys the original used that cotrain names
//! differently are mapped (and logged), keys that change nothing are accepted with a warning naming
//! them, and everything else still fails typing with an error naming the key and the file.

use serde_yaml_ng::{Mapping, Value};
use tracing::{info, warn};

mod actor_critic;
mod era_2026;

/// What the compatibility pass did to a config, for logs and tests.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CompatReport {
    /// `(original key, what it became)`.
    pub mapped: Vec<(String, String)>,
    /// `(key, why it is ignored)`.
    pub ignored: Vec<(String, &'static str)>,
}

/// Trainer-section keys that are accepted and ignored, with the reason.
const IGNORED_TRAINER_KEYS: &[(&str, &str)] = &[
    (
        "per_device_train_batch_size",
        "the original trains on one item at a time whatever its value",
    ),
    (
        "beta",
        "the original computes no KL term, so its coefficient changes nothing (cotrain: reference_kl)",
    ),
    (
        "epsilon_clip",
        "the original's loss has no ratio to clip (cotrain: ppo_clip)",
    ),
    (
        "eval_batch_size",
        "evaluation batching does not change its results",
    ),
    (
        "parallel_training",
        "device placement; cotrain places work by its rollout workers and learner",
    ),
    (
        "agent_devices",
        "device placement; cotrain places work by its rollout workers and learner",
    ),
    (
        "critic_devices",
        "device placement; cotrain keeps the critics beside the policies on the learner",
    ),
];

/// Other keys that are accepted and ignored.
const IGNORED_KEYS: &[(&str, &str)] = &[
    (
        "tokenizer.padding_side",
        "cotrain batches without padding the prompts' left side",
    ),
    (
        "output.save_path",
        "cotrain writes the final models to RUN_DIR/final_model (output.save_final_model)",
    ),
];

fn section_mut<'a>(root: &'a mut Mapping, key: &str) -> Option<&'a mut Mapping> {
    root.get_mut(key).and_then(Value::as_mapping_mut)
}

/// Rewrites the original's keys in `value` (the merged YAML, before typing) in place. Fails, naming
/// the key, on an original key whose behaviour cotrain does not have.
pub fn apply(value: &mut Value, file: &str) -> Result<CompatReport, super::ConfigError> {
    let mut report = CompatReport::default();
    let Some(root) = value.as_mapping_mut() else {
        return Ok(report);
    };
    era_2026::apply(root, file, &mut report)?;

    // The August 2025 multi-turn configs name their trainer section `mt_magrpo`.
    if root.contains_key("mt_magrpo") && !root.contains_key("magrpo") {
        let v = root.remove("mt_magrpo").unwrap_or(Value::Null);
        root.insert(Value::from("magrpo"), v);
        report.mapped.push(("mt_magrpo".into(), "magrpo".into()));
    }
    // The August 2025 writing configs give the agent count in `agents.num_agents`.
    if let Some(agents) = root.get("agents").and_then(Value::as_mapping).cloned()
        && agents.keys().all(|k| k.as_str() == Some("num_agents"))
    {
        root.remove("agents");
        if let Some(n) = agents.get("num_agents") {
            let section = if root.contains_key("grpo") && !root.contains_key("magrpo") {
                "grpo"
            } else {
                "magrpo"
            };
            let s = root
                .entry(Value::from(section))
                .or_insert_with(|| Value::Mapping(Mapping::new()));
            if let Some(m) = s.as_mapping_mut()
                && !m.contains_key("num_agents")
            {
                m.insert(Value::from("num_agents"), n.clone());
            }
            report
                .mapped
                .push(("agents.num_agents".into(), format!("{section}.num_agents")));
        }
    }

    for section in ["magrpo", "grpo", "iac", "maac"] {
        let mut shift: Option<Value> = None;
        let mut expert: Option<Value> = None;
        let mut passthrough: Option<Value> = None;
        if let Some(s) = section_mut(root, section) {
            // `reward_shift: -4` is the reward processor's shift (null: no shift).
            if let Some(v) = s.remove("reward_shift") {
                shift = Some(v);
            }
            if let Some(v) = s.remove("agent_learning_rate") {
                if !s.contains_key("learning_rate") {
                    s.insert(Value::from("learning_rate"), v);
                }
                report.mapped.push((
                    format!("{section}.agent_learning_rate"),
                    format!("{section}.learning_rate"),
                ));
            }
            if let Some(v) = s.remove("expert_model") {
                expert = Some(v);
            }
            if let Some(v) = s.remove("external_prompt_passthrough") {
                passthrough = Some(v);
            }
            for (key, why) in IGNORED_TRAINER_KEYS {
                if s.remove(*key).is_some() {
                    report.ignored.push((format!("{section}.{key}"), why));
                }
            }
        }
        if let Some(v) = shift {
            if v.is_null() {
                report
                    .mapped
                    .push((format!("{section}.reward_shift"), "no shift (null)".into()));
            } else {
                let rp = root
                    .entry(Value::from("reward_processor"))
                    .or_insert_with(|| Value::Mapping(Mapping::new()));
                if let Some(m) = rp.as_mapping_mut() {
                    m.insert(Value::from("enabled"), Value::Bool(true));
                    m.insert(Value::from("shift"), v);
                }
                report.mapped.push((
                    format!("{section}.reward_shift"),
                    "reward_processor.shift (enabled)".into(),
                ));
            }
        }
        if let Some(v) = expert {
            let ext = root
                .entry(Value::from("external"))
                .or_insert_with(|| Value::Mapping(Mapping::new()));
            if let Some(m) = ext.as_mapping_mut() {
                m.insert(Value::from("expert_model"), v);
            }
            report.mapped.push((
                format!("{section}.expert_model"),
                "external.expert_model".into(),
            ));
        }
        if let Some(v) = passthrough {
            let ext = root
                .entry(Value::from("external"))
                .or_insert_with(|| Value::Mapping(Mapping::new()));
            if let Some(m) = ext.as_mapping_mut()
                && !m.contains_key("prompt_passthrough")
                && !m.contains_key("external_prompt_passthrough")
            {
                m.insert(Value::from("prompt_passthrough"), v);
            }
            report.mapped.push((
                format!("{section}.external_prompt_passthrough"),
                "external.prompt_passthrough".into(),
            ));
        }
    }

    actor_critic::apply(root, file, &mut report)?;

    for (key, why) in IGNORED_KEYS {
        let (sec, name) = key.split_once('.').expect("dotted key");
        let mut emptied = false;
        if let Some(s) = section_mut(root, sec)
            && s.remove(name).is_some()
        {
            report.ignored.push((key.to_string(), why));
            emptied = s.is_empty();
        }
        if emptied && sec == "tokenizer" {
            root.remove(sec);
        }
    }

    for (from, to) in &report.mapped {
        info!(file, key = %from, now = %to, "original config key mapped");
    }
    for (key, why) in &report.ignored {
        warn!(file, key = %key, reason = why, "original config key accepted and ignored");
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn original_keys_are_mapped_or_ignored_and_others_left_alone() {
        let mut v: Value = serde_yaml_ng::from_str(
            "mt_magrpo: {num_turns: 2, reward_shift: -4, per_device_train_batch_size: 1, expert_model: m, beta: 0.0, external_prompt_passthrough: true}\n\
             agents: {num_agents: 2}\ntokenizer: {padding_side: left}\noutput: {save_path: x, base_dir: o}\n",
        )
        .unwrap();
        let r = apply(&mut v, "f.yaml").unwrap();
        assert_eq!(v["magrpo"]["num_turns"], Value::from(2));
        assert_eq!(v["magrpo"]["num_agents"], Value::from(2));
        assert_eq!(v["reward_processor"]["shift"], Value::from(-4));
        assert_eq!(v["reward_processor"]["enabled"], Value::Bool(true));
        assert_eq!(v["external"]["expert_model"], Value::from("m"));
        assert_eq!(v["external"]["prompt_passthrough"], Value::Bool(true));
        assert!(v.get("tokenizer").is_none() && v.get("agents").is_none());
        assert_eq!(v["output"]["base_dir"], Value::from("o"));
        let ignored: Vec<&str> = r.ignored.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            ignored,
            vec![
                "magrpo.per_device_train_batch_size",
                "magrpo.beta",
                "tokenizer.padding_side",
                "output.save_path"
            ]
        );
        // A key with no meaning anywhere stays for typing to reject.
        let mut v: Value = serde_yaml_ng::from_str("magrpo: {learnin_rate: 1}\n").unwrap();
        apply(&mut v, "f.yaml").unwrap();
        assert_eq!(v["magrpo"]["learnin_rate"], Value::from(1));
    }
}
