//! [`TrainState`]: everything a joiner needs to take a survivor's place,
//! visited in one order on every rank, so that it can be compared,
//! checksummed and moved chunk by chunk without serializing tensors.

use chorus_runtime::collective::DType;

use crate::sync::{ParamBuffer, Parameters};

/// The state of a training job that survivors hand to joiners: the
/// model's [`Parameters`] (parameters, then buffers), then the optimizer's
/// state, then small extras as bytes. Every rank visits the same entries,
/// in the same order, with the same sizes.
pub trait TrainState: Parameters + Send {
    /// Calls `visit` with each optimizer tensor (moments, momentum
    /// buffers), in a fixed order. None by default (plain SGD).
    fn visit_optimizer(&mut self, _visit: &mut dyn FnMut(&str, &mut dyn ParamBuffer)) {}
    /// The small rest as bytes: data-loader position, RNG state,
    /// scheduler counters. Empty by default.
    fn save_extra(&self) -> Vec<u8> {
        Vec::new()
    }
    /// Takes a survivor's [`save_extra`](Self::save_extra) bytes.
    fn load_extra(&mut self, _bytes: &[u8]) -> Result<(), String> {
        Ok(())
    }
    /// Whether other rank processes of this host may write the state
    /// transfer's chunks straight into this state's buffers (cross-memory
    /// attach, through [`ParamBuffer::as_bytes_mut`]): only with the
    /// promise an [`InPlace`] is. `None` (the default): the chunks come
    /// over the link and this process writes them itself.
    fn buffers_in_place(&self) -> Option<InPlace> {
        None
    }
}

/// A promise, made in `unsafe` code, that the buffers a [`TrainState`]'s
/// visits hand out are its own memory and stay where they are
/// ([`TrainState::buffers_in_place`]). Safe code cannot make one, because
/// breaking the promise lets another process write into freed memory.
#[derive(Debug, Clone, Copy)]
pub struct InPlace(());

impl InPlace {
    /// The promise.
    ///
    /// # Safety
    /// Every buffer the state's visits hand out whose
    /// [`ParamBuffer::as_bytes_mut`] is `Some` must be memory the state
    /// owns (not a buffer built for one visit, like a copy of a device
    /// tensor written back after), allocated where it is for as long as the
    /// state lives and not resized or replaced while a state transfer runs:
    /// other processes write into it between visits, and a source that
    /// stalled between its last check and its write (stopped by a signal)
    /// may still write one chunk of the same step after the transfer
    /// returned an error.
    pub unsafe fn promise() -> Self {
        InPlace(())
    }
}

/// One entry of a [`TrainState`], as [`entries`] lists them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateEntry {
    /// Its name (parameter, buffer or optimizer tensor).
    pub name: String,
    /// Its element type.
    pub dtype: DType,
    /// Its number of elements.
    pub len: usize,
}

impl StateEntry {
    /// Its size in bytes.
    pub fn bytes(&self) -> usize {
        self.len * self.dtype.size()
    }
}

/// Calls `f(index, name, buffer)` for every tensor of `state`: parameters,
/// buffers, then optimizer state.
pub fn for_each_entry(state: &mut dyn TrainState, mut f: impl FnMut(usize, &str, &mut dyn ParamBuffer)) {
    let mut index = 0;
    let mut visit = |name: &str, buffer: &mut dyn ParamBuffer| {
        f(index, name, buffer);
        index += 1;
    };
    state.visit_parameters(&mut visit);
    state.visit_buffers(&mut visit);
    state.visit_optimizer(&mut visit);
}

/// The tensors of `state`, in [`for_each_entry`]'s order.
pub fn entries(state: &mut dyn TrainState) -> Vec<StateEntry> {
    let mut all = Vec::new();
    for_each_entry(state, |_, name, buffer| {
        all.push(StateEntry {
            name: name.to_owned(),
            dtype: buffer.dtype(),
            len: buffer.len(),
        })
    });
    all
}

/// A ready [`TrainState`] over named `f32` vectors: build it from your
/// model's tensors, train on it, and copy back what changed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NamedState {
    /// Trainable parameters, in registration order.
    pub params: Vec<(String, Vec<f32>)>,
    /// Buffers without gradients that must match across ranks.
    pub buffers: Vec<(String, Vec<f32>)>,
    /// Optimizer state.
    pub optimizer: Vec<(String, Vec<f32>)>,
    /// Small extras (data position, RNG state), opaque to chorus.
    pub extra: Vec<u8>,
}

fn visit_all(list: &mut [(String, Vec<f32>)], visit: &mut dyn FnMut(&str, &mut dyn ParamBuffer)) {
    for (name, values) in list.iter_mut() {
        visit(name, values);
    }
}

impl Parameters for NamedState {
    fn visit_parameters(&mut self, visit: &mut dyn FnMut(&str, &mut dyn ParamBuffer)) {
        visit_all(&mut self.params, visit)
    }
    fn visit_buffers(&mut self, visit: &mut dyn FnMut(&str, &mut dyn ParamBuffer)) {
        visit_all(&mut self.buffers, visit)
    }
}

impl TrainState for NamedState {
    fn visit_optimizer(&mut self, visit: &mut dyn FnMut(&str, &mut dyn ParamBuffer)) {
        visit_all(&mut self.optimizer, visit)
    }
    fn save_extra(&self) -> Vec<u8> {
        self.extra.clone()
    }
    fn load_extra(&mut self, bytes: &[u8]) -> Result<(), String> {
        self.extra = bytes.to_vec();
        Ok(())
    }
    fn buffers_in_place(&self) -> Option<InPlace> {
        // SAFETY: it visits its own `Vec`s, which only a `&mut` to the
        // state could resize, and a state transfer holds that borrow.
        Some(unsafe { InPlace::promise() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_list_parameters_then_buffers_then_optimizer_state() {
        let mut state = NamedState {
            params: vec![("w".into(), vec![0.0; 3]), ("b".into(), vec![0.0; 1])],
            buffers: vec![("mean".into(), vec![0.0; 2])],
            optimizer: vec![("w.momentum".into(), vec![0.0; 3])],
            extra: vec![7],
        };
        let names: Vec<(String, usize)> = entries(&mut state).into_iter().map(|e| (e.name, e.len)).collect();
        assert_eq!(
            names,
            [("w", 3), ("b", 1), ("mean", 2), ("w.momentum", 3)].map(|(n, l)| (n.to_owned(), l))
        );
        assert_eq!(entries(&mut state)[0].bytes(), 12);
        let mut other = NamedState::default();
        other.load_extra(&state.save_extra()).unwrap();
        assert_eq!(other.extra, [7]);
    }
}
