//! `chorus bench transfer`: live state transfer ([`sync_state`]) from S
//! sources to one joiner, rank processes on this machine, for each
//! (transport, size, sources); beside it, in the same group, the link's own
//! throughput: a plain stream of frames of the chunk size from one source
//! to the joiner, which drops them unread (what `chorus bench transport`
//! measures).
//!
//! Each configuration is one set of `S + 1` rank processes (`chorus bench
//! transfer --worker`): ranks `0..S` hold the state at step 1, rank `S`
//! joins with none and receives it `--rounds` times after one untimed
//! round; the link is measured as many times, alternating with them. Rank 0
//! prints one JSON line with the medians. The joiner's state is checked
//! against the sources' with [`verify_state`] at the end.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use clap::Args;
use serde::Serialize;
use serde_json::Value;

use chorus::group::ProcessGroup;
use chorus::tensor::Tensor;
use chorus::train::{NamedState, TransferOptions, sync_state, verify_state};

use super::common::median;

/// The channel of the plain link measurement (beside the transfer's).
const LINK_CHANNEL: u32 = 0xFFFF_FE00;

/// `chorus bench transfer`'s flags.
#[derive(Debug, Clone, Args)]
pub struct TransferArgs {
    /// State sizes, comma-separated: bytes, or with K, M, G (binary: 100M = 100 MiB).
    #[arg(long, value_delimiter = ',', default_value = "100M", value_parser = parse_size)]
    pub size: Vec<usize>,
    /// Numbers of sources, comma-separated (each sends to one joiner).
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub sources: Vec<usize>,
    /// CHORUS_TRANSPORT for the ranks, comma-separated (auto, quic, shm).
    #[arg(long, value_delimiter = ',', default_value = "auto", value_parser = ["auto", "quic", "shm"])]
    pub transport: Vec<String>,
    /// Timed transfers per configuration (median reported), after one untimed.
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Chunk size, bytes or with K, M, G [default: TransferOptions' default].
    #[arg(long, value_parser = parse_size)]
    pub chunk: Option<usize>,
    /// Print one JSON object per configuration instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Seconds before a configuration is declared stuck.
    #[arg(long, default_value_t = 300)]
    pub timeout: u64,
    /// The joiner's buffers are all zeroed allocations, untouched until the
    /// first transfer writes them (by default one in four is; the others
    /// are filled, as a model built before it receives). Untouched memory
    /// can come in huge pages, which cross-memory writes need to run at
    /// memcpy speed.
    #[arg(long)]
    pub zeroed_joiner: bool,
    /// Seconds each collective, and each chunk of the transfer, may take
    /// [default: InitOptions' default].
    #[arg(long)]
    pub collective_timeout: Option<u64>,
    /// Testing only: damage this chunk once as a source writes it into
    /// the joiner's memory (`TransferOptions::damage_cma_chunk`).
    #[arg(long, hide = true)]
    pub damage_cma_chunk: Option<usize>,
    /// Internal: run as one rank process.
    #[arg(long, hide = true)]
    pub worker: bool,
}

/// Bytes from `123`, `100K`, `100M`, `1G` (binary multiples).
pub fn parse_size(text: &str) -> Result<usize, String> {
    let text = text.trim();
    let (digits, shift) = match text.char_indices().last() {
        Some((i, 'K' | 'k')) => (&text[..i], 10),
        Some((i, 'M' | 'm')) => (&text[..i], 20),
        Some((i, 'G' | 'g')) => (&text[..i], 30),
        _ => (text, 0),
    };
    digits
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(1 << shift))
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("{text:?} is not a size like 4096, 100M or 1G"))
}

#[derive(Debug, Serialize)]
struct Row {
    transport: String,
    /// What the mesh chose between source 0 and the joiner.
    link: String,
    bytes: u64,
    sources: usize,
    chunk_bytes: usize,
    rounds: usize,
    transfer_gbps: f64,
    transfer_ms: f64,
    link_gbps: f64,
    ratio: f64,
    /// Chunks fetched again after a failed checksum, over every round.
    refetched: usize,
    /// What moved the entries' bytes in the last transfer: "cma" (written
    /// into the joiner's memory by cross-memory attach), the link's way
    /// ("ring" on shm, "quic", "local"), or "cma+ring" when both did.
    path: &'static str,
    /// Bytes that landed by cross-memory attach in the last transfer.
    cma_bytes: u64,
}

/// [`Row::path`] for a transfer that moved `cma` of `data` entry bytes
/// by cross-memory attach over a link of `kind`.
fn path(cma: u64, data: u64, kind: chorus::link::TransportKind) -> &'static str {
    use chorus::link::TransportKind;
    let link = match kind {
        TransportKind::Shm => "ring",
        TransportKind::Quic => "quic",
        TransportKind::Local => "local",
    };
    match cma {
        0 => link,
        _ if cma >= data => "cma",
        _ => "cma+ring",
    }
}

/// A state of `size` bytes in four float32 entries (the last one takes
/// the rest), entry `i` filled with `fill + i * step`.
fn state_of(size: usize, fill: f32, step: f32) -> NamedState {
    let floats = size / 4;
    let quarter = floats / 4;
    let lens = [quarter, quarter, quarter, floats - 3 * quarter];
    NamedState {
        params: lens
            .iter()
            .enumerate()
            .map(|(i, &n)| (format!("layer{i}"), vec![fill + i as f32 * step; n]))
            .collect(),
        extra: vec![fill as u8; 64],
        ..NamedState::default()
    }
}

/// [`run_worker`] on a multi-threaded runtime of its own (two threads), as
/// a training program on tokio's default runtime: the QUIC driver and the
/// link readers run while a chunk is checked and written. Call it outside
/// any runtime.
pub fn run_worker_blocking(args: &TransferArgs) -> Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(run_worker(args))
}

/// One rank process: `WORLD_SIZE - 1` sources and the joiner, last rank.
pub async fn run_worker(args: &TransferArgs) -> Result<()> {
    let mut options = chorus::InitOptions::default().timeout(Duration::from_secs(args.timeout));
    if let Some(seconds) = args.collective_timeout {
        options = options.collective_timeout(Duration::from_secs(seconds));
    }
    let group = chorus::init_process_group(options).await.context("forming the group")?;
    let (size, me, joiner) = (args.size[0], group.rank(), group.world_size() - 1);
    let transfer = TransferOptions {
        chunk_bytes: args.chunk.unwrap_or(TransferOptions::default().chunk_bytes),
        damage_cma_chunk: args.damage_cma_chunk,
        ..TransferOptions::default()
    };
    let mut state = match (me == joiner, args.zeroed_joiner) {
        (true, true) => state_of(size, 0.0, 0.0),
        (true, false) => state_of(size, 0.0, 1.0),
        (false, _) => state_of(size, 1.5, 1.0),
    };
    let step = (me != joiner).then_some(1);
    let (mut transfers, mut links) = (Vec::new(), Vec::new());
    let (mut bytes, mut refetched, mut cma_bytes) = (0, 0, 0);
    for round in 0..=args.rounds {
        group.barrier().await?;
        let report = sync_state(&group, &mut state, step, &transfer).await?;
        bytes = report.bytes;
        refetched += report.refetched;
        cma_bytes = report.cma_bytes;
        let mine = [report.elapsed.as_secs_f64()];
        let all = group.all_gather(Tensor::from_slice(&mine)).await?.to_vec::<f64>()?;
        let slowest = all.iter().copied().fold(0.0, f64::max);
        let link = link_throughput(&group, size, transfer.chunk_bytes, joiner).await?;
        if round > 0 {
            transfers.push(slowest);
            links.push(link);
        }
    }
    verify_state(&group, &mut state)
        .await
        .context("the joiner's state differs")?;
    if me == 0 {
        let seconds = median(&mut transfers).unwrap_or(f64::NAN);
        let link_gbps = median(&mut links).unwrap_or(f64::NAN);
        let transfer_gbps = bytes as f64 / seconds / 1e9;
        let kind = group.link(joiner).context("no link to the joiner")?.kind();
        let row = Row {
            transport: std::env::var("CHORUS_TRANSPORT").unwrap_or_else(|_| "auto".into()),
            link: kind.to_string(),
            bytes,
            sources: joiner,
            chunk_bytes: transfer.chunk_bytes,
            rounds: args.rounds,
            transfer_gbps,
            transfer_ms: seconds * 1e3,
            link_gbps,
            ratio: transfer_gbps / link_gbps,
            refetched,
            path: path(cma_bytes, (size / 4 * 4) as u64, kind),
            cma_bytes,
        };
        println!("{}", serde_json::to_string(&row)?);
    }
    group.destroy().await?;
    Ok(())
}

/// Rank 0 streams `size` bytes to the joiner in frames of `chunk` bytes
/// (one buffer, shared); the joiner drops them unread and acknowledges.
/// Returns GB/s on rank 0 (0 elsewhere).
async fn link_throughput(group: &ProcessGroup, size: usize, chunk: usize, joiner: usize) -> Result<f64> {
    let frames = size.div_ceil(chunk);
    let me = group.rank();
    group.barrier().await?;
    if me == 0 {
        let link: Arc<dyn chorus::link::Link> = group.link(joiner).context("no link to the joiner")?.clone();
        let frame = Bytes::from(vec![1u8; chunk]);
        let started = Instant::now();
        for i in 0..frames {
            let len = chunk.min(size - i * chunk);
            link.send(LINK_CHANNEL, i as u64, frame.slice(..len)).await?;
        }
        link.recv(LINK_CHANNEL).await?;
        return Ok(size as f64 / started.elapsed().as_secs_f64() / 1e9);
    }
    if me == joiner {
        let link = group.link(0).context("no link to rank 0")?;
        for _ in 0..frames {
            link.recv(LINK_CHANNEL).await?;
        }
        link.send(LINK_CHANNEL, 0, Bytes::from_static(b"k")).await?;
    }
    Ok(0.0)
}

/// The parent: one set of rank processes per configuration, then the table.
pub fn run(args: &TransferArgs) -> Result<std::process::ExitCode> {
    if args.rounds == 0 || args.sources.contains(&0) {
        bail!("--rounds and every --sources must be at least 1");
    }
    let exe = std::env::current_exe()?.to_string_lossy().into_owned();
    let timeout = Duration::from_secs(args.timeout);
    let mut rows: Vec<Value> = Vec::new();
    for transport in &args.transport {
        for &size in &args.size {
            for &sources in &args.sources {
                let mut worker: Vec<String> = ["bench", "transfer", "--worker", "--size"].map(String::from).to_vec();
                worker.push(size.to_string());
                worker.extend(["--rounds".into(), args.rounds.to_string()]);
                worker.extend(["--timeout".into(), args.timeout.to_string()]);
                if let Some(chunk) = args.chunk {
                    worker.extend(["--chunk".into(), chunk.to_string()]);
                }
                if args.zeroed_joiner {
                    worker.push("--zeroed-joiner".into());
                }
                if let Some(seconds) = args.collective_timeout {
                    worker.extend(["--collective-timeout".into(), seconds.to_string()]);
                }
                if let Some(chunk) = args.damage_cma_chunk {
                    worker.extend(["--damage-cma-chunk".into(), chunk.to_string()]);
                }
                let env = [
                    ("CHORUS_TRANSPORT", transport.clone()),
                    ("CHORUS_JOB_SECRET", chorus::auth::random_hex(16)?),
                ];
                let row = super::ddp::run_ranks(&exe, &worker, sources + 1, &env, timeout)
                    .with_context(|| format!("{transport}, {size} B, {sources} sources"))?;
                if args.json {
                    println!("{row}");
                }
                rows.push(row);
            }
        }
    }
    if args.json {
        return Ok(std::process::ExitCode::SUCCESS);
    }
    println!(
        "# chorus bench transfer: S sources -> 1 joiner, median of {} rounds; link = frames of the chunk size, source 0 -> joiner, unread",
        args.rounds
    );
    println!(
        "{:<10} {:>6} {:>9} {:>12} {:>8} {:>14} {:>12} {:>12} {:>8}",
        "transport", "link", "path", "size(MiB)", "sources", "transfer GB/s", "transfer ms", "link GB/s", "ratio"
    );
    for row in &rows {
        let f = |k: &str| row[k].as_f64().unwrap_or(f64::NAN);
        println!(
            "{:<10} {:>6} {:>9} {:>12.0} {:>8} {:>14.2} {:>12.1} {:>12.2} {:>8.2}",
            row["transport"].as_str().unwrap_or("?"),
            row["link"].as_str().unwrap_or("?"),
            row["path"].as_str().unwrap_or("?"),
            f("bytes") / (1 << 20) as f64,
            row["sources"],
            f("transfer_gbps"),
            f("transfer_ms"),
            f("link_gbps"),
            f("ratio"),
        );
    }
    Ok(std::process::ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_size("100M"), Ok(100 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("12345"), Ok(12345));
        assert!(parse_size("0").is_err() && parse_size("M").is_err() && parse_size("1T").is_err());
        let state = state_of(1001, 1.0, 1.0);
        assert_eq!(state.params.iter().map(|(_, v)| v.len()).sum::<usize>(), 250);
    }

    #[test]
    fn rows_name_the_path_that_moved_the_bytes() {
        use chorus::link::TransportKind;
        assert_eq!(path(0, 100, TransportKind::Shm), "ring");
        assert_eq!(path(0, 100, TransportKind::Quic), "quic");
        assert_eq!(path(100, 100, TransportKind::Shm), "cma");
        assert_eq!(path(40, 100, TransportKind::Shm), "cma+ring");
    }
}
