//! Silent data corruption, sans IO: the decisions [`train`](super::train)
//! takes from what the members exchanged, and the bit flips a
//! `corrupt(rank=R, step=S, ...)` fault rule asks for.
//!
//! - **State**: every [`IntegrityOptions::cadence`] steps each member
//!   sends a checksum per state tensor (parameters, buffers, optimizer
//!   state; not the extras, where a job may keep per-rank RNG or data
//!   positions); [`judge_state`] finds the members that disagree with
//!   a strict majority. With no majority (two members, or a tie) no one
//!   can tell which copy is right: training stops, naming both.
//! - **Gradients**: with the commit vote each member sends the norm of its
//!   local gradient (taken before it is summed with the others');
//!   [`grad_outliers`] names a non-finite one, or one far above the
//!   others' median (a flipped exponent bit multiplies an element by up to
//!   2^128).
//! - **Cadence**: [`next_interval`] spaces the state checks so that their
//!   cost (the checksums and the exchange, as measured at the last check)
//!   stays within a budget of the step time (1% by default).

use chorus_runtime::collective::DType;
pub use chorus_transports::fault::{StateCorruption, StateTarget};

use crate::sync::{ParamBuffer, Parameters};

/// How often the state is checked.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Cadence {
    /// Spaced so that a check costs at most this fraction of the steps
    /// between two checks (see [`next_interval`]).
    Budget(f64),
    /// Every this many steps.
    Every(u64),
    /// Never (the gradient check stays on).
    Off,
}

/// What [`train`](super::train) checks against silent corruption (DDP only:
/// in the local modes replicas differ by design between outer syncs).
#[derive(Debug, Clone, PartialEq)]
pub struct IntegrityOptions {
    /// How often the members' state is compared.
    pub cadence: Cadence,
    /// A member whose local gradient norm exceeds the median of the
    /// others' by this factor is named an outlier; 0 turns the gradient
    /// check off.
    pub grad_outlier: f64,
}

impl Default for IntegrityOptions {
    fn default() -> Self {
        Self {
            cadence: Cadence::Budget(0.01),
            grad_outlier: 100.0,
        }
    }
}

/// The steps between two state checks before any cost is measured.
pub const FIRST_INTERVAL: u64 = 10;
/// The most steps between two state checks under a budget.
pub const MAX_INTERVAL: u64 = 1000;

/// The steps until the next state check, the same on every member (it
/// depends only on what they exchanged): under [`Cadence::Budget`] the
/// slowest member's last check cost over the budget's share of the
/// slowest member's step, clamped to `1..=`[`MAX_INTERVAL`];
/// [`FIRST_INTERVAL`] while a cost or a step time is not known yet.
pub fn next_interval(cadence: Cadence, costs_ns: &[u64], steps_ns: &[u64]) -> Option<u64> {
    match cadence {
        Cadence::Off => None,
        Cadence::Every(every) => Some(every.max(1)),
        Cadence::Budget(budget) => {
            let (cost, step) = (costs_ns.iter().max(), steps_ns.iter().max());
            let (Some(&cost), Some(&step)) = (cost, step) else {
                return Some(FIRST_INTERVAL);
            };
            if cost == 0 || step == 0 || budget <= 0.0 {
                return Some(FIRST_INTERVAL);
            }
            let steps = (cost as f64 / (budget * step as f64)).ceil();
            Some((steps as u64).clamp(1, MAX_INTERVAL))
        }
    }
}

/// What the members' state checksums say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StateVerdict {
    /// Every member holds the same state.
    Agree,
    /// These members differ from a strict majority: `(rank, index of the
    /// first entry that differs)`.
    Outvoted(Vec<(usize, usize)>),
    /// The members differ and no strict majority holds one state.
    NoMajority {
        /// The first entry that differs between the first two distinct
        /// states.
        entry: usize,
    },
}

/// Judges the members' rows of per-entry checksums (one row per rank).
pub fn judge_state(rows: &[Vec<u64>]) -> StateVerdict {
    let Some(first) = rows.first() else {
        return StateVerdict::Agree;
    };
    if rows.iter().all(|row| row == first) {
        return StateVerdict::Agree;
    }
    let count = |row: &Vec<u64>| rows.iter().filter(|r| *r == row).count();
    let majority = rows.iter().find(|row| 2 * count(row) > rows.len());
    let differs_at =
        |a: &Vec<u64>, b: &Vec<u64>| (0..a.len().max(b.len())).find(|&i| a.get(i) != b.get(i)).unwrap_or(0);
    match majority {
        Some(majority) => StateVerdict::Outvoted(
            rows.iter()
                .enumerate()
                .filter(|(_, row)| *row != majority)
                .map(|(rank, row)| (rank, differs_at(row, majority)))
                .collect(),
        ),
        None => {
            let other = rows.iter().find(|row| *row != first).expect("not all equal");
            StateVerdict::NoMajority {
                entry: differs_at(first, other),
            }
        }
    }
}

/// A row's fingerprint, one number to print.
pub fn fingerprint(row: &[u64]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytemuck::cast_slice(row))
}

/// The members (by rank) whose local gradient norm is not finite, or
/// exceeds `factor` times the median of the others' finite norms (`factor`
/// 0: none is judged an outlier for its size). A small norm is never
/// blamed: a flipped bit that shrinks an element barely changes the sum.
pub fn grad_outliers(norms: &[f64], factor: f64) -> Vec<usize> {
    (0..norms.len())
        .filter(|&rank| {
            let norm = norms[rank];
            if !norm.is_finite() {
                return true;
            }
            if factor <= 0.0 {
                return false;
            }
            let mut others: Vec<f64> = (0..norms.len())
                .filter(|&r| r != rank)
                .map(|r| norms[r])
                .filter(|n| n.is_finite())
                .collect();
            if others.is_empty() {
                return false;
            }
            others.sort_by(f64::total_cmp);
            let median = others[others.len() / 2];
            norm > factor * median.max(f64::MIN_POSITIVE)
        })
        .collect()
}

/// The sum of squares of a buffer of floating-point elements (0 for other
/// types), in `f64` so that a corrupted element's square stays finite.
pub fn sum_of_squares(dtype: DType, bytes: &[u8]) -> f64 {
    match dtype {
        DType::Float32 => bytes
            .chunks_exact(4)
            .map(|b| f64::from(f32::from_le_bytes(b.try_into().expect("4 bytes"))).powi(2))
            .sum(),
        DType::Float64 => bytes
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")).powi(2))
            .sum(),
        DType::Float16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f64().powi(2))
            .sum(),
        DType::BFloat16 => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f64().powi(2))
            .sum(),
        _ => 0.0,
    }
}

/// The bit a corruption of `target` flips in an element of `dtype` when
/// its rule names none: for parameters the top bit of the mantissa (the
/// value moves by up to half of itself: silent, no loss blows up); for
/// gradients the top bit of the exponent (a far outlier). `None` for
/// non-floating types.
pub fn default_bit(target: StateTarget, dtype: DType) -> Option<u32> {
    let (mantissa_top, exponent_top) = match dtype {
        DType::Float32 => (22, 30),
        DType::Float64 => (51, 62),
        DType::Float16 => (9, 14),
        DType::BFloat16 => (6, 14),
        _ => return None,
    };
    Some(match target {
        StateTarget::Params => mantissa_top,
        StateTarget::Grads => exponent_top,
    })
}

/// The element a corruption at `step` strikes among `len`: spread over
/// the buffer, the same for the same step.
pub fn element(step: u64, len: usize) -> usize {
    (step.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 17) as usize % len.max(1)
}

/// The first element at or after `from` (wrapping) of little-endian
/// floating-point elements of `size` bytes in `bytes` that is not zero
/// (`from` when all are). A gradient corruption strikes it: the top
/// exponent bit of a zero makes it 2.0, no far outlier for a large
/// gradient, so that flip is not the one the fault promises.
pub fn nonzero_element(bytes: &[u8], size: usize, from: usize) -> usize {
    let len = bytes.len() / size.max(1);
    // Zero is every bit clear but the sign (the top bit of the last byte).
    let is_zero = |i: usize| {
        let element = &bytes[i * size..(i + 1) * size];
        element[..size - 1].iter().all(|&b| b == 0) && element[size - 1] & 0x7f == 0
    };
    (0..len)
        .map(|k| (from + k) % len)
        .find(|&i| !is_zero(i))
        .unwrap_or(from)
}

/// Flips `bit` of element `index` of little-endian elements of `size`
/// bytes in `bytes`. Returns false when it is out of range.
pub fn flip_bit(bytes: &mut [u8], size: usize, index: usize, bit: u32) -> bool {
    let bit = bit as usize;
    if bit >= size * 8 {
        return false;
    }
    match bytes.get_mut(index * size + bit / 8) {
        Some(byte) => {
            *byte ^= 1 << (bit % 8);
            true
        }
        None => false,
    }
}

/// Flips one bit of the first floating-point parameter of `state` (see
/// [`default_bit`], [`element`]); returns what it flipped, or `None` when
/// no parameter is floating point or the bit is out of its range.
pub fn corrupt_parameters(state: &mut dyn Parameters, step: u64, bit: Option<u32>) -> Option<String> {
    let mut done = None;
    state.visit_parameters(&mut |name: &str, buffer: &mut dyn ParamBuffer| {
        if done.is_some() || buffer.is_empty() {
            return;
        }
        let dtype = buffer.dtype();
        let Some(bit) = bit.or_else(|| default_bit(StateTarget::Params, dtype)) else {
            return;
        };
        let size = dtype.size();
        let index = element(step, buffer.len());
        let mut bytes = vec![0u8; size];
        buffer.read_bytes(index * size, &mut bytes);
        if flip_bit(&mut bytes, size, 0, bit) {
            buffer.write_bytes(index * size, &bytes);
            done = Some(format!("bit {bit} of element {index} of parameter '{name}'"));
        }
    });
    done
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::NamedState;

    fn row(values: &[u64]) -> Vec<u64> {
        values.to_vec()
    }

    #[test]
    fn the_member_that_differs_from_a_majority_is_named_with_its_first_entry() {
        let good = row(&[1, 2, 3]);
        assert_eq!(
            judge_state(&[good.clone(), good.clone(), good.clone()]),
            StateVerdict::Agree
        );
        assert_eq!(
            judge_state(&[good.clone(), row(&[1, 9, 3]), good.clone()]),
            StateVerdict::Outvoted(vec![(1, 1)])
        );
        assert_eq!(
            judge_state(&[
                row(&[0, 2, 3]),
                good.clone(),
                good.clone(),
                good.clone(),
                row(&[1, 2, 4])
            ]),
            StateVerdict::Outvoted(vec![(0, 0), (4, 2)])
        );
    }

    #[test]
    fn without_a_strict_majority_no_member_is_blamed() {
        assert_eq!(
            judge_state(&[row(&[1, 2]), row(&[1, 5])]),
            StateVerdict::NoMajority { entry: 1 }
        );
        assert_eq!(
            judge_state(&[row(&[1]), row(&[1]), row(&[2]), row(&[2])]),
            StateVerdict::NoMajority { entry: 0 }
        );
        assert_eq!(
            judge_state(&[row(&[1]), row(&[2]), row(&[3])]),
            StateVerdict::NoMajority { entry: 0 }
        );
    }

    #[test]
    fn a_non_finite_or_far_larger_gradient_norm_is_an_outlier_a_small_one_is_not() {
        assert!(grad_outliers(&[1.0, 1.3, 0.8], 100.0).is_empty());
        assert_eq!(grad_outliers(&[1.0, 1e30, 0.8], 100.0), [1]);
        assert_eq!(grad_outliers(&[1.0, f64::NAN, 0.8], 100.0), [1]);
        assert_eq!(grad_outliers(&[f64::INFINITY, 1.0], 100.0), [0]);
        // Two members: the larger one only.
        assert_eq!(grad_outliers(&[1e-9, 1.0], 100.0), [1]);
        assert!(grad_outliers(&[1e-3, 1.0], 0.0).is_empty());
        // All zero (no gradient yet): nobody.
        assert!(grad_outliers(&[0.0, 0.0, 0.0], 100.0).is_empty());
    }

    #[test]
    fn checks_are_spaced_to_the_budget_and_agree_on_every_member() {
        let budget = Cadence::Budget(0.01);
        assert_eq!(next_interval(budget, &[], &[]), Some(FIRST_INTERVAL));
        assert_eq!(next_interval(budget, &[0, 0], &[5, 5]), Some(FIRST_INTERVAL));
        // A check as costly as a step: every 100 steps.
        assert_eq!(next_interval(budget, &[1_000, 900], &[1_000, 800]), Some(100));
        // The slowest member's cost counts: 3 µs against 10 µs steps.
        assert_eq!(next_interval(budget, &[1_000, 3_000], &[10_000, 5_000]), Some(30));
        assert_eq!(next_interval(budget, &[1], &[1_000_000_000]), Some(1));
        assert_eq!(next_interval(budget, &[u64::MAX / 2], &[1]), Some(MAX_INTERVAL));
        assert_eq!(next_interval(Cadence::Every(0), &[], &[]), Some(1));
        assert_eq!(next_interval(Cadence::Off, &[1], &[1]), None);
    }

    #[test]
    fn a_gradient_bit_flip_by_default_makes_an_outlier_and_a_parameter_flip_stays_finite() {
        let value = 0.3f32;
        let mut bytes = value.to_le_bytes();
        assert!(flip_bit(
            &mut bytes,
            4,
            0,
            default_bit(StateTarget::Grads, DType::Float32).unwrap()
        ));
        let grad = f32::from_le_bytes(bytes);
        assert!(grad.abs() > 1e30, "{grad}");
        let mut bytes = value.to_le_bytes();
        flip_bit(
            &mut bytes,
            4,
            0,
            default_bit(StateTarget::Params, DType::Float32).unwrap(),
        );
        let param = f32::from_le_bytes(bytes);
        assert!(
            param.is_finite() && param != value && (param - value).abs() <= value / 2.0,
            "{param}"
        );
        assert!(!flip_bit(&mut bytes, 4, 0, 32), "a bit past the element");
        assert!(!flip_bit(&mut bytes, 4, 1, 0), "an element past the buffer");
        assert_eq!(default_bit(StateTarget::Grads, DType::Int64), None);
    }

    #[test]
    fn sums_of_squares_hold_a_corrupted_element_without_overflow() {
        let big = f32::MAX;
        let sum = sum_of_squares(DType::Float32, bytemuck::cast_slice(&[big, 1.0f32]));
        assert!(sum.is_finite() && sum > 1e76);
        let halves = [half::bf16::from_f32(2.0), half::bf16::from_f32(-1.0)];
        assert_eq!(sum_of_squares(DType::BFloat16, bytemuck::cast_slice(&halves)), 5.0);
        assert_eq!(sum_of_squares(DType::Int32, &[1, 0, 0, 0]), 0.0);
    }

    #[test]
    fn a_gradient_corruption_strikes_the_next_element_that_is_not_zero() {
        let bytes: Vec<u8> = [0.5f32, 0.0, -0.0, 0.0, 0.25]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(nonzero_element(&bytes, 4, 0), 0);
        assert_eq!(nonzero_element(&bytes, 4, 1), 4);
        // It wraps around.
        assert_eq!(nonzero_element(&bytes[..16], 4, 1), 0);
        let zeros = [0u8; 16];
        assert_eq!(nonzero_element(&zeros, 4, 3), 3);
        // The top exponent bit of the struck element makes it a far outlier.
        let mut struck = bytes.clone();
        let index = nonzero_element(&struck, 4, 2);
        assert!(flip_bit(
            &mut struck,
            4,
            index,
            default_bit(StateTarget::Grads, DType::Float32).unwrap()
        ));
        assert!(sum_of_squares(DType::Float32, &struck) > 1e30);
    }

    #[test]
    fn a_parameter_corruption_changes_exactly_one_bit_of_the_state() {
        let mut state = NamedState {
            params: vec![("w".into(), vec![0.5; 100]), ("b".into(), vec![1.0; 3])],
            ..NamedState::default()
        };
        let what = corrupt_parameters(&mut state, 17, None).unwrap();
        let index = element(17, 100);
        assert_eq!(what, format!("bit 22 of element {index} of parameter 'w'"));
        let changed: Vec<usize> = (0..100).filter(|&i| state.params[0].1[i] != 0.5).collect();
        assert_eq!(changed, [index]);
        assert_eq!(state.params[0].1[index], 0.75);
        assert!(state.params[1].1.iter().all(|&b| b == 1.0));
        assert_eq!(corrupt_parameters(&mut NamedState::default(), 1, None), None);
    }
}
