//! Server-sent-event streaming for `/v1/chat/completions` and `/v1/completions` (`"stream": true`),
//! in OpenAI's chunk shapes: one chunk per generated token as the engine produces it, then one
//! chunk per choice with its `finish_reason`, an optional usage chunk
//! (`stream_options.include_usage`), and `data: [DONE]`.
//!
//! Text is released as the tokens complete characters. With stop strings, the last
//! `longest stop string − 1` bytes are held back until they cannot start a stop string, and a token
//! that completes one releases only the text before it (the engine reports a token before checking
//! it), so that a client never receives text the final answer cuts; the finish chunk releases the
//! rest.
//! With `return_token_ids` each token chunk carries its `token_ids`, and the first chunk of each
//! choice its prompt's `prompt_token_ids` (chat: on the chunk, as vLLM streams it; completions: on
//! the choice), as the unstreamed answers carry them.
//!
//! An error before the first token is an ordinary OpenAI error response (400, 404, 503, ...);
//! one after it is a final `data: {"error": ...}` event.

use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use cotrain_model::tokenizer::{IncrementalDecoder, Tokenizer};
use futures::StreamExt;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::logprobs::{chat_entry, completion_logprobs};
use super::{ApiError, usage};
use crate::error::WorkerError;
use crate::worker::{GenerateJob, GenerateOutput, PromptInput, StreamToken, Worker};

/// Which endpoint's chunks to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Shape {
    Chat,
    Completion,
}

/// What a streamed response carries besides the text.
pub(super) struct StreamSpec {
    pub shape: Shape,
    pub id: String,
    pub created: u64,
    pub agent: String,
    /// Samples per prompt.
    pub n: usize,
    /// Log-probs in every chunk.
    pub logprobs: bool,
    /// The sampled token ids in every chunk (vLLM's `return_token_ids`).
    pub token_ids: bool,
    /// A last chunk with the usage (`stream_options.include_usage`).
    pub include_usage: bool,
}

impl StreamSpec {
    /// A worker error as this endpoint names its fields.
    fn error(&self, e: WorkerError) -> ApiError {
        match self.shape {
            Shape::Chat => super::chat_error(e),
            Shape::Completion => e.into(),
        }
    }
}

/// One choice's text so far.
struct ChoiceText {
    decoder: IncrementalDecoder,
    /// Bytes of the decoder's text already sent.
    sent: usize,
    started: bool,
    /// Characters of the token strings so far (the completions endpoint's `text_offset`).
    token_chars: usize,
}

/// Turns token events and the final output into chunks.
struct Chunks<'a> {
    spec: &'a StreamSpec,
    tok: &'a Tokenizer,
    /// Each prompt's token ids (sent with `return_token_ids`).
    prompt_ids: Vec<Vec<u32>>,
    /// Bytes held back for stop strings: the longest one's length − 1.
    hold: usize,
    stops: Vec<String>,
    choices: Vec<ChoiceText>,
}

impl<'a> Chunks<'a> {
    fn new(
        spec: &'a StreamSpec,
        tok: &'a Tokenizer,
        job: &GenerateJob,
        prompt_ids: Vec<Vec<u32>>,
    ) -> Self {
        let hold = job
            .stop
            .stop_strings
            .iter()
            .map(String::len)
            .max()
            .unwrap_or(1)
            .saturating_sub(1);
        let choices = (0..job.prompts.len() * job.n)
            .map(|_| ChoiceText {
                decoder: IncrementalDecoder::new(true),
                sent: 0,
                started: false,
                token_chars: 0,
            })
            .collect();
        Self {
            spec,
            tok,
            prompt_ids,
            hold,
            stops: job.stop.stop_strings.clone(),
            choices,
        }
    }

    fn object(&self) -> &'static str {
        match self.spec.shape {
            Shape::Chat => "chat.completion.chunk",
            Shape::Completion => "text_completion",
        }
    }

    fn body(&self, choices: Vec<Value>) -> Value {
        json!({"id": self.spec.id, "object": self.object(), "created": self.spec.created, "model": self.spec.agent, "choices": choices})
    }

    fn chunk(&self, choices: Vec<Value>) -> Event {
        Event::default().data(self.body(choices).to_string())
    }

    /// The chunks of one generated token: chat's role chunk first for a new choice, then the
    /// text it releases with its log-prob and id.
    fn token(&mut self, t: &StreamToken) -> Vec<Event> {
        let index = t.prompt * self.spec.n + t.index;
        let mut events = Vec::new();
        let Some(choice) = self.choices.get_mut(index) else {
            return events;
        };
        let first = !choice.started;
        let prompt_ids = (first && self.spec.token_ids)
            .then(|| json!(self.prompt_ids.get(t.prompt).cloned().unwrap_or_default()));
        if first && self.spec.shape == Shape::Chat {
            let role = json!({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": Value::Null, "finish_reason": Value::Null});
            let mut body = self.body(vec![role]);
            if let Some(ids) = &prompt_ids {
                body["prompt_token_ids"] = ids.clone();
            }
            events.push(Event::default().data(body.to_string()));
        }
        let choice = &mut self.choices[index];
        choice.started = true;
        // A tokenizer error leaves the text for the finish chunk, which sends the final answer's.
        let _ = choice.decoder.push(self.tok, t.token);
        let text = choice.decoder.text();
        // A stop string this token completes starts at or after `sent` (everything before it was
        // held back by `hold`): the answer ends there.
        let stop_at = self
            .stops
            .iter()
            .filter_map(|s| {
                text.get(choice.sent..)?
                    .find(s.as_str())
                    .map(|p| choice.sent + p)
            })
            .min();
        let mut until = stop_at
            .unwrap_or_else(|| text.len().saturating_sub(self.hold))
            .max(choice.sent);
        while until > choice.sent && !text.is_char_boundary(until) {
            until -= 1;
        }
        let delta = text.get(choice.sent..until).unwrap_or_default().to_string();
        choice.sent = until;
        let offset = choice.token_chars;
        // `text_offset` (legacy completions' log-probs) counts the characters of the tokens so far.
        if self.spec.logprobs {
            choice.token_chars += String::from_utf8_lossy(&self.tok.token_bytes(t.token))
                .chars()
                .count();
        }
        let mut c = match self.spec.shape {
            Shape::Chat => json!({
                "index": index,
                "delta": {"content": delta},
                "logprobs": if self.spec.logprobs { json!({"content": [chat_entry(self.tok, t.token, t.logprob, &t.top)], "refusal": Value::Null}) } else { Value::Null },
                "finish_reason": Value::Null,
            }),
            Shape::Completion => json!({
                "index": index,
                "text": delta,
                "logprobs": if self.spec.logprobs { completion_logprobs(self.tok, &[t.token], &[t.logprob], std::slice::from_ref(&t.top), offset) } else { Value::Null },
                "finish_reason": Value::Null,
            }),
        };
        if self.spec.token_ids {
            c["token_ids"] = json!([t.token]);
        }
        if let (Some(ids), Shape::Completion) = (prompt_ids, self.spec.shape) {
            c["prompt_token_ids"] = ids;
        }
        events.push(self.chunk(vec![c]));
        events
    }

    /// Each choice's last chunk (the text still held back and the finish reason), the usage chunk
    /// when asked for, and `[DONE]`.
    fn finish(&mut self, out: &GenerateOutput) -> Vec<Event> {
        let mut events = Vec::new();
        for (p, completion) in out.completions.iter().enumerate() {
            for (i, s) in completion.samples.iter().enumerate() {
                let index = p * self.spec.n + i;
                let Some(choice) = self.choices.get(index) else {
                    continue;
                };
                // The final text is the decoder's, cut before a stop string: what was sent is its prefix.
                let rest = s.text.get(choice.sent..).unwrap_or_default().to_string();
                let c = match self.spec.shape {
                    Shape::Chat => {
                        json!({"index": index, "delta": if rest.is_empty() { json!({}) } else { json!({"content": rest}) }, "logprobs": Value::Null, "finish_reason": s.finish_reason.as_str(), "policy_version": s.policy_version})
                    }
                    Shape::Completion => {
                        json!({"index": index, "text": rest, "logprobs": Value::Null, "finish_reason": s.finish_reason.as_str(), "policy_version": s.policy_version})
                    }
                };
                events.push(self.chunk(vec![c]));
            }
        }
        if self.spec.include_usage {
            let body = json!({"id": self.spec.id, "object": self.object(), "created": self.spec.created, "model": self.spec.agent, "choices": [], "usage": usage(out)});
            events.push(Event::default().data(body.to_string()));
        }
        events.push(Event::default().data("[DONE]"));
        events
    }
}

/// Runs `job` and answers with its stream; see the module docs.
pub(super) async fn respond(
    worker: Arc<Worker>,
    job: GenerateJob,
    spec: StreamSpec,
) -> Result<Response, ApiError> {
    let (events_tx, mut events) = mpsc::unbounded_channel::<Result<Event, ApiError>>();
    tokio::spawn(async move {
        let send = |e| events_tx.send(e).is_ok();
        let tok = match worker.tokenizer(&job.agent) {
            Ok(t) => t,
            Err(e) => {
                send(Err(e.into()));
                return;
            }
        };
        // The prompts' ids first (the first chunk carries them); the job then generates from them.
        let mut job = job;
        let prompt_ids = match worker.encode_prompts(&job) {
            Ok(ids) => ids,
            Err(e) => {
                send(Err(spec.error(e)));
                return;
            }
        };
        job.prompts = prompt_ids
            .iter()
            .cloned()
            .map(PromptInput::Tokens)
            .collect();
        let mut chunks = Chunks::new(&spec, tok, &job, prompt_ids);
        let (tokens_tx, mut tokens) = mpsc::unbounded_channel();
        let generation = worker.generate_streaming(job, Some(tokens_tx));
        tokio::pin!(generation);
        let mut sent_any = false;
        let result = loop {
            tokio::select! {
                biased;
                Some(t) = tokens.recv() => {
                    for e in chunks.token(&t) {
                        // The client left: dropping the generation cancels the job.
                        if !send(Ok(e)) {
                            return;
                        }
                        sent_any = true;
                    }
                }
                out = &mut generation => break out,
            }
        };
        // Tokens of the last step, sent before the reply arrived.
        while let Ok(t) = tokens.try_recv() {
            for e in chunks.token(&t) {
                send(Ok(e));
            }
        }
        match result {
            Ok(out) => {
                for e in chunks.finish(&out) {
                    send(Ok(e));
                }
            }
            Err(e) if !sent_any => {
                send(Err(spec.error(e)));
            }
            Err(e) => {
                let e = spec.error(e);
                send(Ok(Event::default().data(e.body().to_string())));
            }
        }
    });
    // The first event decides between an error response and a stream.
    let first = match events.recv().await {
        Some(Ok(e)) => e,
        Some(Err(e)) => return Err(e),
        None => return Err(ApiError::internal("the generation ended without an answer")),
    };
    let rest = UnboundedReceiverStream::new(events).map(|e| {
        Ok::<_, Infallible>(e.unwrap_or_else(|e| Event::default().data(e.body().to_string())))
    });
    let stream = futures::stream::once(async move { Ok::<_, Infallible>(first) }).chain(rest);
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response())
}
