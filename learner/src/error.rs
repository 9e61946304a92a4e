//! The error every trainer, service adapter and tool of the learner returns.

/// Why training stopped.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The config asks for something inconsistent.
    #[error("config: {0}")]
    Config(String),
    /// A trainer that is not built yet (multi-turn, ...).
    #[error("{0}")]
    NotBuilt(String),
    /// Loading or running the model failed.
    #[error("model: {0}")]
    Model(String),
    /// A forward, loss or backward pass of an update failed.
    #[error("update: {0}")]
    Update(String),
    /// A worker thread of the learner panicked (a bug; the panic message is in the log above).
    #[error("internal error: {0} panicked (the panic message is in the log above)")]
    Panicked(&'static str),
    /// Dataset or prompt preparation failed.
    #[error("data: {0}")]
    Data(String),
    /// The rollout workers failed.
    #[error("rollout: {0}")]
    Rollout(String),
    /// The reward server failed.
    #[error("reward: {0}")]
    Reward(String),
    /// A sample came from another policy version than the learner's, twice in a row.
    #[error(
        "agent {agent}: a sample came from policy version {got}, the learner pushed {expected} (on-policy training refuses stale samples)"
    )]
    StaleSample {
        agent: usize,
        expected: u64,
        got: u64,
    },
    /// The expert model of `expert_edits` refused requests or answered none.
    #[error("expert: {0}")]
    External(String),
    /// Writing or reading a checkpoint failed.
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// A filesystem error.
    #[error("io: {0}")]
    Io(String),
    /// The learner's ranks failed to work together (a collective, diverged weights).
    #[error("{0}")]
    Dist(String),
}
