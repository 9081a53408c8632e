//! `chorus bench transport`: throughput (large transfers) and 8-byte round
//! trip between two processes on this machine, for each transport path, next
//! to raw TCP measured in the same run.
//!
//! The parent is rank 0; it hosts a store and starts rank 1 as a child
//! process. Both walk the same sequence of (round, path) steps; each step
//! sets up a fresh connection (endpoints exchanged through the store under a
//! key unique to the step), measures, and closes. Rounds alternate the paths
//! so that noise on a shared machine hits each path alike; medians are
//! reported.
//!
//! Across hosts (or network namespaces), `--bind` names this process's
//! address, `--peer-bind` the peer's, and `--peer-prefix` the command that
//! starts the peer there (`ip netns exec B`, `ssh host`); see the
//! impaired-link section of bench/HISTORY.md (§9).

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use chorus_runtime::store::{Store, TcpStore, TcpStoreOptions, TcpStoreServer, TcpStoreServerOptions};
use chorus_transports::link::Link;
use chorus_transports::quic::{Congestion, QuicEndpoint, QuicIdentity, QuicOptions, QuicPeer};
use chorus_transports::shm::{ShmEndpoint, ShmOptions, ShmPeer};
use thiserror::Error;

use super::common::median;

/// Why a benchmark could not run.
#[derive(Debug, Error)]
pub enum BenchError {
    /// Setting up or talking to the peer process failed.
    #[error("{0}")]
    Setup(String),
    /// IO failed during a measurement.
    #[error("io error during the {path} measurement: {source}")]
    Io {
        /// The path being measured.
        path: &'static str,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
}

fn setup(e: impl std::fmt::Display) -> BenchError {
    BenchError::Setup(e.to_string())
}

/// What to measure.
#[derive(Debug, Clone)]
pub struct TransportBench {
    /// Bytes per transfer.
    pub size: usize,
    /// Transfers per throughput measurement.
    pub iters: usize,
    /// Round trips per latency measurement.
    pub rtt_iters: usize,
    /// Rounds (each measures every path once).
    pub rounds: usize,
    /// The paths to measure, in this order each round (of `tcp`, `quic`, `shm`).
    pub paths: Vec<&'static str>,
    /// This process's address (the store, TCP and QUIC bind there).
    pub bind: IpAddr,
    /// The peer's address.
    pub peer_bind: IpAddr,
    /// Words put before the peer's command line (e.g. `ip netns exec B`).
    pub peer_prefix: Vec<String>,
    /// QUIC's congestion controller (both ends), as `auto`, `cubic`, `newreno` or `bbr`.
    pub quic_congestion: String,
}

/// One path's medians.
#[derive(Debug, Clone)]
pub struct PathResult {
    /// `tcp`, `quic` or `shm`.
    pub path: &'static str,
    /// Median throughput, GB/s (decimal).
    pub gbps: f64,
    /// Median 8-byte round trip, microseconds.
    pub rtt_us: f64,
}

/// Every path, in the default order.
pub const PATHS: [&str; 3] = ["tcp", "quic", "shm"];

/// Rank 0: hosts the store, starts rank 1 (`chorus_exe bench transport --peer-store ...`),
/// and returns every path's medians and the single-thread memcpy bandwidth.
pub async fn run_leader(
    bench: &TransportBench,
    chorus_exe: &std::path::Path,
) -> Result<(Vec<PathResult>, f64), BenchError> {
    let server = TcpStoreServer::bind(SocketAddr::new(bench.bind, 0), TcpStoreServerOptions::default())
        .await
        .map_err(setup)?;
    let store_addr = server.local_addr();
    let mut command = match bench.peer_prefix.split_first() {
        Some((program, args)) => {
            let mut command = tokio::process::Command::new(program);
            command.args(args).arg(chorus_exe);
            command
        }
        None => tokio::process::Command::new(chorus_exe),
    };
    let mut child = command
        .args([
            "bench",
            "transport",
            "--size",
            &bench.size.to_string(),
            "--iters",
            &bench.iters.to_string(),
            "--rtt-iters",
            &bench.rtt_iters.to_string(),
            "--rounds",
            &bench.rounds.to_string(),
            "--peer-store",
            &store_addr.to_string(),
            "--bind",
            &bench.peer_bind.to_string(),
            "--paths",
            &bench.paths.join(","),
            "--quic-congestion",
            &bench.quic_congestion,
        ])
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| setup(format!("starting the peer process: {e}")))?;
    let store = connect(store_addr).await?;
    let mut samples: Vec<(Vec<f64>, Vec<f64>)> = bench.paths.iter().map(|_| (Vec::new(), Vec::new())).collect();
    for round in 0..bench.rounds {
        for (i, path) in bench.paths.iter().enumerate() {
            let (gbps, rtt) = step(&store, bench, round, path, 0).await?;
            samples[i].0.push(gbps);
            samples[i].1.push(rtt);
        }
    }
    let status = child.wait().await.map_err(setup)?;
    if !status.success() {
        return Err(setup(format!("the peer process failed: {status}")));
    }
    let results = bench
        .paths
        .iter()
        .zip(samples.iter_mut())
        .map(|(path, (gbps, rtt))| PathResult {
            path,
            gbps: median(gbps).unwrap_or(f64::NAN),
            rtt_us: median(rtt).unwrap_or(f64::NAN),
        })
        .collect();
    Ok((results, memcpy_gbps(bench.size)))
}

/// Rank 1: follows the leader's steps.
pub async fn run_peer(bench: &TransportBench, store_addr: SocketAddr) -> Result<(), BenchError> {
    let store = connect(store_addr).await?;
    for round in 0..bench.rounds {
        for &path in &bench.paths {
            step(&store, bench, round, path, 1).await?;
        }
    }
    Ok(())
}

async fn connect(addr: SocketAddr) -> Result<TcpStore, BenchError> {
    let options = TcpStoreOptions {
        timeout: Duration::from_secs(60),
        connect_timeout: Duration::from_secs(10),
        ..TcpStoreOptions::default()
    };
    TcpStore::connect(addr.to_string(), options).await.map_err(setup)
}

/// One path in one round; rank 0 returns (GB/s, round-trip µs).
async fn step(
    store: &TcpStore,
    bench: &TransportBench,
    round: usize,
    path: &'static str,
    rank: usize,
) -> Result<(f64, f64), BenchError> {
    let key = |r: usize| format!("bench/{round}/{path}/{r}");
    match path {
        "tcp" => {
            let bench = bench.clone();
            if rank == 0 {
                let listener = TcpListener::bind(SocketAddr::new(bench.bind, 0)).map_err(setup)?;
                store
                    .set(&key(0), listener.local_addr().map_err(setup)?.to_string().as_bytes())
                    .await
                    .map_err(setup)?;
                tokio::task::spawn_blocking(move || tcp_leader(listener, &bench))
                    .await
                    .map_err(setup)?
            } else {
                let addr: SocketAddr = String::from_utf8_lossy(&store.get(&key(0)).await.map_err(setup)?)
                    .parse()
                    .map_err(setup)?;
                tokio::task::spawn_blocking(move || tcp_peer(addr, &bench))
                    .await
                    .map_err(setup)??;
                Ok((0.0, 0.0))
            }
        }
        "shm" => {
            let endpoint = ShmEndpoint::new(rank, ShmOptions::default()).map_err(setup)?;
            store
                .set(&key(rank), &endpoint.nonce().to_le_bytes())
                .await
                .map_err(setup)?;
            let theirs = store.get(&key(1 - rank)).await.map_err(setup)?;
            let theirs = u64::from_le_bytes(theirs[..].try_into().map_err(setup)?);
            let mut peers = vec![
                ShmPeer {
                    rank,
                    nonce: endpoint.nonce(),
                },
                ShmPeer {
                    rank: 1 - rank,
                    nonce: theirs,
                },
            ];
            peers.sort_by_key(|p| p.rank);
            let links = endpoint.connect_mesh(&peers).await.map_err(setup)?;
            let link = links[1 - rank].clone().ok_or_else(|| setup("no link to the peer"))?;
            measure_link(store, bench, round, path, rank, &link).await
        }
        _ => {
            let identity = QuicIdentity::generate().map_err(setup)?;
            let options = QuicOptions {
                congestion: bench.quic_congestion.parse::<Congestion>().map_err(setup)?,
                ..QuicOptions::default()
            };
            let endpoint = QuicEndpoint::bind(rank, bench.bind, &identity, options).map_err(setup)?;
            let mut mine = identity.fingerprint().to_vec();
            mine.extend_from_slice(endpoint.local_addr().to_string().as_bytes());
            store.set(&key(rank), &mine).await.map_err(setup)?;
            let theirs = store.get(&key(1 - rank)).await.map_err(setup)?;
            if theirs.len() < 32 {
                return Err(setup("the peer published a short QUIC endpoint"));
            }
            let mut peers = vec![
                QuicPeer {
                    rank,
                    addr: endpoint.local_addr(),
                    fingerprint: identity.fingerprint(),
                },
                QuicPeer {
                    rank: 1 - rank,
                    addr: String::from_utf8_lossy(&theirs[32..]).parse().map_err(setup)?,
                    fingerprint: theirs[..32].try_into().map_err(setup)?,
                },
            ];
            peers.sort_by_key(|p| p.rank);
            let links = endpoint.connect_mesh(&peers).await.map_err(setup)?;
            let link = links[1 - rank].clone().ok_or_else(|| setup("no link to the peer"))?;
            measure_link(store, bench, round, path, rank, &link).await
        }
    }
}

/// Runs the measurement over a link, then waits until both sides are done
/// before either drops it.
async fn measure_link(
    store: &TcpStore,
    bench: &TransportBench,
    round: usize,
    path: &'static str,
    rank: usize,
    link: &Arc<dyn Link>,
) -> Result<(f64, f64), BenchError> {
    let result = if rank == 0 {
        link_leader(link, bench).await
    } else {
        link_peer(link, bench).await.map(|()| (0.0, 0.0))
    };
    store
        .add(&format!("bench/{round}/{path}/done"), 1)
        .await
        .map_err(setup)?;
    wait_count(store, &format!("bench/{round}/{path}/done"), 2).await?;
    result
}

async fn wait_count(store: &TcpStore, key: &str, want: i64) -> Result<(), BenchError> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while store.add(key, 0).await.map_err(setup)? < want {
        if Instant::now() > deadline {
            return Err(setup(format!("the peer never reached {key}")));
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Ok(())
}

fn io(path: &'static str) -> impl Fn(std::io::Error) -> BenchError {
    move |source| BenchError::Io { path, source }
}

fn tcp_leader(listener: TcpListener, bench: &TransportBench) -> Result<(f64, f64), BenchError> {
    let (mut stream, _) = listener.accept().map_err(io("tcp"))?;
    stream.set_nodelay(true).map_err(io("tcp"))?;
    let buffer = vec![1u8; bench.size];
    let mut ack = [0u8; 1];
    // One untimed sample first, as over the links (window growth).
    for _ in 0..bench.iters {
        stream.write_all(&buffer).map_err(io("tcp"))?;
    }
    stream.read_exact(&mut ack).map_err(io("tcp"))?;
    let started = Instant::now();
    for _ in 0..bench.iters {
        stream.write_all(&buffer).map_err(io("tcp"))?;
    }
    stream.read_exact(&mut ack).map_err(io("tcp"))?;
    let gbps = (bench.size * bench.iters) as f64 / started.elapsed().as_secs_f64() / 1e9;
    let mut rtts = Vec::with_capacity(bench.rtt_iters);
    let mut ping = [0u8; 8];
    for _ in 0..bench.rtt_iters {
        let sent = Instant::now();
        stream.write_all(&ping).map_err(io("tcp"))?;
        stream.read_exact(&mut ping).map_err(io("tcp"))?;
        rtts.push(sent.elapsed().as_secs_f64() * 1e6);
    }
    Ok((gbps, median(&mut rtts).unwrap_or(f64::NAN)))
}

fn tcp_peer(addr: SocketAddr, bench: &TransportBench) -> Result<(), BenchError> {
    let mut stream = TcpStream::connect(addr).map_err(io("tcp"))?;
    stream.set_nodelay(true).map_err(io("tcp"))?;
    // Received into one reused buffer, as a pooled receiver would.
    let mut buffer = vec![0u8; bench.size];
    for _ in 0..2 {
        for _ in 0..bench.iters {
            stream.read_exact(&mut buffer).map_err(io("tcp"))?;
        }
        stream.write_all(&[1]).map_err(io("tcp"))?;
    }
    let mut ping = [0u8; 8];
    for _ in 0..bench.rtt_iters {
        stream.read_exact(&mut ping).map_err(io("tcp"))?;
        stream.write_all(&ping).map_err(io("tcp"))?;
    }
    Ok(())
}

fn link_error(e: impl std::fmt::Display) -> BenchError {
    setup(format!("link failed: {e}"))
}

async fn link_leader(link: &Arc<dyn Link>, bench: &TransportBench) -> Result<(f64, f64), BenchError> {
    let payload = Bytes::from(vec![1u8; bench.size]);
    // One untimed sample first: a new link's first bytes pay its setup
    // (first-touch faults on both views of a shm ring, QUIC's window
    // growth), as nccl-tests' warm-up iterations do.
    for i in 0..bench.iters {
        link.send(0, u64::MAX - i as u64, payload.clone())
            .await
            .map_err(link_error)?;
    }
    link.recv(1).await.map_err(link_error)?;
    let started = Instant::now();
    for i in 0..bench.iters {
        link.send(0, i as u64, payload.clone()).await.map_err(link_error)?;
    }
    link.recv(1).await.map_err(link_error)?;
    let gbps = (bench.size * bench.iters) as f64 / started.elapsed().as_secs_f64() / 1e9;
    let mut rtts = Vec::with_capacity(bench.rtt_iters);
    let ping = Bytes::from_static(&[0u8; 8]);
    for i in 0..bench.rtt_iters {
        let sent = Instant::now();
        link.send(2, i as u64, ping.clone()).await.map_err(link_error)?;
        link.recv(2).await.map_err(link_error)?;
        rtts.push(sent.elapsed().as_secs_f64() * 1e6);
    }
    Ok((gbps, median(&mut rtts).unwrap_or(f64::NAN)))
}

async fn link_peer(link: &Arc<dyn Link>, bench: &TransportBench) -> Result<(), BenchError> {
    for _ in 0..bench.iters {
        link.recv(0).await.map_err(link_error)?;
    }
    link.send(1, u64::MAX, Bytes::from_static(b"k"))
        .await
        .map_err(link_error)?;
    for _ in 0..bench.iters {
        let frame = link.recv(0).await.map_err(link_error)?;
        if frame.payload.len() != bench.size {
            return Err(setup(format!(
                "received {} bytes, expected {}",
                frame.payload.len(),
                bench.size
            )));
        }
    }
    link.send(1, 0, Bytes::from_static(b"k")).await.map_err(link_error)?;
    for _ in 0..bench.rtt_iters {
        let frame = link.recv(2).await.map_err(link_error)?;
        link.send(2, frame.tag, frame.payload).await.map_err(link_error)?;
    }
    Ok(())
}

/// Single-thread memcpy bandwidth between two reused buffers, GB/s.
pub fn memcpy_gbps(size: usize) -> f64 {
    let source = vec![1u8; size];
    let mut target = vec![0u8; size];
    target.copy_from_slice(&source);
    let mut samples = Vec::new();
    for _ in 0..5 {
        let started = Instant::now();
        target.copy_from_slice(std::hint::black_box(&source));
        std::hint::black_box(&target);
        samples.push(size as f64 / started.elapsed().as_secs_f64() / 1e9);
    }
    median(&mut samples).unwrap_or(f64::NAN)
}
