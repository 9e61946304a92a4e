//! Code tasks (HumanEval schema): agent 0 writes a helper `aux`, agent 1 the entry point that may call
//! it; one agent alone writes the entry point completely.

use super::ChatMessage;
use crate::data::CodeItem;

/// What a code agent is asked to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CodeRole {
    /// Agent 0 of two: a helper function named `aux`.
    Helper,
    /// Agent 1 of two: the entry point, which may call `aux`.
    Main,
    /// GRPO: the entry point, complete.
    Single,
}

/// Parameter names of `entry_point`'s signature in the problem prompt (annotations, defaults and
/// `*`/`/` markers dropped; `*args` / `**kwargs` kept with their stars).
pub fn signature_params(prompt: &str, entry_point: &str) -> Option<Vec<String>> {
    let needle = format!("def {entry_point}(");
    let start = prompt.find(&needle)? + needle.len();
    let mut depth = 1usize;
    let mut end = None;
    for (i, ch) in prompt[start..].char_indices() {
        match ch {
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => {
                depth -= 1;
                if depth == 0 {
                    end = Some(start + i);
                    break;
                }
            }
            _ => {}
        }
    }
    let inner = &prompt[start..end?];
    // Split on top-level commas only (annotations such as Dict[str, int] contain commas).
    let mut parts = Vec::new();
    let (mut depth, mut cur) = (0usize, String::new());
    for ch in inner.chars() {
        match ch {
            '(' | '[' | '{' => {
                depth += 1;
                cur.push(ch)
            }
            ')' | ']' | '}' => {
                depth = depth.saturating_sub(1);
                cur.push(ch)
            }
            ',' if depth == 0 => parts.push(std::mem::take(&mut cur)),
            _ => cur.push(ch),
        }
    }
    parts.push(cur);
    Some(
        parts
            .iter()
            .map(|p| p.split([':', '=']).next().unwrap_or("").trim().to_string())
            .filter(|p| !p.is_empty() && p != "*" && p != "/")
            .collect(),
    )
}

/// The first-turn prompt of a code agent.
pub fn code_prompt(item: &CodeItem, role: CodeRole) -> Vec<ChatMessage> {
    let problem = item.prompt.trim_end();
    let entry = &item.entry_point;
    let params = signature_params(&item.prompt, entry).map(|p| p.join(", ")).unwrap_or_default();
    let text = match role {
        CodeRole::Helper => format!(
            "Create a helper function for this coding problem.\n\n\
             Problem:\n{problem}\n\n\
             IMPORTANT INSTRUCTIONS:\n\
             - Output ONLY the function code, no explanations or examples\n\
             - Do NOT include markdown code blocks (```python)\n\
             - Do NOT include any text before or after the function\n\
             - Do NOT include test cases or example usage\n\
             - Create a helper function named 'aux' that can assist the main function\n\
             - The function should return useful data for solving the problem\n\n\
             Your output should follow this format:\n\n\
             def aux(...):\n    # your function code here\n    return result\n"
        ),
        CodeRole::Main => format!(
            "Solve this coding problem by implementing the required function.\n\n\
             Problem:\n{problem}\n\n\
             You have access to a helper function: aux(...)\n\n\
             IMPORTANT INSTRUCTIONS:\n\
             - Output ONLY the function code, no explanations or examples\n\
             - Do NOT include markdown code blocks (```python)\n\
             - Do NOT include any text before or after the function\n\
             - Do NOT include test cases or example usage\n\
             - Do NOT redefine the aux() function\n\
             - Implement ONLY the '{entry}' function as specified\n\
             - You can call aux() to assign value to a variable within your function if helpful\n\n\
             Your output should follow this format:\n\n\
             def {entry}({params}):\n    # your function code here\n    return result\n"
        ),
        CodeRole::Single => format!(
            "Solve this coding problem by implementing the required function.\n\n\
             Problem:\n{problem}\n\n\
             IMPORTANT INSTRUCTIONS:\n\
             - Output ONLY the function code, no explanations or examples\n\
             - Do NOT include markdown code blocks (```python)\n\
             - Do NOT include any text before or after the function\n\
             - Do NOT include test cases or example usage\n\
             - Implement the '{entry}' function completely, as specified\n\n\
             Your output should follow this format:\n\n\
             def {entry}({params}):\n    # your function code here\n    return result\n"
        ),
    };
    vec![ChatMessage::user(text)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signature_params_skip_annotations_defaults_and_nested_commas() {
        let p = "from typing import List, Dict\n\ndef f(numbers: List[float], m: Dict[str, int] = {}, *args, k=3, **kw) -> bool:\n";
        assert_eq!(signature_params(p, "f").unwrap(), vec!["numbers", "m", "*args", "k", "**kw"]);
        assert_eq!(signature_params("def g():\n", "g").unwrap(), Vec::<String>::new());
        assert_eq!(signature_params("def g(x):\n", "h"), None);
    }

    #[test]
    fn code_prompts_carry_the_agent_role() {
        let item = CodeItem {
            task_id: "t".into(),
            prompt: "def add(a: int, b: int) -> int:\n    \"\"\"Add.\"\"\"\n".into(),
            test: "def check(candidate):\n    assert candidate(1, 2) == 3\n".into(),
            entry_point: "add".into(),
        };
        let helper = &code_prompt(&item, CodeRole::Helper)[0].content;
        assert!(helper.contains("named 'aux'") && helper.contains("def add(a: int, b: int)"));
        let main = &code_prompt(&item, CodeRole::Main)[0].content;
        assert!(main.contains("def add(a, b):") && main.contains("Do NOT redefine the aux()"));
        let single = &code_prompt(&item, CodeRole::Single)[0].content;
        assert!(single.contains("def add(a, b):") && !single.contains("aux"));
    }
}
