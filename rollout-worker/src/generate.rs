//! `rollout-worker generate`: load a model, apply the chat template if asked, sample, print.

use std::io::Write;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use cotrain_model::chat_template::ChatMessage;
use cotrain_model::config::{parse_device, parse_dtype};
use cotrain_model::engine::{
    Engine, EngineConfig, LogprobMode, Request, SamplingParams, StopConditions,
};
use cotrain_model::loader::{self, LoadOptions};

/// Arguments of `generate`.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// Model: a Hugging Face directory, a .gguf file, an `org/name` repo id in the local HF
    /// cache, or `default` (the embedded SmolLM2-135M-Instruct).
    #[arg(long, default_value = "default")]
    model: String,
    /// A PEFT LoRA adapter directory (`adapter_config.json`, `adapter_model.safetensors`, e.g.
    /// `learner export` of a `model.lora` run) to serve on top of `--model`, unmerged.
    #[arg(long)]
    adapter: Option<std::path::PathBuf>,
    /// The prompt text.
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// A system message (with --chat).
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Most tokens to generate per sample.
    #[arg(long, default_value_t = 128)]
    max_new_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Nucleus sampling mass; 1 disables.
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    /// Keep the K most likely tokens; 0 disables.
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Drop tokens below this fraction of the top token's probability; 0 disables.
    #[arg(long, default_value_t = 0.0)]
    min_p: f64,
    /// Random seed (sample i uses the stream (seed, i)).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Number of samples.
    #[arg(long, default_value_t = 1)]
    n: usize,
    /// Strings that end a sample (repeatable).
    #[arg(long = "stop")]
    stop: Vec<String>,
    /// Keep generating past EOS.
    #[arg(long)]
    ignore_eos: bool,
    /// Report log-probs under the sampling distribution instead of the raw model.
    #[arg(long)]
    sampling_logprobs: bool,
    /// Parameter dtype: f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Device: cpu, cuda (cuda:0), cuda:N or auto (a GPU if one is usable). A CUDA device that
    /// cannot be used is an error that says why.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// With --dtype bf16 on a CPU with AVX512_BF16: round each product's input rows to bf16 and
    /// multiply with bf16 dot products (faster from 8 sequences on; not the f32 rows of the default).
    #[arg(long)]
    bf16_dot_products: bool,
    /// Print one JSON object with token ids, texts, log-probs and finish reasons.
    #[arg(long)]
    json: bool,
    /// libtorch intra-op threads (default: libtorch's choice).
    #[arg(long)]
    threads: Option<i32>,
    /// Thread count of decode steps: `adaptive` (measured while decoding; fewer threads when the
    /// cores are shared with other busy processes, same output bit for bit), `fixed` (always the
    /// count above) or a count.
    #[arg(long, default_value = "adaptive")]
    decode_threads: cotrain_model::engine::DecodeThreads,
}

/// Runs `generate`.
pub fn run(args: GenerateArgs) -> Result<()> {
    // Quiet by default (the output is the completions); RUST_LOG=info shows, e.g., the decode
    // kernels' dispatch decision.
    cotrain_proto::logging::init("warn");
    if let Some(t) = args.threads {
        tch::set_num_threads(t);
    }
    let opts = LoadOptions {
        device: parse_device(&args.device)?,
        kind: parse_dtype(&args.dtype)?,
    };
    if args.bf16_dot_products {
        cotrain_model::kernels::gemm_bf16dot::enable_for(
            opts.kind,
            opts.device,
            "--bf16-dot-products",
        )
        .map_err(anyhow::Error::msg)?;
    }
    let load_start = Instant::now();
    let loaded = loader::load(&args.model, &opts)
        .with_context(|| format!("loading model `{}`", args.model))?;
    let load_secs = load_start.elapsed().as_secs_f64();

    let prompt_ids = if args.chat {
        let Some(template) = &loaded.chat_template else {
            bail!("model `{}` has no chat template; drop --chat", args.model);
        };
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(ChatMessage::system(system.clone()));
        }
        messages.push(ChatMessage::user(args.prompt.clone()));
        let text = template
            .render(&messages, true, &serde_json::Value::Null)
            .context("rendering the chat template")?;
        // The template already wrote any BOS it wants.
        loaded
            .tokenizer
            .encode(&text, false)
            .context("tokenizing the prompt")?
    } else {
        loaded
            .tokenizer
            .encode(&args.prompt, true)
            .context("tokenizing the prompt")?
    };

    let request = Request {
        prompt: prompt_ids.clone(),
        n: args.n,
        params: SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            min_p: args.min_p,
        },
        seed: args.seed,
        stop: StopConditions {
            max_new_tokens: args.max_new_tokens,
            stop_token_ids: Vec::new(),
            stop_strings: args.stop.clone(),
            ignore_eos: args.ignore_eos,
        },
        logprobs: if args.sampling_logprobs {
            LogprobMode::Sampling
        } else {
            LogprobMode::Raw
        },
        top_logprobs: 0,
    };

    let adapter = match &args.adapter {
        Some(dir) => Some(
            cotrain_model::lora::LoraAdapter::load_peft(dir, &loaded.model).with_context(|| {
                format!(
                    "loading the adapter {} over `{}`",
                    dir.display(),
                    args.model
                )
            })?,
        ),
        None => None,
    };
    let mut engine = Engine::with_config(
        loaded,
        EngineConfig {
            decode_threads: args.decode_threads,
            ..EngineConfig::default()
        },
    );
    // The adapter is served unmerged, as `serve --adapters` serves an agent's.
    let adapter_id = match adapter {
        Some(a) => {
            engine.set_adapter(0, Some(a))?;
            Some(0)
        }
        None => None,
    };
    let start = Instant::now();
    let stream = !args.json && args.n == 1 && args.stop.is_empty();
    let samples = if stream {
        let handle = engine.add_with_adapter(request, adapter_id)?;
        let mut decoder = engine.tokenizer().incremental_decoder(true);
        let mut finished = Vec::new();
        let mut stdout = std::io::stdout().lock();
        while finished.is_empty() {
            let out = engine.step()?;
            for t in out.tokens.iter().filter(|t| t.request == handle) {
                let piece = decoder.push(engine.tokenizer(), t.token)?;
                write!(stdout, "{piece}")?;
            }
            stdout.flush()?;
            finished.extend(out.finished);
        }
        writeln!(stdout, "{}", decoder.finish(engine.tokenizer())?)?;
        finished
    } else {
        engine
            .generate_with_adapters(&[(request, adapter_id)])?
            .remove(0)
    };
    let secs = start.elapsed().as_secs_f64();
    let generated: usize = samples.iter().map(|s| s.token_ids.len()).sum();

    if args.json {
        let json = serde_json::json!({
            "device": format!("{:?}", opts.device).to_lowercase(),
            "generated_tokens": generated,
            "seconds": secs,
            "load_seconds": load_secs,
            "prompt_token_ids": prompt_ids,
            "samples": samples.iter().map(|s| serde_json::json!({
                "token_ids": s.token_ids,
                "text": s.text,
                "logprobs": s.logprobs,
                "finish_reason": s.finish_reason.as_str(),
            })).collect::<Vec<_>>(),
        });
        println!("{json}");
    } else if !stream {
        for (i, s) in samples.iter().enumerate() {
            if samples.len() > 1 {
                println!("--- sample {i} ({}) ---", s.finish_reason.as_str());
            }
            println!("{}", s.text);
        }
    }
    eprintln!(
        "[{} prompt tokens, {generated} generated in {secs:.2} s: {:.1} tokens/s; model loaded in {load_secs:.1} s]",
        prompt_ids.len(),
        generated as f64 / secs.max(1e-9),
    );
    Ok(())
}
