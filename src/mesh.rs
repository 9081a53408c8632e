//! Building a group's links: which transport each peer gets, what a rank
//! publishes for it, and checking what peers published.
//!
//! Before rendezvous, [`MeshPlan::prepare`] makes this rank's QUIC identity
//! and endpoint and the extras to publish (`quic`: port and certificate
//! fingerprint; `mac`: the record's HMAC under the job secret). After it,
//! [`MeshPlan::connect`] verifies every peer's signature, pins their
//! fingerprints and connects, then wraps the links with `CHORUS_FAULTS`.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Once};
use std::time::Duration;

use chorus_runtime::rendezvous::{Membership, PeerRecord};
use chorus_transports::auth::JobSecret;
use chorus_transports::fault::{FaultPlan, FaultSpecError, wrap_links};
use chorus_transports::link::{Link, TransportError};
use chorus_transports::netif;
use chorus_transports::quic::{Fingerprint, QuicEndpoint, QuicIdentity, QuicOptions, QuicPeer};
use thiserror::Error;

const QUIC_EXTRA: &str = "quic";
const MAC_EXTRA: &str = "mac";

/// Why the mesh could not be built.
#[derive(Debug, Error)]
pub enum MeshError {
    /// `CHORUS_TRANSPORT` names no transport.
    #[error("CHORUS_TRANSPORT={0:?} is not a transport; use auto, quic or local")]
    UnknownTransport(String),
    /// `CHORUS_FAULTS` does not parse.
    #[error("CHORUS_FAULTS: {0}")]
    Faults(#[from] FaultSpecError),
    /// A peer's record is not signed with this job's secret.
    #[error("rank {rank} (pid {pid} on {host}) published a record not signed with this job's secret; every rank must get the same CHORUS_JOB_SECRET (chorus launch hands it out)")]
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

/// Which transport links use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportChoice {
    /// The best path per peer.
    Auto,
    /// QUIC for every peer.
    Quic,
}

impl TransportChoice {
    /// The choice in `CHORUS_TRANSPORT` (auto when unset).
    pub fn from_env() -> Result<Self, MeshError> {
        match std::env::var("CHORUS_TRANSPORT").ok().as_deref().map(str::trim) {
            None | Some("") | Some("auto") => Ok(TransportChoice::Auto),
            Some("quic") => Ok(TransportChoice::Quic),
            Some(other) => Err(MeshError::UnknownTransport(other.to_string())),
        }
    }
}

/// This rank's side of the mesh, made before rendezvous.
#[derive(Debug)]
pub(crate) struct MeshPlan {
    endpoint: QuicEndpoint,
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
    /// the whole job is on this host, on every interface otherwise.
    pub(crate) fn prepare(rank: usize, single_host: bool) -> Result<Self, MeshError> {
        TransportChoice::from_env()?;
        let faults = FaultPlan::from_env()?;
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
        let endpoint = QuicEndpoint::bind(rank, ip, &identity, QuicOptions::default())?;
        Ok(Self {
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
        if let Some(secret) = &self.secret {
            let tag = secret.sign(&signed_message(run_id, generation, record));
            record.extras.push((MAC_EXTRA.to_string(), tag.to_vec()));
        }
    }

    /// Verifies the peers' records and connects to every peer.
    pub(crate) async fn connect(
        self,
        membership: &Membership,
        run_id: &str,
        timeout: Duration,
    ) -> Result<(QuicEndpoint, Vec<Option<Arc<dyn Link>>>), MeshError> {
        let me = membership.me();
        let mut peers = Vec::new();
        for peer in &membership.peers {
            if let Some(secret) = &self.secret {
                let message = signed_message(run_id, membership.generation, peer);
                if !peer.extra(MAC_EXTRA).is_some_and(|tag| secret.verify(&message, tag)) {
                    return Err(MeshError::Unauthenticated {
                        rank: peer.rank as usize,
                        pid: peer.pid,
                        host: peer.host.hostname.clone(),
                    });
                }
            }
            let (port, fingerprint) = quic_extra(peer).ok_or(MeshError::MissingEndpoint {
                rank: peer.rank as usize,
                what: "QUIC endpoint",
            })?;
            let ip = netif::peer_address(&peer.addrs, peer.host == me.host).ok_or_else(|| MeshError::Unreachable {
                rank: peer.rank as usize,
                host: peer.host.hostname.clone(),
            })?;
            peers.push(QuicPeer {
                rank: peer.rank as usize,
                addr: SocketAddr::new(ip, port),
                fingerprint,
            });
        }
        let links = tokio::time::timeout(timeout, self.endpoint.connect_mesh(&peers))
            .await
            .map_err(|_| TransportError::Connect {
                peer: membership.rank,
                reason: format!("the mesh did not form within {timeout:?}"),
            })??;
        let links = match self.faults {
            Some(plan) => wrap_links(membership.rank, links, plan),
            None => links,
        };
        Ok((self.endpoint, links))
    }
}
