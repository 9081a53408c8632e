//! The QUIC mesh: one quinn endpoint per rank, one connection per peer,
//! one unidirectional stream per channel and direction.
//!
//! Authentication is mutual TLS with pinned certificates: every rank makes a
//! fresh key pair and self-signed certificate ([`QuicIdentity`]), publishes
//! its SHA-256 fingerprint through rendezvous, and both TLS verifiers accept
//! only fingerprints of this group's members ([`QuicEndpoint::connect_mesh`]
//! installs them). A stranger, or a member of another group, fails the
//! handshake; the rest of the mesh is not affected.
//!
//! Connections: rank `i` dials every rank `j > i` and accepts from every
//! `j < i`; an accepted connection is identified by its certificate.
//! On a stream, the first 4 bytes name the channel, then frames follow
//! ([`FrameHeader`] + payload). Flow control (stream and connection windows)
//! is the back-pressure.
//!
//! # Cancel safety
//! A dropped [`Link::recv`] loses nothing: what it read of a frame (header
//! bytes, then payload bytes) stays in the channel's receive state and the
//! next `recv` of the channel goes on from there. A dropped [`Link::send`]
//! writes nothing unless it had written its frame's first byte (it waited
//! behind another send of the channel, for a stream or for flow-control
//! credit); once it had, the rest of the frame is written by a task spawned
//! on the current runtime, which holds the channel's stream so that later
//! sends wait for it. Only a send dropped mid-frame outside any runtime
//! cannot be finished: it cuts the link, so the peer fails instead of
//! misreading the channel (a runtime shutting down takes its connections
//! with it). The common path pays nothing for this: no task
//! and no copy unless a send is dropped mid-frame.
//!
//! Congestion control ([`Congestion`]): between hosts, Cubic until the link
//! shows loss, then BBR ([`crate::congestion`], which has the measurements:
//! 0.4 against 54 MB/s through 20 ms and 1% loss each way); Cubic on
//! loopback. BBR's start-up is slower: the first 16 MiB of a fresh
//! connection over a 40 ms round trip took 0.87-0.97 s against Cubic's
//! 0.67-0.75 s, a few round trips that a datacenter link's tens of
//! microseconds hide. The initial window stays quinn's (RFC 9002's ten
//! datagrams): 32 or 100 did not shorten that first transfer under BBR
//! (0.79-0.97 s), which paces from its bandwidth estimate; under Cubic 100
//! did (0.51-0.54 s), but ten times the burst into a switch shared by every
//! rank of a ring was not worth a one-off 0.2 s at 40 ms.
//! Left as quinn has them, checked on the lossy link: loss detection's
//! packet and time thresholds (3 packets, 9/8 RTT; nothing reorders on a
//! datacenter path), MTU discovery (datagrams stayed at ~1.4 KB through 1%
//! loss: its black-hole detector only counts bursts that spare no small
//! packet), the receive windows (64 MiB per stream, 256 MiB per connection:
//! above a bandwidth-delay product of 100 Gbit/s x 1 ms), and the initial
//! RTT (333 ms: it only times the handshake's retransmissions).
//!
//! Tuning (measured on loopback, see the transports issue): on loopback the
//! datagram size may grow to [`LOOPBACK_MTU`] (`max_udp_payload_size`, with
//! MTU discovery from a handshake-safe `initial_mtu`), GSO is turned off (the kernel drops GSO batches of
//! such datagrams), and the congestion window starts at ten datagrams;
//! connection windows and socket buffers are large everywhere.
//!
//! A receive whose frame has not come polls the runtime's sockets between
//! turns for up to 50 us (`RECEIVE_SPIN`) before its thread may sleep
//! (`polling_briefly`): waking a thread whose CPU halted costs 20-45 us
//! on a virtual machine, more than a small all-reduce's whole exchange
//! (bench/HISTORY.md §19). Every fourth turn yields the core, for ranks that
//! outnumber the cores.
//!
//! What limited throughput at 64 MiB on this 2-core machine (`chorus bench
//! transport`, runs with no other load on the machine):
//! - **glibc trimming the heap.** quinn copies every received datagram into a
//!   fresh ~64 KB allocation and frees it once the stream is read. Whenever
//!   the reader caught up, the freed top of the heap (> 128 KiB, glibc's
//!   default `M_TRIM_THRESHOLD`) went back to the kernel and the next
//!   datagrams faulted it in again: ~230k page faults per 4 GiB received,
//!   `brk`/`munmap`/page-fault paths ~15% of the profile. `tune_allocator`
//!   raises the trim threshold to 64 MiB and fixes the mmap threshold at
//!   32 MiB (where glibc's dynamic threshold ends anyway), once per process,
//!   unless the user tuned malloc through the environment. Over six runs
//!   each, QUIC went from 2.0-2.4 GB/s (0.62-0.79x raw TCP in the same
//!   runs, median 0.68x) to 2.95-3.55 GB/s (0.96-1.07x, median 1.0x); page
//!   faults per 4 GiB fell from 291k to 83k. The 8-byte round trip did not
//!   change (62 us in A/B runs of QUIC alone); against TCP it measured
//!   1.02-1.21x before and 1.09-1.40x after, TCP's own round trip moving
//!   between 46 and 72 us from run to run.
//! - **the stream window as a cache footprint**: 1-8 MiB stream windows on
//!   loopback moved another ~20% (3.7-3.9 GB/s, 1.16-1.24x TCP), because less
//!   data in flight stays in cache between the kernel copy, quinn's copy,
//!   decryption and the copy into the frame. Not taken: callers use the
//!   64 MiB window as buffering (`STREAM_WINDOW`), and the mesh test,
//!   which sends 8 MiB frames before reading, deadlocks with 4 MiB.
//! - no gain: datagrams of 65000 or 65500 bytes (within noise of 64000), GSO
//!   with 8000/16000-byte datagrams (0.3-0.5 GB/s), NewReno (same as Cubic),
//!   BBR (-15%).
//! - what is left (on the receiver, the busier side): memmove ~18% (quinn's
//!   per-datagram copy and the copy of a multi-datagram frame into the pooled
//!   buffer, about half each; a frame is one contiguous `Bytes`, so one copy
//!   stays), AES-GCM decrypt ~9%, the kernel's UDP copy ~6.5%.
//! - the round trip: per one-way message quinn makes ~6 syscalls (3
//!   `epoll_wait`, 2 `recvmmsg`, 1.15 `sendmsg`) against TCP's 2; one of the
//!   `epoll_wait`s is an `EPOLLOUT` edge raised when the peer consumes the
//!   datagram (tokio registers the UDP socket for writing too).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{Connection, Endpoint, RecvStream, SendStream, VarInt};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};
use tokio::sync::{Notify, watch};

use crate::link::{ChannelId, CloseNotice, Frame, FrameHeader, Link, SendError, TransportError, TransportKind};

/// The application close code of a link closed on purpose
/// ([`Link::close_with`]); its reason bytes are an encoded [`CloseNotice`].
/// Any other code (0 is what quinn sends for a dropped connection, and what
/// [`Link::cut`] sends) is a lost link.
const CLOSE_NOTICE_CODE: u32 = 3;

/// A certificate's SHA-256 digest: what ranks publish and pin.
pub type Fingerprint = [u8; 32];

/// UDP payload size used on loopback (the loopback MTU is 64 KiB).
pub const LOOPBACK_MTU: u16 = 64_000;

/// The largest datagram a handshake may use: quinn encodes a long-header
/// packet's length in two bytes of varint, so it must stay under 16 KiB.
const HANDSHAKE_MTU: u16 = 16_000;

const ALPN: &[u8] = b"chorus/1";
const SERVER_NAME: &str = "chorus";

/// The SHA-256 fingerprint of a DER certificate.
pub fn fingerprint(cert_der: &[u8]) -> Fingerprint {
    let digest = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, cert_der);
    digest.as_ref().try_into().expect("SHA-256 is 32 bytes")
}

/// A rank's key pair and self-signed certificate, made fresh per process.
pub struct QuicIdentity {
    cert: CertificateDer<'static>,
    key: PrivatePkcs8KeyDer<'static>,
    fingerprint: Fingerprint,
}

impl std::fmt::Debug for QuicIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "QuicIdentity({})", hex(&self.fingerprint))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl QuicIdentity {
    /// A fresh key pair and certificate.
    pub fn generate() -> Result<Self, TransportError> {
        let certified =
            rcgen::generate_simple_self_signed(vec![SERVER_NAME.to_string()]).map_err(|e| TransportError::Connect {
                peer: usize::MAX,
                reason: format!("could not make a certificate: {e}"),
            })?;
        let cert = certified.cert.der().clone();
        Ok(Self {
            fingerprint: fingerprint(&cert),
            key: PrivatePkcs8KeyDer::from(certified.signing_key.serialize_der()),
            cert,
        })
    }

    /// The fingerprint to publish.
    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }
}

/// Fingerprints this rank accepts, and the rank each belongs to.
#[derive(Debug, Default)]
struct Pinned(RwLock<HashMap<Fingerprint, usize>>);

impl Pinned {
    fn check(&self, cert: &CertificateDer<'_>) -> Result<(), rustls::Error> {
        let known = self.0.read().unwrap_or_else(|p| p.into_inner());
        if known.contains_key(&fingerprint(cert)) {
            Ok(())
        } else {
            Err(rustls::Error::General(
                "certificate is not one of this group's pinned members".into(),
            ))
        }
    }

    fn rank_of(&self, cert: &CertificateDer<'_>) -> Option<usize> {
        self.0
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&fingerprint(cert))
            .copied()
    }
}

/// Both TLS verifiers: a certificate is valid iff it is pinned; signatures
/// are checked with the crypto provider's algorithms.
#[derive(Debug)]
struct PinnedVerifier {
    pinned: Arc<Pinned>,
    algorithms: rustls::crypto::WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for PinnedVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.pinned.check(end_entity).map(|()| ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

impl ClientCertVerifier for PinnedVerifier {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.pinned.check(end_entity).map(|()| ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// Settings of the mesh.
#[derive(Debug, Clone)]
pub struct QuicOptions {
    /// Largest frame accepted from a peer.
    pub max_frame: usize,
    /// How long forming the mesh may take.
    pub connect_timeout: Duration,
    /// A peer silent this long (no keep-alive either) is gone.
    pub idle_timeout: Duration,
    /// Socket buffer size asked of the kernel (root may exceed the sysctl cap).
    pub socket_buffer: usize,
    /// The congestion controller of every connection.
    pub congestion: Congestion,
}

/// A connection's congestion controller (quinn's three).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Congestion {
    /// Cubic on loopback (nothing is lost there, and it measured fastest);
    /// between hosts Cubic until the link shows loss, then BBR
    /// ([`crate::congestion::Adaptive`]).
    #[default]
    Auto,
    /// Cubic (RFC 9438): loss-based, as Linux TCP's default.
    Cubic,
    /// NewReno (RFC 9002's example): loss-based.
    NewReno,
    /// BBR (quinn's, after quiche's BBRv1): rate- and RTT-based.
    Bbr,
}

impl std::str::FromStr for Congestion {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "cubic" => Ok(Self::Cubic),
            "newreno" => Ok(Self::NewReno),
            "bbr" => Ok(Self::Bbr),
            _ => Err(format!(
                "unknown congestion controller {s:?}: use auto, cubic, newreno or bbr"
            )),
        }
    }
}

impl Default for QuicOptions {
    fn default() -> Self {
        Self {
            max_frame: 256 << 20,
            connect_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(30),
            socket_buffer: 32 << 20,
            congestion: Congestion::Auto,
        }
    }
}

/// A peer as rendezvous described it.
#[derive(Debug, Clone)]
pub struct QuicPeer {
    /// Its rank.
    pub rank: usize,
    /// Where its endpoint listens.
    pub addr: SocketAddr,
    /// Its certificate's fingerprint.
    pub fingerprint: Fingerprint,
}

/// One rank's QUIC endpoint.
#[derive(Debug)]
pub struct QuicEndpoint {
    rank: usize,
    endpoint: Endpoint,
    pinned: Arc<Pinned>,
    client: quinn::ClientConfig,
    options: QuicOptions,
}

fn connect_error(peer: usize, reason: impl std::fmt::Display) -> TransportError {
    TransportError::Connect {
        peer,
        reason: reason.to_string(),
    }
}

/// Stream receive window. Callers rely on it as buffering: a rank may send
/// frames up to this size before its peer reads (both ranks of a pair sending
/// first, then receiving), so shrinking it can deadlock them; see the module
/// doc for what a smaller one would gain.
const STREAM_WINDOW: u32 = 64 << 20;

/// Keeps glibc from handing freed heap back to the kernel after every burst of
/// received datagrams (see the module doc): raises `M_TRIM_THRESHOLD` to
/// 64 MiB and fixes `M_MMAP_THRESHOLD` at 32 MiB, where glibc's dynamic
/// threshold would end anyway (setting one turns the dynamic one off). Once
/// per process; skipped when the user tuned malloc through the environment.
/// The cost: a process may keep up to 64 MiB of freed heap per arena.
fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            let user_tuned = std::env::var_os("GLIBC_TUNABLES").is_some_and(|v| v.to_string_lossy().contains("malloc"))
                || std::env::vars_os().any(|(k, _)| {
                    k.to_string_lossy().starts_with("MALLOC_") && k.to_string_lossy().ends_with("_THRESHOLD_")
                });
            if user_tuned {
                return;
            }
            // SAFETY: mallopt only changes allocator parameters; glibc
            // serializes it against concurrent allocation.
            unsafe {
                libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
                libc::mallopt(libc::M_TRIM_THRESHOLD, 64 << 20);
            }
        });
    }
}

fn transport_config(loopback: bool, options: &QuicOptions) -> quinn::TransportConfig {
    let mut config = quinn::TransportConfig::default();
    config
        .stream_receive_window(VarInt::from_u32(STREAM_WINDOW))
        .receive_window(VarInt::from_u32(256 << 20))
        .send_window(256 << 20)
        .max_concurrent_uni_streams(VarInt::from_u32(4096))
        .max_concurrent_bidi_streams(VarInt::from_u32(0))
        .keep_alive_interval(Some(options.idle_timeout / 4))
        .max_idle_timeout(options.idle_timeout.try_into().ok());
    // On loopback the window starts at ten of its large datagrams.
    let loopback_window = 10 * u64::from(LOOPBACK_MTU);
    let controller: Arc<dyn quinn::congestion::ControllerFactory + Send + Sync> = match options.congestion {
        Congestion::Auto if !loopback => Arc::new(crate::congestion::AdaptiveConfig::default()),
        Congestion::Bbr => {
            let mut bbr = quinn::congestion::BbrConfig::default();
            if loopback {
                bbr.initial_window(loopback_window);
            }
            Arc::new(bbr)
        }
        Congestion::NewReno => {
            let mut reno = quinn::congestion::NewRenoConfig::default();
            if loopback {
                reno.initial_window(loopback_window);
            }
            Arc::new(reno)
        }
        Congestion::Auto | Congestion::Cubic => {
            let mut cubic = quinn::congestion::CubicConfig::default();
            if loopback {
                cubic.initial_window(loopback_window);
            }
            Arc::new(cubic)
        }
    };
    config.congestion_controller_factory(controller);
    if loopback {
        // Handshake packets must stay under 16 KiB (their length field is a
        // 2-byte varint), so start there and let discovery climb to the top.
        let mut discovery = quinn::MtuDiscoveryConfig::default();
        discovery.upper_bound(LOOPBACK_MTU).interval(Duration::from_secs(60));
        config
            .initial_mtu(HANDSHAKE_MTU)
            .mtu_discovery_config(Some(discovery))
            .enable_segmentation_offload(false);
    }
    config
}

fn udp_socket(addr: SocketAddr, buffer: usize) -> std::io::Result<std::net::UdpSocket> {
    let socket = socket2::Socket::new(socket2::Domain::for_address(addr), socket2::Type::DGRAM, None)?;
    // Root may pass the sysctl caps (SO_*BUFFORCE); others get what the caps allow.
    let _ = socket.set_recv_buffer_size(buffer);
    if socket.recv_buffer_size().unwrap_or(0) < buffer {
        force_buffer(&socket, libc::SO_RCVBUFFORCE, buffer);
    }
    let _ = socket.set_send_buffer_size(buffer);
    if socket.send_buffer_size().unwrap_or(0) < buffer {
        force_buffer(&socket, libc::SO_SNDBUFFORCE, buffer);
    }
    socket.bind(&addr.into())?;
    Ok(socket.into())
}

fn force_buffer(socket: &socket2::Socket, option: libc::c_int, size: usize) {
    use std::os::fd::AsRawFd;
    let value = libc::c_int::try_from(size).unwrap_or(libc::c_int::MAX);
    // SAFETY: setsockopt reads one c_int from `value` for the length given;
    // failure (not root) only leaves the buffer as the caps allow.
    unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            option,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}

impl QuicEndpoint {
    /// Binds rank `rank`'s endpoint on `ip` (port chosen by the kernel).
    pub fn bind(
        rank: usize,
        ip: IpAddr,
        identity: &QuicIdentity,
        options: QuicOptions,
    ) -> Result<Self, TransportError> {
        tune_allocator();
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let pinned = Arc::new(Pinned::default());
        let verifier = Arc::new(PinnedVerifier {
            pinned: pinned.clone(),
            algorithms: provider.signature_verification_algorithms,
        });
        let tls_error = |e: rustls::Error| connect_error(rank, format!("tls setup: {e}"));
        let key = || PrivateKeyDer::Pkcs8(identity.key.clone_key());

        let mut server_tls = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_error)?
            .with_client_cert_verifier(verifier.clone())
            .with_single_cert(vec![identity.cert.clone()], key())
            .map_err(tls_error)?;
        server_tls.alpn_protocols = vec![ALPN.to_vec()];
        let mut client_tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_error)?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_client_auth_cert(vec![identity.cert.clone()], key())
            .map_err(tls_error)?;
        client_tls.alpn_protocols = vec![ALPN.to_vec()];

        let loopback = ip.is_loopback();
        let transport = Arc::new(transport_config(loopback, &options));
        let server_crypto = QuicServerConfig::try_from(server_tls).map_err(|e| connect_error(rank, e))?;
        let mut server = quinn::ServerConfig::with_crypto(Arc::new(server_crypto));
        server.transport_config(transport.clone());
        let client_crypto = QuicClientConfig::try_from(client_tls).map_err(|e| connect_error(rank, e))?;
        let mut client = quinn::ClientConfig::new(Arc::new(client_crypto));
        client.transport_config(transport);

        let mut endpoint_config = quinn::EndpointConfig::default();
        if loopback {
            endpoint_config
                .max_udp_payload_size(LOOPBACK_MTU)
                .map_err(|e| connect_error(rank, e))?;
        }
        let socket = udp_socket(SocketAddr::new(ip, 0), options.socket_buffer)
            .map_err(|e| connect_error(rank, format!("binding a UDP socket on {ip}: {e}")))?;
        let runtime = quinn::default_runtime().ok_or_else(|| connect_error(rank, "no async runtime"))?;
        let endpoint = Endpoint::new(endpoint_config, Some(server), socket, runtime)
            .map_err(|e| connect_error(rank, format!("starting the endpoint: {e}")))?;
        Ok(Self {
            rank,
            endpoint,
            pinned,
            client,
            options,
        })
    }

    /// Where the endpoint listens; publish it at rendezvous.
    pub fn local_addr(&self) -> SocketAddr {
        self.endpoint
            .local_addr()
            .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)))
    }

    /// Connects to every peer (dialling higher ranks, accepting lower ones)
    /// and returns the links, indexed by rank (`None` for this rank).
    pub async fn connect_mesh(&self, peers: &[QuicPeer]) -> Result<Vec<Option<Arc<dyn Link>>>, TransportError> {
        self.connect_mesh_within(peers, self.options.connect_timeout).await
    }

    /// [`connect_mesh`](Self::connect_mesh) within `limit` instead of the
    /// options' `connect_timeout`: what a caller's deadline has left.
    pub async fn connect_mesh_within(
        &self,
        peers: &[QuicPeer],
        limit: Duration,
    ) -> Result<Vec<Option<Arc<dyn Link>>>, TransportError> {
        {
            let mut pinned = self.pinned.0.write().unwrap_or_else(|p| p.into_inner());
            pinned.clear();
            for peer in peers.iter().filter(|p| p.rank != self.rank) {
                pinned.insert(peer.fingerprint, peer.rank);
            }
        }
        let world = peers.iter().map(|p| p.rank + 1).max().unwrap_or(0).max(self.rank + 1);
        let mut links: Vec<Option<Arc<dyn Link>>> = (0..world).map(|_| None).collect();
        // Ranks connected so far: a timeout names the others and their addresses.
        let connected = std::sync::Mutex::new(Vec::new());
        let dial_higher = async {
            let mut dialled = Vec::new();
            for peer in peers.iter().filter(|p| p.rank > self.rank) {
                dialled.push(self.dial(peer.clone()).await?);
                connected.lock().unwrap_or_else(|p| p.into_inner()).push(peer.rank);
            }
            Ok::<_, TransportError>(dialled)
        };
        let lower = peers.iter().filter(|p| p.rank < self.rank).count();
        // Dialling gives up a quarter early: the rank that dialled knows the
        // address and route that failed, so its error should come first
        // (its peer, waiting to be dialled, knows only that nobody came).
        let dial_limit = limit - limit / 4;
        let dial_higher = async {
            match tokio::time::timeout(dial_limit, dial_higher).await {
                Ok(dialled) => dialled,
                Err(_) => Err(self.mesh_timeout(peers, &connected, dial_limit, |p| p.rank > self.rank)),
            }
        };
        let formed = async {
            let (dialled, accepted) = tokio::join!(dial_higher, self.accept(lower, &connected));
            Ok::<_, TransportError>((dialled?, accepted?))
        };
        let (dialled, accepted) = tokio::time::timeout(limit, formed)
            .await
            .map_err(|_| self.mesh_timeout(peers, &connected, limit, |p| p.rank != self.rank))??;
        for (rank, conn) in dialled.into_iter().chain(accepted) {
            links[rank] = Some(Arc::new(QuicLink::new(rank, conn, self.options.max_frame)));
        }
        Ok(links)
    }

    /// The error of a mesh that did not form within `limit`: every peer
    /// `wanted` not connected yet, with the address dialled and the route,
    /// or the port it should have dialled.
    fn mesh_timeout(
        &self,
        peers: &[QuicPeer],
        connected: &std::sync::Mutex<Vec<usize>>,
        limit: Duration,
        wanted: impl Fn(&QuicPeer) -> bool,
    ) -> TransportError {
        let connected = connected.lock().unwrap_or_else(|p| p.into_inner());
        let not_connected: Vec<&QuicPeer> = peers
            .iter()
            .filter(|p| wanted(p) && !connected.contains(&p.rank))
            .collect();
        let missing: Vec<String> = not_connected
            .iter()
            .map(|p| {
                if p.rank > self.rank {
                    format!(
                        "rank {} (dialled {} from {})",
                        p.rank,
                        p.addr,
                        crate::netif::describe_route(p.addr.ip())
                    )
                } else {
                    format!(
                        "rank {} (at {}: it has not dialled this rank on port {})",
                        p.rank,
                        p.addr,
                        self.local_addr().port()
                    )
                }
            })
            .collect();
        // One peer missing is the one this rank could not connect to.
        let peer = match not_connected[..] {
            [only] => only.rank,
            _ => self.rank,
        };
        connect_error(
            peer,
            format!(
                "the mesh did not form within {limit:?}: no connection with {}",
                missing.join(", ")
            ),
        )
    }

    async fn dial(&self, peer: QuicPeer) -> Result<(usize, Connection), TransportError> {
        // Name both ends: "timed out" alone does not say which address of
        // the peer was dialled, nor from which interface.
        let failed = |e: &dyn std::fmt::Display| {
            connect_error(
                peer.rank,
                format!(
                    "dialled {} from {}: {e}",
                    peer.addr,
                    crate::netif::describe_route(peer.addr.ip())
                ),
            )
        };
        let connecting = self
            .endpoint
            .connect_with(self.client.clone(), peer.addr, SERVER_NAME)
            .map_err(|e| failed(&e))?;
        let conn = connecting.await.map_err(|e| failed(&e))?;
        // Any member's certificate passes TLS; the dialled one must be this rank's.
        match peer_certificate(&conn) {
            Some(cert) if fingerprint(&cert) == peer.fingerprint => Ok((peer.rank, conn)),
            _ => {
                conn.close(VarInt::from_u32(1), b"unexpected certificate");
                Err(connect_error(peer.rank, "it presented another member's certificate"))
            }
        }
    }

    /// Accepts until `count` members of lower rank are connected; strangers
    /// fail the handshake and are logged, not counted.
    async fn accept(
        &self,
        count: usize,
        connected: &std::sync::Mutex<Vec<usize>>,
    ) -> Result<Vec<(usize, Connection)>, TransportError> {
        let mut accepted: Vec<(usize, Connection)> = Vec::new();
        while accepted.len() < count {
            let Some(incoming) = self.endpoint.accept().await else {
                return Err(connect_error(self.rank, "the endpoint closed while forming the mesh"));
            };
            let remote = incoming.remote_address();
            let conn = match incoming.await {
                Ok(conn) => conn,
                Err(e) => {
                    tracing::warn!(%remote, error = %e, "refused a QUIC connection");
                    continue;
                }
            };
            let rank = peer_certificate(&conn).and_then(|c| self.pinned.rank_of(&c));
            match rank {
                Some(rank) if rank < self.rank && accepted.iter().all(|(r, _)| *r != rank) => {
                    connected.lock().unwrap_or_else(|p| p.into_inner()).push(rank);
                    accepted.push((rank, conn))
                }
                _ => {
                    tracing::warn!(%remote, ?rank, "closing an unexpected QUIC connection");
                    conn.close(VarInt::from_u32(1), b"unexpected connection");
                }
            }
        }
        Ok(accepted)
    }
}

fn peer_certificate(conn: &Connection) -> Option<CertificateDer<'static>> {
    let identity = conn.peer_identity()?;
    let certs = identity.downcast::<Vec<CertificateDer<'static>>>().ok()?;
    certs.into_iter().next()
}

/// A receive stream, the buffer its payloads are read into, and how far
/// the frame being read has come: a `recv` dropped part-way leaves it here
/// and the next `recv` of the channel goes on from it.
struct Incoming {
    stream: RecvStream,
    /// Reused across frames: `reserve` reclaims it once the caller has
    /// dropped the previous payloads (fresh memory is ~10x slower to fill).
    /// While `frame` is set, it holds the bytes of that frame's payload read
    /// so far.
    pool: BytesMut,
    /// The next frame's header, `header_read` bytes of it read.
    header: [u8; FrameHeader::SIZE],
    header_read: usize,
    /// The frame whose payload is being read, once its header is whole.
    frame: Option<FrameHeader>,
}

impl Incoming {
    fn new(stream: RecvStream) -> Self {
        Self {
            stream,
            pool: BytesMut::new(),
            header: [0; FrameHeader::SIZE],
            header_read: 0,
            frame: None,
        }
    }
}

#[derive(Default)]
struct Demux {
    streams: Mutex<HashMap<ChannelId, Arc<tokio::sync::Mutex<Incoming>>>>,
    arrived: Notify,
}

/// A channel's send stream; `named` once a frame on it carried the
/// channel id in front.
struct Outgoing {
    stream: SendStream,
    named: bool,
}

/// One send at a time per channel: the guard of its stream.
type Writer = tokio::sync::OwnedMutexGuard<Option<Outgoing>>;

/// A frame being written, holding its channel's writer. Dropped part-way
/// (its `send` was), it finishes on a spawned task that keeps the writer,
/// so the channel's later sends wait for it; dropped before its first
/// byte went, it leaves the stream as it was.
struct FrameWrite<'a> {
    link: &'a QuicLink,
    /// Taken by `send` once the write ended, well or not.
    writer: Option<Writer>,
    /// What is left of the frame: quinn empties or shortens each chunk as it
    /// takes it.
    chunks: [Bytes; 2],
    begun: bool,
}

impl FrameWrite<'_> {
    async fn write(&mut self) -> Result<(), quinn::WriteError> {
        let outgoing = self
            .writer
            .as_mut()
            .and_then(|writer| writer.as_mut())
            .expect("send opened the stream");
        write_rest(outgoing, &mut self.chunks, &mut self.begun).await
    }
}

/// Writes what is left of a frame, noting in `begun` once a byte went.
/// `write_chunks` is cancel safe (it takes nothing unless it returns), so
/// `chunks` always holds exactly what the stream has not taken.
async fn write_rest(
    outgoing: &mut Outgoing,
    chunks: &mut [Bytes; 2],
    begun: &mut bool,
) -> Result<(), quinn::WriteError> {
    while chunks.iter().any(|chunk| !chunk.is_empty()) {
        let written = outgoing.stream.write_chunks(chunks).await?;
        *begun |= written.bytes > 0;
    }
    outgoing.named = true;
    Ok(())
}

impl Drop for FrameWrite<'_> {
    fn drop(&mut self) {
        let Some(mut writer) = self.writer.take() else {
            return;
        };
        if !self.begun {
            return;
        }
        let mut chunks = std::mem::take(&mut self.chunks);
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(async move {
                if let Some(outgoing) = writer.as_mut()
                    && write_rest(outgoing, &mut chunks, &mut true).await.is_err()
                {
                    // The connection is gone: the next send finds it so.
                    *writer = None;
                }
            })),
            // Nothing can finish the frame: a lost link beats a misread one.
            Err(_) => self.link.cut("a send was dropped mid-frame outside a runtime"),
        }
    }
}

/// A link to one peer over a QUIC connection.
pub struct QuicLink {
    peer: usize,
    conn: Connection,
    max_frame: usize,
    outgoing: Mutex<HashMap<ChannelId, Arc<tokio::sync::Mutex<Option<Outgoing>>>>>,
    demux: Arc<Demux>,
    failure: watch::Receiver<Option<String>>,
    acceptor: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for QuicLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "QuicLink(peer {} at {})", self.peer, self.conn.remote_address())
    }
}

impl QuicLink {
    fn new(peer: usize, conn: Connection, max_frame: usize) -> Self {
        let demux = Arc::new(Demux::default());
        let (failed, failure) = watch::channel(None);
        let acceptor = tokio::spawn(accept_streams(conn.clone(), demux.clone(), failed));
        Self {
            peer,
            conn,
            max_frame,
            outgoing: Mutex::new(HashMap::new()),
            demux,
            failure,
            acceptor,
        }
    }

    /// The error of an operation that found the connection gone: the
    /// peer's notice when it closed on purpose, otherwise `reason`.
    fn closed(&self, reason: impl std::fmt::Display) -> TransportError {
        match self.conn.close_reason() {
            Some(quinn::ConnectionError::ApplicationClosed(close))
                if close.error_code == VarInt::from_u32(CLOSE_NOTICE_CODE) =>
            {
                CloseNotice::decode(&close.reason).into_error(self.peer)
            }
            _ => TransportError::Closed {
                peer: self.peer,
                reason: reason.to_string(),
            },
        }
    }

    async fn incoming(&self, channel: ChannelId) -> Result<Arc<tokio::sync::Mutex<Incoming>>, TransportError> {
        let mut failure = self.failure.clone();
        loop {
            let arrived = self.demux.arrived.notified();
            tokio::pin!(arrived);
            arrived.as_mut().enable();
            if let Some(stream) = self
                .demux
                .streams
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&channel)
            {
                return Ok(stream.clone());
            }
            if let Some(reason) = failure.borrow_and_update().clone() {
                return Err(self.closed(reason));
            }
            tokio::select! {
                _ = arrived => {}
                _ = failure.changed() => {}
            }
        }
    }
}

/// Takes the peer's new streams, reads each one's channel id and files it.
async fn accept_streams(conn: Connection, demux: Arc<Demux>, failed: watch::Sender<Option<String>>) {
    loop {
        let mut stream = match conn.accept_uni().await {
            Ok(stream) => stream,
            Err(e) => {
                let _ = failed.send(Some(e.to_string()));
                demux.arrived.notify_waiters();
                return;
            }
        };
        let demux = demux.clone();
        tokio::spawn(async move {
            let mut id = [0u8; 4];
            if stream.read_exact(&mut id).await.is_ok() {
                let incoming = Incoming::new(stream);
                demux
                    .streams
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(u32::from_le_bytes(id), Arc::new(tokio::sync::Mutex::new(incoming)));
                demux.arrived.notify_waiters();
            }
        });
    }
}

#[async_trait]
impl Link for QuicLink {
    fn peer(&self) -> usize {
        self.peer
    }

    fn kind(&self) -> TransportKind {
        TransportKind::Quic
    }

    /// # Cancel safety
    /// Dropped before the frame's first byte is written, nothing is sent;
    /// after, a spawned task sends the rest and later sends of the channel
    /// wait for it (the module doc).
    async fn send(&self, channel: ChannelId, tag: u64, payload: Bytes) -> Result<(), SendError> {
        let slot = self
            .outgoing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(channel)
            .or_default()
            .clone();
        let mut writer = slot.lock_owned().await;
        let fail = |error: TransportError, payload: Bytes| Err(SendError { error, payload });
        let named = match &*writer {
            Some(outgoing) => outgoing.named,
            None => match self.conn.open_uni().await {
                Ok(stream) => {
                    *writer = Some(Outgoing { stream, named: false });
                    false
                }
                Err(e) => return fail(self.closed(e), payload),
            },
        };
        let header = FrameHeader {
            tag,
            len: payload.len() as u64,
        }
        .encode();
        // A fresh stream's first frame carries the channel id in front: a
        // send dropped before its first byte leaves nothing on the stream.
        let prefix = if named {
            Bytes::copy_from_slice(&header)
        } else {
            let mut prefix = Vec::with_capacity(4 + FrameHeader::SIZE);
            prefix.extend_from_slice(&channel.to_le_bytes());
            prefix.extend_from_slice(&header);
            Bytes::from(prefix)
        };
        let mut write = FrameWrite {
            link: self,
            writer: Some(writer),
            chunks: [prefix, payload.clone()],
            begun: false,
        };
        let written = write.write().await;
        let mut writer = write.writer.take().expect("held until the frame is written");
        match written {
            Ok(()) => Ok(()),
            Err(e) => {
                *writer = None;
                fail(self.closed(e), payload)
            }
        }
    }

    /// # Cancel safety
    /// Cancel safe: a frame read part-way stays with the channel's stream,
    /// and the next `recv` of the channel goes on from it (the module doc).
    async fn recv(&self, channel: ChannelId) -> Result<Frame, TransportError> {
        let incoming = self.incoming(channel).await?;
        let mut incoming = incoming.lock().await;
        // Every read below is cancel safe (quinn's `read` and `read_chunk`
        // take nothing unless they return it) and what it returns is filed
        // in `incoming` before the next await: a dropped `recv` loses no
        // byte, the next one goes on from there.
        let Incoming {
            stream,
            pool,
            header,
            header_read,
            frame,
        } = &mut *incoming;
        let ended = |len: u64| TransportError::Protocol {
            peer: self.peer,
            reason: format!("stream ended inside a {len}-byte frame"),
        };
        let header = match *frame {
            Some(header) => header,
            None => {
                polling_briefly(async {
                    while *header_read < FrameHeader::SIZE {
                        match stream.read(&mut header[*header_read..]).await {
                            Ok(Some(read)) => *header_read += read,
                            Ok(None) => return Err(self.closed("reading a frame header: the stream ended")),
                            Err(e) => return Err(self.closed(format!("reading a frame header: {e}"))),
                        }
                    }
                    Ok(())
                })
                .await?;
                *header_read = 0;
                let decoded = match FrameHeader::decode(header, self.peer, self.max_frame) {
                    Ok(decoded) => decoded,
                    Err(e) => {
                        // A forged length poisons the stream's framing: drop the link.
                        self.close(&e.to_string());
                        return Err(e);
                    }
                };
                pool.clear();
                *frame = Some(decoded);
                decoded
            }
        };
        let len = header.len as usize;
        // Asking quinn for a chunk of at most 0 bytes would wait for data
        // that belongs to the next frame.
        if len > 0 {
            if pool.is_empty() {
                match stream.read_chunk(len, true).await.map_err(|e| self.closed(e))? {
                    None => return Err(ended(header.len)),
                    // One chunk holding the whole payload is handed out without a copy.
                    Some(chunk) if chunk.bytes.len() == len => {
                        *frame = None;
                        return Ok(Frame {
                            tag: header.tag,
                            payload: chunk.bytes,
                        });
                    }
                    Some(chunk) => {
                        pool.reserve(len);
                        pool.extend_from_slice(&chunk.bytes);
                    }
                }
            }
            while pool.len() < len {
                match stream
                    .read_chunk(len - pool.len(), true)
                    .await
                    .map_err(|e| self.closed(e))?
                {
                    Some(chunk) => pool.extend_from_slice(&chunk.bytes),
                    None => return Err(ended(header.len)),
                }
            }
        }
        *frame = None;
        Ok(Frame {
            tag: header.tag,
            payload: pool.split().freeze(),
        })
    }

    fn close_with(&self, notice: &CloseNotice) {
        self.conn.close(VarInt::from_u32(CLOSE_NOTICE_CODE), &notice.encode());
    }

    fn cut(&self, reason: &str) {
        self.conn.close(VarInt::from_u32(0), reason.as_bytes());
    }
}

/// How long a receive whose frame has not come polls the runtime's sockets
/// before it lets the thread sleep.
const RECEIVE_SPIN: Duration = Duration::from_micros(50);

/// Awaits `read`, first polling it between turns of the runtime (tokio's
/// `yield_now` polls the I/O driver without sleeping) for up to
/// [`RECEIVE_SPIN`]: a packet that comes meanwhile is read at once instead
/// of waking a halted CPU.
async fn polling_briefly<T>(read: impl std::future::Future<Output = T>) -> T {
    let mut read = std::pin::pin!(read);
    let started = std::time::Instant::now();
    for turn in 1usize.. {
        let once = std::future::poll_fn(|cx| std::task::Poll::Ready(read.as_mut().poll(cx))).await;
        if let std::task::Poll::Ready(value) = once {
            return value;
        }
        if started.elapsed() >= RECEIVE_SPIN {
            break;
        }
        if turn % 4 == 0 {
            std::thread::yield_now();
        }
        tokio::task::yield_now().await;
    }
    read.await
}

impl Drop for QuicLink {
    fn drop(&mut self) {
        let stats = self.conn.stats();
        tracing::debug!(
            peer = self.peer,
            mtu = stats.path.current_mtu,
            cwnd = stats.path.cwnd,
            lost = stats.path.lost_packets,
            sent = stats.path.sent_packets,
            "QUIC link closed"
        );
        self.acceptor.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn within<T>(fut: impl std::future::Future<Output = T>) -> T {
        tokio::time::timeout(Duration::from_secs(30), fut)
            .await
            .expect("QUIC test hung")
    }

    fn loopback() -> IpAddr {
        IpAddr::from([127, 0, 0, 1])
    }

    #[test]
    fn congestion_names_parse() {
        assert_eq!("bbr".parse(), Ok(Congestion::Bbr));
        assert_eq!("Cubic".parse(), Ok(Congestion::Cubic));
        assert_eq!("newreno".parse(), Ok(Congestion::NewReno));
        assert_eq!("auto".parse(), Ok(Congestion::Auto));
        assert!(
            "vegas"
                .parse::<Congestion>()
                .unwrap_err()
                .contains("auto, cubic, newreno or bbr")
        );
    }

    fn options() -> QuicOptions {
        QuicOptions {
            connect_timeout: Duration::from_secs(10),
            ..QuicOptions::default()
        }
    }

    /// `world` endpoints and their published peers.
    fn endpoints(world: usize) -> (Vec<QuicEndpoint>, Vec<QuicPeer>) {
        let mut endpoints = Vec::new();
        let mut peers = Vec::new();
        for rank in 0..world {
            let identity = QuicIdentity::generate().unwrap();
            let endpoint = QuicEndpoint::bind(rank, loopback(), &identity, options()).unwrap();
            peers.push(QuicPeer {
                rank,
                addr: endpoint.local_addr(),
                fingerprint: identity.fingerprint(),
            });
            endpoints.push(endpoint);
        }
        (endpoints, peers)
    }

    async fn mesh(world: usize) -> (Vec<QuicEndpoint>, Vec<Vec<Option<Arc<dyn Link>>>>) {
        let (endpoints, peers) = endpoints(world);
        // Every rank must accept while the others dial: run them as tasks.
        let endpoints: Vec<Arc<QuicEndpoint>> = endpoints.into_iter().map(Arc::new).collect();
        let tasks: Vec<_> = endpoints
            .iter()
            .map(|endpoint| {
                let (endpoint, peers) = (endpoint.clone(), peers.clone());
                tokio::spawn(async move { endpoint.connect_mesh(&peers).await })
            })
            .collect();
        let mut formed = Vec::new();
        for task in tasks {
            formed.push(task.await.unwrap().unwrap());
        }
        let endpoints = endpoints
            .into_iter()
            .map(|e| Arc::try_unwrap(e).expect("tasks are done"))
            .collect();
        (endpoints, formed)
    }

    #[tokio::test]
    async fn a_mesh_of_three_moves_frames_on_independent_channels() {
        within(async {
            let (_endpoints, links) = mesh(3).await;
            let big = Bytes::from((0..8 << 20).map(|i| (i % 251) as u8).collect::<Vec<u8>>());
            for (a, row) in links.iter().enumerate() {
                for link in row.iter().flatten() {
                    link.send(7, a as u64, big.clone()).await.unwrap();
                    link.send(9, 100 + a as u64, Bytes::from_static(b"small"))
                        .await
                        .unwrap();
                    link.send(9, 200, Bytes::new()).await.unwrap();
                }
            }
            for row in &links {
                for link in row.iter().flatten() {
                    // Channel 9 is read first although channel 7 was sent first.
                    let small = link.recv(9).await.unwrap();
                    assert_eq!(
                        (small.tag, &small.payload[..]),
                        (100 + link.peer() as u64, &b"small"[..])
                    );
                    let empty = link.recv(9).await.unwrap();
                    assert_eq!((empty.tag, empty.payload.len()), (200, 0), "empty frames arrive too");
                    let frame = link.recv(7).await.unwrap();
                    assert_eq!(frame.tag, link.peer() as u64);
                    assert_eq!(frame.payload, big);
                }
            }
        })
        .await;
    }

    #[tokio::test]
    async fn frames_within_the_stream_window_are_sent_before_the_peer_reads() {
        within(async {
            let (_endpoints, links) = mesh(2).await;
            let (a, b) = (links[0][1].as_ref().unwrap(), links[1][0].as_ref().unwrap());
            let size = STREAM_WINDOW as usize / 3;
            let frame = |k: u8| Bytes::from((0..size).map(|i| (i % 251) as u8 ^ k).collect::<Vec<u8>>());
            // Both sides send first and read afterwards (as paired exchanges
            // do): this only completes if the window buffers the frames.
            for (k, link) in [(1u8, a), (2, b)] {
                link.send(4, 0, frame(k)).await.unwrap();
                link.send(4, 1, frame(k + 10)).await.unwrap();
            }
            for (k, link) in [(2u8, a), (1, b)] {
                for tag in 0..2u8 {
                    // Dropped before the next one, so the pooled buffer is reused.
                    let got = link.recv(4).await.unwrap();
                    assert_eq!(got.tag, u64::from(tag));
                    assert!(got.payload == frame(k + 10 * tag), "frame {tag} arrived altered");
                }
            }
        })
        .await;
    }

    #[tokio::test]
    async fn a_borrowed_send_asks_for_an_owned_frame() {
        within(async {
            // QUIC copies into its own stream buffers from an owned frame:
            // the borrowed form refuses at once, so the caller sends one.
            let (_endpoints, links) = mesh(2).await;
            let (a, b) = (links[0][1].as_ref().unwrap(), links[1][0].as_ref().unwrap());
            let refused = std::future::poll_fn(|cx| a.poll_send_copy(cx, 3, 1, b"borrowed")).await;
            assert_eq!(refused, Ok(false));
            a.send(3, 1, Bytes::from_static(b"owned")).await.unwrap();
            let frame = b.recv(3).await.unwrap();
            assert_eq!((frame.tag, &frame.payload[..]), (1, &b"owned"[..]));
        })
        .await;
    }

    #[tokio::test]
    async fn a_stranger_is_refused_and_the_mesh_still_forms() {
        within(async {
            let (endpoints, peers) = endpoints(2);
            let stranger_identity = QuicIdentity::generate().unwrap();
            let stranger = QuicEndpoint::bind(0, loopback(), &stranger_identity, options()).unwrap();
            // The stranger pins rank 1 (it read the store) but rank 1 does not pin it.
            let mut stranger_view = peers.clone();
            stranger_view[0].fingerprint = stranger_identity.fingerprint();
            stranger_view[0].addr = stranger.local_addr();
            let stranger_attempt = tokio::time::timeout(Duration::from_secs(5), stranger.connect_mesh(&stranger_view));
            let rank1 = endpoints[1].connect_mesh(&peers);
            let rank0 = endpoints[0].connect_mesh(&peers);
            let (stranger_result, rank0, rank1) = tokio::join!(stranger_attempt, rank0, rank1);
            // TLS 1.3 lets a client finish before the server has judged its
            // certificate, so the stranger may believe it connected; it must
            // never get a working link.
            if let Ok(Ok(links)) = stranger_result {
                let link = links[1].as_ref().unwrap();
                let outcome = tokio::time::timeout(Duration::from_secs(5), link.recv(0)).await;
                assert!(matches!(outcome, Ok(Err(TransportError::Closed { .. }))), "{outcome:?}");
            }
            let (rank0, rank1) = (rank0.unwrap(), rank1.unwrap());
            rank0[1]
                .as_ref()
                .unwrap()
                .send(0, 1, Bytes::from_static(b"hi"))
                .await
                .unwrap();
            assert_eq!(
                rank1[0].as_ref().unwrap().recv(0).await.unwrap().payload,
                Bytes::from_static(b"hi")
            );
        })
        .await;
    }

    /// A raw connection from rank 0 to rank 1, and rank 1's link over it.
    async fn raw_pair(max_frame: usize) -> (Vec<QuicEndpoint>, Connection, QuicLink) {
        let (endpoints, peers) = endpoints(2);
        for (endpoint, other) in endpoints.iter().zip(peers.iter().rev()) {
            endpoint.pinned.0.write().unwrap().insert(other.fingerprint, other.rank);
        }
        let connected = std::sync::Mutex::new(Vec::new());
        let (dialled, accepted) = tokio::join!(endpoints[0].dial(peers[1].clone()), endpoints[1].accept(1, &connected));
        let (_, raw) = dialled.unwrap();
        let (rank, conn) = accepted.unwrap().pop().unwrap();
        assert_eq!(rank, 0);
        (endpoints, raw, QuicLink::new(0, conn, max_frame))
    }

    #[tokio::test]
    async fn a_forged_length_is_refused_before_allocation() {
        within(async {
            let (_endpoints, raw, link) = raw_pair(1 << 20).await;
            let mut stream = raw.open_uni().await.unwrap();
            stream.write_all(&3u32.to_le_bytes()).await.unwrap();
            stream
                .write_all(&FrameHeader { tag: 1, len: 1 << 60 }.encode())
                .await
                .unwrap();
            let err = link.recv(3).await.unwrap_err();
            assert!(
                matches!(err, TransportError::FrameTooLarge { peer: 0, len, .. } if len == 1 << 60),
                "{err}"
            );
        })
        .await;
    }

    #[tokio::test]
    async fn a_peer_vanishing_mid_frame_is_an_error_not_a_hang() {
        within(async {
            let (_endpoints, raw, link) = raw_pair(1 << 20).await;
            let mut stream = raw.open_uni().await.unwrap();
            stream.write_all(&3u32.to_le_bytes()).await.unwrap();
            stream
                .write_all(&FrameHeader { tag: 1, len: 1000 }.encode())
                .await
                .unwrap();
            stream.write_all(&[0u8; 10]).await.unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
            raw.close(VarInt::from_u32(0), b"gone");
            let err = link.recv(3).await.unwrap_err();
            assert!(
                matches!(
                    err,
                    TransportError::Closed { peer: 0, .. } | TransportError::Protocol { peer: 0, .. }
                ),
                "{err}"
            );
        })
        .await;
    }

    /// Where `link`'s receive of `channel` stands, once the channel's
    /// stream has come: the header bytes read, and the payload bytes read
    /// once the header is whole.
    fn receive_state(link: &QuicLink, channel: ChannelId) -> Option<(usize, Option<usize>)> {
        let streams = link.demux.streams.lock().unwrap();
        let incoming = streams.get(&channel)?.try_lock().expect("no receive runs");
        Some((incoming.header_read, incoming.frame.map(|_| incoming.pool.len())))
    }

    #[tokio::test]
    async fn a_receive_dropped_mid_frame_is_continued_by_the_next() {
        within(async {
            let size = 8 << 20;
            let (_endpoints, raw, link) = raw_pair(size).await;
            let payload: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
            let header = FrameHeader {
                tag: 1,
                len: size as u64,
            }
            .encode();
            let cut_short = || async {
                tokio::time::timeout(Duration::from_millis(20), link.recv(3))
                    .await
                    .is_err()
            };
            let mut stream = raw.open_uni().await.unwrap();
            stream.write_all(&3u32.to_le_bytes()).await.unwrap();
            // Part of the header, then the rest and part of the payload: the
            // receives are dropped until they have read all that was sent.
            stream.write_all(&header[..7]).await.unwrap();
            while receive_state(&link, 3) != Some((7, None)) {
                assert!(cut_short().await, "a receive finished with 7 bytes sent");
            }
            stream.write_all(&header[7..]).await.unwrap();
            stream.write_all(&payload[..size / 3]).await.unwrap();
            while receive_state(&link, 3) != Some((0, Some(size / 3))) {
                assert!(cut_short().await, "a receive finished with a third of its frame sent");
            }
            stream.write_all(&payload[size / 3..]).await.unwrap();
            stream
                .write_all(&FrameHeader { tag: 2, len: 5 }.encode())
                .await
                .unwrap();
            stream.write_all(b"after").await.unwrap();
            let frame = link.recv(3).await.unwrap();
            assert_eq!(frame.tag, 1);
            assert!(frame.payload == payload[..], "the frame arrived altered");
            let next = link.recv(3).await.unwrap();
            assert_eq!((next.tag, &next.payload[..]), (2, &b"after"[..]));
        })
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn receives_cut_short_mid_frame_lose_nothing() {
        within(async {
            let (_endpoints, raw, rx) = raw_pair(1 << 20).await;
            // Frames of several sizes, the empty one included, as one byte
            // stream that comes in pieces cut anywhere, a millisecond apart.
            let frames: Vec<Bytes> = (0..24u64)
                .map(|k| {
                    let len = [1 << 20, 0, 70_000, 5][k as usize % 4];
                    Bytes::from((0..len).map(|i| (i * 7 + k) as u8).collect::<Vec<u8>>())
                })
                .collect();
            let mut wire = 0u32.to_le_bytes().to_vec();
            for (tag, frame) in frames.iter().enumerate() {
                let header = FrameHeader {
                    tag: tag as u64,
                    len: frame.len() as u64,
                };
                wire.extend_from_slice(&header.encode());
                wire.extend_from_slice(frame);
            }
            let sender = tokio::spawn(async move {
                let mut stream = raw.open_uni().await.unwrap();
                let (mut at, mut random) = (0, 1u64);
                while at < wire.len() {
                    random = random * 48_271 % 2_147_483_647;
                    let end = (at + 1 + random as usize % 200_000).min(wire.len());
                    stream.write_all(&wire[at..end]).await.unwrap();
                    at = end;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                // Kept open until the frames are read.
                (raw, stream)
            });
            let (mut got, mut mid_frame) = (0, 0);
            while got < frames.len() {
                match tokio::time::timeout(Duration::from_micros(500), rx.recv(0)).await {
                    Ok(frame) => {
                        let frame = frame.unwrap();
                        assert_eq!(frame.tag, got as u64);
                        assert!(frame.payload == frames[got], "frame {got} arrived altered");
                        got += 1;
                    }
                    Err(_) => {
                        if matches!(receive_state(&rx, 0), Some((1.., _) | (_, Some(_)))) {
                            mid_frame += 1;
                        }
                    }
                }
            }
            drop(sender.await.unwrap());
            assert!(
                mid_frame > 5,
                "{mid_frame} receives dropped mid-frame: the test shows little"
            );
        })
        .await;
    }

    #[tokio::test]
    async fn a_send_dropped_mid_frame_still_sends_it_whole_and_one_dropped_before_sends_nothing() {
        within(async {
            // More than the stream window: with the peer not reading, the
            // send stops part-way, and the timeout drops it there.
            let size = STREAM_WINDOW as usize + (16 << 20);
            let (_endpoints, raw, rx) = raw_pair(size).await;
            let tx = QuicLink::new(1, raw, size);
            let big = Bytes::from((0..size).map(|i| (i % 251) as u8).collect::<Vec<u8>>());
            let dropped = tokio::time::timeout(Duration::from_millis(200), tx.send(5, 1, big.clone())).await;
            assert!(dropped.is_err(), "a frame over the window was sent unread");
            let writer_held = tx.outgoing.lock().unwrap()[&5].try_lock().is_err();
            assert!(writer_held, "nothing finishes the dropped send's frame");
            // A send waiting behind it, dropped: nothing sent.
            let waiting =
                tokio::time::timeout(Duration::from_millis(50), tx.send(5, 2, Bytes::from_static(b"never"))).await;
            assert!(waiting.is_err(), "a send went ahead of a frame begun");
            let frame = rx.recv(5).await.unwrap();
            assert_eq!(frame.tag, 1);
            assert!(frame.payload == big, "the frame arrived altered");
            tx.send(5, 3, Bytes::from_static(b"next")).await.unwrap();
            let next = rx.recv(5).await.unwrap();
            assert_eq!((next.tag, &next.payload[..]), (3, &b"next"[..]));
            let late = tokio::time::timeout(Duration::from_millis(50), rx.recv(5)).await;
            assert!(late.is_err(), "the send dropped before it began sent {late:?}");
        })
        .await;
    }

    /// A receive polls its read between turns of the runtime for a while,
    /// then sleeps until the read is woken; either way it gets the value.
    #[tokio::test]
    async fn a_receive_polls_briefly_then_sleeps_until_its_frame_comes() {
        let polls = std::sync::atomic::AtomicUsize::new(0);
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let _ = tx.send(7u32);
        });
        let started = std::time::Instant::now();
        let read = std::future::poll_fn(|cx| {
            polls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            std::pin::Pin::new(&mut rx).poll(cx)
        });
        assert_eq!(within(polling_briefly(read)).await, Ok(7));
        let polls = polls.into_inner();
        assert!(started.elapsed() >= Duration::from_millis(20));
        // Polled while spinning, once when woken; not polled all along.
        assert!((3..10_000).contains(&polls), "{polls} polls");
        assert_eq!(polling_briefly(std::future::ready(3)).await, 3);
    }

    #[tokio::test]
    async fn a_closed_peer_fails_its_link_and_the_rest_keeps_working() {
        within(async {
            let (_endpoints, links) = mesh(3).await;
            let notice = CloseNotice {
                reason: "rank 2 aborted: rank 1 sent no heartbeat".into(),
                failed: vec![1],
            };
            links[2][0].as_ref().unwrap().close_with(&notice);
            let err = links[0][2].as_ref().unwrap().recv(0).await.unwrap_err();
            assert_eq!(err, notice.clone().into_error(2), "the peer's notice arrives typed");
            let err = links[0][2]
                .as_ref()
                .unwrap()
                .send(0, 0, Bytes::from_static(b"kept"))
                .await
                .unwrap_err();
            assert_eq!(err.payload, Bytes::from_static(b"kept"));
            links[0][1]
                .as_ref()
                .unwrap()
                .send(5, 5, Bytes::from_static(b"still"))
                .await
                .unwrap();
            assert_eq!(links[1][0].as_ref().unwrap().recv(5).await.unwrap().tag, 5);
            // A cut is a lost link; so is the peer's close seen from the closer's side.
            links[1][0].as_ref().unwrap().cut("fault injection");
            let err = links[0][1].as_ref().unwrap().recv(0).await.unwrap_err();
            assert!(matches!(err, TransportError::Closed { peer: 1, .. }), "{err}");
            let err = links[2][0].as_ref().unwrap().recv(0).await.unwrap_err();
            assert!(matches!(err, TransportError::Closed { peer: 0, .. }), "{err}");
        })
        .await;
    }
}
