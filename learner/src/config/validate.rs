//! The validation step: typed raw config → [`CheckedConfig`], with every rule the trainers rely on.

use std::path::Path;

use super::{
    Algorithm, BatchUnit, CheckedConfig, ConfigError, NormalizationForm, RawConfig, Sampling,
};
use crate::data::{DatasetKind, SplitSpec};

/// The original generation default when `top_k` is unset anywhere.
const DEFAULT_TOP_K: u32 = 50;

pub(super) fn check(raw: RawConfig, source: &Path) -> Result<CheckedConfig, ConfigError> {
    let file = source.display().to_string();
    let invalid = |key: &str, message: String| ConfigError::Invalid {
        file: file.clone(),
        key: key.to_string(),
        message,
    };

    let present: Vec<&str> = [
        ("magrpo", raw.magrpo.is_some()),
        ("grpo", raw.grpo.is_some()),
        ("maporl", raw.maporl.is_some()),
        ("iac", raw.iac.is_some()),
        ("maac", raw.maac.is_some()),
    ]
    .iter()
    .filter(|(_, p)| *p)
    .map(|(n, _)| *n)
    .collect();
    if present.len() > 1 {
        return Err(invalid(
            present[0],
            format!(
                "and {} are both present; keep exactly one trainer section",
                present[1..].join(" and ")
            ),
        ));
    }
    let (algorithm, section) = match present.first().copied() {
        Some("magrpo") => (Algorithm::Magrpo, raw.magrpo.clone().expect("present")),
        Some("grpo") => (Algorithm::Grpo, raw.grpo.clone().expect("present")),
        Some("maporl") => {
            let m = raw.maporl.as_ref().expect("present");
            m.check().map_err(|(key, message)| invalid(&key, message))?;
            (Algorithm::Maporl, m.trainer_view())
        }
        Some("iac") => (Algorithm::Iac, raw.iac.clone().expect("present")),
        Some("maac") => (Algorithm::Maac, raw.maac.clone().expect("present")),
        _ => {
            return Err(ConfigError::MissingKey {
                file: file.clone(),
                key: "magrpo (or grpo, maporl, iac, maac)".into(),
            });
        }
    };
    if !algorithm.is_actor_critic() {
        if let Some(key) = super::actor_critic::critic_key_set(&section) {
            return Err(invalid(
                &format!("{}.{key}", algorithm.section()),
                "is a key of the actor-critic trainers (iac, maac)".into(),
            ));
        }
        if raw.critic_model.is_some() || raw.critics.is_some() {
            let key = if raw.critics.is_some() {
                "critics"
            } else {
                "critic_model"
            };
            return Err(invalid(
                key,
                format!(
                    "names critics, which only the iac and maac trainers train ({} takes none)",
                    algorithm.section()
                ),
            ));
        }
    }
    if raw.output.save_total_limit == Some(0) {
        return Err(invalid(
            "output.save_total_limit",
            "must be at least 1 (unset keeps every checkpoint)".into(),
        ));
    }
    let s = algorithm.section();
    // The maporl section spells some shared keys as MaPoRL does.
    let k = |name: &str| {
        let name = match (algorithm, name) {
            (Algorithm::Maporl, "num_agents") => "agent_num",
            (Algorithm::Maporl, "num_turns") => "round_num",
            (Algorithm::Maporl, "max_new_tokens") => "max_output_length",
            _ => name,
        };
        format!("{s}.{name}")
    };

    let num_agents = match (algorithm, section.num_agents) {
        (Algorithm::Grpo, None | Some(1)) => 1,
        (Algorithm::Grpo, Some(n)) => {
            return Err(invalid(
                &k("num_agents"),
                format!("is {n} but grpo trains one agent (use a magrpo section)"),
            ));
        }
        (Algorithm::Magrpo, None) => 2,
        (Algorithm::Magrpo, Some(0)) => {
            return Err(invalid(&k("num_agents"), "must be at least 1".into()));
        }
        (Algorithm::Magrpo, Some(n)) => n,
        (Algorithm::Maporl, n) => n.unwrap_or(2),
        (Algorithm::Iac | Algorithm::Maac, None) => 2,
        (Algorithm::Iac | Algorithm::Maac, Some(0)) => {
            return Err(invalid(&k("num_agents"), "must be at least 1".into()));
        }
        (Algorithm::Iac | Algorithm::Maac, Some(n)) => n,
    };

    if let Some(v) = &raw.verifier
        && let Err((key, message)) = v.validate()
    {
        return Err(invalid(&format!("verifier.{key}"), message));
    }
    if raw.model.name.trim().is_empty() {
        return Err(invalid("model.name", "must not be empty".into()));
    }
    if section.num_turns == 0 {
        return Err(invalid(&k("num_turns"), "must be at least 1".into()));
    }
    if section.num_train_epochs == 0 {
        return Err(invalid(&k("num_train_epochs"), "must be at least 1".into()));
    }
    if !(section.learning_rate.is_finite() && section.learning_rate > 0.0) {
        return Err(invalid(
            &k("learning_rate"),
            format!("must be a positive number, got {}", section.learning_rate),
        ));
    }
    if algorithm.is_actor_critic() && section.num_generations == 0 {
        return Err(invalid(&k("num_generations"), "must be at least 1".into()));
    }
    if !algorithm.is_actor_critic() && algorithm != Algorithm::Maporl && section.num_generations < 2
    {
        return Err(invalid(
            &k("num_generations"),
            format!(
                "is {} but advantages are taken over at least 2 siblings",
                section.num_generations
            ),
        ));
    }
    if section.max_new_tokens == 0 {
        return Err(invalid(&k("max_new_tokens"), "must be at least 1".into()));
    }
    if section.max_new_tokens >= raw.model.max_length {
        return Err(invalid(
            &k("max_new_tokens"),
            format!(
                "is {} but model.max_length is {}",
                section.max_new_tokens, raw.model.max_length
            ),
        ));
    }

    let temperature = section.temperature.unwrap_or(raw.model.temperature);
    let top_p = section.top_p.unwrap_or(raw.model.top_p);
    let top_k = section.top_k.or(raw.model.top_k).unwrap_or(DEFAULT_TOP_K);
    let t_key = if section.temperature.is_some() {
        k("temperature")
    } else {
        "model.temperature".into()
    };
    if !(temperature.is_finite() && temperature > 0.0) {
        return Err(invalid(
            &t_key,
            format!("must be positive, got {temperature}"),
        ));
    }
    let p_key = if section.top_p.is_some() {
        k("top_p")
    } else {
        "model.top_p".into()
    };
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(invalid(&p_key, format!("must be in (0, 1], got {top_p}")));
    }
    if !(0.0..=1.0).contains(&section.discount) {
        return Err(invalid(
            &k("discount"),
            format!("must be in [0, 1], got {}", section.discount),
        ));
    }
    if section.rollout_buffer_size == 0 {
        return Err(invalid(
            &k("rollout_buffer_size"),
            "must be at least 1".into(),
        ));
    }
    if section.train_batch_size == Some(0) {
        return Err(invalid(&k("train_batch_size"), "must be at least 1".into()));
    }
    if section.logging_steps == 0 {
        return Err(invalid(&k("logging_steps"), "must be at least 1".into()));
    }
    let turn_gradient_weights = match &section.turn_gradient_weights {
        None => vec![1.0; section.num_turns],
        Some(w) => {
            if w.len() != section.num_turns {
                return Err(invalid(
                    &k("turn_gradient_weights"),
                    format!(
                        "has {} values but {} is {}",
                        w.len(),
                        k("num_turns"),
                        section.num_turns
                    ),
                ));
            }
            if let Some(bad) = w.iter().find(|x| !x.is_finite() || **x < 0.0) {
                return Err(invalid(
                    &k("turn_gradient_weights"),
                    format!("must be finite and >= 0, got {bad}"),
                ));
            }
            w.clone()
        }
    };
    if !(section.early_termination_weight.is_finite() && section.early_termination_weight > 0.0) {
        return Err(invalid(
            &k("early_termination_weight"),
            "must be positive".into(),
        ));
    }
    if let Some(c) = section.advantage_clamp
        && !(c.is_finite() && c > 0.0)
    {
        return Err(invalid(
            &k("advantage_clamp"),
            format!("must be positive, got {c}"),
        ));
    }
    let ppo = &section.ppo_clip;
    if ppo.epochs == 0 {
        return Err(invalid(&k("ppo_clip.epochs"), "must be at least 1".into()));
    }
    if !(0.0..1.0).contains(&ppo.clip_low) {
        return Err(invalid(
            &k("ppo_clip.clip_low"),
            format!("must be in [0, 1), got {}", ppo.clip_low),
        ));
    }
    if !(ppo.clip_high.is_finite() && ppo.clip_high >= 0.0) {
        return Err(invalid(
            &k("ppo_clip.clip_high"),
            format!("must be >= 0, got {}", ppo.clip_high),
        ));
    }
    if ppo.epochs > 1 && !ppo.enabled {
        return Err(invalid(
            &k("ppo_clip.epochs"),
            format!(
                "is {} but several passes over the same samples need ppo_clip.enabled: true",
                ppo.epochs
            ),
        ));
    }
    let kl = &section.reference_kl;
    if !(kl.coef.is_finite() && kl.coef >= 0.0) {
        return Err(invalid(
            &k("reference_kl.coef"),
            format!("must be >= 0, got {}", kl.coef),
        ));
    }
    if let Some(g) = section.max_grad_norm
        && !(g.is_finite() && g > 0.0)
    {
        return Err(invalid(
            &k("max_grad_norm"),
            format!("must be positive, got {g}"),
        ));
    }
    if !(section.weight_decay.is_finite() && section.weight_decay >= 0.0) {
        return Err(invalid(
            &k("weight_decay"),
            format!("must be >= 0, got {}", section.weight_decay),
        ));
    }
    let rp = &raw.reward_processor;
    if !rp.scale_factor.is_finite() || !rp.shift.is_finite() {
        return Err(invalid(
            "reward_processor",
            "scale_factor and shift must be finite".into(),
        ));
    }

    let agent_models = match &raw.model.agents {
        None => vec![raw.model.name.clone(); num_agents],
        Some(list) => {
            if list.len() != num_agents {
                return Err(invalid(
                    "model.agents",
                    format!(
                        "has {} entries but {} is {num_agents}",
                        list.len(),
                        k("num_agents")
                    ),
                ));
            }
            list.iter()
                .map(|a| a.name.clone().unwrap_or_else(|| raw.model.name.clone()))
                .collect()
        }
    };
    let shared = Sampling {
        temperature,
        top_p,
        top_k,
        max_new_tokens: section.max_new_tokens,
    };
    let agents = agent_setups(&raw, algorithm, &section, shared, num_agents)
        .map_err(|(key, message)| invalid(&key, message))?;
    if section.shared_parameters && agent_models.iter().any(|m| m != &agent_models[0]) {
        return Err(invalid(
            &k("shared_parameters"),
            "is true but model.agents names different base models; shared agents need one model"
                .into(),
        ));
    }

    let actor_critic = if algorithm.is_actor_critic() {
        Some(
            super::actor_critic::resolve(&raw, algorithm, &section, &agent_models)
                .map_err(|(key, message)| invalid(&key, message))?,
        )
    } else {
        None
    };

    let split = |key: &str, text: &str| {
        SplitSpec::parse(text).map_err(|e| ConfigError::Invalid {
            file: file.clone(),
            key: key.into(),
            message: format!("is invalid: {e}"),
        })
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
    DatasetKind::resolve(&raw.dataset).map_err(|e| invalid(kind_key, e))?;

    for (i, e) in raw.rollout.endpoints.iter().enumerate() {
        if !(e.starts_with("http://") || e.starts_with("https://")) {
            return Err(invalid(
                &format!("rollout.endpoints[{i}]"),
                format!("`{e}` must start with http:// or https://"),
            ));
        }
    }
    if let Some(a) = &raw.learner.control_addr
        && a.parse::<std::net::SocketAddr>().is_err()
    {
        return Err(invalid(
            "learner.control_addr",
            format!("`{a}` must be IP:PORT, e.g. 127.0.0.1:7070 (0.0.0.0:7070 for other hosts)"),
        ));
    }
    if raw.rollout.wait_for_registration && raw.learner.control_addr.is_none() {
        return Err(invalid(
            "rollout.wait_for_registration",
            "workers register with learner.control_addr, which is not set".to_string(),
        ));
    }
    if raw.rollout.bf16_dot_products {
        use super::schema::{Dtype, Precision};
        let bf16 = match raw.rollout.dtype {
            Precision::Bf16 => true,
            Precision::F32 => false,
            Precision::Auto => raw.model.dtype == Dtype::Bf16,
        };
        if !bf16 {
            return Err(invalid(
                "rollout.bf16_dot_products",
                "applies to bf16 rollouts only; set rollout.dtype: bf16".to_string(),
            ));
        }
    }
    if raw.rollout.min_workers == 0 {
        return Err(invalid(
            "rollout.min_workers",
            "must be at least 1".to_string(),
        ));
    }
    if let Some(e) = &raw.reward.endpoint
        && !(e.starts_with("http://") || e.starts_with("https://"))
    {
        return Err(invalid(
            "reward.endpoint",
            format!("`{e}` must start with http:// or https://"),
        ));
    }

    let mut score_options = raw.reward.options.clone();
    if let Some(v) = raw.reward.writing_ratio_version {
        score_options.arxiv_ratio = v;
    }
    // The single-agent writing split's random fallback is seeded by the run's seed unless set.
    if score_options.split_seed == 0 {
        score_options.split_seed = raw.seed;
    }
    if !(score_options.per_test_timeout_secs.is_finite()
        && score_options.per_test_timeout_secs > 0.0)
    {
        return Err(invalid(
            "reward.options.per_test_timeout_secs",
            format!(
                "must be positive, got {}",
                score_options.per_test_timeout_secs
            ),
        ));
    }

    let mut prompt_sources = vec![None; num_agents];
    for (key, p) in &raw.prompts {
        let agent = key
            .strip_prefix("agent")
            .and_then(|i| i.parse::<usize>().ok())
            .filter(|&i| i < num_agents && key == &format!("agent{i}"))
            .ok_or_else(|| {
                invalid(
                    &format!("prompts.{key}"),
                    format!(
                        "is not an agent of this run (agent0 .. agent{})",
                        num_agents - 1
                    ),
                )
            })?;
        prompt_sources[agent] = Some(match (&p.template, &p.template_file) {
            (Some(t), None) => super::PromptSource::Inline(t.clone()),
            (None, Some(f)) => super::PromptSource::File(f.clone()),
            _ => {
                return Err(invalid(
                    &format!("prompts.{key}"),
                    "needs exactly one of template and template_file".into(),
                ));
            }
        });
    }

    let mut trainer = section;
    trainer.num_agents = Some(num_agents);
    // The keys whose meaning changed between CoMLRL's releases default to the config's own era.
    let new_era = raw.era() == super::Era::Comlrl2026;
    trainer
        .advantage_normalization_form
        .get_or_insert(if new_era {
            NormalizationForm::Centred
        } else {
            NormalizationForm::Uncentred
        });
    trainer.train_batch_unit.get_or_insert(if new_era {
        BatchUnit::Nodes
    } else {
        BatchUnit::Completions
    });
    trainer.eval_all_turns.get_or_insert(new_era);
    trainer.train_between_items.get_or_insert(new_era);
    Ok(CheckedConfig {
        prompt_sources,
        score_options,
        source: source.to_path_buf(),
        sampling: shared,
        agents,
        raw,
        algorithm,
        trainer,
        num_agents,
        turn_gradient_weights,
        agent_models,
        train_split,
        eval_split,
        actor_critic,
    })
}

/// Each agent's settings: its `model.agents[i]` entry, every key it leaves out taken from `shared`
/// and the trainer section. Errors are (key, message).
fn agent_setups(
    raw: &RawConfig,
    algorithm: Algorithm,
    section: &super::TrainerSection,
    shared: Sampling,
    num_agents: usize,
) -> Result<Vec<super::AgentSetup>, (String, String)> {
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
        setups.push(super::AgentSetup {
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
