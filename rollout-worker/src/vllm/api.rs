//! The calls the worker makes to an engine: one sample of a prompt, the log-probs of a fixed
//! sequence, and an in-place weight reload. Requests go to vLLM's OpenAI completions endpoint
//! with token ids in and out, so the worker's own encoding decides what the model sees.

use std::path::Path;
use std::time::Duration;

use cotrain_model::engine::{FinishReason, SamplingParams, StopConditions};
use serde_json::{Value, json};

use super::http::{CallError, EngineHttp};

/// One generated sample as the engine returned it.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineSample {
    pub token_ids: Vec<u32>,
    pub text: String,
    pub logprobs: Vec<f32>,
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    pub finish_reason: FinishReason,
}

/// What one sample asks of the engine.
pub struct SampleRequest<'a> {
    /// The served model: the base, or an adapter's name ([`adapter_name`]).
    pub model: &'a str,
    pub prompt: &'a [u32],
    pub params: &'a SamplingParams,
    pub stop: &'a StopConditions,
    /// The sample's own seed.
    pub seed: u64,
    pub top_logprobs: usize,
    /// The engine's context: a completion stops at its end, as with cotrain's engine.
    pub max_model_len: usize,
}

/// The body of a completion request for one sample.
pub fn sample_body(r: &SampleRequest<'_>) -> Value {
    let p = r.params;
    json!({
        "model": r.model,
        "prompt": r.prompt,
        "n": 1,
        "max_tokens": r.stop.max_new_tokens.min(r.max_model_len.saturating_sub(r.prompt.len())).max(1),
        "temperature": p.temperature,
        "top_p": p.top_p,
        // vLLM's "no top-k" is 0 or -1, cotrain's is 0.
        "top_k": if p.top_k == 0 { -1 } else { p.top_k as i64 },
        "min_p": p.min_p,
        // vLLM takes a signed 64-bit seed.
        "seed": (r.seed & (i64::MAX as u64)) as i64,
        "stop": r.stop.stop_strings,
        "stop_token_ids": r.stop.stop_token_ids,
        "ignore_eos": r.stop.ignore_eos,
        "logprobs": r.top_logprobs,
        "return_token_ids": true,
        "return_tokens_as_token_ids": true,
        "skip_special_tokens": true,
    })
}

/// Parses a completion answer of one sample.
pub fn parse_sample(answer: &Value, want_top: usize) -> Result<EngineSample, String> {
    let choice = answer["choices"].get(0).ok_or("no choices")?;
    let token_ids: Vec<u32> = choice["token_ids"]
        .as_array()
        .ok_or("no token_ids (vLLM older than return_token_ids?)")?
        .iter()
        .map(|t| {
            t.as_u64()
                .map(|t| t as u32)
                .ok_or("a token id is not a number")
        })
        .collect::<Result<_, _>>()?;
    let lp = &choice["logprobs"];
    let logprobs: Vec<f32> = lp["token_logprobs"]
        .as_array()
        .ok_or("no token_logprobs")?
        .iter()
        .map(|v| v.as_f64().map(|x| x as f32).unwrap_or(f32::NEG_INFINITY))
        .collect();
    if logprobs.len() != token_ids.len() {
        return Err(format!(
            "{} log-probs for {} tokens",
            logprobs.len(),
            token_ids.len()
        ));
    }
    let top_logprobs = if want_top == 0 {
        Vec::new()
    } else {
        lp["top_logprobs"]
            .as_array()
            .ok_or("no top_logprobs")?
            .iter()
            .map(|pos| {
                let mut v: Vec<(u32, f32)> = pos
                    .as_object()
                    .map(|m| {
                        m.iter()
                            .filter_map(|(k, x)| Some((token_of(k)?, x.as_f64()? as f32)))
                            .collect()
                    })
                    .unwrap_or_default();
                v.sort_by(|a, b| b.1.total_cmp(&a.1));
                v.truncate(want_top);
                v
            })
            .collect()
    };
    let finish_reason = match choice["finish_reason"].as_str() {
        Some("length") => FinishReason::Length,
        _ => FinishReason::Stop,
    };
    Ok(EngineSample {
        token_ids,
        text: choice["text"].as_str().unwrap_or_default().to_string(),
        logprobs,
        top_logprobs,
        finish_reason,
    })
}

/// `token_id:123` (vLLM's `return_tokens_as_token_ids` spelling) → 123.
fn token_of(key: &str) -> Option<u32> {
    key.strip_prefix("token_id:").unwrap_or(key).parse().ok()
}

/// Draws one sample.
pub async fn sample(
    http: &EngineHttp,
    r: &SampleRequest<'_>,
    timeout: Duration,
) -> Result<EngineSample, CallError> {
    let answer = http
        .post_json("/v1/completions", Some(&sample_body(r)), timeout)
        .await?;
    parse_sample(&answer, r.top_logprobs).map_err(|message| CallError::Invalid {
        path: "/v1/completions".into(),
        message,
    })
}

/// `log p(tokens[i + 1] | tokens[..=i])` for every position, under the engine's current weights.
pub async fn sequence_logprobs(
    http: &EngineHttp,
    model: &str,
    tokens: &[u32],
    timeout: Duration,
) -> Result<Vec<f32>, CallError> {
    let body = json!({
        "model": model,
        "prompt": tokens,
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": 0,
    });
    let path = "/v1/completions";
    let answer = http.post_json(path, Some(&body), timeout).await?;
    let invalid = |message: String| CallError::Invalid {
        path: path.into(),
        message,
    };
    let entries = answer["choices"][0]["prompt_logprobs"]
        .as_array()
        .ok_or_else(|| invalid("no prompt_logprobs".into()))?;
    if entries.len() != tokens.len() {
        return Err(invalid(format!(
            "{} prompt log-probs for {} tokens",
            entries.len(),
            tokens.len()
        )));
    }
    tokens[1..]
        .iter()
        .zip(&entries[1..])
        .map(|(t, e)| {
            e.get(t.to_string())
                .and_then(|l| l["logprob"].as_f64())
                .map(|x| x as f32)
                .ok_or_else(|| invalid(format!("no log-prob of prompt token {t}")))
        })
        .collect()
}

/// The served name of `agent`'s adapter at `version`: one name per version, so that a request
/// names the weights it is sampled from and an old version can be unloaded once nothing uses it.
pub fn adapter_name(agent: &str, version: u64) -> String {
    format!("{agent}@v{version}")
}

/// Loads the PEFT adapter directory at `path` under `name` (vLLM's runtime LoRA loading).
pub async fn load_adapter(
    http: &EngineHttp,
    name: &str,
    path: &Path,
    timeout: Duration,
) -> Result<(), CallError> {
    let body = json!({"lora_name": name, "lora_path": path.to_string_lossy()});
    http.post("/v1/load_lora_adapter", Some(&body), timeout)
        .await
        .map(drop)
}

/// Unloads the adapter served as `name`.
pub async fn unload_adapter(
    http: &EngineHttp,
    name: &str,
    timeout: Duration,
) -> Result<(), CallError> {
    let body = json!({"lora_name": name});
    http.post("/v1/unload_lora_adapter", Some(&body), timeout)
        .await
        .map(drop)
}

/// Replaces the tensors named in the safetensors file at `path` in the running model (vLLM's
/// in-place reload, through the worker extension), then drops the prefix cache computed with the
/// old weights. Returns the engine's count of tensors loaded.
pub async fn reload_weights(
    http: &EngineHttp,
    path: &Path,
    timeout: Duration,
) -> Result<u64, CallError> {
    let body = json!({
        "method": "cotrain_reload_weights",
        "args": [path.to_string_lossy()],
        "timeout": timeout.as_secs_f64(),
    });
    let answer = http
        .post_json("/collective_rpc", Some(&body), timeout)
        .await?;
    // One result per model worker (tensor-parallel ranks), each the extension's JSON string.
    let results = answer["results"].as_array().cloned().unwrap_or_default();
    let mut tensors = 0;
    for r in &results {
        let parsed: Value = r
            .as_str()
            .and_then(|s| serde_json::from_str(s).ok())
            .unwrap_or(Value::Null);
        tensors = parsed["tensors"]
            .as_u64()
            .ok_or_else(|| CallError::Invalid {
                path: "/collective_rpc".into(),
                message: format!("unexpected reload answer {r}"),
            })?;
    }
    if results.is_empty() {
        return Err(CallError::Invalid {
            path: "/collective_rpc".into(),
            message: format!("no results in {answer}"),
        });
    }
    http.post_json("/reset_prefix_cache", None, timeout).await?;
    Ok(tensors)
}

/// Reloads the model directory the engine started from, in place (vLLM's own `reload_weights`
/// with no source), and drops the prefix cache.
pub async fn reload_from_model_dir(http: &EngineHttp, timeout: Duration) -> Result<(), CallError> {
    let body = json!({"method": "reload_weights", "timeout": timeout.as_secs_f64()});
    http.post_json("/collective_rpc", Some(&body), timeout)
        .await?;
    http.post_json("/reset_prefix_cache", None, timeout).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The request carries cotrain's sampling as vLLM names it, top-k 0 as vLLM's "off".
    #[test]
    fn a_sample_request_maps_every_parameter() {
        let params = SamplingParams {
            temperature: 0.8,
            top_k: 0,
            top_p: 0.95,
            min_p: 0.05,
        };
        let stop = StopConditions {
            max_new_tokens: 7,
            stop_token_ids: vec![5],
            stop_strings: vec!["\n\n".into()],
            ignore_eos: true,
        };
        let body = sample_body(&SampleRequest {
            model: "alice@v3",
            prompt: &[1, 2, 3],
            params: &params,
            stop: &stop,
            seed: u64::MAX,
            top_logprobs: 2,
            max_model_len: 9,
        });
        assert_eq!(body["prompt"], json!([1, 2, 3]));
        assert_eq!(body["model"], "alice@v3");
        // 7 asked, 6 left in a context of 9 after 3 prompt tokens.
        assert_eq!(body["max_tokens"], 6);
        assert_eq!(body["top_k"], -1);
        assert_eq!(body["seed"], json!(i64::MAX));
        assert_eq!(body["stop"], json!(["\n\n"]));
        assert_eq!(body["stop_token_ids"], json!([5]));
        assert_eq!(body["ignore_eos"], true);
        assert_eq!(body["logprobs"], 2);
    }

    /// Token ids, log-probs, top log-probs (most likely first) and the finish reason.
    #[test]
    fn an_answer_parses_into_a_sample() {
        let answer = json!({"choices": [{
            "text": "hi", "finish_reason": "length", "token_ids": [10, 11],
            "logprobs": {"token_logprobs": [-0.5, -1.5],
                         "top_logprobs": [{"token_id:10": -0.5, "token_id:3": -0.2}, {"token_id:11": -1.5}]}
        }]});
        let s = parse_sample(&answer, 1).unwrap();
        assert_eq!(s.token_ids, vec![10, 11]);
        assert_eq!(s.logprobs, vec![-0.5, -1.5]);
        assert_eq!(s.top_logprobs, vec![vec![(3, -0.2)], vec![(11, -1.5)]]);
        assert_eq!(s.finish_reason, FinishReason::Length);
        let bad = json!({"choices": [{"token_ids": [1], "logprobs": {"token_logprobs": []}}]});
        assert!(parse_sample(&bad, 0).unwrap_err().contains("1 tokens"));
    }
}
