//! Requests answered once: a request carrying an id (`ScoreRequest.request_id`) that arrives again
//! (a client retrying after its answer was lost, or while the first is still being scored) gets
//! the first one's result instead of being scored a second time. The last [`KEPT`] ids are kept; a
//! failed attempt is not kept, so a retry after a failure does the work.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::{Arc, Mutex};

use tokio::sync::OnceCell;

/// Ids remembered (a learner retries the request it just sent, so a few dozen are plenty).
pub const KEPT: usize = 64;

/// See the module docs.
pub struct AnsweredOnce<T> {
    recent: Mutex<VecDeque<(String, Arc<OnceCell<T>>)>>,
}

impl<T> Default for AnsweredOnce<T> {
    fn default() -> Self {
        Self {
            recent: Mutex::new(VecDeque::new()),
        }
    }
}

impl<T: Clone> AnsweredOnce<T> {
    /// `work`'s result, or the result already made under `id` (an empty id: always `work`). The
    /// second value says whether the result was made earlier.
    pub async fn answer<E, F, Fut>(&self, id: &str, work: F) -> Result<(T, bool), E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        if id.is_empty() {
            return work().await.map(|t| (t, false));
        }
        let cell = {
            let mut recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
            match recent.iter().find(|(k, _)| k == id) {
                Some((_, cell)) => cell.clone(),
                None => {
                    let cell = Arc::new(OnceCell::new());
                    recent.push_back((id.to_string(), cell.clone()));
                    while recent.len() > KEPT {
                        recent.pop_front();
                    }
                    cell
                }
            }
        };
        if let Some(done) = cell.get() {
            return Ok((done.clone(), true));
        }
        let mut made_here = false;
        let value = cell
            .get_or_try_init(|| {
                made_here = true;
                work()
            })
            .await?;
        Ok((value.clone(), !made_here))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[tokio::test]
    async fn an_id_is_worked_on_once_and_a_failure_is_not_kept() {
        let once = AnsweredOnce::<u32>::default();
        let runs = AtomicUsize::new(0);
        let work = |v: u32| {
            let runs = &runs;
            move || async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, String>(v)
            }
        };
        assert_eq!(once.answer("a", work(1)).await, Ok((1, false)));
        assert_eq!(
            once.answer("a", work(2)).await,
            Ok((1, true)),
            "the first result again"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert_eq!(
            once.answer("", work(3)).await,
            Ok((3, false)),
            "no id: always worked on"
        );
        assert_eq!(once.answer("", work(4)).await, Ok((4, false)));
        let failed = once
            .answer("b", || async { Err::<u32, _>("down".to_string()) })
            .await;
        assert_eq!(failed, Err("down".to_string()));
        assert_eq!(
            once.answer("b", work(5)).await,
            Ok((5, false)),
            "a failure is retried"
        );
    }

    #[tokio::test]
    async fn old_ids_are_forgotten() {
        let once = AnsweredOnce::<usize>::default();
        for i in 0..=KEPT {
            once.answer(&i.to_string(), || async move { Ok::<_, ()>(i) })
                .await
                .unwrap();
        }
        let (v, earlier) = once
            .answer("0", || async { Ok::<_, ()>(99) })
            .await
            .unwrap();
        assert_eq!(
            (v, earlier),
            (99, false),
            "id 0 fell out of the last {KEPT}"
        );
        let (v, earlier) = once
            .answer(&KEPT.to_string(), || async { Ok::<_, ()>(0) })
            .await
            .unwrap();
        assert_eq!((v, earlier), (KEPT, true));
    }
}
