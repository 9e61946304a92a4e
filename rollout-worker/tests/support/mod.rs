//! Test support: tiny model directories with a byte-level tokenizer and a chat template, and
//! rollout-worker processes started from the real binary on ephemeral ports.

#![allow(dead_code)]

use std::io::BufRead;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cotrain_proto::rollout::rollout_client::RolloutClient;
use cotrain_proto::rollout::{
    GenerateRequest, InfoRequest, InfoResponse, Prompt, SamplingParams, StopConditions, TokenIds,
    prompt,
};
use serde_json::json;
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

/// GPT-2's byte → printable character table, so 256 byte tokens make a byte-level BPE vocabulary.
fn byte_chars() -> Vec<char> {
    let mut bs: Vec<u32> = ('!' as u32..='~' as u32)
        .chain('¡' as u32..='¬' as u32)
        .chain('®' as u32..='ÿ' as u32)
        .collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut table = vec![' '; 256];
    for (b, c) in bs.into_iter().zip(cs) {
        table[b as usize] = char::from_u32(c).expect("valid char");
    }
    table
}

/// A model directory in a temp dir: one of the model crate's tiny checkpoints (vocab 256) plus a
/// byte-level tokenizer (token id = byte) and a small chat template.
pub struct TinyModel {
    pub dir: tempfile::TempDir,
}

impl TinyModel {
    pub fn new(fixture: &str) -> Self {
        let src = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../model/tests/fixtures/tiny")
            .join(fixture);
        let dir = tempfile::tempdir().expect("temp dir");
        for f in ["config.json", "generation_config.json", "model.safetensors"] {
            std::fs::copy(src.join(f), dir.path().join(f))
                .unwrap_or_else(|e| panic!("copying {f}: {e}"));
        }
        let vocab: serde_json::Map<String, serde_json::Value> = byte_chars()
            .into_iter()
            .enumerate()
            .map(|(i, c)| (c.to_string(), json!(i)))
            .collect();
        let tokenizer = json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": vocab, "merges": []}
        });
        std::fs::write(dir.path().join("tokenizer.json"), tokenizer.to_string())
            .expect("write tokenizer");
        std::fs::write(
            dir.path().join("chat_template.jinja"),
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
        )
        .expect("write template");
        Self { dir }
    }

    /// A small random model vLLM's CPU attention can run (its kernels need a head size of 32 or
    /// more; the committed fixtures have 16): `family` (llama or qwen2) with 2 layers, hidden 128,
    /// two heads of 64, one KV head, vocab 256, weights drawn from `seed`, the fixtures' byte-level
    /// tokenizer and chat template, and the tokenizer_config.json transformers wants.
    pub fn vllm_sized(family: &str, seed: i64) -> Self {
        let m = Self::new(family);
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(m.path().join("config.json")).unwrap())
                .unwrap();
        for (k, v) in [
            ("hidden_size", 128),
            ("intermediate_size", 256),
            ("num_attention_heads", 2),
            ("num_key_value_heads", 1),
            ("head_dim", 64),
        ] {
            config[k] = json!(v);
        }
        std::fs::write(m.path().join("config.json"), config.to_string()).unwrap();
        tch::manual_seed(seed);
        let (h, f, v, kv) = (128i64, 256i64, 256i64, 64i64);
        let w =
            |shape: &[i64]| tch::Tensor::randn(shape, (tch::Kind::Float, tch::Device::Cpu)) * 0.1;
        let mut tensors = vec![
            ("model.embed_tokens.weight".to_string(), w(&[v, h])),
            ("model.norm.weight".to_string(), w(&[h]) + 1.0),
            ("lm_head.weight".to_string(), w(&[v, h])),
        ];
        for l in 0..2 {
            let p = format!("model.layers.{l}");
            for (name, shape) in [
                ("self_attn.q_proj.weight", vec![h, h]),
                ("self_attn.k_proj.weight", vec![kv, h]),
                ("self_attn.v_proj.weight", vec![kv, h]),
                ("self_attn.o_proj.weight", vec![h, h]),
                ("mlp.gate_proj.weight", vec![f, h]),
                ("mlp.up_proj.weight", vec![f, h]),
                ("mlp.down_proj.weight", vec![h, f]),
            ] {
                tensors.push((format!("{p}.{name}"), w(&shape)));
            }
            tensors.push((format!("{p}.input_layernorm.weight"), w(&[h]) + 1.0));
            tensors.push((
                format!("{p}.post_attention_layernorm.weight"),
                w(&[h]) + 1.0,
            ));
            if family == "qwen2" {
                for (name, n) in [("q_proj", h), ("k_proj", kv), ("v_proj", kv)] {
                    tensors.push((format!("{p}.self_attn.{name}.bias"), w(&[n])));
                }
            }
        }
        tch::Tensor::write_safetensors(&tensors, m.path().join("model.safetensors")).unwrap();
        std::fs::write(
            m.path().join("tokenizer_config.json"),
            r#"{"tokenizer_class": "PreTrainedTokenizerFast"}"#,
        )
        .unwrap();
        m
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn spec(&self) -> String {
        self.dir.path().display().to_string()
    }
}

/// A `rollout-worker serve` process; killed when dropped.
pub struct WorkerProcess {
    pub child: Child,
    pub grpc: SocketAddr,
    pub http: SocketAddr,
    _stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl WorkerProcess {
    /// Starts the binary with `--agent NAME=MODEL` for each pair plus `extra` flags, reads the
    /// `listening` line and waits until the health check says serving.
    pub async fn start(agents: &[(&str, &str)], extra: &[&str]) -> Self {
        Self::start_on("127.0.0.1:0", agents, extra).await
    }

    /// As [`Self::start`], with the gRPC listener on `grpc_addr` (a restarted worker takes its old port).
    pub async fn start_on(grpc_addr: &str, agents: &[(&str, &str)], extra: &[&str]) -> Self {
        Self::start_under(&[], grpc_addr, agents, extra).await
    }

    /// As [`Self::start_on`], run under `prefix` (e.g. `ip netns exec NS`).
    pub async fn start_under(
        prefix: &[&str],
        grpc_addr: &str,
        agents: &[(&str, &str)],
        extra: &[&str],
    ) -> Self {
        let mut cmd = match prefix.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(env!("CARGO_BIN_EXE_rollout-worker"));
                c
            }
            None => Command::new(env!("CARGO_BIN_EXE_rollout-worker")),
        };
        let http_addr = if grpc_addr.starts_with('[') {
            "[::1]:0"
        } else {
            "127.0.0.1:0"
        };
        cmd.args([
            "serve",
            "--grpc-addr",
            grpc_addr,
            "--http-addr",
            http_addr,
            "--threads",
            "1",
        ]);
        for (name, model) in agents {
            cmd.arg("--agent").arg(format!("{name}={model}"));
        }
        cmd.args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .env("RUST_LOG", "warn");
        let mut child = cmd.spawn().expect("spawn rollout-worker");
        let stdout = child.stdout.take().expect("piped stdout");
        let (line, stdout) = tokio::task::spawn_blocking(move || {
            let mut r = std::io::BufReader::new(stdout);
            let mut line = String::new();
            r.read_line(&mut line).expect("read stdout");
            (line, r)
        })
        .await
        .expect("reader thread");
        let addr = |key: &str| -> SocketAddr {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(key))
                .unwrap_or_else(|| panic!("no {key} in `{line}`"))
                .parse()
                .expect("socket address")
        };
        let (grpc, http) = (addr("grpc="), addr("http="));
        let p = Self {
            child,
            grpc,
            http,
            _stdout: stdout,
        };
        wait_healthy(p.grpc, Duration::from_secs(120)).await;
        p
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.grpc)
    }

    pub async fn client(&self) -> RolloutClient<Channel> {
        RolloutClient::connect(self.endpoint())
            .await
            .expect("connect")
            .max_decoding_message_size(usize::MAX)
    }

    pub async fn info(&self) -> InfoResponse {
        self.client()
            .await
            .info(InfoRequest {})
            .await
            .expect("info")
            .into_inner()
    }

    /// SIGKILL, as a crashed or preempted worker.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM and wait for the exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success());
        self.child.wait().expect("wait")
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until the gRPC health check at `addr` reports SERVING.
pub async fn wait_healthy(addr: SocketAddr, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(channel) = Channel::from_shared(format!("http://{addr}"))
            .expect("uri")
            .connect()
            .await
        {
            let mut h = HealthClient::new(channel);
            if let Ok(r) = h
                .check(HealthCheckRequest {
                    service: String::new(),
                })
                .await
                && r.get_ref().status == 1
            {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "worker at {addr} not healthy after {timeout:?}"
        );
        // Retry delay between failed health checks (the server is still starting).
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Polls `Info` until `cond` holds (condition wait with a deadline).
pub async fn wait_info(
    client: &mut RolloutClient<Channel>,
    timeout: Duration,
    cond: impl Fn(&InfoResponse) -> bool,
) -> InfoResponse {
    let deadline = Instant::now() + timeout;
    loop {
        let info = client
            .info(InfoRequest {})
            .await
            .expect("info")
            .into_inner();
        if cond(&info) {
            return info;
        }
        assert!(
            Instant::now() < deadline,
            "condition not reached within {timeout:?}: {info:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

pub fn token_prompt(ids: Vec<u32>) -> Prompt {
    Prompt {
        kind: Some(prompt::Kind::TokenIds(TokenIds { ids })),
    }
}

pub fn text_prompt(text: &str) -> Prompt {
    Prompt {
        kind: Some(prompt::Kind::Text(text.into())),
    }
}

/// A request for `agent` sampling `max_new_tokens` at temperature 1 past EOS.
pub fn request(
    agent: &str,
    prompts: Vec<Prompt>,
    n: u32,
    seed: u64,
    max_new_tokens: u32,
) -> GenerateRequest {
    GenerateRequest {
        agent: agent.into(),
        prompts,
        n,
        sampling: Some(SamplingParams {
            temperature: Some(1.0),
            top_p: Some(1.0),
            top_k: 0,
            max_new_tokens,
            min_p: None,
            sampling_logprobs: false,
        }),
        seed,
        stop: Some(StopConditions {
            stop_strings: vec![],
            stop_token_ids: vec![],
            ignore_eos: true,
        }),
        min_policy_version: None,
        request_id: format!("seed-{seed}"),
    }
}

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Deterministic pseudo-random f32 bytes in [-0.25, 0.25) for weight updates.
pub fn random_f32_bytes(numel: usize, seed: u32) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..numel)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            ((x as f32 / u32::MAX as f32 - 0.5) * 0.5).to_le_bytes()
        })
        .collect()
}

/// A partial update replacing `agent`'s `lm_head.weight` with random values, deterministic in `seed`.
pub async fn lm_head_update(
    c: &mut RolloutClient<Channel>,
    agent: &str,
    seed: u32,
) -> std::sync::Arc<Vec<cotrain_rollout_client::wire::UpdatedTensor>> {
    let params = c
        .list_parameters(cotrain_proto::rollout::ListParametersRequest {
            agent: agent.into(),
        })
        .await
        .unwrap()
        .into_inner();
    let p = params
        .parameters
        .iter()
        .find(|p| p.name == "lm_head.weight")
        .expect("lm_head.weight");
    let numel: i64 = p.shape.iter().product();
    std::sync::Arc::new(vec![cotrain_rollout_client::wire::UpdatedTensor {
        name: p.name.clone(),
        dtype: cotrain_rollout_client::wire::WireDType::F32,
        shape: p.shape.clone(),
        data: random_f32_bytes(numel as usize, seed),
    }])
}
