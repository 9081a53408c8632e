//! [`EtcdStore`]: the store kept in etcd (v3 API, 3.4 or later), so the
//! rendezvous state is replicated and outlives any one host of the job.
//!
//! It speaks etcd's JSON gateway (`/v3/kv/range`, `/v3/kv/put`,
//! `/v3/kv/txn`, `/v3/kv/deleterange`, `/v3/watch`; keys and values in
//! base64) over plain HTTP/1.0 on the client port, one connection per
//! request: no gRPC stack, so the build needs no `protoc` (see
//! ARCHITECTURE.md). Every request runs under a deadline, so a server that
//! answers nothing costs at most the operation's timeout.
//!
//! # Key layout
//! Under the store's prefix `P` (`/chorus` unless the URL names one), a key
//! `k` of `n` bytes lives in its own directory `P/n/k/`: its value at
//! `P/n/k/v`, its queue's elements at `P/n/k/q/<nonce>` (ordered by their
//! creation revision), the receipt of its last read-modify-write at
//! `P/r/n/k/w`. The length makes directories of different keys
//! disjoint (`a` and `a/b` do not nest), so one watch on a directory sees
//! everything that makes `k` exist, as [`KvState`](super::state::KvState)
//! defines existence: a value or a non-empty queue.
//!
//! # Semantics
//! Read-modify-write operations (`add`, `append`, `compare_set`) read the
//! value, apply [`KvState`](super::state::KvState)'s rule to it (the one
//! definition of store semantics) and write the result in a transaction
//! guarded by the value's revision, retrying when another client won.
//! Waits read, then watch the key's directory from the revision they read,
//! so no write in between is missed. A request that failed before it was
//! sent moves on to the next endpoint, as does a read or plain put that
//! got no reply; a read-modify-write that got none reads the key and its
//! receipt (a random tag written in the same transaction) to tell whether
//! it was applied, and is reported when another write since hides that.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::protocol::Limits;
use super::state::{KvState, StateError};
use super::{DEFAULT_TIMEOUT, Store, StoreError, check_sizes};

/// etcd's default client port.
pub const DEFAULT_ETCD_PORT: u16 = 2379;

/// The key prefix when the URL names none.
pub const DEFAULT_ETCD_PREFIX: &str = "/chorus";

/// Longest value accepted: etcd refuses requests over 1.5 MiB by default.
pub(crate) const MAX_ETCD_VALUE: usize = 1024 * 1024;

/// Most operations etcd takes in one transaction (its `--max-txn-ops` default).
const MAX_TXN_OPS: usize = 128;

/// The pause before looking again after a watch ended without news.
const WATCH_RETRY: Duration = Duration::from_millis(50);
/// How long a read-modify-write whose member went away before replying
/// waits before reading whether its write was applied ([`EtcdStore::was_applied`]).
const LOST_REPLY_SETTLE: Duration = Duration::from_millis(500);

/// Largest reply read, so a confused server cannot exhaust memory.
const MAX_REPLY: usize = 256 * 1024 * 1024;

/// Client settings.
#[derive(Debug, Clone)]
pub struct EtcdStoreOptions {
    /// Default timeout of blocking operations, and of every request.
    pub timeout: Duration,
    /// How long to keep trying to reach a first endpoint.
    pub connect_timeout: Duration,
    /// Prefix of every key (a job's or an installation's namespace).
    pub prefix: String,
}

impl Default for EtcdStoreOptions {
    fn default() -> Self {
        Self {
            timeout: DEFAULT_TIMEOUT,
            connect_timeout: DEFAULT_TIMEOUT,
            prefix: DEFAULT_ETCD_PREFIX.to_string(),
        }
    }
}

// ---------------------------------------------------------------- sans IO

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding, as etcd's gateway writes bytes.
pub(crate) fn b64_encode(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | u32::from(b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(B64[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Decodes standard base64 (padding optional); `None` when malformed.
pub(crate) fn b64_decode(text: &str) -> Option<Vec<u8>> {
    let text = text.trim_end_matches('=');
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0u32);
    for c in text.bytes() {
        let v = B64.iter().position(|&b| b == c)? as u32;
        acc = acc << 6 | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    (text.len() % 4 != 1).then_some(out)
}

/// The end of the range of every key starting with `prefix` (etcd's
/// `range_end`): the prefix with its last byte below 0xff incremented.
pub(crate) fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Every byte 0xff: the range runs to the end of the key space.
    vec![0]
}

/// Where a store's keys live in etcd (see the module doc).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Layout {
    prefix: String,
}

impl Layout {
    pub(crate) fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.trim_end_matches('/').to_string(),
        }
    }

    /// The directory of `key`: its value and its queue, nothing else.
    pub(crate) fn dir(&self, key: &str) -> Vec<u8> {
        format!("{}/{}/{}/", self.prefix, key.len(), key).into_bytes()
    }

    pub(crate) fn value(&self, key: &str) -> Vec<u8> {
        let mut k = self.dir(key);
        k.push(b'v');
        k
    }

    /// The receipt of the last read-modify-write of `key` (a random tag
    /// written in its transaction, to tell whether a write that got no
    /// reply was applied): outside every key's directory, so it makes
    /// nothing exist, and not ending in `/v`, so it is no value.
    pub(crate) fn receipt(&self, key: &str) -> Vec<u8> {
        format!("{}/r/{}/{}/w", self.prefix, key.len(), key).into_bytes()
    }

    pub(crate) fn queue(&self, key: &str) -> Vec<u8> {
        let mut k = self.dir(key);
        k.extend_from_slice(b"q/");
        k
    }

    /// Every key of the store.
    pub(crate) fn all(&self) -> Vec<u8> {
        format!("{}/", self.prefix).into_bytes()
    }

    /// Whether a stored etcd key is a value (not a queue element).
    pub(crate) fn is_value(&self, etcd_key: &[u8]) -> bool {
        etcd_key.starts_with(self.all().as_slice()) && etcd_key.ends_with(b"/v")
    }
}

/// Request bodies for the gateway.
pub(crate) mod req {
    use super::{Value, b64_encode, json, prefix_end};

    pub(crate) fn range(key: &[u8]) -> Value {
        json!({ "key": b64_encode(key) })
    }

    /// How many keys start with `prefix`.
    pub(crate) fn count(prefix: &[u8]) -> Value {
        json!({ "key": b64_encode(prefix), "range_end": b64_encode(&prefix_end(prefix)), "count_only": true })
    }

    /// Every key starting with `prefix`, without values.
    pub(crate) fn keys(prefix: &[u8]) -> Value {
        json!({ "key": b64_encode(prefix), "range_end": b64_encode(&prefix_end(prefix)), "keys_only": true })
    }

    /// The oldest key (by creation) starting with `prefix`.
    pub(crate) fn oldest(prefix: &[u8]) -> Value {
        json!({
            "key": b64_encode(prefix),
            "range_end": b64_encode(&prefix_end(prefix)),
            "limit": 1,
            "sort_order": "ASCEND",
            "sort_target": "CREATE",
        })
    }

    pub(crate) fn put(key: &[u8], value: &[u8]) -> Value {
        json!({ "key": b64_encode(key), "value": b64_encode(value) })
    }

    /// A transaction that applies `ops` when `key` still has `mod_revision`
    /// (0: when it does not exist).
    pub(crate) fn guarded(key: &[u8], mod_revision: i64, ops: Vec<Value>) -> Value {
        let compare = if mod_revision == 0 {
            json!({ "key": b64_encode(key), "target": "VERSION", "result": "EQUAL", "version": 0 })
        } else {
            json!({ "key": b64_encode(key), "target": "MOD", "result": "EQUAL", "mod_revision": mod_revision })
        };
        json!({ "compare": [compare], "success": ops })
    }

    /// A transaction that applies `ops` unconditionally.
    pub(crate) fn batch(ops: Vec<Value>) -> Value {
        json!({ "success": ops })
    }

    pub(crate) fn op_put(key: &[u8], value: &[u8]) -> Value {
        json!({ "request_put": put(key, value) })
    }

    pub(crate) fn op_range(body: Value) -> Value {
        json!({ "request_range": body })
    }

    pub(crate) fn op_delete(key: &[u8]) -> Value {
        json!({ "request_delete_range": { "key": b64_encode(key) } })
    }

    /// Watches every key starting with `prefix` from `revision` on.
    pub(crate) fn watch(prefix: &[u8], revision: i64) -> Value {
        json!({ "create_request": {
            "key": b64_encode(prefix),
            "range_end": b64_encode(&prefix_end(prefix)),
            "start_revision": revision,
        }})
    }
}

/// A key-value pair as etcd returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Kv {
    pub(crate) key: Vec<u8>,
    pub(crate) value: Bytes,
    pub(crate) mod_revision: i64,
}

/// The gateway writes 64-bit integers as strings and leaves out zeros.
fn int(v: &Value, field: &str) -> Option<i64> {
    match v.get(field) {
        None | Some(Value::Null) => Some(0),
        Some(Value::String(s)) => s.parse().ok(),
        Some(n) => n.as_i64(),
    }
}

fn bytes_field(v: &Value, field: &str) -> Option<Vec<u8>> {
    match v.get(field) {
        None | Some(Value::Null) => Some(Vec::new()),
        Some(Value::String(s)) => b64_decode(s),
        Some(_) => None,
    }
}

/// A range reply: its pairs, its count and the store's revision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RangeReply {
    pub(crate) kvs: Vec<Kv>,
    pub(crate) count: i64,
    pub(crate) revision: i64,
}

pub(crate) fn parse_range(v: &Value) -> Result<RangeReply, String> {
    let revision = v.get("header").and_then(|h| int(h, "revision")).unwrap_or(0);
    let count = int(v, "count").ok_or("count is not an integer")?;
    let mut kvs = Vec::new();
    if let Some(list) = v.get("kvs") {
        for kv in list.as_array().ok_or("kvs is not a list")? {
            kvs.push(Kv {
                key: bytes_field(kv, "key").ok_or("a key is not base64")?,
                value: Bytes::from(bytes_field(kv, "value").ok_or("a value is not base64")?),
                mod_revision: int(kv, "mod_revision").ok_or("mod_revision is not an integer")?,
            });
        }
    }
    Ok(RangeReply { kvs, count, revision })
}

/// A transaction's outcome and the replies of its operations, in order.
pub(crate) fn parse_txn(v: &Value) -> Result<(bool, Vec<Value>), String> {
    let succeeded = v.get("succeeded").and_then(Value::as_bool).unwrap_or(false);
    let responses = match v.get("responses") {
        None | Some(Value::Null) => Vec::new(),
        Some(list) => list.as_array().ok_or("responses is not a list")?.clone(),
    };
    Ok((succeeded, responses))
}

/// What a watch message says: still waiting, or something changed (an
/// event, a cancel, a compaction: either way, look again).
pub(crate) fn watch_fired(message: &Value) -> bool {
    let result = message.get("result").unwrap_or(message);
    result
        .get("events")
        .and_then(Value::as_array)
        .is_some_and(|e| !e.is_empty())
        || result.get("canceled").and_then(Value::as_bool).unwrap_or(false)
        || int(result, "compact_revision").unwrap_or(0) > 0
        || message.get("error").is_some()
}

/// A read-modify-write operation, applied to a key's current value by
/// [`KvState`]'s rules.
#[derive(Debug, Clone)]
pub(crate) enum Rmw<'a> {
    Add(i64),
    Append(&'a [u8]),
    CompareSet { expected: &'a [u8], desired: &'a [u8] },
}

/// What a read-modify-write returns and writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Applied {
    /// The reply: the new integer (add), the current value (compare-set).
    pub(crate) reply: Bytes,
    /// The value to write, when the operation changes it.
    pub(crate) write: Option<Bytes>,
}

pub(crate) fn apply(key: &str, current: Option<Bytes>, op: &Rmw<'_>) -> Result<Applied, StateError> {
    let mut state = KvState::<()>::new(MAX_ETCD_VALUE);
    let k = Bytes::copy_from_slice(key.as_bytes());
    if let Some(value) = current.clone() {
        let _ = state.set(k.clone(), value);
    }
    let reply = match op {
        Rmw::Add(delta) => Bytes::from(state.add(k.clone(), *delta)?.0.to_string()),
        Rmw::Append(value) => {
            let _ = state.append(k.clone(), value)?;
            Bytes::new()
        }
        Rmw::CompareSet { expected, desired } => {
            let (reply, _) = state.compare_set(
                k.clone(),
                Bytes::copy_from_slice(expected),
                Bytes::copy_from_slice(desired),
            );
            reply
        }
    };
    let after = state.get(&k);
    let changed = match op {
        // A matching compare-set writes even an equal value, as PyTorch's does.
        Rmw::CompareSet { expected, .. } => current.as_deref().map_or(expected.is_empty(), |c| c == *expected),
        // Reading a counter (add 0) writes only to create it: its readers
        // then never replace its writer's receipt (`EtcdStore::was_applied`).
        Rmw::Add(delta) => *delta != 0 || current.is_none(),
        Rmw::Append(_) => true,
    };
    Ok(Applied {
        reply,
        write: if changed { after } else { None },
    })
}

/// An HTTP/1.0 POST: the server answers, closes, and streams without chunks.
pub(crate) fn http_request(host: &str, path: &str, body: &Value) -> Vec<u8> {
    let body = body.to_string();
    format!(
        "POST {path} HTTP/1.0\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Splits a reply into its status code and where its body starts, once the
/// header is complete.
pub(crate) fn http_head(buf: &[u8]) -> Result<Option<(u16, usize)>, String> {
    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return Ok(None);
    };
    let head = String::from_utf8_lossy(&buf[..end]);
    let status = head
        .lines()
        .next()
        .and_then(|line| line.split_whitespace().nth(1))
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| format!("not an HTTP reply: {:?}", head.lines().next().unwrap_or("")))?;
    if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        return Err("chunked reply to an HTTP/1.0 request".into());
    }
    Ok(Some((status, end + 4)))
}

/// Splits `etcd://h1:p1,h2:p2/prefix` (without the scheme) into endpoints
/// (`host:port`, port 2379 when left out) and the prefix; the query, if any,
/// is the caller's.
pub fn parse_endpoints(authority_and_path: &str) -> Result<(Vec<String>, String), String> {
    let (authority, path) = match authority_and_path.find('/') {
        Some(at) => authority_and_path.split_at(at),
        None => (authority_and_path, ""),
    };
    let mut endpoints = Vec::new();
    for part in authority.split(',').map(str::trim) {
        if part.is_empty() {
            return Err("an empty endpoint; write etcd://host:port[,host:port...][/prefix]".into());
        }
        let (host, port) = if let Some(rest) = part.strip_prefix('[') {
            let (host, after) = rest
                .split_once(']')
                .ok_or_else(|| format!("{part:?} opens [ without closing it"))?;
            (host, after.strip_prefix(':'))
        } else {
            match part.rsplit_once(':') {
                Some((host, port)) if !host.contains(':') => (host, Some(port)),
                _ => (part, None),
            }
        };
        if host.is_empty() {
            return Err(format!("{part:?} has no host"));
        }
        let port: u16 = match port {
            None => DEFAULT_ETCD_PORT,
            Some(p) => p
                .parse()
                .ok()
                .filter(|&p| p > 0)
                .ok_or_else(|| format!("{part:?}: the port is not a number from 1 to 65535"))?,
        };
        endpoints.push(if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        });
    }
    let prefix = path.trim_end_matches('/');
    Ok((
        endpoints,
        if prefix.is_empty() {
            DEFAULT_ETCD_PREFIX.to_string()
        } else {
            prefix.to_string()
        },
    ))
}

// ---------------------------------------------------------------- IO

/// A store in etcd. Cheap to share: every request opens its own connection.
pub struct EtcdStore {
    endpoints: Vec<String>,
    layout: Layout,
    prefix: String,
    options: EtcdStoreOptions,
    /// The endpoint that answered last; tried first.
    current: AtomicUsize,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore").field("location", &self.location()).finish()
    }
}

/// How a failed request may be retried.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Retry {
    /// On another endpoint even after it was sent (reads, plain puts).
    Resend,
    /// Only when it never left (a transaction may have been applied).
    BeforeSending,
}

enum Failure {
    NotSent(std::io::Error),
    Failed(StoreError),
    /// HTTP 503 (etcd's Unavailable: no leader, a leader change); whether
    /// the request certainly was not applied (the member had no leader).
    Unavailable(StoreError, bool),
}

impl EtcdStore {
    /// Reaches one of `endpoints` (`host:port`), retrying until
    /// `options.connect_timeout`.
    pub async fn connect(endpoints: Vec<String>, options: EtcdStoreOptions) -> Result<Self, StoreError> {
        let store = Self {
            layout: Layout::new(&options.prefix),
            prefix: options.prefix.trim_end_matches('/').to_string(),
            endpoints,
            options,
            current: AtomicUsize::new(0),
        };
        let started = Instant::now();
        let deadline = started + store.options.connect_timeout;
        let body = req::count(&store.layout.all());
        match store.post("/v3/kv/range", &body, deadline, Retry::Resend, &[]).await {
            Ok(_) => Ok(store),
            // Connected, but nothing answered: say so, not "waiting for keys".
            Err(StoreError::Timeout { .. }) => Err(StoreError::Unreachable {
                addr: store.endpoints.join(","),
                attempts: 1,
                elapsed: started.elapsed(),
                source: std::io::Error::new(std::io::ErrorKind::TimedOut, "connected, but no reply came"),
            }),
            Err(e) => Err(e),
        }
    }

    /// The endpoints, as given.
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    fn malformed(&self, what: String) -> StoreError {
        StoreError::Protocol {
            location: self.location(),
            source: super::protocol::ProtocolError::MalformedReply(what),
        }
    }

    fn timeout_error(&self, keys: &[&str], waited: Duration) -> StoreError {
        StoreError::Timeout {
            keys: keys.iter().map(|k| k.to_string()).collect(),
            location: self.location(),
            waited,
        }
    }

    fn rejected(&self, source: StateError) -> StoreError {
        StoreError::Rejected {
            location: self.location(),
            source,
        }
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.options.timeout
    }

    /// Connects to the first endpoint that accepts, starting with the last
    /// one that answered.
    async fn dial(&self, deadline: Instant) -> Result<(TcpStream, usize), std::io::Error> {
        let start = self.current.load(Ordering::Relaxed);
        let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "no endpoint");
        for i in 0..self.endpoints.len() {
            let index = (start + i) % self.endpoints.len();
            // A silent host must not eat the whole deadline when others may answer.
            let budget = deadline
                .saturating_duration_since(Instant::now())
                .min(Duration::from_secs(2));
            match tokio::time::timeout(budget, TcpStream::connect(&self.endpoints[index])).await {
                Ok(Ok(stream)) => {
                    let _ = stream.set_nodelay(true);
                    self.current.store(index, Ordering::Relaxed);
                    return Ok((stream, index));
                }
                Ok(Err(e)) => last = e,
                Err(_) => last = std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"),
            }
        }
        Err(last)
    }

    /// One request on one connection; the reply's JSON.
    async fn exchange(&self, path: &str, body: &Value, deadline: Instant) -> Result<Value, Failure> {
        let (mut stream, index) = self.dial(deadline).await.map_err(Failure::NotSent)?;
        let host = &self.endpoints[index];
        let io = |source| {
            Failure::Failed(StoreError::Io {
                location: format!("etcd://{host}"),
                source,
            })
        };
        stream
            .write_all(&http_request(host, path, body))
            .await
            .map_err(Failure::NotSent)?;
        let mut buf = Vec::new();
        loop {
            if buf.len() > MAX_REPLY {
                return Err(Failure::Failed(
                    self.malformed(format!("a reply over {MAX_REPLY} bytes")),
                ));
            }
            match stream.read_buf(&mut buf).await {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) => return Err(io(e)),
            }
        }
        let (status, at) = match http_head(&buf) {
            Ok(Some(head)) => head,
            Ok(None) => {
                return Err(Failure::Failed(StoreError::ConnectionClosed {
                    location: format!("etcd://{host}"),
                    operation: "a request",
                }));
            }
            Err(what) => return Err(Failure::Failed(self.malformed(what))),
        };
        let value: Value = serde_json::from_slice(&buf[at..])
            .map_err(|e| Failure::Failed(self.malformed(format!("{path} answered no JSON: {e}"))))?;
        if status != 200 {
            let message = value
                .get("message")
                .or_else(|| value.get("error"))
                .and_then(Value::as_str)
                .unwrap_or("no message")
                .to_string();
            let refused = StoreError::Refused {
                location: self.location(),
                message: format!("{path}: HTTP {status}: {message}"),
            };
            return Err(if status == 503 {
                let not_applied = message.contains("no leader");
                Failure::Unavailable(refused, not_applied)
            } else {
                Failure::Failed(refused)
            });
        }
        Ok(value)
    }

    /// A request under `deadline`, on the next endpoint when one fails.
    async fn post(
        &self,
        path: &str,
        body: &Value,
        deadline: Instant,
        retry: Retry,
        keys: &[&str],
    ) -> Result<Value, StoreError> {
        let started = Instant::now();
        let mut attempts = 0u32;
        let mut backoff = Duration::from_millis(10);
        let mut unavailable = None;
        loop {
            attempts += 1;
            let error = match tokio::time::timeout_at(deadline, self.exchange(path, body, deadline)).await {
                Err(_) => return Err(unavailable.unwrap_or_else(|| self.timeout_error(keys, started.elapsed()))),
                Ok(Ok(value)) => return Ok(value),
                Ok(Err(Failure::NotSent(e))) => e,
                Ok(Err(Failure::Failed(StoreError::Io { source, .. }))) if retry == Retry::Resend => source,
                // A member killed between request and reply closes the
                // connection: the next member answers a request safe to repeat.
                Ok(Err(Failure::Failed(StoreError::ConnectionClosed { .. }))) if retry == Retry::Resend => {
                    std::io::Error::new(std::io::ErrorKind::ConnectionReset, "closed before a reply")
                }
                // During an election: reads and puts are safe to repeat, and
                // a member without a leader applied nothing.
                Ok(Err(Failure::Unavailable(e, not_applied))) if retry == Retry::Resend || not_applied => {
                    let source = std::io::Error::other(e.to_string());
                    unavailable = Some(e);
                    source
                }
                Ok(Err(Failure::Failed(e) | Failure::Unavailable(e, _))) => return Err(e),
            };
            // The next endpoint is tried first next time.
            let next = (self.current.load(Ordering::Relaxed) + 1) % self.endpoints.len();
            self.current.store(next, Ordering::Relaxed);
            if Instant::now() + backoff >= deadline {
                if let Some(e) = unavailable {
                    return Err(e);
                }
                return Err(StoreError::Unreachable {
                    addr: self.endpoints.join(","),
                    attempts,
                    elapsed: started.elapsed(),
                    source: error,
                });
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_millis(500));
        }
    }

    async fn range(&self, body: Value, deadline: Instant, keys: &[&str]) -> Result<RangeReply, StoreError> {
        let reply = self.post("/v3/kv/range", &body, deadline, Retry::Resend, keys).await?;
        parse_range(&reply).map_err(|e| self.malformed(format!("range: {e}")))
    }

    async fn txn(&self, body: Value, deadline: Instant) -> Result<(bool, Vec<Value>), StoreError> {
        let reply = self
            .post("/v3/kv/txn", &body, deadline, Retry::BeforeSending, &[])
            .await?;
        parse_txn(&reply).map_err(|e| self.malformed(format!("txn: {e}")))
    }

    /// The keys of `keys` that do not exist now, and the revision read at.
    async fn missing<'k>(&self, keys: &[&'k str], deadline: Instant) -> Result<(Vec<&'k str>, i64), StoreError> {
        let mut missing = Vec::new();
        let mut revision = i64::MAX;
        for chunk in keys.chunks(MAX_TXN_OPS) {
            let ops = chunk
                .iter()
                .map(|k| req::op_range(req::count(&self.layout.dir(k))))
                .collect();
            let reply = self
                .post("/v3/kv/txn", &req::batch(ops), deadline, Retry::Resend, keys)
                .await?;
            let (_, responses) = parse_txn(&reply).map_err(|e| self.malformed(format!("txn: {e}")))?;
            revision = revision.min(reply.get("header").and_then(|h| int(h, "revision")).unwrap_or(0));
            if responses.len() != chunk.len() {
                return Err(self.malformed(format!("{} replies to {} ranges", responses.len(), chunk.len())));
            }
            for (key, response) in chunk.iter().zip(&responses) {
                let range = response.get("response_range").unwrap_or(&Value::Null);
                let range = parse_range(range).map_err(|e| self.malformed(format!("range: {e}")))?;
                if range.count == 0 {
                    missing.push(*key);
                }
            }
        }
        Ok((missing, revision))
    }

    /// Returns once anything under `dir` changes after `revision`, the
    /// watch ends, or `deadline` passes (then `false`).
    async fn watch(&self, dir: &[u8], revision: i64, deadline: Instant) -> Result<bool, StoreError> {
        let watched = async {
            let (mut stream, index) = match self.dial(deadline).await {
                Ok(dialled) => dialled,
                // The caller looks again; the next request reports an outage.
                Err(_) => return Ok(()),
            };
            let host = self.endpoints[index].clone();
            stream
                .write_all(&http_request(&host, "/v3/watch", &req::watch(dir, revision)))
                .await
                .map_err(|source| StoreError::Io {
                    location: format!("etcd://{host}"),
                    source,
                })?;
            let mut buf = Vec::new();
            let mut body_at = None;
            loop {
                match stream.read_buf(&mut buf).await {
                    // The server ended the watch: look again, after a pause
                    // so a server that ends every watch is not spun on.
                    Ok(0) | Err(_) => {
                        tokio::time::sleep(WATCH_RETRY).await;
                        return Ok(());
                    }
                    Ok(_) => {}
                }
                if buf.len() > MAX_REPLY {
                    return Err(self.malformed("a watch reply grew too large".into()));
                }
                if body_at.is_none() {
                    match http_head(&buf).map_err(|e| self.malformed(e))? {
                        Some((200, at)) => body_at = Some(at),
                        Some(_) => {
                            tokio::time::sleep(WATCH_RETRY).await;
                            return Ok(());
                        }
                        None => continue,
                    }
                }
                let at = body_at.expect("set above");
                let mut messages = serde_json::Deserializer::from_slice(&buf[at..]).into_iter::<Value>();
                for message in messages.by_ref() {
                    match message {
                        Ok(message) if watch_fired(&message) => return Ok(()),
                        Ok(_) => {}
                        Err(e) if e.is_eof() => break,
                        Err(e) => return Err(self.malformed(format!("watch: {e}"))),
                    }
                }
                let consumed = messages.byte_offset();
                buf.drain(at..at + consumed);
            }
        };
        match tokio::time::timeout_at(deadline, watched).await {
            Ok(result) => result.map(|()| true),
            Err(_) => Ok(false),
        }
    }

    async fn wait_until(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        for key in keys {
            self.check_key(key)?;
        }
        let started = Instant::now();
        let deadline = started + timeout;
        loop {
            let (missing, revision) = match self.missing(keys, deadline).await {
                Err(StoreError::Timeout { .. }) => return Err(self.timeout_error(keys, started.elapsed())),
                other => other?,
            };
            let Some(first) = missing.first() else {
                return Ok(());
            };
            if Instant::now() >= deadline || !self.watch(&self.layout.dir(first), revision + 1, deadline).await? {
                return Err(self.timeout_error(&missing, started.elapsed()));
            }
        }
    }

    fn check_key(&self, key: &str) -> Result<(), StoreError> {
        check_sizes(key, b"", &limits())
    }

    async fn read_modify_write(&self, key: &str, op: Rmw<'_>) -> Result<Bytes, StoreError> {
        self.check_key(key)?;
        let deadline = self.deadline();
        let etcd_key = self.layout.value(key);
        let receipt_key = self.layout.receipt(key);
        loop {
            let current = self.range(req::range(&etcd_key), deadline, &[key]).await?;
            let (value, mod_revision) = match current.kvs.into_iter().next() {
                Some(kv) => (Some(kv.value), kv.mod_revision),
                None => (None, 0),
            };
            let applied = apply(key, value, &op).map_err(|e| self.rejected(e))?;
            let Some(write) = applied.write else {
                return Ok(applied.reply);
            };
            check_sizes(key, &write, &limits())?;
            let tag = getrandom::u64().map_err(|e| StoreError::Io {
                location: self.location(),
                source: std::io::Error::other(format!("no random receipt: {e}")),
            })?;
            let tag = format!("{tag:016x}");
            let writes = vec![
                req::op_put(&etcd_key, &write),
                req::op_put(&receipt_key, tag.as_bytes()),
            ];
            match self.txn(req::guarded(&etcd_key, mod_revision, writes), deadline).await {
                Ok((true, _)) => return Ok(applied.reply),
                Ok((false, _)) => {}
                // Sent, then the member went away without a reply (killed):
                // the write must be neither lost nor applied twice.
                Err(lost @ (StoreError::Io { .. } | StoreError::ConnectionClosed { .. })) => {
                    match self
                        .was_applied(&etcd_key, &receipt_key, mod_revision, &tag, deadline, key)
                        .await?
                    {
                        Some(true) => return Ok(applied.reply),
                        Some(false) => {}
                        None => return Err(lost),
                    }
                }
                Err(error) => return Err(error),
            }
        }
    }

    /// Whether a guarded write of `etcd_key` (guarded on `mod_revision`,
    /// with receipt `tag`) that got no reply was applied: yes when the
    /// receipt is still `tag`, no when the key is still at that revision,
    /// `None` when another read-modify-write came since (it replaced the
    /// receipt, and may have come after this one). The pause first lets a
    /// proposal the lost member forwarded commit (reads are linearizable).
    async fn was_applied(
        &self,
        etcd_key: &[u8],
        receipt_key: &[u8],
        mod_revision: i64,
        tag: &str,
        deadline: Instant,
        key: &str,
    ) -> Result<Option<bool>, StoreError> {
        tokio::time::sleep(LOST_REPLY_SETTLE).await;
        let both = req::batch(vec![
            req::op_range(req::range(etcd_key)),
            req::op_range(req::range(receipt_key)),
        ]);
        let reply = self.post("/v3/kv/txn", &both, deadline, Retry::Resend, &[key]).await?;
        let (_, responses) = parse_txn(&reply).map_err(|e| self.malformed(format!("txn: {e}")))?;
        let kv = |i: usize| -> Result<Option<Kv>, StoreError> {
            let range = responses
                .get(i)
                .and_then(|r| r.get("response_range"))
                .unwrap_or(&Value::Null);
            let range = parse_range(range).map_err(|e| self.malformed(format!("range: {e}")))?;
            Ok(range.kvs.into_iter().next())
        };
        let (value, receipt) = (kv(0)?, kv(1)?);
        // Only this write carries its tag.
        if receipt.is_some_and(|r| r.value.as_ref() == tag.as_bytes()) {
            return Ok(Some(true));
        }
        let unchanged = value.map_or(0, |kv| kv.mod_revision) == mod_revision;
        Ok(unchanged.then_some(false))
    }
}

fn limits() -> Limits {
    Limits {
        max_value: MAX_ETCD_VALUE,
        ..Limits::default()
    }
}

#[async_trait]
impl Store for EtcdStore {
    fn location(&self) -> String {
        format!("etcd://{}{}", self.endpoints.join(","), self.prefix)
    }

    fn timeout(&self) -> Duration {
        self.options.timeout
    }

    async fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        check_sizes(key, value, &limits())?;
        let body = req::put(&self.layout.value(key), value);
        self.post("/v3/kv/put", &body, self.deadline(), Retry::Resend, &[key])
            .await
            .map(drop)
    }

    async fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Bytes, StoreError> {
        let started = Instant::now();
        loop {
            let left = timeout.saturating_sub(started.elapsed());
            self.wait_until(&[key], left).await.map_err(|e| match e {
                StoreError::Timeout { .. } => self.timeout_error(&[key], started.elapsed()),
                e => e,
            })?;
            let deadline = Instant::now() + left.max(Duration::from_millis(1));
            let reply = self
                .range(req::range(&self.layout.value(key)), deadline, &[key])
                .await?;
            if let Some(kv) = reply.kvs.into_iter().next() {
                return Ok(kv.value);
            }
            // Only a queue made the key exist, or it was deleted since: wait on.
            if started.elapsed() >= timeout {
                return Err(self.timeout_error(&[key], started.elapsed()));
            }
            let deadline = started + timeout;
            if !self
                .watch(&self.layout.value(key), reply.revision + 1, deadline)
                .await?
            {
                return Err(self.timeout_error(&[key], started.elapsed()));
            }
        }
    }

    async fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let reply = self.read_modify_write(key, Rmw::Add(delta)).await?;
        std::str::from_utf8(&reply)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| self.malformed("add produced no integer".into()))
    }

    async fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Bytes, StoreError> {
        check_sizes(key, desired, &limits())?;
        self.read_modify_write(key, Rmw::CompareSet { expected, desired }).await
    }

    async fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        for key in keys {
            self.check_key(key)?;
        }
        Ok(self.missing(keys, self.deadline()).await?.0.is_empty())
    }

    async fn wait_timeout(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        self.wait_until(keys, timeout).await
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        self.check_key(key)?;
        let body = json!({ "key": b64_encode(&self.layout.value(key)) });
        let reply = self
            .post(
                "/v3/kv/deleterange",
                &body,
                self.deadline(),
                Retry::BeforeSending,
                &[key],
            )
            .await?;
        Ok(int(&reply, "deleted").unwrap_or(0) > 0)
    }

    async fn num_keys(&self) -> Result<i64, StoreError> {
        let reply = self.range(req::keys(&self.layout.all()), self.deadline(), &[]).await?;
        Ok(reply.kvs.iter().filter(|kv| self.layout.is_value(&kv.key)).count() as i64)
    }

    async fn multi_get(&self, keys: &[&str]) -> Result<Vec<Bytes>, StoreError> {
        let started = Instant::now();
        loop {
            let left = self.options.timeout.saturating_sub(started.elapsed());
            self.wait_until(keys, left).await?;
            let deadline = Instant::now() + left.max(Duration::from_millis(1));
            let mut values = Vec::with_capacity(keys.len());
            for chunk in keys.chunks(MAX_TXN_OPS) {
                let ops = chunk
                    .iter()
                    .map(|k| req::op_range(req::range(&self.layout.value(k))))
                    .collect();
                let (_, responses) = self.txn(req::batch(ops), deadline).await?;
                for response in &responses {
                    let range = response.get("response_range").unwrap_or(&Value::Null);
                    let range = parse_range(range).map_err(|e| self.malformed(format!("range: {e}")))?;
                    values.push(range.kvs.into_iter().next().map(|kv| kv.value));
                }
            }
            if values.len() == keys.len() && values.iter().all(Option::is_some) {
                return Ok(values.into_iter().flatten().collect());
            }
            // A key was deleted, or exists only as a queue: wait again.
            if started.elapsed() >= self.options.timeout {
                return Err(self.timeout_error(keys, started.elapsed()));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<(), StoreError> {
        for (key, value) in pairs {
            check_sizes(key, value, &limits())?;
        }
        // etcd refuses a transaction that writes one key twice: the last write wins.
        let mut last: Vec<(&str, &[u8])> = Vec::new();
        for &(key, value) in pairs.iter().rev() {
            if !last.iter().any(|(k, _)| *k == key) {
                last.push((key, value));
            }
        }
        last.reverse();
        let deadline = self.deadline();
        for chunk in last.chunks(MAX_TXN_OPS) {
            let ops = chunk
                .iter()
                .map(|(k, v)| req::op_put(&self.layout.value(k), v))
                .collect();
            self.txn(req::batch(ops), deadline).await?;
        }
        Ok(())
    }

    async fn append(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        check_sizes(key, value, &limits())?;
        self.read_modify_write(key, Rmw::Append(value)).await.map(drop)
    }

    async fn queue_push(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        check_sizes(key, value, &limits())?;
        let nonce = getrandom::u64().map_err(|e| StoreError::Io {
            location: self.location(),
            source: std::io::Error::other(format!("no random queue nonce: {e}")),
        })?;
        let mut element = self.layout.queue(key);
        element.extend_from_slice(format!("{nonce:016x}").as_bytes());
        let body = req::put(&element, value);
        self.post("/v3/kv/put", &body, self.deadline(), Retry::Resend, &[key])
            .await
            .map(drop)
    }

    async fn queue_pop(&self, key: &str, block: bool) -> Result<Option<Bytes>, StoreError> {
        self.check_key(key)?;
        let started = Instant::now();
        let deadline = self.deadline();
        let queue = self.layout.queue(key);
        loop {
            let oldest = self.range(req::oldest(&queue), deadline, &[key]).await?;
            match oldest.kvs.into_iter().next() {
                Some(kv) => {
                    let body = req::guarded(&kv.key, kv.mod_revision, vec![req::op_delete(&kv.key)]);
                    if self.txn(body, deadline).await?.0 {
                        return Ok(Some(kv.value));
                    }
                }
                None if !block => return Ok(None),
                None => {
                    if !self.watch(&queue, oldest.revision + 1, deadline).await? {
                        return Err(self.timeout_error(&[key], started.elapsed()));
                    }
                }
            }
        }
    }

    async fn queue_len(&self, key: &str) -> Result<i64, StoreError> {
        self.check_key(key)?;
        Ok(self
            .range(req::count(&self.layout.queue(key)), self.deadline(), &[key])
            .await?
            .count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trips_and_matches_the_standard() {
        for (plain, encoded) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("/chorus/3/abc/v", "L2Nob3J1cy8zL2FiYy92"),
        ] {
            assert_eq!(b64_encode(plain.as_bytes()), encoded);
            assert_eq!(b64_decode(encoded).unwrap(), plain.as_bytes());
        }
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(b64_decode(&b64_encode(&all)).unwrap(), all);
        assert_eq!(b64_decode("Zm9"), Some(b"fo".to_vec()));
        assert_eq!(b64_decode("Z"), None);
        assert_eq!(b64_decode("Zm!v"), None);
    }

    #[test]
    fn prefix_end_covers_exactly_the_prefix() {
        assert_eq!(prefix_end(b"a/"), b"a0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff\xff"), b"\0");
    }

    #[test]
    fn key_directories_never_nest() {
        let layout = Layout::new("/job/");
        assert_eq!(layout.value("a"), b"/job/1/a/v");
        assert_eq!(layout.queue("a"), b"/job/1/a/q/");
        let (a, ab) = (layout.dir("a"), layout.dir("a/b"));
        assert!(!ab.starts_with(&a) && !a.starts_with(&ab));
        // A key whose text looks like another key's directory is still apart.
        let tricky = layout.dir("1/a/v");
        assert!(!tricky.starts_with(&a));
        assert!(layout.is_value(&layout.value("x")));
        let mut element = layout.queue("x");
        element.extend_from_slice(b"00000000000000ff");
        assert!(!layout.is_value(&element));
    }

    #[test]
    fn read_modify_write_follows_kvstate() {
        let b = |s: &str| Bytes::copy_from_slice(s.as_bytes());
        let add = apply("n", None, &Rmw::Add(5)).unwrap();
        assert_eq!((add.reply.clone(), add.write), (b("5"), Some(b("5"))));
        let read = apply("n", Some(b("5")), &Rmw::Add(0)).unwrap();
        assert_eq!((read.reply, read.write), (b("5"), None));
        let created = apply("n", None, &Rmw::Add(0)).unwrap();
        assert_eq!(created.write, Some(b("0")));
        assert!(matches!(
            apply("t", Some(b("x")), &Rmw::Add(1)),
            Err(StateError::NotANumber { .. })
        ));
        let cs = |cur: Option<&str>, exp: &str, des: &str| {
            apply(
                "k",
                cur.map(b),
                &Rmw::CompareSet {
                    expected: exp.as_bytes(),
                    desired: des.as_bytes(),
                },
            )
            .unwrap()
        };
        // Missing, empty expected: created.
        assert_eq!(
            cs(None, "", "d"),
            Applied {
                reply: b("d"),
                write: Some(b("d"))
            }
        );
        // Missing, non-empty expected: expected returned, nothing written.
        assert_eq!(
            cs(None, "x", "d"),
            Applied {
                reply: b("x"),
                write: None
            }
        );
        // Present and equal: swapped; present and different: current returned.
        assert_eq!(
            cs(Some("x"), "x", "d"),
            Applied {
                reply: b("d"),
                write: Some(b("d"))
            }
        );
        assert_eq!(
            cs(Some("y"), "x", "d"),
            Applied {
                reply: b("y"),
                write: None
            }
        );
        let appended = apply("a", Some(b("ab")), &Rmw::Append(b"c")).unwrap();
        assert_eq!(appended.write, Some(b("abc")));
        let big = vec![0u8; MAX_ETCD_VALUE];
        assert!(matches!(
            apply("a", Some(b("x")), &Rmw::Append(&big)),
            Err(StateError::ValueTooLong { .. })
        ));
    }

    #[test]
    fn transactions_guard_on_the_revision_read() {
        let created = req::guarded(b"k", 0, vec![req::op_put(b"k", b"v")]);
        assert_eq!(created["compare"][0]["target"], "VERSION");
        assert_eq!(created["compare"][0]["version"], 0);
        let swapped = req::guarded(b"k", 42, vec![req::op_delete(b"k")]);
        assert_eq!(swapped["compare"][0]["target"], "MOD");
        assert_eq!(swapped["compare"][0]["mod_revision"], 42);
        assert_eq!(swapped["success"][0]["request_delete_range"]["key"], "aw==");
        let watch = req::watch(b"a/", 7);
        assert_eq!(watch["create_request"]["range_end"], b64_encode(b"a0"));
    }

    #[test]
    fn gateway_replies_parse_with_zeros_left_out() {
        let reply: Value = serde_json::from_str(
            r#"{"header":{"revision":"9"},"kvs":[{"key":"aw==","mod_revision":"8","create_revision":"8","version":"1"}],"count":"1"}"#,
        )
        .unwrap();
        let range = parse_range(&reply).unwrap();
        assert_eq!(range.revision, 9);
        assert_eq!(range.count, 1);
        assert_eq!(range.kvs[0].key, b"k");
        assert_eq!(range.kvs[0].value, Bytes::new());
        assert_eq!(range.kvs[0].mod_revision, 8);
        let empty = parse_range(&serde_json::from_str(r#"{"header":{"revision":"3"}}"#).unwrap()).unwrap();
        assert_eq!((empty.count, empty.kvs.len()), (0, 0));
        assert!(parse_range(&serde_json::from_str(r#"{"kvs":[{"key":"!!"}]}"#).unwrap()).is_err());
        let (ok, responses) = parse_txn(&serde_json::from_str(r#"{"header":{}}"#).unwrap()).unwrap();
        assert!(!ok && responses.is_empty());
    }

    #[test]
    fn watch_messages_fire_on_events_cancels_and_compactions() {
        let m = |s: &str| serde_json::from_str::<Value>(s).unwrap();
        assert!(!watch_fired(&m(r#"{"result":{"header":{},"created":true}}"#)));
        assert!(watch_fired(&m(r#"{"result":{"events":[{"kv":{"key":"aw=="}}]}}"#)));
        assert!(watch_fired(&m(r#"{"result":{"canceled":true}}"#)));
        assert!(watch_fired(&m(r#"{"result":{"compact_revision":"5"}}"#)));
        assert!(watch_fired(&m(r#"{"error":{"message":"x"}}"#)));
    }

    #[test]
    fn http_framing() {
        let request = String::from_utf8(http_request("h:1", "/v3/kv/put", &json!({"a":1}))).unwrap();
        assert!(request.starts_with("POST /v3/kv/put HTTP/1.0\r\nHost: h:1\r\n"));
        assert!(request.ends_with("Content-Length: 7\r\n\r\n{\"a\":1}"));
        assert_eq!(http_head(b"HTTP/1.0 200 OK\r\nA: b\r\n"), Ok(None));
        assert_eq!(http_head(b"HTTP/1.0 404 Not Found\r\n\r\n{}"), Ok(Some((404, 26))));
        assert!(http_head(b"SSH-2.0\r\n\r\n").is_err());
        assert!(http_head(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n").is_err());
    }

    #[test]
    fn endpoints_parse_with_default_port_and_prefix() {
        let (e, p) = parse_endpoints("h1:1,h2,[::1]:3/jobs/a/").unwrap();
        assert_eq!(e, ["h1:1", "h2:2379", "[::1]:3"]);
        assert_eq!(p, "/jobs/a");
        assert_eq!(parse_endpoints("h").unwrap().1, DEFAULT_ETCD_PREFIX);
        for bad in ["", "h1,,h2", ":1", "h:x", "h:0", "[::1"] {
            assert!(parse_endpoints(bad).is_err(), "{bad}");
        }
    }
}
