//! All-reduce through chorus's supervised NCCL backend on every GPU of this
//! machine, one rank per GPU (threads of one process), with a correctness
//! check and nccl-tests' table (out-of-place, then in-place).
//!
//! ```text
//! cargo run --release --example nccl_all_reduce -- --min-bytes 1K --max-bytes 256M
//! ```
//!
//! Exits 2, with the reason, where CUDA or NCCL is missing; 1 when a result
//! is wrong or an operation fails.
//!
//! Times include chorus's per-operation completion (each operation is
//! launched once the previous one has completed on the device and the actor
//! has seen it), unlike nccl-tests, which times a batch on the stream: small
//! sizes show that overhead.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use chorus_actors::nccl::{
    CommKey, CudaBackend, CudaBuffer, NcclCollective, NcclGroup, NcclGroupConfig, NcclOp, init_communicator, probe,
};
use chorus_runtime::collective::{DType, ReduceOp};
use chorus_runtime::store::HashStore;
use clap::Parser;

#[derive(Debug, Parser)]
#[command(about = "All-reduce float32 sums on every GPU through chorus's NCCL backend")]
struct Args {
    /// Smallest size (bytes; K, M, G suffixes).
    #[arg(short = 'b', long, default_value = "1K", value_parser = parse_size)]
    min_bytes: usize,
    /// Largest size.
    #[arg(short = 'e', long, default_value = "256M", value_parser = parse_size)]
    max_bytes: usize,
    /// Multiply the size by this between rows.
    #[arg(short = 'f', long, default_value_t = 4)]
    factor: usize,
    /// Timed iterations per size.
    #[arg(short = 'n', long, default_value_t = 20)]
    iters: usize,
    /// Untimed iterations first.
    #[arg(short = 'w', long, default_value_t = 5)]
    warmup: usize,
    /// Ranks (GPUs) to use; all visible ones by default.
    #[arg(short = 'g', long)]
    gpus: Option<usize>,
}

fn parse_size(text: &str) -> Result<usize, String> {
    let (digits, scale) = match text.chars().last() {
        Some('K' | 'k') => (&text[..text.len() - 1], 1 << 10),
        Some('M' | 'm') => (&text[..text.len() - 1], 1 << 20),
        Some('G' | 'g') => (&text[..text.len() - 1], 1 << 30),
        _ => (text, 1),
    };
    digits
        .parse::<usize>()
        .map(|n| n * scale)
        .map_err(|e| format!("{text:?}: {e}"))
}

/// One row for one rank: seconds per iteration and wrong elements, out of
/// place then in place.
#[derive(Debug, Clone, Copy)]
struct Row {
    bytes: usize,
    times: [f64; 2],
    wrong: [usize; 2],
}

fn pattern(rank: usize, count: usize) -> Vec<u8> {
    (0..count)
        .flat_map(|i| (((rank + 1) * (i % 13)) as f32).to_ne_bytes())
        .collect()
}

fn count_wrong(bytes: &[u8], world: usize) -> usize {
    let ranks: usize = (1..=world).sum();
    bytes
        .chunks_exact(4)
        .enumerate()
        .filter(|(i, c)| f32::from_ne_bytes((*c).try_into().unwrap_or_default()) != (ranks * (i % 13)) as f32)
        .count()
}

/// Runs `iters` all-reduces of `count` floats (in place when `input` is
/// `None`) and returns the seconds per iteration and the buffers.
async fn timed(
    group: &NcclGroup<chorus_actors::nccl::CudaComm>,
    count: usize,
    iters: usize,
    mut input: Option<CudaBuffer>,
    mut output: CudaBuffer,
) -> anyhow::Result<(f64, Option<CudaBuffer>, CudaBuffer)> {
    let in_place = input.is_none();
    let started = Instant::now();
    for _ in 0..iters {
        let done = group
            .submit(NcclCollective {
                op: NcclOp::all_reduce(DType::Float32, count, ReduceOp::Sum),
                input: input.take(),
                output,
                timeout: None,
            })
            .await?;
        (input, output) = (done.input, done.output);
    }
    debug_assert_eq!(input.is_none(), in_place);
    Ok((started.elapsed().as_secs_f64() / iters.max(1) as f64, input, output))
}

async fn rank_main(
    rank: usize,
    world: usize,
    store: Arc<HashStore>,
    args: Arc<Args>,
) -> anyhow::Result<(String, Vec<Row>)> {
    let backend = CudaBackend::new(rank)?;
    let device = format!("rank {rank}: device {} {}", backend.ordinal(), backend.device_name()?);
    let comm = init_communicator(
        &backend,
        &*store,
        &CommKey::world("nccl-all-reduce", 0),
        rank,
        world,
        Duration::from_secs(120),
    )
    .await?;
    let group = NcclGroup::start(comm, NcclGroupConfig::default())?;
    let mut rows = Vec::new();
    let mut bytes = args.min_bytes.max(4);
    while bytes <= args.max_bytes {
        let count = bytes / 4;
        let mut row = Row {
            bytes: count * 4,
            times: [0.0; 2],
            wrong: [0; 2],
        };
        for (slot, in_place) in [false, true].into_iter().enumerate() {
            let fresh_input = || backend.upload(&pattern(rank, count));
            let (input, output) = if in_place {
                (None, fresh_input()?)
            } else {
                (Some(fresh_input()?), backend.zeros(count * 4)?)
            };
            let (_, input, output) = timed(&group, count, args.warmup, input, output).await?;
            let (seconds, input, output) = timed(&group, count, args.iters, input, output).await?;
            row.times[slot] = seconds;
            // The check runs once more on fresh data: repeated in-place sums grow.
            let (input, output) = match input {
                Some(input) => (Some(input), output),
                None => (None, fresh_input()?),
            };
            let (_, _, output) = timed(&group, count, 1, input, output).await?;
            row.wrong[slot] = count_wrong(&backend.download(&output)?, world);
        }
        rows.push(row);
        bytes = bytes.saturating_mul(args.factor.max(2));
    }
    Ok((device, rows))
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let found = match probe() {
        Ok(found) => found,
        Err(e) => {
            eprintln!("nccl_all_reduce: {e}");
            std::process::exit(2);
        }
    };
    let world = args.gpus.unwrap_or(found.devices);
    if world == 0 || world > found.devices {
        bail!("--gpus {world}: {} device(s) visible", found.devices);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(world.clamp(2, 16))
        .enable_all()
        .build()?;
    let args = Arc::new(args);
    let results = runtime.block_on(async {
        let store = Arc::new(HashStore::new(Duration::from_secs(120)));
        let tasks: Vec<_> = (0..world)
            .map(|rank| tokio::spawn(rank_main(rank, world, store.clone(), args.clone())))
            .collect();
        let mut results = Vec::new();
        for (rank, task) in tasks.into_iter().enumerate() {
            results.push(task.await.with_context(|| format!("rank {rank}"))??);
        }
        anyhow::Ok(results)
    })?;
    println!(
        "# chorus nccl_all_reduce: {world} rank(s), NCCL {}, CUDA driver {}.{}",
        found.nccl,
        found.driver_version / 1000,
        found.driver_version % 1000 / 10
    );
    for (device, _) in &results {
        println!("#  {device}");
    }
    println!(
        "#{:>11}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}",
        "size",
        "count",
        "type",
        "redop",
        "root",
        "time",
        "algbw",
        "busbw",
        "#wrong",
        "time",
        "algbw",
        "busbw",
        "#wrong"
    );
    println!(
        "#{:>11}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}",
        "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", ""
    );
    let factor = 2.0 * (world as f64 - 1.0) / world as f64;
    let (mut busbw_sum, mut samples, mut wrong_total) = (0.0, 0usize, 0usize);
    for (i, row) in results[0].1.iter().enumerate() {
        let mut line = format!(
            "{:>12}  {:>12}  {:>8}  {:>6}  {:>6}",
            row.bytes,
            row.bytes / 4,
            "float",
            "sum",
            -1
        );
        for slot in 0..2 {
            // The slowest rank's time, the sum of every rank's wrong elements.
            let seconds = results.iter().map(|(_, rows)| rows[i].times[slot]).fold(0.0, f64::max);
            let wrong: usize = results.iter().map(|(_, rows)| rows[i].wrong[slot]).sum();
            let algbw = row.bytes as f64 / seconds / 1e9;
            let busbw = algbw * factor;
            busbw_sum += busbw;
            samples += 1;
            wrong_total += wrong;
            line += &format!("  {:>7.1}  {:>6.2}  {:>6.2}  {:>6}", seconds * 1e6, algbw, busbw, wrong);
        }
        println!("{line}");
    }
    println!(
        "# Out of bounds values : {wrong_total} {}",
        if wrong_total == 0 { "OK" } else { "FAILED" }
    );
    println!("# Avg bus bandwidth    : {:.3}", busbw_sum / samples.max(1) as f64);
    if wrong_total > 0 {
        std::process::exit(1);
    }
    Ok(())
}
