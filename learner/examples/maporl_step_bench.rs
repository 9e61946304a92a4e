//! One MaPoRL step, timed: `configs/maporl_gsm8k_config.yaml` on the default model (SmolLM2-135M) at
//! the original's batch (32 GSM8K questions per PPO update, 4 PPO epochs × 8 mini-batches of 4
//! questions) and layout (one turn-0 and one later-turn adapter shared by the agents, one critic per
//! trained turn), shrunk in length (2 turns, 64 new tokens per answer), everything else as shipped:
//! sampling at temperature 0.7 with top_k 0 / top_p 1 for exactly `max_output_length` tokens (EOS
//! ignored), LoRA r 8 / alpha 16 on the 7 projections, kl_coef 0.002, vf_coef 0.1, turn 0 not trained.
//!
//! The run is built as `learner train` builds it (`cotrain_learner::maporl::build`: the embedded
//! rollout worker and reward server start in-process and are spoken to over real gRPC), then two
//! steps run on different questions (rows 0..Q, then Q..2Q: MaPoRL never repeats a step on the same
//! questions); the second is reported, the first paying for lazy initialisation
//! (`--warmup-questions W` runs it on rows 0..W only, to save the time of a full one). The Python side of
//! the comparison is `scripts/bench/maporl_reference.py`; `scripts/bench/maporl_step.sh` runs both.
//!
//! ```sh
//! cargo run --release -p cotrain-learner --example maporl_step_bench -- [--questions 32] [--warmup-questions 32] [--mini-batches 8] \
//!     [--tokens 64] [--turns 2] [--config configs/maporl_gsm8k_config.yaml] [--override key=value]...
//! ```
//! Progress goes to stderr; the last stdout line is one JSON object (`"impl": "cotrain"`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use cotrain_learner::config::{LegacyFlags, load_config};
use cotrain_learner::trainer::TrainItem;

/// `lscpu`'s value of `key` ("Model name", "CPU family"), or "unknown".
fn lscpu(key: &str) -> String {
    std::process::Command::new("lscpu")
        .env("LC_ALL", "C")
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout).lines().find_map(|l| {
                l.split_once(':')
                    .filter(|(k, _)| k.trim() == key)
                    .map(|(_, v)| v.trim().to_string())
            })
        })
        .unwrap_or_else(|| "unknown".into())
}

fn main() -> anyhow::Result<()> {
    // SAFETY: first thing in `main`, before any other thread and any libtorch call.
    unsafe { cotrain_model::mkl_dispatch::prefer_avx512() };
    cotrain_model::allocator::tune_for_tensors();
    println!("cpu: {}", cotrain_model::cpu::CpuFacts::probe().summary());
    println!(
        "roofline: {}",
        cotrain_model::cpu::Roofline::measure().summary()
    );
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut questions = 32usize;
    let mut warmup: Option<usize> = None;
    let mut mini_batches = 8usize;
    let mut tokens = 64usize;
    let mut turns = 2usize;
    let mut config =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../configs/maporl_gsm8k_config.yaml");
    let mut extra = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .cloned()
                .ok_or_else(|| anyhow::anyhow!("{name} needs a value"))
        };
        match a.as_str() {
            "--questions" => questions = value(a)?.parse()?,
            "--warmup-questions" => warmup = Some(value(a)?.parse()?),
            "--mini-batches" => mini_batches = value(a)?.parse()?,
            "--tokens" => tokens = value(a)?.parse()?,
            "--turns" => turns = value(a)?.parse()?,
            "--config" => config = PathBuf::from(value(a)?),
            "--override" => extra.push(value(a)?),
            "-h" | "--help" => {
                eprintln!(
                    "usage: maporl_step_bench [--questions N] [--warmup-questions N] [--mini-batches N] [--tokens N] [--turns N] [--config PATH] [--override key=value]..."
                );
                return Ok(());
            }
            other => anyhow::bail!("unknown argument `{other}` (see --help)"),
        }
    }
    anyhow::ensure!(
        questions > 0 && tokens > 0 && turns >= 2,
        "--questions and --tokens must be positive, --turns at least 2"
    );
    anyhow::ensure!(
        mini_batches > 0 && questions.is_multiple_of(mini_batches),
        "--questions ({questions}) must be a multiple of --mini-batches ({mini_batches})"
    );

    let tmp =
        std::env::temp_dir().join(format!("cotrain-maporl-step-bench-{}", std::process::id()));
    // Questions per step = per_device_train_batch_size × gradient_accumulation_steps × num_mini_batches.
    let mut overrides: Vec<String> = vec![
        "model.name=default".into(),
        format!("dataset.train_split=train[:{}]", 2 * questions),
        "dataset.eval_split=test[:1]".into(),
        format!("maporl.round_num={turns}"),
        format!("maporl.max_output_length={tokens}"),
        "maporl.per_device_train_batch_size=1".into(),
        format!(
            "maporl.gradient_accumulation_steps={}",
            questions / mini_batches
        ),
        format!("maporl.num_mini_batches={mini_batches}"),
        "maporl.num_ppo_epochs=4".into(),
        "maporl.eval_interval=0".into(),
        format!("output.base_dir={}", tmp.display()),
        "output.save_final_model=false".into(),
        "logging.progress=never".into(),
        "logging.plots=false".into(),
        "logging.tensorboard=false".into(),
    ];
    overrides.extend(extra);
    let cfg = load_config(&config, &overrides, &LegacyFlags::default())?;
    let m = cfg
        .raw
        .maporl
        .clone()
        .ok_or_else(|| anyhow::anyhow!("{}: not a maporl config", config.display()))?;
    let qps = m.questions_per_step();

    let t_build = Instant::now();
    let (mut trainer, guard) = cotrain_learner::maporl::build(&cfg, tmp.join("run"))?;
    let build_secs = t_build.elapsed().as_secs_f64();
    anyhow::ensure!(
        trainer.s.train_items.len() >= 2 * qps,
        "the train split has {} rows, 2 steps need {}",
        trainer.s.train_items.len(),
        2 * qps
    );
    let total = trainer.total_steps();
    eprintln!(
        "cotrain: built in {build_secs:.1} s ({} agents, {} turns, {qps} questions per step, {} new tokens, {} PPO epochs x {} mini-batches, \
         {} policy adapters, {} critics)",
        cfg.num_agents,
        m.round_num,
        m.max_output_length,
        m.num_ppo_epochs,
        m.num_mini_batches,
        trainer.s.adapters.policies.len(),
        trainer.s.adapters.critics.len()
    );

    // The first step pays for lazy initialisation and is not reported: it may run on fewer questions.
    let warmup = warmup.unwrap_or(qps).clamp(1, qps);
    let rows = [0..warmup, qps..2 * qps];
    let mut steps: Vec<BTreeMap<String, f64>> = Vec::new();
    for (s, rows) in rows.iter().enumerate() {
        let items: Vec<TrainItem> = trainer.s.train_items[rows.clone()].to_vec();
        let refs: Vec<&TrainItem> = items.iter().collect();
        let t = Instant::now();
        let mut v = trainer.train_step(&refs, total)?;
        v.insert("wall".into(), t.elapsed().as_secs_f64());
        eprintln!(
            "cotrain step {} (rows {}..{}): {:.1} s = rollout {:.1} + update {:.1} [prepare {:.1}, policy {:.1}, value {:.1}] + weight sync {:.2}; \
             turn-1 accuracy {:.2}, {} trained response tokens",
            s + 1,
            rows.start,
            rows.end,
            v["time/step"],
            v["time/rollout"],
            v["time/update"],
            v["time/ppo_prepare"],
            v["time/ppo_policy"],
            v["time/ppo_value"],
            v["time/weight_sync"],
            v.get("accuracy/turn1").copied().unwrap_or(f64::NAN),
            v.get("train/response_tokens").copied().unwrap_or(0.0)
        );
        steps.push(v);
    }
    drop(trainer);
    drop(guard);
    let _ = std::fs::remove_dir_all(&tmp);

    let last = &steps[1];
    let g = |k: &str| last.get(k).copied().unwrap_or(f64::NAN);
    let generated = qps * cfg.num_agents * m.round_num * m.max_output_length;
    let line = serde_json::json!({
        "impl": "cotrain",
        "cpu_model": lscpu("Model name"),
        "cpu_family": lscpu("CPU family"),
        "threads": tch::get_num_threads(),
        "agents": cfg.num_agents,
        "turns": m.round_num,
        "questions": qps,
        "max_output_length": m.max_output_length,
        "num_ppo_epochs": m.num_ppo_epochs,
        "num_mini_batches": m.num_mini_batches,
        "generated_tokens": generated,
        "trained_response_tokens": g("train/response_tokens"),
        "trained_samples": g("train/samples"),
        "policy_positions": g("train/policy_positions"),
        "value_positions": g("train/value_positions"),
        "policy_positions_run": g("train/policy_positions_run"),
        "value_positions_run": g("train/value_positions_run"),
        "step": g("time/step"),
        "rollout": g("time/rollout"),
        "update": g("time/update"),
        "ppo_prepare": g("time/ppo_prepare"),
        "ppo_policy": g("time/ppo_policy"),
        "ppo_value": g("time/ppo_value"),
        "weight_sync": g("time/weight_sync"),
        "first_step": steps[0].get("time/step").copied().unwrap_or(f64::NAN),
        "warmup_questions": warmup,
        "build": build_secs,
    });
    println!("{line}");
    Ok(())
}
