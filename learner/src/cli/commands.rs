//! The longer `learner` commands: show-prompts, verifier, export, compare, plot.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

use super::{PromptSplit, VerifierCommand};
use crate::config::{CheckedConfig, LegacyFlags, load_config};

/// `learner show-prompts`: the prompts exactly as the trainer builds them (templates, then the chat
/// template if `model.chat_template`, then the agent's tokenizer), without loading any weights.
pub fn show_prompts(
    cfg: &CheckedConfig,
    split: PromptSplit,
    limit: Option<usize>,
    out: &mut dyn std::io::Write,
) -> anyhow::Result<()> {
    use crate::prompts::items::render_prompt;
    let spec = match split {
        PromptSplit::Train => &cfg.train_split,
        PromptSplit::Eval => cfg.eval_split.as_ref().with_context(|| {
            format!(
                "{}: --split eval but dataset.eval_split is not set",
                cfg.source.display()
            )
        })?,
    };
    let data = crate::data::load_split(&cfg.raw.dataset, spec)?;
    let prompter = crate::prompts::Prompter::from_config(cfg)
        .with_context(|| cfg.source.display().to_string())?;
    let encoding = cfg.prompt_encoding();
    // Agents naming the same model share one tokenizer and chat template.
    let mut sides = std::collections::BTreeMap::new();
    for name in &cfg.agent_models {
        if !sides.contains_key(name) {
            let side = cotrain_model::loader::load_text_side(name)
                .with_context(|| format!("model `{name}`"))?;
            sides.insert(name.clone(), side);
        }
    }
    let count = limit.unwrap_or(data.items.len()).min(data.items.len());
    for index in 0..count {
        for (agent, name) in cfg.agent_models.iter().enumerate() {
            let (tokenizer, template) = &sides[name];
            let p = render_prompt(
                &data,
                index,
                agent,
                tokenizer,
                template.as_ref(),
                &prompter,
                &encoding,
            )?;
            let line = serde_json::json!({"item_index": index, "agent": agent, "text": p.text, "tokens": p.ids.len()});
            writeln!(out, "{line}")?;
        }
    }
    Ok(())
}

/// `learner show-prompts --turn N` (N ≥ 2): each agent's turn-N prompt as the trainer writes it
/// (`external.next_turn_prompt`, the wrapping of `external.prompt_passthrough`, the chat template,
/// the tokenizer), from placeholder responses (`<agent A turn T response>`) and placeholder
/// diagnostics (`<placeholder: ...>`), since the real ones need the models and the reward server.
pub fn show_turn_prompts(
    cfg: &CheckedConfig,
    split: PromptSplit,
    limit: Option<usize>,
    turn: usize,
    out: &mut dyn std::io::Write,
) -> anyhow::Result<()> {
    use crate::prompts::comlrl::LevelReport;
    use crate::prompts::items::{encode_text, item_json, render_prompt};
    use crate::prompts::multiturn::{
        AgentTurn, NextTurn, NextTurnPrompter, TurnRecord, format_name,
    };
    let turns = cfg.trainer.num_turns;
    if turns < 2 {
        bail!(
            "{}: --turn {turn} but the config is single-turn ({}.num_turns is {turns})",
            cfg.source.display(),
            cfg.algorithm.section()
        );
    }
    if turn > turns {
        bail!(
            "{}: --turn {turn} but {}.num_turns is {turns}",
            cfg.source.display(),
            cfg.algorithm.section()
        );
    }
    let spec = match split {
        PromptSplit::Train => &cfg.train_split,
        PromptSplit::Eval => cfg.eval_split.as_ref().with_context(|| {
            format!(
                "{}: --split eval but dataset.eval_split is not set",
                cfg.source.display()
            )
        })?,
    };
    let kind = crate::data::DatasetKind::resolve(&cfg.raw.dataset).map_err(anyhow::Error::msg)?;
    let data = crate::data::load_split(&cfg.raw.dataset, spec)?;
    let prompter = crate::prompts::Prompter::from_config(cfg)
        .with_context(|| cfg.source.display().to_string())?;
    let next_turn = NextTurnPrompter::from_config(cfg, kind.is_code())
        .with_context(|| cfg.source.display().to_string())?;
    let encoding = cfg.prompt_encoding();
    let mut sides = std::collections::BTreeMap::new();
    for name in &cfg.agent_models {
        if !sides.contains_key(name) {
            let side = cotrain_model::loader::load_text_side(name)
                .with_context(|| format!("model `{name}`"))?;
            sides.insert(name.clone(), side);
        }
    }
    let n = cfg.num_agents;
    let count = limit.unwrap_or(data.items.len()).min(data.items.len());
    for index in 0..count {
        let item = item_json(&data.items[index]);
        let row = data.row_offset + index;
        let entry_point = item
            .get("entry_point")
            .and_then(|v| v.as_str())
            .unwrap_or_default();
        let mut firsts = Vec::with_capacity(n);
        for (agent, name) in cfg.agent_models.iter().enumerate() {
            let (tokenizer, template) = &sides[name];
            firsts.push(
                render_prompt(
                    &data,
                    index,
                    agent,
                    tokenizer,
                    template.as_ref(),
                    &prompter,
                    &encoding,
                )?
                .user_text,
            );
        }
        // Per agent: its turns so far, and the prompt (user text) it reads at the current turn.
        let mut histories: Vec<Vec<TurnRecord>> = vec![Vec::new(); n];
        let mut prompts: Vec<(String, String)> =
            firsts.iter().map(|p| (p.clone(), p.clone())).collect();
        for t in 1..turn {
            let responses: Vec<String> = (0..n)
                .map(|a| format!("<agent {a} turn {t} response>"))
                .collect();
            let report = LevelReport::placeholder(entry_point, &responses);
            let mut next = Vec::with_capacity(n);
            for a in 0..n {
                histories[a].push(TurnRecord {
                    prompt: prompts[a].0.clone(),
                    response: responses[a].clone(),
                });
                let feedback = format!("<placeholder: the reward server's feedback for agent {a}>");
                let agent_turn = AgentTurn {
                    next: NextTurn {
                        original_prompt: &firsts[a],
                        history: &histories[a],
                        feedback: &feedback,
                    },
                    agent: a,
                    item: &item,
                    row,
                    report: Some(&report),
                };
                let text = next_turn
                    .compose(&agent_turn, 0)
                    .with_context(|| format!("row {row} turn {} agent {a}", t + 1))?;
                next.push((text.recorded, text.user_text));
            }
            prompts = next;
        }
        for (agent, name) in cfg.agent_models.iter().enumerate() {
            let (tokenizer, template) = &sides[name];
            let text = encoding.model_text(template.as_ref(), &prompts[agent].1)?;
            let tokens = encode_text(tokenizer, &text)?.len();
            let line = serde_json::json!({
                "item_index": index,
                "agent": agent,
                "turn": turn,
                "next_turn_prompt": format_name(next_turn.format()),
                "text": text,
                "tokens": tokens,
                "placeholders": "the earlier responses and the diagnostics are placeholders",
            });
            writeln!(out, "{line}")?;
        }
    }
    Ok(())
}

/// `learner verifier ...`: see [`crate::verifier`].
pub(super) fn verifier_command(cmd: VerifierCommand) -> anyhow::Result<()> {
    match cmd {
        VerifierCommand::Generate { config, out } => {
            let cfg = config.load()?;
            let s = crate::verifier::generate::generate(&cfg, &out)?;
            println!(
                "{} questions sampled ({} already in the file), {} answers, {} correct ({:.1}%), {:.1} s, {:.2} answers/s",
                s.questions,
                s.resumed,
                s.answers,
                s.correct,
                100.0 * s.correct as f64 / s.answers.max(1) as f64,
                s.seconds,
                s.answers as f64 / s.seconds.max(1e-9)
            );
            println!("wrote {}", out.display());
            Ok(())
        }
        VerifierCommand::Balance {
            input,
            out,
            per_type,
            keep_short,
            config,
            overrides,
            fill_rounds,
        } => {
            if per_type == 0 {
                bail!("--per-type must be at least 1");
            }
            let mut data =
                crate::verifier::VerifierData::read(&input).map_err(anyhow::Error::msg)?;
            if let Some(path) = config {
                let cfg = load_config(&path, &overrides, &LegacyFlags::default())?;
                let mut sampler = crate::verifier::generate::Sampler::connect(&cfg)?;
                let split = crate::data::load_split(&cfg.raw.dataset, &cfg.train_split)?;
                let items: std::collections::HashMap<String, serde_json::Value> = split
                    .items
                    .iter()
                    .map(|it| {
                        let item = crate::prompts::items::item_json(it);
                        (crate::verifier::question_text(&sampler.task, &item), item)
                    })
                    .collect();
                let r = crate::verifier::balance::fill(
                    &mut data,
                    per_type,
                    fill_rounds,
                    &mut sampler,
                    &items,
                )?;
                println!(
                    "filled: {} reference solutions, {} correct rewrites, {} wrong answers added; {} short questions not in the config's train split",
                    r.references, r.correct_added, r.incorrect_added, r.not_found
                );
            }
            let (balanced, report) = crate::verifier::balance::balance(&data, per_type, keep_short);
            for q in &report.questions {
                let short: String = q.question.chars().take(70).collect();
                println!(
                    "{:>4} correct {:>4} incorrect  {}  {short:?}",
                    q.correct, q.incorrect, q.outcome
                );
            }
            println!(
                "{} questions kept, {} dropped; {} answers in, {} out ({per_type} correct + {per_type} incorrect per balanced question)",
                report.kept, report.dropped, report.answers_in, report.answers_out
            );
            if balanced.questions.is_empty() {
                bail!(
                    "no question has {per_type} correct and {per_type} incorrect answers: nothing written (lower --per-type or pass --keep-short)"
                );
            }
            balanced.write(&out).map_err(anyhow::Error::msg)?;
            println!("wrote {}", out.display());
            Ok(())
        }
        VerifierCommand::Train { config, data, out } => {
            let cfg = config.load()?;
            let data = crate::verifier::VerifierData::read(&data).map_err(anyhow::Error::msg)?;
            let summary = crate::verifier::train::train_verifier(&cfg, &data, &out)?;
            println!(
                "verifier: {} ({} optimiser steps)",
                summary.out_dir.display(),
                summary.optimizer_steps
            );
            for (k, v) in &summary.heldout {
                println!("{k}: {v:.4}");
            }
            for p in &summary.plots {
                println!("plot: {}", p.display());
            }
            Ok(())
        }
    }
}

/// `learner export`: see [`crate::export`].
pub(super) fn export_command(
    checkpoint: &Path,
    policy: Option<usize>,
    out: &Path,
    merged: bool,
) -> anyhow::Result<()> {
    if !checkpoint.is_dir() {
        bail!(
            "--checkpoint {}: no such checkpoint directory",
            checkpoint.display()
        );
    }
    if let Some(dir) = crate::export::maporl_dir(checkpoint) {
        if policy.is_some() {
            bail!(
                "--policy selects a MAGRPO policy; a MaPoRL run exports every policy (pick one from --out afterwards)"
            );
        }
        for d in crate::export::export_maporl(&dir, out, merged).map_err(anyhow::Error::msg)? {
            println!(
                "{}: {}",
                if d.join("adapter_config.json").is_file() {
                    "adapter"
                } else {
                    "model"
                },
                d.display()
            );
        }
        return Ok(());
    }
    let written = crate::export::export_checkpoint(checkpoint, policy, out, merged)
        .with_context(|| format!("exporting {}", checkpoint.display()))?;
    for w in written {
        match w {
            crate::export::Exported::Model(d) => println!("model: {}", d.display()),
            crate::export::Exported::Adapter(d) => println!("adapter: {}", d.display()),
        }
    }
    Ok(())
}

/// `learner plot RUN_A RUN_B ... --key K --out F`: K against the step for every run, one line each
/// (named by the run directory).
pub(super) fn compare_command(run_dirs: &[PathBuf], key: &str, out: &Path) -> anyhow::Result<()> {
    let mut series = Vec::new();
    for dir in run_dirs {
        let path = dir.join(crate::metrics::METRICS_FILE);
        let records = crate::metrics::read_metrics(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let points: Vec<(f64, f64)> = records
            .iter()
            .filter_map(|r| r.values.get(key).map(|v| (r.step as f64, *v)))
            .filter(|(_, v)| v.is_finite())
            .collect();
        if points.is_empty() {
            bail!("{}: no `{key}` in any step", path.display());
        }
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| dir.display().to_string());
        series.push((name, points));
    }
    crate::plot::draw_lines(out, key, "step", &series)
        .with_context(|| format!("drawing {}", out.display()))?;
    println!("{}", out.display());
    Ok(())
}

pub(super) fn plot_command(run_dir: &Path) -> anyhow::Result<()> {
    let metrics = run_dir.join("metrics.jsonl");
    if !metrics.is_file() {
        bail!(
            "{}: no metrics.jsonl in this run directory",
            run_dir.display()
        );
    }
    let written = crate::plot::plot_run(run_dir)
        .with_context(|| format!("plotting {}", run_dir.display()))?;
    for p in written {
        println!("{}", p.display());
    }
    Ok(())
}
