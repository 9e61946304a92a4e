//! Each agent's first-turn prompt is a minijinja template rendered with the dataset row and the
//! values derived from it. cotrain's defaults live in `configs/prompts/*.j2` (embedded here, so the
//! binary needs no files); a config replaces any agent's template with `prompts.agentN.template`
//! (inline) or `prompts.agentN.template_file` (a path, relative to the config file's directory).
//!
//! What a template sees:
//! - every task: `item` (the row: `item.task_id`, `item.prompt`, ... as the dataset has them),
//!   `agent` (0-based index), `num_agents`, `model` (the agent's base model as the config names it;
//!   the GSM8K default words its request as MaPoRL does for that model);
//! - code (HumanEval, CoopHumanEval, MBPP): `problem` (the row's prompt, trailing blank space
//!   removed), `entry_point`, `params` (the entry point's parameter names, a list), `signature`
//!   (`entry_point(a, b)`), `def_params` (the parameters of the first `def` in the prompt as
//!   written, annotations kept, as the original's formatters read them; empty when none);
//! - arXiv: `abstract`; TLDR: `post`; GSM8K: `question`; ANLI: `premise`, `hypothesis`.

use std::path::Path;

use minijinja::Environment;
use serde::Serialize;

use super::code::signature_params;
use super::comlrl::{FORMATTER_ERROR, formatter_params};
use crate::config::{CheckedConfig, PromptSource};
use crate::data::TaskItem;

/// Why a prompt template cannot be loaded or rendered.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// A `template_file` could not be read.
    #[error("prompts.{agent}.template_file {path}: {source}")]
    Read {
        agent: String,
        path: String,
        source: std::io::Error,
    },
    /// The template does not parse.
    #[error("prompts.{agent}: invalid template: {message}")]
    Syntax { agent: String, message: String },
    /// Rendering failed (an undefined variable, a filter error, ...).
    #[error("prompts.{agent}: cannot render the prompt of row {row}: {message}")]
    Render {
        agent: String,
        row: usize,
        message: String,
    },
    /// The task has no default prompt for this many agents.
    #[error(
        "task `{task}` has default prompts for {supported} agents, not {num_agents}; give prompts.agentN.template for each agent"
    )]
    AgentCount {
        task: &'static str,
        num_agents: usize,
        supported: &'static str,
    },
}

/// The default template of each (task, role), from `configs/prompts/`.
const DEFAULTS: &[(&str, &str)] = &[
    (
        "code_helper",
        include_str!("../../../configs/prompts/code_helper.j2"),
    ),
    (
        "code_main",
        include_str!("../../../configs/prompts/code_main.j2"),
    ),
    (
        "code_single",
        include_str!("../../../configs/prompts/code_single.j2"),
    ),
    (
        "arxiv_background",
        include_str!("../../../configs/prompts/arxiv_background.j2"),
    ),
    (
        "arxiv_methods",
        include_str!("../../../configs/prompts/arxiv_methods.j2"),
    ),
    (
        "arxiv_single",
        include_str!("../../../configs/prompts/arxiv_single.j2"),
    ),
    (
        "tldr_concise",
        include_str!("../../../configs/prompts/tldr_concise.j2"),
    ),
    (
        "tldr_detailed",
        include_str!("../../../configs/prompts/tldr_detailed.j2"),
    ),
    (
        "tldr_single",
        include_str!("../../../configs/prompts/tldr_single.j2"),
    ),
    ("gsm8k", include_str!("../../../configs/prompts/gsm8k.j2")),
    ("anli", include_str!("../../../configs/prompts/anli.j2")),
];

/// The name of the default template (a file stem in `configs/prompts/`) of `agent` of `num_agents`.
pub fn default_template_name(
    item: &TaskItem,
    agent: usize,
    num_agents: usize,
) -> Result<&'static str, TemplateError> {
    let two = |task: &'static str,
               single: &'static str,
               first: &'static str,
               second: &'static str| match num_agents {
        1 => Ok(single),
        2 if agent == 0 => Ok(first),
        2 => Ok(second),
        _ => Err(TemplateError::AgentCount {
            task,
            num_agents,
            supported: "1 or 2",
        }),
    };
    match item {
        TaskItem::Code(_) => two("code", "code_single", "code_helper", "code_main"),
        TaskItem::Arxiv(_) => two("arxiv", "arxiv_single", "arxiv_background", "arxiv_methods"),
        TaskItem::Tldr(_) => two("tldr", "tldr_single", "tldr_concise", "tldr_detailed"),
        TaskItem::Gsm8k(_) => Ok("gsm8k"),
        TaskItem::Anli(_) => Ok("anli"),
    }
}

/// The prompt templates of a run: per agent, the config's template or the task default.
pub struct Prompter {
    env: Environment<'static>,
    /// Per agent, the name of its template in `env` (`agent0`, ... when configured, else a default).
    names: Vec<Option<String>>,
    /// Per agent, its base model's name (empty when unknown).
    models: Vec<String>,
}

impl std::fmt::Debug for Prompter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prompter")
            .field("names", &self.names)
            .finish_non_exhaustive()
    }
}

#[derive(Serialize)]
struct Context<'a> {
    item: &'a TaskItem,
    agent: usize,
    num_agents: usize,
    model: &'a str,
    #[serde(flatten)]
    derived: Derived,
}

#[derive(Serialize, Default)]
struct Derived {
    #[serde(skip_serializing_if = "Option::is_none")]
    problem: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    entry_point: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    params: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    signature: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    def_params: Option<String>,
    #[serde(rename = "abstract", skip_serializing_if = "Option::is_none")]
    abstract_text: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    post: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    question: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    premise: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    hypothesis: Option<String>,
}

fn derived(item: &TaskItem) -> Derived {
    match item {
        TaskItem::Code(c) => {
            let params = signature_params(&c.prompt, &c.entry_point).unwrap_or_default();
            Derived {
                problem: Some(c.prompt.trim_end().to_string()),
                entry_point: Some(c.entry_point.clone()),
                signature: Some(format!("{}({})", c.entry_point, params.join(", "))),
                def_params: Some(formatter_params(&c.prompt).unwrap_or_default()),
                params: Some(params),
                ..Derived::default()
            }
        }
        TaskItem::Arxiv(a) => Derived {
            abstract_text: Some(a.abstract_text.trim().to_string()),
            ..Derived::default()
        },
        TaskItem::Tldr(t) => Derived {
            post: Some(t.prompt.trim().to_string()),
            ..Derived::default()
        },
        TaskItem::Gsm8k(g) => Derived {
            question: Some(g.question.trim().to_string()),
            ..Derived::default()
        },
        TaskItem::Anli(a) => Derived {
            premise: Some(a.premise.trim().to_string()),
            hypothesis: Some(a.hypothesis.trim().to_string()),
            ..Derived::default()
        },
    }
}

fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    // Block tags do not leave blank lines behind; a template file's final newline is dropped, as in
    // Jinja2, so that a prompt ends where its text ends.
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_undefined_behavior(minijinja::UndefinedBehavior::Strict);
    // Render errors quote the template line and name the undefined variable in release builds too
    // (minijinja turns this on only with debug assertions).
    env.set_debug(true);
    minijinja_contrib::add_to_environment(&mut env);
    for (name, text) in DEFAULTS {
        env.add_template(name, text)
            .expect("the embedded default prompt templates parse");
    }
    env
}

impl Prompter {
    /// The templates a config asks for (`prompts.agentN`), defaults for the other agents.
    pub fn from_config(cfg: &CheckedConfig) -> Result<Self, TemplateError> {
        let base = cfg.source.parent().unwrap_or(Path::new("."));
        let mut env = environment();
        let mut names = vec![None; cfg.num_agents];
        for (agent, source) in cfg.prompt_sources.iter().enumerate() {
            let key = format!("agent{agent}");
            let text = match source {
                None => continue,
                Some(PromptSource::Inline(t)) => t.clone(),
                Some(PromptSource::File(p)) => {
                    let path = if Path::new(p).is_absolute() {
                        Path::new(p).to_path_buf()
                    } else {
                        base.join(p)
                    };
                    std::fs::read_to_string(&path).map_err(|source| TemplateError::Read {
                        agent: key.clone(),
                        path: path.display().to_string(),
                        source,
                    })?
                }
            };
            env.add_template_owned(key.clone(), text)
                .map_err(|e| TemplateError::Syntax {
                    agent: key.clone(),
                    message: e.to_string(),
                })?;
            names[agent] = Some(key);
        }
        Ok(Self {
            env,
            names,
            models: cfg.agent_models.clone(),
        })
    }

    /// Only the defaults (tests, tools), for agents of no named model.
    pub fn defaults(num_agents: usize) -> Self {
        Self {
            env: environment(),
            names: vec![None; num_agents],
            models: Vec::new(),
        }
    }

    /// The first-turn prompt text of `agent` for `item` (row `row` of its split, for messages).
    pub fn render(
        &self,
        item: &TaskItem,
        row: usize,
        agent: usize,
    ) -> Result<String, TemplateError> {
        let num_agents = self.names.len();
        let name = match self.names.get(agent).cloned().flatten() {
            Some(n) => n,
            None => default_template_name(item, agent, num_agents)?.to_string(),
        };
        let agent_key = format!("agent{agent}");
        let tmpl = self
            .env
            .get_template(&name)
            .map_err(|e| TemplateError::Syntax {
                agent: agent_key.clone(),
                message: e.to_string(),
            })?;
        let model = self.models.get(agent).map_or("", String::as_str);
        let ctx = Context {
            item,
            agent,
            num_agents,
            model,
            derived: derived(item),
        };
        tmpl.render(&ctx).map_err(|e| TemplateError::Render {
            agent: agent_key,
            row,
            message: format!("{e:#}"),
        })
    }

    /// A later turn's `text` wrapped in `agent`'s first-turn template, as the original's formatters
    /// wrapped it (`external.prompt_passthrough: false`): the text in place of the code problem, so
    /// the template's `def_params` and `signature` come from the first `def` in the text; the
    /// original's error string when the text has no `def name(params)`. Other tasks are not wrapped.
    pub fn render_next_turn(
        &self,
        item: &TaskItem,
        row: usize,
        agent: usize,
        text: &str,
    ) -> Result<String, TemplateError> {
        let TaskItem::Code(code) = item else {
            return Ok(text.to_string());
        };
        if formatter_params(text).is_none() {
            return Ok(FORMATTER_ERROR.to_string());
        }
        let wrapped = TaskItem::Code(crate::data::CodeItem {
            prompt: text.to_string(),
            ..code.clone()
        });
        self.render(&wrapped, row, agent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{ArxivItem, CodeItem};

    fn code_item() -> TaskItem {
        TaskItem::Code(CodeItem {
            task_id: "t/1".into(),
            prompt: "from typing import List\n\ndef add(a: int, b: List[int]) -> int:\n    \"\"\"Add.\"\"\"\n\n\n".into(),
            test: "def check(candidate):\n    assert candidate(1, [2]) == 3\n".into(),
            entry_point: "add".into(),
        })
    }

    #[test]
    fn every_default_template_renders_for_its_task() {
        let p = Prompter::defaults(2);
        let helper = p.render(&code_item(), 0, 0).unwrap();
        let main = p.render(&code_item(), 0, 1).unwrap();
        assert!(
            helper.contains("aux") && helper.contains("def add(a: int, b: List[int]) -> int:"),
            "{helper}"
        );
        assert!(main.contains("add(a, b)") && main.contains("aux"), "{main}");
        let single = Prompter::defaults(1).render(&code_item(), 0, 0).unwrap();
        assert!(
            single.contains("add(a, b)") && !single.contains("aux"),
            "{single}"
        );
        let a = TaskItem::Arxiv(ArxivItem {
            article_id: "1".into(),
            abstract_text: " We study X. ".into(),
            token_count: None,
        });
        for agents in [1, 2] {
            for agent in 0..agents {
                let text = Prompter::defaults(agents).render(&a, 0, agent).unwrap();
                assert!(text.contains("We study X."), "{text}");
                // The original never tells the agents the reward's thresholds.
                assert!(!text.contains("128") && !text.contains("256"), "{text}");
            }
        }
    }

    #[test]
    fn a_configured_template_sees_the_row_and_derived_values() {
        let yaml = "model: {name: m}\ndataset: {name: humaneval}\nmagrpo: {}\n\
                    prompts: {agent1: {template: '{{ item.task_id }}|{{ entry_point }}|{{ params | join(\",\") }}|{{ signature }}|{{ agent }}/{{ num_agents }}'}}\n";
        let v = crate::config::merged_value(yaml, "p.yaml", &[], &Default::default()).unwrap();
        let cfg = CheckedConfig::from_value(v, Path::new("p.yaml")).unwrap();
        let p = Prompter::from_config(&cfg).unwrap();
        assert_eq!(
            p.render(&code_item(), 0, 1).unwrap(),
            "t/1|add|a,b|add(a, b)|1/2"
        );
        // Agent 0 keeps its default.
        assert!(p.render(&code_item(), 0, 0).unwrap().contains("aux"));
    }

    #[test]
    fn template_errors_name_the_agent_and_the_problem() {
        let yaml = "model: {name: m}\ndataset: {name: humaneval}\nmagrpo: {}\nprompts: {agent0: {template: '{{ nope }}'}}\n";
        let v = crate::config::merged_value(yaml, "p.yaml", &[], &Default::default()).unwrap();
        let cfg = CheckedConfig::from_value(v, Path::new("p.yaml")).unwrap();
        let e = Prompter::from_config(&cfg)
            .unwrap()
            .render(&code_item(), 3, 0)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("prompts.agent0") && e.contains("row 3") && e.contains("nope"),
            "{e}"
        );
        let yaml = "model: {name: m}\ndataset: {name: humaneval}\nmagrpo: {}\nprompts: {agent1: {template: '{% if %}'}}\n";
        let v = crate::config::merged_value(yaml, "p.yaml", &[], &Default::default()).unwrap();
        let cfg = CheckedConfig::from_value(v, Path::new("p.yaml")).unwrap();
        let e = Prompter::from_config(&cfg).unwrap_err().to_string();
        assert!(e.contains("prompts.agent1: invalid template"), "{e}");
    }
}
