//! `Work`: an operation in flight, as torch's `Work` needs it: a blocking
//! wait with a timeout (the GIL released), a poll, the error, and
//! done-callbacks, which the Python side turns into a `torch.futures.Future`
//! (DDP's reducer and comm hooks chain on it).

use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use chorus::{CollectiveError, GroupAborted};
use pyo3::prelude::*;
use tokio::sync::watch;

/// Which of the package's exception classes (`chorus._errors`) a failure
/// raises.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Class {
    /// The group aborted: a rank died, froze or was cut off, or an
    /// operation broke it.
    GroupAborted,
    /// Ranks called different collectives.
    Desync,
    /// The operation ran past its deadline.
    Timeout,
    /// The arguments are wrong (sizes, dtype and operator, root).
    InvalidArgument,
    /// `wait(timeout)` returned before the operation finished.
    WaitTimeout,
    /// The elastic job finished before this process could join it.
    JobFinished,
    /// Anything else the backend reports.
    Backend,
}

impl Class {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Class::GroupAborted => "GroupAborted",
            Class::Desync => "DesyncError",
            Class::Timeout => "CollectiveTimeout",
            Class::InvalidArgument => "InvalidArgument",
            Class::WaitTimeout => "WaitTimeout",
            Class::JobFinished => "JobFinished",
            Class::Backend => "ChorusError",
        }
    }
}

/// Why an operation failed, kept as plain data so every waiter can raise
/// its own exception.
#[derive(Debug, Clone)]
pub(crate) struct Failure {
    pub(crate) class: Class,
    pub(crate) message: String,
    /// The ranks taken for failed (dead, frozen, cut off), when known.
    pub(crate) ranks: Vec<usize>,
}

impl Failure {
    pub(crate) fn new(class: Class, message: impl Into<String>) -> Self {
        Self {
            class,
            message: message.into(),
            ranks: Vec::new(),
        }
    }

    fn aborted(aborted: &GroupAborted) -> Self {
        Self {
            class: Class::GroupAborted,
            message: chorus::error_report(aborted),
            ranks: aborted.failed_ranks.clone(),
        }
    }

    /// `error` as a failure; `failures` is the group's abort notice, which
    /// names the failed ranks where the error itself only says the group
    /// is broken.
    pub(crate) fn from_collective(error: &CollectiveError, failures: &watch::Receiver<Option<GroupAborted>>) -> Self {
        match error {
            CollectiveError::GroupAborted(aborted) => Self::aborted(aborted),
            CollectiveError::Broken(_) | CollectiveError::Transport(_) => match failures.borrow().as_ref() {
                Some(aborted) => Self::aborted(aborted),
                None if matches!(error, CollectiveError::Broken(_)) => {
                    Self::new(Class::GroupAborted, chorus::error_report(error))
                }
                None => Self::new(Class::Backend, chorus::error_report(error)),
            },
            CollectiveError::Desync { .. } => Self::new(Class::Desync, chorus::error_report(error)),
            CollectiveError::Timeout { waiting_for, .. } => Self {
                ranks: waiting_for.clone(),
                ..Self::new(Class::Timeout, chorus::error_report(error))
            },
            CollectiveError::BufferSize { .. } | CollectiveError::Plan(_) | CollectiveError::Reduce(_) => {
                Self::new(Class::InvalidArgument, chorus::error_report(error))
            }
            _ => Self::new(Class::Backend, chorus::error_report(error)),
        }
    }

    /// The exception to raise.
    pub(crate) fn to_err(&self, py: Python<'_>) -> PyErr {
        let made = (|| -> PyResult<PyErr> {
            let class = py.import("chorus._errors")?.getattr(self.class.name())?;
            let exception = class.call1((self.message.clone(),))?;
            exception.setattr("ranks", self.ranks.clone())?;
            Ok(PyErr::from_value(exception))
        })();
        made.unwrap_or_else(|e| e)
    }
}

enum Outcome {
    Pending(Vec<Py<PyAny>>),
    Done(Result<(), Failure>),
}

/// Shared between the `Work` object and the task that completes it.
pub(crate) struct State {
    outcome: Mutex<Outcome>,
    done: Condvar,
    /// The rank a receive took its message from, once it has.
    source: OnceLock<usize>,
}

impl State {
    fn lock(&self) -> std::sync::MutexGuard<'_, Outcome> {
        self.outcome.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records the rank a receive took its message from, before its
    /// completion.
    pub(crate) fn received_from(&self, rank: usize) {
        let _ = self.source.set(rank);
    }

    /// Records the result, wakes the waiters and runs the callbacks (on a
    /// blocking thread: they take the GIL).
    pub(crate) fn complete(&self, result: Result<(), Failure>) {
        let callbacks = match std::mem::replace(&mut *self.lock(), Outcome::Done(result)) {
            Outcome::Pending(callbacks) => callbacks,
            Outcome::Done(_) => Vec::new(),
        };
        self.done.notify_all();
        if !callbacks.is_empty() {
            tokio::task::spawn_blocking(move || Python::attach(|py| run_callbacks(py, callbacks)));
        }
    }
}

fn run_callbacks(py: Python<'_>, callbacks: Vec<Py<PyAny>>) {
    for callback in callbacks {
        if let Err(e) = callback.call0(py) {
            e.write_unraisable(py, Some(callback.bind(py)));
        }
    }
}

/// An operation in flight (or finished).
#[pyclass(module = "chorus._chorus", frozen)]
pub(crate) struct Work {
    state: Arc<State>,
}

impl Work {
    /// A pending work and the state its completion goes to.
    pub(crate) fn pending() -> (Self, Arc<State>) {
        let state = Arc::new(State {
            outcome: Mutex::new(Outcome::Pending(Vec::new())),
            done: Condvar::new(),
            source: OnceLock::new(),
        });
        (Self { state: state.clone() }, state)
    }
}

#[pymethods]
impl Work {
    /// Blocks until the operation ends, at most `timeout` seconds (`None`:
    /// its own deadline); returns True, or raises its error, or
    /// `chorus.WaitTimeout` when `timeout` passes first (the operation goes
    /// on, under its own deadline).
    #[pyo3(signature = (timeout = None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let limit = match timeout {
            Some(t) if !(t >= 0.0 && t.is_finite()) => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "wait(timeout={t}): the timeout must be a finite number of seconds, 0 or more"
                )));
            }
            Some(t) => Some(Duration::from_secs_f64(t)),
            None => None,
        };
        let state = self.state.clone();
        let result = py.detach(move || {
            let deadline = limit.map(|l| Instant::now() + l);
            let mut outcome = state.lock();
            loop {
                if let Outcome::Done(result) = &*outcome {
                    return Some(result.clone());
                }
                outcome = match deadline {
                    None => state.done.wait(outcome).unwrap_or_else(|p| p.into_inner()),
                    Some(deadline) => {
                        let left = deadline.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            return None;
                        }
                        state
                            .done
                            .wait_timeout(outcome, left)
                            .unwrap_or_else(|p| p.into_inner())
                            .0
                    }
                };
            }
        });
        match result {
            Some(Ok(())) => Ok(true),
            Some(Err(failure)) => Err(failure.to_err(py)),
            None => Err(Failure::new(
                Class::WaitTimeout,
                format!(
                    "work not finished within {:?}; it goes on under its own deadline",
                    limit.unwrap_or_default()
                ),
            )
            .to_err(py)),
        }
    }

    /// The rank a receive took its message from (None until it has, and
    /// for other operations).
    #[getter]
    fn source(&self) -> Option<usize> {
        self.state.source.get().copied()
    }

    /// Whether the operation has ended (successfully or not).
    fn is_completed(&self) -> bool {
        matches!(*self.state.lock(), Outcome::Done(_))
    }

    /// Whether it ended successfully.
    fn is_success(&self) -> bool {
        matches!(*self.state.lock(), Outcome::Done(Ok(())))
    }

    /// The exception it failed with, or None (also while it runs).
    fn exception(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        match &*self.state.lock() {
            Outcome::Done(Err(failure)) => Some(failure.to_err(py).into_value(py).into_any()),
            _ => None,
        }
    }

    /// Calls `callback()` once the operation has ended: at once if it has,
    /// else from one of chorus's threads (holding the GIL). Exceptions it
    /// raises are reported as unraisable.
    fn add_done_callback(&self, py: Python<'_>, callback: Py<PyAny>) {
        let run_now = {
            let mut outcome = self.state.lock();
            match &mut *outcome {
                Outcome::Pending(callbacks) => {
                    callbacks.push(callback);
                    None
                }
                Outcome::Done(_) => Some(callback),
            }
        };
        if let Some(callback) = run_now {
            run_callbacks(py, vec![callback]);
        }
    }
}
