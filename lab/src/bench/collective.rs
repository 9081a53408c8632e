//! `chorus bench` (the default form): nccl-tests-style measurements of one
//! collective over a sweep of sizes, optionally next to PyTorch's Gloo
//! measured in the same invocation.
//!
//! # How a run goes
//! The parent process measures nothing itself. For each transport asked for
//! it starts a *side* ([`super::side`]): `--world` rank processes (`chorus bench --worker`,
//! with `MASTER_ADDR`/`MASTER_PORT`/`RANK`/`WORLD_SIZE` and
//! `CHORUS_TRANSPORT`), or with `--in-process` one thread running
//! [`chorus::spawn`]. With `--compare gloo` one more side runs
//! `lab/python/bench_gloo.py` (embedded in the binary) once per rank. Every
//! side forms its group once and then waits for commands: `run COUNT`
//! measures one size (warm-up, then `--iters` timed calls out of place, the
//! same in place, then the check) and answers one JSON line per rank. The
//! parent walks the sizes and, for each size, runs every side in turn, so the
//! sides alternate per size: noise on a shared machine (another tenant, a
//! frequency change) lasting seconds hits chorus and Gloo alike instead of
//! one whole sweep. Idle sides block on their stdin.
//!
//! # What is timed
//! Each rank times each call from submission to completion; the time of an
//! iteration is the mean over ranks (nccl-tests' default `-a 1`), the table
//! shows the mean over iterations (as nccl-tests does) and `--json` also
//! carries the median. chorus's collectives take their buffer by value and
//! hand it back, so:
//! - *in place*: the buffer is moved in and the returned one is the next
//!   call's input (no copy);
//! - *out of place*: the input must survive. An all-reduce uses chorus's
//!   out-of-place form (`all_reduce_into`: the input shared, the output the
//!   buffer the previous call handed back), as nccl-tests' separate send and
//!   receive buffers; the other collectives first copy the input into that
//!   buffer, and the copy is timed — what a caller that keeps its input
//!   pays. Gloo's out of place is that copy (`buf.copy_(x)` first) for the
//!   collectives torch only has in place, all_reduce among them, and its
//!   native separate-output call for the others.
//!
//! # Pure parts (unit-tested)
//! [`parse_size`], [`sizes`], [`BenchOp`] (byte counts and bus-bandwidth
//! factors), [`Row`] and [`format_table`], the reference results of
//! `--check`, and the JSON of the workers' lines and `--json` rows
//! (`serde_json`).

use std::fmt::Write as _;
use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use chorus_runtime::collective::{DType, ReduceOp};
use serde::Serialize;

use super::common::{PeerError, Spread, median, python_peer};
pub use super::measure::BenchOp;
use super::measure::{Raw, Spec, WorkerError, WorkerLine, measure, round, to_line};
use super::side::{InProcessSide, ProcessSide, Side};
use chorus::binding::{NumaBinding, Topology, format_cpu_list};

/// The Gloo side's script, embedded so that the binary works from anywhere.
const GLOO_SCRIPT: &str = include_str!("../../python/bench_gloo.py");

/// The peer `--compare` can measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Peer {
    /// PyTorch's `torch.distributed` with the Gloo backend.
    Gloo,
}

/// `chorus bench` flags (nccl-tests' short names where they exist).
#[derive(Debug, Clone, clap::Args)]
pub struct CollectiveArgs {
    /// The collective.
    #[arg(long, value_enum, default_value = "all_reduce")]
    pub op: BenchOp,
    /// Smallest size, bytes (K, M, G suffixes: powers of 1024).
    #[arg(short = 'b', long = "minbytes", default_value = "8", value_parser = parse_size)]
    pub min_bytes: usize,
    /// Largest size, bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "64M", value_parser = parse_size)]
    pub max_bytes: usize,
    /// Multiply the size by this from one row to the next.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
    pub step_factor: usize,
    /// Element type (nccl-tests' or PyTorch's names: float, half, bfloat16, int32, ...).
    #[arg(short = 'd', long = "dtype", default_value = "float")]
    pub dtype: DType,
    /// Reduction operator (sum, prod, min, max, avg; band, bor, bxor on integers).
    #[arg(short = 'o', long = "redop", default_value = "sum")]
    pub redop: ReduceOp,
    /// Root of broadcast and reduce.
    #[arg(short = 'r', long, default_value_t = 0)]
    pub root: usize,
    /// Number of ranks.
    #[arg(long, default_value_t = 2)]
    pub world: usize,
    /// CHORUS_TRANSPORT for the rank processes; several, comma-separated, are each measured.
    #[arg(long, default_value = "auto", value_delimiter = ',')]
    pub transport: Vec<String>,
    /// Timed iterations per size and half.
    #[arg(short = 'n', long, default_value_t = 20)]
    pub iters: usize,
    /// Untimed iterations before them.
    #[arg(short = 'w', long, default_value_t = 5)]
    pub warmup: usize,
    /// Check every result element against a locally computed reference (#wrong).
    #[arg(short = 'c', long)]
    pub check: bool,
    /// Run the ranks as actors in this process (chorus::spawn, in-process links).
    #[arg(long)]
    pub in_process: bool,
    /// Measure the same sweep with this peer, alternating per size; adds the ratio chorus/peer.
    #[arg(long, value_enum)]
    pub compare: Option<Peer>,
    /// Measure each size this many times, alternating chorus and the peer
    /// each round; the ratio column is the median of the rounds' ratios
    /// [min-max], the other columns pool every round's iterations.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub rounds: u64,
    /// Add a column with each size's peak resident memory over the in-place
    /// calls (VmHWM, MiB, the largest rank process; the whole process with
    /// --in-process) and its ratio to the tensor size.
    #[arg(long)]
    pub memory: bool,
    /// Print one JSON object per row instead of the tables.
    #[arg(long)]
    pub json: bool,
    /// Also write the JSON rows to this file (the tables still print).
    #[arg(long, value_name = "FILE")]
    pub json_file: Option<PathBuf>,
    /// Draw busbw against size (out of place) for every side into this PNG.
    #[arg(long, value_name = "FILE.png")]
    pub plot: Option<PathBuf>,
    /// Seconds allowed for the ranks to form their group and for each size.
    #[arg(long, default_value_t = 300)]
    pub timeout: u64,
    /// Python interpreter for --compare gloo.
    #[arg(long, default_value = "python3", env = "CHORUS_BENCH_PYTHON")]
    pub python: String,
    /// Bind each rank process, chorus's and the peer's alike, as `chorus
    /// launch --numa-binding` does; exclusive falls back to unbound, with a
    /// note, when the host has fewer cores than ranks.
    #[arg(long, default_value = "exclusive", value_parser = BINDINGS)]
    pub numa_binding: String,
    /// Internal: run as one rank process, reading commands on stdin.
    #[arg(long, hide = true)]
    pub worker: bool,
}

/// `--numa-binding`'s values in the benches.
pub(crate) const BINDINGS: [&str; 5] = ["exclusive", "none", "node", "socket", "core-complex"];

/// The CPUs of each of `world` rank processes under `--numa-binding mode`
/// (empty lists: unbound), and a line saying so for the table's header.
pub(crate) fn rank_cpus(mode: &str, world: usize) -> (Vec<Vec<usize>>, String) {
    let Ok(binding) = mode.parse::<NumaBinding>() else {
        return (Vec::new(), "ranks unbound (--numa-binding none)".into());
    };
    match Topology::read().and_then(|topology| topology.plan(binding, world)) {
        Ok(cpus) => {
            let lists: Vec<String> = cpus.iter().map(|c| format_cpu_list(c)).collect();
            let note = format!(
                "ranks bound with --numa-binding {binding}, every side alike: CPUs {}",
                lists.join(" | ")
            );
            (cpus, note)
        }
        Err(why) => (Vec::new(), format!("ranks unbound: {why}")),
    }
}

/// Parses a size in bytes: `8`, `64K`, `64M`, `1G` (binary multiples, as nccl-tests).
pub fn parse_size(text: &str) -> Result<usize, String> {
    let t = text.trim();
    let (digits, shift) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 10),
        Some('M') => (&t[..t.len() - 1], 20),
        Some('G') => (&t[..t.len() - 1], 30),
        _ => (t, 0),
    };
    let n: usize = digits
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a size (a number with an optional K, M or G suffix)"))?;
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("{text:?} is too large"))
}

/// The sizes of a sweep: `min`, `min*factor`, ... up to `max` (nccl-tests' `-b -e -f`).
pub fn sizes(min: usize, max: usize, factor: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut s = min.max(1);
    while s <= max {
        out.push(s);
        if factor <= 1 {
            break;
        }
        s = match s.checked_mul(factor) {
            Some(next) => next,
            None => break,
        };
    }
    out
}

// ---------------------------------------------------------------- results

/// One half (out of place or in place) of a row, over ranks and iterations.
#[derive(Debug, Clone, PartialEq)]
pub struct Half {
    /// Mean time per call, microseconds.
    pub avg_us: f64,
    /// Median time per call, microseconds.
    pub median_us: f64,
    /// Wrong elements over every rank (`None` without `--check`).
    pub wrong: Option<u64>,
}

impl Half {
    /// Combines per-rank samples: each iteration's time is the mean over ranks.
    pub fn from_ranks(samples: &[Vec<f64>], wrong: Option<u64>) -> Self {
        let iters = samples.iter().map(Vec::len).min().unwrap_or(0);
        let mut per_iter: Vec<f64> = (0..iters)
            .map(|i| samples.iter().map(|s| s[i]).sum::<f64>() / samples.len() as f64)
            .collect();
        let avg_us = if iters == 0 {
            f64::NAN
        } else {
            per_iter.iter().sum::<f64>() / iters as f64
        };
        Self {
            avg_us,
            median_us: median(&mut per_iter).unwrap_or(f64::NAN),
            wrong,
        }
    }
}

/// One size of one side.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// The collective.
    pub op: BenchOp,
    /// nccl-tests' count.
    pub count: usize,
    /// Element type.
    pub dtype: DType,
    /// Reduction operator (shown as `none` for the others).
    pub redop: ReduceOp,
    /// Root (shown as -1 for the others).
    pub root: usize,
    /// Ranks.
    pub world: usize,
    /// Out of place.
    pub oop: Half,
    /// In place.
    pub ip: Half,
    /// Peak resident bytes of the largest rank process (`--memory`).
    pub peak_rss: Option<u64>,
}

impl Row {
    /// Bytes S of one call.
    pub fn bytes(&self) -> usize {
        self.op.bytes(self.count, self.dtype, self.world)
    }

    /// algbw, decimal GB/s, for a time in microseconds.
    pub fn algbw(&self, us: f64) -> f64 {
        self.bytes() as f64 / us / 1e3
    }

    /// busbw, decimal GB/s.
    pub fn busbw(&self, us: f64) -> f64 {
        self.algbw(us) * self.op.bus_factor(self.world)
    }
}

/// nccl-tests' time column: fewer decimals as the time grows.
fn format_time(us: f64) -> String {
    if !us.is_finite() {
        "N/A".into()
    } else if us >= 10000.0 {
        format!("{us:.0}")
    } else if us >= 100.0 {
        format!("{us:.1}")
    } else {
        format!("{us:.2}")
    }
}

/// The table header (three lines; the ratio columns only with a peer, the
/// memory columns only with `memory`).
pub fn format_header(peer: Option<&str>, memory: bool) -> String {
    let mut s = String::new();
    s.push_str("#                                                              out-of-place                       in-place          ");
    if let Some(peer) = peer {
        let _ = write!(s, "  {:<44}", format!("chorus/{peer} busbw, median of rounds"));
    }
    if memory {
        s.push_str("   peak RSS, ip");
    }
    s.push('\n');
    s.push_str("#       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw   busbw  #wrong");
    if peer.is_some() {
        s.push_str("      oop     [min-max]       ip     [min-max]");
    }
    if memory {
        s.push_str("     MiB   /size");
    }
    s.push('\n');
    s.push_str("#        (B)    (elements)                               (us)  (GB/s)  (GB/s)             (us)  (GB/s)  (GB/s)        ");
    if peer.is_some() {
        s.push_str("      (x)                     (x)              ");
    }
    if memory {
        s.push_str("                ");
    }
    s.push('\n');
    s
}

/// One table line, nccl-tests' columns; `ratios` (out of place, in place)
/// appended when given, then the peak RSS when `memory`.
pub fn format_row(row: &Row, ratios: Option<(Spread, Spread)>, memory: bool) -> String {
    let redop = if row.op.reduces() { row.redop.name() } else { "none" };
    let root: i64 = if row.op.rooted() { row.root as i64 } else { -1 };
    let mut s = format!(
        "{:>12}  {:>12}  {:>8}  {:>6}  {:>6}",
        row.bytes(),
        row.count,
        row.dtype.nccl_name(),
        redop,
        root
    );
    for half in [&row.oop, &row.ip] {
        let wrong = half.wrong.map_or_else(|| "N/A".to_string(), |w| w.to_string());
        let _ = write!(
            s,
            "  {:>7}  {:>6.2}  {:>6.2}  {:>6}",
            format_time(half.avg_us),
            row.algbw(half.avg_us),
            row.busbw(half.avg_us),
            wrong
        );
    }
    if let Some((oop, ip)) = ratios {
        let _ = write!(s, "  {}  {}", oop.format(), ip.format());
    }
    if memory {
        match row.peak_rss {
            Some(rss) => {
                let _ = write!(
                    s,
                    "  {:>6.0}  {:>6.2}",
                    rss as f64 / (1 << 20) as f64,
                    rss as f64 / row.bytes() as f64
                );
            }
            None => s.push_str("     N/A     N/A"),
        }
    }
    s
}

/// nccl-tests' footer value: the mean busbw over every row and both halves.
pub fn avg_busbw(rows: &[Row]) -> f64 {
    let values: Vec<f64> = rows
        .iter()
        .flat_map(|r| [r.busbw(r.oop.avg_us), r.busbw(r.ip.avg_us)])
        .filter(|v| v.is_finite())
        .collect();
    if values.is_empty() {
        0.0
    } else {
        values.iter().sum::<f64>() / values.len() as f64
    }
}

/// The busbw ratios (out of place, in place) of `ours` to `theirs`, round
/// by round (a round the peer failed counts as missing).
pub fn round_ratios(ours: &[Row], theirs: &[Option<Row>]) -> (Spread, Spread) {
    let ratio = |half: fn(&Row) -> f64| -> Vec<f64> {
        ours.iter()
            .zip(theirs)
            .map(|(o, t)| t.as_ref().map_or(f64::NAN, |t| o.busbw(half(o)) / t.busbw(half(t))))
            .collect()
    };
    (
        Spread::of(&ratio(|r| r.oop.avg_us)),
        Spread::of(&ratio(|r| r.ip.avg_us)),
    )
}

/// A whole table: header, rows (with each row's ratios to the peer, named,
/// when given), `# Avg bus bandwidth` footer and the memcpy line.
pub fn format_table(
    rows: &[Row],
    peer: Option<(&str, &[(Spread, Spread)])>,
    memory: bool,
    memcpy_gbps: Option<f64>,
) -> String {
    let mut s = format_header(peer.map(|(name, _)| name), memory);
    for (i, row) in rows.iter().enumerate() {
        let nan = Spread::of(&[]);
        let ratios = peer.map(|(_, r)| r.get(i).copied().unwrap_or((nan, nan)));
        s.push_str(&format_row(row, ratios, memory));
        s.push('\n');
    }
    let wrong: u64 = rows.iter().flat_map(|r| [r.oop.wrong, r.ip.wrong]).flatten().sum();
    if rows.iter().any(|r| r.oop.wrong.is_some()) {
        let _ = writeln!(
            s,
            "# Out of bounds values : {wrong} {}",
            if wrong == 0 { "OK" } else { "FAILED" }
        );
    }
    let _ = writeln!(s, "# Avg bus bandwidth : {:.4}", avg_busbw(rows));
    if let Some(m) = memcpy_gbps {
        let _ = writeln!(s, "# Single-thread memcpy bandwidth : {m:.2} GB/s (64 MiB, this run)");
    }
    s.push_str("#\n");
    s
}

impl From<&CollectiveArgs> for Spec {
    fn from(args: &CollectiveArgs) -> Self {
        Self {
            op: args.op,
            dtype: args.dtype,
            redop: args.redop,
            root: args.root,
            iters: args.iters.max(1),
            warmup: args.warmup,
            check: args.check,
            memory: args.memory,
        }
    }
}

/// The median in-place time of one size over iterations (each the mean over
/// ranks), microseconds.
pub(crate) fn in_place_median_us(raws: &[Raw]) -> f64 {
    Half::from_ranks(&raws.iter().map(|r| r.ip.clone()).collect::<Vec<_>>(), None).median_us
}

/// A rank process (`chorus bench --worker`): joins over env://, answers
/// `run COUNT` lines on stdin with one JSON line on stdout, until `quit`.
pub async fn run_worker(args: &CollectiveArgs) -> Result<()> {
    let spec = Spec::from(args);
    let options = chorus::InitOptions::default().timeout(Duration::from_secs(args.timeout));
    let group = chorus::init_process_group(options).await.context("forming the group")?;
    let rank = group.rank();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut stdout = std::io::stdout();
    #[derive(Serialize)]
    struct Ready {
        ready: bool,
        rank: usize,
    }
    writeln!(stdout, "{}", to_line(&Ready { ready: true, rank }))?;
    stdout.flush()?;
    while let Some(line) = rx.recv().await {
        let mut words = line.split_whitespace();
        match (words.next(), words.next().and_then(|c| c.parse::<usize>().ok())) {
            (Some("run"), Some(count)) => {
                let answer = match measure(&group, &spec, count).await {
                    Ok(raw) => raw.to_json(rank, count),
                    Err(e) => to_line(&WorkerLine {
                        rank,
                        count,
                        answer: WorkerError {
                            error: format!("{e:#}"),
                        },
                    }),
                };
                writeln!(stdout, "{answer}")?;
                stdout.flush()?;
            }
            (Some("quit"), _) | (None, _) => break,
            _ => bail!("unknown command {line:?}"),
        }
    }
    group.destroy().await?;
    Ok(())
}

// ----------------------------------------------------------------- driver

/// The flags a worker (chorus or Gloo) needs to measure what the parent asks.
fn worker_flags(args: &CollectiveArgs) -> Vec<String> {
    vec![
        "--op".into(),
        args.op.name().into(),
        "--dtype".into(),
        args.dtype.nccl_name().into(),
        "--redop".into(),
        args.redop.name().into(),
        "--root".into(),
        args.root.to_string(),
        "--iters".into(),
        args.iters.max(1).to_string(),
        "--warmup".into(),
        args.warmup.to_string(),
    ]
}

/// A [`Row`] from every rank's answer to one size.
fn make_row(args: &CollectiveArgs, count: usize, raws: &[Raw]) -> Row {
    Row {
        op: args.op,
        count,
        dtype: args.dtype,
        redop: args.redop,
        root: args.root,
        world: args.world,
        oop: Half::from_ranks(
            &raws.iter().map(|r| r.oop.clone()).collect::<Vec<_>>(),
            raws.iter().map(|r| r.wrong_oop).sum(),
        ),
        ip: Half::from_ranks(
            &raws.iter().map(|r| r.ip.clone()).collect::<Vec<_>>(),
            raws.iter().map(|r| r.wrong_ip).sum(),
        ),
        peak_rss: raws.iter().filter_map(|r| r.peak_rss).max(),
    }
}

/// The parent: starts the sides, alternates them per size, prints the tables
/// (or JSON rows) and draws the plot.
pub fn run(args: &CollectiveArgs) -> Result<ExitCode> {
    check_args(args)?;
    let counts = sweep_counts(args)?;
    let timeout = Duration::from_secs(args.timeout);
    let mut sides = Sides::start(args, timeout)?;
    for note in &sides.notes {
        eprintln!("chorus bench: {note}");
    }
    let answers = match sides.sweep(args, &counts, timeout) {
        Ok(answers) => answers,
        Err(error) => {
            // A failed step may have left a rank frozen: dropping a side kills
            // its ranks (SIGKILL) instead of asking them to quit.
            drop(sides);
            return Err(error);
        }
    };
    sides.finish();
    let report = Report::new(args, &sides, &counts, &answers);
    let json_rows = report.json_rows();
    if let Some(path) = &args.json_file {
        std::fs::write(path, &json_rows).with_context(|| format!("writing {}", path.display()))?;
    }
    if args.json {
        print!("{json_rows}");
    } else {
        report.print_tables();
    }
    if let Some(path) = &args.plot {
        report.draw_plot(path)?;
    }
    Ok(if report.wrong() > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// Refuses the flags that cannot be measured together.
fn check_args(args: &CollectiveArgs) -> Result<()> {
    if args.world == 0 {
        bail!("--world must be at least 1");
    }
    if args.op == BenchOp::SendRecv && args.world < 2 {
        bail!("send_recv needs --world 2 or more");
    }
    if args.op.rooted() && args.root >= args.world {
        bail!("--root {} is out of range for --world {}", args.root, args.world);
    }
    if args.op.reduces() && !args.redop.supports(args.dtype) {
        bail!(
            "--redop {} needs an integer --dtype, not {}",
            args.redop,
            args.dtype.nccl_name()
        );
    }
    if args.min_bytes > args.max_bytes {
        bail!("-b {} is larger than -e {}", args.min_bytes, args.max_bytes);
    }
    Ok(())
}

/// The counts of the size sweep, each once, every one at least an element per rank.
fn sweep_counts(args: &CollectiveArgs) -> Result<Vec<usize>> {
    let mut counts: Vec<usize> = sizes(args.min_bytes, args.max_bytes, args.step_factor)
        .into_iter()
        .map(|b| args.op.count_for(b, args.dtype, args.world))
        .filter(|&c| c > 0)
        .collect();
    counts.dedup();
    if counts.is_empty() {
        bail!(
            "no size in -b {} -e {} holds one element per rank",
            args.min_bytes,
            args.max_bytes
        );
    }
    Ok(counts)
}

/// The sides of a run: chorus per transport (or in process), then the peer.
/// Dropped, they go in that order.
struct Sides {
    /// chorus's sides, each with its transport (`local` in process).
    chorus: Vec<(Box<dyn Side>, String)>,
    /// The peer, when `--compare` asked for it and it started.
    gloo: Option<ProcessSide>,
    /// The peer's name in the tables (`torch X gloo`), when it started.
    peer_label: Option<String>,
    /// What stderr and the tables' header say: the binding, a peer that did not start.
    notes: Vec<String>,
}

/// Every answer of the sweep: [side][size][round] every rank's answer; the
/// peer's [size][round] (None: that round failed).
struct Answers {
    chorus: Vec<Vec<Vec<Vec<Raw>>>>,
    gloo: Vec<Vec<Option<Vec<Raw>>>>,
}

impl Sides {
    /// Starts chorus's sides, then the peer's when asked for.
    fn start(args: &CollectiveArgs, timeout: Duration) -> Result<Self> {
        let mut notes = Vec::new();
        let (cpus, bound) = rank_cpus(&args.numa_binding, args.world);
        if !args.in_process {
            notes.push(bound);
        }
        let chorus = Self::start_chorus(args, &cpus, timeout)?;
        let mut sides = Self {
            chorus,
            gloo: None,
            peer_label: None,
            notes,
        };
        if args.compare == Some(Peer::Gloo) {
            sides.start_gloo(args, &cpus, timeout)?;
        }
        Ok(sides)
    }

    /// One in-process side, or a side of rank processes per transport.
    fn start_chorus(
        args: &CollectiveArgs,
        cpus: &[Vec<usize>],
        timeout: Duration,
    ) -> Result<Vec<(Box<dyn Side>, String)>> {
        if args.in_process {
            let side = InProcessSide::start(Spec::from(args), args.world)?;
            return Ok(vec![(Box::new(side), "local".into())]);
        }
        let mut sides: Vec<(Box<dyn Side>, String)> = Vec::new();
        let mut transports = args.transport.clone();
        transports.dedup();
        for transport in transports {
            let mut flags = vec!["bench".to_string(), "--worker".into()];
            flags.extend(worker_flags(args));
            flags.extend(["--timeout".into(), args.timeout.to_string()]);
            if args.check {
                flags.push("--check".into());
            }
            if args.memory {
                flags.push("--memory".into());
            }
            let side = ProcessSide::start_chorus(
                format!("chorus ({transport})"),
                &transport,
                &flags,
                args.world,
                &[],
                cpus,
                timeout,
            )?;
            sides.push((Box::new(side), transport));
        }
        Ok(sides)
    }

    /// Gloo's ranks; without torch, or when they do not start, a note instead.
    fn start_gloo(&mut self, args: &CollectiveArgs, cpus: &[Vec<usize>], timeout: Duration) -> Result<()> {
        let peer = match python_peer(&args.python, "gloo", GLOO_SCRIPT) {
            Ok(peer) => peer,
            Err(e @ PeerError::NoTorch { .. }) => {
                self.notes.push(format!(
                    "--compare gloo: {e}; no comparison (pip install torch to enable it)"
                ));
                return Ok(());
            }
            Err(e) => return Err(e).context("the Gloo script"),
        };
        let mut flags = vec!["-u".to_string(), peer.script.path().to_string_lossy().into_owned()];
        flags.extend(worker_flags(args));
        let env = vec![("OMP_NUM_THREADS".to_string(), "1".to_string())];
        let version = peer.version;
        let mut side = ProcessSide::start(
            format!("gloo (torch {version})"),
            &args.python,
            &flags,
            args.world,
            &env,
            cpus,
        )?;
        // The ranks have read the script once their group formed.
        let ready = side.wait_ready(timeout);
        drop(peer.script);
        match ready {
            Ok(()) => {
                self.peer_label = Some(format!("torch {version} gloo"));
                self.gloo = Some(side);
            }
            Err(e) => self
                .notes
                .push(format!("--compare gloo: Gloo did not start ({e:#}); no comparison")),
        }
        Ok(())
    }

    /// The sweep, alternating the sides per size and round, under a progress bar.
    fn sweep(&mut self, args: &CollectiveArgs, counts: &[usize], timeout: Duration) -> Result<Answers> {
        let rounds = args.rounds as usize;
        let total = (counts.len() * rounds * (self.chorus.len() + usize::from(self.gloo.is_some()))) as u64;
        let bar = indicatif::ProgressBar::with_draw_target(Some(total), indicatif::ProgressDrawTarget::stderr());
        bar.set_style(
            indicatif::ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        let mut sweep = Sweep {
            args,
            timeout,
            bar,
            answers: Answers {
                chorus: vec![Vec::new(); self.chorus.len()],
                gloo: Vec::new(),
            },
        };
        // Piped output shows no table until the end (and no bar where stderr
        // is not a terminal either): a line per finished size says it runs.
        let per_size = !std::io::stdout().is_terminal();
        let result = counts.iter().enumerate().try_for_each(|(done, &count)| {
            sweep.size(self, count)?;
            if per_size {
                sweep.report_size(self, done, counts.len(), count);
            }
            Ok(())
        });
        sweep.bar.finish_and_clear();
        result.map(|()| sweep.answers)
    }

    /// Lets every side's ranks quit.
    fn finish(&mut self) {
        for (side, _) in &mut self.chorus {
            side.finish();
        }
        if let Some(side) = self.gloo.as_mut() {
            side.finish();
        }
    }
}

/// The sweep under way: the answers so far and the progress shown.
struct Sweep<'a> {
    args: &'a CollectiveArgs,
    timeout: Duration,
    bar: indicatif::ProgressBar,
    answers: Answers,
}

impl Sweep<'_> {
    /// Every round of one size, each side in turn; a failed round of the
    /// peer is said and left out, a failed chorus side ends the sweep.
    fn size(&mut self, sides: &mut Sides, count: usize) -> Result<()> {
        let args = self.args;
        let bytes = args.op.bytes(count, args.dtype, args.world);
        self.answers.chorus.iter_mut().for_each(|a| a.push(Vec::new()));
        self.answers.gloo.push(Vec::new());
        for round in 1..=args.rounds as usize {
            for (i, (side, _)) in sides.chorus.iter_mut().enumerate() {
                self.bar
                    .set_message(format!("{} {} B {} round {round}", args.op.name(), bytes, side.label()));
                let raws = side.step(count, self.timeout)?;
                self.answers.chorus[i].last_mut().expect("pushed").push(raws);
                self.bar.inc(1);
            }
            if let Some(side) = sides.gloo.as_mut() {
                self.bar
                    .set_message(format!("{} {} B {} round {round}", args.op.name(), bytes, side.label()));
                let got = match side.step(count, self.timeout) {
                    Ok(raws) => Some(raws),
                    Err(e) => {
                        self.bar.suspend(|| eprintln!("chorus bench: {}: {e:#}", side.label()));
                        None
                    }
                };
                self.answers.gloo.last_mut().expect("pushed").push(got);
                self.bar.inc(1);
            }
        }
        Ok(())
    }

    /// The line saying that a size is done, with each side's median time.
    fn report_size(&self, sides: &Sides, done: usize, sizes: usize, count: usize) {
        let args = self.args;
        let mut times: Vec<String> = sides
            .chorus
            .iter()
            .zip(&self.answers.chorus)
            .map(|((side, _), sizes)| {
                let row = make_row(args, count, &Raw::pool(&sizes[done]));
                format!("{} {:.1} us", side.label(), row.oop.median_us)
            })
            .collect();
        if let (Some(side), Some(rounds)) = (sides.gloo.as_ref(), self.answers.gloo.last()) {
            let ok: Vec<Vec<Raw>> = rounds.iter().flatten().cloned().collect();
            if !ok.is_empty() {
                let row = make_row(args, count, &Raw::pool(&ok));
                times.push(format!("{} {:.1} us", side.label(), row.oop.median_us));
            }
        }
        let bytes = args.op.bytes(count, args.dtype, args.world);
        self.bar.suspend(|| {
            eprintln!(
                "chorus bench: {} {bytes} B done ({} of {sizes} sizes): median {}",
                args.op.name(),
                done + 1,
                times.join(", ")
            )
        });
    }
}

/// The sweep's results, as tables, JSON rows and a plot.
struct Report<'a> {
    args: &'a CollectiveArgs,
    sides: &'a Sides,
    /// Pooled rows per side and size.
    rows: Vec<Vec<Row>>,
    /// The peer's pooled row per size (None: every round failed).
    gloo_rows: Vec<Option<Row>>,
    /// [side][size] the busbw ratios to the peer, round by round.
    ratios: Vec<Vec<(Spread, Spread)>>,
    memcpy: f64,
}

impl<'a> Report<'a> {
    /// Pooled rows per side and size; the peer's per-round rows, for the ratios.
    fn new(args: &'a CollectiveArgs, sides: &'a Sides, counts: &[usize], answers: &Answers) -> Self {
        let rows: Vec<Vec<Row>> = answers
            .chorus
            .iter()
            .map(|sizes| {
                sizes
                    .iter()
                    .zip(counts)
                    .map(|(r, &count)| make_row(args, count, &Raw::pool(r)))
                    .collect()
            })
            .collect();
        let gloo_round_rows: Vec<Vec<Option<Row>>> = answers
            .gloo
            .iter()
            .zip(counts)
            .map(|(r, &count)| {
                r.iter()
                    .map(|a| a.as_ref().map(|raws| make_row(args, count, raws)))
                    .collect()
            })
            .collect();
        let gloo_rows: Vec<Option<Row>> = answers
            .gloo
            .iter()
            .zip(counts)
            .map(|(r, &count)| {
                let ok: Vec<Vec<Raw>> = r.iter().flatten().cloned().collect();
                (!ok.is_empty()).then(|| make_row(args, count, &Raw::pool(&ok)))
            })
            .collect();
        let ratios: Vec<Vec<(Spread, Spread)>> = answers
            .chorus
            .iter()
            .map(|sizes| {
                sizes
                    .iter()
                    .zip(counts)
                    .zip(&gloo_round_rows)
                    .map(|((r, &count), theirs)| {
                        let ours: Vec<Row> = r.iter().map(|raws| make_row(args, count, raws)).collect();
                        round_ratios(&ours, theirs)
                    })
                    .collect()
            })
            .collect();
        Self {
            args,
            sides,
            rows,
            gloo_rows,
            ratios,
            memcpy: super::transport::memcpy_gbps(64 << 20),
        }
    }

    /// How the ranks ran, for the header and the plot's title.
    fn mode(&self) -> &'static str {
        if self.args.in_process {
            "in-process ranks (chorus::spawn)"
        } else {
            "separate processes"
        }
    }

    /// Every `--json` row: chorus's per side and size, then the peer's.
    fn json_rows(&self) -> String {
        let args = self.args;
        let rounds = args.rounds as usize;
        let mut out = String::new();
        for (((_, transport), side_rows), side_ratios) in self.sides.chorus.iter().zip(&self.rows).zip(&self.ratios) {
            for (i, row) in side_rows.iter().enumerate() {
                let theirs = self
                    .gloo_rows
                    .get(i)
                    .and_then(Option::as_ref)
                    .map(|g| (g, side_ratios[i]));
                out.push_str(&json_row(
                    "chorus",
                    transport,
                    args.in_process,
                    row,
                    theirs,
                    rounds,
                    self.memcpy,
                ));
                out.push('\n');
            }
        }
        for row in self.gloo_rows.iter().flatten() {
            out.push_str(&json_row("gloo", "gloo", false, row, None, rounds, self.memcpy));
            out.push('\n');
        }
        out
    }

    /// The header line and notes, a table per chorus side, then the peer's.
    fn print_tables(&self) {
        let args = self.args;
        let spec = Spec::from(args);
        let rounds = args.rounds as usize;
        let peer_label = &self.sides.peer_label;
        println!(
            "# chorus bench: {} {} {}, world {} ({}), {} iters after {} warm-up, {} round{} per size, {}",
            args.op.name(),
            args.dtype.nccl_name(),
            if args.op.reduces() { args.redop.name() } else { "" },
            args.world,
            self.mode(),
            spec.iters,
            spec.warmup,
            rounds,
            if rounds == 1 { "" } else { "s" },
            match peer_label {
                Some(p) => format!("alternating per size and round with {p}"),
                None => "no comparison".into(),
            }
        );
        for note in &self.sides.notes {
            println!("# {note}");
        }
        for (((side, _), side_rows), side_ratios) in self.sides.chorus.iter().zip(&self.rows).zip(&self.ratios) {
            println!("#\n# {}", side.label());
            let peer = peer_label.as_ref().map(|_| ("gloo", side_ratios.as_slice()));
            print!("{}", format_table(side_rows, peer, args.memory, Some(self.memcpy)));
        }
        if let Some(label) = peer_label {
            let present: Vec<Row> = self.gloo_rows.iter().flatten().cloned().collect();
            println!("#\n# {label} (python3 lab/python/bench_gloo.py, one process per rank)");
            print!("{}", format_table(&present, None, false, None));
        }
    }

    /// busbw against size, out of place, a line per side.
    fn draw_plot(&self, path: &std::path::Path) -> Result<()> {
        let args = self.args;
        let mut series: Vec<super::plot::Series> = self
            .sides
            .chorus
            .iter()
            .zip(&self.rows)
            .map(|((side, _), r)| super::plot::Series {
                label: side.label(),
                points: busbw_points(r.iter()),
            })
            .collect();
        if let Some(label) = &self.sides.peer_label {
            series.push(super::plot::Series {
                label: label.clone(),
                points: busbw_points(self.gloo_rows.iter().flatten()),
            });
        }
        let title = format!(
            "{} {}, world {} ({}): busbw, out of place",
            args.op.name(),
            args.dtype.nccl_name(),
            args.world,
            self.mode()
        );
        super::plot::draw(path, &title, &series).map_err(|e| anyhow!("--plot {}: {e}", path.display()))?;
        eprintln!("chorus bench: wrote {}", path.display());
        Ok(())
    }

    /// Wrong elements over every chorus row (`--check`).
    fn wrong(&self) -> u64 {
        self.rows
            .iter()
            .flatten()
            .flat_map(|r| [r.oop.wrong, r.ip.wrong])
            .flatten()
            .sum()
    }
}

/// A plot's points: (bytes, out-of-place busbw) per row.
fn busbw_points<'r>(rows: impl Iterator<Item = &'r Row>) -> Vec<(f64, f64)> {
    rows.map(|row| (row.bytes() as f64, row.busbw(row.oop.avg_us)))
        .collect()
}

/// A number of a `--json` row: to 4 decimals, or `null` when not finite.
fn num(x: f64) -> Option<f64> {
    x.is_finite().then(|| round(x, 1e4))
}

/// One half (out of place or in place) of a `--json` row.
#[derive(Serialize)]
struct HalfJson {
    time_us: Option<f64>,
    median_us: Option<f64>,
    algbw: Option<f64>,
    busbw: Option<f64>,
    median_busbw: Option<f64>,
    wrong: Option<u64>,
}

impl HalfJson {
    fn new(row: &Row, half: &Half) -> Self {
        HalfJson {
            time_us: num(half.avg_us),
            median_us: num(half.median_us),
            algbw: num(row.algbw(half.avg_us)),
            busbw: num(row.busbw(half.avg_us)),
            median_busbw: num(row.busbw(half.median_us)),
            wrong: half.wrong,
        }
    }
}

/// One `--json` row.
#[derive(Serialize)]
struct JsonRow<'a> {
    library: &'a str,
    transport: &'a str,
    in_process: bool,
    op: &'static str,
    world: usize,
    size: usize,
    count: usize,
    #[serde(rename = "type")]
    dtype: &'static str,
    redop: &'static str,
    /// -1 for the collectives without a root.
    root: i64,
    oop: HalfJson,
    ip: HalfJson,
    rounds: usize,
    /// Median over the rounds of chorus/Gloo busbw, then its range.
    gloo_busbw_ratio_oop: Option<f64>,
    gloo_busbw_ratio_oop_min: Option<f64>,
    gloo_busbw_ratio_oop_max: Option<f64>,
    gloo_busbw_ratio_ip: Option<f64>,
    gloo_busbw_ratio_ip_min: Option<f64>,
    gloo_busbw_ratio_ip_max: Option<f64>,
    /// Median time of every round's iterations pooled, chorus/Gloo.
    gloo_median_time_ratio_oop: Option<f64>,
    peak_rss_bytes: Option<u64>,
    memcpy_gbps: Option<f64>,
}

/// One `--json` row, as a line; `gloo` is the peer's row and the rounds' ratios.
fn json_row(
    library: &str,
    transport: &str,
    in_process: bool,
    row: &Row,
    gloo: Option<(&Row, (Spread, Spread))>,
    rounds: usize,
    memcpy: f64,
) -> String {
    let ratio = |f: &dyn Fn(&Row) -> f64| gloo.and_then(|(g, _)| num(f(row) / f(g)));
    let spread = |f: &dyn Fn(&(Spread, Spread)) -> f64| gloo.and_then(|(_, s)| num(f(&s)));
    to_line(&JsonRow {
        library,
        transport,
        in_process,
        op: row.op.name(),
        world: row.world,
        size: row.bytes(),
        count: row.count,
        dtype: row.dtype.nccl_name(),
        redop: if row.op.reduces() { row.redop.name() } else { "none" },
        root: if row.op.rooted() { row.root as i64 } else { -1 },
        oop: HalfJson::new(row, &row.oop),
        ip: HalfJson::new(row, &row.ip),
        rounds,
        gloo_busbw_ratio_oop: spread(&|s| s.0.median),
        gloo_busbw_ratio_oop_min: spread(&|s| s.0.min),
        gloo_busbw_ratio_oop_max: spread(&|s| s.0.max),
        gloo_busbw_ratio_ip: spread(&|s| s.1.median),
        gloo_busbw_ratio_ip_min: spread(&|s| s.1.min),
        gloo_busbw_ratio_ip_max: spread(&|s| s.1.max),
        gloo_median_time_ratio_oop: ratio(&|r| r.oop.median_us),
        peak_rss_bytes: row.peak_rss,
        memcpy_gbps: num(memcpy),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::measure::{count_wrong, input_value, make_tensor, peak_rss, reduce_values, reset_peak_rss};

    #[test]
    fn sizes_parse_like_nccl_tests() {
        assert_eq!(parse_size("8"), Ok(8));
        assert_eq!(parse_size("64K"), Ok(64 << 10));
        assert_eq!(parse_size("64M"), Ok(64 << 20));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert!(parse_size("x").is_err());
        assert!(parse_size("12Q").is_err());
        assert_eq!(sizes(8, 64, 2), vec![8, 16, 32, 64]);
        assert_eq!(sizes(8, 100, 4), vec![8, 32]);
        assert_eq!(sizes(8, 8, 2), vec![8]);
        assert_eq!(sizes(8, 64, 1), vec![8]);
    }

    #[test]
    fn bus_factors_and_sizes_follow_the_conventions() {
        assert_eq!(BenchOp::AllReduce.bus_factor(4), 1.5);
        assert_eq!(BenchOp::AllReduce.bus_factor(2), 1.0);
        assert_eq!(BenchOp::AllGather.bus_factor(4), 0.75);
        assert_eq!(BenchOp::ReduceScatter.bus_factor(2), 0.5);
        assert_eq!(BenchOp::AllToAll.bus_factor(8), 0.875);
        for op in [BenchOp::Broadcast, BenchOp::Reduce, BenchOp::SendRecv] {
            assert_eq!(op.bus_factor(4), 1.0);
        }
        assert_eq!(BenchOp::AllReduce.count_for(64 << 20, DType::Float32, 4), 16 << 20);
        assert_eq!(BenchOp::AllGather.count_for(64 << 20, DType::Float32, 4), 4 << 20);
        assert_eq!(BenchOp::AllGather.bytes(4 << 20, DType::Float32, 4), 64 << 20);
        // 1 GB in 1 s of all-reduce over 4 ranks: algbw 1, busbw 1.5.
        let row = Row {
            op: BenchOp::AllReduce,
            count: 250_000_000,
            dtype: DType::Float32,
            redop: ReduceOp::Sum,
            root: 0,
            world: 4,
            oop: Half {
                avg_us: 1e6,
                median_us: 1e6,
                wrong: None,
            },
            ip: Half {
                avg_us: 1e6,
                median_us: 1e6,
                wrong: None,
            },
            peak_rss: None,
        };
        assert!((row.algbw(1e6) - 1.0).abs() < 1e-12);
        assert!((row.busbw(1e6) - 1.5).abs() < 1e-12);
    }

    #[test]
    fn table_lines_line_up_with_the_header() {
        let header = format_header(None, false);
        let lines: Vec<&str> = header.lines().collect();
        assert_eq!(
            lines[1],
            "#       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw   busbw  #wrong"
        );
        assert!(lines[2].starts_with("#        (B)    (elements)                               (us)  (GB/s)  (GB/s)             (us)  (GB/s)  (GB/s)"));
        let row = Row {
            op: BenchOp::AllGather,
            count: 2,
            dtype: DType::Float32,
            redop: ReduceOp::Sum,
            root: 0,
            world: 2,
            oop: Half {
                avg_us: 12.3456,
                median_us: 12.0,
                wrong: Some(0),
            },
            ip: Half {
                avg_us: 12345.6,
                median_us: 12000.0,
                wrong: Some(3),
            },
            peak_rss: Some(40),
        };
        let line = format_row(&row, None, false);
        assert_eq!(line.len(), lines[1].len(), "{line}");
        assert_eq!(
            line,
            "          16             2     float    none      -1    12.35    0.00    0.00       0    12346    0.00    0.00       3"
        );
        // Every column ends where its header does.
        let ends = |s: &str| -> Vec<usize> {
            s.char_indices()
                .filter(|&(i, c)| c != ' ' && (s[i + 1..].starts_with(' ') || i + 1 == s.len()))
                .map(|(i, _)| i)
                .collect()
        };
        assert_eq!(ends(&line), ends(lines[1])[1..], "the '#' aside");
        let one = Spread::of(&[1.5]);
        let with_ratio = format_row(&row, Some((one, Spread::of(&[2.0]))), false);
        assert_eq!(
            &with_ratio[line.len()..],
            "    1.50x                  2.00x              "
        );
        let rounds = Spread::of(&[1.2, f64::NAN, 1.8, 1.5]);
        let with_rounds = format_row(&row, Some((rounds, rounds)), true);
        assert!(
            with_rounds.contains("    1.50x   [1.20-1.80]    1.50x   [1.20-1.80]"),
            "{with_rounds}"
        );
        // A 40-byte peak for 16 bytes.
        assert!(with_rounds.ends_with("       0    2.50"), "{with_rounds}");
        // The extra columns end where their headers do.
        let wide: Vec<String> = format_header(Some("gloo"), true).lines().map(String::from).collect();
        assert_eq!(ends(&with_rounds), ends(&wide[1])[1..], "{with_rounds}\n{}", wide[1]);
        let table = format_table(std::slice::from_ref(&row), None, false, Some(10.0));
        assert!(table.contains("# Avg bus bandwidth : "), "{table}");
        assert!(table.contains("# Out of bounds values : 3 FAILED"), "{table}");
        assert!(
            table.contains("# Single-thread memcpy bandwidth : 10.00 GB/s"),
            "{table}"
        );
    }

    #[test]
    fn references_match_hand_computed_results() {
        let spec = Spec {
            op: BenchOp::AllReduce,
            dtype: DType::Float32,
            redop: ReduceOp::Sum,
            root: 0,
            iters: 1,
            warmup: 0,
            check: true,
            memory: false,
        };
        // Ranks 0,1 element 0: 1 + (0+3)%3+1 = 1 + 1 = 2.
        assert_eq!(spec.expected(0, 2, 4, 0), Some(2.0));
        let gathered = Spec {
            op: BenchOp::AllGather,
            ..spec.clone()
        };
        assert_eq!(gathered.expected(0, 2, 4, 5), Some(input_value(1, 1)));
        let reduced = Spec {
            op: BenchOp::Reduce,
            ..spec.clone()
        };
        assert_eq!(reduced.expected(1, 2, 4, 0), None);
        assert_eq!(
            reduce_values(DType::Int8, ReduceOp::Prod, [16.0, 16.0].into_iter()),
            0.0
        );
        assert_eq!(reduce_values(DType::Int32, ReduceOp::Avg, [1.0, 2.0].into_iter()), 1.0);
        let out = make_tensor(DType::BFloat16, 8, |i| input_value(0, i) + input_value(1, i));
        assert_eq!(count_wrong(&spec_with(DType::BFloat16), 0, 2, 8, &out), 0);
        assert_eq!(count_wrong(&spec_with(DType::BFloat16), 0, 2, 9, &out), 1);
    }

    fn spec_with(dtype: DType) -> Spec {
        Spec {
            op: BenchOp::AllReduce,
            dtype,
            redop: ReduceOp::Sum,
            root: 0,
            iters: 1,
            warmup: 0,
            check: true,
            memory: false,
        }
    }

    #[test]
    fn medians_and_means_over_ranks() {
        let half = Half::from_ranks(&[vec![1.0, 3.0, 100.0], vec![3.0, 5.0, 100.0]], Some(0));
        assert_eq!(half.median_us, 4.0);
        assert!((half.avg_us - (2.0 + 4.0 + 100.0) / 3.0).abs() < 1e-12);
    }

    #[test]
    fn worker_lines_round_trip_and_gloo_lines_read() {
        let raw = Raw {
            oop: vec![1.23456, 2.0],
            ip: vec![3.5],
            wrong_oop: Some(0),
            wrong_ip: None,
            peak_rss: None,
        };
        let line = raw.to_json(1, 64);
        assert_eq!(
            line,
            r#"{"rank":1,"count":64,"oop":[1.235,2.0],"ip":[3.5],"wrong_oop":0,"wrong_ip":null}"#
        );
        let back = Raw::from_json(serde_json::from_str(&line).unwrap()).unwrap();
        assert_eq!(
            (back.oop, back.ip, back.wrong_oop, back.wrong_ip),
            (vec![1.235, 2.0], vec![3.5], Some(0), None)
        );
        // bench_gloo.py's lines: json.dumps spacing, no wrong_* members.
        let gloo =
            Raw::from_json(serde_json::from_str(r#"{"rank": 0, "count": 8, "oop": [12.5, 3], "ip": [1e1]}"#).unwrap())
                .unwrap();
        assert_eq!((gloo.oop, gloo.ip, gloo.wrong_oop), (vec![12.5, 3.0], vec![10.0], None));
        let error = to_line(&WorkerLine {
            rank: 2,
            count: 8,
            answer: WorkerError {
                error: "a \"b\"\nc".into(),
            },
        });
        assert_eq!(
            Raw::from_json(serde_json::from_str(&error).unwrap()).unwrap_err(),
            "a \"b\"\nc"
        );
        let bad = Raw::from_json(serde_json::json!({"oop": [1, "x"], "ip": []})).unwrap_err();
        assert!(bad.starts_with("a result line: "), "{bad}");
        let with_rss = Raw {
            peak_rss: Some(4096),
            ..Raw::default()
        };
        let line = with_rss.to_json(0, 8);
        assert!(line.ends_with(r#""peak_rss":4096}"#), "{line}");
        assert_eq!(
            Raw::from_json(serde_json::from_str(&line).unwrap()).unwrap().peak_rss,
            Some(4096)
        );
        assert_eq!(num(f64::INFINITY), None);
        assert_eq!(num(2.0 / 3.0), Some(0.6667));
    }

    #[test]
    fn rounds_pool_iterations_and_ratios_are_medians_of_rounds() {
        let spread = Spread::of(&[3.0, 1.0, f64::NAN, 2.0]);
        assert_eq!(
            (spread.median, spread.min, spread.max, spread.rounds),
            (2.0, 1.0, 3.0, 3)
        );
        assert!(Spread::of(&[]).median.is_nan());
        let raw = |oop: f64, rss: u64| Raw {
            oop: vec![oop],
            ip: vec![oop / 2.0],
            wrong_oop: Some(1),
            wrong_ip: None,
            peak_rss: Some(rss),
        };
        let pooled = Raw::pool(&[vec![raw(1.0, 10), raw(2.0, 30)], vec![raw(3.0, 20), raw(4.0, 5)]]);
        assert_eq!(pooled.len(), 2);
        assert_eq!(pooled[0].oop, vec![1.0, 3.0]);
        assert_eq!(pooled[1].ip, vec![1.0, 2.0]);
        assert_eq!((pooled[0].wrong_oop, pooled[0].wrong_ip), (Some(2), None));
        assert_eq!((pooled[0].peak_rss, pooled[1].peak_rss), (Some(20), Some(30)));
        // chorus takes 10 us then 40 us; the peer 20 us, fails, then 20 us:
        // ratios 2 and 0.5 (the failed round is left out), median 1.25.
        let row = |us: f64| Row {
            op: BenchOp::AllReduce,
            count: 2,
            dtype: DType::Float32,
            redop: ReduceOp::Sum,
            root: 0,
            world: 2,
            oop: Half {
                avg_us: us,
                median_us: us,
                wrong: None,
            },
            ip: Half {
                avg_us: us * 2.0,
                median_us: us,
                wrong: None,
            },
            peak_rss: None,
        };
        let (oop, ip) = round_ratios(
            &[row(10.0), row(1.0), row(40.0)],
            &[Some(row(20.0)), None, Some(row(20.0))],
        );
        assert_eq!((oop.median, oop.min, oop.max, oop.rounds), (1.25, 0.5, 2.0, 2));
        assert_eq!(ip, oop);
    }

    #[test]
    fn peak_rss_reads_vmhwm_and_resets() {
        if !std::path::Path::new("/proc/self/status").exists() {
            return;
        }
        let before = peak_rss().expect("VmHWM in /proc/self/status");
        // 64 MiB touched: the peak grows by about that much.
        let big = std::hint::black_box(vec![1u8; 64 << 20]);
        let during = peak_rss().unwrap();
        assert!(during >= before.max(big.len() as u64), "{before} -> {during}");
        drop(big);
        reset_peak_rss();
        let after = peak_rss().unwrap();
        assert!(after < during, "the reset peak {after} is below {during}");
    }
}
