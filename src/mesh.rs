//! Building a group's links: which transport each peer gets, what a rank
//! publishes for it, and checking what peers published.
//!
//! Before rendezvous, `MeshPlan::prepare` makes this rank's QUIC identity
//! and endpoint, its shared-memory endpoint, and the extras to publish
//! (`quic`: port and certificate fingerprint; `shm`: the ring nonce; `mac`:
//! the record's HMAC under the job secret). After it, `MeshPlan::connect`
//! verifies every peer's signature, picks each peer's path (`auto`: shared
//! memory with peers that share `/dev/shm`, QUIC with the others), connects, then
//! wraps the links with `CHORUS_FAULTS`.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Once};
use std::time::Duration;

use chorus_runtime::rendezvous::{Membership, PeerRecord};
use chorus_runtime::wait;
use chorus_transports::auth::JobSecret;
use chorus_transports::fault::{FaultPlan, FaultSpecError, wrap_links};
use chorus_transports::link::{Link, TransportError};
use chorus_transports::netif;
use chorus_transports::quic::{Fingerprint, QuicEndpoint, QuicIdentity, QuicOptions, QuicPeer};
use chorus_transports::shm::{ShmEndpoint, ShmOptions, ShmPeer};
use thiserror::Error;

const QUIC_EXTRA: &str = "quic";
const SHM_EXTRA: &str = "shm";
const MAC_EXTRA: &str = "mac";

/// Why the mesh could not be built.
#[derive(Debug, Error)]
pub enum MeshError {
    /// `CHORUS_TRANSPORT` names no transport.
    #[error(
        "CHORUS_TRANSPORT={0:?} is not a transport; use auto, quic or shm (local is for ranks in one process, chorus::spawn)"
    )]
    UnknownTransport(String),
    /// `CHORUS_TRANSPORT=shm` with a peer that does not share `/dev/shm`.
    #[error(
        "CHORUS_TRANSPORT=shm, but rank {rank} on {host} does not share this process's /dev/shm (another host or container); use auto or quic"
    )]
    NotOnThisHost {
        /// The peer.
        rank: usize,
        /// Its host.
        host: String,
    },
    /// `CHORUS_FAULTS` does not parse, or names a rank outside the world.
    // Not a `source`: the message already holds it, and printed with its
    // chain it would say it twice.
    #[error("CHORUS_FAULTS: {0}")]
    Faults(FaultSpecError),
    /// A peer's record is not signed with this job's secret.
    #[error(
        "rank {rank} (pid {pid} on {host}) published a record not signed with this job's secret; every rank must get the same CHORUS_JOB_SECRET (chorus launch hands it out)"
    )]
    Unauthenticated {
        /// The peer.
        rank: usize,
        /// Its pid.
        pid: u32,
        /// Its host.
        host: String,
    },
    /// A peer published no way to reach it.
    #[error("rank {rank} published no {what}; is it running another chorus version?")]
    MissingEndpoint {
        /// The peer.
        rank: usize,
        /// What is missing.
        what: &'static str,
    },
    /// A peer on another host published only loopback addresses.
    #[error("rank {rank} on {host} published only loopback addresses; set CHORUS_SOCKET_IFNAME there")]
    Unreachable {
        /// The peer.
        rank: usize,
        /// Its host.
        host: String,
    },
    /// The transport failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
}

/// Which transport links between processes use (`CHORUS_TRANSPORT`).
/// Ranks in one process ([`crate::spawn`]) always use in-process links.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportChoice {
    /// Shared memory with peers on this host, QUIC with the others.
    Auto,
    /// QUIC for every peer.
    Quic,
    /// Shared memory for every peer (all must be on this host).
    Shm,
}

impl TransportChoice {
    /// The choice in `CHORUS_TRANSPORT` (auto when unset).
    pub fn from_env() -> Result<Self, MeshError> {
        match std::env::var("CHORUS_TRANSPORT").ok().as_deref().map(str::trim) {
            None | Some("") | Some("auto") => Ok(TransportChoice::Auto),
            Some("quic") => Ok(TransportChoice::Quic),
            Some("shm") => Ok(TransportChoice::Shm),
            Some(other) => Err(MeshError::UnknownTransport(other.to_string())),
        }
    }
}

/// The plan in `CHORUS_FAULTS`, if set, checked against a world of `world`
/// ranks.
pub(crate) fn faults_from_env(world: usize) -> Result<Option<FaultPlan>, MeshError> {
    let plan = FaultPlan::from_env().map_err(MeshError::Faults)?;
    if let Some(plan) = &plan {
        plan.check_world(world).map_err(MeshError::Faults)?;
    }
    Ok(plan)
}

/// Outgoing ring size per peer for a few local peers. Every message of a
/// collective goes in segments of at most 1 MiB, so the ring only holds how
/// far a sender runs ahead of its peer: 48 MiB was as fast as 64 MiB for a
/// 64 MiB all-reduce and 32 MiB was not (BENCHMARKS 21). Both rings of a
/// link count in each process's resident memory once used.
const SHM_RING: usize = 48 << 20;

/// Outgoing ring size per peer: [`SHM_RING`] for a few local peers, less
/// per peer for many, so a rank maps at most ~256 MiB.
fn shm_capacity(local_peers: usize) -> usize {
    (256usize << 20)
        .checked_div(local_peers)
        .map_or(SHM_RING, |share| share.clamp(4 << 20, SHM_RING))
}

/// This rank's side of the mesh, made before rendezvous.
#[derive(Debug)]
pub(crate) struct MeshPlan {
    choice: TransportChoice,
    endpoint: QuicEndpoint,
    shm_nonce: u64,
    fingerprint: Fingerprint,
    secret: Option<JobSecret>,
    faults: Option<FaultPlan>,
}

/// The message a record's MAC covers: the job, the generation and every
/// field but the MAC itself, so a record cannot be replayed elsewhere.
fn signed_message(run_id: &str, generation: u64, record: &PeerRecord) -> Vec<u8> {
    let mut unsigned = record.clone();
    unsigned.extras.retain(|(name, _)| name != MAC_EXTRA);
    let mut message = format!("chorus-record/{run_id}/g{generation}/").into_bytes();
    message.extend(unsigned.encode());
    message
}

fn quic_extra(record: &PeerRecord) -> Option<(u16, Fingerprint)> {
    let bytes = record.extra(QUIC_EXTRA)?;
    let port = u16::from_le_bytes(bytes.get(..2)?.try_into().ok()?);
    let fingerprint = bytes.get(2..34)?.try_into().ok()?;
    Some((port, fingerprint))
}

impl MeshPlan {
    /// Makes the identity and endpoint, on loopback with loopback tuning when
    /// the whole job is on this host, on every interface otherwise; ranks
    /// are below `world` (the fault plan is checked against it); the mesh
    /// must form within `timeout`.
    pub(crate) fn prepare(rank: usize, world: usize, single_host: bool, timeout: Duration) -> Result<Self, MeshError> {
        let choice = TransportChoice::from_env()?;
        let faults = faults_from_env(world)?;
        let secret = JobSecret::from_env();
        if secret.is_none() {
            static WARN: Once = Once::new();
            WARN.call_once(|| {
                tracing::warn!("CHORUS_JOB_SECRET is not set: the mesh is only as trusted as the store");
            });
        }
        let identity = QuicIdentity::generate()?;
        let ip = if single_host {
            IpAddr::from([127, 0, 0, 1])
        } else {
            IpAddr::from([0, 0, 0, 0])
        };
        let options = QuicOptions {
            connect_timeout: timeout,
            ..QuicOptions::default()
        };
        let endpoint = QuicEndpoint::bind(rank, ip, &identity, options)?;
        // The shared-memory endpoint is made once the local peers are known;
        // its nonce names the rings and is published now.
        let shm_nonce = ShmEndpoint::new(rank, ShmOptions::default())?.nonce();
        Ok(Self {
            choice,
            shm_nonce,
            endpoint,
            fingerprint: identity.fingerprint(),
            secret,
            faults,
        })
    }

    /// Adds this rank's transport entries (and signature) to its record.
    pub(crate) fn publish(&self, record: &mut PeerRecord, run_id: &str, generation: u64) {
        let mut quic = self.endpoint.local_addr().port().to_le_bytes().to_vec();
        quic.extend_from_slice(&self.fingerprint);
        record.extras.push((QUIC_EXTRA.to_string(), quic));
        record
            .extras
            .push((SHM_EXTRA.to_string(), self.shm_nonce.to_le_bytes().to_vec()));
        if let Some(secret) = &self.secret {
            let tag = secret.sign(&signed_message(run_id, generation, record));
            record.extras.push((MAC_EXTRA.to_string(), tag.to_vec()));
        }
    }

    /// Verifies the peers' records and connects to every peer, over shared
    /// memory or QUIC as [`TransportChoice`] says.
    pub(crate) async fn connect(
        self,
        membership: &Membership,
        run_id: &str,
        timeout: Duration,
    ) -> Result<(QuicEndpoint, Vec<Option<Arc<dyn Link>>>), MeshError> {
        let me = membership.me();
        let mut quic_peers = Vec::new();
        let mut shm_peers = Vec::new();
        for peer in membership.peers.iter().filter(|peer| peer.rank != me.rank) {
            let rank = peer.rank as usize;
            if let Some(secret) = &self.secret {
                let message = signed_message(run_id, membership.generation, peer);
                if !peer.extra(MAC_EXTRA).is_some_and(|tag| secret.verify(&message, tag)) {
                    return Err(MeshError::Unauthenticated {
                        rank,
                        pid: peer.pid,
                        host: peer.host.hostname.clone(),
                    });
                }
            }
            let same_shm = peer.host.same_shm(&me.host);
            let use_shm = match self.choice {
                TransportChoice::Auto => same_shm,
                TransportChoice::Quic => false,
                TransportChoice::Shm if same_shm => true,
                TransportChoice::Shm => {
                    return Err(MeshError::NotOnThisHost {
                        rank,
                        host: peer.host.hostname.clone(),
                    });
                }
            };
            if use_shm {
                let nonce = peer
                    .extra(SHM_EXTRA)
                    .and_then(|b| b.try_into().ok())
                    .map(u64::from_le_bytes)
                    .ok_or(MeshError::MissingEndpoint {
                        rank,
                        what: "shared-memory nonce",
                    })?;
                shm_peers.push(ShmPeer { rank, nonce });
                continue;
            }
            let (port, fingerprint) = quic_extra(peer).ok_or(MeshError::MissingEndpoint {
                rank,
                what: "QUIC endpoint",
            })?;
            let ip = netif::peer_address(&peer.addrs, peer.host.same_network(&me.host)).ok_or_else(|| {
                MeshError::Unreachable {
                    rank,
                    host: peer.host.hostname.clone(),
                }
            })?;
            quic_peers.push(QuicPeer {
                rank,
                addr: SocketAddr::new(ip, port),
                fingerprint,
            });
        }
        let mut links: Vec<Option<Arc<dyn Link>>> = (0..membership.world_size()).map(|_| None).collect();
        // Both sides connect at once, each within `timeout`, and a failure
        // names the peers and addresses that did not answer.
        let shm = async {
            if shm_peers.is_empty() {
                return Ok(Vec::new());
            }
            let options = ShmOptions {
                capacity: shm_capacity(shm_peers.len()),
                connect_timeout: timeout,
                ..ShmOptions::default()
            };
            ShmEndpoint::with_nonce(membership.rank, self.shm_nonce, options)
                .connect_mesh(&shm_peers)
                .await
        };
        let quic = async {
            if quic_peers.is_empty() {
                return Ok(Vec::new());
            }
            self.endpoint.connect_mesh(&quic_peers).await
        };
        let waiting_for = || {
            let shm: Vec<usize> = shm_peers.iter().map(|p| p.rank).collect();
            let quic: Vec<String> = quic_peers.iter().map(|p| format!("{} at {}", p.rank, p.addr)).collect();
            format!(
                "rank {}: connecting to its peers (shared memory: ranks [{}]; QUIC: ranks [{}])",
                membership.rank,
                wait::rank_list(&shm),
                quic.join(", ")
            )
        };
        let (shm, quic) = wait::noting(async { tokio::join!(shm, quic) }, timeout, waiting_for).await;
        // Each list is indexed by rank, `None` where the other side serves.
        for side in [shm?, quic?] {
            for (rank, link) in side.into_iter().enumerate() {
                if link.is_some() {
                    links[rank] = link;
                }
            }
        }
        let links = match self.faults {
            Some(plan) => wrap_links(membership.rank, links, plan),
            None => links,
        };
        Ok((self.endpoint, links))
    }
}
