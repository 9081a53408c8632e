//! Elastic training that never rolls back (parameter sync, part 2): the
//! state a job keeps in sync, handed from survivors to joiners over the
//! mesh, and steps that count only when every member's sync succeeded.
//!
//! # Layout
//! - [`state`]: [`TrainState`], what a job exposes to be kept in sync
//!   (parameters, buffers, optimizer state, small extras such as the data
//!   position and RNG), and [`NamedState`], a ready implementation over
//!   named `f32` vectors.

pub mod state;

pub use state::{NamedState, StateEntry, TrainState, entries, for_each_entry};
