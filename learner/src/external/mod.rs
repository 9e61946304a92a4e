//! What multi-turn training asks of the outside world between turns: the `expert_edits` transition's
//! expert model, reached over any OpenAI-compatible chat API ([`expert`]).

pub mod expert;

pub use expert::{
    ExpertClient, ExpertEdits, ExpertFailure, ExpertRequest, FailureKind, expert_messages,
    parse_edits,
};
