//! Configs: raw YAML → deep-merged `--override a.b.c=value` → legacy flags → typed [`RawConfig`] →
//! validation into a [`CheckedConfig`]. Every error names the file and the offending key.

mod actor_critic;
pub mod compat;
mod maporl;
pub mod reference;
pub mod resume;
mod schema;
mod validate;
mod verifier;

use std::path::{Path, PathBuf};

pub use actor_critic::ActorCriticSetup;
pub use maporl::{
    AdapterLayout, AdvantageWhitening, AgentShare, CriticHead, FollowupStyle, Horizon,
    IncentiveRule, MaporlScore, MaporlSection, OldLogprobs, ScorePosition, VerifierUserMessage,
};
pub use schema::*;
use serde_yaml_ng::{Mapping, Value};
pub use verifier::VerifierSection;

use crate::data::SplitSpec;

/// Why a config could not be loaded. Every variant names the file it came from.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{file}: cannot read config: {source}")]
    Io {
        file: String,
        source: std::io::Error,
    },
    /// The file is not valid YAML (or not a mapping at the top).
    #[error("{file}: invalid yaml: {message}")]
    Yaml { file: String, message: String },
    /// A key that the schema does not know.
    #[error("{file}: unknown key {key}{}", suggestion.as_ref().map(|s| format!(" (did you mean {s}?)")).unwrap_or_default())]
    UnknownKey {
        file: String,
        key: String,
        suggestion: Option<String>,
    },
    /// A required key is absent.
    #[error("{file}: missing key {key}")]
    MissingKey { file: String, key: String },
    /// A value of the wrong type or an unknown variant.
    #[error("{file}: {key}: {message}")]
    WrongType {
        file: String,
        key: String,
        message: String,
    },
    /// A value of the right type that is not allowed.
    #[error("{file}: {key} {message}")]
    Invalid {
        file: String,
        key: String,
        message: String,
    },
    /// An `--override` argument that is not `a.b.c=value` or cannot be merged.
    #[error("{file}: bad override `{arg}`: {message}")]
    Override {
        file: String,
        arg: String,
        message: String,
    },
}

/// The original training scripts' command-line flags; each one really changes the config.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LegacyFlags {
    /// `--model_name`: `model.name`.
    pub model_name: Option<String>,
    /// `--num_epochs`: `<trainer>.num_train_epochs`.
    pub num_epochs: Option<usize>,
    /// `--num_turns`: `<trainer>.num_turns`.
    pub num_turns: Option<usize>,
    /// `--turn_gradient_weights A B`: `<trainer>.turn_gradient_weights`.
    pub turn_gradient_weights: Option<Vec<f64>>,
    /// `--output_base_dir`: `output.base_dir`.
    pub output_base_dir: Option<String>,
}

/// Which trainer section the config uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Algorithm {
    Grpo,
    Magrpo,
    Maporl,
    /// CoMLRL's independent actor-critic.
    Iac,
    /// CoMLRL's multi-agent actor-critic (one centralised critic).
    Maac,
}

impl Algorithm {
    /// The YAML section name.
    pub fn section(self) -> &'static str {
        match self {
            Algorithm::Grpo => "grpo",
            Algorithm::Magrpo => "magrpo",
            Algorithm::Maporl => "maporl",
            Algorithm::Iac => "iac",
            Algorithm::Maac => "maac",
        }
    }

    /// IAC or MAAC: MAGRPO's rollouts, trained against critics.
    pub fn is_actor_critic(self) -> bool {
        matches!(self, Algorithm::Iac | Algorithm::Maac)
    }
}

/// Sampling parameters after falling back from the trainer section to `model`.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Sampling {
    pub temperature: f64,
    pub top_p: f64,
    /// 0 disables top-k.
    pub top_k: u32,
    pub max_new_tokens: usize,
}

/// One agent's resolved settings: its `model.agents[i]` entry over the shared values.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct AgentSetup {
    pub sampling: Sampling,
    /// Strings that end this agent's completions.
    pub stop: Vec<String>,
    /// AdamW learning rate of this agent's policy.
    pub learning_rate: f64,
    /// The LoRA adapter this agent's policy trains (`model.agents[i].lora`, else `model.lora`);
    /// `None`: full fine-tuning.
    pub lora: Option<cotrain_model::lora::LoraConfig>,
}

/// A validated config: every value checked, fallbacks resolved. Build it with [`load_config`] or
/// [`CheckedConfig::from_value`].
#[derive(Debug, Clone, PartialEq)]
pub struct CheckedConfig {
    /// The file it came from (for messages and the run's copy of the config).
    pub source: PathBuf,
    /// The merged config as typed.
    pub raw: RawConfig,
    pub algorithm: Algorithm,
    /// The trainer section (`magrpo` or `grpo`), with `num_agents` filled in.
    pub trainer: TrainerSection,
    pub num_agents: usize,
    pub sampling: Sampling,
    /// `turn_gradient_weights`, filled with 1.0 per turn when absent.
    pub turn_gradient_weights: Vec<f64>,
    /// One model name per agent (`model.agents` or `model.name` repeated).
    pub agent_models: Vec<String>,
    /// Per agent, its sampling, stop strings and learning rate (`model.agents[i]` over `sampling` and
    /// the trainer section's `learning_rate`).
    pub agents: Vec<AgentSetup>,
    pub train_split: SplitSpec,
    pub eval_split: Option<SplitSpec>,
    /// What every scoring call sends to the reward server: `reward.options`, with
    /// `reward.writing_ratio_version` applied and `split_seed` defaulting to `seed`.
    pub score_options: cotrain_proto::reward_options::ScoreOptions,
    /// Per agent, the configured prompt template (`None`: the task's default).
    pub prompt_sources: Vec<Option<PromptSource>>,
    /// `iac` / `maac`: the critics.
    pub actor_critic: Option<ActorCriticSetup>,
}

/// Where an agent's configured prompt template comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptSource {
    Inline(String),
    /// A path as written in the config (relative to the config file's directory).
    File(String),
}

impl CheckedConfig {
    /// `learner.collective_timeout_secs` as a bound (none when 0).
    pub fn collective_timeout(&self) -> Option<std::time::Duration> {
        let secs = self.raw.learner.collective_timeout_secs;
        (secs > 0).then(|| std::time::Duration::from_secs(secs))
    }

    /// The longest prompt agent `a` may be given: `model.max_length` less its `max_new_tokens`.
    pub fn max_prompt_tokens(&self, a: usize) -> usize {
        let new = self
            .agents
            .get(a)
            .map_or(self.sampling.max_new_tokens, |s| s.sampling.max_new_tokens);
        self.raw.model.max_length.saturating_sub(new)
    }

    /// True when the run needs the multi-turn trainer.
    pub fn is_multi_turn(&self) -> bool {
        self.trainer.num_turns > 1
    }

    /// The merged config as YAML, with every default written out.
    pub fn to_yaml(&self) -> String {
        serde_yaml_ng::to_string(&self.raw)
            .unwrap_or_else(|e| format!("# cannot serialise config: {e}\n"))
    }

    /// Parses, types and validates an already merged YAML value.
    pub fn from_value(value: Value, source: &Path) -> Result<Self, ConfigError> {
        let file = source.display().to_string();
        let raw = typed(value, &file)?;
        validate::check(raw, source)
    }
}

/// Loads `path`, merges `overrides` (`a.b.c=value`, values typed as YAML) and the legacy flags, then
/// types and validates the result.
pub fn load_config(
    path: &Path,
    overrides: &[String],
    legacy: &LegacyFlags,
) -> Result<CheckedConfig, ConfigError> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
        file: file.clone(),
        source,
    })?;
    let value = merged_value(&text, &file, overrides, legacy)?;
    CheckedConfig::from_value(value, path)
}

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

/// Types the merged value, turning serde's messages into ones that name the full key.
fn typed(mut value: Value, file: &str) -> Result<RawConfig, ConfigError> {
    agent_names_as_settings(&mut value).map_err(|(key, message)| ConfigError::Invalid {
        file: file.to_string(),
        key,
        message,
    })?;
    serde_path_to_error::deserialize::<_, RawConfig>(value).map_err(|err| {
        let path = err.path().to_string();
        let message = err.inner().to_string();
        describe_serde_error(file, &path, &message)
    })
}

/// `model.agents` entries may be plain model names (the original's form); they become `{name: ...}`
/// here so that mappings are typed with `deny_unknown_fields` and errors name the field.
fn agent_names_as_settings(value: &mut Value) -> Result<(), (String, String)> {
    let Some(list) = value
        .get_mut("model")
        .and_then(|m| m.get_mut("agents"))
        .and_then(Value::as_sequence_mut)
    else {
        return Ok(());
    };
    for (i, entry) in list.iter_mut().enumerate() {
        match entry {
            Value::String(name) => *entry = name_entry(std::mem::take(name)),
            Value::Null => *entry = Value::Mapping(Mapping::new()),
            Value::Mapping(_) => {}
            other => {
                let shown = serde_yaml_ng::to_string(other).unwrap_or_default();
                return Err((
                    format!("model.agents[{i}]"),
                    format!(
                        "is `{}`; each entry is a model name or a mapping of that agent's settings",
                        shown.trim()
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// A `model.agents` entry written as a plain model name, as the mapping it means.
fn name_entry(name: String) -> Value {
    let mut m = Mapping::new();
    m.insert(Value::from("name"), Value::String(name));
    Value::Mapping(m)
}

fn describe_serde_error(file: &str, path: &str, message: &str) -> ConfigError {
    let path = if path == "." {
        String::new()
    } else {
        path.to_string()
    };
    let join = |name: &str| {
        if path.is_empty() {
            name.to_string()
        } else {
            format!("{path}.{name}")
        }
    };
    let unknown =
        regex::Regex::new(r"^unknown field `([^`]*)`(?:, expected (.*))?").expect("static regex");
    if let Some(c) = unknown.captures(message) {
        let field = c.get(1).map_or("", |m| m.as_str());
        let expected: Vec<String> = c
            .get(2)
            .map(|m| {
                regex::Regex::new(r"`([^`]*)`")
                    .expect("static regex")
                    .captures_iter(m.as_str())
                    .map(|x| x[1].to_string())
                    .collect()
            })
            .unwrap_or_default();
        // serde_path_to_error may or may not include the unknown key itself in the path.
        let key = if path.ends_with(field) && !path.is_empty() {
            path.clone()
        } else {
            join(field)
        };
        return ConfigError::UnknownKey {
            file: file.to_string(),
            key,
            suggestion: closest(field, &expected),
        };
    }
    let missing = regex::Regex::new(r"^missing field `([^`]*)`").expect("static regex");
    if let Some(c) = missing.captures(message) {
        return ConfigError::MissingKey {
            file: file.to_string(),
            key: join(&c[1]),
        };
    }
    let message = message
        .split(" at line ")
        .next()
        .unwrap_or(message)
        .to_string();
    ConfigError::WrongType {
        file: file.to_string(),
        key: if path.is_empty() {
            "(top level)".into()
        } else {
            path
        },
        message,
    }
}

/// The known name closest to a misspelt one, if any is close enough to be a plausible typo.
fn closest(name: &str, known: &[String]) -> Option<String> {
    known
        .iter()
        .map(|k| (strsim::damerau_levenshtein(name, k), k))
        .filter(|(d, k)| *d <= 3.max(k.len() / 4) && *d < k.len())
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// `eval_decoding` is `sampled` in both eras unless set, `greedy` loads, and another value is
    /// refused naming the key and the variants.
    #[test]
    fn eval_decoding_defaults_to_sampled_and_refuses_unknown_values() {
        let load = |text: &str, overrides: &[&str]| {
            let overrides: Vec<String> = overrides.iter().map(|o| o.to_string()).collect();
            merged_value(text, "x.yaml", &overrides, &LegacyFlags::default())
                .and_then(|v| CheckedConfig::from_value(v, Path::new("x.yaml")))
        };
        let text = "model: {name: m}\ndataset: {name: humaneval}\nmagrpo: {}\n";
        assert_eq!(
            load(text, &[]).unwrap().trainer.eval_decoding,
            EvalDecoding::Sampled
        );
        let text_2026 =
            "comlrl_era: '2026'\nmodel: {name: m}\ndataset: {name: humaneval}\nmagrpo: {}\n";
        assert_eq!(
            load(text_2026, &[]).unwrap().trainer.eval_decoding,
            EvalDecoding::Sampled
        );
        assert_eq!(
            load(text, &["magrpo.eval_decoding=greedy"])
                .unwrap()
                .trainer
                .eval_decoding,
            EvalDecoding::Greedy
        );
        assert_eq!(
            load(text_2026, &["magrpo.eval_decoding=greedy"])
                .unwrap()
                .trainer
                .eval_decoding,
            EvalDecoding::Greedy
        );
        let e = load(text, &["magrpo.eval_decoding=argmax"])
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("x.yaml: magrpo.eval_decoding: unknown variant `argmax`"),
            "{e}"
        );
        assert!(e.contains("sampled") && e.contains("greedy"), "{e}");
    }

    #[test]
    fn closest_suggests_plausible_typos_only() {
        let known = vec!["learning_rate".to_string(), "num_agents".to_string()];
        assert_eq!(
            closest("learnin_rate", &known).as_deref(),
            Some("learning_rate")
        );
        assert_eq!(closest("zzzzzzzzzzzzzzzzz", &known), None);
    }
}
