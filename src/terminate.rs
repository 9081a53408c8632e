//! SIGTERM with a trace directory set: every live group of the process
//! dumps its flight recorder, then the process exits (status 143).
//!
//! `chorus launch` (like torchrun) stops the surviving workers with SIGTERM
//! once one fails; without this, a survivor that had not yet noticed the
//! failure died without a dump, and `chorus trace` took it for a suspect.
//! The handler is installed when the first group with a trace directory
//! (`CHORUS_TRACE_DIR`) forms; from then on SIGTERM aborts every live group
//! ("terminated by SIGTERM"), waits up to [`DUMP_GRACE`] for their dumps
//! and exits.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use actix::Addr;
use chorus_actors::rank::{Aborted, RankActor};
use chorus_actors::supervision::{AbortReason, Supervision};
use chorus_actors::system::SystemError;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

/// How long a process stopped by SIGTERM waits for its groups' dumps.
pub(crate) const DUMP_GRACE: Duration = Duration::from_secs(5);

/// A group that dumps on SIGTERM.
struct Live {
    id: u64,
    supervision: Arc<Supervision>,
    actor: Addr<RankActor>,
    dumped: watch::Receiver<bool>,
}

static LIVE: Mutex<Vec<Live>> = Mutex::new(Vec::new());
static NEXT_ID: AtomicU64 = AtomicU64::new(0);
static HANDLER: OnceLock<Result<(), SystemError>> = OnceLock::new();

/// A group's place among those that dump on SIGTERM; dropping it (with the
/// group) takes it out.
#[derive(Debug)]
pub(crate) struct Registration(u64);

impl Drop for Registration {
    fn drop(&mut self) {
        LIVE.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|live| live.id != self.0);
    }
}

/// Has the group of `supervision` and `actor` dump on SIGTERM; `dumped`
/// turns true once the actor dumped (`RankActor::with_dump_notice`).
pub(crate) fn register(
    supervision: Arc<Supervision>,
    actor: Addr<RankActor>,
    dumped: watch::Receiver<bool>,
) -> Result<Registration, SystemError> {
    HANDLER.get_or_init(install).clone()?;
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    LIVE.lock().unwrap_or_else(PoisonError::into_inner).push(Live {
        id,
        supervision,
        actor,
        dumped,
    });
    Ok(Registration(id))
}

/// Starts the thread that waits for SIGTERM; returns once it listens.
fn install() -> Result<(), SystemError> {
    let failed = |what: &str, e: &dyn std::fmt::Display| SystemError::new(format!("{what} for SIGTERM: {e}"));
    let (ready, listening) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("chorus-sigterm".into())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(runtime) => runtime,
                Err(e) => return drop(ready.send(Err(failed("could not start a runtime", &e)))),
            };
            runtime.block_on(async move {
                let mut term = match signal(SignalKind::terminate()) {
                    Ok(term) => term,
                    Err(e) => return drop(ready.send(Err(failed("could not install a handler", &e)))),
                };
                let _ = ready.send(Ok(()));
                term.recv().await;
                dump_all().await;
                std::process::exit(128 + libc::SIGTERM);
            });
        })
        .map_err(|e| failed("could not start a thread", &e))?;
    listening
        .recv()
        .unwrap_or_else(|_| Err(SystemError::new("the SIGTERM thread ended")))
}

/// Aborts every live group and waits (up to [`DUMP_GRACE`]) for their dumps.
async fn dump_all() {
    let live: Vec<(Arc<Supervision>, Addr<RankActor>, watch::Receiver<bool>)> = LIVE
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .iter()
        .map(|l| (l.supervision.clone(), l.actor.clone(), l.dumped.clone()))
        .collect();
    for (supervision, actor, _) in &live {
        supervision.abort(AbortReason::OperationFailed("terminated by SIGTERM".into()), Vec::new());
        // An idle actor learns of the abort from this; a busy one from its operation failing.
        actor.do_send(Aborted);
    }
    let all_dumped = async {
        for (_, _, mut dumped) in live {
            let _ = dumped.wait_for(|done| *done).await;
        }
    };
    if tokio::time::timeout(DUMP_GRACE, all_dumped).await.is_err() {
        eprintln!("chorus: SIGTERM: a flight recorder did not dump within {DUMP_GRACE:?}; exiting");
    }
}
