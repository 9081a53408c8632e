//! `chorus bench tune`: the all-reduce switch points measured per transport.
//!
//! For each transport it starts one group of `--world` rank processes per
//! candidate algorithm (forced with `CHORUS_ALGO`), walks the sizes and, per
//! size and round, asks every group in turn, so noise hits the candidates
//! alike. A size's time is the median over rounds of the in-place median
//! (the collective alone, without the out-of-place input copy).
//! [`crossovers`] (pure, unit-tested) turns the table into [`Thresholds`],
//! printed as the `CHORUS_ALGO_THRESHOLDS` line a user exports, as NCCL users
//! set `NCCL_ALGO` from their own measurements; without it the group keeps the
//! defaults.

use std::fmt::Write as _;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Result, bail};
use chorus_runtime::collective::{Algorithm, DType, Thresholds};

use super::collective::{BINDINGS, in_place_median_us, parse_size, rank_cpus, sizes};
use super::common::Spread;
use super::side::{ProcessSide, Side};

/// `chorus bench tune` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct TuneArgs {
    /// Number of ranks (the thresholds depend on it; tune at the job's size).
    #[arg(long, default_value_t = 2)]
    pub world: usize,
    /// CHORUS_TRANSPORT values to tune, comma-separated; each gets its own table.
    #[arg(long, default_value = "auto", value_delimiter = ',')]
    pub transport: Vec<String>,
    /// Smallest size, bytes (K, M, G suffixes).
    #[arg(short = 'b', long = "minbytes", default_value = "4K", value_parser = parse_size)]
    pub min_bytes: usize,
    /// Largest size, bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "16M", value_parser = parse_size)]
    pub max_bytes: usize,
    /// Multiply the size by this from one row to the next.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
    pub step_factor: usize,
    /// Timed iterations per size, candidate and round.
    #[arg(short = 'n', long, default_value_t = 10)]
    pub iters: usize,
    /// Untimed iterations before them.
    #[arg(short = 'w', long, default_value_t = 3)]
    pub warmup: usize,
    /// Rounds per size (the candidates alternate each round).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    pub rounds: u64,
    /// Seconds allowed for forming each group and for each size.
    #[arg(long, default_value_t = 300)]
    pub timeout: u64,
    /// Bind each rank process as `chorus bench` does (its `--numa-binding`),
    /// so the thresholds hold for the runs they tune.
    #[arg(long, default_value = "exclusive", value_parser = BINDINGS)]
    pub numa_binding: String,
}

/// The all-reduce algorithms that compete at `world` ranks: at two,
/// halving-doubling is recursive doubling in two messages, so it is left out.
pub fn candidates(world: usize) -> Vec<Algorithm> {
    if world <= 2 {
        vec![Algorithm::RecursiveDoubling, Algorithm::Ring]
    } else {
        vec![
            Algorithm::RecursiveDoubling,
            Algorithm::HalvingDoubling,
            Algorithm::Ring,
        ]
    }
}

/// The switch points a table shows: `sizes` ascending, `times[i][j]` the
/// time of `candidates[j]` at `sizes[i]` (non-finite where not measured).
///
/// Recursive doubling runs up to the largest size where it is the fastest;
/// halving-doubling up to the largest size where it beats the ring (never
/// below recursive doubling's threshold). Taking the largest winning size
/// ignores one noisy small size. An algorithm that never wins gets 0 (off),
/// and without halving-doubling (two ranks) both thresholds are recursive
/// doubling's.
pub fn crossovers(candidates: &[Algorithm], sizes: &[usize], times: &[Vec<f64>]) -> Thresholds {
    let column = |a: Algorithm| candidates.iter().position(|&c| c == a);
    let time = |i: usize, col: Option<usize>| {
        col.and_then(|j| times[i].get(j).copied())
            .filter(|t| t.is_finite())
            .unwrap_or(f64::INFINITY)
    };
    let (rd, hd, ring) = (
        column(Algorithm::RecursiveDoubling),
        column(Algorithm::HalvingDoubling),
        column(Algorithm::Ring),
    );
    let largest_where = |wins: &dyn Fn(usize) -> bool| {
        (0..sizes.len().min(times.len()))
            .filter(|&i| wins(i))
            .map(|i| sizes[i])
            .max()
            .unwrap_or(0)
    };
    let rd_max = largest_where(&|i| {
        let t = time(i, rd);
        t.is_finite() && t <= time(i, hd) && t <= time(i, ring)
    });
    let hd_max = if hd.is_some() {
        largest_where(&|i| {
            let t = time(i, hd);
            t.is_finite() && t <= time(i, ring)
        })
        .max(rd_max)
    } else {
        rd_max
    };
    Thresholds {
        recursive_doubling_max: rd_max,
        halving_doubling_max: hd_max,
    }
}

/// The table of one transport, its crossovers and the line to export.
pub fn format_tune(
    transport: &str,
    world: usize,
    candidates: &[Algorithm],
    sizes: &[usize],
    times: &[Vec<Spread>],
) -> String {
    let mut s = String::new();
    let rounds = times.iter().flatten().map(|t| t.rounds).max().unwrap_or(0);
    let _ = writeln!(
        s,
        "# chorus bench tune: all_reduce float sum, world {world}, CHORUS_TRANSPORT={transport}; in-place time (us), median of {rounds} rounds [min-max]"
    );
    let _ = write!(s, "#{:>11}", "size");
    for a in candidates {
        let _ = write!(s, "  {:>28}", a.name());
    }
    let _ = writeln!(s, "  fastest");
    for (i, &size) in sizes.iter().enumerate() {
        let _ = write!(s, "{size:>12}");
        let row = &times[i];
        for t in row {
            let cell = if t.rounds == 0 {
                "N/A".to_string()
            } else {
                format!("{:.1} [{:.1}-{:.1}]", t.median, t.min, t.max)
            };
            let _ = write!(s, "  {cell:>28}");
        }
        let fastest = row
            .iter()
            .enumerate()
            .filter(|(_, t)| t.median.is_finite())
            .min_by(|a, b| a.1.median.total_cmp(&b.1.median))
            .map_or("N/A", |(j, _)| candidates[j].name());
        let _ = writeln!(s, "  {fastest}");
    }
    let medians: Vec<Vec<f64>> = times.iter().map(|r| r.iter().map(|t| t.median).collect()).collect();
    let t = crossovers(candidates, sizes, &medians);
    let largest = sizes.last().copied().unwrap_or(0);
    let describe = |what: &str, max: usize| match max {
        0 => format!("# {what}: never the fastest here (off)"),
        m if m == largest => format!("# {what}: up to {m} B, the largest size measured (it may win beyond)"),
        m => format!("# {what}: up to {m} B"),
    };
    let _ = writeln!(s, "{}", describe("recursive_doubling", t.recursive_doubling_max));
    if candidates.contains(&Algorithm::HalvingDoubling) {
        let _ = writeln!(s, "{}", describe("halving_doubling", t.halving_doubling_max));
    }
    let _ = writeln!(s, "# defaults: {}", Thresholds::default());
    let _ = writeln!(s, "export CHORUS_ALGO_THRESHOLDS={t}");
    s
}

/// The parent: one side per candidate algorithm and transport, alternating per size and round.
pub fn run(args: &TuneArgs) -> Result<ExitCode> {
    if args.world < 2 {
        bail!("--world must be at least 2 (one rank has nothing to choose)");
    }
    if args.min_bytes > args.max_bytes {
        bail!("-b {} is larger than -e {}", args.min_bytes, args.max_bytes);
    }
    let dtype = DType::Float32;
    let sizes: Vec<usize> = sizes(args.min_bytes, args.max_bytes, args.step_factor)
        .into_iter()
        .map(|b| b / dtype.size() * dtype.size())
        .filter(|&b| b > 0)
        .collect();
    if sizes.is_empty() {
        bail!("no size in -b {} -e {} holds one float", args.min_bytes, args.max_bytes);
    }
    let timeout = Duration::from_secs(args.timeout);
    let candidates = candidates(args.world);
    let flags: Vec<String> = [
        "bench",
        "--worker",
        "--op",
        "all_reduce",
        "--dtype",
        "float",
        "--redop",
        "sum",
    ]
    .into_iter()
    .map(String::from)
    .chain([
        "--iters".into(),
        args.iters.max(1).to_string(),
        "--warmup".into(),
        args.warmup.to_string(),
        "--timeout".into(),
        args.timeout.to_string(),
    ])
    .collect();
    let (cpus, bound) = rank_cpus(&args.numa_binding, args.world);
    println!("# {bound}");
    let mut transports = args.transport.clone();
    transports.dedup();
    for transport in transports {
        let mut sides = Vec::new();
        for &algo in &candidates {
            let algo_env = ("CHORUS_ALGO".to_string(), format!("all_reduce={}", algo.name()));
            sides.push(ProcessSide::start_chorus(
                format!("chorus ({transport}, {algo})"),
                &transport,
                &flags,
                args.world,
                &[algo_env],
                &cpus,
                timeout,
            )?);
        }
        let mut table: Vec<Vec<Spread>> = Vec::new();
        for &size in &sizes {
            let count = size / dtype.size();
            let mut per_round = vec![Vec::new(); sides.len()];
            for _ in 0..args.rounds {
                for (j, side) in sides.iter_mut().enumerate() {
                    eprint!("\rchorus bench tune: {transport} {size} B {}          ", candidates[j]);
                    per_round[j].push(in_place_median_us(&side.step(count, timeout)?));
                }
            }
            table.push(per_round.iter().map(|r| Spread::of(r)).collect());
        }
        eprint!("\r{:70}\r", "");
        for side in &mut sides {
            side.finish();
        }
        print!("{}", format_tune(&transport, args.world, &candidates, &sizes, &table));
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    const RD: Algorithm = Algorithm::RecursiveDoubling;
    const HD: Algorithm = Algorithm::HalvingDoubling;
    const RING: Algorithm = Algorithm::Ring;

    #[test]
    fn crossovers_follow_the_fastest() {
        let sizes = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20];
        // Doubling wins up to 64K, halving-doubling up to 1M, the ring above.
        let times = vec![
            vec![10.0, 12.0, 20.0],
            vec![30.0, 31.0, 40.0],
            vec![90.0, 70.0, 80.0],
            vec![300.0, 200.0, 210.0],
            vec![1200.0, 900.0, 700.0],
        ];
        let t = crossovers(&[RD, HD, RING], &sizes, &times);
        assert_eq!((t.recursive_doubling_max, t.halving_doubling_max), (64 << 10, 1 << 20));
        // One noisy small size where the ring wins does not move the switch.
        let mut noisy = times.clone();
        noisy[0] = vec![10.0, 12.0, 9.0];
        assert_eq!(crossovers(&[RD, HD, RING], &sizes, &noisy), t);
        // The ring everywhere: both off.
        let ring_wins: Vec<Vec<f64>> = sizes.iter().map(|_| vec![2.0, 2.0, 1.0]).collect();
        let off = crossovers(&[RD, HD, RING], &sizes, &ring_wins);
        assert_eq!((off.recursive_doubling_max, off.halving_doubling_max), (0, 0));
        // Halving-doubling never below doubling's threshold.
        let rd_everywhere: Vec<Vec<f64>> = sizes.iter().map(|_| vec![1.0, 3.0, 2.0]).collect();
        let rd = crossovers(&[RD, HD, RING], &sizes, &rd_everywhere);
        assert_eq!((rd.recursive_doubling_max, rd.halving_doubling_max), (4 << 20, 4 << 20));
    }

    #[test]
    fn two_ranks_compare_doubling_with_the_ring_only() {
        assert_eq!(candidates(2), vec![RD, RING]);
        assert_eq!(candidates(4), vec![RD, HD, RING]);
        let sizes = [1 << 10, 1 << 20, 16 << 20];
        let times = vec![vec![5.0, 9.0], vec![400.0, 450.0], vec![9000.0, 6000.0]];
        let t = crossovers(&candidates(2), &sizes, &times);
        assert_eq!((t.recursive_doubling_max, t.halving_doubling_max), (1 << 20, 1 << 20));
        // A size not measured (NaN) never wins; short rows are tolerated.
        let gaps = vec![vec![f64::NAN, 9.0], vec![400.0], vec![]];
        let g = crossovers(&candidates(2), &sizes, &gaps);
        assert_eq!(g.recursive_doubling_max, 1 << 20);
    }

    #[test]
    fn the_table_ends_with_the_line_to_export() {
        let sizes = [4096, 8192];
        let spread = |m: f64| Spread::of(&[m, m * 1.1, m * 0.9]);
        let times = vec![vec![spread(10.0), spread(20.0)], vec![spread(50.0), spread(30.0)]];
        let out = format_tune("shm", 2, &candidates(2), &sizes, &times);
        assert!(
            out.starts_with("# chorus bench tune: all_reduce float sum, world 2, CHORUS_TRANSPORT=shm;"),
            "{out}"
        );
        let row = out
            .lines()
            .find(|l| l.trim_start().starts_with("4096 "))
            .expect("a 4096 row");
        assert!(
            row.contains(" 10.0 [9.0-11.0] ") && row.ends_with("  recursive_doubling"),
            "{out}"
        );
        assert!(out.contains("# recursive_doubling: up to 4096 B\n"), "{out}");
        assert!(
            out.ends_with("export CHORUS_ALGO_THRESHOLDS=recursive_doubling=4K,halving_doubling=4K\n"),
            "{out}"
        );
        let parsed = Thresholds::parse(out.lines().last().unwrap().split_once('=').unwrap().1).unwrap();
        assert_eq!(parsed.recursive_doubling_max, 4096);
    }
}
