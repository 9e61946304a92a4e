//! Bounded concurrency with a bounded queue: at most `max_concurrency` runs at once, at most
//! `queue_limit` waiting; past that callers get [`RunnerError::Overloaded`] at once instead of
//! piling up memory.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::code_runner::RunnerError;

#[derive(Debug)]
pub struct Admission {
    slots: Arc<Semaphore>,
    max_concurrency: usize,
    queue_limit: usize,
    waiting: AtomicUsize,
}

/// Decrements the waiting count however the wait ends (granted, or the caller gave up).
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Admission {
    pub fn new(max_concurrency: usize, queue_limit: usize) -> Self {
        let max_concurrency = max_concurrency.max(1);
        Self {
            slots: Arc::new(Semaphore::new(max_concurrency)),
            max_concurrency,
            queue_limit,
            waiting: AtomicUsize::new(0),
        }
    }

    /// A run slot, waiting in the queue if needed, or `Overloaded` if the queue is full.
    pub async fn acquire(&self) -> Result<OwnedSemaphorePermit, RunnerError> {
        if let Ok(permit) = self.slots.clone().try_acquire_owned() {
            return Ok(permit);
        }
        let before = self.waiting.fetch_add(1, Ordering::SeqCst);
        let guard = Waiting(&self.waiting);
        if before >= self.queue_limit {
            drop(guard);
            return Err(RunnerError::Overloaded { queued: before });
        }
        let permit = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| RunnerError::Sandbox("the sandbox is shutting down".into()))?;
        drop(guard);
        Ok(permit)
    }

    /// Runs waiting for a slot.
    pub fn queue_depth(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    /// Runs executing now.
    pub fn in_flight(&self) -> usize {
        self.max_concurrency - self.slots.available_permits()
    }

    pub fn max_concurrency(&self) -> usize {
        self.max_concurrency
    }

    /// Refuses new work and wakes every waiter with an error (graceful shutdown).
    pub fn close(&self) {
        self.slots.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_full_queue_rejects_at_once_and_frees_up_again() {
        let adm = Arc::new(Admission::new(1, 1));
        let held = adm.acquire().await.unwrap();
        assert_eq!(adm.in_flight(), 1);
        let waiter = {
            let adm = adm.clone();
            tokio::spawn(async move { adm.acquire().await.map(|_| ()) })
        };
        while adm.queue_depth() == 0 {
            tokio::task::yield_now().await;
        }
        assert!(matches!(
            adm.acquire().await,
            Err(RunnerError::Overloaded { queued: 1 })
        ));
        drop(held);
        waiter.await.unwrap().unwrap();
        assert_eq!(adm.queue_depth(), 0);
        assert!(adm.acquire().await.is_ok());
    }
}
