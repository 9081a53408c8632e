//! The membership rules of a round that re-forms, sans IO: when it closes
//! ([`closes_with`]) and how its members are ranked ([`places`]). Both
//! rounds that re-form use them, with their own records and stores: the
//! elastic rendezvous of ranks ([`super::elastic`]) and the node rounds of
//! `chorus launch` (its `launch::nodes`).

use std::time::Duration;

/// How many members a round closes with, if it closes now: `max` as soon
/// as that many joined; otherwise, once at least `min` joined, all of
/// them when every member of the previous round is `accounted` for (it
/// came back, or was seen to fail), or when the last call passed since
/// `min` was first seen (`since_min`); `None`: wait.
pub fn closes_with(
    joined: usize,
    (min, max): (usize, usize),
    accounted: bool,
    since_min: Option<Duration>,
    last_call: Duration,
) -> Option<usize> {
    if joined >= max {
        return Some(max);
    }
    let last_call_passed = since_min.is_some_and(|waited| waited >= last_call);
    (joined >= min && (accounted || last_call_passed)).then_some(joined)
}

/// What a participant claims of a round's places.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Claim {
    /// A place it must have (a launcher's `--node-rank`).
    pub fixed: Option<usize>,
    /// Its place in the previous round, if it was a member.
    pub previous: Option<usize>,
}

/// The members of a round that closes with `n` of the participants
/// claiming `claims` (in arrival order): for each place in rank order, the
/// index of its participant. Fixed claims come first and keep their place
/// (when it exists and is free), then the previous round's members by
/// their previous place, so survivors keep their relative order, then
/// newcomers in arrival order; the places left go in that order. Ranks are
/// dense: a member that left leaves no hole. Returns `min(n, claims.len())`
/// places.
pub fn places(claims: &[Claim], n: usize) -> Vec<usize> {
    let mut by_priority: Vec<usize> = (0..claims.len()).collect();
    // A stable sort: equal keys (two newcomers) keep their arrival order.
    by_priority.sort_by_key(|&i| match claims[i] {
        Claim { fixed: Some(place), .. } => (0, place),
        Claim {
            previous: Some(place), ..
        } => (1, place),
        _ => (2, 0),
    });
    by_priority.truncate(n);
    let mut placed: Vec<Option<usize>> = vec![None; by_priority.len()];
    let mut rest = Vec::new();
    for i in by_priority {
        match claims[i].fixed {
            Some(place) if place < placed.len() && placed[place].is_none() => placed[place] = Some(i),
            _ => rest.push(i),
        }
    }
    // As many places are empty as participants are left.
    let mut rest = rest.into_iter();
    placed
        .into_iter()
        .map(|place| place.or_else(|| rest.next()).expect("one participant per empty place"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_round_closes_at_max_at_once_or_at_min_once_accounted_or_after_the_last_call() {
        let (bounds, last_call) = ((2, 4), ms(100));
        assert_eq!(closes_with(4, bounds, false, None, last_call), Some(4));
        assert_eq!(closes_with(5, bounds, false, Some(ms(0)), last_call), Some(4));
        assert_eq!(closes_with(1, bounds, true, None, last_call), None);
        assert_eq!(closes_with(3, bounds, true, Some(ms(0)), last_call), Some(3));
        assert_eq!(closes_with(3, bounds, false, Some(ms(99)), last_call), None);
        assert_eq!(closes_with(3, bounds, false, Some(ms(100)), last_call), Some(3));
        assert_eq!(closes_with(1, bounds, false, Some(ms(500)), last_call), None);
    }

    #[test]
    fn fixed_places_first_then_survivors_by_old_place_then_newcomers_in_arrival_order() {
        let newcomer = Claim::default();
        let survivor = |place| Claim {
            fixed: None,
            previous: Some(place),
        };
        let fixed = |place| Claim {
            fixed: Some(place),
            previous: None,
        };
        // Arrival order: a newcomer, old 2, fixed 0, old 0, a newcomer.
        let claims = [newcomer, survivor(2), fixed(0), survivor(0), newcomer];
        assert_eq!(places(&claims, 5), vec![2, 3, 1, 0, 4]);
        // Three places: the newcomers are left out first.
        assert_eq!(places(&claims, 3), vec![2, 3, 1]);
        // A fixed place past the round's size, or taken, goes with the rest.
        assert_eq!(places(&[fixed(5), survivor(0)], 2), vec![0, 1]);
        assert_eq!(places(&[fixed(0), fixed(0)], 2), vec![0, 1]);
    }

    fn claim() -> impl Strategy<Value = Claim> {
        (proptest::option::of(0usize..8), proptest::option::of(0usize..8))
            .prop_map(|(fixed, previous)| Claim { fixed, previous })
    }

    proptest! {
        /// Any claims: each place one participant, none twice; a fixed
        /// claim that fits and is the first on its place gets it; the
        /// previous round's members keep their relative order among
        /// themselves where nothing is fixed.
        #[test]
        fn places_are_dense_distinct_and_keep_survivors_in_order(
            claims in proptest::collection::vec(claim(), 0..10),
            n in 0usize..12,
        ) {
            let chosen = places(&claims, n);
            prop_assert_eq!(chosen.len(), n.min(claims.len()));
            let mut seen = chosen.clone();
            seen.sort_unstable();
            seen.dedup();
            prop_assert_eq!(seen.len(), chosen.len());
            for (place, &i) in chosen.iter().enumerate() {
                if let Some(fixed) = claims[i].fixed {
                    let first = (0..claims.len()).find(|&j| claims[j].fixed == Some(fixed));
                    if fixed < chosen.len() && first == Some(i) {
                        prop_assert_eq!(place, fixed);
                    }
                }
            }
            let survivors: Vec<usize> = chosen
                .iter()
                .filter_map(|&i| claims[i].previous.filter(|_| claims[i].fixed.is_none()))
                .collect();
            prop_assert!(survivors.windows(2).all(|w| w[0] <= w[1]), "{:?}", survivors);
        }
    }
}
