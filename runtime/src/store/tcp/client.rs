//! [`TcpStore`]: a client of any TCPStore server, chorus's or PyTorch's.
//!
//! Like PyTorch's client it prefixes user keys with `/`, so Python and Rust
//! clients of one server see the same keys. One connection, one request in
//! flight at a time. An operation abandoned half-way (its future dropped, a
//! timeout) leaves the connection's framing unknown, so it is marked broken and
//! the next operation reconnects instead of reading someone else's reply.
//!
//! Every operation ends by its deadline, reconnecting included, also against
//! a server that accepts and never answers (stopped, or not a store): a
//! `connect` within `connect_timeout`, a blocking operation within its
//! timeout plus [`CANCEL_GRACE`], any other within `timeout`.

use std::net::SocketAddr;
use std::time::Duration;

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Mutex;
use tokio::time::Instant;

use super::super::protocol::{self, Limits, Reply, ReplyShape, Request};
use super::super::{DEFAULT_TIMEOUT, Store, StoreError, check_sizes};
use crate::wait::{self, Notes};

/// How long a timed-out wait may spend after its timeout cancelling the
/// `WAIT` (to keep the connection) and asking which keys are missing.
const CANCEL_GRACE: Duration = Duration::from_millis(500);

/// Client settings.
#[derive(Debug, Clone)]
pub struct TcpStoreOptions {
    /// Default timeout of blocking operations, and of every reply
    /// (default: PyTorch's 300 s).
    pub timeout: Duration,
    /// How long [`TcpStore::connect`] keeps retrying the first connection
    /// (the server may start later), handshake included (default: 300 s).
    pub connect_timeout: Duration,
    /// Size limits, checked before sending and on replies.
    pub limits: Limits,
    /// Prepended to every key; PyTorch's client uses `/`.
    pub key_prefix: String,
}

impl Default for TcpStoreOptions {
    fn default() -> Self {
        Self {
            timeout: DEFAULT_TIMEOUT,
            connect_timeout: DEFAULT_TIMEOUT,
            limits: Limits::default(),
            key_prefix: "/".to_string(),
        }
    }
}

struct Connection {
    stream: TcpStream,
    buf: BytesMut,
    /// Set while a request is in flight; still set afterwards means it was abandoned.
    in_flight: bool,
}

/// A TCPStore client.
pub struct TcpStore {
    addr: String,
    options: TcpStoreOptions,
    conn: Mutex<Option<Connection>>,
}

impl std::fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStore").field("addr", &self.addr).finish()
    }
}

impl TcpStore {
    /// Connects to the server at `addr` (`host:port`), retrying until
    /// `options.connect_timeout`, and validates it with `VALIDATE` and `PING`
    /// within the same time.
    pub async fn connect(addr: impl Into<String>, options: TcpStoreOptions) -> Result<Self, StoreError> {
        let addr = addr.into();
        check_addr(&addr)?;
        let store = Self {
            addr,
            options,
            conn: Mutex::new(None),
        };
        let conn = store.open(Instant::now() + store.options.connect_timeout).await?;
        *store.conn.lock().await = Some(conn);
        Ok(store)
    }

    /// The server address as given.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Connects (retrying refused attempts) and runs the handshake, all by `deadline`.
    async fn open(&self, deadline: Instant) -> Result<Connection, StoreError> {
        let started = Instant::now();
        let mut attempts = 0u32;
        let mut backoff = Duration::from_millis(10);
        let mut notes = Notes::new(deadline.saturating_duration_since(started));
        let stream = loop {
            attempts += 1;
            let error = match tokio::time::timeout_at(deadline, self.connect_once()).await {
                Ok(Ok(stream)) => break stream,
                Ok(Err(e)) => e,
                // A SYN nobody answers (a full backlog, a filtered port).
                Err(_) => std::io::Error::new(std::io::ErrorKind::TimedOut, "the connection attempt got no answer"),
            };
            if Instant::now() + backoff >= deadline {
                return Err(StoreError::Unreachable {
                    addr: self.addr.clone(),
                    attempts,
                    elapsed: started.elapsed(),
                    source: error,
                });
            }
            if notes.due() {
                tracing::info!(
                    target: wait::TARGET,
                    "waiting for the store at tcp://{} ({error}; is its server up?); {}",
                    self.addr,
                    notes.progress()
                );
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(1));
        };
        let _ = stream.set_nodelay(true);
        let mut conn = Connection {
            stream,
            buf: BytesMut::with_capacity(4096),
            in_flight: false,
        };
        let nonce = std::process::id();
        let handshake = async {
            self.exchange(
                &mut conn,
                &Request::Validate {
                    magic: protocol::VALIDATION_MAGIC,
                },
                "validate",
            )
            .await?;
            self.exchange(&mut conn, &Request::Ping { nonce }, "ping").await
        };
        match tokio::time::timeout_at(deadline, handshake).await {
            Ok(Ok(Reply::U32(echo))) if echo == nonce => Ok(conn),
            Ok(Ok(other)) => Err(self.malformed(format!("ping answered {other:?}, not the nonce {nonce}"))),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(self.no_reply("the connect handshake", started.elapsed())),
        }
    }

    async fn connect_once(&self) -> std::io::Result<TcpStream> {
        let addrs: Vec<SocketAddr> = tokio::net::lookup_host(&self.addr).await?.collect();
        connect_any(&addrs).await
    }

    /// The connection to use, reconnecting by `deadline` when the last
    /// operation was abandoned or failed.
    async fn ready<'a>(
        &self,
        guard: &'a mut Option<Connection>,
        deadline: Instant,
    ) -> Result<&'a mut Connection, StoreError> {
        if guard.as_ref().is_none_or(|c| c.in_flight) {
            *guard = None;
            let by = deadline.min(Instant::now() + self.options.connect_timeout);
            *guard = Some(self.open(by).await?);
        }
        Ok(guard.as_mut().expect("connection was just opened"))
    }

    fn no_reply(&self, operation: &'static str, waited: Duration) -> StoreError {
        StoreError::NoReply {
            location: self.location(),
            operation,
            waited,
        }
    }

    fn location(&self) -> String {
        format!("tcp://{}", self.addr)
    }

    /// Every key holding a value, exactly as stored: keys of PyTorch-style
    /// clients (this one included) start with the `/` they prefix.
    pub async fn list_keys(&self) -> Result<Vec<Bytes>, StoreError> {
        match self.call(Request::ListKeys, "list_keys", self.options.timeout).await? {
            Reply::Keys(keys) => Ok(keys),
            other => Err(self.malformed(format!("list_keys answered {other:?}"))),
        }
    }

    fn malformed(&self, what: String) -> StoreError {
        StoreError::Protocol {
            location: self.location(),
            source: protocol::ProtocolError::MalformedReply(what),
        }
    }

    fn io(&self, source: std::io::Error) -> StoreError {
        StoreError::Io {
            location: self.location(),
            source,
        }
    }

    /// Sends one request and reads its reply, with no timeout.
    async fn exchange(&self, conn: &mut Connection, request: &Request, op: &'static str) -> Result<Reply, StoreError> {
        conn.in_flight = true;
        let mut out = BytesMut::new();
        request.encode(&mut out);
        conn.stream.write_all(&out).await.map_err(|e| self.io(e))?;
        let reply = self.read_reply(conn, ReplyShape::of(request), op).await?;
        conn.in_flight = false;
        Ok(reply)
    }

    async fn read_reply(
        &self,
        conn: &mut Connection,
        shape: ReplyShape,
        op: &'static str,
    ) -> Result<Reply, StoreError> {
        loop {
            let decoded = protocol::decode_reply(&mut conn.buf, shape, &self.options.limits).map_err(|source| {
                StoreError::Protocol {
                    location: self.location(),
                    source,
                }
            })?;
            if let Some(reply) = decoded {
                return Ok(reply);
            }
            match conn.stream.read_buf(&mut conn.buf).await {
                Ok(0) => {
                    return Err(StoreError::ConnectionClosed {
                        location: self.location(),
                        operation: op,
                    });
                }
                Ok(_) => {}
                Err(e) => return Err(self.io(e)),
            }
        }
    }

    /// Runs `request` on a healthy connection, reconnecting when the last
    /// operation was abandoned or failed; all of it within `timeout`.
    async fn call(&self, request: Request, op: &'static str, timeout: Duration) -> Result<Reply, StoreError> {
        let deadline = Instant::now() + timeout;
        let mut guard = self.conn.lock().await;
        let conn = self.ready(&mut guard, deadline).await?;
        match tokio::time::timeout_at(deadline, self.exchange(conn, &request, op)).await {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(e)) => {
                *guard = None;
                Err(e)
            }
            Err(_) => {
                *guard = None;
                Err(self.no_reply(op, timeout))
            }
        }
    }

    fn timeout_error(&self, keys: &[&str], waited: Duration) -> StoreError {
        StoreError::Timeout {
            keys: keys.iter().map(|k| k.to_string()).collect(),
            location: self.location(),
            waited,
        }
    }

    fn key(&self, key: &str) -> Bytes {
        Bytes::from(format!("{}{}", self.options.key_prefix, key))
    }

    fn check_key(&self, key: &str) -> Result<(), StoreError> {
        check_sizes(
            &format!("{}{}", self.options.key_prefix, key),
            b"",
            &self.options.limits,
        )
    }

    /// `WAIT` with a client-side deadline; on expiry, `CANCEL_WAIT` and drain
    /// its reply (a late `STOP_WAITING` may come first) to keep the
    /// connection, and name the missing keys, within [`CANCEL_GRACE`]. A
    /// server that answers neither is reported as not answering `op`.
    async fn wait_keys(&self, keys: &[&str], timeout: Duration, op: &'static str) -> Result<(), StoreError> {
        for key in keys {
            self.check_key(key)?;
        }
        let request = Request::Wait {
            keys: keys.iter().map(|k| self.key(k)).collect(),
        };
        let deadline = Instant::now() + timeout;
        let mut guard = self.conn.lock().await;
        let conn = self.ready(&mut guard, deadline).await?;
        match tokio::time::timeout_at(deadline, self.exchange(conn, &request, op)).await {
            Ok(Ok(Reply::U8(protocol::WAIT_STOP_WAITING))) => return Ok(()),
            Ok(Ok(other)) => {
                *guard = None;
                return Err(self.malformed(format!("wait answered {other:?}")));
            }
            Ok(Err(e)) => {
                *guard = None;
                return Err(e);
            }
            Err(_) => {}
        }
        let cleanup = async {
            let mut out = BytesMut::new();
            Request::CancelWait.encode(&mut out);
            conn.stream.write_all(&out).await.map_err(|e| self.io(e))?;
            loop {
                match self.read_reply(conn, ReplyShape::U8, "cancel wait").await? {
                    Reply::U8(protocol::WAIT_CANCELED) => break,
                    Reply::U8(protocol::WAIT_STOP_WAITING) => continue,
                    other => return Err(self.malformed(format!("cancel wait answered {other:?}"))),
                }
            }
            conn.in_flight = false;
            let mut missing = Vec::new();
            for key in keys {
                let check = Request::Check {
                    keys: vec![self.key(key)],
                };
                if let Reply::U8(protocol::CHECK_NOT_READY) = self.exchange(conn, &check, "check").await? {
                    missing.push(*key);
                }
            }
            Ok::<_, StoreError>(missing)
        };
        match tokio::time::timeout(CANCEL_GRACE, cleanup).await {
            Ok(Ok(missing)) => Err(self.timeout_error(if missing.is_empty() { keys } else { &missing }, timeout)),
            Ok(Err(_)) => {
                *guard = None;
                Err(self.timeout_error(keys, timeout))
            }
            Err(_) => {
                *guard = None;
                Err(self.no_reply(op, timeout))
            }
        }
    }
}

/// Refuses what cannot be a `host:port` at once, instead of retrying it.
fn check_addr(addr: &str) -> Result<(), StoreError> {
    let valid = addr
        .rsplit_once(':')
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
    if valid {
        Ok(())
    } else {
        Err(StoreError::BadAddress { addr: addr.to_string() })
    }
}

async fn connect_any(addrs: &[SocketAddr]) -> std::io::Result<TcpStream> {
    let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "the host name resolved to no address");
    for addr in addrs {
        match TcpStream::connect(addr).await {
            Ok(stream) => return Ok(stream),
            Err(e) => last = e,
        }
    }
    Err(last)
}

fn expect_i64(store: &TcpStore, reply: Reply, op: &str) -> Result<i64, StoreError> {
    match reply {
        Reply::I64(v) => Ok(v),
        other => Err(store.malformed(format!("{op} answered {other:?}"))),
    }
}

#[async_trait]
impl Store for TcpStore {
    fn location(&self) -> String {
        TcpStore::location(self)
    }

    fn timeout(&self) -> Duration {
        self.options.timeout
    }

    async fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        check_sizes(key, value, &self.options.limits)?;
        let request = Request::Set {
            key: self.key(key),
            value: Bytes::copy_from_slice(value),
        };
        self.call(request, "set", self.options.timeout).await.map(drop)
    }

    async fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Bytes, StoreError> {
        self.wait_keys(&[key], timeout, "get").await?;
        match self
            .call(Request::Get { key: self.key(key) }, "get", self.options.timeout)
            .await?
        {
            Reply::Value(v) => Ok(v),
            other => Err(self.malformed(format!("get answered {other:?}"))),
        }
    }

    async fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        self.check_key(key)?;
        let reply = self
            .call(
                Request::Add {
                    key: self.key(key),
                    delta,
                },
                "add",
                self.options.timeout,
            )
            .await?;
        expect_i64(self, reply, "add")
    }

    async fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Bytes, StoreError> {
        check_sizes(key, expected, &self.options.limits)?;
        check_sizes(key, desired, &self.options.limits)?;
        let request = Request::CompareSet {
            key: self.key(key),
            expected: Bytes::copy_from_slice(expected),
            desired: Bytes::copy_from_slice(desired),
        };
        match self.call(request, "compare_set", self.options.timeout).await? {
            Reply::Value(v) => Ok(v),
            other => Err(self.malformed(format!("compare_set answered {other:?}"))),
        }
    }

    async fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        for key in keys {
            self.check_key(key)?;
        }
        let request = Request::Check {
            keys: keys.iter().map(|k| self.key(k)).collect(),
        };
        match self.call(request, "check", self.options.timeout).await? {
            Reply::U8(protocol::CHECK_READY) => Ok(true),
            Reply::U8(protocol::CHECK_NOT_READY) => Ok(false),
            other => Err(self.malformed(format!("check answered {other:?}"))),
        }
    }

    async fn wait_timeout(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        self.wait_keys(keys, timeout, "wait").await
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        self.check_key(key)?;
        let reply = self
            .call(
                Request::DeleteKey { key: self.key(key) },
                "delete",
                self.options.timeout,
            )
            .await?;
        Ok(expect_i64(self, reply, "delete")? > 0)
    }

    async fn num_keys(&self) -> Result<i64, StoreError> {
        let reply = self.call(Request::GetNumKeys, "num_keys", self.options.timeout).await?;
        expect_i64(self, reply, "num_keys")
    }

    async fn multi_get(&self, keys: &[&str]) -> Result<Vec<Bytes>, StoreError> {
        self.wait_keys(keys, self.options.timeout, "multi_get").await?;
        let request = Request::MultiGet {
            keys: keys.iter().map(|k| self.key(k)).collect(),
        };
        match self.call(request, "multi_get", self.options.timeout).await? {
            Reply::Values(values) => Ok(values),
            other => Err(self.malformed(format!("multi_get answered {other:?}"))),
        }
    }

    async fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<(), StoreError> {
        for (key, value) in pairs {
            check_sizes(key, value, &self.options.limits)?;
        }
        let request = Request::MultiSet {
            pairs: pairs
                .iter()
                .map(|(k, v)| (self.key(k), Bytes::copy_from_slice(v)))
                .collect(),
        };
        self.call(request, "multi_set", self.options.timeout).await.map(drop)
    }

    async fn append(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        check_sizes(key, value, &self.options.limits)?;
        let request = Request::Append {
            key: self.key(key),
            value: Bytes::copy_from_slice(value),
        };
        self.call(request, "append", self.options.timeout).await.map(drop)
    }

    async fn queue_push(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        check_sizes(key, value, &self.options.limits)?;
        let request = Request::QueuePush {
            key: self.key(key),
            value: Bytes::copy_from_slice(value),
        };
        self.call(request, "queue_push", self.options.timeout).await.map(drop)
    }

    async fn queue_pop(&self, key: &str, block: bool) -> Result<Option<Bytes>, StoreError> {
        self.check_key(key)?;
        let started = Instant::now();
        loop {
            if block {
                let left = self.options.timeout.saturating_sub(started.elapsed());
                self.wait_keys(&[key], left, "queue_pop").await?;
            }
            let reply = self
                .call(
                    Request::QueuePop { key: self.key(key) },
                    "queue_pop",
                    self.options.timeout,
                )
                .await?;
            match reply {
                Reply::Popped(Some(value)) => return Ok(Some(value)),
                // Another client took the item between our wait and our pop.
                Reply::Popped(None) if block => continue,
                Reply::Popped(None) => return Ok(None),
                other => return Err(self.malformed(format!("queue_pop answered {other:?}"))),
            }
        }
    }

    async fn queue_len(&self, key: &str) -> Result<i64, StoreError> {
        self.check_key(key)?;
        let reply = self
            .call(
                Request::QueueLen { key: self.key(key) },
                "queue_len",
                self.options.timeout,
            )
            .await?;
        expect_i64(self, reply, "queue_len")
    }
}
