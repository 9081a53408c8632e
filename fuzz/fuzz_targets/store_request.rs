//! TCPStore server side: `decode_request` fed an arbitrary byte stream in
//! arbitrary pieces, as a connection delivers it, then every decoded request
//! applied to a `KvState` the way the server does.
//!
//! Input: byte 0 picks the limits and seeds the piece sizes; the rest is the
//! stream.
//!
//! Checks, besides "no panic, no unbounded allocation":
//! - `Ok(None)` consumes nothing; `Ok(Some)` consumes at least one byte and
//!   only from the front;
//! - a decoded request encodes back to exactly the bytes it consumed;
//! - decoding piece by piece gives the same requests and the same final
//!   outcome as decoding the whole stream at once;
//! - the state answers consistently (a set key reads back, `num_keys`
//!   matches `keys`, an append concatenates).
#![no_main]

use bytes::{Bytes, BytesMut};
use chorus_runtime::store::protocol::{Limits, ProtocolError, Request, decode_request};
use chorus_runtime::store::state::KvState;
use libfuzzer_sys::fuzz_target;

/// What a connection ended with: every request, then `Ok(())` when the
/// stream ran out mid-request (or at a boundary), or the error that closed it.
type Outcome = (Vec<Request>, Result<(), ProtocolError>);

fn limits(selector: u8) -> Limits {
    if selector & 1 == 0 {
        Limits::default()
    } else {
        // Small enough that the fuzzer hits every limit.
        Limits {
            max_key: 16,
            max_value: 64,
            max_keys_per_request: 4,
            max_request: 160,
        }
    }
}

/// Decodes every whole request at the front of `buf`, checking the
/// consumption rules; `Err` once the stream is broken.
fn drain(buf: &mut BytesMut, limits: &Limits, out: &mut Vec<Request>) -> Result<(), ProtocolError> {
    loop {
        let before = buf.clone();
        match decode_request(buf, limits) {
            Ok(None) => {
                assert_eq!(*buf, before, "Ok(None) consumed bytes");
                return Ok(());
            }
            Ok(Some(request)) => {
                let consumed = before.len() - buf.len();
                assert!(consumed > 0, "a request of zero bytes");
                assert_eq!(
                    &before[consumed..],
                    &buf[..],
                    "bytes consumed from elsewhere than the front"
                );
                let mut encoded = BytesMut::new();
                request.encode(&mut encoded);
                assert_eq!(
                    &encoded[..],
                    &before[..consumed],
                    "{request:?} does not encode back to its bytes"
                );
                out.push(request);
            }
            Err(error) => return Err(error),
        }
    }
}

fn whole(stream: &[u8], limits: &Limits) -> Outcome {
    let mut buf = BytesMut::from(stream);
    let mut requests = Vec::new();
    let end = drain(&mut buf, limits, &mut requests);
    (requests, end)
}

fn in_pieces(stream: &[u8], limits: &Limits, seed: u8) -> Outcome {
    let mut rng = u32::from(seed) | 0x100;
    let mut buf = BytesMut::new();
    let mut requests = Vec::new();
    let mut rest = stream;
    while !rest.is_empty() {
        // xorshift32: piece sizes 1..=32, sometimes a single byte.
        rng ^= rng << 13;
        rng ^= rng >> 17;
        rng ^= rng << 5;
        let n = ((rng % 32) as usize + 1).min(rest.len());
        buf.extend_from_slice(&rest[..n]);
        rest = &rest[n..];
        if let Err(error) = drain(&mut buf, limits, &mut requests) {
            return (requests, Err(error));
        }
    }
    (requests, Ok(()))
}

/// Applies `request` as the server would, checking the answers agree.
fn apply(
    state: &mut KvState<u64>,
    request: &Request,
    waits: &mut Vec<chorus_runtime::store::state::WaitId>,
    token: u64,
) {
    match request {
        Request::Validate { .. } | Request::Ping { .. } => {}
        Request::Set { key, value } => {
            let _ = state.set(key.clone(), value.clone());
            assert_eq!(state.get(key).as_ref(), Some(value));
        }
        Request::CompareSet { key, expected, desired } => {
            let (current, _) = state.compare_set(key.clone(), expected.clone(), desired.clone());
            if let Some(stored) = state.get(key) {
                assert_eq!(stored, current);
            }
        }
        Request::Get { key } | Request::QueueLen { key } => {
            let _ = state.get(key);
            assert!(state.queue_len(key) >= 0);
        }
        Request::Add { key, delta } => {
            if let Ok((next, _)) = state.add(key.clone(), *delta) {
                assert_eq!(state.get(key), Some(Bytes::from(next.to_string())));
            }
        }
        Request::Check { keys } => {
            let _ = state.check(keys);
        }
        Request::Wait { keys } => {
            if let Ok(id) = state.register_wait(keys, token) {
                waits.push(id);
            }
        }
        Request::GetNumKeys | Request::ListKeys => {
            assert_eq!(state.num_keys(), state.keys().len() as i64);
        }
        Request::DeleteKey { key } => {
            let _ = state.delete(key);
            assert_eq!(state.get(key), None);
        }
        Request::Append { key, value } => {
            let old = state.get(key);
            if state.append(key.clone(), value).is_ok() {
                let mut joined = old.map(|b| b.to_vec()).unwrap_or_default();
                joined.extend_from_slice(value);
                assert_eq!(state.get(key).as_deref(), Some(&joined[..]));
            }
        }
        Request::MultiGet { keys } => {
            if let Ok(values) = state.multi_get(keys) {
                assert_eq!(values.len(), keys.len());
            }
        }
        Request::MultiSet { pairs } => {
            for (key, value) in pairs {
                let _ = state.set(key.clone(), value.clone());
            }
        }
        Request::CancelWait => {
            if let Some(id) = waits.pop() {
                let _ = state.cancel_wait(id);
            }
        }
        Request::QueuePush { key, value } => {
            let before = state.queue_len(key);
            let _ = state.queue_push(key.clone(), value.clone());
            assert_eq!(state.queue_len(key), before + 1);
        }
        Request::QueuePop { key } => {
            let before = state.queue_len(key);
            match state.queue_pop(key) {
                Some((len_before, _)) => assert_eq!(len_before, before),
                None => assert_eq!(before, 0),
            }
        }
        Request::Barrier { key, world_size } => {
            if let Ok((Ok(id), _)) = state.barrier(key.clone(), *world_size, token) {
                waits.push(id);
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, stream)) = data.split_first() else {
        return;
    };
    let limits = limits(selector);
    let all_at_once = whole(stream, &limits);
    let piecewise = in_pieces(stream, &limits, selector);
    assert_eq!(
        all_at_once, piecewise,
        "piecewise decoding differs from decoding the whole stream"
    );

    let mut state = KvState::new(limits.max_value);
    let mut waits = Vec::new();
    for (token, request) in all_at_once.0.iter().enumerate() {
        apply(&mut state, request, &mut waits, token as u64);
    }
});
