//! Commit records, opt-in: with `CHORUS_TRAIN_RECORD=DIR` in its
//! environment, every process running [`train`](super::train) or a
//! [`Stepper`](super::Stepper) appends one JSON line per committed step to
//! `DIR/<pid>.jsonl` ([`CommitRecord`]), written as the step commits (a
//! stepper's once its caller applied the update, see
//! [`Stepper::record`](super::Stepper::record)), so a process killed a
//! moment later has already left its record. `chorus chaos` reads them to
//! check a run (one sequence of generations, equal parameters on every
//! member, every step applied once); any program training through
//! [`train`](super::train) gets them without a change, and a Python job's
//! `chorus.torch.Manager` writes them too.
//!
//! Recording never fails training: a directory that cannot be written is
//! reported once in the log, and the run goes on unrecorded.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::sync::Parameters;

/// The environment variable naming the directory of the records.
pub const RECORD_ENV: &str = "CHORUS_TRAIN_RECORD";

/// One committed step, as one member saw it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CommitRecord {
    /// The process that wrote it.
    pub pid: u32,
    /// The generation the step committed in.
    pub generation: u64,
    /// This member's rank in it.
    pub rank: usize,
    /// Members of that generation.
    pub world_size: usize,
    /// The committed step (from 0).
    pub step: u64,
    /// Mean loss over the step's global batch; `None` when the program
    /// did not report one (a Python loop that never called
    /// `Manager.report_loss`).
    pub loss: Option<f64>,
    /// xxh3 of the parameters' bytes after the update, in visit order;
    /// `None` in the local modes, where members' parameters differ between
    /// outer syncs.
    pub checksum: Option<u64>,
    /// Updates this process applied so far, this step's included.
    pub applied: u64,
    /// Steps this process took over in received state so far: `applied +
    /// adopted == step + 1` when none was applied twice or skipped.
    pub adopted: u64,
    /// When the step committed here, microseconds since the Unix epoch.
    pub at_us: i64,
    /// Corruptions this process injected so far (fault injection).
    #[serde(default)]
    pub corruptions_injected: u64,
    /// Corruptions this process's checks found so far.
    #[serde(default)]
    pub corruptions_detected: u64,
    /// Steps between two state checks, as last agreed; `None` where the
    /// state is not checked.
    #[serde(default)]
    pub check_interval: Option<u64>,
}

/// Appends this process's records (see the module docs).
#[derive(Debug)]
pub(crate) struct Recorder {
    file: std::fs::File,
    path: PathBuf,
    failed: bool,
}

impl Recorder {
    /// The recorder `CHORUS_TRAIN_RECORD` asks for, if it is set.
    pub(crate) fn from_env() -> Option<Self> {
        let dir = PathBuf::from(std::env::var_os(RECORD_ENV)?);
        Self::open(&dir)
    }

    fn open(dir: &Path) -> Option<Self> {
        let path = dir.join(format!("{}.jsonl", std::process::id()));
        let opened = std::fs::create_dir_all(dir)
            .and_then(|()| std::fs::OpenOptions::new().create(true).append(true).open(&path));
        match opened {
            Ok(file) => Some(Self {
                file,
                path,
                failed: false,
            }),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "{RECORD_ENV}: not recording the committed steps");
                None
            }
        }
    }

    /// Appends `record` as one line, in one write.
    pub(crate) fn write(&mut self, record: &CommitRecord) {
        let mut line = serde_json::to_vec(record).expect("a record serializes");
        line.push(b'\n');
        if let Err(e) = self.file.write_all(&line)
            && !std::mem::replace(&mut self.failed, true)
        {
            tracing::warn!(path = %self.path.display(), error = %e, "{RECORD_ENV}: a record was not written");
        }
    }
}

/// xxh3 of the parameters' bytes, in visit order (every dtype as stored):
/// what a [`CommitRecord`]'s `checksum` holds.
pub fn checksum(params: &mut dyn Parameters) -> u64 {
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let mut scratch = Vec::new();
    params.visit_parameters(&mut |_, buffer| match buffer.as_bytes() {
        Some(bytes) => hasher.update(bytes),
        None => {
            scratch.resize(buffer.len() * buffer.dtype().size(), 0u8);
            buffer.read_bytes(0, &mut scratch);
            hasher.update(&scratch);
        }
    });
    hasher.digest()
}

/// Microseconds since the Unix epoch.
pub fn unix_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::NamedState;

    #[test]
    fn records_append_one_line_each_and_read_back() {
        let dir = std::env::temp_dir().join(format!("chorus-record-test-{}", std::process::id()));
        let mut recorder = Recorder::open(&dir).expect("a writable directory");
        let mut record = CommitRecord {
            pid: std::process::id(),
            generation: 2,
            rank: 1,
            world_size: 3,
            step: 7,
            loss: Some(0.5),
            checksum: Some(u64::MAX),
            applied: 5,
            adopted: 3,
            at_us: unix_us(),
            corruptions_injected: 0,
            corruptions_detected: 1,
            check_interval: Some(12),
        };
        recorder.write(&record);
        record.step = 8;
        record.checksum = None;
        record.loss = None;
        recorder.write(&record);
        let text = std::fs::read_to_string(dir.join(format!("{}.jsonl", std::process::id()))).unwrap();
        let back: Vec<CommitRecord> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(back.len(), 2);
        assert_eq!((back[0].step, back[0].checksum), (7, Some(u64::MAX)));
        assert_eq!(back[1], record);
    }

    #[test]
    fn the_checksum_follows_every_parameter_byte() {
        let mut state = NamedState {
            params: vec![("a".into(), vec![1.0, 2.0]), ("b".into(), vec![3.0])],
            ..NamedState::default()
        };
        let before = checksum(&mut state);
        assert_eq!(before, checksum(&mut state.clone()));
        state.params[1].1[0] = f32::from_bits(3.0f32.to_bits() ^ 1);
        assert_ne!(before, checksum(&mut state));
    }
}
