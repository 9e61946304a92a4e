//! `RUN_DIR/rollouts.jsonl` (`logging.rollouts: true`): one JSON line per node of every step's
//! forest, so users can read what their agents learned from and tests can check the math
//! independently of the trainer.

use std::io::Write;
use std::path::Path;

use super::TrainItem;
use super::tree::Forest;

/// One node as a JSON object (the fields the README documents).
pub fn node_json(step: u64, forest: &Forest, id: usize, items: &[&TrainItem]) -> serde_json::Value {
    let node = &forest.nodes[id];
    let agents: Vec<serde_json::Value> = node
        .prompts
        .iter()
        .zip(&node.samples)
        .map(|(p, s)| serde_json::json!({ "prompt": p.text, "completions": s.iter().map(|c| c.text.as_str()).collect::<Vec<_>>() }))
        .collect();
    let mut line = serde_json::json!({
        "step": step,
        "item_index": items[node.item].index,
        "node_id": node.id,
        "parent_id": node.parent,
        "parent_joint": node.parent_joint,
        "handoff": node.handoff,
        "turn": node.turn + 1,
        "agents": agents,
        "joint_actions": node.actions,
        "raw_rewards": node.scores.iter().map(|s| s.reward).collect::<Vec<_>>(),
        "rewards": node.rewards,
        "returns": node.returns,
        "advantages": node.advantages,
        "leaf": node.leaf,
        "early_stop": node.early_stop,
        "turn_weight": node.turn_weight,
        "history_truncated": node.truncated,
        "expert_failure": node.expert_failure,
    });
    // The actor-critic trainers' critic values and TD targets (`advantages` is then y − V).
    if !node.values.is_empty() {
        line["values"] = serde_json::json!(node.values);
        line["value_targets"] = serde_json::json!(node.value_targets);
    }
    line
}

/// Appends every node of `forest` (items in order, each in pre-order) to `path`.
pub fn append(
    path: &Path,
    step: u64,
    forest: &Forest,
    items: &[&TrainItem],
) -> std::io::Result<()> {
    let mut out = String::new();
    for i in 0..items.len() {
        for id in forest.preorder(i) {
            out.push_str(&node_json(step, forest, id, items).to_string());
            out.push('\n');
        }
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    f.write_all(out.as_bytes())
}
