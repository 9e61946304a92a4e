//! Joint actions: which completion of each agent forms each scored joint action, and how the joint
//! rewards are credited back to each agent's completions.

use crate::config::JointMode;

/// One completion index per agent.
pub type JointAction = Vec<usize>;

/// The joint actions of one node where each of `num_agents` agents sampled `g` completions.
/// `aligned`: j → (j, j, ..., j), G actions. `cross`: the Cartesian product, G^N actions, in
/// lexicographic order with agent 0 most significant (action index = Σ_i k_i·G^(N−1−i)).
pub fn joint_actions(mode: JointMode, num_agents: usize, g: usize) -> Vec<JointAction> {
    match mode {
        JointMode::Aligned => (0..g).map(|j| vec![j; num_agents]).collect(),
        JointMode::Cross => {
            let total = g.pow(num_agents as u32);
            (0..total)
                .map(|mut idx| {
                    let mut action = vec![0; num_agents];
                    for slot in action.iter_mut().rev() {
                        *slot = idx % g;
                        idx /= g;
                    }
                    action
                })
                .collect()
        }
    }
}

/// Per agent, per completion: the return credited to that completion. `aligned`: completion j gets the
/// return of joint action j. `cross`: completion k of agent i gets the SUM of the returns of every joint
/// action that contains it (G^(N−1) of them). `returns[a]` belongs to `joint_actions(mode, N, g)[a]`.
pub fn credit_per_agent(
    mode: JointMode,
    num_agents: usize,
    g: usize,
    returns: &[f64],
) -> Vec<Vec<f64>> {
    let actions = joint_actions(mode, num_agents, g);
    assert_eq!(actions.len(), returns.len(), "one return per joint action");
    let mut credit = vec![vec![0.0; g]; num_agents];
    for (action, r) in actions.iter().zip(returns) {
        for (agent, &k) in action.iter().enumerate() {
            credit[agent][k] += r;
        }
    }
    credit
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cross_enumerates_the_cartesian_product() {
        let a = joint_actions(JointMode::Cross, 2, 3);
        assert_eq!(a.len(), 9);
        assert_eq!(a[0], vec![0, 0]);
        assert_eq!(a[1], vec![0, 1]);
        assert_eq!(a[5], vec![1, 2]);
        assert_eq!(a[8], vec![2, 2]);
        assert_eq!(joint_actions(JointMode::Cross, 3, 2).len(), 8);
        assert_eq!(
            joint_actions(JointMode::Aligned, 3, 2),
            vec![vec![0, 0, 0], vec![1, 1, 1]]
        );
    }

    #[test]
    fn cross_credit_sums_the_returns_of_the_joint_actions_containing_a_completion() {
        // G = 2, N = 2, returns of (0,0) (0,1) (1,0) (1,1) = 1, 2, 3, 4.
        // agent 0: k=0 → 1+2 = 3, k=1 → 3+4 = 7; agent 1: k=0 → 1+3 = 4, k=1 → 2+4 = 6.
        let c = credit_per_agent(JointMode::Cross, 2, 2, &[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(c, vec![vec![3.0, 7.0], vec![4.0, 6.0]]);
        let a = credit_per_agent(JointMode::Aligned, 2, 2, &[1.0, 2.0]);
        assert_eq!(a, vec![vec![1.0, 2.0], vec![1.0, 2.0]]);
    }
}
