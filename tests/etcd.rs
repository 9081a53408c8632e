//! The store in etcd: the store semantics against a real etcd server, ranks
//! meeting over `etcd://`, an elastic group re-forming over it, and
//! `chorus launch --rdzv-backend etcd` going on after the first launcher's
//! host is killed (no launcher serves the store, so none takes it along).
//!
//! The `etcd_*` tests need Debian's `etcd-server`; they are ignored unless
//! asked for (`cargo test --workspace --release -- --ignored etcd_`), which
//! `.ci/run` does after installing it. The semantics suite also runs on the
//! in-memory store, unignored, so the suite itself is checked everywhere.

use std::process::{Command, ExitStatus};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use chorus::store::{EtcdStore, EtcdStoreOptions, HashStore, Store, StoreError};

mod common;
use common::etcd::Etcd;
use common::launchers::{Job, lock};
use common::{Ranks, Stop, chorus_bin, field, joined, within};

fn b(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

/// Every operation of [`Store`] with PyTorch's semantics; `store` is empty
/// and its default timeout is short (about 300 ms).
async fn suite(store: &dyn Store) {
    store.set("a", b"1").await.unwrap();
    assert_eq!(store.get("a").await.unwrap(), b("1"));
    assert_eq!(store.add("n", 5).await.unwrap(), 5);
    assert_eq!(store.add("n", -7).await.unwrap(), -2);
    assert_eq!(store.get("n").await.unwrap(), b("-2"));
    store.set("t", b"text").await.unwrap();
    assert!(matches!(store.add("t", 1).await, Err(StoreError::Rejected { .. })));

    // compare_set: PyTorch's rules.
    assert_eq!(store.compare_set("cs", b"x", b"y").await.unwrap(), b("x"));
    assert!(!store.check(&["cs"]).await.unwrap(), "nothing stored for a missing key");
    assert_eq!(store.compare_set("cs", b"", b"y").await.unwrap(), b("y"));
    assert_eq!(store.compare_set("cs", b"z", b"w").await.unwrap(), b("y"));
    assert_eq!(store.compare_set("cs", b"y", b"w").await.unwrap(), b("w"));
    assert_eq!(store.get("cs").await.unwrap(), b("w"));

    store.append("ap", b"ab").await.unwrap();
    store.append("ap", b"cd").await.unwrap();
    assert_eq!(store.get("ap").await.unwrap(), b("abcd"));

    store
        .multi_set(&[("m1", b"x"), ("m2", b""), ("m1", b"last")])
        .await
        .unwrap();
    assert_eq!(
        store.multi_get(&["m1", "m2"]).await.unwrap(),
        vec![b("last"), Bytes::new()]
    );
    assert!(store.check(&["a", "n", "cs", "m2"]).await.unwrap());
    assert!(!store.check(&["a", "absent"]).await.unwrap());
    // a, n, t, cs, ap, m1, m2.
    assert_eq!(store.num_keys().await.unwrap(), 7);
    assert!(store.delete("a").await.unwrap());
    assert!(!store.delete("a").await.unwrap());
    assert!(!store.check(&["a"]).await.unwrap());

    // Keys that nest as text are separate keys.
    store.set("d", b"1").await.unwrap();
    store.set("d/e", b"2").await.unwrap();
    assert_eq!(store.get("d").await.unwrap(), b("1"));
    assert!(store.delete("d").await.unwrap());
    assert_eq!(store.get("d/e").await.unwrap(), b("2"));

    // Queues: in order; a non-empty queue makes its key exist for waits.
    store.queue_push("q", b"first").await.unwrap();
    store.queue_push("q", b"second").await.unwrap();
    assert_eq!(store.queue_len("q").await.unwrap(), 2);
    assert!(store.check(&["q"]).await.unwrap());
    store.wait(&["q"]).await.unwrap();
    assert_eq!(store.queue_pop("q", false).await.unwrap(), Some(b("first")));
    assert_eq!(store.queue_pop("q", true).await.unwrap(), Some(b("second")));
    assert_eq!(store.queue_pop("q", false).await.unwrap(), None);
    assert_eq!(store.queue_len("q").await.unwrap(), 0);
    assert!(!store.check(&["q"]).await.unwrap());
    let started = Instant::now();
    let err = store.queue_pop("q", true).await.unwrap_err();
    assert!(err.is_timeout(), "{err}");
    assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());

    // Blocking reads time out naming the missing key, within their timeout.
    let started = Instant::now();
    let err = store
        .wait_timeout(&["n", "never"], Duration::from_millis(200))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, StoreError::Timeout { keys, .. } if keys == &["never".to_string()]),
        "{err}"
    );
    assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
    let err = store.get("never").await.unwrap_err();
    assert!(err.is_timeout(), "{err}");
    let err = store.multi_get(&["n", "never"]).await.unwrap_err();
    assert!(err.is_timeout(), "{err}");
}

/// The suite holds for the in-memory store, the reference: so a failure
/// against etcd is etcd's store, not the suite.
#[tokio::test]
async fn the_store_suite_holds_for_the_in_memory_store() {
    within(30, "the suite", suite(&HashStore::new(Duration::from_millis(300)))).await;
}

async fn etcd_store(endpoints: Vec<String>, prefix: &str, timeout: Duration) -> EtcdStore {
    let options = EtcdStoreOptions {
        timeout,
        connect_timeout: Duration::from_secs(5),
        prefix: prefix.to_string(),
    };
    EtcdStore::connect(endpoints, options).await.expect("connect to etcd")
}

#[tokio::test]
#[ignore = "needs etcd-server (/usr/bin/etcd): apt-get install -y etcd-server"]
async fn etcd_store_semantics_and_prefixes() {
    let etcd = Etcd::start();
    within(60, "the suite against etcd", async {
        let store = etcd_store(vec![etcd.endpoint()], "/suite", Duration::from_millis(300)).await;
        suite(&store).await;
        // Another prefix is another store.
        let other = etcd_store(vec![etcd.endpoint()], "/other", Duration::from_millis(300)).await;
        assert_eq!(other.num_keys().await.unwrap(), 0);
        assert!(!other.check(&["n"]).await.unwrap());
        assert!(store.location().contains(&etcd.endpoint()), "{}", store.location());
        let big = vec![7u8; 2 << 20];
        assert!(matches!(store.set("big", &big).await, Err(StoreError::TooLarge { .. })));
        let fits = vec![7u8; 900 << 10];
        store.set("fits", &fits).await.unwrap();
        assert_eq!(store.get("fits").await.unwrap().len(), fits.len());
    })
    .await;
}

#[tokio::test]
#[ignore = "needs etcd-server (/usr/bin/etcd): apt-get install -y etcd-server"]
async fn etcd_waits_wake_on_another_clients_writes() {
    let etcd = Etcd::start();
    within(60, "waits", async {
        let reader = Arc::new(etcd_store(vec![etcd.endpoint()], "/w", Duration::from_secs(10)).await);
        let writer = etcd_store(vec![etcd.endpoint()], "/w", Duration::from_secs(10)).await;
        let r = reader.clone();
        let get = tokio::spawn(async move { r.get("late").await });
        let r = reader.clone();
        let wait = tokio::spawn(async move { r.wait(&["x", "y"]).await });
        let r = reader.clone();
        let pop = tokio::spawn(async move { r.queue_pop("jobs", true).await });
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!get.is_finished() && !wait.is_finished() && !pop.is_finished());
        let started = Instant::now();
        writer.set("late", b"here").await.unwrap();
        writer.set("x", b"1").await.unwrap();
        writer.queue_push("jobs", b"j1").await.unwrap();
        assert_eq!(get.await.unwrap().unwrap(), b("here"));
        assert_eq!(pop.await.unwrap().unwrap(), Some(b("j1")));
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!wait.is_finished(), "one of two keys is not enough");
        writer.set("y", b"2").await.unwrap();
        wait.await.unwrap().unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "woken late: {:?}",
            started.elapsed()
        );
    })
    .await;
}

#[tokio::test]
#[ignore = "needs etcd-server (/usr/bin/etcd): apt-get install -y etcd-server"]
async fn etcd_eight_clients_add_and_compare_set_exactly_once() {
    let etcd = Etcd::start();
    within(120, "concurrent adds", async {
        let mut tasks = Vec::new();
        for i in 0..8 {
            let store = etcd_store(vec![etcd.endpoint()], "/c", Duration::from_secs(20)).await;
            tasks.push(tokio::spawn(async move {
                for _ in 0..25 {
                    store.add("sum", 1).await.unwrap();
                }
                store
                    .compare_set("winner", b"", i.to_string().as_bytes())
                    .await
                    .unwrap()
            }));
        }
        let mut winners = Vec::new();
        for task in tasks {
            winners.push(task.await.unwrap());
        }
        let store = etcd_store(vec![etcd.endpoint()], "/c", Duration::from_secs(5)).await;
        assert_eq!(store.get("sum").await.unwrap(), b("200"));
        let winner = store.get("winner").await.unwrap();
        assert!(winners.iter().all(|w| *w == winner), "{winners:?}");
    })
    .await;
}

/// A dead endpoint first in the list is skipped; a list of dead endpoints
/// is an error naming them, within the connect timeout.
#[tokio::test]
#[ignore = "needs etcd-server (/usr/bin/etcd): apt-get install -y etcd-server"]
async fn etcd_a_dead_endpoint_in_the_list_is_skipped() {
    let etcd = Etcd::start();
    within(60, "failover", async {
        let dead = format!("127.0.0.1:{}", common::free_port());
        let store = etcd_store(vec![dead.clone(), etcd.endpoint()], "/f", Duration::from_secs(2)).await;
        store.set("k", b"v").await.unwrap();
        assert_eq!(store.get("k").await.unwrap(), b("v"));
    })
    .await;
}

/// A store on a three-member etcd cluster outlives the member it talked
/// to: after that member is SIGKILLed, reads, writes and waits go to the
/// others, and what was written before is still there.
#[tokio::test]
#[ignore = "needs etcd-server (/usr/bin/etcd): apt-get install -y etcd-server"]
async fn etcd_the_store_outlives_an_etcd_member() {
    let mut members = Etcd::cluster(3);
    let endpoints: Vec<String> = members.iter().map(Etcd::endpoint).collect();
    within(60, "a store across a member's loss", async {
        let store = etcd_store(endpoints.clone(), "/r", Duration::from_secs(10)).await;
        assert_eq!(store.add("n", 1).await.unwrap(), 1);
        store.set("before", b"1").await.unwrap();
        // The first endpoint is the one it talks to: kill it.
        members[0].kill();
        assert_eq!(store.get("before").await.unwrap(), b("1"));
        assert_eq!(store.add("n", 1).await.unwrap(), 2);
        let waiter = etcd_store(endpoints.clone(), "/r", Duration::from_secs(10)).await;
        let wait = tokio::spawn(async move { waiter.get("after").await });
        tokio::time::sleep(Duration::from_millis(200)).await;
        store.set("after", b"2").await.unwrap();
        assert_eq!(wait.await.unwrap().unwrap(), b("2"));
    })
    .await;
}

/// Against endpoints that refuse connections or accept and answer nothing,
/// connecting gives up within its timeout and says where it tried.
#[tokio::test]
async fn an_etcd_endpoint_that_refuses_or_answers_nothing_costs_only_the_timeout() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_addr = silent.local_addr().unwrap().to_string();
    let refused = format!("127.0.0.1:{}", common::free_port());
    within(30, "giving up", async {
        for endpoints in [vec![refused.clone()], vec![silent_addr.clone()]] {
            let options = EtcdStoreOptions {
                timeout: Duration::from_millis(500),
                connect_timeout: Duration::from_millis(500),
                prefix: "/x".into(),
            };
            let started = Instant::now();
            let err = EtcdStore::connect(endpoints.clone(), options).await.unwrap_err();
            let message = err.to_string();
            assert!(
                started.elapsed() < Duration::from_secs(3),
                "{:?}: {message}",
                started.elapsed()
            );
            assert!(
                matches!(err, StoreError::Unreachable { .. }) && message.contains(&endpoints[0]),
                "{message}"
            );
        }
    })
    .await;
    drop(silent);
}

/// `chorus hello` ranks in separate processes meet over `etcd://`.
#[test]
#[ignore = "needs etcd-server (/usr/bin/etcd): apt-get install -y etcd-server"]
fn etcd_ranks_meet_over_an_etcd_url() {
    let etcd = Etcd::start();
    let world = 3;
    let mut ranks = Ranks::new();
    for rank in 0..world {
        let url = format!("{}?rank={rank}&world_size={world}", etcd.url("/hello"));
        let mut command = Command::new(chorus_bin());
        command
            .args(["hello", "--timeout", "30", "--worker", &url])
            .env("CHORUS_JOB_SECRET", "etcd-hello");
        ranks.spawn(&mut command, "chorus hello --worker");
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    for rank in 0..world {
        let status = ranks.wait(rank, deadline);
        ranks.drain();
        assert!(status.success(), "rank {rank}: {status}\n{}", ranks.output());
    }
    ranks.drain();
    let log = ranks.output();
    for rank in 0..world {
        for peer in (0..world).filter(|&p| p != rank) {
            assert!(
                log.lines()
                    .any(|l| l.starts_with(&format!("[{rank}] "))
                        && l.contains(&format!("said \"hello from rank {peer}\""))),
                "rank {rank} never heard rank {peer}:\n{log}"
            );
        }
    }
}

/// An elastic group of three over `etcd://`: one rank is SIGKILLed, the
/// two others re-form as generation 1 of 2 and finish.
#[test]
#[ignore = "needs etcd-server (/usr/bin/etcd): apt-get install -y etcd-server"]
fn etcd_an_elastic_group_re_forms_after_a_sigkill() {
    let etcd = Etcd::start();
    let url = etcd.url("/elastic");
    let mut ranks = Ranks::new();
    for rank in 0..3 {
        let mut command = Command::new(chorus_bin());
        command
            .args(["elastic-probe", "--init", &url, "--iterations", "300"])
            .args(["--min-world", "2", "--max-world", "3"])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", "3")
            .env("CHORUS_HEARTBEAT_TIMEOUT", "2")
            .env("CHORUS_JOB_SECRET", "etcd-elastic");
        ranks.spawn(&mut command, "chorus elastic-probe");
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let has = |log: &[String], r: usize, needle: &str| {
        log.iter()
            .any(|l| l.starts_with(&format!("[{r}] ")) && l.contains(needle))
    };
    ranks.until("every rank running", deadline, |log| {
        (0..3).all(|r| has(log, r, "event=running"))
    });
    ranks.kill(1);
    ranks.until("the survivors done", deadline, |log| {
        [0, 2].iter().all(|&r| has(log, r, "event=done"))
    });
    for rank in [0, 2] {
        let status = ranks.wait(rank, deadline);
        assert!(status.success(), "rank {rank}: {status}\n{}", ranks.output());
    }
    let log = ranks.output();
    for (old, new) in [(0, 0), (2, 1)] {
        assert!(
            log.contains(&format!(
                "[{old}] probe rank={new} gen=1 world=2 event=done iterations=300"
            )),
            "{log}"
        );
    }
}

const WORKER: &str = r#"#!/bin/sh
exec "$CHORUS" elastic-probe --min-world "$CHORUS_MIN_WORLD" --max-world "$CHORUS_MAX_WORLD" "$@"
"#;

/// Two launchers of `--nnodes 1:2 --restart-policy worker` meeting in
/// etcd. The first one (with the c10d backend, the one serving the store)
/// is SIGKILLed with its worker: the other's worker re-forms alone and
/// finishes, and its launcher exits 0, since the store was never on the
/// lost host.
#[test]
#[ignore = "needs etcd-server (/usr/bin/etcd): apt-get install -y etcd-server"]
fn etcd_launch_goes_on_when_the_first_launcher_is_killed() {
    let _turn = lock();
    let etcd = Etcd::start();
    let mut job = Job::named("etcd-job", "etcd-launch-test", WORKER).in_etcd(&etcd.url("/launch"));
    let flags = [
        "--restart-policy",
        "worker",
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "1",
        "--rdzv-conf",
        "join_timeout=20,last_call_timeout=2,keep_alive_interval=0.5,keep_alive_max_attempt=2",
    ];
    let start = |job: &mut Job, tag: &str| {
        let mut command = job.command(tag, &flags);
        command
            .arg(job.worker())
            .args(["--iterations", "2000"])
            .env_remove("CHORUS_MIN_WORLD")
            .env_remove("CHORUS_MAX_WORLD")
            .env_remove("CHORUS_STORE");
        job.spawn(tag, command);
    };
    // Both join round 0 within its last call: one group of two.
    start(&mut job, "a");
    start(&mut job, "b");
    for tag in ["a", "b"] {
        job.wait_until(30, &format!("{tag}'s worker never ran in a world of two"), |job| {
            job.stdout(tag).contains("gen=0 world=2") && job.stdout(tag).contains("event=running")
        });
    }
    let first_worker: i32 = job
        .stdout("a")
        .lines()
        .find(|l| l.contains("event=ready"))
        .and_then(|l| field(l, "pid")?.parse().ok())
        .unwrap_or_else(|| panic!("no pid from a's worker\n{}", job.all_output()));
    job.child("a").kill().unwrap();
    job.child("a").wait().unwrap();
    job.wait_until(5, "the killed launcher's worker outlived it", |_| {
        !common::launchers::alive(first_worker)
    });

    let status: ExitStatus = job.finish("b", 90);
    let all = job.all_output();
    assert!(status.success(), "{status}\n{all}\n--- etcd:\n{}", etcd.log());
    let stdout = job.stdout("b");
    assert!(
        stdout.lines().any(|l| l.contains("world=1 event=done iterations=2000")),
        "b's worker finished alone\n{all}"
    );
    assert_eq!(
        stdout.lines().filter(|l| l.contains("event=ready")).count(),
        1,
        "b's worker was never restarted\n{all}"
    );
    assert!(job.stderr("b").contains("taking it for gone"), "{all}");
    assert!(!job.stderr("b").contains("lost the job's store"), "{all}");
}

/// `chorus launch --rdzv-backend etcd` without an endpoint says what to give.
#[test]
fn launch_with_etcd_needs_an_endpoint() {
    let output = common::run(
        Command::new(chorus_bin()).args(["launch", "--rdzv-backend", "etcd", "--", "true"]),
        30,
        "chorus launch",
        Stop::Kill,
    );
    assert!(!output.status.success());
    assert!(joined(&output).contains("--rdzv-endpoint"), "{}", joined(&output));
}
