//! The original MAGRPO code reward's text rules, reproduced exactly (rewards.md, "Code tasks"; the
//! behaviour of `rewards/code_utils.py` in OpenMLRL/LLM_Collab_Code_Generation at 7ad5985, checked
//! against fixtures that the original's own functions produced, `tests/fixtures/original_code_reward.jsonl`).
//!
//! These rules work line by line with regular expressions, and their quirks change rewards, so they
//! are kept as they are, by default: a user comparing with a published run gets the same numbers.
//! cotrain's structural alternatives ([`super::extract`]) are named options beside them. The quirks,
//! for the record:
//! - a function ends at the first non-blank line that is not indented one space deeper than its
//!   `def` (or by a tab); a nested `def` starts a new block, so the outer function's lines after it
//!   are lost;
//! - a line of prose (a capitalised sentence without code characters) is dropped anywhere;
//! - a name defined twice: the later definition wins when only blank lines separate them, else the
//!   first;
//! - "has a return" is `return` followed by whitespace anywhere in the text (docstrings included);
//! - a test is a line of `check` that starts with `assert` plus whitespace and contains `candidate`,
//!   deduplicated; a multi-line assert contributes its first line only;
//! - the thin-wrapper check re-enters "docstring" at a line that is only `"""`, so a main whose
//!   docstring closes on its own line counts as a wrapper;
//! - the "ignores aux's result" penalty matches `aux (x)`: one whitespace, one character.

use std::sync::LazyLock;

use regex::Regex;

static DEF_START: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^(\s*)def\s+\w+\s*\(").expect("valid regex"));
static ANY_DEF: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"def\s+\w+\s*\(").expect("valid regex"));
static PROSE: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^[A-Z][a-z].*[.!?:]$").expect("valid regex"));
static FENCE_PY: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"```python\s*\n?").expect("valid regex"));
static FENCE: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"```\s*\n?").expect("valid regex"));
static IMPORT_FROM: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^from\s+[\w\.]+\s+import\s+.*$").expect("valid regex"));
static IMPORT: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^import\s+[\w\.,\s]+$").expect("valid regex"));
static RETURN: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"return\s+").expect("valid regex"));
static TEST_LINE: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^assert\s+.*candidate").expect("valid regex"));
static AUX_CALL: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\baux\s*\(").expect("valid regex"));
static AUX_ASSIGN: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(\w+)\s*=\s*aux\s*\(").expect("valid regex"));
static IGNORED_CALL: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"aux\s\([^)]\)").expect("valid regex"));
static IGNORED_LINE: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^aux\s\([^)]\)$").expect("valid regex"));

/// Characters of leading whitespace (what `len(line) - len(line.lstrip())` counts).
fn indent_of(line: &str) -> usize {
    line.chars().take_while(|c| c.is_whitespace()).count()
}

/// A line that continues the block opened by a `def` indented `base` characters: blank, indented
/// by more than `base` spaces, or starting with a tab.
fn continues(line: &str, base: usize) -> bool {
    line.trim().is_empty() || line.starts_with(&" ".repeat(base + 1)) || line.starts_with('\t')
}

/// The function definitions of a completion, as the original cleans it: fences removed, blocks that
/// start at a `def` line (any indentation) and continue by [`continues`] (plus docstrings opened at
/// the `def`'s own level), joined by a blank line, prose lines dropped; empty when no `def` remains.
pub fn cleanup(code: &str) -> String {
    let code = FENCE_PY.replace_all(code, "");
    let code = FENCE.replace_all(&code, "");
    let lines: Vec<&str> = code.split('\n').collect();
    let mut blocks: Vec<String> = Vec::new();
    let mut current: Vec<&str> = Vec::new();
    let mut in_function = false;
    let mut base = 0;
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let stripped = line.trim();
        if DEF_START.is_match(line) {
            if in_function && !current.is_empty() {
                blocks.push(current.join("\n"));
            }
            current = vec![line];
            in_function = true;
            base = indent_of(line);
        } else if in_function {
            if stripped.is_empty()
                || line.starts_with(&" ".repeat(base + 1))
                || line.starts_with('\t')
            {
                current.push(line);
            } else if stripped.starts_with("\"\"\"") || stripped.starts_with("'''") {
                current.push(line);
                let quote = if stripped.starts_with("\"\"\"") {
                    "\"\"\""
                } else {
                    "'''"
                };
                if !(stripped.ends_with(quote) && stripped.chars().count() > 3) {
                    i += 1;
                    while i < lines.len() {
                        current.push(lines[i]);
                        if lines[i].contains(quote) {
                            break;
                        }
                        i += 1;
                    }
                }
            } else {
                if !current.is_empty() {
                    blocks.push(current.join("\n"));
                }
                current = Vec::new();
                in_function = false;
            }
        }
        i += 1;
    }
    if in_function && !current.is_empty() {
        blocks.push(current.join("\n"));
    }
    let joined = blocks.join("\n\n");
    let kept: Vec<&str> = joined.split('\n').filter(|line| !is_prose(line)).collect();
    let result = kept.join("\n").trim().to_string();
    if ANY_DEF.is_match(&result) {
        result
    } else {
        String::new()
    }
}

/// A line the original takes for natural language and drops.
fn is_prose(line: &str) -> bool {
    const CODE_MARKS: [&str; 10] = [
        "def ", "return ", "if ", "for ", "while ", "=", "(", ")", "[", "]",
    ];
    let stripped = line.trim();
    !stripped.is_empty()
        && !stripped.starts_with('#')
        && !stripped.starts_with("\"\"\"")
        && !stripped.starts_with("'''")
        && !CODE_MARKS.iter().any(|m| line.contains(m))
        && PROSE.is_match(stripped)
}

/// The function `name` of a completion (after [`cleanup`]), or `""`. Blank lines between two
/// definitions of the same name keep the search going (the later one wins); anything else ends it
/// (the first one wins).
pub fn extract_function(code: &str, name: &str) -> String {
    if code.is_empty() || name.is_empty() {
        return String::new();
    }
    let cleaned = cleanup(code);
    let header =
        Regex::new(&format!(r"^(\s*)def\s+{}\s*\(", regex::escape(name))).expect("escaped name");
    let mut lines: Vec<&str> = Vec::new();
    let mut inside = false;
    let mut base = 0;
    for line in cleaned.split('\n') {
        if header.is_match(line) {
            lines = vec![line];
            inside = true;
            base = indent_of(line);
        } else if inside {
            if continues(line, base) {
                lines.push(line);
            } else {
                break;
            }
        }
    }
    lines.join("\n").trim().to_string()
}

/// The prompt's import lines: every line (stripped, docstrings included) that looks like an
/// import, deduplicated in order.
pub fn prompt_imports(prompt: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for line in prompt.split('\n') {
        let line = line.trim();
        if (IMPORT_FROM.is_match(line) || IMPORT.is_match(line)) && !out.iter().any(|l| l == line) {
            out.push(line.to_string());
        }
    }
    out
}

/// The tests: lines of `check`'s body (up to the next blank-line-then-`def`, or the end) that start
/// with `assert` plus whitespace and contain `candidate`, stripped, deduplicated, `candidate`
/// replaced by the entry point everywhere in the line.
pub fn tests(test_src: &str, entry_point: &str) -> Vec<String> {
    if test_src.is_empty() || entry_point.is_empty() {
        return Vec::new();
    }
    const HEAD: &str = "def check(candidate):";
    let Some(start) = test_src.find(HEAD) else {
        return Vec::new();
    };
    let rest = &test_src[start + HEAD.len()..];
    let body = match rest.find("\n\ndef") {
        Some(end) => &rest[..end],
        None => rest,
    };
    let mut seen: Vec<&str> = Vec::new();
    for line in body.trim().split('\n') {
        let line = line.trim();
        if line.starts_with("assert")
            && line.contains("candidate")
            && TEST_LINE.is_match(line)
            && !seen.contains(&line)
        {
            seen.push(line);
        }
    }
    seen.into_iter()
        .map(|l| l.replace("candidate", entry_point))
        .collect()
}

/// `return` followed by whitespace anywhere in the function's text.
pub fn has_return(function: &str) -> bool {
    RETURN.is_match(function)
}

/// `aux(` (word boundary, optional whitespace) anywhere in main's text, comments included.
pub fn uses_aux(main: &str) -> bool {
    AUX_CALL.is_match(main)
}

/// The original's thin-wrapper test (see the module docs for its docstring quirk).
pub fn is_wrapper(main: &str) -> bool {
    if main.is_empty() {
        return false;
    }
    let mut code: Vec<&str> = Vec::new();
    let mut in_docstring = false;
    for line in main.split('\n') {
        let s = line.trim();
        if s.is_empty() {
            continue;
        }
        if s.starts_with("\"\"\"") || s.starts_with("'''") {
            let quote = if s.starts_with("\"\"\"") {
                "\"\"\""
            } else {
                "'''"
            };
            if !(s.ends_with(quote) && s.chars().count() > 3) {
                in_docstring = true;
            }
            continue;
        } else if in_docstring {
            if s.contains("\"\"\"") || s.contains("'''") {
                in_docstring = false;
            }
            continue;
        }
        if s.starts_with('#') || s.starts_with("def ") {
            continue;
        }
        code.push(s);
    }
    match code.as_slice() {
        [] => true,
        [only] => only.starts_with("return ") && only.contains("aux"),
        [first, second] => AUX_ASSIGN
            .captures(first)
            .is_some_and(|c| *second == format!("return {}", &c[1])),
        _ => false,
    }
}

/// The first line (1-based, with its text) that the original's "aux result ignored" penalty
/// matches: a stripped line that is exactly `aux`, one whitespace, `(`, one character, `)`.
pub fn ignored_aux_call(main: &str) -> Option<(usize, String)> {
    if !main.contains("aux") {
        return None;
    }
    main.split('\n').enumerate().find_map(|(i, line)| {
        let s = line.trim();
        (!s.is_empty()
            && !s.starts_with('#')
            && IGNORED_CALL.is_match(s)
            && IGNORED_LINE.is_match(s))
        .then(|| (i + 1, s.to_string()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_definitions_split_blocks_and_lose_the_outer_tail() {
        let code = "def f(x):\n    def g(y):\n        return y\n    z = g(x)\n    return z\n";
        // The nested def starts a new block; `z = g(x)` is not deeper than it, so it ends the block
        // and the outer `return z` is lost (values checked against the original's functions).
        assert_eq!(
            cleanup(code),
            "def f(x):\n\n    def g(y):\n        return y"
        );
        assert_eq!(
            extract_function(code, "f"),
            "def f(x):\n\n    def g(y):\n        return y"
        );
    }

    #[test]
    fn duplicate_definitions_adjacent_take_the_later_separated_the_first() {
        let adjacent = "def f():\n    return 1\n\ndef f():\n    return 2\n";
        assert_eq!(extract_function(adjacent, "f"), "def f():\n    return 2");
        let separated =
            "def f():\n    return 1\n\ndef g():\n    return 3\n\ndef f():\n    return 2\n";
        assert_eq!(extract_function(separated, "f"), "def f():\n    return 1");
    }

    #[test]
    fn prose_fences_and_return_detection() {
        let code = "Here is the code:\n```python\ndef aux(x):\n    \"\"\"return nothing\"\"\"\n    print(x)\n```\nThis prints x.";
        let f = extract_function(code, "aux");
        assert_eq!(
            f,
            "def aux(x):\n    \"\"\"return nothing\"\"\"\n    print(x)"
        );
        assert!(has_return(&f), "`return ` inside the docstring counts");
        assert!(!has_return("def f(x):\n    return(x)"));
    }

    #[test]
    fn tests_are_candidate_asserts_deduplicated() {
        let src = "\n\nMETADATA = {}\n\n\ndef check(candidate):\n    assert True, 'x'\n    assert candidate(1) == 2\n    assert candidate(1) == 2\n    assert candidate([1,\n        2]) == 3\n    assert(candidate(0) == 0)\n    for x in range(3):\n        assert candidate(x) == x + 1\n\n\ndef other():\n    assert candidate(9) == 9\n";
        assert_eq!(
            tests(src, "f"),
            vec!["assert f(1) == 2", "assert f([1,", "assert f(x) == x + 1"]
        );
    }

    #[test]
    fn wrapper_rules_and_the_docstring_quirk() {
        assert!(is_wrapper("def f(x):\n    return aux(x) + 1"));
        assert!(is_wrapper("def f(x):\n    y = aux(x)\n    return y"));
        assert!(!is_wrapper("def f(x):\n    y = aux(x)\n    return y + 1"));
        // The closing `"""` on its own line re-enters docstring mode: the body is never seen.
        assert!(is_wrapper(
            "def f(x):\n    \"\"\"Doc.\n    More.\n    \"\"\"\n    y = aux(x)\n    z = y * 2\n    return z"
        ));
    }

    #[test]
    fn ignored_result_needs_one_space_and_one_character() {
        assert_eq!(
            ignored_aux_call("def f(x):\n    aux (0)\n    return x"),
            Some((2, "aux (0)".into()))
        );
        assert_eq!(
            ignored_aux_call("def f(x):\n    aux(x)\n    return x"),
            None
        );
        assert_eq!(
            ignored_aux_call("def f(x):\n    aux (10)\n    return x"),
            None
        );
    }

    #[test]
    fn imports_come_from_every_prompt_line() {
        let p = "from typing import List\nimport math\n\ndef f():\n    \"\"\"\n    import os\n    \"\"\"\nfrom typing import List\n";
        assert_eq!(
            prompt_imports(p),
            vec!["from typing import List", "import math", "import os"]
        );
    }
}
