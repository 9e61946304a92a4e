//! Per-agent settings (`model.agents[i]`: temperature, top-p, top-k, max new tokens, stop strings,
//! learning rate) through the trainer's own paths: `load_policies` builds each agent's optimiser from
//! the config, `Trainer::train_step` asks the rollout source with each agent's sampling, and one
//! step moves each agent's weights by its own learning rate.

mod train_common;

use std::sync::{Arc, Mutex};

use cotrain_learner::services::EngineRollout;
use cotrain_learner::trainer::{Trainer, TrainerSetup, load_policies};
use cotrain_model::loader::{LoadOptions, LoadedModel, load};
use train_common::{Recording, Seen, TokenRule, config, items, taken, tiny_model_dir};

fn yaml(model: &std::path::Path, agents: &str) -> String {
    format!(
        "model: {{name: '{}', temperature: 0.7, top_p: 0.9, max_length: 64, agents: {agents}}}\n\
         dataset: {{name: gsm8k, train_split: 'train[:2]'}}\n\
         magrpo:\n  num_agents: 2\n  num_generations: 4\n  max_new_tokens: 6\n  learning_rate: 0.5\n  num_train_epochs: 1\n  \
         rollout_buffer_size: 1\n  eval_interval: 0\n  save_steps: 100000\n\
         logging: {{tensorboard: false, plots: false, progress: never}}\n",
        model.display()
    )
}

/// A trainer whose policies come from `load_policies(cfg)`, as `learner train` builds them.
fn trainer(yaml: &str, run: &std::path::Path) -> (Trainer, Arc<Mutex<Vec<Seen>>>) {
    let cfg = config(yaml, &[]);
    let (policies, agent_policy) = load_policies(&cfg).unwrap();
    let engines = cfg
        .agent_models
        .iter()
        .enumerate()
        .map(|(a, spec)| {
            (
                format!("agent{a}"),
                load(spec, &LoadOptions::default()).unwrap(),
            )
        })
        .collect();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut trainer = Trainer::new(TrainerSetup {
        cfg,
        run_dir: run.to_path_buf(),
        task: "token_rule".into(),
        is_code: false,
        policies,
        agent_policy,
        rollout: Box::new(Recording {
            inner: EngineRollout::new(engines),
            seen: seen.clone(),
        }),
        // Joint rewards that vary with both agents' first tokens, so both get a gradient.
        reward: Box::new(TokenRule {
            rule: |t: &[u32]| t[0].wrapping_add(t[1]).is_multiple_of(2),
        }),
        train_items: items(2, 2),
        eval_items: items(2, 2),
    })
    .unwrap();
    trainer.sync_all_weights().unwrap();
    (trainer, seen)
}

/// The largest change of any parameter between two copies of one model.
fn moved(a: &LoadedModel, b: &LoadedModel) -> f64 {
    let (pa, pb) = (a.named_parameters(), b.named_parameters());
    pa.iter()
        .map(|(name, t)| (t - &pb[name]).abs().max().double_value(&[]))
        .fold(0.0, f64::max)
}

#[test]
fn each_agent_samples_and_learns_with_its_own_settings() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model_dir(tmp.path());
    let base = load(&model.display().to_string(), &LoadOptions::default()).unwrap();
    let stop: Vec<String> = ('a'..='z').map(String::from).collect();
    let agents = format!(
        "[{{temperature: 1.5, top_k: 0, max_new_tokens: 3, stop: [{}]}}, {{temperature: 0.9, top_p: 0.5, top_k: 7, learning_rate: 1.0e-9}}]",
        stop.join(", ")
    );
    let (mut t, seen) = trainer(&yaml(&model, &agents), &tmp.path().join("per-agent"));
    assert_eq!(
        t.policies()
            .iter()
            .map(|p| p.optimizer.cfg.lr)
            .collect::<Vec<_>>(),
        [0.5, 1e-9],
        "each policy's optimiser has its agent's rate"
    );

    let m = t.train_step(&[0]).unwrap();
    let requests = taken(&seen);
    assert_eq!(requests.len(), 2, "one request per agent for one item");
    for r in &requests {
        let s = &r.sampling;
        match r.agent.as_str() {
            "agent0" => {
                assert_eq!(
                    (s.temperature, s.top_p, s.top_k, s.max_new_tokens),
                    (1.5, 0.9, 0, 3),
                    "agent 0's own values over the shared ones"
                );
                assert_eq!(s.stop, stop);
                assert!(
                    r.completions.iter().all(|c| c.len() <= 3),
                    "{:?}",
                    r.completions
                );
                assert!(
                    r.texts
                        .iter()
                        .all(|text| !stop.iter().any(|x| text.contains(x.as_str()))),
                    "a stop string left in {:?}",
                    r.texts
                );
            }
            "agent1" => {
                assert_eq!(
                    (s.temperature, s.top_p, s.top_k, s.max_new_tokens),
                    (0.9, 0.5, 7, 6),
                    "agent 1's own values, the shared max_new_tokens"
                );
                assert!(s.stop.is_empty());
            }
            other => panic!("unexpected agent {other}"),
        }
    }
    assert!(
        m["reward/std"] > 0.0,
        "the rewards varied, so both agents had a gradient: {m:?}"
    );
    assert_eq!(
        (m["agent0/learning_rate"], m["agent1/learning_rate"]),
        (0.5, 1e-9),
        "logged per agent"
    );
    let (a0, a1) = (
        moved(&t.policies()[0].model, &base),
        moved(&t.policies()[1].model, &base),
    );
    assert!(a0 > 1e-3, "agent 0 trains at 0.5: moved {a0}");
    assert!(a1 < 1e-6, "agent 1 trains at 1e-9: moved {a1}");

    // Control: without agent 1's own rate, the same step moves it by the shared rate.
    let agents = agents.replace(", learning_rate: 1.0e-9", "");
    let (mut t, _) = trainer(&yaml(&model, &agents), &tmp.path().join("shared-rate"));
    t.train_step(&[0]).unwrap();
    let a1 = moved(&t.policies()[1].model, &base);
    assert!(a1 > 1e-3, "agent 1 at the shared rate 0.5: moved {a1}");
}

#[test]
fn per_agent_settings_are_checked_and_named() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model_dir(tmp.path());
    let err = |agents: &str, extra: &[&str]| {
        let v = cotrain_learner::config::merged_value(
            &yaml(&model, agents),
            "t.yaml",
            &extra.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
            &Default::default(),
        )
        .unwrap();
        cotrain_learner::config::CheckedConfig::from_value(v, std::path::Path::new("t.yaml"))
            .unwrap_err()
            .to_string()
    };
    let e = err("[{temperature: 0}, {}]", &[]);
    assert!(
        e.contains("model.agents[0].temperature") && e.contains("positive"),
        "{e}"
    );
    let e = err("[{}, {max_new_tokens: 64}]", &[]);
    assert!(e.contains("model.agents[1].max_new_tokens"), "{e}");
    let e = err("[{}, {stop: ['']}]", &[]);
    assert!(e.contains("model.agents[1].stop"), "{e}");
    let e = err(
        "[{}, {learning_rate: 1e-3}]",
        &["magrpo.shared_parameters=true"],
    );
    assert!(
        e.contains("model.agents[1].learning_rate") && e.contains("shared_parameters"),
        "{e}"
    );
    let e = err("[{}, {temprature: 0.5}]", &[]);
    assert!(e.contains("temprature"), "an unknown key is named: {e}");
    let e = err("[{}]", &[]);
    assert!(e.contains("model.agents") && e.contains("1 entries"), "{e}");

    // Plain model names (the original's form) and mappings mix.
    let m = model.display().to_string();
    let cfg = config(
        &yaml(&model, &format!("['{m}', {{name: '{m}', top_p: 0.3}}]")),
        &[],
    );
    assert_eq!(cfg.agent_models, [m.clone(), m]);
    assert_eq!(
        (cfg.agents[0].sampling.top_p, cfg.agents[1].sampling.top_p),
        (0.9, 0.3)
    );
    assert_eq!(cfg.agents[1].learning_rate, 0.5);
}

/// A stop string reaches a real rollout worker over gRPC (`PoolRollout`, the learner's client of the
/// worker pool): the completion ends at it, its text cut before it, as the in-process engine does.
#[test]
fn stop_strings_reach_the_workers_over_grpc() {
    use cotrain_learner::services::embedded::EmbeddedRollout;
    use cotrain_learner::services::{PoolRollout, runtime};
    use cotrain_learner::trainer::{GenRequest, RolloutSource, SamplingSpec};

    let tmp = tempfile::tempdir().unwrap();
    let spec = tiny_model_dir(tmp.path()).display().to_string();
    let rt = runtime().unwrap();
    let worker = EmbeddedRollout::start(
        rt.clone(),
        &[("agent0".to_string(), spec)],
        tch::Device::Cpu,
        tch::Kind::Float,
    )
    .unwrap();
    let mut pool = PoolRollout::connect(
        rt.clone(),
        vec![format!("http://{}", worker.grpc)],
        vec![],
        std::time::Duration::from_secs(60),
        1,
        std::time::Duration::from_secs(5),
        std::time::Duration::from_secs(60),
    )
    .unwrap();
    let mut greedy = |stop: Vec<String>| {
        let sampling = SamplingSpec {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            max_new_tokens: 16,
            ignore_eos: true,
            stop,
            sampling_logprobs: false,
        };
        let req = GenRequest {
            agent: "agent0".into(),
            prompt: vec![65, 97, 48],
            n: 1,
            sampling,
            seed: 5,
            min_policy_version: 0,
        };
        pool.generate(&[req]).unwrap().remove(0).remove(0)
    };
    let full = greedy(Vec::new());
    assert_eq!(full.token_ids.len(), 16);
    // The stop string: the completion's third character (whatever the tiny model wrote).
    let (at, c) = full
        .text
        .char_indices()
        .nth(2)
        .expect("a completion of 16 bytes has 3 characters");
    let stop = c.to_string();
    let cut = greedy(vec![stop.clone()]);
    let first = full.text.find(&stop).unwrap();
    assert!(first <= at);
    assert_eq!(
        cut.text,
        full.text[..first],
        "the text ends before the stop string"
    );
    assert!(cut.stopped, "a stop string is a stop, not a length cut");
    assert!(
        cut.token_ids.len() < 16 && full.token_ids.starts_with(&cut.token_ids),
        "{:?} then {:?}",
        full.token_ids,
        cut.token_ids
    );
}

/// What users type besides the mapping form: `--override` of one agent's key (as errors name it, or
/// dotted), a config written back by the run (`config.yaml`) loading to the same settings, and the
/// maporl trainer refusing settings it does not read.
#[test]
fn per_agent_keys_override_round_trip_and_are_refused_where_unread() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model_dir(tmp.path());
    let m = model.display().to_string();
    let text = yaml(&model, &format!("['{m}', {{top_p: 0.3}}]"));
    let cfg = config(
        &text,
        &[
            "model.agents[0].temperature=1.2".into(),
            "model.agents.1.learning_rate=0.01".into(),
        ],
    );
    assert_eq!(
        cfg.agent_models,
        [m.clone(), m.clone()],
        "a plain name keeps its model when a key below it is set"
    );
    assert_eq!(
        (
            cfg.agents[0].sampling.temperature,
            cfg.agents[1].sampling.temperature
        ),
        (1.2, 0.7)
    );
    assert_eq!(
        (
            cfg.agents[0].learning_rate,
            cfg.agents[1].learning_rate,
            cfg.agents[1].sampling.top_p
        ),
        (0.5, 0.01, 0.3)
    );
    let again = config(&cfg.to_yaml(), &[]);
    assert_eq!(
        (again.agents, again.agent_models),
        (cfg.agents.clone(), cfg.agent_models.clone()),
        "the written config loads to the same settings"
    );

    let bad = |overrides: &[&str], text: &str| {
        let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        match cotrain_learner::config::merged_value(text, "t.yaml", &o, &Default::default()) {
            Err(e) => e.to_string(),
            Ok(v) => cotrain_learner::config::CheckedConfig::from_value(
                v,
                std::path::Path::new("t.yaml"),
            )
            .unwrap_err()
            .to_string(),
        }
    };
    let e = bad(&["model.agents.2.temperature=1"], &text);
    assert!(e.contains("`model.agents` is a list of 2"), "{e}");
    let e = bad(
        &["model.agents[1].temperature=1"],
        &text.replace(&format!("agents: ['{m}', {{top_p: 0.3}}]"), "agents: null"),
    );
    assert!(e.contains("`model.agents` is not set"), "{e}");
    let e = bad(&[], &yaml(&model, "[5, {}]"));
    assert!(
        e.contains("model.agents[0]") && e.contains("a model name or a mapping"),
        "{e}"
    );

    let maporl = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../configs/maporl_gsm8k_config.yaml"),
    )
    .unwrap();
    let e = bad(&["model.agents=[{temperature: 0.9}, {}]"], &maporl);
    assert!(
        e.contains("model.agents[0]") && e.contains("maporl trainer does not read"),
        "{e}"
    );
}
