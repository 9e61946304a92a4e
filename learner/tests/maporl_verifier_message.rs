//! What MaPoRL's trainer sends the learned verifier (`score: verifier`): one (user, answer)
//! conversation per agent's answer, every turn, whose user message is by default the answering
//! agent's own turn-0 question message (the original's trainer pairs each answer with
//! `raw_agent_context_set[agent][q][0]["content"]`), and with
//! `maporl.verifier_user_message: template` the `verifier.user_template` over the row's question.
//! The discussion runs through `MaporlTrainer::evaluate` on the seed GSM8K config and the tiny
//! model, the in-process engine behind a source that records the verifier's conversations.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use cotrain_learner::config::{LegacyFlags, load_config};
use cotrain_learner::data::load_split;
use cotrain_learner::maporl::agents::{Adapters, Bases};
use cotrain_learner::maporl::{MaporlSetup, MaporlTrainer};
use cotrain_learner::prompts::items::prepare_items;
use cotrain_learner::services::EngineRollout;
use cotrain_learner::trainer::{
    GenRequest, GenSample, RewardSource, RolloutSource, Score, ScoreAction, TrainError,
};
use tch::Tensor;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The in-process engine, answering the verifier with 0.5 and keeping what it was asked.
struct VerifierRecorder {
    inner: EngineRollout,
    asked: Arc<Mutex<Vec<(String, String)>>>,
}

impl RolloutSource for VerifierRecorder {
    fn generate(&mut self, requests: &[GenRequest]) -> Result<Vec<Vec<GenSample>>, TrainError> {
        self.inner.generate(requests)
    }
    fn policy_version(&mut self, agent: &str) -> Result<u64, TrainError> {
        self.inner.policy_version(agent)
    }
    fn push_weights(
        &mut self,
        agent: &str,
        version: u64,
        params: &BTreeMap<String, Tensor>,
    ) -> Result<(), TrainError> {
        self.inner.push_weights(agent, version, params)
    }
    fn score_verifier(
        &mut self,
        name: &str,
        conversations: &[(String, String)],
    ) -> Result<Vec<f32>, TrainError> {
        assert_eq!(name, "judge", "the configured verifier name");
        self.asked
            .lock()
            .unwrap()
            .extend(conversations.iter().cloned());
        Ok(vec![0.5; conversations.len()])
    }
    fn describe(&self) -> String {
        "verifier recorder".into()
    }
}

/// Every answer wrong, with the row's label as the reference (what the reward server reports).
struct Wrong;

impl RewardSource for Wrong {
    fn score(&mut self, _task: &str, actions: &[ScoreAction]) -> Result<Vec<Score>, TrainError> {
        Ok(actions
            .iter()
            .map(|a| Score {
                reward: 0.0,
                levels: BTreeMap::new(),
                details: serde_json::json!({"reference": a.item["answer"].to_string()}),
                code: None,
            })
            .collect())
    }
    fn describe(&self) -> String {
        "wrong".into()
    }
}

/// What `asked_with` returns: the verifier's conversations as (user message, answer) pairs, each eval
/// item's prompt texts, and each eval item's dataset row.
type Asked = (
    Vec<(String, String)>,
    Vec<Vec<String>>,
    Vec<serde_json::Value>,
);

/// The verifier's conversations of one evaluation of 2 questions (2 agents, 2 turns).
fn asked_with(extra: &[&str]) -> Asked {
    let overrides: Vec<String> = [
        "model.name=default",
        "model.chat_template=false",
        "maporl.round_num=2",
        "maporl.max_output_length=4",
        "maporl.min_output_length=1",
        "maporl.max_input_length=4000",
        "model.max_length=4096",
        "maporl.eval_num_samples=2",
        "maporl.score=verifier",
        "maporl.reward_feedback=true",
        "maporl.verifier_name=judge",
        // Remote workers serve verifiers by name: nothing is connected here (the recorder answers).
        "rollout.endpoints=[\"http://127.0.0.1:9\"]",
        "dataset.eval_split=test[:2]",
        "dataset.train_split=train[:2]",
    ]
    .iter()
    .chain(extra)
    .map(|s| s.to_string())
    .collect();
    let cfg = load_config(
        &repo().join("configs/maporl_gsm8k_config.yaml"),
        &overrides,
        &LegacyFlags::default(),
    )
    .unwrap();
    let m = cfg.raw.maporl.clone().unwrap();
    let opts = cotrain_learner::model_options::load_options(&cfg).unwrap();
    let bases = Bases::load(&cfg, &opts).unwrap();
    let adapters = Adapters::new(&cfg, &m, &bases).unwrap();
    let engines = adapters
        .worker_agents(&bases)
        .into_iter()
        .map(|(key, spec)| (key, cotrain_model::loader::load(&spec, &opts).unwrap()))
        .collect();
    let prompter = cotrain_learner::prompts::Prompter::from_config(&cfg).unwrap();
    let models: Vec<&cotrain_model::loader::LoadedModel> =
        bases.agent_base.iter().map(|&b| &bases.models[b]).collect();
    let limits = vec![4000; cfg.num_agents];
    let encoding = cfg.prompt_encoding();
    let train = load_split(&cfg.raw.dataset, &cfg.train_split).unwrap();
    let eval = load_split(&cfg.raw.dataset, cfg.eval_split.as_ref().unwrap()).unwrap();
    let train_items = prepare_items(&train, &models, &prompter, &encoding, &limits).unwrap();
    let eval_items = prepare_items(&eval, &models, &prompter, &encoding, &limits).unwrap();
    let texts = eval_items.iter().map(|it| it.texts.clone()).collect();
    let rows = eval_items.iter().map(|it| it.item.clone()).collect();
    let asked = Arc::new(Mutex::new(Vec::new()));
    let run = tempfile::tempdir().unwrap();
    let setup = MaporlSetup {
        cfg: cfg.clone(),
        run_dir: run.path().join("run"),
        task: "gsm8k".into(),
        bases,
        adapters,
        rollout: Box::new(VerifierRecorder {
            inner: EngineRollout::new(engines),
            asked: asked.clone(),
        }),
        reward: Box::new(Wrong),
        train_items,
        eval_items,
    };
    let mut trainer = MaporlTrainer::new(setup).unwrap();
    trainer.evaluate().unwrap();
    let asked = std::mem::take(&mut *asked.lock().unwrap());
    (asked, texts, rows)
}

#[test]
fn the_verifier_reads_each_agents_own_first_question_message_by_default() {
    let (asked, texts, _) = asked_with(&[]);
    // 2 turns × 2 questions × 2 agents, in (question, agent) order each turn.
    assert_eq!(asked.len(), 8, "{asked:#?}");
    for (k, (user, _)) in asked.iter().enumerate() {
        let (q, agent) = ((k % 4) / 2, k % 2);
        assert_eq!(user, &texts[q][agent], "conversation {k}");
        assert!(
            user.contains("Please ensure that the final answer is always formatted this way."),
            "the seed's turn-0 message: {user}"
        );
    }
    // Turn 1's messages are the turn-0 question messages too, not the follow-up the agents read.
    assert!(!asked[4].0.contains("verifier"), "{}", asked[4].0);
}

#[test]
fn the_template_option_sends_the_verifier_template_over_the_question() {
    let (asked, texts, rows) = asked_with(&[
        "maporl.verifier_user_message=template",
        "verifier.user_template=Q: {{ question }} (judge this)",
    ]);
    assert_eq!(asked.len(), 8);
    for (k, (user, _)) in asked.iter().enumerate() {
        let q = (k % 4) / 2;
        assert_eq!(
            user,
            &format!(
                "Q: {} (judge this)",
                rows[q]["question"].as_str().unwrap().trim()
            ),
            "conversation {k}"
        );
        assert_ne!(user, &texts[q][k % 2]);
    }
}
