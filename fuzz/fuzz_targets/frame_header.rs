//! The link frame header (`FrameHeader::decode`): the 16 bytes in front of
//! every payload on a QUIC stream, read from a peer.
//!
//! Input: 16 header bytes, then up to 8 bytes of the receiver's `max_frame`
//! (little-endian; absent bytes are 0), so limits around the announced
//! length get hit.
//!
//! Checks: a header is accepted exactly when its length is within
//! `max_frame`; an accepted header encodes back to its bytes; a refusal
//! reports the announced length, the limit and the peer.
#![no_main]

use chorus_transports::link::{FrameHeader, TransportError};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((header, rest)) = data.split_first_chunk::<{ FrameHeader::SIZE }>() else {
        return;
    };
    let mut limit = [0u8; 8];
    let n = rest.len().min(8);
    limit[..n].copy_from_slice(&rest[..n]);
    let max_frame = u64::from_le_bytes(limit) as usize;
    let announced = u64::from_le_bytes(header[8..].try_into().unwrap());
    match FrameHeader::decode(header, 7, max_frame) {
        Ok(decoded) => {
            assert!(decoded.len <= max_frame as u64);
            assert_eq!(decoded.len, announced);
            assert_eq!(&decoded.encode(), header);
        }
        Err(TransportError::FrameTooLarge { peer, len, limit }) => {
            assert_eq!((peer, len, limit), (7, announced, max_frame));
            assert!(len > max_frame as u64);
        }
        Err(other) => panic!("unexpected error {other:?}"),
    }
});
