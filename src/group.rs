//! [`init_process_group`]: from an init method to a formed group.
//!
//! The steps, each in its own layer: resolve the configuration
//! (`rendezvous::resolve`, reading the launcher's environment), open the
//! store (rank 0 serves `tcp://`), choose the addresses to publish
//! (`netif::local_addresses`: the route to the master first, loopback last),
//! prepare this rank's endpoint (`mesh`), exchange records
//! (`rendezvous::rendezvous`), then connect to every peer.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use chorus_runtime::rendezvous::{
    self, HostId, InitMethod, Membership, PeerRecord, RendezvousConfig, RendezvousError,
};
use chorus_runtime::store::{DEFAULT_TIMEOUT, Store, StoreError, TcpStoreServer};
use chorus_transports::link::Link;
use chorus_transports::netif::{self, NetifError};
use chorus_transports::quic::QuicEndpoint;
use thiserror::Error;

use crate::mesh::{MeshError, MeshPlan};

/// Why a group could not be formed.
#[derive(Debug, Error)]
pub enum InitError {
    /// Configuration, store or exchange failed.
    #[error(transparent)]
    Rendezvous(#[from] RendezvousError),
    /// No address could be chosen to publish.
    #[error(transparent)]
    Netif(#[from] NetifError),
    /// The store failed after rendezvous (e.g. in a barrier).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The links to the peers could not be made.
    #[error(transparent)]
    Mesh(#[from] MeshError),
}

/// What [`init_process_group`] needs; PyTorch's arguments by other names.
#[derive(Debug, Clone)]
pub struct InitOptions {
    /// How ranks meet (`env://` by default, as in PyTorch).
    pub init_method: InitMethod,
    /// This rank, when not in the URL or the environment.
    pub rank: Option<usize>,
    /// The world size, when not in the URL or the environment.
    pub world_size: Option<usize>,
    /// Limit on connecting to the store and on the whole exchange.
    pub timeout: Duration,
}

impl Default for InitOptions {
    fn default() -> Self {
        Self {
            init_method: InitMethod::Env,
            rank: None,
            world_size: None,
            timeout: DEFAULT_TIMEOUT,
        }
    }
}

impl InitOptions {
    /// Options for an init URL (`tcp://host:port`, `file:///path`, `env://`).
    pub fn from_url(url: &str) -> Result<Self, InitError> {
        Ok(Self {
            init_method: InitMethod::parse(url)?,
            ..Self::default()
        })
    }

    /// Sets the rank.
    pub fn rank(mut self, rank: usize) -> Self {
        self.rank = Some(rank);
        self
    }

    /// Sets the world size.
    pub fn world_size(mut self, world_size: usize) -> Self {
        self.world_size = Some(world_size);
        self
    }

    /// Sets the timeout.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

/// A formed group: this rank's place, every peer's record, and the store.
///
/// Call [`ProcessGroup::destroy`] when done (PyTorch's
/// `destroy_process_group`): it waits until every rank is done with the
/// store, which rank 0 serves for `tcp://`.
#[derive(Debug)]
pub struct ProcessGroup {
    config: RendezvousConfig,
    membership: Membership,
    store: Arc<dyn Store>,
    timeout: Duration,
    server: Option<TcpStoreServer>,
    links: Vec<Option<Arc<dyn Link>>>,
    /// Kept alive for the links' connections.
    _endpoint: QuicEndpoint,
}

/// Forms the group: resolves the configuration, opens the store, publishes
/// this rank's addresses and waits for every peer's.
pub async fn init_process_group(options: InitOptions) -> Result<ProcessGroup, InitError> {
    let env = |name: &str| std::env::var(name).ok();
    let config = rendezvous::resolve(options.init_method, options.rank, options.world_size, &env)?;
    let opened = rendezvous::open_store(&config, options.timeout).await?;
    let master = match config.master_host() {
        Some(host) => tokio::net::lookup_host((host, 0))
            .await
            .ok()
            .and_then(|mut addrs| addrs.next())
            .map(|a| a.ip()),
        None => None,
    };
    let addrs = netif::local_addresses(master, &env)?;
    let plan = MeshPlan::prepare(config.rank, master.is_some_and(|ip| ip.is_loopback()))?;
    let mut record = PeerRecord {
        rank: config.rank as u32,
        host: HostId::local(),
        pid: std::process::id(),
        addrs,
        extras: Vec::new(),
    };
    plan.publish(&mut record, &config.run_id, config.generation);
    let membership = rendezvous::rendezvous(opened.store.clone(), &config, record, options.timeout).await?;
    let (endpoint, links) = plan.connect(&membership, &config.run_id, options.timeout).await?;
    tracing::info!(
        rank = membership.rank,
        world_size = membership.world_size(),
        generation = membership.generation,
        store = %opened.store.location(),
        "process group formed"
    );
    Ok(ProcessGroup {
        config,
        membership,
        store: opened.store,
        timeout: options.timeout,
        server: opened.server,
        links,
        _endpoint: endpoint,
    })
}

impl ProcessGroup {
    /// This rank.
    pub fn rank(&self) -> usize {
        self.membership.rank
    }

    /// How many ranks.
    pub fn world_size(&self) -> usize {
        self.membership.world_size()
    }

    /// The rank among those on this host: the launcher's `LOCAL_RANK` when
    /// one said, else counted from the peers' host identities.
    pub fn local_rank(&self) -> usize {
        self.config.local_rank.unwrap_or_else(|| {
            self.membership
                .local_ranks()
                .iter()
                .position(|&r| r == self.rank())
                .expect("a rank is always local to itself")
        })
    }

    /// The generation of this group (0 unless restarted).
    pub fn generation(&self) -> u64 {
        self.membership.generation
    }

    /// Every rank's published record, indexed by rank.
    pub fn peers(&self) -> &[PeerRecord] {
        &self.membership.peers
    }

    /// The address to reach `rank` at from here: loopback when it shares this
    /// host, its first routable address otherwise; `None` when it published
    /// only loopback from another host.
    pub fn peer_address(&self, rank: usize) -> Option<IpAddr> {
        let peer = self.membership.peers.get(rank)?;
        netif::peer_address(&peer.addrs, peer.host == self.membership.me().host)
    }

    /// This rank's link to `rank` (`None` for itself or out of range).
    pub fn link(&self, rank: usize) -> Option<&Arc<dyn Link>> {
        self.links.get(rank)?.as_ref()
    }

    /// The store the group met on.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// Waits until every rank has reached the barrier named `name`.
    pub async fn store_barrier(&self, name: &str) -> Result<(), InitError> {
        let prefix = format!("chorus/{}/g{}/barrier/{name}", self.config.run_id, self.generation());
        let arrived = self.store.add(&format!("{prefix}/count"), 1).await?;
        if arrived as usize == self.world_size() {
            self.store.set(&format!("{prefix}/done"), b"1").await?;
        }
        self.store
            .wait_timeout(&[&format!("{prefix}/done")], self.timeout)
            .await?;
        Ok(())
    }

    /// Leaves the group once every rank is leaving, so rank 0 stops serving
    /// the store only when nobody needs it.
    pub async fn destroy(self) -> Result<(), InitError> {
        self.store_barrier("destroy").await?;
        let ProcessGroup { store, server, .. } = self;
        // Our own connection must not hold the server's shutdown open.
        drop(store);
        if let Some(server) = server {
            server.shutdown().await;
        }
        Ok(())
    }
}
