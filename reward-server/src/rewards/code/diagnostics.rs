//! Structured diagnostics of a code joint action, the input of every feedback mode
//! (rewards.md, "Feedback for the next turn").
//!
//! The analysis runs only the tests selected by `external.sandbox_slice` (the reward always
//! uses all of them, see [`super::score`]).

use std::fmt;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::extract::ExtractedTest;
use super::{AUX_NAME, Prepared, count_passed, prepare};
use crate::code_runner::{CodeRunner, SetupOutcome, SyntaxCheck};
use crate::rewards::{AnalyzeOptions, RewardError};

/// Which of the item's tests feedback shows (`external.sandbox_slice`): a positive n = the
/// first n, a negative n = the last |n|, 0 / null / `"all"` = all. Default: the first one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TestSlice {
    All,
    First(usize),
    Last(usize),
}

impl Default for TestSlice {
    fn default() -> Self {
        TestSlice::First(1)
    }
}

impl TestSlice {
    /// From the config's integer.
    pub fn from_int(n: i64) -> Self {
        match n {
            0 => TestSlice::All,
            n if n > 0 => TestSlice::First(n as usize),
            n => TestSlice::Last(n.unsigned_abs() as usize),
        }
    }

    /// The selected tests.
    pub fn apply<'a, T>(&self, tests: &'a [T]) -> &'a [T] {
        match *self {
            TestSlice::All => tests,
            TestSlice::First(n) => &tests[..n.min(tests.len())],
            TestSlice::Last(n) => &tests[tests.len().saturating_sub(n)..],
        }
    }
}

impl Serialize for TestSlice {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match *self {
            TestSlice::All => s.serialize_str("all"),
            TestSlice::First(n) => s.serialize_i64(n as i64),
            TestSlice::Last(n) => s.serialize_i64(-(n as i64)),
        }
    }
}

impl<'de> Deserialize<'de> for TestSlice {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TestSlice;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an integer, null or \"all\"")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<TestSlice, E> {
                Ok(TestSlice::from_int(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<TestSlice, E> {
                Ok(TestSlice::First(v as usize)).map(|s| if v == 0 { TestSlice::All } else { s })
            }
            fn visit_unit<E: de::Error>(self) -> Result<TestSlice, E> {
                Ok(TestSlice::All)
            }
            fn visit_none<E: de::Error>(self) -> Result<TestSlice, E> {
                Ok(TestSlice::All)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<TestSlice, E> {
                if v.eq_ignore_ascii_case("all") {
                    Ok(TestSlice::All)
                } else {
                    v.trim()
                        .parse::<i64>()
                        .map(TestSlice::from_int)
                        .map_err(|_| {
                            E::invalid_value(de::Unexpected::Str(v), &"an integer, null or \"all\"")
                        })
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// Which function an agent is responsible for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AgentRole {
    /// Agent 0 of two: writes `aux`.
    Aux,
    /// The agent that writes the entry point (agent 1 of two, or the single agent).
    Main,
}

/// How the main function uses aux.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AuxUsage {
    pub calls_aux: bool,
    /// Calls aux and no call throws the result away.
    pub uses_result: bool,
    /// The first statement that calls aux and ignores its result: 1-based line within the
    /// extracted function, and the statement.
    pub misuse_line: Option<usize>,
    pub misuse_text: Option<String>,
    pub thin_wrapper: bool,
}

/// What was found in one agent's completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentDiagnostics {
    pub role: AgentRole,
    /// The function this agent must define (`aux` or the entry point).
    pub function: String,
    pub found: bool,
    pub has_return: bool,
    /// Why the function does not count, when it does not.
    pub reason: Option<String>,
    /// The extracted function (empty when not found).
    pub code: String,
    /// Main agent of a pair only.
    pub aux_usage: Option<AuxUsage>,
}

/// One test that did not pass.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TestFailure {
    /// The assert, `candidate` replaced by the entry point.
    pub assert: String,
    pub error_type: Option<String>,
    pub message: Option<String>,
    pub timed_out: bool,
    /// The test never ran (timeout limit reached earlier, or the definitions failed).
    pub not_run: bool,
}

/// Outcome of the shown tests.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TestsSummary {
    pub passed: usize,
    /// Number of tests shown (the slice), the denominator of "Tests: p/t passed".
    pub total: usize,
    /// Number of tests of the item before slicing.
    pub item_total: usize,
    pub timeouts: usize,
    pub stopped_after_timeouts: bool,
    pub failures: Vec<TestFailure>,
}

/// Diagnostics of one code joint action.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CodeDiagnostics {
    pub single_agent: bool,
    pub entry_point: String,
    /// One entry per completion, in order.
    pub agents: Vec<AgentDiagnostics>,
    /// `None` when no function was found at all, so nothing ran.
    pub syntax: Option<SyntaxCheck>,
    pub setup: Option<SetupOutcome>,
    pub tests: TestsSummary,
    /// The combined program that was run.
    pub program: String,
}

impl CodeDiagnostics {
    /// Syntax parsed (and something was run).
    pub fn syntax_ok(&self) -> bool {
        self.syntax == Some(SyntaxCheck::Ok)
    }
    /// Every shown test passed (and there was at least one).
    pub fn all_tests_passed(&self) -> bool {
        self.tests.total > 0 && self.tests.passed == self.tests.total
    }
    /// The entry point's agent.
    pub fn main_agent(&self) -> &AgentDiagnostics {
        self.agents.last().expect("at least one agent")
    }
}

fn agent_diagnostics(
    role: AgentRole,
    function: &str,
    completion: &str,
    prep: &Prepared,
) -> AgentDiagnostics {
    let (src, facts) = match role {
        AgentRole::Aux => (prep.aux.as_ref(), prep.aux_facts.as_ref()),
        AgentRole::Main => (prep.main.as_ref(), prep.main_facts.as_ref()),
    };
    let found = src.is_some();
    let has_return = facts.is_some_and(|f| f.has_return);
    let reason = if !found {
        let others: Vec<String> =
            super::extract::function_blocks(&super::extract::strip_fences(completion))
                .into_iter()
                .map(|f| f.name)
                .collect();
        Some(if completion.trim().is_empty() {
            "the response is empty".to_string()
        } else if others.is_empty() {
            format!("no function definition `def {function}(...)` found in the response")
        } else {
            format!(
                "no function named `{function}` found (found: {})",
                others.join(", ")
            )
        })
    } else if !has_return {
        Some(format!("`{function}` has no return statement"))
    } else {
        None
    };
    let aux_usage = match (role, prep.single_agent, facts) {
        (AgentRole::Main, false, Some(f)) => Some(AuxUsage {
            calls_aux: f.calls_aux,
            uses_result: f.calls_aux && f.ignored_aux_call.is_none(),
            misuse_line: f.ignored_aux_call.as_ref().map(|m| m.0),
            misuse_text: f.ignored_aux_call.as_ref().map(|m| m.1.clone()),
            thin_wrapper: f.thin_wrapper,
        }),
        _ => None,
    };
    AgentDiagnostics {
        role,
        function: function.to_string(),
        found,
        has_return,
        reason,
        code: src.map(|f| f.source.clone()).unwrap_or_default(),
        aux_usage,
    }
}

/// Runs the sliced tests and gathers the diagnostics of one joint action.
pub async fn analyze<R: CodeRunner>(
    completions: &[String],
    item: &serde_json::Value,
    runner: &R,
    opts: &AnalyzeOptions,
) -> Result<CodeDiagnostics, RewardError> {
    let prep = prepare(completions, item, &opts.score)?;
    let shown: Vec<ExtractedTest> = opts.sandbox_slice.apply(&prep.tests).to_vec();
    let anything = prep.aux.is_some() || prep.main.is_some();
    let report = if anything {
        Some(
            runner
                .run_tests(prep.program_tests(&shown, &opts.score))
                .await?,
        )
    } else {
        None
    };

    let mut agents = Vec::new();
    if prep.single_agent {
        agents.push(agent_diagnostics(
            AgentRole::Main,
            &prep.entry_point,
            &completions[0],
            &prep,
        ));
    } else {
        agents.push(agent_diagnostics(
            AgentRole::Aux,
            AUX_NAME,
            &completions[0],
            &prep,
        ));
        agents.push(agent_diagnostics(
            AgentRole::Main,
            &prep.entry_point,
            &completions[1],
            &prep,
        ));
    }

    let mut failures = Vec::new();
    let mut passed = 0;
    if let Some(r) = &report {
        passed = count_passed(r);
        for (i, t) in shown.iter().enumerate() {
            let outcome = r
                .tests
                .iter()
                .find(|o| o.index == i)
                .filter(|_| r.setup == SetupOutcome::Ok);
            match outcome {
                Some(o) if o.passed => {}
                Some(o) => failures.push(TestFailure {
                    assert: t.assert_text.clone(),
                    error_type: o.error_type.clone(),
                    message: o.message.clone(),
                    timed_out: o.timed_out,
                    not_run: false,
                }),
                None => failures.push(TestFailure {
                    assert: t.assert_text.clone(),
                    error_type: None,
                    message: None,
                    timed_out: false,
                    not_run: true,
                }),
            }
        }
    } else {
        failures.extend(shown.iter().map(|t| TestFailure {
            assert: t.assert_text.clone(),
            error_type: None,
            message: None,
            timed_out: false,
            not_run: true,
        }));
    }

    Ok(CodeDiagnostics {
        single_agent: prep.single_agent,
        entry_point: prep.entry_point.clone(),
        agents,
        syntax: report.as_ref().map(|r| r.syntax.clone()),
        setup: report.as_ref().map(|r| r.setup.clone()),
        tests: TestsSummary {
            passed,
            total: shown.len(),
            item_total: prep.tests.len(),
            timeouts: report.as_ref().map_or(0, |r| r.timeouts),
            stopped_after_timeouts: report.as_ref().is_some_and(|r| r.stopped_after_timeouts),
            failures,
        },
        program: prep.program.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_select_first_last_or_all() {
        let t = [1, 2, 3, 4];
        assert_eq!(TestSlice::from_int(2).apply(&t), &[1, 2]);
        assert_eq!(TestSlice::from_int(-1).apply(&t), &[4]);
        assert_eq!(TestSlice::from_int(0).apply(&t), &t);
        assert_eq!(TestSlice::from_int(10).apply(&t), &t);
        assert_eq!(TestSlice::from_int(-10).apply(&t), &t);
        assert_eq!(TestSlice::default().apply(&t), &[1]);
    }

    #[test]
    fn slices_deserialize_from_int_null_and_all() {
        let p = |s: &str| serde_json::from_str::<TestSlice>(s).unwrap();
        assert_eq!(p("3"), TestSlice::First(3));
        assert_eq!(p("-2"), TestSlice::Last(2));
        assert_eq!(p("0"), TestSlice::All);
        assert_eq!(p("null"), TestSlice::All);
        assert_eq!(p("\"all\""), TestSlice::All);
        assert!(serde_json::from_str::<TestSlice>("\"some\"").is_err());
        #[derive(Deserialize)]
        struct W {
            #[serde(default)]
            s: TestSlice,
        }
        assert_eq!(
            serde_json::from_str::<W>("{}").unwrap().s,
            TestSlice::First(1)
        );
        assert_eq!(
            serde_json::from_str::<W>(r#"{"s": null}"#).unwrap().s,
            TestSlice::All
        );
    }
}
