//! The close notice (`CloseNotice::decode`): what a peer leaves when it
//! closes a link on purpose, read from a QUIC close frame's reason or from
//! the shared-memory ring header (up to 1020 bytes there).
//!
//! Input: the bytes as received.
//!
//! Checks, besides "never panics" (every input is some notice):
//! - bytes not in the encoded form (no marker, too short, or too few rank
//!   bytes) read as a plain reason, lossily as UTF-8;
//! - a decoded notice encoded again stays within `MAX_ENCODED` and decodes
//!   to a prefix of itself (ranks first, then the reason), and to itself
//!   when nothing had to be cut.
#![no_main]

use chorus_transports::link::CloseNotice;
use libfuzzer_sys::fuzz_target;

const MARKER: u8 = 0xC1;

fuzz_target!(|data: &[u8]| {
    let notice = CloseNotice::decode(data);
    let encoded_form = data.len() >= 3
        && data[0] == MARKER
        && data.len() - 3 >= 4 * usize::from(u16::from_le_bytes([data[1], data[2]]));
    if encoded_form {
        let count = usize::from(u16::from_le_bytes([data[1], data[2]]));
        assert_eq!(notice.failed.len(), count);
        let reason = &data[3 + 4 * count..];
        assert_eq!(notice.reason, String::from_utf8_lossy(reason));
    } else {
        assert_eq!(notice, CloseNotice::new(String::from_utf8_lossy(data)));
    }

    let again = notice.encode();
    assert!(again.len() <= CloseNotice::MAX_ENCODED);
    let back = CloseNotice::decode(&again);
    assert!(notice.failed.starts_with(&back.failed));
    assert!(notice.reason.starts_with(&back.reason));
    let room = (CloseNotice::MAX_ENCODED - 3) / 4;
    let uncut =
        notice.failed.len() <= room && 3 + 4 * notice.failed.len() + notice.reason.len() <= CloseNotice::MAX_ENCODED;
    if uncut {
        assert_eq!(back, notice);
    }
});
