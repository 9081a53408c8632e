//! `chorus bench ddp`: the cost of data-parallel gradient sync
//! ([`DistributedSync`]) on a model of `--params`
//! float32 parameters in layers of a transformer's sizes, `--world` rank
//! processes: the step time with sync, without (`no_sync`), and their
//! difference, the communication the backward pass did not hide
//! (`exposed_sync_ms`). With `--compare torch`, PyTorch DDP over Gloo on the
//! same shapes (`lab/python/ddp_bench.py`, embedded) in the same run;
//! `--rounds N` runs the two in turn N times and shows medians over the
//! rounds and the step-time ratio's median [min-max].
//!
//! The backward pass writes each gradient (`p * scale`, one pass over the
//! layer) into its bucket and marks it ready, last layer first; every step
//! starts after a barrier; sync and no_sync steps alternate.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use clap::{Args, ValueEnum};
use serde::Serialize;
use serde_json::Value;

use chorus::group::ProcessGroup;
use chorus::sync::{
    Average, BucketInfo, CommHook, Compress, DistributedSync, HookFuture, PowerSgd, PowerSgdOptions, SyncOptions,
};
use chorus::tensor::Tensor;

use super::common::{PeerError, Spread, free_port, median, python_peer, torchrun_env};

/// PyTorch DDP's side, embedded so that the binary works from anywhere.
const TORCH_SCRIPT: &str = include_str!("../../python/ddp_bench.py");

/// The peer `--compare` measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DdpPeer {
    /// PyTorch's DistributedDataParallel with the Gloo backend.
    Torch,
}

/// The bucket hook chorus's side uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum HookChoice {
    /// Average (the default).
    Avg,
    /// Send float16.
    Fp16,
    /// Send bfloat16.
    Bf16,
    /// PowerSGD, rank 1, from the first step.
    Powersgd,
}

/// `chorus bench ddp`'s flags.
#[derive(Debug, Clone, Args)]
pub struct DdpArgs {
    /// Number of rank processes.
    #[arg(long, default_value_t = 2)]
    pub world: usize,
    /// CHORUS_TRANSPORT for the rank processes (auto, quic, shm).
    #[arg(long, default_value = "auto")]
    pub transport: String,
    /// Float32 parameters in the model (K, M suffixes: thousands, millions).
    #[arg(long, default_value = "25M", value_parser = parse_count)]
    pub params: usize,
    /// Timed steps of each kind (with sync, without).
    #[arg(long, default_value_t = 10)]
    pub steps: usize,
    /// Untimed steps of each kind before them.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Cap of every bucket after the first, MiB (DDP's bucket_cap_mb).
    #[arg(long, default_value_t = 25.0)]
    pub bucket_cap_mb: f64,
    /// How chorus reduces a bucket.
    #[arg(long, value_enum, default_value = "avg")]
    pub hook: HookChoice,
    /// Also measure this peer on the same shapes.
    #[arg(long, value_enum)]
    pub compare: Option<DdpPeer>,
    /// Measure chorus and the peer this many times, in turn; the table shows
    /// medians over the rounds and the step-time ratio's median [min-max].
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub rounds: u64,
    /// Print one JSON object per library instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Also draw chorus's per-bucket timeline of the last timed synced step
    /// (each bucket's all-reduce against the backward pass) into this PNG.
    #[arg(long, value_name = "FILE.png")]
    pub plot: Option<std::path::PathBuf>,
    /// Seconds allowed for each side.
    #[arg(long, default_value_t = 300)]
    pub timeout: u64,
    /// --compare torch with DDP's gradient_as_bucket_view (true: autograd
    /// writes gradients into the buckets, as chorus's side does; false:
    /// PyTorch's default, DDP copies each gradient into its bucket).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub torch_bucket_view: bool,
    /// Python interpreter for --compare torch.
    #[arg(long, default_value = "python3", env = "CHORUS_BENCH_PYTHON")]
    pub python: String,
    /// Internal: run as one rank process.
    #[arg(long, hide = true)]
    pub worker: bool,
}

/// The median over `rounds` of member `key` of the rows of `row`'s library.
fn round_median(rounds: &[Vec<Value>], row: &Value, key: &str) -> f64 {
    let values: Vec<f64> = rounds
        .iter()
        .flatten()
        .filter(|r| r["library"] == row["library"])
        .filter_map(|r| r[key].as_f64())
        .collect();
    Spread::of(&values).median
}

/// A parameter count: digits with an optional K or M (powers of 1000).
pub fn parse_count(text: &str) -> Result<usize, String> {
    let t = text.trim();
    let (digits, factor) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 1_000),
        Some('M') => (&t[..t.len() - 1], 1_000_000),
        _ => (t, 1),
    };
    digits
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(factor))
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("{text:?} is not a parameter count (a positive number, optional K or M suffix)"))
}

/// `total` parameters as a GPT-style stack of width 512 (per block: two
/// layer norms, attention in and out projections, a 4x MLP, with biases),
/// registered in forward order; the last block is cut where the total is
/// reached.
pub fn layer_shapes(total: usize) -> Vec<(String, usize)> {
    const D: usize = 512;
    let block = [
        ("ln1.weight", D),
        ("ln1.bias", D),
        ("attn.qkv.weight", D * 3 * D),
        ("attn.qkv.bias", 3 * D),
        ("attn.proj.weight", D * D),
        ("attn.proj.bias", D),
        ("ln2.weight", D),
        ("ln2.bias", D),
        ("mlp.fc1.weight", D * 4 * D),
        ("mlp.fc1.bias", 4 * D),
        ("mlp.fc2.weight", 4 * D * D),
        ("mlp.fc2.bias", D),
    ];
    let mut shapes = Vec::new();
    let mut left = total;
    for b in 0.. {
        for (name, n) in block {
            if left == 0 {
                return shapes;
            }
            let n = n.min(left);
            shapes.push((format!("h.{b}.{name}"), n));
            left -= n;
        }
    }
    shapes
}

/// When each bucket's reduction started and ended in one step, relative to
/// the step's start.
#[derive(Debug, Clone, Serialize)]
pub struct BucketSpan {
    /// Bucket index (launch order).
    pub index: usize,
    /// Its size in bytes.
    pub bytes: usize,
    /// Handed to the hook, ms after the step started.
    pub start_ms: f64,
    /// Reduced, ms after the step started.
    pub end_ms: f64,
}

/// Records [`BucketSpan`]s around another hook.
struct Timeline {
    inner: Box<dyn CommHook>,
    step_start: Arc<Mutex<Instant>>,
    spans: Arc<Mutex<Vec<BucketSpan>>>,
}

impl CommHook for Timeline {
    fn reduce(&mut self, group: &ProcessGroup, bucket: BucketInfo, data: Tensor) -> HookFuture {
        let origin = *self.step_start.lock().expect("step start");
        let bytes = data.as_bytes().len();
        let start_ms = origin.elapsed().as_secs_f64() * 1e3;
        let work = self.inner.reduce(group, bucket, data);
        let spans = self.spans.clone();
        Box::pin(async move {
            let out = work.await;
            spans.lock().expect("spans").push(BucketSpan {
                index: bucket.index,
                bytes,
                start_ms,
                end_ms: origin.elapsed().as_secs_f64() * 1e3,
            });
            out
        })
    }
}

/// Rank 0's answer for chorus's side.
#[derive(Debug, Serialize)]
struct ChorusLine {
    library: &'static str,
    transport: String,
    hook: String,
    world: usize,
    params: usize,
    layers: usize,
    buckets: usize,
    steps: usize,
    step_ms: f64,
    no_sync_ms: f64,
    exposed_sync_ms: f64,
    /// When the last gradient of the last timed sync step was marked ready.
    backward_ms: f64,
    timeline: Vec<BucketSpan>,
}

/// [`run_worker`] on a runtime of its own with two worker threads, so
/// that hooks' futures (and the timeline's end times) complete while the
/// backward pass holds the calling thread, as in a training program on
/// tokio's default runtime. Call it outside any runtime.
pub fn run_worker_blocking(args: &DdpArgs) -> Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(run_worker(args))
}

/// One rank process (`chorus bench ddp --worker`): joins over env://,
/// measures, and rank 0 prints one JSON line.
pub async fn run_worker(args: &DdpArgs) -> Result<()> {
    let options = chorus::InitOptions::default().timeout(Duration::from_secs(args.timeout));
    let group = chorus::init_process_group(options).await.context("forming the group")?;
    let shapes = layer_shapes(args.params);
    let mut model: Vec<(String, Vec<f32>)> = shapes.iter().map(|(name, n)| (name.clone(), vec![0.01; *n])).collect();
    let sync_options = SyncOptions {
        bucket_cap_mb: args.bucket_cap_mb,
        ..SyncOptions::default()
    };
    let mut ddp = DistributedSync::new(&group, &mut model, sync_options).await?;
    let step_start = Arc::new(Mutex::new(Instant::now()));
    let spans = Arc::new(Mutex::new(Vec::new()));
    let inner: Box<dyn CommHook> = match args.hook {
        HookChoice::Avg => Box::new(Average),
        HookChoice::Fp16 => Box::new(Compress::fp16()),
        HookChoice::Bf16 => Box::new(Compress::bf16()),
        HookChoice::Powersgd => Box::new(
            PowerSgd::new(
                &group,
                PowerSgdOptions {
                    start_iter: 0,
                    ..PowerSgdOptions::default()
                },
            )
            .await?,
        ),
    };
    ddp.register_comm_hook(Box::new(Timeline {
        inner,
        step_start: step_start.clone(),
        spans: spans.clone(),
    }));
    let (mut with_sync, mut without) = (vec![], vec![]);
    let mut backward_ms = 0.0;
    let mut timeline = vec![];
    for i in 0..args.warmup + args.steps {
        for sync in [true, false] {
            group.barrier().await?;
            if sync {
                spans.lock().expect("spans").clear();
            }
            let start = Instant::now();
            *step_start.lock().expect("step start") = start;
            let scale = 1.0 + i as f32 * 1e-3;
            let mut guard;
            let d: &mut DistributedSync<'_> = if sync {
                &mut ddp
            } else {
                guard = ddp.no_sync();
                &mut guard
            };
            for p in (0..model.len()).rev() {
                for (g, w) in d.grad_mut::<f32>(p)?.iter_mut().zip(&model[p].1) {
                    *g = w * scale;
                }
                d.mark_ready(p)?;
            }
            let marked = start.elapsed().as_secs_f64() * 1e3;
            d.finish().await?;
            let took = start.elapsed().as_secs_f64() * 1e3;
            if i >= args.warmup {
                if sync {
                    with_sync.push(took);
                    backward_ms = marked;
                    timeline = spans.lock().expect("spans").clone();
                } else {
                    without.push(took);
                }
            }
        }
    }
    if group.rank() == 0 {
        let (step_ms, no_sync_ms) = (
            median(&mut with_sync).unwrap_or(f64::NAN),
            median(&mut without).unwrap_or(f64::NAN),
        );
        timeline.sort_by_key(|s: &BucketSpan| s.index);
        let line = ChorusLine {
            library: "chorus",
            transport: args.transport.clone(),
            hook: format!("{:?}", args.hook).to_lowercase(),
            world: group.world_size(),
            params: args.params,
            layers: shapes.len(),
            buckets: ddp.layout().buckets.len(),
            steps: args.steps,
            step_ms,
            no_sync_ms,
            exposed_sync_ms: (step_ms - no_sync_ms).max(0.0),
            backward_ms,
            timeline,
        };
        let mut out = std::io::stdout().lock();
        writeln!(out, "{}", serde_json::to_string(&line)?)?;
        out.flush()?;
    }
    group.destroy().await?;
    Ok(())
}

/// Runs `world` copies of `program args` as env:// ranks and returns rank
/// 0's last JSON line.
pub(super) fn run_ranks(
    program: &str,
    args: &[String],
    world: usize,
    env: &[(&str, String)],
    timeout: Duration,
) -> Result<Value> {
    let port = free_port()?;
    let mut children: Vec<Child> = Vec::new();
    for rank in 0..world {
        let mut command = Command::new(program);
        torchrun_env(&mut command, rank, world, port);
        command
            .args(args)
            .stdin(Stdio::null())
            .stdout(if rank == 0 { Stdio::piped() } else { Stdio::null() })
            .stderr(Stdio::inherit());
        for (k, v) in env {
            command.env(k, v);
        }
        children.push(
            command
                .spawn()
                .with_context(|| format!("starting rank {rank}: {program}"))?,
        );
    }
    let out = children[0].stdout.take().context("rank 0's stdout")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let last = BufReader::new(out)
            .lines()
            .map_while(Result::ok)
            .filter_map(|l| serde_json::from_str::<Value>(&l).ok())
            .last();
        let _ = tx.send(last);
    });
    let deadline = Instant::now() + timeout;
    let mut failed = None;
    for (rank, child) in children.iter_mut().enumerate() {
        loop {
            match child.try_wait()? {
                Some(status) if !status.success() => {
                    failed.get_or_insert(format!("rank {rank} exited with {status}"));
                    break;
                }
                Some(_) => break,
                // Once one rank failed, the others are not waited for.
                None if failed.is_some() => break,
                None if Instant::now() >= deadline => {
                    failed.get_or_insert(format!("rank {rank} did not finish within {timeout:?}"));
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
                None => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
    if let Some(why) = failed {
        for child in &mut children {
            let _ = child.kill();
            let _ = child.wait();
        }
        bail!("{program}: {why}");
    }
    rx.recv_timeout(Duration::from_secs(5))
        .ok()
        .flatten()
        .ok_or_else(|| anyhow!("{program}: rank 0 printed no result"))
}

/// The parent: measures chorus, then the peer, and prints the table or JSON.
pub fn run(args: &DdpArgs) -> Result<ExitCode> {
    if args.world < 1 || args.steps < 1 {
        bail!("--world and --steps must be at least 1");
    }
    let shapes = layer_shapes(args.params);
    // [round] chorus's row, then the peer's when it ran.
    let rounds = measure_rounds(args, &shapes)?;
    let rows = rounds.last().cloned().unwrap_or_default();
    if let Some(path) = &args.plot {
        let title = format!(
            "chorus bench ddp: {}M float32 parameters, world {}, {} transport, {} hook",
            args.params / 1_000_000,
            args.world,
            args.transport,
            format!("{:?}", args.hook).to_lowercase()
        );
        draw_timeline(path, &title, &rows[0]).map_err(|e| anyhow!("drawing {}: {e}", path.display()))?;
    }
    if args.json {
        for row in rounds.iter().flatten() {
            println!("{row}");
        }
        return Ok(ExitCode::SUCCESS);
    }
    print_table(args, shapes.len(), &rounds, &rows);
    Ok(ExitCode::SUCCESS)
}

/// Every round: chorus's ranks, then the peer's when `--compare torch` asks
/// for it and torch is there; a row each.
fn measure_rounds(args: &DdpArgs, shapes: &[(String, usize)]) -> Result<Vec<Vec<Value>>> {
    let exe = std::env::current_exe()?.to_string_lossy().into_owned();
    let timeout = Duration::from_secs(args.timeout);
    let worker_args = worker_args(args);
    let mut rounds: Vec<Vec<Value>> = Vec::new();
    for _ in 0..args.rounds {
        let mut rows = vec![];
        rows.push(run_ranks(
            &exe,
            &worker_args,
            args.world,
            &[
                ("CHORUS_TRANSPORT", args.transport.clone()),
                ("CHORUS_JOB_SECRET", chorus::auth::random_hex(16)?),
            ],
            timeout,
        )?);
        if args.compare == Some(DdpPeer::Torch) {
            rows.extend(torch_row(args, shapes, timeout)?);
        }
        rounds.push(rows);
    }
    Ok(rounds)
}

/// The flags of chorus's rank processes (`chorus bench ddp --worker`).
fn worker_args(args: &DdpArgs) -> Vec<String> {
    [
        "bench",
        "ddp",
        "--worker",
        "--params",
        &args.params.to_string(),
        "--steps",
        &args.steps.to_string(),
        "--warmup",
        &args.warmup.to_string(),
        "--bucket-cap-mb",
        &args.bucket_cap_mb.to_string(),
        "--hook",
        &format!("{:?}", args.hook).to_lowercase(),
        "--transport",
        &args.transport,
        "--timeout",
        &args.timeout.to_string(),
    ]
    .map(String::from)
    .to_vec()
}

/// One round of torch's DDP over the same layers; `None`, said, without torch.
fn torch_row(args: &DdpArgs, shapes: &[(String, usize)], timeout: Duration) -> Result<Option<Value>> {
    let peer = match python_peer(&args.python, "ddp", TORCH_SCRIPT) {
        Err(e @ PeerError::NoTorch { .. }) => {
            eprintln!("# skipping --compare torch: {e}");
            return Ok(None);
        }
        Err(e) => return Err(e).context("the torch DDP script"),
        Ok(peer) => peer,
    };
    let sizes: Vec<String> = shapes.iter().map(|(_, n)| n.to_string()).collect();
    let torch_args = vec![
        peer.script.path().to_string_lossy().into_owned(),
        sizes.join(","),
        args.steps.to_string(),
        args.warmup.to_string(),
        args.bucket_cap_mb.to_string(),
        u8::from(args.torch_bucket_view).to_string(),
    ];
    let row = run_ranks(
        &args.python,
        &torch_args,
        args.world,
        &[("OMP_NUM_THREADS", "1".into())],
        timeout,
    )?;
    Ok(Some(row))
}

/// The table: a line per library (the median over rounds of each column),
/// then chorus/torch step time round by round.
fn print_table(args: &DdpArgs, layers: usize, rounds: &[Vec<Value>], rows: &[Value]) {
    println!(
        "# chorus bench ddp: {} float32 parameters in {} layers, world {}, median of {} steps{}",
        args.params,
        layers,
        args.world,
        args.steps,
        if args.rounds > 1 {
            format!(
                ", then the median of {} rounds (chorus and the peer in turn)",
                args.rounds
            )
        } else {
            String::new()
        }
    );
    println!(
        "{:<24} {:>10} {:>12} {:>16}",
        "library", "step_ms", "no_sync_ms", "exposed_sync_ms"
    );
    for row in rows {
        let label = match row["library"].as_str() {
            Some("chorus") => format!(
                "chorus ({}, {})",
                row["transport"].as_str().unwrap_or("?"),
                row["hook"].as_str().unwrap_or("?")
            ),
            _ => format!("torch {} gloo", row["version"].as_str().unwrap_or("?")),
        };
        let f = |k: &str| round_median(rounds, row, k);
        println!(
            "{label:<24} {:>10.2} {:>12.2} {:>16.2}",
            f("step_ms"),
            f("no_sync_ms"),
            f("exposed_sync_ms")
        );
    }
    if rows.len() > 1 {
        // Round by round, so that both sides of a ratio saw the same noise.
        let ratios: Vec<f64> = rounds
            .iter()
            .filter_map(|r| Some(r.first()?["step_ms"].as_f64()? / r.get(1)?["step_ms"].as_f64()?))
            .collect();
        let spread = Spread::of(&ratios);
        println!(
            "# chorus/torch step_ms: {:.2}x, median of {} rounds [{:.2}-{:.2}]",
            spread.median, spread.rounds, spread.min, spread.max
        );
    }
}

/// Draws chorus's row (its `timeline`, `backward_ms` and `step_ms`) as a
/// Gantt chart: the backward pass on the top row, one bar per bucket's
/// all-reduce below it, ms since the step started.
pub fn draw_timeline(path: &std::path::Path, title: &str, row: &Value) -> Result<(), String> {
    use super::plot::{AXIS, LABEL, canvas, legend};
    use plotters::prelude::*;
    let spans: Vec<BucketSpanRow> = row["timeline"]
        .as_array()
        .ok_or("the result has no timeline")?
        .iter()
        .map(|s| BucketSpanRow {
            index: s["index"].as_u64().unwrap_or(0) as usize,
            mb: s["bytes"].as_f64().unwrap_or(0.0) / 1e6,
            start: s["start_ms"].as_f64().unwrap_or(0.0),
            end: s["end_ms"].as_f64().unwrap_or(0.0),
        })
        .collect();
    let backward = row["backward_ms"].as_f64().unwrap_or(0.0);
    let step = row["step_ms"].as_f64().unwrap_or(0.0);
    let no_sync = row["no_sync_ms"].as_f64().unwrap_or(0.0);
    let last = spans.iter().map(|s| s.end).fold(backward.max(step), f64::max);
    let rows = spans.len() as f64 + 1.0;
    // Room under the bars for the legend.
    let legend_rows = 1.8;
    let root = canvas(path, (900, 200 + 45 * (spans.len() as u32 + 1)))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(10)
        .build_cartesian_2d(0f64..last * 1.25, -legend_rows..rows)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .disable_y_axis()
        .x_desc("ms since the step started")
        .label_style(LABEL)
        .axis_desc_style(AXIS)
        .draw()
        .map_err(|e| e.to_string())?;
    let bar = |row: f64, from: f64, to: f64, color: RGBColor| {
        Rectangle::new(
            [
                (from, rows - row - 0.8),
                (to.max(from + last * 0.002), rows - row - 0.2),
            ],
            color.filled(),
        )
    };
    let gray = RGBColor(127, 127, 127);
    let blue = RGBColor(31, 119, 180);
    chart
        .draw_series(std::iter::once(bar(0.0, 0.0, backward, gray)))
        .map_err(|e| e.to_string())?
        .label(format!(
            "this step's backward pass: last gradient ready at {backward:.1} ms"
        ))
        .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 20, y + 5)], gray.filled()));
    chart
        .draw_series(
            spans
                .iter()
                .enumerate()
                .map(|(i, s)| bar(i as f64 + 1.0, s.start, s.end, blue)),
        )
        .map_err(|e| e.to_string())?
        .label("a bucket's all-reduce: handed to the hook .. averaged")
        .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 20, y + 5)], blue.filled()));
    // Each bar named at its right end.
    let names = std::iter::once((0.0, backward, "backward".to_owned())).chain(
        spans
            .iter()
            .enumerate()
            .map(|(i, s)| (i as f64 + 1.0, s.end, format!("bucket {} ({:.1} MB)", s.index, s.mb))),
    );
    chart
        .draw_series(
            names.map(|(row, end, name)| Text::new(name, (end + last * 0.01, rows - row - 0.35), ("sans-serif", 13))),
        )
        .map_err(|e| e.to_string())?;
    let red = RGBColor(214, 39, 40);
    chart
        .draw_series(std::iter::once(PathElement::new(
            vec![(no_sync, -legend_rows), (no_sync, rows)],
            red.stroke_width(2),
        )))
        .map_err(|e| e.to_string())?
        .label(format!(
            "median step without sync: {no_sync:.1} ms (with: {step:.1} ms)"
        ))
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], red.stroke_width(2)));
    legend(&mut chart, SeriesLabelPosition::LowerLeft)?;
    root.present().map_err(|e| e.to_string())
}

/// One bar of [`draw_timeline`].
struct BucketSpanRow {
    index: usize,
    mb: f64,
    start: f64,
    end: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_give_each_library_its_median() {
        let row = |library: &str, step: f64| serde_json::json!({"library": library, "step_ms": step});
        let rounds = vec![
            vec![row("chorus", 10.0), row("torch", 30.0)],
            vec![row("chorus", 50.0), row("torch", 20.0)],
            vec![row("chorus", 12.0)],
        ];
        assert_eq!(round_median(&rounds, &row("chorus", 0.0), "step_ms"), 12.0);
        assert_eq!(round_median(&rounds, &row("torch", 0.0), "step_ms"), 25.0);
        assert!(round_median(&rounds, &row("chorus", 0.0), "no_sync_ms").is_nan());
    }

    #[test]
    fn shapes_add_up_and_look_like_a_transformer() {
        let shapes = layer_shapes(25_000_000);
        assert_eq!(shapes.iter().map(|(_, n)| n).sum::<usize>(), 25_000_000);
        assert_eq!(shapes[2], ("h.0.attn.qkv.weight".to_string(), 512 * 1536));
        assert!(shapes.len() > 90, "{}", shapes.len());
        assert_eq!(layer_shapes(10), vec![("h.0.ln1.weight".to_string(), 10)]);
    }

    #[test]
    fn a_timeline_draws_into_a_png() {
        let dir = std::env::temp_dir().join(format!("chorus-bench-ddp-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("timeline.png");
        let row = serde_json::json!({
            "library": "chorus", "backward_ms": 12.0, "step_ms": 40.0, "no_sync_ms": 13.0,
            "timeline": [
                {"index": 0, "bytes": 3_000_000, "start_ms": 0.5, "end_ms": 5.0},
                {"index": 1, "bytes": 29_000_000, "start_ms": 6.0, "end_ms": 30.0},
            ],
        });
        draw_timeline(&path, "test", &row).unwrap();
        let png = std::fs::read(&path).unwrap();
        assert_eq!(&png[1..4], b"PNG");
        assert!(draw_timeline(&path, "test", &serde_json::json!({})).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn counts_parse_with_decimal_suffixes() {
        assert_eq!(parse_count("25M"), Ok(25_000_000));
        assert_eq!(parse_count("3k"), Ok(3_000));
        assert_eq!(parse_count("17"), Ok(17));
        assert!(parse_count("0").is_err() && parse_count("x").is_err());
    }
}
