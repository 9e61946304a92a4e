//! MaPoRL's discussion text against the original's own functions (fixtures written by
//! `scripts/reference/maporl_fixtures.py` from chanwoo-park-official/MAPoRL): the follow-up chats the
//! trainer's code builds for a 2-agent, 3-turn GSM8K discussion equal the chats the original passes
//! to `apply_chat_template`, for the Phi-3 and the generic (Qwen2.5) question wording, with and
//! without `reward_feedback`; the answer rewrite, the verifier's copy, the correctness read from it
//! and the penalty's box check equal the original's on every fixture case.

use std::path::Path;

use cotrain_learner::algo::discussion_score::{InvalidOutputRule, InvalidReason, invalid_reason};
use cotrain_learner::config::{CheckedConfig, MaporlSection, merged_value};
use cotrain_learner::data::{Gsm8kItem, TaskItem};
use cotrain_learner::maporl::rewrite;
use cotrain_learner::maporl::rollout::{Answer, followup_chat, present};
use cotrain_learner::prompts::{ChatMessage, Followup, Prompter};
use serde_json::Value;

fn fixture(name: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/maporl")
        .join(name);
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn messages(v: &Value) -> Vec<ChatMessage> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let content = m["content"].as_str().unwrap();
            match m["role"].as_str().unwrap() {
                "user" => ChatMessage::user(content),
                "assistant" => ChatMessage::assistant(content),
                r => panic!("role {r}"),
            }
        })
        .collect()
}

/// The original's extracted answer as the fixtures write it: an integer or "invalid".
fn answer_value(a: &Option<String>) -> Value {
    match a {
        Some(x) => Value::from(x.parse::<i64>().unwrap()),
        None => Value::from("invalid"),
    }
}

fn answer(text: &str, shown: String, raw_score: f64) -> Answer {
    Answer {
        prompt: vec![],
        value_prompt: vec![],
        tokens: vec![],
        text: text.to_string(),
        correct: false,
        extracted: Value::Null,
        score: raw_score,
        raw_score,
        shown,
        invalid: None,
        adapter: String::new(),
        logprobs: vec![],
    }
}

#[test]
fn the_followup_chats_are_the_originals_byte_for_byte() {
    let f = fixture("followup_prompt.json");
    let question = f["question"].as_str().unwrap();
    let item = TaskItem::Gsm8k(Gsm8kItem {
        question: question.into(),
        answer: "#### 29".into(),
        final_answer: "29".into(),
    });
    let texts = |t: usize, i: usize| f["answers"][t][i].as_str().unwrap();
    let score = |t: usize, i: usize| f["scores"][t][i].as_f64().unwrap();
    let discussions = f["discussions"].as_array().unwrap();
    assert_eq!(
        discussions.len(),
        4,
        "Phi-3 and generic, with and without reward_feedback"
    );
    for d in discussions {
        let model = d["model_name"].as_str().unwrap();
        let feedback = d["reward_feedback"].as_bool().unwrap();
        let label = format!("{model}, reward_feedback {feedback}");
        // The first-turn prompt through the config and the default GSM8K template.
        let yaml = format!("model: {{name: {model}}}\ndataset: {{name: gsm8k}}\nmaporl: {{}}\n");
        let cfg = CheckedConfig::from_value(
            merged_value(&yaml, "m.yaml", &[], &Default::default()).unwrap(),
            Path::new("m.yaml"),
        )
        .unwrap();
        let prompter = Prompter::from_config(&cfg).unwrap();
        let m: MaporlSection =
            serde_json::from_value(serde_json::json!({ "reward_feedback": feedback })).unwrap();
        let followup = Followup::new(m.followup_style, m.followup_template.as_deref()).unwrap();
        let n = 2;
        let questions: Vec<String> = (0..n)
            .map(|i| prompter.render(&item, 0, i).unwrap())
            .collect();
        let mut histories: Vec<Vec<ChatMessage>> = questions
            .iter()
            .map(|q| vec![ChatMessage::user(q.clone())])
            .collect();
        let mut previous: Vec<Answer> = Vec::new();
        let chats = d["chats"].as_array().unwrap();
        assert_eq!(chats.len(), 6);
        for turn in 0..3 {
            for i in 0..n {
                if turn > 0 {
                    histories[i] =
                        followup_chat(&followup, &m, &histories[i], &questions[i], &previous, i)
                            .unwrap();
                }
                let want = chats
                    .iter()
                    .find(|c| c["turn"] == turn && c["agent"] == i)
                    .unwrap();
                let want = messages(&want["messages"]);
                assert_eq!(
                    histories[i].len(),
                    want.len(),
                    "{label}: turn {turn} agent {i}"
                );
                for (got, want) in histories[i].iter().zip(&want) {
                    assert_eq!(got.role, want.role, "{label}: turn {turn} agent {i}");
                    assert_eq!(got.content, want.content, "{label}: turn {turn} agent {i}");
                }
            }
            // This turn's answers, as the discussion presents them.
            previous = (0..n)
                .map(|i| {
                    let p = present(&m, "gsm8k", texts(turn, i));
                    let shown = d["shown_answers"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .find(|s| s["turn"] == turn && s["agent"] == i)
                        .unwrap();
                    assert_eq!(
                        p.shown,
                        shown["text"].as_str().unwrap(),
                        "{label}: shown answer turn {turn} agent {i}"
                    );
                    assert_eq!(
                        answer_value(&p.answer),
                        shown["answer"],
                        "{label}: answer turn {turn} agent {i}"
                    );
                    let query = d["verifier_queries"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .find(|s| s["turn"] == turn && s["agent"] == i)
                        .unwrap();
                    assert_eq!(
                        p.judged,
                        query["query"][1]["content"].as_str().unwrap(),
                        "{label}: verifier text turn {turn} agent {i}"
                    );
                    assert_eq!(
                        questions[i],
                        query["query"][0]["content"].as_str().unwrap(),
                        "{label}: question turn {turn} agent {i}"
                    );
                    histories[i].push(ChatMessage::assistant(p.shown.clone()));
                    answer(texts(turn, i), p.shown, score(turn, i))
                })
                .collect();
        }
    }
}

#[test]
fn the_cotrain_style_stays_reachable() {
    let m: MaporlSection = serde_json::from_value(
        serde_json::json!({ "followup_style": "cotrain", "rewrite_answers": false }),
    )
    .unwrap();
    let followup = Followup::new(m.followup_style, None).unwrap();
    let raw = "36 - 7 = 29\nThe answer is: 29 ";
    let p = present(&m, "gsm8k", raw);
    assert_eq!((p.shown.as_str(), p.judged.as_str()), (raw, raw));
    let prev = vec![answer("a", "a".into(), 1.0), answer(raw, p.shown, 0.0)];
    let chat = followup_chat(&followup, &m, &[ChatMessage::user("q")], "q", &prev, 0).unwrap();
    assert_eq!(chat.len(), 2);
    assert!(
        chat[1]
            .content
            .contains("Agent 1 solution: 36 - 7 = 29\nThe answer is: 29\n"),
        "{}",
        chat[1].content
    );
    assert!(
        !chat[1].content.contains("Once again"),
        "{}",
        chat[1].content
    );
}

#[test]
fn the_answer_rewrite_is_the_originals_on_every_case() {
    let f = fixture("boxed_rewrite.json");
    let rule = InvalidOutputRule {
        min_tokens: 0,
        require_boxed: true,
        ..InvalidOutputRule::default()
    };
    let cases = f["cases"].as_array().unwrap();
    assert!(cases.len() >= 16);
    for c in cases {
        let name = c["case"].as_str().unwrap();
        let response = c["response"].as_str().unwrap();
        let r = rewrite::rewrite("gsm8k", response);
        assert_eq!(answer_value(&r.answer), c["answer"], "{name}: answer");
        assert_eq!(
            r.shown,
            c["rewritten"].as_str().unwrap(),
            "{name}: rewritten"
        );
        assert_eq!(
            r.judged,
            c["verifier_text"].as_str().unwrap(),
            "{name}: verifier text"
        );
        let truth = c["ground_truth"].as_i64().unwrap().to_string();
        let correct =
            rewrite::extract_answer("gsm8k", &r.judged).as_deref() == Some(truth.as_str());
        assert_eq!(
            i64::from(correct),
            c["correct"].as_i64().unwrap(),
            "{name}: correct"
        );
        // The penalty's box check reads the answer as sampled.
        let boxed = invalid_reason(response, 1000, &rule) != Some(InvalidReason::NoBoxed);
        assert_eq!(
            boxed,
            c["has_box_for_penalty"].as_bool().unwrap(),
            "{name}: box for the penalty"
        );
    }
}

#[test]
fn the_llama_3_question_keeps_its_leading_and_trailing_spaces() {
    let yaml =
        "model: {name: meta-llama/Meta-Llama-3-8B-Instruct}\ndataset: {name: gsm8k}\nmaporl: {}\n";
    let cfg = CheckedConfig::from_value(
        merged_value(yaml, "m.yaml", &[], &Default::default()).unwrap(),
        Path::new("m.yaml"),
    )
    .unwrap();
    let item = TaskItem::Gsm8k(Gsm8kItem {
        question: "Q?".into(),
        answer: "#### 1".into(),
        final_answer: "1".into(),
    });
    let text = Prompter::from_config(&cfg)
        .unwrap()
        .render(&item, 0, 0)
        .unwrap();
    assert_eq!(
        text,
        "Question: Q?\n\n Let's think step by step. At the end, you MUST write the answer in the following format:```\n\nAnswer: \\boxed{ XXX }'''\n\nPlease ensure that the final answer is always formatted this way. "
    );
}
