//! Store throughput: chorus's TCPStore server against PyTorch's, side by side.
//!
//! Measures set/get pairs per second with N clients (default 8), each client
//! on its own connection looping `set(key_i, value)` then `get(key_i)` on its
//! own key. (A `get` is `WAIT` + `GET` on the wire for both PyTorch's client
//! and chorus's, and `SET` has no reply, so one pair is three requests and
//! two replies, two round trips.) Both servers run as separate processes,
//! started by this program:
//!
//! - chorus: `chorus store serve --host 127.0.0.1 --port 0` (the `chorus`
//!   binary next to this example's directory, or `--chorus-bin`);
//! - PyTorch: `python3 lab/python/serve_store.py` (its libuv server).
//!
//! Two kinds of load generator are measured against each server:
//!
//! - `chorus` clients: N [`TcpStore`] clients, tokio tasks in this process;
//! - `python` clients: N Python processes running PyTorch's own client
//!   (`lab/python/bench_store_client.py`), skipped with `--skip-python-clients`.
//!
//! Rounds alternate between the servers (chorus, pytorch, chorus, ...) so
//! that a noisy shared machine slows both alike. Every client connects once,
//! before the first round, so connection set-up and Python's import time are
//! not measured.
//!
//! Run it (build the `chorus` binary too; the example runs it):
//!
//! ```text
//! cargo build --release --example store_bench --bin chorus
//! cargo run --release --example store_bench -- [--clients 8] [--rounds 5] [--seconds 3] [--value-bytes 64] [--json]
//! ```
//!
//! Reading the output: one line per round, then a summary per client kind
//! and server: the median of the rounds' pairs/s (all clients together),
//! min–max over rounds, the server process's CPU time per pair (user+system,
//! from /proc; lower is a more efficient server whatever the load generator
//! manages), and chorus/pytorch, the ratio of the medians (above 1: chorus
//! is faster). The line after it gives the ratio round by round (each chorus
//! run against the PyTorch run right after it), which is steadier when the
//! machine's load drifts. On a machine with few cores the clients compete with the
//! server for CPU, so pairs/s is a property of the whole setup; the CPU per
//! pair is the server's own cost. `--json` prints one JSON object per line
//! instead (kinds `round`, `summary`, `ratio`, `paired_ratio`). If Python cannot import
//! torch, only the chorus server is measured, and the output says so.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use chorus::store::{Store, TcpStore, TcpStoreOptions};
use clap::Parser;

#[derive(Parser)]
#[command(about = "Set/get pairs per second: chorus's store server against PyTorch's.")]
struct Args {
    /// Clients of each kind, each on its own connection.
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// Rounds per server and client kind.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Seconds per round.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Bytes per value.
    #[arg(long, default_value_t = 64)]
    value_bytes: usize,
    /// Measure with chorus clients only.
    #[arg(long)]
    skip_python_clients: bool,
    /// Print one JSON object per line instead of tables.
    #[arg(long)]
    json: bool,
    /// The chorus binary (default: `chorus` in the target directory of this example).
    #[arg(long)]
    chorus_bin: Option<PathBuf>,
    /// The Python interpreter that has torch.
    #[arg(long, default_value = "python3")]
    python: String,
}

const CHORUS: &str = "chorus";
const PYTORCH: &str = "pytorch";

fn main() -> Result<()> {
    let args = Args::parse();
    if args.clients == 0 || args.rounds == 0 || args.seconds <= 0.0 {
        bail!("--clients, --rounds and --seconds must be positive");
    }
    let python_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("lab/python");
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let chorus_bin = match &args.chorus_bin {
        Some(path) => path.clone(),
        None => default_chorus_bin()?,
    };
    let servers = Servers::start(&args, &chorus_bin, &python_dir)?;
    let use_python_clients = !args.skip_python_clients && servers.no_torch.is_none();
    let mut clients = Clients::connect(&args, &runtime, &servers.list, &python_dir, use_python_clients)?;
    let mut kinds = vec![CHORUS];
    if use_python_clients {
        kinds.push(PYTHON);
    }
    let out = Output { json: args.json };
    out.header(
        &args,
        &servers.list,
        &chorus_bin,
        servers.no_torch.is_some(),
        use_python_clients,
    );
    clients.warm_up(&kinds, &servers.list)?;
    let rows = clients.rounds(&args, &kinds, &servers.list, &out)?;
    out.summary(&rows, &kinds, &servers.list);
    // Close the clients before the servers, so neither logs a broken connection.
    clients.close();
    servers.stop();
    Ok(())
}

const PYTHON: &str = "python";

/// The servers measured, each a process of its own; dropped on an early
/// error, PyTorch's goes first, then chorus's.
struct Servers {
    /// What the clients reach: chorus's, then PyTorch's when torch is there.
    list: Vec<Server>,
    pytorch: Option<Proc>,
    chorus: Proc,
    /// Why PyTorch's server is not measured.
    no_torch: Option<String>,
}

impl Servers {
    /// Starts chorus's server, then PyTorch's where torch imports.
    fn start(args: &Args, chorus_bin: &Path, python_dir: &Path) -> Result<Self> {
        let mut chorus = Proc::spawn(
            Command::new(chorus_bin).args(["store", "serve", "--host", "127.0.0.1", "--port", "0"]),
            &format!("{} store serve", chorus_bin.display()),
        )?;
        let first = chorus.line(Duration::from_secs(10))?;
        let chorus_addr = first
            .strip_prefix("chorus store serving on ")
            .with_context(|| format!("chorus server said {first:?}, not \"chorus store serving on ADDR\""))?
            .trim()
            .to_string();
        let mut servers = Self {
            list: vec![Server {
                name: CHORUS,
                addr: chorus_addr,
                pid: chorus.pid(),
            }],
            pytorch: None,
            chorus,
            no_torch: None,
        };
        match Self::start_pytorch(args, python_dir) {
            Ok((proc, port)) => {
                servers.list.push(Server {
                    name: PYTORCH,
                    addr: format!("127.0.0.1:{port}"),
                    pid: proc.pid(),
                });
                servers.pytorch = Some(proc);
            }
            Err(e) => servers.no_torch = Some(format!("{e:#}")),
        }
        if let Some(why) = &servers.no_torch {
            eprintln!("store_bench: PyTorch's TCPStore is not available, measuring the chorus server only.\n  {why}");
        }
        Ok(servers)
    }

    /// PyTorch's libuv server, and the port it listens on.
    fn start_pytorch(args: &Args, python_dir: &Path) -> Result<(Proc, u16)> {
        let mut python = Command::new(&args.python);
        python
            .arg(python_dir.join("serve_store.py"))
            .env("PYTHONWARNINGS", "ignore");
        let mut p = Proc::spawn(&mut python, "serve_store.py")?;
        // Importing torch takes seconds on a loaded machine.
        let port = p.line(Duration::from_secs(120))?;
        let port: u16 = port
            .trim()
            .parse()
            .with_context(|| format!("serve_store.py printed {port:?}"))?;
        Ok((p, port))
    }

    /// Lets PyTorch's server exit, then kills chorus's.
    fn stop(mut self) {
        if let Some(server) = self.pytorch.take() {
            server.finish();
        }
        self.chorus.kill();
    }
}

/// The load generators, every one connected to every server. Dropped on an
/// early error, the Python clients go first.
struct Clients<'a> {
    runtime: &'a tokio::runtime::Runtime,
    /// Python processes running PyTorch's client (none without them).
    python: Vec<Proc>,
    /// chorus's clients, [server][client].
    chorus: Vec<Vec<Arc<TcpStore>>>,
    /// The value every client sets.
    value: Vec<u8>,
}

impl<'a> Clients<'a> {
    /// Every client connects to every server now, once.
    fn connect(
        args: &Args,
        runtime: &'a tokio::runtime::Runtime,
        servers: &[Server],
        python_dir: &Path,
        use_python_clients: bool,
    ) -> Result<Self> {
        let value = vec![0xa5u8; args.value_bytes];
        let chorus: Vec<Vec<Arc<TcpStore>>> = runtime.block_on(async {
            let mut all = Vec::new();
            for server in servers {
                let mut clients = Vec::new();
                for _ in 0..args.clients {
                    let options = TcpStoreOptions {
                        timeout: Duration::from_secs(60),
                        connect_timeout: Duration::from_secs(10),
                        ..Default::default()
                    };
                    let store = TcpStore::connect(server.addr.clone(), options)
                        .await
                        .with_context(|| format!("connecting to the {} server at {}", server.name, server.addr))?;
                    clients.push(Arc::new(store));
                }
                all.push(clients);
            }
            anyhow::Ok(all)
        })?;
        let mut clients = Self {
            runtime,
            python: Vec::new(),
            chorus,
            value,
        };
        if use_python_clients {
            clients.start_python(args, servers, python_dir)?;
        }
        Ok(clients)
    }

    /// PyTorch's clients, a process each, until every one is ready.
    fn start_python(&mut self, args: &Args, servers: &[Server], python_dir: &Path) -> Result<()> {
        for index in 0..args.clients {
            let mut command = Command::new(&args.python);
            command
                .arg(python_dir.join("bench_store_client.py"))
                .arg(index.to_string())
                .arg(args.value_bytes.to_string())
                .args(servers.iter().map(|s| format!("{}={}", s.name, s.addr)))
                .env("PYTHONWARNINGS", "ignore");
            self.python.push(Proc::spawn(&mut command, "bench_store_client.py")?);
        }
        // Started together, they import torch in parallel; wait for all.
        for client in &mut self.python {
            let line = client.line(Duration::from_secs(300))?;
            if line.trim() != "ready" {
                bail!("bench_store_client.py said {line:?}, not \"ready\"");
            }
        }
        Ok(())
    }

    /// Pages in code, grows buffers and the key table; not counted.
    fn warm_up(&mut self, kinds: &[&str], servers: &[Server]) -> Result<()> {
        for kind in kinds {
            for (s, server) in servers.iter().enumerate() {
                let warm = Duration::from_millis(500);
                self.measure(kind, s, server, warm)?;
            }
        }
        Ok(())
    }

    /// Every round: each client kind against each server in turn, a row each.
    fn rounds(&mut self, args: &Args, kinds: &[&'static str], servers: &[Server], out: &Output) -> Result<Vec<Row>> {
        let seconds = Duration::from_secs_f64(args.seconds);
        let mut rows = Vec::new();
        for round in 1..=args.rounds {
            for kind in kinds {
                for (s, server) in servers.iter().enumerate() {
                    let m = self.measure(kind, s, server, seconds)?;
                    let row = Row {
                        round,
                        clients: kind,
                        server: server.name,
                        pairs: m.pairs,
                        pairs_per_s: m.pairs_per_s,
                        cpu_us_per_pair: m.server_cpu_s * 1e6 / m.pairs.max(1) as f64,
                    };
                    out.round(&row);
                    rows.push(row);
                }
            }
        }
        Ok(rows)
    }

    /// Closes chorus's clients, then lets the Python ones exit.
    fn close(self) {
        let Self { python, chorus, .. } = self;
        drop(chorus);
        for client in python {
            client.finish();
        }
    }

    /// One timed run of every client of `kind` against server number `s`.
    fn measure(&mut self, kind: &str, s: usize, server: &Server, seconds: Duration) -> Result<Measured> {
        let cpu_before = process_cpu_seconds(server.pid);
        // Per client: pairs and the seconds it ran. The total rate is the sum of
        // per-client rates, so a client that starts a little late counts fairly.
        let results: Vec<(u64, f64)> = if kind == CHORUS {
            self.runtime.block_on(async {
                let tasks: Vec<_> = self.chorus[s]
                    .iter()
                    .enumerate()
                    .map(|(i, store)| {
                        let store = store.clone();
                        let value = self.value.to_vec();
                        tokio::spawn(async move { chorus_client_loop(&store, i, &value, seconds).await })
                    })
                    .collect();
                let mut results = Vec::new();
                for task in tasks {
                    results.push(task.await??);
                }
                anyhow::Ok(results)
            })?
        } else {
            // Send every client its go first, then collect, so they run together.
            let go = format!("{} {}\n", server.name, seconds.as_secs_f64());
            for client in self.python.iter_mut() {
                client.send(&go)?;
            }
            let mut results = Vec::new();
            for client in self.python.iter_mut() {
                let line = client.line(seconds + Duration::from_secs(60))?;
                let mut fields = line.split_whitespace();
                let parsed = (|| Some((fields.next()?.parse().ok()?, fields.next()?.parse().ok()?)))();
                results.push(parsed.with_context(|| format!("bench_store_client.py printed {line:?}"))?);
            }
            results
        };
        let cpu_after = process_cpu_seconds(server.pid);
        Ok(Measured {
            pairs: results.iter().map(|r| r.0).sum(),
            pairs_per_s: results.iter().map(|&(n, t)| n as f64 / t).sum(),
            server_cpu_s: match (cpu_before, cpu_after) {
                (Some(a), Some(b)) => b - a,
                _ => f64::NAN,
            },
        })
    }
}

/// `target/<profile>/chorus`: examples are built into `target/<profile>/examples/`.
fn default_chorus_bin() -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .context("this example's executable has no grandparent directory")?;
    let bin = dir.join(format!("chorus{}", std::env::consts::EXE_SUFFIX));
    if !bin.exists() {
        bail!(
            "{} does not exist; build it alongside the example (cargo build --release --example store_bench --bin chorus) or pass --chorus-bin",
            bin.display()
        );
    }
    Ok(bin)
}

struct Server {
    name: &'static str,
    addr: String,
    pid: u32,
}

struct Measured {
    pairs: u64,
    pairs_per_s: f64,
    server_cpu_s: f64,
}

async fn chorus_client_loop(store: &TcpStore, index: usize, value: &[u8], seconds: Duration) -> Result<(u64, f64)> {
    let key = format!("bench/rs/{index}");
    let started = Instant::now();
    let deadline = started + seconds;
    let mut pairs = 0u64;
    loop {
        store.set(&key, value).await?;
        let got = store.get(&key).await?;
        pairs += 1;
        if Instant::now() >= deadline {
            // Checked once per run: a wrong value means a broken server.
            if got.len() != value.len() {
                bail!("get returned {} bytes, not the {} set", got.len(), value.len());
            }
            return Ok((pairs, started.elapsed().as_secs_f64()));
        }
    }
}

/// User+system CPU seconds of a process and all its threads, from /proc (Linux only).
fn process_cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces; fields resume after its closing ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line, 12 and 13 after ')'.
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf only reads a configuration value.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (per_second > 0).then(|| ticks as f64 / per_second as f64)
}

/// A child process whose stdout is read line by line with timeouts, and
/// whose stderr is kept for error messages.
struct Proc {
    child: Child,
    what: String,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    stderr: Arc<Mutex<String>>,
}

impl Proc {
    fn spawn(command: &mut Command, what: &str) -> Result<Self> {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {what}"))?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let mut stderr_pipe = child.stderr.take().expect("stderr is piped");
        let (tx, lines) = mpsc::channel();
        // Reader threads, so that reads can time out and a chatty stderr never blocks the child.
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(String::new()));
        let sink = stderr.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = stderr_pipe.read(&mut buf) {
                if n == 0 {
                    break;
                }
                let mut text = sink.lock().unwrap();
                text.push_str(&String::from_utf8_lossy(&buf[..n]));
                // Only the tail matters for an error message.
                if text.len() > 16_384 {
                    let cut = text.len() - 8192;
                    let cut = (cut..text.len()).find(|&i| text.is_char_boundary(i)).unwrap_or(0);
                    text.drain(..cut);
                }
            }
        });
        Ok(Self {
            stdin: child.stdin.take(),
            child,
            what: what.to_string(),
            lines,
            stderr,
        })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn line(&mut self, timeout: Duration) -> Result<String> {
        match self.lines.recv_timeout(timeout) {
            Ok(line) => Ok(line),
            Err(mpsc::RecvTimeoutError::Timeout) => bail!("{} said nothing for {timeout:?}", self.what),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                // Give stderr's reader a moment to collect the last words.
                let _ = self.child.wait();
                std::thread::sleep(Duration::from_millis(100));
                let stderr = self.stderr.lock().unwrap();
                let last = stderr.trim().lines().last().unwrap_or("(no stderr)").to_string();
                bail!("{} exited: {last}", self.what)
            }
        }
    }

    fn send(&mut self, text: &str) -> Result<()> {
        let stdin = self.stdin.as_mut().context("stdin already closed")?;
        stdin
            .write_all(text.as_bytes())
            .and_then(|()| stdin.flush())
            .with_context(|| format!("writing to {}", self.what))
    }

    /// Closes stdin (the Python helpers exit on EOF), then kills it if it lingers.
    fn finish(mut self) {
        self.stdin.take();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // On an early error, leave no server or client running.
        if let Ok(None) = self.child.try_wait() {
            self.kill();
        }
    }
}

struct Row {
    round: usize,
    clients: &'static str,
    server: &'static str,
    pairs: u64,
    pairs_per_s: f64,
    cpu_us_per_pair: f64,
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

/// JSON has no NaN; a missing figure is null.
fn num(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.1}")
    } else {
        "null".into()
    }
}

struct Output {
    json: bool,
}

impl Output {
    fn header(&self, args: &Args, servers: &[Server], chorus_bin: &Path, no_torch: bool, python_clients: bool) {
        if self.json {
            return;
        }
        println!(
            "store_bench: {} clients per kind, {}-byte values, {} rounds x {} s per server and client kind, servers alternating",
            args.clients, args.value_bytes, args.rounds, args.seconds
        );
        for server in servers {
            let how = if server.name == CHORUS {
                format!("{} store serve", chorus_bin.display())
            } else {
                "lab/python/serve_store.py (PyTorch's libuv TCPStore)".to_string()
            };
            println!(
                "  {:<8} server on {:<16} pid {:<8} {how}",
                server.name, server.addr, server.pid
            );
        }
        if no_torch {
            println!("  pytorch  server: NOT MEASURED, python cannot import torch");
        }
        if !python_clients {
            println!("  python clients: skipped");
        }
        println!();
        println!(
            "{:>5}  {:<8} {:<8} {:>11} {:>13}",
            "round", "clients", "server", "pairs/s", "srv µs/pair"
        );
    }

    fn round(&self, row: &Row) {
        if self.json {
            println!(
                "{{\"kind\":\"round\",\"round\":{},\"clients\":\"{}\",\"server\":\"{}\",\"pairs\":{},\"pairs_per_s\":{},\"server_cpu_us_per_pair\":{}}}",
                row.round,
                row.clients,
                row.server,
                row.pairs,
                num(row.pairs_per_s),
                num(row.cpu_us_per_pair)
            );
        } else {
            println!(
                "{:>5}  {:<8} {:<8} {:>11.0} {:>13.1}",
                row.round, row.clients, row.server, row.pairs_per_s, row.cpu_us_per_pair
            );
        }
    }

    fn summary(&self, rows: &[Row], kinds: &[&str], servers: &[Server]) {
        if !self.json {
            println!();
            println!("set/get pairs per second, all clients together; median and min-max over rounds");
            println!(
                "{:<8} {:<8} {:>11} {:>21} {:>13} {:>15}",
                "clients", "server", "median", "min-max", "srv µs/pair", "chorus/pytorch"
            );
        }
        for kind in kinds {
            let mut medians = Vec::new();
            for server in servers {
                let picked: Vec<&Row> = rows
                    .iter()
                    .filter(|r| r.clients == *kind && r.server == server.name)
                    .collect();
                let mut rates: Vec<f64> = picked.iter().map(|r| r.pairs_per_s).collect();
                let mut cpu: Vec<f64> = picked.iter().map(|r| r.cpu_us_per_pair).collect();
                let (min, max) = rates
                    .iter()
                    .fold((f64::INFINITY, 0.0f64), |(lo, hi), &x| (lo.min(x), hi.max(x)));
                let med = median(&mut rates);
                let cpu = median(&mut cpu);
                medians.push(med);
                let ratio = (server.name == PYTORCH && medians.len() == 2).then(|| medians[0] / medians[1]);
                if self.json {
                    println!(
                        "{{\"kind\":\"summary\",\"clients\":\"{kind}\",\"server\":\"{}\",\"median_pairs_per_s\":{},\"min\":{},\"max\":{},\"server_cpu_us_per_pair\":{}}}",
                        server.name,
                        num(med),
                        num(min),
                        num(max),
                        num(cpu)
                    );
                    if let Some(ratio) = ratio {
                        println!("{{\"kind\":\"ratio\",\"clients\":\"{kind}\",\"chorus_over_pytorch\":{ratio:.3}}}");
                    }
                } else {
                    println!(
                        "{:<8} {:<8} {:>11.0} {:>21} {:>13.1} {:>15}",
                        kind,
                        server.name,
                        med,
                        format!("{min:.0}-{max:.0}"),
                        cpu,
                        ratio.map(|r| format!("{r:.2}")).unwrap_or_default()
                    );
                }
            }
            if servers.len() == 2 {
                self.paired(rows, kind);
            }
        }
    }

    /// Rounds pair a chorus run with the PyTorch run just after it; the ratio
    /// within a pair shrugs off load that drifts over minutes, which the
    /// ratio of medians does not.
    fn paired(&self, rows: &[Row], kind: &str) {
        let rate = |round: usize, server: &str| {
            rows.iter()
                .find(|r| r.round == round && r.clients == kind && r.server == server)
                .map(|r| r.pairs_per_s)
        };
        let mut ratios: Vec<f64> = (1..=rows.iter().map(|r| r.round).max().unwrap_or(0))
            .filter_map(|round| Some(rate(round, CHORUS)? / rate(round, PYTORCH)?))
            .collect();
        if ratios.is_empty() {
            return;
        }
        let (min, max) = ratios
            .iter()
            .fold((f64::INFINITY, 0.0f64), |(lo, hi), &x| (lo.min(x), hi.max(x)));
        let med = median(&mut ratios);
        if self.json {
            println!(
                "{{\"kind\":\"paired_ratio\",\"clients\":\"{kind}\",\"median\":{med:.3},\"min\":{min:.3},\"max\":{max:.3}}}"
            );
        } else {
            println!(
                "{:<8} chorus/pytorch round by round: median {med:.2}, min-max {min:.2}-{max:.2}",
                kind
            );
        }
    }
}
