//! Writing rewards: arXiv abstract expansion and TLDR summarisation, two agents or one agent
//! whose completion is split in two (rewards.md, "Writing tasks"). Maximum 3.0, levels gated.
//!
//! Measurements, as defined:
//! - tokens: whitespace-separated words (`str::split_whitespace`, Python's `str.split()`);
//! - ρ = characters of agent 2's text / characters of agent 1's (Unicode scalar values, as
//!   Python's `len`); the texts are used as given (two agents) or as trimmed parts (split);
//! - u = |unique words of agent 2| / |unique words of agent 1|, words = `\b\w+\b` of the
//!   lowercased text, stopwords included;
//! - J = Jaccard of the two word sets with the lexicon's 106 stopwords removed; both empty → 1.0;
//! - T: a transition category counts when one of its entries is a substring of the lowercased
//!   text; T = 0 for none, else min(0.4 + 0.05·(k − 1), 1.0). For arXiv, "both texts" means a
//!   category found in either text (each text searched separately, so no phrase is formed
//!   across the seam between them).

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::LazyLock;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use regex::Regex;
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::{RewardError, ScoreOptions, ScoreResult, TaskKind};

/// The arXiv length-ratio table in force: a scoring option, defined in `cotrain-proto` with the
/// other [`ScoreOptions`].
pub use cotrain_proto::reward_options::ArxivRatioVersion;

/// The word lists of the original writing rewards (`data/writing_lexicon`, see its SOURCE.md).
#[derive(Debug, Deserialize)]
pub struct Lexicon {
    pub stopwords: Vec<String>,
    pub transition_categories: BTreeMap<String, Vec<String>>,
}

/// The lexicon, parsed once from the copy compiled into the binary.
pub static LEXICON: LazyLock<Lexicon> = LazyLock::new(|| {
    serde_json::from_str(include_str!("../../data/writing_lexicon/lexicon.json"))
        .expect("the bundled writing lexicon is valid JSON")
});

static STOPWORDS: LazyLock<HashSet<&'static str>> =
    LazyLock::new(|| LEXICON.stopwords.iter().map(String::as_str).collect());

static WORD_RE: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"\b\w+\b").expect("valid regex"));

/// Marker between the two parts of a single-agent completion.
pub const SPLIT_MARKER: &str = "[PARAGRAPH_SPLIT]";
/// Fallback marker.
pub const PARAGRAPH_2_MARKER: &str = "Paragraph 2:";

/// Whitespace-separated tokens.
pub fn token_count(text: &str) -> usize {
    text.split_whitespace().count()
}

/// Length in characters.
pub fn char_len(text: &str) -> usize {
    text.chars().count()
}

/// The set of `\b\w+\b` words of the lowercased text.
pub fn word_set(text: &str) -> BTreeSet<String> {
    let lower = text.to_lowercase();
    WORD_RE
        .find_iter(&lower)
        .map(|m| m.as_str().to_string())
        .collect()
}

/// u, or `None` when agent 1 has no words.
pub fn unique_word_ratio(text1: &str, text2: &str) -> Option<f64> {
    let n1 = word_set(text1).len();
    (n1 > 0).then(|| word_set(text2).len() as f64 / n1 as f64)
}

/// Jaccard similarity of the stopword-free word sets (1.0 when both are empty).
pub fn jaccard(text1: &str, text2: &str) -> f64 {
    let strip = |t: &str| -> BTreeSet<String> {
        word_set(t)
            .into_iter()
            .filter(|w| !STOPWORDS.contains(w.as_str()))
            .collect()
    };
    let (a, b) = (strip(text1), strip(text2));
    let union = a.union(&b).count();
    if union == 0 {
        return 1.0;
    }
    a.intersection(&b).count() as f64 / union as f64
}

/// Names of the transition categories found in the texts (substring match, lowercased).
pub fn transition_categories(texts: &[&str]) -> Vec<String> {
    let lowered: Vec<String> = texts.iter().map(|t| t.to_lowercase()).collect();
    LEXICON
        .transition_categories
        .iter()
        .filter(|(_, entries)| {
            entries
                .iter()
                .any(|e| lowered.iter().any(|t| t.contains(e.as_str())))
        })
        .map(|(name, _)| name.clone())
        .collect()
}

/// T for k categories found.
pub fn transition_score(k: usize) -> f64 {
    if k == 0 {
        0.0
    } else {
        (0.4 + 0.05 * (k as f64 - 1.0)).min(1.0)
    }
}

/// Level 2 of arXiv: `None` = STOP.
pub fn arxiv_ratio_reward(rho: f64, version: ArxivRatioVersion) -> Option<f64> {
    match version {
        ArxivRatioVersion::Newest => {
            if (1.3..=1.6).contains(&rho) {
                Some(1.0)
            } else if (0.8..1.3).contains(&rho) {
                Some((rho - 0.8) / 0.5)
            } else if rho > 1.6 && rho <= 2.0 {
                Some(1.0 - (rho - 1.6) / 0.4)
            } else {
                None
            }
        }
        ArxivRatioVersion::Earlier => {
            if (1.0..=1.3).contains(&rho) {
                Some(1.0)
            } else if (0.8..1.0).contains(&rho) {
                Some((rho - 0.8) / 0.2)
            } else if rho > 1.3 && rho <= 1.5 {
                Some(1.0 - (rho - 1.3) / 0.2)
            } else {
                None
            }
        }
    }
}

/// Level 3 of arXiv: `None` = STOP.
pub fn arxiv_unique_reward(u: f64) -> Option<f64> {
    if (0.7..=1.3).contains(&u) {
        Some(0.5)
    } else if (0.5..0.7).contains(&u) {
        Some(0.5 * (u - 0.5) / 0.2)
    } else if u > 1.3 && u <= 1.7 {
        Some(0.5 * (1.0 - (u - 1.3) / 0.4))
    } else {
        None
    }
}

/// Level 2 of TLDR: `None` = STOP.
pub fn tldr_ratio_reward(rho: f64) -> Option<f64> {
    if (1.6..=3.2).contains(&rho) {
        Some(1.0)
    } else if (1.1..1.6).contains(&rho) {
        Some((rho - 1.1) / 0.5)
    } else if rho > 3.2 && rho <= 5.0 {
        Some(1.0 - (rho - 3.2) / 1.8)
    } else {
        None
    }
}

/// Level 3 of TLDR: `None` = STOP.
pub fn tldr_unique_reward(u: f64) -> Option<f64> {
    if u >= 2.0 {
        Some(0.5)
    } else if (1.3..2.0).contains(&u) {
        Some(0.5 * (u - 1.3) / 0.7)
    } else {
        None
    }
}

/// How a single-agent completion was split.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SplitMethod {
    Marker,
    Paragraph2,
    /// At character len/(1 + r), r ~ U(2, 3) from the seed.
    Random,
}

static PARAGRAPH_2_RE: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?i)Paragraph 2:\s*").expect("valid regex"));
static LEADING_P1_RE: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?i)^Paragraph 1:\s*").expect("valid regex"));
static LEADING_P2_RE: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?i)^Paragraph 2:\s*").expect("valid regex"));

/// Splits one completion into agent 1's and agent 2's parts, as the original's single-agent writing
/// reward does: the trimmed text at the first `[PARAGRAPH_SPLIT]`; else at the first
/// `Paragraph 2:` (any case, with the whitespace after it); else at character ⌊len/(1 + r)⌋ with r
/// drawn uniformly from [2, 3] (ChaCha8 seeded with `seed`). Both parts are trimmed, then a leading
/// `Paragraph 1:` / `Paragraph 2:` label (any case) is removed from each, so the labels the prompt
/// asks for are not scored as words.
pub fn split_single(text: &str, seed: u64) -> (String, String, SplitMethod) {
    let text = text.trim();
    let (a, b, method) = if let Some(p) = text.find(SPLIT_MARKER) {
        (
            &text[..p],
            &text[p + SPLIT_MARKER.len()..],
            SplitMethod::Marker,
        )
    } else if let Some(m) = PARAGRAPH_2_RE.find(text) {
        (
            &text[..m.start()],
            &text[m.end()..],
            SplitMethod::Paragraph2,
        )
    } else {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let r: f64 = rng.random_range(2.0..=3.0);
        let k = (char_len(text) as f64 / (1.0 + r)).floor() as usize;
        let byte = text.char_indices().nth(k).map_or(text.len(), |(b, _)| b);
        (&text[..byte], &text[byte..], SplitMethod::Random)
    };
    let a = LEADING_P1_RE.replace(a.trim(), "").to_string();
    let b = LEADING_P2_RE.replace(b.trim(), "").to_string();
    (a, b, method)
}

/// Scores arXiv or TLDR: two completions, or one that is split.
pub fn score(
    task: TaskKind,
    completions: &[String],
    opts: &ScoreOptions,
) -> Result<ScoreResult, RewardError> {
    match completions {
        [a, b] => Ok(score_pair(task, a, b, opts, None)),
        [one] => {
            let (a, b, method) = split_single(one, opts.split_seed);
            Ok(score_pair(task, &a, &b, opts, Some(method)))
        }
        _ => Err(RewardError::WrongCompletionCount {
            task,
            expected: "2 (one per agent) or 1 (single agent, split into two parts)",
            got: completions.len(),
        }),
    }
}

/// The two-part reward of `task` (arXiv or TLDR) for agent 1's and agent 2's texts.
pub fn score_pair(
    task: TaskKind,
    text1: &str,
    text2: &str,
    opts: &ScoreOptions,
    split: Option<SplitMethod>,
) -> ScoreResult {
    let arxiv = task == TaskKind::Arxiv;
    let (t1, t2) = (token_count(text1), token_count(text2));
    let (c1, c2) = (char_len(text1), char_len(text2));
    let (lo, hi) = if arxiv { (128, 256) } else { (8, 256) };
    let mut levels = [0.0f64; 4];
    let mut stopped_at: Option<&str> = None;
    let mut rho: Option<f64> = None;
    let mut u: Option<f64> = None;
    let mut j: Option<f64> = None;
    let mut cats: Vec<String> = Vec::new();
    let mut t_score: Option<f64> = None;

    'levels: {
        if !((lo..=hi).contains(&t1) && (lo..=hi).contains(&t2)) {
            stopped_at = Some("level_1");
            break 'levels;
        }
        levels[0] = 0.5;
        // Level 1 guarantees at least one token, so agent 1 has characters.
        let r = c2 as f64 / c1 as f64;
        rho = Some(r);
        let l2 = if arxiv {
            arxiv_ratio_reward(r, opts.arxiv_ratio)
        } else {
            tldr_ratio_reward(r)
        };
        let Some(l2) = l2 else {
            stopped_at = Some("level_2");
            break 'levels;
        };
        levels[1] = l2;
        u = unique_word_ratio(text1, text2);
        let l3 = u.and_then(|u| {
            if arxiv {
                arxiv_unique_reward(u)
            } else {
                tldr_unique_reward(u)
            }
        });
        let Some(l3) = l3 else {
            stopped_at = Some("level_3");
            break 'levels;
        };
        levels[2] = l3;
        let jv = jaccard(text1, text2);
        j = Some(jv);
        cats = if arxiv {
            transition_categories(&[text1, text2])
        } else {
            transition_categories(&[text2])
        };
        let t = transition_score(cats.len());
        t_score = Some(t);
        let cap = if arxiv { 0.23 } else { 0.03 };
        levels[3] = 0.4 * t + 0.6 * jv.min(cap) / cap;
    }

    let reward: f64 = levels.iter().sum();
    let levels_map: BTreeMap<String, f64> = levels
        .iter()
        .enumerate()
        .map(|(i, v)| (format!("level_{}", i + 1), *v))
        .collect();
    let details = json!({
        "task": task.as_str(),
        "arxiv_ratio": arxiv.then_some(opts.arxiv_ratio),
        "split": split,
        "tokens_1": t1,
        "tokens_2": t2,
        "chars_1": c1,
        "chars_2": c2,
        "length_ratio": rho,
        "unique_word_ratio": u,
        "jaccard": j,
        "transition_categories": cats,
        "transition_score": t_score,
        "stopped_at": stopped_at,
        "total": reward,
    });
    ScoreResult {
        reward,
        levels: levels_map,
        details,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lexicon_has_106_stopwords_and_12_categories() {
        assert_eq!(LEXICON.stopwords.len(), 106);
        assert_eq!(LEXICON.transition_categories.len(), 12);
    }

    #[test]
    fn newest_ratio_table_boundaries() {
        let f = |r| arxiv_ratio_reward(r, ArxivRatioVersion::Newest);
        assert_eq!(f(1.6), Some(1.0));
        assert_eq!(f(1.3), Some(1.0));
        // The ramps reach 0 at their outer ends without stopping (IEEE arithmetic of the same
        // formula may leave ~1e-16, exactly as the original's Python does).
        assert!(f(0.8).unwrap().abs() < 1e-12);
        assert!(f(2.0).unwrap().abs() < 1e-12);
        assert_eq!(f(0.79), None);
        assert_eq!(f(2.01), None);
        // (1.05 − 0.8)/0.5 = 0.5 ; 1 − (1.8 − 1.6)/0.4 = 0.5
        assert!((f(1.05).unwrap() - 0.5).abs() < 1e-12);
        assert!((f(1.8).unwrap() - 0.5).abs() < 1e-12);
    }

    #[test]
    fn earlier_ratio_table_boundaries() {
        let f = |r| arxiv_ratio_reward(r, ArxivRatioVersion::Earlier);
        assert_eq!(f(1.0), Some(1.0));
        assert_eq!(f(1.3), Some(1.0));
        assert!(f(1.5).unwrap().abs() < 1e-12);
        assert!(f(0.8).unwrap().abs() < 1e-12);
        assert_eq!(f(0.79), None);
        assert_eq!(f(1.6), None);
        // (0.9 − 0.8)/0.2 = 0.5 ; 1 − (1.4 − 1.3)/0.2 = 0.5
        assert!((f(0.9).unwrap() - 0.5).abs() < 1e-12);
        assert!((f(1.4).unwrap() - 0.5).abs() < 1e-12);
    }

    #[test]
    fn transition_score_formula() {
        assert_eq!(transition_score(0), 0.0);
        assert_eq!(transition_score(1), 0.4);
        // 0.4 + 0.05 * 11 = 0.95 for all 12 categories
        assert!((transition_score(12) - 0.95).abs() < 1e-12);
        assert_eq!(transition_score(20), 1.0);
    }

    #[test]
    fn jaccard_excludes_stopwords_and_both_empty_is_one() {
        assert_eq!(jaccard("the and of", "a the"), 1.0);
        // {cats, dogs} vs {cats, birds}: 1 / 3
        assert!((jaccard("The cats and the dogs", "cats, birds") - 1.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn split_prefers_marker_then_paragraph_two_then_seeded_random() {
        let (a, b, m) = split_single("one two [PARAGRAPH_SPLIT] three Paragraph 2: four", 0);
        assert_eq!(
            (a.as_str(), b.as_str(), m),
            ("one two", "three Paragraph 2: four", SplitMethod::Marker)
        );
        // Labels are matched in any case and stripped from both parts.
        let (a, b, m) = split_single("Paragraph 1: x\nparagraph 2:  y", 0);
        assert_eq!(
            (a.as_str(), b.as_str(), m),
            ("x", "y", SplitMethod::Paragraph2)
        );
        let (a, b, _) = split_single(" PARAGRAPH 1: x\n[PARAGRAPH_SPLIT]\nParagraph 2: y ", 0);
        assert_eq!((a.as_str(), b.as_str()), ("x", "y"));
        let text = "abcdefghij".repeat(10);
        let (a, b, m) = split_single(&text, 42);
        assert_eq!(m, SplitMethod::Random);
        // r in [2, 3] → split index in [100/4, 100/3] = [25, 33]
        assert!((25..=33).contains(&a.len()), "{}", a.len());
        assert_eq!(a.len() + b.len(), 100);
        assert_eq!(split_single(&text, 42), (a, b, m));
    }
}
