//! The resolved settings of CoMLRL's actor-critic trainers (`iac`, `maac`; comlrl 1.4.3's
//! `IACConfig`/`MAACConfig` and the experiment scripts that fill them), checked once here.

use super::{Algorithm, CriticType, RawConfig, TrainerSection};

/// Upstream's `value_loss_coef` default.
const DEFAULT_VALUE_LOSS_COEF: f64 = 0.6;

/// What an `iac` / `maac` run trains its critics with.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ActorCriticSetup {
    /// IAC: one critic per agent, on that agent's prompt; MAAC: one critic on every agent's.
    pub centralised: bool,
    pub critic_type: CriticType,
    /// IAC with `use_separate_critic: false`: a value head on each actor, trained with it.
    pub value_head_on_actor: bool,
    /// The value clip ε of a value head on the actor (`value_clip_range`; upstream ignores it
    /// with separate critics).
    pub value_clip: Option<f64>,
    /// The model each separate critic starts from: one per agent (IAC) or one (MAAC); empty with
    /// value heads on the actors.
    pub critic_models: Vec<String>,
    pub critic_learning_rate: f64,
    pub value_loss_coef: f64,
    /// Width of the value head's hidden layer (`None`: one Linear).
    pub head_hidden: Option<usize>,
}

/// Resolves and checks the critic keys of `section` (`algorithm` is `iac` or `maac`), as
/// `(key, message)` on failure. `agent_models` is each agent's model.
pub(super) fn resolve(
    raw: &RawConfig,
    algorithm: Algorithm,
    section: &TrainerSection,
    agent_models: &[String],
) -> Result<ActorCriticSetup, (String, String)> {
    let s = algorithm.section();
    let bad = |k: &str, m: String| Err((format!("{s}.{k}"), m));
    if section.num_turns > 1 && section.num_generations != 1 {
        return bad(
            "num_generations",
            format!(
                "is {} but a multi-turn actor-critic run follows one chain per item (upstream requires 1)",
                section.num_generations
            ),
        );
    }
    if section.rollout != super::MultiTurnMode::Tree {
        return bad("rollout", "is handoff; the actor-critic trainers continue each item's one chain (tree with one sample per agent)".into());
    }
    if section.joint_mode != super::JointMode::Aligned {
        return bad("joint_mode", "is cross; the actor-critic trainers pair the agents' completions as upstream (aligned)".into());
    }
    if section.shared_parameters {
        return bad(
            "shared_parameters",
            "is true; the actor-critic trainers give every agent its own actor".into(),
        );
    }
    if section.ppo_clip.enabled {
        return bad(
            "ppo_clip.enabled",
            "is true; the actor-critic trainers take one plain policy-gradient pass (no ratio)"
                .into(),
        );
    }
    if section.reference_kl.enabled && section.reference_kl.placement == super::KlPlacement::Loss {
        return bad("reference_kl.placement", "is loss; the actor-critic trainers shape the rewards with the reference KL (placement: returns)".into());
    }
    let value_head_on_actor = section.use_separate_critic == Some(false);
    if value_head_on_actor && (raw.critic_model.is_some() || raw.critics.is_some()) {
        let key = if raw.critics.is_some() {
            "critics"
        } else {
            "critic_model"
        };
        return Err((
            key.into(),
            format!(
                "names a critic model, but {s}.use_separate_critic is false (a value head on each actor); upstream refuses this too"
            ),
        ));
    }
    if algorithm == Algorithm::Maac {
        for key in [
            "use_separate_critic",
            "value_clip_range",
            "value_head_hidden_dim",
        ] {
            let set = match key {
                "use_separate_critic" => section.use_separate_critic.is_some(),
                "value_clip_range" => section.value_clip_range.is_some(),
                _ => section.value_head_hidden_dim.is_some(),
            };
            if set {
                return bad(
                    key,
                    "is an iac key; maac has one separate, centralised critic".into(),
                );
            }
        }
    }
    // MAGRPO's options with no actor-critic meaning are refused rather than ignored.
    if section.turn_gradient_weights.is_some() {
        return bad(
            "turn_gradient_weights",
            "weighs MAGRPO's tree turns; the actor-critic trainers weigh every sample alike".into(),
        );
    }
    if section.early_termination_weight != 2.0 {
        return bad("early_termination_weight", "weighs MAGRPO's early-stopped nodes; the actor-critic trainers weigh every sample alike".into());
    }
    if section.advantage_mode != super::AdvantageMode::Mean || section.advantage_clamp.is_some() {
        let key = if section.advantage_clamp.is_some() {
            "advantage_clamp"
        } else {
            "advantage_mode"
        };
        return bad(key, "shapes MAGRPO's group baseline; the actor-critic trainers' advantage is the TD error y − V".into());
    }
    if section.max_grad_norm.is_some() {
        return bad("max_grad_norm", "clips gradients, which upstream's actor-critic trainers never do (and cotrain's critics would not)".into());
    }
    let critic_learning_rate = section
        .critic_learning_rate
        .unwrap_or(section.learning_rate);
    if !(critic_learning_rate.is_finite() && critic_learning_rate > 0.0) {
        return bad(
            "critic_learning_rate",
            format!("must be positive, got {critic_learning_rate}"),
        );
    }
    let value_loss_coef = section.value_loss_coef.unwrap_or(DEFAULT_VALUE_LOSS_COEF);
    if !(value_loss_coef.is_finite() && value_loss_coef >= 0.0) {
        return bad(
            "value_loss_coef",
            format!("must be >= 0, got {value_loss_coef}"),
        );
    }
    if let Some(c) = section.value_clip_range
        && !(c.is_finite() && c > 0.0)
    {
        return bad("value_clip_range", format!("must be positive, got {c}"));
    }
    let centralised = algorithm == Algorithm::Maac;
    let wanted = if centralised { 1 } else { agent_models.len() };
    let critic_models = match (&raw.critics, &raw.critic_model) {
        _ if value_head_on_actor => Vec::new(),
        (Some(_), Some(_)) => {
            return Err((
                "critics".into(),
                "and critic_model are both present; keep one".into(),
            ));
        }
        (Some(list), None) if list.len() == wanted => list.clone(),
        (Some(list), None) if list.len() == 1 => vec![list[0].clone(); wanted],
        (Some(list), None) => {
            return Err((
                "critics".into(),
                format!(
                    "has {} entries; {s} trains {wanted} critic{}",
                    list.len(),
                    if wanted == 1 { "" } else { "s" }
                ),
            ));
        }
        (None, Some(m)) => vec![m.name.clone(); wanted],
        // Each critic starts from its agent's model (MAAC: agent 0's, whose tokenizer reads the
        // joint prompt upstream); upstream asks for one of the two keys.
        (None, None) => agent_models[..wanted].to_vec(),
    };
    if critic_models.iter().any(|m| m.trim().is_empty()) {
        return Err(("critic_model.name".into(), "must not be empty".into()));
    }
    Ok(ActorCriticSetup {
        centralised,
        critic_type: section.critic_type.unwrap_or_default(),
        value_head_on_actor,
        value_clip: section.value_clip_range,
        critic_models,
        critic_learning_rate,
        value_loss_coef,
        head_hidden: if value_head_on_actor {
            section.value_head_hidden_dim
        } else {
            section.critic_value_head_hidden_dim
        }
        .filter(|&d| d > 0),
    })
}

/// The critic keys a `magrpo`/`grpo` section must not set, for a message naming the first.
pub(super) fn critic_key_set(section: &TrainerSection) -> Option<&'static str> {
    [
        (
            "critic_learning_rate",
            section.critic_learning_rate.is_some(),
        ),
        ("value_loss_coef", section.value_loss_coef.is_some()),
        ("value_clip_range", section.value_clip_range.is_some()),
        ("use_separate_critic", section.use_separate_critic.is_some()),
        ("critic_type", section.critic_type.is_some()),
        (
            "critic_value_head_hidden_dim",
            section.critic_value_head_hidden_dim.is_some(),
        ),
        (
            "value_head_hidden_dim",
            section.value_head_hidden_dim.is_some(),
        ),
    ]
    .into_iter()
    .find(|(_, set)| *set)
    .map(|(k, _)| k)
}
