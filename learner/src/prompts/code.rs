//! Values derived from code problems (HumanEval schema) for the prompt templates.

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signature_params_skip_annotations_defaults_and_nested_commas() {
        let p = "from typing import List, Dict\n\ndef f(numbers: List[float], m: Dict[str, int] = {}, *args, k=3, **kw) -> bool:\n";
        assert_eq!(
            signature_params(p, "f").unwrap(),
            vec!["numbers", "m", "*args", "k", "**kw"]
        );
        assert_eq!(
            signature_params("def g():\n", "g").unwrap(),
            Vec::<String>::new()
        );
        assert_eq!(signature_params("def g(x):\n", "h"), None);
    }
}
