//! Code reward for HumanEval-schema items (HumanEval, CoopHumanEval, MBPP), two agents
//! (helper `aux` + entry point, maximum 4.0) or one (entry point only, maximum 2.1).
//!
//! Levels, gated in order (rewards.md):
//! 1. +0.4 if `aux` is defined and has a `return`; +0.6 if the entry point is defined and has a
//!    `return`, otherwise STOP. (Single agent: only the +0.6 part.)
//! 2. imports + aux + main parse as Python (the sandbox's own parser): +0.5, otherwise STOP.
//! 3. +1.0 × passed / total over all of the item's tests (0 when the item has no test).
//! 4. Two agents only, and only if at least one test passed and `aux` is defined: +0.5 if main
//!    calls `aux(`; if it does, +1.0 unless main is a thin wrapper, and −0.5 if some call of aux
//!    throws its result away (a statement that is only `aux(...)`).
//!
//! Level 4's +1.0 is nested under "main calls aux": a main that never calls aux is not
//! cooperating, and the spec's "then" orders it after the call check. The sandbox is run
//! once per joint action, and only if level 1 did not stop.

pub mod diagnostics;
pub mod extract;
pub mod original;
pub(crate) mod pysrc;

use std::collections::BTreeMap;

use serde_json::json;

use self::extract::{
    ExtractedTest, FunctionFacts, FunctionSource, completion_imports, extract_tests, find_function,
    function_facts, prompt_helpers, prompt_imports, strip_fences,
};
use super::{CodeFunctions, CodeTests, RewardError, ScoreOptions, ScoreResult, TaskKind, item_str};
use crate::code_runner::{CodeRunner, ProgramReport, ProgramTests, SetupOutcome, SyntaxCheck};

/// The helper function's name in the two-agent setting.
pub const AUX_NAME: &str = "aux";

/// Level 1 rewards.
pub const AUX_DEFINED_REWARD: f64 = 0.4;
pub const MAIN_DEFINED_REWARD: f64 = 0.6;
/// Level 2 reward.
pub const SYNTAX_REWARD: f64 = 0.5;
/// Level 3 reward for all tests passing.
pub const TESTS_REWARD: f64 = 1.0;
/// Level 4 parts.
pub const AUX_CALL_BONUS: f64 = 0.5;
pub const NOT_WRAPPER_BONUS: f64 = 1.0;
pub const IGNORED_RESULT_PENALTY: f64 = -0.5;

/// One joint action after pre-processing, ready to be run and scored.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// One completion (GRPO) instead of two.
    pub single_agent: bool,
    pub entry_point: String,
    /// The extracted `aux` (None for a single agent or when agent 0 did not define it).
    pub aux: Option<FunctionSource>,
    pub aux_facts: Option<FunctionFacts>,
    /// The extracted entry point.
    pub main: Option<FunctionSource>,
    pub main_facts: Option<FunctionFacts>,
    /// Imports + prompt helpers + aux + main.
    pub program: String,
    /// All of the item's tests.
    pub tests: Vec<ExtractedTest>,
}

/// The item fields of a code task.
pub(crate) struct CodeItem<'a> {
    pub prompt: &'a str,
    pub test: &'a str,
    pub entry_point: &'a str,
}

pub(crate) fn code_item(item: &serde_json::Value) -> Result<CodeItem<'_>, RewardError> {
    let task = TaskKind::Code;
    let entry_point = item_str(task, item, "entry_point")?;
    if entry_point.trim().is_empty()
        || !entry_point
            .trim()
            .chars()
            .all(|c| c.is_alphanumeric() || c == '_')
    {
        return Err(RewardError::InvalidField {
            field: "entry_point",
            reason: format!("`{entry_point}` is not a Python function name"),
        });
    }
    Ok(CodeItem {
        prompt: item_str(task, item, "prompt")?,
        test: item_str(task, item, "test")?,
        entry_point: entry_point.trim(),
    })
}

/// Pre-processes one joint action: finds the functions, builds the program and the tests, with the
/// original's rules by default and cotrain's corrections where the options ask for them.
pub fn prepare(
    completions: &[String],
    item: &serde_json::Value,
    opts: &ScoreOptions,
) -> Result<Prepared, RewardError> {
    let single_agent = match completions.len() {
        1 => true,
        2 => false,
        got => {
            return Err(RewardError::WrongCompletionCount {
                task: TaskKind::Code,
                expected: "1 (single agent) or 2 (aux, main)",
                got,
            });
        }
    };
    let it = code_item(item)?;
    let main_text = &completions[completions.len() - 1];
    let (aux, main, aux_facts, main_facts, mut imports, separator) = match opts.code_functions {
        CodeFunctions::Original => {
            // The original extracts from the raw completions (its clean-up strips the fences).
            let found = |text: &str, name: &str| {
                let source = original::extract_function(text, name);
                (!source.is_empty()).then(|| FunctionSource {
                    name: name.to_string(),
                    source,
                    start: 0,
                    end: 0,
                })
            };
            let aux = if single_agent {
                None
            } else {
                found(&completions[0], AUX_NAME)
            };
            let main = found(main_text, it.entry_point);
            let facts = |f: &FunctionSource| original_facts(&f.source);
            let (af, mf) = (aux.as_ref().map(facts), main.as_ref().map(facts));
            (
                aux,
                main,
                af,
                mf,
                original::prompt_imports(it.prompt),
                "\n\n",
            )
        }
        CodeFunctions::Structural => {
            let aux = if single_agent {
                None
            } else {
                find_function(&strip_fences(&completions[0]), AUX_NAME)
            };
            let main = find_function(&strip_fences(main_text), it.entry_point);
            let af = aux.as_ref().map(|f| function_facts(&f.source, AUX_NAME));
            let mf = main.as_ref().map(|f| function_facts(&f.source, AUX_NAME));
            (aux, main, af, mf, prompt_imports(it.prompt), "\n\n\n")
        }
    };
    if opts.completion_imports {
        for c in completions {
            for imp in completion_imports(&strip_fences(c)) {
                if !imports.contains(&imp) {
                    imports.push(imp);
                }
            }
        }
    }
    let mut parts: Vec<String> = Vec::new();
    if !imports.is_empty() {
        parts.push(imports.join("\n"));
    }
    if opts.prompt_helpers {
        parts.extend(prompt_helpers(it.prompt, it.entry_point));
    }
    for f in [&aux, &main].into_iter().flatten() {
        let text = match opts.code_functions {
            // The original cleans each extracted function once more when it joins them.
            CodeFunctions::Original => original::cleanup(&f.source),
            CodeFunctions::Structural => f.source.clone(),
        };
        if !text.is_empty() {
            parts.push(text);
        }
    }
    let mut program = parts.join(separator);
    program.push('\n');
    let tests = match opts.code_tests {
        CodeTests::Original => original::tests(it.test, it.entry_point)
            .into_iter()
            .map(|t| ExtractedTest {
                assert_text: t.clone(),
                code: t,
            })
            .collect(),
        CodeTests::Statements => extract_tests(it.test, it.entry_point),
    };

    Ok(Prepared {
        single_agent,
        entry_point: it.entry_point.to_string(),
        aux,
        aux_facts,
        main,
        main_facts,
        program,
        tests,
    })
}

/// Level 1 and 4 facts by the original's text rules.
fn original_facts(source: &str) -> FunctionFacts {
    FunctionFacts {
        has_return: original::has_return(source),
        calls_aux: original::uses_aux(source),
        thin_wrapper: original::is_wrapper(source),
        ignored_aux_call: original::ignored_aux_call(source),
    }
}

impl Prepared {
    /// Level 1 passes (the entry point is defined and has a return), so the sandbox must run.
    pub fn needs_run(&self) -> bool {
        self.main_facts.as_ref().is_some_and(|f| f.has_return)
    }

    /// The sandbox job for these tests.
    pub fn program_tests(&self, tests: &[ExtractedTest], opts: &ScoreOptions) -> ProgramTests {
        ProgramTests {
            code: self.program.clone(),
            tests: tests.iter().map(|t| t.code.clone()).collect(),
            per_test_timeout_secs: opts.per_test_timeout_secs,
            max_timeouts: opts.max_timeouts,
            double_call: !opts.single_call_tests,
        }
    }
}

/// Scores one code joint action: pre-process, run once in the sandbox if level 1 passes, gate.
pub async fn score<R: CodeRunner>(
    completions: &[String],
    item: &serde_json::Value,
    runner: &R,
    opts: &ScoreOptions,
) -> Result<ScoreResult, RewardError> {
    let prep = prepare(completions, item, opts)?;
    let report = if prep.needs_run() {
        Some(
            runner
                .run_tests(prep.program_tests(&prep.tests, opts))
                .await?,
        )
    } else {
        None
    };
    Ok(score_report(&prep, report.as_ref()))
}

/// Test counts of a report against `total` tests.
pub(crate) fn count_passed(report: &ProgramReport) -> usize {
    if report.setup != SetupOutcome::Ok {
        return 0;
    }
    report.tests.iter().filter(|t| t.passed).count()
}

/// The gated reward of a prepared joint action given the sandbox's report (`None` when level 1
/// stopped and nothing ran). Pure, so that the gating can be tested on hand-made reports.
pub fn score_report(prep: &Prepared, report: Option<&ProgramReport>) -> ScoreResult {
    let aux_ok = prep.aux_facts.as_ref().is_some_and(|f| f.has_return);
    let main_ok = prep.main_facts.as_ref().is_some_and(|f| f.has_return);
    let total = prep.tests.len();

    let mut level_1 = 0.0;
    if !prep.single_agent && aux_ok {
        level_1 += AUX_DEFINED_REWARD;
    }
    let mut level_2 = 0.0;
    let mut level_3 = 0.0;
    let (mut aux_call, mut not_wrapper, mut ignored) = (0.0, 0.0, 0.0);
    let mut passed = 0usize;
    let mut stopped_at: Option<&str> = None;
    let mut syntax_ok: Option<bool> = None;

    if main_ok {
        level_1 += MAIN_DEFINED_REWARD;
        match report {
            None => stopped_at = Some("level_2"),
            Some(r) => {
                syntax_ok = Some(r.syntax == SyntaxCheck::Ok);
                if r.syntax == SyntaxCheck::Ok {
                    level_2 = SYNTAX_REWARD;
                    passed = count_passed(r);
                    if total > 0 {
                        level_3 = TESTS_REWARD * passed as f64 / total as f64;
                    }
                    if !prep.single_agent && passed >= 1 && prep.aux.is_some() {
                        let facts = prep.main_facts.as_ref().expect("main_ok implies facts");
                        if facts.calls_aux {
                            aux_call = AUX_CALL_BONUS;
                            if !facts.thin_wrapper {
                                not_wrapper = NOT_WRAPPER_BONUS;
                            }
                            if facts.ignored_aux_call.is_some() {
                                ignored = IGNORED_RESULT_PENALTY;
                            }
                        }
                    }
                } else {
                    stopped_at = Some("level_2");
                }
            }
        }
    } else {
        stopped_at = Some("level_1");
    }
    let level_4 = aux_call + not_wrapper + ignored;
    let reward = level_1 + level_2 + level_3 + level_4;

    let mut levels = BTreeMap::new();
    levels.insert("level_1".to_string(), level_1);
    levels.insert("level_2".to_string(), level_2);
    levels.insert("level_3".to_string(), level_3);
    if !prep.single_agent {
        levels.insert("level_4".to_string(), level_4);
    }
    let ran = report.filter(|_| main_ok);
    let details = json!({
        "agents": if prep.single_agent { 1 } else { 2 },
        "entry_point": prep.entry_point,
        "aux_defined": prep.aux.is_some(),
        "aux_has_return": aux_ok,
        "main_defined": prep.main.is_some(),
        "main_has_return": main_ok,
        "syntax_ok": syntax_ok,
        "syntax": ran.map(|r| serde_json::to_value(&r.syntax).unwrap_or_default()),
        "setup": ran.map(|r| serde_json::to_value(&r.setup).unwrap_or_default()),
        "passed_tests": passed,
        "total_tests": total,
        "passed_rate": if total > 0 { passed as f64 / total as f64 } else { 0.0 },
        "timeouts": ran.map_or(0, |r| r.timeouts),
        "stopped_after_timeouts": ran.is_some_and(|r| r.stopped_after_timeouts),
        "level_1_reward": level_1,
        "level_2_reward": level_2,
        "level_3_reward": level_3,
        "bonus": {
            "aux_call": aux_call,
            "not_thin_wrapper": not_wrapper,
            "ignored_result_penalty": ignored,
            "total": level_4,
        },
        "main_calls_aux": prep.main_facts.as_ref().is_some_and(|f| f.calls_aux),
        "main_thin_wrapper": prep.main_facts.as_ref().is_some_and(|f| f.thin_wrapper),
        "stopped_at": stopped_at,
        "sandbox_wall_time_ms": ran.map(|r| r.wall_time_ms),
        "total": reward,
    });
    ScoreResult {
        reward,
        levels,
        details,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::code_runner::TestOutcome;

    const PROMPT: &str =
        "from typing import List\n\n\ndef add(a: int, b: int) -> int:\n    \"\"\"Add.\"\"\"\n";
    const TEST: &str = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(2, 2) == 4\n    assert candidate(0, 0) == 0\n    assert candidate(5, 5) == 10\n";

    fn item() -> serde_json::Value {
        json!({"prompt": PROMPT, "test": TEST, "entry_point": "add"})
    }

    fn report(passed: &[bool]) -> ProgramReport {
        ProgramReport {
            syntax: SyntaxCheck::Ok,
            setup: SetupOutcome::Ok,
            tests: passed
                .iter()
                .enumerate()
                .map(|(index, &p)| TestOutcome {
                    index,
                    passed: p,
                    timed_out: false,
                    error_type: (!p).then(|| "AssertionError".to_string()),
                    message: (!p).then(String::new),
                })
                .collect(),
            timeouts: 0,
            stopped_after_timeouts: false,
            wall_time_ms: 1,
        }
    }

    fn two(aux: &str, main: &str, passed: &[bool]) -> ScoreResult {
        let prep = prepare(
            &[aux.to_string(), main.to_string()],
            &item(),
            &ScoreOptions::default(),
        )
        .unwrap();
        let r = prep.needs_run().then(|| report(passed));
        score_report(&prep, r.as_ref())
    }

    const AUX: &str = "def aux(a, b):\n    return a + b\n";
    const MAIN_COOP: &str =
        "def add(a, b):\n    if a == 0:\n        return b\n    return aux(a, b)\n";

    #[test]
    fn full_marks_for_a_cooperating_pair_passing_all_tests() {
        // 0.4 + 0.6 (level 1) + 0.5 (syntax) + 1.0 * 4/4 + 0.5 (calls aux) + 1.0 (not thin) = 4.0
        let r = two(AUX, MAIN_COOP, &[true; 4]);
        assert_eq!(r.reward, 4.0);
        assert_eq!(r.levels["level_4"], 1.5);
        assert_eq!(r.details["bonus"]["ignored_result_penalty"], 0.0);
    }

    #[test]
    fn partial_tests_scale_level_three() {
        // 1.0 + 0.5 + 1.0 * 3/4 + 1.5 = 3.75
        let r = two(AUX, MAIN_COOP, &[true, true, false, true]);
        assert_eq!(r.reward, 3.75);
        assert_eq!(r.details["passed_tests"], 3);
        assert_eq!(r.details["passed_rate"], 0.75);
    }

    #[test]
    fn no_bonus_without_a_passing_test() {
        // 1.0 + 0.5 + 0 = 1.5, level 4 gated off by zero passed tests
        let r = two(AUX, MAIN_COOP, &[false; 4]);
        assert_eq!(r.reward, 1.5);
        assert_eq!(r.levels["level_4"], 0.0);
    }

    #[test]
    fn aux_without_return_loses_only_its_part() {
        // aux defined without return: 0 + 0.6; syntax 0.5; tests 1.0; aux exists so level 4
        // applies: calls aux 0.5 + not thin 1.0 → 3.6
        let r = two("def aux(a, b):\n    print(a + b)\n", MAIN_COOP, &[true; 4]);
        assert_eq!(r.levels["level_1"], 0.6);
        assert_eq!(r.reward, 3.6);
    }

    #[test]
    fn missing_aux_gets_no_bonus_even_if_main_calls_it() {
        // 0.6 + 0.5 + 1.0 * 1/4 = 1.35, no level 4 (aux not defined)
        let r = two(
            "I cannot help with that.",
            MAIN_COOP,
            &[true, false, false, false],
        );
        assert!((r.reward - 1.35).abs() < 1e-12);
        assert_eq!(r.levels["level_4"], 0.0);
    }

    #[test]
    fn missing_main_stops_at_level_one() {
        // aux ok 0.4, main missing → STOP with 0.4, nothing run
        let r = two(AUX, "def other(a, b):\n    return a + b\n", &[true; 4]);
        assert_eq!(r.reward, 0.4);
        assert_eq!(r.details["stopped_at"], "level_1");
        let r = two(AUX, "def add(a, b):\n    pass\n", &[true; 4]);
        assert_eq!(r.reward, 0.4);
    }

    #[test]
    fn syntax_error_stops_at_level_two() {
        let prep = prepare(
            &[AUX.to_string(), MAIN_COOP.to_string()],
            &item(),
            &ScoreOptions::default(),
        )
        .unwrap();
        let mut rep = report(&[]);
        rep.syntax = SyntaxCheck::Error {
            error_type: "SyntaxError".into(),
            message: "invalid syntax".into(),
            line: Some(3),
            column: Some(5),
        };
        rep.setup = SetupOutcome::Skipped;
        // 0.4 + 0.6 = 1.0, STOP
        let r = score_report(&prep, Some(&rep));
        assert_eq!(r.reward, 1.0);
        assert_eq!(r.details["stopped_at"], "level_2");
    }

    #[test]
    fn thin_wrappers_get_only_the_call_bonus() {
        // 1.0 + 0.5 + 1.0 + 0.5 (calls aux), no +1.0 → 3.0
        let r = two(AUX, "def add(a, b):\n    return aux(a, b)\n", &[true; 4]);
        assert_eq!(r.reward, 3.0);
        let r = two(
            AUX,
            "def add(a, b):\n    s = aux(a, b)\n    return s\n",
            &[true; 4],
        );
        assert_eq!(r.reward, 3.0);
    }

    fn two_with(aux: &str, main: &str, passed: &[bool], opts: &ScoreOptions) -> ScoreResult {
        let prep = prepare(&[aux.to_string(), main.to_string()], &item(), opts).unwrap();
        let r = prep.needs_run().then(|| report(passed));
        score_report(&prep, r.as_ref())
    }

    #[test]
    fn ignored_aux_result_is_penalised() {
        // Structural checks: a statement that is only a call of aux.
        // 1.0 + 0.5 + 1.0 + 0.5 + 1.0 − 0.5 = 3.5
        let main = "def add(a, b):\n    aux(a, b)\n    return a + b\n";
        let r = two_with(AUX, main, &[true; 4], &ScoreOptions::corrected());
        assert_eq!(r.reward, 3.5);
        assert_eq!(r.details["bonus"]["ignored_result_penalty"], -0.5);
        // The original's pattern needs `aux`, one space, one character in parentheses.
        assert_eq!(two(AUX, main, &[true; 4]).reward, 4.0);
        let r = two(
            AUX,
            "def add(a, b):\n    aux (a)\n    return a + b\n",
            &[true; 4],
        );
        assert_eq!(r.reward, 3.5);
    }

    #[test]
    fn main_not_calling_aux_gets_no_level_four() {
        // 1.0 + 0.5 + 1.0 = 2.5
        let r = two(AUX, "def add(a, b):\n    return a + b\n", &[true; 4]);
        assert_eq!(r.reward, 2.5);
    }

    #[test]
    fn single_agent_maximum_is_two_point_one() {
        let prep = prepare(
            &["def add(a, b):\n    return a + b\n".to_string()],
            &item(),
            &ScoreOptions::default(),
        )
        .unwrap();
        // 0.6 + 0.5 + 1.0 = 2.1
        let r = score_report(&prep, Some(&report(&[true; 4])));
        assert_eq!(r.reward, 0.6 + 0.5 + 1.0);
        assert!(!r.levels.contains_key("level_4"));
        // 0.6 + 0.5 + 1.0 * 2/4 = 1.6
        let r = score_report(&prep, Some(&report(&[true, false, true, false])));
        assert!((r.reward - 1.6).abs() < 1e-12);
    }

    #[test]
    fn setup_failure_passes_no_test() {
        let prep = prepare(
            &["def add(a, b):\n    return a + b\n".to_string()],
            &item(),
            &ScoreOptions::default(),
        )
        .unwrap();
        let mut rep = report(&[]);
        rep.setup = SetupOutcome::Error {
            error_type: "NameError".into(),
            message: "x".into(),
        };
        // 0.6 + 0.5 + 0 = 1.1
        assert!((score_report(&prep, Some(&rep)).reward - 1.1).abs() < 1e-12);
    }

    #[test]
    fn program_is_imports_then_aux_then_main() {
        let completions = [
            "```python\nimport math\ndef aux(a, b):\n    return a + b\n```".to_string(),
            MAIN_COOP.to_string(),
        ];
        // The original: the prompt's imports only, parts joined by one blank line.
        let prep = prepare(&completions, &item(), &ScoreOptions::default()).unwrap();
        assert_eq!(
            prep.program,
            format!(
                "from typing import List\n\n{}\n\n{}\n",
                AUX.trim_end(),
                MAIN_COOP.trim_end()
            )
        );
        assert_eq!(prep.tests.len(), 4);
        assert_eq!(prep.tests[3].code, "assert add(5, 5) == 10");
        // With the completion's own imports kept (and cotrain's layout).
        let prep = prepare(&completions, &item(), &ScoreOptions::corrected()).unwrap();
        assert_eq!(
            prep.program,
            format!(
                "from typing import List\nimport math\n\n\n{}\n\n\n{}\n",
                AUX.trim_end(),
                MAIN_COOP.trim_end()
            )
        );
        assert_eq!(prep.tests[3].code, "assert add(5, 5) == 10");
    }

    #[test]
    fn wrong_completion_count_and_missing_fields_are_errors() {
        let e = prepare(&[], &item(), &ScoreOptions::default()).unwrap_err();
        assert_eq!(e.field().as_deref(), Some("completions"));
        let e = prepare(
            &["x".into()],
            &json!({"prompt": "", "entry_point": "f"}),
            &ScoreOptions::default(),
        )
        .unwrap_err();
        assert_eq!(e.field().as_deref(), Some("item.test"));
        let e = prepare(
            &["x".into()],
            &json!({"prompt": "", "test": "", "entry_point": 3}),
            &ScoreOptions::default(),
        )
        .unwrap_err();
        assert_eq!(e.field().as_deref(), Some("item.entry_point"));
    }
}
