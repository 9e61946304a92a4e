//! Helpers for the workspace integration tests: building and locating the service binaries,
//! starting them on ephemeral loopback ports (each prints `listening grpc=ADDR http=ADDR` once bound,
//! so no test sleeps), and tiny model directories.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `target/<profile>/` of the running test binary (`target/<profile>/deps/test-hash`).
pub fn profile_dir() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let deps = exe.parent().context("test binary has no parent dir")?;
    Ok(deps
        .parent()
        .context("deps dir has no parent")?
        .to_path_buf())
}

/// Builds (once per test process) the service binaries in the test binary's profile, so the tests
/// always run the current sources, and returns the directory holding them. The tests crate cannot
/// name other packages' binaries with `CARGO_BIN_EXE_*`, so it asks cargo directly.
pub fn binaries() -> anyhow::Result<PathBuf> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let dir = profile_dir().map_err(|e| e.to_string())?;
            let release = dir.file_name().is_some_and(|n| n == "release");
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let mut cmd = Command::new(cargo);
            cmd.current_dir(workspace_root()).args([
                "build",
                // The same command `make test` runs before the tests, so that this one finds
                // everything fresh: a different package selection would unify features
                // differently and rebuild half the workspace in the middle of a test.
                "--workspace",
                "--bins",
            ]);
            if release {
                cmd.arg("--release");
            }
            if cfg!(feature = "cuda") {
                cmd.args(["--features", "cotrain-learner/cuda"]);
            }
            let status = cmd
                .status()
                .map_err(|e| format!("running cargo build: {e}"))?;
            if !status.success() {
                return Err(format!(
                    "cargo build of the service binaries failed: {status}"
                ));
            }
            Ok(dir)
        })
        .clone()
        .map_err(anyhow::Error::msg)
}

/// A service process, killed when dropped.
pub struct Service {
    pub child: Child,
    pub grpc: String,
    pub http: String,
    pub name: String,
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `binary args...` and waits (up to `timeout`) for its `listening grpc=ADDR http=ADDR` line.
pub fn start_service(binary: &str, args: &[String], timeout: Duration) -> anyhow::Result<Service> {
    let path = binaries()?.join(binary);
    let mut child = Command::new(&path)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("starting {}", path.display()))?;
    let stdout = child.stdout.take().context("no stdout")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Some(rest) = line.strip_prefix("listening ") {
                let mut grpc = String::new();
                let mut http = String::new();
                for part in rest.split_whitespace() {
                    if let Some(a) = part.strip_prefix("grpc=") {
                        grpc = a.to_string();
                    } else if let Some(a) = part.strip_prefix("http=") {
                        http = a.to_string();
                    }
                }
                let _ = tx.send((grpc, http));
            }
        }
    });
    let start = Instant::now();
    loop {
        if let Ok((grpc, http)) = rx.recv_timeout(Duration::from_millis(200)) {
            return Ok(Service {
                child,
                grpc,
                http,
                name: binary.to_string(),
            });
        }
        if let Some(status) = child.try_wait()? {
            bail!("{binary} exited before listening: {status}");
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            bail!("{binary} did not report its ports within {timeout:?}");
        }
    }
}

/// GPT-2's byte ↔ printable-character table (the ByteLevel pre-tokenizer's alphabet).
fn byte_chars() -> Vec<char> {
    let printable = |b: u32| {
        (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
    };
    let mut extra = 0;
    (0..256u32)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).expect("valid char")
            } else {
                extra += 1;
                char::from_u32(255 + extra).expect("valid char")
            }
        })
        .collect()
}

/// A byte-level BPE tokenizer with exactly 256 tokens (one per byte, no merges).
pub fn byte_tokenizer_json() -> String {
    let vocab: serde_json::Map<String, serde_json::Value> = byte_chars()
        .into_iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), serde_json::json!(i)))
        .collect();
    serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": []}
    })
    .to_string()
}

/// The committed tiny Llama (2 layers, hidden 64, vocab 256) copied into `dir/tiny-llama` with a
/// byte-level tokenizer and a context long enough for real dataset prompts (one token per byte).
pub fn tiny_model_dir(dir: &Path) -> anyhow::Result<PathBuf> {
    let src = workspace_root().join("model/tests/fixtures/tiny/llama");
    let out = dir.join("tiny-llama");
    std::fs::create_dir_all(&out)?;
    for f in ["model.safetensors", "generation_config.json"] {
        std::fs::copy(src.join(f), out.join(f))?;
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json"))?)?;
    config["max_position_embeddings"] = serde_json::json!(4096);
    std::fs::write(
        out.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    std::fs::write(out.join("tokenizer.json"), byte_tokenizer_json())?;
    Ok(out)
}

/// The tiny Llama with a word-level tokenizer: id i ≥ 3 decodes to the word `w{i}` followed by
/// i mod 60 `x`s, so that a random model's completions are words of very different lengths. The
/// writing rewards (TLDR: at least 8 words per agent, then the ratio of the agents' lengths) then
/// vary between samples, which gives the trainer non-zero advantages to learn from. Prompt words
/// outside the vocabulary read as `[UNK]`.
pub fn tiny_word_model_dir(dir: &Path) -> anyhow::Result<PathBuf> {
    let src = workspace_root().join("model/tests/fixtures/tiny/llama");
    let out = dir.join("tiny-llama-words");
    std::fs::create_dir_all(&out)?;
    for f in ["model.safetensors", "generation_config.json", "config.json"] {
        std::fs::copy(src.join(f), out.join(f))?;
    }
    let mut vocab = serde_json::Map::new();
    for (i, special) in ["[UNK]", "<s>", "</s>"].iter().enumerate() {
        vocab.insert(special.to_string(), serde_json::json!(i));
    }
    for i in 3..256usize {
        vocab.insert(format!("w{i}{}", "x".repeat(i % 60)), serde_json::json!(i));
    }
    let added: Vec<serde_json::Value> = ["[UNK]", "<s>", "</s>"]
        .iter()
        .enumerate()
        .map(|(id, content)| {
            serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
                               "normalized": false, "special": true})
        })
        .collect();
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added, "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    });
    std::fs::write(out.join("tokenizer.json"), tokenizer.to_string())?;
    Ok(out)
}

/// A process whose stdout and stderr lines arrive on a channel and are kept, killed when dropped;
/// for tests that watch a process's output while it runs.
pub struct Proc {
    pub child: Child,
    lines: std::sync::mpsc::Receiver<String>,
    /// Every line read so far, stdout and stderr interleaved as they came.
    pub seen: Vec<String>,
    /// The program, and the last [`TAIL_LINES`] lines it wrote (read or not): printed when a test
    /// fails while the process is still held, so that the failure shows what the process said.
    program: String,
    tail: std::sync::Arc<std::sync::Mutex<std::collections::VecDeque<String>>>,
}

/// How many of a [`Proc`]'s last lines a failing test prints.
const TAIL_LINES: usize = 60;

impl Proc {
    pub fn spawn(cmd: &mut Command) -> Self {
        let program = cmd
            .get_program()
            .to_string_lossy()
            .rsplit('/')
            .next()
            .unwrap_or_default()
            .to_string();
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn");
        let (tx, lines) = std::sync::mpsc::channel();
        let tail = std::sync::Arc::new(std::sync::Mutex::new(std::collections::VecDeque::new()));
        let out: Box<dyn std::io::Read + Send> =
            Box::new(child.stdout.take().expect("piped stdout"));
        let err: Box<dyn std::io::Read + Send> =
            Box::new(child.stderr.take().expect("piped stderr"));
        for stream in [out, err] {
            let (tx, tail) = (tx.clone(), tail.clone());
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    if let Ok(mut t) = tail.lock() {
                        if t.len() == TAIL_LINES {
                            t.pop_front();
                        }
                        t.push_back(line.clone());
                    }
                    let _ = tx.send(line);
                }
            });
        }
        Self {
            child,
            lines,
            seen: Vec::new(),
            program,
            tail,
        }
    }

    /// Waits for a line starting with `prefix`; returns the rest of it.
    pub fn wait_line(&mut self, prefix: &str, timeout: Duration) -> String {
        let line = self.wait_for(prefix, timeout, |l| l.starts_with(prefix));
        line[prefix.len()..].to_string()
    }

    /// Waits for a line containing `needle` (a log message, after its timestamp and level);
    /// returns the line.
    pub fn wait_containing(&mut self, needle: &str, timeout: Duration) -> String {
        self.wait_for(needle, timeout, |l| l.contains(needle))
    }

    fn wait_for(
        &mut self,
        prefix: &str,
        timeout: Duration,
        matches: impl Fn(&str) -> bool,
    ) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(l) = self.seen.iter().find(|l| matches(l)) {
                return l.clone();
            }
            match self.lines.recv_timeout(Duration::from_millis(200)) {
                Ok(l) => self.seen.push(l),
                Err(_) if Instant::now() >= deadline => {
                    panic!("no `{prefix}` line within {timeout:?}; saw {:?}", self.seen)
                }
                Err(_) => assert!(
                    self.child.try_wait().unwrap().is_none(),
                    "exited before `{prefix}`; saw {:?}",
                    self.seen
                ),
            }
        }
    }

    /// Reads what is waiting (until 200 ms pass without a line).
    pub fn drain(&mut self) {
        while let Ok(l) = self.lines.recv_timeout(Duration::from_millis(200)) {
            self.seen.push(l);
        }
    }

    /// Waits for the exit, then reads what is left of its output.
    pub fn wait_exit(&mut self, timeout: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                self.drain();
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "process still running after {timeout:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Sends a signal (`-9`, `-TERM`, `-STOP`) with `kill`.
    pub fn signal(&self, sig: &str) {
        assert!(
            Command::new("kill")
                .args([sig, &self.child.id().to_string()])
                .status()
                .unwrap()
                .success()
        );
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let exited = self
                .child
                .try_wait()
                .ok()
                .flatten()
                .map_or("still running".to_string(), |s| format!("exited: {s}"));
            eprintln!(
                "--- the last lines of `{}` (pid {}, {exited}) ---",
                self.program,
                self.child.id()
            );
            if let Ok(t) = self.tail.lock() {
                for l in t.iter() {
                    eprintln!("{l}");
                }
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
