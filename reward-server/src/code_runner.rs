//! The contract between reward computation and the sandbox: run one program's definitions and
//! its test asserts in ONE sandboxed interpreter and report, per test, what happened.
//!
//! Rewards (`rewards::code`) only see these types; the sandbox (`sandbox`) implements
//! [`CodeRunner`]. Keeping the boundary here lets either side change without the other.

use serde::{Deserialize, Serialize};

/// One program and its tests, run in a single sandboxed interpreter.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProgramTests {
    /// Source executed once before the tests (imports + helper + entry point definitions).
    pub code: String,
    /// Each element is one test statement (typically one `assert ...` line), run separately.
    pub tests: Vec<String>,
    /// Time limit for each test statement (the original uses 10 s).
    pub per_test_timeout_secs: f64,
    /// Stop running further tests after this many timeouts (the original uses 3).
    pub max_timeouts: usize,
    /// Run a test of the form `assert f(args) == expected` as the original did: evaluate `f(args)`,
    /// then `expected`, then execute the whole assert (so `f` runs twice, which matters only for
    /// functions with side effects). False: each test statement runs once.
    #[serde(default)]
    pub double_call: bool,
}

/// Result of parsing the program (Python's own parser, inside the sandbox).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum SyntaxCheck {
    Ok,
    /// `SyntaxError` (or `IndentationError`, ...) with Python's message and 1-based position.
    Error {
        error_type: String,
        message: String,
        line: Option<u32>,
        column: Option<u32>,
    },
}

/// What happened when the definitions themselves were executed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum SetupOutcome {
    Ok,
    /// Not run because the syntax check failed.
    Skipped,
    Error {
        error_type: String,
        message: String,
    },
    TimedOut,
}

/// One test statement's outcome.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TestOutcome {
    /// Index into [`ProgramTests::tests`].
    pub index: usize,
    pub passed: bool,
    pub timed_out: bool,
    /// Python exception type name for a failure (`AssertionError`, `NameError`, ...).
    pub error_type: Option<String>,
    /// The exception's message (may be empty for a bare `AssertionError`).
    pub message: Option<String>,
}

/// The full report of one [`ProgramTests`] run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProgramReport {
    pub syntax: SyntaxCheck,
    pub setup: SetupOutcome,
    /// Outcomes of the tests that ran, in order; tests after the timeout limit are absent.
    pub tests: Vec<TestOutcome>,
    pub timeouts: usize,
    /// True if testing stopped early because `max_timeouts` was reached.
    pub stopped_after_timeouts: bool,
    /// Wall-clock time of the whole sandboxed run.
    pub wall_time_ms: u64,
}

/// Failure to run at all (as opposed to the program failing, which is a normal report).
#[derive(Debug, thiserror::Error)]
pub enum RunnerError {
    /// The bounded queue is full: callers should map this to RESOURCE_EXHAUSTED / HTTP 429.
    #[error("sandbox queue is full ({queued} waiting)")]
    Overloaded { queued: usize },
    /// The sandbox itself broke (could not start, harness output unreadable).
    #[error("sandbox failure: {0}")]
    Sandbox(String),
}

/// Runs programs with tests in isolation. Implemented by the bubblewrap sandbox.
pub trait CodeRunner: Send + Sync {
    fn run_tests(
        &self,
        program: ProgramTests,
    ) -> impl std::future::Future<Output = Result<ProgramReport, RunnerError>> + Send;
}
