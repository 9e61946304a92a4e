//! Tokenizers for the policy models: Hugging Face `tokenizer.json` files and the byte-level BPE
//! vocabularies embedded in GGUF files, behind one [`Tokenizer`] type.
//!
//! Both are run by the `tokenizers` crate. From a GGUF file the BPE model, its pre-tokenizer and
//! decoder are built programmatically from the `tokenizer.ggml.*` metadata; the pre-tokenizer
//! regex is the one implied by `tokenizer.ggml.pre` (the same split rules llama.cpp applies).
//!
//! Generation needs two extra things a plain tokenizer does not give: the set of token ids that
//! end a turn ([`Tokenizer::stop_token_ids`]), and text that grows as tokens arrive even when a
//! byte-level token ends in the middle of a UTF-8 character ([`IncrementalDecoder`]).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::gguf::{GgufError, GgufFile};

/// Names of special tokens that end an assistant turn in the chat formats we meet.
const EOS_LIKE_TOKENS: &[&str] = &[
    "<|im_end|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|eot_id|>",
    "<|end|>",
    "<end_of_turn>",
    "</s>",
];

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// Errors from building or running a tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A tokenizer file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A JSON side file (`tokenizer_config.json`, `generation_config.json`) is malformed.
    #[error("invalid json in {path}: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// The `tokenizers` crate rejected the tokenizer or failed to encode/decode.
    #[error("tokenizer error: {0}")]
    Tokenizers(String),
    /// Reading tokenizer metadata from a GGUF file failed.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// `tokenizer.ggml.model` names a tokenizer kind this crate cannot build.
    #[error("unsupported gguf tokenizer model `{0}` (supported: gpt2)")]
    UnsupportedModel(String),
    /// `tokenizer.ggml.pre` names a pre-tokenizer whose split rules this crate does not know.
    #[error("unsupported gguf pre-tokenizer `{0}` (supported: gpt-2, smollm, qwen2, llama-bpe)")]
    UnsupportedPreTokenizer(String),
    /// The vocabulary metadata is inconsistent (bad merge line, id out of range, ...).
    #[error("invalid tokenizer vocabulary: {0}")]
    InvalidVocab(String),
}

pub type Result<T, E = TokenizerError> = std::result::Result<T, E>;

fn tk_err(e: impl std::fmt::Display) -> TokenizerError {
    TokenizerError::Tokenizers(e.to_string())
}

/// A tokenizer plus the special-token ids generation needs.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    pad_id: Option<u32>,
    stop_ids: BTreeSet<u32>,
    /// Whether the decoder is byte-level BPE's (token strings spell bytes in GPT-2's printable
    /// alphabet), read from the decoder once.
    byte_level: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos_id", &self.bos_id)
            .field("eos_id", &self.eos_id)
            .field("pad_id", &self.pad_id)
            .field("stop_ids", &self.stop_ids)
            .finish()
    }
}

/// The pre-tokenizer split rules of one `tokenizer.ggml.pre` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreTokenizerKind {
    /// GPT-2's byte-level regex (`gpt-2`).
    Gpt2,
    /// GPT-2's regex after isolating every digit (`smollm`, StarCoder-style).
    SmolLm,
    /// Qwen2's regex: single digits, letters with one leading non-letter, NFC-normalised input.
    Qwen2,
    /// Llama 3's regex: digit runs of at most three (`llama-bpe`).
    LlamaBpe,
}

const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

impl PreTokenizerKind {
    /// Maps a `tokenizer.ggml.pre` value.
    pub fn from_gguf_name(name: &str) -> Result<Self> {
        Ok(match name {
            "gpt-2" | "gpt2" => Self::Gpt2,
            "smollm" => Self::SmolLm,
            "qwen2" => Self::Qwen2,
            "llama-bpe" => Self::LlamaBpe,
            other => return Err(TokenizerError::UnsupportedPreTokenizer(other.to_string())),
        })
    }

    fn build(self) -> Result<PreTokenizerWrapper> {
        let split = |re: &str| -> Result<PreTokenizerWrapper> {
            Ok(Split::new(
                SplitPattern::Regex(re.to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(tk_err)?
            .into())
        };
        // After a regex split, ByteLevel only maps bytes to its printable alphabet.
        let bytes_only: PreTokenizerWrapper = ByteLevel::new(false, false, false).into();
        Ok(match self {
            Self::Gpt2 => ByteLevel::new(false, true, true).into(),
            Self::SmolLm => Sequence::new(vec![
                split(r"\p{N}")?,
                ByteLevel::new(false, true, true).into(),
            ])
            .into(),
            Self::Qwen2 => Sequence::new(vec![split(QWEN2_REGEX)?, bytes_only]).into(),
            Self::LlamaBpe => Sequence::new(vec![split(LLAMA3_REGEX)?, bytes_only]).into(),
        })
    }
}

impl Tokenizer {
    /// Wraps an already built `tokenizers` tokenizer. Special ids are looked up by the usual
    /// names; override them with the setters.
    pub fn from_inner(inner: tokenizers::Tokenizer) -> Self {
        let byte_level = inner
            .get_decoder()
            .and_then(|d| serde_json::to_string(d).ok())
            .is_some_and(|json| json.contains("\"ByteLevel\""));
        let mut t = Self {
            inner,
            bos_id: None,
            eos_id: None,
            pad_id: None,
            stop_ids: BTreeSet::new(),
            byte_level,
        };
        t.add_eos_like_specials();
        t
    }

    /// Loads a Hugging Face `tokenizer.json`. No bos/eos ids are known from the file alone
    /// (they live in `tokenizer_config.json`); see [`Tokenizer::from_hf_dir`].
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| TokenizerError::Tokenizers(format!("{}: {e}", path.display())))?;
        Ok(Self::from_inner(inner))
    }

    /// Loads a Hugging Face model directory: `tokenizer.json`, plus the bos/eos/pad tokens of
    /// `tokenizer_config.json` and the eos ids of `generation_config.json` when present.
    pub fn from_hf_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let mut t = Self::from_file(dir.join("tokenizer.json"))?;
        if let Some(cfg) = read_json_if_exists(&dir.join("tokenizer_config.json"))? {
            let lookup =
                |key: &str| special_token_content(&cfg[key]).and_then(|s| t.token_to_id(&s));
            let (bos, eos, pad) = (
                lookup("bos_token"),
                lookup("eos_token"),
                lookup("pad_token"),
            );
            t.bos_id = bos.or(t.bos_id);
            t.pad_id = pad.or(t.pad_id);
            if let Some(eos) = eos {
                t.set_eos_id(eos);
            }
        }
        if let Some(generation) = read_json_if_exists(&dir.join("generation_config.json"))? {
            for id in json_ids(&generation["eos_token_id"]) {
                t.add_stop_token_id(id);
            }
        }
        Ok(t)
    }

    /// Builds the tokenizer stored in a GGUF file's `tokenizer.ggml.*` metadata.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self> {
        let model = gguf.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(TokenizerError::UnsupportedModel(model.to_string()));
        }
        let pre_name = match gguf.get("tokenizer.ggml.pre") {
            Some(_) => gguf.get_str("tokenizer.ggml.pre")?,
            None => "gpt-2",
        };
        let pre = PreTokenizerKind::from_gguf_name(pre_name)?;
        let tokens = gguf.get_str_array("tokenizer.ggml.tokens")?;
        let types = match gguf.get("tokenizer.ggml.token_type") {
            Some(_) => gguf.get_i64_array("tokenizer.ggml.token_type")?,
            None => vec![1; tokens.len()],
        };
        if types.len() != tokens.len() {
            return Err(TokenizerError::InvalidVocab(format!(
                "{} tokens but {} token types",
                tokens.len(),
                types.len()
            )));
        }
        let merges = gguf
            .get_str_array("tokenizer.ggml.merges")?
            .into_iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| {
                        TokenizerError::InvalidVocab(format!("merge `{m}` has no space"))
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        let special_id = |key: &str| -> Result<Option<u32>> {
            match gguf.get(key) {
                None => Ok(None),
                Some(_) => {
                    let id = gguf.get_u32(key)?;
                    if id as usize >= tokens.len() {
                        return Err(TokenizerError::InvalidVocab(format!(
                            "{key} = {id} is outside the vocabulary of {}",
                            tokens.len()
                        )));
                    }
                    Ok(Some(id))
                }
            }
        };
        let bos = special_id("tokenizer.ggml.bos_token_id")?;
        let eos = special_id("tokenizer.ggml.eos_token_id")?;
        let pad = special_id("tokenizer.ggml.padding_token_id")?;
        let eot = special_id("tokenizer.ggml.eot_token_id")?;
        let flag = |key: &str, default: bool| -> Result<bool> {
            Ok(if gguf.get(key).is_some() {
                gguf.get_bool(key)?
            } else {
                default
            })
        };
        let add_bos = flag("tokenizer.ggml.add_bos_token", false)?;
        let add_eos = flag("tokenizer.ggml.add_eos_token", false)?;

        let options = BpeVocab {
            tokens: &tokens,
            token_types: &types,
            merges,
            pre,
            bos: bos.filter(|_| add_bos),
            eos: eos.filter(|_| add_eos),
        };
        let mut t = Self::from_inner(build_byte_level_bpe(options)?);
        t.bos_id = bos;
        t.pad_id = pad;
        if let Some(eos) = eos {
            t.set_eos_id(eos);
        }
        if let Some(eot) = eot {
            t.add_stop_token_id(eot);
        }
        Ok(t)
    }

    fn add_eos_like_specials(&mut self) {
        let specials: Vec<u32> = self
            .inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, tok)| tok.special && EOS_LIKE_TOKENS.contains(&tok.content.as_str()))
            .map(|(id, _)| id)
            .collect();
        self.stop_ids.extend(specials);
    }

    /// Token ids of `text`; with `add_special_tokens` the tokenizer's post-processor adds its
    /// special tokens (for example bos when `add_bos_token` is set).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        Ok(self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(tk_err)?
            .get_ids()
            .to_vec())
    }

    /// Text of `ids`; with `skip_special_tokens` special tokens are left out.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner.decode(ids, skip_special_tokens).map_err(tk_err)
    }

    /// The id of a token string (including added/special tokens).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token string of an id (byte-level tokens are in their printable form, e.g. `Ġthe`).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The bytes token `id` stands for, as OpenAI's log-prob entries report them: a byte-level
    /// token's own bytes (part of a character, when it is), otherwise the token decoded alone.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let Some(token) = self.id_to_token(id) else {
            return Vec::new();
        };
        if self.byte_level
            && self
                .inner
                .get_added_vocabulary()
                .simple_id_to_token(id)
                .is_none()
            && let Some(bytes) = byte_level_bytes(&token)
        {
            return bytes;
        }
        self.decode(&[id], false)
            .map(String::into_bytes)
            .unwrap_or_else(|_| token.into_bytes())
    }

    /// Number of ids, added tokens included (the embedding may be larger).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Beginning-of-sequence id, if the tokenizer has one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// End-of-sequence id, if known.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos_id
    }

    /// Padding id, if known.
    pub fn pad_id(&self) -> Option<u32> {
        self.pad_id
    }

    /// The bos token string.
    pub fn bos_token(&self) -> Option<String> {
        self.bos_id.and_then(|id| self.id_to_token(id))
    }

    /// The eos token string.
    pub fn eos_token(&self) -> Option<String> {
        self.eos_id.and_then(|id| self.id_to_token(id))
    }

    pub fn set_bos_id(&mut self, id: Option<u32>) {
        self.bos_id = id;
    }

    /// Sets the eos id and adds it to the stop ids.
    pub fn set_eos_id(&mut self, id: u32) {
        self.eos_id = Some(id);
        self.stop_ids.insert(id);
    }

    pub fn set_pad_id(&mut self, id: Option<u32>) {
        self.pad_id = id;
    }

    /// Ids that end generation: eos, the end-of-turn specials present in the vocabulary
    /// (`<|im_end|>`, `<|endoftext|>`, `<|eot_id|>`, ...) and any added with
    /// [`Tokenizer::add_stop_token_id`] (e.g. `generation_config.json`'s `eos_token_id`).
    pub fn stop_token_ids(&self) -> &BTreeSet<u32> {
        &self.stop_ids
    }

    /// Whether `id` ends generation.
    pub fn is_stop_token(&self, id: u32) -> bool {
        self.stop_ids.contains(&id)
    }

    pub fn add_stop_token_id(&mut self, id: u32) {
        self.stop_ids.insert(id);
    }

    /// A fresh incremental decoder (see [`IncrementalDecoder`]).
    pub fn incremental_decoder(&self, skip_special_tokens: bool) -> IncrementalDecoder {
        IncrementalDecoder::new(skip_special_tokens)
    }

    /// The wrapped `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// Inputs of [`build_byte_level_bpe`].
struct BpeVocab<'a> {
    tokens: &'a [&'a str],
    token_types: &'a [i64],
    merges: Vec<(String, String)>,
    pre: PreTokenizerKind,
    /// Prepended by the post-processor when set.
    bos: Option<u32>,
    /// Appended by the post-processor when set.
    eos: Option<u32>,
}

fn build_byte_level_bpe(v: BpeVocab<'_>) -> Result<tokenizers::Tokenizer> {
    let mut vocab = tokenizers::models::bpe::Vocab::with_capacity(v.tokens.len());
    for (id, tok) in v.tokens.iter().enumerate() {
        // Like Hugging Face's converter, a repeated string maps to its last id.
        vocab.insert((*tok).to_string(), id as u32);
    }
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, v.merges)
        .ignore_merges(v.pre == PreTokenizerKind::LlamaBpe)
        .build()
        .map_err(tk_err)?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    inner.with_pre_tokenizer(Some(v.pre.build()?));
    inner.with_decoder(Some(ByteLevelDecoder::default()));
    if v.pre == PreTokenizerKind::Qwen2 {
        inner.with_normalizer(Some(NFC));
    }

    let added: Vec<AddedToken> = v
        .tokens
        .iter()
        .zip(v.token_types)
        .filter_map(|(tok, &ty)| match ty {
            TOKEN_TYPE_CONTROL => Some(AddedToken::from(*tok, true)),
            TOKEN_TYPE_USER_DEFINED => Some(AddedToken::from(*tok, false).normalized(false)),
            _ => None,
        })
        .collect();
    inner.add_tokens(&added);

    if v.bos.is_some() || v.eos.is_some() {
        let name = |id: u32| v.tokens[id as usize].to_string();
        // `[bos] $A [eos]` for one sequence, and the same again around `$B` for a pair.
        let around = |seq: &str| {
            let mut parts: Vec<String> = v.bos.map(name).into_iter().collect();
            parts.push(seq.to_string());
            parts.extend(v.eos.map(name));
            parts.join(" ")
        };
        let single = around("$A");
        let pair = format!("{} {}", around("$A"), around("$B:1"));
        let specials: Vec<(String, u32)> = v
            .bos
            .into_iter()
            .chain(v.eos)
            .map(|id| (name(id), id))
            .collect();
        let processor = TemplateProcessing::builder()
            .try_single(single)
            .map_err(tk_err)?
            .try_pair(pair)
            .map_err(tk_err)?
            .special_tokens(specials)
            .build()
            .map_err(tk_err)?;
        inner.with_post_processor(Some(processor));
    }
    Ok(inner)
}

fn read_json_if_exists(path: &Path) -> Result<Option<serde_json::Value>> {
    match std::fs::read(path) {
        Ok(bytes) => {
            serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|source| TokenizerError::Json {
                    path: path.to_path_buf(),
                    source,
                })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TokenizerError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// A special token in `tokenizer_config.json`: a string or `{"content": ...}`.
fn special_token_content(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o
            .get("content")
            .and_then(|c| c.as_str())
            .map(str::to_string),
        _ => None,
    }
}

/// An id or a list of ids (`generation_config.json`'s `eos_token_id`).
fn json_ids(v: &serde_json::Value) -> Vec<u32> {
    match v {
        serde_json::Value::Number(n) => n
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .into_iter()
            .collect(),
        serde_json::Value::Array(a) => a.iter().flat_map(json_ids).collect(),
        _ => Vec::new(),
    }
}

/// Turns a stream of token ids into text as they arrive.
///
/// Decoding token by token is wrong for byte-level BPE: one character can span several tokens,
/// and some decoders change a token's text depending on its neighbours. This keeps a short
/// window of ids, re-decodes it on each push, and releases only text that is complete, i.e.
/// does not end in the replacement character left by a partial UTF-8 sequence.
#[derive(Debug, Clone, Default)]
pub struct IncrementalDecoder {
    skip_special_tokens: bool,
    ids: Vec<u32>,
    /// Start of the window that gives context for the next decode.
    prefix_offset: usize,
    /// End of the ids whose text has been released.
    read_offset: usize,
    text: String,
}

impl IncrementalDecoder {
    pub fn new(skip_special_tokens: bool) -> Self {
        Self {
            skip_special_tokens,
            ..Self::default()
        }
    }

    /// Adds one id and returns the text it completes (possibly empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let prefix = tokenizer.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let full = tokenizer.decode(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') && full.starts_with(&prefix) {
            let new = full[prefix.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            self.text.push_str(&new);
            Ok(new)
        } else {
            Ok(String::new())
        }
    }

    /// Releases whatever is still held back (an incomplete character decodes to U+FFFD).
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<String> {
        let prefix = tokenizer.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let full = tokenizer.decode(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        let new = full
            .strip_prefix(prefix.as_str())
            .unwrap_or(&full)
            .to_string();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        self.text.push_str(&new);
        Ok(new)
    }

    /// All text released so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// All ids pushed so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
}

/// The bytes a byte-level BPE token string spells: GPT-2's alphabet writes the printable bytes
/// `!`..`~`, `¡`..`¬` and `®`..`ÿ` as themselves and every other byte b as the character 256 + n,
/// n counting those other bytes in order. `None` when a character is outside that alphabet.
fn byte_level_bytes(token: &str) -> Option<Vec<u8>> {
    fn printable(b: u32) -> bool {
        (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b)
    }
    // The bytes that are not printable, in order: character 256 + n spells the n-th.
    static OTHERS: std::sync::LazyLock<Vec<u8>> = std::sync::LazyLock::new(|| {
        (0u32..256)
            .filter(|&b| !printable(b))
            .map(|b| b as u8)
            .collect()
    });
    token
        .chars()
        .map(|c| {
            let c = c as u32;
            if c < 256 {
                return printable(c).then_some(c as u8);
            }
            OTHERS.get((c - 256) as usize).copied()
        })
        .collect()
}

#[cfg(test)]
mod byte_level_tests {
    use super::byte_level_bytes;

    #[test]
    fn byte_level_token_strings_map_back_to_their_bytes() {
        assert_eq!(byte_level_bytes("Ġthe").unwrap(), b" the");
        assert_eq!(byte_level_bytes("ĊĊ").unwrap(), b"\n\n");
        assert_eq!(byte_level_bytes("é").unwrap(), [0xe9]);
        // One half of "é" in UTF-8 (0xc3 0xa9) is written as the printable characters Ã and ©.
        assert_eq!(byte_level_bytes("Ã©").unwrap(), "é".as_bytes());
        assert_eq!(byte_level_bytes("▁x"), None);
    }
}
