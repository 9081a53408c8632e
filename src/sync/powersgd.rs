//! PowerSGD (Vogels et al., 2019; PyTorch's `batched_powerSGD_hook`): each
//! bucket, as a square matrix `M` (zero-padded), is sent as two thin
//! factors `P = M Q` and `Q = M^T P` of rank `r`, `2 * side * r` elements
//! instead of `side^2`; what the approximation misses is added back into
//! the next step's gradient (error feedback), and `Q` carries over between
//! steps (warm start). Before `start_iter` synced steps, and for buckets
//! too small to gain `min_compression_rate`, it averages plainly.
//!
//! The second round depends on the first's result, so it cannot be
//! submitted inside [`CommHook::reduce`]: it goes to a subgroup of its own
//! (own actor, own numbering), each bucket's after the previous bucket's,
//! so every rank submits the same sequence there.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use chorus_actors::driver::CollectiveError;
use chorus_runtime::collective::{DType, ReduceOp};
use tokio::sync::oneshot;

use super::hook::{Average, BucketInfo, CommHook, HookFuture};
use crate::group::{InitError, ProcessGroup};
use crate::tensor::Tensor;

/// PowerSGD's settings (PyTorch's `PowerSGDState` defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PowerSgdOptions {
    /// Rank of the approximation (`matrix_approximation_rank`: 1).
    pub rank: usize,
    /// Synced steps averaged plainly first (`start_powerSGD_iter`: 1000).
    pub start_iter: u64,
    /// A bucket is compressed only if it shrinks by at least this (2.0).
    pub min_compression_rate: f64,
    /// Add the approximation error to the next step's gradient (true).
    pub error_feedback: bool,
    /// Keep `Q` from the previous step (true); otherwise drawn afresh.
    pub warm_start: bool,
}

impl Default for PowerSgdOptions {
    fn default() -> Self {
        Self {
            rank: 1,
            start_iter: 1000,
            min_compression_rate: 2.0,
            error_feedback: true,
            warm_start: true,
        }
    }
}

/// Per bucket: `Q` (side x r, row-major) and the error (side^2).
#[derive(Default)]
struct BucketState {
    q: Vec<f32>,
    error: Vec<f32>,
}

/// The PowerSGD hook for `f32` buckets (others are averaged).
pub struct PowerSgd {
    options: PowerSgdOptions,
    second: Arc<ProcessGroup>,
    states: Arc<Mutex<HashMap<(usize, usize), BucketState>>>,
    /// Fires once the previous compressed bucket submitted its second round.
    previous: Option<oneshot::Receiver<()>>,
    sent: Arc<AtomicU64>,
}

impl std::fmt::Debug for PowerSgd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PowerSgd").field("options", &self.options).finish()
    }
}

impl PowerSgd {
    /// The hook for `group` (every rank calls it: it forms the subgroup
    /// for the second round).
    pub async fn new(group: &ProcessGroup, options: PowerSgdOptions) -> Result<Self, InitError> {
        let all: Vec<usize> = (0..group.world_size()).collect();
        let second = group
            .new_group(&all)
            .await?
            .ok_or_else(|| InitError::Subgroup("this rank is missing from a group of every rank".into()))?;
        Ok(Self {
            options: PowerSgdOptions {
                rank: options.rank.max(1),
                ..options
            },
            second: Arc::new(second),
            states: Arc::default(),
            previous: None,
            sent: Arc::default(),
        })
    }

    /// Elements this rank has sent so far (both rounds, and plain averages).
    pub fn sent_elements(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }
}

/// The same pseudo-random `Q` on every rank (a fixed-seed generator).
fn initial_q(len: usize, seed: u64) -> Vec<f32> {
    let mut state = seed ^ 0x9e37_79b9_7f4a_7c15;
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect()
}

/// Orthonormalizes the `r` columns of `p` (side x r, row-major) in place.
fn orthogonalize(p: &mut [f32], side: usize, r: usize) {
    for c in 0..r {
        for prev in 0..c {
            let dot: f32 = (0..side).map(|i| p[i * r + c] * p[i * r + prev]).sum();
            (0..side).for_each(|i| p[i * r + c] -= dot * p[i * r + prev]);
        }
        let norm = (0..side)
            .map(|i| p[i * r + c] * p[i * r + c])
            .sum::<f32>()
            .sqrt()
            .max(1e-8);
        (0..side).for_each(|i| p[i * r + c] /= norm);
    }
}

impl CommHook for PowerSgd {
    fn reduce(&mut self, group: &ProcessGroup, bucket: BucketInfo, data: Tensor) -> HookFuture {
        let n = data.len();
        let side = (n as f64).sqrt().ceil() as usize;
        let r = self.options.rank.min(side.max(1));
        let worth = (n as f64) >= self.options.min_compression_rate * (2 * side * r) as f64;
        if data.dtype() != DType::Float32 || bucket.step < self.options.start_iter || !worth || n == 0 {
            self.sent.fetch_add(n as u64, Ordering::Relaxed);
            return Average.reduce(group, bucket, data);
        }
        let world = group.world_size() as f32;
        let mut m: Vec<f32> = bytemuck::pod_collect_to_vec(data.as_bytes());
        m.resize(side * side, 0.0);
        let key = (bucket.index, n);
        let q = {
            let mut states = self.states.lock().expect("powersgd state");
            let state = states.entry(key).or_default();
            if self.options.error_feedback && state.error.len() == m.len() {
                m.iter_mut().zip(&state.error).for_each(|(x, e)| *x += e);
            }
            if !self.options.warm_start || state.q.len() != side * r {
                state.q = initial_q(side * r, bucket.step.wrapping_mul(31).wrapping_add(bucket.index as u64));
            }
            state.q.clone()
        };
        // P = M Q, summed over the ranks (submitted now, in bucket order).
        let mut p = vec![0f32; side * r];
        for i in 0..side {
            for c in 0..r {
                p[i * r + c] = (0..side).map(|j| m[i * side + j] * q[j * r + c]).sum();
            }
        }
        let p_work = group.all_reduce(Tensor::from_slice(&p), ReduceOp::Sum);
        self.sent.fetch_add(2 * (side * r) as u64, Ordering::Relaxed);
        let previous = self.previous.take();
        let (done, next) = oneshot::channel();
        self.previous = Some(next);
        let (second, states, options) = (self.second.clone(), self.states.clone(), self.options);
        let broken = |reason: String| CollectiveError::Broken(reason);
        Box::pin(async move {
            let mut p = p_work.await?.to_vec::<f32>().map_err(|e| broken(e.to_string()))?;
            orthogonalize(&mut p, side, r);
            // Q = M^T P, summed over the ranks, after the previous bucket's.
            let mut q = vec![0f32; side * r];
            // Row by row: M is row-major, so this reads it in order.
            for i in 0..side {
                let row = &m[i * side..(i + 1) * side];
                for c in 0..r {
                    let pic = p[i * r + c];
                    row.iter().enumerate().for_each(|(j, x)| q[j * r + c] += x * pic);
                }
            }
            if let Some(previous) = previous {
                // A dropped sender means that bucket failed before its turn; go on.
                let _ = previous.await;
            }
            let q_work = second.all_reduce(Tensor::from_slice(&q), ReduceOp::Sum);
            let _ = done.send(());
            let q: Vec<f32> = q_work.await?.to_vec::<f32>().map_err(|e| broken(e.to_string()))?;
            // This rank's share of the average: P Q^T / world.
            let mut approx = vec![0f32; side * side];
            for i in 0..side {
                for j in 0..side {
                    approx[i * side + j] = (0..r).map(|c| p[i * r + c] * q[j * r + c]).sum::<f32>() / world;
                }
            }
            {
                let mut states = states.lock().expect("powersgd state");
                let state = states.entry(key).or_default();
                if options.error_feedback {
                    // What this rank's gradient lost: its input minus its share.
                    state.error = m.iter().zip(&approx).map(|(x, a)| x - a).collect();
                }
                state.q = q;
            }
            approx.truncate(n);
            Ok(Tensor::from_slice(&approx))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_come_out_orthonormal_and_q_is_the_same_for_a_seed() {
        let (side, r) = (5, 2);
        let mut p: Vec<f32> = (0..side * r).map(|i| (i as f32 * 1.7).sin() + 0.2).collect();
        orthogonalize(&mut p, side, r);
        let dot = |a: usize, b: usize| (0..side).map(|i| p[i * r + a] * p[i * r + b]).sum::<f32>();
        assert!((dot(0, 0) - 1.0).abs() < 1e-5 && (dot(1, 1) - 1.0).abs() < 1e-5);
        assert!(dot(0, 1).abs() < 1e-5);
        let mut zero = vec![0f32; side];
        orthogonalize(&mut zero, side, 1);
        assert!(zero.iter().all(|x| x.is_finite()));
        assert_eq!(initial_q(7, 3), initial_q(7, 3));
        assert_ne!(initial_q(7, 3), initial_q(7, 4));
    }
}
