//! Reward processing and the four advantage modes over a node's G siblings.

use crate::config::{AdvantageMode, NormalizationForm, RewardProcessorConfig};

/// r ← scale_factor·r + shift (identity when disabled).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RewardProcessor {
    pub scale_factor: f64,
    pub shift: f64,
}

impl RewardProcessor {
    pub fn from_config(cfg: &RewardProcessorConfig) -> Self {
        if cfg.enabled {
            Self {
                scale_factor: cfg.scale_factor,
                shift: cfg.shift,
            }
        } else {
            Self::identity()
        }
    }
    pub fn identity() -> Self {
        Self {
            scale_factor: 1.0,
            shift: 0.0,
        }
    }
    pub fn apply(&self, r: f64) -> f64 {
        self.scale_factor * r + self.shift
    }
}

/// Added to the standard deviation by the [`NormalizationForm::Uncentred`] form.
pub const ADV_STD_EPS: f64 = 1e-8;
/// The floor of the standard deviation of the [`NormalizationForm::Centred`] form (CoMLRL 2026).
pub const ADV_STD_FLOOR: f64 = 1e-6;

/// Advantages of G sibling returns.
/// `mean`: A = R − mean(R); `rloo`: A = (G·R − ΣR)/(G − 1) (= R − mean of the others);
/// `max`: A = R − max(R); `raw`: A = R. `normalize` then rescales them:
/// - [`NormalizationForm::Centred`] (CoMLRL 2026, for G > 1): A ← (A − mean A) / max(std(A), 1e-6), std
///   with divisor G. Re-centring makes the four modes agree (rloo is a scaled `mean`).
/// - [`NormalizationForm::Uncentred`]: A ← A / (std(R) + 1e-8), std of the returns with divisor G − 1.
///
/// `clamp` limits A to [−c, c] last (the oldest release used 10).
pub fn advantages(
    returns: &[f64],
    mode: AdvantageMode,
    normalize: Option<NormalizationForm>,
    clamp: Option<f64>,
) -> Vec<f64> {
    let g = returns.len();
    if g == 0 {
        return Vec::new();
    }
    let sum: f64 = returns.iter().sum();
    let mean = sum / g as f64;
    let mut adv: Vec<f64> = match mode {
        AdvantageMode::Mean => returns.iter().map(|r| r - mean).collect(),
        // G = 1 has no leave-one-out baseline; the advantage is then 0 (no signal), never a division by 0.
        AdvantageMode::Rloo if g < 2 => vec![0.0; g],
        AdvantageMode::Rloo => returns
            .iter()
            .map(|r| (g as f64 * r - sum) / (g as f64 - 1.0))
            .collect(),
        AdvantageMode::Max => {
            let max = returns.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            returns.iter().map(|r| r - max).collect()
        }
        AdvantageMode::Raw => returns.to_vec(),
    };
    match normalize {
        None => {}
        Some(NormalizationForm::Centred) if g > 1 => {
            let m = adv.iter().sum::<f64>() / g as f64;
            let std = (adv.iter().map(|a| (a - m).powi(2)).sum::<f64>() / g as f64)
                .sqrt()
                .max(ADV_STD_FLOOR);
            for a in &mut adv {
                *a = (*a - m) / std;
            }
        }
        Some(NormalizationForm::Centred) => {}
        Some(NormalizationForm::Uncentred) => {
            let std = if g < 2 {
                0.0
            } else {
                (returns.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (g as f64 - 1.0)).sqrt()
            };
            for a in &mut adv {
                *a /= std + ADV_STD_EPS;
            }
        }
    }
    if let Some(c) = clamp {
        for a in &mut adv {
            *a = a.clamp(-c, c);
        }
    }
    adv
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[f64], b: &[f64]) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 1e-9, "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn the_four_modes_match_hand_computed_values() {
        // R = [1, 2, 3, 6]: ΣR = 12, mean 3, max 6.
        let r = [1.0, 2.0, 3.0, 6.0];
        close(
            &advantages(&r, AdvantageMode::Mean, None, None),
            &[-2.0, -1.0, 0.0, 3.0],
        );
        // (4·R − 12)/3 = [-8/3, -4/3, 0, 4]
        close(
            &advantages(&r, AdvantageMode::Rloo, None, None),
            &[-8.0 / 3.0, -4.0 / 3.0, 0.0, 4.0],
        );
        close(
            &advantages(&r, AdvantageMode::Max, None, None),
            &[-5.0, -4.0, -3.0, 0.0],
        );
        close(&advantages(&r, AdvantageMode::Raw, None, None), &r);
        // unbiased std = sqrt((4+1+0+9)/3) = sqrt(14/3)
        let s = (14.0f64 / 3.0).sqrt() + 1e-8;
        close(
            &advantages(
                &r,
                AdvantageMode::Mean,
                Some(NormalizationForm::Uncentred),
                None,
            ),
            &[-2.0 / s, -1.0 / s, 0.0, 3.0 / s],
        );
        close(
            &advantages(&r, AdvantageMode::Mean, None, Some(1.5)),
            &[-1.5, -1.0, 0.0, 1.5],
        );
    }

    #[test]
    fn equal_returns_normalise_to_zero_not_nan() {
        for form in [NormalizationForm::Centred, NormalizationForm::Uncentred] {
            let a = advantages(&[2.0, 2.0, 2.0], AdvantageMode::Mean, Some(form), None);
            assert!(a.iter().all(|x| *x == 0.0), "{form:?}");
        }
    }

    #[test]
    fn reward_processor_scales_then_shifts() {
        let p = RewardProcessor::from_config(&RewardProcessorConfig {
            enabled: true,
            scale_factor: 2.0,
            shift: -4.0,
        });
        assert_eq!(p.apply(3.0), 2.0);
        let off = RewardProcessor::from_config(&RewardProcessorConfig {
            enabled: false,
            scale_factor: 2.0,
            shift: -4.0,
        });
        assert_eq!(off.apply(3.0), 3.0);
    }
}
