//! Configs: raw YAML → deep-merged `--override a.b.c=value` → legacy flags → typed [`RawConfig`] →
//! validation into a [`CheckedConfig`]. Every error names the file and the offending key.

mod actor_critic;
pub mod compat;
mod maporl;
mod merge;
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
pub use merge::merged_value;
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
pub(super) fn name_entry(name: String) -> Value {
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
