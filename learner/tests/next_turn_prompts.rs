//! The original's next-turn prompts (`external.next_turn_prompt: comlrl_2026 | comlrl_2025_09`)
//! against `tests/fixtures/comlrl2026/turn2_prompts.json`, which the ORIGINAL code wrote
//! (`scripts/reference/comlrl2026_fixtures.py`): each era's raw text, the text wrapped by the
//! first-turn formatter (`external.prompt_passthrough: false`) and passed through (`true`), built by
//! the trainer's own [`NextTurnPrompter`] with the original's formatters as prompt templates
//! (`configs/prompts/comlrl_code_*.j2`); the reward server's diagnostics reaching that text through
//! the gRPC client; and `learner show-prompts --turn 2`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use cotrain_learner::config::{CheckedConfig, NextTurnPrompt};
use cotrain_learner::prompts::comlrl::LevelReport;
use cotrain_learner::prompts::{AgentTurn, NextTurn, NextTurnPrompter, Prompter, TurnRecord};
use cotrain_learner::services::GrpcReward;
use cotrain_learner::trainer::{FeedbackSpec, RewardSource, ScoreAction};
use cotrain_proto::reward as pb;
use serde_json::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn fixture() -> Value {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/comlrl2026/turn2_prompts.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

/// A two-agent, two-turn HumanEval config of `era` with the original's formatters as templates.
fn config(era: &str, passthrough: Option<bool>) -> CheckedConfig {
    let prompts = repo().join("configs/prompts");
    let passthrough = passthrough.map_or(String::new(), |p| format!(", prompt_passthrough: {p}"));
    let yaml = format!(
        "model: {{name: m}}\ndataset: {{name: humaneval}}\ncomlrl_era: '{era}'\n\
         external: {{mode: level_feedback, sandbox_slice: 1, original_prompt: true, previous_response: true{passthrough}}}\n\
         magrpo: {{num_agents: 2, num_turns: 2}}\n\
         prompts: {{agent0: {{template_file: '{}'}}, agent1: {{template_file: '{}'}}}}\n",
        prompts.join("comlrl_code_aux.j2").display(),
        prompts.join("comlrl_code_main.j2").display()
    );
    let v =
        cotrain_learner::config::merged_value(&yaml, "t.yaml", &[], &Default::default()).unwrap();
    CheckedConfig::from_value(v, Path::new("t.yaml")).unwrap()
}

/// The fixture row as the trainer holds it (the dataset item as JSON; the sandbox's tests).
fn item_json(item: &Value) -> Value {
    serde_json::json!({
        "task": "code",
        "task_id": item["task_id"],
        "prompt": item["prompt"],
        "test": item["tests_sandbox"],
        "entry_point": item["entry_point"],
    })
}

/// Both agents' (recorded, model-read) turn-2 texts from the fixture's turn-1 prompts and responses.
fn turn_two(cfg: &CheckedConfig, item: &Value, report: &LevelReport) -> Vec<(String, String)> {
    let prompter = NextTurnPrompter::from_config(cfg, true).unwrap();
    let row = item_json(item);
    let firsts = strings(&item["turn1_prompts"]);
    let responses = strings(&item["turn1_responses"]);
    (0..2)
        .map(|a| {
            let history = [TurnRecord {
                prompt: firsts[a].clone(),
                response: responses[a].clone(),
            }];
            let turn = AgentTurn {
                next: NextTurn {
                    original_prompt: &firsts[a],
                    history: &history,
                    feedback: "unused by the original's wordings",
                },
                agent: a,
                item: &row,
                row: 0,
                report: Some(report),
            };
            let t = prompter.compose(&turn, 0).unwrap();
            (t.recorded, t.user_text)
        })
        .collect()
}

fn assert_texts(what: &str, got: &[String], want: &[String]) {
    for (a, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g == w,
            "{what}, agent {a}:\n--- got\n{g}\n--- want\n{w}\n---"
        );
    }
}

#[test]
fn the_original_formatters_as_templates_give_the_fixture_turn_one_prompts() {
    let cfg = config("2026", None);
    let p = Prompter::from_config(&cfg).unwrap();
    for item in fixture()["items"].as_array().unwrap() {
        let row: cotrain_learner::data::TaskItem = serde_json::from_value(item_json(item)).unwrap();
        let got: Vec<String> = (0..2).map(|a| p.render(&row, 0, a).unwrap()).collect();
        assert_texts(
            item["task_id"].as_str().unwrap(),
            &got,
            &strings(&item["turn1_prompts"]),
        );
    }
}

#[test]
fn comlrl_2026_turn_two_prompts_equal_the_originals_raw_wrapped_and_passed_through() {
    let fx = fixture();
    assert_eq!(
        config("2026", None)
            .raw
            .external
            .resolved_next_turn_prompt(config("2026", None).raw.era(), true),
        NextTurnPrompt::Comlrl2026
    );
    for item in fx["items"].as_array().unwrap() {
        let id = item["task_id"].as_str().unwrap();
        let tree = &item["tree2026"];
        let report: LevelReport = serde_json::from_value(item["report"].clone()).unwrap();
        // Passed through (e5b008e hard-codes external_prompt_passthrough: true).
        let (recorded, read): (Vec<String>, Vec<String>) =
            turn_two(&config("2026", Some(true)), item, &report)
                .into_iter()
                .unzip();
        assert_texts(
            &format!("{id} 2026 level_feedback"),
            &recorded,
            &strings(&tree["level_feedback"]),
        );
        assert_texts(
            &format!("{id} 2026 passthrough true"),
            &read,
            &strings(&tree["tokenised_passthrough_true"]),
        );
        // Wrapped by the first-turn formatter (the 07663c1 configs; cotrain's default); the history
        // keeps the raw text.
        let (recorded, read): (Vec<String>, Vec<String>) =
            turn_two(&config("2026", None), item, &report)
                .into_iter()
                .unzip();
        assert_texts(
            &format!("{id} 2026 passthrough false"),
            &read,
            &strings(&tree["tokenised_passthrough_false"]),
        );
        assert_texts(
            &format!("{id} 2026 recorded"),
            &recorded,
            &strings(&tree["recorded_in_history_passthrough_false"]),
        );
        // Every line of the diagnostics, from a report with a syntax error, failures and misuse.
        let fake: LevelReport = serde_json::from_value(fx["fake_report"].clone()).unwrap();
        let (recorded, _): (Vec<String>, Vec<String>) =
            turn_two(&config("2026", Some(true)), item, &fake)
                .into_iter()
                .unzip();
        assert_texts(
            &format!("{id} 2026 fake report"),
            &recorded,
            &strings(&tree["fake_report_level_feedback"]),
        );
    }
}

#[test]
fn comlrl_2025_09_turn_two_prompts_equal_the_originals_raw_and_wrapped() {
    let fx = fixture();
    let sep = config("2025-09", None);
    assert_eq!(
        sep.raw
            .external
            .resolved_next_turn_prompt(sep.raw.era(), true),
        NextTurnPrompt::ComlrlSeptember2025
    );
    for item in fx["items"].as_array().unwrap() {
        let id = item["task_id"].as_str().unwrap();
        let s = &item["september2025"];
        let report: LevelReport = serde_json::from_value(item["report"].clone()).unwrap();
        let (recorded, read): (Vec<String>, Vec<String>) =
            turn_two(&sep, item, &report).into_iter().unzip();
        assert_texts(
            &format!("{id} 2025-09 level_feedback"),
            &recorded,
            &strings(&s["level_feedback"]),
        );
        assert_texts(
            &format!("{id} 2025-09 wrapped"),
            &read,
            &strings(&s["tokenised"]),
        );
        let (_, read): (Vec<String>, Vec<String>) =
            turn_two(&config("2025-09", Some(true)), item, &report)
                .into_iter()
                .unzip();
        assert_texts(
            &format!("{id} 2025-09 passthrough"),
            &read,
            &strings(&s["level_feedback"]),
        );
        let fake: LevelReport = serde_json::from_value(fx["fake_report"].clone()).unwrap();
        let (recorded, _): (Vec<String>, Vec<String>) =
            turn_two(&sep, item, &fake).into_iter().unzip();
        assert_texts(
            &format!("{id} 2025-09 fake report"),
            &recorded,
            &strings(&s["fake_report_level_feedback"]),
        );
    }
}

#[test]
fn wrapping_a_text_without_a_def_gives_the_original_formatters_error() {
    let prompter = NextTurnPrompter::from_config(&config("2026", None), true).unwrap();
    let row = serde_json::json!({"task": "code", "task_id": "t", "prompt": "no code here", "test": "", "entry_point": "f"});
    let history = [TurnRecord {
        prompt: "no code".into(),
        response: "nothing".into(),
    }];
    let report = LevelReport::placeholder("f", &["a".into(), "b".into()]);
    for agent in 0..2 {
        let turn = AgentTurn {
            next: NextTurn {
                original_prompt: "",
                history: &history,
                feedback: "",
            },
            agent,
            item: &row,
            row: 0,
            report: Some(&report),
        };
        assert_eq!(
            prompter.compose(&turn, 0).unwrap().user_text,
            "Error: Could not extract function information from prompt."
        );
    }
}

/// Answers Analyze with fixed diagnostics, as the reward server writes them.
struct FixedAnalysis(String);

#[tonic::async_trait]
impl pb::reward_server::Reward for FixedAnalysis {
    async fn score(
        &self,
        _: tonic::Request<pb::ScoreRequest>,
    ) -> Result<tonic::Response<pb::ScoreResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("score"))
    }
    async fn analyze(
        &self,
        r: tonic::Request<pb::AnalyzeRequest>,
    ) -> Result<tonic::Response<pb::AnalyzeResponse>, tonic::Status> {
        let results = r
            .into_inner()
            .actions
            .iter()
            .map(|_| pb::AnalyzeResult {
                analysis_json: self.0.clone(),
                elapsed_ms: 0,
            })
            .collect();
        Ok(tonic::Response::new(pb::AnalyzeResponse {
            results,
            elapsed_ms: 0,
        }))
    }
    async fn execute(
        &self,
        _: tonic::Request<pb::ExecuteRequest>,
    ) -> Result<tonic::Response<pb::ExecuteResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("execute"))
    }
    async fn info(
        &self,
        _: tonic::Request<pb::InfoRequest>,
    ) -> Result<tonic::Response<pb::InfoResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("info"))
    }
    async fn verify(
        &self,
        _: tonic::Request<pb::VerifyRequest>,
    ) -> Result<tonic::Response<pb::VerifyResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("verify"))
    }
}

#[test]
fn the_reward_servers_diagnostics_reach_the_original_wording_through_the_client() {
    use cotrain_reward_server::code_runner::{SetupOutcome, SyntaxCheck};
    use cotrain_reward_server::rewards::code::diagnostics::{
        AgentDiagnostics, AgentRole, AuxUsage, CodeDiagnostics, TestsSummary,
    };
    // CoopHumanEval/0 of the fixture: both functions found, the test passes, main is a thin wrapper
    // (`return x if aux(n) else y`): cotrain's analysis and the original's agree on every signal.
    let fx = fixture();
    let item = &fx["items"][1];
    let responses = strings(&item["turn1_responses"]);
    let agent = |role, function: &str, code: &str, aux_usage| AgentDiagnostics {
        role,
        function: function.into(),
        found: true,
        has_return: true,
        reason: None,
        code: code.trim_end().into(),
        aux_usage,
    };
    let d = CodeDiagnostics {
        single_agent: false,
        entry_point: "x_or_y".into(),
        agents: vec![
            agent(AgentRole::Aux, "aux", &responses[0], None),
            agent(
                AgentRole::Main,
                "x_or_y",
                &responses[1],
                Some(AuxUsage {
                    calls_aux: true,
                    uses_result: true,
                    misuse_line: None,
                    misuse_text: None,
                    thin_wrapper: true,
                }),
            ),
        ],
        syntax: Some(SyntaxCheck::Ok),
        setup: Some(SetupOutcome::Ok),
        tests: TestsSummary {
            passed: 1,
            total: 1,
            item_total: 1,
            timeouts: 0,
            stopped_after_timeouts: false,
            failures: vec![],
        },
        program: String::new(),
    };
    let analysis =
        serde_json::json!({"diagnostics": d, "feedback": ["aux text", "main text"]}).to_string();

    let rt = Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap(),
    );
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    rt.spawn(
        tonic::transport::Server::builder()
            .add_service(pb::reward_server::RewardServer::new(FixedAnalysis(
                analysis,
            )))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    let mut client = GrpcReward::connect(
        rt.clone(),
        &format!("http://{addr}"),
        Duration::from_secs(30),
        None,
    )
    .unwrap();
    let action = ScoreAction {
        completions: responses.clone(),
        completion_ids: vec![vec![1], vec![1]],
        item: item_json(item),
    };
    let spec = FeedbackSpec {
        mode: cotrain_learner::config::ExternalMode::LevelFeedback,
        sandbox_slice: Some(1),
    };
    let got = client.analyze("code", &[action], &spec).unwrap();
    assert_eq!(
        got[0].feedback,
        vec!["aux text".to_string(), "main text".to_string()]
    );
    let report = LevelReport::from_diagnostics(
        got[0]
            .diagnostics
            .as_ref()
            .expect("diagnostics on the wire"),
    );
    let (recorded, _): (Vec<String>, Vec<String>) =
        turn_two(&config("2026", Some(true)), item, &report)
            .into_iter()
            .unzip();
    assert_texts(
        "2026 from the server's diagnostics",
        &recorded,
        &strings(&item["tree2026"]["level_feedback"]),
    );
    let (recorded, _): (Vec<String>, Vec<String>) =
        turn_two(&config("2025-09", None), item, &report)
            .into_iter()
            .unzip();
    assert_texts(
        "2025-09 from the server's diagnostics",
        &recorded,
        &strings(&item["september2025"]["level_feedback"]),
    );
}

fn show(args: &[&str]) -> anyhow::Result<Vec<Value>> {
    use clap::Parser;
    let cfg = repo().join("configs/mt_magrpo_he_config.yaml");
    let mut argv = vec![
        "learner",
        "show-prompts",
        "--config",
        cfg.to_str().unwrap(),
        "--limit",
        "1",
        "--override",
        "model.name=default",
    ];
    argv.extend(args);
    let cli = cotrain_learner::cli::Cli::try_parse_from(argv).unwrap();
    let cotrain_learner::cli::Command::ShowPrompts {
        config,
        split,
        limit,
        turn,
    } = &cli.command
    else {
        panic!()
    };
    let cfg = config.load()?;
    let mut out = Vec::new();
    if *turn == 1 {
        cotrain_learner::cli::show_prompts(&cfg, *split, *limit, &mut out)?;
    } else {
        cotrain_learner::cli::show_turn_prompts(&cfg, *split, *limit, *turn as usize, &mut out)?;
    }
    Ok(String::from_utf8(out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect())
}

#[test]
fn show_prompts_turn_two_prints_the_full_history_prompt_of_a_2026_config() {
    let first = show(&[]).unwrap();
    let lines = show(&[
        "--turn",
        "2",
        "--override",
        "comlrl_era='2026'",
        "--override",
        "external.prompt_passthrough=true",
    ])
    .unwrap();
    assert_eq!(lines.len(), 2, "1 item x 2 agents");
    for (a, l) in lines.iter().enumerate() {
        let text = l["text"].as_str().unwrap();
        assert_eq!(l["next_turn_prompt"], "comlrl_2026");
        let p1 = first[a]["text"].as_str().unwrap();
        let heading = if a == 0 {
            "History: your previous aux(...) responses:"
        } else {
            "History: your previous main responses:"
        };
        let want_start = format!(
            "History: previous prompts:\n- Turn 1 prompt:\n{p1}\n\n{heading}\n- Turn 1 response:\n<agent {a} turn 1 response>\n\nStatic and execution diagnostics:\n"
        );
        assert!(text.starts_with(&want_start), "{text}");
        assert!(text.contains("<placeholder: the syntax check>"), "{text}");
    }
    // The September default of the seed config: the problem block, wrapped in the agent's template.
    let sep = show(&["--turn", "2"]).unwrap();
    let text = sep[1]["text"].as_str().unwrap();
    assert_eq!(sep[1]["next_turn_prompt"], "comlrl_2025_09");
    assert!(
        text.contains("Original problem and instructions:")
            && text.contains("Your previous main implementation:\n<agent 1 turn 1 response>"),
        "{text}"
    );
    assert!(
        text.starts_with(&first[1]["text"].as_str().unwrap()[..20]),
        "wrapped in the first-turn template: {text}"
    );
}

#[test]
fn show_prompts_refuses_a_turn_the_config_does_not_have() {
    let e = show(&["--turn", "3"]).unwrap_err().to_string();
    assert!(
        e.contains("--turn 3") && e.contains("num_turns is 2"),
        "{e}"
    );
    let e = show(&[
        "--turn",
        "2",
        "--override",
        "magrpo.num_turns=1",
        "--override",
        "magrpo.turn_gradient_weights=[1.0]",
    ])
    .unwrap_err()
    .to_string();
    assert!(e.contains("single-turn"), "{e}");
}

#[test]
fn a_2026_config_file_resolves_to_the_full_history_prompt_wrapped_by_its_passthrough_key() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/comlrl2026/upstream/magrpo_he_config.yaml");
    let cfg = cotrain_learner::config::load_config(&path, &[], &Default::default()).unwrap();
    // `external.external_prompt_passthrough: false` is the original's spelling of prompt_passthrough.
    assert_eq!(cfg.raw.external.prompt_passthrough, Some(false));
    assert_eq!(
        cfg.raw
            .external
            .resolved_next_turn_prompt(cfg.raw.era(), true),
        NextTurnPrompt::Comlrl2026
    );
    // Not a code task, or another feedback mode: the original has no such wording, cotrain's is used.
    assert_eq!(
        cfg.raw
            .external
            .resolved_next_turn_prompt(cfg.raw.era(), false),
        NextTurnPrompt::Cotrain
    );
}
