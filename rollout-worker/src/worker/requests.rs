//! Generate requests: validation, prompt encoding, admission (the bound on requests in flight) and
//! the hand-off to the agent's engine loop, answered whole or streamed token by token.

use std::sync::atomic::{AtomicUsize, Ordering};

use cotrain_model::engine::Request;
use tokio::sync::{mpsc, oneshot};

use super::slot::ModelSlot;
use super::{
    CompletionOutput, GenerateJob, GenerateOutput, MAX_TEMPERATURE, PromptInput, SampleOutput,
    StreamToken, Worker, prompt_seed,
};
use crate::batcher::{Command, JobOutput};
use crate::error::{Result, WorkerError};
use crate::metrics::Metrics;

impl Worker {
    /// The token ids of every prompt of `job`, as generation encodes them, after the checks
    /// generation makes first (errors name the field as generation's do). A streamed answer reads
    /// them before the first token.
    pub fn encode_prompts(&self, job: &GenerateJob) -> Result<Vec<Vec<u32>>> {
        let slot = self.slot(&job.agent)?;
        self.validate(job)?;
        job.prompts
            .iter()
            .enumerate()
            .map(|(i, p)| self.encode(slot, p, &format!("prompts[{i}]")))
            .collect()
    }

    /// Renders and tokenises one prompt, checking it against the model. `field` names it in errors.
    fn encode(&self, slot: &ModelSlot, prompt: &PromptInput, field: &str) -> Result<Vec<u32>> {
        let ids = match prompt {
            PromptInput::Text(t) => {
                if t.is_empty() {
                    return Err(WorkerError::invalid(field, "empty prompt"));
                }
                slot.tokenizer
                    .encode(t, true)
                    .map_err(|e| WorkerError::invalid(field, e.to_string()))?
            }
            PromptInput::Chat(messages) => {
                if messages.is_empty() {
                    return Err(WorkerError::invalid(field, "no chat messages"));
                }
                let Some(template) = &slot.chat_template else {
                    return Err(WorkerError::invalid(
                        field,
                        format!("model `{}` has no chat template", slot.id),
                    ));
                };
                let text = template
                    .render(messages, true, &serde_json::Value::Null)
                    .map_err(|e| WorkerError::invalid(field, format!("chat template: {e}")))?;
                // The template writes any BOS it wants.
                slot.tokenizer
                    .encode(&text, false)
                    .map_err(|e| WorkerError::invalid(field, e.to_string()))?
            }
            PromptInput::Tokens(ids) => ids.clone(),
        };
        if ids.is_empty() {
            return Err(WorkerError::invalid(field, "empty prompt"));
        }
        if ids.len() >= slot.context_length {
            return Err(WorkerError::invalid(
                field,
                format!(
                    "prompt of {} tokens leaves no room in the model's context of {} tokens",
                    ids.len(),
                    slot.context_length
                ),
            ));
        }
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= slot.vocab_size) {
            return Err(WorkerError::invalid(
                field,
                format!(
                    "token id {bad} is outside the vocabulary of {}",
                    slot.vocab_size
                ),
            ));
        }
        Ok(ids)
    }

    fn validate(&self, job: &GenerateJob) -> Result<()> {
        let s = &job.sampling;
        if !(s.temperature.is_finite() && (0.0..=MAX_TEMPERATURE).contains(&s.temperature)) {
            return Err(WorkerError::invalid(
                "sampling.temperature",
                format!("{} is not in [0, {MAX_TEMPERATURE}]", s.temperature),
            ));
        }
        if !(s.top_p > 0.0 && s.top_p <= 1.0) {
            return Err(WorkerError::invalid(
                "sampling.top_p",
                format!("{} is not in (0, 1]", s.top_p),
            ));
        }
        if !(s.min_p >= 0.0 && s.min_p < 1.0) {
            return Err(WorkerError::invalid(
                "sampling.min_p",
                format!("{} is not in [0, 1)", s.min_p),
            ));
        }
        if job.stop.max_new_tokens == 0 {
            return Err(WorkerError::invalid(
                "sampling.max_new_tokens",
                "must be at least 1",
            ));
        }
        if job.n == 0 || job.n > self.config.max_batch_size {
            return Err(WorkerError::invalid(
                "n",
                format!(
                    "{} is not in [1, {}] (the batch size)",
                    job.n, self.config.max_batch_size
                ),
            ));
        }
        if job.prompts.is_empty() {
            return Err(WorkerError::invalid("prompts", "no prompts"));
        }
        if job.stop.stop_strings.iter().any(String::is_empty) {
            return Err(WorkerError::invalid(
                "stop.stop_strings",
                "empty stop string",
            ));
        }
        Ok(())
    }

    /// Samples `n` completions of every prompt of `job` on `job.agent`'s model. Dropping the
    /// returned future cancels the job's sequences.
    pub async fn generate(&self, job: GenerateJob) -> Result<GenerateOutput> {
        self.generate_streaming(job, None).await
    }

    /// [`Worker::generate`], sending each token to `stream` as the engine produces it (for
    /// server-sent events); the returned output is the same as without a stream.
    pub async fn generate_streaming(
        &self,
        job: GenerateJob,
        stream: Option<mpsc::UnboundedSender<StreamToken>>,
    ) -> Result<GenerateOutput> {
        let slot = self.slot(&job.agent)?;
        self.validate(&job)?;
        if let Some(&bad) = job
            .stop
            .stop_token_ids
            .iter()
            .find(|&&t| t as usize >= slot.vocab_size)
        {
            return Err(WorkerError::invalid(
                "stop.stop_token_ids",
                format!("token id {bad} is outside the vocabulary"),
            ));
        }
        let prompts: Vec<Vec<u32>> = job
            .prompts
            .iter()
            .enumerate()
            .map(|(i, p)| self.encode(slot, p, &format!("prompts[{i}]")))
            .collect::<Result<_>>()?;
        let rows = job.n * prompts.len();
        if rows > self.config.max_batch_size * 64 {
            return Err(WorkerError::invalid(
                "prompts",
                format!("{rows} sequences in one request is too many"),
            ));
        }
        if let Some(min) = job.min_policy_version {
            let current = slot.version_of(&job.agent);
            if current < min {
                return Err(WorkerError::StalePolicy {
                    agent: job.agent.clone(),
                    current,
                    required: min,
                });
            }
        }
        let _admitted = Admission::try_new(
            &self.in_flight,
            self.config.max_queued_requests,
            &self.metrics,
        )?;
        let requests: Vec<Request> = prompts
            .iter()
            .enumerate()
            .map(|(i, ids)| Request {
                prompt: ids.clone(),
                n: job.n,
                params: job.sampling,
                seed: prompt_seed(job.seed, i),
                stop: job.stop.clone(),
                logprobs: job.logprobs,
                top_logprobs: job.top_logprobs,
            })
            .collect();
        let id = self.next_job.fetch_add(1, Ordering::Relaxed);
        let (reply, rx) = oneshot::channel();
        slot.tx
            .send(Command::Submit {
                id,
                requests,
                adapter: slot.adapter_id(&job.agent),
                reply,
                stream,
            })
            .map_err(|_| WorkerError::Unavailable("engine loop stopped".into()))?;
        let cancel = CancelOnDrop {
            tx: &slot.tx,
            id,
            armed: true,
        };
        let out: JobOutput = rx
            .await
            .map_err(|_| WorkerError::Unavailable("engine loop stopped".into()))??;
        cancel.disarm();
        let completions = out
            .samples
            .into_iter()
            .zip(prompts)
            .map(|(samples, prompt_token_ids)| CompletionOutput {
                prompt_token_ids,
                samples: samples
                    .into_iter()
                    .map(|s| SampleOutput {
                        token_ids: s.token_ids,
                        text: s.text,
                        logprobs: s.logprobs,
                        top_logprobs: s.top_logprobs,
                        finish_reason: s.finish_reason,
                        policy_version: out.policy_version,
                    })
                    .collect(),
            })
            .collect();
        Ok(GenerateOutput {
            model: slot.id.clone(),
            completions,
        })
    }
}

/// Counts one admitted request; refuses beyond the bound.
struct Admission<'a> {
    count: &'a AtomicUsize,
    metrics: &'a Metrics,
}

impl<'a> Admission<'a> {
    fn try_new(count: &'a AtomicUsize, max: usize, metrics: &'a Metrics) -> Result<Self> {
        let prev = count.fetch_add(1, Ordering::SeqCst);
        if prev >= max {
            count.fetch_sub(1, Ordering::SeqCst);
            return Err(WorkerError::Overloaded { queued: prev, max });
        }
        metrics.in_flight_requests.set((prev + 1) as i64);
        Ok(Self { count, metrics })
    }
}

impl Drop for Admission<'_> {
    fn drop(&mut self) {
        let now = self.count.fetch_sub(1, Ordering::SeqCst) - 1;
        self.metrics.in_flight_requests.set(now as i64);
    }
}

/// Tells the engine loop to drop a job whose caller went away before the answer.
struct CancelOnDrop<'a> {
    tx: &'a mpsc::UnboundedSender<Command>,
    id: u64,
    armed: bool,
}

impl CancelOnDrop<'_> {
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for CancelOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.tx.send(Command::Cancel { id: self.id });
        }
    }
}
