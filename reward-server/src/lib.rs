//! The reward service: sandboxed execution of model-written code ([`sandbox`]), every seed task's
//! reward with its level breakdown ([`rewards`]), and the gRPC/HTTP front ends ([`server`]).
//!
//! [`code_runner`] is the boundary between rewards and the sandbox: rewards only see
//! [`code_runner::CodeRunner`], the sandbox implements it.
pub mod code_runner;
#[cfg(feature = "server")]
pub mod config;
pub mod rewards;
#[cfg(feature = "server")]
pub mod sandbox;
#[cfg(feature = "server")]
pub mod server;
