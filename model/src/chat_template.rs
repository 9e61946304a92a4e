//! A model's own chat template, rendered the way Hugging Face `transformers` renders it.
//!
//! Templates are Jinja source taken from a GGUF file (`tokenizer.chat_template`) or from a
//! Hugging Face directory (`chat_template.jinja`, or `chat_template` in `tokenizer_config.json`,
//! either a string or a list of named templates). `transformers` renders them with jinja2 under
//! `trim_blocks`, `lstrip_blocks` and the loop-controls extension, passes `messages`, `tools`,
//! `documents`, `add_generation_prompt`, the special tokens and any extra keyword arguments, and
//! adds `raise_exception`, `strftime_now` and a `tojson` filter that behaves like Python's
//! `json.dumps(..., ensure_ascii=False)`; its `{% generation %}` marker blocks render as plain
//! blocks. This module sets up minijinja (with Python string and
//! dict methods from `minijinja-contrib`) to match that, so prompts are byte-identical.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::{Deserialize, Serialize};

use crate::gguf::{GgufError, GgufFile};

const TEMPLATE_NAME: &str = "chat";

/// Errors from loading or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    /// The template source does not parse.
    #[error("invalid chat template: {0:#}")]
    Syntax(Error),
    /// Rendering failed, including a `raise_exception(...)` called by the template.
    #[error("chat template rendering failed: {0:#}")]
    Render(Error),
    /// The model ships no chat template.
    #[error("no chat template found in {0}")]
    Missing(String),
    /// A list of named templates has no entry of the requested name.
    #[error("chat template `{name}` not found (available: {available:?})")]
    UnknownName {
        name: String,
        available: Vec<String>,
    },
    /// `extra` was not a JSON object.
    #[error("extra template arguments must be a json object, got {0}")]
    ExtraNotObject(String),
    /// A template file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// `tokenizer_config.json` is malformed.
    #[error("invalid json in {path}: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// Reading the template from a GGUF file failed.
    #[error(transparent)]
    Gguf(#[from] GgufError),
}

pub type Result<T, E = ChatTemplateError> = std::result::Result<T, E>;

/// One chat turn.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }

    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// A compiled chat template plus the special tokens it is rendered with.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("source_len", &self.source.len())
            .finish()
    }
}

impl Clone for ChatTemplate {
    /// Compiles the same source again (minijinja environments are not `Clone`); it compiled once,
    /// so it compiles again.
    fn clone(&self) -> Self {
        Self::new(
            self.source.clone(),
            self.bos_token.as_deref(),
            self.eos_token.as_deref(),
        )
        .expect("a compiled template compiles again")
    }
}

impl ChatTemplate {
    /// Compiles `source`. `bos_token`/`eos_token` are the strings the template sees as
    /// `bos_token`/`eos_token`; `None` leaves the variable undefined, as `transformers` does for a
    /// tokenizer without that token.
    pub fn new(
        source: impl Into<String>,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> Result<Self> {
        let source = source.into();
        let mut env = Environment::new();
        // jinja2 as configured by transformers.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, rewrite_generation_tags(&source))
            .map_err(ChatTemplateError::Syntax)?;
        Ok(Self {
            env,
            source,
            bos_token: bos_token.map(str::to_string),
            eos_token: eos_token.map(str::to_string),
        })
    }

    /// The template stored in a GGUF file (`tokenizer.chat_template`), with bos/eos strings
    /// taken from `tokenizer.ggml.tokens` at the bos/eos ids.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self> {
        let source = match gguf.get("tokenizer.chat_template") {
            Some(_) => gguf.get_str("tokenizer.chat_template")?,
            None => {
                let at = gguf
                    .path()
                    .map_or_else(|| "gguf file".to_string(), |p| p.display().to_string());
                return Err(ChatTemplateError::Missing(at));
            }
        };
        let token = |key: &str| -> Result<Option<String>> {
            if gguf.get(key).is_none() {
                return Ok(None);
            }
            let id = gguf.get_u32(key)? as usize;
            Ok(gguf
                .get_array("tokenizer.ggml.tokens")?
                .get(id)
                .and_then(|t| t.as_str())
                .map(str::to_string))
        };
        let bos = token("tokenizer.ggml.bos_token_id")?;
        let eos = token("tokenizer.ggml.eos_token_id")?;
        Self::new(source, bos.as_deref(), eos.as_deref())
    }

    /// The template of a parsed `tokenizer_config.json`. `name` picks one of a list of named
    /// templates (default: the one named `default`).
    pub fn from_tokenizer_config(config: &serde_json::Value, name: Option<&str>) -> Result<Self> {
        let source = template_from_config(config, name)?
            .ok_or_else(|| ChatTemplateError::Missing("tokenizer_config.json".to_string()))?;
        let bos = special_token_content(&config["bos_token"]);
        let eos = special_token_content(&config["eos_token"]);
        Self::new(source, bos.as_deref(), eos.as_deref())
    }

    /// The template of a Hugging Face model directory: `chat_template.jinja` if present, else
    /// `tokenizer_config.json`'s `chat_template`; special tokens from `tokenizer_config.json`.
    pub fn from_hf_dir(dir: impl AsRef<Path>, name: Option<&str>) -> Result<Self> {
        let dir = dir.as_ref();
        let cfg_path = dir.join("tokenizer_config.json");
        let config = match std::fs::read(&cfg_path) {
            Ok(bytes) => {
                serde_json::from_slice(&bytes).map_err(|source| ChatTemplateError::Json {
                    path: cfg_path.clone(),
                    source,
                })?
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::Value::Null,
            Err(source) => {
                return Err(ChatTemplateError::Io {
                    path: cfg_path,
                    source,
                });
            }
        };
        let jinja_path = dir.join("chat_template.jinja");
        let source = match std::fs::read_to_string(&jinja_path) {
            Ok(s) => s,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                template_from_config(&config, name)?
                    .ok_or_else(|| ChatTemplateError::Missing(dir.display().to_string()))?
            }
            Err(source) => {
                return Err(ChatTemplateError::Io {
                    path: jinja_path,
                    source,
                });
            }
        };
        let bos = special_token_content(&config["bos_token"]);
        let eos = special_token_content(&config["eos_token"]);
        Self::new(source, bos.as_deref(), eos.as_deref())
    }

    /// The Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Renders `messages`. `extra` must be a JSON object (or null) of additional template
    /// variables, e.g. `{"enable_thinking": false}` for Qwen3; its keys override the defaults.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: &serde_json::Value,
    ) -> Result<String> {
        self.render_value(
            Value::from_serialize(messages),
            add_generation_prompt,
            extra,
        )
    }

    /// Like [`ChatTemplate::render`] for messages with fields beyond role and content
    /// (`reasoning_content`, `tool_calls`, ...), given as a JSON array.
    pub fn render_json(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
        extra: &serde_json::Value,
    ) -> Result<String> {
        self.render_value(
            Value::from_serialize(messages),
            add_generation_prompt,
            extra,
        )
    }

    /// Renders template values directly. `extra` must be a map (or none/undefined).
    ///
    /// `serde_json::Value` objects iterate in sorted key order, so a tool schema passed through
    /// [`ChatTemplate::render`] comes out of `tojson` with sorted keys, while Python keeps insertion
    /// order. Parse such JSON with [`parse_json_ordered`] and render it here to keep the order.
    pub fn render_values(
        &self,
        messages: Value,
        add_generation_prompt: bool,
        extra: Value,
    ) -> Result<String> {
        let mut ctx = self.base_context(messages, add_generation_prompt);
        match extra.kind() {
            ValueKind::Undefined | ValueKind::None => {}
            ValueKind::Map => {
                for key in extra.try_iter().map_err(ChatTemplateError::Render)? {
                    let v = extra.get_item(&key).map_err(ChatTemplateError::Render)?;
                    ctx.insert(key.to_string(), v);
                }
            }
            _ => return Err(ChatTemplateError::ExtraNotObject(extra.to_string())),
        }
        self.render_context(ctx)
    }

    fn base_context(
        &self,
        messages: Value,
        add_generation_prompt: bool,
    ) -> BTreeMap<String, Value> {
        let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
        ctx.insert("messages".into(), messages);
        ctx.insert("tools".into(), Value::from(()));
        ctx.insert("documents".into(), Value::from(()));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        if let Some(bos) = &self.bos_token {
            ctx.insert("bos_token".into(), Value::from(bos.as_str()));
        }
        if let Some(eos) = &self.eos_token {
            ctx.insert("eos_token".into(), Value::from(eos.as_str()));
        }
        ctx
    }

    fn render_context(&self, ctx: BTreeMap<String, Value>) -> Result<String> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(ChatTemplateError::Syntax)?;
        template
            .render(Value::from(ctx))
            .map_err(ChatTemplateError::Render)
    }

    fn render_value(
        &self,
        messages: Value,
        add_generation_prompt: bool,
        extra: &serde_json::Value,
    ) -> Result<String> {
        let mut ctx = self.base_context(messages, add_generation_prompt);
        match extra {
            serde_json::Value::Null => {}
            serde_json::Value::Object(map) => {
                for (k, v) in map {
                    ctx.insert(k.clone(), Value::from_serialize(v));
                }
            }
            other => return Err(ChatTemplateError::ExtraNotObject(other.to_string())),
        }
        self.render_context(ctx)
    }
}

/// Parses JSON into a template value whose objects keep their key order (as Python dicts do).
pub fn parse_json_ordered(json: &str) -> Result<Value, serde_json::Error> {
    serde_json::from_str(json)
}

/// Turns transformers' `{% generation %}...{% endgeneration %}` block (its AssistantTracker
/// extension, which only marks assistant tokens for training masks) into `{% if true %}...{% endif %}`,
/// which renders the same text and keeps the tags' whitespace control.
fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            break;
        };
        let inner = &tag[2..end];
        let (open_ctl, body) = match inner.chars().next() {
            Some(c @ ('-' | '+')) => (c.to_string(), &inner[1..]),
            _ => (String::new(), inner),
        };
        let (body, close_ctl) = match body.trim_end().chars().last() {
            Some(c @ ('-' | '+')) => (&body.trim_end()[..body.trim_end().len() - 1], c.to_string()),
            _ => (body, String::new()),
        };
        let replacement = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => out.push_str(&format!("{{%{open_ctl} {r} {close_ctl}%}}")),
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

/// `chat_template` of a tokenizer config: a string, or a list of `{name, template}`.
fn template_from_config(config: &serde_json::Value, name: Option<&str>) -> Result<Option<String>> {
    match &config["chat_template"] {
        serde_json::Value::String(s) => Ok(Some(s.clone())),
        serde_json::Value::Array(items) => {
            let wanted = name.unwrap_or("default");
            let named = |item: &serde_json::Value| {
                Some((
                    item.get("name")?.as_str()?.to_string(),
                    item.get("template")?.as_str()?.to_string(),
                ))
            };
            let all: Vec<(String, String)> = items.iter().filter_map(named).collect();
            match all.iter().find(|(n, _)| n == wanted) {
                Some((_, t)) => Ok(Some(t.clone())),
                None => Err(ChatTemplateError::UnknownName {
                    name: wanted.to_string(),
                    available: all.into_iter().map(|(n, _)| n).collect(),
                }),
            }
        }
        _ => Ok(None),
    }
}

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

fn raise_exception(message: String) -> std::result::Result<Value, Error> {
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!("raise_exception: {message}"),
    ))
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)`.
fn tojson(value: Value, kwargs: Kwargs) -> std::result::Result<String, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let _ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_i64() {
            Some(n) => Some(" ".repeat(n.max(0) as usize)),
            None => Some(v.as_str().unwrap_or_default().to_string()),
        },
    };
    let (item_sep, key_sep) = match separators.filter(|v| !v.is_none()) {
        Some(v) => {
            let parts: Vec<String> = v
                .try_iter()?
                .map(|p| p.as_str().unwrap_or_default().to_string())
                .collect();
            match parts.as_slice() {
                [a, b] => (a.clone(), b.clone()),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "separators must be a pair of strings",
                    ));
                }
            }
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let fmt = JsonFormat {
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    fmt.write(&mut out, &value, 0)?;
    Ok(out)
}

struct JsonFormat {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

impl JsonFormat {
    fn newline(&self, out: &mut String, level: usize) {
        if let Some(ind) = &self.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    }

    fn write(&self, out: &mut String, v: &Value, level: usize) -> std::result::Result<(), Error> {
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => {
                if v.is_integer() {
                    out.push_str(&v.to_string());
                } else {
                    let f = f64::try_from(v.clone())?;
                    out.push_str(&python_float(f));
                }
            }
            ValueKind::String => write_json_string(out, v.as_str().unwrap_or_default()),
            ValueKind::Map => {
                let mut keys: Vec<Value> = v.try_iter()?.collect();
                if keys.is_empty() {
                    out.push_str("{}");
                    return Ok(());
                }
                if self.sort_keys {
                    keys.sort();
                }
                out.push('{');
                for (i, key) in keys.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(out, level + 1);
                    let key_str = match key.kind() {
                        ValueKind::String => key.as_str().unwrap_or_default().to_string(),
                        ValueKind::None => "null".to_string(),
                        ValueKind::Bool => {
                            (if key.is_true() { "true" } else { "false" }).to_string()
                        }
                        _ => key.to_string(),
                    };
                    write_json_string(out, &key_str);
                    out.push_str(&self.key_sep);
                    self.write(out, &v.get_item(key)?, level + 1)?;
                }
                self.newline(out, level);
                out.push('}');
            }
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                if items.is_empty() {
                    out.push_str("[]");
                    return Ok(());
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(out, level + 1);
                    self.write(out, item, level + 1)?;
                }
                self.newline(out, level);
                out.push(']');
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("object of type {} is not json serializable", v.kind()),
                ));
            }
        }
        Ok(())
    }
}

/// Python's `repr(float)` for the values JSON can carry.
fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    let exp = if f == 0.0 {
        0
    } else {
        f.abs().log10().floor() as i32
    };
    if (-4..16).contains(&exp) {
        // Shortest round-trip digits, always with a fractional part.
        let s = format!("{f:?}");
        if s.contains('.') || s.contains('e') {
            s
        } else {
            format!("{s}.0")
        }
    } else {
        // Rust's `{:e}` gives the shortest digits as `1.5e-7`; Python writes `1.5e-07`.
        let s = format!("{f:e}");
        let (mantissa, e) = s.split_once('e').unwrap_or((&s, "0"));
        let e: i32 = e.parse().unwrap_or(0);
        format!("{mantissa}e{}{:02}", if e < 0 { '-' } else { '+' }, e.abs())
    }
}

/// A JSON string as `json.dumps(..., ensure_ascii=False)` writes it.
fn write_json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// `strftime_now(format)`: the current UTC time formatted with the common strftime directives.
fn strftime_now(format: String) -> std::result::Result<Value, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    strftime(&format, secs).map(Value::from)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// Formats a Unix time (UTC) with `%Y %y %m %d %e %H %I %M %S %p %b %B %a %A %j %%`.
fn strftime(format: &str, unix_secs: i64) -> std::result::Result<String, Error> {
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday.
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let (hour, minute, second) = (secs_of_day / 3600, secs_of_day / 60 % 60, secs_of_day % 60);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(d) = chars.next() else {
            out.push('%');
            break;
        };
        let piece = match d {
            'Y' => year.to_string(),
            'y' => format!("{:02}", year.rem_euclid(100)),
            'm' => format!("{month:02}"),
            'd' => format!("{day:02}"),
            'e' => format!("{day:>2}"),
            'H' => format!("{hour:02}"),
            'I' => format!("{:02}", if hour % 12 == 0 { 12 } else { hour % 12 }),
            'M' => format!("{minute:02}"),
            'S' => format!("{second:02}"),
            'p' => (if hour < 12 { "AM" } else { "PM" }).to_string(),
            'b' => MONTHS[month as usize - 1][..3].to_string(),
            'B' => MONTHS[month as usize - 1].to_string(),
            'a' => WEEKDAYS[weekday][..3].to_string(),
            'A' => WEEKDAYS[weekday].to_string(),
            'j' => format!("{day_of_year:03}"),
            '%' => "%".to_string(),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: unsupported directive %{other}"),
                ));
            }
        };
        out.push_str(&piece);
    }
    Ok(out)
}

/// Days since 1970-01-01 to a proleptic Gregorian date (Howard Hinnant's civil algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = 1_709_211_909;
        assert_eq!(
            strftime("%Y-%m-%d %H:%M:%S", t).unwrap(),
            "2024-02-29 13:05:09"
        );
        assert_eq!(
            strftime("%d %b %Y, %A %j %I%p %%", t).unwrap(),
            "29 Feb 2024, Thursday 060 01PM %"
        );
        assert_eq!(strftime("%Y-%m-%d", 0).unwrap(), "1970-01-01");
        assert!(strftime("%Q", 0).is_err());
    }

    #[test]
    fn generation_tags_become_plain_blocks() {
        assert_eq!(
            rewrite_generation_tags(
                "a{%- generation %}b{% endgeneration -%} {% if x %}{% endif %}{{ '%}' }}"
            ),
            "a{%- if true %}b{% endif -%} {% if x %}{% endif %}{{ '%}' }}"
        );
        let t = ChatTemplate::new(
            "[{% generation %}{{ 'x' }}{%- endgeneration %}]",
            None,
            None,
        )
        .unwrap();
        assert_eq!(
            t.render(&[], false, &serde_json::Value::Null).unwrap(),
            "[x]"
        );
    }

    #[test]
    fn python_float_repr_matches_python() {
        assert_eq!(python_float(1.0), "1.0");
        assert_eq!(python_float(0.1), "0.1");
        assert_eq!(python_float(1e16), "1e+16");
        assert_eq!(python_float(1.5e-7), "1.5e-07");
        assert_eq!(python_float(0.0001), "0.0001");
    }
}
