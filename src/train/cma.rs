//! Cross-memory attach: one rank process writes bytes straight into
//! another's memory (`process_vm_writev(2)`, what Open MPI's shared-memory
//! transport does for large messages), one copy where a shared-memory
//! ring takes two. The kernel allows it where this process may ptrace the
//! other: same user and, under Yama, `ptrace_scope` 0 (or root). Where it
//! is refused (Yama's `ptrace_scope` 1 between sibling processes, a
//! seccomp filter, another OS) the state transfer falls back to the link;
//! nothing here lowers a protection (no `PR_SET_PTRACER`).

use std::io;

/// Writes all of `local` at address `remote` of process `pid`: an error
/// unless every byte landed (a partial write is an error too: the caller
/// falls back and sends the bytes another way).
#[cfg(target_os = "linux")]
pub(crate) fn write(pid: u32, local: &[u8], remote: u64) -> io::Result<()> {
    if local.is_empty() {
        return Ok(());
    }
    let pid = libc::pid_t::try_from(pid).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let local_iov = libc::iovec {
        iov_base: local.as_ptr() as *mut libc::c_void,
        iov_len: local.len(),
    };
    let remote_iov = libc::iovec {
        iov_base: remote as usize as *mut libc::c_void,
        iov_len: local.len(),
    };
    // SAFETY: `local_iov` describes `local`, borrowed for the call, which
    // the kernel only reads; `remote_iov` names memory of another process,
    // which the kernel checks (EFAULT when it is not mapped writable
    // there): nothing of this process is written.
    let written = unsafe { libc::process_vm_writev(pid, &local_iov, 1, &remote_iov, 1, 0) };
    match usize::try_from(written) {
        Err(_) => Err(io::Error::last_os_error()),
        Ok(n) if n == local.len() => Ok(()),
        Ok(n) => Err(io::Error::other(format!(
            "partial cross-memory write: {n} of {} bytes",
            local.len()
        ))),
    }
}

/// Asks the kernel to back the whole 2 MiB pages of `bytes` with huge
/// pages where it can (`madvise(MADV_HUGEPAGE)`; a hint that changes no
/// byte). A cross-memory write pins every target page first: on 4 KiB
/// pages that halves its speed here (5-6 against 9-11 GB/s). Pages not
/// touched yet (a joiner's zeroed buffers) come huge at their first write;
/// touched ones are merged later by the kernel, if at all.
#[cfg(target_os = "linux")]
pub(crate) fn advise_huge_pages(bytes: &mut [u8]) {
    const HUGE: usize = 2 << 20;
    let start = (bytes.as_mut_ptr() as usize).next_multiple_of(HUGE);
    let end = (bytes.as_mut_ptr() as usize + bytes.len()) / HUGE * HUGE;
    if start < end {
        // SAFETY: the range lies within `bytes`, memory this process
        // owns, and MADV_HUGEPAGE changes how it is backed, never its
        // contents. A refusal (THP off, an old kernel) changes nothing.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
}

/// Huge pages are asked for on Linux only.
#[cfg(not(target_os = "linux"))]
pub(crate) fn advise_huge_pages(_bytes: &mut [u8]) {}

/// Cross-memory attach is Linux's: elsewhere every write is refused.
#[cfg(not(target_os = "linux"))]
pub(crate) fn write(_pid: u32, _local: &[u8], _remote: u64) -> io::Result<()> {
    Err(io::Error::from(io::ErrorKind::Unsupported))
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn writes_land_whole_and_bad_targets_are_errors() {
        // A process may always write its own memory this way (no ptrace check).
        let me = std::process::id();
        let mut target = vec![0u8; 300_000];
        let data: Vec<u8> = (0..target.len()).map(|i| (i % 253) as u8).collect();
        let at = target.as_mut_ptr() as u64;
        write(me, &data, at).expect("a write into this process");
        assert_eq!(target, data);
        // An unmapped address: EFAULT, nothing lands, an error to fall back on.
        let err = write(me, &data, 8).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EFAULT), "{err}");
        // A pid that cannot exist (over pid_max's ceiling of 2^22).
        assert!(write(u32::MAX >> 1, &data, at).is_err());
        assert!(write(me, &[], 8).is_ok(), "nothing to write");
    }
}
