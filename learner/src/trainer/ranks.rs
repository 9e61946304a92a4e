//! The learner's ranks in the trainer: where each rank's work lies ([`Layout`]), the step's forest
//! gathered on rank 0, and weights kept identical across ranks.

use std::time::Instant;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use tracing::info;

use super::setup::Trainer;
use super::tree::Forest;
use crate::dist::Collective;
use crate::dist::rank_share;
use crate::error::TrainError;
use crate::prompts::items::TrainItem;
use crate::sources::WeightPush;

/// Where a rank's work lies. Data placement: the step's items are split into one shard per rank and
/// every rank trains every policy on its shard. Agent placement (`learner.placement: agent`, P
/// policies on P·D ranks): rank r computes only policy r / D's gradients, on shard r mod D of D; every
/// rank still holds every policy and applies every policy's summed gradients, so all ranks stay
/// identical.
#[derive(Debug, Clone, Copy)]
pub(super) struct Layout {
    pub(super) shards: usize,
    pub(super) shard: usize,
    /// Agent placement: the one policy this rank computes gradients for.
    pub(super) own: Option<usize>,
}

impl Trainer {
    /// How this rank's work is placed (see [`Layout`]).
    pub(super) fn layout(&self) -> Layout {
        let (rank, world) = (self.dist.rank(), self.dist.world());
        match self.s.cfg.raw.learner.placement {
            crate::config::Placement::Agent if world > 1 => {
                let shards = (world / self.s.policies.len().max(1)).max(1);
                Layout {
                    shards,
                    shard: rank % shards,
                    own: Some(rank / shards),
                }
            }
            _ => Layout {
                shards: world,
                shard: rank,
                own: None,
            },
        }
    }

    /// Pushes every policy's current weights to the rollout workers, as a version above anything
    /// they serve (a remote worker may hold an older run's weights). With several ranks, rank 0
    /// pushes and every rank learns the version.
    pub fn sync_all_weights(&mut self) -> Result<f64, TrainError> {
        let t = Instant::now();
        let mut versions = vec![0; self.s.policies.len()];
        if self.dist.is_root() {
            for (p, v) in self.s.policies.iter().zip(&mut versions) {
                let served = self.s.rollout.policy_version(&p.worker_agent)?;
                *v = served.max(p.wire_version) + 1;
            }
            let params: Vec<_> = self.s.policies.iter().map(|p| p.parameters()).collect();
            let probes = self
                .s
                .policies
                .iter()
                .map(|p| p.weight_probe())
                .collect::<Result<Vec<_>, _>>()?;
            let updates: Vec<WeightPush> = self
                .s
                .policies
                .iter()
                .zip(&versions)
                .zip(&params)
                .zip(&probes)
                .map(|(((p, &version), params), probe)| WeightPush {
                    agent: &p.worker_agent,
                    version,
                    params,
                    lora_scaling: p.lora_scaling(),
                    probe: Some(probe),
                })
                .collect();
            self.s.rollout.push_weights_all(&updates)?;
        }
        for (pi, v) in versions.into_iter().enumerate() {
            self.s.policies[pi].wire_version = self.dist.broadcast_u64(v, 0)?;
        }
        Ok(t.elapsed().as_secs_f64())
    }

    /// The learner's ranks.
    pub fn collective(&self) -> &dyn Collective {
        self.dist.as_ref()
    }

    /// Gives every rank rank 0's weights, optimiser moments (when rank 0 has them: after a resume)
    /// and train state, so that all ranks start identical.
    pub fn sync_ranks(&mut self) -> Result<(), TrainError> {
        if self.dist.world() == 1 {
            return Ok(());
        }
        let mut state = serde_json::to_vec(&serde_json::json!({
            "step": self.step, "epoch": self.epoch, "position": self.position,
            "rng_seed": self.rng_seed, "rng_word_pos": self.rng.get_word_pos().to_string(),
            "moments": self.optimizers().iter().map(|o| o.has_state() && o.step > 0).collect::<Vec<_>>(),
            "optimizer_steps": self.optimizers().iter().map(|o| o.step).collect::<Vec<_>>(),
        }))
        .map_err(|e| TrainError::Dist(e.to_string()))?;
        let d = self.dist.as_ref();
        d.broadcast_bytes(&mut state, 0)?;
        let st: serde_json::Value = serde_json::from_slice(&state)
            .map_err(|e| TrainError::Dist(format!("rank 0's train state: {e}")))?;
        let num = |k: &str| {
            st[k]
                .as_u64()
                .ok_or_else(|| TrainError::Dist(format!("rank 0's train state lacks {k}")))
        };
        self.step = num("step")?;
        self.epoch = num("epoch")?;
        self.position = num("position")?;
        self.rng_seed = num("rng_seed")?;
        self.rng = ChaCha8Rng::seed_from_u64(self.rng_seed);
        self.rng.set_word_pos(
            st["rng_word_pos"]
                .as_str()
                .and_then(|w| w.parse().ok())
                .unwrap_or(0),
        );
        // Every optimiser's tensors: the policies', then the actor-critic trainers' critics and value heads.
        for (i, o) in Self::optimizers_mut(&mut self.s.policies, &mut self.critics, &mut self.heads)
            .into_iter()
            .enumerate()
        {
            crate::dist::broadcast_tensors(d, &o.parameters(), 0)?;
            if st["moments"][i].as_bool() == Some(true) {
                crate::dist::broadcast_tensors(d, &o.moments_mut(), 0)?;
                o.step = st["optimizer_steps"][i].as_u64().unwrap_or(o.step);
            }
        }
        // The actor-critic trainers' partly filled buffer (rank 0's, from its checkpoint).
        if self.s.cfg.algorithm.is_actor_critic() {
            let mut buffer = serde_json::to_vec(&self.ac_buffer).map_err(|e| {
                TrainError::Dist(format!("serialising the actor-critic buffer: {e}"))
            })?;
            d.broadcast_bytes(&mut buffer, 0)?;
            self.ac_buffer = serde_json::from_slice(&buffer)
                .map_err(|e| TrainError::Dist(format!("rank 0's actor-critic buffer: {e}")))?;
        }
        info!(
            rank = d.rank(),
            world = d.world(),
            backend = d.backend(),
            step = self.step,
            "ranks start from rank 0's state"
        );
        Ok(())
    }

    /// Compares the policies' weights (and the actor-critic trainers' critics and value heads)
    /// over the ranks (see [`crate::dist::check_same`]).
    pub(super) fn check_ranks_agree(&self) -> Result<(), TrainError> {
        let step = self.step;
        for p in &self.s.policies {
            crate::dist::check_same(
                self.dist.as_ref(),
                &format!("policy `{}` after step {step}", p.worker_agent),
                &p.optimizer.parameters(),
            )?;
        }
        for (i, c) in self.critics.iter().enumerate() {
            let mut params = c.optimizer.parameters();
            params.extend(c.head.optimizer.parameters());
            crate::dist::check_same(
                self.dist.as_ref(),
                &format!("critic {i} (`{}`) after step {step}", c.spec),
                &params,
            )?;
        }
        for (i, h) in self.heads.iter().enumerate() {
            crate::dist::check_same(
                self.dist.as_ref(),
                &format!("value head of policy {i} after step {step}"),
                &h.optimizer.parameters(),
            )?;
        }
        Ok(())
    }

    /// Rank 0 receives every rank's forest of this step (merged in rank order, with the items of
    /// [`rank_share`] in the same order); other ranks get an empty forest back.
    pub(super) fn gather_step(
        &self,
        forest: Forest,
        rows: &[usize],
    ) -> Result<(Forest, Vec<TrainItem>), TrainError> {
        let bytes = serde_json::to_vec(&forest)
            .map_err(|e| TrainError::Dist(format!("serialising the step's rollouts: {e}")))?;
        let all = self.dist.all_gather_bytes(&bytes)?;
        if !self.dist.is_root() {
            return Ok((Forest::default(), Vec::new()));
        }
        let shards = self.layout().shards;
        let (mut merged, mut items) = (Forest::default(), Vec::new());
        // Ranks 0..shards hold one shard each (under agent placement the others hold copies).
        for (rank, b) in all.iter().enumerate().take(shards) {
            let part: Forest = serde_json::from_slice(b)
                .map_err(|e| TrainError::Dist(format!("rank {rank}'s rollouts: {e}")))?;
            merged.absorb(part, items.len());
            items.extend(
                rank_share(rows, rank, shards)
                    .iter()
                    .map(|&r| self.s.train_items[r].clone()),
            );
        }
        Ok((merged, items))
    }
}
