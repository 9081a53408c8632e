//! The sync layer's decisions, sans IO: describing and comparing parameter
//! lists, assigning gradients to buckets, cutting the start-up broadcast
//! into chunks, tracking which gradients are ready in a step, and finding
//! diverged ranks from their checksums. Everything here is a pure function
//! or a plain state machine; `super` does the communication.

use chorus_runtime::collective::DType;

/// What a rank registered for one parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSpec {
    /// Its name (e.g. `layer1.weight`).
    pub name: String,
    /// Its element type.
    pub dtype: DType,
    /// Its number of elements.
    pub len: usize,
}

impl ParamSpec {
    /// Its size in bytes.
    pub fn bytes(&self) -> usize {
        self.len * self.dtype.size()
    }
}

impl std::fmt::Display for ParamSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "'{}' {} x {}", self.name, self.dtype, self.len)
    }
}

/// A parameter list as bytes, to compare and ship between ranks:
/// per parameter, the name's length (u32 LE), the name, the dtype's index in
/// [`DType::ALL`] (u8) and the element count (u64 LE).
pub fn encode_specs(specs: &[ParamSpec]) -> Vec<u8> {
    let mut out = Vec::new();
    for spec in specs {
        out.extend_from_slice(&(spec.name.len() as u32).to_le_bytes());
        out.extend_from_slice(spec.name.as_bytes());
        out.push(DType::ALL.iter().position(|d| *d == spec.dtype).unwrap_or(0) as u8);
        out.extend_from_slice(&(spec.len as u64).to_le_bytes());
    }
    out
}

/// The inverse of [`encode_specs`]; `None` for bytes it did not make.
pub fn decode_specs(mut bytes: &[u8]) -> Option<Vec<ParamSpec>> {
    fn take<'a>(bytes: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        let (head, tail) = (bytes.get(..n)?, bytes.get(n..)?);
        *bytes = tail;
        Some(head)
    }
    let mut specs = Vec::new();
    while !bytes.is_empty() {
        let name_len = u32::from_le_bytes(take(&mut bytes, 4)?.try_into().ok()?) as usize;
        let name = String::from_utf8(take(&mut bytes, name_len)?.to_vec()).ok()?;
        let dtype = *DType::ALL.get(take(&mut bytes, 1)?[0] as usize)?;
        let len = usize::try_from(u64::from_le_bytes(take(&mut bytes, 8)?.try_into().ok()?)).ok()?;
        specs.push(ParamSpec { name, dtype, len });
    }
    Some(specs)
}

/// 64-bit FNV-1a, continued from `state` (start from [`FNV_OFFSET`]): a
/// fingerprint to compare across ranks, not a defence against an adversary.
pub fn fnv1a(mut state: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        state ^= u64::from(b);
        state = state.wrapping_mul(0x0000_0100_0000_01b3);
    }
    state
}

/// FNV-1a's initial state.
pub const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// The first place where two ranks' parameter lists differ.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Difference {
    /// Position in registration order.
    pub index: usize,
    /// Rank 0's parameter there (`None`: its list is shorter).
    pub reference: Option<ParamSpec>,
    /// The other rank's parameter there (`None`: its list is shorter).
    pub other: Option<ParamSpec>,
}

/// Where `other` first differs from `reference`, if it does.
pub fn first_difference(reference: &[ParamSpec], other: &[ParamSpec]) -> Option<Difference> {
    let index = (0..reference.len().max(other.len())).find(|&i| reference.get(i) != other.get(i))?;
    Some(Difference {
        index,
        reference: reference.get(index).cloned(),
        other: other.get(index).cloned(),
    })
}

/// Bucket size limits in bytes: DDP's defaults are 1 MiB for each dtype's
/// first bucket (so the first all-reduce starts early) and 25 MiB after.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketCaps {
    /// The first bucket of each dtype.
    pub first: usize,
    /// Every later bucket.
    pub rest: usize,
}

impl Default for BucketCaps {
    fn default() -> Self {
        Self {
            first: 1 << 20,
            rest: 25 << 20,
        }
    }
}

/// One bucket: parameters of one dtype whose gradients are contiguous.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketLayout {
    /// Its element type.
    pub dtype: DType,
    /// Its parameters (registration indices), in storage order.
    pub params: Vec<usize>,
    /// Its total number of elements.
    pub len: usize,
}

/// Every parameter's place: buckets in launch order and, per parameter
/// (registration index), its bucket and element offset there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// Buckets in the order their all-reduces are launched.
    pub buckets: Vec<BucketLayout>,
    /// Per parameter: (bucket, element offset).
    pub place: Vec<(usize, usize)>,
}

/// Packs parameters into buckets taking them in `order` (DDP: reverse
/// registration order first, the order gradients became ready after the
/// first step). A bucket takes one dtype only and is closed once it holds
/// at least its cap (so one large parameter makes a bucket of its own).
/// `order` must be a permutation of `0..specs.len()` ([`check_order`]).
pub fn assign_buckets(specs: &[ParamSpec], order: &[usize], caps: BucketCaps) -> Layout {
    // Per dtype: the open bucket's index and whether a bucket was closed yet.
    let mut open: Vec<(DType, Option<usize>, bool)> = Vec::new();
    let mut buckets: Vec<BucketLayout> = Vec::new();
    let mut place = vec![(0, 0); specs.len()];
    for &p in order {
        let spec = &specs[p];
        let slot = match open.iter().position(|(d, ..)| *d == spec.dtype) {
            Some(slot) => slot,
            None => {
                open.push((spec.dtype, None, false));
                open.len() - 1
            }
        };
        let bucket = match open[slot].1 {
            Some(b) => b,
            None => {
                buckets.push(BucketLayout {
                    dtype: spec.dtype,
                    params: Vec::new(),
                    len: 0,
                });
                open[slot].1 = Some(buckets.len() - 1);
                buckets.len() - 1
            }
        };
        place[p] = (bucket, buckets[bucket].len);
        buckets[bucket].params.push(p);
        buckets[bucket].len += spec.len;
        let cap = if open[slot].2 { caps.rest } else { caps.first };
        if buckets[bucket].len * spec.dtype.size() >= cap {
            open[slot].1 = None;
            open[slot].2 = true;
        }
    }
    Layout { buckets, place }
}

/// DDP's initial order: last registered first (the backward pass produces
/// the last layer's gradients first).
pub fn reverse_order(n: usize) -> Vec<usize> {
    (0..n).rev().collect()
}

/// Whether `order` names each of `0..n` exactly once.
pub fn check_order(order: &[usize], n: usize) -> bool {
    let mut seen = vec![false; n];
    order.len() == n && order.iter().all(|&p| p < n && !std::mem::replace(&mut seen[p], true))
}

/// A byte range of one parameter inside a broadcast chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// The parameter (index into the sizes given).
    pub param: usize,
    /// First byte within the parameter.
    pub start: usize,
    /// One past its last byte.
    pub end: usize,
}

/// Cuts buffers of `sizes` bytes, in order, into chunks of at most `cap`
/// bytes (PyTorch broadcasts 250 MiB at a time); a buffer larger than a
/// chunk spans several.
pub fn broadcast_chunks(sizes: &[usize], cap: usize) -> Vec<Vec<Piece>> {
    let cap = cap.max(1);
    let mut chunks = vec![];
    let mut current: Vec<Piece> = vec![];
    let mut filled = 0;
    for (param, &size) in sizes.iter().enumerate() {
        let mut start = 0;
        while start < size {
            let take = (size - start).min(cap - filled);
            current.push(Piece {
                param,
                start,
                end: start + take,
            });
            (start, filled) = (start + take, filled + take);
            if filled == cap {
                chunks.push(std::mem::take(&mut current));
                filled = 0;
            }
        }
    }
    if !current.is_empty() {
        chunks.push(current);
    }
    chunks
}

/// What [`ReadyTracker::mark`] refuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MarkError {
    /// No such parameter.
    Unknown,
    /// Already marked in this step.
    Twice,
}

/// One step's readiness: which gradients are ready, in which order, and
/// which buckets may start. Buckets start strictly in layout order (every
/// rank must submit the same all-reduces in the same order, whatever order
/// its own gradients arrive in), each as soon as it and all before it are
/// complete.
#[derive(Debug, Clone)]
pub struct ReadyTracker {
    bucket_of: Vec<usize>,
    pending: Vec<usize>,
    marked: Vec<bool>,
    order: Vec<usize>,
    next: usize,
}

impl ReadyTracker {
    /// A fresh step over `layout`.
    pub fn new(layout: &Layout) -> Self {
        Self {
            bucket_of: layout.place.iter().map(|&(b, _)| b).collect(),
            pending: layout.buckets.iter().map(|b| b.params.len()).collect(),
            marked: vec![false; layout.place.len()],
            order: Vec::new(),
            next: 0,
        }
    }

    /// Marks `param` ready; returns the buckets that may start now, in order.
    pub fn mark(&mut self, param: usize) -> Result<std::ops::Range<usize>, MarkError> {
        let marked = self.marked.get_mut(param).ok_or(MarkError::Unknown)?;
        if std::mem::replace(marked, true) {
            return Err(MarkError::Twice);
        }
        self.order.push(param);
        self.pending[self.bucket_of[param]] -= 1;
        Ok(self.launchable())
    }

    /// Marks every unmarked parameter (their gradients count as given);
    /// returns the buckets that may start now.
    pub fn mark_rest(&mut self) -> std::ops::Range<usize> {
        for p in 0..self.marked.len() {
            if !self.marked[p] {
                self.marked[p] = true;
                self.pending[self.bucket_of[p]] -= 1;
            }
        }
        self.launchable()
    }

    fn launchable(&mut self) -> std::ops::Range<usize> {
        let start = self.next;
        while self.next < self.pending.len() && self.pending[self.next] == 0 {
            self.next += 1;
        }
        start..self.next
    }

    /// Parameters not marked yet, in registration order.
    pub fn unmarked(&self) -> Vec<usize> {
        (0..self.marked.len()).filter(|&p| !self.marked[p]).collect()
    }

    /// Whether anything was marked in this step.
    pub fn started(&self) -> bool {
        self.marked.iter().any(|&m| m)
    }

    /// The order parameters were marked in, then the unmarked ones in
    /// reverse registration order: the order to rebuild buckets in.
    pub fn ready_order(&self) -> Vec<usize> {
        let mut order = self.order.clone();
        order.extend((0..self.marked.len()).rev().filter(|&p| !self.order.contains(&p)));
        order
    }
}

/// Ranks whose per-parameter checksums differ from rank 0's, each with the
/// first parameter (index) that differs. `sums` holds one row per rank.
pub fn diverged(sums: &[Vec<u64>]) -> Vec<(usize, usize)> {
    let Some(reference) = sums.first() else {
        return vec![];
    };
    sums.iter()
        .enumerate()
        .skip(1)
        .filter_map(|(rank, row)| {
            let index = (0..reference.len().max(row.len())).find(|&i| reference.get(i) != row.get(i))?;
            Some((rank, index))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, dtype: DType, len: usize) -> ParamSpec {
        ParamSpec {
            name: name.into(),
            dtype,
            len,
        }
    }

    #[test]
    fn specs_round_trip_and_garbage_is_refused() {
        let specs = vec![spec("w", DType::Float32, 7), spec("é.bias", DType::BFloat16, 0)];
        let bytes = encode_specs(&specs);
        assert_eq!(decode_specs(&bytes), Some(specs));
        assert_eq!(decode_specs(&bytes[..bytes.len() - 1]), None);
        assert_eq!(decode_specs(&[]), Some(vec![]));
    }

    #[test]
    fn first_difference_names_both_sides() {
        let a = vec![spec("a", DType::Float32, 3), spec("b", DType::Float32, 4)];
        let mut b = a.clone();
        assert_eq!(first_difference(&a, &b), None);
        b[1].len = 5;
        let d = first_difference(&a, &b).unwrap();
        assert_eq!((d.index, d.reference.unwrap().len, d.other.unwrap().len), (1, 4, 5));
        let d = first_difference(&a, &a[..1]).unwrap();
        assert_eq!((d.index, d.other), (1, None));
    }

    #[test]
    fn buckets_go_in_reverse_order_first_one_mib_then_the_cap() {
        // 10 parameters of 512 KiB (f32): the first bucket closes at 1 MiB,
        // then buckets hold 3 MiB (a 3 MiB cap here).
        let specs: Vec<_> = (0..10)
            .map(|i| spec(&format!("p{i}"), DType::Float32, 128 << 10))
            .collect();
        let caps = BucketCaps {
            first: 1 << 20,
            rest: 3 << 20,
        };
        let layout = assign_buckets(&specs, &reverse_order(10), caps);
        let params: Vec<_> = layout.buckets.iter().map(|b| b.params.clone()).collect();
        assert_eq!(params, vec![vec![9, 8], vec![7, 6, 5, 4, 3, 2], vec![1, 0]]);
        assert_eq!(layout.place[8], (0, 128 << 10));
        assert_eq!(layout.place[0], (2, 128 << 10));
        assert_eq!(
            BucketCaps::default(),
            BucketCaps {
                first: 1 << 20,
                rest: 25 << 20
            }
        );
    }

    #[test]
    fn a_large_parameter_gets_its_own_bucket_and_dtypes_never_mix() {
        let specs = vec![
            spec("small", DType::Float32, 10),
            spec("huge", DType::Float32, 1 << 20),
            spec("half", DType::Float16, 10),
            spec("last", DType::Float32, 10),
        ];
        let layout = assign_buckets(&specs, &reverse_order(4), BucketCaps::default());
        let got: Vec<_> = layout.buckets.iter().map(|b| (b.dtype, b.params.clone())).collect();
        assert_eq!(
            got,
            vec![
                (DType::Float32, vec![3, 1]),
                (DType::Float16, vec![2]),
                (DType::Float32, vec![0]),
            ]
        );
        assert_eq!(layout.buckets[0].len, (1 << 20) + 10);
    }

    #[test]
    fn orders_are_checked() {
        assert!(check_order(&[2, 0, 1], 3));
        assert!(!check_order(&[2, 0, 0], 3));
        assert!(!check_order(&[2, 0], 3));
        assert!(!check_order(&[3, 0, 1], 3));
    }

    #[test]
    fn broadcast_chunks_cover_every_byte_once_and_respect_the_cap() {
        let sizes = [5, 0, 12, 3, 1];
        let chunks = broadcast_chunks(&sizes, 4);
        assert!(
            chunks
                .iter()
                .all(|c| c.iter().map(|p| p.end - p.start).sum::<usize>() <= 4)
        );
        let mut covered: Vec<Vec<(usize, usize)>> = vec![vec![]; sizes.len()];
        for piece in chunks.iter().flatten() {
            covered[piece.param].push((piece.start, piece.end));
        }
        for (param, ranges) in covered.iter().enumerate() {
            let mut at = 0;
            for &(s, e) in ranges {
                assert_eq!(s, at, "param {param}");
                at = e;
            }
            assert_eq!(at, sizes[param]);
        }
        assert_eq!(chunks.len(), 6); // 21 bytes in chunks of 4
        assert_eq!(broadcast_chunks(&[], 4), Vec::<Vec<Piece>>::new());
    }

    #[test]
    fn buckets_start_in_layout_order_when_complete() {
        let specs: Vec<_> = (0..4)
            .map(|i| spec(&format!("p{i}"), DType::Float32, 1 << 18))
            .collect();
        // Buckets: [3], [2], [1], [0] (each 1 MiB reaches a 1 MiB cap).
        let caps = BucketCaps {
            first: 1 << 20,
            rest: 1 << 20,
        };
        let layout = assign_buckets(&specs, &reverse_order(4), caps);
        assert_eq!(layout.buckets.len(), 4);
        let mut t = ReadyTracker::new(&layout);
        assert_eq!(t.mark(2), Ok(0..0)); // bucket 1 waits for bucket 0
        assert_eq!(t.mark(3), Ok(0..2));
        assert_eq!(t.mark(3), Err(MarkError::Twice));
        assert_eq!(t.mark(9), Err(MarkError::Unknown));
        assert_eq!(t.unmarked(), vec![0, 1]);
        assert_eq!(t.ready_order(), vec![2, 3, 1, 0]);
        assert_eq!(t.mark_rest(), 2..4);
        assert!(t.unmarked().is_empty());
    }

    #[test]
    fn checksums_name_each_diverged_rank_and_its_first_parameter() {
        let sums = vec![vec![1, 2, 3], vec![1, 2, 3], vec![1, 9, 8], vec![1, 2, 4]];
        assert_eq!(diverged(&sums), vec![(2, 1), (3, 2)]);
        assert!(diverged(&sums[..2]).is_empty());
        assert_eq!(fnv1a(FNV_OFFSET, b""), FNV_OFFSET);
        assert_ne!(fnv1a(FNV_OFFSET, b"a"), fnv1a(FNV_OFFSET, b"b"));
    }
}
