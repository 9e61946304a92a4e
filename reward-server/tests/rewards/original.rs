//! The default code reward against the original's own values: every joint action of
//! `tests/fixtures/original_code_reward.jsonl.gz` (made by `scripts/reference/code_reward_fixtures.py`,
//! which runs the original project's reward functions; see the SOURCE.md beside it) is scored here
//! through the real sandbox with the default options, and must get the original's reward. That
//! includes the timeout cases: the harness raises each test's time limit inside the program as the
//! original did, so a function slow only on its first call passes later tests.

use std::collections::BTreeMap;
use std::io::Read;

use cotrain_reward_server::rewards::{self, ScoreOptions, TaskKind};
use cotrain_reward_server::sandbox::{BwrapSandbox, SandboxConfig};
use serde_json::Value;

fn gz_text(path: &str) -> String {
    let mut text = String::new();
    flate2::read::GzDecoder::new(
        std::fs::File::open(path).unwrap_or_else(|e| panic!("{path}: {e}")),
    )
    .read_to_string(&mut text)
    .expect("gzip");
    text
}

/// Items by (dataset, task_id), from the repository's data files.
fn items() -> BTreeMap<(String, String), Value> {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let mut out = BTreeMap::new();
    for line in gz_text(&format!("{root}/data/humaneval/HumanEval.jsonl.gz")).lines() {
        let v: Value = serde_json::from_str(line).expect("json line");
        out.insert(
            (
                "humaneval".to_string(),
                v["task_id"].as_str().unwrap().to_string(),
            ),
            v,
        );
    }
    for (ds, file) in [
        ("coophumaneval", "coophumaneval/che_raw.json"),
        ("mbpp", "mbpp/mbpp_raw.json"),
    ] {
        let text = std::fs::read_to_string(format!("{root}/data/{file}")).expect("data file");
        let rows: Vec<Value> = serde_json::from_str(&text).expect("json");
        for v in rows {
            out.insert(
                (ds.to_string(), v["task_id"].as_str().unwrap().to_string()),
                v,
            );
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_code_reward_equals_the_original_on_every_fixture() {
    let config = SandboxConfig {
        queue_limit: 2048,
        ..SandboxConfig::default()
    };
    let sb = BwrapSandbox::start(&config)
        .await
        .expect("the bubblewrap sandbox starts");
    let items = items();
    let rows: Vec<Value> = gz_text(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/original_code_reward.jsonl.gz"
    ))
    .lines()
    .map(|l| serde_json::from_str(l).expect("fixture line"))
    .collect();
    assert!(
        rows.len() > 1000,
        "the fixture holds {} joint actions",
        rows.len()
    );
    let mut set = tokio::task::JoinSet::new();
    for (n, row) in rows.into_iter().enumerate() {
        let case = row["case"].as_str().unwrap().to_string();
        let key = (
            row["dataset"].as_str().unwrap().to_string(),
            row["task_id"].as_str().unwrap().to_string(),
        );
        let item = items
            .get(&key)
            .unwrap_or_else(|| panic!("no item {key:?}"))
            .clone();
        let sb = sb.clone();
        set.spawn(async move {
            let completions: Vec<String> =
                serde_json::from_value(row["completions"].clone()).unwrap();
            let got = rewards::score(
                TaskKind::Code,
                &completions,
                &item,
                &sb,
                &ScoreOptions::default(),
            )
            .await
            .expect("scored");
            (n, key, case, row["reward"].as_f64().unwrap(), got)
        });
    }
    let mut mismatches = Vec::new();
    let mut checked = 0;
    while let Some(r) = set.join_next().await {
        let (n, key, case, want, got) = r.expect("task");
        checked += 1;
        if (got.reward - want).abs() > 1e-9 {
            mismatches.push(format!(
                "line {}: {} {} [{case}]: original {want}, cotrain {} ({})",
                n + 1,
                key.0,
                key.1,
                got.reward,
                got.details
            ));
        }
    }
    mismatches.sort();
    assert!(
        mismatches.is_empty(),
        "{} of {checked} joint actions differ:\n{}",
        mismatches.len(),
        mismatches.join("\n")
    );
}
