//! OpenAI's log-prob shapes for the worker's samples: chat's `logprobs.content` entries and the
//! legacy completions' `tokens` / `token_logprobs` / `top_logprobs` / `text_offset` lists.
//!
//! Every sampled token has its entry, the stop token (EOS) included, so that the entries' sum is
//! the sequence log-prob the gRPC API reports and the learner trains on. The log-probs are the raw
//! model's (log-softmax of the logits, before temperature and filters), as vLLM reports them by
//! default.

use cotrain_model::tokenizer::Tokenizer;
use serde_json::{Map, Value, json};

/// Most alternatives per position a request may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// The `top_logprobs` of a position, or none.
fn top_at(tops: &[Vec<(u32, f32)>], i: usize) -> &[(u32, f32)] {
    tops.get(i).map_or(&[], Vec::as_slice)
}

/// `{"token", "logprob", "bytes"}`: the token's text (lossy where it is part of a character) and
/// its bytes.
fn token_entry(tok: &Tokenizer, id: u32, logprob: f32) -> Value {
    let bytes = tok.token_bytes(id);
    json!({"token": String::from_utf8_lossy(&bytes), "logprob": logprob, "bytes": bytes})
}

/// One position of chat's `logprobs.content`.
pub fn chat_entry(tok: &Tokenizer, id: u32, logprob: f32, top: &[(u32, f32)]) -> Value {
    let mut entry = token_entry(tok, id, logprob);
    entry["top_logprobs"] = top.iter().map(|&(t, lp)| token_entry(tok, t, lp)).collect();
    entry
}

/// Chat's `logprobs` object for the tokens `ids` with log-probs `lps` and alternatives `tops`.
pub fn chat_logprobs(tok: &Tokenizer, ids: &[u32], lps: &[f32], tops: &[Vec<(u32, f32)>]) -> Value {
    let content: Vec<Value> = ids
        .iter()
        .zip(lps)
        .enumerate()
        .map(|(i, (&id, &lp))| chat_entry(tok, id, lp, top_at(tops, i)))
        .collect();
    json!({"content": content, "refusal": Value::Null})
}

/// The completions endpoint's `logprobs` object; `text_offset` counts characters from `offset`.
pub fn completion_logprobs(
    tok: &Tokenizer,
    ids: &[u32],
    lps: &[f32],
    tops: &[Vec<(u32, f32)>],
    offset: usize,
) -> Value {
    let mut tokens = Vec::with_capacity(ids.len());
    let mut offsets = Vec::with_capacity(ids.len());
    let mut at = offset;
    for &id in ids {
        let text = String::from_utf8_lossy(&tok.token_bytes(id)).into_owned();
        offsets.push(at);
        at += text.chars().count();
        tokens.push(text);
    }
    // As OpenAI's legacy endpoint: the sampled token beside the k most likely (up to k + 1 entries).
    let top: Vec<Value> = (0..ids.len())
        .map(|i| {
            let mut m = Map::new();
            m.insert(tokens[i].clone(), json!(lps[i]));
            for &(t, lp) in top_at(tops, i) {
                m.entry(String::from_utf8_lossy(&tok.token_bytes(t)).into_owned())
                    .or_insert(json!(lp));
            }
            Value::Object(m)
        })
        .collect();
    json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets})
}
