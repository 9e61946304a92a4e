//! Dataset rows turned into what the trainer needs: per agent, the prompt token ids (the task's prompt
//! formatter, then the model's chat template, then its tokenizer), and the row as the reward server
//! reads it.

use cotrain_model::chat_template::ChatMessage as TemplateMessage;
use cotrain_model::loader::LoadedModel;

use super::TrainError;
use crate::data::{Dataset, DatasetKind, TaskItem};
use crate::prompts::{ChatMessage, first_turn_prompt};

/// One dataset row, ready to be rolled out.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainItem {
    /// Row index in the selected split.
    pub index: usize,
    /// The row as JSON (what the reward server scores against).
    pub item: serde_json::Value,
    /// Prompt token ids, one per agent.
    pub prompts: Vec<Vec<u32>>,
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

/// Renders messages with the model's chat template (plain concatenation when it has none) and
/// tokenizes them.
pub fn encode_prompt(model: &LoadedModel, messages: &[ChatMessage], extra: &serde_json::Value) -> Result<Vec<u32>, TrainError> {
    let text = match &model.chat_template {
        Some(t) => {
            let msgs: Vec<TemplateMessage> = messages.iter().map(|m| TemplateMessage::new(m.role.clone(), m.content.clone())).collect();
            t.render(&msgs, true, extra).map_err(|e| TrainError::Model(format!("chat template: {e}")))?
        }
        None => messages.iter().map(|m| m.content.as_str()).collect::<Vec<_>>().join("\n\n"),
    };
    let ids = model.tokenizer.encode(&text, false).map_err(|e| TrainError::Model(format!("tokenizer: {e}")))?;
    if ids.is_empty() {
        return Err(TrainError::Data("a prompt tokenized to nothing".into()));
    }
    Ok(ids)
}

/// Builds every row's per-agent prompts; `models[agent]` is the model agent `agent` samples from.
/// Prompts longer than `max_prompt_tokens` are an error naming the row (silently cutting a problem
/// statement would train on a different task).
pub fn prepare_items(
    data: &Dataset,
    models: &[&LoadedModel],
    extra: &serde_json::Value,
    max_prompt_tokens: usize,
) -> Result<Vec<TrainItem>, TrainError> {
    let n = models.len();
    data.items
        .iter()
        .enumerate()
        .map(|(index, item)| {
            let prompts = (0..n)
                .map(|agent| {
                    let messages = first_turn_prompt(item, agent, n).map_err(|e| TrainError::Data(e.to_string()))?;
                    let ids = encode_prompt(models[agent], &messages, extra)?;
                    if ids.len() > max_prompt_tokens {
                        return Err(TrainError::Data(format!(
                            "row {} of split {}: agent {agent}'s prompt has {} tokens, more than model.max_length - max_new_tokens = {max_prompt_tokens}",
                            data.row_offset + index,
                            data.split,
                            ids.len()
                        )));
                    }
                    Ok(ids)
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok(TrainItem { index, item: item_json(item), prompts })
        })
        .collect()
}
