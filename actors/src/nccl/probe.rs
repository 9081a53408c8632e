//! Whether CUDA and NCCL can be used here (NC-1), without a panic.
//!
//! cudarc loads libcuda and libnccl on first use and panics when either is
//! missing, or when a symbol it needs is; so before the first call the
//! probe checks that both libraries load (`is_culib_present`), that the
//! NCCL symbols the backend calls exist, and that NCCL is new enough.

use std::ffi::c_int;
use std::fmt;
use std::sync::OnceLock;

use cudarc::driver::sys::{CUresult, cudaError_enum};
use thiserror::Error;

use super::code::NcclCode;

/// The oldest NCCL with non-blocking communicators (`ncclConfig_t.blocking`,
/// `ncclCommInitRankConfig`), which the backend needs so that init and abort
/// can time out (NC-4).
pub const MIN_NCCL: NcclVersion = NcclVersion {
    major: 2,
    minor: 14,
    patch: 0,
};

/// The NCCL functions the backend calls; cudarc panics on a missing one.
pub const REQUIRED_SYMBOLS: [&str; 16] = [
    "ncclGetVersion",
    "ncclGetUniqueId",
    "ncclGetLastError",
    "ncclCommInitRankConfig",
    "ncclCommGetAsyncError",
    "ncclCommAbort",
    "ncclAllReduce",
    "ncclBroadcast",
    "ncclReduce",
    "ncclAllGather",
    "ncclReduceScatter",
    "ncclSend",
    "ncclRecv",
    "ncclGroupStart",
    "ncclGroupEnd",
    "ncclGetErrorString",
];

const CUDA_HINT: &str = "install the NVIDIA driver, and put the directory holding libcuda.so.1 on LD_LIBRARY_PATH \
     (in containers often /usr/local/nvidia/lib64 or /usr/lib/x86_64-linux-gnu)";
const NCCL_HINT: &str = "install NCCL (`pip install nvidia-nccl-cu12` puts libnccl.so.2 in \
     site-packages/nvidia/nccl/lib; or the libnccl2 package) and put a libnccl.so linked to its libnccl.so.2 in a \
     directory on LD_LIBRARY_PATH (the loader looks for libnccl.so, not .so.2; scripts/gpu-check.sh makes the link)";

/// An NCCL version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct NcclVersion {
    /// Major.
    pub major: u32,
    /// Minor.
    pub minor: u32,
    /// Patch.
    pub patch: u32,
}

impl NcclVersion {
    /// Decodes `ncclGetVersion`'s code: `major * 10000 + minor * 100 +
    /// patch` since 2.9, `major * 1000 + minor * 100 + patch` before.
    pub fn from_code(code: u32) -> Self {
        let (major, rest) = if code >= 10_000 {
            (code / 10_000, code % 10_000)
        } else {
            (code / 1_000, code % 1_000)
        };
        Self {
            major,
            minor: rest / 100,
            patch: rest % 100,
        }
    }

    /// The code in the current encoding, as `ncclConfig_t.version` takes it.
    pub fn code(self) -> u32 {
        self.major * 10_000 + self.minor * 100 + self.patch
    }
}

impl fmt::Display for NcclVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// What the probe found: everything the backend needs is here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Availability {
    /// CUDA devices visible to this process.
    pub devices: usize,
    /// The CUDA version the driver supports (`cuDriverGetVersion`: 12040 is 12.4).
    pub driver_version: u32,
    /// The NCCL library's version.
    pub nccl: NcclVersion,
}

/// CUDA or NCCL cannot be used here.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ProbeError {
    /// A library could not be loaded.
    #[error("{library} could not be loaded: {hint}")]
    MissingLibrary {
        /// `libcuda` or `libnccl`.
        library: &'static str,
        /// Where to get it.
        hint: &'static str,
    },
    /// The driver loads but sees no device.
    #[error(
        "the CUDA driver sees no device (CUDA_VISIBLE_DEVICES={visible:?}); check nvidia-smi and CUDA_VISIBLE_DEVICES"
    )]
    NoDevice {
        /// The variable, when set.
        visible: Option<String>,
    },
    /// A driver call failed.
    #[error("CUDA {call} failed with {code}")]
    Driver {
        /// The call.
        call: &'static str,
        /// The driver's result, as its debug name.
        code: String,
    },
    /// `ncclGetVersion` failed.
    #[error("ncclGetVersion failed with {code}")]
    Version {
        /// What it returned.
        code: NcclCode,
    },
    /// NCCL is too old for non-blocking communicators.
    #[error(
        "NCCL {found} is older than {needed}, the first with non-blocking communicators, which chorus needs so that \
         init and abort can time out; {NCCL_HINT}"
    )]
    TooOld {
        /// The version found.
        found: NcclVersion,
        /// The version needed.
        needed: NcclVersion,
    },
    /// The library lacks a function the backend calls.
    #[error("the loaded libnccl lacks {symbol}; {NCCL_HINT}")]
    MissingSymbol {
        /// The function.
        symbol: &'static str,
    },
}

/// Probes CUDA and NCCL once per process (NC-1) and returns what it found.
/// Never panics: a missing library is a [`ProbeError`] naming it.
pub fn probe() -> Result<Availability, ProbeError> {
    static PROBE: OnceLock<Result<Availability, ProbeError>> = OnceLock::new();
    PROBE.get_or_init(probe_now).clone()
}

fn driver(call: &'static str, result: CUresult) -> Result<(), ProbeError> {
    match result {
        cudaError_enum::CUDA_SUCCESS => Ok(()),
        code => Err(ProbeError::Driver {
            call,
            code: format!("{code:?}"),
        }),
    }
}

fn probe_now() -> Result<Availability, ProbeError> {
    // SAFETY: only tries to dlopen the library; loads nothing else.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(ProbeError::MissingLibrary {
            library: "libcuda (the NVIDIA driver's CUDA library)",
            hint: CUDA_HINT,
        });
    }
    // SAFETY: libcuda loads (checked above); cuInit takes flags 0.
    match unsafe { cudarc::driver::sys::cuInit(0) } {
        cudaError_enum::CUDA_ERROR_NO_DEVICE => {
            return Err(ProbeError::NoDevice {
                visible: std::env::var("CUDA_VISIBLE_DEVICES").ok(),
            });
        }
        result => driver("cuInit", result)?,
    }
    let mut devices: c_int = 0;
    // SAFETY: the driver is initialized; the pointer is to a live c_int.
    driver("cuDeviceGetCount", unsafe {
        cudarc::driver::sys::cuDeviceGetCount(&mut devices)
    })?;
    if devices <= 0 {
        return Err(ProbeError::NoDevice {
            visible: std::env::var("CUDA_VISIBLE_DEVICES").ok(),
        });
    }
    let mut driver_version: c_int = 0;
    // SAFETY: the pointer is to a live c_int.
    driver("cuDriverGetVersion", unsafe {
        cudarc::driver::sys::cuDriverGetVersion(&mut driver_version)
    })?;
    // SAFETY: only tries to dlopen the library.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(ProbeError::MissingLibrary {
            library: "libnccl",
            hint: NCCL_HINT,
        });
    }
    // SAFETY: libnccl loads (checked above), so culib() returns it.
    let library = unsafe { cudarc::nccl::sys::culib() };
    for symbol in REQUIRED_SYMBOLS {
        // SAFETY: looks the symbol up without calling it; the type is irrelevant to a lookup.
        if unsafe { library.get::<unsafe extern "C" fn()>(symbol.as_bytes()) }.is_err() {
            return Err(ProbeError::MissingSymbol { symbol });
        }
    }
    let mut code: c_int = 0;
    // SAFETY: ncclGetVersion exists (checked above) and writes one c_int.
    let result = unsafe { cudarc::nccl::sys::ncclGetVersion(&mut code) };
    if let Some(code) = NcclCode::from_result(result) {
        return Err(ProbeError::Version { code });
    }
    let nccl = NcclVersion::from_code(u32::try_from(code).unwrap_or(0));
    if nccl < MIN_NCCL {
        return Err(ProbeError::TooOld {
            found: nccl,
            needed: MIN_NCCL,
        });
    }
    Ok(Availability {
        devices: devices as usize,
        driver_version: driver_version as u32,
        nccl,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_versions_decode_both_encodings() {
        assert_eq!(
            NcclVersion::from_code(22_105),
            NcclVersion {
                major: 2,
                minor: 21,
                patch: 5
            }
        );
        assert_eq!(NcclVersion::from_code(2_708).to_string(), "2.7.8");
        assert_eq!(NcclVersion::from_code(21_403).code(), 21_403);
        assert!(NcclVersion::from_code(21_306) < MIN_NCCL);
        assert!(NcclVersion::from_code(21_400) >= MIN_NCCL);
    }

    #[test]
    fn nc1_the_probe_never_panics_and_names_what_is_missing() {
        match probe() {
            Ok(found) => assert!(found.devices > 0 && found.nccl >= MIN_NCCL, "{found:?}"),
            Err(e) => {
                let text = e.to_string();
                assert!(!text.is_empty());
                if let ProbeError::MissingLibrary { library, .. } = &e {
                    assert!(text.contains(library) && text.contains("LD_LIBRARY_PATH"), "{text}");
                }
            }
        }
        // Cached: the same answer twice.
        assert_eq!(probe(), probe());
    }
}
