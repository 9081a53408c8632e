//! The `chorus` command line.
//!
//! - `chorus hello --world N`: the quickstart job. Starts N rank processes on
//!   this machine that rendezvous (over `tcp://`, `file://` or `env://`),
//!   print who they found, greet each other over the mesh, and all-reduce
//!   16 MiB, checking every element.
//! - `chorus launch [flags] PROGRAM ...`: torchrun's launcher (`chorus_cli::launch`).
//! - `chorus store serve`: a standalone TCPStore-compatible server.
//! - `chorus store get|set|add|wait|check|delete|keys`: look inside a job's
//!   store while debugging a stuck rendezvous.
//! - `chorus chaos`: a training job across N nodes of this host (or N
//!   simulated hosts, `--hosts`, with partitions and lossy and slow links)
//!   under random faults from a seed, checked against its fault-free run
//!   (`chorus_lab::chaos`).
//! - `chorus trace DIR [--json]`: name the rank(s) a stuck collective waits
//!   for, from the flight-recorder dumps in DIR (`chorus::trace`).
//! - `chorus fault-probe` (hidden): one rank that all-reduces in a loop and
//!   prints each event with a timestamp, for the supervision tests.
//! - `chorus elastic-probe` (hidden): one rank of an elastic group that
//!   all-reduces through restarts, for the restart tests.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use chorus::process::{self, Signal};
use chorus::store::{self, Store, TcpStore, TcpStoreOptions, TcpStoreServer, TcpStoreServerOptions};
use chorus::{DType, InitOptions, init_process_group};
use chorus_lab::bench::common::{free_port, torchrun_env};
use clap::{Args, Parser, Subcommand, ValueEnum};

#[derive(Parser)]
#[command(
    name = "chorus",
    version,
    about = "Keeps the parameters of a distributed training job in sync."
)]
struct Cli {
    #[command(subcommand)]
    command: Commands,
}

#[derive(Subcommand)]
enum Commands {
    /// Start N ranks on this machine that find each other, all-reduce and check the result.
    Hello(HelloArgs),
    /// Serve or inspect a TCPStore-compatible key/value store.
    #[command(subcommand)]
    Store(StoreCommand),
    /// As one rank (e.g. under `chorus launch`): check a backend's collectives (cpu: every one and every dtype) against a reference.
    Selftest {
        /// How the ranks meet.
        #[arg(long, default_value = "env://")]
        init: String,
        /// Seconds for rendezvous and for each collective.
        #[arg(long, default_value_t = 120)]
        timeout: u64,
        /// Elements per rank to check, comma-separated [default: 0,1,13,1000 for cpu; 1,4099,1048576 for nccl].
        #[arg(long, value_delimiter = ',')]
        counts: Option<Vec<usize>>,
        /// Dtypes to check (cpu backend), comma-separated PyTorch names [default: all ten].
        #[arg(long, value_delimiter = ',')]
        dtypes: Option<Vec<DType>>,
        /// The backend to check: cpu (every collective and dtype over the mesh) or nccl (one GPU per process, as torchrun starts them; exits 2 where CUDA or NCCL is missing).
        #[arg(long, value_enum, default_value_t)]
        backend: chorus_lab::selftest::SelfTestBackend,
    },
    /// Measure chorus against the peers it must beat (`chorus bench --help`).
    Bench(Box<BenchCommand>),
    /// Start a node's workers as torchrun does (`chorus launch --help`).
    #[command(disable_help_flag = true)]
    Launch {
        /// Flags, then the program and its arguments.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Internal: as one rank, all-reduce in a loop and print each event (ready, error, the next call) with a timestamp.
    #[command(hide = true)]
    FaultProbe {
        /// How the ranks meet.
        #[arg(long, default_value = "env://")]
        init: String,
        /// Seconds to loop before leaving cleanly.
        #[arg(long, default_value_t = 30)]
        seconds: u64,
    },
    /// Internal: as one rank of an elastic group, all-reduce in a loop through restarts and print each event.
    #[command(hide = true)]
    ElasticProbe {
        /// How the ranks meet.
        #[arg(long, default_value = "env://")]
        init: String,
        /// Successful all-reduces to run before leaving.
        #[arg(long, default_value_t = 400)]
        iterations: u64,
        /// Fewest ranks a restart may form.
        #[arg(long)]
        min_world: Option<usize>,
        /// Most ranks a generation admits.
        #[arg(long)]
        max_world: Option<usize>,
        /// Milliseconds a rendezvous waits for more once min_world came.
        #[arg(long, default_value_t = 300)]
        last_call_ms: u64,
        /// In the first attempt (TORCHELASTIC_RESTART_COUNT unset or 0), the process with this RANK kills itself (SIGKILL) after --kill-after all-reduces.
        #[arg(long)]
        kill_rank: Option<usize>,
        /// All-reduces before --kill-rank kills itself.
        #[arg(long, default_value_t = 30)]
        kill_after: u64,
    },
    /// Join two interfaces through a lossy, slow link (userspace netem): loss, delay, jitter, rate per direction.
    Netem(NetemArgs),
    /// Train across N nodes of this host under random faults from a seed, and check the run against a fault-free one.
    Chaos(Box<ChaosArgs>),
    /// Serve the live page of a running job, read from its store (the job secret in CHORUS_JOB_SECRET or --job-secret-file).
    Dashboard {
        /// The job's store, host:port.
        #[arg(long)]
        store: String,
        /// Where to serve the page: loopback unless told otherwise (127.0.0.1:0 picks a free port).
        #[arg(long, default_value = "127.0.0.1:0")]
        addr: String,
        /// The run to show [default: the newest that published].
        #[arg(long)]
        run_id: Option<String>,
        /// A file holding the job secret (else CHORUS_JOB_SECRET).
        #[arg(long)]
        job_secret_file: Option<std::path::PathBuf>,
        /// Let the page inject faults (each request needs the job secret).
        #[arg(long)]
        faults: bool,
    },
    /// Compare the ranks' flight-recorder dumps (CHORUS_TRACE_DIR) and name the rank(s) a stuck collective waits for.
    Trace {
        /// The directory the ranks dumped into.
        dir: std::path::PathBuf,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args)]
struct NetemArgs {
    /// One interface (in this network namespace).
    #[arg(long)]
    a: String,
    /// The other interface.
    #[arg(long)]
    b: String,
    /// Delay added to every frame, each direction, milliseconds.
    #[arg(long, default_value_t = 0.0)]
    delay_ms: f64,
    /// Each frame's delay is drawn within delay ± jitter (order is kept), milliseconds.
    #[arg(long, default_value_t = 0.0)]
    jitter_ms: f64,
    /// Probability that a frame is dropped, each direction: 0.01 or 1%.
    #[arg(long, default_value = "0", value_parser = |s: &str| chorus_lab::netem::core::parse_loss(s))]
    loss: f64,
    /// Seeds the losses and delays (default: random).
    #[arg(long)]
    seed: Option<u64>,
    /// Line rate each direction, Mbit/s (default: as fast as frames come).
    #[arg(long)]
    rate_mbit: Option<f64>,
    /// Frames held per direction; more are dropped.
    #[arg(long, default_value_t = 100_000)]
    limit: usize,
}

#[derive(Clone, Copy, ValueEnum)]
enum InitKind {
    Tcp,
    File,
    Env,
}

#[derive(Args)]
struct HelloArgs {
    /// Number of ranks (processes) to start.
    #[arg(long, default_value_t = 4)]
    world: usize,
    /// How the ranks meet.
    #[arg(long, value_enum, default_value = "tcp")]
    init: InitKind,
    /// Seconds before the job is declared stuck.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
    /// Internal: run as one rank with the given init URL.
    #[arg(long, hide = true)]
    worker: Option<String>,
}

/// `chorus bench [--op ...]`: the nccl-tests table for one collective (the
/// default form), or `chorus bench transport`.
#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
struct BenchCommand {
    #[command(subcommand)]
    command: Option<BenchSubcommand>,
    #[command(flatten)]
    collective: chorus_lab::bench::collective::CollectiveArgs,
}

#[derive(Subcommand)]
enum BenchSubcommand {
    /// Data-parallel gradient sync (DistributedSync) on a 25M-parameter model: step time with and without sync.
    Ddp(chorus_lab::bench::ddp::DdpArgs),
    /// The memory a job takes on this host: peak /dev/shm segments and the processes' summed peak resident memory (`chorus bench memory -- chorus launch --nproc-per-node 64 chorus selftest`).
    Memory(chorus_lab::bench::memory::MemoryArgs),
    /// In-process ranks and TCP store rendezvous against the world size (8..1024): time and peak memory.
    Scale(chorus_lab::bench::scale::ScaleArgs),
    /// Live state transfer (sync_state) from S sources to one joiner, next to the link's own throughput.
    Transfer(chorus_lab::bench::transfer::TransferArgs),
    /// All-reduce algorithms per transport across sizes: the table, the crossovers and the CHORUS_ALGO_THRESHOLDS line.
    Tune(chorus_lab::bench::tune::TuneArgs),
    /// Recovery time of an elastic group: SIGKILL a random rank, time until the survivors' next collective.
    Recovery(RecoveryArgs),
    /// Throughput and 8-byte round trip between two processes, per transport, next to raw TCP.
    Transport(TransportArgs),
}

#[derive(Args)]
struct RecoveryArgs {
    /// Ranks per trial (one is killed; the survivors form the next generation).
    #[arg(long, default_value_t = 4)]
    world: usize,
    /// How many trials.
    #[arg(long, default_value_t = 10)]
    trials: usize,
    /// CHORUS_TRANSPORT for the ranks (auto, quic, shm); default: auto.
    #[arg(long)]
    transport: Option<String>,
    /// CHORUS_HEARTBEAT_TIMEOUT for the ranks, seconds; default: the library's.
    #[arg(long)]
    heartbeat_timeout: Option<u64>,
    /// The elastic rendezvous' last-call window, milliseconds (the library's default).
    #[arg(long, default_value_t = 1000)]
    last_call_ms: u64,
    /// All-reduces per rank (the kill comes after the 20th).
    #[arg(long, default_value_t = 150)]
    iterations: u64,
    /// Seeds which rank is killed and when (default: random).
    #[arg(long)]
    seed: Option<u64>,
    /// Print JSON lines instead of the table.
    #[arg(long)]
    json: bool,
    /// Also measure torchrun restarting a Gloo job (needs torch), trials alternating.
    #[arg(long, value_parser = ["torchrun"])]
    compare: Option<String>,
    /// The Python that runs torchrun for --compare.
    #[arg(long, default_value = "python3", env = "CHORUS_BENCH_PYTHON")]
    python: String,
}

#[derive(Args)]
struct TransportArgs {
    /// Bytes per transfer.
    #[arg(long, default_value_t = 64 << 20)]
    size: usize,
    /// Transfers per throughput sample.
    #[arg(long, default_value_t = 8)]
    iters: usize,
    /// Round trips per latency sample.
    #[arg(long, default_value_t = 2000)]
    rtt_iters: usize,
    /// Samples per path (paths alternate between rounds).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Print machine-readable rows (JSON lines) instead of the table.
    #[arg(long)]
    json: bool,
    /// The paths to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "tcp,quic,shm", value_parser = ["tcp", "quic", "shm"])]
    paths: Vec<String>,
    /// This process's address (e.g. a host of scripts/netem-pair.sh).
    #[arg(long, default_value = "127.0.0.1")]
    bind: std::net::IpAddr,
    /// The peer's address [default: --bind].
    #[arg(long)]
    peer_bind: Option<std::net::IpAddr>,
    /// Command words that start the peer where --peer-bind is, e.g. "ip netns exec NAME-b".
    #[arg(long)]
    peer_prefix: Option<String>,
    /// QUIC's congestion controller: auto (Cubic on loopback, BBR between hosts), cubic, newreno, bbr.
    #[arg(long, default_value = "auto", value_parser = ["auto", "cubic", "newreno", "bbr"])]
    quic_congestion: String,
    /// Internal: run as the peer process, using this store.
    #[arg(long, hide = true)]
    peer_store: Option<std::net::SocketAddr>,
}

#[derive(Subcommand)]
enum StoreCommand {
    /// Run a standalone store server until interrupted.
    Serve {
        /// Port to listen on.
        #[arg(long, default_value_t = store::DEFAULT_PORT)]
        port: u16,
        /// Address to listen on: loopback unless told otherwise (`--host 0.0.0.0` serves every interface; anyone who reaches the port can read and write the store).
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
    },
    /// Print the value of KEY (waiting for it up to --timeout).
    Get {
        #[command(flatten)]
        client: ClientArgs,
        /// The key.
        key: String,
    },
    /// Set KEY to VALUE.
    Set {
        #[command(flatten)]
        client: ClientArgs,
        /// The key.
        key: String,
        /// The value.
        value: String,
    },
    /// Add DELTA to the integer at KEY and print the result.
    Add {
        #[command(flatten)]
        client: ClientArgs,
        /// The key.
        key: String,
        /// The amount to add.
        #[arg(allow_hyphen_values = true)]
        delta: i64,
    },
    /// Wait until every KEY exists.
    Wait {
        #[command(flatten)]
        client: ClientArgs,
        /// The keys.
        #[arg(required = true)]
        keys: Vec<String>,
    },
    /// Print whether every KEY exists, naming the missing ones (exit code 1 when some are).
    Check {
        #[command(flatten)]
        client: ClientArgs,
        /// The keys.
        #[arg(required = true)]
        keys: Vec<String>,
    },
    /// Delete KEY.
    Delete {
        #[command(flatten)]
        client: ClientArgs,
        /// The key.
        key: String,
    },
    /// List every key in the store, with the count: as `get` and `set` name them (without the "/" PyTorch's client puts in front), or with --raw exactly as stored.
    Keys {
        #[command(flatten)]
        client: ClientArgs,
    },
}

#[derive(Args)]
struct ChaosArgs {
    /// Nodes: one `chorus launch` each, which may be killed whole.
    #[arg(long, default_value_t = 3, conflicts_with = "hosts")]
    nodes: usize,
    /// N simulated hosts (network namespaces, root only), one node each; adds the network faults (partition, lossy-link, slow-link) to the default --faults.
    #[arg(long)]
    hosts: Option<usize>,
    /// Workers per node.
    #[arg(long, default_value_t = 1)]
    nproc_per_node: usize,
    /// How long the job trains (60s, 10m): the example gets the steps that fill it at the measured fault-free rate; faults go on until it ends.
    #[arg(long, default_value = "60s", value_parser = |s: &str| chorus_lab::chaos::schedule::parse_duration(s))]
    duration: Duration,
    /// Steps for the example instead of filling --duration.
    #[arg(long)]
    steps: Option<u64>,
    /// Seconds between faults, drawn uniformly from LOW..HIGH (or fixed: 15).
    #[arg(long, default_value = "10..20", value_parser = |s: &str| chorus_lab::chaos::schedule::parse_range(s))]
    fault_every: (Duration, Duration),
    /// The faults drawn from, comma-separated [default: kill,stop,kill-launcher,slow; with --hosts also partition,lossy-link,slow-link].
    #[arg(long, value_enum, value_delimiter = ',')]
    faults: Vec<chorus_lab::chaos::FaultKind>,
    /// The schedule's seed: the same seed, the same faults at the same times.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The example's heartbeat window, milliseconds; a stopped worker is killed twice it later.
    #[arg(long, default_value_t = 2000)]
    heartbeat_ms: u64,
    /// Lowest goodput (committed steps per second against the fault-free rate).
    #[arg(long, default_value_t = 0.9)]
    min_goodput: f64,
    /// Largest relative difference of the final loss from the fault-free run's.
    #[arg(long, default_value_t = 0.02)]
    loss_tolerance: f64,
    /// Longest recovery allowed, milliseconds.
    #[arg(long, default_value_t = 10_000)]
    max_recovery_ms: u64,
    /// Keep the runs' files (records, launcher logs) in this directory.
    #[arg(long)]
    dir: Option<std::path::PathBuf>,
    /// Print the report as one JSON object.
    #[arg(long)]
    json: bool,
    /// The program to train (through `chorus::train`) instead of examples/train, with its arguments.
    #[arg(last = true)]
    program: Vec<String>,
}

#[derive(Args)]
struct ClientArgs {
    /// Store address, host:port.
    #[arg(long, default_value = "127.0.0.1:29500")]
    addr: String,
    /// Seconds to wait for the server and for keys.
    #[arg(long, default_value_t = 10)]
    timeout: u64,
    /// Keys exactly as stored: send them without the "/" PyTorch's client puts in front (and `keys` lists them unchanged).
    #[arg(long)]
    raw: bool,
}

fn main() -> ExitCode {
    chorus_cli::logging::init();
    let cli = Cli::parse();
    let result = match cli.command {
        Commands::Hello(args) => match &args.worker {
            Some(url) => run_async(hello_worker(url.clone(), Duration::from_secs(args.timeout))),
            None => hello(&args),
        },
        // One thread serves the store as libuv's loop does: with a second
        // worker, waking it cost a context switch per request (measured).
        Commands::Store(command) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting the async runtime")
            .and_then(|runtime| runtime.block_on(store_command(command))),
        Commands::Selftest {
            init,
            timeout,
            counts,
            dtypes,
            backend,
        } => selftest_command(init, Duration::from_secs(timeout), counts, dtypes, backend),
        Commands::Bench(command) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting the async runtime")
            .and_then(|runtime| runtime.block_on(bench_command(*command))),
        Commands::Launch { args } => return chorus_cli::launch::main(&args),
        Commands::Netem(args) => netem(args),
        Commands::Chaos(args) => chaos(*args),
        Commands::Trace { dir, json } => return chorus_cli::trace::main(&dir, json),
        Commands::Dashboard {
            store,
            addr,
            run_id,
            job_secret_file,
            faults,
        } => run_async(dashboard(store, addr, run_id, job_secret_file, faults)),
        Commands::FaultProbe { init, seconds } => run_async(fault_probe(init, Duration::from_secs(seconds))),
        Commands::ElasticProbe {
            init,
            iterations,
            min_world,
            max_world,
            last_call_ms,
            kill_rank,
            kill_after,
        } => {
            let first_attempt = std::env::var("TORCHELASTIC_RESTART_COUNT").map_or(true, |n| n.trim() == "0");
            let env_rank = std::env::var("RANK").ok().and_then(|r| r.parse::<usize>().ok());
            let kill_after = (first_attempt && kill_rank.is_some() && kill_rank == env_rank).then_some(kill_after);
            run_async(elastic_probe(
                init,
                iterations,
                min_world,
                max_world,
                Duration::from_millis(last_call_ms),
                kill_after,
            ))
        }
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("chorus: error: {}", chorus::error_report(error.as_ref()));
            ExitCode::FAILURE
        }
    }
}

/// `chorus selftest`: the cpu backend's check of every collective and dtype,
/// or the nccl backend's (which picks its own dtypes).
fn selftest_command(
    init: String,
    timeout: Duration,
    counts: Option<Vec<usize>>,
    dtypes: Option<Vec<DType>>,
    backend: chorus_lab::selftest::SelfTestBackend,
) -> Result<ExitCode> {
    use chorus_lab::selftest::SelfTestBackend;
    match (backend, dtypes) {
        // A rank drives its links from one thread, as its actor will: a
        // cross-thread wake-up per packet tripled the QUIC round trip.
        (SelfTestBackend::Cpu, dtypes) => run_async(selftest(
            init,
            timeout,
            counts.unwrap_or_else(|| vec![0, 1, 13, 1000]),
            dtypes.unwrap_or_else(|| chorus_lab::selftest::ALL_DTYPES.to_vec()),
        )),
        (SelfTestBackend::Nccl, Some(_)) => {
            eprintln!("chorus: selftest --backend nccl checks its own dtypes; --dtypes is for --backend cpu");
            Ok(ExitCode::from(2))
        }
        // One GPU per process; the probe's message and exit code 2 where
        // CUDA or NCCL is missing, which the launcher reports as the worker's.
        (SelfTestBackend::Nccl, None) => run_async(async move {
            use chorus_lab::selftest::nccl;
            let counts = counts.unwrap_or_else(|| nccl::DEFAULT_COUNTS.to_vec());
            let mut report = |line: &str| println!("{line}");
            match nccl::run(&init, timeout, &counts, &mut report).await {
                Ok(summary) => {
                    println!("{summary}");
                    Ok(ExitCode::SUCCESS)
                }
                Err(error) => {
                    eprintln!("chorus: selftest --backend nccl: {error}");
                    Ok(ExitCode::from(error.exit_code()))
                }
            }
        }),
    }
}

fn run_async<F: std::future::Future<Output = Result<ExitCode>>>(future: F) -> Result<ExitCode> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(future)
}

/// One rank of `chorus hello`: rendezvous, greet every peer over the mesh,
/// all-reduce and check the result, leave together.
async fn hello_worker(url: String, timeout: Duration) -> Result<ExitCode> {
    let group = init_process_group(InitOptions::from_url(&url)?.timeout(timeout)).await?;
    let me = &group.peers()[group.rank()];
    println!(
        "rank {}/{} (local rank {}, pid {} on {}) found:",
        group.rank(),
        group.world_size(),
        group.local_rank(),
        me.pid,
        me.host
    );
    // Greet every peer over the mesh: the links work, not only the store.
    for rank in (0..group.world_size()).filter(|&r| r != group.rank()) {
        let link = group.link(rank).context("a peer without a link")?;
        let greeting = format!("hello from rank {}", group.rank());
        link.send(0, group.rank() as u64, greeting.into()).await?;
    }
    for peer in group.peers() {
        let rank = peer.rank as usize;
        let reach = group.peer_address(rank).map_or_else(
            || "unreachable (published only loopback)".to_string(),
            |ip| ip.to_string(),
        );
        let heard = match group.link(rank) {
            Some(link) => {
                let frame = link.recv(0).await?;
                format!("{} said {:?}", link.kind(), String::from_utf8_lossy(&frame.payload))
            }
            None => "(this rank)".to_string(),
        };
        println!(
            "  rank {} pid {} on {} via {}: {}",
            peer.rank, peer.pid, peer.host, reach, heard
        );
    }
    check_all_reduce(&group).await?;
    group.destroy().await?;
    Ok(ExitCode::SUCCESS)
}

/// All-reduces 16 MiB of float32 (rank r contributes r + 1 everywhere) and
/// checks every element of the sum, so the job proves the data path.
async fn check_all_reduce(group: &chorus::ProcessGroup) -> Result<()> {
    const ELEMENTS: usize = 4 << 20;
    let world = group.world_size();
    let mine = chorus::Tensor::from_slice(&vec![(group.rank() + 1) as f32; ELEMENTS]);
    let started = std::time::Instant::now();
    let sum = group.all_reduce(mine, chorus::ReduceOp::Sum).await?;
    let took = started.elapsed();
    let expected = (world * (world + 1) / 2) as f32;
    let wrong = sum.to_vec::<f32>()?.iter().filter(|&&v| v != expected).count();
    if wrong > 0 {
        bail!("all_reduce gave {wrong} wrong elements of {ELEMENTS} (expected {expected} everywhere)");
    }
    let bytes = (ELEMENTS * 4) as f64;
    let busbw = bytes / took.as_secs_f64() / 1e9 * 2.0 * (world - 1) as f64 / world as f64;
    println!(
        "all_reduce of {} MiB float32: every element is {expected}, correct; {:.1} ms, busbw {busbw:.2} GB/s",
        (ELEMENTS * 4) >> 20,
        took.as_secs_f64() * 1e3
    );
    Ok(())
}

/// One rank of `chorus selftest`.
async fn selftest(url: String, timeout: Duration, counts: Vec<usize>, dtypes: Vec<DType>) -> Result<ExitCode> {
    let options = InitOptions::from_url(&url)?
        .timeout(timeout)
        .collective_timeout(timeout);
    let group = init_process_group(options).await?;
    let mut checks = 0;
    for &dtype in &dtypes {
        for &count in &counts {
            checks += chorus_lab::selftest::check_collectives(&group, dtype, count).await?;
        }
    }
    checks += chorus_lab::selftest::check_subgroups(&group).await?;
    println!(
        "selftest: rank {} of {}: {checks} checks passed ({} dtypes, counts {counts:?})",
        group.rank(),
        group.world_size(),
        dtypes.len()
    );
    group.destroy().await?;
    Ok(ExitCode::SUCCESS)
}

/// A seed from the clock and the pid, for runs that name none.
fn netem(args: NetemArgs) -> Result<ExitCode> {
    let ms = |v: f64| Duration::try_from_secs_f64(v / 1e3).context("--delay-ms and --jitter-ms must be >= 0");
    let impairment = chorus_lab::netem::core::Impairment::new(
        ms(args.delay_ms)?,
        ms(args.jitter_ms)?,
        args.loss,
        args.rate_mbit.map(|r| r * 1e6),
        args.limit,
    )?;
    let options = chorus_lab::netem::NetemOptions {
        a: args.a,
        b: args.b,
        impairment,
        seed: args.seed.unwrap_or_else(rand_seed),
    };
    chorus_lab::netem::run(&options)?;
    Ok(ExitCode::SUCCESS)
}

/// `chorus chaos`: the run, its verdict table (or JSON), exit 1 when a check failed.
fn chaos(args: ChaosArgs) -> Result<ExitCode> {
    let exe = std::env::current_exe().context("finding this executable")?;
    let program = match args.program.is_empty() {
        true => chorus_lab::chaos::Program::Example(exe.with_file_name("examples").join("train")),
        false => chorus_lab::chaos::Program::Command(args.program),
    };
    let faults = match args.faults.is_empty() {
        false => args.faults,
        true => {
            use chorus_lab::chaos::FaultKind::*;
            let mut kinds = vec![Kill, Stop, KillLauncher, Slow];
            if args.hosts.is_some() {
                kinds.extend([Partition, LossyLink, SlowLink]);
            }
            kinds
        }
    };
    let options = chorus_lab::chaos::ChaosOptions {
        program,
        chorus: exe,
        nodes: args.hosts.unwrap_or(args.nodes),
        hosts: args.hosts.is_some(),
        nproc_per_node: args.nproc_per_node,
        duration: args.duration,
        steps: args.steps,
        every: args.fault_every,
        faults,
        seed: args.seed,
        heartbeat: Duration::from_millis(args.heartbeat_ms),
        bounds: chorus_lab::chaos::Bounds {
            loss_tolerance: args.loss_tolerance,
            min_goodput: args.min_goodput,
            max_recovery: Duration::from_millis(args.max_recovery_ms),
        },
        dir: args.dir,
    };
    let report = chorus_lab::chaos::run(&options, &mut |line| eprintln!("{line}"))?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "# chorus chaos: {} {} x {} workers, seed {}, {} steps; chaos run {:.1} s, reference {:.1} s; {} faults acted, {} hit nothing",
            report.nodes,
            match report.hosts {
                true => "simulated hosts",
                false => "nodes",
            },
            report.nproc_per_node,
            report.seed,
            report.steps,
            report.chaos_seconds,
            report.reference_seconds,
            report.faults.iter().filter(|f| f.acted).count(),
            report.faults.iter().filter(|f| !f.acted).count(),
        );
        print!("{}", report.verdict.table());
        if let Some(dir) = &report.dir {
            println!("# the runs' files: {}", dir.display());
        }
    }
    Ok(match report.verdict.passed() {
        true => ExitCode::SUCCESS,
        false => ExitCode::FAILURE,
    })
}

fn rand_seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    nanos ^ (u64::from(std::process::id()) << 32)
}

/// One rank of `chorus fault-probe`: all-reduces until an operation fails,
/// then prints `event=error` (with the Unix time in ms, the error's kind and
/// the ranks it blames) and how long the next call took to fail, and exits 3.
async fn fault_probe(url: String, seconds: Duration) -> Result<ExitCode> {
    use chorus::CollectiveError;
    let unix_ms = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis())
    };
    let group = init_process_group(InitOptions::from_url(&url)?).await?;
    let (rank, world) = (group.rank(), group.world_size());
    println!(
        "probe rank={rank} pid={} event=ready at_ms={}",
        std::process::id(),
        unix_ms()
    );
    let started = Instant::now();
    let mut iteration = 0u64;
    while started.elapsed() < seconds {
        let sum = group
            .all_reduce(chorus::Tensor::from_slice(&[1.0f32; 1024]), chorus::ReduceOp::Sum)
            .await;
        match sum {
            Ok(sum) if sum.to_vec::<f32>()?.iter().all(|&v| v == world as f32) => {}
            Ok(_) => bail!("rank {rank}: all_reduce gave a wrong sum"),
            Err(error) => {
                let (kind, failed) = match &error {
                    CollectiveError::GroupAborted(aborted) => ("aborted", aborted.failed_ranks.clone()),
                    CollectiveError::Timeout { waiting_for, .. } => ("timeout", waiting_for.clone()),
                    CollectiveError::Transport(_) => ("transport", Vec::new()),
                    CollectiveError::Broken(_) => ("broken", Vec::new()),
                    _ => ("other", Vec::new()),
                };
                // `failed=[0,1]`: one word, for the tests' key=value parsing.
                let failed: Vec<String> = failed.iter().map(ToString::to_string).collect();
                println!(
                    "probe rank={rank} event=error at_ms={} iteration={iteration} kind={kind} failed=[{}] error={error}",
                    unix_ms(),
                    failed.join(",")
                );
                let next = Instant::now();
                let again = group
                    .all_reduce(chorus::Tensor::from_slice(&[1.0f32]), chorus::ReduceOp::Sum)
                    .await;
                println!(
                    "probe rank={rank} event=next ok={} waited_ms={}",
                    again.is_ok(),
                    next.elapsed().as_millis()
                );
                return Ok(ExitCode::from(3));
            }
        }
        iteration += 1;
        if iteration == 20 {
            println!("probe rank={rank} event=running at_ms={}", unix_ms());
        }
    }
    group.destroy().await?;
    Ok(ExitCode::SUCCESS)
}

/// One rank of an elastic group for the restart tests: all-reduces ones in
/// a loop, checks each sum against the generation's world size, and after a
/// restart agrees with the others on the step to resume from.
/// With `kill_after`, the process SIGKILLs itself after that many all-reduces.
async fn elastic_probe(
    url: String,
    iterations: u64,
    min_world: Option<usize>,
    max_world: Option<usize>,
    last_call: Duration,
    kill_after: Option<u64>,
) -> Result<ExitCode> {
    let mut options = InitOptions::from_url(&url)?
        .timeout(Duration::from_secs(30))
        .last_call(last_call);
    options.min_world = min_world;
    options.max_world = max_world;
    let group = chorus::ElasticGroup::init(options).await?;
    let mut probe = ElasticProbe::ready(group, kill_after).await?;
    while probe.done < iterations {
        probe.step().await?;
    }
    probe.leave().await
}

/// `chorus elastic-probe` between two all-reduces: its group, the
/// all-reduces done and the generation they were done in.
struct ElasticProbe {
    group: chorus::ElasticGroup,
    done: u64,
    generation: u64,
    /// The all-reduces after which this process SIGKILLs itself.
    kill_after: Option<u64>,
}

impl ElasticProbe {
    /// Says it is ready; a process that joined a running job first agrees
    /// with the survivors on the step to resume from.
    async fn ready(group: chorus::ElasticGroup, kill_after: Option<u64>) -> Result<Self> {
        use chorus::{ReduceOp, Tensor};
        let pg = group.current();
        println!(
            "probe rank={} gen={} world={} pid={} event=ready",
            pg.rank(),
            pg.generation(),
            pg.world_size(),
            std::process::id()
        );
        let mut done = 0u64;
        if pg.generation() > 0 {
            // Joined a running job (a relaunched worker): the survivors agree on
            // the step to resume from, and a joiner has none to offer.
            let step = pg
                .all_reduce(Tensor::from_slice(&[f64::INFINITY]), ReduceOp::Min)
                .await?;
            let step = step.to_vec::<f64>()?[0];
            done = if step.is_finite() { step as u64 } else { 0 };
            println!(
                "probe rank={} gen={} world={} event=joined resume={done}",
                pg.rank(),
                pg.generation(),
                pg.world_size()
            );
        }
        let generation = pg.generation();
        Ok(Self {
            group,
            done,
            generation,
            kill_after,
        })
    }

    /// One all-reduce of ones checked, or the first of a new generation.
    async fn step(&mut self) -> Result<()> {
        use chorus::{ReduceOp, Tensor};
        let pg = self.group.current();
        let result = if pg.generation() != self.generation {
            // A new generation, seen through an error below or formed by the
            // supervisor between two operations: a collective may have
            // completed on some survivors only, so resume from the least step.
            match pg
                .all_reduce(Tensor::from_slice(&[self.done as f64]), ReduceOp::Min)
                .await
            {
                Ok(step) => return self.resume(&pg, step),
                Err(error) => Err(error),
            }
        } else {
            pg.all_reduce(Tensor::from_slice(&[1.0f32; 1024]), ReduceOp::Sum).await
        };
        match result {
            Ok(sum) => self.summed(&pg, sum).await,
            Err(error) => {
                println!(
                    "probe rank={} gen={} event=error at_us={} error={error}",
                    pg.rank(),
                    pg.generation(),
                    chorus::train::record::unix_us()
                );
                self.group
                    .next_generation(pg.generation())
                    .await
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
                Ok(())
            }
        }
    }

    /// Resumes in `pg`'s generation from the least step its members hold.
    fn resume(&mut self, pg: &chorus::ProcessGroup, step: chorus::Tensor) -> Result<()> {
        self.done = step.to_vec::<f64>()?[0] as u64;
        self.generation = pg.generation();
        // at_us: when the first collective of the new generation completed here.
        println!(
            "probe rank={} gen={} world={} event=restarted resume={} at_us={}",
            pg.rank(),
            pg.generation(),
            pg.world_size(),
            self.done,
            chorus::train::record::unix_us()
        );
        Ok(())
    }

    /// Checks a sum against the world size and counts it; kills this
    /// process where asked, says when it is running.
    async fn summed(&mut self, pg: &chorus::ProcessGroup, sum: chorus::Tensor) -> Result<()> {
        if !sum.to_vec::<f32>()?.iter().all(|&v| v == pg.world_size() as f32) {
            bail!(
                "rank {} generation {}: all_reduce gave a wrong sum",
                pg.rank(),
                pg.generation()
            );
        }
        self.done += 1;
        if Some(self.done) == self.kill_after {
            println!(
                "probe rank={} gen={} pid={} event=killing-self at_us={}",
                pg.rank(),
                pg.generation(),
                std::process::id(),
                chorus::train::record::unix_us()
            );
            process::signal_self(Signal::SIGKILL);
        }
        if self.done == 20 {
            println!("probe rank={} gen={} event=running", pg.rank(), pg.generation());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
        Ok(())
    }

    /// Says it is done and leaves the group.
    async fn leave(self) -> Result<ExitCode> {
        let pg = self.group.current();
        println!(
            "probe rank={} gen={} world={} event=done iterations={} pid={}",
            pg.rank(),
            pg.generation(),
            pg.world_size(),
            self.done,
            std::process::id()
        );
        drop(pg);
        self.group.destroy().await?;
        Ok(ExitCode::SUCCESS)
    }
}

/// Starts `--world` worker processes, prefixes their output with their rank
/// and fails if any fails or the job outlives `--timeout`. The first rank to
/// fail ends the job: it is named with its last error line, and the others
/// are killed (SIGKILL: also a stopped one) instead of waiting on a peer or a
/// store that is gone.
fn hello(args: &HelloArgs) -> Result<ExitCode> {
    if args.world == 0 {
        bail!("--world must be at least 1");
    }
    let exe = std::env::current_exe().context("locating the chorus binary")?;
    let port = free_port().context("finding a free port")?;
    let store_file = std::env::temp_dir().join(format!("chorus-hello-{}-{port}.store", std::process::id()));
    let url = match args.init {
        InitKind::Tcp => format!("tcp://127.0.0.1:{port}"),
        InitKind::File => format!("file://{}", store_file.display()),
        InitKind::Env => "env://".to_string(),
    };
    // The ranks sign their records with one secret, as under `chorus launch`.
    let secret = match std::env::var("CHORUS_JOB_SECRET") {
        Ok(secret) if !secret.is_empty() => secret,
        _ => chorus::auth::random_hex(32)?,
    };
    println!("chorus hello: {} ranks meeting over {url}", args.world);
    let mut ranks = HelloRanks::start(args, &exe, &url, port, &secret)?;
    let failed = ranks.watch(args.timeout);
    ranks.stop();
    let _ = std::fs::remove_file(&store_file);
    if failed.is_empty() {
        println!("chorus hello: all {} ranks found each other", args.world);
        return Ok(ExitCode::SUCCESS);
    }
    bail!("{}", ranks.why(&failed))
}

/// The rank processes of `chorus hello`, and what they printed.
struct HelloRanks {
    children: Vec<Child>,
    /// (rank, from stderr, line)
    lines: mpsc::Receiver<(usize, bool, String)>,
    /// Each rank's last line on stderr: why it failed.
    last_error: Vec<Option<String>>,
    /// The ranks not seen to exit.
    running: Vec<usize>,
}

impl HelloRanks {
    /// Starts every rank, its output forwarded line by line.
    fn start(args: &HelloArgs, exe: &std::path::Path, url: &str, port: u16, secret: &str) -> Result<Self> {
        let (lines_tx, lines) = mpsc::channel::<(usize, bool, String)>();
        let mut children: Vec<Child> = Vec::new();
        for rank in 0..args.world {
            let mut command = Command::new(exe);
            torchrun_env(&mut command, rank, args.world, port);
            command
                .args(["hello", "--timeout", &args.timeout.to_string(), "--worker", url])
                .env("CHORUS_JOB_SECRET", secret)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            let mut child = command.spawn().with_context(|| format!("starting rank {rank}"))?;
            let stdout = child
                .stdout
                .take()
                .map(|s| (false, Box::new(s) as Box<dyn std::io::Read + Send>));
            let stderr = child
                .stderr
                .take()
                .map(|s| (true, Box::new(s) as Box<dyn std::io::Read + Send>));
            for (is_stderr, stream) in [stdout, stderr].into_iter().flatten() {
                let tx = lines_tx.clone();
                std::thread::spawn(move || {
                    for line in BufReader::new(stream).lines().map_while(Result::ok) {
                        let _ = tx.send((rank, is_stderr, line));
                    }
                });
            }
            children.push(child);
        }
        Ok(Self {
            running: (0..children.len()).collect(),
            last_error: vec![None; args.world],
            children,
            lines,
        })
    }

    /// Prints a rank's line, and keeps it when it may say why the rank failed.
    fn show(&mut self, (rank, is_stderr, line): (usize, bool, String)) {
        if is_stderr && !line.trim().is_empty() {
            self.last_error[rank] = Some(line.clone());
        }
        println!("[{rank}]: {line}");
    }

    /// Shows the ranks' lines until every rank exited, one failed, or the
    /// job outlived `timeout` seconds (every rank still running failed);
    /// returns the failures.
    fn watch(&mut self, timeout: u64) -> Vec<(usize, String)> {
        let deadline = Instant::now() + Duration::from_secs(timeout) + Duration::from_secs(5);
        let mut failed: Vec<(usize, String)> = Vec::new();
        while !self.running.is_empty() && failed.is_empty() {
            while let Ok(line) = self.lines.try_recv() {
                self.show(line);
            }
            self.running.retain(|&rank| match self.children[rank].try_wait() {
                Ok(Some(status)) => {
                    if !status.success() {
                        failed.push((rank, format!("exited with {status}")));
                    }
                    false
                }
                Ok(None) => true,
                Err(_) => false,
            });
            if failed.is_empty() && Instant::now() > deadline {
                failed.extend(
                    self.running
                        .iter()
                        .map(|&rank| (rank, format!("was still running after {timeout}s"))),
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        failed
    }

    /// Kills the ranks still running, waits for every one and shows their last lines.
    fn stop(&mut self) {
        for &rank in &self.running {
            let _ = self.children[rank].kill();
        }
        for child in &mut self.children {
            let _ = child.wait();
        }
        while let Ok(line) = self.lines.recv() {
            self.show(line);
        }
    }

    /// Why the job failed: each failed rank with its last error line, and
    /// the ranks killed because of it.
    fn why(&self, failed: &[(usize, String)]) -> String {
        let mut why: Vec<String> = failed
            .iter()
            .map(|(rank, how)| match &self.last_error[*rank] {
                Some(line) => format!("rank {rank} {how}: {}", line.trim_start_matches("chorus: error: ")),
                None => format!("rank {rank} {how}"),
            })
            .collect();
        let stopped: Vec<String> = self
            .running
            .iter()
            .filter(|r| !failed.iter().any(|(f, _)| f == *r))
            .map(ToString::to_string)
            .collect();
        if !stopped.is_empty() {
            why.push(format!("killed the other ranks still running ({})", stopped.join(", ")));
        }
        why.join("; ")
    }
}

/// `chorus dashboard`: the page of the job on `store`, until interrupted.
async fn dashboard(
    store: String,
    addr: String,
    run_id: Option<String>,
    secret_file: Option<std::path::PathBuf>,
    faults: bool,
) -> Result<ExitCode> {
    let secret = match secret_file {
        Some(path) => std::fs::read_to_string(&path)
            .with_context(|| format!("reading the job secret from {}", path.display()))?
            .trim()
            .to_string(),
        None => std::env::var("CHORUS_JOB_SECRET").unwrap_or_default(),
    };
    if secret.is_empty() {
        bail!("the job secret is required: set CHORUS_JOB_SECRET or give --job-secret-file");
    }
    let options = TcpStoreOptions {
        timeout: Duration::from_secs(10),
        connect_timeout: Duration::from_secs(10),
        ..TcpStoreOptions::default()
    };
    let client: std::sync::Arc<dyn Store> = std::sync::Arc::new(
        TcpStore::connect(store.clone(), options)
            .await
            .with_context(|| format!("connecting to the job's store at {store}"))?,
    );
    let options = chorus_cli::dashboard::DashboardOptions {
        addr,
        faults,
        secret,
        run_id,
    };
    let dashboard = chorus_cli::dashboard::start(client, &options).await?;
    if let Some(warning) = dashboard.exposure_warning() {
        eprintln!("chorus dashboard: {warning}");
    }
    println!("chorus dashboard: {} (store {store})", dashboard.url());
    tokio::select! {
        () = dashboard.wait() => Ok(ExitCode::FAILURE),
        _ = tokio::signal::ctrl_c() => Ok(ExitCode::SUCCESS),
    }
}

fn client_options(client: &ClientArgs) -> TcpStoreOptions {
    TcpStoreOptions {
        timeout: Duration::from_secs(client.timeout),
        connect_timeout: Duration::from_secs(client.timeout),
        key_prefix: if client.raw { String::new() } else { "/".to_string() },
        ..TcpStoreOptions::default()
    }
}

async fn connect(client: &ClientArgs) -> Result<TcpStore> {
    Ok(TcpStore::connect(client.addr.clone(), client_options(client)).await?)
}

/// Prints a value as text when it is text, as hex otherwise.
fn show(value: &[u8]) -> String {
    match std::str::from_utf8(value) {
        Ok(text) if !text.chars().any(|c| c.is_control() && c != '\n' && c != '\t') => text.to_string(),
        _ => format!("0x{}", value.iter().map(|b| format!("{b:02x}")).collect::<String>()),
    }
}

async fn store_command(command: StoreCommand) -> Result<ExitCode> {
    match command {
        StoreCommand::Serve { port, host } => {
            let addr = format!("{host}:{port}")
                .parse()
                .with_context(|| format!("{host}:{port} is not an IP address and port"))?;
            let server = TcpStoreServer::bind(addr, TcpStoreServerOptions::default())
                .await
                .with_context(|| format!("serving the store on {addr}"))?;
            println!("chorus store serving on {}", server.local_addr());
            tokio::signal::ctrl_c().await?;
            server.shutdown().await;
        }
        StoreCommand::Get { client, key } => {
            let value = connect(&client).await?.get(&key).await?;
            println!("{}", show(&value));
        }
        StoreCommand::Set { client, key, value } => {
            connect(&client).await?.set(&key, value.as_bytes()).await?;
        }
        StoreCommand::Add { client, key, delta } => {
            println!("{}", connect(&client).await?.add(&key, delta).await?);
        }
        StoreCommand::Wait { client, keys } => {
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            connect(&client).await?.wait(&keys).await?;
        }
        StoreCommand::Check { client, keys } => {
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            let store = connect(&client).await?;
            if store.check(&keys).await? {
                println!("ready");
            } else {
                let mut missing = Vec::new();
                for key in keys {
                    if !store.check(&[key]).await? {
                        missing.push(key);
                    }
                }
                println!("not ready: missing {}", missing.join(", "));
                return Ok(ExitCode::from(1));
            }
        }
        StoreCommand::Delete { client, key } => {
            let existed = connect(&client).await?.delete(&key).await?;
            println!("{}", if existed { "deleted" } else { "no such key" });
        }
        StoreCommand::Keys { client } => {
            let mut keys = connect(&client).await?.list_keys().await?;
            keys.sort();
            for key in &keys {
                match key.strip_prefix(b"/") {
                    Some(name) if !client.raw => println!("{}", show(name)),
                    // Not reachable through the "/" prefix: only with --raw.
                    None if !client.raw => println!("{}  (stored without \"/\": use --raw)", show(key)),
                    _ => println!("{}", show(key)),
                }
            }
            println!("{} keys", keys.len());
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn bench_command(command: BenchCommand) -> Result<ExitCode> {
    let Some(subcommand) = command.command else {
        let args = command.collective;
        if args.worker {
            chorus_lab::bench::collective::run_worker(&args).await?;
            return Ok(ExitCode::SUCCESS);
        }
        // The parent only waits on its ranks' pipes: off the async thread.
        return tokio::task::spawn_blocking(move || chorus_lab::bench::collective::run(&args)).await?;
    };
    match subcommand {
        BenchSubcommand::Ddp(args) => {
            tokio::task::spawn_blocking(move || match args.worker {
                true => chorus_lab::bench::ddp::run_worker_blocking(&args).map(|()| ExitCode::SUCCESS),
                false => chorus_lab::bench::ddp::run(&args),
            })
            .await?
        }
        BenchSubcommand::Memory(args) => {
            tokio::task::spawn_blocking(move || chorus_lab::bench::memory::run(&args)).await?
        }
        BenchSubcommand::Tune(args) => tokio::task::spawn_blocking(move || chorus_lab::bench::tune::run(&args)).await?,
        BenchSubcommand::Scale(args) => {
            let ok = tokio::task::spawn_blocking(move || chorus_lab::bench::scale::run(&args)).await??;
            Ok(if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
        }
        BenchSubcommand::Transfer(args) => {
            // The parent only waits on its ranks; a rank runs on a runtime of its own.
            tokio::task::spawn_blocking(move || match args.worker {
                true => chorus_lab::bench::transfer::run_worker_blocking(&args).map(|()| ExitCode::SUCCESS),
                false => chorus_lab::bench::transfer::run(&args),
            })
            .await?
        }
        BenchSubcommand::Recovery(args) => bench_recovery(args).await,
        BenchSubcommand::Transport(args) => bench_transport(args).await,
    }
}

/// `chorus bench recovery`: the trials, then success where every one recovered.
async fn bench_recovery(args: RecoveryArgs) -> Result<ExitCode> {
    if args.world < 2 || args.iterations <= 20 {
        bail!("--world must be at least 2 and --iterations above 20 (the kill comes after the 20th)");
    }
    let bench = chorus_lab::bench::recovery::RecoveryBench {
        world: args.world,
        trials: args.trials,
        transport: args.transport,
        heartbeat_timeout: args.heartbeat_timeout,
        last_call_ms: args.last_call_ms,
        iterations: args.iterations,
        seed: args.seed.unwrap_or_else(rand_seed),
        trial_timeout: Duration::from_secs(60),
        compare_torchrun: args.compare.map(|_| args.python),
    };
    let failed = chorus_lab::bench::recovery::run(&bench, args.json).await?;
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// `chorus bench transport`: as the leader, the table (or JSON rows); as
/// the peer process, its half of every path.
async fn bench_transport(args: TransportArgs) -> Result<ExitCode> {
    use chorus_lab::bench::transport::{TransportBench, run_leader, run_peer};
    let bench = TransportBench {
        size: args.size,
        iters: args.iters,
        rtt_iters: args.rtt_iters,
        rounds: args.rounds.max(1),
        paths: chorus_lab::bench::transport::PATHS
            .into_iter()
            .filter(|p| args.paths.iter().any(|q| q == p))
            .collect(),
        bind: args.bind,
        peer_bind: args.peer_bind.unwrap_or(args.bind),
        peer_prefix: args
            .peer_prefix
            .map(|p| p.split_whitespace().map(str::to_string).collect())
            .unwrap_or_default(),
        quic_congestion: args.quic_congestion,
    };
    if let Some(store) = args.peer_store {
        run_peer(&bench, store).await?;
        return Ok(ExitCode::SUCCESS);
    }
    let exe = std::env::current_exe().context("locating the chorus binary")?;
    let (results, memcpy) = run_leader(&bench, &exe).await?;
    let tcp = results.iter().find(|r| r.path == "tcp").map(|r| (r.gbps, r.rtt_us));
    let size = args.size;
    if args.json {
        for r in &results {
            println!(
                "{{\"path\":\"{}\",\"bytes\":{},\"gbps\":{:.6},\"rtt_us\":{:.1},\"memcpy_gbps\":{:.2}}}",
                r.path, size, r.gbps, r.rtt_us, memcpy
            );
        }
        return Ok(ExitCode::SUCCESS);
    }
    let (iters, rtt_iters, rounds) = (args.iters, args.rtt_iters, args.rounds);
    println!(
        "# chorus bench transport: {size} B x {iters} per sample, {rtt_iters} round trips, median of {rounds} rounds"
    );
    println!("#  path   throughput(GB/s)  vs tcp   rtt 8B(us)  vs tcp");
    for r in &results {
        let (tcp_gbps, tcp_rtt) = tcp.unwrap_or((r.gbps, r.rtt_us));
        println!(
            "   {:<6} {:>16.2} {:>7.2}x {:>12.1} {:>7.2}x",
            r.path,
            r.gbps,
            r.gbps / tcp_gbps,
            r.rtt_us,
            r.rtt_us / tcp_rtt
        );
    }
    println!("# single-thread memcpy: {memcpy:.2} GB/s");
    Ok(ExitCode::SUCCESS)
}
