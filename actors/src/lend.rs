//! Regions of a collective's output lent to ranks of this process: the peer
//! reduces or copies straight from this rank's buffer, so a byte sent to it
//! is read once, by the peer, instead of first copied into a frame.
//!
//! Sound because:
//! 1. the buffer outlives every view: a [`LentOutput`] dropped while views
//!    are out (an error, an operation dropped midway) parks its buffer with
//!    them, and it is freed with the last;
//! 2. nothing writes a lent region while its view is out: the driver lends
//!    only what its plan allows (`Plan::lendable`), checks every write
//!    against the views still out (`Leases::busy`), and hands the output
//!    back only once all are released.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::Notify;

use crate::buffer::Buffer;

#[derive(Default)]
struct Shared {
    /// Views not yet released.
    out: AtomicUsize,
    /// A view was released.
    released: Notify,
    /// The buffer of a [`LentOutput`] that went while views were out.
    parked: Mutex<Option<Buffer>>,
    /// The buffer went back to its owner: nothing more is lent.
    returned: AtomicBool,
}

/// A collective's output buffer, lendable to peers in this process.
pub struct LentOutput {
    buffer: Buffer,
    shared: Arc<Shared>,
}

impl LentOutput {
    /// Wraps `buffer`; nothing is lent yet.
    pub fn new(buffer: Buffer) -> Self {
        Self {
            buffer,
            shared: Arc::default(),
        }
    }

    /// The bytes to write, for the driver (which lends through
    /// [`Self::lender`]); `None` while a view is out.
    pub fn as_mut_slice(&mut self) -> Option<&mut [u8]> {
        (self.shared.out.load(Ordering::Acquire) == 0).then_some(&mut self.buffer[..])
    }

    /// What the driver lends this buffer's regions with.
    pub fn lender(&self) -> Lender {
        Lender {
            shared: self.shared.clone(),
            base: self.buffer.as_ptr() as usize,
            len: self.buffer.len(),
        }
    }

    /// The buffer, once every view is released; `None` while one is out
    /// (the buffer then stays parked until it is).
    pub fn into_inner(mut self) -> Option<Buffer> {
        if self.shared.out.load(Ordering::Acquire) > 0 {
            return None;
        }
        self.shared.returned.store(true, Ordering::Release);
        Some(std::mem::take(&mut self.buffer))
    }
}

impl Drop for LentOutput {
    fn drop(&mut self) {
        if self.shared.out.load(Ordering::Acquire) > 0 {
            let buffer = std::mem::take(&mut self.buffer);
            *self.shared.parked.lock().unwrap_or_else(|p| p.into_inner()) = Some(buffer);
        }
    }
}

/// Makes views of one [`LentOutput`]'s regions.
#[derive(Clone)]
pub struct Lender {
    shared: Arc<Shared>,
    /// Where the buffer lies: only regions inside it are lent.
    base: usize,
    len: usize,
}

impl std::fmt::Debug for Lender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Lender({} out)", self.outstanding())
    }
}

/// Whether one view is still out.
pub(crate) struct Lease {
    released: AtomicBool,
    shared: Arc<Shared>,
}

/// A view's owner inside its `Bytes`: releases the lease when the last
/// clone of the view goes.
struct View {
    ptr: *const u8,
    len: usize,
    lease: Arc<Lease>,
}

// SAFETY: the view only reads, and its memory stays valid and unwritten
// while it lives (module docs).
unsafe impl Send for View {}

impl AsRef<[u8]> for View {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: as for `Send`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for View {
    fn drop(&mut self) {
        self.lease.released.store(true, Ordering::Release);
        self.lease.shared.out.fetch_sub(1, Ordering::AcqRel);
        self.lease.shared.released.notify_one();
    }
}

impl Lender {
    /// Views not yet released.
    pub fn outstanding(&self) -> usize {
        self.shared.out.load(Ordering::Acquire)
    }

    /// Resolves once a view is released after the last call (or was since).
    pub(crate) async fn released(&self) {
        self.shared.released.notified().await
    }

    /// A view of `region`, and its lease; `None` unless `region` lies in
    /// this lender's [`LentOutput`] buffer (which alone is kept for views)
    /// and that buffer is not yet handed back.
    ///
    /// # Safety
    /// Nothing may write `region` until the lease is released.
    pub(crate) unsafe fn lend(&self, region: &[u8]) -> Option<(Bytes, Arc<Lease>)> {
        let start = region.as_ptr() as usize;
        if start < self.base
            || start + region.len() > self.base + self.len
            || self.shared.returned.load(Ordering::Acquire)
        {
            return None;
        }
        let lease = Arc::new(Lease {
            released: AtomicBool::new(false),
            shared: self.shared.clone(),
        });
        self.shared.out.fetch_add(1, Ordering::AcqRel);
        let view = View {
            ptr: region.as_ptr(),
            len: region.len(),
            lease: lease.clone(),
        };
        Some((Bytes::from_owner(view), lease))
    }
}

/// The regions (byte ranges of the output) one collective has lent, and to
/// which peer.
#[derive(Default)]
pub(crate) struct Leases(Vec<(Range<usize>, usize, Arc<Lease>)>);

impl Leases {
    pub(crate) fn push(&mut self, region: Range<usize>, peer: usize, lease: Arc<Lease>) {
        self.0.push((region, peer, lease));
    }

    fn prune(&mut self) {
        self.0.retain(|(_, _, lease)| !lease.released.load(Ordering::Acquire));
    }

    /// Whether a view of a region overlapping `range` is still out.
    pub(crate) fn busy(&mut self, range: &Range<usize>) -> bool {
        self.prune();
        self.0
            .iter()
            .any(|(r, _, _)| r.start < range.end && range.start < r.end)
    }

    /// The peers still holding a view.
    pub(crate) fn holders(&mut self) -> Vec<usize> {
        self.prune();
        self.0.iter().map(|(_, peer, _)| *peer).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_dropped_while_lent_stays_readable_until_the_last_view_goes() {
        let mut output = LentOutput::new(vec![7u8; 1 << 20].into());
        let lender = output.lender();
        let region = &output.as_mut_slice().unwrap()[4096..8192];
        // SAFETY: nothing writes the buffer in this test.
        let (view, lease) = unsafe { lender.lend(region) }.unwrap();
        let mut leases = Leases::default();
        leases.push(4096..8192, 1, lease);
        assert!(leases.busy(&(0..4097)), "a write overlapping the view must wait");
        assert!(!leases.busy(&(8192..9000)), "a write beside it need not");
        assert_eq!(leases.holders(), vec![1]);
        drop(output);
        assert_eq!(lender.outstanding(), 1);
        assert!(view.iter().all(|&b| b == 7), "the parked buffer is intact");
        drop(view);
        assert_eq!(lender.outstanding(), 0);
        assert!(!leases.busy(&(0..1 << 20)));
        assert!(lender.shared.parked.lock().unwrap().is_some());
        drop(lender);
    }

    #[test]
    fn the_buffer_comes_back_only_once_every_view_is_released() {
        let mut output = LentOutput::new(vec![1, 2, 3, 4].into());
        let lender = output.lender();
        let region = &output.as_mut_slice().unwrap()[1..3];
        // SAFETY: nothing writes the buffer in this test.
        let (view, _lease) = unsafe { lender.lend(region) }.unwrap();
        let clone = view.clone();
        drop(view);
        assert_eq!(&clone[..], &[2, 3]);
        assert_eq!(lender.outstanding(), 1, "a clone keeps the view out");
        assert!(output.as_mut_slice().is_none(), "no writing while lent");
        let elsewhere = [0u8; 4];
        assert!(
            // SAFETY: as above.
            unsafe { lender.lend(&elsewhere) }.is_none(),
            "only the output's regions are lent"
        );
        drop(clone);
        let buffer = output.into_inner().unwrap();
        assert_eq!(buffer[..], [1, 2, 3, 4]);
        assert!(
            // SAFETY: as above.
            unsafe { lender.lend(&buffer[..]) }.is_none(),
            "nothing is lent once handed back"
        );
    }
}
