//! Rendezvous: from "how was I started" to "who are my peers".
//!
//! 1. [`InitMethod::parse`] reads PyTorch's init URLs (`tcp://`, `file://`,
//!    `env://`) and `etcd://host:port[,host:port...][/prefix]`; [`resolve`] combines one with explicit arguments and the
//!    launcher's environment ([`env`](mod@env)) into a [`RendezvousConfig`]: store,
//!    rank, world size, generation. Explicit arguments win over URL queries,
//!    which win over the environment.
//! 2. [`open_store`] opens that store (rank 0 hosts the TCP server for
//!    `tcp://` and `env://`, as in PyTorch, unless the launcher already
//!    does: `TORCHELASTIC_USE_AGENT_STORE`); `etcd://` connects to etcd,
//!    which nobody in the job serves. A launcher whose store is not its own
//!    TCP store names it in `CHORUS_STORE`, which `env://` prefers to
//!    `MASTER_ADDR` / `MASTER_PORT`.
//! 3. [`rendezvous`] runs the exchange on the store, under
//!    `chorus/<run id>/g<generation>/`, so an elastic restart re-runs it as
//!    a new generation without seeing the old one's keys:
//!    - `world_size`: compare-and-set by the first arrival; a rank started with
//!      another world size fails, naming the rank that set it;
//!    - `rank/<r>`: compare-and-set by the claimant; a second process claiming
//!      the same rank fails, naming both hosts and pids;
//!    - `peer/<r>`: the rank's [`PeerRecord`]; every rank waits for all of them
//!      and a timeout names the ranks that never arrived.
//!
//!    A rank that finds a conflict (another world size, a rank claimed
//!    twice) writes its message into every `peer/<r>` still missing (records
//!    are written with compare-and-set, so each key is written once): every
//!    rank waiting on them wakes and fails at once with the same message
//!    ([`RendezvousError::Conflict`]), instead of waiting out the timeout,
//!    and so does a rank arriving later. The finder stays up to
//!    [`CONFLICT_LINGER`] until the ranks that claimed a place have read it
//!    (it may host the store they read it from).
//!
//! Groups that re-form after a failure (an elastic group's generations,
//! `chorus launch`'s node rounds) close their rounds and rank their members
//! by the rules of [`membership`], sans IO.
//!
//! Default timeouts (each configurable; `InitOptions` in the root crate):
//! rendezvous and store operations 300 s (PyTorch's store default), the
//! store's connection attempts within the same 300 s.

use std::os::unix::ffi::OsStringExt as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;

use crate::store::{
    DEFAULT_PORT, EtcdStore, EtcdStoreOptions, FileStore, FileStoreOptions, PrefixStore, Store, StoreError, TcpStore,
    TcpStoreOptions, TcpStoreServer, TcpStoreServerOptions,
};
use crate::wait::{self, Notes};

pub mod elastic;
pub mod env;
pub mod membership;
mod record;

pub use record::{Claimant, HostId, PeerRecord};

use env::{EnvError, LaunchEnv, Launcher};

/// Errors of rendezvous, each saying what to change.
#[derive(Error)]
pub enum RendezvousError {
    /// The launcher's environment is incomplete or wrong.
    #[error(transparent)]
    Env(#[from] EnvError),
    /// The init URL could not be understood.
    #[error("bad init method {url:?}: {reason}")]
    BadUrl {
        /// The URL given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// No rank was given anywhere.
    #[error("no rank given: pass one explicitly, add ?rank=R to the URL, or set RANK")]
    MissingRank,
    /// No world size was given anywhere.
    #[error("no world size given: pass one explicitly, add ?world_size=N to the URL, or set WORLD_SIZE")]
    MissingWorldSize,
    /// The world size is zero.
    #[error("world size must be at least 1")]
    EmptyWorld,
    /// The rank is outside `0..world_size`.
    #[error("rank {rank} is out of range for world size {world_size}: ranks go from 0 to {}", world_size.saturating_sub(1))]
    RankOutOfRange {
        /// The rank given.
        rank: usize,
        /// The world size given.
        world_size: usize,
    },
    /// This rank was started with another world size than the first arrival.
    #[error(
        "world size mismatch: {ours_by} has world size {ours}, but {theirs_by} registered world size {theirs}; start every rank with the same world size"
    )]
    WorldSizeMismatch {
        /// Our world size.
        ours: usize,
        /// Who we are.
        ours_by: Claimant,
        /// The world size already registered.
        theirs: usize,
        /// Who registered it.
        theirs_by: Claimant,
    },
    /// Two processes claim the same rank.
    #[error("rank {rank} is claimed twice: by {first} and by {second}; give every process its own rank")]
    DuplicateRank {
        /// The rank claimed twice.
        rank: usize,
        /// The process that claimed it first.
        first: Claimant,
        /// This process.
        second: Claimant,
    },
    /// Not every rank arrived in time.
    #[error(
        "rendezvous of generation {generation} timed out after {waited:?} on store {location}: {arrived} of {world_size} ranks arrived; missing ranks {missing:?}"
    )]
    Incomplete {
        /// The generation being formed.
        generation: u64,
        /// Ranks whose records never appeared.
        missing: Vec<usize>,
        /// How many arrived.
        arrived: usize,
        /// The expected world size.
        world_size: usize,
        /// How long we waited.
        waited: Duration,
        /// The store.
        location: String,
    },
    /// Another process of this rendezvous found a conflict (a world size
    /// mismatch, a rank claimed twice); the message is the one it reported.
    #[error("{message}")]
    Conflict {
        /// The finder's error, word for word.
        message: String,
    },
    /// A rank's published record could not be read.
    #[error("rank {rank} published an unreadable record ({reason}); is it running another chorus version?")]
    BadRecord {
        /// Whose record.
        rank: usize,
        /// Why it is unreadable.
        reason: String,
    },
    /// Rank 0 could not start the store server.
    #[error("rank 0 could not serve the store on {addr}: {source}; {hint}")]
    Serve {
        /// The address it tried.
        addr: String,
        /// What failed.
        #[source]
        source: std::io::Error,
        /// What to do about it.
        hint: &'static str,
    },
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

crate::debug_as_report!(RendezvousError);

/// How the ranks meet, as given by the user (PyTorch's `init_method`).
#[derive(Debug, Clone)]
pub enum InitMethod {
    /// `tcp://host:port[?rank=R&world_size=N]`: rank 0 serves a TCP store there.
    Tcp {
        /// Host rank 0 listens on and the others connect to.
        host: String,
        /// Its port.
        port: u16,
        /// `rank` from the URL query.
        rank: Option<usize>,
        /// `world_size` from the URL query.
        world_size: Option<usize>,
    },
    /// `file:///path[?rank=R&world_size=N]`: a [`FileStore`] at `path`.
    File {
        /// The store file.
        path: PathBuf,
        /// `rank` from the URL query.
        rank: Option<usize>,
        /// `world_size` from the URL query.
        world_size: Option<usize>,
    },
    /// `etcd://host:port[,host:port...][/prefix][?rank=R&world_size=N]`:
    /// an [`EtcdStore`] on those endpoints (port 2379 when left out), its
    /// keys under `prefix` (`/chorus` when left out).
    Etcd {
        /// `host:port` of each etcd endpoint, tried in turn.
        endpoints: Vec<String>,
        /// Prefix of every key.
        prefix: String,
        /// `rank` from the URL query.
        rank: Option<usize>,
        /// `world_size` from the URL query.
        world_size: Option<usize>,
    },
    /// `env://`: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, or the variables
    /// of torchrun, Slurm, Open MPI, MPICH or Kubeflow; the store is
    /// `CHORUS_STORE` (a store URL, e.g. `etcd://...`) when set.
    Env,
    /// A store the caller made; rank and world size must be given.
    Store(Arc<dyn Store>),
}

fn parse_count(url: &str, name: &str, value: &str) -> Result<usize, RendezvousError> {
    value.parse().map_err(|_| RendezvousError::BadUrl {
        url: url.to_string(),
        reason: format!("{name}={value:?} is not a non-negative integer"),
    })
}

impl InitMethod {
    /// Parses a PyTorch init URL.
    pub fn parse(text: &str) -> Result<Self, RendezvousError> {
        let bad = |reason: &str| RendezvousError::BadUrl {
            url: text.to_string(),
            reason: reason.to_string(),
        };
        let (scheme, rest) = text
            .split_once("://")
            .ok_or_else(|| bad("expected tcp://host:port, file:///path, etcd://host:port or env://"))?;
        if rest.contains('#') {
            return Err(bad("a fragment (#...) means nothing in an init URL"));
        }
        let (location, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (rank, world_size) = parse_query(text, form_urlencoded::parse(query.as_bytes()))?;
        match scheme.to_ascii_lowercase().as_str() {
            "tcp" => {
                let (host, port) = parse_host_port(location).map_err(|reason| bad(&reason))?;
                Ok(InitMethod::Tcp {
                    host,
                    port,
                    rank,
                    world_size,
                })
            }
            "file" => {
                // `file:///p` and `file://localhost/p` name the same local file.
                let path = location.strip_prefix("localhost").unwrap_or(location);
                if !path.starts_with('/') {
                    return Err(bad("not an absolute local path; write file:///absolute/path"));
                }
                let bytes: Vec<u8> = percent_encoding::percent_decode_str(path).collect();
                let path = PathBuf::from(std::ffi::OsString::from_vec(bytes));
                Ok(InitMethod::File { path, rank, world_size })
            }
            "etcd" => {
                let (endpoints, prefix) = crate::store::parse_endpoints(location).map_err(|e| bad(&e))?;
                Ok(InitMethod::Etcd {
                    endpoints,
                    prefix,
                    rank,
                    world_size,
                })
            }
            "env" => {
                if !location.trim_end_matches('/').is_empty() {
                    return Err(bad("env:// takes no host or path"));
                }
                if rank.is_some() || world_size.is_some() {
                    return Err(bad(
                        "env:// takes rank and world size from RANK and WORLD_SIZE, not the URL",
                    ));
                }
                Ok(InitMethod::Env)
            }
            other => Err(bad(&format!(
                "unknown scheme {other:?}; use tcp://, file://, etcd:// or env://"
            ))),
        }
    }
}

/// `host` and `port` of a `tcp://` URL's `host:port` (`[v6]:port` for an
/// IPv6 address; a trailing `/` is allowed, a path is not).
fn parse_host_port(location: &str) -> Result<(String, u16), String> {
    let authority = location.strip_suffix('/').unwrap_or(location);
    if authority.contains('/') {
        return Err("a path means nothing here; write tcp://host:port".into());
    }
    if authority.contains('@') {
        return Err("no user name or password; write tcp://host:port".into());
    }
    let (host, port) = match authority.strip_prefix('[') {
        Some(bracketed) => {
            let (host, after) = bracketed
                .split_once(']')
                .ok_or("an IPv6 address needs its closing ]; write tcp://[::1]:port")?;
            (host, after.strip_prefix(':'))
        }
        None => match authority.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        },
    };
    if host.is_empty() {
        return Err("no host; write tcp://host:port".into());
    }
    let port = port.filter(|p| !p.is_empty()).ok_or("no port; write tcp://host:port")?;
    let port = port
        .parse()
        .map_err(|_| format!("port {port:?} is not a number from 0 to 65535"))?;
    Ok((host.to_string(), port))
}

/// `rank` and `world_size` from a URL query; anything else is an error.
fn parse_query<'a>(
    text: &str,
    pairs: impl Iterator<Item = (std::borrow::Cow<'a, str>, std::borrow::Cow<'a, str>)>,
) -> Result<(Option<usize>, Option<usize>), RendezvousError> {
    let (mut rank, mut world_size) = (None, None);
    for (name, value) in pairs {
        match name.as_ref() {
            "rank" => rank = Some(parse_count(text, "rank", &value)?),
            "world_size" => world_size = Some(parse_count(text, "world_size", &value)?),
            other => {
                return Err(RendezvousError::BadUrl {
                    url: text.to_string(),
                    reason: format!("unknown query parameter {other:?}; only rank and world_size are understood"),
                });
            }
        }
    }
    Ok((rank, world_size))
}

/// Where the store is, once resolved.
#[derive(Debug, Clone)]
pub enum StoreSpec {
    /// A TCP store; rank 0 serves it.
    Tcp {
        /// Host name or address.
        host: String,
        /// Port.
        port: u16,
    },
    /// A file store.
    File {
        /// The store file.
        path: PathBuf,
    },
    /// An etcd store; nobody in the job serves it.
    Etcd {
        /// `host:port` of each endpoint.
        endpoints: Vec<String>,
        /// Prefix of every key.
        prefix: String,
    },
    /// A store given by the caller.
    Given(Arc<dyn Store>),
}

/// The store variable a launcher sets when its workers should meet on
/// another store than `MASTER_ADDR:MASTER_PORT` (an `etcd://` URL).
pub const STORE_ENV: &str = "CHORUS_STORE";

/// Everything rendezvous needs, resolved from the init method, explicit
/// arguments and the environment.
#[derive(Debug, Clone)]
pub struct RendezvousConfig {
    /// The store to meet on.
    pub store: StoreSpec,
    /// This process's rank.
    pub rank: usize,
    /// How many ranks.
    pub world_size: usize,
    /// Rank on this node, when a launcher said.
    pub local_rank: Option<usize>,
    /// Ranks on this node, when a launcher said.
    pub local_world_size: Option<usize>,
    /// Generation of the group (torchrun's restart count by default).
    pub generation: u64,
    /// Names the job in the store, so jobs sharing a store stay apart.
    pub run_id: String,
    /// The launcher detected, if any.
    pub launcher: Option<Launcher>,
    /// Whether this process serves the TCP store: rank 0, unless the
    /// launcher serves it (`TORCHELASTIC_USE_AGENT_STORE`).
    pub serve_store: bool,
}

impl RendezvousConfig {
    /// The master's host, for choosing the local address that routes to it.
    pub fn master_host(&self) -> Option<&str> {
        match &self.store {
            StoreSpec::Tcp { host, .. } => Some(host),
            // Any endpoint will do: the local address that routes to it routes to the job.
            StoreSpec::Etcd { endpoints, .. } => endpoints.first().map(|e| {
                let host = e.rsplit_once(':').map_or(e.as_str(), |(host, _)| host);
                host.trim_start_matches('[').trim_end_matches(']')
            }),
            _ => None,
        }
    }
}

/// Combines `method`, explicit `rank` / `world_size` and the environment
/// (read through `lookup`) into a validated configuration.
pub fn resolve(
    method: InitMethod,
    rank: Option<usize>,
    world_size: Option<usize>,
    lookup: &dyn Fn(&str) -> Option<String>,
) -> Result<RendezvousConfig, RendezvousError> {
    // A launcher's environment is needed only where the method leaves rank,
    // world size or the store to it. Otherwise explicit arguments win, as in
    // torch: a half-set environment (WORLD_SIZE or MASTER_ADDR exported for
    // another purpose, as torch's own test harness does) is not an error.
    let needs_env = matches!(method, InitMethod::Env) || rank.is_none() || world_size.is_none();
    let launch: Option<LaunchEnv> = match env::detect(lookup) {
        Ok(launch) => launch,
        Err(_) if !needs_env => None,
        Err(error) => return Err(error.into()),
    };
    // A store the caller made is its own scope (torch prefixes it per group
    // and per attempt already); the launcher's restart count scopes only a
    // store found through the environment or a URL. Under a per-worker
    // restart policy the count differs between ranks of one group.
    let given_store = matches!(method, InitMethod::Store(_));
    let (store, url_rank, url_world) = method_store(method, launch.as_ref(), lookup)?;
    let rank = rank
        .or(url_rank)
        .or(launch.as_ref().map(|l| l.rank))
        .ok_or(RendezvousError::MissingRank)?;
    let world_size = world_size
        .or(url_world)
        .or(launch.as_ref().map(|l| l.world_size))
        .ok_or(RendezvousError::MissingWorldSize)?;
    if world_size == 0 {
        return Err(RendezvousError::EmptyWorld);
    }
    if rank >= world_size {
        return Err(RendezvousError::RankOutOfRange { rank, world_size });
    }
    Ok(RendezvousConfig {
        store,
        rank,
        world_size,
        local_rank: launch.as_ref().map(|l| l.local_rank),
        local_world_size: launch.as_ref().map(|l| l.local_world_size),
        generation: match &launch {
            Some(launch) if !given_store => launch.restart_count,
            _ => 0,
        },
        run_id: launch
            .as_ref()
            .and_then(|l| l.run_id.clone())
            .unwrap_or_else(|| "default".to_string()),
        launcher: launch.map(|l| l.launcher),
        serve_store: rank == 0 && !env::uses_agent_store(lookup),
    })
}

/// The store `method` meets on, with the rank and world size its URL
/// gives; `env://` takes it from [`STORE_ENV`] or else the launcher's
/// `launch` environment.
fn method_store(
    method: InitMethod,
    launch: Option<&LaunchEnv>,
    lookup: &dyn Fn(&str) -> Option<String>,
) -> Result<(StoreSpec, Option<usize>, Option<usize>), RendezvousError> {
    Ok(match method {
        InitMethod::Tcp {
            host,
            port,
            rank,
            world_size,
        } => (StoreSpec::Tcp { host, port }, rank, world_size),
        InitMethod::File { path, rank, world_size } => (StoreSpec::File { path }, rank, world_size),
        InitMethod::Etcd {
            endpoints,
            prefix,
            rank,
            world_size,
        } => (StoreSpec::Etcd { endpoints, prefix }, rank, world_size),
        InitMethod::Store(store) => (StoreSpec::Given(store), None, None),
        InitMethod::Env if lookup(STORE_ENV).is_some_and(|v| !v.trim().is_empty()) => {
            (named_store(lookup(STORE_ENV).unwrap_or_default())?, None, None)
        }
        InitMethod::Env => (master_store(launch)?, None, None),
    })
}

/// The store the URL `text` of [`STORE_ENV`] names, which gives no rank
/// or world size.
fn named_store(text: String) -> Result<StoreSpec, RendezvousError> {
    match InitMethod::parse(text.trim())? {
        InitMethod::Etcd {
            endpoints,
            prefix,
            rank: None,
            world_size: None,
        } => Ok(StoreSpec::Etcd { endpoints, prefix }),
        InitMethod::Tcp {
            host,
            port,
            rank: None,
            world_size: None,
        } => Ok(StoreSpec::Tcp { host, port }),
        InitMethod::File {
            path,
            rank: None,
            world_size: None,
        } => Ok(StoreSpec::File { path }),
        _ => Err(RendezvousError::BadUrl {
            url: text,
            reason: format!("{STORE_ENV} names the store only: etcd://, tcp:// or file:// without rank or world_size"),
        }),
    }
}

/// The TCP store at the launcher's `MASTER_ADDR` and `MASTER_PORT` (or the
/// port its launcher's convention gives).
fn master_store(launch: Option<&LaunchEnv>) -> Result<StoreSpec, RendezvousError> {
    let launch = launch.ok_or(EnvError::Missing {
        var: "MASTER_ADDR",
        launcher: Launcher::Env,
    })?;
    let host = launch.master_addr.clone().ok_or(EnvError::Missing {
        var: "MASTER_ADDR",
        launcher: launch.launcher,
    })?;
    let port = match (launch.master_port, launch.launcher) {
        (Some(port), _) => port,
        // Slurm hands out no port: derive one from the job id, as
        // Lightning does, so two jobs sharing a node do not collide.
        (None, Launcher::Slurm) => launch.run_id.as_deref().map_or(DEFAULT_PORT, slurm_port),
        // MPI hands out no port either; PyTorch's default is the convention.
        (None, Launcher::OpenMpi | Launcher::Mpich) => DEFAULT_PORT,
        (None, launcher) => {
            return Err(EnvError::Missing {
                var: "MASTER_PORT",
                launcher,
            }
            .into());
        }
    };
    Ok(StoreSpec::Tcp { host, port })
}

/// An open store, with the server this process hosts for it (rank 0 of `tcp://`).
#[derive(Debug)]
pub struct OpenedStore {
    /// The store.
    pub store: Arc<dyn Store>,
    /// The server, when this process hosts it; dropping it stops serving.
    pub server: Option<TcpStoreServer>,
}

/// Opens the configured store; rank 0 of a TCP store starts its server.
pub async fn open_store(config: &RendezvousConfig, timeout: Duration) -> Result<OpenedStore, RendezvousError> {
    match &config.store {
        StoreSpec::Given(store) => Ok(OpenedStore {
            store: store.clone(),
            server: None,
        }),
        StoreSpec::File { path } => {
            let options = FileStoreOptions {
                timeout,
                ..FileStoreOptions::default()
            };
            let store = FileStore::open(path, options).await?;
            Ok(OpenedStore {
                store: Arc::new(store),
                server: None,
            })
        }
        StoreSpec::Etcd { endpoints, prefix } => {
            let options = EtcdStoreOptions {
                timeout,
                connect_timeout: timeout,
                prefix: prefix.clone(),
            };
            let store = EtcdStore::connect(endpoints.clone(), options).await?;
            Ok(OpenedStore {
                store: Arc::new(store),
                server: None,
            })
        }
        StoreSpec::Tcp { host, port } => {
            let server = if config.serve_store {
                Some(serve(host, *port).await?)
            } else {
                None
            };
            let addr = match &server {
                // Port 0 asked for any free port: connect to the one chosen.
                Some(server) if *port == 0 => format!("{}:{}", bracket(host), server.local_addr().port()),
                _ => format!("{}:{}", bracket(host), port),
            };
            let options = TcpStoreOptions {
                timeout,
                connect_timeout: timeout,
                ..TcpStoreOptions::default()
            };
            let store = TcpStore::connect(addr, options).await?;
            Ok(OpenedStore {
                store: Arc::new(store),
                server,
            })
        }
    }
}

fn bracket(host: &str) -> String {
    if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_string()
    }
}

/// Rank 0's server: on loopback when the master address is loopback (the
/// job is local, so nothing else needs to reach it), on every interface
/// otherwise, as PyTorch does.
async fn serve(host: &str, port: u16) -> Result<TcpStoreServer, RendezvousError> {
    let resolved = tokio::net::lookup_host((host, port))
        .await
        .map_err(|source| RendezvousError::Serve {
            addr: format!("{host}:{port}"),
            source,
            hint: "the master address does not resolve; check MASTER_ADDR or the tcp:// host",
        })?;
    let local = resolved.into_iter().next().map(|a| a.ip());
    let bind_ip = match local {
        Some(ip) if ip.is_loopback() => ip,
        Some(std::net::IpAddr::V6(_)) => std::net::IpAddr::from([0u16; 8]),
        _ => std::net::IpAddr::from([0u8; 4]),
    };
    let addr = std::net::SocketAddr::new(bind_ip, port);
    TcpStoreServer::bind(addr, TcpStoreServerOptions::default())
        .await
        .map_err(|source| RendezvousError::Serve {
            addr: addr.to_string(),
            hint: if source.kind() == std::io::ErrorKind::AddrInUse {
                "the port is in use: pick another MASTER_PORT, or check that rank 0 is not started twice"
            } else {
                "check the master address and port"
            },
            source,
        })
}

/// The outcome of rendezvous: this rank's place and every peer's record.
#[derive(Debug, Clone)]
pub struct Membership {
    /// The generation formed.
    pub generation: u64,
    /// This rank.
    pub rank: usize,
    /// Every rank's record, indexed by rank.
    pub peers: Vec<PeerRecord>,
}

impl Membership {
    /// How many ranks.
    pub fn world_size(&self) -> usize {
        self.peers.len()
    }

    /// This rank's own record.
    pub fn me(&self) -> &PeerRecord {
        &self.peers[self.rank]
    }

    /// Ranks on the same host as this one (this one included), in rank
    /// order: one kernel and one network namespace, as a launcher's node.
    pub fn local_ranks(&self) -> Vec<usize> {
        let host = &self.me().host;
        (0..self.peers.len())
            .filter(|&r| self.peers[r].host.same_network(host))
            .collect()
    }
}

/// The store port of Slurm job `job_id` without `MASTER_PORT`: 15000 plus
/// the id's last four digits (Lightning's rule), so every task of a job
/// agrees on it and concurrent jobs on a node rarely share it.
fn slurm_port(job_id: &str) -> u16 {
    let digits: String = job_id.chars().filter(char::is_ascii_digit).collect();
    let tail = &digits[digits.len().saturating_sub(4)..];
    15000 + tail.parse::<u16>().unwrap_or(0)
}

fn random_nonce() -> u64 {
    let mut bytes = [0u8; 8];
    // The nonce only tells a restarted process from its predecessor; a
    // failing OS generator falls back to the time, which does that too.
    if getrandom::fill(&mut bytes).is_err() {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        bytes = nanos.to_le_bytes();
    }
    u64::from_le_bytes(bytes)
}

/// Starts a `peer/<r>` value that carries a conflict's message instead of a
/// record (0xff starts no record: it is no bincode integer prefix).
const CONFLICT_MARK: &[u8] = b"\xffchorus conflict:";

/// How long the process that found a conflict waits for the ranks that
/// claimed a place to read it before it fails (and may stop serving the store).
pub const CONFLICT_LINGER: Duration = Duration::from_secs(2);

/// The conflict a `peer/<r>` value carries, if it carries one.
fn conflict_in(value: &[u8]) -> Option<RendezvousError> {
    value
        .strip_prefix(CONFLICT_MARK)
        .map(|message| RendezvousError::Conflict {
            message: String::from_utf8_lossy(message).into_owned(),
        })
}

/// Tells every rank of the generation about `error`: its message goes into
/// every `peer/<r>` (r < `world_size`) still missing, waking the ranks that
/// wait for them. Then waits (up to [`CONFLICT_LINGER`]) until each rank that
/// claimed a place acknowledged it, and hands `error` back.
async fn report_conflict(scoped: &PrefixStore, world_size: usize, error: RendezvousError) -> RendezvousError {
    let mut value = CONFLICT_MARK.to_vec();
    value.extend_from_slice(error.to_string().as_bytes());
    // Each phase is bounded: the ranks that read the conflict exit, and the
    // store may go with them (rank 0 serves it); a store call would then
    // retry the connection for its whole timeout.
    let write = async {
        let mut wrote = false;
        for r in 0..world_size {
            wrote |= scoped.compare_set(&format!("peer/{r}"), b"", &value).await? == value;
        }
        Ok::<_, StoreError>(wrote)
    };
    // Nothing written: every rank had published, and that group formed
    // without this process (or the store failed, and the rank's own error
    // says more).
    if !matches!(tokio::time::timeout(CONFLICT_LINGER, write).await, Ok(Ok(true))) {
        return error;
    }
    await_acknowledgements(scoped, world_size).await;
    error
}

/// Waits (up to [`CONFLICT_LINGER`]) until every rank that claimed a place
/// acknowledged the conflict: the process serving the store (rank 0) must
/// not take it away before the others have read the message.
async fn await_acknowledgements(scoped: &PrefixStore, world_size: usize) {
    let acknowledged = async {
        let mut acks = Vec::new();
        for r in 0..world_size {
            if let Ok(true) = scoped.check(&[&format!("rank/{r}")]).await {
                acks.push(format!("conflict_seen/{r}"));
            }
        }
        let acks: Vec<&str> = acks.iter().map(String::as_str).collect();
        let _ = scoped.wait_timeout(&acks, CONFLICT_LINGER).await;
    };
    let _ = tokio::time::timeout(CONFLICT_LINGER, acknowledged).await;
}

/// Fails this rank with the conflict another process reported, after
/// acknowledging it and letting the other claimants read it too.
async fn conflict_seen(
    scoped: &PrefixStore,
    rank: usize,
    world_size: usize,
    conflict: RendezvousError,
) -> RendezvousError {
    let _ = tokio::time::timeout(CONFLICT_LINGER, scoped.set(&format!("conflict_seen/{rank}"), b"")).await;
    await_acknowledgements(scoped, world_size).await;
    conflict
}

fn decode_claim(rank: usize, bytes: &[u8]) -> Result<Claimant, RendezvousError> {
    crate::codec::decode(bytes).map_err(|e| RendezvousError::BadRecord {
        rank,
        reason: e.to_string(),
    })
}

/// Runs the exchange: claims `rank`, publishes `record` (its `rank` field is
/// set here), and waits up to `timeout` for all `world_size` records of
/// `generation`.
pub async fn rendezvous(
    store: Arc<dyn Store>,
    config: &RendezvousConfig,
    mut record: PeerRecord,
    timeout: Duration,
) -> Result<Membership, RendezvousError> {
    let (rank, world_size, generation) = (config.rank, config.world_size, config.generation);
    if rank >= world_size {
        return Err(RendezvousError::RankOutOfRange { rank, world_size });
    }
    let exchange = Exchange {
        location: store.location(),
        scoped: PrefixStore::new(format!("chorus/{}/g{}", config.run_id, generation), store),
        rank,
        world_size,
        generation,
    };
    record.rank = rank as u32;
    let me = Claimant {
        hostname: record.host.hostname.clone(),
        pid: record.pid,
        nonce: random_nonce(),
        world_size: world_size as u32,
        rank: rank as u32,
    };
    exchange.claim(me).await?;
    exchange.publish(&record).await?;
    exchange.wait_for_all(timeout).await?;
    exchange.membership().await
}

/// One rank's part in the exchange of a generation's records, under the
/// generation's keys.
struct Exchange {
    scoped: PrefixStore,
    /// The store's location, for notes.
    location: String,
    rank: usize,
    world_size: usize,
    generation: u64,
}

impl Exchange {
    /// Claims the world size (the first claimant's must match) and this
    /// rank (no other process may hold it); a conflict is reported to every
    /// rank of the generation.
    async fn claim(&self, me: Claimant) -> Result<(), RendezvousError> {
        let (rank, world_size) = (self.rank, self.world_size);
        let mine = crate::codec::encode(&me);
        let registered = self.scoped.compare_set("world_size", b"", &mine).await?;
        let first = decode_claim(rank, &registered)?;
        if first.world_size as usize != world_size {
            let theirs = first.world_size as usize;
            let error = RendezvousError::WorldSizeMismatch {
                ours: world_size,
                ours_by: me,
                theirs,
                theirs_by: first,
            };
            return Err(report_conflict(&self.scoped, theirs, error).await);
        }
        let claimed = self.scoped.compare_set(&format!("rank/{rank}"), b"", &mine).await?;
        if claimed != mine {
            let error = RendezvousError::DuplicateRank {
                rank,
                first: decode_claim(rank, &claimed)?,
                second: me,
            };
            return Err(report_conflict(&self.scoped, world_size, error).await);
        }
        Ok(())
    }

    /// Publishes this rank's record.
    async fn publish(&self, record: &PeerRecord) -> Result<(), RendezvousError> {
        // Written once: a conflict written here first stays, and fails us.
        let published = record.encode();
        let current = self
            .scoped
            .compare_set(&format!("peer/{}", self.rank), b"", &published)
            .await?;
        if let Some(conflict) = conflict_in(&current) {
            return Err(conflict_seen(&self.scoped, self.rank, self.world_size, conflict).await);
        }
        Ok(())
    }

    /// Every rank's record key, in rank order.
    fn peer_keys(&self) -> Vec<String> {
        (0..self.world_size).map(|r| format!("peer/{r}")).collect()
    }

    /// The ranks whose record is not published yet.
    async fn missing(&self) -> Result<Vec<usize>, StoreError> {
        let mut missing = Vec::new();
        for (r, key) in self.peer_keys().iter().enumerate() {
            if !self.scoped.check(&[key.as_str()]).await? {
                missing.push(r);
            }
        }
        Ok(missing)
    }

    /// Waits up to `timeout` until every rank published its record.
    async fn wait_for_all(&self, timeout: Duration) -> Result<(), RendezvousError> {
        let (rank, world_size, generation) = (self.rank, self.world_size, self.generation);
        let keys = self.peer_keys();
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let started = tokio::time::Instant::now();
        let deadline = started + timeout;
        let mut notes = Notes::new(timeout);
        // In slices, each ending at the next note: who is missing is said
        // while the wait goes on, not only once it failed.
        loop {
            let until = notes.next_at().min(deadline);
            // Never 0, which a store may read as "no limit".
            let slice = until
                .saturating_duration_since(tokio::time::Instant::now())
                .max(Duration::from_millis(1));
            match self.scoped.wait_timeout(&key_refs, slice).await {
                Ok(()) => return Ok(()),
                Err(StoreError::Timeout { .. }) if tokio::time::Instant::now() < deadline => {
                    if notes.due() {
                        let missing = self.missing().await?;
                        tracing::info!(
                            target: wait::TARGET,
                            "rank {rank}: waiting for ranks {} of {world_size} (generation {generation}) at {}; {}",
                            wait::rank_list(&missing),
                            self.location,
                            notes.progress()
                        );
                    }
                }
                Err(StoreError::Timeout { .. }) => {
                    let missing = self.missing().await?;
                    return Err(RendezvousError::Incomplete {
                        generation,
                        arrived: world_size - missing.len(),
                        missing,
                        world_size,
                        waited: started.elapsed(),
                        location: self.scoped.location(),
                    });
                }
                Err(other) => return Err(other.into()),
            }
        }
    }

    /// Reads every rank's record, once all are published.
    async fn membership(&self) -> Result<Membership, RendezvousError> {
        let keys = self.peer_keys();
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let values = self.scoped.multi_get(&key_refs).await?;
        // Every key exists now and is never written again: every rank sees
        // the same values, so all of them fail on a conflict, or none.
        if let Some(conflict) = values.iter().find_map(|v| conflict_in(v)) {
            return Err(conflict_seen(&self.scoped, self.rank, self.world_size, conflict).await);
        }
        let mut peers = Vec::with_capacity(self.world_size);
        for (r, bytes) in values.iter().enumerate() {
            let peer = PeerRecord::decode(bytes).map_err(|e| RendezvousError::BadRecord {
                rank: r,
                reason: e.to_string(),
            })?;
            if peer.rank as usize != r {
                return Err(RendezvousError::BadRecord {
                    rank: r,
                    reason: format!("it says it is rank {}", peer.rank),
                });
            }
            peers.push(peer);
        }
        Ok(Membership {
            generation: self.generation,
            rank: self.rank,
            peers,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::HashStore;
    use std::collections::HashMap;

    fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn urls_parse_like_pytorch() {
        match InitMethod::parse("tcp://10.1.2.3:23456?rank=1&world_size=4").unwrap() {
            InitMethod::Tcp {
                host,
                port,
                rank,
                world_size,
            } => assert_eq!(
                (host.as_str(), port, rank, world_size),
                ("10.1.2.3", 23456, Some(1), Some(4))
            ),
            other => panic!("{other:?}"),
        }
        match InitMethod::parse("tcp://[::1]:29500").unwrap() {
            InitMethod::Tcp { host, .. } => assert_eq!(host, "::1"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            InitMethod::parse("file:///tmp/store").unwrap(),
            InitMethod::File { .. }
        ));
        match InitMethod::parse("FILE://localhost/tmp/a%20store?world_size=2").unwrap() {
            InitMethod::File { path, world_size, .. } => {
                assert_eq!((path, world_size), (PathBuf::from("/tmp/a store"), Some(2)))
            }
            other => panic!("{other:?}"),
        }
        match InitMethod::parse("tcp://node-1.cluster:29500/").unwrap() {
            InitMethod::Tcp { host, port, .. } => assert_eq!((host.as_str(), port), ("node-1.cluster", 29500)),
            other => panic!("{other:?}"),
        }
        assert!(matches!(InitMethod::parse("env://").unwrap(), InitMethod::Env));
        for bad in [
            "tcp://host",
            "udp://h:1",
            "tcp://h:1?rank=x",
            "tcp://h:1?color=red",
            "nonsense",
            "env://?rank=1",
            "tcp://h:65536",
            "tcp://h:1/path",
            "tcp://user@h:1",
            "tcp://[::1:1",
            "tcp://:1",
            "file://relative/path",
            "env://host",
            "tcp://h:1#frag",
        ] {
            assert!(
                matches!(InitMethod::parse(bad), Err(RendezvousError::BadUrl { .. })),
                "{bad}"
            );
        }
    }

    #[test]
    fn explicit_arguments_beat_url_beat_environment() {
        let env = lookup(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "8"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ]);
        let url = InitMethod::parse("tcp://h:1?rank=1&world_size=4").unwrap();
        let c = resolve(url.clone(), Some(0), None, &env).unwrap();
        assert_eq!((c.rank, c.world_size), (0, 4));
        let c = resolve(url, None, None, &env).unwrap();
        assert_eq!((c.rank, c.world_size), (1, 4));
        let c = resolve(InitMethod::Env, None, None, &env).unwrap();
        assert_eq!((c.rank, c.world_size), (2, 8));
    }

    #[test]
    fn explicit_rank_and_world_size_ignore_a_half_set_environment() {
        // torch's test harness exports WORLD_SIZE and MASTER_ADDR, then passes
        // rank and world size to init_process_group with a file:// store.
        let env = lookup(&[("WORLD_SIZE", "3"), ("MASTER_ADDR", "h")]);
        let file = InitMethod::parse("file:///tmp/s").unwrap();
        let c = resolve(file.clone(), Some(1), Some(2), &env).unwrap();
        assert_eq!((c.rank, c.world_size, c.launcher), (1, 2, None));
        let store = InitMethod::Store(Arc::new(HashStore::default()));
        assert_eq!(resolve(store, Some(0), Some(2), &env).unwrap().rank, 0);
        // Where the environment must supply something, its error stands.
        let missing = resolve(file, None, Some(2), &env).unwrap_err().to_string();
        assert!(missing.starts_with("RANK is not set"), "{missing}");
        assert!(resolve(InitMethod::Env, Some(0), Some(2), &env).is_err());
    }

    #[test]
    fn a_given_store_is_not_scoped_by_the_launchers_restart_count() {
        // Under a per-worker restart policy, two ranks of one group carry
        // different restart counts; a store the caller made must not split them.
        for count in ["1", "2"] {
            let launched = [
                ("RANK", "1"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "h"),
                ("MASTER_PORT", "29500"),
                ("LOCAL_RANK", "1"),
                ("LOCAL_WORLD_SIZE", "2"),
                ("GROUP_RANK", "0"),
                ("TORCHELASTIC_RUN_ID", "job"),
                ("TORCHELASTIC_RESTART_COUNT", count),
            ];
            let env = lookup(&launched);
            let store = InitMethod::Store(Arc::new(HashStore::default()));
            let c = resolve(store, Some(0), Some(2), &env).unwrap();
            assert_eq!(c.generation, 0, "restart count {count}");
            let from_env = resolve(InitMethod::Env, None, None, &env).unwrap();
            assert_eq!(from_env.generation.to_string(), count);
        }
    }

    #[test]
    fn etcd_urls_take_endpoint_lists_and_a_prefix() {
        match InitMethod::parse("etcd://h1:1,h2/jobs/a?rank=1&world_size=2").unwrap() {
            InitMethod::Etcd {
                endpoints,
                prefix,
                rank,
                world_size,
            } => {
                assert_eq!(endpoints, ["h1:1", "h2:2379"]);
                assert_eq!((prefix.as_str(), rank, world_size), ("/jobs/a", Some(1), Some(2)));
            }
            other => panic!("{other:?}"),
        }
        for bad in ["etcd://", "etcd://h:x", "etcd://h?colour=red"] {
            assert!(
                matches!(InitMethod::parse(bad), Err(RendezvousError::BadUrl { .. })),
                "{bad}"
            );
        }
    }

    #[test]
    fn env_meets_on_chorus_store_when_the_launcher_names_one() {
        let mut vars = vec![
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
            (STORE_ENV, "etcd://[::1]:7/p"),
        ];
        let config = resolve(InitMethod::Env, None, None, &lookup(&vars)).unwrap();
        assert!(
            matches!(&config.store, StoreSpec::Etcd { endpoints, prefix } if endpoints == &["[::1]:7"] && prefix == "/p")
        );
        assert_eq!(config.master_host(), Some("::1"));
        vars.push((STORE_ENV, "etcd://h:7?rank=1"));
        vars.swap_remove(4);
        assert!(matches!(
            resolve(InitMethod::Env, None, None, &lookup(&vars)),
            Err(RendezvousError::BadUrl { .. })
        ));
    }

    #[test]
    fn rank_zero_serves_unless_the_launcher_does() {
        let mut vars = vec![
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ];
        assert!(
            resolve(InitMethod::Env, None, None, &lookup(&vars))
                .unwrap()
                .serve_store
        );
        vars.push(("TORCHELASTIC_USE_AGENT_STORE", "True"));
        assert!(
            !resolve(InitMethod::Env, None, None, &lookup(&vars))
                .unwrap()
                .serve_store
        );
    }

    #[test]
    fn env_init_names_what_is_missing() {
        let err = resolve(InitMethod::Env, None, None, &lookup(&[])).unwrap_err();
        assert!(err.to_string().contains("MASTER_ADDR"), "{err}");
        let err = resolve(
            InitMethod::Env,
            None,
            None,
            &lookup(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")]),
        )
        .unwrap_err();
        assert!(err.to_string().contains("MASTER_PORT"), "{err}");
        let err = resolve(InitMethod::parse("tcp://h:1").unwrap(), None, None, &lookup(&[])).unwrap_err();
        assert!(matches!(err, RendezvousError::MissingRank));
        let err = resolve(
            InitMethod::parse("tcp://h:1?rank=4&world_size=4").unwrap(),
            None,
            None,
            &lookup(&[]),
        )
        .unwrap_err();
        assert!(matches!(
            err,
            RendezvousError::RankOutOfRange { rank: 4, world_size: 4 }
        ));
    }

    fn config(store: &HashStore, rank: usize, world_size: usize) -> RendezvousConfig {
        RendezvousConfig {
            store: StoreSpec::Given(Arc::new(store.clone())),
            rank,
            world_size,
            local_rank: None,
            local_world_size: None,
            generation: 0,
            run_id: "t".into(),
            launcher: None,
            serve_store: false,
        }
    }

    fn record(pid: u32) -> PeerRecord {
        PeerRecord {
            rank: 0,
            host: HostId::local(),
            pid,
            addrs: vec!["127.0.0.1".parse().unwrap()],
            extras: vec![],
        }
    }

    #[tokio::test]
    async fn every_rank_learns_every_record() {
        let store = HashStore::default();
        let mut tasks = Vec::new();
        for rank in 0..5 {
            let cfg = config(&store, rank, 5);
            let store: Arc<dyn Store> = Arc::new(store.clone());
            tasks.push(tokio::spawn(async move {
                rendezvous(store, &cfg, record(100 + rank as u32), Duration::from_secs(10)).await
            }));
        }
        for (rank, task) in tasks.into_iter().enumerate() {
            let m = tokio::time::timeout(Duration::from_secs(20), task)
                .await
                .expect("rendezvous hung")
                .unwrap()
                .unwrap();
            assert_eq!(m.rank, rank);
            assert_eq!(
                m.peers.iter().map(|p| p.pid).collect::<Vec<_>>(),
                vec![100, 101, 102, 103, 104]
            );
            assert_eq!(m.local_ranks(), vec![0, 1, 2, 3, 4]);
        }
    }

    #[tokio::test]
    async fn duplicate_ranks_and_world_mismatch_are_named() {
        let store = HashStore::default();
        let shared: Arc<dyn Store> = Arc::new(store.clone());
        let first = tokio::spawn({
            let cfg = config(&store, 0, 2);
            let shared = shared.clone();
            async move { rendezvous(shared, &cfg, record(1), Duration::from_secs(10)).await }
        });
        store.wait(&["chorus/t/g0/rank/0"]).await.unwrap();
        let err = rendezvous(shared.clone(), &config(&store, 0, 2), record(2), Duration::from_secs(1))
            .await
            .unwrap_err();
        match &err {
            RendezvousError::DuplicateRank { rank: 0, first, second } => assert_eq!((first.pid, second.pid), (1, 2)),
            other => panic!("expected a duplicate rank error, got {other}"),
        }
        let err = rendezvous(shared.clone(), &config(&store, 1, 3), record(3), Duration::from_secs(1))
            .await
            .unwrap_err();
        assert!(
            matches!(err, RendezvousError::WorldSizeMismatch { ours: 3, theirs: 2, .. }),
            "{err}"
        );
        // The conflicts failed the generation: rank 0 and a late rank 1 are told.
        let late = rendezvous(shared, &config(&store, 1, 2), record(4), Duration::from_secs(10)).await;
        assert!(matches!(late, Err(RendezvousError::Conflict { .. })), "{late:?}");
        let first = first.await.unwrap();
        assert!(matches!(first, Err(RendezvousError::Conflict { .. })), "{first:?}");
    }

    /// Starts `rendezvous` for `rank` of `world` in a task, with a long timeout.
    fn start(
        store: &HashStore,
        rank: usize,
        world: usize,
        pid: u32,
    ) -> tokio::task::JoinHandle<Result<Membership, RendezvousError>> {
        let cfg = config(store, rank, world);
        let shared: Arc<dyn Store> = Arc::new(store.clone());
        tokio::spawn(async move { rendezvous(shared, &cfg, record(pid), Duration::from_secs(300)).await })
    }

    /// The task's outcome, which must come within 5 s (not at the 300 s timeout).
    async fn soon(
        task: tokio::task::JoinHandle<Result<Membership, RendezvousError>>,
    ) -> Result<Membership, RendezvousError> {
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("the rank kept waiting for the rendezvous timeout")
            .unwrap()
    }

    #[tokio::test]
    async fn a_world_size_conflict_fails_every_waiting_rank_at_once_with_its_message() {
        let store = HashStore::default();
        let rank0 = start(&store, 0, 2, 1);
        store.wait(&["chorus/t/g0/rank/0"]).await.unwrap();
        let found = soon(start(&store, 1, 3, 2)).await.unwrap_err();
        assert!(matches!(found, RendezvousError::WorldSizeMismatch { .. }), "{found}");
        match soon(rank0).await.unwrap_err() {
            RendezvousError::Conflict { message } => assert_eq!(message, found.to_string()),
            other => panic!("expected the conflict, got {other}"),
        }
    }

    #[tokio::test]
    async fn a_rank_claimed_twice_fails_every_rank_at_once_and_later_arrivals_too() {
        let store = HashStore::default();
        let rank0 = start(&store, 0, 3, 1);
        let rank1 = start(&store, 1, 3, 2);
        store.wait(&["chorus/t/g0/rank/0", "chorus/t/g0/rank/1"]).await.unwrap();
        let found = soon(start(&store, 1, 3, 3)).await.unwrap_err();
        assert!(
            matches!(found, RendezvousError::DuplicateRank { rank: 1, .. }),
            "{found}"
        );
        for waiting in [rank0, rank1] {
            match soon(waiting).await.unwrap_err() {
                RendezvousError::Conflict { message } => assert_eq!(message, found.to_string()),
                other => panic!("expected the conflict, got {other}"),
            }
        }
        // Rank 2, the one nobody started, comes late: it is told too.
        match soon(start(&store, 2, 3, 4)).await.unwrap_err() {
            RendezvousError::Conflict { message } => assert_eq!(message, found.to_string()),
            other => panic!("expected the conflict, got {other}"),
        }
    }

    #[tokio::test]
    async fn an_extra_process_after_the_group_formed_fails_alone() {
        let store = HashStore::default();
        let (rank0, rank1) = (start(&store, 0, 2, 1), start(&store, 1, 2, 2));
        soon(rank0).await.unwrap();
        soon(rank1).await.unwrap();
        let extra = soon(start(&store, 1, 2, 3)).await.unwrap_err();
        assert!(matches!(extra, RendezvousError::DuplicateRank { .. }), "{extra}");
        // The formed group's records are untouched.
        let peer = store.get("chorus/t/g0/peer/1").await.unwrap();
        assert_eq!(PeerRecord::decode(&peer).unwrap().pid, 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_missing_rank_is_named_on_timeout() {
        let store = HashStore::default();
        let err = rendezvous(
            Arc::new(store.clone()),
            &config(&store, 1, 3),
            record(1),
            Duration::from_secs(5),
        )
        .await
        .unwrap_err();
        match err {
            RendezvousError::Incomplete { missing, arrived, .. } => {
                assert_eq!(missing, vec![0, 2]);
                assert_eq!(arrived, 1);
            }
            other => panic!("expected an incomplete rendezvous, got {other}"),
        }
    }

    #[tokio::test]
    async fn generations_do_not_see_each_other() {
        let store = HashStore::default();
        let mut cfg = config(&store, 0, 1);
        rendezvous(Arc::new(store.clone()), &cfg, record(1), Duration::from_secs(1))
            .await
            .unwrap();
        cfg.generation = 1;
        // The same rank claimed again in a new generation is no duplicate.
        let m = rendezvous(Arc::new(store.clone()), &cfg, record(2), Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!((m.generation, m.peers[0].pid), (1, 2));
    }
}
