//! Writing rewards: every level, boundary and stop of arXiv (both ratio tables) and TLDR.
//!
//! Texts are built from synthetic words that contain no stopword and no transition entry:
//! `q000`..`q999` (4 characters) and `q0000`.. (5 characters), so a text of n4 four-letter and
//! n5 five-letter tokens has n4 + n5 tokens and 4·n4 + 5·n5 + (n4 + n5 − 1) characters.

use cotrain_reward_server::rewards::writing::{self, ArxivRatioVersion, SplitMethod};
use cotrain_reward_server::rewards::{ScoreOptions, ScoreResult, TaskKind};

fn text(four: impl IntoIterator<Item = usize>, five: impl IntoIterator<Item = usize>) -> String {
    let mut words: Vec<String> = four.into_iter().map(|i| format!("q{i:03}")).collect();
    words.extend(five.into_iter().map(|i| format!("q{i:04}")));
    words.join(" ")
}

fn none() -> std::iter::Empty<usize> {
    std::iter::empty()
}

fn score(task: TaskKind, t1: &str, t2: &str, version: ArxivRatioVersion) -> ScoreResult {
    let opts = ScoreOptions {
        arxiv_ratio: version,
        ..ScoreOptions::default()
    };
    writing::score(task, &[t1.to_string(), t2.to_string()], &opts).expect("scored")
}

fn tldr(t1: &str, t2: &str) -> ScoreResult {
    score(TaskKind::Tldr, t1, t2, ArxivRatioVersion::Newest)
}

fn arxiv(t1: &str, t2: &str) -> ScoreResult {
    score(TaskKind::Arxiv, t1, t2, ArxivRatioVersion::Newest)
}

fn arxiv_earlier(t1: &str, t2: &str) -> ScoreResult {
    score(TaskKind::Arxiv, t1, t2, ArxivRatioVersion::Earlier)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[track_caller]
fn assert_reward(r: &ScoreResult, expected: f64, stopped_at: Option<&str>) {
    assert!(
        close(r.reward, expected),
        "reward {} != {expected}: {}",
        r.reward,
        r.details
    );
    assert_eq!(
        r.details["stopped_at"].as_str(),
        stopped_at,
        "{}",
        r.details
    );
    let sum: f64 = r.levels.values().sum();
    assert!(close(sum, r.reward));
}

// ---------------------------------------------------------------- TLDR

#[test]
fn tldr_all_levels_with_transitions_and_overlap() {
    // t1: 8 tokens, 8·4 + 7 = 39 chars, 8 unique words.
    let t1 = text(0..8, none());
    // t2: q000 + 15 new words + "however therefore": 18 tokens, 16·4 + 7 + 9 + 17 = 97 chars.
    let t2 = format!("q000 {} however therefore", text(100..115, none()));
    let r = tldr(&t1, &t2);
    assert_eq!(r.details["chars_2"], 97);
    // L1 0.5; ρ = 97/39 ≈ 2.49 ∈ [1.6, 3.2] → 1.0; u = 18/8 = 2.25 ≥ 2 → 0.5;
    // J = 1/(8 + 18 − 1) = 0.04 ≥ 0.03 → 0.6; T(t2): "however" is in contrast and concession,
    // "therefore" in cause_effect: k = 3 → T = 0.4 + 0.05·2 = 0.5 → 0.4·0.5 = 0.2.
    // Total 0.5 + 1.0 + 0.5 + 0.2 + 0.6 = 2.8
    assert_reward(&r, 2.8, None);
    assert!(close(r.levels["level_4"], 0.8));
    assert_eq!(
        r.details["transition_categories"],
        serde_json::json!(["cause_effect", "concession", "contrast"])
    );
}

#[test]
fn tldr_transitions_count_in_agent_two_only() {
    // t1 = 7 words + "however": 8 tokens, 28 + 7 + 7 = 42 chars; t2 = 16 words, 79 chars.
    // ρ = 79/42 ≈ 1.88 → 1.0; u = 16/8 = 2.0 → 0.5 (boundary: ≥ 2.0); J = 0; T(t2) = 0.
    // Total 0.5 + 1.0 + 0.5 + 0 = 2.0
    let t1 = format!("{} however", text(0..7, none()));
    let r = tldr(&t1, &text(100..116, none()));
    assert_reward(&r, 2.0, None);
}

#[test]
fn tldr_ratio_exactly_1_6_and_the_ramp_below() {
    // t1: 9 four-letter + 1 five-letter = 10 tokens, 36 + 5 + 9 = 50 chars, 10 unique.
    let t1 = text(0..9, [9]);
    // t2: 15 + 1 = 16 tokens, 60 + 5 + 15 = 80 chars → ρ = 80/50 = 1.6 exactly → 1.0.
    // u = 16/10 = 1.6 ∈ [1.3, 2.0) → 0.5·(1.6 − 1.3)/0.7 = 3/14; J = 0, T = 0.
    // Total 0.5 + 1.0 + 3/14
    let r = tldr(&t1, &text(100..115, [115]));
    assert_eq!(r.details["length_ratio"], 1.6);
    assert_reward(&r, 1.5 + 3.0 / 14.0, None);
    // t2: 16 four-letter words = 79 chars → ρ = 1.58 → (1.58 − 1.1)/0.5 = 0.96.
    let r = tldr(&t1, &text(100..116, none()));
    assert_reward(&r, 0.5 + 0.96 + 3.0 / 14.0, None);
}

#[test]
fn tldr_ratio_lower_end() {
    let t1 = text(0..9, [9]); // 50 chars, 10 unique
    // t2: 10 + 1 tokens, 40 + 5 + 10 = 55 chars → ρ = 1.1 exactly → (1.1 − 1.1)/0.5 = 0, no stop;
    // u = 11/10 = 1.1 < 1.3 → STOP at level 3 with 0.5 + 0.
    assert_reward(&tldr(&t1, &text(100..110, [110])), 0.5, Some("level_3"));
    // t2: 11 four-letter = 54 chars → ρ = 1.08 < 1.1 → STOP at level 2 with 0.5.
    assert_reward(&tldr(&t1, &text(100..111, none())), 0.5, Some("level_2"));
}

#[test]
fn tldr_ratio_upper_end() {
    let t1 = text(0..8, none()); // 39 chars, 8 unique
    // t2: 32 tokens, 159 chars → ρ = 159/39 = 53/13 ∈ (3.2, 5.0]:
    // 1 − (53/13 − 16/5)/1.8 = 1 − (57/65)/(9/5) = 1 − 19/39 = 20/39; u = 32/8 = 4 → 0.5.
    // Total 0.5 + 20/39 + 0.5
    assert_reward(&tldr(&t1, &text(100..132, none())), 1.0 + 20.0 / 39.0, None);
    // t2: 38 + 1 tokens, 152 + 5 + 38 = 195 chars → ρ = 5.0 exactly → 1 − 1.8/1.8 = 0, no stop;
    // u = 39/8 → 0.5. Total 0.5 + 0 + 0.5 = 1.0
    assert_reward(&tldr(&t1, &text(100..138, [138])), 1.0, None);
    // t2: 40 tokens, 199 chars → ρ ≈ 5.10 → STOP at level 2 with 0.5.
    assert_reward(&tldr(&t1, &text(100..140, none())), 0.5, Some("level_2"));
    // ρ = 3.2 exactly: t1 50 chars (10 unique), t2 31 + 1 tokens = 124 + 5 + 31 = 160 chars
    // → 1.0; u = 32/10 = 3.2 → 0.5. Total 2.0
    assert_reward(&tldr(&text(0..9, [9]), &text(100..131, [131])), 2.0, None);
}

#[test]
fn tldr_unique_ratio_boundaries() {
    let t1 = text(0..10, none()); // 10 tokens, 49 chars, 10 unique
    // t2: q000 + 12 new words + 7 repeats = 20 tokens, 99 chars → ρ = 99/49 ≈ 2.02 → 1.0;
    // u = 13/10 = 1.3 → 0.5·0/0.7 = 0 (no stop); J = 1/(10 + 13 − 1) = 1/22 ≈ 0.045 → 0.6.
    // Total 0.5 + 1.0 + 0 + 0.6 = 2.1
    let t2 = text([0].into_iter().chain(100..112).chain(100..107), none());
    assert_reward(&tldr(&t1, &t2), 2.1, None);
    // Same with one unique word less (12 unique, 20 tokens): u = 1.2 < 1.3 → STOP at level 3:
    // 0.5 + 1.0 = 1.5
    let t2 = text([0].into_iter().chain(100..111).chain(100..108), none());
    assert_reward(&tldr(&t1, &t2), 1.5, Some("level_3"));
}

#[test]
fn tldr_token_limits_and_empty_texts() {
    // t1 with 7 tokens: STOP at level 1 with 0.
    assert_reward(
        &tldr(&text(0..7, none()), &text(100..120, none())),
        0.0,
        Some("level_1"),
    );
    // t2 with 256 tokens passes level 1 (0.5), then ρ = 1279/39 ≈ 32.8 stops level 2.
    assert_reward(
        &tldr(&text(0..8, none()), &text(100..356, none())),
        0.5,
        Some("level_2"),
    );
    // t2 with 257 tokens: STOP at level 1.
    assert_reward(
        &tldr(&text(0..8, none()), &text(100..357, none())),
        0.0,
        Some("level_1"),
    );
    // Empty completions: 0 tokens, STOP with 0.
    assert_reward(&tldr("", ""), 0.0, Some("level_1"));
    // Agent 1 has 8 tokens but no word: ρ = 39/15 = 2.6 → 1.0, then u undefined → STOP: 1.5.
    assert_reward(
        &tldr("- - - - - - - -", &text(0..8, none())),
        1.5,
        Some("level_3"),
    );
}

// ---------------------------------------------------------------- arXiv

/// 127 four-letter + 1 five-letter tokens: 128 tokens, 508 + 5 + 127 = 640 chars, 128 unique.
fn a1() -> String {
    text(0..127, [0])
}

#[test]
fn arxiv_ratio_exactly_1_6_in_both_tables() {
    // t2: 125 distinct + 50 repeated four-letter tokens and 25 five-letter ones: 200 tokens,
    // 700 + 125 + 199 = 1024 chars → ρ = 1024/640 = 1.6; 150 unique → u = 150/128 ≈ 1.17 → 0.5.
    let t2 = text((500..625).chain(500..550), 5000..5025);
    // Newest: ρ = 1.6 ∈ [1.3, 1.6] → 1.0; J = 0; T = 0. Total 0.5 + 1.0 + 0.5 = 2.0
    let r = arxiv(&a1(), &t2);
    assert_eq!(r.details["chars_2"], 1024);
    assert_reward(&r, 2.0, None);
    // Earlier: 1.6 > 1.5 → STOP at level 2 with 0.5.
    assert_reward(&arxiv_earlier(&a1(), &t2), 0.5, Some("level_2"));
}

#[test]
fn arxiv_jaccard_below_and_above_its_cap() {
    // As above but 10 of the distinct four-letter words are agent 1's (q000..q009):
    // J = 10/(128 + 150 − 10) = 10/268 → 0.6·(10/268)/0.23. Total 2.0 + that.
    let t2 = text((0..10).chain(510..625).chain(510..560), 5000..5025);
    assert_reward(&arxiv(&a1(), &t2), 2.0 + 0.6 * (10.0 / 268.0) / 0.23, None);
    // 60 shared: J = 60/218 ≈ 0.275 > 0.23 → 0.6. Total 2.6
    let t2 = text((0..60).chain(560..625).chain(560..610), 5000..5025);
    assert_reward(&arxiv(&a1(), &t2), 2.6, None);
}

#[test]
fn arxiv_ratio_ramps_and_stops() {
    // ρ = 1.05 (131 + 3 tokens: 524 + 15 + 133 = 672 chars; 134 unique → u ≈ 1.05 → 0.5):
    // newest (1.05 − 0.8)/0.5 = 0.5 → total 1.5; earlier [1.0, 1.3] → 1.0 → total 2.0.
    let t2 = text(500..631, 5000..5003);
    assert_reward(&arxiv(&a1(), &t2), 1.5, None);
    assert_reward(&arxiv_earlier(&a1(), &t2), 2.0, None);
    // ρ = 1.8 (157 distinct + 70 repeated four-letter + 3 five-letter: 908 + 15 + 229 = 1152;
    // 160 unique → u = 1.25 → 0.5): newest 1 − 0.2/0.4 = 0.5 → 1.5; earlier STOP → 0.5.
    let t2 = text((500..657).chain(500..570), 5000..5003);
    assert_reward(&arxiv(&a1(), &t2), 1.5, None);
    assert_reward(&arxiv_earlier(&a1(), &t2), 0.5, Some("level_2"));
    // ρ = 2.0 (165 distinct + 90 repeated + 1 five-letter: 1020 + 5 + 255 = 1280, 166 unique →
    // u ≈ 1.297 → 0.5): newest 1 − 0.4/0.4 = 0, no stop → 1.0.
    let t2 = text((500..665).chain(500..590), [5000]);
    assert_reward(&arxiv(&a1(), &t2), 1.0, None);
    // ρ = 1290/640 ≈ 2.016 (209 + 41 tokens): STOP → 0.5.
    let t2 = text((500..625).chain(500..584), 5000..5041);
    assert_reward(&arxiv(&a1(), &t2), 0.5, Some("level_2"));
}

#[test]
fn arxiv_ratio_lower_end_in_both_tables() {
    // t1: 255 + 1 tokens, 1020 + 5 + 255 = 1280 chars, 256 unique.
    let t1 = text(0..255, [0]);
    // t2 as in the 1.6 case: 1024 chars → ρ = 0.8 exactly → (0.8 − 0.8)/0.5 = 0 (newest) and
    // (0.8 − 0.8)/0.2 = 0 (earlier), no stop; u = 150/256 = 0.5859375 ∈ [0.5, 0.7) →
    // 0.5·0.0859375/0.2 = 0.21484375. Total 0.5 + 0 + 0.21484375
    let t2 = text((500..625).chain(500..550), 5000..5025);
    assert_reward(&arxiv(&t1, &t2), 0.71484375, None);
    assert_reward(&arxiv_earlier(&t1, &t2), 0.71484375, None);
    // 176 + 24 tokens: 704 + 120 + 199 = 1023 chars → ρ < 0.8 → STOP at level 2 with 0.5.
    let t2 = text(500..676, 5000..5024);
    assert_reward(&arxiv(&t1, &t2), 0.5, Some("level_2"));
    assert_reward(&arxiv_earlier(&t1, &t2), 0.5, Some("level_2"));
    // Earlier table at ρ = 1.3 and 1.5 (t1 = a1, 640 chars):
    // 163 + 3 tokens: 652 + 15 + 165 = 832 → ρ = 1.3 → 1.0; 166 unique → u ≈ 1.297 → 0.5 → 2.0
    assert_reward(
        &arxiv_earlier(&a1(), &text(500..663, 5000..5003)),
        2.0,
        None,
    );
    // 165 distinct + 26 repeated + 1: 764 + 5 + 191 = 960 → ρ = 1.5 → 1 − 0.2/0.2 = 0 → 1.0
    let t2 = text((500..665).chain(500..526), [5000]);
    assert_reward(&arxiv_earlier(&a1(), &t2), 1.0, None);
    // … and the newest table gives ρ = 1.5 the full 1.0 → 2.0
    assert_reward(&arxiv(&a1(), &t2), 2.0, None);
}

#[test]
fn arxiv_unique_ratio_boundaries() {
    // t1: 100 distinct + 28 repeated = 128 tokens, 639 chars, 100 unique.
    let t1 = text((0..100).chain(0..28), none());
    // t2: k distinct words repeated cyclically to 180 tokens: 899 chars → ρ = 899/639 ≈ 1.41 →
    // 1.0 (newest); u = k/100. Base 0.5 + 1.0 = 1.5 plus level 3:
    let t2 = |k: usize| text((0..180).map(|i| 500 + i % k), none());
    // u = 0.49 → STOP; 0.5 → 0; 0.6 → 0.5·0.1/0.2 = 0.25; 0.7 → 0.5; 1.3 → 0.5;
    // 1.5 → 0.5·(1 − 0.2/0.4) = 0.25; 1.7 → 0.5·(1 − 0.4/0.4) = 0; 1.71 → STOP.
    assert_reward(&arxiv(&t1, &t2(49)), 1.5, Some("level_3"));
    assert_reward(&arxiv(&t1, &t2(50)), 1.5, None);
    assert_reward(&arxiv(&t1, &t2(60)), 1.75, None);
    assert_reward(&arxiv(&t1, &t2(70)), 2.0, None);
    assert_reward(&arxiv(&t1, &t2(130)), 2.0, None);
    assert_reward(&arxiv(&t1, &t2(150)), 1.75, None);
    assert_reward(&arxiv(&t1, &t2(170)), 1.5, None);
    assert_reward(&arxiv(&t1, &t2(171)), 1.5, Some("level_3"));
}

#[test]
fn arxiv_token_limits_and_transitions_of_both_texts() {
    // 127 tokens: STOP at level 1.
    assert_reward(
        &arxiv(&text(0..127, none()), &text(500..700, none())),
        0.0,
        Some("level_1"),
    );
    // 257 tokens for agent 2: STOP at level 1.
    assert_reward(&arxiv(&a1(), &text(500..757, none())), 0.0, Some("level_1"));
    // Transition categories of both texts: "however" in agent 1 (contrast, concession) and
    // "therefore" in agent 2 (cause_effect) → k = 3.
    let cats = writing::transition_categories(&["we note, however, that", "therefore it holds"]);
    assert_eq!(cats, vec!["cause_effect", "concession", "contrast"]);
    // Substring semantics, no word boundaries: "also" inside "palsood" counts as elaboration,
    // and its "so" as cause_effect.
    assert_eq!(
        writing::transition_categories(&["palsood"]),
        vec!["cause_effect", "elaboration"]
    );
}

// ---------------------------------------------------------------- single agent

#[test]
fn single_agent_split_gives_the_two_part_reward() {
    let t1 = text(0..8, none());
    let t2 = format!("q000 {} however therefore", text(100..115, none()));
    let opts = ScoreOptions::default();
    // Same parts as tldr_all_levels_with_transitions_and_overlap: 2.8 whichever marker.
    for joined in [
        format!("{t1}\n[PARAGRAPH_SPLIT]\n{t2}"),
        format!("{t1}\n\nParagraph 2: {t2}"),
    ] {
        let r = writing::score(TaskKind::Tldr, &[joined], &opts).unwrap();
        assert_reward(&r, 2.8, None);
    }
    // No marker: split at ⌊len/(1 + r)⌋, r ~ U(2, 3) from the seed; same seed, same split.
    let joined = format!("{t1} {t2}");
    let (a, b, m) = writing::split_single(&joined, 7);
    assert_eq!(m, SplitMethod::Random);
    let n = joined.chars().count(); // 39 + 1 + 97 = 137 → split index in [137/4, 137/3] = [34, 45]
    assert_eq!(n, 137);
    let k = joined.find(&b).unwrap();
    assert!((34..=45).contains(&k), "split at {k}");
    assert_eq!(writing::split_single(&joined, 7), (a.clone(), b.clone(), m));
    let seeded = ScoreOptions {
        split_seed: 7,
        ..ScoreOptions::default()
    };
    let r = writing::score(TaskKind::Tldr, &[joined], &seeded).unwrap();
    assert_eq!(
        r.reward,
        writing::score_pair(TaskKind::Tldr, &a, &b, &seeded, None).reward
    );
    // Three completions are an error naming the completions.
    let e = writing::score(
        TaskKind::Arxiv,
        &["a".into(), "b".into(), "c".into()],
        &opts,
    )
    .unwrap_err();
    assert_eq!(e.field().as_deref(), Some("completions"));
}
