//! chorus and PyTorch (2.15) share the TCPStore wire protocol in both
//! directions: PyTorch's client gets the same answers from a chorus server as
//! from PyTorch's own, and chorus's client gets the same answers from
//! PyTorch's server as from chorus's. Ignored by default (`cargo test` lists
//! them as ignored, with the reason); `-- --ignored torch_` runs them, and
//! then they fail without torch.

use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use chorus::store::{Store, StoreError, TcpStore, TcpStoreOptions, TcpStoreServer, TcpStoreServerOptions};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::{Child, Command};

mod common;
use common::within;

const SCRIPTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../lab/python");

/// PyTorch's own server, in a Python process that lives while `Child` does.
async fn pytorch_server() -> (Child, u16) {
    let mut child = Command::new("python3")
        .arg(format!("{SCRIPTS}/serve_store.py"))
        .env("PYTHONWARNINGS", "ignore")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start python3");
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .await
        .unwrap();
    let port = line
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("PyTorch's server printed {line:?}, not a port"));
    (child, port)
}

/// PyTorch's client running every operation against 127.0.0.1:`port`.
/// The script prints one line of JSON steps; split per step so a mismatch reads well.
async fn pytorch_transcript(port: u16) -> Vec<String> {
    let mut child = Command::new("python3")
        .arg(format!("{SCRIPTS}/store_ops.py"))
        .args(["127.0.0.1", &port.to_string()])
        .env("PYTHONWARNINGS", "ignore")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start python3");
    let mut out = String::new();
    child.stdout.take().unwrap().read_to_string(&mut out).await.unwrap();
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).await.unwrap();
    let status = child.wait().await.unwrap();
    assert!(status.success(), "store_ops.py failed:\n{err}");
    out.trim().split("], [").map(str::to_string).collect()
}

async fn chorus_server() -> TcpStoreServer {
    TcpStoreServer::bind("127.0.0.1:0".parse().unwrap(), TcpStoreServerOptions::default())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyTorch (python3 -c 'import torch'); run: cargo test --workspace --release -- --ignored torch_"]
async fn torch_pytorch_client_gets_the_same_answers_from_chorus_as_from_pytorch() {
    common::require_torch();
    within(120, "pytorch client transcripts", async {
        let (_python_server, port) = pytorch_server().await;
        let reference = pytorch_transcript(port).await;
        let server = chorus_server().await;
        let ours = pytorch_transcript(server.local_addr().port()).await;
        assert_eq!(ours, reference, "chorus server (left) differs from PyTorch's (right)");
    })
    .await;
}

fn outcome<T: std::fmt::Debug>(result: Result<T, StoreError>) -> String {
    match result {
        Ok(value) => format!("{value:?}"),
        Err(StoreError::Timeout { keys, .. }) => format!("timeout {keys:?}"),
        Err(StoreError::ConnectionClosed { operation, .. }) => format!("closed during {operation}"),
        Err(other) => format!("error {other}"),
    }
}

/// chorus's client running every operation against 127.0.0.1:`port`.
async fn chorus_transcript(port: u16) -> Vec<String> {
    let options = TcpStoreOptions {
        timeout: Duration::from_millis(300),
        connect_timeout: Duration::from_secs(10),
        ..TcpStoreOptions::default()
    };
    let store = TcpStore::connect(format!("127.0.0.1:{port}"), options).await.unwrap();
    let mut steps = Vec::new();
    macro_rules! step {
        ($name:expr, $e:expr) => {
            steps.push(format!("{}: {}", $name, outcome($e.await)));
        };
    }
    step!("set", store.set("k", b"v"));
    step!("get", store.get("k"));
    step!("add fresh", store.add("n", 5));
    step!("add again", store.add("n", -7));
    step!("compare_set lie", store.compare_set("cs", b"x", b"y"));
    step!("check after lie", store.check(&["cs"]));
    step!("compare_set create", store.compare_set("cs", b"", b"y"));
    step!("compare_set mismatch", store.compare_set("cs", b"nope", b"z"));
    step!("compare_set swap", store.compare_set("cs", b"y", b"z"));
    step!("append", store.append("ap", b"ab"));
    step!("append more", store.append("ap", b"cd"));
    step!("get appended", store.get("ap"));
    step!("multi_set", store.multi_set(&[("m1", b"x"), ("m2", b"")]));
    step!("multi_get", store.multi_get(&["m1", "m2"]));
    step!("check", store.check(&["k", "absent"]));
    step!("num_keys", store.num_keys());
    step!("delete", store.delete("k"));
    step!("delete again", store.delete("k"));
    step!("wait timeout", store.wait(&["n", "never"]));
    step!("usable after timeout", store.add("n", 1));
    step!("get timeout", store.get("never"));
    step!("queue_push", store.queue_push("q", b"first"));
    step!("queue_push", store.queue_push("q", b"second"));
    step!("queue_len", store.queue_len("q"));
    step!("wait on queue", store.wait(&["q"]));
    step!("queue_pop", store.queue_pop("q", true));
    step!("queue_pop", store.queue_pop("q", false));
    step!("queue_pop empty", store.queue_pop("q", false));
    step!("queue_pop blocking times out", store.queue_pop("q", true));
    let listed = store.list_keys().await.map(|mut keys| {
        keys.sort();
        keys
    });
    steps.push(format!("list_keys: {}", outcome(listed)));
    let big = vec![3u8; 4 << 20];
    step!("set 4 MiB", store.set("big", &big));
    steps.push(format!(
        "get 4 MiB: {}",
        outcome(store.get("big").await.map(|v| v.len()))
    ));
    step!("add on text", store.add("ap", 1));
    step!("reconnects after the server closed it", store.get("m1"));
    steps
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyTorch (python3 -c 'import torch'); run: cargo test --workspace --release -- --ignored torch_"]
async fn torch_chorus_client_gets_the_same_answers_from_pytorch_as_from_chorus() {
    common::require_torch();
    within(120, "chorus client transcripts", async {
        let (_python_server, port) = pytorch_server().await;
        let reference = chorus_transcript(port).await;
        let server = chorus_server().await;
        let ours = chorus_transcript(server.local_addr().port()).await;
        assert_eq!(ours, reference, "against chorus (left) and PyTorch (right)");
        assert!(reference.iter().any(|s| s == "get: b\"v\""), "{reference:#?}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyTorch (python3 -c 'import torch'); run: cargo test --workspace --release -- --ignored torch_"]
async fn torch_keys_written_by_one_side_are_read_by_the_other() {
    common::require_torch();
    within(120, "cross reads", async {
        let server = chorus_server().await;
        let port = server.local_addr().port();
        // PyTorch writes (through its own client), chorus reads with the same key names.
        pytorch_transcript(port).await;
        let options = TcpStoreOptions {
            timeout: Duration::from_secs(5),
            ..TcpStoreOptions::default()
        };
        let store = TcpStore::connect(format!("127.0.0.1:{port}"), options.clone()).await.unwrap();
        assert_eq!(store.get("m1").await.unwrap(), Bytes::from_static(b"x"));
        assert_eq!(store.get("job/k").await.unwrap(), Bytes::from_static(b"pv"));

        // chorus writes to PyTorch's server, PyTorch's client reads.
        let (_python_server, port) = pytorch_server().await;
        let store = TcpStore::connect(format!("127.0.0.1:{port}"), options).await.unwrap();
        store.set("from_rust", b"hello").await.unwrap();
        let output = Command::new("python3")
            .args([
                "-c",
                &format!(
                    "import torch.distributed as d; s = d.TCPStore('127.0.0.1', {port}, is_master=False); print(s.get('from_rust').decode())"
                ),
            ])
            .env("PYTHONWARNINGS", "ignore")
            .output()
            .await
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&output.stdout).trim(), "hello", "{}", String::from_utf8_lossy(&output.stderr));
    })
    .await;
}
