//! The validation step: typed raw config → [`CheckedConfig`], with every rule the trainers rely on,
//! one function per part of the config. The parts return `(key, message)`; [`check`] names the file.

mod setup;
mod trainer;

use std::path::Path;

use cotrain_proto::reward_options::ScoreOptions;

use super::{
    Algorithm, CheckedConfig, ConfigError, PromptSource, RawConfig, Sampling, TrainerSection,
};
use crate::data::SplitSpec;
use setup::{agent_models, agent_setups, dataset, prompt_sources, score_options, services};
use trainer::{generation_lengths, sampling, update_rules, with_era_defaults};

/// The original generation default when `top_k` is unset anywhere.
const DEFAULT_TOP_K: u32 = 50;

/// A rule broken: the full key and what is wrong with its value.
type Broken = (String, String);

fn broken<T>(key: impl Into<String>, message: impl Into<String>) -> Result<T, Broken> {
    Err((key.into(), message.into()))
}

/// The full key of a trainer-section field: the section's name, and MaPoRL's own spelling of the
/// keys it shares with the others.
#[derive(Clone, Copy)]
struct Keys(Algorithm);

impl Keys {
    fn of(self, name: &str) -> String {
        let name = match (self.0, name) {
            (Algorithm::Maporl, "num_agents") => "agent_num",
            (Algorithm::Maporl, "num_turns") => "round_num",
            (Algorithm::Maporl, "max_new_tokens") => "max_output_length",
            _ => name,
        };
        format!("{}.{name}", self.0.section())
    }
}

/// Validates `raw` (loaded from `source`) into the config the trainers run.
pub(super) fn check(raw: RawConfig, source: &Path) -> Result<CheckedConfig, ConfigError> {
    let file = source.display().to_string();
    let invalid = |(key, message): Broken| ConfigError::Invalid {
        file: file.clone(),
        key,
        message,
    };
    let Some((algorithm, section)) = trainer_section(&raw).map_err(invalid)? else {
        return Err(ConfigError::MissingKey {
            file: file.clone(),
            key: "magrpo (or grpo, maporl, iac, maac)".into(),
        });
    };
    let parts = parts(&raw, algorithm, section).map_err(invalid)?;
    Ok(CheckedConfig {
        prompt_sources: parts.prompt_sources,
        score_options: parts.score_options,
        source: source.to_path_buf(),
        sampling: parts.sampling,
        agents: parts.agents,
        raw,
        algorithm,
        trainer: parts.trainer,
        num_agents: parts.num_agents,
        turn_gradient_weights: parts.turn_gradient_weights,
        agent_models: parts.agent_models,
        train_split: parts.train_split,
        eval_split: parts.eval_split,
        actor_critic: parts.actor_critic,
    })
}

/// What validation derives from the raw config, for [`CheckedConfig`].
struct Parts {
    num_agents: usize,
    sampling: Sampling,
    turn_gradient_weights: Vec<f64>,
    agent_models: Vec<String>,
    agents: Vec<super::AgentSetup>,
    actor_critic: Option<super::ActorCriticSetup>,
    train_split: SplitSpec,
    eval_split: Option<SplitSpec>,
    score_options: ScoreOptions,
    prompt_sources: Vec<Option<PromptSource>>,
    trainer: TrainerSection,
}

/// Every part's rules, in the order their errors are reported.
fn parts(raw: &RawConfig, algorithm: Algorithm, section: TrainerSection) -> Result<Parts, Broken> {
    let k = Keys(algorithm);
    if raw.output.save_total_limit == Some(0) {
        return broken(
            "output.save_total_limit",
            "must be at least 1 (unset keeps every checkpoint)",
        );
    }
    let num_agents = num_agents(algorithm, &section, k)?;
    if let Some(v) = &raw.verifier
        && let Err((key, message)) = v.validate()
    {
        return broken(format!("verifier.{key}"), message);
    }
    generation_lengths(raw, algorithm, &section, k)?;
    let sampling = sampling(raw, &section, k)?;
    let turn_gradient_weights = update_rules(raw, &section, k)?;
    let agent_models = agent_models(raw, num_agents, k)?;
    let agents = agent_setups(raw, algorithm, &section, sampling, num_agents)?;
    if section.shared_parameters && agent_models.iter().any(|m| m != &agent_models[0]) {
        return broken(
            k.of("shared_parameters"),
            "is true but model.agents names different base models; shared agents need one model",
        );
    }
    let actor_critic = if algorithm.is_actor_critic() {
        Some(super::actor_critic::resolve(
            raw,
            algorithm,
            &section,
            &agent_models,
        )?)
    } else {
        None
    };
    let (train_split, eval_split) = dataset(raw)?;
    services(raw)?;
    Ok(Parts {
        score_options: score_options(raw)?,
        prompt_sources: prompt_sources(raw, num_agents)?,
        trainer: with_era_defaults(section, raw, num_agents),
        num_agents,
        sampling,
        turn_gradient_weights,
        agent_models,
        agents,
        actor_critic,
        train_split,
        eval_split,
    })
}

/// The one trainer section present (`None`: none is), as the shared trainer view; the actor-critic
/// keys refused outside `iac`/`maac`.
fn trainer_section(raw: &RawConfig) -> Result<Option<(Algorithm, TrainerSection)>, Broken> {
    let present: Vec<(Algorithm, TrainerSection)> = [
        (Algorithm::Magrpo, raw.magrpo.clone()),
        (Algorithm::Grpo, raw.grpo.clone()),
        (
            Algorithm::Maporl,
            raw.maporl.as_ref().map(|m| m.trainer_view()),
        ),
        (Algorithm::Iac, raw.iac.clone()),
        (Algorithm::Maac, raw.maac.clone()),
    ]
    .into_iter()
    .filter_map(|(algorithm, section)| Some((algorithm, section?)))
    .collect();
    if present.len() > 1 {
        let others: Vec<&str> = present[1..].iter().map(|(a, _)| a.section()).collect();
        return broken(
            present[0].0.section(),
            format!(
                "and {} are both present; keep exactly one trainer section",
                others.join(" and ")
            ),
        );
    }
    let Some((algorithm, section)) = present.into_iter().next() else {
        return Ok(None);
    };
    if let (Algorithm::Maporl, Some(m)) = (algorithm, &raw.maporl) {
        m.check()?;
    }
    if !algorithm.is_actor_critic() {
        if let Some(key) = super::actor_critic::critic_key_set(&section) {
            return broken(
                format!("{}.{key}", algorithm.section()),
                "is a key of the actor-critic trainers (iac, maac)",
            );
        }
        if raw.critic_model.is_some() || raw.critics.is_some() {
            let key = if raw.critics.is_some() {
                "critics"
            } else {
                "critic_model"
            };
            return broken(
                key,
                format!(
                    "names critics, which only the iac and maac trainers train ({} takes none)",
                    algorithm.section()
                ),
            );
        }
    }
    Ok(Some((algorithm, section)))
}

fn num_agents(algorithm: Algorithm, section: &TrainerSection, k: Keys) -> Result<usize, Broken> {
    Ok(match (algorithm, section.num_agents) {
        (Algorithm::Grpo, None | Some(1)) => 1,
        (Algorithm::Grpo, Some(n)) => {
            return broken(
                k.of("num_agents"),
                format!("is {n} but grpo trains one agent (use a magrpo section)"),
            );
        }
        (Algorithm::Maporl, n) => n.unwrap_or(2),
        (Algorithm::Magrpo | Algorithm::Iac | Algorithm::Maac, None) => 2,
        (Algorithm::Magrpo | Algorithm::Iac | Algorithm::Maac, Some(0)) => {
            return broken(k.of("num_agents"), "must be at least 1");
        }
        (Algorithm::Magrpo | Algorithm::Iac | Algorithm::Maac, Some(n)) => n,
    })
}
