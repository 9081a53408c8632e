//! The arithmetic of the local modes, sans IO: what a member contributes
//! to an outer sync and what it does with the sum of every member's
//! contribution. The trainer all-reduces (sums) the contributions between
//! [`OuterRule::contribution`] and [`OuterRule::apply`].

/// How parameters are reconciled every `every` local steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OuterRule {
    /// Local SGD: the parameters become the members' average.
    Average,
    /// DiLoCo: the members' average drift from the anchor (the parameters
    /// at the last outer sync) is a pseudo-gradient for an outer SGD step
    /// with Nesterov momentum (published defaults: lr 0.7, momentum 0.9).
    Nesterov {
        /// Outer learning rate.
        lr: f32,
        /// Outer momentum.
        momentum: f32,
    },
}

impl OuterRule {
    /// This member's contribution to the sum: its parameters (local SGD)
    /// or its drift `anchor - params` (DiLoCo), written into `out`.
    pub fn contribution(&self, params: &[f32], anchor: &[f32], out: &mut [f32]) {
        match self {
            OuterRule::Average => out.copy_from_slice(params),
            OuterRule::Nesterov { .. } => {
                for ((o, p), a) in out.iter_mut().zip(params).zip(anchor) {
                    *o = a - p;
                }
            }
        }
    }

    /// Applies the outer step from `sum` (every member's contribution
    /// summed over `world` members): the parameters, the anchor and the
    /// momentum all leave equal on every member that applies the same sum.
    pub fn apply(&self, sum: &[f32], world: usize, params: &mut [f32], anchor: &mut [f32], momentum: &mut [f32]) {
        let scale = 1.0 / world.max(1) as f32;
        match *self {
            OuterRule::Average => {
                for (p, s) in params.iter_mut().zip(sum) {
                    *p = s * scale;
                }
                anchor.copy_from_slice(params);
            }
            OuterRule::Nesterov { lr, momentum: mu } => {
                // torch.optim.SGD(nesterov=True): buf = mu*buf + g; p -= lr*(g + mu*buf).
                for ((a, m), s) in anchor.iter_mut().zip(momentum.iter_mut()).zip(sum) {
                    let g = s * scale;
                    *m = mu * *m + g;
                    *a -= lr * (g + mu * *m);
                }
                params.copy_from_slice(anchor);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outer_sync(rule: OuterRule, members: &mut [Vec<f32>], anchor: &mut Vec<f32>, momentum: &mut Vec<f32>) {
        let n = anchor.len();
        let mut sum = vec![0.0; n];
        for params in members.iter() {
            let mut out = vec![0.0; n];
            rule.contribution(params, anchor, &mut out);
            sum.iter_mut().zip(&out).for_each(|(s, o)| *s += o);
        }
        let (a0, m0) = (anchor.clone(), momentum.clone());
        let world = members.len();
        for params in members.iter_mut() {
            // Every member applies the same sum to its own copy of the outer state.
            let (mut a, mut m) = (a0.clone(), m0.clone());
            rule.apply(&sum, world, params, &mut a, &mut m);
            *anchor = a;
            *momentum = m;
        }
    }

    #[test]
    fn local_sgd_averages_the_members_parameters() {
        let mut members = vec![vec![1.0, 4.0], vec![3.0, 0.0]];
        let (mut anchor, mut momentum) = (vec![0.0; 2], vec![0.0; 2]);
        outer_sync(OuterRule::Average, &mut members, &mut anchor, &mut momentum);
        assert_eq!(members, vec![vec![2.0, 2.0], vec![2.0, 2.0]]);
        assert_eq!(anchor, vec![2.0, 2.0]);
    }

    #[test]
    fn diloco_takes_a_nesterov_step_on_the_average_drift() {
        let rule = OuterRule::Nesterov { lr: 0.7, momentum: 0.9 };
        // Anchor 1.0; members drifted to 0.0 and 0.5: average drift 0.75.
        let mut members = vec![vec![0.0], vec![0.5]];
        let (mut anchor, mut momentum) = (vec![1.0], vec![0.0]);
        outer_sync(rule, &mut members, &mut anchor, &mut momentum);
        // buf = 0.75; step = 0.7 * (0.75 + 0.9 * 0.75) = 0.9975.
        assert!((momentum[0] - 0.75).abs() < 1e-6);
        assert!((anchor[0] - 0.0025).abs() < 1e-6, "{anchor:?}");
        assert_eq!(members[0], anchor);
        assert_eq!(members[1], anchor);
        // A second sync with no drift still moves by momentum alone.
        outer_sync(rule, &mut members, &mut anchor, &mut momentum);
        assert!((momentum[0] - 0.675).abs() < 1e-6);
        assert!((anchor[0] - (0.0025 - 0.7 * 0.9 * 0.675)).abs() < 1e-5, "{anchor:?}");
    }

    #[test]
    fn diloco_with_lr_1_and_no_momentum_is_local_sgd() {
        let rule = OuterRule::Nesterov { lr: 1.0, momentum: 0.0 };
        let mut members = vec![vec![1.0, 4.0], vec![3.0, 0.0]];
        let (mut anchor, mut momentum) = (vec![5.0, -1.0], vec![0.0; 2]);
        outer_sync(rule, &mut members, &mut anchor, &mut momentum);
        assert_eq!(members[0], vec![2.0, 2.0]);
    }
}
