#![no_main]
//! `chorus::sync::plan::decode_specs`, the parameter lists ranks exchange to
//! check they sync the same parameters (names, dtypes, lengths).
//!
//! Beyond "no panic": what decodes was made by `encode_specs`, byte for
//! byte (a list decodes from its one encoding only).

use chorus::sync::plan::{decode_specs, encode_specs};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some(specs) = decode_specs(data) {
        assert_eq!(encode_specs(&specs), data);
    }
});
