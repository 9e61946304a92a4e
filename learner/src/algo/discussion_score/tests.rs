use super::*;

fn close(a: &[Vec<f64>], b: &[Vec<f64>]) {
    assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.len(), y.len(), "{a:?} vs {b:?}");
        for (p, q) in x.iter().zip(y) {
            assert!((p - q).abs() < 1e-12, "{a:?} vs {b:?}");
        }
    }
}

// 3 turns × 2 agents. Means over agents: m(0) = 0.5, m(1) = 0.5, m(2) = 1.
fn table() -> Vec<Vec<f64>> {
    vec![vec![1.0, 0.0], vec![0.0, 1.0], vec![1.0, 1.0]]
}

#[test]
fn discounted_sum_over_all_agents_matches_hand_computed_values() {
    // Denominators: turn 0: 1 + 0.3 + 0.09 = 1.39; turn 1: 1 + 0.3 = 1.3; turn 2: 1.
    // R(0,0) = (1 + 0.3·0.5 + 0.09·1) / 1.39 = 1.24 / 1.39
    // R(0,1) = (0 + 0.15 + 0.09) / 1.39 = 0.24 / 1.39
    // R(1,0) = (0 + 0.3·1) / 1.3 = 0.3 / 1.3;  R(1,1) = (1 + 0.3) / 1.3 = 1
    // R(2,i) = s(2,i) = 1
    let r = training_scores(&table(), &ScoreRule::default()).unwrap();
    close(
        &r,
        &[
            vec![1.24 / 1.39, 0.24 / 1.39],
            vec![0.3 / 1.3, 1.0],
            vec![1.0, 1.0],
        ],
    );
}

#[test]
fn individual_share_uses_only_the_agents_own_future() {
    // R(0,0) = (1 + 0.3·0 + 0.09·1) / 1.39 = 1.09 / 1.39;  R(0,1) = (0 + 0.3·1 + 0.09·1) / 1.39
    // R(1,0) = (0 + 0.3·1) / 1.3;  R(1,1) = (1 + 0.3·1) / 1.3 = 1
    let rule = ScoreRule {
        agent_share: AgentShare::Individual,
        ..ScoreRule::default()
    };
    let r = training_scores(&table(), &rule).unwrap();
    close(
        &r,
        &[
            vec![1.09 / 1.39, 0.39 / 1.39],
            vec![0.3 / 1.3, 1.0],
            vec![1.0, 1.0],
        ],
    );
}

#[test]
fn lookahead_limits_the_window() {
    // k = 1: turn 0 sees turns 0..=1 only, denominator 1.3.
    // R(0,0) = (1 + 0.3·0.5) / 1.3 = 1.15 / 1.3;  R(0,1) = 0.15 / 1.3; later turns as before.
    let rule = ScoreRule {
        lookahead: Some(1),
        ..ScoreRule::default()
    };
    let r = training_scores(&table(), &rule).unwrap();
    close(
        &r,
        &[
            vec![1.15 / 1.3, 0.15 / 1.3],
            vec![0.3 / 1.3, 1.0],
            vec![1.0, 1.0],
        ],
    );
    // k = 0 is the agent's own score.
    let rule = ScoreRule {
        lookahead: Some(0),
        ..ScoreRule::default()
    };
    close(&training_scores(&table(), &rule).unwrap(), &table());
}

#[test]
fn a_question_that_stopped_early_sums_to_its_last_played_turn() {
    // Two played turns: turn 0's denominator is 1.3. R(0,0) = (1 + 0.3·0.5) / 1.3.
    let r = training_scores(&table()[..2], &ScoreRule::default()).unwrap();
    close(&r, &[vec![1.15 / 1.3, 0.15 / 1.3], vec![0.0, 1.0]]);
}

#[test]
fn current_and_last_horizons() {
    let rule = |horizon, agent_share| ScoreRule {
        horizon,
        agent_share,
        ..ScoreRule::default()
    };
    let s = table();
    close(
        &training_scores(&s, &rule(Horizon::Current, AgentShare::Individual)).unwrap(),
        &s,
    );
    close(
        &training_scores(&s, &rule(Horizon::Current, AgentShare::All)).unwrap(),
        &[vec![0.5, 0.5], vec![0.5, 0.5], vec![1.0, 1.0]],
    );
    let s = vec![vec![1.0, 0.0], vec![0.0, 1.0], vec![0.2, 0.6]];
    close(
        &training_scores(&s, &rule(Horizon::Last, AgentShare::Individual)).unwrap(),
        &vec![vec![0.2, 0.6]; 3],
    );
    close(
        &training_scores(&s, &rule(Horizon::Last, AgentShare::All)).unwrap(),
        &vec![vec![0.4, 0.4]; 3],
    );
}

#[test]
fn malformed_tables_and_gamma_are_errors() {
    let ragged = vec![vec![1.0, 0.0], vec![1.0]];
    assert_eq!(
        training_scores(&ragged, &ScoreRule::default()).unwrap_err(),
        MaporlError::RaggedTable {
            turn: 1,
            expected: 2,
            got: 1
        }
    );
    assert_eq!(
        training_scores(&[vec![]], &ScoreRule::default()).unwrap_err(),
        MaporlError::NoAgents
    );
    let rule = ScoreRule {
        gamma: -0.1,
        ..ScoreRule::default()
    };
    assert!(matches!(
        training_scores(&table(), &rule),
        Err(MaporlError::InvalidGamma(_))
    ));
    assert!(
        training_scores(&[], &ScoreRule::default())
            .unwrap()
            .is_empty()
    );
}

#[test]
fn answer_changes_covers_the_four_transitions() {
    assert_eq!(answer_changes(true, false), Transition::CorrectToWrong);
    assert_eq!(answer_changes(false, true), Transition::WrongToCorrect);
    assert_eq!(answer_changes(true, true), Transition::StayedCorrect);
    assert_eq!(answer_changes(false, false), Transition::StayedWrong);
}

fn only(k: usize, rule: IncentiveRule) -> Incentives {
    let mut alpha = [0.0; 4];
    alpha[k] = 1.0;
    Incentives { alpha, rule }
}
const P: IncentiveRule = IncentiveRule::Paper;
const R: IncentiveRule = IncentiveRule::ReleasedCode;

// Tables are correct[turn][agent]; with two agents "the others" is the other agent.
fn bonus(c: &[&[bool]], inc: Incentives) -> Vec<Vec<f64>> {
    let c: Vec<Vec<bool>> = c.iter().map(|r| r.to_vec()).collect();
    incentive_bonus(&c, &inc).unwrap()
}

/// Agent 0's bonus at turn 1 for each weight alone: `[w0, w1, w2, w3]`.
fn turn1_weights(c: &[&[bool]], rule: IncentiveRule) -> [f64; 4] {
    std::array::from_fn(|k| bonus(c, only(k, rule))[1][0])
}

#[test]
fn answer_changes_follow_the_papers_table_1_and_the_released_code() {
    // (agent 0 at turns 0 and 1, agent 1 at turn 0) → agent 0's weight at turn 1: paper, released.
    // Right → wrong, the other right: −α1 in both.
    let c: &[&[bool]] = &[&[true, true], &[false, true]];
    assert_eq!(turn1_weights(c, P), [0.0, -1.0, 0.0, 0.0]);
    assert_eq!(turn1_weights(c, R), [0.0, -1.0, 0.0, 0.0]);
    // Right → wrong, the other wrong: −α0 in both.
    let c: &[&[bool]] = &[&[true, false], &[false, false]];
    assert_eq!(turn1_weights(c, P), [-1.0, 0.0, 0.0, 0.0]);
    assert_eq!(turn1_weights(c, R), [-1.0, 0.0, 0.0, 0.0]);
    // Wrong → right, the other wrong: +α0 (paper: reasoning past a wrong answer), +w1 released.
    let c: &[&[bool]] = &[&[false, false], &[true, false]];
    assert_eq!(turn1_weights(c, P), [1.0, 0.0, 0.0, 0.0]);
    assert_eq!(turn1_weights(c, R), [0.0, 1.0, 0.0, 0.0]);
    // Wrong → right, the other right: +α1 (paper: persuaded by a right answer), +w0 released.
    let c: &[&[bool]] = &[&[false, true], &[true, true]];
    assert_eq!(turn1_weights(c, P), [0.0, 1.0, 0.0, 0.0]);
    assert_eq!(turn1_weights(c, R), [1.0, 0.0, 0.0, 0.0]);
    // A single agent: every change is its own (w1), in both rules.
    for rule in [P, R] {
        assert_eq!(
            bonus(&[&[false], &[true], &[false]], only(1, rule)),
            [[0.0], [1.0], [-1.0]]
        );
        assert_eq!(
            bonus(&[&[false], &[true], &[false]], only(0, rule)),
            [[0.0], [0.0], [0.0]]
        );
    }
}

#[test]
fn influence_follows_the_papers_table_2_and_the_released_code_has_the_opposite_signs() {
    // Agent 0's answer at turn 1 stays; agent 1 changes from turn 1 to turn 2.
    // The other wrong → right while agent 0 is right: +β1 (paper), −w3 (released).
    let c: &[&[bool]] = &[&[true, false], &[true, false], &[true, true]];
    assert_eq!(turn1_weights(c, P), [0.0, 0.0, 0.0, 1.0]);
    assert_eq!(turn1_weights(c, R), [0.0, 0.0, 0.0, -1.0]);
    // The other wrong → right while agent 0 is wrong: +β0 (paper), −w2 (released).
    let c: &[&[bool]] = &[&[false, false], &[false, false], &[false, true]];
    assert_eq!(turn1_weights(c, P), [0.0, 0.0, 1.0, 0.0]);
    assert_eq!(turn1_weights(c, R), [0.0, 0.0, -1.0, 0.0]);
    // The other right → wrong while agent 0 is right: −β1 (paper), +w2 (released).
    let c: &[&[bool]] = &[&[true, true], &[true, true], &[true, false]];
    assert_eq!(turn1_weights(c, P), [0.0, 0.0, 0.0, -1.0]);
    assert_eq!(turn1_weights(c, R), [0.0, 0.0, 1.0, 0.0]);
    // The other right → wrong while agent 0 is wrong: −β0 (paper), +w3 (released).
    let c: &[&[bool]] = &[&[false, true], &[false, true], &[false, false]];
    assert_eq!(turn1_weights(c, P), [0.0, 0.0, -1.0, 0.0]);
    assert_eq!(turn1_weights(c, R), [0.0, 0.0, 0.0, 1.0]);
}

#[test]
fn turn_0_gets_the_papers_influence_term_and_nothing_from_the_released_code() {
    // Agent 0 right at turn 0, agent 1 wrong → right by turn 1.
    let c: &[&[bool]] = &[&[true, false], &[true, true]];
    assert_eq!(bonus(c, only(3, P)), [[1.0, 0.0], [0.0, 0.0]]);
    assert_eq!(bonus(c, only(3, R)), [[0.0, 0.0], [0.0, 0.0]]);
}

#[test]
fn bonuses_add_up_and_vanish_without_weights_or_on_a_tie() {
    // Agent 1 wrong → right at turn 2 with agent 0 right: +α1 for agent 1 at turn 2 (paper), and
    // +β1 for agent 0 at turn 1 (it was right when agent 1 came round).
    let inc = Incentives {
        alpha: [0.5, 0.25, 0.0, 2.0],
        rule: P,
    };
    let t = [&[true, false][..], &[true, false], &[true, true]];
    assert_eq!(bonus(&t, inc), [[0.0, 0.0], [2.0, 0.0], [0.0, 0.25]]);
    assert_eq!(
        bonus(&t, Incentives::default()),
        [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]
    );
    // Three agents: agent 0 wrong → right while the others were split (one right, one wrong).
    let all = Incentives {
        alpha: [1.0; 4],
        rule: P,
    };
    let b = bonus(&[&[false, true, false], &[true, true, false]], all);
    assert_eq!(b[1][0], 0.0);
}

#[test]
fn shaped_scores_add_the_bonus_after_the_discount() {
    let s = vec![vec![1.0, 0.0], vec![1.0, 0.0], vec![1.0, 1.0]];
    let c = vec![vec![true, false], vec![true, false], vec![true, true]];
    let inc = Incentives {
        alpha: [0.5, 0.0, 0.0, 2.0],
        rule: R,
    };
    // Released rule: R(1,0) = (1 + 0.3·1) / 1.3 = 1, − w3 = −1; R(1,1) = 0.3 / 1.3; R(2,1) = 1, + w0 = 1.5.
    // R(0,0) = (1 + 0.3·0.5 + 0.09·1) / 1.39; R(0,1) = (0 + 0.3·0.5 + 0.09·1) / 1.39; no bonus at turn 0.
    let r = shaped_training_scores(&s, &c, &ScoreRule::default(), &inc).unwrap();
    close(
        &r,
        &[
            vec![1.24 / 1.39, 0.24 / 1.39],
            vec![-1.0, 0.3 / 1.3],
            vec![1.0, 1.5],
        ],
    );
    let err = shaped_training_scores(&s, &c[..1], &ScoreRule::default(), &inc).unwrap_err();
    assert!(matches!(err, MaporlError::ShapeMismatch { .. }));
}

const SOLUTION: &str = "Natalia sold 48 clips in April. In May she sold half as many, which is 48 / 2 = 24 \
clips. Altogether she sold 48 + 24 = 72 clips in April and May. Checking: 24 is half of 48, and \
48 + 24 = 72.\nAnswer: \\boxed{72}";

fn reason(text: &str, tokens: usize) -> Option<InvalidReason> {
    invalid_reason(text, tokens, &InvalidOutputRule::default())
}

#[test]
fn a_normal_gsm8k_solution_is_valid() {
    assert_eq!(reason(SOLUTION, 60), None);
    assert_eq!(
        reason(
            "The total is 6 * 7 = 42 apples, so the answer is \\boxed{42}.",
            50
        ),
        None
    );
}

#[test]
fn too_short_is_fewer_than_min_tokens() {
    assert_eq!(reason(SOLUTION, 49), Some(InvalidReason::TooShort));
    assert_eq!(reason(SOLUTION, 50), None);
}

#[test]
fn a_phrase_repeated_more_than_three_times_in_a_row_is_invalid() {
    let four = "so the answer is the answer is the answer is the answer is \\boxed{5}";
    assert_eq!(reason(four, 60), Some(InvalidReason::Repetition));
    let three = "so the answer is the answer is the answer is \\boxed{5}";
    assert_eq!(reason(three, 60), None);
    assert_eq!(
        reason("wait wait wait wait \\boxed{5}", 60),
        Some(InvalidReason::Repetition)
    );
    // Four times, but not in a row.
    assert_eq!(reason("wait wait, ok wait wait \\boxed{5}", 60), None);
    // A sentence longer than 20 words repeated on consecutive lines.
    let line = "Let me carefully reconsider every single step of this long problem once more because I am \
not entirely sure the previous reasoning was right";
    assert!(line.split_whitespace().count() > 20);
    let text = format!("{line}\n{line}\n{line}\n{line}\n\\boxed{{5}}");
    assert_eq!(reason(&text, 200), Some(InvalidReason::Repetition));
    let text = format!("{line}\n{line}\n{line}\n\\boxed{{5}}");
    assert_eq!(reason(&text, 200), None);
}

#[test]
fn repeated_arithmetic_is_not_repetition() {
    for text in [
        "Counting: 1, 2, 3, 4, 5, 6, 7, 8. So \\boxed{8}",
        "1 + 1 + 1 + 1 + 1 + 1 = 6, \\boxed{6}",
        "$5 + $5 + $5 + $5 + $5 = $25 \\boxed{25}",
        "2 \\times 2 \\times 2 \\times 2 \\times 2 = 32 \\boxed{32}",
        "x + x + x + x + x = 5x \\boxed{5}",
        "= 5\n= 5\n= 5\n= 5\n\\boxed{5}",
        "0 0 0 0 0 0 \\boxed{0}",
    ] {
        assert_eq!(reason(text, 60), None, "{text}");
    }
}

#[test]
fn no_boxed_answer_where_one_is_required() {
    let plain = SOLUTION.replace("\\boxed{72}", "72");
    assert_eq!(reason(&plain, 60), Some(InvalidReason::NoBoxed));
    assert_eq!(
        reason(&SOLUTION.replace("\\boxed{72}", "\\boxed{72"), 60),
        Some(InvalidReason::NoBoxed)
    );
    // An empty box is a box (its answer scores 0 elsewhere).
    assert_eq!(
        reason(&SOLUTION.replace("\\boxed{72}", "\\boxed{}"), 60),
        None
    );
    let lenient = InvalidOutputRule {
        require_boxed: false,
        ..InvalidOutputRule::default()
    };
    assert_eq!(invalid_reason(&plain, 60, &lenient), None);
    assert!(!boxed_required(0, false));
    assert!(boxed_required(0, true));
    assert!(boxed_required(1, false));
}

#[test]
fn the_penalty_replaces_the_score() {
    let rule = InvalidOutputRule::default();
    assert_eq!(
        apply_invalid_penalty(0.9, Some(InvalidReason::TooShort), &rule),
        -10.0
    );
    assert_eq!(apply_invalid_penalty(0.9, None, &rule), 0.9);
}
