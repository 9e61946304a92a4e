//! The trainer section's rules: lengths, sampling, the update's options, and the defaults of the
//! keys whose meaning changed between CoMLRL's releases.

use super::{Broken, DEFAULT_TOP_K, Keys, broken};
use crate::config::{Algorithm, BatchUnit, NormalizationForm, RawConfig, Sampling, TrainerSection};

/// The model, turns, epochs, learning rate, group size and completion length.
pub(super) fn generation_lengths(
    raw: &RawConfig,
    algorithm: Algorithm,
    section: &TrainerSection,
    k: Keys,
) -> Result<(), Broken> {
    if raw.model.name.trim().is_empty() {
        return broken("model.name", "must not be empty");
    }
    if section.num_turns == 0 {
        return broken(k.of("num_turns"), "must be at least 1");
    }
    if section.num_train_epochs == 0 {
        return broken(k.of("num_train_epochs"), "must be at least 1");
    }
    if !(section.learning_rate.is_finite() && section.learning_rate > 0.0) {
        return broken(
            k.of("learning_rate"),
            format!("must be a positive number, got {}", section.learning_rate),
        );
    }
    if algorithm.is_actor_critic() && section.num_generations == 0 {
        return broken(k.of("num_generations"), "must be at least 1");
    }
    if !algorithm.is_actor_critic() && algorithm != Algorithm::Maporl && section.num_generations < 2
    {
        return broken(
            k.of("num_generations"),
            format!(
                "is {} but advantages are taken over at least 2 siblings",
                section.num_generations
            ),
        );
    }
    if section.max_new_tokens == 0 {
        return broken(k.of("max_new_tokens"), "must be at least 1");
    }
    if section.max_new_tokens >= raw.model.max_length {
        return broken(
            k.of("max_new_tokens"),
            format!(
                "is {} but model.max_length is {}",
                section.max_new_tokens, raw.model.max_length
            ),
        );
    }
    Ok(())
}

/// The shared sampling: the trainer section's values over `model`'s.
pub(super) fn sampling(
    raw: &RawConfig,
    section: &TrainerSection,
    k: Keys,
) -> Result<Sampling, Broken> {
    let temperature = section.temperature.unwrap_or(raw.model.temperature);
    let top_p = section.top_p.unwrap_or(raw.model.top_p);
    let top_k = section.top_k.or(raw.model.top_k).unwrap_or(DEFAULT_TOP_K);
    let t_key = if section.temperature.is_some() {
        k.of("temperature")
    } else {
        "model.temperature".into()
    };
    if !(temperature.is_finite() && temperature > 0.0) {
        return broken(t_key, format!("must be positive, got {temperature}"));
    }
    let p_key = if section.top_p.is_some() {
        k.of("top_p")
    } else {
        "model.top_p".into()
    };
    if !(top_p > 0.0 && top_p <= 1.0) {
        return broken(p_key, format!("must be in (0, 1], got {top_p}"));
    }
    Ok(Sampling {
        temperature,
        top_p,
        top_k,
        max_new_tokens: section.max_new_tokens,
    })
}

/// Returns, batches, clipping, the reference KL, the optimiser and the reward processor; returns
/// the per-turn gradient weights.
pub(super) fn update_rules(
    raw: &RawConfig,
    section: &TrainerSection,
    k: Keys,
) -> Result<Vec<f64>, Broken> {
    if !(0.0..=1.0).contains(&section.discount) {
        return broken(
            k.of("discount"),
            format!("must be in [0, 1], got {}", section.discount),
        );
    }
    if section.rollout_buffer_size == 0 {
        return broken(k.of("rollout_buffer_size"), "must be at least 1");
    }
    if section.train_batch_size == Some(0) {
        return broken(k.of("train_batch_size"), "must be at least 1");
    }
    if section.logging_steps == 0 {
        return broken(k.of("logging_steps"), "must be at least 1");
    }
    let turn_gradient_weights = match &section.turn_gradient_weights {
        None => vec![1.0; section.num_turns],
        Some(w) => {
            if w.len() != section.num_turns {
                return broken(
                    k.of("turn_gradient_weights"),
                    format!(
                        "has {} values but {} is {}",
                        w.len(),
                        k.of("num_turns"),
                        section.num_turns
                    ),
                );
            }
            if let Some(bad) = w.iter().find(|x| !x.is_finite() || **x < 0.0) {
                return broken(
                    k.of("turn_gradient_weights"),
                    format!("must be finite and >= 0, got {bad}"),
                );
            }
            w.clone()
        }
    };
    if !(section.early_termination_weight.is_finite() && section.early_termination_weight > 0.0) {
        return broken(k.of("early_termination_weight"), "must be positive");
    }
    if let Some(c) = section.advantage_clamp
        && !(c.is_finite() && c > 0.0)
    {
        return broken(
            k.of("advantage_clamp"),
            format!("must be positive, got {c}"),
        );
    }
    let ppo = &section.ppo_clip;
    if ppo.epochs == 0 {
        return broken(k.of("ppo_clip.epochs"), "must be at least 1");
    }
    if !(0.0..1.0).contains(&ppo.clip_low) {
        return broken(
            k.of("ppo_clip.clip_low"),
            format!("must be in [0, 1), got {}", ppo.clip_low),
        );
    }
    if !(ppo.clip_high.is_finite() && ppo.clip_high >= 0.0) {
        return broken(
            k.of("ppo_clip.clip_high"),
            format!("must be >= 0, got {}", ppo.clip_high),
        );
    }
    if ppo.epochs > 1 && !ppo.enabled {
        return broken(
            k.of("ppo_clip.epochs"),
            format!(
                "is {} but several passes over the same samples need ppo_clip.enabled: true",
                ppo.epochs
            ),
        );
    }
    let kl = &section.reference_kl;
    if !(kl.coef.is_finite() && kl.coef >= 0.0) {
        return broken(
            k.of("reference_kl.coef"),
            format!("must be >= 0, got {}", kl.coef),
        );
    }
    if let Some(g) = section.max_grad_norm
        && !(g.is_finite() && g > 0.0)
    {
        return broken(k.of("max_grad_norm"), format!("must be positive, got {g}"));
    }
    if !(section.weight_decay.is_finite() && section.weight_decay >= 0.0) {
        return broken(
            k.of("weight_decay"),
            format!("must be >= 0, got {}", section.weight_decay),
        );
    }
    let rp = &raw.reward_processor;
    if !rp.scale_factor.is_finite() || !rp.shift.is_finite() {
        return broken("reward_processor", "scale_factor and shift must be finite");
    }
    Ok(turn_gradient_weights)
}

/// The trainer section as the trainers read it: the agent count resolved, and the keys whose
/// meaning changed between CoMLRL's releases defaulting to the config's own era.
pub(super) fn with_era_defaults(
    mut trainer: TrainerSection,
    raw: &RawConfig,
    num_agents: usize,
) -> TrainerSection {
    trainer.num_agents = Some(num_agents);
    let new_era = raw.era() == crate::config::Era::Comlrl2026;
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
    trainer
}
