//! The launchers of one job meeting on the job's store (a launcher's TCP
//! store, or etcd with `--rdzv-backend etcd`): who serves it, the
//! rounds in which they form a node group (node ranks, node count, an
//! agreed `--nproc-per-node`), the job secret, and how a round ends: a
//! failure anywhere, or a launcher waiting to join, moves every node to the
//! next round, whose group may have other nodes (nodes leave and join
//! between rounds, within `--nnodes MIN:MAX`).
//!
//! # Key layout
//! Under `chorus/launch/<run id>/`:
//! - `attempt`: the current round; advanced from n to n+1 by compare-set,
//!   so several nodes ending a round at once advance it once.
//! - `secret`: the job secret, only when the store's host had to generate one.
//! - `a<n>/joiners`: appended, one line per event in arrival order:
//!   `+ <launcher id> <nproc> <node rank or ->` when a launcher joins round n,
//!   `- <launcher id>` when it gives up waiting. A launcher that finds round
//!   n closed without it joins round n+1: being in `a<n+1>/joiners` while
//!   round n runs is how a newcomer says it waits.
//! - `a<n>/claim/<rank>`: the launcher that claimed an explicit `--node-rank`.
//! - `a<n>/closed`: round n's group, written once by compare-set by
//!   whichever launcher closes it first (everyone reads the same one):
//!   `restarts <k>` then `<launcher id> <nproc>` per node in node rank
//!   order; or `ended <why>` when the job ended before round n formed, so
//!   launchers waiting for it stop.
//! - `a<n>/end`: why round n ended, first writer wins: `failure <what>`
//!   (counts against `--max-restarts`) or `membership <what>` (does not).
//! - `a<n>/done`: how many nodes' workers all succeeded in round n.
//! - `alive/<launcher id>`: a counter each launcher bumps every monitor
//!   interval while its round runs; a member whose counter stands still for
//!   the keep-alive timeout is taken for hung, and its round ends.
//!
//! # Rounds
//! 1. A launcher joins the current round (appends itself) unless it is
//!    closed; a closed round without it sends it on to the next one.
//! 2. Round n may close only once it is the current round (`attempt` >= n),
//!    so launchers waiting for round n+1 never form a group beside round n's.
//! 3. Any member closes it (`membership::closes_with`, the rule the elastic
//!    rendezvous of ranks uses too): at once with max nodes;
//!    with min or more once every node of round n-1 is back or after the
//!    last call; node ranks are dense ([`plan::members`]).
//! 4. A running launcher advances the round when one of its workers fails,
//!    when another member's keep-alive stands still ([`plan::KeepAlives`]),
//!    or when a launcher waits in the next round and the group has room and
//!    no node has finished ([`plan::admit_waiting`]).
//! 5. `restarts` of round n+1 is round n's, plus one when round n ended by
//!    a failure: `TORCHELASTIC_RESTART_COUNT`, the same on every node.
//!
//! # Rounds under `--restart-policy worker`
//! The workers are elastic (`ElasticGroup`): they re-form by themselves
//! when a worker or a whole node is lost, and take in processes that start
//! while they run (SV-13). Restarting every node's workers would throw that
//! away, so under this policy a round only records who the nodes are, and
//! moving to the next round restarts nobody:
//! 6. Rounds 0.. form as above until the first one forms; from then on the
//!    running launchers never meet again. A failed worker is relaunched by
//!    its own launcher alone, counted against that node's `--max-restarts`
//!    (each node counts its own, as torchrun's agents do), and the round
//!    stays.
//! 7. A running launcher that sees a member's keep-alive stand still (the
//!    node left: its launcher was killed and its workers with it), or a
//!    launcher waiting in round n+1 while the group has room and no node has
//!    finished, closes round n+1 itself ([`reform`]): round n's members less
//!    the ones taken for gone, then the waiting launchers, up to max, with
//!    dense node ranks ([`plan::members`]); then it advances `attempt`
//!    (`end` is a membership change). `closed` is written before `attempt`
//!    moves, so whoever sees the new round can read its group.
//! 8. Every running launcher follows the round ([`adopt`]) and keeps its
//!    workers: only the node rank and node count for later relaunches
//!    change. The waiting launchers find themselves in `a<n+1>/closed` and
//!    start their workers, which join the running job's next generation. A
//!    launcher that finds itself left out (taken for gone while it was only
//!    slow) stops its workers and waits to join again, as a newcomer.
//! 9. The job is over when every member of the current round is in
//!    `finished` (a node is added once all its workers succeeded; a set,
//!    not a per-round count, since rounds move while nodes wait), or as
//!    soon as `over` is set: a node whose worker failed past its
//!    `--max-restarts` ends the job for every node, as under `all`.
//! 10. Every launcher of a job runs the same policy: `policy` holds the
//!    first one's, and a launcher with the other one is refused.
//!
//! Keys of this policy, under the same prefix: `policy`, `finished` (one
//! launcher id per line), `over` (why the job ended for good).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chorus_runtime::rendezvous::membership;
use chorus_runtime::store::{
    EtcdStore, EtcdStoreOptions, Store, StoreError, TcpStore, TcpStoreOptions, TcpStoreServer, TcpStoreServerOptions,
    parse_endpoints,
};
use chorus_runtime::wait;

use super::LaunchError;
use super::config::{StorePlan, StoreRole};
use super::plan;
use super::records::{self, Closed, Member, RoundEnd, parse_joiners};

/// The job's store as this launcher sees it.
#[derive(Debug)]
pub struct JobStore {
    /// A client of the store (also when this launcher serves it).
    pub store: Arc<dyn Store>,
    /// The server, when this launcher hosts it.
    pub server: Option<TcpStoreServer>,
    /// `MASTER_ADDR` for the workers.
    pub host: String,
    /// `MASTER_PORT` for the workers.
    pub port: u16,
    /// The store's URL when it is not served by a launcher (`etcd://...`),
    /// given to the workers as `CHORUS_STORE`.
    pub url: Option<String>,
}

impl JobStore {
    /// Where the store is, for messages.
    pub fn addr(&self) -> String {
        self.url
            .clone()
            .unwrap_or_else(|| format!("{}:{}", self.host, self.port))
    }

    /// Whether no launcher serves the store (it is in etcd), so any
    /// launcher may publish the job secret, the first one winning.
    pub fn replicated(&self) -> bool {
        self.url.is_some()
    }
}

/// Connects to the job's store in etcd.
async fn open_etcd(plan: &StorePlan, url: &str, timeout: Duration) -> Result<JobStore, LaunchError> {
    let (endpoints, prefix) = parse_endpoints(url.trim_start_matches("etcd://")).map_err(|message| {
        LaunchError::Store(StoreError::Refused {
            location: url.to_string(),
            message,
        })
    })?;
    let options = EtcdStoreOptions {
        timeout,
        connect_timeout: timeout,
        prefix,
    };
    let store = EtcdStore::connect(endpoints, options).await?;
    Ok(JobStore {
        store: Arc::new(store),
        server: None,
        host: plan.host.clone(),
        port: plan.port,
        url: Some(url.to_string()),
    })
}

/// The address to bind for serving `host`, or `None` when `host` is not an
/// address of this machine: loopback as is; another local address as the
/// unspecified address, as PyTorch does, so every interface reaches it.
async fn local_bind_ip(host: &str) -> Result<Option<IpAddr>, LaunchError> {
    let ip = tokio::net::lookup_host((host, 0))
        .await
        .ok()
        .and_then(|mut addrs| addrs.next())
        .map(|a| a.ip())
        .ok_or_else(|| LaunchError::Unresolvable(host.to_string()))?;
    if ip.is_loopback() {
        return Ok(Some(ip));
    }
    // Binding fails with "address not available" for another machine's address.
    if std::net::TcpListener::bind((ip, 0)).is_err() {
        return Ok(None);
    }
    Ok(Some(if ip.is_ipv4() {
        IpAddr::from([0u8; 4])
    } else {
        IpAddr::from([0u16; 8])
    }))
}

/// Serves or connects to the store as `plan` says.
pub async fn open(plan: &StorePlan, timeout: Duration) -> Result<JobStore, LaunchError> {
    if let Some(url) = &plan.etcd {
        return open_etcd(plan, url, timeout).await;
    }
    let mut server = None;
    if plan.role != StoreRole::Client {
        match local_bind_ip(&plan.host).await? {
            Some(ip) => {
                match TcpStoreServer::bind(SocketAddr::new(ip, plan.port), TcpStoreServerOptions::default()).await {
                    Ok(bound) => server = Some(bound),
                    Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && plan.role == StoreRole::FirstToBind => {
                        tracing::info!(host = %plan.host, port = plan.port, "another launcher serves the store");
                    }
                    Err(source) => {
                        return Err(LaunchError::Bind {
                            addr: format!("{}:{}", plan.host, plan.port),
                            source,
                        });
                    }
                }
            }
            None if plan.role == StoreRole::Host => return Err(LaunchError::NotLocal(plan.host.clone())),
            None => {}
        }
    }
    let port = server.as_ref().map_or(plan.port, |s| s.local_addr().port());
    let host = if plan.host.contains(':') {
        format!("[{}]", plan.host)
    } else {
        plan.host.clone()
    };
    let options = TcpStoreOptions {
        timeout,
        connect_timeout: timeout,
        ..TcpStoreOptions::default()
    };
    let store = TcpStore::connect(format!("{host}:{port}"), options).await?;
    Ok(JobStore {
        store: Arc::new(store),
        server,
        host: plan.host.clone(),
        port,
        url: None,
    })
}

/// This node's place in one round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Formed {
    /// The round (`attempt_<round>` directories).
    pub round: u64,
    /// This node's rank.
    pub node_rank: usize,
    /// Nodes in the round.
    pub nnodes: usize,
    /// Restarts after failures before this round (what `--max-restarts` counts).
    pub restarts: u64,
    /// The launchers of the round, in node rank order.
    pub members: Vec<String>,
}

/// What a launcher brings to a round's rendezvous.
#[derive(Debug, Clone)]
pub struct Joining<'a> {
    /// `--node-rank` (static `--nnodes N` only).
    pub node_rank: Option<usize>,
    /// `--nproc-per-node`.
    pub nproc_per_node: usize,
    /// `--nnodes` bounds.
    pub min_nodes: usize,
    /// Upper bound.
    pub max_nodes: usize,
    /// How long to wait for the group.
    pub join_timeout: Duration,
    /// How long to wait for more nodes once `min_nodes` are in.
    pub last_call_timeout: Duration,
    /// How often to look.
    pub poll: Duration,
    /// Names this launcher in messages (`host:pid`).
    pub launcher_id: &'a str,
}

/// The job's keys in the store.
#[derive(Debug, Clone)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    /// The keys of run `run_id`.
    pub fn new(run_id: &str) -> Self {
        Self {
            prefix: format!("chorus/launch/{run_id}"),
        }
    }

    fn key(&self, suffix: &str) -> String {
        format!("{}/{suffix}", self.prefix)
    }

    /// Where this launcher writes the promotion of its standby worker
    /// `serial` (each standby it starts gets the next serial).
    pub fn standby(&self, launcher_id: &str, serial: u64) -> String {
        self.key(&format!("standby/{launcher_id}/{serial}"))
    }

    fn round_key(&self, round: u64, suffix: &str) -> String {
        format!("{}/a{round}/{suffix}", self.prefix)
    }
}

fn joiner_line(me: &Joining<'_>) -> String {
    records::joiner_line(&plan::Arrival {
        id: me.launcher_id.to_string(),
        nproc: me.nproc_per_node,
        node_rank: me.node_rank,
    })
}

/// The value of `key`, or `None` when it is not set (keys here are never deleted).
async fn try_get(store: &dyn Store, key: &str) -> Result<Option<String>, StoreError> {
    if !store.check(&[key]).await? {
        return Ok(None);
    }
    Ok(Some(String::from_utf8_lossy(&store.get(key).await?).into_owned()))
}

async fn closed(store: &dyn Store, keys: &Keys, round: u64) -> Result<Option<Closed>, StoreError> {
    Ok(try_get(store, &keys.round_key(round, "closed"))
        .await?
        .map(|t| Closed::parse(&t)))
}

/// The members of `round` in node rank order (empty when it did not form).
async fn member_ids(store: &dyn Store, keys: &Keys, round: u64) -> Result<Vec<String>, StoreError> {
    Ok(match closed(store, keys, round).await? {
        Some(Closed::Formed { members, .. }) => members.into_iter().map(|m| m.id).collect(),
        _ => Vec::new(),
    })
}

/// Restarts before round `round`: round n-1's, plus one if it ended by a failure.
async fn restarts_before(store: &dyn Store, keys: &Keys, round: u64) -> Result<u64, StoreError> {
    let Some(last) = round.checked_sub(1) else {
        return Ok(0);
    };
    let restarts = match closed(store, keys, last).await? {
        Some(Closed::Formed { restarts, .. }) => restarts,
        _ => 0,
    };
    let failed = matches!(round_end(store, keys, last).await?, Some(RoundEnd::Failure(_)));
    Ok(restarts + u64::from(failed))
}

/// Joins the group of round `*round` or, when that one closes without this
/// launcher, of the rounds after it (updating `*round`): waits until one
/// forms with this launcher in it, closing it when the rule says so, and
/// checks every node runs as many workers as this one.
pub async fn join(store: &dyn Store, keys: &Keys, round: &mut u64, me: &Joining<'_>) -> Result<Formed, LaunchError> {
    let mut joiner = Joiner {
        store,
        keys,
        me,
        start: Instant::now(),
        notes: wait::Notes::new(me.join_timeout),
        entered: None,
        previous: Vec::new(),
        open_with_min: None,
    };
    loop {
        let r = *round;
        match closed(store, keys, r).await? {
            Some(Closed::Ended(why)) => return Err(LaunchError::JobEnded { why }),
            Some(Closed::Formed { restarts, members }) => {
                if let Some(node_rank) = members.iter().position(|m| m.id == me.launcher_id) {
                    check_nproc(&members, me.nproc_per_node)?;
                    return Ok(Formed {
                        round: r,
                        node_rank,
                        nnodes: members.len(),
                        restarts,
                        members: members.into_iter().map(|m| m.id).collect(),
                    });
                }
                *round += 1;
                continue;
            }
            None => {}
        }
        if joiner.entered != Some(r) {
            joiner.enter(r).await?;
            // Look again at once: the round may have closed meanwhile.
            continue;
        }
        let open = current_attempt(store, keys).await? >= r;
        let arrivals = match try_get(store, &keys.round_key(r, "joiners")).await? {
            Some(text) => parse_joiners(&text),
            None => Vec::new(),
        };
        if joiner.close(r, open, &arrivals).await? {
            continue;
        }
        if joiner.start.elapsed() >= me.join_timeout {
            if joiner.withdraw(r).await? {
                continue;
            }
            return Err(joiner.not_joined(open, arrivals.len()));
        }
        if joiner.notes.due() {
            joiner.say_waiting(r, open, arrivals.len());
        }
        tokio::time::sleep(me.poll).await;
    }
}

/// A launcher joining a round, and what it saw of the round it entered.
struct Joiner<'a> {
    store: &'a dyn Store,
    keys: &'a Keys,
    me: &'a Joining<'a>,
    start: Instant,
    notes: wait::Notes,
    /// The round this launcher wrote itself into the joiners of.
    entered: Option<u64>,
    /// The members of the round before the one entered.
    previous: Vec<String>,
    /// Since when the entered round has been open with `min_nodes` in.
    open_with_min: Option<Instant>,
}

impl Joiner<'_> {
    /// Writes this launcher into round `r`'s joiners (claiming its node
    /// rank, if given), and notes the round before's members.
    async fn enter(&mut self, r: u64) -> Result<(), LaunchError> {
        let (store, keys, me) = (self.store, self.keys, self.me);
        if let Some(rank) = me.node_rank {
            claim(store, keys, r, rank, me.launcher_id).await?;
        }
        store
            .append(&keys.round_key(r, "joiners"), joiner_line(me).as_bytes())
            .await?;
        self.entered = Some(r);
        self.previous = match r.checked_sub(1) {
            Some(last) => member_ids(store, keys, last).await?,
            None => Vec::new(),
        };
        self.open_with_min = None;
        Ok(())
    }

    /// Closes round `r` (when `open`) if the rule says it forms with
    /// `arrivals`; whether it wrote a group.
    async fn close(&mut self, r: u64, open: bool, arrivals: &[plan::Arrival]) -> Result<bool, LaunchError> {
        let (store, keys, me) = (self.store, self.keys, self.me);
        if open && arrivals.len() >= me.min_nodes {
            self.open_with_min.get_or_insert_with(Instant::now);
        } else {
            self.open_with_min = None;
        }
        let formed = membership::closes_with(
            arrivals.len(),
            (me.min_nodes, me.max_nodes),
            plan::previous_back(arrivals, &self.previous),
            self.open_with_min.map(|t| t.elapsed()),
            me.last_call_timeout,
        );
        let Some(n) = formed.filter(|_| open) else {
            return Ok(false);
        };
        let members = plan::members(arrivals, &self.previous, n)
            .into_iter()
            .map(|a| Member {
                id: a.id,
                nproc: a.nproc,
            })
            .collect();
        let record = Closed::Formed {
            restarts: restarts_before(store, keys, r).await?,
            members,
        };
        // First writer wins; the loop reads back whichever group won.
        store
            .compare_set(&keys.round_key(r, "closed"), b"", record.encode().as_bytes())
            .await?;
        Ok(true)
    }

    /// Withdraws from round `r` on timing out; whether it formed with this
    /// launcher meanwhile.
    async fn withdraw(&self, r: u64) -> Result<bool, LaunchError> {
        let (store, keys, me) = (self.store, self.keys, self.me);
        store
            .append(
                &keys.round_key(r, "joiners"),
                format!("- {}\n", me.launcher_id).as_bytes(),
            )
            .await?;
        // A launcher that closed the round just before the withdrawal counts us in.
        if let Some(Closed::Formed { members, .. }) = closed(store, keys, r).await?
            && members.iter().any(|m| m.id == me.launcher_id)
        {
            return Ok(true);
        }
        Ok(false)
    }

    /// Why no group took this launcher within the join timeout.
    fn not_joined(&self, open: bool, joined: usize) -> LaunchError {
        let me = self.me;
        if open {
            LaunchError::NodesMissing {
                joined,
                expected: me.min_nodes,
                waited: me.join_timeout,
            }
        } else if self.previous.len() >= me.max_nodes {
            LaunchError::JobFull {
                max: me.max_nodes,
                waited: me.join_timeout,
            }
        } else {
            LaunchError::NotAdmitted {
                running: self.previous.len(),
                waited: me.join_timeout,
            }
        }
    }

    fn say_waiting(&self, r: u64, open: bool, joined: usize) {
        let me = self.me;
        let waiting_for = match open {
            true => format!(
                "for nodes to join ({joined} joined; {}..{} may form it)",
                me.min_nodes, me.max_nodes
            ),
            false => "for the running job to admit this launcher".to_string(),
        };
        super::say(format!(
            "round {r}: waiting {waiting_for} at {}; {}",
            self.store.location(),
            self.notes.progress()
        ));
    }
}

/// Claims an explicit node rank in `round`, refusing one another launcher holds.
async fn claim(store: &dyn Store, keys: &Keys, round: u64, rank: usize, id: &str) -> Result<(), LaunchError> {
    let held = store
        .compare_set(&keys.round_key(round, &format!("claim/{rank}")), b"", id.as_bytes())
        .await?;
    if held != id.as_bytes() {
        return Err(LaunchError::DuplicateNodeRank {
            node_rank: rank,
            other: String::from_utf8_lossy(&held).into_owned(),
        });
    }
    Ok(())
}

fn check_nproc(members: &[Member], mine: usize) -> Result<(), LaunchError> {
    match members.iter().enumerate().find(|(_, m)| m.nproc != mine) {
        Some((rank, other)) => Err(LaunchError::NprocMismatch {
            mine,
            other_node: rank,
            other_id: other.id.clone(),
            other: other.nproc.to_string(),
        }),
        None => Ok(()),
    }
}

/// The current round (0 before any restart). Creating the counter here
/// lets [`end_round`] compare-set it as text.
pub async fn current_attempt(store: &dyn Store, keys: &Keys) -> Result<u64, StoreError> {
    Ok(store.add(&keys.key("attempt"), 0).await?.max(0) as u64)
}

/// Ends round `round` for `why` and moves every node to the next round;
/// several nodes ending it at once advance it only once. Returns the reason
/// that won, which every node acts on.
pub async fn end_round(store: &dyn Store, keys: &Keys, round: u64, why: &RoundEnd) -> Result<RoundEnd, StoreError> {
    let held = store
        .compare_set(&keys.round_key(round, "end"), b"", why.encode().as_bytes())
        .await?;
    let from = round.to_string();
    let to = (round + 1).to_string();
    store
        .compare_set(&keys.key("attempt"), from.as_bytes(), to.as_bytes())
        .await?;
    Ok(RoundEnd::parse(&String::from_utf8_lossy(&held)))
}

/// Why round `round` ended, once it has.
pub async fn round_end(store: &dyn Store, keys: &Keys, round: u64) -> Result<Option<RoundEnd>, StoreError> {
    Ok(try_get(store, &keys.round_key(round, "end"))
        .await?
        .map(|t| RoundEnd::parse(&t)))
}

/// Tells launchers waiting for the round after `round` that the job is
/// over, so they stop instead of waiting out their join timeout.
pub async fn end_job(store: &dyn Store, keys: &Keys, round: u64, why: &str) -> Result<(), StoreError> {
    store
        .compare_set(
            &keys.round_key(round + 1, "closed"),
            b"",
            Closed::Ended(why.to_string()).encode().as_bytes(),
        )
        .await?;
    Ok(())
}

/// A launcher waiting to join the round after `round`, if any.
pub async fn waiting(store: &dyn Store, keys: &Keys, round: u64) -> Result<Option<String>, StoreError> {
    Ok(try_get(store, &keys.round_key(round + 1, "joiners"))
        .await?
        .and_then(|text| parse_joiners(&text).into_iter().next())
        .map(|a| a.id))
}

/// Takes this launcher out of `round` while it is open, so no group forms
/// with a launcher that is gone.
pub async fn withdraw(store: &dyn Store, keys: &Keys, round: u64, id: &str) -> Result<(), StoreError> {
    if closed(store, keys, round).await?.is_none() {
        store
            .append(&keys.round_key(round, "joiners"), format!("- {id}\n").as_bytes())
            .await?;
    }
    Ok(())
}

/// Bumps this launcher's keep-alive counter.
pub async fn keep_alive(store: &dyn Store, keys: &Keys, id: &str) -> Result<(), StoreError> {
    store.add(&keys.key(&format!("alive/{id}")), 1).await?;
    Ok(())
}

/// Launcher `id`'s keep-alive counter.
pub async fn keep_alive_count(store: &dyn Store, keys: &Keys, id: &str) -> Result<i64, StoreError> {
    store.add(&keys.key(&format!("alive/{id}")), 0).await
}

/// Marks this node's workers done in `round`; returns how many nodes are.
pub async fn mark_done(store: &dyn Store, keys: &Keys, round: u64) -> Result<usize, StoreError> {
    Ok(store.add(&keys.round_key(round, "done"), 1).await? as usize)
}

/// How many nodes' workers are done in `round`.
pub async fn done_count(store: &dyn Store, keys: &Keys, round: u64) -> Result<usize, StoreError> {
    Ok(store.add(&keys.round_key(round, "done"), 0).await? as usize)
}

/// Makes sure every launcher of the job runs restart policy `mine`: the
/// first launcher records its own, the others must match it (a node
/// restarting everybody beside nodes that never restart cannot work).
pub async fn agree_policy(store: &dyn Store, keys: &Keys, mine: &str) -> Result<(), LaunchError> {
    let held = store.compare_set(&keys.key("policy"), b"", mine.as_bytes()).await?;
    if held != mine.as_bytes() {
        return Err(LaunchError::PolicyMismatch {
            mine: mine.to_string(),
            theirs: String::from_utf8_lossy(&held).into_owned(),
        });
    }
    Ok(())
}

/// Closes the round after `formed` for the running group without
/// restarting anyone (rule 7): `formed`'s members less `gone`, then the
/// launchers waiting in the next round, up to `max_nodes`; then advances
/// the round as a membership change. Several launchers doing it at once
/// write one group: the first record wins and everyone follows it.
pub async fn reform(
    store: &dyn Store,
    keys: &Keys,
    formed: &Formed,
    gone: &[&str],
    max_nodes: usize,
    why: &str,
) -> Result<(), StoreError> {
    let round = formed.round;
    let (restarts, members) = match closed(store, keys, round).await? {
        Some(Closed::Formed { restarts, members }) => (restarts, members),
        // Not formed (cannot happen for a running round): nothing to change.
        _ => return Ok(()),
    };
    let previous: Vec<String> = members.iter().map(|m| m.id.clone()).collect();
    let mut arrivals: Vec<plan::Arrival> = members
        .into_iter()
        .filter(|m| !gone.contains(&m.id.as_str()))
        .map(|m| plan::Arrival {
            id: m.id,
            nproc: m.nproc,
            node_rank: None,
        })
        .collect();
    if let Some(text) = try_get(store, &keys.round_key(round + 1, "joiners")).await? {
        for waiting in parse_joiners(&text) {
            if !arrivals.iter().any(|a| a.id == waiting.id) {
                arrivals.push(waiting);
            }
        }
    }
    let n = arrivals.len().min(max_nodes);
    let members = plan::members(&arrivals, &previous, n)
        .into_iter()
        .map(|a| Member {
            id: a.id,
            nproc: a.nproc,
        })
        .collect();
    let record = Closed::Formed { restarts, members };
    store
        .compare_set(&keys.round_key(round + 1, "closed"), b"", record.encode().as_bytes())
        .await?;
    end_round(store, keys, round, &RoundEnd::Membership(why.to_string())).await?;
    Ok(())
}

/// Where a running launcher stands after the round moved (rule 8).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Adopted {
    /// It is a member of the current round, with this place.
    Member(Formed),
    /// The current round left it out; it may wait to join this round.
    Dropped(u64),
    /// The job ended.
    Ended(String),
    /// The current round's group is not written yet: look again later.
    Pending,
}

/// This launcher's place in the current round (rule 8).
pub async fn adopt(store: &dyn Store, keys: &Keys, id: &str) -> Result<Adopted, StoreError> {
    let round = current_attempt(store, keys).await?;
    Ok(match closed(store, keys, round).await? {
        None => Adopted::Pending,
        Some(Closed::Ended(why)) => Adopted::Ended(why),
        Some(Closed::Formed { restarts, members }) => match members.iter().position(|m| m.id == id) {
            Some(node_rank) => Adopted::Member(Formed {
                round,
                node_rank,
                nnodes: members.len(),
                restarts,
                members: members.into_iter().map(|m| m.id).collect(),
            }),
            None => Adopted::Dropped(round),
        },
    })
}

/// Records that every worker of launcher `id` succeeded (rule 9).
pub async fn mark_finished(store: &dyn Store, keys: &Keys, id: &str) -> Result<(), StoreError> {
    store.append(&keys.key("finished"), format!("{id}\n").as_bytes()).await
}

/// How many of `members` finished (rule 9).
pub async fn finished_among(store: &dyn Store, keys: &Keys, members: &[String]) -> Result<usize, StoreError> {
    let text = try_get(store, &keys.key("finished")).await?.unwrap_or_default();
    Ok(members.iter().filter(|m| text.lines().any(|l| l == m.as_str())).count())
}

/// Ends the job for every node (rule 9); the first reason stays.
pub async fn end_for_good(store: &dyn Store, keys: &Keys, why: &str) -> Result<(), StoreError> {
    store.compare_set(&keys.key("over"), b"", why.as_bytes()).await?;
    Ok(())
}

/// Why the job ended for good, once it has.
pub async fn over(store: &dyn Store, keys: &Keys) -> Result<Option<String>, StoreError> {
    try_get(store, &keys.key("over")).await
}

/// The job secret of a multi-node job that brought none: the host
/// publishes one (the first to publish wins), the others read it.
pub async fn shared_secret(
    store: &dyn Store,
    keys: &Keys,
    hosting: bool,
    generate: impl FnOnce() -> String,
    timeout: Duration,
) -> Result<String, LaunchError> {
    let key = keys.key("secret");
    if hosting {
        let mine = generate();
        let held = store.compare_set(&key, b"", mine.as_bytes()).await?;
        return Ok(String::from_utf8_lossy(&held).into_owned());
    }
    match store.get_timeout(&key, timeout).await {
        Ok(value) => Ok(String::from_utf8_lossy(&value).into_owned()),
        Err(e) if e.is_timeout() => Err(LaunchError::NoSecret),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chorus_runtime::store::HashStore;

    fn joining(node_rank: Option<usize>, nproc: usize, id: &'static str) -> Joining<'static> {
        Joining {
            node_rank,
            nproc_per_node: nproc,
            min_nodes: 2,
            max_nodes: 2,
            join_timeout: Duration::from_secs(5),
            last_call_timeout: Duration::from_secs(30),
            poll: Duration::from_millis(5),
            launcher_id: id,
        }
    }

    /// Bounds 2:3 with a short last call.
    fn elastic(id: &'static str) -> Joining<'static> {
        Joining {
            max_nodes: 3,
            last_call_timeout: Duration::from_millis(50),
            ..joining(None, 1, id)
        }
    }

    async fn join_from(store: &HashStore, round: u64, me: &Joining<'_>) -> Result<Formed, LaunchError> {
        let mut round = round;
        join(store, &Keys::new("r"), &mut round, me).await
    }

    fn spawn_join(
        store: &HashStore,
        round: u64,
        me: Joining<'static>,
    ) -> tokio::task::JoinHandle<Result<Formed, LaunchError>> {
        let store = store.clone();
        tokio::spawn(async move { join_from(&store, round, &me).await })
    }

    #[tokio::test]
    async fn nodes_get_ranks_in_arrival_order_and_agree() {
        let store = HashStore::new(Duration::from_secs(5));
        let (a, b) = (joining(None, 2, "a"), joining(None, 2, "b"));
        let (x, y) = tokio::join!(join_from(&store, 0, &a), join_from(&store, 0, &b));
        let (x, y) = (x.unwrap(), y.unwrap());
        assert_eq!((x.nnodes, y.nnodes, x.round, x.restarts), (2, 2, 0, 0));
        assert_eq!(x.members, y.members);
        let mut ranks = [x.node_rank, y.node_rank];
        ranks.sort();
        assert_eq!(ranks, [0, 1]);
    }

    #[tokio::test]
    async fn differing_nproc_and_duplicate_ranks_are_refused() {
        let store = HashStore::new(Duration::from_secs(5));
        let (a, b) = (joining(Some(0), 2, "a"), joining(Some(1), 3, "b"));
        let (x, y) = tokio::join!(join_from(&store, 0, &a), join_from(&store, 0, &b));
        assert!(matches!(x, Err(LaunchError::NprocMismatch { .. })), "{x:?}");
        assert!(matches!(y, Err(LaunchError::NprocMismatch { .. })), "{y:?}");
        let store = HashStore::new(Duration::from_secs(5));
        let first = spawn_join(&store, 0, joining(Some(0), 1, "a"));
        tokio::time::sleep(Duration::from_millis(20)).await;
        let second = join_from(&store, 0, &joining(Some(0), 1, "b")).await;
        assert!(matches!(second, Err(LaunchError::DuplicateNodeRank { node_rank: 0, ref other }) if other == "a"));
        first.abort();
    }

    #[tokio::test]
    async fn a_missing_node_times_out_with_a_count() {
        let store = HashStore::new(Duration::from_secs(5));
        let me = Joining {
            join_timeout: Duration::from_millis(50),
            ..joining(None, 1, "a")
        };
        let error = join_from(&store, 0, &me).await.unwrap_err();
        assert!(
            matches!(
                error,
                LaunchError::NodesMissing {
                    joined: 1,
                    expected: 2,
                    ..
                }
            ),
            "{error:?}"
        );
    }

    #[tokio::test]
    async fn concurrent_ends_advance_the_round_once_and_the_first_reason_wins() {
        let store = HashStore::new(Duration::from_secs(5));
        let keys = Keys::new("r");
        assert_eq!(current_attempt(&store, &keys).await.unwrap(), 0);
        let first = RoundEnd::Membership("node c waits to join".into());
        let won = end_round(&store, &keys, 0, &first).await.unwrap();
        assert_eq!(won, first);
        let won = end_round(&store, &keys, 0, &RoundEnd::Failure("rank 3 failed".into()))
            .await
            .unwrap();
        assert_eq!(won, first, "a failure racing a membership change reads the winner");
        assert_eq!(current_attempt(&store, &keys).await.unwrap(), 1);
        assert_eq!(round_end(&store, &keys, 0).await.unwrap(), Some(first));
        assert_eq!(round_end(&store, &keys, 1).await.unwrap(), None);
    }

    /// Rule 3: a node of round 0 left; the others form round 1 after the
    /// last call, with dense ranks in their old order, one restart counted.
    #[tokio::test]
    async fn survivors_of_a_node_that_left_get_dense_ranks_in_their_old_order() {
        let store = HashStore::new(Duration::from_secs(5));
        let keys = Keys::new("r");
        let (a, b, c) = (elastic("a"), elastic("b"), elastic("c"));
        let (x, y, z) = tokio::join!(
            join_from(&store, 0, &a),
            join_from(&store, 0, &b),
            join_from(&store, 0, &c)
        );
        let ranks = [x.unwrap().node_rank, y.unwrap().node_rank, z.unwrap().node_rank];
        let lost = ranks.iter().position(|&r| r == 1).unwrap();
        end_round(&store, &keys, 0, &RoundEnd::Failure("node left".into()))
            .await
            .unwrap();
        let survivors: Vec<(usize, Joining<'static>)> =
            [a, b, c].into_iter().enumerate().filter(|(i, _)| *i != lost).collect();
        let (p, q) = tokio::join!(
            join_from(&store, 1, &survivors[0].1),
            join_from(&store, 1, &survivors[1].1)
        );
        let (p, q) = (p.unwrap(), q.unwrap());
        assert_eq!((p.round, p.nnodes, p.restarts), (1, 2, 1));
        assert_eq!((q.round, q.nnodes, q.restarts), (1, 2, 1));
        // Old ranks 0 and 2 become 0 and 1, in the same order.
        let old = |i: usize| ranks[survivors[i].0];
        assert_eq!(p.node_rank < q.node_rank, old(0) < old(1));
    }

    /// Rules 1, 2, 4: a launcher arriving while round 0 runs waits in round
    /// 1 (round 1 does not form beside round 0), is seen as waiting, and
    /// joins the others in round 1 with the last rank; no restart counted.
    #[tokio::test]
    async fn a_newcomer_waits_for_the_next_round_and_is_admitted() {
        let store = HashStore::new(Duration::from_secs(5));
        let keys = Keys::new("r");
        let (a, b) = (elastic("a"), elastic("b"));
        let (x, y) = tokio::join!(join_from(&store, 0, &a), join_from(&store, 0, &b));
        assert_eq!((x.unwrap().nnodes, y.unwrap().nnodes), (2, 2));
        let newcomer = spawn_join(&store, 0, elastic("c"));
        let deadline = Instant::now() + Duration::from_secs(5);
        while waiting(&store, &keys, 0).await.unwrap().is_none() {
            assert!(Instant::now() < deadline, "the newcomer never waited");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(waiting(&store, &keys, 0).await.unwrap().as_deref(), Some("c"));
        // Past the last call, round 1 has still not formed without round 0's nodes.
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert!(closed(&store, &keys, 1).await.unwrap().is_none());
        end_round(&store, &keys, 0, &RoundEnd::Membership("node c waits to join".into()))
            .await
            .unwrap();
        let (x, y) = tokio::join!(join_from(&store, 1, &a), join_from(&store, 1, &b));
        let z = newcomer.await.unwrap().unwrap();
        let (x, y) = (x.unwrap(), y.unwrap());
        assert_eq!((z.round, z.node_rank, z.nnodes, z.restarts), (1, 2, 3, 0));
        assert_eq!((x.nnodes, y.nnodes, x.restarts), (3, 3, 0));
    }

    /// More launchers than max arriving while round 0 closes: max of them
    /// form it, the others wait in round 1 and, the job being full, give up
    /// with a clear error and withdraw.
    #[tokio::test]
    async fn launchers_past_max_wait_and_give_up_when_the_job_is_full() {
        let store = HashStore::new(Duration::from_secs(5));
        let keys = Keys::new("r");
        let me = |id| Joining {
            join_timeout: Duration::from_millis(300),
            ..joining(None, 1, id)
        };
        let (a, b, c) = (me("a"), me("b"), me("c"));
        let (x, y, z) = tokio::join!(
            join_from(&store, 0, &a),
            join_from(&store, 0, &b),
            join_from(&store, 0, &c)
        );
        let results = [x, y, z];
        assert_eq!(results.iter().filter(|r| r.is_ok()).count(), 2, "{results:?}");
        let error = results.into_iter().find_map(Result::err).unwrap();
        assert!(matches!(error, LaunchError::JobFull { max: 2, .. }), "{error:?}");
        assert!(error.to_string().contains("maximum of 2 nodes"), "{error}");
        assert_eq!(waiting(&store, &keys, 0).await.unwrap(), None, "it withdrew");
    }

    #[tokio::test]
    async fn a_waiting_launcher_stops_when_the_job_ends() {
        let store = HashStore::new(Duration::from_secs(5));
        let keys = Keys::new("r");
        let (a, b) = (elastic("a"), elastic("b"));
        let (x, y) = tokio::join!(join_from(&store, 0, &a), join_from(&store, 0, &b));
        let (_, _) = (x.unwrap(), y.unwrap());
        let newcomer = spawn_join(&store, 0, elastic("c"));
        end_job(&store, &keys, 0, "the job finished").await.unwrap();
        let error = newcomer.await.unwrap().unwrap_err();
        assert!(
            matches!(error, LaunchError::JobEnded { ref why } if why == "the job finished"),
            "{error:?}"
        );
    }

    /// Forms round 0 of `ids` (bounds 2:3) and returns each one's place.
    async fn formed_round_zero(store: &HashStore, ids: &[&'static str]) -> Vec<Formed> {
        let joins = ids.iter().map(|id| spawn_join(store, 0, elastic(id)));
        let mut formed = Vec::new();
        for join in joins.collect::<Vec<_>>() {
            formed.push(join.await.unwrap().unwrap());
        }
        formed
    }

    /// Rule 7: a node taken for gone is dropped and a waiting one admitted
    /// in one new round, with dense ranks (survivors in their old order,
    /// the newcomer last), as a membership change; rule 8: the others
    /// follow it, the dropped one finds itself left out.
    #[tokio::test]
    async fn reform_drops_the_gone_admits_the_waiting_and_everyone_follows() {
        let store = HashStore::new(Duration::from_secs(5));
        let keys = Keys::new("r");
        let formed = formed_round_zero(&store, &["a", "b", "c"]).await;
        let by_rank = |rank: usize| formed.iter().find(|f| f.node_rank == rank).unwrap().members[rank].clone();
        let (first, lost, last) = (by_rank(0), by_rank(1), by_rank(2));
        let newcomer = spawn_join(&store, 0, elastic("d"));
        let deadline = Instant::now() + Duration::from_secs(5);
        while waiting(&store, &keys, 0).await.unwrap().is_none() {
            assert!(Instant::now() < deadline, "the newcomer never waited");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        reform(&store, &keys, &formed[0], &[lost.as_str()], 3, "node 1 left")
            .await
            .unwrap();
        assert_eq!(current_attempt(&store, &keys).await.unwrap(), 1);
        assert_eq!(
            round_end(&store, &keys, 0).await.unwrap(),
            Some(RoundEnd::Membership("node 1 left".into()))
        );
        let d = newcomer.await.unwrap().unwrap();
        assert_eq!((d.round, d.node_rank, d.nnodes, d.restarts), (1, 2, 3, 0));
        assert_eq!(d.members, [first.clone(), last.clone(), "d".to_string()]);
        match adopt(&store, &keys, &last).await.unwrap() {
            Adopted::Member(place) => assert_eq!((place.round, place.node_rank, place.nnodes), (1, 1, 3)),
            other => panic!("{other:?}"),
        }
        assert_eq!(adopt(&store, &keys, &lost).await.unwrap(), Adopted::Dropped(1));
        // A launcher that saw something else a moment later follows the first record.
        reform(&store, &keys, &formed[0], &[], 3, "node e waits to join")
            .await
            .unwrap();
        assert_eq!(current_attempt(&store, &keys).await.unwrap(), 1);
        assert_eq!(member_ids(&store, &keys, 1).await.unwrap(), d.members);
    }

    /// Rules 9 and 10: the job is over for the members of the current
    /// round once each finished, whatever round it finished in; `over`
    /// keeps the first reason; a second policy is refused.
    #[tokio::test]
    async fn finished_nodes_over_and_one_policy_per_job() {
        let store = HashStore::new(Duration::from_secs(5));
        let keys = Keys::new("r");
        let members = ["a".to_string(), "b".to_string()];
        assert_eq!(finished_among(&store, &keys, &members).await.unwrap(), 0);
        mark_finished(&store, &keys, "b").await.unwrap();
        mark_finished(&store, &keys, "gone").await.unwrap();
        assert_eq!(finished_among(&store, &keys, &members).await.unwrap(), 1);
        mark_finished(&store, &keys, "a").await.unwrap();
        assert_eq!(finished_among(&store, &keys, &members).await.unwrap(), 2);
        assert_eq!(over(&store, &keys).await.unwrap(), None);
        end_for_good(&store, &keys, "rank 3 failed").await.unwrap();
        end_for_good(&store, &keys, "rank 1 failed").await.unwrap();
        assert_eq!(over(&store, &keys).await.unwrap().as_deref(), Some("rank 3 failed"));
        agree_policy(&store, &keys, "worker").await.unwrap();
        agree_policy(&store, &keys, "worker").await.unwrap();
        let error = agree_policy(&store, &keys, "all").await.unwrap_err();
        assert!(
            matches!(error, LaunchError::PolicyMismatch { ref mine, ref theirs } if mine == "all" && theirs == "worker"),
            "{error:?}"
        );
        assert_eq!(error.exit_code(), 2);
    }
}
