//! Sans-IO codec for PyTorch's TCPStore wire protocol (libuv server, as of PyTorch 2.15).
//!
//! Integers are little-endian and raw; a key or value is a `u64` length then
//! its bytes; a request is a `u8` query type then its arguments. Decoders are
//! incremental: they return `Ok(None)` until a whole message is buffered and
//! consume nothing until then. Every length is checked against [`Limits`]
//! before anything is allocated or awaited, so a forged prefix of 2^60 is an
//! error at once, not an allocation.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use thiserror::Error;

/// The magic number a client sends first (`VALIDATE`).
pub const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;

/// `CHECK` reply: every key exists.
pub const CHECK_READY: u8 = 0;
/// `CHECK` reply: some key is missing.
pub const CHECK_NOT_READY: u8 = 1;
/// `WAIT` reply: every key exists.
pub const WAIT_STOP_WAITING: u8 = 0;
/// `CANCEL_WAIT` reply.
pub const WAIT_CANCELED: u8 = 1;

/// Size limits a decoder enforces before it allocates or waits for bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Longest key accepted, in bytes.
    pub max_key: usize,
    /// Longest value accepted, in bytes.
    pub max_value: usize,
    /// Most keys in one multi-key request.
    pub max_keys_per_request: usize,
    /// Largest whole request (all keys and values together), in bytes.
    pub max_request: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_key: 8 * 1024,
            max_value: 64 * 1024 * 1024,
            max_keys_per_request: 128 * 1024,
            max_request: 128 * 1024 * 1024,
        }
    }
}

/// Why a message could not be decoded. The connection that sent it is closed.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ProtocolError {
    /// The query type byte is not one this protocol defines.
    #[error("unknown query type {0}")]
    UnknownQuery(u8),
    /// The first message was not `VALIDATE` with the right magic.
    #[error("handshake failed: expected VALIDATE with magic 0x3c85f7ce, got {0}")]
    BadHandshake(String),
    /// A key is longer than [`Limits::max_key`].
    #[error("key of {len} bytes exceeds the limit of {limit} bytes")]
    KeyTooLong {
        /// Announced length.
        len: u64,
        /// Configured limit.
        limit: usize,
    },
    /// A value is longer than [`Limits::max_value`].
    #[error("value of {len} bytes exceeds the limit of {limit} bytes")]
    ValueTooLong {
        /// Announced length.
        len: u64,
        /// Configured limit.
        limit: usize,
    },
    /// A multi-key request names more keys than [`Limits::max_keys_per_request`].
    #[error("request names {count} keys, more than the limit of {limit}")]
    TooManyKeys {
        /// Announced count (as sent, possibly negative).
        count: i128,
        /// Configured limit.
        limit: usize,
    },
    /// A request is larger than [`Limits::max_request`].
    #[error("request of at least {len} bytes exceeds the limit of {limit} bytes")]
    RequestTooLarge {
        /// Bytes announced so far.
        len: u64,
        /// Configured limit.
        limit: usize,
    },
    /// A reply did not have the shape the request calls for.
    #[error("malformed reply: {0}")]
    MalformedReply(String),
}

/// Query type codes, in wire order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
#[allow(missing_docs)] // each variant is named after the query it codes
pub enum QueryType {
    Validate = 0,
    Set = 1,
    CompareSet = 2,
    Get = 3,
    Add = 4,
    Check = 5,
    Wait = 6,
    GetNumKeys = 7,
    DeleteKey = 8,
    Append = 9,
    MultiGet = 10,
    MultiSet = 11,
    CancelWait = 12,
    Ping = 13,
    QueuePush = 14,
    QueuePop = 15,
    QueueLen = 16,
    ListKeys = 17,
    Barrier = 18,
}

impl QueryType {
    fn from_u8(byte: u8) -> Option<Self> {
        use QueryType::*;
        Some(match byte {
            0 => Validate,
            1 => Set,
            2 => CompareSet,
            3 => Get,
            4 => Add,
            5 => Check,
            6 => Wait,
            7 => GetNumKeys,
            8 => DeleteKey,
            9 => Append,
            10 => MultiGet,
            11 => MultiSet,
            12 => CancelWait,
            13 => Ping,
            14 => QueuePush,
            15 => QueuePop,
            16 => QueueLen,
            17 => ListKeys,
            18 => Barrier,
            _ => return None,
        })
    }
}

/// One request, as a client sends it. Keys are raw bytes: the Python client
/// prefixes user keys with `/`, the server does not care.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(missing_docs)] // fields are the protocol's own arguments
pub enum Request {
    Validate {
        magic: u32,
    },
    Set {
        key: Bytes,
        value: Bytes,
    },
    CompareSet {
        key: Bytes,
        expected: Bytes,
        desired: Bytes,
    },
    Get {
        key: Bytes,
    },
    Add {
        key: Bytes,
        delta: i64,
    },
    Check {
        keys: Vec<Bytes>,
    },
    Wait {
        keys: Vec<Bytes>,
    },
    GetNumKeys,
    DeleteKey {
        key: Bytes,
    },
    Append {
        key: Bytes,
        value: Bytes,
    },
    MultiGet {
        keys: Vec<Bytes>,
    },
    MultiSet {
        pairs: Vec<(Bytes, Bytes)>,
    },
    CancelWait,
    Ping {
        nonce: u32,
    },
    QueuePush {
        key: Bytes,
        value: Bytes,
    },
    QueuePop {
        key: Bytes,
    },
    QueueLen {
        key: Bytes,
    },
    ListKeys,
    /// Adds 1 to the counter at `key`; replied to once it reaches `world_size`.
    Barrier {
        key: Bytes,
        world_size: i64,
    },
}

impl Request {
    /// The query type this request is sent as.
    pub fn query_type(&self) -> QueryType {
        match self {
            Request::Validate { .. } => QueryType::Validate,
            Request::Set { .. } => QueryType::Set,
            Request::CompareSet { .. } => QueryType::CompareSet,
            Request::Get { .. } => QueryType::Get,
            Request::Add { .. } => QueryType::Add,
            Request::Check { .. } => QueryType::Check,
            Request::Wait { .. } => QueryType::Wait,
            Request::GetNumKeys => QueryType::GetNumKeys,
            Request::DeleteKey { .. } => QueryType::DeleteKey,
            Request::Append { .. } => QueryType::Append,
            Request::MultiGet { .. } => QueryType::MultiGet,
            Request::MultiSet { .. } => QueryType::MultiSet,
            Request::CancelWait => QueryType::CancelWait,
            Request::Ping { .. } => QueryType::Ping,
            Request::QueuePush { .. } => QueryType::QueuePush,
            Request::QueuePop { .. } => QueryType::QueuePop,
            Request::QueueLen { .. } => QueryType::QueueLen,
            Request::ListKeys => QueryType::ListKeys,
            Request::Barrier { .. } => QueryType::Barrier,
        }
    }

    /// Appends the wire form of this request to `out`.
    pub fn encode(&self, out: &mut BytesMut) {
        out.put_u8(self.query_type() as u8);
        match self {
            Request::Validate { magic } => out.put_u32_le(*magic),
            Request::Set { key, value } | Request::Append { key, value } | Request::QueuePush { key, value } => {
                put_bytes(out, key);
                put_bytes(out, value);
            }
            Request::CompareSet { key, expected, desired } => {
                put_bytes(out, key);
                put_bytes(out, expected);
                put_bytes(out, desired);
            }
            Request::Get { key }
            | Request::DeleteKey { key }
            | Request::QueuePop { key }
            | Request::QueueLen { key } => put_bytes(out, key),
            Request::Add { key, delta: value } | Request::Barrier { key, world_size: value } => {
                put_bytes(out, key);
                out.put_i64_le(*value);
            }
            Request::Check { keys } | Request::Wait { keys } | Request::MultiGet { keys } => {
                out.put_u64_le(keys.len() as u64);
                for key in keys {
                    put_bytes(out, key);
                }
            }
            Request::MultiSet { pairs } => {
                out.put_i64_le(pairs.len() as i64);
                for (key, value) in pairs {
                    put_bytes(out, key);
                    put_bytes(out, value);
                }
            }
            Request::GetNumKeys | Request::CancelWait | Request::ListKeys => {}
            Request::Ping { nonce } => out.put_u32_le(*nonce),
        }
    }
}

/// Appends a `u64`-length-prefixed byte string.
pub fn put_bytes(out: &mut BytesMut, bytes: &[u8]) {
    out.put_u64_le(bytes.len() as u64);
    out.put_slice(bytes);
}

/// A read cursor over buffered bytes that reports "need more" as `None`.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    limits: Limits,
}

impl<'a> Cursor<'a> {
    fn new(buf: &'a [u8], limits: Limits) -> Self {
        Self { buf, pos: 0, limits }
    }

    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let slice = self.buf.get(self.pos..end)?;
        self.pos = end;
        Some(slice)
    }

    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }

    fn u32(&mut self) -> Option<u32> {
        self.take(4).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
    }

    fn u64(&mut self) -> Option<u64> {
        self.take(8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }

    fn i64(&mut self) -> Option<i64> {
        self.u64().map(|v| v as i64)
    }

    fn check_size(&self, extra: u64) -> Result<(), ProtocolError> {
        let total = self.pos as u64 + extra;
        if total > self.limits.max_request as u64 {
            return Err(ProtocolError::RequestTooLarge {
                len: total,
                limit: self.limits.max_request,
            });
        }
        Ok(())
    }

    /// A length-prefixed key; the range it occupies in the buffer.
    fn key(&mut self) -> Result<Option<(usize, usize)>, ProtocolError> {
        let Some(len) = self.u64() else {
            return Ok(None);
        };
        if len > self.limits.max_key as u64 {
            return Err(ProtocolError::KeyTooLong {
                len,
                limit: self.limits.max_key,
            });
        }
        self.check_size(len)?;
        let start = self.pos;
        Ok(self.take(len as usize).map(|_| (start, len as usize)))
    }

    fn value(&mut self) -> Result<Option<(usize, usize)>, ProtocolError> {
        let Some(len) = self.u64() else {
            return Ok(None);
        };
        if len > self.limits.max_value as u64 {
            return Err(ProtocolError::ValueTooLong {
                len,
                limit: self.limits.max_value,
            });
        }
        self.check_size(len)?;
        let start = self.pos;
        Ok(self.take(len as usize).map(|_| (start, len as usize)))
    }

    fn count(&mut self, raw: Option<i128>) -> Result<Option<usize>, ProtocolError> {
        let Some(count) = raw else {
            return Ok(None);
        };
        if count < 0 || count > self.limits.max_keys_per_request as i128 {
            return Err(ProtocolError::TooManyKeys {
                count,
                limit: self.limits.max_keys_per_request,
            });
        }
        Ok(Some(count as usize))
    }
}

/// Evaluates to the value inside `Ok(Some(_))`, or returns `Ok(None)` / the error.
macro_rules! need {
    ($e:expr) => {
        match $e {
            Some(v) => v,
            None => return Ok(None),
        }
    };
}

macro_rules! need_res {
    ($e:expr) => {
        match $e? {
            Some(v) => v,
            None => return Ok(None),
        }
    };
}

/// Decodes one request from the front of `buf`, removing its bytes.
///
/// `Ok(None)`: more bytes are needed; nothing was consumed.
pub fn decode_request(buf: &mut BytesMut, limits: &Limits) -> Result<Option<Request>, ProtocolError> {
    // Parse ranges first, then split the buffer once, so keys and values are
    // zero-copy slices of the receive buffer.
    let mut cur = Cursor::new(&buf[..], *limits);
    let Some(shape) = Shape::read(&mut cur)? else {
        return Ok(None);
    };
    let frame = buf.split_to(cur.pos).freeze();
    Ok(Some(shape.into_request(&frame)))
}

/// A request read as byte ranges of the receive buffer (start, length),
/// before the buffer is split.
enum Shape {
    Fixed(Request),
    One(QueryType, (usize, usize)),
    Two(QueryType, (usize, usize), (usize, usize)),
    Three((usize, usize), (usize, usize), (usize, usize)),
    KeyAndInt(QueryType, (usize, usize), i64),
    Keys(QueryType, Vec<(usize, usize)>),
    Pairs(Vec<((usize, usize), (usize, usize))>),
}

impl Shape {
    /// Reads one request's fields; `Ok(None)` where bytes are missing.
    fn read(cur: &mut Cursor<'_>) -> Result<Option<Self>, ProtocolError> {
        let code = need!(cur.u8());
        let query = QueryType::from_u8(code).ok_or(ProtocolError::UnknownQuery(code))?;
        Ok(Some(match query {
            QueryType::Validate => Shape::Fixed(Request::Validate {
                magic: need!(cur.u32()),
            }),
            QueryType::GetNumKeys => Shape::Fixed(Request::GetNumKeys),
            QueryType::CancelWait => Shape::Fixed(Request::CancelWait),
            QueryType::ListKeys => Shape::Fixed(Request::ListKeys),
            QueryType::Ping => Shape::Fixed(Request::Ping {
                nonce: need!(cur.u32()),
            }),
            QueryType::Set | QueryType::Append | QueryType::QueuePush => {
                let key = need_res!(cur.key());
                let value = need_res!(cur.value());
                Shape::Two(query, key, value)
            }
            QueryType::CompareSet => {
                let key = need_res!(cur.key());
                let expected = need_res!(cur.value());
                let desired = need_res!(cur.value());
                Shape::Three(key, expected, desired)
            }
            QueryType::Get | QueryType::DeleteKey | QueryType::QueuePop | QueryType::QueueLen => {
                Shape::One(query, need_res!(cur.key()))
            }
            QueryType::Add | QueryType::Barrier => {
                let key = need_res!(cur.key());
                Shape::KeyAndInt(query, key, need!(cur.i64()))
            }
            QueryType::Check | QueryType::Wait | QueryType::MultiGet => {
                let raw = cur.u64().map(i128::from);
                let count = need_res!(cur.count(raw));
                let mut keys = Vec::new();
                for _ in 0..count {
                    keys.push(need_res!(cur.key()));
                }
                Shape::Keys(query, keys)
            }
            QueryType::MultiSet => {
                let raw = cur.i64().map(i128::from);
                let count = need_res!(cur.count(raw));
                let mut pairs = Vec::new();
                for _ in 0..count {
                    let key = need_res!(cur.key());
                    let value = need_res!(cur.value());
                    pairs.push((key, value));
                }
                Shape::Pairs(pairs)
            }
        }))
    }

    /// The request, its keys and values slices of `frame` (its bytes).
    fn into_request(self, frame: &Bytes) -> Request {
        let slice = |(start, len): (usize, usize)| frame.slice(start..start + len);
        match self {
            Shape::Fixed(request) => request,
            Shape::One(query, key) => {
                let key = slice(key);
                match query {
                    QueryType::Get => Request::Get { key },
                    QueryType::DeleteKey => Request::DeleteKey { key },
                    QueryType::QueuePop => Request::QueuePop { key },
                    _ => Request::QueueLen { key },
                }
            }
            Shape::Two(query, key, value) => {
                let (key, value) = (slice(key), slice(value));
                match query {
                    QueryType::Set => Request::Set { key, value },
                    QueryType::Append => Request::Append { key, value },
                    _ => Request::QueuePush { key, value },
                }
            }
            Shape::Three(key, expected, desired) => Request::CompareSet {
                key: slice(key),
                expected: slice(expected),
                desired: slice(desired),
            },
            Shape::KeyAndInt(QueryType::Add, key, delta) => Request::Add { key: slice(key), delta },
            Shape::KeyAndInt(_, key, world_size) => Request::Barrier {
                key: slice(key),
                world_size,
            },
            Shape::Keys(query, keys) => {
                let keys = keys.into_iter().map(slice).collect();
                match query {
                    QueryType::Check => Request::Check { keys },
                    QueryType::Wait => Request::Wait { keys },
                    _ => Request::MultiGet { keys },
                }
            }
            Shape::Pairs(pairs) => Request::MultiSet {
                pairs: pairs.into_iter().map(|(k, v)| (slice(k), slice(v))).collect(),
            },
        }
    }
}

/// The shape of the reply a request calls for; the client decodes with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyShape {
    /// No reply (`SET`, `APPEND`, `MULTI_SET`, `QUEUE_PUSH`, `VALIDATE`).
    Nothing,
    /// One `u8` (`CHECK`, `WAIT`, `CANCEL_WAIT`, `BARRIER`).
    U8,
    /// One `u32` (`PING`).
    U32,
    /// One `i64` (`ADD`, `GETNUMKEYS`, `DELETE_KEY`, `QUEUE_LEN`).
    I64,
    /// One length-prefixed value (`GET`, `COMPARE_SET`).
    Value,
    /// `n` length-prefixed values (`MULTI_GET`).
    Values(usize),
    /// The queue's `i64` length before the pop, then a value if it was
    /// positive (`QUEUE_POP`).
    QueuePop,
    /// An `i64` count then that many keys (`LIST_KEYS`).
    KeyList,
}

impl ReplyShape {
    /// The reply shape `request` calls for.
    pub fn of(request: &Request) -> Self {
        match request {
            Request::Validate { .. }
            | Request::Set { .. }
            | Request::Append { .. }
            | Request::MultiSet { .. }
            | Request::QueuePush { .. } => ReplyShape::Nothing,
            Request::Check { .. } | Request::Wait { .. } | Request::CancelWait | Request::Barrier { .. } => {
                ReplyShape::U8
            }
            Request::Ping { .. } => ReplyShape::U32,
            Request::Add { .. } | Request::GetNumKeys | Request::DeleteKey { .. } | Request::QueueLen { .. } => {
                ReplyShape::I64
            }
            Request::Get { .. } | Request::CompareSet { .. } => ReplyShape::Value,
            Request::MultiGet { keys } => ReplyShape::Values(keys.len()),
            Request::QueuePop { .. } => ReplyShape::QueuePop,
            Request::ListKeys => ReplyShape::KeyList,
        }
    }
}

/// A decoded reply.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(missing_docs)] // each variant mirrors a ReplyShape
pub enum Reply {
    Nothing,
    U8(u8),
    U32(u32),
    I64(i64),
    Value(Bytes),
    Values(Vec<Bytes>),
    /// The value popped; `None` when the queue was empty.
    Popped(Option<Bytes>),
    /// The popped value and the queue length before the pop (server side).
    PoppedFrom {
        len_before: i64,
        value: Bytes,
    },
    Keys(Vec<Bytes>),
}

/// Decodes one reply of `shape` from the front of `buf`, removing its bytes.
pub fn decode_reply(buf: &mut BytesMut, shape: ReplyShape, limits: &Limits) -> Result<Option<Reply>, ProtocolError> {
    let limits = Limits {
        max_request: usize::MAX,
        ..*limits
    };
    let mut cur = Cursor::new(&buf[..], limits);
    let reply = match shape {
        ReplyShape::Nothing => return Ok(Some(Reply::Nothing)),
        ReplyShape::U8 => Reply::U8(need!(cur.u8())),
        ReplyShape::U32 => Reply::U32(need!(cur.u32())),
        ReplyShape::I64 => Reply::I64(need!(cur.i64())),
        ReplyShape::Value => {
            let (start, len) = need_res!(cur.value());
            let end = cur.pos;
            let mut frame = buf.split_to(end).freeze();
            return Ok(Some(Reply::Value(frame.split_off(start).slice(..len))));
        }
        ReplyShape::Values(count) => {
            let mut ranges = Vec::new();
            for _ in 0..count {
                ranges.push(need_res!(cur.value()));
            }
            let frame = buf.split_to(cur.pos).freeze();
            return Ok(Some(Reply::Values(
                ranges.into_iter().map(|(s, l)| frame.slice(s..s + l)).collect(),
            )));
        }
        ReplyShape::QueuePop => {
            if need!(cur.i64()) <= 0 {
                Reply::Popped(None)
            } else {
                let (start, len) = need_res!(cur.value());
                let frame = buf.split_to(cur.pos).freeze();
                return Ok(Some(Reply::Popped(Some(frame.slice(start..start + len)))));
            }
        }
        ReplyShape::KeyList => {
            let raw = cur.i64().map(i128::from);
            let count = need_res!(cur.count(raw));
            let mut ranges = Vec::new();
            for _ in 0..count {
                ranges.push(need_res!(cur.key()));
            }
            let frame = buf.split_to(cur.pos).freeze();
            return Ok(Some(Reply::Keys(
                ranges.into_iter().map(|(s, l)| frame.slice(s..s + l)).collect(),
            )));
        }
    };
    buf.advance(cur.pos);
    Ok(Some(reply))
}

/// Appends the wire form of `reply` (server side).
pub fn encode_reply(reply: &Reply, out: &mut BytesMut) {
    match reply {
        Reply::Nothing => {}
        Reply::U8(v) => out.put_u8(*v),
        Reply::U32(v) => out.put_u32_le(*v),
        Reply::I64(v) => out.put_i64_le(*v),
        Reply::Value(v) => put_bytes(out, v),
        Reply::Values(values) => {
            for v in values {
                put_bytes(out, v);
            }
        }
        Reply::Popped(None) => out.put_i64_le(0),
        Reply::Popped(Some(v)) => {
            out.put_i64_le(1);
            put_bytes(out, v);
        }
        Reply::PoppedFrom { len_before, value } => {
            out.put_i64_le(*len_before);
            put_bytes(out, value);
        }
        Reply::Keys(keys) => {
            out.put_i64_le(keys.len() as i64);
            for k in keys {
                put_bytes(out, k);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn roundtrip(request: Request) {
        let mut buf = BytesMut::new();
        request.encode(&mut buf);
        let full = buf.clone();
        // Every strict prefix is "need more", and consumes nothing.
        for cut in 0..full.len() {
            let mut partial = BytesMut::from(&full[..cut]);
            assert_eq!(
                decode_request(&mut partial, &Limits::default()),
                Ok(None),
                "cut at {cut}"
            );
            assert_eq!(partial.len(), cut);
        }
        let decoded = decode_request(&mut buf, &Limits::default()).unwrap().unwrap();
        assert_eq!(decoded, request);
        assert!(buf.is_empty());
    }

    fn b(s: &str) -> Bytes {
        Bytes::copy_from_slice(s.as_bytes())
    }

    #[test]
    fn every_request_roundtrips() {
        for request in [
            Request::Validate {
                magic: VALIDATION_MAGIC,
            },
            Request::Set {
                key: b("/k"),
                value: b("v"),
            },
            Request::CompareSet {
                key: b("k"),
                expected: b(""),
                desired: b("d"),
            },
            Request::Get { key: b("k") },
            Request::Add { key: b("k"), delta: -7 },
            Request::Check {
                keys: vec![b("a"), b("b")],
            },
            Request::Wait { keys: vec![b("a")] },
            Request::GetNumKeys,
            Request::DeleteKey { key: b("k") },
            Request::Append {
                key: b("k"),
                value: b("xyz"),
            },
            Request::MultiGet {
                keys: vec![b("a"), b(""), b("c")],
            },
            Request::MultiSet {
                pairs: vec![(b("a"), b("1")), (b("b"), b(""))],
            },
            Request::CancelWait,
            Request::Ping { nonce: 0xdead_beef },
            Request::QueuePush {
                key: b("q"),
                value: b("item"),
            },
            Request::QueuePop { key: b("q") },
            Request::QueueLen { key: b("q") },
            Request::ListKeys,
            Request::Barrier {
                key: b("/b"),
                world_size: 4,
            },
        ] {
            roundtrip(request);
        }
    }

    #[test]
    fn forged_lengths_fail_before_any_wait() {
        let mut buf = BytesMut::new();
        buf.put_u8(QueryType::Set as u8);
        buf.put_u64_le(1 << 60);
        assert!(matches!(
            decode_request(&mut buf, &Limits::default()),
            Err(ProtocolError::KeyTooLong { .. })
        ));
        let mut buf = BytesMut::new();
        buf.put_u8(QueryType::Set as u8);
        put_bytes(&mut buf, b"k");
        buf.put_u64_le(1 << 60);
        assert!(matches!(
            decode_request(&mut buf, &Limits::default()),
            Err(ProtocolError::ValueTooLong { .. })
        ));
        let mut buf = BytesMut::new();
        buf.put_u8(QueryType::MultiSet as u8);
        buf.put_i64_le(-1);
        assert!(matches!(
            decode_request(&mut buf, &Limits::default()),
            Err(ProtocolError::TooManyKeys { count: -1, .. })
        ));
    }

    #[test]
    fn request_size_is_bounded_across_keys() {
        let limits = Limits {
            max_request: 100,
            ..Limits::default()
        };
        let mut buf = BytesMut::new();
        Request::MultiSet {
            pairs: vec![(b("a"), Bytes::from(vec![0u8; 60])); 2],
        }
        .encode(&mut buf);
        assert!(matches!(
            decode_request(&mut buf, &limits),
            Err(ProtocolError::RequestTooLarge { .. })
        ));
    }

    #[test]
    fn unknown_query_is_rejected() {
        let mut buf = BytesMut::from(&[19u8, 0, 0][..]);
        assert_eq!(
            decode_request(&mut buf, &Limits::default()),
            Err(ProtocolError::UnknownQuery(19))
        );
    }

    #[test]
    fn replies_roundtrip() {
        let cases = [
            (ReplyShape::U8, Reply::U8(1)),
            (ReplyShape::U32, Reply::U32(9)),
            (ReplyShape::I64, Reply::I64(-3)),
            (ReplyShape::Value, Reply::Value(b("value"))),
            (ReplyShape::Values(2), Reply::Values(vec![b("a"), b("")])),
            (ReplyShape::QueuePop, Reply::Popped(None)),
            (ReplyShape::QueuePop, Reply::Popped(Some(b("x")))),
            (ReplyShape::KeyList, Reply::Keys(vec![b("/a"), b("init/")])),
        ];
        for (shape, reply) in cases {
            let mut buf = BytesMut::new();
            encode_reply(&reply, &mut buf);
            let full = buf.clone();
            for cut in 0..full.len() {
                let mut partial = BytesMut::from(&full[..cut]);
                assert_eq!(decode_reply(&mut partial, shape, &Limits::default()), Ok(None));
            }
            assert_eq!(decode_reply(&mut buf, shape, &Limits::default()), Ok(Some(reply)));
            assert!(buf.is_empty());
        }
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic_and_never_overconsume(data in proptest::collection::vec(any::<u8>(), 0..512)) {
            let limits = Limits { max_key: 64, max_value: 256, max_keys_per_request: 8, max_request: 1024 };
            let mut buf = BytesMut::from(&data[..]);
            loop {
                let before = buf.len();
                match decode_request(&mut buf, &limits) {
                    Ok(Some(_)) => prop_assert!(buf.len() < before),
                    Ok(None) => { prop_assert_eq!(buf.len(), before); break }
                    Err(_) => break,
                }
            }
        }

        #[test]
        fn arbitrary_reply_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..256), shape_ix in 0usize..8) {
            let shapes = [ReplyShape::U8, ReplyShape::U32, ReplyShape::I64, ReplyShape::Value,
                ReplyShape::Values(3), ReplyShape::QueuePop, ReplyShape::Nothing, ReplyShape::KeyList];
            let limits = Limits { max_key: 64, max_value: 128, max_keys_per_request: 8, max_request: 1024 };
            let mut buf = BytesMut::from(&data[..]);
            let _ = decode_reply(&mut buf, shapes[shape_ix], &limits);
        }

        #[test]
        fn encoded_requests_decode_back(key in proptest::collection::vec(any::<u8>(), 0..64),
                                        value in proptest::collection::vec(any::<u8>(), 0..256),
                                        delta in any::<i64>()) {
            let (key, value) = (Bytes::from(key), Bytes::from(value));
            for request in [
                Request::Set { key: key.clone(), value: value.clone() },
                Request::Add { key: key.clone(), delta },
                Request::MultiSet { pairs: vec![(key.clone(), value.clone()); 3] },
            ] {
                let mut buf = BytesMut::new();
                request.encode(&mut buf);
                prop_assert_eq!(decode_request(&mut buf, &Limits::default()).unwrap(), Some(request));
            }
        }
    }
}
