//! Elastic training that never rolls back (parameter sync, part 2): the
//! state a job keeps in sync, handed from survivors to joiners over the
//! mesh, and steps that count only when every member's sync succeeded.
//!
//! # Layout
//! - [`state`]: [`TrainState`], what a job exposes to be kept in sync
//!   (parameters, buffers, optimizer state, small extras such as the data
//!   position and RNG), and [`NamedState`], a ready implementation over
//!   named `f32` vectors.
//! - [`transfer`]: [`sync_state`], live state transfer from the most
//!   advanced members to those behind (chunked, striped over every source,
//!   checksummed, damaged chunks fetched again), [`verify_state`], and
//!   [`sync_verified`], both in one call;
//!   [`transfer_plan`]: its decisions, sans IO.
//! - [`integrity`]: silent data corruption, sans IO: whose state or
//!   gradient disagrees with the others', how often to check, and the bit
//!   flips a `corrupt` fault asks for.
//! - [`outer`]: local SGD's and DiLoCo's outer step, sans IO.
//! - [`trainer`]: [`train`], the loop with per-step commit and recovery.
//! - [`stepper`]: [`Stepper`], the same per-step commit and recovery for a
//!   loop the caller runs (a torch script's own).
//! - [`record`]: opt-in commit records (`CHORUS_TRAIN_RECORD`), one JSON
//!   line per committed step and member, which `chorus chaos` checks.
//! - [`live`]: each process's live progress in the job's store (recent
//!   steps, recoveries with their phases, aborts) and the faults a
//!   dashboard asks it for, with the job secret; [`observe`]: all of it
//!   read back by an outside watcher (a dashboard, `chorus chaos`), and
//!   fault requests written.

mod cma;
mod guard;
pub mod integrity;
pub mod live;
pub mod observe;
pub mod outer;
pub mod record;
pub mod state;
pub mod stepper;
pub mod trainer;
pub mod transfer;
pub mod transfer_plan;

pub use integrity::{Cadence, IntegrityOptions, StateCorruption, StateTarget};
pub use record::{CommitRecord, RECORD_ENV, checksum};
pub use state::{InPlace, NamedState, StateEntry, TrainState, entries, for_each_entry};
pub use stepper::{Begin, Begun, Stepper, StepperOptions};
pub use trainer::{Committed, Job, Mode, Recovery, Step, TrainError, TrainOptions, TrainReport, train};
pub use transfer::{TransferError, TransferOptions, TransferReport, sync_state, sync_verified, verify_state};
