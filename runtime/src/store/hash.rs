//! [`HashStore`]: the store in memory, shared by ranks of one process.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::protocol::Limits;
use super::state::KvState;
use super::{DEFAULT_TIMEOUT, Store, StoreError, check_sizes};

type State = KvState<oneshot::Sender<()>>;

/// An in-memory store. Clones share the same contents.
#[derive(Clone)]
pub struct HashStore {
    state: Arc<Mutex<State>>,
    timeout: Duration,
    limits: Limits,
}

impl std::fmt::Debug for HashStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HashStore").field("timeout", &self.timeout).finish()
    }
}

impl Default for HashStore {
    fn default() -> Self {
        Self::new(DEFAULT_TIMEOUT)
    }
}

fn wake(tokens: Vec<oneshot::Sender<()>>) {
    for token in tokens {
        // A waiter that gave up has dropped its receiver: nothing to do.
        let _ = token.send(());
    }
}

impl HashStore {
    /// An empty store whose blocking operations wait up to `timeout`.
    pub fn new(timeout: Duration) -> Self {
        let limits = Limits::default();
        Self {
            state: Arc::new(Mutex::new(KvState::new(limits.max_value))),
            timeout,
            limits,
        }
    }

    /// The same contents with another default timeout.
    pub fn with_timeout(&self, timeout: Duration) -> Self {
        Self {
            timeout,
            ..self.clone()
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // No code path panics while holding the lock; recover the data if one ever does.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn timeout_error(&self, keys: &[&str], waited: Duration) -> StoreError {
        let state = self.lock();
        let missing: Vec<String> = keys
            .iter()
            .filter(|k| !state.check(&[k.as_bytes()]))
            .map(|k| k.to_string())
            .collect();
        StoreError::Timeout {
            keys: if missing.is_empty() {
                keys.iter().map(|k| k.to_string()).collect()
            } else {
                missing
            },
            location: self.location(),
            waited,
        }
    }

    async fn wait_until(&self, keys: &[&str], deadline: Instant, started: Instant) -> Result<(), StoreError> {
        let wanted: Vec<Bytes> = keys.iter().map(|k| Bytes::copy_from_slice(k.as_bytes())).collect();
        let (tx, rx) = oneshot::channel();
        let id = match self.lock().register_wait(&wanted, tx) {
            Err(_) => return Ok(()),
            Ok(id) => id,
        };
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(_) => Ok(()),
            Err(_) => {
                self.lock().cancel_wait(id);
                Err(self.timeout_error(keys, started.elapsed()))
            }
        }
    }

    fn rejected(&self, source: super::state::StateError) -> StoreError {
        StoreError::Rejected {
            location: self.location(),
            source,
        }
    }
}

fn bytes(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

#[async_trait]
impl Store for HashStore {
    fn location(&self) -> String {
        "hash store (in process)".to_string()
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    async fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        check_sizes(key, value, &self.limits)?;
        let woken = self.lock().set(bytes(key), Bytes::copy_from_slice(value));
        wake(woken);
        Ok(())
    }

    async fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Bytes, StoreError> {
        let started = Instant::now();
        let deadline = started + timeout;
        loop {
            if let Some(value) = self.lock().get(key.as_bytes()) {
                return Ok(value);
            }
            // Deleted between the wait and the read: wait again.
            self.wait_until(&[key], deadline, started).await?;
        }
    }

    async fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        check_sizes(key, b"", &self.limits)?;
        let result = self.lock().add(bytes(key), delta);
        let (value, woken) = result.map_err(|e| self.rejected(e))?;
        wake(woken);
        Ok(value)
    }

    async fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Bytes, StoreError> {
        check_sizes(key, desired, &self.limits)?;
        let (current, woken) = self.lock().compare_set(
            bytes(key),
            Bytes::copy_from_slice(expected),
            Bytes::copy_from_slice(desired),
        );
        wake(woken);
        Ok(current)
    }

    async fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        let keys: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        Ok(self.lock().check(&keys))
    }

    async fn wait_timeout(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        let started = Instant::now();
        self.wait_until(keys, started + timeout, started).await
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        Ok(self.lock().delete(key.as_bytes()) == 1)
    }

    async fn num_keys(&self) -> Result<i64, StoreError> {
        Ok(self.lock().num_keys())
    }

    async fn multi_get(&self, keys: &[&str]) -> Result<Vec<Bytes>, StoreError> {
        let started = Instant::now();
        let deadline = started + self.timeout;
        let wanted: Vec<Bytes> = keys.iter().map(|k| bytes(k)).collect();
        loop {
            if let Ok(values) = self.lock().multi_get(&wanted) {
                return Ok(values);
            }
            self.wait_until(keys, deadline, started).await?;
        }
    }

    async fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<(), StoreError> {
        for (key, value) in pairs {
            check_sizes(key, value, &self.limits)?;
        }
        let mut woken = Vec::new();
        {
            let mut state = self.lock();
            for (key, value) in pairs {
                woken.extend(state.set(bytes(key), Bytes::copy_from_slice(value)));
            }
        }
        wake(woken);
        Ok(())
    }

    async fn append(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        check_sizes(key, value, &self.limits)?;
        let result = self.lock().append(bytes(key), value);
        wake(result.map_err(|e| self.rejected(e))?);
        Ok(())
    }

    async fn queue_push(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        check_sizes(key, value, &self.limits)?;
        let woken = self.lock().queue_push(bytes(key), Bytes::copy_from_slice(value));
        wake(woken);
        Ok(())
    }

    async fn queue_pop(&self, key: &str, block: bool) -> Result<Option<Bytes>, StoreError> {
        let started = Instant::now();
        let deadline = started + self.timeout;
        loop {
            if let Some((_, value)) = self.lock().queue_pop(key.as_bytes()) {
                return Ok(Some(value));
            }
            if !block {
                return Ok(None);
            }
            self.wait_until(&[key], deadline, started).await?;
        }
    }

    async fn queue_len(&self, key: &str) -> Result<i64, StoreError> {
        Ok(self.lock().queue_len(key.as_bytes()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn get_waits_for_a_later_set() {
        let store = HashStore::new(Duration::from_secs(5));
        let writer = store.clone();
        let reader = tokio::spawn(async move { store.get("k").await });
        tokio::time::sleep(Duration::from_secs(1)).await;
        writer.set("k", b"v").await.unwrap();
        assert_eq!(reader.await.unwrap().unwrap(), Bytes::from_static(b"v"));
    }

    #[tokio::test(start_paused = true)]
    async fn wait_timeout_names_the_missing_key() {
        let store = HashStore::new(Duration::from_secs(5));
        store.set("here", b"1").await.unwrap();
        let err = store
            .wait_timeout(&["here", "late"], Duration::from_secs(2))
            .await
            .unwrap_err();
        match err {
            StoreError::Timeout { keys, waited, .. } => {
                assert_eq!(keys, vec!["late".to_string()]);
                assert!(waited >= Duration::from_secs(2));
            }
            other => panic!("expected a timeout, got {other}"),
        }
        assert_eq!(store.lock().pending_waits(), 0, "a timed-out wait must be deregistered");
    }

    #[tokio::test(start_paused = true)]
    async fn blocking_queue_pop_waits_for_a_push() {
        let store = HashStore::new(Duration::from_secs(5));
        assert_eq!(store.queue_pop("q", false).await.unwrap(), None);
        let pusher = store.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            pusher.queue_push("q", b"job").await.unwrap();
        });
        assert_eq!(
            store.queue_pop("q", true).await.unwrap(),
            Some(Bytes::from_static(b"job"))
        );
        assert!(store.queue_pop("q", true).await.unwrap_err().is_timeout());
    }
}
