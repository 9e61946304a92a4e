//! The Python harness run inside the sandbox (`harness/harness.py`, embedded at build time): the
//! job it reads on fd 3 and the event lines it writes on fd 4, turned back into typed results.

use serde::{Deserialize, Serialize};

use crate::code_runner::{ProgramReport, ProgramTests, SetupOutcome, SyntaxCheck, TestOutcome};

/// The harness source, written to a private file at start-up and mounted read-only.
pub const SOURCE: &str = include_str!("../../harness/harness.py");

/// The job the harness reads on fd 3.
#[derive(Debug, Serialize)]
#[serde(tag = "mode", rename_all = "snake_case")]
pub enum Job<'a> {
    Exec {
        code: &'a str,
        max_processes: Option<u32>,
    },
    Tests {
        code: &'a str,
        tests: &'a [String],
        per_test_timeout_secs: f64,
        setup_timeout_secs: f64,
        max_timeouts: usize,
        max_processes: Option<u32>,
        double_call: bool,
    },
}

/// One line the harness writes on fd 4.
#[derive(Debug, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
enum Event {
    Syntax {
        status: String,
        error_type: Option<String>,
        message: Option<String>,
        line: Option<u32>,
        column: Option<u32>,
    },
    Setup {
        status: String,
        error_type: Option<String>,
        message: Option<String>,
    },
    Test {
        index: usize,
        passed: bool,
        #[serde(default)]
        timed_out: bool,
        error_type: Option<String>,
        message: Option<String>,
    },
    Done {
        timeouts: usize,
        stopped_after_timeouts: bool,
        #[serde(default)]
        aborted: Option<String>,
    },
    Exit {
        exit_code: Option<i32>,
        signal: Option<i32>,
    },
}

fn events(raw: &[u8]) -> impl Iterator<Item = Event> + '_ {
    raw.split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .filter_map(|l| serde_json::from_slice::<Event>(l).ok())
}

/// How the program itself ended, according to the harness (exec mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProgramExit {
    Code(i32),
    Signal(i32),
}

/// The program's exit as the harness saw it, if it got to report it.
pub fn exec_exit(raw: &[u8]) -> Option<ProgramExit> {
    events(raw).find_map(|e| match e {
        Event::Exit {
            signal: Some(s), ..
        } => Some(ProgramExit::Signal(s)),
        Event::Exit {
            exit_code: Some(c), ..
        } => Some(ProgramExit::Code(c)),
        _ => None,
    })
}

/// Rebuilds the report from the harness's events. `None` if the harness never got as far as
/// the syntax check (the sandbox itself failed). When the events stop early (the run was
/// killed from outside), the report holds the outcomes so far; `cut_short` says why.
pub fn program_report(
    raw: &[u8],
    program: &ProgramTests,
    wall_time_ms: u64,
    cut_short: Option<&str>,
) -> Option<(ProgramReport, Option<String>)> {
    let mut syntax = None;
    let mut setup = None;
    let mut tests: Vec<TestOutcome> = Vec::new();
    let mut done = None;
    for event in events(raw) {
        match event {
            Event::Syntax {
                status,
                error_type,
                message,
                line,
                column,
            } => {
                syntax = Some(if status == "ok" {
                    SyntaxCheck::Ok
                } else {
                    SyntaxCheck::Error {
                        error_type: error_type.unwrap_or_else(|| "SyntaxError".into()),
                        message: message.unwrap_or_default(),
                        line,
                        column,
                    }
                });
            }
            Event::Setup {
                status,
                error_type,
                message,
            } => {
                setup = Some(match status.as_str() {
                    "ok" => SetupOutcome::Ok,
                    "skipped" => SetupOutcome::Skipped,
                    "timed_out" => SetupOutcome::TimedOut,
                    _ => SetupOutcome::Error {
                        error_type: error_type.unwrap_or_else(|| "Error".into()),
                        message: message.unwrap_or_default(),
                    },
                });
            }
            // Only accept outcomes in order, for tests that exist: anything else is not the
            // harness talking.
            Event::Test {
                index,
                passed,
                timed_out,
                error_type,
                message,
            } if index == tests.len() && index < program.tests.len() => {
                tests.push(TestOutcome {
                    index,
                    passed,
                    timed_out,
                    error_type,
                    message,
                });
            }
            Event::Done {
                timeouts,
                stopped_after_timeouts,
                aborted,
            } => {
                done = Some((timeouts, stopped_after_timeouts, aborted));
            }
            _ => {}
        }
    }
    let syntax = syntax?;
    let counted_timeouts = tests.iter().filter(|t| t.timed_out).count();
    let (timeouts, stopped, aborted) = match done {
        Some((t, s, a)) => (t, s, a),
        None => (
            counted_timeouts,
            false,
            Some(cut_short.unwrap_or("the harness stopped early").to_string()),
        ),
    };
    let setup = setup.unwrap_or(match (&syntax, cut_short) {
        (SyntaxCheck::Error { .. }, _) => SetupOutcome::Skipped,
        (_, Some(_)) => SetupOutcome::TimedOut,
        _ => SetupOutcome::Error {
            error_type: "SandboxError".into(),
            message: "the program ended before its definitions finished".into(),
        },
    });
    let report = ProgramReport {
        syntax,
        setup,
        tests,
        timeouts,
        stopped_after_timeouts: stopped,
        wall_time_ms,
    };
    Some((report, aborted))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn program(n: usize) -> ProgramTests {
        ProgramTests {
            code: String::new(),
            tests: (0..n).map(|i| format!("assert {i}")).collect(),
            per_test_timeout_secs: 1.0,
            max_timeouts: 3,
            double_call: false,
        }
    }

    #[test]
    fn out_of_order_or_unknown_test_events_are_ignored() {
        let raw = br#"{"event":"syntax","status":"ok"}
{"event":"setup","status":"ok"}
{"event":"test","index":1,"passed":true}
{"event":"test","index":0,"passed":false,"error_type":"AssertionError","message":""}
{"event":"test","index":0,"passed":true}
{"event":"test","index":7,"passed":true}
{"event":"done","timeouts":0,"stopped_after_timeouts":false}
"#;
        let (report, aborted) = program_report(raw, &program(2), 5, None).unwrap();
        assert_eq!(report.tests.len(), 1);
        assert!(!report.tests[0].passed);
        assert_eq!(aborted, None);
    }

    #[test]
    fn a_report_cut_short_keeps_the_outcomes_so_far() {
        let raw = br#"{"event":"syntax","status":"ok"}
{"event":"setup","status":"ok"}
{"event":"test","index":0,"passed":true}
{"event":"test","index":1,"passed":false,"timed_out":true,"error_type":"TimeoutError","message":"x"}"#;
        let (report, aborted) = program_report(raw, &program(3), 5, Some("wall timeout")).unwrap();
        assert_eq!(report.tests.len(), 2);
        assert_eq!(report.timeouts, 1);
        assert_eq!(aborted.as_deref(), Some("wall timeout"));
        assert!(program_report(b"garbage", &program(1), 5, None).is_none());
    }
}
