//! The key/value state machine behind [`HashStore`](super::HashStore), the
//! TCP server and the file store: one place that defines what every store
//! operation means (PyTorch's semantics, checked against its server).
//!
//! It owns no IO and no clock. Waits are registered with a token `W` (a
//! channel sender, say); a mutation returns the tokens of the waits it
//! completed, and the caller fires them after releasing its lock.

use std::collections::{HashMap, VecDeque};

use bytes::Bytes;
use thiserror::Error;

/// Why a state operation was refused.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum StateError {
    /// `add` on a key whose value is not a decimal integer.
    #[error("value of key {key:?} is not an integer, so it cannot be added to")]
    NotANumber {
        /// The key, lossily decoded.
        key: String,
    },
    /// `add` would overflow an `i64`.
    #[error("adding {delta} to key {key:?} overflows a 64-bit integer")]
    Overflow {
        /// The key, lossily decoded.
        key: String,
        /// The delta asked for.
        delta: i64,
    },
    /// `append` would grow a value past the value limit.
    #[error("appending to key {key:?} would make its value {len} bytes, over the limit of {limit}")]
    ValueTooLong {
        /// The key, lossily decoded.
        key: String,
        /// The length the value would have.
        len: usize,
        /// The configured limit.
        limit: usize,
    },
}

/// Identifies a registered wait, to cancel it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WaitId(u64);

enum Condition {
    /// Every key in the list (distinct keys) exists; `missing` of them do
    /// not yet. A count, not a list to search: a key that appears completes
    /// its share of every wait on it in O(1), where removing it from each
    /// waiter's list made a rendezvous of n ranks (n waits on n keys) cost
    /// n^3.
    Keys { keys: Vec<Bytes>, missing: usize },
    /// The integer at the key reaches the target (a `BARRIER`).
    Counter(Bytes, i64),
}

impl Condition {
    fn keys(&self) -> &[Bytes] {
        match self {
            Condition::Keys { keys, .. } => keys,
            Condition::Counter(key, _) => std::slice::from_ref(key),
        }
    }
}

struct PendingWait<W> {
    condition: Condition,
    token: W,
}

/// Keys, values, queues and the waits on them.
pub struct KvState<W> {
    map: HashMap<Bytes, Bytes>,
    queues: HashMap<Bytes, VecDeque<Bytes>>,
    pending: HashMap<WaitId, PendingWait<W>>,
    waiting_on: HashMap<Bytes, Vec<WaitId>>,
    next_wait: u64,
    max_value: usize,
}

impl<W> std::fmt::Debug for KvState<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvState")
            .field("keys", &self.map.len())
            .field("queues", &self.queues.len())
            .field("pending_waits", &self.pending.len())
            .finish()
    }
}

fn lossy(key: &[u8]) -> String {
    String::from_utf8_lossy(key).into_owned()
}

/// Reads an integer the way PyTorch's server does (`std::stoll`): leading
/// white space, an optional sign, then the longest run of digits; text after
/// the digits is ignored, no digits at all is an error.
fn parse_integer(value: &[u8]) -> Option<i64> {
    let text = std::str::from_utf8(value).ok()?.trim_start();
    let unsigned = text.strip_prefix(['+', '-']).unwrap_or(text);
    let digits = unsigned.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 {
        return None;
    }
    let sign_len = text.len() - unsigned.len();
    text[..sign_len + digits].parse().ok()
}

impl<W> KvState<W> {
    /// An empty state whose values may grow (by `append`) to `max_value` bytes.
    pub fn new(max_value: usize) -> Self {
        Self {
            map: HashMap::new(),
            queues: HashMap::new(),
            pending: HashMap::new(),
            waiting_on: HashMap::new(),
            next_wait: 0,
            max_value,
        }
    }

    /// A key exists for waits and checks when it holds a value or a non-empty queue.
    fn exists(&self, key: &[u8]) -> bool {
        self.map.contains_key(key) || self.queues.get(key).is_some_and(|q| !q.is_empty())
    }

    /// Completes the waits that `key`'s appearance or new value satisfies.
    #[must_use]
    fn key_appeared(&mut self, key: &Bytes) -> Vec<W> {
        let Some(ids) = self.waiting_on.remove(key) else {
            return Vec::new();
        };
        let counter = self.map.get(key).and_then(|v| parse_integer(v));
        let mut woken = Vec::new();
        let mut still_waiting = Vec::new();
        for id in ids {
            let Some(wait) = self.pending.get_mut(&id) else {
                continue;
            };
            let done = match &mut wait.condition {
                // `waiting_on` lists a wait once per key and drops the key's
                // list when it appears, so each key counts once.
                Condition::Keys { missing, .. } => {
                    *missing -= 1;
                    *missing == 0
                }
                Condition::Counter(_, target) => counter.is_some_and(|c| c >= *target),
            };
            if done {
                woken.push(self.pending.remove(&id).expect("present").token);
            } else if matches!(wait.condition, Condition::Counter(..)) {
                still_waiting.push(id);
            }
        }
        if !still_waiting.is_empty() {
            self.waiting_on.insert(key.clone(), still_waiting);
        }
        woken
    }

    /// Stores `value` under `key`.
    #[must_use]
    pub fn set(&mut self, key: Bytes, value: Bytes) -> Vec<W> {
        self.map.insert(key.clone(), value);
        self.key_appeared(&key)
    }

    /// The value under `key`, if any.
    pub fn get(&self, key: &[u8]) -> Option<Bytes> {
        self.map.get(key).cloned()
    }

    /// PyTorch's compare-and-set: a missing key with an empty `expected` is
    /// set to `desired`; a missing key with a non-empty `expected` stays
    /// missing and `expected` is returned; a present key is swapped only when
    /// it equals `expected`. Returns the value current afterwards.
    #[must_use]
    pub fn compare_set(&mut self, key: Bytes, expected: Bytes, desired: Bytes) -> (Bytes, Vec<W>) {
        match self.map.get(&key) {
            None if expected.is_empty() => {
                let woken = self.set(key, desired.clone());
                (desired, woken)
            }
            None => (expected, Vec::new()),
            Some(current) if *current == expected => {
                let woken = self.set(key, desired.clone());
                (desired, woken)
            }
            Some(current) => (current.clone(), Vec::new()),
        }
    }

    /// Adds `delta` to the integer stored (as ASCII decimal) under `key`; a
    /// missing key counts as 0. Returns the new value.
    pub fn add(&mut self, key: Bytes, delta: i64) -> Result<(i64, Vec<W>), StateError> {
        let current = match self.map.get(&key) {
            None => 0,
            Some(value) => parse_integer(value).ok_or_else(|| StateError::NotANumber { key: lossy(&key) })?,
        };
        let next = current.checked_add(delta).ok_or_else(|| StateError::Overflow {
            key: lossy(&key),
            delta,
        })?;
        let woken = self.set(key, Bytes::from(next.to_string()));
        Ok((next, woken))
    }

    /// Appends `value` to the value under `key` (creating it).
    pub fn append(&mut self, key: Bytes, value: &[u8]) -> Result<Vec<W>, StateError> {
        let joined = match self.map.get(&key) {
            None => Bytes::copy_from_slice(value),
            Some(current) => {
                let len = current.len() + value.len();
                if len > self.max_value {
                    return Err(StateError::ValueTooLong {
                        key: lossy(&key),
                        len,
                        limit: self.max_value,
                    });
                }
                let mut joined = Vec::with_capacity(len);
                joined.extend_from_slice(current);
                joined.extend_from_slice(value);
                Bytes::from(joined)
            }
        };
        Ok(self.set(key, joined))
    }

    /// Whether every key exists.
    pub fn check<K: AsRef<[u8]>>(&self, keys: &[K]) -> bool {
        keys.iter().all(|k| self.exists(k.as_ref()))
    }

    /// Removes `key`; returns how many keys were removed (0 or 1).
    pub fn delete(&mut self, key: &[u8]) -> i64 {
        i64::from(self.map.remove(key).is_some())
    }

    /// How many keys hold values.
    pub fn num_keys(&self) -> i64 {
        self.map.len() as i64
    }

    /// The values of `keys`, or the first missing key.
    pub fn multi_get<'k>(&self, keys: &'k [Bytes]) -> Result<Vec<Bytes>, &'k Bytes> {
        keys.iter().map(|k| self.get(k).ok_or(k)).collect()
    }

    /// Pushes `value` on the queue under `key`.
    #[must_use]
    pub fn queue_push(&mut self, key: Bytes, value: Bytes) -> Vec<W> {
        self.queues.entry(key.clone()).or_default().push_back(value);
        self.key_appeared(&key)
    }

    /// Pops the oldest value of the queue under `key`, with the queue's
    /// length before the pop (PyTorch's reply carries it).
    pub fn queue_pop(&mut self, key: &[u8]) -> Option<(i64, Bytes)> {
        let queue = self.queues.get_mut(key)?;
        let len_before = queue.len() as i64;
        let value = queue.pop_front()?;
        if queue.is_empty() {
            self.queues.remove(key);
        }
        Some((len_before, value))
    }

    /// Every key holding a value (queues are not listed), in no order.
    pub fn keys(&self) -> Vec<Bytes> {
        self.map.keys().cloned().collect()
    }

    /// PyTorch's `BARRIER`: adds 1 to the counter at `key`, then waits until
    /// it reaches `world_size`. `Ok(Err(token))` hands the token back when it
    /// already has; every other barrier waiter the increment satisfied is
    /// among the woken tokens returned.
    #[allow(clippy::type_complexity)]
    pub fn barrier(
        &mut self,
        key: Bytes,
        world_size: i64,
        token: W,
    ) -> Result<(Result<WaitId, W>, Vec<W>), StateError> {
        let (count, woken) = self.add(key.clone(), 1)?;
        if count >= world_size {
            return Ok((Err(token), woken));
        }
        let id = self.next_id();
        self.waiting_on.entry(key.clone()).or_default().push(id);
        self.pending.insert(
            id,
            PendingWait {
                condition: Condition::Counter(key, world_size),
                token,
            },
        );
        Ok((Ok(id), woken))
    }

    fn next_id(&mut self) -> WaitId {
        let id = WaitId(self.next_wait);
        self.next_wait += 1;
        id
    }

    /// The length of the queue under `key`.
    pub fn queue_len(&self, key: &[u8]) -> i64 {
        self.queues.get(key).map_or(0, |q| q.len() as i64)
    }

    /// Registers a wait for `keys`. `Err(token)` hands the token back when
    /// every key already exists.
    pub fn register_wait(&mut self, keys: &[Bytes], token: W) -> Result<WaitId, W> {
        let mut missing: Vec<Bytes> = keys.iter().filter(|k| !self.exists(k)).cloned().collect();
        missing.sort();
        missing.dedup();
        if missing.is_empty() {
            return Err(token);
        }
        let id = self.next_id();
        for key in &missing {
            self.waiting_on.entry(key.clone()).or_default().push(id);
        }
        self.pending.insert(
            id,
            PendingWait {
                condition: Condition::Keys {
                    missing: missing.len(),
                    keys: missing,
                },
                token,
            },
        );
        Ok(id)
    }

    /// Cancels a wait; its token, if it had not completed.
    pub fn cancel_wait(&mut self, id: WaitId) -> Option<W> {
        let wait = self.pending.remove(&id)?;
        for key in wait.condition.keys() {
            if let Some(ids) = self.waiting_on.get_mut(key) {
                ids.retain(|other| *other != id);
                if ids.is_empty() {
                    self.waiting_on.remove(key);
                }
            }
        }
        Some(wait.token)
    }

    /// How many waits are registered and not yet complete.
    pub fn pending_waits(&self) -> usize {
        self.pending.len()
    }

    /// Every key and value, for a file store snapshot.
    pub fn entries(&self) -> impl Iterator<Item = (&Bytes, &Bytes)> {
        self.map.iter()
    }

    /// Every queue, oldest value first, for a file store snapshot.
    pub fn queues(&self) -> impl Iterator<Item = (&Bytes, &VecDeque<Bytes>)> {
        self.queues.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(s: &str) -> Bytes {
        Bytes::copy_from_slice(s.as_bytes())
    }

    #[test]
    fn compare_set_follows_pytorch() {
        let mut s = KvState::<()>::new(1024);
        // Missing key, non-empty expected: nothing stored, expected returned.
        assert_eq!(s.compare_set(b("k"), b("x"), b("y")).0, b("x"));
        assert_eq!(s.get(b"k"), None);
        // Missing key, empty expected: stored.
        assert_eq!(s.compare_set(b("k"), b(""), b("y")).0, b("y"));
        // Present, mismatch: unchanged, current returned.
        assert_eq!(s.compare_set(b("k"), b("z"), b("w")).0, b("y"));
        // Present, match: swapped.
        assert_eq!(s.compare_set(b("k"), b("y"), b("w")).0, b("w"));
        assert_eq!(s.get(b"k"), Some(b("w")));
    }

    #[test]
    fn add_counts_from_zero_and_rejects_text() {
        let mut s = KvState::<()>::new(1024);
        assert_eq!(s.add(b("n"), 5).unwrap().0, 5);
        assert_eq!(s.add(b("n"), -7).unwrap().0, -2);
        assert_eq!(s.get(b"n"), Some(b("-2")));
        let _ = s.set(b("t"), b("abc"));
        assert!(matches!(s.add(b("t"), 1), Err(StateError::NotANumber { .. })));
        // Like std::stoll: a numeric prefix counts, the rest is ignored.
        let _ = s.set(b("p"), b(" -12abc"));
        assert_eq!(s.add(b("p"), 2).unwrap().0, -10);
        let _ = s.set(b("max"), Bytes::from(i64::MAX.to_string()));
        assert!(matches!(s.add(b("max"), 1), Err(StateError::Overflow { .. })));
    }

    #[test]
    fn waits_complete_when_the_last_key_appears() {
        let mut s = KvState::<&str>::new(1024);
        let id = s.register_wait(&[b("a"), b("b"), b("a")], "w").unwrap();
        assert!(s.set(b("a"), b("1")).is_empty());
        assert_eq!(s.queue_push(b("b"), b("x")), vec!["w"]);
        assert_eq!(s.pending_waits(), 0);
        assert_eq!(s.cancel_wait(id), None);
        // Already satisfied: the token comes straight back.
        assert_eq!(s.register_wait(&[b("a")], "now"), Err("now"));
    }

    #[test]
    fn a_rendezvous_of_many_waits_on_many_keys_completes_at_the_last_key() {
        let mut s = KvState::<usize>::new(1024);
        let keys: Vec<Bytes> = (0..64).map(|r| b(&format!("peer/{r}"))).collect();
        for waiter in 0..64 {
            s.register_wait(&keys, waiter).unwrap();
        }
        for key in &keys[..63] {
            // A key written twice counts once.
            assert!(s.set(key.clone(), b("1")).is_empty());
            assert!(s.set(key.clone(), b("2")).is_empty());
        }
        let mut woken = s.set(keys[63].clone(), b("1"));
        woken.sort_unstable();
        assert_eq!(woken, (0..64).collect::<Vec<_>>());
        assert_eq!(s.pending_waits(), 0);
        assert!(s.waiting_on.is_empty());
    }

    #[test]
    fn barrier_releases_everyone_at_the_world_size() {
        let mut s = KvState::<u8>::new(1024);
        let (first, woken) = s.barrier(b("b"), 3, 1).unwrap();
        assert!(first.is_ok() && woken.is_empty());
        let (second, _) = s.barrier(b("b"), 3, 2).unwrap();
        assert!(second.is_ok());
        let (third, woken) = s.barrier(b("b"), 3, 3).unwrap();
        assert_eq!(third, Err(3));
        let mut woken = woken;
        woken.sort();
        assert_eq!(woken, vec![1, 2]);
        assert_eq!(s.pending_waits(), 0);
        assert!(s.waiting_on.is_empty());
        let (id, _) = s.barrier(b("c"), 2, 9).unwrap();
        assert_eq!(s.cancel_wait(id.unwrap()), Some(9));
    }

    #[test]
    fn cancelled_waits_leave_nothing_behind() {
        let mut s = KvState::<u8>::new(1024);
        let id = s.register_wait(&[b("a"), b("b")], 7).unwrap();
        assert_eq!(s.cancel_wait(id), Some(7));
        assert!(s.waiting_on.is_empty());
        assert!(s.set(b("a"), b("1")).is_empty());
    }

    #[test]
    fn delete_counts_and_queues_drain() {
        let mut s = KvState::<()>::new(4);
        let _ = s.set(b("k"), b("v"));
        assert_eq!(s.num_keys(), 1);
        assert_eq!(s.delete(b"k"), 1);
        assert_eq!(s.delete(b"k"), 0);
        let _ = s.queue_push(b("q"), b("1"));
        let _ = s.queue_push(b("q"), b("2"));
        assert_eq!(s.queue_len(b"q"), 2);
        assert_eq!(s.queue_pop(b"q"), Some((2, b("1"))));
        assert_eq!(s.queue_pop(b"q"), Some((1, b("2"))));
        assert_eq!(s.queue_pop(b"q"), None);
        assert!(!s.check(&[b("q")]));
        let _ = s.append(b("a"), b"ab").unwrap();
        let _ = s.append(b("a"), b"cd").unwrap();
        assert!(matches!(s.append(b("a"), b"e"), Err(StateError::ValueTooLong { .. })));
    }
}
