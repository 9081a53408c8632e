//! The collective signature (`Signature::decode`): 32 bytes every rank
//! sends its peers before a collective, so mismatched calls are an error
//! instead of a hang.
//!
//! Input: the bytes as received.
//!
//! Checks: only 32-byte inputs decode; a decoded signature encodes back to
//! exactly its bytes (every field is checked, nothing is ignored); a
//! collective matches itself, a send matches the receive that mirrors it
//! (whatever their peers) and not another send.
#![no_main]

use chorus_runtime::collective::{CollectiveKind, ENCODED_LEN, Signature};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match Signature::decode(data) {
        Ok(signature) => {
            assert_eq!(data.len(), ENCODED_LEN);
            assert_eq!(&signature.encode()[..], data);
            let mirror = match signature.kind {
                CollectiveKind::Send => Some(CollectiveKind::Recv),
                CollectiveKind::Recv => Some(CollectiveKind::Send),
                _ => None,
            };
            match mirror {
                None => assert_eq!(signature.mismatch(&signature), None),
                Some(kind) => {
                    assert!(signature.mismatch(&signature).is_some(), "a send matched a send");
                    let other = Signature {
                        kind,
                        root: signature.root.map(|r| r ^ 1),
                        ..signature
                    };
                    assert_eq!(signature.mismatch(&other), None);
                    assert_eq!(other.mismatch(&signature), None);
                }
            }
        }
        Err(error) => {
            let _ = error.to_string();
        }
    }
});
