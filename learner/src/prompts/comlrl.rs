//! The original's next-turn texts (`external.next_turn_prompt: comlrl_2026 | comlrl_2025_09`),
//! byte for byte: OpenMLRL/LLM_Collab_Code_Generation `external/level_feedback.py`
//! `format_followup_prompts`, at e5b008e (2026, full history) and 9a8608d (September 2025, problem
//! block and previous function).
//!
//! Both print the original's `analyze_code` report ([`LevelReport`]). cotrain's reward server
//! analyses a joint action its own way ([`CodeDiagnostics`]); [`LevelReport::from_diagnostics`]
//! writes that analysis in the original's words. Where the two analyses differ (the original's
//! AST-based aux-usage check, which also flags a variable used only inside a comprehension; the
//! passing tests, which the text never shows), the words follow cotrain's analysis.

use cotrain_reward_server::code_runner::{SetupOutcome, SyntaxCheck};
use cotrain_reward_server::rewards::CodeDiagnostics;
use cotrain_reward_server::rewards::code::diagnostics::AgentDiagnostics;
use serde::{Deserialize, Serialize};

use super::turns::TurnRecord;

/// What the original's formatters return when the prompt has no `def name(params)`.
pub const FORMATTER_ERROR: &str = "Error: Could not extract function information from prompt.";

/// The original's `analyze_code` report, with its field names (the fixtures hold it as written).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct LevelReport {
    /// `aux` as extracted from agent 0's response (empty when absent).
    pub aux_func: String,
    /// The entry point as extracted from the main agent's response.
    pub main_func: String,
    pub aux_defined: bool,
    pub aux_message: String,
    pub main_defined: bool,
    pub main_message: String,
    pub syntax_ok: bool,
    pub syntax_message: String,
    pub syntax_error: Option<SyntaxErrorAt>,
    pub aux_called: bool,
    pub aux_called_but_not_used: bool,
    /// `Line N: reason`, in order; the text shows the first two.
    pub aux_problematic_calls: Vec<String>,
    pub is_wrapper: bool,
    pub tests_passed: usize,
    /// 0: no test ran (the text says "no test cases found").
    pub tests_total: usize,
    pub test_details: Vec<TestDetail>,
}

/// Where the combined program fails to parse.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SyntaxErrorAt {
    pub line: Option<u32>,
    pub offset: Option<u32>,
    pub msg: String,
}

/// One test case's outcome (`status`: `pass` or `fail`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TestDetail {
    pub status: String,
    pub case: String,
    #[serde(default)]
    pub error_type: Option<String>,
    #[serde(default)]
    pub error_message: Option<String>,
}

/// The original's `check_function_definition` message.
fn definition(a: &AgentDiagnostics, what: &str) -> (bool, String) {
    if !a.found {
        (false, format!("{what} not defined"))
    } else if !a.has_return {
        (false, format!("{what} missing return statement"))
    } else {
        (
            true,
            format!("{what} properly defined with return statement"),
        )
    }
}

fn or_none<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(|| "None".to_string(), |v| v.to_string())
}

impl LevelReport {
    /// cotrain's analysis in the original's words.
    pub fn from_diagnostics(d: &CodeDiagnostics) -> Self {
        let ep = &d.entry_point;
        let main = d.main_agent();
        let aux = (!d.single_agent).then(|| &d.agents[0]);
        let (aux_defined, aux_message) = aux.map_or(
            (false, "Single-agent mode: aux not used".to_string()),
            |a| definition(a, "Aux function"),
        );
        let (main_defined, main_message) = definition(main, &format!("Main function ({ep})"));
        // Nothing found: the original still parses (imports only, fine) and runs the tests.
        let (syntax_ok, syntax_message, syntax_error) = match &d.syntax {
            Some(SyntaxCheck::Error {
                message,
                line,
                column,
                ..
            }) => (
                false,
                // Python's str(SyntaxError) from ast.parse.
                format!(
                    "Combined code has syntax error: {message} (<unknown>, line {})",
                    or_none(*line)
                ),
                Some(SyntaxErrorAt {
                    line: *line,
                    offset: *column,
                    msg: message.clone(),
                }),
            ),
            _ => (true, "Combined code syntax OK".to_string(), None),
        };
        let mut test_details = Vec::new();
        if syntax_ok {
            for f in &d.tests.failures {
                let (error_type, error_message) = if f.timed_out {
                    (
                        "TimeoutException".to_string(),
                        "Code execution timed out".to_string(),
                    )
                } else if f.not_run {
                    match &d.setup {
                        Some(SetupOutcome::Error {
                            error_type,
                            message,
                        }) => (error_type.clone(), message.clone()),
                        Some(SetupOutcome::TimedOut) => (
                            "TimeoutException".to_string(),
                            "Code execution timed out".to_string(),
                        ),
                        None => (
                            "NameError".to_string(),
                            format!("name '{ep}' is not defined"),
                        ),
                        // Left out after the timeout limit: the original lists no detail for them.
                        _ => continue,
                    }
                } else {
                    (
                        f.error_type.clone().unwrap_or_else(|| "Exception".into()),
                        f.message.clone().unwrap_or_default(),
                    )
                };
                test_details.push(TestDetail {
                    status: "fail".into(),
                    case: f.assert.clone(),
                    error_type: Some(error_type),
                    error_message: Some(error_message),
                });
            }
        }
        let usage = main.aux_usage.as_ref();
        Self {
            aux_func: aux.map(|a| a.code.clone()).unwrap_or_default(),
            main_func: main.code.clone(),
            aux_defined,
            aux_message,
            main_defined,
            main_message,
            syntax_ok,
            syntax_message,
            syntax_error,
            aux_called: usage.is_some_and(|u| u.calls_aux),
            aux_called_but_not_used: usage.is_some_and(|u| u.misuse_line.is_some()),
            // cotrain flags a bare call, which the original words as a standalone call.
            aux_problematic_calls: usage
                .and_then(|u| u.misuse_line)
                .map(|l| format!("Line {l}: standalone call (not assigned)"))
                .into_iter()
                .collect(),
            is_wrapper: usage.is_some_and(|u| u.thin_wrapper),
            tests_passed: if syntax_ok { d.tests.passed } else { 0 },
            tests_total: if syntax_ok { d.tests.total } else { 0 },
            test_details,
        }
    }

    /// A report whose every message says it is a placeholder (`learner show-prompts --turn N`).
    pub fn placeholder(entry_point: &str, responses: &[String]) -> Self {
        let aux = responses.len() > 1;
        Self {
            aux_func: if aux {
                responses[0].clone()
            } else {
                String::new()
            },
            main_func: responses.last().cloned().unwrap_or_default(),
            aux_defined: aux,
            aux_message: "<placeholder: the aux definition check>".into(),
            main_defined: true,
            main_message: format!("<placeholder: the {entry_point} definition check>"),
            syntax_ok: true,
            syntax_message: "<placeholder: the syntax check>".into(),
            syntax_error: None,
            aux_called: aux,
            aux_called_but_not_used: aux,
            aux_problematic_calls: vec!["<placeholder: aux usage>".into()],
            is_wrapper: false,
            tests_passed: 0,
            tests_total: 1,
            test_details: vec![TestDetail {
                status: "fail".into(),
                case: "<placeholder: failing test>".into(),
                error_type: Some("<placeholder: error type>".into()),
                error_message: Some("<placeholder: error message>".into()),
            }],
        }
    }
}

/// Agent `agent` of `num_agents` writes `aux` (agent 0 of two); the others the entry point.
fn is_aux(agent: usize, num_agents: usize) -> bool {
    num_agents > 1 && agent == 0
}

/// The diagnostics block and the closing request, as lines (the original's `lines` after history).
fn diagnostics(report: &LevelReport, aux: bool, single: bool, entry_point: &str) -> Vec<String> {
    let found = |ok: bool| if ok { "FOUND" } else { "MISSING" };
    let aux_line = format!(
        "- Aux definition: {} ({})",
        found(report.aux_defined),
        report.aux_message
    );
    let main_line = format!(
        "- Main definition: {} ({})",
        found(report.main_defined),
        report.main_message
    );
    let mut lines = vec!["Static and execution diagnostics:".to_string()];
    match (single, aux) {
        (true, _) => lines.push(main_line),
        (false, true) => lines.extend([aux_line, main_line]),
        (false, false) => lines.extend([main_line, aux_line]),
    }
    lines.push(format!(
        "- Syntax: {} ({})",
        if report.syntax_ok { "OK" } else { "ERROR" },
        report.syntax_message
    ));
    if let Some(se) = &report.syntax_error {
        lines.push(format!(
            "  SyntaxError at line {}, col {}: {}",
            or_none(se.line),
            or_none(se.offset),
            se.msg
        ));
    }
    if report.tests_total > 0 {
        lines.push(format!(
            "- Tests: {}/{} passed",
            report.tests_passed, report.tests_total
        ));
        for td in report.test_details.iter().filter(|t| t.status == "fail") {
            lines.push(format!(
                "  Failed case: {} -> {}: {}",
                td.case,
                td.error_type.as_deref().unwrap_or("None"),
                td.error_message.as_deref().unwrap_or("None")
            ));
        }
    } else {
        lines.push("- Tests: no test cases found".to_string());
    }
    if !single && !aux && report.main_defined {
        if !report.aux_called {
            lines.push("- Aux usage: main does NOT call aux".to_string());
        } else if report.aux_called_but_not_used {
            let reasons: Vec<&str> = report
                .aux_problematic_calls
                .iter()
                .take(2)
                .map(String::as_str)
                .collect();
            lines.push(format!(
                "- Aux usage: called but misused ({})",
                reasons.join(", ")
            ));
        } else {
            lines.push("- Aux usage: main calls aux and uses its result".to_string());
        }
        if report.is_wrapper {
            lines.push("- Warning: main appears to be a thin wrapper over aux".to_string());
        }
    }
    let function = if aux { "aux" } else { entry_point };
    lines.push(format!("\nRevise your {function}(...) accordingly. Output ONLY the function code with no extra text."));
    lines
}

/// The 2026 next-turn text of `agent`: every earlier turn's prompt, every response, the diagnostics
/// (e5b008e `format_followup_prompts`). `drop` leaves out that many of the oldest turns (cotrain's
/// fitting into the context; the original never leaves any out).
pub fn level_feedback_2026(
    report: &LevelReport,
    agent: usize,
    num_agents: usize,
    entry_point: &str,
    history: &[TurnRecord],
    drop: usize,
) -> String {
    let aux = is_aux(agent, num_agents);
    let single = num_agents == 1;
    let kept: Vec<(usize, &TurnRecord)> = history.iter().enumerate().skip(drop).collect();
    let mut lines = Vec::new();
    if !kept.is_empty() {
        lines.push("History: previous prompts:".to_string());
        lines.extend(
            kept.iter()
                .map(|(i, t)| format!("- Turn {} prompt:\n{}", i + 1, t.prompt)),
        );
        lines.push(String::new());
        lines.push(
            match (single, aux) {
                (true, _) => "History: your previous responses:",
                (false, true) => "History: your previous aux(...) responses:",
                (false, false) => "History: your previous main responses:",
            }
            .to_string(),
        );
        lines.extend(
            kept.iter()
                .map(|(i, t)| format!("- Turn {} response:\n{}", i + 1, t.response)),
        );
        lines.push(String::new());
    }
    lines.extend(diagnostics(report, aux, single, entry_point));
    lines.join("\n")
}

/// The September 2025 original's first-turn texts of the problem block (9a8608d
/// `external/common.py` `build_first_turn_prompts`; not the agent's own first-turn prompt).
fn september_problem_block(problem: &str, entry_point: &str, aux: bool) -> String {
    const RULES: &str = "IMPORTANT INSTRUCTIONS:\n\
        - Output ONLY the function code, no explanations or examples\n\
        - Do NOT include markdown code blocks (```python)\n\
        - Do NOT include any text before or after the function\n\
        - Do NOT include test cases or example usage\n";
    if aux {
        return format!(
            "Original problem and instructions:\n\nCreate a helper function for this coding problem.\n\nProblem:\n{problem}\n\n{RULES}\
             - Create a helper function named 'aux' that can assist the main function\n\
             - The function should return useful data for solving the problem\n\n\
             Your output should follow this format:\n\ndef aux(...):\n # your function code here\nreturn result\n"
        );
    }
    let (only, form) = if entry_point.is_empty() {
        (
            "- Implement ONLY the required function as specified\n".to_string(),
            "def <entry_point>(...):".to_string(),
        )
    } else {
        (
            format!("- Implement ONLY the '{entry_point}' function as specified\n"),
            format!("def {entry_point}(...):"),
        )
    };
    format!(
        "Original problem and instructions:\n\nSolve this coding problem by implementing the required function.\n\nProblem:\n{problem}\n\n\
         You have access to a helper function: aux(...)\n\n{RULES}- Do NOT redefine the aux() function\n{only}\
         - You can call aux() to assign value to a variable within your function if helpful\n\n\
         Your output should follow this format:\n\n{form}\n # your function code here\nreturn result\n"
    )
}

/// The September 2025 next-turn text of `agent` (9a8608d `format_followup_prompts`): the problem
/// block (`original_prompt`), the previous function as extracted (`previous_response`), the
/// diagnostics.
pub fn level_feedback_2025_09(
    report: &LevelReport,
    agent: usize,
    num_agents: usize,
    problem: &str,
    entry_point: &str,
    original_prompt: bool,
    previous_response: bool,
) -> String {
    let aux = is_aux(agent, num_agents);
    let single = num_agents == 1;
    let mut lines = Vec::new();
    if original_prompt {
        // The single-agent text reuses the main block, aux instructions and all.
        lines.extend([
            september_problem_block(problem, entry_point, aux),
            String::new(),
        ]);
    }
    if previous_response {
        let (heading, code) = match (single, aux) {
            (true, _) => ("Your previous implementation:", &report.main_func),
            (false, true) => ("Your previous aux(...) implementation:", &report.aux_func),
            (false, false) => ("Your previous main implementation:", &report.main_func),
        };
        let code = if code.is_empty() {
            "<no implementation found>"
        } else {
            code.as_str()
        };
        lines.extend([heading.to_string(), code.to_string(), String::new()]);
    }
    lines.extend(diagnostics(report, aux, single, entry_point));
    lines.join("\n")
}

/// The parameters of the first `def name(params)` in `text`, as written (annotations kept) and
/// joined by ", ": what the original's formatters put in `def entry_point(...)`
/// (`re.search(r"def\s+\w+\s*\(([^)]+)\)")`). `None` where they return [`FORMATTER_ERROR`].
pub fn formatter_params(text: &str) -> Option<String> {
    static DEF: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
        regex::Regex::new(r"def\s+\w+\s*\(([^)]+)\)").expect("static regex")
    });
    let inner = DEF.captures(text)?.get(1)?.as_str();
    let params: Vec<&str> = inner
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect();
    (!params.is_empty()).then(|| params.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formatter_params_read_the_first_def_as_the_original_regex_does() {
        assert_eq!(
            formatter_params("x\ndef f(a: List[int], b=1) -> int:\ndef g(c):").as_deref(),
            Some("a: List[int], b=1")
        );
        // `[^)]+` needs one character: an empty list moves on to the next def.
        assert_eq!(
            formatter_params("def f():\n    pass\ndef g(c):").as_deref(),
            Some("c")
        );
        assert_eq!(formatter_params("def f():"), None);
        assert_eq!(formatter_params("no code"), None);
        // Python's split-strip-filter: stray commas vanish.
        assert_eq!(formatter_params("def f(a, , b,)").as_deref(), Some("a, b"));
    }

    #[test]
    fn cotrain_diagnostics_read_in_the_originals_words() {
        use cotrain_reward_server::rewards::code::diagnostics::{
            AgentRole, AuxUsage, TestFailure, TestsSummary,
        };
        let agent = |role, function: &str, found, has_return, aux_usage| AgentDiagnostics {
            role,
            function: function.into(),
            found,
            has_return,
            reason: None,
            code: if found {
                format!("def {function}(x):\n    return x")
            } else {
                String::new()
            },
            aux_usage,
        };
        let failure = |assert: &str, timed_out, not_run| TestFailure {
            assert: assert.into(),
            error_type: Some("AssertionError".into()),
            message: Some(String::new()),
            timed_out,
            not_run,
        };
        let usage = AuxUsage {
            calls_aux: true,
            uses_result: false,
            misuse_line: Some(2),
            misuse_text: Some("aux(x)".into()),
            thin_wrapper: false,
        };
        let mut d = CodeDiagnostics {
            single_agent: false,
            entry_point: "f".into(),
            agents: vec![
                agent(AgentRole::Aux, "aux", true, false, None),
                agent(AgentRole::Main, "f", true, true, Some(usage)),
            ],
            syntax: Some(SyntaxCheck::Ok),
            setup: Some(SetupOutcome::Ok),
            tests: TestsSummary {
                passed: 0,
                total: 3,
                item_total: 3,
                timeouts: 1,
                stopped_after_timeouts: true,
                failures: vec![
                    failure("assert f(1) == 2", false, false),
                    failure("assert f(2) == 3", true, false),
                    failure("assert f(3) == 4", false, true),
                ],
            },
            program: String::new(),
        };
        let r = LevelReport::from_diagnostics(&d);
        assert_eq!(
            (r.aux_defined, r.aux_message.as_str()),
            (false, "Aux function missing return statement")
        );
        assert_eq!(
            r.main_message,
            "Main function (f) properly defined with return statement"
        );
        assert_eq!(
            r.aux_problematic_calls,
            vec!["Line 2: standalone call (not assigned)".to_string()]
        );
        let main = level_feedback_2026(&r, 1, 2, "f", &[], 0);
        assert!(main.contains("- Tests: 0/3 passed\n  Failed case: assert f(1) == 2 -> AssertionError: \n  Failed case: assert f(2) == 3 -> TimeoutException: Code execution timed out\n- Aux usage: called but misused (Line 2: standalone call (not assigned))\n"), "{main}");
        // A syntax error: the original runs no test.
        d.syntax = Some(SyntaxCheck::Error {
            error_type: "SyntaxError".into(),
            message: "invalid syntax".into(),
            line: Some(3),
            column: Some(7),
        });
        let aux = level_feedback_2026(&LevelReport::from_diagnostics(&d), 0, 2, "f", &[], 0);
        assert!(aux.contains("- Syntax: ERROR (Combined code has syntax error: invalid syntax (<unknown>, line 3))\n  SyntaxError at line 3, col 7: invalid syntax\n- Tests: no test cases found\n"), "{aux}");
    }

    #[test]
    fn history_left_out_keeps_the_turn_numbers() {
        let report = LevelReport::placeholder("f", &["A".into(), "M".into()]);
        let h = [
            TurnRecord {
                prompt: "P1".into(),
                response: "R1".into(),
            },
            TurnRecord {
                prompt: "P2".into(),
                response: "R2".into(),
            },
        ];
        let t = level_feedback_2026(&report, 1, 2, "f", &h, 1);
        assert!(t.starts_with("History: previous prompts:\n- Turn 2 prompt:\nP2\n\nHistory: your previous main responses:\n- Turn 2 response:\nR2\n\n"), "{t}");
        let none = level_feedback_2026(&report, 0, 2, "f", &h, 2);
        assert!(
            none.starts_with("Static and execution diagnostics:\n- Aux definition:"),
            "{none}"
        );
        assert!(none.ends_with("\n\nRevise your aux(...) accordingly. Output ONLY the function code with no extra text."));
    }
}
