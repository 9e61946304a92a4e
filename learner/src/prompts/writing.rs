//! Writing tasks: arXiv abstract expansion in two halves and TLDR concise vs detailed summaries; one
//! agent alone writes both parts separated by [`PARAGRAPH_SPLIT`].

use super::ChatMessage;
use crate::data::{ArxivItem, TldrItem};

/// The separator a single writing agent puts between its two parts.
pub const PARAGRAPH_SPLIT: &str = "[PARAGRAPH_SPLIT]";

/// Which part a writing agent writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WritingRole {
    /// Agent 1 (index 0): arXiv background and motivation / TLDR concise summary.
    First,
    /// Agent 2 (index 1): arXiv methodology and implications / TLDR detailed summary.
    Second,
    /// GRPO: both parts in one completion.
    Single,
}

/// arXiv abstract expansion.
pub fn arxiv_prompt(item: &ArxivItem, role: WritingRole) -> Vec<ChatMessage> {
    let abs = item.abstract_text.trim();
    let text = match role {
        WritingRole::First => format!(
            "Based on the following scientific abstract, expand the content for an introduction section.\n\n\
             Abstract:\n{abs}\n\n\
             Instructions:\n\
             - Write about the background and motivation of this work\n\
             - Another writer covers the methodology and implications, so do not discuss those\n\
             - Write one coherent paragraph of about 128 to 256 words, without headings or lists\n"
        ),
        WritingRole::Second => format!(
            "Based on the following scientific abstract, expand the content for an introduction section.\n\n\
             Abstract:\n{abs}\n\n\
             Instructions:\n\
             - Write about the methodology of this work and its implications\n\
             - Another writer covers the background and motivation, so do not discuss those\n\
             - Write one coherent paragraph of about 128 to 256 words, without headings or lists\n"
        ),
        WritingRole::Single => format!(
            "Based on the following scientific abstract, expand the content for an introduction section in two \
             paragraphs.\n\n\
             Abstract:\n{abs}\n\n\
             Instructions:\n\
             - Paragraph 1: the background and motivation of this work\n\
             - Paragraph 2: the methodology of this work and its implications\n\
             - Each paragraph about 128 to 256 words, without headings or lists\n\
             - Separate the two paragraphs with the marker {PARAGRAPH_SPLIT} on its own line\n"
        ),
    };
    vec![ChatMessage::user(text)]
}

/// TLDR summarisation of a Reddit post.
pub fn tldr_prompt(item: &TldrItem, role: WritingRole) -> Vec<ChatMessage> {
    let post = item.prompt.trim();
    let text = match role {
        WritingRole::First => format!(
            "Create a concise summary of the following post.\n\n{post}\n\n\
             Instructions:\n\
             - Give only the main point in one or two short sentences\n\
             - Another writer gives a detailed summary, so keep yours brief\n"
        ),
        WritingRole::Second => format!(
            "Create a detailed summary of the following post.\n\n{post}\n\n\
             Instructions:\n\
             - Cover the situation, the key details and the outcome in a few sentences\n\
             - Use a richer vocabulary (more distinct words) than a one-line summary would\n\
             - Connect ideas with transition words (for example: however, therefore, meanwhile, in addition)\n\
             - Another writer gives a concise summary; yours should be noticeably longer\n"
        ),
        WritingRole::Single => format!(
            "Summarise the following post twice.\n\n{post}\n\n\
             Instructions:\n\
             - Part 1: a concise summary, one or two short sentences with only the main point\n\
             - Part 2: a detailed summary with more distinct words and transition words (however, therefore, \
             meanwhile, ...)\n\
             - Separate the two parts with the marker {PARAGRAPH_SPLIT} on its own line\n"
        ),
    };
    vec![ChatMessage::user(text)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_agent_writing_prompts_ask_for_the_split_marker() {
        let a = ArxivItem { article_id: "1".into(), abstract_text: "We study X.".into(), token_count: None };
        assert!(arxiv_prompt(&a, WritingRole::Single)[0].content.contains(PARAGRAPH_SPLIT));
        assert!(!arxiv_prompt(&a, WritingRole::First)[0].content.contains(PARAGRAPH_SPLIT));
        assert!(arxiv_prompt(&a, WritingRole::First)[0].content.contains("background and motivation of this work"));
        assert!(arxiv_prompt(&a, WritingRole::Second)[0].content.contains("methodology of this work"));
        let t = TldrItem { prompt: "SUBREDDIT: r/x\n\nTITLE: t\n\nPOST: p\n\nTL;DR:".into(), reference: None };
        assert!(tldr_prompt(&t, WritingRole::First)[0].content.starts_with("Create a concise summary"));
        assert!(tldr_prompt(&t, WritingRole::Second)[0].content.contains("transition words"));
        assert!(tldr_prompt(&t, WritingRole::Single)[0].content.contains(PARAGRAPH_SPLIT));
    }
}
