//! Every seed task's reward, with its level breakdown, and the code diagnostics behind the
//! multi-turn feedback modes (the definitions are in `shared/spec/rewards.md`).
//!
//! [`score`] is the one entry point the server calls: a task kind, one completion per agent and
//! the dataset row. Code tasks run their program through a [`CodeRunner`] exactly once per joint
//! action; every other task is pure. [`analyze`] gives the structured diagnostics of a code joint
//! action and, on request, the feedback text of one mode ([`feedback`]).
//!
//! Each task family lives in its own module: [`code`] (HumanEval, CoopHumanEval, MBPP),
//! [`writing`] (arXiv expansion, TLDR, the single-agent split), [`gsm8k`] and [`anli`].

pub mod anli;
pub mod code;
pub mod feedback;
pub mod gsm8k;
pub mod writing;

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::code_runner::{CodeRunner, RunnerError};

pub use code::diagnostics::{CodeDiagnostics, TestSlice};
/// The scoring options are defined in `cotrain-proto`, beside the protocol that carries them, so
/// that the learner's config can name them without depending on this crate's internals.
pub use cotrain_proto::reward_options::{CodeFunctions, CodeTests, ScoreOptions};
pub use feedback::FeedbackMode;
pub use writing::ArxivRatioVersion;

/// The task families the server scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum TaskKind {
    /// HumanEval-schema code (HumanEval, CoopHumanEval, MBPP): one completion = single agent,
    /// two = (aux, main).
    Code,
    /// arXiv abstract expansion: two completions, or one for the single-agent split.
    Arxiv,
    /// TLDR summarisation: two completions, or one for the single-agent split.
    Tldr,
    /// GSM8K: one completion, item with `answer`.
    Gsm8k,
    /// ANLI: one completion, item with `label`.
    Anli,
}

impl TaskKind {
    /// The canonical name (what [`fmt::Display`] prints and the API returns).
    pub fn as_str(self) -> &'static str {
        match self {
            TaskKind::Code => "code",
            TaskKind::Arxiv => "arxiv",
            TaskKind::Tldr => "tldr",
            TaskKind::Gsm8k => "gsm8k",
            TaskKind::Anli => "anli",
        }
    }
}

impl fmt::Display for TaskKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for TaskKind {
    type Err = RewardError;

    /// Canonical names plus the explicit dataset aliases of the code family; case-insensitive.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "code" | "humaneval" | "coophumaneval" | "mbpp" => Ok(TaskKind::Code),
            "arxiv" => Ok(TaskKind::Arxiv),
            "tldr" => Ok(TaskKind::Tldr),
            "gsm8k" => Ok(TaskKind::Gsm8k),
            "anli" => Ok(TaskKind::Anli),
            _ => Err(RewardError::UnknownTask {
                task: s.to_string(),
            }),
        }
    }
}

impl TryFrom<String> for TaskKind {
    type Error = RewardError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<TaskKind> for String {
    fn from(t: TaskKind) -> String {
        t.as_str().to_string()
    }
}

/// The score of one joint action.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScoreResult {
    /// Total reward (the sum of the levels).
    pub reward: f64,
    /// Reward contributed by each level that was reached (`level_1`, `level_2`, ...); levels
    /// after a STOP are present with 0.0 so that every result of a task has the same keys.
    pub levels: BTreeMap<String, f64>,
    /// Task-specific measurements (tests passed, ratios, parsed answers, where it stopped, ...).
    pub details: serde_json::Value,
}

/// Options of one analysis call.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AnalyzeOptions {
    /// Which tests are run and shown (`external.sandbox_slice`).
    pub sandbox_slice: TestSlice,
    /// If set, the feedback text of this mode is built for every agent.
    pub feedback_mode: Option<FeedbackMode>,
    /// Code pre-processing and sandbox options (as for scoring).
    pub score: ScoreOptions,
}

/// Diagnostics of one code joint action, and optionally the per-agent feedback text.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Analysis {
    pub diagnostics: CodeDiagnostics,
    /// One text per agent (in completion order) when a feedback mode was requested.
    pub feedback: Option<Vec<String>>,
}

/// Why a request cannot be scored. Everything except [`RewardError::Runner`] is the caller's
/// fault (HTTP 400 / INVALID_ARGUMENT); [`RewardError::field`] names the offending field.
#[derive(Debug, thiserror::Error)]
pub enum RewardError {
    /// The task name is not one of the known kinds.
    #[error(
        "unknown task `{task}` (expected code, humaneval, coophumaneval, mbpp, arxiv, tldr, gsm8k or anli)"
    )]
    UnknownTask { task: String },
    /// The dataset item lacks a field the task needs.
    #[error("item is missing field `{field}` required by task {task}")]
    MissingField { task: TaskKind, field: &'static str },
    /// A field of the item has the wrong type or an unusable value.
    #[error("item field `{field}` is invalid: {reason}")]
    InvalidField { field: &'static str, reason: String },
    /// The number of completions does not fit the task.
    #[error("task {task} takes {expected} completion(s), got {got}")]
    WrongCompletionCount {
        task: TaskKind,
        expected: &'static str,
        got: usize,
    },
    /// An option has an unusable value.
    #[error("option `{field}` is invalid: {reason}")]
    InvalidOption { field: &'static str, reason: String },
    /// Analysis (diagnostics) exists only for code tasks.
    #[error("analyze is only defined for code tasks, not {task}")]
    AnalyzeUnsupported { task: TaskKind },
    /// The sandbox could not run the program (overload or sandbox failure, not a program error).
    #[error(transparent)]
    Runner(#[from] RunnerError),
}

impl RewardError {
    /// The request field at fault, for the server's error message (`item.test`, `completions`,
    /// `task`, `options.max_timeouts`).
    pub fn field(&self) -> Option<String> {
        match self {
            RewardError::UnknownTask { .. } | RewardError::AnalyzeUnsupported { .. } => {
                Some("task".to_string())
            }
            RewardError::MissingField { field, .. } | RewardError::InvalidField { field, .. } => {
                Some(format!("item.{field}"))
            }
            RewardError::WrongCompletionCount { .. } => Some("completions".to_string()),
            RewardError::InvalidOption { field, .. } => Some(format!("options.{field}")),
            RewardError::Runner(_) => None,
        }
    }

    /// True if the request itself is wrong (as opposed to the sandbox failing or being full).
    pub fn is_client_error(&self) -> bool {
        !matches!(self, RewardError::Runner(_))
    }
}

/// A string field of the item.
pub(crate) fn item_str<'a>(
    task: TaskKind,
    item: &'a serde_json::Value,
    field: &'static str,
) -> Result<&'a str, RewardError> {
    match item.get(field) {
        None | Some(serde_json::Value::Null) => Err(RewardError::MissingField { task, field }),
        Some(serde_json::Value::String(s)) => Ok(s),
        Some(other) => Err(RewardError::InvalidField {
            field,
            reason: format!("expected a string, got {}", json_type(other)),
        }),
    }
}

pub(crate) fn json_type(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

fn check_options(opts: &ScoreOptions) -> Result<(), RewardError> {
    if !(opts.per_test_timeout_secs.is_finite() && opts.per_test_timeout_secs > 0.0) {
        return Err(RewardError::InvalidOption {
            field: "per_test_timeout_secs",
            reason: format!(
                "must be a positive number of seconds, got {}",
                opts.per_test_timeout_secs
            ),
        });
    }
    if opts.max_timeouts == 0 {
        return Err(RewardError::InvalidOption {
            field: "max_timeouts",
            reason: "must be at least 1".to_string(),
        });
    }
    Ok(())
}

/// Scores one joint action of `task` on dataset row `item`.
pub async fn score<R: CodeRunner>(
    task: TaskKind,
    completions: &[String],
    item: &serde_json::Value,
    runner: &R,
    opts: &ScoreOptions,
) -> Result<ScoreResult, RewardError> {
    check_options(opts)?;
    match task {
        TaskKind::Code => code::score(completions, item, runner, opts).await,
        TaskKind::Arxiv | TaskKind::Tldr => writing::score(task, completions, opts),
        TaskKind::Gsm8k => gsm8k::score(completions, item),
        TaskKind::Anli => anli::score(completions, item),
    }
}

/// Diagnoses one code joint action (the `Analyze` RPC): definitions found, syntax, the sliced
/// tests' outcomes, aux usage; with the feedback text of `opts.feedback_mode` if set.
pub async fn analyze<R: CodeRunner>(
    task: TaskKind,
    completions: &[String],
    item: &serde_json::Value,
    runner: &R,
    opts: &AnalyzeOptions,
) -> Result<Analysis, RewardError> {
    check_options(&opts.score)?;
    if task != TaskKind::Code {
        return Err(RewardError::AnalyzeUnsupported { task });
    }
    let diagnostics = code::diagnostics::analyze(completions, item, runner, opts).await?;
    let feedback = opts.feedback_mode.map(|mode| {
        (0..diagnostics.agents.len())
            .map(|agent| {
                feedback::render(
                    mode,
                    &diagnostics,
                    agent,
                    &feedback::FeedbackContext::default(),
                )
            })
            .collect()
    });
    Ok(Analysis {
        diagnostics,
        feedback,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn task_kinds_parse_with_aliases_and_reject_unknown_names() {
        assert_eq!("HumanEval".parse::<TaskKind>().unwrap(), TaskKind::Code);
        assert_eq!("coophumaneval".parse::<TaskKind>().unwrap(), TaskKind::Code);
        assert_eq!("mbpp".parse::<TaskKind>().unwrap(), TaskKind::Code);
        assert_eq!("tldr".parse::<TaskKind>().unwrap(), TaskKind::Tldr);
        let err = "poetry".parse::<TaskKind>().unwrap_err();
        assert_eq!(err.field().as_deref(), Some("task"));
        assert!(err.to_string().contains("poetry"));
        let t: TaskKind = serde_json::from_str("\"gsm8k\"").unwrap();
        assert_eq!(t, TaskKind::Gsm8k);
        assert_eq!(serde_json::to_string(&TaskKind::Anli).unwrap(), "\"anli\"");
    }

    #[test]
    fn options_deserialize_with_defaults_and_reject_unknown_keys() {
        let o: ScoreOptions = serde_json::from_str(r#"{"split_seed": 7}"#).unwrap();
        assert_eq!(o.split_seed, 7);
        assert_eq!(o.max_timeouts, 3);
        assert_eq!(o.per_test_timeout_secs, 10.0);
        assert!(serde_json::from_str::<ScoreOptions>(r#"{"max_timeout": 3}"#).is_err());
    }
}
