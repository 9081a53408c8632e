//! The dashboard over a real socket: bad input gets a clear 4xx and
//! changes nothing (a store holding a made-up job), and
//! `browser_dashboard_shows_a_kill_injected_from_the_page` (headless
//! Chromium, ignored unless asked for) opens the page of a running
//! `examples/train.rs` job, kills a rank through the page's endpoint and
//! waits for the recovery on the timeline.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chorus::process::{self, Signal};
use chorus::rendezvous::elastic::Joiner;
use chorus::store::{HashStore, Store};
use chorus::train::live::{self, LiveRecord, secret_tag};
use chorus_cli::dashboard::{self, Dashboard, DashboardOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

mod common;
use common::{example, within};

const SECRET: &str = "dashboard-test-secret";

/// One HTTP/1.1 request; the status and the body.
async fn http(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("the dashboard accepts");
    let mut request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    request.push_str(body);
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await.unwrap();
    let response = String::from_utf8_lossy(&response).into_owned();
    let status = response.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_string());
    (status, body)
}

const FORM: (&str, &str) = ("Content-Type", "application/x-www-form-urlencoded");

/// A bad request: its headers and body, the status it must get and what the answer must say.
type Case = (&'static [(&'static str, &'static str)], String, u16, &'static str);

/// A store holding generation 0 of run `r` with two members that publish
/// live records, signed as by `SECRET`.
async fn made_up_job() -> Arc<dyn Store> {
    let store: Arc<dyn Store> = Arc::new(HashStore::new(Duration::from_secs(5)));
    let elastic = "chorus/r/g0/elastic";
    store.set(&format!("{elastic}/closed"), b"2").await.unwrap();
    for (i, pid) in [100u32, 101].into_iter().enumerate() {
        let joiner = Joiner {
            old_rank: Some(i as u32),
            previous_generation: None,
            hostname: "h".into(),
            pid,
            nonce: i as u64,
            previous_world: Some(2),
            failed: Vec::new(),
        };
        store
            .set(
                &format!("{elastic}/joiner/{i}"),
                &chorus_runtime::codec::encode(&joiner),
            )
            .await
            .unwrap();
        let record = LiveRecord {
            slot: i as u64,
            pid,
            host: "h".into(),
            node: Some(0),
            generation: 0,
            rank: i,
            world_size: 2,
            recovering: false,
            steps: VecDeque::new(),
            recoveries: VecDeque::new(),
            abort: None,
            started_us: 0,
            updated_us: chorus::train::record::unix_us(),
            secret_tag: Some(secret_tag(&chorus::auth::JobSecret::new(SECRET.as_bytes()), "r")),
        };
        store
            .set(&live::record_key("r", i as u64), &serde_json::to_vec(&record).unwrap())
            .await
            .unwrap();
    }
    store.add(&live::count_key("r"), 2).await.unwrap();
    store.set("chorus/r/elastic/latest", b"0").await.unwrap();
    store
}

async fn serve(store: Arc<dyn Store>, faults: bool) -> Dashboard {
    let options = DashboardOptions {
        addr: "127.0.0.1:0".into(),
        faults,
        secret: SECRET.into(),
        run_id: Some("r".into()),
    };
    dashboard::start(store, &options).await.expect("the dashboard binds")
}

#[tokio::test]
async fn the_page_and_the_job_json_show_the_members_and_generations() {
    within(30, "the page", async {
        let dash = serve(made_up_job().await, false).await;
        let (status, body) = http(dash.addr, "GET", "/api/job", &[], "").await;
        assert_eq!(status, 200, "{body}");
        let job: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(job["members"].as_array().unwrap().len(), 2);
        assert_eq!(job["members"][1]["state"], "training");
        assert_eq!(job["generations"][0]["world_size"], 2);
        let (status, page) = http(dash.addr, "GET", "/", &[], "").await;
        assert_eq!(status, 200);
        assert!(
            page.contains("<table id=members>") && page.contains("<td>g0<td>2<td>first"),
            "{page}"
        );
        assert!(!page.contains("<form"), "no fault form without --dashboard-faults");
        let (status, _) = http(dash.addr, "GET", "/nothing-here", &[], "").await;
        assert_eq!(status, 404);
    })
    .await;
}

#[tokio::test]
async fn bad_fault_requests_get_a_clear_4xx_and_change_nothing() {
    within(30, "the fault requests", async {
        let store = made_up_job().await;
        let off = serve(store.clone(), false).await;
        let good = format!("rank=1&kind=kill&secret={SECRET}");
        let (status, body) = http(off.addr, "POST", "/api/fault", &[FORM], &good).await;
        assert_eq!(status, 403, "faults are off: {body}");
        assert!(body.contains("--dashboard-faults"), "{body}");

        let on = serve(store.clone(), true).await;
        let cases: [Case; 8] = [
            (&[FORM], "rank=1&kind=kill&secret=wrong".into(), 403, "wrong job secret"),
            (&[FORM], "rank=1&kind=kill".into(), 401, "secret is required"),
            (
                &[FORM],
                format!("rank=7&kind=kill&secret={SECRET}"),
                404,
                "no rank 7 in generation 0",
            ),
            (
                &[FORM],
                format!("rank=one&kind=kill&secret={SECRET}"),
                400,
                "rank must be a number",
            ),
            (
                &[FORM],
                format!("rank=1&kind=explode&secret={SECRET}"),
                400,
                "kind must be one of",
            ),
            (&[FORM], "%%%&&&==".into(), 401, "secret is required"),
            (
                &[("Content-Type", "application/json")],
                "{\"rank\":1}".into(),
                415,
                "x-www-form-urlencoded",
            ),
            (
                &[FORM, ("X-Chorus-Secret", "wrong")],
                "rank=1&kind=kill".into(),
                403,
                "wrong job secret",
            ),
        ];
        for (headers, body, want, says) in cases {
            let (status, answer) = http(on.addr, "POST", "/api/fault", headers, &body).await;
            assert_eq!(status, want, "{body}: {answer}");
            assert!(answer.contains(says), "{body}: {answer}");
        }
        let (status, _) = http(on.addr, "GET", "/api/fault", &[], "").await;
        assert_eq!(status, 405);
        for slot in 0..2 {
            assert!(
                !store.check(&[&live::fault_key("r", slot)]).await.unwrap(),
                "nothing was asked of slot {slot}"
            );
        }
        assert_eq!(store.add(&live::fault_log_count_key("r"), 0).await.unwrap(), 0);

        // A good one is logged with who asked, and signed for its process.
        let (status, answer) = http(on.addr, "POST", "/api/fault", &[FORM], &format!("{good}&who=tester")).await;
        assert_eq!(status, 200, "{answer}");
        let request: live::FaultRequest =
            serde_json::from_slice(&store.get(&live::fault_key("r", 1)).await.unwrap()).unwrap();
        assert_eq!((request.pid, request.kind), (101, live::FaultKind::Kill));
        assert!(request.verify(&chorus::auth::JobSecret::new(SECRET.as_bytes()), "r", 1));
        let (_, job) = http(on.addr, "GET", "/api/job", &[], "").await;
        let job: serde_json::Value = serde_json::from_str(&job).unwrap();
        assert_eq!(job["faults"][0]["rank"], 1);
        assert!(job["faults"][0]["who"].as_str().unwrap().ends_with("(tester)"));
    })
    .await;
}

/// Debian's `chromium`, or a failure saying how to get it.
fn chromium() -> PathBuf {
    ["/usr/bin/chromium", "/usr/bin/chromium-browser"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .expect("the browser_ tests need chromium (apt-get install chromium)")
}

/// Kills the example (its launcher stops the workers) when the test ends.
struct Job(Child);

impl Drop for Job {
    fn drop(&mut self) {
        process::signal(self.0.id(), Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline && matches!(self.0.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs `chromium` with `args` and `url`, failing past `secs`; its stdout.
fn run_chromium(args: &[String], url: &str, secs: u64) -> String {
    let profile = tempfile::tempdir().unwrap();
    let mut child = Command::new(chromium())
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(args)
        .arg(url)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("chromium starts");
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("chromium {args:?} did not finish within {secs}s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut out = String::new();
    std::io::Read::read_to_string(child.stdout.as_mut().unwrap(), &mut out).unwrap();
    out
}

#[tokio::test]
#[ignore = "needs chromium (Debian's chromium package)"]
async fn browser_dashboard_shows_a_kill_injected_from_the_page() {
    let chromium_path = chromium();
    let started = Instant::now();
    let mut child = Command::new(example("train"))
        .args([
            "--dashboard",
            "127.0.0.1:0",
            "--dashboard-faults",
            "--world",
            "3",
            "--steps",
            "400000",
        ])
        .args([
            "--fault",
            "none",
            "--no-reference",
            "--hidden",
            "32",
            "--batch",
            "48",
            "--heartbeat-ms",
            "1000",
        ])
        .arg("--plot")
        .arg(std::env::temp_dir().join(format!("chorus-dashboard-test-{}.png", std::process::id())))
        .env("CHORUS_JOB_SECRET", SECRET)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the example starts");
    let stderr = child.stderr.take().unwrap();
    let _job = Job(child);
    // The launcher prints the page's URL first (the example's own lines go to stderr).
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufRead::lines(std::io::BufReader::new(stderr)).map_while(Result::ok) {
            if let Some(at) = line.find("http://") {
                let url: String = line[at..].chars().take_while(|c| !c.is_whitespace()).collect();
                let _ = tx.send(url);
            }
        }
    });
    let url = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the launcher printed the dashboard's URL within 20 s");
    let addr: std::net::SocketAddr = url.trim_start_matches("http://").trim_end_matches('/').parse().unwrap();

    // Waits until `/api/job` satisfies `done`, or fails saying `what`.
    let wait_for = |what: &'static str, secs: u64, done: fn(&serde_json::Value) -> bool| async move {
        within(secs, what, async {
            loop {
                let (status, body) = http(addr, "GET", "/api/job", &[], "").await;
                if status == 200 {
                    let job: serde_json::Value = serde_json::from_str(&body).unwrap();
                    if done(&job) {
                        return job;
                    }
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
        .await
    };
    wait_for("three ranks training with committed steps", 30, |job| {
        job["members"]
            .as_array()
            .is_some_and(|m| m.iter().filter(|m| m["state"] == "training").count() == 3)
            && job["steps"].as_array().is_some_and(|s| s.len() > 3)
    })
    .await;

    // As the page's kill button posts it, with the secret.
    let (status, answer) = http(
        addr,
        "POST",
        "/api/fault",
        &[FORM],
        &format!("rank=2&kind=kill&secret={SECRET}&who=browser-test"),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    let job = wait_for("the kill to show as a recovery on the timeline", 30, |job| {
        job["generations"].as_array().is_some_and(|gs| {
            gs.iter().any(|g| {
                g["recovery"].is_object()
                    && g["changes"]
                        .as_array()
                        .is_some_and(|c| c.iter().any(|c| c["cause"] == "killed"))
            })
        })
    })
    .await;
    assert_eq!(job["faults"][0]["kind"], "kill");

    // The page as the browser renders it: the recovery's bar and cause.
    let dom = run_chromium(&["--dump-dom".into()], &url, 30);
    assert!(
        dom.contains("class=\"recovery\"") && dom.contains("killed"),
        "the page shows no recovery: {dom}"
    );

    let shot = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/dashboard.png");
    let _ = std::fs::remove_file(&shot);
    run_chromium(
        &[
            format!("--screenshot={}", shot.display()),
            "--window-size=1100,1000".into(),
        ],
        &url,
        30,
    );
    let decoder = png::Decoder::new(std::io::BufReader::new(
        std::fs::File::open(&shot).expect("a screenshot"),
    ));
    let mut reader = decoder.read_info().expect("the screenshot is a PNG");
    let mut pixels = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut pixels).unwrap();
    let channels = info.color_type.samples();
    let colours: std::collections::HashSet<&[u8]> = pixels[..info.buffer_size()].chunks(channels).collect();
    assert!(
        colours.len() > 16,
        "the screenshot looks blank: {} colours",
        colours.len()
    );
    println!(
        "browser test: {} ({}x{}, {} colours) in {:.1} s with {}",
        shot.display(),
        info.width,
        info.height,
        colours.len(),
        started.elapsed().as_secs_f64(),
        chromium_path.display()
    );
}
