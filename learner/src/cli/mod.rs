//! The `learner` command line: argument types (clap derive) and the dispatch ([`run`]); the longer
//! commands are in [`commands`]. Both are library code so that tests can call them without spawning
//! the binary.

use std::path::PathBuf;

use anyhow::bail;
use clap::{Args, Parser, Subcommand};

use crate::config::{CheckedConfig, LegacyFlags, load_config};

mod commands;

use commands::{compare_command, export_command, plot_command, verifier_command};
pub use commands::{show_prompts, show_turn_prompts};

/// Trains cooperating LLM agents with GRPO / MAGRPO.
#[derive(Debug, Parser)]
#[command(name = "learner", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// A file holding the cluster token, sent with every weight update (rollout workers started with
    /// a token refuse updates without it; the embedded worker then requires it too).
    #[arg(long, global = true, env = cotrain_proto::auth::TOKEN_FILE_ENV, value_name = "PATH")]
    pub cluster_token_file: Option<PathBuf>,
    /// Allow the control plane (`learner.control_addr`) on a non-loopback address without a cluster
    /// token: anyone who reaches it could then register workers or stop the run.
    #[arg(long, global = true)]
    pub insecure: bool,
    /// Serve the control plane (`learner.control_addr`) over TLS with this PEM certificate chain.
    #[arg(long, global = true, value_name = "PATH", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, global = true, value_name = "PATH", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Dial remote rollout workers, the reward server and control planes over TLS, trusting these
    /// PEM certificates (default: COTRAIN_TLS_CA).
    #[arg(long, global = true, value_name = "PATH")]
    pub tls_ca: Option<PathBuf>,
    /// The name the services' certificates are checked against (default: COTRAIN_TLS_DOMAIN, else
    /// the host dialled).
    #[arg(long, global = true, value_name = "NAME")]
    pub tls_domain: Option<String>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Train from a config.
    Train {
        #[command(flatten)]
        config: ConfigArgs,
        /// Continue the run in this directory from its latest checkpoint; `auto`: the config's run
        /// (`output.base_dir/<logging.run_name>`) from its newest checkpoint if it has one, started
        /// if not, nothing if it finished (for supervisors that restart the learner blindly).
        #[arg(long, value_name = "RUN_DIR|auto")]
        resume: Option<PathBuf>,
    },
    /// Start N learner ranks on this machine and stop them all if one fails (as torchrun does):
    /// `learner launch --nproc-per-node 2 -- train --config FILE [...]`. The ranks split every
    /// step's items and average their gradients (see the book's "Learner ranks" page,
    /// docs/src/deployment/ranks.md).
    Launch {
        /// Ranks to start on this machine.
        #[arg(long)]
        nproc_per_node: usize,
        /// The collective library: mpi (CPU; ranks started through Open MPI's mpirun), nccl (CUDA;
        /// ranks started here with torchrun's environment), or auto (nccl when CUDA is available).
        #[arg(long, default_value = "auto", value_parser = ["auto", "mpi", "nccl"])]
        backend: String,
        /// MASTER_PORT for the nccl backend's rendezvous (default: a free port).
        #[arg(long)]
        master_port: Option<u16>,
        /// For tests on a one-GPU machine only: NCCL refuses two ranks on one GPU ("Duplicate GPU
        /// detected"), so give each rank its own NCCL_HOSTID and make NCCL talk over sockets on
        /// loopback (no P2P, no shared memory, no InfiniBand), as if the ranks were two hosts.
        /// Slow; never for training. Implies --backend nccl.
        #[arg(long)]
        nccl_one_gpu_test: bool,
        /// The network interface the ranks talk over (Open MPI's btl/oob_tcp_if_include, NCCL's
        /// NCCL_SOCKET_IFNAME). Unset: Open MPI leaves out the bridges present (docker0, virbr*, cni*).
        #[arg(long, value_name = "IF")]
        network_interface: Option<String>,
        /// The learner command each rank runs (`train --config FILE ...`), after `--`.
        #[arg(last = true, required = true)]
        args: Vec<String>,
    },
    /// Evaluate a checkpoint on the config's eval split.
    Eval {
        #[command(flatten)]
        config: ConfigArgs,
        /// Checkpoint directory to evaluate. For a MaPoRL config: a run directory (its final
        /// policies, else its latest checkpoint), its `adapters/` or `final_model/`, or a
        /// `checkpoints/step-N/`, evaluated as the run evaluates (accuracy per turn; `--k` does not apply).
        #[arg(long)]
        checkpoint: PathBuf,
        /// The k of PassOrNot@k, Accuracy@k and MaxCoop@k; the largest k joint samples are drawn per item.
        #[arg(long, value_delimiter = ',', default_value = "1,5,10")]
        k: Vec<usize>,
    },
    /// Draw reward, loss and throughput curves of a run directory to PNG files in it.
    /// With several run directories: one chart of `--key` for all of them (`--out`).
    Plot {
        /// The run directory (holding metrics.jsonl), or several to compare.
        #[arg(required = true)]
        run_dirs: Vec<PathBuf>,
        /// Comparing runs: the metric to draw, against the step.
        #[arg(long, default_value = "reward/mean")]
        key: String,
        /// Comparing runs: the PNG to write.
        #[arg(long, default_value = "compare.png")]
        out: PathBuf,
    },
    /// Write a checkpoint's policies as Hugging Face model directories (for transformers, vLLM or
    /// `rollout-worker generate --model DIR`), or PEFT adapter directories for LoRA policies.
    Export {
        /// Checkpoint directory (`RUN_DIR/checkpoints/step-N`), or a run directory for its latest
        /// checkpoint.
        #[arg(long)]
        checkpoint: PathBuf,
        /// Export only this policy (0-based); its model directory is then `--out` itself.
        #[arg(long)]
        policy: Option<usize>,
        /// Where to write: one model directory per policy under it (`agent-{i}`, or `shared` for
        /// shared parameters), or with `--policy` the model directory itself. MaPoRL runs: one
        /// directory per adapter key (PEFT's layout, or a model with `full_finetune`).
        #[arg(long)]
        out: PathBuf,
        /// LoRA policies (`model.lora`, MaPoRL): also write each adapter merged into its base as a
        /// Hugging Face model directory (`<dir>-merged`).
        #[arg(long)]
        merged: bool,
    },
    /// MaPoRL's learned verifier: sample and label its data, balance it, train it.
    #[command(subcommand)]
    Verifier(VerifierCommand),
    /// Print how a running learner is going (its `learner.control_addr`): step, epoch, reward, ETA,
    /// and every rollout worker with its policy versions and load.
    Status {
        /// The learner's control address, HOST:PORT.
        #[arg(long)]
        addr: String,
        /// Print the status as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Ask a running learner (its `learner.control_addr`) to write a checkpoint now, or to stop
    /// gracefully (a checkpoint, then exit; as SIGTERM does).
    Control {
        #[arg(value_enum)]
        action: ControlAction,
        /// The learner's control address, HOST:PORT.
        #[arg(long)]
        addr: String,
    },
    /// Print the merged, validated config.
    CheckConfig {
        #[command(flatten)]
        config: ConfigArgs,
    },
    /// Print the `--agent NAME=MODEL` arguments (one per line) a standalone `rollout-worker serve`
    /// needs to serve this config's policies, each with weights of its own; deploy scripts pass them
    /// on together with `--separate-weights`. With `rollout.lora_serving: unmerged`, also one
    /// `--adapters A,B` per base for its LoRA agents.
    WorkerArgs {
        #[command(flatten)]
        config: ConfigArgs,
    },
    /// Print, as one JSON line per item and agent, the exact prompt text each agent's model receives
    /// and its token count: `{"item_index", "agent", "text", "tokens"}`.
    ShowPrompts {
        #[command(flatten)]
        config: ConfigArgs,
        /// Which split's items.
        #[arg(long, value_enum, default_value_t = PromptSplit::Train)]
        split: PromptSplit,
        /// Only the first N items.
        #[arg(long)]
        limit: Option<usize>,
        /// Which turn's prompts (multi-turn configs): turns after the first are built by the
        /// trainer's own code from placeholder responses and placeholder diagnostics, each marked
        /// `<agent N turn T response>` / `<placeholder: ...>`.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
        turn: u64,
    },
}

/// `learner control ACTION`.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum ControlAction {
    /// Write a checkpoint at the end of the current step (returns once it is on disk).
    Checkpoint,
    /// Write a checkpoint at the end of the current step and exit.
    Stop,
}

/// `learner verifier ...`.
#[derive(Debug, Subcommand)]
pub enum VerifierCommand {
    /// Sample answers to every question of the config's train split through the rollout workers
    /// (`verifier.samples_per_question` each, temperature from U(temperature_min, temperature_max),
    /// top-p `verifier.top_p`) and label them with the reward server; resumes a partial file.
    Generate {
        #[command(flatten)]
        config: ConfigArgs,
        /// The data file to write (or to resume).
        #[arg(long)]
        out: PathBuf,
    },
    /// Give every question the same number of correct and incorrect answers (MaPoRL: 10 each);
    /// questions short of one kind are dropped (or kept with `--keep-short`). Prints what happened
    /// to each question and in total.
    Balance {
        /// MaPoRL's data file (question → original_answer, generated_answers, rewards).
        #[arg(long = "in")]
        input: PathBuf,
        #[arg(long)]
        out: PathBuf,
        /// Answers of each kind per question.
        #[arg(long, default_value_t = 10)]
        per_type: usize,
        /// Keep questions short of one kind with what they have instead of dropping them.
        #[arg(long)]
        keep_short: bool,
        /// Fill short questions first: the dataset's reference solution, rewrites of correct
        /// answers and plausible wrong answers, sampled through the rollout workers this config
        /// names (or embedded ones) and labelled by the reward server. The questions must come from
        /// the config's train split.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Overrides of `--config`.
        #[arg(long = "override", value_name = "KEY=VALUE", num_args = 1.., action = clap::ArgAction::Append, requires = "config")]
        overrides: Vec<String>,
        /// Sampling rounds when filling.
        #[arg(long, default_value_t = 3, requires = "config")]
        fill_rounds: usize,
    },
    /// Train a verifier (`model.name` with the `verifier` section's settings) on a data file and
    /// write the directory `rollout-worker serve --verifier NAME=DIR` loads.
    Train {
        #[command(flatten)]
        config: ConfigArgs,
        /// The (balanced) data file.
        #[arg(long)]
        data: PathBuf,
        /// The verifier directory to write (with metrics.jsonl and plots/).
        #[arg(long)]
        out: PathBuf,
    },
}

/// The split `show-prompts` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PromptSplit {
    Train,
    Eval,
}

/// The config file, overrides and the original scripts' legacy flags.
#[derive(Debug, Clone, Args)]
pub struct ConfigArgs {
    /// YAML config file.
    #[arg(long)]
    pub config: PathBuf,
    /// Deep-merged `key.path=value` pairs (values typed as YAML; Python's `None`/`True`/`False` too),
    /// e.g. `--override magrpo.learning_rate=1e-5 magrpo.num_train_epochs=2`; the flag may repeat.
    #[arg(long = "override", value_name = "KEY=VALUE", num_args = 1.., action = clap::ArgAction::Append)]
    pub overrides: Vec<String>,
    /// Legacy: sets `model.name`.
    #[arg(long = "model_name", alias = "model-name")]
    pub model_name: Option<String>,
    /// Legacy: sets the trainer section's `num_train_epochs`.
    #[arg(long = "num_epochs", alias = "num-epochs")]
    pub num_epochs: Option<usize>,
    /// Legacy: sets the trainer section's `num_turns`.
    #[arg(long = "num_turns", alias = "num-turns")]
    pub num_turns: Option<usize>,
    /// Legacy: sets the trainer section's `turn_gradient_weights` (one value per turn).
    #[arg(long = "turn_gradient_weights", alias = "turn-gradient-weights", num_args = 1.., allow_negative_numbers = true)]
    pub turn_gradient_weights: Option<Vec<f64>>,
    /// Legacy: sets `output.base_dir`.
    #[arg(long = "output_base_dir", alias = "output-base-dir")]
    pub output_base_dir: Option<PathBuf>,
}

impl ConfigArgs {
    pub fn legacy(&self) -> LegacyFlags {
        LegacyFlags {
            model_name: self.model_name.clone(),
            num_epochs: self.num_epochs,
            num_turns: self.num_turns,
            turn_gradient_weights: self.turn_gradient_weights.clone(),
            output_base_dir: self
                .output_base_dir
                .as_ref()
                .map(|p| p.display().to_string()),
        }
    }

    /// Loads and validates the config these arguments describe.
    pub fn load(&self) -> anyhow::Result<CheckedConfig> {
        Ok(load_config(&self.config, &self.overrides, &self.legacy())?)
    }
}

/// Refuses configs the single-turn trainer cannot run, naming what is missing.
pub fn ensure_trainable(cfg: &CheckedConfig) -> anyhow::Result<()> {
    Ok(crate::trainer::check_supported(cfg)?)
}

/// Runs one parsed command.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    let token =
        cotrain_proto::auth::ClusterToken::from_flag_or_env(cli.cluster_token_file.as_deref())
            .map_err(anyhow::Error::msg)?;
    crate::services::set_cluster_token(token.clone());
    crate::services::set_insecure(cli.insecure);
    let server_tls =
        cotrain_proto::tls::ServerTls::from_flags(cli.tls_cert.as_deref(), cli.tls_key.as_deref())
            .map_err(anyhow::Error::msg)?;
    let client_tls = cotrain_proto::tls::ClientTls::from_flag_or_env(
        cli.tls_ca.as_deref(),
        cli.tls_domain.as_deref(),
    )
    .map_err(anyhow::Error::msg)?;
    crate::services::set_tls(server_tls, client_tls.clone());
    match cli.command {
        Command::Status { addr, json } => {
            let status = crate::control::client::call(
                &addr,
                token.as_ref(),
                client_tls.as_ref(),
                crate::control::client::Call::Status,
            )?
            .map_err(anyhow::Error::msg)?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&crate::control::server::status_json(&status))?
                );
            } else {
                print!("{}", crate::control::client::format_status(&status));
            }
            Ok(())
        }
        Command::Control { action, addr } => {
            let call = match action {
                ControlAction::Checkpoint => crate::control::client::Call::Checkpoint,
                ControlAction::Stop => crate::control::client::Call::Stop,
            };
            if let Err(message) =
                crate::control::client::call(&addr, token.as_ref(), client_tls.as_ref(), call)?
            {
                println!("{message}");
            }
            Ok(())
        }
        Command::CheckConfig { config } => {
            let cfg = config.load()?;
            print!("{}", cfg.to_yaml());
            Ok(())
        }
        Command::WorkerArgs { config } => {
            let cfg = config.load()?;
            for (agent, spec) in crate::model_options::worker_agents(&cfg) {
                println!("--agent");
                println!("{agent}={spec}");
            }
            // `rollout.lora_serving: unmerged`: the LoRA agents of each base as one adapter group.
            if cfg.raw.rollout.lora_serving == crate::config::LoraServing::Unmerged {
                for group in crate::model_options::adapter_groups(&cfg) {
                    println!("--adapters");
                    println!("{}", group.join(","));
                }
            }
            Ok(())
        }
        Command::Train { config, resume } => {
            let cfg = config.load()?;
            ensure_trainable(&cfg)?;
            let resume = match resume {
                Some(dir) if dir.as_os_str() == "auto" => {
                    match crate::run_state::auto_resume(&cfg)? {
                        crate::run_state::AutoResume::Finished(dir) => {
                            println!("run {} already finished; nothing to do", dir.display());
                            return Ok(());
                        }
                        crate::run_state::AutoResume::Resume(dir) => Some(dir),
                        crate::run_state::AutoResume::Start => None,
                    }
                }
                other => other,
            };
            if let Some(dir) = &resume
                && !dir.is_dir()
            {
                bail!("--resume {}: no such run directory", dir.display());
            }
            // SIGTERM/SIGINT and the control plane (`learner.control_addr`) stop the run after a checkpoint.
            let control = crate::control::install();
            crate::control::handle_signals(control)?;
            let summary = crate::trainers::train(&cfg, resume.as_deref())?;
            if crate::dist::RankEnv::from_env().is_ok_and(|r| r.rank != 0) {
                // Rank 0 reports the run.
                return Ok(());
            }
            if summary.stopped {
                println!(
                    "stopped on request after step {}; continue with --resume {}",
                    summary.steps,
                    summary.run_dir.display()
                );
            }
            println!("run directory: {}", summary.run_dir.display());
            println!("metrics: {}", summary.metrics_path.display());
            if let Some(c) = &summary.checkpoint {
                println!("checkpoint: {}", c.display());
            }
            for m in &summary.final_models {
                println!("final model: {}", m.display());
            }
            for p in &summary.plots {
                println!("plot: {}", p.display());
            }
            Ok(())
        }
        Command::Eval {
            config,
            checkpoint,
            k,
        } => {
            if k.contains(&0) {
                bail!("--k: every k must be at least 1, got {k:?}");
            }
            let cfg = config.load()?;
            if !checkpoint.is_dir() {
                bail!(
                    "--checkpoint {}: no such checkpoint directory",
                    checkpoint.display()
                );
            }
            ensure_trainable(&cfg)?;
            let metrics = crate::trainers::evaluate(&cfg, &checkpoint, &k)?;
            println!("{}", serde_json::to_string_pretty(&metrics)?);
            Ok(())
        }
        Command::Plot { run_dirs, key, out } => match run_dirs.as_slice() {
            [one] => plot_command(one),
            many => compare_command(many, &key, &out),
        },
        Command::Launch {
            nproc_per_node,
            backend,
            master_port,
            nccl_one_gpu_test,
            network_interface,
            args,
        } => {
            let backend = match backend.as_str() {
                "mpi" if nccl_one_gpu_test => {
                    anyhow::bail!("--nccl-one-gpu-test runs NCCL ranks: drop --backend mpi")
                }
                _ if nccl_one_gpu_test => crate::config::DistBackend::Nccl,
                "mpi" => crate::config::DistBackend::Mpi,
                "nccl" => crate::config::DistBackend::Nccl,
                _ => crate::config::DistBackend::Auto,
            };
            let token_file = cli.cluster_token_file.clone();
            let mut global_flags = Vec::new();
            if cli.insecure {
                global_flags.push("--insecure".to_string());
            }
            for (flag, path) in [("--tls-cert", &cli.tls_cert), ("--tls-key", &cli.tls_key)] {
                if let Some(p) = path {
                    global_flags.extend([flag.to_string(), p.display().to_string()]);
                }
            }
            crate::dist::launch::launch(&crate::dist::launch::LaunchSpec {
                global_flags,
                nproc: nproc_per_node,
                backend,
                master_port,
                args,
                token_file,
                nccl_one_gpu_test,
                network_interface,
            })
        }
        Command::Verifier(cmd) => verifier_command(cmd),
        Command::Export {
            checkpoint,
            policy,
            out,
            merged,
        } => export_command(&checkpoint, policy, &out, merged),
        Command::ShowPrompts {
            config,
            split,
            limit,
            turn,
        } => {
            let cfg = config.load()?;
            let mut out = std::io::stdout().lock();
            if turn == 1 {
                show_prompts(&cfg, split, limit, &mut out)
            } else {
                show_turn_prompts(&cfg, split, limit, turn as usize, &mut out)
            }
        }
    }
}
