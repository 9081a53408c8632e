//! The launchers of one job meeting on the job's store: who serves it, node
//! ranks, the agreed node count and `--nproc-per-node`, the job secret, and
//! the attempt counter through which a failure on one node restarts all.
//!
//! Keys, under `chorus/launch/<run id>/`: `attempt` (the current attempt,
//! advanced by compare-set so concurrent failures restart once), `secret`
//! (only when the host had to generate one), and per attempt `a<n>/joined`
//! (arrival counter), `a<n>/node/<rank>` (`<nproc> <launcher id>`),
//! `a<n>/nnodes` (set by node 0 when the group is formed), `a<n>/failure`
//! (what failed, for the other nodes' messages) and `a<n>/done` (nodes whose
//! workers all succeeded).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chorus_runtime::store::{Store, StoreError, TcpStore, TcpStoreOptions, TcpStoreServer, TcpStoreServerOptions};

use super::LaunchError;
use super::config::{StorePlan, StoreRole};
use super::plan;

/// The job's store as this launcher sees it.
#[derive(Debug)]
pub struct JobStore {
    /// A client of the store (also when this launcher serves it).
    pub store: Arc<TcpStore>,
    /// The server, when this launcher hosts it.
    pub server: Option<TcpStoreServer>,
    /// `MASTER_ADDR` for the workers.
    pub host: String,
    /// `MASTER_PORT` for the workers.
    pub port: u16,
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
    })
}

/// This node's place in one attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Formed {
    /// This node's rank.
    pub node_rank: usize,
    /// Nodes in the attempt.
    pub nnodes: usize,
}

/// What a launcher brings to an attempt's rendezvous.
#[derive(Debug, Clone)]
pub struct Joining<'a> {
    /// `--node-rank`, or the rank this node got in an earlier attempt.
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

    fn attempt_key(&self, attempt: u64, suffix: &str) -> String {
        format!("{}/a{attempt}/{suffix}", self.prefix)
    }
}

/// Joins attempt `attempt`: takes a node rank, waits for the group to form
/// and checks every node runs as many workers as this one.
pub async fn join(store: &dyn Store, keys: &Keys, attempt: u64, me: &Joining<'_>) -> Result<Formed, LaunchError> {
    let order = store.add(&keys.attempt_key(attempt, "joined"), 1).await? as usize - 1;
    let node_rank = me.node_rank.unwrap_or(order);
    if node_rank >= me.max_nodes {
        return Err(LaunchError::TooManyNodes { max: me.max_nodes });
    }
    let mine = format!("{} {}", me.nproc_per_node, me.launcher_id);
    let held = store
        .compare_set(
            &keys.attempt_key(attempt, &format!("node/{node_rank}")),
            b"",
            mine.as_bytes(),
        )
        .await?;
    if held != mine.as_bytes() {
        let other = String::from_utf8_lossy(&held);
        return Err(LaunchError::DuplicateNodeRank {
            node_rank,
            other: other
                .split_once(' ')
                .map_or(other.to_string(), |(_, id)| id.to_string()),
        });
    }
    let nnodes_key = keys.attempt_key(attempt, "nnodes");
    if node_rank == 0 {
        let start = Instant::now();
        let mut min_reached: Option<Instant> = None;
        let nnodes = loop {
            let joined = store.add(&keys.attempt_key(attempt, "joined"), 0).await? as usize;
            if joined >= me.min_nodes {
                min_reached.get_or_insert_with(Instant::now);
            }
            let since_min = min_reached.map(|t| t.elapsed());
            if let Some(n) = plan::nodes_formed(joined, me.min_nodes, me.max_nodes, since_min, me.last_call_timeout) {
                break n;
            }
            if start.elapsed() >= me.join_timeout {
                return Err(LaunchError::NodesMissing {
                    joined,
                    expected: me.min_nodes,
                    waited: me.join_timeout,
                });
            }
            tokio::time::sleep(me.poll).await;
        };
        store.set(&nnodes_key, nnodes.to_string().as_bytes()).await?;
    }
    let nnodes = match store.get_timeout(&nnodes_key, me.join_timeout).await {
        Ok(value) => String::from_utf8_lossy(&value).parse().unwrap_or(0),
        Err(e) if e.is_timeout() => {
            return Err(LaunchError::NodesMissing {
                joined: store.add(&keys.attempt_key(attempt, "joined"), 0).await? as usize,
                expected: me.min_nodes,
                waited: me.join_timeout,
            });
        }
        Err(e) => return Err(e.into()),
    };
    if node_rank >= nnodes {
        return Err(LaunchError::TooManyNodes { max: nnodes });
    }
    for rank in 0..nnodes {
        let value = store
            .get_timeout(&keys.attempt_key(attempt, &format!("node/{rank}")), me.join_timeout)
            .await?;
        let value = String::from_utf8_lossy(&value);
        let (nproc, id) = value.split_once(' ').unwrap_or((&value, "?"));
        if nproc != me.nproc_per_node.to_string() {
            return Err(LaunchError::NprocMismatch {
                mine: me.nproc_per_node,
                other_node: rank,
                other_id: id.to_string(),
                other: nproc.to_string(),
            });
        }
    }
    Ok(Formed { node_rank, nnodes })
}

/// The current attempt (0 before any restart). Creating the counter here
/// lets [`advance_attempt`] compare-set it as text.
pub async fn current_attempt(store: &dyn Store, keys: &Keys) -> Result<u64, StoreError> {
    Ok(store.add(&keys.key("attempt"), 0).await?.max(0) as u64)
}

/// Records why attempt `attempt` failed and moves every node to the next
/// attempt; several nodes failing at once advance it only once.
pub async fn advance_attempt(store: &dyn Store, keys: &Keys, attempt: u64, failure: &str) -> Result<(), StoreError> {
    store
        .compare_set(&keys.attempt_key(attempt, "failure"), b"", failure.as_bytes())
        .await?;
    let from = attempt.to_string();
    let to = (attempt + 1).to_string();
    store
        .compare_set(&keys.key("attempt"), from.as_bytes(), to.as_bytes())
        .await?;
    Ok(())
}

/// Why attempt `attempt` failed, as the failing node wrote it.
pub async fn failure(store: &dyn Store, keys: &Keys, attempt: u64) -> String {
    match store
        .get_timeout(&keys.attempt_key(attempt, "failure"), Duration::from_secs(1))
        .await
    {
        Ok(value) => String::from_utf8_lossy(&value).into_owned(),
        Err(_) => "another node left the job".to_string(),
    }
}

/// Marks this node's workers done in `attempt`; returns how many nodes are.
pub async fn mark_done(store: &dyn Store, keys: &Keys, attempt: u64) -> Result<usize, StoreError> {
    Ok(store.add(&keys.attempt_key(attempt, "done"), 1).await? as usize)
}

/// How many nodes' workers are done in `attempt`.
pub async fn done_count(store: &dyn Store, keys: &Keys, attempt: u64) -> Result<usize, StoreError> {
    Ok(store.add(&keys.attempt_key(attempt, "done"), 0).await? as usize)
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

    #[tokio::test]
    async fn nodes_get_ranks_in_arrival_order_and_agree() {
        let store = HashStore::new(Duration::from_secs(5));
        let keys = Keys::new("r");
        let a = joining(None, 2, "a");
        let b = joining(None, 2, "b");
        let (x, y) = tokio::join!(join(&store, &keys, 0, &a), join(&store, &keys, 0, &b));
        let (x, y) = (x.unwrap(), y.unwrap());
        assert_eq!(x.nnodes, 2);
        assert_eq!(y.nnodes, 2);
        let mut ranks = [x.node_rank, y.node_rank];
        ranks.sort();
        assert_eq!(ranks, [0, 1]);
    }

    #[tokio::test]
    async fn differing_nproc_and_duplicate_ranks_are_refused() {
        let store = HashStore::new(Duration::from_secs(5));
        let keys = Keys::new("r");
        let (a, b) = (joining(Some(0), 2, "a"), joining(Some(1), 3, "b"));
        let (x, y) = tokio::join!(join(&store, &keys, 0, &a), join(&store, &keys, 0, &b));
        assert!(matches!(x, Err(LaunchError::NprocMismatch { .. })), "{x:?}");
        assert!(matches!(y, Err(LaunchError::NprocMismatch { .. })), "{y:?}");
        let store = HashStore::new(Duration::from_secs(5));
        let first = tokio::spawn({
            let store = store.clone();
            let keys = keys.clone();
            async move { join(&store, &keys, 0, &joining(Some(0), 1, "a")).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        let second = join(&store, &keys, 0, &joining(Some(0), 1, "b")).await;
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
        let error = join(&store, &Keys::new("r"), 0, &me).await.unwrap_err();
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
    async fn concurrent_failures_advance_the_attempt_once() {
        let store = HashStore::new(Duration::from_secs(5));
        let keys = Keys::new("r");
        assert_eq!(current_attempt(&store, &keys).await.unwrap(), 0);
        advance_attempt(&store, &keys, 0, "rank 1 failed").await.unwrap();
        advance_attempt(&store, &keys, 0, "rank 3 failed").await.unwrap();
        assert_eq!(current_attempt(&store, &keys).await.unwrap(), 1);
        assert_eq!(failure(&store, &keys, 0).await, "rank 1 failed");
    }
}
