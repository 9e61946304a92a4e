//! Per-agent rollout buffers: samples accumulate node by node; when an agent's buffer holds
//! `rollout_buffer_size` nodes it is drained, shuffled, and cut into `train_batch_size` mini-batches
//! for one optimiser step.

use rand::Rng;
use rand::seq::SliceRandom;

/// Samples of one agent, grouped by the node that produced them.
#[derive(Debug, Clone)]
pub struct RolloutBuffer<S> {
    nodes: Vec<Vec<S>>,
    capacity_nodes: usize,
}

impl<S> RolloutBuffer<S> {
    /// A buffer that is ready after `capacity_nodes` nodes (`rollout_buffer_size`).
    pub fn new(capacity_nodes: usize) -> Self {
        Self {
            nodes: Vec::new(),
            capacity_nodes: capacity_nodes.max(1),
        }
    }

    /// Adds one node's samples (its G completions with their advantages).
    pub fn push_node(&mut self, samples: Vec<S>) {
        self.nodes.push(samples);
    }

    pub fn nodes(&self) -> usize {
        self.nodes.len()
    }

    pub fn samples(&self) -> usize {
        self.nodes.iter().map(Vec::len).sum()
    }

    /// True once the buffer holds `rollout_buffer_size` nodes.
    pub fn is_ready(&self) -> bool {
        self.nodes.len() >= self.capacity_nodes
    }

    /// Empties the buffer: all samples shuffled with `rng`, in mini-batches of `batch_size` samples (one
    /// batch with everything when `None`). The last batch may be smaller.
    pub fn drain_minibatches<R: Rng + ?Sized>(
        &mut self,
        rng: &mut R,
        batch_size: Option<usize>,
    ) -> Vec<Vec<S>> {
        let mut all: Vec<S> = self.nodes.drain(..).flatten().collect();
        all.shuffle(rng);
        let size = batch_size.unwrap_or(all.len()).max(1);
        let mut out = Vec::new();
        let mut iter = all.into_iter().peekable();
        while iter.peek().is_some() {
            out.push(iter.by_ref().take(size).collect());
        }
        out
    }

    /// Empties the buffer as CoMLRL 2026 does (`train_batch_size` counting nodes): the nodes shuffled
    /// whole with `rng`, in mini-batches of `nodes_per_batch` nodes (one batch with everything when
    /// `None`), each batch the samples of its nodes.
    pub fn drain_node_minibatches<R: Rng + ?Sized>(
        &mut self,
        rng: &mut R,
        nodes_per_batch: Option<usize>,
    ) -> Vec<Vec<S>> {
        let mut nodes: Vec<Vec<S>> = self.nodes.drain(..).collect();
        nodes.shuffle(rng);
        let size = nodes_per_batch.unwrap_or(nodes.len()).max(1);
        let mut out = Vec::new();
        let mut iter = nodes.into_iter().peekable();
        while iter.peek().is_some() {
            out.push(iter.by_ref().take(size).flatten().collect());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn buffer_drains_every_sample_once_in_seeded_shuffled_minibatches() {
        let mut b = RolloutBuffer::new(2);
        b.push_node(vec![0, 1, 2, 3]);
        assert!(!b.is_ready());
        b.push_node(vec![4, 5, 6, 7]);
        assert!(b.is_ready());
        assert_eq!(b.samples(), 8);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let batches = b.drain_minibatches(&mut rng, Some(3));
        assert_eq!(
            batches.iter().map(Vec::len).collect::<Vec<_>>(),
            vec![3, 3, 2]
        );
        let mut all: Vec<i32> = batches.concat();
        assert_ne!(all, (0..8).collect::<Vec<_>>(), "shuffled");
        all.sort();
        assert_eq!(all, (0..8).collect::<Vec<_>>());
        assert_eq!(b.nodes(), 0);
        // Same seed, same order: resumable.
        let mut b2 = RolloutBuffer::new(2);
        b2.push_node(vec![0, 1, 2, 3]);
        b2.push_node(vec![4, 5, 6, 7]);
        let mut rng2 = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        assert_eq!(b2.drain_minibatches(&mut rng2, Some(3)), batches);
    }

    #[test]
    fn node_minibatches_keep_each_node_whole() {
        let mut b = RolloutBuffer::new(3);
        for n in 0..3 {
            b.push_node(vec![10 * n, 10 * n + 1, 10 * n + 2, 10 * n + 3]);
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let batches = b.drain_node_minibatches(&mut rng, Some(2));
        assert_eq!(
            batches.iter().map(Vec::len).collect::<Vec<_>>(),
            vec![8, 4],
            "2 nodes of G = 4, then 1"
        );
        for batch in &batches {
            for node in batch.chunks(4) {
                assert!(
                    node.iter().all(|s| s / 10 == node[0] / 10) && node[0] % 10 == 0,
                    "whole nodes in order: {batch:?}"
                );
            }
        }
        assert_eq!(b.nodes(), 0);
    }
}
