//! Copies into memory that will not be read again while it is in cache.
//!
//! An ordinary store first reads the destination's cache line (write
//! allocate), so copying into memory that is not cached moves every byte
//! over the memory bus twice before it is even written back. Non-temporal
//! stores write whole lines without reading them: copying 1 MiB pieces from
//! a cached source into a 64 MiB buffer ran at 12-13 GB/s with them and 7-8
//! GB/s without on the 2-core machine (bench/HISTORY.md §20). They pay only
//! where the copied bytes would have left the cache before anyone read them:
//! a collective whose data is larger than the last-level cache. Below that
//! they cost (the reader then fetches from memory what it would have found
//! in cache): a 4 MiB all-reduce over shared memory was 25% slower with
//! them, a 16 MiB one 25% faster.

use std::sync::OnceLock;

/// Data a collective moves, from which its copies stream: half the
/// last-level cache this process's first CPU shares (what
/// [`streaming_threshold`] reads), or this much when it cannot be read.
const DEFAULT_STREAMING_THRESHOLD: usize = 16 << 20;

/// Copies below this go through the cache anyway: the fence after the
/// non-temporal stores costs more than they save.
pub const STREAMING_MIN_COPY: usize = 64 << 10;

/// Overrides [`streaming_threshold`] with a number of bytes, as glibc's
/// `glibc.cpu.x86_non_temporal_threshold` tunable does for `memcpy`.
pub const STREAMING_THRESHOLD_ENV: &str = "CHORUS_STREAMING_THRESHOLD";

/// The size of data (bytes a collective reads or writes in one buffer)
/// from which [`copy_streaming`] pays: [`STREAMING_THRESHOLD_ENV`] when
/// set to a size, otherwise half the last-level cache; read once.
pub fn streaming_threshold() -> usize {
    static THRESHOLD: OnceLock<usize> = OnceLock::new();
    *THRESHOLD.get_or_init(|| {
        let configured = std::env::var(STREAMING_THRESHOLD_ENV)
            .ok()
            .and_then(|v| parse_cache_size(&v));
        configured.unwrap_or_else(|| last_level_cache_bytes().map_or(DEFAULT_STREAMING_THRESHOLD, |bytes| bytes / 2))
    })
}

/// The largest unified cache of CPU 0, as Linux lists it.
fn last_level_cache_bytes() -> Option<usize> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    dir.flatten()
        .filter(|entry| entry.file_name().to_string_lossy().starts_with("index"))
        .filter_map(|entry| {
            let read = |name: &str| std::fs::read_to_string(entry.path().join(name)).ok();
            (read("type")?.trim() == "Unified").then_some(())?;
            parse_cache_size(&read("size")?)
        })
        .max()
}

/// A cache size as `/sys` writes it: `32768K`, `1M`, or plain bytes.
pub fn parse_cache_size(text: &str) -> Option<usize> {
    let text = text.trim();
    let (digits, unit) = match text.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((at, _)) => text.split_at(at),
        None => (text, ""),
    };
    let value: usize = digits.parse().ok()?;
    let scale = match unit {
        "" => 1,
        "K" => 1 << 10,
        "M" => 1 << 20,
        "G" => 1 << 30,
        _ => return None,
    };
    value.checked_mul(scale).filter(|&bytes| bytes > 0)
}

/// `dst.copy_from_slice(src)`, writing `dst` with non-temporal stores
/// where the CPU has them (x86-64); an ordinary copy elsewhere and for
/// copies under [`STREAMING_MIN_COPY`].
///
/// # Panics
/// If the lengths differ, as `copy_from_slice`.
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(
        dst.len(),
        src.len(),
        "copy_streaming between slices of different lengths"
    );
    #[cfg(target_arch = "x86_64")]
    if dst.len() >= STREAMING_MIN_COPY {
        // Non-temporal stores need aligned destinations: the bytes before
        // the first 64-byte line and after the last whole one go ordinarily.
        let head = dst.as_ptr().align_offset(64).min(dst.len());
        let lines = (dst.len() - head) / 64 * 64;
        dst[..head].copy_from_slice(&src[..head]);
        // SAFETY: SSE2 is part of x86-64; `dst[head..head + lines]` is
        // 64-byte aligned and both ranges are in bounds of their slices.
        unsafe { stream_lines(&mut dst[head..head + lines], &src[head..head + lines]) };
        let tail = head + lines;
        dst[tail..].copy_from_slice(&src[tail..]);
        return;
    }
    dst.copy_from_slice(src)
}

/// Copies whole 64-byte lines into a 64-byte aligned `dst` with
/// non-temporal stores, then fences them so they are ordered before any
/// later store (a ring's `head`, a frame's release).
///
/// # Safety
/// `dst` must be 64-byte aligned and a multiple of 64 bytes long, as long
/// as `src`.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_lines(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    debug_assert!(dst.len() == src.len() && dst.len().is_multiple_of(64) && dst.as_ptr().align_offset(64) == 0);
    for (to, from) in dst.chunks_exact_mut(64).zip(src.chunks_exact(64)) {
        let (to, from) = (to.as_mut_ptr().cast::<__m128i>(), from.as_ptr().cast::<__m128i>());
        // SAFETY: each chunk is 64 bytes, so four 16-byte lanes; `to` is
        // 64-byte aligned (the caller's alignment, stepped by 64), as
        // `_mm_stream_si128` needs; `from` may be unaligned (`loadu`).
        unsafe {
            let lanes = [
                _mm_loadu_si128(from),
                _mm_loadu_si128(from.add(1)),
                _mm_loadu_si128(from.add(2)),
                _mm_loadu_si128(from.add(3)),
            ];
            for (i, lane) in lanes.into_iter().enumerate() {
                _mm_stream_si128(to.add(i), lane);
            }
        }
    }
    // SAFETY: a fence has no preconditions.
    unsafe { _mm_sfence() };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_streaming_copy_equals_an_ordinary_one_at_every_alignment_and_length() {
        let src: Vec<u8> = (0..STREAMING_MIN_COPY * 2 + 300)
            .map(|i| (i * 7 + i / 251) as u8)
            .collect();
        let mut backing = vec![0u8; src.len() + 64];
        for offset in [0, 1, 15, 16, 63] {
            for len in [
                0,
                1,
                63,
                64,
                65,
                STREAMING_MIN_COPY - 1,
                STREAMING_MIN_COPY,
                STREAMING_MIN_COPY * 2 + 131,
            ] {
                for source_offset in [0, 3] {
                    backing.fill(0xAA);
                    let from = &src[source_offset..source_offset + len];
                    copy_streaming(&mut backing[offset..offset + len], from);
                    assert_eq!(&backing[offset..offset + len], from, "offset {offset}, length {len}");
                    assert!(
                        backing[..offset].iter().all(|&b| b == 0xAA),
                        "wrote before the destination"
                    );
                    assert!(
                        backing[offset + len..].iter().all(|&b| b == 0xAA),
                        "wrote past the destination"
                    );
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "different lengths")]
    fn lengths_must_match() {
        copy_streaming(&mut [0u8; 4], &[0u8; 5]);
    }

    #[test]
    fn cache_sizes_read_as_sys_writes_them() {
        assert_eq!(parse_cache_size("32768K\n"), Some(32 << 20));
        assert_eq!(parse_cache_size("1M"), Some(1 << 20));
        assert_eq!(parse_cache_size("4096"), Some(4096));
        assert_eq!(parse_cache_size("0K"), None);
        assert_eq!(parse_cache_size("12Q"), None);
        assert_eq!(parse_cache_size(""), None);
        assert!(streaming_threshold() >= 1 << 10);
    }
}
