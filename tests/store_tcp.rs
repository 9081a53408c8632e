//! The TCP store over real sockets: semantics, timeouts, concurrency, and
//! bad input from raw sockets while good clients keep being served.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use chorus::process::{self, Signal};
use chorus::store::protocol::{self, QueryType, Request};
use chorus::store::{Store, StoreError, TcpStore, TcpStoreOptions, TcpStoreServer, TcpStoreServerOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

mod common;
use common::{chorus_bin, free_port, within};

async fn server_with(options: TcpStoreServerOptions) -> TcpStoreServer {
    TcpStoreServer::bind("127.0.0.1:0".parse().unwrap(), options)
        .await
        .expect("bind")
}

async fn client(addr: SocketAddr, timeout: Duration) -> TcpStore {
    let options = TcpStoreOptions {
        timeout,
        connect_timeout: Duration::from_secs(5),
        ..TcpStoreOptions::default()
    };
    TcpStore::connect(addr.to_string(), options).await.expect("connect")
}

#[tokio::test]
async fn every_operation_over_tcp() {
    within(30, "operations", async {
        let server = server_with(TcpStoreServerOptions::default()).await;
        let store = client(server.local_addr(), Duration::from_secs(5)).await;
        store.set("a", b"1").await.unwrap();
        assert_eq!(store.get("a").await.unwrap(), Bytes::from_static(b"1"));
        assert_eq!(store.add("n", 5).await.unwrap(), 5);
        assert_eq!(store.add("n", -2).await.unwrap(), 3);
        assert_eq!(
            store.compare_set("cs", b"x", b"y").await.unwrap(),
            Bytes::from_static(b"x")
        );
        assert!(!store.check(&["cs"]).await.unwrap());
        assert_eq!(
            store.compare_set("cs", b"", b"y").await.unwrap(),
            Bytes::from_static(b"y")
        );
        assert_eq!(
            store.compare_set("cs", b"y", b"z").await.unwrap(),
            Bytes::from_static(b"z")
        );
        assert!(store.check(&["a", "n", "cs"]).await.unwrap());
        store.append("ap", b"ab").await.unwrap();
        store.append("ap", b"cd").await.unwrap();
        assert_eq!(store.get("ap").await.unwrap(), Bytes::from_static(b"abcd"));
        store.multi_set(&[("m1", b"x"), ("m2", b"")]).await.unwrap();
        assert_eq!(
            store.multi_get(&["m1", "m2"]).await.unwrap(),
            vec![Bytes::from_static(b"x"), Bytes::new()]
        );
        assert_eq!(store.num_keys().await.unwrap(), 6);
        assert!(store.delete("a").await.unwrap());
        assert!(!store.delete("a").await.unwrap());
        store.queue_push("q", b"first").await.unwrap();
        store.queue_push("q", b"second").await.unwrap();
        assert_eq!(store.queue_len("q").await.unwrap(), 2);
        assert_eq!(
            store.queue_pop("q", false).await.unwrap(),
            Some(Bytes::from_static(b"first"))
        );
        assert_eq!(
            store.queue_pop("q", true).await.unwrap(),
            Some(Bytes::from_static(b"second"))
        );
        assert_eq!(store.queue_pop("q", false).await.unwrap(), None);
        let mut keys = store.list_keys().await.unwrap();
        keys.sort();
        assert_eq!(
            keys,
            ["/ap", "/cs", "/m1", "/m2", "/n"].map(|k| Bytes::from_static(k.as_bytes()))
        );
        let big = vec![7u8; 8 << 20];
        store.set("big", &big).await.unwrap();
        assert_eq!(store.get("big").await.unwrap().len(), big.len());
    })
    .await;
}

#[tokio::test]
async fn a_get_waits_for_another_clients_set() {
    within(30, "wait", async {
        let server = server_with(TcpStoreServerOptions::default()).await;
        let reader = client(server.local_addr(), Duration::from_secs(10)).await;
        let writer = client(server.local_addr(), Duration::from_secs(10)).await;
        let pending = tokio::spawn(async move { reader.get("late").await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!pending.is_finished());
        writer.set("late", b"here").await.unwrap();
        assert_eq!(pending.await.unwrap().unwrap(), Bytes::from_static(b"here"));
    })
    .await;
}

#[tokio::test]
async fn a_wait_timeout_names_key_and_address_and_the_connection_survives() {
    within(30, "timeout", async {
        let server = server_with(TcpStoreServerOptions::default()).await;
        let store = client(server.local_addr(), Duration::from_millis(300)).await;
        store.set("present", b"1").await.unwrap();
        let err = store.wait(&["present", "never"]).await.unwrap_err();
        let message = err.to_string();
        assert!(
            matches!(err, StoreError::Timeout { ref keys, .. } if keys == &["never".to_string()]),
            "{message}"
        );
        assert!(message.contains(&server.local_addr().to_string()), "{message}");
        let err = store.get("never").await.unwrap_err();
        assert!(err.is_timeout(), "{err}");
        // CANCEL_WAIT kept the connection in step: the next reply is ours.
        assert_eq!(store.add("counter", 1).await.unwrap(), 1);
    })
    .await;
}

#[tokio::test]
async fn eight_concurrent_clients_add_up() {
    within(60, "concurrent adds", async {
        let server = server_with(TcpStoreServerOptions::default()).await;
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let store = client(server.local_addr(), Duration::from_secs(10)).await;
            tasks.push(tokio::spawn(async move {
                for _ in 0..200 {
                    store.add("sum", 1).await.unwrap();
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        let store = client(server.local_addr(), Duration::from_secs(10)).await;
        assert_eq!(store.add("sum", 0).await.unwrap(), 1600);
    })
    .await;
}

#[tokio::test]
async fn an_unreachable_store_says_where_and_how_long() {
    within(30, "unreachable", async {
        let port = free_port();
        let options = TcpStoreOptions {
            connect_timeout: Duration::from_millis(500),
            ..TcpStoreOptions::default()
        };
        let err = TcpStore::connect(format!("127.0.0.1:{port}"), options)
            .await
            .unwrap_err();
        match &err {
            StoreError::Unreachable {
                addr,
                attempts,
                elapsed,
                ..
            } => {
                assert_eq!(addr, &format!("127.0.0.1:{port}"));
                assert!(*attempts > 1, "it should retry");
                assert!(*elapsed <= Duration::from_secs(2));
            }
            other => panic!("expected unreachable, got {other}"),
        }
    })
    .await;
}

#[tokio::test]
async fn a_server_that_goes_away_is_an_error_not_a_hang() {
    within(30, "server gone", async {
        let server = server_with(TcpStoreServerOptions::default()).await;
        let store = client(server.local_addr(), Duration::from_secs(20)).await;
        let waiter = tokio::spawn(async move { store.wait(&["never"]).await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(server);
        let err = waiter.await.unwrap().unwrap_err();
        assert!(
            !err.is_timeout(),
            "the server's exit must be reported at once, got {err}"
        );
    })
    .await;
}

/// A raw connection that has passed the handshake.
async fn raw(addr: SocketAddr) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let mut hello = BytesMut::new();
    Request::Validate {
        magic: protocol::VALIDATION_MAGIC,
    }
    .encode(&mut hello);
    stream.write_all(&hello).await.unwrap();
    stream
}

/// Whether the server closes `stream` within a few seconds.
async fn closed_by_server(stream: &mut TcpStream) -> bool {
    let mut buf = [0u8; 64];
    loop {
        match tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue,
            Err(_) => return false,
        }
    }
}

#[tokio::test]
async fn bad_input_closes_only_the_offending_connection() {
    within(60, "bad input", async {
        let options = TcpStoreServerOptions {
            handshake_timeout: Duration::from_millis(500),
            ..TcpStoreServerOptions::default()
        };
        let server = server_with(options).await;
        let addr = server.local_addr();
        let good = client(addr, Duration::from_secs(5)).await;
        good.set("k", b"v").await.unwrap();

        let mut forged_key = BytesMut::new();
        forged_key.put_u8(QueryType::Set as u8);
        forged_key.put_u64_le(1 << 60);
        let mut forged_value = BytesMut::new();
        forged_value.put_u8(QueryType::Set as u8);
        protocol::put_bytes(&mut forged_value, b"/k");
        forged_value.put_u64_le(1 << 60);
        let mut forged_count = BytesMut::new();
        forged_count.put_u8(QueryType::MultiGet as u8);
        forged_count.put_u64_le(u64::MAX);
        let mut add_on_text = BytesMut::new();
        Request::Add {
            key: Bytes::from_static(b"/k"),
            delta: 1,
        }
        .encode(&mut add_on_text);
        let cases: Vec<(&str, Vec<u8>)> = vec![
            ("unknown query type", vec![200, 1, 2, 3]),
            ("forged key length", forged_key.to_vec()),
            ("forged value length", forged_value.to_vec()),
            ("forged key count", forged_count.to_vec()),
            ("add on text", add_on_text.to_vec()),
        ];
        for (what, bytes) in cases {
            let mut stream = raw(addr).await;
            stream.write_all(&bytes).await.unwrap();
            assert!(
                closed_by_server(&mut stream).await,
                "{what}: the server kept the connection"
            );
            assert_eq!(good.get("k").await.unwrap(), Bytes::from_static(b"v"), "after {what}");
        }

        // Garbage instead of the handshake.
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        assert!(closed_by_server(&mut stream).await, "garbage handshake kept");

        // A client that connects and says nothing is dropped after the handshake timeout.
        let mut silent = TcpStream::connect(addr).await.unwrap();
        assert!(closed_by_server(&mut silent).await, "silent client kept");

        // A truncated frame, then the client vanishes: the server just forgets it.
        let mut truncated = raw(addr).await;
        truncated.write_all(&forged_value[..5]).await.unwrap();
        drop(truncated);
        // A client that vanishes mid-wait leaves no wait behind to fire into a dead socket.
        let mut waiting = raw(addr).await;
        let mut wait = BytesMut::new();
        Request::Wait {
            keys: vec![Bytes::from_static(b"/later")],
        }
        .encode(&mut wait);
        waiting.write_all(&wait).await.unwrap();
        drop(waiting);
        tokio::time::sleep(Duration::from_millis(100)).await;
        good.set("later", b"1").await.unwrap();
        assert_eq!(good.add("alive", 1).await.unwrap(), 1);
    })
    .await;
}

#[tokio::test]
async fn ten_thousand_idle_connections_do_not_starve_a_working_client() {
    within(120, "10k idle connections", async {
        // The server runs in its own process so each side holds 10 000 sockets, not 20 000.
        let mut server = tokio::process::Command::new(chorus_bin())
            .args(["store", "serve", "--host", "127.0.0.1", "--port", "0"])
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start chorus store serve");
        let mut stdout = tokio::io::BufReader::new(server.stdout.take().unwrap());
        let mut line = String::new();
        tokio::io::AsyncBufReadExt::read_line(&mut stdout, &mut line)
            .await
            .unwrap();
        let addr: SocketAddr = line.trim().rsplit(' ').next().unwrap().parse().expect("server address");

        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: plain getrlimit/setrlimit on a local struct.
        unsafe {
            libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit);
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
        let wanted = 10_000usize.min(limit.rlim_cur.saturating_sub(200) as usize);
        assert!(
            wanted >= 10_000,
            "this machine allows only {} open files; the test needs 10 200",
            limit.rlim_cur
        );
        let mut idle = Vec::with_capacity(wanted);
        for _ in 0..wanted {
            idle.push(raw(addr).await);
        }
        let store = client(addr, Duration::from_secs(10)).await;
        let started = std::time::Instant::now();
        for i in 0..100 {
            store.set(&format!("k{i}"), b"v").await.unwrap();
        }
        assert_eq!(store.num_keys().await.unwrap(), 100);
        println!(
            "100 sets with {wanted} idle connections open took {:?}",
            started.elapsed()
        );
        drop(idle);
        server.kill().await.unwrap();
    })
    .await;
}

/// A listener that accepts every connection and never answers, as a stopped
/// server looks (the kernel completes the handshake for it).
fn silent_listener() -> (std::net::TcpListener, SocketAddr) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    (listener, addr)
}

/// A listener whose accept queue is full, so new connection attempts get no
/// answer at all; the filling connections come back to be held.
fn full_backlog() -> (tokio::net::TcpListener, Vec<std::net::TcpStream>, SocketAddr) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(1).unwrap();
    let addr = listener.local_addr().unwrap();
    let mut held = Vec::new();
    for _ in 0..64 {
        match std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
            Ok(stream) => held.push(stream),
            Err(_) => return (listener, held, addr),
        }
    }
    panic!("64 connections fitted in a backlog of 1: cannot make a full backlog here");
}

fn options(timeout: Duration, connect_timeout: Duration) -> TcpStoreOptions {
    TcpStoreOptions {
        timeout,
        connect_timeout,
        ..TcpStoreOptions::default()
    }
}

#[tokio::test]
async fn a_server_that_accepts_and_never_answers_fails_the_connect_in_time() {
    within(30, "silent connect", async {
        let (_listener, addr) = silent_listener();
        let started = std::time::Instant::now();
        let err = TcpStore::connect(
            addr.to_string(),
            options(Duration::from_secs(60), Duration::from_secs(1)),
        )
        .await
        .unwrap_err();
        let took = started.elapsed();
        assert!(took < Duration::from_millis(1500), "connect took {took:?}");
        let message = err.to_string();
        assert!(
            matches!(err, StoreError::NoReply { .. }) && message.contains("handshake"),
            "{message}"
        );
        assert!(message.contains(&addr.to_string()), "{message}");
    })
    .await;
}

#[tokio::test]
async fn a_full_backlog_fails_the_connect_in_time() {
    within(30, "full backlog", async {
        let (_listener, _held, addr) = full_backlog();
        let started = std::time::Instant::now();
        let err = TcpStore::connect(
            addr.to_string(),
            options(Duration::from_secs(60), Duration::from_secs(1)),
        )
        .await
        .unwrap_err();
        let took = started.elapsed();
        assert!(took < Duration::from_millis(1500), "connect took {took:?}");
        assert!(matches!(err, StoreError::Unreachable { .. }), "{err}");
        assert!(err.to_string().contains(&addr.to_string()), "{err}");
    })
    .await;
}

/// A server that passes the handshake, then never answers again.
async fn server_that_freezes_after_the_handshake() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((mut stream, _)) = listener.accept().await {
            // VALIDATE (1 + 4 bytes), then PING (1 + 4): echo the nonce.
            let mut hello = [0u8; 10];
            if stream.read_exact(&mut hello).await.is_ok() {
                let _ = stream.write_all(&hello[6..10]).await;
            }
            held.push(stream);
        }
    });
    addr
}

#[tokio::test]
async fn every_operation_ends_in_time_against_a_server_that_stops_answering() {
    within(60, "frozen server", async {
        let addr = server_that_freezes_after_the_handshake().await;
        let timeout = Duration::from_millis(500);
        let store = TcpStore::connect(addr.to_string(), options(timeout, Duration::from_secs(5)))
            .await
            .expect("the handshake is answered");
        // SET has no reply in the protocol: only the answered operations can tell.
        for (op, result) in [
            ("get", store.get("k").await.map(drop)),
            ("add", store.add("n", 1).await.map(drop)),
            ("wait", store.wait(&["k"]).await),
            ("check", store.check(&["k"]).await.map(drop)),
            ("list_keys", store.list_keys().await.map(drop)),
        ] {
            let err = result.unwrap_err();
            let message = err.to_string();
            assert!(matches!(err, StoreError::NoReply { .. }), "{op}: {message}");
            assert!(message.contains(op) || op == "list_keys", "{op}: {message}");
            assert!(message.contains(&addr.to_string()), "{op}: {message}");
        }
        // Each operation, reconnecting included, within its timeout (plus
        // the cancel grace for the waiting ones).
        let started = std::time::Instant::now();
        let _ = store.get_timeout("k", Duration::from_millis(300)).await.unwrap_err();
        let took = started.elapsed();
        assert!(took < Duration::from_millis(1200), "get took {took:?}");
    })
    .await;
}

#[tokio::test]
async fn an_address_without_a_port_fails_at_once() {
    within(10, "bad address", async {
        let started = std::time::Instant::now();
        let err = TcpStore::connect("nonsense", options(Duration::from_secs(9), Duration::from_secs(9)))
            .await
            .unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(1));
        assert!(err.to_string().contains("expected host:port"), "{err}");
    })
    .await;
}

#[test]
fn store_get_against_a_stopped_store_server_returns_in_time() {
    let port = free_port();
    let mut server = std::process::Command::new(chorus_bin())
        .args(["store", "serve", "--port", &port.to_string()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start chorus store serve");
    let mut ready = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(server.stdout.take().unwrap()), &mut ready).unwrap();
    assert!(ready.contains("serving"), "{ready}");
    process::signal(server.id(), Signal::SIGSTOP);
    let started = std::time::Instant::now();
    let output = common::run(
        std::process::Command::new(chorus_bin()).args([
            "store",
            "get",
            "k",
            "--addr",
            &format!("127.0.0.1:{port}"),
            "--timeout",
            "2",
        ]),
        20,
        "chorus store get",
        common::Stop::Kill,
    );
    let took = started.elapsed();
    let _ = server.kill();
    let _ = server.wait();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        took < Duration::from_secs(4),
        "chorus store get took {took:?}: {stderr}"
    );
    assert!(stderr.contains(&format!("127.0.0.1:{port}")), "{stderr}");
    assert!(stderr.contains("did not answer"), "{stderr}");
}

/// Runs `chorus store ARGS` to its end (20 s at most).
fn store_cli(args: &[&str]) -> std::process::Output {
    common::run(
        std::process::Command::new(chorus_bin()).arg("store").args(args),
        20,
        &format!("chorus store {args:?}"),
        common::Stop::Kill,
    )
}

#[test]
fn store_cli_errors_say_each_cause_once_and_a_bad_address_at_once() {
    let addr = format!("127.0.0.1:{}", free_port());
    let output = store_cli(&["get", "k", "--addr", &addr, "--timeout", "1"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains(&addr), "{stderr}");
    assert_eq!(stderr.matches("refused").count(), 1, "the cause once: {stderr}");

    let started = std::time::Instant::now();
    let output = store_cli(&["get", "k", "--addr", "nonsense", "--timeout", "9"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(started.elapsed() < Duration::from_secs(2), "{stderr}");
    assert!(stderr.contains("expected host:port"), "{stderr}");
}

#[test]
fn store_cli_check_names_missing_keys_and_keys_raw_shows_them_as_stored() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let server = runtime.block_on(server_with(TcpStoreServerOptions::default()));
    let addr = server.local_addr().to_string();
    runtime.block_on(async {
        client(server.local_addr(), Duration::from_secs(5))
            .await
            .set("a", b"1")
            .await
            .unwrap();
        let raw = TcpStore::connect(
            addr.clone(),
            TcpStoreOptions {
                key_prefix: String::new(),
                ..options(Duration::from_secs(5), Duration::from_secs(5))
            },
        )
        .await
        .unwrap();
        raw.set("b", b"2").await.unwrap();
    });
    let stdout = |output: &std::process::Output| String::from_utf8_lossy(&output.stdout).into_owned();

    let output = store_cli(&["check", "a", "c", "d", "--addr", &addr]);
    assert_eq!(output.status.code(), Some(1), "{}", common::text(&output));
    assert_eq!(stdout(&output).trim(), "not ready: missing c, d");

    let keys = store_cli(&["keys", "--addr", &addr]);
    let raw = store_cli(&["keys", "--raw", "--addr", &addr]);
    assert!(keys.status.success() && raw.status.success());
    let lines = |s: String| s.lines().map(str::to_string).collect::<Vec<_>>();
    assert_eq!(
        lines(stdout(&keys)),
        ["a", "b  (stored without \"/\": use --raw)", "2 keys"]
    );
    assert_eq!(lines(stdout(&raw)), ["/a", "b", "2 keys"]);
    drop(server);
}

#[test]
fn store_serve_listens_on_loopback_unless_told_otherwise() {
    let mut server = std::process::Command::new(chorus_bin())
        .args(["store", "serve", "--port", "0"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start chorus store serve");
    let mut ready = String::new();
    let read = std::io::BufRead::read_line(&mut std::io::BufReader::new(server.stdout.take().unwrap()), &mut ready);
    let _ = server.kill();
    let _ = server.wait();
    read.unwrap();
    assert!(ready.starts_with("chorus store serving on 127.0.0.1:"), "{ready}");
}
