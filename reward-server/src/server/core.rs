//! What the service does, independent of the wire: score, analyze, execute. The gRPC and HTTP
//! adapters only translate requests into these calls and results back.

use std::sync::Arc;
use std::time::Instant;

use futures::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};

use super::error::ApiError;
use super::metrics::Metrics;
use crate::code_runner::{CodeRunner, ProgramReport, ProgramTests, RunnerError};
use crate::rewards::{
    self, Analysis, AnalyzeOptions, RewardError, ScoreOptions, ScoreResult, TaskKind,
};
use crate::sandbox::{BwrapSandbox, ExecLimits, ExecOutcome, ExecStatus};

/// One joint action: one completion per agent and the dataset row.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JointAction {
    pub completions: Vec<String>,
    pub item: serde_json::Value,
}

/// A scored joint action.
#[derive(Debug, Clone, Serialize)]
pub struct Scored {
    #[serde(flatten)]
    pub result: ScoreResult,
    pub elapsed_ms: u64,
}

/// An analysed joint action.
#[derive(Debug, Clone, Serialize)]
pub struct Analyzed {
    #[serde(flatten)]
    pub analysis: Analysis,
    pub elapsed_ms: u64,
}

/// Counts every sandboxed test run by outcome, then passes it on.
struct MeteredRunner<'a> {
    sandbox: &'a BwrapSandbox,
    metrics: &'a Metrics,
}

impl CodeRunner for MeteredRunner<'_> {
    async fn run_tests(&self, program: ProgramTests) -> Result<ProgramReport, RunnerError> {
        let result = self.sandbox.run_tests(program).await;
        let outcome = match &result {
            Ok(r) if r.stopped_after_timeouts => "stopped_after_timeouts",
            Ok(r) if r.timeouts > 0 => "some_timeouts",
            Ok(_) => "report",
            Err(RunnerError::Overloaded { .. }) => "overloaded",
            Err(RunnerError::Sandbox(_)) => "sandbox_error",
        };
        self.metrics.observe_sandbox("tests", outcome);
        result
    }
}

pub struct RewardApi {
    pub sandbox: BwrapSandbox,
    pub metrics: Arc<Metrics>,
    /// The learned verifier's rollout worker (`--verifier-endpoint`), if any.
    pub verifier: Option<super::verifier::VerifierClient>,
}

fn parse_task(task: &str) -> Result<TaskKind, ApiError> {
    task.parse::<TaskKind>()
        .map_err(|e| ApiError::from_reward(e, ""))
}

/// Options from an optional JSON object; `null`/absent = defaults.
pub fn parse_options<T: serde::de::DeserializeOwned + Default>(
    options: Option<serde_json::Value>,
) -> Result<T, ApiError> {
    match options {
        None | Some(serde_json::Value::Null) => Ok(T::default()),
        Some(v) => {
            serde_json::from_value(v).map_err(|e| ApiError::invalid("options", e.to_string()))
        }
    }
}

impl RewardApi {
    pub fn new(sandbox: BwrapSandbox, metrics: Arc<Metrics>) -> Self {
        Self {
            sandbox,
            metrics,
            verifier: None,
        }
    }

    /// Scores (user, assistant) conversations with the learned verifier.
    pub async fn verify(
        &self,
        name: &str,
        conversations: Vec<(String, String)>,
    ) -> Result<(String, Vec<f32>), ApiError> {
        if conversations.is_empty() {
            return Err(ApiError::invalid("conversations", "must not be empty"));
        }
        let client = self.verifier.as_ref().ok_or_else(|| {
            ApiError::Unavailable("no verifier is configured: start reward-server with --verifier-endpoint URL (a rollout worker serving --verifier NAME=DIR)".into())
        })?;
        client.score(name, conversations).await
    }

    /// How many joint actions of one request are worked on at once: enough to fill the
    /// sandbox, without one big batch taking the whole queue.
    fn batch_concurrency(&self) -> usize {
        self.sandbox.max_concurrency().max(1)
    }

    /// Scores one joint action (no metrics of its own).
    pub async fn score_one(
        &self,
        task: TaskKind,
        completions: &[String],
        item: &serde_json::Value,
        opts: &ScoreOptions,
    ) -> Result<ScoreResult, RewardError> {
        let runner = MeteredRunner {
            sandbox: &self.sandbox,
            metrics: &self.metrics,
        };
        rewards::score(task, completions, item, &runner, opts).await
    }

    /// Scores a batch of joint actions of one task; results in request order. Errors name the
    /// action as `{list_name}[i]` (the request's own field name).
    pub async fn score(
        &self,
        task: &str,
        actions: Vec<JointAction>,
        options: Option<serde_json::Value>,
        list_name: &str,
    ) -> Result<Vec<Scored>, ApiError> {
        let task = parse_task(task)?;
        let opts: ScoreOptions = parse_options(options)?;
        futures::stream::iter(actions.into_iter().enumerate())
            .map(|(i, action)| {
                let opts = &opts;
                async move {
                    let started = Instant::now();
                    let result = self
                        .score_one(task, &action.completions, &action.item, opts)
                        .await
                        .map_err(|e| ApiError::from_reward(e, &format!("{list_name}[{i}]")))?;
                    Ok::<_, ApiError>(Scored {
                        result,
                        elapsed_ms: started.elapsed().as_millis() as u64,
                    })
                }
            })
            .buffered(self.batch_concurrency())
            .try_collect()
            .await
    }

    /// Diagnoses a batch of code joint actions; results in request order.
    pub async fn analyze(
        &self,
        task: &str,
        actions: Vec<JointAction>,
        options: Option<serde_json::Value>,
        list_name: &str,
    ) -> Result<Vec<Analyzed>, ApiError> {
        let task = parse_task(task)?;
        let opts: AnalyzeOptions = parse_options(options)?;
        let runner = MeteredRunner {
            sandbox: &self.sandbox,
            metrics: &self.metrics,
        };
        futures::stream::iter(actions.into_iter().enumerate())
            .map(|(i, action)| {
                let (opts, runner) = (&opts, &runner);
                async move {
                    let started = Instant::now();
                    let analysis =
                        rewards::analyze(task, &action.completions, &action.item, runner, opts)
                            .await
                            .map_err(|e| ApiError::from_reward(e, &format!("{list_name}[{i}]")))?;
                    Ok::<_, ApiError>(Analyzed {
                        analysis,
                        elapsed_ms: started.elapsed().as_millis() as u64,
                    })
                }
            })
            .buffered(self.batch_concurrency())
            .try_collect()
            .await
    }

    /// Runs one program in the sandbox. Limits may only lower the server's policy.
    pub async fn execute(
        &self,
        code: &str,
        stdin: Option<&str>,
        timeout_secs: Option<f64>,
        memory_mb: Option<u64>,
    ) -> Result<ExecOutcome, ApiError> {
        let wall_timeout_ms = match timeout_secs {
            None => None,
            Some(t) if t.is_finite() && t > 0.0 => Some((t * 1000.0).ceil() as u64),
            Some(t) => {
                return Err(ApiError::invalid(
                    "timeout_secs",
                    format!("must be a positive number, got {t}"),
                ));
            }
        };
        let limits = ExecLimits {
            wall_timeout_ms,
            memory_mb,
        };
        let result = self
            .sandbox
            .execute(code, stdin.map(str::as_bytes), &limits)
            .await;
        let outcome = match &result {
            Ok(o) => match o.status {
                ExecStatus::Finished { .. } => "finished",
                ExecStatus::Killed { .. } => "killed",
                ExecStatus::CpuTimeExceeded { .. } => "cpu_time_exceeded",
                ExecStatus::TimedOut { .. } => "timed_out",
                ExecStatus::OutputLimit { .. } => "output_limit",
            },
            Err(RunnerError::Overloaded { .. }) => "overloaded",
            Err(RunnerError::Sandbox(_)) => "sandbox_error",
        };
        self.metrics.observe_sandbox("exec", outcome);
        Ok(result?)
    }
}
