//! Key/value stores: how ranks find each other.
//!
//! [`Store`] is the async interface every backend implements, with PyTorch's
//! semantics (defined once, in [`state`]):
//! - [`HashStore`]: in memory, for ranks in one process and for tests;
//! - [`TcpStore`] / [`TcpStoreServer`]: PyTorch's TCPStore wire protocol, so
//!   chorus and PyTorch clients and servers talk to each other;
//! - [`FileStore`]: a file on a (shared) file system, for `file://`;
//! - [`EtcdStore`]: kept in etcd, replicated, for `etcd://`;
//! - [`PrefixStore`]: a namespace inside another store.

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use thiserror::Error;

mod etcd;
mod file;
mod hash;
mod prefix;
pub mod protocol;
pub mod state;
mod tcp;

pub use etcd::{DEFAULT_ETCD_PORT, DEFAULT_ETCD_PREFIX, EtcdStore, EtcdStoreOptions, parse_endpoints};
pub use file::{FileStore, FileStoreOptions};
pub use hash::HashStore;
pub use prefix::PrefixStore;
pub use tcp::{TcpStore, TcpStoreOptions, TcpStoreServer, TcpStoreServerOptions};

/// PyTorch's default store timeout (300 s): of blocking operations, of
/// replies and of connecting, unless a store's options say otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// PyTorch's default store port.
pub const DEFAULT_PORT: u16 = 29500;

/// Errors from any store.
#[derive(Error)]
pub enum StoreError {
    /// A blocking operation ran out of time before its keys appeared.
    #[error(
        "timed out after {waited:?} waiting for key(s) {keys:?} in store {location}; check that every rank runs and uses the same store and generation"
    )]
    Timeout {
        /// The keys still missing (or all awaited keys, when unknown).
        keys: Vec<String>,
        /// Where the store is.
        location: String,
        /// How long the operation waited.
        waited: Duration,
    },
    /// The store could not be reached at all.
    #[error(
        "could not connect to store at {addr} after {attempts} attempt(s) over {elapsed:?}: {source}; check the address and that the store server (rank 0) is up"
    )]
    Unreachable {
        /// Address tried.
        addr: String,
        /// How many connection attempts were made.
        attempts: u32,
        /// How long it tried.
        elapsed: Duration,
        /// The last connection error.
        #[source]
        source: io::Error,
    },
    /// The server accepted the connection but did not answer in time
    /// (stopped, overloaded, or not a store).
    #[error(
        "store {location} did not answer {operation} within {waited:?}; check that the store server (rank 0 or `chorus store serve`) is running and not stopped"
    )]
    NoReply {
        /// Where the store is.
        location: String,
        /// The operation that got no answer.
        operation: &'static str,
        /// How long it waited.
        waited: Duration,
    },
    /// The store address is not `host:port`.
    #[error("store address {addr:?} is not valid: expected host:port, e.g. 127.0.0.1:29500")]
    BadAddress {
        /// The address given.
        addr: String,
    },
    /// IO on an established connection or file failed.
    #[error("io error on store {location}: {source}")]
    Io {
        /// Where the store is.
        location: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The server closed the connection while a reply was due (PyTorch's
    /// server does this for requests it refuses, such as `add` on text).
    #[error("store {location} closed the connection during {operation}; the server refused the request or went away")]
    ConnectionClosed {
        /// Where the store is.
        location: String,
        /// The operation in flight.
        operation: &'static str,
    },
    /// The peer sent bytes that do not follow the protocol.
    #[error("store {location} broke the protocol: {source}")]
    Protocol {
        /// Where the store is.
        location: String,
        /// What was wrong.
        #[source]
        source: protocol::ProtocolError,
    },
    /// The operation is invalid on the current contents (e.g. `add` on text).
    #[error("store {location} refused the operation: {source}")]
    Rejected {
        /// Where the store is.
        location: String,
        /// Why.
        #[source]
        source: state::StateError,
    },
    /// A key or value is larger than the store accepts.
    #[error("{what} of {len} bytes is over the store's limit of {limit} bytes")]
    TooLarge {
        /// "key" or "value".
        what: &'static str,
        /// Its length.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// The server answered the request with an error.
    #[error(
        "store {location} refused the request ({message}); check that it is an etcd v3 server the job may write to"
    )]
    Refused {
        /// Where the store is.
        location: String,
        /// What it said.
        message: String,
    },
    /// A file store's file is not one chorus wrote, or is damaged.
    #[error("file store {path} is unreadable: {reason}; remove the file if no job uses it")]
    CorruptFile {
        /// The store file.
        path: PathBuf,
        /// What was wrong.
        reason: String,
    },
}

crate::debug_as_report!(StoreError);

impl StoreError {
    /// Whether this error is a timeout (the store is fine, a key is late).
    pub fn is_timeout(&self) -> bool {
        matches!(self, StoreError::Timeout { .. })
    }
}

/// A key/value store shared by the ranks of a job.
///
/// Blocking operations (`get`, `wait`, `multi_get`, a waiting `queue_pop`)
/// give up after [`Store::timeout`] unless given their own timeout, with an
/// error naming the keys and the store.
///
/// # Cancel safety
///
/// Every operation may be dropped half-way (a `select!`, a timeout) and the
/// store stays usable: a later call works (`TcpStore` takes its connection
/// for broken and reconnects; `FileStore` runs each call on a blocking
/// thread, which finishes it anyway). What the dropped call did is another
/// matter:
///
/// - Reads (`get`, `wait`, `check`, `multi_get`, `num_keys`, `queue_len`)
///   change nothing: drop and call again.
/// - Writes (`set`, `add`, `compare_set`, `delete`, `multi_set`, `append`,
///   `queue_push`) may or may not have taken effect once the request left:
///   `set`, `multi_set`, `delete` and a `compare_set` can be repeated, an
///   `add`, `append` or `queue_push` repeated may count twice.
/// - A `queue_pop` dropped after the store popped the value for it loses
///   that value (`TcpStore`, `EtcdStore`, `FileStore`); `HashStore` pops
///   only as the call returns.
#[async_trait]
pub trait Store: Send + Sync + fmt::Debug {
    /// Where the store lives, for messages (`tcp://host:port`, a path, ...).
    fn location(&self) -> String;

    /// The default timeout of blocking operations.
    fn timeout(&self) -> Duration;

    /// Stores `value` under `key`, replacing any value.
    async fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError>;

    /// Waits up to `timeout` for `key`, then returns its value.
    async fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Bytes, StoreError>;

    /// Waits up to [`Store::timeout`] for `key`, then returns its value.
    async fn get(&self, key: &str) -> Result<Bytes, StoreError> {
        self.get_timeout(key, self.timeout()).await
    }

    /// Adds `delta` to the integer under `key` (0 when missing); returns the result.
    async fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError>;

    /// PyTorch's compare-and-set; returns the value current afterwards (see
    /// [`state::KvState::compare_set`] for the exact rules).
    async fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Bytes, StoreError>;

    /// Whether every key exists now.
    async fn check(&self, keys: &[&str]) -> Result<bool, StoreError>;

    /// Waits up to `timeout` until every key exists.
    async fn wait_timeout(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError>;

    /// Waits up to [`Store::timeout`] until every key exists.
    async fn wait(&self, keys: &[&str]) -> Result<(), StoreError> {
        self.wait_timeout(keys, self.timeout()).await
    }

    /// Deletes `key`; whether it existed.
    async fn delete(&self, key: &str) -> Result<bool, StoreError>;

    /// How many keys hold values (queues are not counted).
    async fn num_keys(&self) -> Result<i64, StoreError>;

    /// Waits for every key, then returns their values in order.
    async fn multi_get(&self, keys: &[&str]) -> Result<Vec<Bytes>, StoreError>;

    /// Sets several keys at once.
    async fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<(), StoreError>;

    /// Appends `value` to the value under `key` (creating it).
    async fn append(&self, key: &str, value: &[u8]) -> Result<(), StoreError>;

    /// Pushes `value` on the queue named `key`.
    async fn queue_push(&self, key: &str, value: &[u8]) -> Result<(), StoreError>;

    /// Pops the oldest value of queue `key`. With `block`, waits up to
    /// [`Store::timeout`] for one; without, returns `None` when it is empty.
    async fn queue_pop(&self, key: &str, block: bool) -> Result<Option<Bytes>, StoreError>;

    /// The length of queue `key`.
    async fn queue_len(&self, key: &str) -> Result<i64, StoreError>;
}

#[async_trait]
impl<S: Store + ?Sized> Store for Arc<S> {
    fn location(&self) -> String {
        (**self).location()
    }
    fn timeout(&self) -> Duration {
        (**self).timeout()
    }
    async fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        (**self).set(key, value).await
    }
    async fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Bytes, StoreError> {
        (**self).get_timeout(key, timeout).await
    }
    async fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        (**self).add(key, delta).await
    }
    async fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Bytes, StoreError> {
        (**self).compare_set(key, expected, desired).await
    }
    async fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        (**self).check(keys).await
    }
    async fn wait_timeout(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        (**self).wait_timeout(keys, timeout).await
    }
    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        (**self).delete(key).await
    }
    async fn num_keys(&self) -> Result<i64, StoreError> {
        (**self).num_keys().await
    }
    async fn multi_get(&self, keys: &[&str]) -> Result<Vec<Bytes>, StoreError> {
        (**self).multi_get(keys).await
    }
    async fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<(), StoreError> {
        (**self).multi_set(pairs).await
    }
    async fn append(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        (**self).append(key, value).await
    }
    async fn queue_push(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        (**self).queue_push(key, value).await
    }
    async fn queue_pop(&self, key: &str, block: bool) -> Result<Option<Bytes>, StoreError> {
        (**self).queue_pop(key, block).await
    }
    async fn queue_len(&self, key: &str) -> Result<i64, StoreError> {
        (**self).queue_len(key).await
    }
}

/// Checks a key and value against limits before they are sent or stored.
pub(crate) fn check_sizes(key: &str, value: &[u8], limits: &protocol::Limits) -> Result<(), StoreError> {
    if key.len() > limits.max_key {
        return Err(StoreError::TooLarge {
            what: "key",
            len: key.len(),
            limit: limits.max_key,
        });
    }
    if value.len() > limits.max_value {
        return Err(StoreError::TooLarge {
            what: "value",
            len: value.len(),
            limit: limits.max_value,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The claim of [`Store`]'s cancel safety that holds for every store: a
    /// call dropped half-way leaves the store usable (over TCP, the
    /// connection it left mid-reply is replaced, not read from).
    #[tokio::test]
    async fn a_dropped_get_leaves_the_store_usable() {
        let server = TcpStoreServer::bind(([127, 0, 0, 1], 0).into(), TcpStoreServerOptions::default())
            .await
            .expect("a store server on loopback");
        let tcp = TcpStore::connect(server.local_addr().to_string(), TcpStoreOptions::default())
            .await
            .expect("connecting to it");
        let stores: [Arc<dyn Store>; 2] = [Arc::new(tcp), Arc::new(HashStore::default())];
        for store in stores {
            let at = store.location();
            let dropped = tokio::time::timeout(Duration::from_millis(100), store.get("late")).await;
            assert!(
                dropped.is_err(),
                "{at}: nobody set the key, so the get was dropped waiting"
            );
            store.set("late", b"value").await.expect("a set after the dropped get");
            let value = tokio::time::timeout(Duration::from_secs(10), store.get("late"))
                .await
                .unwrap_or_else(|_| panic!("{at}: a get after the dropped one hung"));
            assert_eq!(value.expect("the get").as_ref(), b"value", "{at}");
            assert_eq!(store.add("count", 2).await.expect("an add"), 2, "{at}");
        }
        server.shutdown().await;
    }
}
