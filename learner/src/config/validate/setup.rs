//! The rules of the parts around the trainer: each agent's model and settings, the dataset, the
//! services' addresses, the reward's options and the prompt templates.

use cotrain_proto::reward_options::ScoreOptions;

use super::{Broken, Keys, broken};
use crate::config::{Algorithm, PromptSource, RawConfig, Sampling, TrainerSection};
use crate::data::{DatasetKind, SplitSpec};

/// Each agent's base model: `model.agents[i].name`, or `model.name`.
pub(super) fn agent_models(
    raw: &RawConfig,
    num_agents: usize,
    k: Keys,
) -> Result<Vec<String>, Broken> {
    match &raw.model.agents {
        None => Ok(vec![raw.model.name.clone(); num_agents]),
        Some(list) if list.len() != num_agents => broken(
            "model.agents",
            format!(
                "has {} entries but {} is {num_agents}",
                list.len(),
                k.of("num_agents")
            ),
        ),
        Some(list) => Ok(list
            .iter()
            .map(|a| a.name.clone().unwrap_or_else(|| raw.model.name.clone()))
            .collect()),
    }
}

/// Each agent's settings: its `model.agents[i]` entry, every key it leaves out taken from `shared`
/// and the trainer section. Errors are (key, message).
pub(super) fn agent_setups(
    raw: &RawConfig,
    algorithm: Algorithm,
    section: &TrainerSection,
    shared: Sampling,
    num_agents: usize,
) -> Result<Vec<crate::config::AgentSetup>, Broken> {
    let entries = raw
        .model
        .agents
        .clone()
        .unwrap_or_else(|| vec![Default::default(); num_agents]);
    if algorithm == Algorithm::Maporl
        && let Some(i) = entries.iter().position(|e| e.has_overrides())
    {
        return Err((
            format!("model.agents[{i}]"),
            "sets per-agent sampling, learning rate or lora, which the maporl trainer does not read (it takes maporl.temperature, \
             maporl.learning_rate and maporl.lora for every agent); give model names only"
                .into(),
        ));
    }
    if algorithm == Algorithm::Maporl && raw.model.lora.is_some() {
        return Err(("model.lora".into(), "is read by the GRPO/MAGRPO trainer; the maporl trainer's adapters are set by maporl.lora".into()));
    }
    let mut setups = Vec::with_capacity(num_agents);
    for (i, e) in entries.iter().enumerate() {
        let key = |name: &str| format!("model.agents[{i}].{name}");
        let sampling = Sampling {
            temperature: e.temperature.unwrap_or(shared.temperature),
            top_p: e.top_p.unwrap_or(shared.top_p),
            top_k: e.top_k.unwrap_or(shared.top_k),
            max_new_tokens: e.max_new_tokens.unwrap_or(shared.max_new_tokens),
        };
        if !(sampling.temperature.is_finite() && sampling.temperature > 0.0) {
            return Err((
                key("temperature"),
                format!("must be positive, got {}", sampling.temperature),
            ));
        }
        if !(sampling.top_p > 0.0 && sampling.top_p <= 1.0) {
            return Err((
                key("top_p"),
                format!("must be in (0, 1], got {}", sampling.top_p),
            ));
        }
        if sampling.max_new_tokens == 0 || sampling.max_new_tokens >= raw.model.max_length {
            return Err((
                key("max_new_tokens"),
                format!(
                    "must be in [1, model.max_length = {}), got {}",
                    raw.model.max_length, sampling.max_new_tokens
                ),
            ));
        }
        let stop = e.stop.clone().unwrap_or_default();
        if stop.iter().any(String::is_empty) {
            return Err((
                key("stop"),
                "holds an empty string, which would end every completion at once".into(),
            ));
        }
        let learning_rate = e.learning_rate.unwrap_or(section.learning_rate);
        if !(learning_rate.is_finite() && learning_rate > 0.0) {
            return Err((
                key("learning_rate"),
                format!("must be a positive number, got {learning_rate}"),
            ));
        }
        let lora = match e.lora.as_ref().or(raw.model.lora.as_ref()) {
            Some(section) => {
                let config = section.to_model();
                let which = if e.lora.is_some() {
                    key("lora")
                } else {
                    "model.lora".to_string()
                };
                config.validate().map_err(|err| (which, err.to_string()))?;
                Some(config)
            }
            None => None,
        };
        setups.push(crate::config::AgentSetup {
            sampling,
            stop,
            learning_rate,
            lora,
        });
    }
    // One policy has one adapter (or none).
    if section.shared_parameters
        && let Some(j) = setups.iter().position(|s| s.lora != setups[0].lora)
    {
        return Err((
            format!("model.agents[{j}].lora"),
            format!(
                "differs from agent 0's: with {}.shared_parameters the agents train one policy, with one adapter",
                algorithm.section()
            ),
        ));
    }
    // Shared parameters are one policy with one optimiser.
    if section.shared_parameters
        && let Some(j) = setups
            .iter()
            .position(|s| s.learning_rate != setups[0].learning_rate)
    {
        // Name an entry that sets a rate of its own (agent 0's when only it does).
        let (i, other) = if entries[j].learning_rate.is_some() {
            (j, 0)
        } else {
            (0, j)
        };
        return Err((
            format!("model.agents[{i}].learning_rate"),
            format!(
                "is {} but agent {other}'s is {}: with {}.shared_parameters the agents train one policy with one learning rate",
                setups[i].learning_rate,
                setups[other].learning_rate,
                algorithm.section()
            ),
        ));
    }
    Ok(setups)
}

/// The dataset's kind and its train and eval splits.
pub(super) fn dataset(raw: &RawConfig) -> Result<(SplitSpec, Option<SplitSpec>), Broken> {
    let split = |key: &str, text: &str| {
        SplitSpec::parse(text).map_err(|e| (key.to_string(), format!("is invalid: {e}")))
    };
    let train_split = split("dataset.train_split", &raw.dataset.train_split)?;
    let eval_split = raw
        .dataset
        .eval_split
        .as_deref()
        .map(|t| split("dataset.eval_split", t))
        .transpose()?;
    let kind_key = if raw.dataset.kind.is_some() {
        "dataset.type"
    } else {
        "dataset.name"
    };
    DatasetKind::resolve(&raw.dataset).map_err(|e| (kind_key.to_string(), e))?;
    Ok((train_split, eval_split))
}

/// The rollout workers, the control plane and the reward server's addresses and options.
pub(super) fn services(raw: &RawConfig) -> Result<(), Broken> {
    for (i, e) in raw.rollout.endpoints.iter().enumerate() {
        if !(e.starts_with("http://") || e.starts_with("https://")) {
            return broken(
                format!("rollout.endpoints[{i}]"),
                format!("`{e}` must start with http:// or https://"),
            );
        }
    }
    if let Some(a) = &raw.learner.control_addr
        && a.parse::<std::net::SocketAddr>().is_err()
    {
        return broken(
            "learner.control_addr",
            format!("`{a}` must be IP:PORT, e.g. 127.0.0.1:7070 (0.0.0.0:7070 for other hosts)"),
        );
    }
    if raw.rollout.wait_for_registration && raw.learner.control_addr.is_none() {
        return broken(
            "rollout.wait_for_registration",
            "workers register with learner.control_addr, which is not set",
        );
    }
    if raw.rollout.bf16_dot_products {
        use crate::config::{Dtype, Precision};
        let bf16 = match raw.rollout.dtype {
            Precision::Bf16 => true,
            Precision::F32 => false,
            Precision::Auto => raw.model.dtype == Dtype::Bf16,
        };
        if !bf16 {
            return broken(
                "rollout.bf16_dot_products",
                "applies to bf16 rollouts only; set rollout.dtype: bf16",
            );
        }
    }
    if raw.rollout.min_workers == 0 {
        return broken("rollout.min_workers", "must be at least 1");
    }
    let outage = raw.reward.outage_timeout;
    if !(outage.is_finite() && outage >= 0.0) {
        return broken(
            "reward.outage_timeout",
            format!("must be a number of seconds >= 0, got {outage}"),
        );
    }
    if let Some(e) = &raw.reward.endpoint
        && !(e.starts_with("http://") || e.starts_with("https://"))
    {
        return broken(
            "reward.endpoint",
            format!("`{e}` must start with http:// or https://"),
        );
    }
    Ok(())
}

/// The reward server's scoring options as the run sends them.
pub(super) fn score_options(raw: &RawConfig) -> Result<ScoreOptions, Broken> {
    let mut options = raw.reward.options.clone();
    if let Some(v) = raw.reward.writing_ratio_version {
        options.arxiv_ratio = v;
    }
    // The single-agent writing split's random fallback is seeded by the run's seed unless set.
    if options.split_seed == 0 {
        options.split_seed = raw.seed;
    }
    if !(options.per_test_timeout_secs.is_finite() && options.per_test_timeout_secs > 0.0) {
        return broken(
            "reward.options.per_test_timeout_secs",
            format!("must be positive, got {}", options.per_test_timeout_secs),
        );
    }
    Ok(options)
}

/// Each agent's prompt template (`prompts.agent{i}`), if the config gives one.
pub(super) fn prompt_sources(
    raw: &RawConfig,
    num_agents: usize,
) -> Result<Vec<Option<PromptSource>>, Broken> {
    let mut sources = vec![None; num_agents];
    for (key, p) in &raw.prompts {
        let Some(agent) = key
            .strip_prefix("agent")
            .and_then(|i| i.parse::<usize>().ok())
            .filter(|&i| i < num_agents && key == &format!("agent{i}"))
        else {
            return broken(
                format!("prompts.{key}"),
                format!(
                    "is not an agent of this run (agent0 .. agent{})",
                    num_agents - 1
                ),
            );
        };
        sources[agent] = Some(match (&p.template, &p.template_file) {
            (Some(t), None) => PromptSource::Inline(t.clone()),
            (None, Some(f)) => PromptSource::File(f.clone()),
            _ => {
                return broken(
                    format!("prompts.{key}"),
                    "needs exactly one of template and template_file",
                );
            }
        });
    }
    Ok(sources)
}
