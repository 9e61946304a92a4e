//! Dataset rows turned into what the trainer needs: per agent, the prompt token ids (the agent's
//! prompt template, then the model's chat template if the config asks for it, then its tokenizer),
//! and the row as the reward server reads it.

use cotrain_model::chat_template::{ChatMessage as TemplateMessage, ChatTemplate};
use cotrain_model::loader::LoadedModel;
use cotrain_model::tokenizer::Tokenizer;

use super::Prompter;
use crate::data::{Dataset, DatasetKind, TaskItem};
use crate::error::TrainError;

/// One dataset row, ready to be rolled out.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainItem {
    /// Row index in the selected split.
    pub index: usize,
    /// The row as JSON (what the reward server scores against).
    pub item: serde_json::Value,
    /// Prompt token ids, one per agent.
    pub prompts: Vec<Vec<u32>>,
    /// The first-turn user text of each agent, before any chat template (what later turns quote as
    /// the original problem and keep in the history).
    pub texts: Vec<String>,
}

/// The reward server's task name for a dataset kind.
pub fn reward_task(kind: DatasetKind) -> &'static str {
    match kind {
        DatasetKind::HumanEval | DatasetKind::CoopHumanEval | DatasetKind::Mbpp => "code",
        DatasetKind::Arxiv => "arxiv",
        DatasetKind::Tldr => "tldr",
        DatasetKind::Gsm8k => "gsm8k",
        DatasetKind::Anli => "anli",
    }
}

/// The reward server's view of a row: the row's fields (its `task` tag is harmless extra).
pub fn item_json(item: &TaskItem) -> serde_json::Value {
    serde_json::to_value(item).unwrap_or(serde_json::Value::Null)
}

/// How a prompt text becomes what the model reads.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptEncoding {
    /// `model.chat_template`: wrap the text as one user message of the model's chat template.
    pub chat_template: bool,
    /// Extra chat-template variables (`enable_thinking`).
    pub extra: serde_json::Value,
}

impl PromptEncoding {
    /// `model.chat_template` and `model.enable_thinking` (the config builds it:
    /// `CheckedConfig::prompt_encoding`, so that `data` does not import `config`).
    pub fn new(chat_template: bool, enable_thinking: Option<bool>) -> Self {
        let extra = match enable_thinking {
            Some(b) => serde_json::json!({ "enable_thinking": b }),
            None => serde_json::Value::Null,
        };
        Self {
            chat_template,
            extra,
        }
    }

    /// The exact text the model receives: `text` itself (the original tokenises the raw prompt), or
    /// `text` as a user message rendered with the model's chat template.
    pub fn model_text(
        &self,
        chat_template: Option<&ChatTemplate>,
        text: &str,
    ) -> Result<String, TrainError> {
        if !self.chat_template {
            return Ok(text.to_string());
        }
        self.render_chat(chat_template, &[TemplateMessage::new("user", text)])
    }

    /// `messages` rendered with the model's chat template (the generation prompt added), with this
    /// encoding's extra variables; an error when the model has none.
    pub fn render_chat(
        &self,
        chat_template: Option<&ChatTemplate>,
        messages: &[TemplateMessage],
    ) -> Result<String, TrainError> {
        let t = chat_template.ok_or_else(|| {
            TrainError::Config(
                "model.chat_template is true but the model has no chat template".into(),
            )
        })?;
        t.render(messages, true, &self.extra)
            .map_err(|e| TrainError::Model(format!("chat template: {e}")))
    }
}

/// Tokenizes the text the model receives (no special tokens added: the chat template, if any, has
/// them already, and the original's raw prompts get none).
pub fn encode_text(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>, TrainError> {
    let ids = tokenizer
        .encode(text, false)
        .map_err(|e| TrainError::Model(format!("tokenizer: {e}")))?;
    if ids.is_empty() {
        return Err(TrainError::Data("a prompt tokenized to nothing".into()));
    }
    Ok(ids)
}

/// One agent's prompt of one row, as the model receives it.
#[derive(Debug, Clone, PartialEq)]
pub struct RenderedPrompt {
    /// The agent's prompt template rendered (the user message).
    pub user_text: String,
    /// What the model reads (the user text, or it in the model's chat template).
    pub text: String,
    pub ids: Vec<u32>,
}

/// The prompt of `agent` for row `index` of `data`.
pub fn render_prompt(
    data: &Dataset,
    index: usize,
    agent: usize,
    tokenizer: &Tokenizer,
    chat_template: Option<&ChatTemplate>,
    prompter: &Prompter,
    encoding: &PromptEncoding,
) -> Result<RenderedPrompt, TrainError> {
    let row = data.row_offset + index;
    let user_text = prompter
        .render(&data.items[index], row, agent)
        .map_err(|e| TrainError::Config(e.to_string()))?;
    let text = encoding.model_text(chat_template, &user_text)?;
    let ids = encode_text(tokenizer, &text)?;
    Ok(RenderedPrompt {
        user_text,
        text,
        ids,
    })
}

/// Builds every row's per-agent prompts; `models[agent]` is the model agent `agent` samples from.
/// Prompts longer than `max_prompt_tokens` are an error naming the row (silently cutting a problem
/// statement would train on a different task).
pub fn prepare_items(
    data: &Dataset,
    models: &[&LoadedModel],
    prompter: &Prompter,
    encoding: &PromptEncoding,
    max_prompt_tokens: &[usize],
) -> Result<Vec<TrainItem>, TrainError> {
    let n = models.len();
    (0..data.items.len())
        .map(|index| {
            let rendered = (0..n)
                .map(|agent| {
                    let m = models[agent];
                    let p = render_prompt(data, index, agent, &m.tokenizer, m.chat_template.as_ref(), prompter, encoding)?;
                    let limit = max_prompt_tokens[agent];
                    if p.ids.len() > limit {
                        return Err(TrainError::Data(format!(
                            "row {} of split {}: agent {agent}'s prompt has {} tokens, more than model.max_length - max_new_tokens = {limit} \
                             (max_new_tokens: the agent's model.agents[i].max_new_tokens when set)",
                            data.row_offset + index,
                            data.split,
                            p.ids.len()
                        )));
                    }
                    Ok(p)
                })
                .collect::<Result<Vec<_>, _>>()?;
            let (prompts, texts) = rendered.into_iter().map(|p| (p.ids, p.user_text)).unzip();
            Ok(TrainItem { index, item: item_json(&data.items[index]), prompts, texts })
        })
        .collect()
}

// Here rather than in `config`: the config knows nothing of prompts.
impl crate::config::CheckedConfig {
    /// How this config's prompt texts become what the model reads.
    pub fn prompt_encoding(&self) -> PromptEncoding {
        PromptEncoding::new(self.raw.model.chat_template, self.raw.model.enable_thinking)
    }
}
