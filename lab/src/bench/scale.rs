//! `chorus bench scale`: how in-process ranks ([`chorus::spawn`]) and the TCP
//! store's rendezvous grow with the world size.
//!
//! Each world size runs in a child process of its own (`--child`), so its
//! peak resident memory (`VmHWM`) is its own and not the largest world's
//! before it. The in-process table gives the time to form the group, the
//! time of an 8-byte and of a 1 MiB all-reduce (both checked), the peak
//! resident memory once formed and through the 8-byte ones, then through
//! the 1 MiB ones (each rank's own tensor is 1 MiB: 1 GiB at 1024 ranks),
//! and the threads the process ended with; the store
//! table the time for `world` ranks, each with its own TCP connection, to
//! rendezvous through rank 0's `TcpStoreServer`.

use std::io::BufRead;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use chorus_runtime::rendezvous::{self, HostId, InitMethod, PeerRecord};
use clap::Args;

use chorus::{DType, ReduceOp, Tensor};

/// `chorus bench scale`.
#[derive(Debug, Clone, Args)]
pub struct ScaleArgs {
    /// World sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "8,16,32,64,128,256,512,1024")]
    pub worlds: Vec<usize>,
    /// 8-byte all-reduces timed per world (after one warm-up).
    #[arg(long, default_value_t = 50)]
    pub iters: usize,
    /// 1 MiB all-reduces timed per world (after one warm-up).
    #[arg(long, default_value_t = 3)]
    pub large_iters: usize,
    /// Which tables: `spawn` (in-process ranks), `store` (TCP store rendezvous), or both.
    #[arg(long, value_delimiter = ',', default_value = "spawn,store")]
    pub tables: Vec<String>,
    /// Seconds one world size may take before it is reported as timed out.
    #[arg(long, default_value_t = 120)]
    pub timeout: u64,
    /// Internal: measure one world size of one table in this process.
    #[arg(long, hide = true, num_args = 2, value_names = ["TABLE", "WORLD"])]
    pub child: Option<Vec<String>>,
}

/// One in-process measurement.
#[derive(Debug, Clone, Copy)]
struct SpawnRow {
    form: Duration,
    small: Duration,
    large: Duration,
    /// Peak resident memory before the 1 MiB all-reduces (the ranks' own
    /// tensors are 1 MiB each after).
    small_hwm_kib: u64,
    hwm_kib: u64,
    threads: u64,
}

/// Peak resident memory (`VmHWM`) and thread count of this process.
fn proc_status() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    (field("VmHWM:"), field("Threads:"))
}

/// Times `iters` all-reduces of `count` f32 after a warm-up, checking every
/// result: rank r contributes r + 1, so each element sums to w(w+1)/2.
/// Returns when this rank's warm-up and last operation ended.
async fn timed_all_reduce(pg: &chorus::ProcessGroup, count: usize, iters: usize) -> Result<(Instant, Instant), String> {
    let world = pg.world_size();
    let want = (world * (world + 1) / 2) as f32;
    let mut warm = Instant::now();
    let mine = ((pg.rank() + 1) as f32).to_ne_bytes();
    for i in 0..=iters {
        // One buffer per rank, checked where it lies: the process's peak
        // is then the ranks' tensors and what chorus adds, not copies.
        let tensor = Tensor::from_bytes(DType::Float32, mine.repeat(count));
        let out = pg.all_reduce(tensor, ReduceOp::Sum).await.map_err(|e| e.to_string())?;
        let values = out
            .as_bytes()
            .chunks_exact(4)
            .map(|v| f32::from_ne_bytes([v[0], v[1], v[2], v[3]]));
        if let Some((bad, value)) = values.enumerate().find(|&(_, v)| v != want) {
            return Err(format!(
                "rank {}: element {bad} is {value} after the all-reduce, not {want}",
                pg.rank()
            ));
        }
        if i == 0 {
            warm = Instant::now();
        }
    }
    Ok((warm, Instant::now()))
}

/// The time per operation: from the last rank's warm-up to the last rank's
/// end, over the operations timed (all-reduce synchronises the ranks).
fn per_op(spans: &[(Instant, Instant)], iters: usize) -> Duration {
    let start = spans.iter().map(|s| s.0).max().expect("at least one rank");
    let end = spans.iter().map(|s| s.1).max().expect("at least one rank");
    end.saturating_duration_since(start) / iters.max(1) as u32
}

async fn measure_spawn(world: usize, iters: usize, large_iters: usize) -> Result<SpawnRow> {
    let started = Instant::now();
    let outcomes = chorus::spawn(world, move |pg| async move {
        let formed = Instant::now();
        let small = timed_all_reduce(&pg, 2, iters).await?;
        pg.barrier().await.map_err(|e| e.to_string())?;
        let small_hwm = (pg.rank() == 0).then(|| proc_status().0);
        pg.barrier().await.map_err(|e| e.to_string())?;
        let large = timed_all_reduce(&pg, (1 << 20) / 4, large_iters).await?;
        pg.destroy().await.map_err(|e| e.to_string())?;
        Ok::<_, String>((formed, small, large, small_hwm))
    })
    .await?;
    let mut formed = Vec::new();
    let (mut small, mut large, mut small_hwm_kib) = (Vec::new(), Vec::new(), 0);
    for outcome in outcomes {
        let (f, s, l, h) = outcome.map_err(|e| anyhow!(e))?;
        small_hwm_kib = small_hwm_kib.max(h.unwrap_or(0));
        formed.push(f);
        small.push(s);
        large.push(l);
    }
    let (hwm_kib, threads) = proc_status();
    Ok(SpawnRow {
        form: formed.iter().max().expect("ranks").saturating_duration_since(started),
        small: per_op(&small, iters),
        large: per_op(&large, large_iters),
        small_hwm_kib,
        hwm_kib,
        threads,
    })
}

/// `world` ranks rendezvous through rank 0's TCP store, each over its own
/// connection, as separate processes would; returns the time until the
/// last has every record.
async fn measure_store(world: usize) -> Result<Duration> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let timeout = Duration::from_secs(60);
    let config = |rank: usize| {
        rendezvous::resolve(
            InitMethod::Tcp {
                host: "127.0.0.1".into(),
                port,
                rank: Some(rank),
                world_size: Some(world),
            },
            None,
            None,
            &|_| None,
        )
    };
    let started = Instant::now();
    // Rank 0 serves; the others retry their connection until it listens.
    let server = rendezvous::open_store(&config(0)?, timeout).await?;
    let mut ranks = Vec::with_capacity(world);
    for rank in 0..world {
        let config = config(rank)?;
        let served = (rank == 0).then(|| server.store.clone());
        ranks.push(tokio::spawn(async move {
            let store = match served {
                Some(store) => store,
                None => rendezvous::open_store(&config, timeout).await?.store,
            };
            let record = PeerRecord {
                rank: rank as u32,
                host: HostId::local(),
                pid: std::process::id(),
                addrs: vec![std::net::Ipv4Addr::LOCALHOST.into()],
                extras: Vec::new(),
            };
            let membership = rendezvous::rendezvous(store.clone(), &config, record, timeout).await?;
            Ok::<_, rendezvous::RendezvousError>((membership.world_size(), store))
        }));
    }
    let mut stores = Vec::with_capacity(world);
    for rank in ranks {
        let (seen, store) = rank.await??;
        if seen != world {
            bail!("a rank saw {seen} records, not {world}");
        }
        stores.push(store);
    }
    let took = started.elapsed();
    drop(stores);
    if let Some(server) = server.server {
        server.shutdown().await;
    }
    Ok(took)
}

/// Runs one child measurement and prints its row as `key=value` words.
fn run_child(args: &ScaleArgs, table: &str, world: usize) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(std::thread::available_parallelism().map_or(2, |n| n.get()))
        .enable_all()
        .build()?;
    match table {
        "spawn" => {
            let row = runtime.block_on(measure_spawn(world, args.iters, args.large_iters))?;
            println!(
                "row form_us={} small_us={} large_us={} small_hwm_kib={} hwm_kib={} threads={}",
                row.form.as_micros(),
                row.small.as_micros(),
                row.large.as_micros(),
                row.small_hwm_kib,
                row.hwm_kib,
                row.threads
            );
        }
        "store" => {
            let took = runtime.block_on(measure_store(world))?;
            let (hwm_kib, _) = proc_status();
            println!("row rendezvous_us={} hwm_kib={hwm_kib}", took.as_micros());
        }
        other => bail!("unknown table {other:?}: spawn or store"),
    }
    // The ranks' threads need not wind down one by one.
    std::process::exit(0);
}

/// Runs `chorus bench scale --child table world` and reads its row.
fn child_row(args: &ScaleArgs, table: &str, world: usize) -> Result<Vec<(String, u64)>> {
    let exe = std::env::current_exe().context("finding the chorus binary")?;
    let mut child = Command::new(exe)
        .args([
            "bench",
            "scale",
            "--iters",
            &args.iters.to_string(),
            "--large-iters",
            &args.large_iters.to_string(),
            "--child",
            table,
            &world.to_string(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting a measurement process")?;
    let stdout = child.stdout.take().expect("piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let row = std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .find(|l| l.starts_with("row "));
        let _ = tx.send(row);
    });
    let row = rx.recv_timeout(Duration::from_secs(args.timeout));
    if row.is_err() {
        let _ = child.kill();
    }
    let output = child.wait_with_output()?;
    let Ok(Some(row)) = row else {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(5).collect();
        bail!(
            "world {world} ({table}) gave no result within {}s ({}): {}",
            args.timeout,
            output.status,
            tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
        );
    };
    Ok(row
        .split_whitespace()
        .skip(1)
        .filter_map(|kv| kv.split_once('='))
        .filter_map(|(k, v)| Some((k.to_string(), v.parse().ok()?)))
        .collect())
}

fn ms(us: u64) -> String {
    format!("{:.3}", us as f64 / 1000.0)
}

fn mib(kib: u64) -> String {
    format!("{:.0}", kib as f64 / 1024.0)
}

/// `chorus bench scale`: prints the tables asked for; fails when a world
/// size failed or timed out.
pub fn run(args: &ScaleArgs) -> Result<bool> {
    if let Some(child) = &args.child {
        let world = child[1].parse().context("--child WORLD")?;
        run_child(args, &child[0], world)?;
        return Ok(true);
    }
    let mut ok = true;
    let get = |row: &[(String, u64)], key: &str| row.iter().find(|(k, _)| k == key).map_or(0, |(_, v)| *v);
    if args.tables.iter().any(|t| t == "spawn") {
        println!(
            "# chorus bench scale: ranks in one process (chorus::spawn); 8 B x {} and 1 MiB x {} all-reduces (f32 sum, checked), one process per world",
            args.iters, args.large_iters
        );
        println!(
            "{:>6} {:>10} {:>10} {:>10} {:>13} {:>13} {:>8}",
            "world", "form_ms", "8B_ms", "1MiB_ms", "peak_8B_MiB", "peak_1MiB_MiB", "threads"
        );
        for &world in &args.worlds {
            match child_row(args, "spawn", world) {
                Ok(row) => println!(
                    "{world:>6} {:>10} {:>10} {:>10} {:>13} {:>13} {:>8}",
                    ms(get(&row, "form_us")),
                    ms(get(&row, "small_us")),
                    ms(get(&row, "large_us")),
                    mib(get(&row, "small_hwm_kib")),
                    mib(get(&row, "hwm_kib")),
                    get(&row, "threads")
                ),
                Err(e) => {
                    ok = false;
                    println!("{world:>6} failed: {e:#}");
                }
            }
        }
    }
    if args.tables.iter().any(|t| t == "store") {
        println!(
            "# chorus bench scale: rendezvous through the TCP store (rank 0 serves; one connection per rank), one process per world"
        );
        println!("{:>6} {:>14} {:>10}", "world", "rendezvous_ms", "peak_MiB");
        for &world in &args.worlds {
            match child_row(args, "store", world) {
                Ok(row) => println!(
                    "{world:>6} {:>14} {:>10}",
                    ms(get(&row, "rendezvous_us")),
                    mib(get(&row, "hwm_kib"))
                ),
                Err(e) => {
                    ok = false;
                    println!("{world:>6} failed: {e:#}");
                }
            }
        }
    }
    Ok(ok)
}
