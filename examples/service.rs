//! A service that embeds chorus: a few replicas of a model, each training on
//! its own (here: a random walk), average their parameters every period,
//! and expose chorus's metrics (`chorus::metrics`) to Prometheus.
//!
//! ```text
//! cargo run --release --example service -- --port 9464 --replicas 3 --period-ms 50
//! curl -s localhost:9464/metrics | grep chorus_
//! ```
//!
//! SIGINT or SIGTERM is the service's shutdown path: every replica leaves
//! its group (`ProcessGroup::destroy`, which waits for the others; a
//! replica leaving alone would call `shutdown`) and the process exits 0.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, bail};
use chorus::{ProcessGroup, ReduceOp, Tensor};
use metrics_exporter_prometheus::PrometheusBuilder;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

/// Parameters per replica.
const PARAMETERS: usize = 4096;

struct Args {
    port: u16,
    replicas: usize,
    period: Duration,
}

fn args() -> anyhow::Result<Args> {
    let mut parsed = Args {
        port: 9464,
        replicas: 3,
        period: Duration::from_millis(50),
    };
    let mut given = std::env::args().skip(1);
    while let Some(flag) = given.next() {
        let value = given.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--port" => parsed.port = value.parse().context("--port: a TCP port")?,
            "--replicas" => parsed.replicas = value.parse().context("--replicas: a count")?,
            "--period-ms" => parsed.period = Duration::from_millis(value.parse().context("--period-ms: milliseconds")?),
            _ => bail!("unknown flag {flag}: use --port, --replicas or --period-ms"),
        }
    }
    if parsed.replicas < 2 {
        bail!("--replicas: at least 2, so there is something to average");
    }
    Ok(parsed)
}

/// One replica: a local step, then every `period` an average of the model
/// over all replicas, until `stop` turns true.
async fn replica(group: ProcessGroup, period: Duration, mut stop: watch::Receiver<bool>) -> anyhow::Result<u64> {
    let mut model = vec![0.0f32; PARAMETERS];
    let mut state = group.rank() as u32 + 1;
    let mut rounds = 0;
    loop {
        for value in &mut model {
            // xorshift: a local "training" step that differs per replica.
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            *value += (state % 1000) as f32 / 1000.0 - 0.5;
        }
        // Every replica agrees to stop before the next collective, so none
        // is left waiting in one: one flag all-reduced per round.
        let stopping = u32::from(*stop.borrow());
        let votes = group.all_reduce(Tensor::from_slice(&[stopping]), ReduceOp::Max).await?;
        if votes.to_vec::<u32>()?[0] == 1 {
            break;
        }
        let averaged = group.all_reduce(Tensor::from_slice(&model), ReduceOp::Avg).await?;
        model = averaged.to_vec::<f32>()?;
        rounds += 1;
        tokio::select! {
            () = tokio::time::sleep(period) => {}
            _ = stop.changed() => {}
        }
    }
    group.destroy().await?;
    Ok(rounds)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = args()?;
    let address = SocketAddr::from(([127, 0, 0, 1], args.port));
    // Installed before any group forms: groups register their metrics then.
    PrometheusBuilder::new()
        .with_http_listener(address)
        .install()
        .with_context(|| format!("serve metrics on {address}"))?;
    println!("metrics on http://{address}/metrics");
    let (stop_tx, stop) = watch::channel(false);
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    tokio::spawn(async move {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
        println!("shutting down");
        stop_tx.send_replace(true);
    });
    let period = args.period;
    let results = chorus::spawn(args.replicas, move |group| replica(group, period, stop.clone())).await?;
    for (rank, rounds) in results.into_iter().enumerate() {
        println!("replica {rank}: {} rounds", rounds?);
    }
    Ok(())
}
