//! `chorus bench memory -- COMMAND...`: the memory a job takes on this host.
//!
//! Runs the command (`chorus launch ...`, the training example, ...) and
//! samples, every `--interval-ms`, every process descended from it and the
//! shared memory they map. Reported peaks:
//! - the job's `/dev/shm` segments: the sizes of the distinct shared-memory
//!   files its processes map (the rings are unlinked once both sides map
//!   them, so only the mappings show them; their pages are reserved
//!   whole), and `/dev/shm`'s own use above what it was at the start
//!   (which also counts anything else on the host);
//! - the sum over processes of each one's peak resident memory (`VmHWM`;
//!   it counts the shared pages a process touched, so a ring's touched
//!   pages count in both of its processes) and of each one's peak
//!   anonymous resident memory (`RssAnon`, its own);
//! - the host total: peak segments plus the summed anonymous peaks, what
//!   the job cost the host.
//!
//! Afterwards it counts the chorus ring files left in `/dev/shm` (the
//! launcher and the next job remove those of dead ranks). With
//! `--kill-above` it kills the job once the host total passes a limit, so
//! a run that would take a shared machine down ends first.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use serde::Serialize;

use crate::bench::collective::parse_size;
use chorus::process::{self, Signal};

/// `chorus bench memory`.
#[derive(Debug, Clone, Args)]
pub struct MemoryArgs {
    /// Milliseconds between samples.
    #[arg(long, default_value_t = 100)]
    pub interval_ms: u64,
    /// The tmpfs the rings live in.
    #[arg(long, default_value = "/dev/shm")]
    pub shm_dir: PathBuf,
    /// Kill the job (SIGKILL, every process of it) once the host total
    /// passes this many bytes (K, M, G suffixes), and fail.
    #[arg(long, value_parser = parse_size)]
    pub kill_above: Option<usize>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// The command and its arguments (after `--`).
    #[arg(trailing_var_arg = true, required = true, allow_hyphen_values = true)]
    pub command: Vec<String>,
}

/// One process's figures in one sample, bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct ProcessSample {
    peak_rss: u64,
    anon_rss: u64,
}

/// The `VmHWM` and `RssAnon` of a `/proc/<pid>/status` text, bytes.
fn parse_status(status: &str) -> ProcessSample {
    let kib = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap_or(0)
            * 1024
    };
    ProcessSample {
        peak_rss: kib("VmHWM:"),
        anon_rss: kib("RssAnon:"),
    }
}

/// The parent pid in a `/proc/<pid>/stat` text (the command name, in
/// parentheses, may hold spaces and parentheses itself).
fn parse_ppid(stat: &str) -> Option<u32> {
    stat[stat.rfind(')')? + 1..].split_whitespace().nth(1)?.parse().ok()
}

/// `root` and every process below it in a parent map.
fn descendants(root: u32, parents: &HashMap<u32, u32>) -> Vec<u32> {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    for (&pid, &ppid) in parents {
        children.entry(ppid).or_default().push(pid);
    }
    let mut found = vec![root];
    let mut next = 0;
    while let Some(&pid) = found.get(next) {
        found.extend(children.get(&pid).into_iter().flatten());
        next += 1;
    }
    found
}

/// The shared-memory files in a `/proc/<pid>/maps` text under `dir`, by
/// inode, with the largest extent mapped from offset 0: a ring maps its
/// whole file (header and data) from 0, then its data once more.
fn shm_segments(maps: &str, dir: &str) -> Vec<(u64, u64)> {
    let mut segments = Vec::new();
    for line in maps.lines() {
        let mut fields = line.split_whitespace();
        let (Some(range), Some(_perms), Some(offset), Some(_dev), Some(inode), Some(path)) = (
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
        ) else {
            continue;
        };
        if !path.starts_with(dir) || u64::from_str_radix(offset, 16) != Ok(0) {
            continue;
        }
        let Some((start, end)) = range.split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(end), Ok(inode)) = (
            u64::from_str_radix(start, 16),
            u64::from_str_radix(end, 16),
            inode.parse::<u64>(),
        ) else {
            continue;
        };
        segments.push((inode, end - start));
    }
    segments
}

/// Peaks over the samples.
#[derive(Debug, Default)]
struct Peaks {
    processes: HashMap<u32, ProcessSample>,
    segments: u64,
    shm_used: u64,
}

impl Peaks {
    /// Takes one sample: each process's figures (the peak of each), the
    /// distinct segments' total size and `/dev/shm`'s use above `base`.
    fn add(&mut self, processes: &[(u32, ProcessSample)], segments: &HashMap<u64, u64>, shm_used: u64) {
        for (pid, sample) in processes {
            let peak = self.processes.entry(*pid).or_default();
            peak.peak_rss = peak.peak_rss.max(sample.peak_rss);
            peak.anon_rss = peak.anon_rss.max(sample.anon_rss);
        }
        self.segments = self.segments.max(segments.values().sum());
        self.shm_used = self.shm_used.max(shm_used);
    }

    fn sum_peak_rss(&self) -> u64 {
        self.processes.values().map(|p| p.peak_rss).sum()
    }

    fn sum_anon_rss(&self) -> u64 {
        self.processes.values().map(|p| p.anon_rss).sum()
    }

    /// Peak segments plus the summed anonymous peaks.
    fn host_total(&self) -> u64 {
        self.segments + self.sum_anon_rss()
    }
}

/// Bytes of `dir`'s filesystem in use.
fn used_bytes(dir: &Path) -> u64 {
    chorus_transports::shm::tmpfs_space(dir).map_or(0, |space| space.size - space.free)
}

/// Every process's parent, from `/proc`.
fn parent_map() -> HashMap<u32, u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return HashMap::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            Some((pid, parse_ppid(&stat)?))
        })
        .collect()
}

/// The job's processes' figures and shared-memory segments now.
fn sample(root: u32, dir: &str) -> (Vec<(u32, ProcessSample)>, HashMap<u64, u64>) {
    let pids = descendants(root, &parent_map());
    let mut processes = Vec::new();
    let mut segments = HashMap::new();
    for pid in pids {
        // A process may end between listing and reading: skip it.
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
            continue;
        };
        processes.push((pid, parse_status(&status)));
        if let Ok(maps) = std::fs::read_to_string(format!("/proc/{pid}/maps")) {
            for (inode, size) in shm_segments(&maps, dir) {
                let known = segments.entry(inode).or_insert(0);
                *known = size.max(*known);
            }
        }
    }
    (processes, segments)
}

/// Ring files (`chorus-*-to-*`) in `dir`.
fn rings_left(dir: &Path) -> usize {
    std::fs::read_dir(dir).map_or(0, |entries| {
        entries
            .flatten()
            .filter(|e| {
                e.file_name()
                    .to_str()
                    .is_some_and(|n| n.starts_with("chorus-") && n.contains("-to-"))
            })
            .count()
    })
}

/// The report.
#[derive(Debug, Serialize)]
struct Report {
    command: String,
    exit_code: Option<i32>,
    killed_above_limit: bool,
    seconds: f64,
    processes: usize,
    peak_shm_segments_bytes: u64,
    peak_shm_used_bytes: u64,
    sum_peak_rss_bytes: u64,
    sum_peak_anon_rss_bytes: u64,
    host_total_bytes: u64,
    rings_left: usize,
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1 << 20) as f64)
}

/// Runs `chorus bench memory`.
pub fn run(args: &MemoryArgs) -> Result<ExitCode> {
    let Some((program, rest)) = args.command.split_first() else {
        bail!("chorus bench memory needs a command after --");
    };
    let dir = args.shm_dir.display().to_string();
    let base = used_bytes(&args.shm_dir);
    let started = Instant::now();
    let mut child = Command::new(program)
        .args(rest)
        .spawn()
        .with_context(|| format!("starting {program}"))?;
    let root = child.id();
    let mut peaks = Peaks::default();
    let mut killed = false;
    let status = loop {
        let (processes, segments) = sample(root, &dir);
        peaks.add(&processes, &segments, used_bytes(&args.shm_dir).saturating_sub(base));
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if let Some(limit) = args.kill_above
            && peaks.host_total() > limit as u64
            && !killed
        {
            killed = true;
            eprintln!(
                "chorus bench memory: the job took {} (over --kill-above {}); killing it",
                mib(peaks.host_total()),
                mib(limit as u64)
            );
            // Children first would let the parent start new ones: the
            // whole tree as it is now, root first.
            for (pid, _) in &processes {
                process::signal(*pid, Signal::SIGKILL);
            }
        }
        std::thread::sleep(Duration::from_millis(args.interval_ms.max(1)));
    };
    let report = Report {
        command: args.command.join(" "),
        exit_code: status.code(),
        killed_above_limit: killed,
        seconds: started.elapsed().as_secs_f64(),
        processes: peaks.processes.len(),
        peak_shm_segments_bytes: peaks.segments,
        peak_shm_used_bytes: peaks.shm_used,
        sum_peak_rss_bytes: peaks.sum_peak_rss(),
        sum_peak_anon_rss_bytes: peaks.sum_anon_rss(),
        host_total_bytes: peaks.host_total(),
        rings_left: rings_left(&args.shm_dir),
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", format_report(&report, &dir, base));
    }
    Ok(if status.success() && !killed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn format_report(r: &Report, dir: &str, base: u64) -> String {
    let exit = r
        .exit_code
        .map_or("killed by a signal".to_string(), |c| format!("exit {c}"));
    let rows = [
        (
            format!("peak size of the job's {dir} segments"),
            mib(r.peak_shm_segments_bytes),
        ),
        (
            format!("peak {dir} use above the {} at start", mib(base)),
            mib(r.peak_shm_used_bytes),
        ),
        (
            "sum of the processes' peak RSS (VmHWM)".into(),
            mib(r.sum_peak_rss_bytes),
        ),
        (
            "sum of the processes' peak anonymous RSS".into(),
            mib(r.sum_peak_anon_rss_bytes),
        ),
        ("host total (segments + anonymous)".into(), mib(r.host_total_bytes)),
        (format!("chorus rings left in {dir}"), r.rings_left.to_string()),
    ];
    let mut s = format!(
        "# chorus bench memory: {}\n# {exit}{}, {} processes, {:.1} s\n",
        r.command,
        if r.killed_above_limit {
            " (killed above --kill-above)"
        } else {
            ""
        },
        r.processes,
        r.seconds
    );
    let width = rows.iter().map(|(name, _)| name.len()).max().unwrap_or(0);
    for (name, value) in rows {
        s.push_str(&format!("{name:<width$}  {value:>12}\n"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_stat_and_maps_parse() {
        let status = "Name:\tchorus\nVmHWM:\t  20480 kB\nVmRSS:\t  10240 kB\nRssAnon:\t    4096 kB\n";
        assert_eq!(
            parse_status(status),
            ProcessSample {
                peak_rss: 20 << 20,
                anon_rss: 4 << 20
            }
        );
        assert_eq!(parse_ppid("42 (a (b) c) S 7 42 42 0"), Some(7));
        let maps = "\
7f0000000000-7f0003001000 rw-s 00000000 00:1a 1234 /dev/shm/chorus-00ab-to-1 (deleted)
7f0003001000-7f0006001000 rw-s 00001000 00:1a 1234 /dev/shm/chorus-00ab-to-1 (deleted)
7f0010000000-7f0010001000 rw-s 00000000 00:1a 99 /dev/shm/other
7f0020000000-7f0020001000 r-xp 00000000 08:01 5 /usr/bin/chorus
7f0030000000-7f0030001000 rw-p 00000000 00:00 0
";
        assert_eq!(shm_segments(maps, "/dev/shm"), vec![(1234, 0x3001000), (99, 0x1000)]);
    }

    #[test]
    fn peaks_follow_each_process_and_count_a_shared_segment_once() {
        let parents = HashMap::from([(10, 1), (11, 10), (12, 10), (13, 11), (20, 1)]);
        let mut tree = descendants(10, &parents);
        tree.sort();
        assert_eq!(tree, vec![10, 11, 12, 13]);

        let mut peaks = Peaks::default();
        let sample = |peak_rss, anon_rss| ProcessSample { peak_rss, anon_rss };
        let segments = HashMap::from([(1234, 100)]);
        peaks.add(&[(11, sample(50, 30)), (12, sample(40, 20))], &segments, 100);
        peaks.add(&[(11, sample(60, 10)), (13, sample(5, 5))], &HashMap::new(), 0);
        assert_eq!(peaks.sum_peak_rss(), 60 + 40 + 5);
        assert_eq!(peaks.sum_anon_rss(), 30 + 20 + 5);
        assert_eq!((peaks.segments, peaks.shm_used), (100, 100));
        assert_eq!(peaks.host_total(), 100 + 55);
    }
}
