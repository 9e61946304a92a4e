//! A small Python source scanner: just enough structure to find logical lines, statements,
//! strings and comments in model-written code without a Python interpreter.
//!
//! Rewards need structural facts (where a function ends, whether a statement is a bare call,
//! which lines form one `assert`) long before, and independently of, running the code in the
//! sandbox. The scanner follows the tokenizer's rules that matter for that: brackets and
//! triple-quoted strings continue a logical line, a trailing backslash joins lines, a
//! single-quoted string never crosses a line end (so an apostrophe in prose cannot swallow the
//! rest of a completion), and `#` starts a comment outside strings.

/// One logical line: a statement (or compound-statement header) possibly spanning several
/// physical lines.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LogicalLine {
    /// 0-based index of the first physical line.
    pub first: usize,
    /// 0-based index of the last physical line.
    pub last: usize,
    /// Indentation width of the first physical line (a tab advances to the next multiple of 8).
    pub indent: usize,
    /// The code with every string literal's contents removed (`"abc"` becomes `""`, prefixes
    /// kept) and comments dropped; physical lines joined by a space.
    pub skeleton: String,
}

/// Result of scanning a source text.
#[derive(Debug, Clone)]
pub(crate) struct Scan {
    pub lines: Vec<LogicalLine>,
}

/// Indentation width of a physical line.
pub(crate) fn indent_width(line: &str) -> usize {
    let mut w = 0;
    for c in line.chars() {
        match c {
            ' ' => w += 1,
            '\t' => w = (w / 8 + 1) * 8,
            '\x0c' => w = 0,
            _ => break,
        }
    }
    w
}

/// Physical lines of a text, without line terminators (`\r\n` and `\n` both end a line).
pub(crate) fn physical_lines(src: &str) -> Vec<&str> {
    src.split('\n')
        .map(|l| l.strip_suffix('\r').unwrap_or(l))
        .collect()
}

/// Splits `src` into logical lines.
pub(crate) fn scan(src: &str) -> Scan {
    let phys = physical_lines(src);
    Scan {
        lines: LogicalLines::new(&phys).collect(),
    }
}

/// Lazily yields the logical lines of a slice of physical lines, so that a caller looking for
/// the end of one block scans only that block.
pub(crate) struct LogicalLines<'a> {
    phys: &'a [&'a str],
    next: usize,
    depth: usize,
    /// Quote character of an open triple-quoted string.
    triple: Option<char>,
    backslash: bool,
}

impl<'a> LogicalLines<'a> {
    pub(crate) fn new(phys: &'a [&'a str]) -> Self {
        LogicalLines {
            phys,
            next: 0,
            depth: 0,
            triple: None,
            backslash: false,
        }
    }

    /// Appends one physical line's code to `line`, updating the open-construct state.
    fn consume(&mut self, text: &str, line: &mut LogicalLine) {
        let chars: Vec<char> = text.chars().collect();
        let mut i = 0;
        while i < chars.len() {
            let c = chars[i];
            if let Some(q) = self.triple {
                if c == '\\' {
                    i += 2;
                    continue;
                }
                if c == q && chars.get(i + 1) == Some(&q) && chars.get(i + 2) == Some(&q) {
                    self.triple = None;
                    line.skeleton.push(q);
                    line.skeleton.push(q);
                    i += 3;
                    continue;
                }
                i += 1;
                continue;
            }
            match c {
                '#' => break,
                '"' | '\'' => {
                    if chars.get(i + 1) == Some(&c) && chars.get(i + 2) == Some(&c) {
                        self.triple = Some(c);
                        i += 3;
                        continue;
                    }
                    // Single-quoted string: ends at the matching quote or, unterminated, at the
                    // end of the physical line.
                    let mut j = i + 1;
                    while j < chars.len() && chars[j] != c {
                        if chars[j] == '\\' {
                            j += 1;
                        }
                        j += 1;
                    }
                    line.skeleton.push(c);
                    line.skeleton.push(c);
                    i = j + 1;
                    continue;
                }
                '(' | '[' | '{' => self.depth += 1,
                ')' | ']' | '}' => self.depth = self.depth.saturating_sub(1),
                '\\' if chars[i + 1..].iter().all(|c| c.is_whitespace()) => {
                    self.backslash = true;
                    break;
                }
                _ => {}
            }
            line.skeleton.push(c);
            i += 1;
        }
    }

    fn open(&self) -> bool {
        self.depth > 0 || self.triple.is_some() || self.backslash
    }
}

impl Iterator for LogicalLines<'_> {
    type Item = LogicalLine;

    fn next(&mut self) -> Option<LogicalLine> {
        // Skip blank and comment-only lines between logical lines.
        while self.next < self.phys.len() {
            let t = self.phys[self.next].trim_start();
            if t.is_empty() || t.starts_with('#') {
                self.next += 1;
            } else {
                break;
            }
        }
        if self.next >= self.phys.len() {
            return None;
        }
        let first = self.next;
        let mut line = LogicalLine {
            first,
            last: first,
            indent: indent_width(self.phys[first]),
            skeleton: String::new(),
        };
        loop {
            let idx = self.next;
            if idx > first {
                line.skeleton.push(' ');
            }
            self.backslash = false;
            self.consume(self.phys[idx], &mut line);
            line.last = idx;
            self.next += 1;
            if !self.open() || self.next >= self.phys.len() {
                break;
            }
        }
        line.skeleton = line.skeleton.trim().to_string();
        Some(line)
    }
}

/// One simple statement or compound-statement header.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Stmt {
    /// 0-based first physical line of the logical line this statement is on.
    pub first: usize,
    /// 0-based last physical line of that logical line.
    pub last: usize,
    /// Indentation; statements written inline after a compound header's colon get the header's
    /// indentation + 1 so that they nest under it.
    pub indent: usize,
    /// Skeleton of the statement alone (see [`LogicalLine::skeleton`]).
    pub skel: String,
}

const COMPOUND: &[&str] = &[
    "if", "elif", "else", "for", "while", "with", "try", "except", "finally", "def", "class",
    "async", "match", "case",
];

/// True if the skeleton starts with keyword `kw` as a whole word.
pub(crate) fn starts_with_keyword(skel: &str, kw: &str) -> bool {
    skel.strip_prefix(kw)
        .is_some_and(|rest| !rest.starts_with(|c: char| c.is_alphanumeric() || c == '_'))
}

/// Byte offsets of the characters `target` at bracket depth 0 in a skeleton (strings are
/// already blanked, so their contents cannot interfere).
fn top_level_positions(skel: &str, target: char) -> Vec<usize> {
    let mut depth = 0usize;
    let mut out = Vec::new();
    let bytes: Vec<(usize, char)> = skel.char_indices().collect();
    for (k, &(pos, c)) in bytes.iter().enumerate() {
        match c {
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => depth = depth.saturating_sub(1),
            _ if c == target && depth == 0 => {
                // `:=` is the walrus operator, not a block colon.
                if target == ':' && bytes.get(k + 1).map(|x| x.1) == Some('=') {
                    continue;
                }
                out.push(pos);
            }
            _ => {}
        }
    }
    out
}

/// Splits a skeleton at top-level `;`.
fn split_semicolons(skel: &str) -> Vec<String> {
    let mut parts = Vec::new();
    let mut start = 0;
    for p in top_level_positions(skel, ';') {
        parts.push(skel[start..p].trim().to_string());
        start = p + 1;
    }
    parts.push(skel[start..].trim().to_string());
    parts.into_iter().filter(|p| !p.is_empty()).collect()
}

/// The statements of a source text, in order: logical lines split at top-level `;` and at the
/// colon of a compound header that carries an inline body (`if x: return y`).
pub(crate) fn statements(src: &str) -> Vec<Stmt> {
    let mut out = Vec::new();
    for ll in scan(src).lines {
        let is_compound = COMPOUND
            .iter()
            .any(|kw| starts_with_keyword(&ll.skeleton, kw))
            || ll.skeleton.starts_with('@');
        let colon = if is_compound && !ll.skeleton.starts_with('@') {
            top_level_positions(&ll.skeleton, ':').first().copied()
        } else {
            None
        };
        let mk = |skel: String, indent: usize| Stmt {
            first: ll.first,
            last: ll.last,
            indent,
            skel,
        };
        match colon {
            Some(p) => {
                out.push(mk(ll.skeleton[..=p].to_string(), ll.indent));
                for part in split_semicolons(&ll.skeleton[p + 1..]) {
                    out.push(mk(part, ll.indent + 1));
                }
            }
            None => {
                for part in split_semicolons(&ll.skeleton) {
                    out.push(mk(part, ll.indent));
                }
            }
        }
    }
    out
}

/// True if a statement skeleton is a string-literal expression (a docstring).
pub(crate) fn is_string_expr(skel: &str) -> bool {
    let t = skel.trim_start_matches(|c: char| c.is_ascii_alphabetic());
    t == "\"\"" || t == "''" || t == "\"\"\"\"" || t == "''''"
}

/// Replaces every identifier token equal to `old` with `new`, outside strings and comments.
pub(crate) fn rename_identifier(src: &str, old: &str, new: &str) -> String {
    let chars: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    let mut triple: Option<char> = None;
    while i < chars.len() {
        let c = chars[i];
        if let Some(q) = triple {
            out.push(c);
            if c == '\\' {
                if let Some(&n) = chars.get(i + 1) {
                    out.push(n);
                }
                i += 2;
                continue;
            }
            if c == q && chars.get(i + 1) == Some(&q) && chars.get(i + 2) == Some(&q) {
                out.push(q);
                out.push(q);
                triple = None;
                i += 3;
                continue;
            }
            i += 1;
            continue;
        }
        if c == '#' {
            while i < chars.len() && chars[i] != '\n' {
                out.push(chars[i]);
                i += 1;
            }
            continue;
        }
        if c == '"' || c == '\'' {
            if chars.get(i + 1) == Some(&c) && chars.get(i + 2) == Some(&c) {
                triple = Some(c);
                out.extend([c, c, c]);
                i += 3;
                continue;
            }
            out.push(c);
            i += 1;
            while i < chars.len() && chars[i] != c && chars[i] != '\n' {
                if chars[i] == '\\' && i + 1 < chars.len() {
                    out.push(chars[i]);
                    i += 1;
                }
                out.push(chars[i]);
                i += 1;
            }
            if i < chars.len() && chars[i] == c {
                out.push(c);
                i += 1;
            }
            continue;
        }
        if c.is_alphabetic() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            // A string prefix (`f"..."`, `rb'...'`) is not an identifier.
            let is_prefix = i < chars.len() && (chars[i] == '"' || chars[i] == '\'');
            if word == old && !is_prefix {
                out.push_str(new);
            } else {
                out.push_str(&word);
            }
            continue;
        }
        out.push(c);
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn brackets_and_triple_strings_continue_a_logical_line() {
        let src = "x = [\n  1,\n  2]\ndef f():\n    '''doc\nat column 0\n'''\n    return x  # c\n";
        let s = scan(src);
        let firsts: Vec<usize> = s.lines.iter().map(|l| l.first).collect();
        assert_eq!(firsts, vec![0, 3, 4, 7]);
        assert_eq!(s.lines[0].last, 2);
        assert_eq!(s.lines[2].skeleton, "''");
        assert_eq!(s.lines[3].skeleton, "return x");
    }

    #[test]
    fn apostrophe_in_prose_does_not_swallow_later_lines() {
        let s = scan("Here's the code:\ndef f():\n    return 1\n");
        assert_eq!(s.lines.len(), 3);
        assert_eq!(s.lines[1].skeleton, "def f():");
    }

    #[test]
    fn strings_are_blanked_and_hashes_inside_them_are_not_comments() {
        let s = scan("y = f('a # b', \"(\")  # real comment\n");
        assert_eq!(s.lines[0].skeleton, "y = f('', \"\")");
    }

    #[test]
    fn inline_bodies_and_semicolons_become_statements() {
        let st = statements("def f(x): y = aux(x); return y\nif a: b()\n");
        let skels: Vec<&str> = st.iter().map(|s| s.skel.as_str()).collect();
        assert_eq!(
            skels,
            vec!["def f(x):", "y = aux(x)", "return y", "if a:", "b()"]
        );
        assert_eq!(st[1].indent, 1);
        assert_eq!(st[4].indent, 1);
    }

    #[test]
    fn walrus_and_dict_colons_do_not_split() {
        let st = statements("if (n := 3) > 2: x = {1: 2}\n");
        assert_eq!(st.len(), 2);
        assert_eq!(st[1].skel, "x = {1: 2}");
    }

    #[test]
    fn rename_skips_strings_comments_and_longer_identifiers() {
        let out = rename_identifier(
            "assert candidate(1) == 'candidate' # candidate\nassert candidates(candidate)",
            "candidate",
            "f",
        );
        assert_eq!(
            out,
            "assert f(1) == 'candidate' # candidate\nassert candidates(f)"
        );
    }
}
