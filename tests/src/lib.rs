//! Helpers for the workspace integration tests (starting binaries, waiting on health checks).
