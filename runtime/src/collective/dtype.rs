//! Element types and reduction operators, with the names users already know
//! (PyTorch's dtype names for display, nccl-tests' names accepted too).

use std::fmt;
use std::str::FromStr;

use thiserror::Error;

/// A name that is not a known dtype, reduction operator, collective or
/// algorithm.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("unknown {what} {name:?}; expected one of: {expected}")]
pub struct ParseError {
    /// What was being parsed ("dtype", "reduce op", ...).
    pub what: &'static str,
    /// The name given.
    pub name: String,
    /// The accepted names, comma-separated.
    pub expected: String,
}

impl ParseError {
    pub(crate) fn new(what: &'static str, name: &str, expected: &[&str]) -> Self {
        ParseError {
            what,
            name: name.to_owned(),
            expected: expected.join(", "),
        }
    }
}

/// The element type of a collective's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// `i8`.
    Int8,
    /// `u8`.
    UInt8,
    /// `i32`.
    Int32,
    /// `u32`.
    UInt32,
    /// `i64`.
    Int64,
    /// `u64`.
    UInt64,
    /// IEEE 754 binary16 ([`half::f16`]).
    Float16,
    /// bfloat16 ([`half::bf16`]).
    BFloat16,
    /// `f32`.
    Float32,
    /// `f64`.
    Float64,
}

impl DType {
    /// Every dtype, in nccl-tests' order of integers then floats.
    pub const ALL: [DType; 10] = [
        DType::Int8,
        DType::UInt8,
        DType::Int32,
        DType::UInt32,
        DType::Int64,
        DType::UInt64,
        DType::Float16,
        DType::BFloat16,
        DType::Float32,
        DType::Float64,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::Int8 | DType::UInt8 => 1,
            DType::Float16 | DType::BFloat16 => 2,
            DType::Int32 | DType::UInt32 | DType::Float32 => 4,
            DType::Int64 | DType::UInt64 | DType::Float64 => 8,
        }
    }

    /// Whether this is an integer type (the bitwise operators need one).
    pub const fn is_integer(self) -> bool {
        !self.is_float()
    }

    /// Whether this is a floating-point type.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::Float16 | DType::BFloat16 | DType::Float32 | DType::Float64)
    }

    /// PyTorch's name (`float32`, `bfloat16`, `int64`, ...); also [`Display`](fmt::Display).
    pub const fn name(self) -> &'static str {
        match self {
            DType::Int8 => "int8",
            DType::UInt8 => "uint8",
            DType::Int32 => "int32",
            DType::UInt32 => "uint32",
            DType::Int64 => "int64",
            DType::UInt64 => "uint64",
            DType::Float16 => "float16",
            DType::BFloat16 => "bfloat16",
            DType::Float32 => "float32",
            DType::Float64 => "float64",
        }
    }

    /// nccl-tests' name (`-d` flag, and its output table): `half`, `float`,
    /// `double` for the IEEE floats, the PyTorch name otherwise.
    pub const fn nccl_name(self) -> &'static str {
        match self {
            DType::Float16 => "half",
            DType::Float32 => "float",
            DType::Float64 => "double",
            other => other.name(),
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

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = ParseError;

    /// Accepts PyTorch's names and nccl-tests' names.
    fn from_str(s: &str) -> Result<Self, ParseError> {
        Self::ALL
            .into_iter()
            .find(|d| d.name() == s || d.nccl_name() == s)
            .ok_or_else(|| {
                let mut names: Vec<&str> = Self::ALL.iter().map(|d| d.name()).collect();
                names.extend(["half", "float", "double"]);
                ParseError::new("dtype", s, &names)
            })
    }
}

/// A reduction operator.
///
/// Integers wrap on overflow (`sum`, `prod`, `avg`), as NCCL and Gloo do in
/// C; they never panic. Float `min`/`max` propagate NaN, as
/// `torch.minimum`/`torch.maximum` do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Product.
    Prod,
    /// Minimum.
    Min,
    /// Maximum.
    Max,
    /// Mean over the ranks: combined as [`Sum`](Self::Sum), then the result
    /// is divided by the world size once, at the end, by
    /// [`finalize_avg`](super::finalize_avg). Integers divide truncating
    /// toward zero, as NCCL's `ncclAvg` on integer types (Gloo has no AVG;
    /// PyTorch offers it only through NCCL); floats divide in their
    /// accumulation type and round once.
    Avg,
    /// Bitwise and (integers only).
    BAnd,
    /// Bitwise or (integers only).
    BOr,
    /// Bitwise exclusive or (integers only).
    BXor,
}

impl ReduceOp {
    /// Every operator.
    pub const ALL: [ReduceOp; 8] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
        ReduceOp::BAnd,
        ReduceOp::BOr,
        ReduceOp::BXor,
    ];

    /// The lowercase name (`sum`, `band`, ...), as PyTorch's `ReduceOp`.
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
            ReduceOp::BAnd => "band",
            ReduceOp::BOr => "bor",
            ReduceOp::BXor => "bxor",
        }
    }

    /// Whether the operator only applies to integers.
    pub const fn is_bitwise(self) -> bool {
        matches!(self, ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor)
    }

    /// Whether `self` applies to `dtype` (bitwise operators need integers).
    pub const fn supports(self, dtype: DType) -> bool {
        !self.is_bitwise() || dtype.is_integer()
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

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReduceOp {
    type Err = ParseError;

    fn from_str(s: &str) -> Result<Self, ParseError> {
        Self::ALL.into_iter().find(|op| op.name() == s).ok_or_else(|| {
            let names: Vec<&str> = Self::ALL.iter().map(|op| op.name()).collect();
            ParseError::new("reduce op", s, &names)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_sizes_and_names_round_trip() {
        let nccl: Vec<&str> = DType::ALL.iter().map(|d| d.nccl_name()).collect();
        assert_eq!(
            nccl.join(" "),
            "int8 uint8 int32 uint32 int64 uint64 half bfloat16 float double"
        );
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>(), Ok(d));
            assert_eq!(d.nccl_name().parse::<DType>(), Ok(d));
            assert_eq!(DType::from_code(d.code()), Some(d));
        }
        assert_eq!(DType::BFloat16.size(), 2);
        assert_eq!(DType::UInt64.size(), 8);
        let err = "float8".parse::<DType>().unwrap_err();
        assert!(err.to_string().contains("float8"), "{err}");
        assert_eq!(DType::from_code(10), None);
    }

    #[test]
    fn bitwise_ops_need_integers() {
        for op in ReduceOp::ALL {
            assert_eq!(op.name().parse::<ReduceOp>(), Ok(op));
            assert_eq!(ReduceOp::from_code(op.code()), Some(op));
            assert!(op.supports(DType::Int32));
            assert_eq!(op.supports(DType::Float32), !op.is_bitwise());
        }
        assert!("mean".parse::<ReduceOp>().is_err());
    }
}
