//! The untyped stage of loading a config: the YAML text, `--override a.b.c=value` pairs deep-merged
//! into it (values typed as YAML, Python literals accepted as the original's scripts wrote them), and
//! the legacy flags of the seed scripts.

use serde_yaml_ng::{Mapping, Value};

use super::{ConfigError, LegacyFlags, compat, name_entry};

/// Parses `text` and applies overrides and legacy flags, without typing it.
pub fn merged_value(
    text: &str,
    file: &str,
    overrides: &[String],
    legacy: &LegacyFlags,
) -> Result<Value, ConfigError> {
    let mut value: Value = serde_yaml_ng::from_str(text).map_err(|e| ConfigError::Yaml {
        file: file.to_string(),
        message: e.to_string(),
    })?;
    if value.is_null() {
        value = Value::Mapping(Mapping::new());
    }
    if !value.is_mapping() {
        return Err(ConfigError::Yaml {
            file: file.to_string(),
            message: "the top level must be a mapping".into(),
        });
    }
    for arg in overrides {
        let (key, raw_value) = arg.split_once('=').ok_or_else(|| ConfigError::Override {
            file: file.to_string(),
            arg: arg.clone(),
            message: "expected key=value (e.g. magrpo.learning_rate=1e-5)".into(),
        })?;
        set_path(&mut value, key.trim(), parse_override_value(raw_value)).map_err(|message| {
            ConfigError::Override {
                file: file.to_string(),
                arg: arg.clone(),
                message,
            }
        })?;
    }
    // The original projects' own keys, from the file or an override, before the legacy flags
    // (which name cotrain's sections).
    compat::apply(&mut value, file)?;
    apply_legacy(&mut value, legacy, file)?;
    Ok(value)
}

/// An override value is YAML (`1e-5`, `[1.5,0.5]`, `'test[16:]'`, `true`); text that is not valid YAML
/// is taken as a plain string. Users of the Python originals type Python literals, so the bare words
/// `None`, `True` and `False` (outside quotes, also inside lists) mean null and the booleans, where
/// YAML would read `None` as a string; `'None'` stays a string.
fn parse_override_value(text: &str) -> Value {
    if text.trim().is_empty() {
        return Value::Null;
    }
    let yaml = python_literals_to_yaml(text);
    serde_yaml_ng::from_str(&yaml).unwrap_or_else(|_| Value::String(text.to_string()))
}

/// Rewrites bare `None` / `True` / `False` words outside quotes as YAML's `null` / `true` / `false`.
fn python_literals_to_yaml(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut quote: Option<char> = None;
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        out.push_str(match word.as_str() {
            "None" => "null",
            "True" => "true",
            "False" => "false",
            w => w,
        });
        word.clear();
    };
    for ch in text.chars() {
        match quote {
            Some(q) => {
                out.push(ch);
                if ch == q {
                    quote = None;
                }
            }
            None if ch.is_alphanumeric() || ch == '_' || ch == '.' || ch == '-' => word.push(ch),
            None => {
                flush(&mut word, &mut out);
                if ch == '\'' || ch == '"' {
                    quote = Some(ch);
                }
                out.push(ch);
            }
        }
    }
    flush(&mut word, &mut out);
    out
}

/// Deep-merges `new` at the dotted `key`, creating mappings on the way.
fn set_path(root: &mut Value, key: &str, new: Value) -> Result<(), String> {
    // `model.agents[1].temperature` (as errors name keys) is `model.agents.1.temperature`.
    let dotted = key.replace('[', ".").replace(']', "");
    let parts: Vec<&str> = dotted.split('.').collect();
    if parts.iter().any(|p| p.is_empty()) {
        return Err(format!("empty segment in key `{key}`"));
    }
    let mut node = root;
    for (i, part) in parts.iter().enumerate() {
        if node.is_null() && part.parse::<usize>().is_ok() {
            return Err(format!(
                "`{}` is not set, so it has no entry {part}; give the whole list (e.g. model.agents=[{{}}, {{temperature: 0.9}}])",
                parts[..i].join(".")
            ));
        }
        // A list entry by index (`model.agents.1`); a plain model name there becomes `{name: ...}`
        // when a key below it is set.
        if let Value::Sequence(list) = node {
            let len = list.len();
            let entry = part
                .parse::<usize>()
                .ok()
                .and_then(|j| list.get_mut(j))
                .ok_or_else(|| {
                    format!(
                        "`{}` is a list of {len}; `{part}` is not an index of it",
                        parts[..i].join(".")
                    )
                })?;
            if i + 1 == parts.len() {
                *entry = new;
                return Ok(());
            }
            if let Value::String(name) = entry {
                *entry = name_entry(std::mem::take(name));
            }
            node = entry;
            continue;
        }
        let map = match node {
            Value::Mapping(m) => m,
            Value::Null => {
                *node = Value::Mapping(Mapping::new());
                node.as_mapping_mut().expect("just made a mapping")
            }
            _ => return Err(format!("`{}` is not a mapping", parts[..i].join("."))),
        };
        let k = Value::String(part.to_string());
        if i + 1 == parts.len() {
            match (map.get_mut(&k), new) {
                (Some(Value::Mapping(existing)), Value::Mapping(incoming)) => {
                    deep_merge(existing, incoming)
                }
                (_, new) => {
                    map.insert(k, new);
                }
            }
            return Ok(());
        }
        node = map.entry(k).or_insert(Value::Null);
    }
    Ok(())
}

fn deep_merge(base: &mut Mapping, incoming: Mapping) {
    for (k, v) in incoming {
        match (base.get_mut(&k), v) {
            (Some(Value::Mapping(b)), Value::Mapping(i)) => deep_merge(b, i),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

/// The trainer section a raw value uses: `grpo` if only that is present, else `magrpo`.
fn trainer_section_of(value: &Value) -> &'static str {
    let has = |k: &str| value.get(k).is_some_and(|v| !v.is_null());
    if has("grpo") && !has("magrpo") {
        "grpo"
    } else {
        "magrpo"
    }
}

fn apply_legacy(value: &mut Value, legacy: &LegacyFlags, file: &str) -> Result<(), ConfigError> {
    let section = trainer_section_of(value);
    let mut sets: Vec<(String, Value)> = Vec::new();
    if let Some(name) = &legacy.model_name {
        sets.push(("model.name".into(), Value::String(name.clone())));
    }
    if let Some(n) = legacy.num_epochs {
        sets.push((
            format!("{section}.num_train_epochs"),
            Value::Number((n as u64).into()),
        ));
    }
    if let Some(n) = legacy.num_turns {
        sets.push((
            format!("{section}.num_turns"),
            Value::Number((n as u64).into()),
        ));
    }
    if let Some(w) = &legacy.turn_gradient_weights {
        let list = w.iter().map(|x| Value::Number((*x).into())).collect();
        sets.push((
            format!("{section}.turn_gradient_weights"),
            Value::Sequence(list),
        ));
    }
    if let Some(dir) = &legacy.output_base_dir {
        sets.push(("output.base_dir".into(), Value::String(dir.clone())));
    }
    for (key, v) in sets {
        set_path(value, &key, v).map_err(|message| ConfigError::Override {
            file: file.to_string(),
            arg: format!("legacy flag for {key}"),
            message,
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::config::CheckedConfig;

    #[test]
    fn override_values_are_yaml_typed_and_deep_merged() {
        let text = "model: {name: m}\ndataset: {name: humaneval}\nmagrpo: {num_turns: 2}\n";
        let v = merged_value(
            text,
            "x.yaml",
            &[
                "magrpo.turn_gradient_weights=[1.5,0.5]".into(),
                "dataset.train_split='test[16:]'".into(),
                "magrpo.learning_rate=1e-5".into(),
                "reward_processor={enabled: true, shift: -4}".into(),
            ],
            &LegacyFlags::default(),
        )
        .unwrap();
        let cfg = CheckedConfig::from_value(v, Path::new("x.yaml")).unwrap();
        assert_eq!(cfg.turn_gradient_weights, vec![1.5, 0.5]);
        assert_eq!(cfg.raw.dataset.train_split, "test[16:]");
        assert_eq!(cfg.trainer.learning_rate, 1e-5);
        assert_eq!(cfg.trainer.num_turns, 2);
        assert!(cfg.raw.reward_processor.enabled);
        assert_eq!(cfg.raw.reward_processor.shift, -4.0);
    }

    #[test]
    fn python_literals_in_overrides() {
        let text = "model: {name: m}\ndataset: {name: humaneval}\nmagrpo: {}\n";
        let v = merged_value(
            text,
            "x.yaml",
            &[
                "magrpo.termination_threshold=None".into(),
                "magrpo.advantage_normalization=True".into(),
                "output.save_final_model=False".into(),
                "magrpo.turn_gradient_weights=[1.5]".into(),
                "model.name='None'".into(),
            ],
            &LegacyFlags::default(),
        )
        .unwrap();
        let cfg = CheckedConfig::from_value(v, Path::new("x.yaml")).unwrap();
        assert_eq!(cfg.trainer.termination_threshold, None);
        assert!(cfg.trainer.advantage_normalization);
        assert!(!cfg.raw.output.save_final_model);
        // A quoted value stays a string.
        assert_eq!(cfg.raw.model.name, "None");
        assert_eq!(
            python_literals_to_yaml("[None, True,'False', Nonesuch]"),
            "[null, true,'False', Nonesuch]"
        );
    }
}
