//! Pre-processing of code completions and of the dataset's tests (rewards.md, "Code tasks").
//!
//! Decisions where the definition leaves room, in one place:
//! - **Fences**: every line whose first non-blank characters are three backticks is dropped
//!   (opening fences with a language tag included); the lines between are kept.
//! - **Function definitions**: a definition starts at a physical line `def NAME(` / `async def
//!   NAME(` (any indentation) together with the `@decorator` lines directly above it at the same
//!   indentation, and runs until the first logical line indented no deeper than the `def`.
//!   Continuation lines (open brackets, triple-quoted strings, backslashes) belong to it whatever
//!   their indentation, so a docstring with lines at column 0 stays whole. Nested definitions
//!   and indented bodies are part of their enclosing function. Everything else (prose, stray
//!   statements, `if __name__ == ...` blocks, example calls) is dropped. The block is dedented by
//!   the `def`'s indentation, so a completion indented as a whole still works.
//! - **Which definition**: when a name is defined several times, the LAST definition is taken,
//!   as Python itself would bind it.
//! - **Imports**: the problem prompt's top-level `import` / `from ... import` statements; in
//!   addition (option `completion_imports`, on by default) single-line top-level import
//!   statements written in the completions themselves, because a model told to write code only
//!   legitimately writes `import math` above its function. The prompt's own helper functions
//!   (other than the entry point, e.g. `poly` in HumanEval/32) are included too (option
//!   `prompt_helpers`, on by default) because the tests and the canonical solutions call them.
//! - **Tests**: see [`extract_tests`].

use std::sync::LazyLock;

use regex::Regex;

use super::pysrc::{
    LogicalLines, Stmt, indent_width, is_string_expr, physical_lines, rename_identifier, scan,
    starts_with_keyword, statements,
};

static DEF_RE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^\s*(?:async\s+)?def\s+([A-Za-z_][A-Za-z0-9_]*)\s*\(").expect("valid regex")
});
static IMPORT_RE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(concat!(
        r"^(?:import\s+[A-Za-z_][\w.]*(?:\s+as\s+\w+)?(?:\s*,\s*[A-Za-z_][\w.]*(?:\s+as\s+\w+)?)*",
        r"|from\s+\.*[A-Za-z_][\w.]*\s+import\s+(?:\*|\w+(?:\s+as\s+\w+)?(?:\s*,\s*\w+(?:\s+as\s+\w+)?)*))",
        r"\s*;?\s*$"
    ))
    .expect("valid regex")
});

/// Drops markdown fence lines (```` ``` ````, ```` ```python ````, ...).
pub fn strip_fences(text: &str) -> String {
    physical_lines(text)
        .into_iter()
        .filter(|l| !l.trim_start().starts_with("```"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// One top-level function definition found in a text.
#[derive(Debug, Clone, PartialEq)]
pub struct FunctionSource {
    pub name: String,
    /// The definition with its decorators, dedented to column 0.
    pub source: String,
    /// 0-based physical line range `[start, end]` in the scanned text.
    pub start: usize,
    pub end: usize,
}

fn dedent(line: &str, width: usize) -> &str {
    let mut w = 0;
    for (pos, c) in line.char_indices() {
        if w >= width {
            return &line[pos..];
        }
        match c {
            ' ' => w += 1,
            '\t' => w = (w / 8 + 1) * 8,
            _ => return &line[pos..],
        }
    }
    ""
}

/// All function definitions in `text` that are not nested in another one, in order.
pub fn function_blocks(text: &str) -> Vec<FunctionSource> {
    let phys = physical_lines(text);
    let mut out = Vec::new();
    let mut i = 0;
    let mut prev_end = 0usize; // first line not yet consumed by a block
    while i < phys.len() {
        let Some(caps) = DEF_RE.captures(phys[i]) else {
            i += 1;
            continue;
        };
        let name = caps[1].to_string();
        let ind = indent_width(phys[i]);
        // Only this block is scanned: the first logical line indented no deeper than the
        // `def` (after the `def` itself) ends it.
        let mut end_rel = phys.len() - i;
        let mut last_rel = 0;
        for (k, l) in LogicalLines::new(&phys[i..]).enumerate() {
            if k > 0 && l.indent <= ind {
                end_rel = l.first;
                break;
            }
            last_rel = l.last;
        }
        debug_assert!(last_rel < end_rel);
        let mut start = i;
        while start > prev_end
            && phys[start - 1].trim_start().starts_with('@')
            && indent_width(phys[start - 1]) == ind
        {
            start -= 1;
        }
        let end = i + last_rel;
        let source = phys[start..=end]
            .iter()
            .map(|l| dedent(l, ind))
            .collect::<Vec<_>>()
            .join("\n");
        out.push(FunctionSource {
            name,
            source,
            start,
            end,
        });
        i = end + 1;
        prev_end = i;
    }
    out
}

/// The last top-level definition of `name` in `text` (fences already stripped).
pub fn find_function(text: &str, name: &str) -> Option<FunctionSource> {
    function_blocks(text)
        .into_iter()
        .rev()
        .find(|f| f.name == name)
}

/// Single-line import statements outside every function definition of a completion.
pub fn completion_imports(text: &str) -> Vec<String> {
    let blocks = function_blocks(text);
    physical_lines(text)
        .into_iter()
        .enumerate()
        .filter(|(i, _)| !blocks.iter().any(|b| (b.start..=b.end).contains(i)))
        .map(|(_, l)| l.trim())
        .filter(|l| IMPORT_RE.is_match(l))
        .map(|l| l.trim_end_matches(';').trim().to_string())
        .collect()
}

/// The prompt's top-level `import` and `from ... import` statements, as written.
pub fn prompt_imports(prompt: &str) -> Vec<String> {
    let phys = physical_lines(prompt);
    scan(prompt)
        .lines
        .into_iter()
        .filter(|l| {
            l.indent == 0
                && (starts_with_keyword(&l.skeleton, "import")
                    || (starts_with_keyword(&l.skeleton, "from")
                        && l.skeleton.contains(" import ")))
        })
        .map(|l| phys[l.first..=l.last].join("\n"))
        .collect()
}

/// The prompt's complete helper functions (every top-level definition except the entry point).
pub fn prompt_helpers(prompt: &str, entry_point: &str) -> Vec<String> {
    function_blocks(prompt)
        .into_iter()
        .filter(|f| f.name != entry_point)
        .map(|f| f.source)
        .collect()
}

/// One test of an item, ready to run after the program's definitions.
#[derive(Debug, Clone, PartialEq)]
pub struct ExtractedTest {
    /// The test statement as shown to users, `candidate` already replaced.
    pub assert_text: String,
    /// What the sandbox executes: the set-up statements of `check` that precede this test,
    /// then the test statement.
    pub code: String,
}

/// The tests of a HumanEval-schema `test` field.
///
/// Every statement directly in the body of `check(candidate)` that contains an `assert` using
/// `candidate` is one test (`assert True, "..."` lines are not). For the usual one-line `assert candidate(...) == ...` that is exactly "each assert
/// line"; an assert spanning several physical lines (brackets, continuation) is one test, and a
/// compound statement holding asserts (`for x in ...: assert ...`, HumanEval/32, /44, /53) is one
/// test, since its asserts are meaningless without the loop. The other statements of the body
/// (imports, `rng = random.Random(42)`, `lst = ...`) are set-up: each test is preceded by all
/// set-up statements that come before it in `check`, so it runs in the state it would have in
/// the original function. `candidate` is renamed to the entry point as an identifier (never
/// inside strings or comments). Returns an empty list if there is no `check` function.
pub fn extract_tests(test_src: &str, entry_point: &str) -> Vec<ExtractedTest> {
    let Some(check) = find_function(test_src, "check") else {
        return Vec::new();
    };
    let lines = physical_lines(&check.source);
    let sc = scan(&check.source);
    let Some(h) = sc.lines.iter().position(|l| {
        starts_with_keyword(&l.skeleton, "def") || starts_with_keyword(&l.skeleton, "async")
    }) else {
        return Vec::new();
    };
    let header_indent = sc.lines[h].indent;
    let body: Vec<_> = sc.lines[h + 1..]
        .iter()
        .filter(|l| l.indent > header_indent)
        .collect();
    let Some(first) = body.first() else {
        return Vec::new();
    };
    let child_indent = first.indent;

    let mut groups: Vec<Vec<&super::pysrc::LogicalLine>> = Vec::new();
    for l in body {
        if l.indent <= child_indent || groups.is_empty() {
            groups.push(vec![l]);
        } else if let Some(g) = groups.last_mut() {
            g.push(l);
        }
    }
    let assert_re = Regex::new(r"\bassert\b").expect("valid regex");
    let candidate_re = Regex::new(r"\bcandidate\b").expect("valid regex");
    let mut context: Vec<String> = Vec::new();
    let mut tests = Vec::new();
    for g in groups {
        let first = g[0].first;
        let last = g.iter().map(|l| l.last).max().unwrap_or(first);
        let text = lines[first..=last]
            .iter()
            .map(|l| dedent(l, child_indent))
            .collect::<Vec<_>>()
            .join("\n");
        let text = rename_identifier(&text, "candidate", entry_point);
        let asserts = g.iter().any(|l| assert_re.is_match(&l.skeleton));
        let uses_candidate = g.iter().any(|l| candidate_re.is_match(&l.skeleton));
        if asserts && !uses_candidate {
            // `assert True, "..."`: checks nothing about the solution, so it is no test.
            continue;
        }
        if asserts {
            let mut code = context.join("\n");
            if !code.is_empty() {
                code.push('\n');
            }
            code.push_str(&text);
            tests.push(ExtractedTest {
                assert_text: text,
                code,
            });
        } else if !(g.len() == 1 && is_string_expr(&g[0].skeleton)) {
            context.push(text);
        }
    }
    tests
}

/// Structural facts about one function, used by levels 1 and 4 and by the diagnostics.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FunctionFacts {
    /// A `return` statement of the function itself (nested `def`/`class` bodies excluded).
    pub has_return: bool,
    /// The body calls `aux(` (a plain call: `obj.aux(` and a nested `def aux(` do not count).
    pub calls_aux: bool,
    /// The body is only `return ...aux(...)...`, or only `x = ...aux(...)...` then `return x`
    /// (a leading docstring ignored).
    pub thin_wrapper: bool,
    /// The first statement that calls aux and throws the result away: the whole statement is
    /// one call `aux(...)` (optionally `await aux(...)`). 1-based line within the function's
    /// source and the statement's text.
    pub ignored_aux_call: Option<(usize, String)>,
}

fn is_def_header(skel: &str) -> bool {
    starts_with_keyword(skel, "def")
        || (starts_with_keyword(skel, "async") && skel.contains("def "))
}

/// The body statements of the (single) function in `source`, header and decorators excluded.
fn body_statements(source: &str) -> Vec<Stmt> {
    let st = statements(source);
    let Some(h) = st.iter().position(|s| is_def_header(&s.skel)) else {
        return Vec::new();
    };
    let hi = st[h].indent;
    st.into_iter()
        .skip(h + 1)
        .take_while(|s| s.indent > hi)
        .collect()
}

/// The pattern of a plain call of `aux` (not `obj.aux(`, not `my_aux(`).
fn call_pattern(aux: &str) -> Regex {
    Regex::new(&format!(r"(?:^|[^\w.])({})\s*\(", regex::escape(aux))).expect("valid regex")
}

fn calls(skel: &str, re: &Regex) -> bool {
    re.captures_iter(skel).any(|c| {
        let name_start = c.get(1).map_or(0, |m| m.start());
        let before = skel[..name_start].trim_end();
        // `def aux(` defines a function; it does not call one.
        before
            .rsplit(|ch: char| !(ch.is_alphanumeric() || ch == '_'))
            .next()
            != Some("def")
    })
}

/// True if `skel` is exactly one call `aux(...)` whose parentheses close at its end.
fn is_bare_call(skel: &str, aux: &str) -> bool {
    let s = skel.trim();
    let s = s.strip_prefix("await ").map(str::trim_start).unwrap_or(s);
    let Some(rest) = s.strip_prefix(aux) else {
        return false;
    };
    let rest = rest.trim_start();
    if !rest.starts_with('(') {
        return false;
    }
    let mut depth = 0usize;
    for (pos, c) in rest.char_indices() {
        match c {
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return rest[pos + 1..].trim().is_empty();
                }
            }
            _ => {}
        }
    }
    false
}

/// `NAME = rhs` or `NAME: T = rhs` (a single-target assignment): returns (NAME, rhs).
fn simple_assignment(skel: &str) -> Option<(&str, &str)> {
    let bytes = skel.as_bytes();
    let mut depth = 0usize;
    for (i, &b) in bytes.iter().enumerate() {
        match b {
            b'(' | b'[' | b'{' => depth += 1,
            b')' | b']' | b'}' => depth = depth.saturating_sub(1),
            b'=' if depth == 0 => {
                let prev = if i > 0 { bytes[i - 1] } else { b' ' };
                let next = bytes.get(i + 1).copied().unwrap_or(b' ');
                if next == b'=' || matches!(prev, b'=' | b'!' | b'<' | b'>' | b':') {
                    return None;
                }
                let lhs = skel[..i].trim();
                let lhs = lhs.split(':').next().unwrap_or(lhs).trim();
                let ident = !lhs.is_empty()
                    && lhs
                        .chars()
                        .next()
                        .is_some_and(|c| c.is_alphabetic() || c == '_')
                    && lhs.chars().all(|c| c.is_alphanumeric() || c == '_');
                return ident.then(|| (lhs, skel[i + 1..].trim()));
            }
            _ => {}
        }
    }
    None
}

/// Structural facts of the function in `source` (one definition, as in [`FunctionSource`]),
/// with the helper's name `aux`.
pub fn function_facts(source: &str, aux: &str) -> FunctionFacts {
    let body = body_statements(source);
    let mut facts = FunctionFacts::default();

    let mut skip_deeper_than: Option<usize> = None;
    for s in &body {
        if let Some(d) = skip_deeper_than {
            if s.indent > d {
                continue;
            }
            skip_deeper_than = None;
        }
        if is_def_header(&s.skel) || starts_with_keyword(&s.skel, "class") {
            skip_deeper_than = Some(s.indent);
            continue;
        }
        if starts_with_keyword(&s.skel, "return") {
            facts.has_return = true;
        }
    }

    let call_re = call_pattern(aux);
    facts.calls_aux = body.iter().any(|s| calls(&s.skel, &call_re));
    let phys = physical_lines(source);
    facts.ignored_aux_call = body.iter().find(|s| is_bare_call(&s.skel, aux)).map(|s| {
        (
            s.first + 1,
            phys[s.first..=s.last]
                .iter()
                .map(|l| l.trim())
                .collect::<Vec<_>>()
                .join(" "),
        )
    });

    if let Some(first) = body.first() {
        let direct: Vec<&Stmt> = body.iter().filter(|s| s.indent == first.indent).collect();
        let direct: Vec<&Stmt> = match direct.first() {
            Some(d) if is_string_expr(&d.skel) => direct[1..].to_vec(),
            _ => direct,
        };
        let ret_expr = |s: &Stmt| -> Option<String> {
            starts_with_keyword(&s.skel, "return")
                .then(|| s.skel["return".len()..].trim().to_string())
        };
        facts.thin_wrapper = match direct.as_slice() {
            [only] => ret_expr(only).is_some_and(|e| calls(&e, &call_re)),
            [assign, ret] => match (simple_assignment(&assign.skel), ret_expr(ret)) {
                (Some((name, rhs)), Some(e)) => {
                    calls(rhs, &call_re) && (e == name || e == format!("({name})"))
                }
                _ => false,
            },
            _ => false,
        };
    }
    facts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fences_and_prose_are_dropped_and_decorators_kept() {
        let text = "Sure! Here's the helper:\n```python\nimport math\n\n@cache\ndef aux(n):\n    \"\"\"doc\nunindented doc line\n\"\"\"\n    def inner(k):\n        return k\n\n    return inner(n)\n```\nThis works (mostly.\n";
        let clean = strip_fences(text);
        let blocks = function_blocks(&clean);
        assert_eq!(blocks.len(), 1);
        assert_eq!(blocks[0].name, "aux");
        assert_eq!(
            blocks[0].source,
            "@cache\ndef aux(n):\n    \"\"\"doc\nunindented doc line\n\"\"\"\n    def inner(k):\n        return k\n\n    return inner(n)"
        );
        assert_eq!(completion_imports(&clean), vec!["import math".to_string()]);
    }

    #[test]
    fn unbalanced_brackets_in_prose_do_not_hide_a_definition() {
        let text = "Note (see below:\ndef aux(x):\n    return x\nDone [really.\n";
        let f = find_function(text, "aux").unwrap();
        assert_eq!(f.source, "def aux(x):\n    return x");
    }

    #[test]
    fn many_definitions_are_extracted_in_linear_time() {
        let text: String = (0..20_000)
            .map(|i| format!("def f{i}():\n    return {i}\n"))
            .collect();
        let start = std::time::Instant::now();
        let blocks = function_blocks(&text);
        assert_eq!(blocks.len(), 20_000);
        assert_eq!(blocks[19_999].source, "def f19999():\n    return 19999");
        // A rescan of the rest of the text per definition (quadratic) takes minutes here.
        assert!(
            start.elapsed().as_secs_f64() < 5.0,
            "took {:?}",
            start.elapsed()
        );
    }

    #[test]
    fn last_definition_wins_and_indented_completions_are_dedented() {
        let text = "    def f(x):\n        return 1\n    def f(x):\n        return 2\n";
        let f = find_function(text, "f").unwrap();
        assert_eq!(f.source, "def f(x):\n    return 2");
    }

    #[test]
    fn return_inside_nested_def_does_not_count() {
        let src = "def aux(x):\n    def g():\n        return 1\n    print(g())\n";
        assert!(!function_facts(src, "aux").has_return);
        let src = "def aux(x):\n    if x: return 1\n";
        assert!(function_facts(src, "aux").has_return);
    }

    #[test]
    fn thin_wrapper_forms() {
        let f = |s: &str| function_facts(s, "aux");
        assert!(f("def main(a):\n    \"\"\"doc\"\"\"\n    return aux(a)\n").thin_wrapper);
        assert!(f("def main(a):\n    return sorted(aux(a))[0]\n").thin_wrapper);
        assert!(f("def main(a):\n    r = aux(a, 2)\n    return r\n").thin_wrapper);
        assert!(f("def main(a): return aux(a)").thin_wrapper);
        assert!(!f("def main(a):\n    r = aux(a)\n    return r + 1\n").thin_wrapper);
        assert!(
            !f("def main(a):\n    if a < 0:\n        return 0\n    return aux(a)\n").thin_wrapper
        );
        assert!(!f("def main(a):\n    return a + 1\n").thin_wrapper);
    }

    #[test]
    fn ignored_result_is_a_bare_call_statement() {
        let src = "def main(a):\n    aux(a)\n    return a\n";
        assert_eq!(
            function_facts(src, "aux").ignored_aux_call,
            Some((2, "aux(a)".to_string()))
        );
        let used = "def main(a):\n    print(aux(a))\n    x = [aux(i) for i in a]\n    return x\n";
        let facts = function_facts(used, "aux");
        assert!(facts.calls_aux);
        assert_eq!(facts.ignored_aux_call, None);
    }

    #[test]
    fn method_calls_nested_definitions_and_strings_are_not_aux_calls() {
        let f = |s: &str| function_facts(s, "aux").calls_aux;
        assert!(!f("def main(a):\n    return self.aux(a)\n"));
        assert!(!f(
            "def main(a):\n    def aux(b):\n        return b\n    return 1\n"
        ));
        assert!(!f("def main(a):\n    return 'aux(a)'  # aux(a)\n"));
        assert!(!f("def main(a):\n    return my_aux(a)\n"));
        assert!(f("def main(a):\n    return [aux (x) for x in a]\n"));
    }

    #[test]
    fn tests_are_asserts_with_their_setup_and_candidate_renamed() {
        let test = "METADATA = {}\n\ndef check(candidate):\n    import math\n    assert candidate([\n        1, 2\n    ]) == 3, 'candidate'\n    lst = [1]\n    for x in lst:\n        assert candidate([x]) == x\n";
        let t = extract_tests(test, "f");
        assert_eq!(t.len(), 2);
        assert_eq!(
            t[0].assert_text,
            "assert f([\n    1, 2\n]) == 3, 'candidate'"
        );
        assert_eq!(
            t[0].code,
            "import math\nassert f([\n    1, 2\n]) == 3, 'candidate'"
        );
        assert_eq!(
            t[1].code,
            "import math\nlst = [1]\nfor x in lst:\n    assert f([x]) == x"
        );
    }

    #[test]
    fn prompt_imports_and_helpers() {
        let prompt = "from typing import List\nimport math\n\n\ndef poly(xs: list, x: float):\n    return sum(xs)\n\n\ndef find_zero(xs: list):\n    \"\"\" doc \"\"\"\n";
        assert_eq!(
            prompt_imports(prompt),
            vec!["from typing import List", "import math"]
        );
        assert_eq!(
            prompt_helpers(prompt, "find_zero"),
            vec!["def poly(xs: list, x: float):\n    return sum(xs)"]
        );
    }
}
