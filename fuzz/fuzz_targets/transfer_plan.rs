#![no_main]
//! The state transfer's control decoders (`chorus::train::transfer_plan`),
//! which read what peers send before and after the chunks: a rank's hello
//! (words of an all-gather), a receiver's memory offer (checksummed bytes)
//! and a round's row of damaged chunks (a bitmap and a byte count). The
//! first byte picks the decoder; the rest is its input.
//!
//! Beyond "no panic": a hello decodes only from exactly its words and
//! survives encode/decode; an offer decodes only when its checksum holds
//! and re-encodes to an offer that decodes equal; a row decodes only at its
//! exact length, names chunks below the count once each, ascending, and
//! survives encode/decode.

use chorus::train::transfer_plan::{Hello, Offer, bitmap_words, decode_round, encode_round};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let words: Vec<u64> = rest
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    match selector % 3 {
        0 => {
            if let Some(hello) = Hello::decode(&words) {
                assert_eq!(words.len(), Hello::WORDS);
                assert_eq!(Hello::decode(&hello.encode()), Some(hello));
            }
        }
        1 => {
            if let Some(offer) = Offer::decode(rest) {
                assert_eq!(Offer::decode(&offer.encode()).as_ref(), Some(&offer));
            }
        }
        _ => {
            // The chunk count from the selector's high bits: small counts
            // reach the bitmap's edges (0, 63, 64, 65 chunks).
            let chunks = usize::from(selector >> 2) * 3;
            if let Some((bad, cma)) = decode_round(chunks, &words) {
                assert_eq!(words.len(), bitmap_words(chunks) + 1);
                assert!(bad.iter().all(|&c| c < chunks), "{bad:?} past {chunks}");
                assert!(bad.windows(2).all(|w| w[0] < w[1]), "{bad:?}");
                assert_eq!(decode_round(chunks, &encode_round(chunks, &bad, cma)), Some((bad, cma)));
            }
        }
    }
});
