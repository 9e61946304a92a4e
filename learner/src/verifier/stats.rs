//! Held-out quality of a verifier's scores: accuracy at 0.5, ROC AUC, and calibration (expected
//! calibration error over equal-width bins, with the bins for a reliability plot).

/// ROC AUC (the probability that a random correct answer scores above a random incorrect one, ties
/// counting half), by the Mann–Whitney rank sum with average ranks for ties. `None` when one class
/// is absent.
pub fn auc(scores: &[f32], labels: &[f32]) -> Option<f64> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]));
    let mut ranks = vec![0.0; scores.len()];
    let mut i = 0;
    while i < idx.len() {
        let mut j = i;
        while j + 1 < idx.len() && scores[idx[j + 1]] == scores[idx[i]] {
            j += 1;
        }
        let avg = (i + j) as f64 / 2.0 + 1.0;
        for &k in &idx[i..=j] {
            ranks[k] = avg;
        }
        i = j + 1;
    }
    let pos = labels.iter().filter(|&&y| y > 0.5).count();
    let neg = labels.len() - pos;
    if pos == 0 || neg == 0 {
        return None;
    }
    let rank_sum: f64 = labels
        .iter()
        .zip(&ranks)
        .filter(|(y, _)| **y > 0.5)
        .map(|(_, r)| r)
        .sum();
    Some((rank_sum - (pos * (pos + 1)) as f64 / 2.0) / (pos * neg) as f64)
}

/// Fraction of answers whose score is on the label's side of 0.5.
pub fn accuracy(scores: &[f32], labels: &[f32]) -> f64 {
    let right = scores
        .iter()
        .zip(labels)
        .filter(|(s, y)| (**s >= 0.5) == (**y > 0.5))
        .count();
    right as f64 / scores.len().max(1) as f64
}

/// One calibration bin: how many answers, their mean score, the fraction correct.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bin {
    pub count: usize,
    pub mean_score: f64,
    pub fraction_correct: f64,
}

/// Equal-width bins over [0, 1] (a score of 1 falls in the last bin).
pub fn calibration_bins(scores: &[f32], labels: &[f32], bins: usize) -> Vec<Bin> {
    let mut acc = vec![(0usize, 0.0f64, 0.0f64); bins];
    for (s, y) in scores.iter().zip(labels) {
        let b = ((f64::from(*s) * bins as f64) as usize).min(bins - 1);
        acc[b].0 += 1;
        acc[b].1 += f64::from(*s);
        acc[b].2 += f64::from(*y);
    }
    acc.into_iter()
        .map(|(n, s, y)| Bin {
            count: n,
            mean_score: if n > 0 { s / n as f64 } else { 0.0 },
            fraction_correct: if n > 0 { y / n as f64 } else { 0.0 },
        })
        .collect()
}

/// Expected calibration error: Σ_bins (count / n) · |fraction correct − mean score|.
pub fn ece(scores: &[f32], labels: &[f32], bins: usize) -> f64 {
    let n = scores.len().max(1) as f64;
    calibration_bins(scores, labels, bins)
        .iter()
        .map(|b| b.count as f64 / n * (b.fraction_correct - b.mean_score).abs())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auc_counts_ordered_pairs_with_ties_as_half() {
        // Pairs (pos, neg): (0.9, 0.1) ✓, (0.9, 0.4) ✓, (0.4, 0.1) ✓, (0.4, 0.4) ½ → 3.5 / 4.
        let s = [0.9, 0.4, 0.1, 0.4];
        let y = [1.0, 1.0, 0.0, 0.0];
        assert!((auc(&s, &y).unwrap() - 0.875).abs() < 1e-12);
        assert_eq!(auc(&[0.1, 0.9], &[0.0, 1.0]), Some(1.0));
        assert_eq!(auc(&[0.9, 0.1], &[0.0, 1.0]), Some(0.0));
        assert_eq!(auc(&[0.3], &[1.0]), None);
    }

    #[test]
    fn accuracy_and_calibration_by_hand() {
        let s = [0.95, 0.85, 0.15, 0.55];
        let y = [1.0, 0.0, 0.0, 1.0];
        assert_eq!(accuracy(&s, &y), 0.75);
        // Bins of width 0.5: [0.15] → |0 − 0.15|; [0.95, 0.85, 0.55] → |2/3 − 0.7833|.
        let want = 0.25 * 0.15 + 0.75 * (2.0 / 3.0 - (0.95 + 0.85 + 0.55) / 3.0f64).abs();
        assert!((ece(&s, &y, 2) - want).abs() < 1e-6);
        let bins = calibration_bins(&[1.0], &[1.0], 10);
        assert_eq!(bins[9].count, 1);
    }
}
