//! Which collective, which algorithm, and the [`Plan`] for one rank.

use std::fmt;
use std::str::FromStr;

use thiserror::Error;

use super::dtype::{DType, ParseError};
use super::plan::{Builder, Plan};
use super::{direct, doubling, ring, tree};

/// All-reduces up to this size use recursive doubling: `log2 P` latencies,
/// each moving the whole buffer. On the early loopback figures (about
/// 70 us per message, 1-3 GB/s) the whole-buffer cost overtakes the extra
/// `log2 P` latencies of halving-doubling around 100-500 KiB at `P = 8`; this
/// stays below that until measured on real links.
pub const RECURSIVE_DOUBLING_MAX_BYTES: usize = 64 << 10;

/// All-reduces up to this size (and above [`RECURSIVE_DOUBLING_MAX_BYTES`])
/// use halving-doubling; larger ones the pipelined ring, whose
/// neighbour-only, segmented traffic keeps every link busy and whose fold-free
/// schedule costs non-powers of two nothing extra.
pub const HALVING_DOUBLING_MAX_BYTES: usize = 1 << 20;

/// Ranks sharing one process's threads ([`Overrides::sharing_threads`]) run
/// all-reduces up to the recursive-doubling threshold on the binomial tree
/// from this many ranks on: there every message costs the shared threads
/// its CPU time, and the tree sends `2 (P - 1)` messages against recursive
/// doubling's `P log2 P`. Measured in one process on 2 cores (`chorus bench
/// scale`, 8 bytes, medians of 3 alternated runs): within the noise at 8
/// and 16 ranks (up to 16 every rank checks every rank's signature, which
/// dominates), 1.7-2.9x faster from 32 to 1024 ranks, 2.6x at 1024
/// (bench/HISTORY.md, section 15d).
pub const SHARED_THREADS_TREE_MIN_WORLD: usize = 16;

/// Largest world a plan is made for.
pub const MAX_WORLD: usize = 1 << 20;

/// Largest buffer (in bytes, all blocks together) a plan is made for; keeps
/// segment and round numbers within a [`Tag`](super::Tag)'s `u32`s.
pub const MAX_BYTES: usize = 1 << 50;

/// The operations of a process group.
///
/// Each plan reads an `input` buffer and reads and writes an `output` buffer
/// (see [`Plan`]); `count` is the per-rank element count and `P` the world
/// size. Where an entry says "in place", the output holds this rank's data
/// before the plan runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CollectiveKind {
    /// Output `count`, in place: every rank ends with the reduction.
    AllReduce,
    /// Output `count`: the root's data before; every rank's after.
    Broadcast,
    /// Output `count`, in place: the root ends with the reduction; other
    /// ranks' outputs end unspecified (they hold partial results).
    Reduce,
    /// Input `count`; output `count * P`: block `i` is rank `i`'s input.
    AllGather,
    /// Input `count`; output `count * P` at the root (block `i` is rank
    /// `i`'s input), none elsewhere.
    Gather,
    /// Input `count * P` at the root, none elsewhere; output `count`: block
    /// `rank` of the root's input.
    Scatter,
    /// Output `count * P`, in place: block `rank` ends with the reduction of
    /// every rank's block `rank`; the other blocks end unspecified.
    ReduceScatter,
    /// Input and output `count * P`: input block `j` goes to rank `j`,
    /// output block `i` comes from rank `i`.
    AllToAll,
    /// No buffers: returns on each rank once every rank has entered.
    Barrier,
    /// Input `count`, sent to the peer.
    Send,
    /// Output `count`, received from the peer.
    Recv,
}

impl CollectiveKind {
    /// Every kind.
    pub const ALL: [CollectiveKind; 11] = [
        CollectiveKind::AllReduce,
        CollectiveKind::Broadcast,
        CollectiveKind::Reduce,
        CollectiveKind::AllGather,
        CollectiveKind::Gather,
        CollectiveKind::Scatter,
        CollectiveKind::ReduceScatter,
        CollectiveKind::AllToAll,
        CollectiveKind::Barrier,
        CollectiveKind::Send,
        CollectiveKind::Recv,
    ];

    /// PyTorch's name for it (`all_reduce`, `reduce_scatter`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllReduce => "all_reduce",
            CollectiveKind::Broadcast => "broadcast",
            CollectiveKind::Reduce => "reduce",
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::Gather => "gather",
            CollectiveKind::Scatter => "scatter",
            CollectiveKind::ReduceScatter => "reduce_scatter",
            CollectiveKind::AllToAll => "all_to_all",
            CollectiveKind::Barrier => "barrier",
            CollectiveKind::Send => "send",
            CollectiveKind::Recv => "recv",
        }
    }

    /// Whether it combines values with a [`ReduceOp`](super::ReduceOp).
    pub const fn reduces(self) -> bool {
        matches!(
            self,
            CollectiveKind::AllReduce | CollectiveKind::Reduce | CollectiveKind::ReduceScatter
        )
    }

    /// Whether it needs a root (for [`Send`](Self::Send) and
    /// [`Recv`](Self::Recv): the peer).
    pub const fn rooted(self) -> bool {
        matches!(
            self,
            CollectiveKind::Broadcast
                | CollectiveKind::Reduce
                | CollectiveKind::Gather
                | CollectiveKind::Scatter
                | CollectiveKind::Send
                | CollectiveKind::Recv
        )
    }

    /// The algorithms that implement it.
    pub const fn algorithms(self) -> &'static [Algorithm] {
        match self {
            CollectiveKind::AllReduce => &[
                Algorithm::RecursiveDoubling,
                Algorithm::HalvingDoubling,
                Algorithm::Ring,
                Algorithm::BinomialTree,
            ],
            CollectiveKind::Broadcast | CollectiveKind::Reduce => &[Algorithm::BinomialTree],
            CollectiveKind::AllGather | CollectiveKind::ReduceScatter => &[Algorithm::Ring],
            CollectiveKind::Gather | CollectiveKind::Scatter | CollectiveKind::Send | CollectiveKind::Recv => {
                &[Algorithm::Direct]
            }
            CollectiveKind::AllToAll => &[Algorithm::Pairwise],
            CollectiveKind::Barrier => &[Algorithm::Dissemination],
        }
    }

    /// The one-byte code used in [`Signature`](super::Signature) encodings.
    pub(crate) const fn code(self) -> u8 {
        self as u8
    }

    /// Inverse of [`code`](Self::code).
    pub(crate) fn from_code(code: u8) -> Option<Self> {
        Self::ALL.get(usize::from(code)).copied()
    }
}

impl fmt::Display for CollectiveKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CollectiveKind {
    type Err = ParseError;

    fn from_str(s: &str) -> Result<Self, ParseError> {
        Self::ALL.into_iter().find(|k| k.name() == s).ok_or_else(|| {
            let names: Vec<&str> = Self::ALL.iter().map(|k| k.name()).collect();
            ParseError::new("collective", s, &names)
        })
    }
}

/// How a collective's data moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Segmented, pipelined ring (large all-reduce, all-gather,
    /// reduce-scatter).
    Ring,
    /// Recursive doubling of the whole buffer (small all-reduce).
    RecursiveDoubling,
    /// Rabenseifner's recursive halving + doubling (medium all-reduce).
    HalvingDoubling,
    /// Binomial tree from or to the root (broadcast, reduce; all-reduce as
    /// a reduce to rank 0 and a broadcast from it).
    BinomialTree,
    /// One message per rank and the root, or the peer (gather, scatter,
    /// send, recv).
    Direct,
    /// Pairwise exchange (all-to-all).
    Pairwise,
    /// Dissemination of empty messages (barrier).
    Dissemination,
}

impl Algorithm {
    /// Every algorithm.
    pub const ALL: [Algorithm; 7] = [
        Algorithm::Ring,
        Algorithm::RecursiveDoubling,
        Algorithm::HalvingDoubling,
        Algorithm::BinomialTree,
        Algorithm::Direct,
        Algorithm::Pairwise,
        Algorithm::Dissemination,
    ];

    /// Its name in `CHORUS_ALGO`.
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::RecursiveDoubling => "recursive_doubling",
            Algorithm::HalvingDoubling => "halving_doubling",
            Algorithm::BinomialTree => "binomial_tree",
            Algorithm::Direct => "direct",
            Algorithm::Pairwise => "pairwise",
            Algorithm::Dissemination => "dissemination",
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Algorithm {
    type Err = ParseError;

    fn from_str(s: &str) -> Result<Self, ParseError> {
        Self::ALL.into_iter().find(|a| a.name() == s).ok_or_else(|| {
            let names: Vec<&str> = Self::ALL.iter().map(|a| a.name()).collect();
            ParseError::new("algorithm", s, &names)
        })
    }
}

/// The all-reduce switch points: the parsed value of `CHORUS_ALGO_THRESHOLDS`
/// (`chorus bench tune` measures them per transport and prints the line).
///
/// The grammar is a comma-separated list of `algorithm=size`, the size in
/// bytes with an optional K, M or G suffix (powers of 1024), for example
/// `recursive_doubling=256K,halving_doubling=4M`: all-reduces up to that
/// size use that algorithm. An algorithm left out keeps its default
/// ([`RECURSIVE_DOUBLING_MAX_BYTES`], [`HALVING_DOUBLING_MAX_BYTES`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Thresholds {
    /// Largest all-reduce that uses recursive doubling.
    pub recursive_doubling_max: usize,
    /// Largest all-reduce that uses halving-doubling (recursive doubling at
    /// two ranks, where the two move the same bytes); the ring above it.
    pub halving_doubling_max: usize,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds {
            recursive_doubling_max: RECURSIVE_DOUBLING_MAX_BYTES,
            halving_doubling_max: HALVING_DOUBLING_MAX_BYTES,
        }
    }
}

impl Thresholds {
    /// Parses a `CHORUS_ALGO_THRESHOLDS` value.
    pub fn parse(value: &str) -> Result<Self, ParseError> {
        let mut out = Thresholds::default();
        for entry in value.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let Some((algo, size)) = entry.split_once('=') else {
                return Err(ParseError::new(
                    "threshold",
                    entry,
                    &["recursive_doubling=SIZE", "halving_doubling=SIZE"],
                ));
            };
            let size = parse_bytes(size.trim()).ok_or_else(|| {
                ParseError::new("size", size.trim(), &["a byte count with an optional K, M or G suffix"])
            })?;
            match algo.trim().parse::<Algorithm>()? {
                Algorithm::RecursiveDoubling => out.recursive_doubling_max = size,
                Algorithm::HalvingDoubling => out.halving_doubling_max = size,
                _ => {
                    return Err(ParseError::new(
                        "algorithm with a threshold",
                        algo.trim(),
                        &["recursive_doubling", "halving_doubling"],
                    ));
                }
            }
        }
        Ok(out)
    }
}

impl fmt::Display for Thresholds {
    /// The `CHORUS_ALGO_THRESHOLDS` value that parses back to these.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "recursive_doubling={},halving_doubling={}",
            format_bytes(self.recursive_doubling_max),
            format_bytes(self.halving_doubling_max)
        )
    }
}

/// `64K`, `1M`, `3G`, or plain bytes when no suffix divides evenly.
fn format_bytes(n: usize) -> String {
    match n {
        0 => "0".into(),
        n if n % (1 << 30) == 0 => format!("{}G", n >> 30),
        n if n % (1 << 20) == 0 => format!("{}M", n >> 20),
        n if n % (1 << 10) == 0 => format!("{}K", n >> 10),
        n => n.to_string(),
    }
}

/// A byte count with an optional K, M or G suffix (powers of 1024).
fn parse_bytes(text: &str) -> Option<usize> {
    let (digits, shift) = match text.chars().last()?.to_ascii_uppercase() {
        'K' => (&text[..text.len() - 1], 10),
        'M' => (&text[..text.len() - 1], 20),
        'G' => (&text[..text.len() - 1], 30),
        _ => (text, 0),
    };
    digits.trim().parse::<usize>().ok()?.checked_mul(1 << shift)
}

/// Algorithms forced per collective: the parsed value of `CHORUS_ALGO`.
///
/// The grammar is a comma-separated list of `kind=algorithm` (for example
/// `all_reduce=ring,broadcast=binomial_tree`) or bare `algorithm`, which
/// applies to every kind that has it (`ring` forces all-reduce,
/// all-gather and reduce-scatter onto the ring). Later entries win; the
/// empty string forces nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overrides {
    forced: Vec<(CollectiveKind, Algorithm)>,
    thresholds: Thresholds,
    sharing_threads: bool,
}

impl Overrides {
    /// Parses a `CHORUS_ALGO` value.
    pub fn parse(value: &str) -> Result<Self, ParseError> {
        let mut forced = Vec::new();
        for entry in value.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            match entry.split_once('=') {
                Some((kind, algo)) => {
                    let kind: CollectiveKind = kind.trim().parse()?;
                    let algo: Algorithm = algo.trim().parse()?;
                    if !kind.algorithms().contains(&algo) {
                        let names: Vec<&str> = kind.algorithms().iter().map(|a| a.name()).collect();
                        return Err(ParseError::new("algorithm for this collective", entry, &names));
                    }
                    forced.push((kind, algo));
                }
                None => {
                    let algo: Algorithm = entry.parse()?;
                    forced.extend(
                        CollectiveKind::ALL
                            .into_iter()
                            .filter(|k| k.algorithms().contains(&algo))
                            .map(|k| (k, algo)),
                    );
                }
            }
        }
        Ok(Overrides {
            forced,
            ..Overrides::default()
        })
    }

    /// These overrides with the all-reduce switch points `thresholds`.
    pub fn with_thresholds(self, thresholds: Thresholds) -> Self {
        Overrides { thresholds, ..self }
    }

    /// These overrides for ranks that share a few threads of one process
    /// (`chorus::spawn`), where the total number of messages sets a small
    /// all-reduce's time ([`SHARED_THREADS_TREE_MIN_WORLD`]). Every rank of
    /// a group must be told the same, or their plans would not meet.
    pub fn sharing_threads(self) -> Self {
        Overrides {
            sharing_threads: true,
            ..self
        }
    }

    /// The all-reduce switch points in force.
    pub fn thresholds(&self) -> Thresholds {
        self.thresholds
    }

    /// The algorithm forced for `kind`, if any.
    pub fn get(&self, kind: CollectiveKind) -> Option<Algorithm> {
        self.forced.iter().rev().find(|(k, _)| *k == kind).map(|&(_, a)| a)
    }
}

/// Picks the algorithm for a collective of `bytes` per rank (the buffer an
/// all-reduce reduces) over `world` ranks, unless `overrides` forces one;
/// all-reduce switches at the overrides' [`Thresholds`] (and, for ranks
/// [sharing threads](Overrides::sharing_threads), to the binomial tree for
/// small buffers over many ranks).
pub fn choose_algorithm(kind: CollectiveKind, bytes: usize, world: usize, overrides: &Overrides) -> Algorithm {
    if let Some(forced) = overrides.get(kind) {
        return forced;
    }
    let t = overrides.thresholds;
    match kind {
        CollectiveKind::AllReduce
            if overrides.sharing_threads
                && world >= SHARED_THREADS_TREE_MIN_WORLD
                && bytes <= t.recursive_doubling_max =>
        {
            Algorithm::BinomialTree
        }
        // Two ranks: halving-doubling moves the same bytes as recursive
        // doubling, in two messages instead of one.
        CollectiveKind::AllReduce
            if bytes <= t.recursive_doubling_max || (world <= 2 && bytes <= t.halving_doubling_max) =>
        {
            Algorithm::RecursiveDoubling
        }
        CollectiveKind::AllReduce if bytes <= t.halving_doubling_max => Algorithm::HalvingDoubling,
        CollectiveKind::AllReduce => Algorithm::Ring,
        _ => kind.algorithms()[0],
    }
}

/// Why no plan could be made.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PlanError {
    /// World size zero or above [`MAX_WORLD`].
    #[error("world size {0} is out of range 1..={MAX_WORLD}")]
    World(usize),
    /// The rank is not below the world size.
    #[error("rank {rank} is out of range for a world of {world}")]
    Rank {
        /// The rank.
        rank: usize,
        /// The world size.
        world: usize,
    },
    /// A rooted collective without a root, a root (or peer) not below the
    /// world size, or a point-to-point operation with this rank itself.
    #[error("{kind} needs a root (for send and recv: a peer other than this rank) in 0..{world}; got {root:?}")]
    Root {
        /// The collective.
        kind: CollectiveKind,
        /// The root given.
        root: Option<usize>,
        /// The world size.
        world: usize,
    },
    /// The algorithm does not implement the collective.
    #[error("{kind} has no {algorithm} algorithm; it has: {}", algorithm_names(*.kind))]
    Unsupported {
        /// The collective.
        kind: CollectiveKind,
        /// The algorithm asked for.
        algorithm: Algorithm,
    },
    /// An out-of-place plan of a collective that has only one form.
    #[error("{0} has no out-of-place form (only all_reduce, reduce and reduce_scatter have)")]
    NotOutOfPlace(CollectiveKind),
    /// The buffers are larger than [`MAX_BYTES`].
    #[error("{count} elements of {dtype} per rank over {world} ranks exceed the limit of {MAX_BYTES} bytes")]
    TooLarge {
        /// Elements per rank.
        count: usize,
        /// The dtype.
        dtype: DType,
        /// The world size.
        world: usize,
    },
}

/// `kind`'s algorithms, for error messages.
fn algorithm_names(kind: CollectiveKind) -> String {
    let names: Vec<&str> = kind.algorithms().iter().map(|a| a.name()).collect();
    names.join(", ")
}

/// What every rank agrees on about one collective (its plan also needs the
/// rank and the algorithm).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Spec {
    /// Which collective.
    pub kind: CollectiveKind,
    /// The element type (sets segment sizes; plans count elements).
    pub dtype: DType,
    /// Elements per rank, as in [`CollectiveKind`].
    pub count: usize,
    /// The root of a rooted collective, the peer of a send or receive.
    pub root: Option<usize>,
    /// The number of ranks.
    pub world: usize,
}

impl Spec {
    /// The bytes of one rank's `count` elements (what
    /// [`choose_algorithm`] takes).
    pub fn bytes(&self) -> usize {
        self.count.saturating_mul(self.dtype.size())
    }

    /// The plan for `rank` with `algorithm`.
    pub fn plan(&self, rank: usize, algorithm: Algorithm) -> Result<Plan, PlanError> {
        self.build(rank, algorithm, false)
    }

    /// The plan for `rank` with `algorithm` of a collective that is in place
    /// (all_reduce, reduce, reduce_scatter), made out of place: this rank's
    /// data is in `input` (as long as the output), which is left as it was,
    /// and `output` needs no contents before. Ranks may mix both forms.
    pub fn plan_out_of_place(&self, rank: usize, algorithm: Algorithm) -> Result<Plan, PlanError> {
        self.build(rank, algorithm, true)
    }

    fn build(&self, rank: usize, algorithm: Algorithm, out_of_place: bool) -> Result<Plan, PlanError> {
        let Spec {
            kind,
            dtype,
            count: n,
            root,
            world,
        } = *self;
        if world == 0 || world > MAX_WORLD {
            return Err(PlanError::World(world));
        }
        if rank >= world {
            return Err(PlanError::Rank { rank, world });
        }
        if !kind.algorithms().contains(&algorithm) {
            return Err(PlanError::Unsupported { kind, algorithm });
        }
        let size = dtype.size();
        let all = n
            .checked_mul(world)
            .filter(|all| all.checked_mul(size).is_some_and(|bytes| bytes <= MAX_BYTES))
            .ok_or(PlanError::TooLarge { count: n, dtype, world })?;
        let p2p = matches!(kind, CollectiveKind::Send | CollectiveKind::Recv);
        let root = match root {
            _ if !kind.rooted() => 0,
            Some(r) if r < world && !(p2p && r == rank) => r,
            _ => return Err(PlanError::Root { kind, root, world }),
        };
        let is_root = rank == root;
        let (input_len, output_len) = match kind {
            CollectiveKind::AllReduce | CollectiveKind::Broadcast | CollectiveKind::Reduce => (0, n),
            CollectiveKind::AllGather => (n, all),
            CollectiveKind::Gather => (n, if is_root { all } else { 0 }),
            CollectiveKind::Scatter => (if is_root { all } else { 0 }, n),
            CollectiveKind::ReduceScatter => (0, all),
            CollectiveKind::AllToAll => (all, all),
            CollectiveKind::Barrier => (0, 0),
            CollectiveKind::Send => (n, 0),
            CollectiveKind::Recv => (0, n),
        };
        let mut b = match out_of_place {
            false => Builder::new(rank, world, input_len, output_len),
            true if kind.reduces() => Builder::out_of_place(rank, world, output_len),
            true => return Err(PlanError::NotOutOfPlace(kind)),
        };
        match (kind, algorithm) {
            (CollectiveKind::AllReduce, Algorithm::Ring) => ring::all_reduce(&mut b, rank, world, n, size),
            (CollectiveKind::AllReduce, Algorithm::RecursiveDoubling) => {
                doubling::recursive_doubling(&mut b, rank, world, n)
            }
            (CollectiveKind::AllReduce, Algorithm::BinomialTree) => tree::all_reduce(&mut b, rank, world, n, size),
            (CollectiveKind::AllReduce, _) => doubling::halving_doubling(&mut b, rank, world, n),
            (CollectiveKind::Broadcast, _) => tree::broadcast(&mut b, rank, world, root, n, size),
            (CollectiveKind::Reduce, _) => tree::reduce(&mut b, rank, world, root, n, size),
            (CollectiveKind::AllGather, _) => ring::all_gather(&mut b, rank, world, n, size),
            (CollectiveKind::ReduceScatter, _) => ring::reduce_scatter(&mut b, rank, world, n, size),
            (CollectiveKind::Gather, _) => direct::gather(&mut b, rank, world, root, n, size),
            (CollectiveKind::Scatter, _) => direct::scatter(&mut b, rank, world, root, n, size),
            (CollectiveKind::AllToAll, _) => direct::all_to_all(&mut b, rank, world, n, size),
            (CollectiveKind::Barrier, _) => direct::barrier(&mut b, rank, world),
            (CollectiveKind::Send, _) => direct::send(&mut b, root, n),
            (CollectiveKind::Recv, _) => direct::recv(&mut b, root, n),
        }
        Ok(b.finish())
    }
}
