//! What the benches share: the median and spread of measurements, the
//! environment of torchrun-style rank processes and their job secret, and
//! the start-up of a Python peer (torch, Gloo).

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use thiserror::Error;

/// The median of `values`, sorting them: the middle one, or the mean of
/// the two middle ones for an even count; `None` for none.
pub fn median(values: &mut [f64]) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(values[n / 2]),
        _ => Some((values[n / 2 - 1] + values[n / 2]) / 2.0),
    }
}

/// The median of a value measured once per round, and its range.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spread {
    /// Median over the rounds (NaN for none).
    pub median: f64,
    /// Smallest round.
    pub min: f64,
    /// Largest round.
    pub max: f64,
    /// Rounds with a finite value.
    pub rounds: usize,
}

impl Spread {
    /// The spread of `values`, ignoring the non-finite ones (a failed round).
    pub fn of(values: &[f64]) -> Self {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
        Spread {
            median: median(&mut v).unwrap_or(f64::NAN),
            min: v.first().copied().unwrap_or(f64::NAN),
            max: v.last().copied().unwrap_or(f64::NAN),
            rounds: v.len(),
        }
    }

    /// `1.50x`, or `1.50x [1.20-1.80]` over several rounds.
    pub(crate) fn format(&self) -> String {
        let range = if self.rounds > 1 {
            format!("[{:.2}-{:.2}]", self.min, self.max)
        } else {
            String::new()
        };
        format!("{:>6.2}x {range:>13}", self.median)
    }
}

/// A free TCP port on loopback for rank 0's store.
pub fn free_port() -> io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Makes `command` rank `rank` of `world` on this host, as torchrun's
/// env:// rendezvous expects, with rank 0's store on loopback at `port`
/// (the benches' ranks and `chorus hello`'s).
pub fn torchrun_env(command: &mut Command, rank: usize, world: usize, port: u16) {
    command
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("LOCAL_WORLD_SIZE", world.to_string());
}

/// Whether `python` can import torch.distributed with Gloo; its version or
/// why not.
pub(crate) fn torch_version(python: &str) -> Result<String, String> {
    match Command::new(python)
        .args([
            "-c",
            "import torch, torch.distributed as d; assert d.is_gloo_available(); print(torch.__version__)",
        ])
        .stdin(Stdio::null())
        .output()
    {
        Ok(out) if out.status.success() => Ok(String::from_utf8_lossy(&out.stdout).trim().to_string()),
        Ok(out) => Err(String::from_utf8_lossy(&out.stderr)
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("import failed")
            .to_string()),
        Err(e) => Err(format!("cannot run {python}: {e}")),
    }
}

/// Why a Python peer cannot start.
#[derive(Debug, Error)]
pub enum PeerError {
    /// No usable torch: the bench goes on without the comparison.
    #[error("{python} cannot import torch ({why})")]
    NoTorch {
        /// The interpreter asked.
        python: String,
        /// Its last line of error.
        why: String,
    },
    /// The peer's script could not be written out.
    #[error("writing {}: {source}", path.display())]
    Script {
        /// Where it was to go.
        path: PathBuf,
        /// Why it could not.
        source: io::Error,
    },
}

/// A Python peer ready to start: torch's version, and its script (embedded
/// in the binary, so that it works from anywhere) written out.
pub(crate) struct PythonPeer {
    /// `torch.__version__`.
    pub version: String,
    /// The script's file, removed when the peer is dropped.
    pub script: Script,
}

/// A file written for the length of a run, removed on drop.
pub(crate) struct Script(PathBuf);

impl Script {
    /// Its path.
    pub(crate) fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Script {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Checks that `python` has torch and writes `text` out as
/// `chorus-bench-<name>-<pid>.py` in the temporary directory.
pub(crate) fn python_peer(python: &str, name: &str, text: &str) -> Result<PythonPeer, PeerError> {
    let version = torch_version(python).map_err(|why| PeerError::NoTorch {
        python: python.to_string(),
        why,
    })?;
    let path = std::env::temp_dir().join(format!("chorus-bench-{name}-{}.py", std::process::id()));
    std::fs::write(&path, text).map_err(|source| PeerError::Script {
        path: path.clone(),
        source,
    })?;
    Ok(PythonPeer {
        version,
        script: Script(path),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_of_an_even_count_is_the_mean_of_the_two_middle_values() {
        assert_eq!(median(&mut []), None);
        assert_eq!(median(&mut [3.0]), Some(3.0));
        assert_eq!(median(&mut [5.0, 1.0, 3.0]), Some(3.0));
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&mut [30.0, 20.0]), Some(25.0));
    }

    #[test]
    fn a_spread_leaves_failed_rounds_out() {
        let spread = Spread::of(&[3.0, 1.0, f64::NAN, 2.0, f64::INFINITY]);
        assert_eq!(
            (spread.median, spread.min, spread.max, spread.rounds),
            (2.0, 1.0, 3.0, 3)
        );
        assert!(Spread::of(&[f64::NAN]).median.is_nan());
        assert_eq!(Spread::of(&[]).rounds, 0);
    }

    #[test]
    fn a_rank_gets_torchruns_variables() {
        let mut command = Command::new("true");
        torchrun_env(&mut command, 2, 4, 29500);
        let env: Vec<(String, String)> = command
            .get_envs()
            .filter_map(|(k, v)| Some((k.to_str()?.to_string(), v?.to_str()?.to_string())))
            .collect();
        for (key, value) in [
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "2"),
            ("LOCAL_WORLD_SIZE", "4"),
        ] {
            assert!(
                env.contains(&(key.to_string(), value.to_string())),
                "{key} missing: {env:?}"
            );
        }
    }

    #[test]
    fn a_missing_interpreter_is_no_torch_and_writes_no_script() {
        let err = python_peer("/nonexistent/python3", "test", "print(1)")
            .err()
            .expect("no interpreter");
        assert!(
            matches!(&err, PeerError::NoTorch { why, .. } if why.contains("cannot run")),
            "{err}"
        );
        let path = std::env::temp_dir().join(format!("chorus-bench-test-{}.py", std::process::id()));
        assert!(!path.exists());
    }
}
