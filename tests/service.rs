//! `examples/service.rs`: replicas averaging a model expose chorus's metrics
//! through a Prometheus exporter; the counters move between two scrapes,
//! and SIGTERM shuts the service down cleanly.

use chorus::process::{self, Signal};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

mod common;
use common::{Stop, example, free_port, spawn_piped};

/// One plain HTTP GET of `/metrics`; `None` while nothing answers.
fn scrape(port: u16) -> Option<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    stream.set_write_timeout(Some(Duration::from_secs(5))).ok()?;
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200").then(|| body.to_owned())
}

/// The sum of every sample of `name` (all label sets).
fn total(body: &str, name: &str) -> f64 {
    body.lines()
        .filter(|line| line.starts_with(name) && line[name.len()..].starts_with(['{', ' ']))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Kills the service if the test fails before it stops it.
struct Service(Option<Child>);

impl Drop for Service {
    fn drop(&mut self) {
        if let Some(child) = &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[test]
fn the_example_service_exports_metrics_that_move_and_stops_on_sigterm() {
    let port = free_port();
    let mut command = Command::new(example("service"));
    command.args(["--port", &port.to_string(), "--replicas", "3", "--period-ms", "20"]);
    let mut service = Service(Some(spawn_piped(&mut command, "examples/service")));
    let deadline = Instant::now() + Duration::from_secs(30);
    let first = loop {
        if let Some(body) = scrape(port)
            && total(&body, "chorus_collectives_completed_total") > 0.0
        {
            break body;
        }
        assert!(
            Instant::now() < deadline,
            "no collective counted on port {port} within 30 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    std::thread::sleep(Duration::from_millis(500));
    let second = scrape(port).expect("a second scrape");
    for name in [
        "chorus_collectives_started_total",
        "chorus_collectives_completed_total",
        "chorus_bytes_sent_total",
        "chorus_bytes_received_total",
        "chorus_collective_duration_seconds_count",
    ] {
        let (before, after) = (total(&first, name), total(&second, name));
        assert!(after > before, "{name} did not move: {before} then {after}\n{second}");
    }
    assert!(
        second.contains("chorus_world_size{group=") && total(&second, "chorus_world_size") == 3.0,
        "one group of 3 replicas:\n{second}"
    );
    assert_eq!(total(&second, "chorus_collectives_failed_total"), 0.0, "{second}");
    assert!(
        second.contains("transport=\"local\""),
        "in-process replicas talk over local links:\n{second}"
    );

    let child = service.0.take().expect("running");
    assert!(process::signal(child.id(), Signal::SIGTERM));
    let output = common::finish(child, 20, "examples/service after SIGTERM", Stop::Kill);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && stdout.contains("replica 2:"),
        "a clean shutdown, every replica reporting:\n{}",
        common::text(&output)
    );
}
