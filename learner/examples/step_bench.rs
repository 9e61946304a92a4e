//! One single-turn MAGRPO step on the reference setting of `notes/toolchain.md` — 2 agents (each its
//! own copy of SmolLM2-135M, f32) × 4 samples × 128 new tokens (EOS ignored) after a ~100-token
//! prompt, then one update per agent — timed for cotrain (the embedded rollout worker over gRPC, the
//! chunked log-prob kernel, one batched forward per agent) and, in the same run, for the original
//! trainer's way with transformers (`scripts/reference/original_step.py`: per agent `generate`, one
//! forward per completion, backward, AdamW).
//!
//! With `--turns 2 --variant tree|handoff` the step is a 2-turn MAGRPO step instead (tree: the root
//! and one child per joint action, 1 + 4 nodes; handoff: two turns of one node), each turn-2 prompt
//! the turn-1 prompt, the handed-on completion and a fixed stand-in feedback text; the reference is
//! `scripts/reference/original_mt_step.py` (the original generates node after node, one `generate`
//! per agent per node, and updates node by node).
//!
//! Sampling follows the seeds' code configs by default (temperature 0.7, top-p 0.9, top-k 50, as the
//! original's `generate` call); `--sampling plain` samples at temperature 1 without filters (the
//! figures of earlier sessions). `--rollout-dtype bf16` draws the rollouts with bf16 weights (and
//! pushes bf16 weights); `--matmul-dtype bf16` trains with bf16 products of the f32 master weights;
//! `--policies-in-turn` updates the two policies one after the other (`learner.concurrent_policies:
//! false`) instead of at the same time; `--bf16-dot-products` (with `--rollout-dtype bf16`) decodes
//! with AVX512_BF16 dot products (`rollout.bf16_dot_products`).
//!
//! `--lora R` trains LoRA adapters (`model.lora`: rank R, alpha 2R, no dropout, every projection) on
//! one shared base, loaded by `load_policies` as `learner train` loads them; `--agents N` runs N
//! agents (default 2). Either skips the Python reference (the original trains 2 full copies). The
//! resident set is printed after the policies load, after the embedded worker starts (it holds one
//! merged copy per agent, or with `--unmerged` one base for all the adapters) and after each step
//! (AdamW state and gradients appear with the first).
//!
//! ```sh
//! cargo run --release -p cotrain-learner --example step_bench [-- --steps 2 --skip-python]
//! cargo run --release -p cotrain-learner --example step_bench -- --rollout-dtype bf16 --matmul-dtype bf16
//! cargo run --release -p cotrain-learner --example step_bench -- --turns 2 --variant tree
//! for a in 2 8; do cargo run --release -p cotrain-learner --example step_bench -- --skip-python --agents $a --lora 8 [--unmerged]; done
//! ```
//! The Python side needs the pyref environment (`scripts/reference/setup-pyref.sh`; `COTRAIN_PYREF_PYTHON`
//! overrides its interpreter).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use cotrain_learner::algo::AdamWConfig;
use cotrain_learner::config::{CheckedConfig, LegacyFlags, merged_value};
use cotrain_learner::services::{PoolRollout, embedded::EmbeddedRollout, runtime};
use cotrain_learner::trainer::{
    FeedbackSpec, Policy, RewardSource, Score, ScoreAction, TrainError, TrainItem, Trainer,
    TrainerSetup,
};

/// A deterministic stand-in reward (the benchmark times the trainer, not a task): the fraction of
/// even token ids in agent 0's completion plus agent 1's, so advantages are non-zero.
struct Parity;

impl RewardSource for Parity {
    fn score(&mut self, _: &str, actions: &[ScoreAction]) -> Result<Vec<Score>, TrainError> {
        Ok(actions
            .iter()
            .map(|a| {
                let r: f64 = a
                    .completion_ids
                    .iter()
                    .map(|c| {
                        c.iter().filter(|t| *t % 2 == 0).count() as f64 / c.len().max(1) as f64
                    })
                    .sum();
                Score {
                    reward: r,
                    levels: BTreeMap::new(),
                    details: serde_json::Value::Null,
                    code: None,
                }
            })
            .collect())
    }
    /// The stand-in next-turn feedback (the benchmark times the trainer, not the sandbox).
    fn feedback(
        &mut self,
        _: &str,
        actions: &[ScoreAction],
        _: &FeedbackSpec,
    ) -> Result<Vec<Vec<String>>, TrainError> {
        Ok(actions
            .iter()
            .map(|a| vec![FEEDBACK.to_string(); a.completions.len()])
            .collect())
    }
    fn describe(&self) -> String {
        "parity".into()
    }
}

const FEEDBACK: &str =
    "Feedback: 0 of 1 tests passed. Revise your function and output only the code.";

const PROMPT: &str = "You are a careful Python programmer. Write a function `rolling_max(numbers)` that, given a list \
of integers, returns the list of the running maximum at every position. For example rolling_max([1, 2, 3, 2, 3, 4, 2]) \
returns [1, 2, 3, 3, 3, 4, 4]. Explain briefly, then give the code.";

/// The process's minor page faults so far and its resident set: first-touch faults (zeroing fresh
/// pages) are a cost of the first steps that warm steps should not pay.
struct MemoryFacts {
    minor_faults: u64,
    rss_bytes: u64,
}

impl MemoryFacts {
    /// From `/proc/self/stat` (field 10, minflt) and `/proc/self/statm` (resident pages); zeros where
    /// the files are missing (not Linux).
    fn now() -> Self {
        let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
        // The command name (field 2) may hold spaces; the fields after its closing parenthesis start at 3.
        let after_name = stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or("");
        let minor_faults = after_name
            .split_whitespace()
            .nth(7)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
        let pages: u64 = statm
            .split_whitespace()
            .nth(1)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        MemoryFacts {
            minor_faults,
            rss_bytes: pages * 4096,
        }
    }
}

/// `b` merged into `a`, mappings key by key.
fn deep_merge(a: serde_yaml_ng::Value, b: serde_yaml_ng::Value) -> serde_yaml_ng::Value {
    match (a, b) {
        (serde_yaml_ng::Value::Mapping(mut a), serde_yaml_ng::Value::Mapping(b)) => {
            for (k, v) in b {
                let merged = match a.remove(&k) {
                    Some(old) => deep_merge(old, v),
                    None => v,
                };
                a.insert(k, merged);
            }
            serde_yaml_ng::Value::Mapping(a)
        }
        (_, b) => b,
    }
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    // SAFETY: first thing in `main`, before any other thread and any libtorch call.
    unsafe { cotrain_model::mkl_dispatch::prefer_avx512() };
    cotrain_model::allocator::tune_for_tensors();
    println!("cpu: {}", cotrain_model::cpu::CpuFacts::probe().summary());
    println!(
        "roofline: {}",
        cotrain_model::cpu::Roofline::measure().summary()
    );
    // RUST_LOG=debug shows, e.g., how each weight push splits into writing and the worker's swap.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let steps: u64 = args
        .iter()
        .position(|a| a == "--steps")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let lora_rank: Option<usize> = flag("--lora").map(|s| s.parse()).transpose()?;
    let n_agents: usize = flag("--agents")
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(2);
    anyhow::ensure!(n_agents >= 1, "--agents must be at least 1");
    let skip_python =
        args.iter().any(|a| a == "--skip-python") || lora_rank.is_some() || n_agents != 2;
    let turns: usize = flag("--turns").and_then(|s| s.parse().ok()).unwrap_or(1);
    let variant = flag("--variant").unwrap_or_else(|| "tree".into());
    if !matches!(variant.as_str(), "tree" | "handoff") {
        anyhow::bail!("--variant must be tree or handoff, got {variant}");
    }
    // The chat template on every prompt, as the reference scripts render them (the same prompt
    // tokens on both sides). Multi-turn:
    // turn-2 prompts = problem + previous response + feedback; no early stops (the stand-in reward
    // never reaches them), handoff of the best joint action.
    let multi = if turns > 1 {
        format!(
            "external: {{mode: level_feedback, original_prompt: true, previous_response: true}}\n\
             magrpo: {{num_turns: {turns}, rollout: {variant}, handoff: best, turn_gradient_weights: [1.2, 0.8], discount: 0.9}}\n"
        )
    } else {
        String::new()
    };
    let (sampling, python_sampling) = match flag("--sampling").as_deref() {
        None | Some("seeds") => (
            "temperature: 0.7, top_p: 0.9, top_k: 50",
            ["--temperature", "0.7", "--top-p", "0.9", "--top-k", "50"],
        ),
        Some("plain") => (
            "temperature: 1.0, top_p: 1.0, top_k: 0",
            ["--temperature", "1.0", "--top-p", "1.0", "--top-k", "0"],
        ),
        Some(other) => anyhow::bail!("--sampling must be seeds or plain, got {other}"),
    };
    let dtype = |name: &str| -> anyhow::Result<String> {
        match flag(name).as_deref() {
            None | Some("f32") => Ok("f32".into()),
            Some("bf16") => Ok("bf16".into()),
            Some(other) => anyhow::bail!("{name} must be f32 or bf16, got {other}"),
        }
    };
    let (rollout_dtype, matmul_dtype) = (dtype("--rollout-dtype")?, dtype("--matmul-dtype")?);
    let concurrent = !args.iter().any(|a| a == "--policies-in-turn");
    let bf16_dot = args.iter().any(|a| a == "--bf16-dot-products");
    let lora = lora_rank
        .map(|r| {
            format!(
                ", lora: {{r: {r}, lora_alpha: {}, lora_dropout: 0.0}}",
                2 * r
            )
        })
        .unwrap_or_default();
    let yaml = format!(
        "model: {{name: default, dtype: f32, matmul_dtype: {matmul_dtype}, {sampling}, max_length: 1024, chat_template: true{lora}}}\n\
         dataset: {{name: coophumaneval, train_split: 'test[:1]'}}\n\
         magrpo: {{num_agents: {n_agents}, num_generations: 4, max_new_tokens: 128, learning_rate: 1.0e-5, rollout_buffer_size: 1, \
         num_train_epochs: 100, save_steps: 100000, eval_interval: 100000}}\n\
         rollout: {{dtype: {rollout_dtype}, weight_dtype: {rollout_dtype}, bf16_dot_products: {bf16_dot}}}\n\
         learner: {{concurrent_policies: {concurrent}}}\n\
         logging: {{tensorboard: false, plots: false, progress: never}}\n"
    );
    println!(
        "sampling: {sampling}; rollout dtype {rollout_dtype}{}, training products {matmul_dtype}; policies updated {}",
        if bf16_dot {
            " (AVX512_BF16 dot products)"
        } else {
            ""
        },
        if concurrent {
            "at the same time"
        } else {
            "in turn"
        }
    );
    let base = merged_value(&yaml, "bench", &[], &LegacyFlags::default())?;
    let value = if multi.is_empty() {
        base
    } else {
        deep_merge(base, serde_yaml_ng::from_str(&multi)?)
    };
    let cfg = CheckedConfig::from_value(value, Path::new("bench"))?;
    let opts = cotrain_model::loader::LoadOptions::default();
    let adam = AdamWConfig::new(1e-5, 0.0, None);
    let rss_start = MemoryFacts::now().rss_bytes;
    let policies: Vec<Policy> = if lora_rank.is_some() {
        cotrain_learner::trainer::load_policies(&cfg)?.0
    } else {
        (0..n_agents)
            .map(|i| {
                Ok(Policy::new(
                    &format!("agent{i}"),
                    "default",
                    cotrain_model::loader::load("default", &opts)?,
                    None,
                    adam,
                ))
            })
            .collect::<anyhow::Result<_>>()?
    };
    let rss_policies = MemoryFacts::now().rss_bytes;
    println!(
        "{n_agents} agents, {}: learner policies resident {:.2} GB ({:.2} GB trained tensors)",
        lora_rank
            .map(|r| format!("LoRA r {r}"))
            .unwrap_or_else(|| "full fine-tuning".into()),
        rss_policies.saturating_sub(rss_start) as f64 / 1e9,
        policies
            .iter()
            .flat_map(|p| p.parameters().into_values())
            .map(|t| t.numel() * 4)
            .sum::<usize>() as f64
            / 1e9
    );
    let encoding = cfg.prompt_encoding();
    let model_text = encoding.model_text(policies[0].model.chat_template.as_ref(), PROMPT)?;
    let prompt =
        cotrain_learner::trainer::items::encode_text(&policies[0].model.tokenizer, &model_text)?;
    let rt = runtime()?;
    let agents: Vec<(String, String)> = (0..n_agents)
        .map(|i| (format!("agent{i}"), "default".to_string()))
        .collect();
    if cfg.raw.rollout.bf16_dot_products {
        // As the learner does before it starts its embedded worker.
        cotrain_model::kernels::gemm_bf16dot::enable_for(
            cotrain_learner::trainer::rollout_kind(&cfg),
            tch::Device::Cpu,
            "--bf16-dot-products",
        )
        .map_err(anyhow::Error::msg)?;
    }
    // `--unmerged` (with `--lora`): the agents as adapters on one base in the embedded worker.
    let groups = if args.iter().any(|a| a == "--unmerged") {
        vec![agents.iter().map(|(a, _)| a.clone()).collect()]
    } else {
        Vec::new()
    };
    anyhow::ensure!(
        groups.is_empty() || lora_rank.is_some(),
        "--unmerged needs --lora"
    );
    let worker = EmbeddedRollout::start_full(
        rt.clone(),
        &agents,
        tch::Device::Cpu,
        cotrain_learner::trainer::rollout_kind(&cfg),
        Vec::new(),
        groups,
        cfg.raw.rollout.engine,
    )?;
    let rollout = PoolRollout::connect(
        rt.clone(),
        vec![format!("http://{}", worker.grpc)],
        vec![],
        std::time::Duration::from_secs(600),
        1,
        std::time::Duration::from_secs(5),
        std::time::Duration::from_secs(60),
    )?
    .with_weight_dtype(cfg.raw.rollout.weight_dtype);
    let rss_worker = MemoryFacts::now().rss_bytes;
    println!(
        "embedded worker ({n_agents} served models) resident {:.2} GB",
        rss_worker.saturating_sub(rss_policies) as f64 / 1e9
    );
    let tmp = std::env::temp_dir().join(format!("cotrain-step-bench-{}", std::process::id()));
    let mut trainer = Trainer::new(TrainerSetup {
        cfg,
        run_dir: tmp.clone(),
        task: "parity".into(),
        is_code: false,
        policies,
        agent_policy: (0..n_agents).collect(),
        rollout: Box::new(rollout),
        reward: Box::new(Parity),
        train_items: vec![TrainItem {
            index: 0,
            item: serde_json::Value::Null,
            prompts: vec![prompt.clone(); n_agents],
            texts: vec![PROMPT.into(); n_agents],
        }],
        eval_items: vec![],
    })?;
    trainer.ignore_eos = true;
    trainer.sync_all_weights()?;
    eprintln!("prompt tokens: {}", prompt.len());
    let mut times = Vec::new();
    for s in 0..steps {
        let faults = MemoryFacts::now();
        let t = Instant::now();
        let m = trainer.train_step(&[0])?;
        let secs = t.elapsed().as_secs_f64();
        let after = MemoryFacts::now();
        eprintln!(
            "cotrain step {}: {secs:.1} s (generate {:.1} s, reward {:.2} s, train {:.1} s [forward {:.1}, backward {:.1}, optimiser {:.1}], weight sync {:.1} s), {} tokens per completion, {} nodes, {} optimiser steps; {}k page faults, RSS {:.2} GB",
            s + 1,
            m["time/generate"],
            m["time/reward"],
            m["time/train"],
            m["time/train_forward"],
            m["time/train_backward"],
            m["time/train_optimizer"],
            m["time/weight_sync"],
            m["completion_len/mean"],
            m.get("nodes_per_item").copied().unwrap_or(1.0),
            m["optimizer_steps"],
            after.minor_faults.saturating_sub(faults.minor_faults) / 1000,
            after.rss_bytes as f64 / 1e9
        );
        if let Some(gap) = m.get("logprob_gap") {
            eprintln!("  rollout/training log-prob gap: {gap:.4} per token (mean |Δ|)");
        }
        times.push(secs);
    }
    let rss_end = MemoryFacts::now().rss_bytes;
    drop(trainer);
    drop(worker);
    let _ = std::fs::remove_dir_all(&tmp);
    let best = times.iter().cloned().fold(f64::INFINITY, f64::min);
    println!(
        "{}",
        serde_json::json!({"impl": "cotrain", "turns": turns, "variant": variant, "agents": n_agents, "lora_rank": lora_rank, "samples": 4, "new_tokens": 128, "prompt_tokens": prompt.len(), "step_seconds": times, "best_seconds": best, "rss_gb_after_steps": rss_end as f64 / 1e9})
    );

    if !skip_python {
        let python = std::env::var("COTRAIN_PYREF_PYTHON").unwrap_or_else(|_| {
            format!(
                "{}/.cache/cotrain/pyref/bin/python",
                std::env::var("HOME").unwrap_or_default()
            )
        });
        let reference = if turns > 1 {
            "../scripts/reference/original_mt_step.py"
        } else {
            "../scripts/reference/original_step.py"
        };
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join(reference);
        let mut cmd = Command::new(&python);
        cmd.arg(&script).arg("--steps").arg(steps.to_string());
        if turns > 1 {
            cmd.arg("--variant").arg(&variant);
        } else {
            cmd.args(python_sampling);
        }
        let out = cmd.output()?;
        if !out.status.success() {
            anyhow::bail!(
                "{} failed: {}",
                script.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let line = String::from_utf8_lossy(&out.stdout);
        print!("{line}");
        let reference: serde_json::Value =
            serde_json::from_str(line.trim().lines().last().unwrap_or("{}"))?;
        if let Some(r) = reference["best_seconds"].as_f64() {
            println!(
                "speed-up: {:.2}x (cotrain {best:.1} s vs original-style {r:.1} s per step)",
                r / best
            );
        }
    }
    Ok(())
}
