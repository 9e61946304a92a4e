//! The rollout of one step as a forest of nodes (docs/src/trainers/multi-turn.md).
//!
//! A node is one item at one turn with one prompt per agent: every agent samples `g` completions,
//! the node's joint actions are scored, and the node either stops (a leaf) or grows children whose
//! prompts the external transition builds from its joint actions. Single-turn training is the forest
//! of one root per item and nothing else.
//!
//! How a node grows ([`Expansion`]):
//! - `Tree` (current CoMLRL): a node whose mean processed reward is above `termination_threshold`
//!   is a leaf; otherwise one child per joint action. Returns R_j = r_j + γ·mean(returns of child j).
//! - `Handoff` (the September 2025 release): one child per node, its prompts built from one
//!   completion per agent (the best joint action, or each agent's own random pick); the episode stops
//!   early when the turn's mean reward reaches `early_termination_threshold`. Returns are the rewards.
//! - `Paths` (evaluation): every joint action continues its own path with one sample per agent,
//!   until the path's reward passes the stopping rule or the last turn.
//!
//! Everything here is pure: the trainer fills in samples and scores, this module decides leaves,
//! children, returns, advantages, turn weights and the order of updates, so tests can check the math
//! on hand-made trees.

use rand::Rng;

use crate::algo::{AdvantageOptions, JointAction, advantages, credit_per_agent, kl_shaped_returns};
use crate::config::{Handoff, JointMode};
use crate::metrics::mean;
use crate::prompts::multiturn::TurnRecord;
use crate::sources::{GenSample, Score};

/// One agent's prompt at a node.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AgentPrompt {
    /// The user text (before any chat template).
    pub text: String,
    /// What the model reads, tokenised.
    pub ids: Vec<u32>,
}

/// One node of the forest; see the module docs.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Node {
    pub id: usize,
    /// Position of the node's item in the step's items.
    pub item: usize,
    /// The creation order of the node within its item (seeds derive from it).
    pub local: usize,
    /// 0-based.
    pub turn: usize,
    pub parent: Option<usize>,
    /// The parent's joint action this node continues (tree and paths; best handoff).
    pub parent_joint: Option<usize>,
    /// Handoff: per agent, the parent's completion handed on.
    pub handoff: Option<Vec<usize>>,
    /// Samples per agent at this node.
    pub g: usize,
    pub prompts: Vec<AgentPrompt>,
    /// Per agent, the earlier turns on this node's path (oldest first).
    pub history: Vec<Vec<TurnRecord>>,
    /// History entries the prompt left out to fit the context (per agent, summed).
    pub truncated: usize,
    /// Why the expert gave no edits for this node's prompts (`expert_edits`), if it did not.
    pub expert_failure: Option<String>,
    /// Per agent, its `g` completions.
    pub samples: Vec<Vec<GenSample>>,
    pub actions: Vec<JointAction>,
    pub scores: Vec<Score>,
    /// Per joint action, after `reward_processor`.
    pub rewards: Vec<f64>,
    /// Per joint action.
    pub returns: Vec<f64>,
    /// Per agent, per completion, as used in the loss.
    pub advantages: Vec<Vec<f64>>,
    /// Per agent, per completion: Σ_t KL_t to the frozen reference, measured for
    /// `reference_kl.placement: returns` (empty otherwise).
    #[serde(default)]
    pub reference_kl: Vec<Vec<f64>>,
    /// Actor-critic trainers: per agent, per completion, the critic's rollout-time value and the
    /// TD target (empty otherwise).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub values: Vec<Vec<f64>>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub value_targets: Vec<Vec<f64>>,
    pub children: Vec<usize>,
    pub leaf: bool,
    /// A leaf before the last turn (the stopping rule fired).
    pub early_stop: bool,
    /// The loss weight of this node's samples.
    pub turn_weight: f64,
}

impl Node {
    /// A node with prompts and nothing sampled yet.
    pub fn new(
        id: usize,
        item: usize,
        local: usize,
        turn: usize,
        g: usize,
        prompts: Vec<AgentPrompt>,
        history: Vec<Vec<TurnRecord>>,
    ) -> Self {
        Self {
            id,
            item,
            local,
            turn,
            parent: None,
            parent_joint: None,
            handoff: None,
            g,
            prompts,
            history,
            truncated: 0,
            expert_failure: None,
            samples: Vec::new(),
            actions: Vec::new(),
            scores: Vec::new(),
            rewards: Vec::new(),
            returns: Vec::new(),
            advantages: Vec::new(),
            reference_kl: Vec::new(),
            values: Vec::new(),
            value_targets: Vec::new(),
            children: Vec::new(),
            leaf: false,
            early_stop: false,
            turn_weight: 1.0,
        }
    }

    pub fn mean_reward(&self) -> f64 {
        mean(&self.rewards)
    }

    /// The completion index of each agent in joint action `j`.
    pub fn joint(&self, j: usize) -> &[usize] {
        &self.actions[j]
    }
}

/// How nodes grow; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Expansion {
    Tree {
        termination_threshold: Option<f64>,
    },
    Handoff {
        handoff: Handoff,
        early_termination_threshold: Option<f64>,
    },
    Paths {
        stop_above: Option<f64>,
        inclusive: bool,
    },
}

/// What a non-leaf node's child continues from.
#[derive(Debug, Clone, PartialEq)]
pub struct ChildSpec {
    pub parent: usize,
    /// The joint action continued (tree, paths, best handoff).
    pub parent_joint: Option<usize>,
    /// Per agent, the parent's completion carried into the child's prompt.
    pub picks: Vec<usize>,
    /// Samples per agent at the child.
    pub g: usize,
}

/// Decides whether `node` (scored, at turn `node.turn` of `num_turns`) is a leaf and which children
/// it gets. `rng` draws random handoffs.
pub fn expand<R: Rng + ?Sized>(
    node: &mut Node,
    num_turns: usize,
    how: Expansion,
    rng: &mut R,
) -> Vec<ChildSpec> {
    let last = node.turn + 1 >= num_turns;
    let m = node.mean_reward();
    match how {
        Expansion::Tree {
            termination_threshold,
        } => {
            let stop = termination_threshold.is_some_and(|t| !node.rewards.is_empty() && m > t);
            node.leaf = last || stop;
            node.early_stop = stop && !last;
            if node.leaf {
                return Vec::new();
            }
            (0..node.actions.len())
                .map(|j| ChildSpec {
                    parent: node.id,
                    parent_joint: Some(j),
                    picks: node.actions[j].clone(),
                    g: node.g,
                })
                .collect()
        }
        Expansion::Handoff {
            handoff,
            early_termination_threshold,
        } => {
            let stop =
                early_termination_threshold.is_some_and(|t| !node.rewards.is_empty() && m >= t);
            node.leaf = last || stop;
            node.early_stop = stop && !last;
            if node.leaf {
                return Vec::new();
            }
            let (parent_joint, picks) = handoff_picks(node, handoff, rng);
            vec![ChildSpec {
                parent: node.id,
                parent_joint,
                picks,
                g: node.g,
            }]
        }
        Expansion::Paths {
            stop_above,
            inclusive,
        } => {
            let passes =
                |r: f64| stop_above.is_some_and(|t| if inclusive { r >= t } else { r > t });
            let children: Vec<ChildSpec> = if last {
                Vec::new()
            } else {
                (0..node.actions.len())
                    .filter(|&j| !passes(node.rewards[j]))
                    .map(|j| ChildSpec {
                        parent: node.id,
                        parent_joint: Some(j),
                        picks: node.actions[j].clone(),
                        g: 1,
                    })
                    .collect()
            };
            node.leaf = children.is_empty();
            node.early_stop = node.leaf && !last;
            children
        }
    }
}

/// The handoff of a node: `best` = the joint action with the highest reward (the first on ties, as
/// Python's `list.index(max(...))`); `random` = each agent one of its own completions, uniformly.
pub fn handoff_picks<R: Rng + ?Sized>(
    node: &Node,
    handoff: Handoff,
    rng: &mut R,
) -> (Option<usize>, Vec<usize>) {
    match handoff {
        Handoff::Best => {
            let mut best = 0;
            for (j, r) in node.rewards.iter().enumerate() {
                if *r > node.rewards[best] {
                    best = j;
                }
            }
            (Some(best), node.actions[best].clone())
        }
        Handoff::Random => (
            None,
            node.samples
                .iter()
                .map(|s| rng.random_range(0..s.len().max(1)))
                .collect(),
        ),
    }
}

/// The forest of one step, nodes in creation order (a child is always created after its parent).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Forest {
    pub nodes: Vec<Node>,
}

impl Forest {
    /// Appends another forest (another rank's share of a step): its node ids, parents and children
    /// move past this forest's nodes and its items past `item_offset`.
    pub fn absorb(&mut self, other: Forest, item_offset: usize) {
        let base = self.nodes.len();
        for mut n in other.nodes {
            n.id += base;
            n.item += item_offset;
            n.parent = n.parent.map(|p| p + base);
            n.children.iter_mut().for_each(|c| *c += base);
            self.nodes.push(n);
        }
    }

    /// The update groups of data-parallel ranks: one per turn, every turn of the run present (empty
    /// when this rank has no node of it), so that every rank runs the same optimiser rounds.
    pub fn groups_by_turn(&self, items: usize, turns: usize) -> Vec<Vec<usize>> {
        let order: Vec<usize> = (0..items).flat_map(|i| self.preorder(i)).collect();
        (0..turns.max(1))
            .map(|t| {
                order
                    .iter()
                    .copied()
                    .filter(|&i| self.nodes[i].turn == t)
                    .collect()
            })
            .collect()
    }

    /// Returns of every node: `discounted` (tree) R_j = r_j + γ·mean(returns of child j), R_j = r_j
    /// at leaves and for joint actions without a child; otherwise (handoff) R = r.
    pub fn compute_returns(&mut self, gamma: f64, discounted: bool) {
        for id in (0..self.nodes.len()).rev() {
            let mut returns = self.nodes[id].rewards.clone();
            if discounted {
                for &c in &self.nodes[id].children {
                    let child = &self.nodes[c];
                    if let Some(j) = child.parent_joint {
                        returns[j] += gamma * mean(&child.returns);
                    }
                }
            }
            self.nodes[id].returns = returns;
        }
    }

    /// Advantages over each node's siblings, per agent: each completion's credit (aligned: its joint
    /// action's return; cross: the sum over the joint actions that contain it), with `kl_coef`
    /// (`reference_kl.placement: returns`) less coef·its `reference_kl` ([`kl_shaped_returns`]; a node
    /// without them is left as it is), then the configured advantage mode.
    pub fn compute_advantages(
        &mut self,
        num_agents: usize,
        opts: &AdvantageOptions,
        kl_coef: Option<f64>,
    ) {
        for node in &mut self.nodes {
            let mut credit = credit_per_agent(opts.joint_mode, num_agents, node.g, &node.returns);
            if let Some(coef) = kl_coef {
                for (c, kl) in credit.iter_mut().zip(&node.reference_kl) {
                    *c = kl_shaped_returns(c, kl, coef);
                }
            }
            node.advantages = credit
                .iter()
                .map(|c| advantages(c, opts.mode, opts.normalize, opts.clamp))
                .collect();
        }
    }

    /// Loss weight of every node: `turn_gradient_weights[turn]`, times `early_termination_weight`
    /// for the last node of an episode that stopped early (`apply_early`, the handoff variant).
    pub fn assign_turn_weights(
        &mut self,
        weights: &[f64],
        early_termination_weight: f64,
        apply_early: bool,
    ) {
        for node in &mut self.nodes {
            let w = weights.get(node.turn).copied().unwrap_or(1.0);
            node.turn_weight = if apply_early && node.early_stop {
                w * early_termination_weight
            } else {
                w
            };
        }
    }

    /// The nodes of `item` in depth-first pre-order (the order the original creates and buffers them).
    pub fn preorder(&self, item: usize) -> Vec<usize> {
        let mut out = Vec::new();
        let mut stack: Vec<usize> = self
            .nodes
            .iter()
            .filter(|n| n.item == item && n.parent.is_none())
            .map(|n| n.id)
            .rev()
            .collect();
        while let Some(id) = stack.pop() {
            out.push(id);
            stack.extend(self.nodes[id].children.iter().rev());
        }
        out
    }

    /// The groups of nodes that make one optimiser update each, in order.
    ///
    /// Tree (current CoMLRL): each agent's buffer receives the nodes item after item in pre-order and
    /// is processed whenever it holds `buffer_nodes` nodes (and at the end of the step): its nodes are
    /// grouped by turn, one update per turn, first turn first. Handoff (September 2025): one update
    /// per turn over the step's items, first turn first.
    pub fn update_groups(
        &self,
        items: usize,
        buffer_nodes: usize,
        per_turn_over_step: bool,
    ) -> Vec<Vec<usize>> {
        let by_turn = |ids: &[usize]| -> Vec<Vec<usize>> {
            let max_turn = ids.iter().map(|&i| self.nodes[i].turn).max().unwrap_or(0);
            (0..=max_turn)
                .map(|t| {
                    ids.iter()
                        .copied()
                        .filter(|&i| self.nodes[i].turn == t)
                        .collect::<Vec<usize>>()
                })
                .filter(|g| !g.is_empty())
                .collect()
        };
        let order: Vec<usize> = (0..items).flat_map(|i| self.preorder(i)).collect();
        if per_turn_over_step {
            return by_turn(&order);
        }
        order
            .chunks(buffer_nodes.max(1))
            .flat_map(by_turn)
            .collect()
    }
}

/// The joint actions of a node of `g` samples per agent: `aligned` or `cross` (Cartesian product).
pub fn node_actions(mode: JointMode, num_agents: usize, g: usize) -> Vec<JointAction> {
    crate::algo::joint_actions(mode, num_agents, g)
}

/// The most nodes one item's tree can have: Σ_{t<T} b^t with b = G (aligned) or G^N (cross) children
/// per node.
pub fn max_tree_nodes(mode: JointMode, num_agents: usize, g: usize, turns: usize) -> u128 {
    let b: u128 = match mode {
        JointMode::Aligned => g as u128,
        JointMode::Cross => (g as u128).saturating_pow(num_agents as u32),
    };
    (0..turns)
        .map(|t| b.saturating_pow(t as u32))
        .fold(0u128, u128::saturating_add)
}
