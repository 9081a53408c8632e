//! The actor system chorus's rank actors live in: one process-wide actix
//! `System` on a thread of its own, and one `Arbiter` (a thread with a
//! current-thread tokio runtime) per rank of its own process; ranks in one
//! process (`chorus::spawn`) share a few arbiters ([`shared_arbiter`]), so a
//! world of a thousand ranks is not a thousand threads, and one frame pool
//! ([`shared_frame_pool`]).
//!
//! A rank's links are created on its arbiter too: quinn drives a connection
//! on the runtime that made it, and keeping the driver, the actor and the
//! collective on one thread saves a cross-thread wake-up per packet (it
//! tripled the QUIC round trip when measured).

use std::sync::OnceLock;

use std::sync::Mutex;

use actix_rt::{Arbiter, ArbiterHandle, System};
use thiserror::Error;

use crate::driver::FramePool;

/// The actor system could not be started.
#[derive(Debug, Error, Clone)]
#[error("could not start the actor system: {0}")]
pub struct SystemError(String);

impl SystemError {
    /// An error saying `reason`.
    pub fn new(reason: impl Into<String>) -> Self {
        Self(reason.into())
    }
}

static SYSTEM: OnceLock<Result<System, SystemError>> = OnceLock::new();

fn system() -> Result<System, SystemError> {
    SYSTEM
        .get_or_init(|| {
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::Builder::new()
                .name("chorus-actor-system".into())
                .spawn(move || {
                    let runner = actix_rt::System::new();
                    let _ = tx.send(System::current());
                    // Runs for the life of the process.
                    let _ = runner.run();
                })
                .map_err(|e| SystemError(e.to_string()))?;
            rx.recv().map_err(|e| SystemError(e.to_string()))
        })
        .clone()
}

/// A new arbiter (thread and current-thread runtime) for one rank. Made
/// from the system's own thread, so the caller's thread (which may run an
/// actix system of its own) is left alone.
pub fn new_arbiter() -> Result<Arbiter, SystemError> {
    let system = system()?;
    let (tx, rx) = std::sync::mpsc::channel();
    let spawned = system.arbiter().spawn_fn(move || {
        let _ = tx.send(Arbiter::try_new().map_err(|e| SystemError(e.to_string())));
    });
    if !spawned {
        return Err(SystemError("the actor system has stopped".into()));
    }
    rx.recv().map_err(|e| SystemError(e.to_string()))?
}

/// The frame pool ranks sharing the process's arbiters share: one
/// [`FramePool`] bound (16 MiB) for the process instead of one per rank,
/// which a thousand ranks' 1 MiB all-reduces would each fill.
pub fn shared_frame_pool() -> FramePool {
    static POOL: OnceLock<FramePool> = OnceLock::new();
    POOL.get_or_init(FramePool::default).clone()
}

/// The arbiters ranks in one process share, made as needed.
static SHARED: Mutex<Vec<Arbiter>> = Mutex::new(Vec::new());

/// How many arbiters ranks in one process share: one per core.
pub fn shared_arbiters() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get())
}

/// The shared arbiter for `rank` of `world` ranks in this process: ranks
/// in contiguous blocks, one per arbiter, so the partners of a recursive
/// doubling's early rounds and a ring's neighbours share a thread. It runs
/// for the life of the process, so a rank's group must stop its own tasks
/// rather than the arbiter.
pub fn shared_arbiter(rank: usize, world: usize) -> Result<ArbiterHandle, SystemError> {
    let slot = rank * shared_arbiters() / world.max(rank + 1);
    let mut shared = SHARED.lock().unwrap_or_else(|p| p.into_inner());
    while shared.len() <= slot {
        shared.push(new_arbiter()?);
    }
    Ok(shared[slot].handle())
}
