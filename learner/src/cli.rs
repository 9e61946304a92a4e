//! The `learner` command line: argument types (clap derive) and the commands' logic, so that tests
//! can call them without spawning the binary.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand};

use crate::config::{CheckedConfig, LegacyFlags, load_config};

/// Trains cooperating LLM agents with GRPO / MAGRPO.
#[derive(Debug, Parser)]
#[command(name = "learner", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Train from a config.
    Train {
        #[command(flatten)]
        config: ConfigArgs,
        /// Continue the run in this directory from its latest checkpoint.
        #[arg(long)]
        resume: Option<PathBuf>,
    },
    /// Evaluate a checkpoint on the config's eval split.
    Eval {
        #[command(flatten)]
        config: ConfigArgs,
        /// Checkpoint directory to evaluate.
        #[arg(long)]
        checkpoint: PathBuf,
    },
    /// Draw reward, loss and throughput curves of a run directory to PNG files in it.
    Plot {
        /// The run directory (holding metrics.jsonl).
        run_dir: PathBuf,
    },
    /// Print the merged, validated config.
    CheckConfig {
        #[command(flatten)]
        config: ConfigArgs,
    },
}

/// The config file, overrides and the original scripts' legacy flags.
#[derive(Debug, Clone, Args)]
pub struct ConfigArgs {
    /// YAML config file.
    #[arg(long)]
    pub config: PathBuf,
    /// Deep-merged `key.path=value` (value typed as YAML), e.g. `magrpo.learning_rate=1e-5`; repeatable.
    #[arg(long = "override", value_name = "KEY=VALUE")]
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
            output_base_dir: self.output_base_dir.as_ref().map(|p| p.display().to_string()),
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
    match cli.command {
        Command::CheckConfig { config } => {
            let cfg = config.load()?;
            print!("{}", cfg.to_yaml());
            Ok(())
        }
        Command::Train { config, resume } => {
            let cfg = config.load()?;
            ensure_trainable(&cfg)?;
            if let Some(dir) = &resume
                && !dir.is_dir()
            {
                bail!("--resume {}: no such run directory", dir.display());
            }
            let summary = crate::trainer::train(&cfg, &crate::trainer::TrainOptions { resume })?;
            println!("run directory: {}", summary.run_dir.display());
            println!("metrics: {}", summary.metrics_path.display());
            if let Some(c) = &summary.checkpoint {
                println!("checkpoint: {}", c.display());
            }
            for p in &summary.plots {
                println!("plot: {}", p.display());
            }
            Ok(())
        }
        Command::Eval { config, checkpoint } => {
            let cfg = config.load()?;
            if !checkpoint.is_dir() {
                bail!("--checkpoint {}: no such checkpoint directory", checkpoint.display());
            }
            ensure_trainable(&cfg)?;
            let metrics = crate::trainer::evaluate_checkpoint(&cfg, &checkpoint)?;
            println!("{}", serde_json::to_string_pretty(&metrics)?);
            Ok(())
        }
        Command::Plot { run_dir } => plot_command(&run_dir),
    }
}

fn plot_command(run_dir: &Path) -> anyhow::Result<()> {
    let metrics = run_dir.join("metrics.jsonl");
    if !metrics.is_file() {
        bail!("{}: no metrics.jsonl in this run directory", run_dir.display());
    }
    let written = crate::plot::plot_run(run_dir).with_context(|| format!("plotting {}", run_dir.display()))?;
    for p in written {
        println!("{}", p.display());
    }
    Ok(())
}
