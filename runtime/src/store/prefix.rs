//! [`PrefixStore`]: a namespace inside another store (PyTorch's `PrefixStore`).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use super::{Store, StoreError};

/// Maps every key `k` to `prefix/k` in the wrapped store, as PyTorch does.
#[derive(Debug, Clone)]
pub struct PrefixStore {
    prefix: String,
    inner: Arc<dyn Store>,
}

impl PrefixStore {
    /// A view of `inner` whose keys live under `prefix/`.
    pub fn new(prefix: impl Into<String>, inner: Arc<dyn Store>) -> Self {
        Self {
            prefix: prefix.into(),
            inner,
        }
    }

    /// The wrapped store.
    pub fn inner(&self) -> &Arc<dyn Store> {
        &self.inner
    }

    fn key(&self, key: &str) -> String {
        format!("{}/{}", self.prefix, key)
    }

    fn keys(&self, keys: &[&str]) -> Vec<String> {
        keys.iter().map(|k| self.key(k)).collect()
    }
}

fn refs(keys: &[String]) -> Vec<&str> {
    keys.iter().map(String::as_str).collect()
}

#[async_trait]
impl Store for PrefixStore {
    fn location(&self) -> String {
        format!("{} (prefix {:?})", self.inner.location(), self.prefix)
    }
    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }
    async fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.inner.set(&self.key(key), value).await
    }
    async fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Bytes, StoreError> {
        self.inner.get_timeout(&self.key(key), timeout).await
    }
    async fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        self.inner.add(&self.key(key), delta).await
    }
    async fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Bytes, StoreError> {
        self.inner.compare_set(&self.key(key), expected, desired).await
    }
    async fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        self.inner.check(&refs(&self.keys(keys))).await
    }
    async fn wait_timeout(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        self.inner.wait_timeout(&refs(&self.keys(keys)), timeout).await
    }
    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        self.inner.delete(&self.key(key)).await
    }
    /// Counts every key of the wrapped store, as PyTorch's `PrefixStore` does.
    async fn num_keys(&self) -> Result<i64, StoreError> {
        self.inner.num_keys().await
    }
    async fn multi_get(&self, keys: &[&str]) -> Result<Vec<Bytes>, StoreError> {
        self.inner.multi_get(&refs(&self.keys(keys))).await
    }
    async fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<(), StoreError> {
        let keys: Vec<String> = pairs.iter().map(|(k, _)| self.key(k)).collect();
        let pairs: Vec<(&str, &[u8])> = keys
            .iter()
            .map(String::as_str)
            .zip(pairs.iter().map(|(_, v)| *v))
            .collect();
        self.inner.multi_set(&pairs).await
    }
    async fn append(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.inner.append(&self.key(key), value).await
    }
    async fn queue_push(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.inner.queue_push(&self.key(key), value).await
    }
    async fn queue_pop(&self, key: &str, block: bool) -> Result<Option<Bytes>, StoreError> {
        self.inner.queue_pop(&self.key(key), block).await
    }
    async fn queue_len(&self, key: &str) -> Result<i64, StoreError> {
        self.inner.queue_len(&self.key(key)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::HashStore;

    #[tokio::test]
    async fn keys_land_under_the_prefix() {
        let base = HashStore::default();
        let prefixed = PrefixStore::new("job7", Arc::new(base.clone()));
        prefixed.set("k", b"v").await.unwrap();
        assert_eq!(base.get("job7/k").await.unwrap(), Bytes::from_static(b"v"));
        assert!(!base.check(&["k"]).await.unwrap());
        assert!(prefixed.check(&["k"]).await.unwrap());
        prefixed.multi_set(&[("a", b"1"), ("b", b"2")]).await.unwrap();
        assert_eq!(base.multi_get(&["job7/a", "job7/b"]).await.unwrap().len(), 2);
    }
}
