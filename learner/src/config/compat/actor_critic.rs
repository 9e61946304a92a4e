//! The `iac` / `maac` sections of CoMLRL's actor-critic configs: the defaults of upstream's
//! `IACConfig`/`MAACConfig` (comlrl 1.4.3) where they differ from the MAGRPO section's, written in
//! so that the trainer section reads as upstream's dataclass would.

use serde_yaml_ng::{Mapping, Value};

use super::CompatReport;
use crate::config::ConfigError;

/// (key, upstream default) inserted when absent (besides advantages normalised and the tree stop
/// at a mean reward above −0.2): γ 1.0, one sample per agent, torch's AdamW weight decay, the
/// dataclasses' buffer of 8, 40 epochs, evaluation every 16 items, logging every step, and both
/// learning rates 5e-6.
const DEFAULTS: &[(&str, f64)] = &[
    ("discount", 1.0),
    ("num_generations", 1.0),
    ("weight_decay", 0.01),
    ("rollout_buffer_size", 8.0),
    ("num_train_epochs", 40.0),
    ("eval_interval", 16.0),
    ("logging_steps", 1.0),
    ("learning_rate", 5e-6),
    ("critic_learning_rate", 5e-6),
];

/// The DEFAULTS that are counts (YAML integers).
const COUNTS: &[&str] = &[
    "num_generations",
    "rollout_buffer_size",
    "num_train_epochs",
    "eval_interval",
    "logging_steps",
];

pub(super) fn apply(
    root: &mut Mapping,
    file: &str,
    report: &mut CompatReport,
) -> Result<(), ConfigError> {
    for section in ["iac", "maac"] {
        let Some(s) = root.get_mut(section).and_then(Value::as_mapping_mut) else {
            continue;
        };
        let invalid = |key: &str, message: &str| ConfigError::Invalid {
            file: file.to_string(),
            key: format!("{section}.{key}"),
            message: message.to_string(),
        };
        match (
            s.remove("early_termination_threshold"),
            s.contains_key("termination_threshold"),
        ) {
            (Some(_), true) => {
                return Err(invalid(
                    "early_termination_threshold",
                    "and termination_threshold are both present; keep one",
                ));
            }
            (Some(v), false) => {
                s.insert(Value::from("termination_threshold"), v);
                report.mapped.push((
                    format!("{section}.early_termination_threshold"),
                    format!("{section}.termination_threshold"),
                ));
            }
            (None, true) => {}
            (None, false) => {
                s.insert(Value::from("termination_threshold"), Value::from(-0.2));
            }
        }
        // Upstream evaluates with the training rollout's early stop.
        if !s.contains_key("eval_all_turns") {
            s.insert(Value::from("eval_all_turns"), Value::Bool(false));
        }
        // Upstream's default clip; `null` turns it off.
        if section == "iac" && !s.contains_key("value_clip_range") {
            s.insert(Value::from("value_clip_range"), Value::from(0.2));
        }
        if !s.contains_key("advantage_normalization") {
            s.insert(Value::from("advantage_normalization"), Value::Bool(true));
        }
        for (key, v) in DEFAULTS {
            if !s.contains_key(*key) {
                let v = if COUNTS.contains(key) {
                    Value::from(*v as u64)
                } else {
                    Value::from(*v)
                };
                s.insert(Value::from(*key), v);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_defaults_are_written_in_and_given_values_kept() {
        let mut v: Value =
            serde_yaml_ng::from_str("iac: {discount: 0.9, early_termination_threshold: -1.5}\n")
                .unwrap();
        let mut r = CompatReport::default();
        apply(v.as_mapping_mut().unwrap(), "f.yaml", &mut r).unwrap();
        let s = &v["iac"];
        assert_eq!(s["discount"], Value::from(0.9));
        assert_eq!(s["termination_threshold"], Value::from(-1.5));
        assert_eq!(s["advantage_normalization"], Value::Bool(true));
        assert_eq!(s["num_generations"], Value::from(1));
        assert_eq!(s["weight_decay"], Value::from(0.01));
        let mut v: Value = serde_yaml_ng::from_str("maac: {}\n").unwrap();
        apply(v.as_mapping_mut().unwrap(), "f.yaml", &mut r).unwrap();
        assert_eq!(v["maac"]["termination_threshold"], Value::from(-0.2));
        assert_eq!(v["maac"]["discount"], Value::from(1.0));
    }
}
