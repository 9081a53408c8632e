//! Elastic restarts (rules SV-9..SV-13 in `chorus::elastic`), in process
//! and with real processes (`chorus elastic-probe` ranks meeting on a
//! `chorus store serve` store that outlives every rank).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chorus::store::{HashStore, Store};
use chorus::{Admission, ElasticGroup, InitOptions, ReduceOp, Tensor};

mod common;
use common::{Ranks, Stop, chorus_bin, elastic_options as options, free_port, within};

async fn init(options: InitOptions) -> ElasticGroup {
    ElasticGroup::init_with(options, |e| eprintln!("gave up: {e}"))
        .await
        .unwrap()
}

/// All-reduces ones `iterations` times through restarts, checking each sum
/// against the world size of the generation it ran on.
async fn train(group: &ElasticGroup, iterations: u64) {
    let mut done = 0;
    while done < iterations {
        let pg = group.current();
        match pg.all_reduce(Tensor::from_slice(&[1.0f32; 64]), ReduceOp::Sum).await {
            Ok(sum) => {
                assert!(
                    sum.to_vec::<f32>()
                        .unwrap()
                        .iter()
                        .all(|&v| v == pg.world_size() as f32),
                    "wrong sum"
                );
                done += 1;
            }
            Err(_) => {
                let next = group.next_generation(pg.generation()).await.unwrap();
                let step = next
                    .all_reduce(Tensor::from_slice(&[done as f64]), ReduceOp::Min)
                    .await
                    .unwrap();
                done = step.to_vec::<f64>().unwrap()[0] as u64;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sv9_sv10_survivors_restart_in_process_and_keep_their_order() {
    let store: Arc<dyn Store> = Arc::new(HashStore::default());
    let mut ranks = Vec::new();
    for rank in 0..4 {
        let options = options(&store, rank, 4).elastic_world(3, 4);
        ranks.push(tokio::spawn(async move {
            let group = init(options).await;
            let mut events = group.events();
            if rank == 2 {
                train(&group, 5).await;
                // Rank 2 dies: its supervisor stops, its links are lost (a
                // cut, not a close: a close on purpose is not a failure, SV-14).
                let links: Vec<_> = (0..4).filter_map(|r| group.current().link(r).cloned()).collect();
                drop(group);
                for link in links {
                    link.cut("rank 2 died");
                }
                return None;
            }
            train(&group, 40).await;
            let change = events.try_recv().expect("a membership event");
            let result = (change, group.rank(), group.world_size(), group.generation());
            group.destroy().await.unwrap();
            Some(result)
        }));
    }
    let mut seen = Vec::new();
    for task in ranks {
        if let Some(result) = within(30, "the elastic group", task).await.unwrap() {
            seen.push(result);
        }
    }
    let new_ranks: Vec<(Option<usize>, usize)> = seen.iter().map(|(c, ..)| (c.old_rank, c.new_rank)).collect();
    assert_eq!(new_ranks, vec![(Some(0), 0), (Some(1), 1), (Some(3), 2)]);
    for (change, rank, world, generation) in &seen {
        assert_eq!((change.generation, change.world_size), (1, 3));
        assert_eq!((*rank, *world, *generation), (change.new_rank, 3, 1));
    }
}

/// Survivors fewer than the minimum world re-form with the joiner that
/// comes: under `Admission::AtStepBoundary` a joiner waits for the
/// generation after the survivors' only when they can form theirs without
/// it (under `chorus chaos`, two of three members lost in a row, the lone
/// survivor and the joiners each waited for the other until the formation
/// timeout). This in-process run does not reach that timing: it passes
/// without the rule too, and checks that the joiner completes the group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_completes_survivors_below_the_minimum_world() {
    let store: Arc<dyn Store> = Arc::new(HashStore::default());
    let options = |rank| {
        options(&store, rank, 2)
            .elastic_world(2, 3)
            .admission(Admission::AtStepBoundary {
                longest: Duration::from_secs(60),
            })
    };
    let survivor = tokio::spawn({
        let options = options(0);
        async move {
            let group = init(options).await;
            train(&group, 40).await;
            let held = (group.generation(), group.world_size());
            group.destroy().await.unwrap();
            held
        }
    });
    let dying = within(10, "rank 1's group", init(options(1))).await;
    train(&dying, 5).await;
    let links: Vec<_> = (0..2).filter_map(|r| dying.current().link(r).cloned()).collect();
    drop(dying);
    for link in links {
        link.cut("rank 1 died");
    }
    // The survivor is re-forming generation 1 alone by now (below 2): it
    // found the loss within its heartbeat window (1 s).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let joiner = within(10, "the joiner", init(options(1))).await;
    assert_eq!(
        joiner.generation(),
        1,
        "the joiner took the survivor's generation, not the one after"
    );
    // As the survivor does on re-forming: agree on the iterations done
    // (the joiner has none of its own), then go on to the end with it.
    let agreed = joiner
        .current()
        .all_reduce(Tensor::from_slice(&[f64::MAX]), ReduceOp::Min)
        .await
        .unwrap();
    let done = agreed.to_vec::<f64>().unwrap()[0] as u64;
    assert!((5..40).contains(&done), "the survivor's iterations: {done}");
    for _ in done..40 {
        let sum = joiner
            .current()
            .all_reduce(Tensor::from_slice(&[1.0f32; 64]), ReduceOp::Sum)
            .await
            .unwrap();
        assert_eq!(sum.to_vec::<f32>().unwrap()[0], 2.0);
    }
    joiner.destroy().await.unwrap();
    let (generation, world) = within(10, "the survivor", survivor).await.unwrap();
    assert_eq!((generation, world), (1, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sv12_a_generation_that_cannot_form_is_retried_in_the_next() {
    use chorus::rendezvous::elastic::{ElasticConfig, Joiner, join};
    let store: Arc<dyn Store> = Arc::new(HashStore::default());
    let forming: Vec<_> = (0..3)
        .map(|rank| {
            tokio::spawn(init(
                options(&store, rank, 3)
                    .elastic_world(2, 3)
                    .timeout(Duration::from_secs(3)),
            ))
        })
        .collect();
    let mut groups = Vec::new();
    for task in forming {
        groups.push(within(20, "generation 0", task).await.unwrap());
    }
    // A member of generation 1 that will never form it: admitted, then gone
    // (a process that joined and died before publishing its record).
    let ghost = Joiner {
        old_rank: None,
        previous_generation: None,
        hostname: "ghost".into(),
        pid: 1,
        nonce: u64::MAX,
        previous_world: None,
        failed: Vec::new(),
    };
    let config = ElasticConfig {
        run_id: groups[0].current().run_id().to_string(),
        generation: 1,
        min_world: 2,
        max_world: 3,
        last_call: Duration::from_millis(200),
        timeout: Duration::from_secs(20),
        poll: Duration::from_millis(10),
    };
    let arrivals = format!("chorus/{}/g1/elastic/count", config.run_id);
    let ghost = tokio::spawn({
        let store = store.clone();
        async move { join(store, &config, ghost).await }
    });
    // The ghost arrives first: on a loaded machine its task may start only
    // after the survivors, seeing rank 2's death, closed generation 1.
    within(20, "the ghost's arrival", async {
        while store.add(&arrivals, 0).await.unwrap() < 1 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    // Rank 2 dies: its links are lost.
    let dead = groups.pop().unwrap();
    let links: Vec<_> = (0..3).filter_map(|r| dead.current().link(r).cloned()).collect();
    drop(dead);
    for link in links {
        link.cut("rank 2 died");
    }
    let admitted = within(20, "generation 1's rendezvous", ghost).await.unwrap().unwrap();
    assert_eq!(admitted.world_size(), 3, "the ghost was admitted to generation 1");
    let survivors: Vec<_> = groups
        .into_iter()
        .map(|group| {
            tokio::spawn(async move {
                let next = group.next_generation(1).await.unwrap();
                let sum = next
                    .all_reduce(Tensor::from_slice(&[1.0f32; 8]), ReduceOp::Sum)
                    .await
                    .unwrap();
                let result = (next.generation(), next.world_size(), sum.to_vec::<f32>().unwrap()[0]);
                drop(next);
                group.destroy().await.unwrap();
                result
            })
        })
        .collect();
    for task in survivors {
        let (generation, world, sum) = within(30, "generation 2", task).await.unwrap();
        assert_eq!(
            (generation, world, sum),
            (2, 2, 2.0),
            "generation 1 could not form; 2 did"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sv13_a_process_waiting_to_join_is_admitted_into_the_next_generation() {
    let store: Arc<dyn Store> = Arc::new(HashStore::default());
    // Generation 1 closes at once when all four are in (max_world); the
    // long last call only keeps a survivor slowed by a loaded machine from
    // being left for generation 2 (200 ms was missed under CI's load).
    let options = |store, rank| {
        options(store, rank, 3)
            .elastic_world(3, 4)
            .last_call(Duration::from_secs(2))
    };
    let forming: Vec<_> = (0..3).map(|rank| tokio::spawn(init(options(&store, rank)))).collect();
    let mut groups = Vec::new();
    for task in forming {
        groups.push(within(20, "generation 0", task).await.unwrap());
    }
    assert!(groups.iter().all(|g| (g.generation(), g.world_size()) == (0, 3)));
    // A new process finds the job running and joins generation 1 as rank 3.
    let joiner = within(20, "the joiner", init(options(&store, 0))).await;
    assert_eq!((joiner.generation(), joiner.rank(), joiner.world_size()), (1, 3, 4));
    groups.push(joiner);
    let running: Vec<_> = groups
        .into_iter()
        .map(|group| {
            tokio::spawn(async move {
                let next = group.next_generation(0).await.unwrap();
                let sum = next
                    .all_reduce(Tensor::from_slice(&[1.0f32; 8]), ReduceOp::Sum)
                    .await
                    .unwrap();
                let result = (group.rank(), group.generation(), sum.to_vec::<f32>().unwrap()[0]);
                drop(next);
                group.destroy().await.unwrap();
                result
            })
        })
        .collect();
    let mut results = Vec::new();
    for task in running {
        results.push(within(20, "generation 1", task).await.unwrap());
    }
    assert_eq!(results, vec![(0, 1, 4.0), (1, 1, 4.0), (2, 1, 4.0), (3, 1, 4.0)]);
}

/// A store server and elastic-probe ranks, with their output. Dropping it
/// kills the ranks, then the store.
struct Job {
    ranks: Ranks,
    store: Child,
    url: String,
}

impl Job {
    fn start() -> Self {
        let port = free_port();
        let mut store = Command::new(chorus_bin())
            .args(["store", "serve", "--host", "127.0.0.1", "--port", &port.to_string()])
            .stdout(Stdio::piped())
            .spawn()
            .expect("start chorus store serve");
        let mut first = String::new();
        BufReader::new(store.stdout.take().unwrap())
            .read_line(&mut first)
            .unwrap();
        assert!(first.contains("serving"), "{first}");
        Self {
            ranks: Ranks::new(),
            store,
            url: format!("tcp://127.0.0.1:{port}"),
        }
    }

    fn rank(&mut self, rank: usize, world: usize, args: &[&str], env: &[(&str, &str)]) {
        let mut command = Command::new(chorus_bin());
        command
            .args(["elastic-probe", "--init", &self.url])
            .args(args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("TORCHELASTIC_USE_AGENT_STORE", "True")
            .env("CHORUS_HEARTBEAT_TIMEOUT", "2");
        for (k, v) in env {
            command.env(k, v);
        }
        let started = self.ranks.spawn(&mut command, "chorus elastic-probe");
        assert_eq!(started, rank, "ranks start in order");
    }

    /// Reads output until a line from each of `ranks` contains `needle`.
    fn until(&mut self, ranks: &[usize], needle: &str, deadline: Instant) {
        let has = |log: &[String], r: usize| {
            log.iter()
                .any(|l| l.starts_with(&format!("[{r}] ")) && l.contains(needle))
        };
        self.ranks
            .until(&format!("{needle:?} from ranks {ranks:?}"), deadline, |log| {
                ranks.iter().all(|&r| has(log, r))
            });
    }

    fn kill(&mut self, rank: usize) {
        self.ranks.kill(rank);
    }

    fn wait(&mut self, rank: usize, deadline: Instant) -> std::process::ExitStatus {
        self.ranks.wait(rank, deadline)
    }

    fn output(&self) -> String {
        self.ranks.output()
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        self.ranks.kill_all();
        let _ = self.store.kill();
        let _ = self.store.wait();
    }
}

#[test]
fn sv9_sigkill_mid_loop_survivors_form_generation_1_of_3_and_finish() {
    let mut job = Job::start();
    for rank in 0..4 {
        job.rank(
            rank,
            4,
            &["--iterations", "300", "--min-world", "3", "--max-world", "4"],
            &[],
        );
    }
    let deadline = Instant::now() + Duration::from_secs(40);
    job.until(&[0, 1, 2, 3], "event=running", deadline);
    job.kill(2);
    job.until(&[0, 1, 3], "event=done", deadline);
    for rank in [0, 1, 3] {
        assert!(
            job.wait(rank, deadline).success(),
            "rank {rank} failed:\n{}",
            job.output()
        );
    }
    let log = job.output();
    for (old, new) in [(0, 0), (1, 1), (3, 2)] {
        assert!(
            log.contains(&format!("[{old}] probe rank={new} gen=1 world=3 event=restarted")),
            "{log}"
        );
        assert!(
            log.contains(&format!(
                "[{old}] probe rank={new} gen=1 world=3 event=done iterations=300"
            )),
            "{log}"
        );
    }
}

#[test]
fn a_process_started_to_join_waits_for_the_first_generation_then_joins_the_next() {
    let mut job = Job::start();
    let probe = |rank: usize, extra: &[(&str, &str)]| {
        let mut command = Command::new(chorus_bin());
        command
            .args(["elastic-probe", "--init", &job.url, "--iterations", "200"])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", "3")
            .env("TORCHELASTIC_USE_AGENT_STORE", "True")
            .env("CHORUS_HEARTBEAT_TIMEOUT", "2")
            // The bounds come from the environment, as `chorus launch --restart-policy worker` sets them.
            .env("CHORUS_MIN_WORLD", "3")
            .env("CHORUS_MAX_WORLD", "4");
        for (k, v) in extra {
            command.env(k, v);
        }
        command
    };
    // Started before the group exists (a worker relaunched early, a node
    // that came first): told to join, it waits instead of forming
    // generation 0 with a rank it does not own.
    let joiner = job
        .ranks
        .spawn(&mut probe(0, &[("CHORUS_ELASTIC_JOIN", "1")]), "the joiner");
    assert_eq!(joiner, 0);
    for rank in 0..3 {
        assert_eq!(job.ranks.spawn(&mut probe(rank, &[]), "chorus elastic-probe"), rank + 1);
    }
    let deadline = Instant::now() + Duration::from_secs(40);
    job.until(&[0, 1, 2, 3], "event=done", deadline);
    let log = job.output();
    assert!(log.contains("[0] probe rank=3 gen=1 world=4 event=joined"), "{log}");
    for (index, rank) in [(1, 0), (2, 1), (3, 2)] {
        assert!(
            log.contains(&format!("[{index}] probe rank={rank} gen=0 world=3 pid=")),
            "generation 0 formed without the joiner:\n{log}"
        );
        assert!(
            log.contains(&format!(
                "[{index}] probe rank={rank} gen=1 world=4 event=done iterations=200"
            )),
            "{log}"
        );
    }
    assert!(
        log.contains("[0] probe rank=3 gen=1 world=4 event=done iterations=200"),
        "{log}"
    );
}

/// Issue 7 asks for 20 trials; CI runs 3. Run the 20 with
/// `CHORUS_SUPERVISION_TRIALS=20 cargo test --release --test elastic random_rank`.
const SIGKILL_TRIALS: usize = 3;

#[test]
fn sv9_sigkill_of_a_random_rank_survivors_re_form_every_trial() {
    let trials: usize = std::env::var("CHORUS_SUPERVISION_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(SIGKILL_TRIALS);
    // `chorus bench recovery` runs the trials: a store that outlives the
    // ranks, 4 elastic-probe ranks, a random one SIGKILLed mid-loop; a trial
    // counts only if every survivor formed generation 1 of 3 ranks and
    // finished its loop with correct sums.
    let mut command = Command::new(chorus_bin());
    command
        .args(["bench", "recovery", "--json", "--heartbeat-timeout", "2"])
        .args(["--trials", &trials.to_string()]);
    let output = common::run(
        &mut command,
        30 + 30 * trials as u64,
        &format!("{trials} recovery trials"),
        Stop::Kill,
    );
    let (stdout, stderr) = (
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    assert!(output.status.success(), "a trial failed:\n{stdout}\n{stderr}");
    let rows: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}")))
        .collect();
    let summary = rows.last().expect("a summary line");
    assert_eq!(summary["recovered"], trials, "{stdout}\n{stderr}");
    for row in &rows[..rows.len() - 1] {
        // Every survivor errors within the heartbeat window (2 s) + 1 s.
        let detect = row["detect_ms"].as_f64().unwrap();
        assert!(
            detect <= 3000.0,
            "a survivor saw the failure {detect} ms after the kill: {row}"
        );
    }
}

#[test]
fn sv12_the_restart_budget_is_enforced_in_processes() {
    let mut job = Job::start();
    for rank in 0..4 {
        job.rank(
            rank,
            4,
            &["--iterations", "1000000", "--min-world", "2", "--max-world", "4"],
            &[("CHORUS_MAX_RESTARTS", "1")],
        );
    }
    let deadline = Instant::now() + Duration::from_secs(40);
    job.until(&[0, 1, 2, 3], "event=running", deadline);
    job.kill(3);
    job.until(&[0, 1, 2], "event=restarted", deadline);
    job.kill(2);
    for rank in [0, 1] {
        assert!(
            !job.wait(rank, deadline).success(),
            "rank {rank} went on past the budget:\n{}",
            job.output()
        );
    }
    job.until(&[0, 1], "restart budget spent", deadline);
    let log = job.output();
    let message = log
        .lines()
        .find(|l| l.starts_with("[0] ") && l.contains("restart budget spent"))
        .unwrap();
    assert!(
        message.contains("generation 0") && message.contains("generation 1"),
        "{message}"
    );
}
