//! NCCL's result codes ([`NcclCode`]), which both the probe and the errors
//! of NCCL calls name.

use std::fmt;

use cudarc::nccl::sys::ncclResult_t;

/// An NCCL result other than `ncclSuccess` (mirrors `ncclResult_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NcclCode {
    /// `ncclUnhandledCudaError`: a CUDA call inside NCCL failed.
    UnhandledCudaError,
    /// `ncclSystemError`: a system call failed (sockets, shared memory).
    SystemError,
    /// `ncclInternalError`: an NCCL bug or memory corruption.
    InternalError,
    /// `ncclInvalidArgument`: a bad argument (pointer, count, rank).
    InvalidArgument,
    /// `ncclInvalidUsage`: a bad sequence of calls (e.g. mismatched
    /// collectives across ranks).
    InvalidUsage,
    /// `ncclRemoteError`: a peer failed or went away.
    RemoteError,
    /// `ncclInProgress`: a non-blocking operation has not finished.
    InProgress,
    /// `ncclTimeout` (NCCL 2.30+).
    Timeout,
}

impl NcclCode {
    /// The code of `result`, or `None` for `ncclSuccess` (and the
    /// `ncclNumResults` sentinel, which no call returns).
    pub fn from_result(result: ncclResult_t) -> Option<Self> {
        match result {
            ncclResult_t::ncclSuccess | ncclResult_t::ncclNumResults => None,
            ncclResult_t::ncclUnhandledCudaError => Some(Self::UnhandledCudaError),
            ncclResult_t::ncclSystemError => Some(Self::SystemError),
            ncclResult_t::ncclInternalError => Some(Self::InternalError),
            ncclResult_t::ncclInvalidArgument => Some(Self::InvalidArgument),
            ncclResult_t::ncclInvalidUsage => Some(Self::InvalidUsage),
            ncclResult_t::ncclRemoteError => Some(Self::RemoteError),
            ncclResult_t::ncclInProgress => Some(Self::InProgress),
            ncclResult_t::ncclTimeout => Some(Self::Timeout),
        }
    }

    /// NCCL's name (`ncclRemoteError`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            Self::UnhandledCudaError => "ncclUnhandledCudaError",
            Self::SystemError => "ncclSystemError",
            Self::InternalError => "ncclInternalError",
            Self::InvalidArgument => "ncclInvalidArgument",
            Self::InvalidUsage => "ncclInvalidUsage",
            Self::RemoteError => "ncclRemoteError",
            Self::InProgress => "ncclInProgress",
            Self::Timeout => "ncclTimeout",
        }
    }
}

impl fmt::Display for NcclCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nc2_result_codes_map_both_ways_of_success() {
        assert_eq!(NcclCode::from_result(ncclResult_t::ncclSuccess), None);
        assert_eq!(
            NcclCode::from_result(ncclResult_t::ncclRemoteError),
            Some(NcclCode::RemoteError)
        );
        assert_eq!(
            NcclCode::from_result(ncclResult_t::ncclInProgress),
            Some(NcclCode::InProgress)
        );
        assert_eq!(NcclCode::RemoteError.to_string(), "ncclRemoteError");
    }
}
