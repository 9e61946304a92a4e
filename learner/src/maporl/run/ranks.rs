//! The learner's ranks in a MaPoRL run: each discusses every world-th question of a step and they
//! exchange the discussions; rank 0's adapters and critics start every rank; rank 0 alone pushes.

use super::super::rollout::Discussion;
use super::MaporlTrainer;
use crate::error::TrainError;
use crate::prompts::items::TrainItem;

impl MaporlTrainer {
    /// This rank's share of `items` discussed (every world-th question), then every rank's
    /// discussions in the items' order, on every rank.
    pub(super) fn discuss_ranked(
        &mut self,
        items: &[&TrainItem],
        seed: u64,
    ) -> Result<Vec<Discussion>, TrainError> {
        let (rank, world) = (self.dist.rank(), self.dist.world());
        if world == 1 {
            return self.discuss(items, seed);
        }
        let positions: Vec<usize> =
            crate::dist::rank_share(&(0..items.len()).collect::<Vec<_>>(), rank, world);
        let mine: Vec<&TrainItem> = positions.iter().map(|&q| items[q]).collect();
        let own = if mine.is_empty() {
            Vec::new()
        } else {
            self.discuss(&mine, seed)?
        };
        let bytes = serde_json::to_vec(&own)
            .map_err(|e| TrainError::Dist(format!("serialising discussions: {e}")))?;
        let mut all: Vec<Option<Discussion>> = vec![None; items.len()];
        for (r, part) in self.dist.all_gather_bytes(&bytes)?.iter().enumerate() {
            let theirs: Vec<Discussion> = serde_json::from_slice(part)
                .map_err(|e| TrainError::Dist(format!("rank {r}'s discussions: {e}")))?;
            let at = crate::dist::rank_share(&(0..items.len()).collect::<Vec<_>>(), r, world);
            for (mut d, q) in theirs.into_iter().zip(at) {
                d.item = q;
                all[q] = Some(d);
            }
        }
        all.into_iter()
            .enumerate()
            .map(|(q, d)| {
                d.ok_or_else(|| {
                    TrainError::Dist(format!("no rank discussed question {q} of the step"))
                })
            })
            .collect()
    }

    /// Gives every rank rank 0's adapters and critics (weights only: the run starts here).
    pub(super) fn sync_ranks(&mut self) -> Result<(), TrainError> {
        if self.dist.world() == 1 {
            return Ok(());
        }
        let d = self.dist.as_ref();
        for p in self.s.adapters.policies.values() {
            crate::dist::broadcast_tensors(d, &p.optimizer.parameters(), 0)?;
        }
        for c in self.s.adapters.critics.values() {
            crate::dist::broadcast_tensors(d, &c.adapter_opt.parameters(), 0)?;
            crate::dist::broadcast_tensors(d, &c.head_opt.parameters(), 0)?;
        }
        Ok(())
    }

    /// Pushes every adapter once (version 1), so that the workers serve exactly the learner's
    /// adapters before the first sample.
    pub(super) fn sync_all(&mut self) -> Result<(), TrainError> {
        let keys: Vec<String> = self.s.adapters.policies.keys().cloned().collect();
        self.push_next_versions(&keys)
    }

    /// Gives each policy adapter in `keys` its next version, rank 0 pushing it to the rollout
    /// workers; with several ranks, no rank samples before those pushes are served.
    pub(super) fn push_next_versions(&mut self, keys: &[String]) -> Result<(), TrainError> {
        for key in keys {
            let p = self
                .s
                .adapters
                .policies
                .get_mut(key)
                .expect("keys name the learner's adapters");
            let next = p.version + 1;
            if self.dist.is_root() {
                p.push(self.s.rollout.as_mut(), next)?;
            }
            p.version = next;
        }
        if self.dist.world() > 1 {
            self.dist.barrier()?;
        }
        Ok(())
    }
}
