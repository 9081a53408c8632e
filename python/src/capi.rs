//! A C entry point into a group's collectives, for a `c10d::Backend`
//! written in C++ over this library: torch's dispatcher then calls
//! compiled code all the way to the ranks, with no Python step.
//! `chorus/_backend.cpp` is such a backend, the C++ front of the torch
//! backend; `python/bench/dispatch.py` and `torch_backend.py --python`
//! measure it against the Python backend alone.
//!
//! The C side gets the table below and a handle to the package's `Group`
//! object, which it keeps alive by holding that Python object (so a
//! destroyed group stays destroyed for it too), and calls `collective`
//! with contiguous CPU tensors' memory, which it must keep alive and
//! leave alone until `done` is called. `done` runs on one of the runtime's
//! threads, at once (a blocked `wait()` wakes with no hop in between), so
//! it must not block: what may (torch's future callbacks wait on further
//! operations, as PowerSGD's do) it hands to `run_blocking`, which runs it
//! on the runtime's pool of blocking threads (grown as needed, so callbacks
//! waiting on each other never run out of threads).

use std::ffi::{CStr, c_char, c_void};
use std::str::FromStr;
use std::time::Duration;

use chorus::{Collective, CollectiveKind, DType, ReduceOp, Tensor};

use crate::group::Group;
use crate::runtime::runtime;
use crate::work::{Class, Failure};

/// Called once with the operation's outcome: `failure` null for success,
/// else why (valid during the call only).
pub(crate) type Done = extern "C" fn(ctx: *mut c_void, failure: *const CFailure);

/// Why an operation failed, as the Python backend would raise it: the
/// exception class of `chorus._errors` (`GroupAborted`, ...), its message
/// and the ranks taken for failed; strings are UTF-8, not NUL-terminated.
#[repr(C)]
pub(crate) struct CFailure {
    class: *const u8,
    class_len: usize,
    message: *const u8,
    message_len: usize,
    ranks: *const usize,
    ranks_len: usize,
}

/// What the C side calls.
#[repr(C)]
pub(crate) struct Api {
    /// Submits collective `kind` (as the Python `Group.submit` names it:
    /// "all_reduce", "broadcast", "all_gather", "reduce_scatter", ...) of
    /// `count` elements of `dtype`, reading `input_bytes` at `input` and
    /// writing `output_bytes` at `output` (either null with 0 bytes where
    /// the kind has none); `op` null and `root` negative where it takes
    /// none; `timeout_s` 0 or less: the group's own. Returns 0, or 1 with
    /// `done` already called with the reason (bad arguments).
    collective: unsafe extern "C" fn(
        group: *const Group,
        kind: *const c_char,
        count: usize,
        dtype: *const c_char,
        input: *const u8,
        input_bytes: usize,
        output: *mut u8,
        output_bytes: usize,
        op: *const c_char,
        root: i64,
        timeout_s: f64,
        done: Done,
        ctx: *mut c_void,
    ) -> i32,
    /// Runs `f(arg)` on a blocking thread; returns 1 (and runs nothing)
    /// when the runtime could not start.
    run_blocking: unsafe extern "C" fn(f: extern "C" fn(arg: *mut c_void), arg: *mut c_void) -> i32,
}

static API: Api = Api {
    collective,
    run_blocking,
};

/// The table's address and the handle of `group`, valid while its Python
/// object lives.
pub(crate) fn export(group: &Group) -> (usize, usize) {
    (&API as *const Api as usize, group as *const Group as usize)
}

fn report(done: Done, ctx: *mut c_void, failure: &Failure) {
    let class = failure.class.name();
    let c = CFailure {
        class: class.as_ptr(),
        class_len: class.len(),
        message: failure.message.as_ptr(),
        message_len: failure.message.len(),
        ranks: failure.ranks.as_ptr(),
        ranks_len: failure.ranks.len(),
    };
    done(ctx, &c);
}

fn fail(done: Done, ctx: *mut c_void, class: Class, message: String) -> i32 {
    report(done, ctx, &Failure::new(class, message));
    1
}

/// # Safety
/// `group` is a handle from [`export`] whose object lives; `kind`, `dtype`
/// and `op` (unless null) are NUL-terminated; `input` and `output` address
/// `input_bytes` readable and `output_bytes` writable bytes that stay
/// valid, and untouched by the caller, until `done` is called.
#[allow(clippy::too_many_arguments)] // a C signature: one flat call
unsafe extern "C" fn collective(
    group: *const Group,
    kind: *const c_char,
    count: usize,
    dtype: *const c_char,
    input: *const u8,
    input_bytes: usize,
    output: *mut u8,
    output_bytes: usize,
    op: *const c_char,
    root: i64,
    timeout_s: f64,
    done: Done,
    ctx: *mut c_void,
) -> i32 {
    // SAFETY: NUL-terminated strings, per the contract.
    let (kind, dtype) = unsafe { (CStr::from_ptr(kind), CStr::from_ptr(dtype)) };
    let Some(kind) = kind.to_str().ok().and_then(|k| CollectiveKind::from_str(k).ok()) else {
        return fail(
            done,
            ctx,
            Class::InvalidArgument,
            format!("no collective named {kind:?}"),
        );
    };
    let name = kind.name();
    let Some(dtype) = dtype.to_str().ok().and_then(|d| DType::from_str(d).ok()) else {
        return fail(
            done,
            ctx,
            Class::InvalidArgument,
            format!("{name}: chorus does not take {dtype:?}"),
        );
    };
    let op = if op.is_null() {
        None
    } else {
        // SAFETY: NUL-terminated, per the contract.
        let op = unsafe { CStr::from_ptr(op) };
        match op.to_str().ok().and_then(|o| ReduceOp::from_str(o).ok()) {
            Some(op) => Some(op),
            None => {
                return fail(
                    done,
                    ctx,
                    Class::InvalidArgument,
                    format!("{name}: no reduction named {op:?}"),
                );
            }
        }
    };
    // SAFETY: the handle's object lives, per the contract.
    let group = unsafe { &*group };
    let root = match usize::try_from(root) {
        Err(_) => None,
        Ok(root) if root < group.world_size() => Some(root),
        Ok(root) => {
            let message = format!(
                "{name} from rank {root}: the group has ranks 0 to {}",
                group.world_size() - 1
            );
            return fail(done, ctx, Class::InvalidArgument, message);
        }
    };
    for (what, ptr, bytes) in [
        ("input", input, input_bytes),
        ("output", output as *const u8, output_bytes),
    ] {
        if !bytes.is_multiple_of(dtype.size())
            || (bytes > 0 && (ptr.is_null() || !(ptr as usize).is_multiple_of(dtype.size())))
        {
            let message = format!("{name}: the {what}'s {bytes} bytes at {ptr:p} are not {dtype} elements");
            return fail(done, ctx, Class::InvalidArgument, message);
        }
    }
    if input_bytes > 0
        && output_bytes > 0
        && (input as usize) < output as usize + output_bytes
        && (output as usize) < input as usize + input_bytes
    {
        let message = format!("{name}: the input and output share memory");
        return fail(done, ctx, Class::InvalidArgument, message);
    }
    let Ok(rt) = runtime() else {
        return fail(
            done,
            ctx,
            Class::Backend,
            "chorus could not start its runtime threads".into(),
        );
    };
    // SAFETY: the caller keeps both regions alive and alone until `done`,
    // which comes after the operation has dropped its buffers; the input
    // is only read.
    let (input, output) = unsafe {
        (
            (input_bytes > 0).then(|| Tensor::from_raw_parts(dtype, input.cast_mut(), input_bytes, Box::new(()))),
            (output_bytes > 0).then(|| Tensor::from_raw_parts(dtype, output, output_bytes, Box::new(()))),
        )
    };
    let collective = Collective {
        kind,
        dtype,
        count,
        root,
        op,
        input: input.map(Tensor::into_shared).unwrap_or_default(),
        output: output.map(Tensor::into_buffer).unwrap_or_default(),
        timeout: (timeout_s > 0.0 && timeout_s.is_finite()).then(|| Duration::from_secs_f64(timeout_s)),
        tag: 0,
    };
    let Some(group) = group.live() else {
        report(done, ctx, &group.destroyed(name));
        return 1;
    };
    let (work, failures) = {
        let _enter = rt.enter();
        (group.submit_tensor(collective), group.failures())
    };
    let ctx = ctx as usize;
    rt.spawn(async move {
        // The operation's buffers are dropped with its result, before `done`.
        let failed = work.await.err().map(|e| Failure::from_collective(&e, &failures));
        let ctx = ctx as *mut c_void;
        match failed {
            None => done(ctx, std::ptr::null()),
            Some(failure) => report(done, ctx, &failure),
        }
    });
    0
}

/// # Safety
/// `arg` may be used by `f` on another thread.
unsafe extern "C" fn run_blocking(f: extern "C" fn(arg: *mut c_void), arg: *mut c_void) -> i32 {
    let Ok(rt) = runtime() else {
        return 1;
    };
    let arg = arg as usize;
    rt.spawn_blocking(move || f(arg as *mut c_void));
    0
}
