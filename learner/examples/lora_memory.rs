//! The learner's resident memory for N agents, full fine-tuning against LoRA: the policies loaded
//! as `learner train` loads them (`load_policies`: one copy per agent, or one frozen base shared by
//! the agents' adapters), then one update of each policy on a 5-token sample (gradients and AdamW
//! moments appear with it). Nothing is generated: the worker's side is measured by the worker.
//!
//! ```sh
//! cargo build -p cotrain-learner --example lora_memory
//! target/debug/examples/lora_memory --model default --agents 2 [--lora 8]
//! target/debug/examples/lora_memory --model DIR --agents 8 --lora 8
//! target/debug/examples/lora_memory --model DIR --agents 1 --load-only   # no update (its memory)
//! ```

use std::path::Path;

use cotrain_learner::algo::LossOptions;
use cotrain_learner::config::{CheckedConfig, LegacyFlags, merged_value};
use cotrain_learner::trainer::{AgentBatches, TrainSample, load_policies};

fn rss_gb() -> f64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: f64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    pages * 4096.0 / 1e9
}

fn main() -> anyhow::Result<()> {
    cotrain_model::allocator::tune_for_tensors();
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let model = flag("--model").unwrap_or_else(|| "default".into());
    let agents: usize = flag("--agents")
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(2);
    let lora: Option<usize> = flag("--lora").map(|s| s.parse()).transpose()?;
    let lora_yaml = lora
        .map(|r| {
            format!(
                ", lora: {{r: {r}, lora_alpha: {}, lora_dropout: 0.0}}",
                2 * r
            )
        })
        .unwrap_or_default();
    let yaml = format!(
        "model: {{name: '{model}', dtype: f32{lora_yaml}}}\ndataset: {{name: gsm8k}}\n\
         magrpo: {{num_agents: {agents}, learning_rate: 1.0e-5}}\nlogging: {{progress: never}}\n"
    );
    let cfg = CheckedConfig::from_value(
        merged_value(&yaml, "bench", &[], &LegacyFlags::default())?,
        Path::new("bench"),
    )?;
    println!("cpu: {}", cotrain_model::cpu::CpuFacts::probe().summary());
    let start = rss_gb();
    let (mut policies, _) = load_policies(&cfg)?;
    let loaded = rss_gb();
    let trained: usize = policies
        .iter()
        .flat_map(|p| p.parameters().into_values())
        .map(|t| t.numel() * 4)
        .sum();
    if args.iter().any(|a| a == "--load-only") {
        println!(
            "{model}, {agents} agents: trained tensors {:.2} GB; learner resident +{:.2} GB after loading",
            trained as f64 / 1e9,
            loaded - start
        );
        return Ok(());
    }
    let sample = TrainSample {
        prompt: vec![1, 2, 3],
        completion: vec![4, 5],
        advantage: 1.0,
        weight: 1.0,
        old_logprobs: Vec::new(),
    };
    for p in policies.iter_mut() {
        p.update(
            &[AgentBatches {
                minibatches: vec![vec![sample.clone()]],
                scale: 1.0,
            }],
            &LossOptions::original(),
            1,
        )?;
    }
    let updated = rss_gb();
    let what = lora
        .map(|r| format!("LoRA r {r}"))
        .unwrap_or_else(|| "full fine-tuning".into());
    println!(
        "{model}, {agents} agents, {what}: trained tensors {:.2} GB; learner resident +{:.2} GB after loading, +{:.2} GB after one update",
        trained as f64 / 1e9,
        loaded - start,
        updated - start
    );
    Ok(())
}
