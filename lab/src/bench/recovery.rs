//! `chorus bench recovery`: how long an elastic group takes to recover
//! from the loss of a rank, from the SIGKILL to the first successful
//! collective of the new generation, over repeated trials.
//!
//! Each trial starts a store that outlives every rank (served by this
//! process) and `--world` `chorus elastic-probe` processes (an
//! [`ElasticGroup`](chorus::ElasticGroup) each, all-reducing in a loop),
//! SIGKILLs a random rank mid-loop, and reads the survivors' event lines:
//! `event=error at_us=` (the abort reached the application; a survivor
//! between two operations when its group restarted has none and learns at
//! the restart), `event=restarted at_us=` (the first collective of
//! generation 1 completed) and `event=done`
//! (the loop finished, every sum checked against the world size). A trial
//! counts only if every survivor re-formed generation 1 of `world - 1`
//! ranks and finished. Event times are wall-clock microseconds, comparable
//! between processes of one host.
//!
//! With `--compare torchrun`, the peer is measured in the same run, trials
//! alternating: `lab/python/elastic_gloo.py` (embedded) under torchrun
//! `--max-restarts 1`, a Gloo all-reduce loop in which a random rank
//! SIGKILLs itself; torchrun restarts every worker, and the recovery is the
//! kill to the first all-reduce of the new attempt on every worker.
//!
//! The parsing and the statistics are pure ([`TrialOutcome::from_lines`],
//! [`torchrun_recovery`], [`Summary::of`]); [`run_trial`] and
//! [`run_torchrun_trial`] are the process drivers.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use chorus::process::{self, Signal};
use thiserror::Error;

use super::common::{PeerError, PythonPeer, median, python_peer};

/// What `chorus bench recovery` does.
#[derive(Debug, Clone)]
pub struct RecoveryBench {
    /// Ranks per trial (one is killed).
    pub world: usize,
    /// How many trials.
    pub trials: usize,
    /// `CHORUS_TRANSPORT` for the ranks (`None`: the default, auto).
    pub transport: Option<String>,
    /// `CHORUS_HEARTBEAT_TIMEOUT` for the ranks, seconds (`None`: the default).
    pub heartbeat_timeout: Option<u64>,
    /// The elastic rendezvous' last-call window, milliseconds.
    pub last_call_ms: u64,
    /// All-reduces each rank runs (the kill comes after the 20th).
    pub iterations: u64,
    /// Seeds the choice of the killed rank and of the moment.
    pub seed: u64,
    /// Limit on one trial.
    pub trial_timeout: Duration,
    /// Also measure torchrun with this Python (`None`: chorus alone).
    pub compare_torchrun: Option<String>,
}

/// torchrun's side: the script, embedded so that the binary works from anywhere.
const TORCHRUN_SCRIPT: &str = include_str!("../../python/elastic_gloo.py");

/// Why a trial failed.
#[derive(Debug, Error)]
pub enum RecoveryError {
    /// A process could not be started or signalled.
    #[error("{0}")]
    Setup(String),
    /// The trial did not reach `phase` in time, or a rank misbehaved.
    #[error("trial {trial}: {what}\n--- output ---\n{output}")]
    Trial {
        /// Which trial.
        trial: usize,
        /// What went wrong.
        what: String,
        /// Every line the ranks printed, prefixed by their rank.
        output: String,
    },
}

/// One survivor's view of a trial.
#[derive(Debug, Clone, PartialEq)]
pub struct SurvivorTimes {
    /// Its rank in generation 0.
    pub rank: usize,
    /// Microseconds from the kill until its operation failed.
    pub detected_us: i64,
    /// Microseconds from the kill until its first collective of generation 1 completed.
    pub recovered_us: i64,
}

/// What one trial measured.
#[derive(Debug, Clone, PartialEq)]
pub struct TrialOutcome {
    /// The killed rank.
    pub killed: usize,
    /// Per survivor, by rank.
    pub survivors: Vec<SurvivorTimes>,
}

impl TrialOutcome {
    /// Microseconds until the last survivor saw the failure.
    pub fn detected_us(&self) -> i64 {
        self.survivors.iter().map(|s| s.detected_us).max().unwrap_or(0)
    }

    /// Microseconds until the last survivor completed the new generation's
    /// first collective: the trial's recovery time.
    pub fn recovered_us(&self) -> i64 {
        self.survivors.iter().map(|s| s.recovered_us).max().unwrap_or(0)
    }

    /// Reads a trial's outcome from the probes' lines (`(rank, line)`),
    /// given the killed rank and the kill's wall-clock time. Every survivor
    /// must have failed, re-formed generation 1 of `world - 1` ranks and
    /// finished `iterations`; otherwise says what is missing.
    pub fn from_lines(
        lines: &[(usize, String)],
        world: usize,
        killed: usize,
        killed_at_us: i64,
        iterations: u64,
    ) -> Result<Self, String> {
        let mut survivors = Vec::new();
        for rank in (0..world).filter(|&r| r != killed) {
            let find = |event: &str| {
                lines
                    .iter()
                    .filter(|(r, _)| *r == rank)
                    .map(|(_, l)| l.as_str())
                    .find(|l| l.split_whitespace().any(|w| w == event))
            };
            let at = |line: &str| -> Option<i64> { field(line, "at_us")?.parse().ok() };
            let error = find("event=error");
            let restarted = find("event=restarted").ok_or_else(|| format!("rank {rank} never restarted"))?;
            let generation = (field(restarted, "gen"), field(restarted, "world"));
            if generation != (Some("1"), Some(&(world - 1).to_string())) {
                return Err(format!(
                    "rank {rank} restarted into {restarted:?}, not generation 1 of {} ranks",
                    world - 1
                ));
            }
            let done = find("event=done").ok_or_else(|| format!("rank {rank} did not finish its loop"))?;
            if field(done, "iterations") != Some(&iterations.to_string()) {
                return Err(format!("rank {rank} finished with {done:?}"));
            }
            let Some(restarted_at) = at(restarted) else {
                return Err(format!("rank {rank} printed no restart time"));
            };
            // A survivor between two operations when its group restarted
            // sees no failed operation: it learned of the failure from the
            // new generation.
            let detected_at = match error {
                Some(error) => at(error).ok_or_else(|| format!("rank {rank} printed no error time"))?,
                None => restarted_at,
            };
            survivors.push(SurvivorTimes {
                rank,
                detected_us: detected_at - killed_at_us,
                recovered_us: restarted_at - killed_at_us,
            });
        }
        Ok(Self { killed, survivors })
    }
}

/// torchrun's recovery in microseconds, from its workers' lines: the
/// killing rank's `event=killing at_us=` to the last `event=restarted at_us=`
/// of the `world` restarted workers; or why it did not recover.
pub fn torchrun_recovery(lines: &[String], world: usize) -> Result<i64, String> {
    let at = |line: &str| -> Option<i64> { field(line, "at_us")?.parse().ok() };
    let killed_at = lines
        .iter()
        .find(|l| l.contains("event=killing"))
        .and_then(|l| at(l))
        .ok_or("no worker killed itself")?;
    let restarted: Vec<i64> = lines
        .iter()
        .filter(|l| l.contains("event=restarted"))
        .filter_map(|l| at(l))
        .collect();
    if restarted.len() < world {
        // The reason: the workers' last exception, else their last error line.
        let last = |pattern: &str| lines.iter().rev().find(|l| l.contains(pattern));
        let why = last("RuntimeError:")
            .or_else(|| last("Error"))
            .map_or("no reason printed".to_string(), |l| {
                l.trim().chars().take(200).collect()
            });
        return Err(format!(
            "{} of {world} workers ran an all-reduce after the restart; last error: {why}",
            restarted.len()
        ));
    }
    Ok(restarted.iter().max().expect("world > 0") - killed_at)
}

/// The value of `key=` in a probe line.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

/// Medians and tails over trials, in milliseconds.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// Trials summarized.
    pub trials: usize,
    /// Median time until every survivor saw the failure.
    pub detect_median_ms: f64,
    /// Median recovery time.
    pub recover_median_ms: f64,
    /// 90th percentile of the recovery time (nearest rank).
    pub recover_p90_ms: f64,
    /// Slowest recovery.
    pub recover_max_ms: f64,
}

impl Summary {
    /// Summarizes `outcomes` (at least one).
    pub fn of(outcomes: &[TrialOutcome]) -> Option<Self> {
        if outcomes.is_empty() {
            return None;
        }
        let sorted = |f: fn(&TrialOutcome) -> i64| {
            let mut v: Vec<f64> = outcomes.iter().map(|o| f(o) as f64 / 1e3).collect();
            v.sort_by(f64::total_cmp);
            v
        };
        let mut detect = sorted(TrialOutcome::detected_us);
        let mut recover = sorted(TrialOutcome::recovered_us);
        let nearest = |v: &[f64], q: f64| v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
        Some(Self {
            trials: outcomes.len(),
            detect_median_ms: median(&mut detect).unwrap_or(f64::NAN),
            recover_median_ms: median(&mut recover).unwrap_or(f64::NAN),
            recover_p90_ms: nearest(&recover, 0.9),
            recover_max_ms: recover[recover.len() - 1],
        })
    }
}

/// A small deterministic generator (xorshift64*) for the kill schedule.
#[derive(Debug, Clone)]
pub struct Schedule(u64);

impl Schedule {
    /// Seeded through splitmix64, so that small seeds start well mixed
    /// (xorshift also needs a nonzero state).
    pub fn new(seed: u64) -> Self {
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Self((z ^ (z >> 31)).max(1))
    }

    /// A number in `0..bound`.
    pub fn below(&mut self, bound: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % bound.max(1)
    }
}

/// Sends every line `child` prints (stdout and stderr, piped), tagged, to
/// `tx`, from a thread per stream.
fn forward_lines(child: &mut Child, tag: usize, tx: &mpsc::Sender<(usize, String)>) {
    let streams: [Box<dyn std::io::Read + Send>; 2] = [
        Box::new(child.stdout.take().expect("piped")),
        Box::new(child.stderr.take().expect("piped")),
    ];
    for stream in streams {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                let _ = tx.send((tag, line));
            }
        });
    }
}

/// The ranks of one trial; dropping it kills whatever still runs.
struct Ranks {
    children: Vec<Child>,
    lines: mpsc::Receiver<(usize, String)>,
    seen: Vec<(usize, String)>,
}

impl Drop for Ranks {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Ranks {
    fn output(&self) -> String {
        let lines: Vec<String> = self.seen.iter().map(|(r, l)| format!("[{r}] {l}")).collect();
        lines.join("\n")
    }

    /// Reads lines until `done` holds for what was seen, or the deadline.
    fn until(&mut self, deadline: Instant, done: impl Fn(&[(usize, String)]) -> bool) -> bool {
        while !done(&self.seen) {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left.max(Duration::from_millis(1))) {
                Ok(line) => self.seen.push(line),
                Err(_) => return false,
            }
        }
        true
    }
}

fn every(lines: &[(usize, String)], ranks: impl Iterator<Item = usize>, event: &str) -> bool {
    let mut ranks = ranks;
    ranks.all(|rank| {
        lines
            .iter()
            .any(|(r, l)| *r == rank && l.split_whitespace().any(|w| w == event))
    })
}

/// Runs trial `trial`: ranks meet on the store at `store_url`, one is
/// killed, the survivors' outcome is read.
pub fn run_trial(
    bench: &RecoveryBench,
    exe: &std::path::Path,
    store_url: &str,
    trial: usize,
    schedule: &mut Schedule,
) -> Result<TrialOutcome, RecoveryError> {
    let (tx, lines) = mpsc::channel();
    let mut ranks = Ranks {
        children: Vec::new(),
        lines,
        seen: Vec::new(),
    };
    let secret = format!("chorus-bench-recovery-{}-{trial}", std::process::id());
    for rank in 0..bench.world {
        let mut command = Command::new(exe);
        command
            .args(["elastic-probe", "--init", store_url])
            .args(["--iterations", &bench.iterations.to_string()])
            .args(["--min-world", &(bench.world - 1).to_string()])
            .args(["--max-world", &bench.world.to_string()])
            .args(["--last-call-ms", &bench.last_call_ms.to_string()])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", bench.world.to_string())
            .env("TORCHELASTIC_USE_AGENT_STORE", "True")
            .env("CHORUS_JOB_SECRET", &secret)
            .env_remove("CHORUS_FAULTS")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        match &bench.transport {
            Some(transport) => command.env("CHORUS_TRANSPORT", transport),
            None => command.env_remove("CHORUS_TRANSPORT"),
        };
        if let Some(secs) = bench.heartbeat_timeout {
            command.env("CHORUS_HEARTBEAT_TIMEOUT", secs.to_string());
        }
        let mut child = command
            .spawn()
            .map_err(|e| RecoveryError::Setup(format!("starting {}: {e}", exe.display())))?;
        forward_lines(&mut child, rank, &tx);
        ranks.children.push(child);
    }
    let deadline = Instant::now() + bench.trial_timeout;
    let fail = |ranks: &Ranks, what: String| RecoveryError::Trial {
        trial,
        what,
        output: ranks.output(),
    };
    if !ranks.until(deadline, |seen| every(seen, 0..bench.world, "event=running")) {
        return Err(fail(&ranks, "the ranks did not all start running in time".into()));
    }
    // A random moment within a few all-reduces, so the kill lands in any phase.
    std::thread::sleep(Duration::from_millis(schedule.below(50)));
    let killed = schedule.below(bench.world as u64) as usize;
    let killed_at_us = chorus::train::record::unix_us();
    ranks.children[killed]
        .kill()
        .map_err(|e| RecoveryError::Setup(format!("killing rank {killed}: {e}")))?;
    let _ = ranks.children[killed].wait();
    let survivors = (0..bench.world).filter(|&r| r != killed);
    if !ranks.until(deadline, |seen| every(seen, survivors.clone(), "event=done")) {
        return Err(fail(
            &ranks,
            format!("after rank {killed} was killed, the survivors did not all finish in time"),
        ));
    }
    for rank in (0..bench.world).filter(|&r| r != killed) {
        let status = loop {
            if let Some(status) = ranks.children[rank]
                .try_wait()
                .map_err(|e| RecoveryError::Setup(e.to_string()))?
            {
                break status;
            }
            if Instant::now() > deadline {
                return Err(fail(&ranks, format!("rank {rank} did not exit after its loop")));
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        if !status.success() {
            return Err(fail(&ranks, format!("rank {rank} exited with {status}")));
        }
    }
    // Lines printed before exit may still be in the reader threads' hands.
    let _ = ranks.until(Instant::now() + Duration::from_millis(200), |_| false);
    TrialOutcome::from_lines(&ranks.seen, bench.world, killed, killed_at_us, bench.iterations)
        .map_err(|what| fail(&ranks, what))
}

/// One torchrun trial: `python -m torch.distributed.run --standalone
/// --nproc-per-node world --max-restarts 1` over the embedded script, whose
/// rank `killed` SIGKILLs itself; returns the recovery in microseconds, or
/// why torchrun did not recover.
pub fn run_torchrun_trial(
    bench: &RecoveryBench,
    python: &str,
    script: &std::path::Path,
    killed: usize,
    kill_after: u64,
) -> Result<i64, String> {
    let mut child = Command::new(python)
        .args(["-m", "torch.distributed.run", "--standalone", "--max-restarts", "1"])
        .args([
            "--monitor-interval",
            "0.1",
            "--nproc-per-node",
            &bench.world.to_string(),
        ])
        .arg(script)
        .args([
            "--kill-rank",
            &killed.to_string(),
            "--kill-after",
            &kill_after.to_string(),
        ])
        .args(["--iterations", &bench.iterations.to_string()])
        .env("OMP_NUM_THREADS", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start torchrun with {python}: {e}"))?;
    let (tx, rx) = mpsc::channel();
    forward_lines(&mut child, 0, &tx);
    drop(tx);
    let deadline = Instant::now() + bench.trial_timeout;
    let mut lines = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left.max(Duration::from_millis(1))) {
            Ok((_, line)) => lines.push(line),
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                // SIGTERM lets the torchrun we started stop its workers.
                process::signal(child.id(), Signal::SIGTERM);
                std::thread::sleep(Duration::from_secs(2));
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("torchrun did not finish within {:?}", bench.trial_timeout));
            }
        }
    }
    let _ = child.wait();
    torchrun_recovery(&lines, bench.world)
}

/// Runs every trial (each on a store of its own) and prints a row per
/// trial and the summary (or JSON lines); returns how many trials failed.
pub async fn run(bench: &RecoveryBench, json: bool) -> Result<usize, RecoveryError> {
    let mut trials = Trials::new(bench, json)?;
    trials.print_header();
    for trial in 0..bench.trials {
        trials.chorus_trial(trial).await?;
        trials.torchrun_trial(trial).await?;
    }
    // The script goes once every trial ran.
    let compared = trials.torchrun.take().is_some();
    trials.print_summary();
    if compared {
        trials.print_torchrun_summary();
    }
    Ok(trials.failures)
}

/// The trials of one run, chorus's and torchrun's alternating, and what
/// they found so far.
struct Trials<'a> {
    bench: &'a RecoveryBench,
    json: bool,
    /// This binary: the ranks run its `elastic-probe`.
    exe: std::path::PathBuf,
    /// Which rank is killed, and when, trial after trial.
    schedule: Schedule,
    /// chorus's trials that recovered.
    outcomes: Vec<TrialOutcome>,
    /// chorus's trials that failed.
    failures: usize,
    /// torchrun's Python and script (`--compare torchrun`, torch found).
    torchrun: Option<(String, PythonPeer)>,
    /// torchrun's recoveries, microseconds.
    torchrun_us: Vec<i64>,
    /// torchrun's trials that did not recover.
    torchrun_failed: usize,
}

impl<'a> Trials<'a> {
    /// Locates the binary and, with `--compare torchrun`, the peer's torch.
    fn new(bench: &'a RecoveryBench, json: bool) -> Result<Self, RecoveryError> {
        let exe =
            std::env::current_exe().map_err(|e| RecoveryError::Setup(format!("locating the chorus binary: {e}")))?;
        let schedule = Schedule::new(bench.seed);
        let torchrun = match &bench.compare_torchrun {
            Some(python) => match python_peer(python, "recovery", TORCHRUN_SCRIPT) {
                Ok(peer) => Some((python.clone(), peer)),
                Err(e @ PeerError::NoTorch { .. }) => {
                    eprintln!("--compare torchrun: {e}; no comparison (pip install torch to enable it)");
                    None
                }
                Err(e) => return Err(RecoveryError::Setup(e.to_string())),
            },
            None => None,
        };
        Ok(Self {
            bench,
            json,
            exe,
            schedule,
            outcomes: Vec::new(),
            failures: 0,
            torchrun,
            torchrun_us: Vec::new(),
            torchrun_failed: 0,
        })
    }

    /// The table's header (none for JSON).
    fn print_header(&self) {
        if self.json {
            return;
        }
        let bench = self.bench;
        println!(
            "# chorus bench recovery: {} ranks on loopback (transport {}), SIGKILL of a random rank mid-loop, {} trials",
            bench.world,
            bench.transport.as_deref().unwrap_or("auto"),
            bench.trials
        );
        println!("# recovery = kill -> first all_reduce of generation 1 completed on every survivor");
        if let Some((_, peer)) = &self.torchrun {
            println!(
                "# torchrun (torch {} gloo, --max-restarts 1) measured in the same run, trials alternating",
                peer.version
            );
        }
        println!("#  trial  runtime   killed  detect(ms)  recovery(ms)");
    }

    /// chorus's trial `trial`, on a store of its own, and its row; a failed
    /// trial is said on stderr and counted.
    async fn chorus_trial(&mut self, trial: usize) -> Result<(), RecoveryError> {
        use chorus_runtime::store::{TcpStoreServer, TcpStoreServerOptions};
        let server = TcpStoreServer::bind(
            "127.0.0.1:0".parse().expect("literal address"),
            TcpStoreServerOptions::default(),
        )
        .await
        .map_err(|e| RecoveryError::Setup(format!("serving the store: {e}")))?;
        let url = format!("tcp://{}", server.local_addr());
        let (task_bench, task_exe, mut task_schedule) = (self.bench.clone(), self.exe.clone(), self.schedule.clone());
        let (result, used) = tokio::task::spawn_blocking(move || {
            let result = run_trial(&task_bench, &task_exe, &url, trial, &mut task_schedule);
            (result, task_schedule)
        })
        .await
        .map_err(|e| RecoveryError::Setup(format!("the trial's thread failed: {e}")))?;
        self.schedule = used;
        server.shutdown().await;
        match result {
            Ok(outcome) => {
                let (detect_ms, recovery_ms) =
                    (outcome.detected_us() as f64 / 1e3, outcome.recovered_us() as f64 / 1e3);
                if self.json {
                    println!(
                        "{{\"trial\":{trial},\"killed\":{},\"detect_ms\":{detect_ms:.1},\"recovery_ms\":{recovery_ms:.1}}}",
                        outcome.killed
                    );
                } else {
                    println!(
                        "   {trial:>5}  {:<8}  {:>6}  {detect_ms:>10.1}  {recovery_ms:>12.1}",
                        "chorus", outcome.killed
                    );
                }
                self.outcomes.push(outcome);
            }
            Err(error) => {
                self.failures += 1;
                eprintln!("chorus bench recovery: {error}");
            }
        }
        Ok(())
    }

    /// torchrun's trial `trial` (with `--compare torchrun`) and its row.
    async fn torchrun_trial(&mut self, trial: usize) -> Result<(), RecoveryError> {
        let Some((python, peer)) = &self.torchrun else {
            return Ok(());
        };
        let killed = self.schedule.below(self.bench.world as u64) as usize;
        let kill_after = 20 + self.schedule.below(10);
        let (task_bench, python, script) = (self.bench.clone(), python.clone(), peer.script.path().to_path_buf());
        let result =
            tokio::task::spawn_blocking(move || run_torchrun_trial(&task_bench, &python, &script, killed, kill_after))
                .await
                .map_err(|e| RecoveryError::Setup(format!("the trial's thread failed: {e}")))?;
        match result {
            Ok(us) => {
                if self.json {
                    println!(
                        "{{\"trial\":{trial},\"runtime\":\"torchrun\",\"killed\":{killed},\"recovery_ms\":{:.1}}}",
                        us as f64 / 1e3
                    );
                } else {
                    println!(
                        "   {trial:>5}  {:<8}  {killed:>6}  {:>10}  {:>12.1}",
                        "torchrun",
                        "-",
                        us as f64 / 1e3
                    );
                }
                self.torchrun_us.push(us);
            }
            Err(why) => {
                self.torchrun_failed += 1;
                if self.json {
                    println!(
                        "{{\"trial\":{trial},\"runtime\":\"torchrun\",\"killed\":{killed},\"failed\":{}}}",
                        serde_json::Value::String(why)
                    );
                } else {
                    println!(
                        "   {trial:>5}  {:<8}  {killed:>6}  {:>10}  {:>12}  did not recover: {why}",
                        "torchrun", "-", "-"
                    );
                }
            }
        }
        Ok(())
    }

    /// chorus's summary over the trials that recovered (none without one).
    fn print_summary(&self) {
        let Some(summary) = Summary::of(&self.outcomes) else {
            return;
        };
        let bench = self.bench;
        if self.json {
            println!(
                "{{\"trials\":{},\"recovered\":{},\"detect_median_ms\":{:.1},\"recovery_median_ms\":{:.1},\"recovery_p90_ms\":{:.1},\"recovery_max_ms\":{:.1}}}",
                bench.trials,
                summary.trials,
                summary.detect_median_ms,
                summary.recover_median_ms,
                summary.recover_p90_ms,
                summary.recover_max_ms
            );
        } else {
            println!(
                "# {}/{} trials: every survivor re-formed generation 1 of {} ranks and finished its loop with correct sums",
                summary.trials,
                bench.trials,
                bench.world - 1
            );
            println!(
                "# detect median {:.1} ms; recovery median {:.1} ms, p90 {:.1} ms, max {:.1} ms",
                summary.detect_median_ms, summary.recover_median_ms, summary.recover_p90_ms, summary.recover_max_ms
            );
        }
    }

    /// torchrun's summary, and chorus's median recovery over torchrun's.
    fn print_torchrun_summary(&self) {
        let trials = self.bench.trials;
        let recovered = self.torchrun_us.len();
        let mut torchrun_ms: Vec<f64> = self.torchrun_us.iter().map(|&us| us as f64 / 1e3).collect();
        let median = median(&mut torchrun_ms);
        let ours = Summary::of(&self.outcomes).map(|s| s.recover_median_ms);
        if self.json {
            println!(
                "{{\"runtime\":\"torchrun\",\"trials\":{trials},\"recovered\":{recovered},\"recovery_median_ms\":{}}}",
                median.map_or("null".to_string(), |m| format!("{m:.1}"))
            );
            return;
        }
        match (median, ours) {
            (Some(theirs), Some(ours)) => println!(
                "# torchrun: {recovered}/{trials} trials recovered, recovery median {theirs:.1} ms; chorus/torchrun {:.3}x",
                ours / theirs
            ),
            _ => println!(
                "# torchrun: {recovered}/{trials} trials recovered ({} did not)",
                self.torchrun_failed
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(text: &[(usize, &str)]) -> Vec<(usize, String)> {
        text.iter().map(|(r, l)| (*r, l.to_string())).collect()
    }

    #[test]
    fn a_trial_is_read_from_the_survivors_events() {
        let seen = lines(&[
            (0, "probe rank=0 gen=0 event=running"),
            (0, "probe rank=0 gen=0 event=error at_us=1100 error=rank 1 died"),
            (2, "probe rank=2 gen=0 event=error at_us=1300 error=rank 1 died"),
            (0, "probe rank=0 gen=1 world=2 event=restarted resume=40 at_us=1900"),
            (2, "probe rank=1 gen=1 world=2 event=restarted resume=40 at_us=2000"),
            (0, "probe rank=0 gen=1 world=2 event=done iterations=100 pid=7"),
            (2, "probe rank=1 gen=1 world=2 event=done iterations=100 pid=8"),
        ]);
        let outcome = TrialOutcome::from_lines(&seen, 3, 1, 1000, 100).unwrap();
        assert_eq!(outcome.killed, 1);
        assert_eq!((outcome.detected_us(), outcome.recovered_us()), (300, 1000));
        assert_eq!(outcome.survivors[1].rank, 2);
        // A survivor that restarted into the wrong world, or never finished, fails the trial.
        let mut wrong = seen.clone();
        wrong[4].1 = "probe rank=1 gen=1 world=3 event=restarted resume=40 at_us=2000".into();
        assert!(
            TrialOutcome::from_lines(&wrong, 3, 1, 1000, 100)
                .unwrap_err()
                .contains("rank 2")
        );
        let unfinished: Vec<_> = seen[..6].to_vec();
        let error = TrialOutcome::from_lines(&unfinished, 3, 1, 1000, 100).unwrap_err();
        assert!(error.contains("rank 2 did not finish"), "{error}");
        // A survivor whose group restarted between two of its operations
        // saw no error: it detected the failure when it restarted.
        let between: Vec<_> = seen
            .iter()
            .filter(|(r, l)| !(*r == 2 && l.contains("error")))
            .cloned()
            .collect();
        let outcome = TrialOutcome::from_lines(&between, 3, 1, 1000, 100).unwrap();
        assert_eq!((outcome.detected_us(), outcome.recovered_us()), (1000, 1000));
    }

    #[test]
    fn torchrun_recovery_needs_every_restarted_worker() {
        let lines: Vec<String> = [
            "probe rank=1 gen=0 event=killing at_us=1000",
            "probe rank=0 gen=1 world=2 event=restarted at_us=4000",
            "probe rank=1 gen=1 world=2 event=restarted at_us=4500",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(torchrun_recovery(&lines, 2), Ok(3500));
        let failed = vec![
            lines[0].clone(),
            "RuntimeError: Gloo connectFullMesh failed with ... Connection refused".to_string(),
        ];
        let why = torchrun_recovery(&failed, 2).unwrap_err();
        assert!(why.contains("0 of 2") && why.contains("connectFullMesh"), "{why}");
    }

    #[test]
    fn the_summary_takes_medians_and_nearest_rank_tails() {
        let outcome = |recovered_us| TrialOutcome {
            killed: 0,
            survivors: vec![SurvivorTimes {
                rank: 1,
                detected_us: 100_000,
                recovered_us,
            }],
        };
        let outcomes: Vec<_> = (1..=10).map(|i| outcome(i * 100_000)).collect();
        let summary = Summary::of(&outcomes).unwrap();
        assert_eq!(summary.trials, 10);
        // An even count: the mean of the two middle trials.
        assert_eq!(summary.recover_median_ms, 550.0);
        assert_eq!(summary.recover_p90_ms, 900.0);
        assert_eq!(summary.recover_max_ms, 1000.0);
        assert_eq!(summary.detect_median_ms, 100.0);
        assert!(Summary::of(&[]).is_none());
    }

    #[test]
    fn the_schedule_is_deterministic_and_in_bounds() {
        let (mut a, mut b) = (Schedule::new(7), Schedule::new(7));
        let draws: Vec<u64> = (0..100).map(|_| a.below(4)).collect();
        assert!(draws.iter().all(|&d| d < 4));
        assert_eq!(draws, (0..100).map(|_| b.below(4)).collect::<Vec<_>>());
        assert!((0..4).all(|r| draws.contains(&r)), "every rank gets killed sometimes");
    }
}
