//! Jobs across simulated hosts (network namespaces made by
//! `scripts/sim-cluster.sh`: own host name, own `/dev/shm`, `eth0` on a
//! switch, a decoy `docker0` with the same address everywhere). Each test
//! starts one `chorus launch` per host, as a user would on real machines.
//! They need root (network namespaces): ignored by the README's test
//! command, listed with that reason; `.ci/run` runs them as root
//! (`cargo test --release --test multihost -- --ignored netns_`), and they
//! fail where the hosts cannot be made.

mod common;

use std::process::{Child, Command, Output};

use common::cluster::{self, Cluster};
use common::{LAUNCHER, chorus_bin, finish, joined, spawn_piped};

/// `chorus launch` on `host` of a job of `nnodes` nodes whose store is on
/// host 1, with `flags`, running `program`.
fn launcher(cluster: &Cluster, host: usize, nnodes: usize, nproc: usize, flags: &[&str], program: &[&str]) -> Command {
    let mut command = cluster.command(host, chorus_bin());
    command
        .args([
            "launch",
            "--nnodes",
            &nnodes.to_string(),
            "--nproc-per-node",
            &nproc.to_string(),
        ])
        .args(["--master-addr", &cluster.addr(1), "--master-port", "29500"])
        // Node ranks in host order: the tests name ranks by host.
        .args(["--node-rank", &(host - 1).to_string()])
        .args(flags)
        .arg("--")
        .args(program)
        .env("CHORUS_JOB_SECRET", "multihost-test");
    command
}

/// Starts one launcher per host (1..=hosts) and waits for all of them.
fn run_job(cluster: &Cluster, hosts: usize, nproc: usize, program: &[&str], secs: u64) -> Vec<Output> {
    let children: Vec<Child> = (1..=hosts)
        .map(|host| spawn_piped(&mut launcher(cluster, host, hosts, nproc, &[], program), "a launcher"))
        .collect();
    finish_all(children, secs)
}

fn hello() -> Vec<&'static str> {
    vec![chorus_bin(), "hello", "--worker", "env://", "--timeout", "20"]
}

/// Every launcher succeeded and printed, per rank, how it reached each peer.
fn assert_all_succeeded(outputs: &[Output]) -> String {
    let all: String = outputs.iter().map(joined).collect::<Vec<_>>().join("\n");
    for (host, output) in outputs.iter().enumerate() {
        assert!(
            output.status.success(),
            "the launcher on host {} failed:\n{all}",
            host + 1
        );
    }
    assert!(!all.contains("172.17."), "a rank used the decoy docker0:\n{all}");
    all
}

/// Lines `rank R pid P on HOST via ADDR: KIND said ...` of hello's output.
fn greetings(all: &str) -> Vec<&str> {
    all.lines().filter(|l| l.contains(" said ")).collect()
}

#[test]
#[ignore = "needs root for network namespaces; run: cargo test --release --test multihost -- --ignored netns_"]
fn netns_mh1_two_nodes_with_one_rank_each_form() {
    let _one = cluster::lock();
    let cluster = Cluster::up("mha", 2, &[]);
    let outputs = run_job(&cluster, 2, 1, &hello(), 90);
    let all = assert_all_succeeded(&outputs);
    let said = greetings(&all);
    assert_eq!(said.len(), 2, "each rank greets the other once:\n{all}");
    assert!(said.iter().all(|l| l.contains("quic said")), "{all}");
    assert!(all.contains("via 10.77.0.1") && all.contains("via 10.77.0.2"), "{all}");
}

#[test]
#[ignore = "needs root for network namespaces; run: cargo test --release --test multihost -- --ignored netns_"]
fn netns_mh2_three_hosts_of_two_ranks_pass_selftest_and_never_pick_the_decoy() {
    let _one = cluster::lock();
    let cluster = Cluster::up("mhb", 3, &[]);
    let outputs = run_job(
        &cluster,
        3,
        2,
        &[chorus_bin(), "selftest", "--timeout", "60", "--counts", "0,13,1000"],
        240,
    );
    let all = assert_all_succeeded(&outputs);
    assert!(all.contains("passed"), "{all}");
    let outputs = run_job(&cluster, 3, 2, &hello(), 90);
    let all = assert_all_succeeded(&outputs);
    let said = greetings(&all);
    assert_eq!(said.len(), 6 * 5, "{all}");
    // Ranks 2k and 2k+1 share a host: shared memory; the others over eth0.
    for line in said {
        let shm = line.contains("shm said");
        let quic_over_eth0 = line.contains("quic said") && line.contains("via 10.77.0.");
        assert!(shm || quic_over_eth0, "unexpected path: {line}\n{all}");
    }
}

#[test]
#[ignore = "needs root for network namespaces; run: cargo test --release --test multihost -- --ignored netns_"]
fn netns_mh3_containers_with_one_host_name_use_neither_loopback_nor_shm_between_them() {
    let _one = cluster::lock();
    let cluster = Cluster::up("mhc", 2, &["--same-hostname"]);
    let outputs = run_job(&cluster, 2, 2, &hello(), 90);
    let all = assert_all_succeeded(&outputs);
    let said = greetings(&all);
    assert_eq!(said.len(), 4 * 3, "{all}");
    // `[n]: [r]: rank p ...`: rank r greets rank p; same host when r/2 == p/2.
    for line in &said {
        let (me, peer) = ranks_of(line);
        if me / 2 == peer / 2 {
            assert!(
                line.contains("shm said"),
                "same container, shared memory expected: {line}\n{all}"
            );
        } else {
            assert!(
                line.contains("quic said") && line.contains("via 10.77.0."),
                "other container, QUIC over eth0 expected: {line}\n{all}"
            );
        }
    }
}

#[test]
#[ignore = "needs root for network namespaces; run: cargo test --release --test multihost -- --ignored netns_"]
fn netns_mh4_containers_sharing_a_network_but_not_dev_shm_talk_quic_over_loopback() {
    let _one = cluster::lock();
    let cluster = Cluster::up("mhd", 2, &["--share-net", "1:2"]);
    let outputs = run_job(&cluster, 2, 1, &hello(), 90);
    let all = assert_all_succeeded(&outputs);
    let said = greetings(&all);
    assert_eq!(said.len(), 2, "{all}");
    for line in said {
        assert!(
            line.contains("quic said") && line.contains("via 127.0.0.1"),
            "one network namespace, two /dev/shm: QUIC over loopback expected: {line}\n{all}"
        );
    }
}

#[test]
#[ignore = "needs root for network namespaces; run: cargo test --release --test multihost -- --ignored netns_"]
fn netns_mh5_a_failed_connect_names_the_address_and_the_interface() {
    let _one = cluster::lock();
    let cluster = Cluster::up("mhe", 2, &[]);
    // Host 2 publishes only its docker0 address: host 1 cannot reach it.
    let program = [chorus_bin(), "hello", "--worker", "env://", "--timeout", "4"];
    let first = spawn_piped(&mut launcher(&cluster, 1, 2, 1, &[], &program), "launcher 1");
    let second = spawn_piped(
        launcher(&cluster, 2, 2, 1, &[], &program).env("CHORUS_SOCKET_IFNAME", "=docker0"),
        "launcher 2",
    );
    let outputs = [
        finish(first, 60, "the launcher on host 1", LAUNCHER),
        finish(second, 60, "the launcher on host 2", LAUNCHER),
    ];
    let all: String = outputs.iter().map(joined).collect::<Vec<_>>().join("\n");
    assert!(outputs.iter().all(|o| !o.status.success()), "{all}");
    assert!(
        all.contains("could not connect to rank 1") && all.contains("172.17.0.1:"),
        "rank 0's error names the address it dialled:\n{all}"
    );
    assert!(all.contains(" on docker0"), "and the interface it left from:\n{all}");
}

/// (greeting rank, greeted rank) of a hello line `[n]: [r]:   rank p pid ...`,
/// or of `[r]:   rank p ...` when the launcher prints one prefix.
fn ranks_of(line: &str) -> (usize, usize) {
    let numbers: Vec<usize> = line
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    let peer = line
        .split("rank ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no peer rank in {line}"));
    (numbers[0], peer)
}

/// `chorus launch --restart-policy worker --nnodes 1:N` on `host`, running
/// `chorus elastic-probe` with `probe`'s flags and the launcher's bounds.
fn elastic_launcher(cluster: &Cluster, host: usize, nnodes: usize, nproc: usize, probe: &[&str]) -> Command {
    let mut command = cluster.command(host, chorus_bin());
    command
        .args(["launch", "--restart-policy", "worker", "--max-restarts", "2"])
        .args([
            "--nnodes",
            &format!("1:{nnodes}"),
            "--nproc-per-node",
            &nproc.to_string(),
        ])
        .args([
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            &format!("{}:29400", cluster.addr(1)),
        ])
        .args([
            "--rdzv-id",
            "mh",
            "--rdzv-conf",
            "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3",
        ])
        .arg("--")
        .args([
            "sh",
            "-c",
            r#"exec "$0" elastic-probe --min-world "$CHORUS_MIN_WORLD" --max-world "$CHORUS_MAX_WORLD" "$@""#,
            chorus_bin(),
        ])
        .args(probe)
        .env("CHORUS_JOB_SECRET", "multihost-test");
    command
}

/// The `[rank]: probe ... event=NAME ...` lines relayed by the launchers
/// (not the indented copies in a failure report's last lines).
fn probe_events<'a>(all: &'a str, event: &str) -> Vec<&'a str> {
    all.lines()
        .filter(|l| l.starts_with('[') && l.contains(&format!("event={event}")))
        .collect()
}

/// The value of `key=` in a probe line.
fn probe_field<'a>(line: &'a str, key: &str) -> &'a str {
    common::field(line.split_once("probe ").map_or(line, |(_, rest)| rest), key)
        .unwrap_or_else(|| panic!("no {key}= in {line}"))
}

#[test]
#[ignore = "needs root for network namespaces; run: cargo test --release --test multihost -- --ignored netns_"]
fn netns_mh6_an_elastic_job_that_loses_a_rank_stays_one_job() {
    let _one = cluster::lock();
    let cluster = Cluster::up("mhf", 2, &[]);
    let probe = ["--iterations", "150", "--kill-rank", "3", "--kill-after", "30"];
    let outputs = finish_all(start_elastic(&cluster, 2, 2, &probe, &[]), 150);
    let all = outputs.iter().map(joined).collect::<Vec<_>>().join("\n");
    assert!(outputs.iter().all(|o| o.status.success()), "{all}");
    assert_eq!(probe_events(&all, "killing-self").len(), 1, "{all}");
    // Every process that finished, on both hosts, finished in one generation
    // of one group: never two groups each re-running the steps.
    let done = probe_events(&all, "done");
    assert_eq!(
        done.len(),
        4,
        "the three survivors and the relaunched rank finish:\n{all}"
    );
    let last = (probe_field(done[0], "gen"), probe_field(done[0], "world"));
    for line in &done {
        assert_eq!(
            (probe_field(line, "gen"), probe_field(line, "world")),
            last,
            "the job split:\n{all}"
        );
    }
    assert_eq!(last.1, "4", "{all}");
}

#[test]
#[ignore = "needs root for network namespaces; run: cargo test --release --test multihost -- --ignored netns_"]
fn netns_mh7_a_killed_rank_on_another_host_is_detected_within_a_second() {
    let _one = cluster::lock();
    let cluster = Cluster::up("mhg", 2, &[]);
    // One rank per host: rank 0 has no neighbour of rank 1 that could tell
    // it; without the launcher's word it would wait out the 5 s window.
    let probe = ["--iterations", "120", "--kill-rank", "1", "--kill-after", "30"];
    let outputs = finish_all(start_elastic(&cluster, 2, 1, &probe, &[]), 120);
    let all = outputs.iter().map(joined).collect::<Vec<_>>().join("\n");
    assert!(outputs.iter().all(|o| o.status.success()), "{all}");
    let killed: u64 = probe_field(probe_events(&all, "killing-self")[0], "at_us")
        .parse()
        .unwrap();
    let noticed = probe_events(&all, "error")
        .iter()
        .filter(|l| probe_field(l, "rank") == "0")
        .map(|l| probe_field(l, "at_us").parse::<u64>().unwrap())
        .next()
        .unwrap_or_else(|| panic!("rank 0 never saw the failure:\n{all}"));
    let detection_ms = (noticed - killed) as f64 / 1e3;
    eprintln!("rank 0 noticed the SIGKILL of rank 1 on another host in {detection_ms:.0} ms");
    assert!(detection_ms < 1000.0, "took {detection_ms} ms:\n{all}");
}

#[test]
#[ignore = "needs root for network namespaces; run: cargo test --release --test multihost -- --ignored netns_"]
fn netns_mh8_a_cut_off_node_reports_at_once_and_gives_up_on_the_store_within_the_keep_alive_window() {
    let _one = cluster::lock();
    let cluster = Cluster::up("mhh", 2, &[]);
    let probe = [chorus_bin(), "elastic-probe", "--iterations", "100000"];
    let start = |host: usize| {
        let flags = ["--rdzv-conf", "keep_alive_interval=1,keep_alive_max_attempt=2"];
        let mut command = launcher(&cluster, host, 2, 1, &flags, &probe);
        command
            .env("CHORUS_HEARTBEAT_TIMEOUT", "2")
            .env("CHORUS_ASYNC_ERROR_HANDLING", "3");
        spawn_piped(&mut command, "a launcher")
    };
    let (first, second) = (start(1), start(2));
    std::thread::sleep(std::time::Duration::from_secs(4));
    cluster.cut(2);
    let cut = std::time::Instant::now();
    let second = finish(second, 40, "the cut-off launcher on host 2", LAUNCHER);
    let took = cut.elapsed();
    let first = finish(first, 60, "the launcher on host 1", LAUNCHER);
    let all = format!("host 1:\n{}\nhost 2:\n{}", joined(&first), joined(&second));
    assert!(!second.status.success(), "{all}");
    let text = joined(&second);
    assert!(
        text.contains("rank 1 (local rank 0 on node 1"),
        "it reports its worker's failure:\n{all}"
    );
    assert!(text.contains("could not reach the job's store"), "{all}");
    // Heartbeat window (2 s), keep-alive window (2 s), stopping: well under join_timeout (600 s).
    assert!(took < std::time::Duration::from_secs(20), "took {took:?}:\n{all}");
}

/// Starts an elastic launcher per host (1..=hosts, `nproc` ranks each)
/// running `probe`, returning them in host order.
fn start_elastic(cluster: &Cluster, hosts: usize, nproc: usize, probe: &[&str], env: &[(&str, &str)]) -> Vec<Child> {
    (1..=hosts)
        .map(|host| {
            let mut command = elastic_launcher(cluster, host, hosts, nproc, probe);
            command.envs(env.iter().copied());
            spawn_piped(&mut command, "an elastic launcher")
        })
        .collect()
}

/// Waits for `children` (launchers of hosts 1, 2, ...) and returns their outputs.
fn finish_all(children: Vec<Child>, secs: u64) -> Vec<Output> {
    children
        .into_iter()
        .enumerate()
        .map(|(i, child)| finish(child, secs, &format!("the launcher on host {}", i + 1), LAUNCHER))
        .collect()
}

#[test]
#[ignore = "needs root for network namespaces; run: cargo test --release --test multihost -- --ignored netns_"]
fn netns_mh9_a_partitioned_host_is_left_behind_and_the_majority_goes_on() {
    let _one = cluster::lock();
    let cluster = Cluster::up("mhi", 3, &[]);
    let env = [("CHORUS_HEARTBEAT_TIMEOUT", "2")];
    let mut children = start_elastic(&cluster, 3, 1, &["--iterations", "1500"], &env);
    std::thread::sleep(std::time::Duration::from_secs(3));
    cluster.cut(3);
    let cut_off = children.pop().unwrap();
    let outputs = finish_all(children, 120);
    let all = outputs.iter().map(joined).collect::<Vec<_>>().join("\n");
    let cut_off = finish(cut_off, 60, "the cut-off launcher on host 3", LAUNCHER);
    let all = format!("{all}\nhost 3:\n{}", joined(&cut_off));
    assert!(outputs.iter().all(|o| o.status.success()), "{all}");
    assert!(
        !cut_off.status.success(),
        "the cut-off host cannot finish alone:\n{all}"
    );
    let done = probe_events(&all, "done");
    assert_eq!(done.len(), 2, "{all}");
    assert!(done.iter().all(|l| probe_field(l, "world") == "2"), "{all}");
}

#[test]
#[ignore = "needs root for network namespaces; run: cargo test --release --test multihost -- --ignored netns_"]
fn netns_mh10_a_killed_node_leaves_a_group_that_goes_on_under_either_restart_policy() {
    let _one = cluster::lock();
    let cluster = Cluster::up("mhj", 3, &[]);
    // --restart-policy worker: the survivors' group re-forms without the node.
    let mut children = start_elastic(&cluster, 3, 1, &["--iterations", "2500"], &[]);
    std::thread::sleep(std::time::Duration::from_secs(3));
    let mut killed = children.pop().unwrap();
    killed.kill().unwrap();
    killed.wait().unwrap();
    let outputs = finish_all(children, 120);
    let all = outputs.iter().map(joined).collect::<Vec<_>>().join("\n");
    assert!(outputs.iter().all(|o| o.status.success()), "worker policy:\n{all}");
    let done = probe_events(&all, "done");
    assert!(
        done.len() == 2 && done.iter().all(|l| probe_field(l, "world") == "2"),
        "worker policy:\n{all}"
    );
    // --restart-policy all: the launchers restart every worker without it.
    let start = |host: usize| {
        let flags = [
            "--max-restarts",
            "2",
            "--rdzv-conf",
            "keep_alive_interval=1,keep_alive_max_attempt=2",
        ];
        let mut command = cluster.command(host, chorus_bin());
        command
            .args([
                "launch",
                "--nnodes",
                "2:3",
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
            ])
            .args([
                "--rdzv-endpoint",
                &format!("{}:29401", cluster.addr(1)),
                "--rdzv-id",
                "mh10",
            ])
            .args(flags)
            .args(["--", chorus_bin(), "elastic-probe", "--iterations", "2500"])
            .env("CHORUS_JOB_SECRET", "multihost-test");
        spawn_piped(&mut command, "a launcher")
    };
    let mut children: Vec<Child> = (1..=3).map(start).collect();
    std::thread::sleep(std::time::Duration::from_secs(3));
    let mut killed = children.pop().unwrap();
    killed.kill().unwrap();
    killed.wait().unwrap();
    let outputs = finish_all(children, 120);
    let all = outputs.iter().map(joined).collect::<Vec<_>>().join("\n");
    assert!(outputs.iter().all(|o| o.status.success()), "all policy:\n{all}");
    let done = probe_events(&all, "done");
    assert!(
        done.len() == 2 && done.iter().all(|l| probe_field(l, "world") == "2"),
        "all policy:\n{all}"
    );
}

#[test]
#[ignore = "needs root for network namespaces; run: cargo test --release --test multihost -- --ignored netns_"]
fn netns_mh11_a_job_across_a_link_with_20_ms_and_1_percent_loss_forms_and_sums_right() {
    let _one = cluster::lock();
    let cluster = Cluster::up("mhk", 2, &[]);
    let impaired = std::process::Command::new("bash")
        .args([
            concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/sim-cluster.sh"),
            "impair",
        ])
        .args([cluster.prefix(), "2", "--delay-ms", "20", "--loss", "1%", "--seed", "3"])
        .env("CHORUS", chorus_bin())
        .status()
        .unwrap();
    assert!(impaired.success(), "could not impair host 2's link");
    let outputs = run_job(&cluster, 2, 1, &hello(), 120);
    let all = assert_all_succeeded(&outputs);
    assert_eq!(greetings(&all).len(), 2, "{all}");
    assert!(
        all.matches("correct").count() == 2,
        "both ranks checked the 16 MiB all-reduce:\n{all}"
    );
}
