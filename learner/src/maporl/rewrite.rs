//! MaPoRL's answer rewrite (chanwoo-park-official/MAPoRL, `ppov2_trainer_multi_different_model.py`
//! lines 1120-1217 and 1274-1293): before an answer is shown to the agents and scored, it is made to
//! end in `Answer: \boxed{x}`, x being what the original's `extract_ans_from_response`
//! (`utils/dataset.py`) reads from it; the verifier then scores a cleaned copy, and correctness is
//! that copy's extracted answer against the reference. The original's quirks are kept on purpose:
//! without a box every digit of a GSM8K answer is glued into one number, a decimal is no answer, the
//! trailing bare answer is cut with a character-set `rstrip` (which may eat more digits), and the
//! verifier's copy loses everything after its last letter or `}`.

use std::sync::LazyLock;

use regex::Regex;

/// `\boxed{...}`, non-greedy, no nesting, within one line (the original's extraction pattern).
static BOXED: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\\boxed\{(.*?)\}").expect("valid regex"));
/// What the verifier's copy loses at its end (once it has an answer).
static TRAILING: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"[^a-zA-Z}]+$").expect("valid regex"));

/// One answer as the discussion presents it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rewritten {
    /// The original's extracted answer (`None`: its "invalid"), read from the sampled text.
    pub answer: Option<String>,
    /// The text shown to the other agents and kept in the agent's own history.
    pub shown: String,
    /// The text the verifier scores and correctness is read from.
    pub judged: String,
}

/// Python's `str.strip()` (whitespace on both ends).
fn strip(s: &str) -> &str {
    s.trim()
}

/// The original's `extract_ans_from_response` for `gsm8k` and `anli` (`None` for its "invalid" and
/// for other tasks). GSM8K answers are Python `int`s, here their decimal text.
pub fn extract_answer(task: &str, text: &str) -> Option<String> {
    let text = strip(text);
    let answer = BOXED
        .captures_iter(text)
        .last()
        .map_or(text, |c| strip(c.get(1).map_or("", |m| m.as_str())));
    match task {
        "gsm8k" => {
            let kept: String = answer
                .chars()
                .filter(|c| c.is_ascii_digit() || *c == '-' || *c == '.')
                .collect();
            python_int(&kept)
        }
        "anli" => {
            let letters: String = answer
                .chars()
                .filter(char::is_ascii_alphabetic)
                .collect::<String>()
                .to_lowercase();
            ["entailment", "neutral", "contradiction"]
                .into_iter()
                .find(|l| letters.contains(l))
                .map(str::to_string)
        }
        _ => None,
    }
}

/// `int(s)` for a string of digits, `-` and `.`: an optional leading minus and digits; its value's text.
fn python_int(s: &str) -> Option<String> {
    let (negative, digits) = match s.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, s),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let digits = digits.trim_start_matches('0');
    Some(match (negative, digits.is_empty()) {
        (_, true) => "0".to_string(),
        (true, false) => format!("-{digits}"),
        (false, false) => digits.to_string(),
    })
}

/// The last `n` characters of `s` (all of it when shorter).
fn last_chars(s: &str, n: usize) -> &str {
    match s.char_indices().rev().nth(n.saturating_sub(1)) {
        Some((i, _)) if n > 0 => &s[i..],
        _ if n == 0 => "",
        _ => s,
    }
}

/// The rewrite of a sampled answer (trainer lines 1121, 1169-1172, 1180-1217): the stripped text,
/// its "The answer is: x", "The answer is: \boxed{x}" and "Answer: x" turned into `Answer: \boxed{x}`,
/// and, when an answer was read but that line is not in its last 1.5 × len characters, every box
/// unwrapped, a trailing bare answer cut and `\n\nAnswer: \boxed{x}` appended.
pub fn rewrite_answer(task: &str, response: &str) -> (Option<String>, String) {
    let d = strip(response);
    let answer = extract_answer(task, d);
    let x = answer.as_deref().unwrap_or("invalid");
    let final_line = format!("Answer: \\boxed{{{x}}}");
    let mut m = d.to_string();
    for pattern in [
        format!("The answer is: {x}"),
        format!("The answer is: \\boxed{{{x}}}"),
        format!("Answer: {x}"),
    ] {
        if d.contains(&pattern) {
            m = m.replace(&pattern, &final_line);
        }
    }
    // int(1.5 * len(final_answer_str)) characters.
    let window = final_line.chars().count() * 3 / 2;
    if answer.is_some() && !last_chars(&m, window).contains(&final_line) {
        m = BOXED.replace_all(&m, "${1}").into_owned();
        if m.ends_with(&format!("\n{x}")) {
            // str.rstrip(f"\n{x}"): strips any of these characters, not the suffix.
            let set: Vec<char> = format!("\n{x}").chars().collect();
            m.truncate(m.trim_end_matches(|c| set.contains(&c)).len());
        }
        if m.ends_with('\n') {
            m.truncate(m.trim_end_matches('\n').len());
        }
        m = format!("{m}\n\n{final_line}");
    }
    (answer, m)
}

/// The verifier's copy of a rewritten answer (trainer lines 1274-1293): chat markers stripped, then,
/// when it has an answer, everything after its last letter or `}`.
pub fn judged_text(task: &str, rewritten: &str) -> String {
    let mut m = rewritten;
    if let Some(rest) = m.strip_suffix("<|im_end|>") {
        m = strip(rest);
    }
    for prefix in [
        "model",
        "<|im_start|>",
        "assistant",
        "<|im_start|>assistant",
    ] {
        if let Some(rest) = m.strip_prefix(prefix) {
            m = strip(rest);
        }
    }
    if extract_answer(task, m).is_some() {
        TRAILING.replace(m, "").into_owned()
    } else {
        m.to_string()
    }
}

/// The rewrite and the verifier's copy of a sampled answer.
pub fn rewrite(task: &str, response: &str) -> Rewritten {
    let (answer, shown) = rewrite_answer(task, response);
    let judged = judged_text(task, &shown);
    Rewritten {
        answer,
        shown,
        judged,
    }
}

/// Whether the rewrite applies to `task` (the original has it for its GSM8K and ANLI).
pub fn rewrites(task: &str) -> bool {
    matches!(task, "gsm8k" | "anli")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_int_reads_only_plain_integers() {
        assert_eq!(python_int("0029"), Some("29".into()));
        assert_eq!(python_int("-4"), Some("-4".into()));
        assert_eq!(python_int("-0"), Some("0".into()));
        for bad in ["", "-", "2.5", "3-4", "--4", "."] {
            assert_eq!(python_int(bad), None, "{bad}");
        }
    }

    #[test]
    fn last_chars_counts_characters() {
        assert_eq!(last_chars("aéb", 2), "éb");
        assert_eq!(last_chars("ab", 5), "ab");
        assert_eq!(last_chars("ab", 0), "");
    }

    #[test]
    fn anli_answers_are_read_as_the_original_reads_them() {
        assert_eq!(
            extract_answer("anli", "So: \\boxed{Neutral}."),
            Some("neutral".into())
        );
        assert_eq!(extract_answer("anli", "no label"), None);
        let r = rewrite("anli", "It follows. \\boxed{entailment} indeed");
        assert_eq!(
            r.shown,
            "It follows. entailment indeed\n\nAnswer: \\boxed{entailment}"
        );
    }
}
