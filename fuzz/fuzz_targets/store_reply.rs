//! TCPStore client side: `decode_reply` fed what a (possibly hostile or
//! broken) server sends, in arbitrary pieces, for every reply shape.
//!
//! Input: byte 0 picks the shape (and, for `Values`, byte 1 the count) and
//! the limits; the rest is the stream.
//!
//! Checks, besides "no panic, no unbounded allocation":
//! - `Ok(None)` consumes nothing; `Ok(Some)` consumes only from the front;
//! - piece-by-piece decoding agrees with decoding the whole stream;
//! - a decoded reply, encoded again, decodes to itself.
#![no_main]

use bytes::BytesMut;
use chorus_runtime::store::protocol::{Limits, ProtocolError, Reply, ReplyShape, decode_reply, encode_reply};
use libfuzzer_sys::fuzz_target;

type Outcome = (Vec<Reply>, Result<(), ProtocolError>);

fn drain(buf: &mut BytesMut, shape: ReplyShape, limits: &Limits, out: &mut Vec<Reply>) -> Result<(), ProtocolError> {
    // `Nothing` and `Values(0)` consume nothing and always succeed: one is enough.
    let rounds = if consumes_nothing(shape) { 1 } else { usize::MAX };
    for _ in 0..rounds {
        let before = buf.clone();
        match decode_reply(buf, shape, limits)? {
            None => {
                assert_eq!(*buf, before, "Ok(None) consumed bytes");
                return Ok(());
            }
            Some(reply) => {
                let consumed = before.len() - buf.len();
                assert_eq!(
                    &before[consumed..],
                    &buf[..],
                    "bytes consumed from elsewhere than the front"
                );
                let mut encoded = BytesMut::new();
                encode_reply(&reply, &mut encoded);
                let again = decode_reply(&mut encoded, shape, limits);
                assert_eq!(
                    again,
                    Ok(Some(reply.clone())),
                    "{reply:?} does not survive encode/decode"
                );
                assert!(encoded.is_empty() || shape == ReplyShape::Nothing);
                assert!(consumed > 0 || consumes_nothing(shape), "a reply of zero bytes");
                out.push(reply);
                if consumed == 0 {
                    return Ok(());
                }
            }
        }
    }
    Ok(())
}

fn consumes_nothing(shape: ReplyShape) -> bool {
    matches!(shape, ReplyShape::Nothing | ReplyShape::Values(0))
}

fuzz_target!(|data: &[u8]| {
    let [selector, count, stream @ ..] = data else {
        return;
    };
    let shape = match selector % 8 {
        0 => ReplyShape::Nothing,
        1 => ReplyShape::U8,
        2 => ReplyShape::U32,
        3 => ReplyShape::I64,
        4 => ReplyShape::Value,
        5 => ReplyShape::Values(usize::from(*count % 16)),
        6 => ReplyShape::QueuePop,
        _ => ReplyShape::KeyList,
    };
    let limits = if selector & 8 == 0 {
        Limits::default()
    } else {
        Limits {
            max_key: 16,
            max_value: 64,
            max_keys_per_request: 4,
            max_request: 160,
        }
    };

    let mut buf = BytesMut::from(stream);
    let mut whole = Vec::new();
    let whole_end = drain(&mut buf, shape, &limits, &mut whole);
    let all_at_once: Outcome = (whole, whole_end);

    let mut buf = BytesMut::new();
    let mut replies = Vec::new();
    let mut end = Ok(());
    let mut step = usize::from(*count % 7) + 1;
    let mut rest = stream;
    while !rest.is_empty() && end.is_ok() {
        let n = step.min(rest.len());
        buf.extend_from_slice(&rest[..n]);
        rest = &rest[n..];
        step = step % 23 + 3;
        end = drain(&mut buf, shape, &limits, &mut replies);
    }
    if consumes_nothing(shape) {
        // The number of replies depends on how often it was asked.
        return;
    }
    assert_eq!(
        all_at_once,
        (replies, end),
        "piecewise decoding differs from decoding the whole stream"
    );
});
