//! `chorus._chorus`: the extension module of the `chorus` Python package, a
//! thin binding of the chorus library. The package's Python half
//! (`python/chorus/`) maps `torch.distributed`'s calls onto it; everything
//! that moves bytes, supervises or recovers stays in the Rust library.
//!
//! # Layout
//! - `group`: `Group`, one rank's process group: forming it through a
//!   torch store, submitting collectives over tensors lent in place,
//!   destroying it.
//! - `work`: `Work`, an operation in flight: wait with a timeout, poll,
//!   done-callbacks (what torch's futures hang on), errors raised as the
//!   package's exception classes.
//! - `store`: chorus's `Store` over a `torch.distributed.Store` object,
//!   so ranks meet through whatever store torch made (TCP, file, hash,
//!   prefixed).
//! - `manager`: `Trainer`, one member of an elastic training job over a
//!   torch model and optimizer whose tensors are the state, read and
//!   written in place: per-step commit in the user's loop (`begin_step`,
//!   `commit_step`, a `Stepper`) or chorus's own loop (`train`).
//! - `capi`: a C entry point into a group's all-reduce, for a
//!   `c10d::Backend` written in C++ over the library.
//! - `runtime`: the process's tokio runtime, which drives every
//!   operation's completion.

mod capi;
mod group;
mod manager;
mod runtime;
mod store;
mod work;

use pyo3::prelude::*;

/// The extension module.
#[pymodule]
fn _chorus(m: &Bound<'_, PyModule>) -> PyResult<()> {
    install_logging();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<group::Group>()?;
    m.add_class::<work::Work>()?;
    m.add_class::<manager::Trainer>()?;
    Ok(())
}

/// The library's log lines on stderr, filtered by `CHORUS_LOG` as the
/// `chorus` command's are (by default warnings and the notes of long
/// waits), so that a worker's log says why a group aborted. Left alone
/// when the process already has a subscriber (another extension's).
fn install_logging() {
    use tracing_subscriber::EnvFilter;
    let filter =
        EnvFilter::try_from_env("CHORUS_LOG").unwrap_or_else(|_| EnvFilter::new(chorus::wait::default_log_filter()));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
}
