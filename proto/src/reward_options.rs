//! The scoring options of the reward service: what a learner sends with every scoring call (as
//! JSON in the `options` field of the reward protocol) and what the reward server reads.
//!
//! They live in the protocol crate because both sides of the call use them: the learner's config
//! schema names them (`reward.options`, `reward.writing_ratio_version`) and must not import the
//! reward server's internals, and the reward server scores with them (re-exported at their old
//! paths, `cotrain_reward_server::rewards::{ScoreOptions, CodeFunctions, CodeTests}` and
//! `rewards::writing::ArxivRatioVersion`). Validation of the values
//! (`per_test_timeout_secs > 0`, `max_timeouts >= 1`) is the reward server's.
//!
//! The doc comments are the configuration reference's text: with the `schemars` feature the types
//! derive `schemars::JsonSchema`, from which the learner generates
//! `docs/src/configuration/reference.md`.

use serde::{Deserialize, Serialize};

/// The reward server's scoring options: the original's behaviour by default; each correction
/// cotrain offers beside it is one named option (the book's "MAGRPO and GRPO" page lists them).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[serde(default, deny_unknown_fields)]
pub struct ScoreOptions {
    /// Which arXiv length-ratio table the writing reward uses (the learner's
    /// `reward.writing_ratio_version` sets it too).
    pub arxiv_ratio: ArxivRatioVersion,
    /// Seed of the single-agent writing split's random split point for a text without a paragraph
    /// marker (the learner fills it in from the run's `seed`).
    pub split_seed: u64,
    /// Time limit of each code test, in seconds.
    pub per_test_timeout_secs: f64,
    /// Stop testing a completion after this many timeouts.
    pub max_timeouts: usize,
    /// How functions are found in code completions and judged (has a return, calls `aux`, thin
    /// wrapper, ignored result).
    pub code_functions: CodeFunctions,
    /// Which statements of `check` are tests.
    pub code_tests: CodeTests,
    /// Keep `import` lines written above a completion's function (the original drops them, so
    /// `import math` then fails with a NameError).
    pub completion_imports: bool,
    /// Put the prompt's own helper functions (HumanEval/10, /32, /38, /50) before the program (the
    /// original leaves them out, so solutions calling them fail).
    pub prompt_helpers: bool,
    /// Run each test once (the original evaluates `f(args)` before executing
    /// `assert f(args) == y`, so `f` runs twice).
    pub single_call_tests: bool,
}

impl Default for ScoreOptions {
    fn default() -> Self {
        ScoreOptions {
            arxiv_ratio: ArxivRatioVersion::default(),
            split_seed: 0,
            per_test_timeout_secs: 10.0,
            max_timeouts: 3,
            code_functions: CodeFunctions::Original,
            code_tests: CodeTests::Original,
            completion_imports: false,
            prompt_helpers: false,
            single_call_tests: false,
        }
    }
}

impl ScoreOptions {
    /// Every cotrain correction on: structural functions, whole-statement tests, completion
    /// imports, prompt helpers, one call per test.
    pub fn corrected() -> Self {
        ScoreOptions {
            code_functions: CodeFunctions::Structural,
            code_tests: CodeTests::Statements,
            completion_imports: true,
            prompt_helpers: true,
            single_call_tests: true,
            ..ScoreOptions::default()
        }
    }
}

/// The arXiv length-ratio table in force.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum ArxivRatioVersion {
    /// From 2025-12-31: [1.3, 1.6] full, ramps down to 0.8 and up to 2.0.
    #[default]
    Newest,
    /// Before: [1.0, 1.3] full, ramps down to 0.8 and up to 1.5.
    Earlier,
}

/// `code_functions`: how function definitions are found and judged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum CodeFunctions {
    /// The original's regular expressions, line by line.
    // The reward server's `rewards::code::original`.
    #[default]
    Original,
    /// cotrain's scanner: whole definitions with nested functions, decorators and `async def`; the
    /// last definition of a name wins; `return`, `aux(` calls, thin wrappers and ignored results
    /// judged on statements, outside strings and comments.
    // The reward server's `rewards::code::extract`.
    Structural,
}

/// `code_tests`: what counts as one test of an item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum CodeTests {
    /// Each line of `check` starting with `assert` that contains `candidate`, deduplicated (a
    /// multi-line assert contributes its first line only, which then fails).
    #[default]
    Original,
    /// Each statement of `check` whose asserts use `candidate`: multi-line asserts whole, loops of
    /// asserts as one test, run after the set-up statements before them.
    // `assert True` lines are still not tests.
    Statements,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names on the wire and in config files; renaming one breaks every existing config.
    #[test]
    fn serde_names_and_defaults() {
        let json = serde_json::to_value(ScoreOptions::default()).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "arxiv_ratio": "newest",
                "split_seed": 0,
                "per_test_timeout_secs": 10.0,
                "max_timeouts": 3,
                "code_functions": "original",
                "code_tests": "original",
                "completion_imports": false,
                "prompt_helpers": false,
                "single_call_tests": false,
            })
        );
        let corrected: ScoreOptions = serde_json::from_value(serde_json::json!({
            "code_functions": "structural",
            "code_tests": "statements",
            "completion_imports": true,
            "prompt_helpers": true,
            "single_call_tests": true,
        }))
        .unwrap();
        assert_eq!(corrected, ScoreOptions::corrected());
        assert_eq!(
            serde_json::from_str::<ArxivRatioVersion>("\"earlier\"").unwrap(),
            ArxivRatioVersion::Earlier
        );
        assert!(serde_json::from_str::<ScoreOptions>(r#"{"max_timeout": 3}"#).is_err());
    }
}
