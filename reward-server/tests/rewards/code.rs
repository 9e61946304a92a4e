//! Code rewards end to end through the real sandbox, with cotrain's corrections on
//! (`ScoreOptions::corrected()`: structural function extraction, whole-statement tests, completion
//! imports, prompt helpers, one call per test). The original's default rules are checked against the
//! original's own values in `original.rs`.

use std::io::Read;
use std::time::Instant;

use cotrain_reward_server::rewards::{
    self, AnalyzeOptions, FeedbackMode, ScoreOptions, TaskKind, TestSlice,
};
use cotrain_reward_server::sandbox::{BwrapSandbox, SandboxConfig};
use serde_json::{Value, json};

async fn sandbox() -> BwrapSandbox {
    // A queue long enough for the 164 canonical solutions submitted at once.
    let config = SandboxConfig {
        queue_limit: 256,
        ..SandboxConfig::default()
    };
    BwrapSandbox::start(&config)
        .await
        .expect("the bubblewrap sandbox starts")
}

fn humaneval() -> Vec<Value> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/HumanEval.jsonl.gz");
    let mut text = String::new();
    flate2::read::GzDecoder::new(std::fs::File::open(path).expect("HumanEval data"))
        .read_to_string(&mut text)
        .expect("gzip");
    text.lines()
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

async fn score(
    sb: &BwrapSandbox,
    completions: &[&str],
    item: &Value,
    opts: &ScoreOptions,
) -> rewards::ScoreResult {
    let completions: Vec<String> = completions.iter().map(|s| s.to_string()).collect();
    rewards::score(TaskKind::Code, &completions, item, sb, opts)
        .await
        .expect("scored")
}

/// Every canonical HumanEval solution, written as the single agent would (prompt + body),
/// scores the single-agent maximum 0.6 + 0.5 + 1.0 = 2.1 with all tests passing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn canonical_humaneval_solutions_score_full_marks() {
    let sb = sandbox().await;
    let rows = humaneval();
    assert_eq!(rows.len(), 164);
    let start = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for row in rows {
        let sb = sb.clone();
        set.spawn(async move {
            let completion = format!(
                "{}{}",
                row["prompt"].as_str().unwrap(),
                row["canonical_solution"].as_str().unwrap()
            );
            let r = rewards::score(
                TaskKind::Code,
                &[completion],
                &row,
                &sb,
                &ScoreOptions::corrected(),
            )
            .await
            .expect("scored");
            (row["task_id"].as_str().unwrap().to_string(), r)
        });
    }
    let mut bad = Vec::new();
    let mut n = 0;
    while let Some(res) = set.join_next().await {
        let (id, r) = res.expect("task");
        n += 1;
        if !close(r.reward, 2.1) || r.details["passed_tests"] != r.details["total_tests"] {
            bad.push(format!("{id}: {} {}", r.reward, r.details));
        }
    }
    eprintln!(
        "164 canonical solutions scored in {:.1} s",
        start.elapsed().as_secs_f64()
    );
    assert_eq!(n, 164);
    assert!(bad.is_empty(), "not full marks:\n{}", bad.join("\n"));
}

fn he0() -> Value {
    humaneval().into_iter().next().unwrap()
}

const HE0_HEADER: &str = "from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n";

#[tokio::test]
async fn broken_humaneval_solutions_score_what_the_definition_says() {
    let sb = sandbox().await;
    let item = he0();
    let opts = ScoreOptions::corrected();

    // Always False: HumanEval/0 expects True, False, True, False, True, True, False, so 3 of
    // the 7 asserts pass: 0.6 + 0.5 + 1.0 * 3/7.
    let r = score(
        &sb,
        &[&format!("{HE0_HEADER}    return False\n")],
        &item,
        &opts,
    )
    .await;
    assert!(close(r.reward, 0.6 + 0.5 + 3.0 / 7.0), "{}", r.details);
    assert_eq!(r.details["passed_tests"], 3);
    assert_eq!(r.details["total_tests"], 7);

    // Syntax error after a return: 0.6, then STOP at level 2.
    let r = score(
        &sb,
        &[&format!("{HE0_HEADER}    return (numbers\n")],
        &item,
        &opts,
    )
    .await;
    assert!(close(r.reward, 0.6), "{}", r.details);
    assert_eq!(r.details["stopped_at"], "level_2");
    assert_eq!(r.details["syntax"]["status"], "error");

    // No return statement: level 1 fails, STOP with 0.
    let r = score(&sb, &[&format!("{HE0_HEADER}    pass\n")], &item, &opts).await;
    assert_eq!(r.reward, 0.0);
    assert_eq!(r.details["stopped_at"], "level_1");

    // Wrong function name: main not defined, 0.
    let r = score(
        &sb,
        &["def close_elements(numbers, threshold):\n    return True\n"],
        &item,
        &opts,
    )
    .await;
    assert_eq!(r.reward, 0.0);

    // The definitions fail when run (unknown decorator): no test can pass, 0.6 + 0.5 + 0.
    let decorated = HE0_HEADER.replace("\ndef ", "\n@undefined_decorator\ndef ");
    let r = score(
        &sb,
        &[&format!("{decorated}    return True\n")],
        &item,
        &opts,
    )
    .await;
    assert!(close(r.reward, 1.1), "{}", r.details);
    assert_eq!(r.details["setup"]["status"], "error");

    // Empty completion: 0, and nothing runs.
    let r = score(&sb, &[""], &item, &opts).await;
    assert_eq!(r.reward, 0.0);
    assert_eq!(r.details["sandbox_wall_time_ms"], Value::Null);
}

fn small_item(n_tests: usize) -> Value {
    let asserts: String = (0..n_tests)
        .map(|i| format!("    assert candidate({i}) == {i}\n"))
        .collect();
    json!({
        "task_id": "Test/0",
        "prompt": "def ident(x):\n    \"\"\"Return x.\"\"\"\n",
        "test": format!("def check(candidate):\n{asserts}"),
        "entry_point": "ident",
    })
}

fn fast() -> ScoreOptions {
    // 1 s instead of the original 10 s per test, to keep the suite quick; the rule is the same.
    ScoreOptions {
        per_test_timeout_secs: 1.0,
        ..ScoreOptions::corrected()
    }
}

#[tokio::test]
async fn a_test_that_times_out_counts_as_failed() {
    let sb = sandbox().await;
    // Tests candidate(0..4): x == 2 loops forever, the other 3 pass: 0.6 + 0.5 + 3/4 = 1.85.
    let main = "def ident(x):\n    while x == 2:\n        pass\n    return x\n";
    let r = score(&sb, &[main], &small_item(4), &fast()).await;
    assert!(close(r.reward, 1.85), "{}", r.details);
    assert_eq!(r.details["timeouts"], 1);
    assert_eq!(r.details["passed_tests"], 3);
    assert_eq!(r.details["stopped_after_timeouts"], false);
}

#[tokio::test]
async fn three_timeouts_stop_testing() {
    let sb = sandbox().await;
    // Every call loops: tests 0, 1, 2 time out, then testing stops; tests 3 and 4 never run
    // but still count in the denominator: 0.6 + 0.5 + 0/5 = 1.1.
    let main = "def ident(x):\n    while True:\n        pass\n    return x\n";
    let start = Instant::now();
    let r = score(&sb, &[main], &small_item(5), &fast()).await;
    assert!(close(r.reward, 1.1), "{}", r.details);
    assert_eq!(r.details["timeouts"], 3);
    assert_eq!(r.details["total_tests"], 5);
    assert_eq!(r.details["stopped_after_timeouts"], true);
    assert!(
        start.elapsed().as_secs_f64() < 4.5 + 3.0,
        "ran past the third timeout"
    );
}

fn add_item() -> Value {
    json!({
        "task_id": "Test/add",
        "prompt": "def add_sq(a: int, b: int) -> int:\n    \"\"\"Return a*a + b*b.\"\"\"\n",
        "test": "def check(candidate):\n    assert candidate(1, 2) == 5\n    assert candidate(0, 0) == 0\n    assert candidate(3, 0) == 9\n    assert candidate(2, 2) == 8\n",
        "entry_point": "add_sq",
    })
}

const AUX_SQ: &str = "def aux(v):\n    return v * v\n";

#[tokio::test]
async fn two_agent_levels_through_the_sandbox() {
    let sb = sandbox().await;
    let item = add_item();
    let o = ScoreOptions::corrected();

    // `return aux(a) + aux(b)` is a body of one `return ...aux(...)...`: a thin wrapper by the
    // definition, so no +1.0 although all 4 tests pass: 0.4 + 0.6 + 0.5 + 1.0 + 0.5 = 3.0
    let thin = "def add_sq(a, b):\n    return aux(a) + aux(b)\n";
    let r = score(&sb, &[AUX_SQ, thin], &item, &o).await;
    assert!(close(r.reward, 3.0), "{}", r.details);

    // A cooperating main with logic of its own, all 4 tests pass:
    // 0.4 + 0.6 + 0.5 + 1.0 + 0.5 + 1.0 = 4.0
    let coop = "def add_sq(a, b):\n    total = 0\n    for v in (a, b):\n        total += aux(v)\n    return total\n";
    let r = score(&sb, &[AUX_SQ, coop], &item, &o).await;
    assert!(close(r.reward, 4.0), "{}", r.details);
    assert_eq!(r.levels["level_4"], 1.5);

    // Markdown fences and prose around both completions change nothing: 4.0.
    let aux_md = format!("Here's a helper:\n```python\n{AUX_SQ}```\nIt squares its input.");
    let main_md = format!("```python\n{coop}\n\nprint(add_sq(1, 2))\n```");
    let r = score(&sb, &[&aux_md, &main_md], &item, &o).await;
    assert!(close(r.reward, 4.0), "{}", r.details);

    // Thin wrapper, second form (`r = aux(a)` then `return r`); it computes aux(a) only, so tests
    // (1,2)→1≠5, (0,0)→0 ✓, (3,0)→9 ✓, (2,2)→4≠8: 2 of 4 pass: 0.4 + 0.6 + 0.5 + 0.5 + 0.5 = 2.5
    let wrapper = "def add_sq(a, b):\n    r = aux(a)\n    return r\n";
    let r = score(&sb, &[AUX_SQ, wrapper], &item, &o).await;
    assert!(close(r.reward, 2.5), "{}", r.details);

    // Ignored result: correct answer computed without using aux's value:
    // 0.4 + 0.6 + 0.5 + 1.0 + 0.5 + 1.0 − 0.5 = 3.5
    let ignoring = "def add_sq(a, b):\n    aux(a)\n    return a * a + b * b\n";
    let r = score(&sb, &[AUX_SQ, ignoring], &item, &o).await;
    assert!(close(r.reward, 3.5), "{}", r.details);

    // aux without return (prints): 0 + 0.6; main calls aux and gets None: TypeError in every
    // test, 0 passed, so no level 4: 0.6 + 0.5 + 0 = 1.1
    let r = score(&sb, &["def aux(v):\n    print(v * v)\n", coop], &item, &o).await;
    assert!(close(r.reward, 1.1), "{}", r.details);

    // aux missing, main self-sufficient: 0.6 + 0.5 + 1.0 = 2.1 and no level 4.
    let r = score(
        &sb,
        &["", "def add_sq(a, b):\n    return a * a + b * b\n"],
        &item,
        &o,
    )
    .await;
    assert!(close(r.reward, 2.1), "{}", r.details);

    // main missing: 0.4, STOP.
    let r = score(
        &sb,
        &[AUX_SQ, "I think the answer is aux(a) + aux(b)."],
        &item,
        &o,
    )
    .await;
    assert!(close(r.reward, 0.4), "{}", r.details);

    // Both empty: 0.
    let r = score(&sb, &["", ""], &item, &o).await;
    assert_eq!(r.reward, 0.0);

    // A syntax error in aux stops the pair at level 2: 0.4 + 0.6 = 1.0.
    let r = score(&sb, &["def aux(v):\n    return v *\n", coop], &item, &o).await;
    assert!(close(r.reward, 1.0), "{}", r.details);
}

#[tokio::test]
async fn analyze_reports_failures_syntax_and_aux_misuse() {
    let sb = sandbox().await;
    let item = add_item();
    let opts = AnalyzeOptions {
        sandbox_slice: TestSlice::All,
        feedback_mode: Some(FeedbackMode::LevelFeedback),
        score: ScoreOptions::corrected(),
    };
    // aux(a) is called and ignored; the result is a + b*b, wrong for (1,2)→5 ✓ (1+4), (0,0) ✓,
    // (3,0)→3 ✗, (2,2)→6 ✗.
    let main = "def add_sq(a, b):\n    aux(a)\n    return a + b * b\n";
    let a = rewards::analyze(
        TaskKind::Code,
        &[AUX_SQ.into(), main.into()],
        &item,
        &sb,
        &opts,
    )
    .await
    .unwrap();
    let d = &a.diagnostics;
    assert_eq!(d.tests.passed, 2);
    assert_eq!(d.tests.total, 4);
    assert_eq!(d.tests.failures.len(), 2);
    assert_eq!(d.tests.failures[0].assert, "assert add_sq(3, 0) == 9");
    assert_eq!(
        d.tests.failures[0].error_type.as_deref(),
        Some("AssertionError")
    );
    let usage = d.agents[1].aux_usage.as_ref().unwrap();
    assert_eq!(usage.misuse_line, Some(2));
    let fb = a.feedback.unwrap();
    assert!(fb[1].contains("Tests: 2/4 passed"), "{}", fb[1]);
    assert!(
        fb[1].contains("ignores its result at line 2: `aux(a)`"),
        "{}",
        fb[1]
    );

    // The default slice shows the first test only; -1 the last one.
    let first = rewards::analyze(
        TaskKind::Code,
        &[AUX_SQ.into(), main.into()],
        &item,
        &sb,
        &AnalyzeOptions {
            score: ScoreOptions::corrected(),
            ..AnalyzeOptions::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(
        (
            first.diagnostics.tests.passed,
            first.diagnostics.tests.total
        ),
        (1, 1)
    );
    let last_opts = AnalyzeOptions {
        sandbox_slice: TestSlice::Last(1),
        score: ScoreOptions::corrected(),
        ..AnalyzeOptions::default()
    };
    let last = rewards::analyze(
        TaskKind::Code,
        &[AUX_SQ.into(), main.into()],
        &item,
        &sb,
        &last_opts,
    )
    .await
    .unwrap();
    assert_eq!(
        (last.diagnostics.tests.passed, last.diagnostics.tests.total),
        (0, 1)
    );
    assert_eq!(
        last.diagnostics.tests.failures[0].assert,
        "assert add_sq(2, 2) == 8"
    );

    // A syntax error is reported with its line and column.
    let broken = "def add_sq(a, b):\n    return (a +\n";
    let a = rewards::analyze(
        TaskKind::Code,
        &[AUX_SQ.into(), broken.into()],
        &item,
        &sb,
        &opts,
    )
    .await
    .unwrap();
    match &a.diagnostics.syntax {
        Some(cotrain_reward_server::code_runner::SyntaxCheck::Error { line, .. }) => {
            assert!(line.is_some())
        }
        other => panic!("expected a syntax error, got {other:?}"),
    }
    assert!(a.feedback.unwrap()[0].contains("Syntax: SyntaxError at line"));

    // Missing definitions come with a reason.
    let a = rewards::analyze(
        TaskKind::Code,
        &["def helper(v):\n    return v\n".into(), main.into()],
        &item,
        &sb,
        &opts,
    )
    .await
    .unwrap();
    assert_eq!(
        a.diagnostics.agents[0].reason.as_deref(),
        Some("no function named `aux` found (found: helper)")
    );
}

#[tokio::test]
async fn request_errors_name_the_field() {
    let sb = sandbox().await;
    let e = rewards::score(
        TaskKind::Code,
        &["x".into()],
        &json!({"prompt": "", "entry_point": "f"}),
        &sb,
        &ScoreOptions::corrected(),
    )
    .await
    .unwrap_err();
    assert_eq!(e.field().as_deref(), Some("item.test"));
    assert!(e.to_string().contains("`test`"));
    let e = rewards::score(
        TaskKind::Code,
        &["a".into(), "b".into(), "c".into()],
        &add_item(),
        &sb,
        &ScoreOptions::corrected(),
    )
    .await
    .unwrap_err();
    assert_eq!(e.field().as_deref(), Some("completions"));
    let e = rewards::analyze(
        TaskKind::Tldr,
        &["a".into()],
        &json!({}),
        &sb,
        &AnalyzeOptions {
            score: ScoreOptions::corrected(),
            ..AnalyzeOptions::default()
        },
    )
    .await
    .unwrap_err();
    assert_eq!(e.field().as_deref(), Some("task"));
}

/// Test counts of HumanEval items with unusual `check` bodies, counted by hand from the data:
/// multi-line asserts (/1, /87, /113), asserts in loops with set-up (/32, /44, /53), set-up
/// between asserts (/151), a stray `print` (/129).
#[test]
fn humaneval_test_extraction_counts() {
    use cotrain_reward_server::rewards::code::extract::extract_tests;
    let rows = humaneval();
    let count = |id: &str| {
        let row = rows.iter().find(|r| r["task_id"] == id).unwrap();
        extract_tests(
            row["test"].as_str().unwrap(),
            row["entry_point"].as_str().unwrap(),
        )
    };
    // /1: three asserts over three lines each, one on a single line.
    let t = count("HumanEval/1");
    assert_eq!(t.len(), 4);
    assert_eq!(
        t[0].assert_text,
        "assert separate_paren_groups('(()()) ((())) () ((())()())') == [\n    '(()())', '((()))', '()', '((())()())'\n]"
    );
    // /32: one `for` loop holding the only assert, after 4 set-up statements.
    let t = count("HumanEval/32");
    assert_eq!(t.len(), 1);
    assert!(t[0].code.starts_with(
        "import math\nimport random\nrng = random.Random(42)\nimport copy\nfor _ in range(100):"
    ));
    assert_eq!(count("HumanEval/44").len(), 7); // 6 asserts + 1 loop
    assert_eq!(count("HumanEval/53").len(), 6); // 5 asserts + 1 loop
    assert_eq!(count("HumanEval/87").len(), 6); // `assert True` is no test
    assert_eq!(count("HumanEval/113").len(), 3); // nor `assert True, ...`
    assert_eq!(count("HumanEval/129").len(), 11);
    let t = count("HumanEval/151");
    assert_eq!(t.len(), 7);
    assert_eq!(
        t[6].code,
        "lst = list(range(-99, 100, 2))\nodd_sum = sum([i**2 for i in lst if i%2!=0 and i > 0])\nassert double_the_difference(lst) == odd_sum , \"This prints if this assert fails 7 (good for debugging!)\""
    );
}
