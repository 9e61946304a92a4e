//! The text of the next-turn prompt for each `external.mode` (rewards.md, "Feedback for the next
//! turn"), built as pure functions of [`CodeDiagnostics`].
//!
//! `expert_edits` needs an external model and is built by the learner, not here.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use super::code::diagnostics::{AgentRole, CodeDiagnostics, TestFailure};
use crate::code_runner::{SetupOutcome, SyntaxCheck};

/// The feedback modes computed from diagnostics alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FeedbackMode {
    /// Every signal in words (the default of the original).
    #[default]
    LevelFeedback,
    /// The same signals as short binary statements.
    LevelPassed,
    /// One line: all levels passed or not.
    Passed,
    /// No signals; the previous attempt and a request to revise.
    Plain,
}

/// Optional parts of the next-turn prompt (`external.original_prompt`,
/// `external.previous_response`). The learner composes these itself (with the agent's history and
/// its context budget) and asks for the feedback alone, the default.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FeedbackContext {
    pub original_prompt: Option<String>,
    pub previous_response: Option<String>,
}

fn syntax_line(d: &CodeDiagnostics) -> String {
    match &d.syntax {
        None => "Syntax: not checked (no function to run)".to_string(),
        Some(SyntaxCheck::Ok) => "Syntax: OK".to_string(),
        Some(SyntaxCheck::Error {
            error_type,
            message,
            line,
            column,
        }) => {
            let pos = match (line, column) {
                (Some(l), Some(c)) => format!(" at line {l}, column {c}"),
                (Some(l), None) => format!(" at line {l}"),
                _ => String::new(),
            };
            format!("Syntax: {error_type}{pos}: {message}")
        }
    }
}

fn failure_line(f: &TestFailure) -> String {
    let what = if f.timed_out {
        "timed out".to_string()
    } else if f.not_run {
        "not run".to_string()
    } else {
        match (&f.error_type, &f.message) {
            (Some(t), Some(m)) if !m.is_empty() => format!("{t}: {m}"),
            (Some(t), _) => t.clone(),
            _ => "failed".to_string(),
        }
    };
    format!("  - `{}` -> {what}", f.assert.replace('\n', " "))
}

fn definition_line(d: &CodeDiagnostics, i: usize) -> String {
    let a = &d.agents[i];
    let label = match a.role {
        AgentRole::Aux => "Helper function".to_string(),
        AgentRole::Main => "Main function".to_string(),
    };
    match &a.reason {
        None => format!("{label} `{}`: found", a.function),
        Some(r) => format!("{label} `{}`: {r}", a.function),
    }
}

fn request(d: &CodeDiagnostics, agent: usize) -> String {
    let f = &d.agents[agent].function;
    let mut s = format!(
        "Revise your function `{f}` and output only its Python code, without explanations, tests or markdown fences."
    );
    if d.agents[agent].role == AgentRole::Main && !d.single_agent {
        s.push_str(" Do not redefine `aux`; call it where it helps.");
    }
    s
}

fn preamble(ctx: &FeedbackContext) -> String {
    let mut s = String::new();
    if let Some(p) = &ctx.original_prompt {
        let _ = writeln!(s, "Problem:\n{}\n", p.trim_end());
    }
    if let Some(prev) = &ctx.previous_response {
        let _ = writeln!(s, "Your previous response:\n{}\n", prev.trim_end());
    }
    s
}

/// The next-turn prompt of `agent` (index into `d.agents`) in `mode`.
pub fn render(
    mode: FeedbackMode,
    d: &CodeDiagnostics,
    agent: usize,
    ctx: &FeedbackContext,
) -> String {
    let mut s = preamble(ctx);
    let is_main = d.agents[agent].role == AgentRole::Main;
    match mode {
        FeedbackMode::LevelFeedback => {
            s.push_str("Feedback:\n");
            for i in 0..d.agents.len() {
                let _ = writeln!(s, "- {}", definition_line(d, i));
            }
            let _ = writeln!(s, "- {}", syntax_line(d));
            if let Some(SetupOutcome::Error {
                error_type,
                message,
            }) = &d.setup
            {
                let _ = writeln!(
                    s,
                    "- Running the definitions failed: {error_type}: {message}"
                );
            }
            if d.setup == Some(SetupOutcome::TimedOut) {
                let _ = writeln!(s, "- Running the definitions timed out");
            }
            let _ = writeln!(s, "- Tests: {}/{} passed", d.tests.passed, d.tests.total);
            for f in &d.tests.failures {
                let _ = writeln!(s, "{}", failure_line(f));
            }
            if d.tests.stopped_after_timeouts {
                let _ = writeln!(s, "  (testing stopped after {} timeouts)", d.tests.timeouts);
            }
            if let Some(u) = d.agents[agent].aux_usage.as_ref().filter(|_| is_main) {
                let line = match (&u.misuse_line, &u.misuse_text) {
                    (Some(l), Some(t)) => {
                        format!(
                            "- aux usage: main calls aux but ignores its result at line {l}: `{t}`"
                        )
                    }
                    _ if u.uses_result => {
                        "- aux usage: main calls aux and uses its result".to_string()
                    }
                    _ => "- aux usage: main does not call aux".to_string(),
                };
                let _ = writeln!(s, "{line}");
                if u.thin_wrapper {
                    let _ = writeln!(
                        s,
                        "- Warning: main is a thin wrapper that only returns aux's result; add logic of its own"
                    );
                }
            }
        }
        FeedbackMode::LevelPassed => {
            let a = &d.agents[agent];
            let ok = a.found && a.has_return;
            let _ = writeln!(s, "- Implementation: {}", if ok { "OK" } else { "not OK" });
            let _ = writeln!(
                s,
                "- Syntax: {}",
                if d.syntax_ok() {
                    "correct"
                } else {
                    "incorrect"
                }
            );
            let tests = if d.tests.total > 0 && d.tests.passed == d.tests.total {
                "all passed".to_string()
            } else if d.tests.passed == 0 {
                "none passed".to_string()
            } else {
                format!("{} of {} passed", d.tests.passed, d.tests.total)
            };
            let _ = writeln!(s, "- Tests: {tests}");
            if let Some(u) = &d.agents[agent].aux_usage {
                let use_line = if !u.calls_aux {
                    "not used"
                } else if u.uses_result {
                    "used"
                } else {
                    "called but its result is ignored"
                };
                let _ = writeln!(s, "- aux: {use_line}");
            }
        }
        FeedbackMode::Passed => {
            let main = d.main_agent();
            let all = d.syntax_ok() && main.found && main.has_return && d.all_tests_passed();
            let _ = writeln!(
                s,
                "{}",
                if all {
                    "All levels passed."
                } else {
                    "Not all levels passed."
                }
            );
        }
        FeedbackMode::Plain => {}
    }
    s.push('\n');
    s.push_str(&request(d, agent));
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rewards::code::diagnostics::{AgentDiagnostics, AuxUsage, TestsSummary};

    fn diag() -> CodeDiagnostics {
        CodeDiagnostics {
            single_agent: false,
            entry_point: "add".into(),
            agents: vec![
                AgentDiagnostics {
                    role: AgentRole::Aux,
                    function: "aux".into(),
                    found: true,
                    has_return: true,
                    reason: None,
                    code: "def aux(a):\n    return a".into(),
                    aux_usage: None,
                },
                AgentDiagnostics {
                    role: AgentRole::Main,
                    function: "add".into(),
                    found: true,
                    has_return: true,
                    reason: None,
                    code: "def add(a, b):\n    aux(a)\n    return a + b".into(),
                    aux_usage: Some(AuxUsage {
                        calls_aux: true,
                        uses_result: false,
                        misuse_line: Some(2),
                        misuse_text: Some("aux(a)".into()),
                        thin_wrapper: false,
                    }),
                },
            ],
            syntax: Some(SyntaxCheck::Ok),
            setup: Some(SetupOutcome::Ok),
            tests: TestsSummary {
                passed: 1,
                total: 2,
                item_total: 5,
                timeouts: 0,
                stopped_after_timeouts: false,
                failures: vec![TestFailure {
                    assert: "assert add(1, 2) == 4".into(),
                    error_type: Some("AssertionError".into()),
                    message: Some(String::new()),
                    timed_out: false,
                    not_run: false,
                }],
            },
            program: String::new(),
        }
    }

    #[test]
    fn level_feedback_lists_every_signal_for_main() {
        let t = render(
            FeedbackMode::LevelFeedback,
            &diag(),
            1,
            &FeedbackContext::default(),
        );
        assert!(t.contains("Helper function `aux`: found"));
        assert!(t.contains("Syntax: OK"));
        assert!(t.contains("Tests: 1/2 passed"));
        assert!(t.contains("`assert add(1, 2) == 4` -> AssertionError"));
        assert!(t.contains("ignores its result at line 2: `aux(a)`"));
        assert!(t.trim_end().ends_with("call it where it helps."));
        let aux = render(
            FeedbackMode::LevelFeedback,
            &diag(),
            0,
            &FeedbackContext::default(),
        );
        assert!(!aux.contains("aux usage"));
        assert!(aux.contains("Revise your function `aux`"));
    }

    #[test]
    fn syntax_errors_show_line_and_column() {
        let mut d = diag();
        d.syntax = Some(SyntaxCheck::Error {
            error_type: "SyntaxError".into(),
            message: "invalid syntax".into(),
            line: Some(3),
            column: Some(7),
        });
        let t = render(
            FeedbackMode::LevelFeedback,
            &d,
            0,
            &FeedbackContext::default(),
        );
        assert!(t.contains("Syntax: SyntaxError at line 3, column 7: invalid syntax"));
    }

    #[test]
    fn binary_modes_and_plain() {
        let ctx = FeedbackContext {
            original_prompt: Some("Add two numbers.".into()),
            previous_response: Some("PREV".into()),
        };
        let t = render(FeedbackMode::LevelPassed, &diag(), 1, &ctx);
        assert!(t.starts_with("Problem:\nAdd two numbers."));
        assert!(t.contains("Your previous response:\nPREV"));
        assert!(t.contains("- Tests: 1 of 2 passed"));
        assert!(t.contains("- aux: called but its result is ignored"));
        assert!(render(FeedbackMode::Passed, &diag(), 1, &ctx).contains("Not all levels passed."));
        let mut d = diag();
        d.tests.passed = 2;
        assert!(render(FeedbackMode::Passed, &d, 1, &ctx).contains("All levels passed."));
        let plain = render(FeedbackMode::Plain, &diag(), 0, &FeedbackContext::default());
        assert!(
            !plain.contains("def aux(a):"),
            "without context the feedback is the signals and the request only"
        );
        assert!(!plain.contains("Tests"));
        assert!(plain.trim_start().starts_with("Revise your function `aux`"));
    }
}
