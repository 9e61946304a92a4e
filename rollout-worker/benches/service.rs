//! Service benchmark over loopback gRPC, printed in one run:
//! - throughput of 32 concurrent single-prompt requests vs one 32-prompt request (continuous
//!   batching should bring the first close to the second);
//! - weight-update throughput (GB/s) of a full update of the model, in bf16 and f32 chunks.
//!
//! `cargo bench -p cotrain-rollout-worker --bench service`. Environment: `BENCH_MODEL` (default
//! `default`, the embedded SmolLM2-135M-Instruct), `BENCH_MAX_NEW_TOKENS` (default 48),
//! `BENCH_DTYPE` (f32 or bf16, default f32), `BENCH_DEVICE` (default cpu).

use std::sync::Arc;
use std::time::Instant;

use cotrain_proto::rollout::rollout_client::RolloutClient;
use cotrain_proto::rollout::{
    ChatMessage, ChatMessages, GenerateRequest, GenerateResponse, ListParametersRequest, Prompt,
    SamplingParams, StopConditions, UpdateHeader, prompt,
};
use cotrain_rollout_client::pool::update_stream;
use cotrain_rollout_client::wire::{UpdatedTensor, WireDType};
use cotrain_rollout_worker::WorkerConfig;
use cotrain_rollout_worker::server;
use tonic::transport::Channel;

const AGENT: &str = "policy";
const PROMPTS: usize = 32;
const ROUNDS: usize = 2;

fn env_or(key: &str, default: &str) -> String {
    std::env::var(key).unwrap_or_else(|_| default.to_string())
}

fn chat_prompt(i: usize) -> Prompt {
    let content = format!("Write a short story about the number {i}.");
    Prompt {
        kind: Some(prompt::Kind::Chat(ChatMessages {
            messages: vec![ChatMessage {
                role: "user".into(),
                content,
            }],
        })),
    }
}

fn request(prompts: Vec<Prompt>, seed: u64, max_new_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        agent: AGENT.into(),
        prompts,
        n: 1,
        sampling: Some(SamplingParams {
            temperature: Some(1.0),
            top_p: Some(1.0),
            top_k: 0,
            max_new_tokens,
            min_p: None,
            sampling_logprobs: false,
        }),
        seed,
        // Fixed-length completions so both runs do the same work.
        stop: Some(StopConditions {
            ignore_eos: true,
            ..Default::default()
        }),
        min_policy_version: None,
        request_id: String::new(),
    }
}

fn completion_tokens(r: &GenerateResponse) -> usize {
    r.completions
        .iter()
        .flat_map(|c| &c.samples)
        .map(|s| s.token_ids.len())
        .sum()
}

async fn one_big_request(c: &RolloutClient<Channel>, max_new_tokens: u32) -> (usize, f64) {
    let mut c = c.clone();
    let start = Instant::now();
    let r = c
        .generate(request(
            (0..PROMPTS).map(chat_prompt).collect(),
            1,
            max_new_tokens,
        ))
        .await
        .expect("generate");
    (
        completion_tokens(&r.into_inner()),
        start.elapsed().as_secs_f64(),
    )
}

async fn many_small_requests(c: &RolloutClient<Channel>, max_new_tokens: u32) -> (usize, f64) {
    let start = Instant::now();
    let handles: Vec<_> = (0..PROMPTS)
        .map(|i| {
            let mut c = c.clone();
            tokio::spawn(async move {
                let r = c
                    .generate(request(vec![chat_prompt(i)], 1 + i as u64, max_new_tokens))
                    .await
                    .expect("generate");
                completion_tokens(&r.into_inner())
            })
        })
        .collect();
    let mut tokens = 0;
    for h in handles {
        tokens += h.await.expect("task");
    }
    (tokens, start.elapsed().as_secs_f64())
}

async fn weight_update(c: &RolloutClient<Channel>, dtype: WireDType, version: u64) -> (u64, f64) {
    let mut c = c.clone();
    let params = c
        .list_parameters(ListParametersRequest {
            agent: AGENT.into(),
        })
        .await
        .expect("params")
        .into_inner();
    let tensors: Vec<UpdatedTensor> = params
        .parameters
        .iter()
        .map(|p| {
            let numel: i64 = p.shape.iter().product();
            // Small constant weights: the bytes' values do not change the transfer.
            let one = match dtype {
                WireDType::F32 => 0.01f32.to_le_bytes().to_vec(),
                WireDType::Bf16 => half::bf16::from_f32(0.01).to_le_bytes().to_vec(),
            };
            UpdatedTensor {
                name: p.name.clone(),
                dtype,
                shape: p.shape.clone(),
                data: one.repeat(numel as usize),
            }
        })
        .collect();
    let bytes: u64 = tensors.iter().map(|t| t.data.len() as u64).sum();
    let header = UpdateHeader {
        agent: AGENT.into(),
        version,
        tensor_count: tensors.len() as u32,
        partial: false,
        lora_scaling: 0.0,
        probe: None,
    };
    let start = Instant::now();
    let r = c
        .update_weights(update_stream(header, Arc::new(tensors), 4 << 20))
        .await
        .expect("update")
        .into_inner();
    assert_eq!(r.version, version);
    (bytes, start.elapsed().as_secs_f64())
}

/// CPU seconds this process has used (user + system), from /proc: wall time on a shared machine
/// swings with other load, CPU time much less.
fn cpu_secs() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the parenthesised command name, from `state`: utime and stime (in clock
    // ticks of 1/100 s) are the 12th and 13th; they sum over all threads.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| {
        f.get(i)
            .and_then(|x| x.parse::<f64>().ok())
            .unwrap_or(f64::NAN)
    };
    (tick(11) + tick(12)) / 100.0
}

fn main() -> anyhow::Result<()> {
    let model = env_or("BENCH_MODEL", "default");
    let max_new_tokens: u32 = env_or("BENCH_MAX_NEW_TOKENS", "48").parse()?;
    let config = WorkerConfig {
        share: Vec::new(),
        adapters: Vec::new(),
        agents: vec![(AGENT.into(), model.clone())],
        device: cotrain_model::config::parse_device(&env_or("BENCH_DEVICE", "cpu"))?,
        kind: cotrain_model::config::parse_dtype(&env_or("BENCH_DTYPE", "f32"))?,
        max_batch_size: 64,
        max_queued_requests: 1024,
        engine_threads: Default::default(),
        decode_threads: Default::default(),
        verifiers: Vec::new(),
        lora_modules: Vec::new(),
        engine: Default::default(),
        agent_devices: Vec::new(),
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let load = Instant::now();
        let srv = server::start(config, "127.0.0.1:0".parse()?, "127.0.0.1:0".parse()?).await?;
        println!("model {model} loaded in {:.1} s, serving on {}", load.elapsed().as_secs_f64(), srv.grpc_addr);
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", srv.grpc_addr))?
            .initial_stream_window_size(server::STREAM_WINDOW_BYTES)
            .initial_connection_window_size(server::CONNECTION_WINDOW_BYTES)
            .connect()
            .await?;
        let c = RolloutClient::new(channel)
            .max_encoding_message_size(usize::MAX)
            .max_decoding_message_size(usize::MAX);
        // Warm-up: first forwards allocate caches and kernels.
        let mut w = c.clone();
        w.generate(request(vec![chat_prompt(0)], 0, 4)).await?;

        let steps = || srv.worker().metrics().decode_steps.with_label_values(&[model.as_str()]).get();
        println!("generation, {PROMPTS} prompts x {max_new_tokens} new tokens (alternating runs, best of {ROUNDS}):");
        let (mut big, mut small) = (0f64, 0f64);
        let mut cpu_ratio = Vec::new();
        for round in 0..ROUNDS {
            let (s0, c0) = (steps(), cpu_secs());
            let (t1, s1) = one_big_request(&c, max_new_tokens).await;
            let (s1_steps, c1) = (steps() - s0, cpu_secs() - c0);
            let (s0, c0) = (steps(), cpu_secs());
            let (t2, s2) = many_small_requests(&c, max_new_tokens).await;
            let (s2_steps, c2) = (steps() - s0, cpu_secs() - c0);
            println!("  round {round}: one {PROMPTS}-prompt request: {t1} tokens in {s1:.2} s = {:.1} tokens/s, {c1:.1} CPU-s = {:.1} tokens/CPU-s, {s1_steps} decode steps",
                t1 as f64 / s1, t1 as f64 / c1);
            println!("  round {round}: {PROMPTS} concurrent 1-prompt requests: {t2} tokens in {s2:.2} s = {:.1} tokens/s, {c2:.1} CPU-s = {:.1} tokens/CPU-s, {s2_steps} decode steps",
                t2 as f64 / s2, t2 as f64 / c2);
            cpu_ratio.push((t2 as f64 / c2) / (t1 as f64 / c1));
            big = big.max(t1 as f64 / s1);
            small = small.max(t2 as f64 / s2);
        }
        println!("  best: batched {big:.1} tokens/s, concurrent {small:.1} tokens/s, ratio concurrent / batched = {:.2} (target >= 0.80)", small / big);
        println!("  per CPU-second, ratio concurrent / batched by round: {cpu_ratio:.2?}");

        for (i, dtype) in [WireDType::Bf16, WireDType::F32].into_iter().enumerate() {
            let (bytes, secs) = weight_update(&c, dtype, i as u64 + 1).await;
            println!(
                "weight update ({dtype:?}, full model): {:.1} MB in {secs:.2} s = {:.2} GB/s (stream, validation, conversion, swap)",
                bytes as f64 / 1e6,
                bytes as f64 / 1e9 / secs
            );
        }
        srv.shutdown().await
    })
}
