//! The error file a launcher reads (`TORCHELASTIC_ERROR_FILE`, as torchrun
//! sets it): a rank process whose group aborts on a failure writes why, and
//! which peers it took for failed, before any operation fails on it.
//!
//! A launcher learns a worker failed when its process exits, and the first
//! to exit is often a healthy rank that found a peer frozen or dead: the
//! file lets `chorus launch` blame the peer (by its process id) as the
//! workers and `chorus trace` do. The format is torchelastic's (`message`:
//! `message`, `extraInfo.timestamp`), which torchrun reads too, plus
//! `chorus.failed`, the peers blamed.

use std::path::{Path, PathBuf};

use chorus_actors::supervision::{FailureHook, GroupAborted};
use chorus_runtime::rendezvous::Membership;
use serde::{Deserialize, Serialize};

/// The variable naming the file.
pub const ERROR_FILE_ENV: &str = "TORCHELASTIC_ERROR_FILE";

/// A peer a rank took for failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailedPeer {
    /// Its rank in the group (under an elastic group, not necessarily its `RANK`).
    pub rank: usize,
    /// Its host name.
    pub host: String,
    /// Its process id on that host.
    pub pid: u32,
}

/// What a rank wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorReport {
    /// Why its group aborted.
    pub message: String,
    /// The peers it took for failed (empty when none is known).
    pub failed: Vec<FailedPeer>,
}

#[derive(Serialize, Deserialize)]
struct File {
    message: Message,
    #[serde(default)]
    chorus: Option<Chorus>,
}

#[derive(Serialize, Deserialize)]
struct Message {
    message: String,
    #[serde(rename = "extraInfo")]
    extra_info: ExtraInfo,
}

#[derive(Serialize, Deserialize)]
struct ExtraInfo {
    timestamp: String,
}

#[derive(Serialize, Deserialize)]
struct Chorus {
    failed: Vec<FailedPeer>,
}

impl ErrorReport {
    /// Reads the file a worker wrote; `None` when there is none (or not
    /// one in this format).
    pub fn read(path: &Path) -> Option<Self> {
        let file: File = serde_json::from_slice(&std::fs::read(path).ok()?).ok()?;
        Some(Self {
            message: file.message.message,
            failed: file.chorus.map(|c| c.failed).unwrap_or_default(),
        })
    }

    /// Writes it to `path`: whole or not at all (a launcher may read it
    /// as soon as the process exits).
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let timestamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let file = File {
            message: Message {
                message: self.message.clone(),
                extra_info: ExtraInfo {
                    timestamp: timestamp.to_string(),
                },
            },
            chorus: Some(Chorus {
                failed: self.failed.clone(),
            }),
        };
        let aside = path.with_extension(format!("{}.tmp", std::process::id()));
        std::fs::write(&aside, serde_json::to_vec(&file).map_err(std::io::Error::other)?)?;
        std::fs::rename(&aside, path)
    }
}

/// The hook writing a rank's abort to the error file its launcher named,
/// if it named one.
pub(crate) fn hook(membership: &Membership) -> Option<FailureHook> {
    let path = PathBuf::from(std::env::var_os(ERROR_FILE_ENV)?);
    // What an earlier generation wrote is over: an elastic group formed
    // again after it, and a later exit must not be blamed on that failure.
    let _ = std::fs::remove_file(&path);
    let peers: Vec<FailedPeer> = membership
        .peers
        .iter()
        .map(|p| FailedPeer {
            rank: p.rank as usize,
            host: p.host.hostname.clone(),
            pid: p.pid,
        })
        .collect();
    Some(FailureHook::new(move |abort: &GroupAborted| {
        let report = ErrorReport {
            message: abort.to_string(),
            failed: abort
                .failed_ranks
                .iter()
                .filter_map(|&r| peers.get(r).cloned())
                .collect(),
        };
        if let Err(error) = report.write(&path) {
            tracing::warn!(path = %path.display(), %error, "could not write the error file");
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_reads_back_and_torchrun_finds_its_message() {
        let dir = std::env::temp_dir().join(format!("chorus-error-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("error.json");
        let report = ErrorReport {
            message: "process group (generation 0) aborted on rank 0: rank 2 sent no heartbeat".into(),
            failed: vec![FailedPeer {
                rank: 2,
                host: "h".into(),
                pid: 42,
            }],
        };
        report.write(&path).unwrap();
        assert_eq!(ErrorReport::read(&path), Some(report.clone()));
        let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(json["message"]["message"], report.message.as_str());
        assert!(json["message"]["extraInfo"]["timestamp"].is_string());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
