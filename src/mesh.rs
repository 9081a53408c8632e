//! Building a group's links: which transport each peer gets, what a rank
//! publishes for it, and checking what peers published.
//!
//! Before rendezvous, `MeshPlan::prepare` makes this rank's QUIC identity
//! and endpoint, its shared-memory endpoint, and the extras to publish
//! (`quic`: port and certificate fingerprint; `shm`: the ring nonce; `mac`:
//! the record's HMAC under the job secret). After it, `MeshPlan::connect`
//! verifies every peer's signature, picks each peer's path (`auto`: shared
//! memory with peers that share `/dev/shm`, QUIC with the others), connects, then
//! wraps the links with the fault plan. The transport, the fault plan and
//! the job secret come from [`InitOptions`](crate::InitOptions), which
//! reads them from the environment when they are not set in code.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Once};
use std::time::Duration;

use chorus_runtime::rendezvous::{Membership, PeerRecord};
use chorus_runtime::wait;
use chorus_transports::auth::JobSecret;
use chorus_transports::fault::{FaultPlan, FaultSpecError, wrap_links};
use chorus_transports::link::{Link, TransportError};
use chorus_transports::netif;
use chorus_transports::quic::{Fingerprint, QuicEndpoint, QuicIdentity, QuicOptions, QuicPeer};
use chorus_transports::shm::{self, ShmEndpoint, ShmOptions, ShmPeer, TmpfsSpace};
use thiserror::Error;

const QUIC_EXTRA: &str = "quic";
const SHM_EXTRA: &str = "shm";
const MAC_EXTRA: &str = "mac";

/// Why the mesh could not be built.
#[derive(Debug, Error)]
pub enum MeshError {
    /// `CHORUS_TRANSPORT` (or [`TransportChoice::parse`]'s text) names no transport.
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
    /// `CHORUS_FAULTS` does not parse, or a fault plan names a rank
    /// outside the world.
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
    /// `CHORUS_SHM_BUDGET` is not a size.
    #[error("CHORUS_SHM_BUDGET={0:?} is not a size in bytes (a K, M, G or T suffix allowed: 2G)")]
    BadShmBudget(String),
    /// The shared-memory budget gives the local ranks' rings less than the
    /// smallest ring.
    #[error(
        "{local_ranks} ranks share this host's /dev/shm and their rings may use {} MiB (CHORUS_SHM_BUDGET, at most half of /dev/shm), less than the {} MiB their {rings} rings need at the least; raise CHORUS_SHM_BUDGET (and /dev/shm), put fewer ranks on this host or set CHORUS_TRANSPORT=quic",
        mib(*.budget), mib(*.needed)
    )]
    ShmBudget {
        /// Ranks sharing this host's `/dev/shm`, this one included.
        local_ranks: usize,
        /// Their rings, one per ordered pair.
        rings: u64,
        /// The budget in effect, bytes.
        budget: u64,
        /// The least the rings need, bytes.
        needed: u64,
    },
    /// This rank's rings do not fit in what the tmpfs has free.
    #[error(
        "this rank's {rings} shared-memory rings of {} MiB need {} MiB and {} has {} MiB free; lower CHORUS_SHM_BUDGET (the ring memory of all ranks on this host, now {} MiB), free or enlarge {} (docker: --shm-size), or set CHORUS_TRANSPORT=quic",
        mib(*.capacity), mib(*.needed), dir.display(), mib(*.free), mib(*.budget), dir.display()
    )]
    ShmSpace {
        /// Rings this rank creates.
        rings: usize,
        /// Bytes of data per ring.
        capacity: u64,
        /// Bytes they need, header pages included.
        needed: u64,
        /// Bytes free in the tmpfs.
        free: u64,
        /// The tmpfs.
        dir: PathBuf,
        /// The budget in effect, bytes.
        budget: u64,
    },
    /// The transport failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
}

/// Bytes in MiB, for messages.
fn mib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / (1 << 20) as f64)
}

/// Which transport links between processes use
/// ([`InitOptions::transport`](crate::InitOptions::transport), by default
/// `CHORUS_TRANSPORT`). Ranks in one process ([`crate::spawn`]) always use
/// in-process links.
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
    /// A `CHORUS_TRANSPORT` value: `auto` (or blank), `quic` or `shm`.
    pub fn parse(text: &str) -> Result<Self, MeshError> {
        match text.trim() {
            "" | "auto" => Ok(TransportChoice::Auto),
            "quic" => Ok(TransportChoice::Quic),
            "shm" => Ok(TransportChoice::Shm),
            other => Err(MeshError::UnknownTransport(other.to_string())),
        }
    }
}

/// `plan`, checked against a world of `world` ranks.
pub(crate) fn checked_faults(plan: Option<FaultPlan>, world: usize) -> Result<Option<FaultPlan>, MeshError> {
    if let Some(plan) = &plan {
        plan.check_world(world).map_err(MeshError::Faults)?;
    }
    Ok(plan)
}

/// Outgoing ring size per peer for a few local peers. Every message of a
/// collective goes in segments of at most 1 MiB, so the ring only holds how
/// far a sender runs ahead of its peer: 48 MiB was as fast as 64 MiB for a
/// 64 MiB all-reduce and 32 MiB was not (bench/HISTORY.md §21). Both rings
/// of a link count in each process's resident memory once used.
const SHM_RING: usize = 48 << 20;

/// The default `CHORUS_SHM_BUDGET`: full-size rings for four ranks on a
/// host (12 rings), so the 2-4 local ranks the all-reduce figures measure
/// keep [`SHM_RING`], and more ranks share the same memory. Every pair of
/// local ranks has two rings whose pages are all reserved, so without a
/// budget a host's rings grow with the square of its ranks (64 ranks took
/// a 24 GiB host down).
pub(crate) const SHM_BUDGET: u64 = 12 * SHM_RING as u64;

/// The smallest ring a budget may give: below it the 1 MiB segments of the
/// collectives would go in pieces of under 16 KiB, a record (and a copy)
/// each. 64 ranks fit the default budget with 144 KiB rings.
const SHM_MIN_RING: u64 = 64 << 10;

/// A `CHORUS_SHM_BUDGET` value (`InitOptions::shm_budget`): bytes of ring
/// (data; each ring has one more header page) that all ranks sharing a
/// host's `/dev/shm` may use together, with an optional K, M, G or T suffix
/// (powers of 1024); unset or blank is `None` (the default,
/// [`SHM_BUDGET`], applied where the links' options are made).
pub(crate) fn parse_shm_budget(text: Option<&str>) -> Result<Option<u64>, MeshError> {
    let Some(t) = text.map(str::trim).filter(|t| !t.is_empty()) else {
        return Ok(None);
    };
    let (digits, shift) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 10),
        Some('M') => (&t[..t.len() - 1], 20),
        Some('G') => (&t[..t.len() - 1], 30),
        Some('T') => (&t[..t.len() - 1], 40),
        _ => (t, 0),
    };
    digits
        .trim()
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(1 << shift))
        .map(Some)
        .ok_or_else(|| MeshError::BadShmBudget(t.to_string()))
}

/// Sizes this rank's outbound rings (sans IO): `budget` bytes shared by
/// `local_ranks` ranks, each with a ring to each other, in whole pages, at
/// most [`SHM_RING`]. The budget is at most half of the tmpfs, so a small
/// `/dev/shm` (a container's 64 MiB) gets smaller rings instead of none;
/// every rank reads the same size, and readers take the size from the
/// ring, so ranks need not agree anyway. Then this rank's rings (header
/// pages included) must fit in what is free now: failing here, before
/// forming, says why, where a full tmpfs later would fail a link.
fn shm_capacity(local_ranks: usize, budget: u64, page: u64, dir: &Path, space: TmpfsSpace) -> Result<usize, MeshError> {
    let rings = (local_ranks * local_ranks.saturating_sub(1)).max(1) as u64;
    let budget = budget.min(space.size / 2);
    let capacity = (budget / rings / page * page).min(SHM_RING as u64);
    if capacity < SHM_MIN_RING.next_multiple_of(page) {
        return Err(MeshError::ShmBudget {
            local_ranks,
            rings,
            budget,
            needed: rings * SHM_MIN_RING.next_multiple_of(page),
        });
    }
    let needed = (local_ranks as u64 - 1).max(1) * (capacity + page);
    if needed > space.free {
        return Err(MeshError::ShmSpace {
            rings: local_ranks.saturating_sub(1).max(1),
            capacity,
            needed,
            free: space.free,
            dir: dir.to_path_buf(),
            budget,
        });
    }
    Ok(capacity as usize)
}

/// What a group's options say about its links.
#[derive(Debug, Clone)]
pub(crate) struct LinkOptions {
    /// Which transport each peer gets.
    pub(crate) transport: TransportChoice,
    /// Faults to inject.
    pub(crate) faults: Option<FaultPlan>,
    /// The key records are signed with.
    pub(crate) secret: Option<JobSecret>,
    /// The host's shared-memory budget in bytes.
    pub(crate) shm_budget: u64,
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
    shm_budget: u64,
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
    /// must form within `timeout`. `links` is what the caller's options
    /// chose: transport, fault plan, job secret and shared-memory budget.
    pub(crate) fn prepare(
        rank: usize,
        world: usize,
        single_host: bool,
        timeout: Duration,
        links: LinkOptions,
    ) -> Result<Self, MeshError> {
        let LinkOptions {
            transport: choice,
            faults,
            secret,
            shm_budget,
        } = links;
        let faults = checked_faults(faults, world)?;
        if secret.is_none() {
            static WARN: Once = Once::new();
            WARN.call_once(|| {
                tracing::warn!(
                    "CHORUS_JOB_SECRET is not set (nor InitOptions::job_secret): the mesh is only as trusted as the store"
                );
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
            shm_budget,
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
        let mut peers = Peers::default();
        for peer in membership.peers.iter().filter(|peer| peer.rank != membership.me().rank) {
            self.verify(peer, run_id, membership.generation)?;
            peers.add(self.route(peer, membership.me())?);
        }
        let shm_dir = ShmOptions::default().dir;
        let ring_capacity = self.ring_capacity(&peers, membership.rank, &shm_dir)?;
        let links = self.dial(&peers, membership, ring_capacity, shm_dir, timeout).await?;
        let links = match self.faults {
            Some(plan) => wrap_links(membership.rank, links, plan),
            None => links,
        };
        Ok((self.endpoint, links))
    }

    /// Checks that `peer`'s record is signed with the job's secret, when
    /// there is one.
    fn verify(&self, peer: &PeerRecord, run_id: &str, generation: u64) -> Result<(), MeshError> {
        let Some(secret) = &self.secret else {
            return Ok(());
        };
        let message = signed_message(run_id, generation, peer);
        if !peer.extra(MAC_EXTRA).is_some_and(|tag| secret.verify(&message, tag)) {
            return Err(MeshError::Unauthenticated {
                rank: peer.rank as usize,
                pid: peer.pid,
                host: peer.host.hostname.clone(),
            });
        }
        Ok(())
    }

    /// The path to `peer`, from what it published and where it runs
    /// beside `me`.
    fn route(&self, peer: &PeerRecord, me: &PeerRecord) -> Result<Route, MeshError> {
        let rank = peer.rank as usize;
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
            return Ok(Route::Shm(ShmPeer { rank, nonce }));
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
        Ok(Route::Quic(QuicPeer {
            rank,
            addr: SocketAddr::new(ip, port),
            fingerprint,
        }))
    }

    /// The data bytes of each of this rank's shared-memory rings (0: it
    /// has none), from the budget and the room in `shm_dir`.
    fn ring_capacity(&self, peers: &Peers, rank: usize, shm_dir: &Path) -> Result<usize, MeshError> {
        if peers.shm.is_empty() {
            return Ok(0);
        }
        // One rank per host clears rings that killed ranks left (of
        // this job or an earlier one), before the space is counted.
        if peers.shm.iter().all(|peer| peer.rank > rank) {
            let removed = shm::remove_dead_rings(shm_dir);
            if removed > 0 {
                tracing::info!(
                    "removed {removed} shared-memory rings of dead ranks from {}",
                    shm_dir.display()
                );
            }
        }
        let space = shm::tmpfs_space(shm_dir).map_err(|e| TransportError::Connect {
            peer: rank,
            reason: format!("reading the room in {}: {e}", shm_dir.display()),
        })?;
        shm_capacity(
            peers.shm.len() + 1,
            self.shm_budget,
            shm::page_size() as u64,
            shm_dir,
            space,
        )
    }

    /// Connects to `peers` over both paths at once, within `timeout`, with
    /// shared-memory rings of `ring_capacity` bytes in `shm_dir`; the links
    /// are indexed by rank.
    async fn dial(
        &self,
        peers: &Peers,
        membership: &Membership,
        ring_capacity: usize,
        shm_dir: PathBuf,
        timeout: Duration,
    ) -> Result<Vec<Option<Arc<dyn Link>>>, MeshError> {
        // Both sides connect at once, each within `timeout`, and a failure
        // names the peers and addresses that did not answer.
        let shm = async {
            if peers.shm.is_empty() {
                return Ok(Vec::new());
            }
            let options = ShmOptions {
                capacity: ring_capacity,
                connect_timeout: timeout,
                dir: shm_dir,
                ..ShmOptions::default()
            };
            ShmEndpoint::with_nonce(membership.rank, self.shm_nonce, options)
                .connect_mesh(&peers.shm)
                .await
        };
        let quic = async {
            if peers.quic.is_empty() {
                return Ok(Vec::new());
            }
            // Its own limit ends a little before the stage's, so a peer
            // that never answered is named with the address dialled and
            // the interface it left from, not only as a stage that ran out.
            let limit = timeout.saturating_sub((timeout / 10).min(Duration::from_millis(200)));
            self.endpoint.connect_mesh_within(&peers.quic, limit).await
        };
        let waiting_for = || peers.waiting_for(membership.rank);
        // Shared memory's limit was set from the whole stage: this one ends
        // the stage on time.
        let (shm, quic) = tokio::time::timeout(
            timeout,
            wait::noting(async { tokio::join!(shm, quic) }, timeout, waiting_for),
        )
        .await
        .map_err(|_| TransportError::Connect {
            peer: membership.rank,
            reason: format!("the mesh did not form within {timeout:?}: {}", waiting_for()),
        })?;
        let mut links: Vec<Option<Arc<dyn Link>>> = (0..membership.world_size()).map(|_| None).collect();
        // Each list is indexed by rank, `None` where the other side serves.
        for side in [shm?, quic?] {
            for (rank, link) in side.into_iter().enumerate() {
                if link.is_some() {
                    links[rank] = link;
                }
            }
        }
        Ok(links)
    }
}

/// The path to one peer.
enum Route {
    Shm(ShmPeer),
    Quic(QuicPeer),
}

/// The peers a rank connects to, by path.
#[derive(Default)]
struct Peers {
    shm: Vec<ShmPeer>,
    quic: Vec<QuicPeer>,
}

impl Peers {
    fn add(&mut self, route: Route) {
        match route {
            Route::Shm(peer) => self.shm.push(peer),
            Route::Quic(peer) => self.quic.push(peer),
        }
    }

    /// What rank `rank` waits for while it connects, for messages.
    fn waiting_for(&self, rank: usize) -> String {
        let shm: Vec<usize> = self.shm.iter().map(|p| p.rank).collect();
        let quic: Vec<String> = self.quic.iter().map(|p| format!("{} at {}", p.rank, p.addr)).collect();
        format!(
            "rank {}: connecting to its peers (shared memory: ranks [{}]; QUIC: ranks [{}])",
            rank,
            wait::rank_list(&shm),
            quic.join(", ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: u64 = 4096;
    const ROOMY: TmpfsSpace = TmpfsSpace {
        free: 24 << 30,
        size: 24 << 30,
    };

    fn ring_for(local_ranks: usize, budget: u64, space: TmpfsSpace) -> Result<usize, MeshError> {
        shm_capacity(local_ranks, budget, PAGE, Path::new("/dev/shm"), space)
    }

    #[test]
    fn a_few_local_ranks_keep_full_rings_and_many_share_the_budget() {
        for ranks in 2..=4 {
            assert_eq!(ring_for(ranks, SHM_BUDGET, ROOMY).unwrap(), SHM_RING, "{ranks} ranks");
        }
        for ranks in [5, 8, 16, 64] {
            let ring = ring_for(ranks, SHM_BUDGET, ROOMY).unwrap() as u64;
            assert!(
                ring < SHM_RING as u64 && ring.is_multiple_of(PAGE),
                "{ranks} ranks: {ring}"
            );
            let host = (ranks * (ranks - 1)) as u64 * ring;
            assert!(host <= SHM_BUDGET && host >= SHM_BUDGET - (ranks * (ranks - 1)) as u64 * PAGE);
        }
        assert_eq!(ring_for(64, SHM_BUDGET, ROOMY).unwrap(), 144 << 10);
        // A larger budget: the host's rings stay within it, whatever the ranks.
        assert_eq!(ring_for(8, 4 << 30, ROOMY).unwrap(), SHM_RING);
    }

    #[test]
    fn a_small_tmpfs_halves_the_budget_and_too_many_ranks_for_it_is_an_error() {
        let docker = TmpfsSpace {
            free: 64 << 20,
            size: 64 << 20,
        };
        assert_eq!(ring_for(2, SHM_BUDGET, docker).unwrap(), 16 << 20);
        let err = ring_for(128, SHM_BUDGET, ROOMY).unwrap_err();
        assert!(
            matches!(err, MeshError::ShmBudget { local_ranks: 128, rings: 16256, budget: SHM_BUDGET, needed } if needed == 16256 * SHM_MIN_RING),
            "{err}"
        );
        assert!(err.to_string().contains("raise CHORUS_SHM_BUDGET"), "{err}");
    }

    #[test]
    fn a_rank_whose_rings_do_not_fit_in_the_free_space_says_how_much_and_how_to_lower_it() {
        // Others filled the tmpfs: 8 ranks' rings are 10.3 MiB, this
        // rank's seven need 72 MiB, and 40 MiB is free.
        let full = TmpfsSpace {
            free: 40 << 20,
            size: 24 << 30,
        };
        let err = ring_for(8, SHM_BUDGET, full).unwrap_err();
        let MeshError::ShmSpace {
            rings,
            capacity,
            needed,
            free,
            ..
        } = &err
        else {
            panic!("{err}");
        };
        assert_eq!((*rings, *free), (7, 40 << 20));
        assert_eq!(*needed, 7 * (capacity + PAGE));
        let message = err.to_string();
        for part in [
            "need 72.0 MiB",
            "/dev/shm has 40.0 MiB free",
            "lower CHORUS_SHM_BUDGET",
            "576.0 MiB",
        ] {
            assert!(message.contains(part), "{part:?} not in {message}");
        }
        // A lower budget fits.
        assert!(ring_for(8, 256 << 20, full).is_ok());
    }

    #[test]
    fn budgets_parse_with_binary_suffixes() {
        assert_eq!(parse_shm_budget(None).unwrap(), None);
        assert_eq!(parse_shm_budget(Some(" ")).unwrap(), None);
        assert_eq!(parse_shm_budget(Some("2G")).unwrap(), Some(2 << 30));
        assert_eq!(parse_shm_budget(Some("512m")).unwrap(), Some(512 << 20));
        assert_eq!(parse_shm_budget(Some("65536")).unwrap(), Some(65536));
        for bad in ["lots", "-1M", "99999999999T"] {
            assert!(
                matches!(parse_shm_budget(Some(bad)), Err(MeshError::BadShmBudget(_))),
                "{bad}"
            );
        }
    }
}
