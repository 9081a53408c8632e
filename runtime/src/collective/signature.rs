//! Collective signatures: what every rank believes the current collective
//! is. Each collective's first frame carries the sender's, in a fixed
//! 32-byte encoding; the receiver compares it with its own, so ranks that
//! disagree (different op, dtype, count, root or sequence number) fail with
//! both signatures instead of hanging or reducing garbage.

use std::fmt;

use thiserror::Error;

use super::dtype::{DType, ReduceOp};
use super::schedule::CollectiveKind;

/// Bytes of an encoded [`Signature`].
pub const ENCODED_LEN: usize = 32;

/// Version byte of the encoding.
const VERSION: u8 = 1;

/// Encodes "none" in the operator byte.
const NO_OP: u8 = u8::MAX;

/// Encodes "none" in the root field.
const NO_ROOT: u64 = u64::MAX;

/// A malformed encoded signature.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SignatureError {
    /// Not [`ENCODED_LEN`] bytes.
    #[error("signature of {0} bytes; expected {ENCODED_LEN}")]
    Length(usize),
    /// An encoding version this build does not know; peers run different
    /// chorus versions.
    #[error("signature version {0}; this build knows version {VERSION} (do all ranks run the same chorus?)")]
    Version(u8),
    /// A field holds a value no signature encodes.
    #[error("signature field {field} holds invalid value {value}")]
    Field {
        /// The field's name.
        field: &'static str,
        /// Its raw value.
        value: u64,
    },
}

/// One collective as a rank sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Signature {
    /// The group's sequence number of this collective.
    pub seq: u64,
    /// Which collective.
    pub kind: CollectiveKind,
    /// The element type.
    pub dtype: DType,
    /// Elements per rank.
    pub count: usize,
    /// The root, or the peer of a send or receive.
    pub root: Option<usize>,
    /// The reduction operator, for reducing collectives.
    pub reduce_op: Option<ReduceOp>,
}

impl Signature {
    /// The fixed-size encoding: version, kind, dtype, operator (`0xff` for
    /// none), 4 zero bytes, then little-endian `seq`, `count` and `root`
    /// (`u64::MAX` for none).
    pub fn encode(&self) -> [u8; ENCODED_LEN] {
        let mut out = [0u8; ENCODED_LEN];
        out[0] = VERSION;
        out[1] = self.kind.code();
        out[2] = self.dtype.code();
        out[3] = self.reduce_op.map_or(NO_OP, ReduceOp::code);
        out[8..16].copy_from_slice(&self.seq.to_le_bytes());
        out[16..24].copy_from_slice(&(self.count as u64).to_le_bytes());
        let root = self.root.map_or(NO_ROOT, |r| r as u64);
        out[24..32].copy_from_slice(&root.to_le_bytes());
        out
    }

    /// Decodes [`encode`](Self::encode)'s output, checking every field.
    pub fn decode(bytes: &[u8]) -> Result<Self, SignatureError> {
        let bytes: &[u8; ENCODED_LEN] = bytes.try_into().map_err(|_| SignatureError::Length(bytes.len()))?;
        if bytes[0] != VERSION {
            return Err(SignatureError::Version(bytes[0]));
        }
        let bad = |field, value: u64| SignatureError::Field { field, value };
        let word = |at: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(w)
        };
        let kind = CollectiveKind::from_code(bytes[1]).ok_or(bad("kind", bytes[1].into()))?;
        let dtype = DType::from_code(bytes[2]).ok_or(bad("dtype", bytes[2].into()))?;
        let reduce_op = match bytes[3] {
            NO_OP => None,
            code => Some(ReduceOp::from_code(code).ok_or(bad("reduce_op", code.into()))?),
        };
        let reserved = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
        if reserved != 0 {
            return Err(bad("reserved", reserved.into()));
        }
        let count = word(16);
        let count = usize::try_from(count).map_err(|_| bad("count", count))?;
        let root = match word(24) {
            NO_ROOT => None,
            r => Some(usize::try_from(r).map_err(|_| bad("root", r))?),
        };
        Ok(Signature {
            seq: word(8),
            kind,
            dtype,
            count,
            root,
            reduce_op,
        })
    }

    /// How `self` and `other` (another rank's signature for the same
    /// collective) disagree, or `None` when they match.
    ///
    /// A send matches a receive (and not another send): their roots name
    /// each other's peers, so they are not compared.
    pub fn mismatch(&self, other: &Signature) -> Option<String> {
        use CollectiveKind::{Recv, Send};
        let mut diffs = Vec::new();
        if self.seq != other.seq {
            diffs.push(format!("sequence number {} vs {}", self.seq, other.seq));
        }
        let p2p = matches!((self.kind, other.kind), (Send, Recv) | (Recv, Send));
        if self.kind != other.kind && !p2p || self.kind == other.kind && matches!(self.kind, Send | Recv) {
            diffs.push(format!("operation {} vs {}", self.kind, other.kind));
        }
        if self.dtype != other.dtype {
            diffs.push(format!("dtype {} vs {}", self.dtype, other.dtype));
        }
        if self.count != other.count {
            diffs.push(format!("count {} vs {}", self.count, other.count));
        }
        if self.root != other.root && !p2p {
            diffs.push(format!("root {} vs {}", Root(self.root), Root(other.root)));
        }
        if self.reduce_op != other.reduce_op {
            diffs.push(format!("reduce op {} vs {}", Op(self.reduce_op), Op(other.reduce_op)));
        }
        (!diffs.is_empty()).then(|| format!("{}: {self} vs {other}", diffs.join(", ")))
    }
}

/// Formats an optional root.
struct Root(Option<usize>);

impl fmt::Display for Root {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(r) => write!(f, "{r}"),
            None => f.write_str("none"),
        }
    }
}

/// Formats an optional operator.
struct Op(Option<ReduceOp>);

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(op) => write!(f, "{op}"),
            None => f.write_str("none"),
        }
    }
}

impl fmt::Display for Signature {
    /// `#7 all_reduce(1024 x float32, sum)`, `#8 broadcast(16 x int64, root 0)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{} {}({} x {}", self.seq, self.kind, self.count, self.dtype)?;
        if let Some(root) = self.root {
            let what = if matches!(self.kind, CollectiveKind::Send | CollectiveKind::Recv) {
                "peer"
            } else {
                "root"
            };
            write!(f, ", {what} {root}")?;
        }
        if let Some(op) = self.reduce_op {
            write!(f, ", {op}")?;
        }
        f.write_str(")")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_reduce() -> Signature {
        Signature {
            seq: 7,
            kind: CollectiveKind::AllReduce,
            dtype: DType::Float32,
            count: 1024,
            root: None,
            reduce_op: Some(ReduceOp::Sum),
        }
    }

    #[test]
    fn encoding_round_trips_and_rejects_garbage() {
        let broadcast = Signature {
            seq: u64::MAX - 1,
            kind: CollectiveKind::Broadcast,
            dtype: DType::BFloat16,
            count: 0,
            root: Some(3),
            reduce_op: None,
        };
        for sig in [all_reduce(), broadcast] {
            let bytes = sig.encode();
            assert_eq!(bytes.len(), ENCODED_LEN);
            assert_eq!(Signature::decode(&bytes), Ok(sig));
        }
        let good = all_reduce().encode();
        assert_eq!(Signature::decode(&good[..31]), Err(SignatureError::Length(31)));
        let mut bad = good;
        bad[0] = 9;
        assert_eq!(Signature::decode(&bad), Err(SignatureError::Version(9)));
        for (at, field) in [(1, "kind"), (2, "dtype"), (3, "reduce_op"), (5, "reserved")] {
            let mut bad = good;
            bad[at] = 200;
            assert!(
                matches!(Signature::decode(&bad), Err(SignatureError::Field { field: f, .. }) if f == field),
                "{field}"
            );
        }
    }

    #[test]
    fn mismatch_names_every_difference_and_both_signatures() {
        let a = all_reduce();
        assert_eq!(a.mismatch(&a), None);
        let b = Signature {
            kind: CollectiveKind::Broadcast,
            count: 512,
            root: Some(0),
            reduce_op: None,
            ..a
        };
        let msg = a.mismatch(&b).unwrap();
        assert_eq!(
            msg,
            "operation all_reduce vs broadcast, count 1024 vs 512, root none vs 0, reduce op sum vs none: \
             #7 all_reduce(1024 x float32, sum) vs #7 broadcast(512 x float32, root 0)"
        );
        let later = Signature {
            seq: 8,
            dtype: DType::Float64,
            ..a
        };
        let msg = a.mismatch(&later).unwrap();
        assert!(
            msg.starts_with("sequence number 7 vs 8, dtype float32 vs float64:"),
            "{msg}"
        );
    }

    #[test]
    fn a_send_matches_a_recv_but_not_another_send() {
        let send = Signature {
            kind: CollectiveKind::Send,
            root: Some(1),
            reduce_op: None,
            ..all_reduce()
        };
        let recv = Signature {
            kind: CollectiveKind::Recv,
            root: Some(0),
            ..send
        };
        assert_eq!(send.mismatch(&recv), None);
        assert!(send.mismatch(&Signature { root: Some(0), ..send }).is_some());
        assert!(send.mismatch(&Signature { count: 1, ..recv }).is_some());
    }
}
