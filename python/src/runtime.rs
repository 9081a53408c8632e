//! The process's tokio runtime: it forms groups and awaits every
//! operation's completion (the ranks' own threads run the collectives).

use std::sync::OnceLock;

use pyo3::PyResult;
use pyo3::exceptions::PyRuntimeError;
use tokio::runtime::Runtime;

/// The runtime, started on first use; two worker threads suffice, since
/// they only await completions and run rendezvous.
pub(crate) fn runtime() -> PyResult<&'static Runtime> {
    static RUNTIME: OnceLock<Result<Runtime, String>> = OnceLock::new();
    RUNTIME
        .get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name("chorus-py")
                .enable_all()
                .build()
                .map_err(|e| format!("chorus could not start its runtime threads: {e}"))
        })
        .as_ref()
        .map_err(|e| PyRuntimeError::new_err(e.clone()))
}
