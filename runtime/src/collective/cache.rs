//! [`PlanCache`]: a rank's plans kept for the next call with the same
//! arguments. A training loop (or a thousand simulated ranks) repeats a few
//! collectives of a few sizes; building a plan each time (its steps, their
//! dependencies, the peers it touches) cost more than running an 8-byte
//! all-reduce in process.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use super::schedule::{Algorithm, Spec};

/// What a plan depends on: the collective's arguments, this rank, the
/// algorithm, and whether it is the out-of-place form
/// ([`Spec::plan_out_of_place`]).
pub type PlanKey = (Spec, usize, Algorithm, bool);

/// Up to `capacity` values derived from plans (a [`Plan`](super::Plan), or
/// a plan with what a driver derives from it), the oldest dropped first.
#[derive(Debug)]
pub struct PlanCache<T> {
    entries: HashMap<PlanKey, Arc<T>>,
    order: VecDeque<PlanKey>,
    capacity: usize,
}

impl<T> PlanCache<T> {
    /// A cache of at most `capacity` entries (0 keeps none).
    pub fn new(capacity: usize) -> Self {
        Self {
            entries: HashMap::new(),
            order: VecDeque::new(),
            capacity,
        }
    }

    /// The value kept for `key`.
    pub fn get(&self, key: &PlanKey) -> Option<Arc<T>> {
        self.entries.get(key).cloned()
    }

    /// Keeps `value` for `key` (dropping the oldest entry when full) and
    /// returns it.
    pub fn insert(&mut self, key: PlanKey, value: T) -> Arc<T> {
        let value = Arc::new(value);
        if self.capacity == 0 {
            return value;
        }
        if self.entries.insert(key, value.clone()).is_none() {
            self.order.push_back(key);
        }
        if self.order.len() > self.capacity
            && let Some(oldest) = self.order.pop_front()
        {
            self.entries.remove(&oldest);
        }
        value
    }

    /// How many entries are kept.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is kept.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::{CollectiveKind, DType, Plan, PlanError};

    fn spec(count: usize) -> Spec {
        Spec {
            kind: CollectiveKind::AllReduce,
            dtype: DType::Float32,
            count,
            root: None,
            world: 8,
        }
    }

    fn plan(cache: &mut PlanCache<Plan>, count: usize, made: &mut usize) -> Result<Arc<Plan>, PlanError> {
        let key = (spec(count), 3, Algorithm::RecursiveDoubling, false);
        if let Some(plan) = cache.get(&key) {
            return Ok(plan);
        }
        *made += 1;
        Ok(cache.insert(key, key.0.plan(key.1, key.2)?))
    }

    #[test]
    fn a_plan_is_made_once_per_arguments_and_equals_a_fresh_one() {
        let mut cache = PlanCache::new(4);
        let mut made = 0;
        let first = plan(&mut cache, 2, &mut made).unwrap();
        let again = plan(&mut cache, 2, &mut made).unwrap();
        assert!(Arc::ptr_eq(&first, &again));
        assert_eq!(made, 1);
        assert_eq!(*first, spec(2).plan(3, Algorithm::RecursiveDoubling).unwrap());
        let other = plan(&mut cache, 4, &mut made).unwrap();
        assert_eq!((made, other.output_len()), (2, 4), "another count is another plan");
    }

    #[test]
    fn the_oldest_plan_goes_when_the_cache_is_full() {
        let mut cache = PlanCache::new(2);
        let mut made = 0;
        for count in [1, 2, 3] {
            plan(&mut cache, count, &mut made).unwrap();
        }
        assert_eq!((cache.len(), made), (2, 3));
        plan(&mut cache, 3, &mut made).unwrap();
        assert_eq!(made, 3, "the newest stays");
        plan(&mut cache, 1, &mut made).unwrap();
        assert_eq!(made, 4, "the oldest went");
        let key = (spec(1), 3, Algorithm::RecursiveDoubling, false);
        cache.insert(key, key.0.plan(key.1, key.2).unwrap());
        assert_eq!(cache.len(), 2, "a key kept again is not kept twice");
        let mut none = PlanCache::new(0);
        plan(&mut none, 1, &mut made).unwrap();
        assert!(none.is_empty());
    }
}
