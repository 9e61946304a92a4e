//! The learner: configs, datasets, per-agent prompt formatters, the update math, the trainers and
//! the `learner` CLI's logic.
//!
//! The trainers, each implementing [`harness::Algorithm`] and run by [`harness::drive`]:
//! - [`trainer`]: GRPO and MAGRPO (single- and multi-turn, CoMLRL's advantage modes, LoRA or full
//!   fine-tuning, asynchronous rollouts) and CoMLRL 1.4.3's actor-critic trainers IAC and MAAC;
//! - [`maporl`]: MaPoRL's discussions trained with PPO, critics and LoRA, scored by rule or by a
//!   learned [`verifier`].
//!
//! [`trainers`] picks one for a config (`learner train`, `learner eval`). The models (the Llama,
//! Qwen2/Qwen2.5, Qwen3 and Phi-3 families) are `cotrain-model`'s; the rollout workers and the reward
//! server are reached through [`services`] (embedded in this process or remote).

pub mod algo;
pub mod checkpoint;
pub mod cli;
pub mod config;
pub mod control;
pub mod data;
pub mod dist;
pub mod error;
pub mod export;
pub mod external;
pub mod harness;
pub mod maporl;
pub mod metrics;
pub mod model_options;
pub mod plot;
pub mod prompts;
pub mod run_state;
pub mod security;
pub mod seeds;
pub mod services;
pub mod sources;
pub mod trainer;
pub mod trainers;
pub mod verifier;
