//! Reward tests: hand-built cases for every level, boundary and stop of every task, with the
//! expected values worked out from `shared/spec/rewards.md` in the comments; code cases run
//! through the real bubblewrap sandbox.

#[path = "rewards/answers.rs"]
mod answers;
#[path = "rewards/code.rs"]
mod code;
#[path = "rewards/original.rs"]
mod original;
#[path = "rewards/writing.rs"]
mod writing;
