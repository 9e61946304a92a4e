//! The learner: configs, datasets, per-agent prompt formatters, the update math of GRPO/MAGRPO,
//! metrics, checkpoints and plots, and the `learner` CLI's logic.
//!
//! The trainer loop (talking to the rollout workers and the reward server) is built on top of these
//! pieces; the pieces themselves are pure and testable without a model.

pub mod algo;
pub mod cli;
pub mod config;
pub mod control;
pub mod data;
pub mod dist;
pub mod error;
pub mod export;
pub mod external;
pub mod maporl;
pub mod prompts;
pub mod checkpoint;
pub mod metrics;
pub mod model_options;
pub mod plot;
pub mod run_state;
pub mod seeds;
pub mod security;
pub mod services;
pub mod sources;
pub mod trainer;
pub mod verifier;
