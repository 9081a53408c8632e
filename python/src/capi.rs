//! A C entry point into a group's all-reduce, for a `c10d::Backend`
//! written in C++ over this library: torch's dispatcher then calls
//! compiled code all the way to the ranks, with no Python step.
//! `python/bench/cpp_backend.cpp` is such a backend; `python/bench/
//! dispatch.py` and `torch_backend.py --cpp` measure it against the
//! package's Python one.
//!
//! The C side gets the table below and a handle to the package's `Group`
//! object, which it keeps alive by holding that Python object (so a
//! destroyed group stays destroyed for it too), and calls `all_reduce`
//! with a contiguous CPU tensor's memory, which it must keep alive and
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
    /// Submits an all-reduce of `bytes` bytes at `ptr`, in place; returns 0,
    /// or 1 with `done` already called with the reason (bad arguments).
    /// `timeout_s` 0 or less: the group's own.
    all_reduce: unsafe extern "C" fn(
        group: *const Group,
        ptr: *mut u8,
        bytes: usize,
        dtype: *const c_char,
        op: *const c_char,
        timeout_s: f64,
        done: Done,
        ctx: *mut c_void,
    ) -> i32,
    /// Runs `f(arg)` on a blocking thread; returns 1 (and runs nothing)
    /// when the runtime could not start.
    run_blocking: unsafe extern "C" fn(f: extern "C" fn(arg: *mut c_void), arg: *mut c_void) -> i32,
}

static API: Api = Api {
    all_reduce,
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
/// `group` is a handle from [`export`] whose object lives; `dtype` and `op` are
/// NUL-terminated; `ptr` addresses `bytes` writable bytes that stay valid,
/// and untouched by the caller, until `done` is called.
unsafe extern "C" fn all_reduce(
    group: *const Group,
    ptr: *mut u8,
    bytes: usize,
    dtype: *const c_char,
    op: *const c_char,
    timeout_s: f64,
    done: Done,
    ctx: *mut c_void,
) -> i32 {
    // SAFETY: NUL-terminated strings, per the contract.
    let (dtype, op) = unsafe { (CStr::from_ptr(dtype), CStr::from_ptr(op)) };
    let Some(dtype) = dtype.to_str().ok().and_then(|d| DType::from_str(d).ok()) else {
        return fail(
            done,
            ctx,
            Class::InvalidArgument,
            format!("all_reduce: chorus does not reduce {dtype:?}"),
        );
    };
    let Some(op) = op.to_str().ok().and_then(|o| ReduceOp::from_str(o).ok()) else {
        return fail(
            done,
            ctx,
            Class::InvalidArgument,
            format!("all_reduce: no reduction named {op:?}"),
        );
    };
    if !bytes.is_multiple_of(dtype.size()) || (bytes > 0 && !(ptr as usize).is_multiple_of(dtype.size())) {
        let message = format!("all_reduce: {bytes} bytes at {ptr:p} are not {dtype} elements");
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
    // SAFETY: the caller keeps the memory alive and alone until `done`,
    // which comes after the operation has dropped its buffer.
    let tensor = unsafe { Tensor::from_raw_parts(dtype, ptr, bytes, Box::new(())) };
    let collective = Collective {
        kind: CollectiveKind::AllReduce,
        dtype,
        count: bytes / dtype.size(),
        root: None,
        op: Some(op),
        input: Default::default(),
        output: tensor.into_buffer(),
        timeout: (timeout_s > 0.0 && timeout_s.is_finite()).then(|| Duration::from_secs_f64(timeout_s)),
        tag: 0,
    };
    // SAFETY: the handle's object lives, per the contract.
    let group = unsafe { &*group };
    let Some(group) = group.live() else {
        report(done, ctx, &group.destroyed("all_reduce"));
        return 1;
    };
    let (work, failures) = {
        let _enter = rt.enter();
        (group.submit_tensor(collective), group.failures())
    };
    let ctx = ctx as usize;
    rt.spawn(async move {
        // The operation's buffer is dropped with its result, before `done`.
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
