//! `chorus netem`: a userspace link impairer for kernels without `sch_netem`.
//!
//! It joins two interfaces of the current network namespace as a cable
//! would: every frame that arrives on one is sent out of the other, each
//! direction on its own thread with its own [`core::Direction`] (loss, rate,
//! delay, jitter, order kept). Frames are read and written through raw
//! `AF_PACKET` sockets, in batches (`recvmmsg`/`sendmmsg`).
//!
//! Frames travel with their `virtio_net_hdr` (`PACKET_VNET_HDR`), so a frame
//! whose checksum the sender left to the "hardware" (veths do) is handed on
//! still marked as such and not dropped as corrupt on the far side. For loss
//! to hit single frames rather than 64 KB offload batches, give the senders'
//! interfaces `gso_max_segs 1` (`scripts/netem-pair.sh` does).
//!
//! Its own transmissions are not read back: the receiving sockets set
//! `PACKET_IGNORE_OUTGOING` and skip `PACKET_OUTGOING` frames as well.

pub mod core;

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use thiserror::Error;

use self::core::{Direction, Impairment, ImpairmentError, Verdict};

/// Why the impairer could not run.
#[derive(Debug, Error)]
pub enum NetemError {
    /// A setting is out of range.
    #[error(transparent)]
    Setting(#[from] ImpairmentError),
    /// The interface does not exist here.
    #[error(
        "no interface {0} in this network namespace (run it where both interfaces are, e.g. under `ip netns exec`)"
    )]
    NoInterface(String),
    /// A socket call failed.
    #[error("{what} on {iface}: {source} (raw sockets need root or CAP_NET_RAW)")]
    Socket {
        /// The call.
        what: &'static str,
        /// The interface.
        iface: String,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// Waiting for the stop signal failed.
    #[error("waiting for SIGINT/SIGTERM: {0}")]
    Signal(io::Error),
}

/// What to do to the frames between two interfaces (both directions alike).
#[derive(Debug, Clone)]
pub struct NetemOptions {
    /// One interface.
    pub a: String,
    /// The other.
    pub b: String,
    /// The impairment of each direction.
    pub impairment: Impairment,
    /// Seeds direction a->b; b->a uses the next seed.
    pub seed: u64,
}

/// Largest frame read: a 64 KB offload batch plus its headers.
const FRAME_MAX: usize = 65_536 + 256;
/// Frames per `recvmmsg`/`sendmmsg`.
const BATCH: usize = 64;
/// Kernel buffer per socket, so a burst waits while a thread is off the CPU.
const SOCKET_BUFFER: libc::c_int = 32 << 20;

/// What one direction did, shared with the thread that prints it.
#[derive(Debug, Default)]
struct Stats {
    forwarded: AtomicU64,
    lost: AtomicU64,
    overflow: AtomicU64,
    send_failed: AtomicU64,
}

/// Forwards between the two interfaces until SIGINT or SIGTERM, then prints
/// what each direction did. Prints `netem: ready ...` on stderr once both
/// directions forward.
pub fn run(options: &NetemOptions) -> Result<(), NetemError> {
    let ab = (
        open_socket(&options.a, true)?,
        open_socket(&options.b, false)?,
        Arc::new(Stats::default()),
    );
    let ba = (
        open_socket(&options.b, true)?,
        open_socket(&options.a, false)?,
        Arc::new(Stats::default()),
    );
    // Block the stop signals before starting the threads (they inherit the
    // mask), so that only sigwait below receives them.
    let signals = block_stop_signals();
    let start = Instant::now();
    for (index, (rx, tx, stats)) in [&ab, &ba].into_iter().enumerate() {
        let (rx, tx) = (
            rx.try_clone().map_err(socket_error("dup", &options.a))?,
            tx.try_clone().map_err(socket_error("dup", &options.b))?,
        );
        let stats = stats.clone();
        let direction = Direction::new(options.impairment.clone(), options.seed.wrapping_add(index as u64));
        std::thread::Builder::new()
            .name(format!("netem-{index}"))
            .spawn(move || forward(&rx, &tx, direction, start, &stats))
            .map_err(socket_error("starting a thread", &options.a))?;
    }
    let imp = &options.impairment;
    eprintln!(
        "netem: ready {} <-> {}: delay {:?} jitter {:?} loss {} rate {} seed {}",
        options.a,
        options.b,
        imp.delay,
        imp.jitter,
        imp.loss,
        imp.rate_bps
            .map_or("unlimited".into(), |r| format!("{} Mbit/s", r / 1e6)),
        options.seed
    );
    wait_for(&signals)?;
    for (name, (_, _, stats)) in [
        (format!("{}->{}", options.a, options.b), &ab),
        (format!("{}->{}", options.b, options.a), &ba),
    ] {
        eprintln!(
            "netem: {name}: forwarded {} lost {} overflow {} send-failed {}",
            stats.forwarded.load(Ordering::Relaxed),
            stats.lost.load(Ordering::Relaxed),
            stats.overflow.load(Ordering::Relaxed),
            stats.send_failed.load(Ordering::Relaxed)
        );
    }
    Ok(())
}

fn socket_error(what: &'static str, iface: &str) -> impl Fn(io::Error) -> NetemError {
    let iface = iface.to_string();
    move |source| NetemError::Socket {
        what,
        iface: iface.clone(),
        source,
    }
}

fn setsockopt(fd: &OwnedFd, level: libc::c_int, option: libc::c_int, value: libc::c_int) -> io::Result<()> {
    // SAFETY: passes one c_int by pointer with its size; the fd is open.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            option,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A raw socket on `iface`: receiving every frame that arrives there
/// (`receive`), or only sending (protocol 0 receives nothing).
fn open_socket(iface: &str, receive: bool) -> Result<OwnedFd, NetemError> {
    let name = CString::new(iface).map_err(|_| NetemError::NoInterface(iface.to_string()))?;
    // SAFETY: `name` is a valid NUL-terminated string.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if index == 0 {
        return Err(NetemError::NoInterface(iface.to_string()));
    }
    let error = |what| socket_error(what, iface);
    // Protocol 0 at creation: the socket receives nothing until bound to
    // its one interface below, so no other interface's frame slips in.
    // SAFETY: plain socket(2) call.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(error("opening a packet socket")(io::Error::last_os_error()));
    }
    // SAFETY: `fd` was just opened and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    setsockopt(&fd, libc::SOL_PACKET, libc::PACKET_VNET_HDR, 1).map_err(error("PACKET_VNET_HDR"))?;
    if receive {
        // Kernels before 4.20 lack it; forward() also skips outgoing frames.
        let _ = setsockopt(&fd, libc::SOL_PACKET, libc::PACKET_IGNORE_OUTGOING, 1);
        if setsockopt(&fd, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, SOCKET_BUFFER).is_err() {
            setsockopt(&fd, libc::SOL_SOCKET, libc::SO_RCVBUF, SOCKET_BUFFER).map_err(error("SO_RCVBUF"))?;
        }
    } else {
        // A veth has no queue to bypass; a real NIC's qdisc would only add delay.
        let _ = setsockopt(&fd, libc::SOL_PACKET, libc::PACKET_QDISC_BYPASS, 1);
        if setsockopt(&fd, libc::SOL_SOCKET, libc::SO_SNDBUFFORCE, SOCKET_BUFFER).is_err() {
            setsockopt(&fd, libc::SOL_SOCKET, libc::SO_SNDBUF, SOCKET_BUFFER).map_err(error("SO_SNDBUF"))?;
        }
    }
    // SAFETY: sockaddr_ll is plain data; all-zero is a valid start.
    let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    addr.sll_family = libc::AF_PACKET as libc::c_ushort;
    addr.sll_protocol = if receive { (libc::ETH_P_ALL as u16).to_be() } else { 0 };
    addr.sll_ifindex = index as libc::c_int;
    // SAFETY: `addr` is a sockaddr_ll of the length given.
    let rc = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&addr as *const libc::sockaddr_ll).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(error("binding the packet socket")(io::Error::last_os_error()));
    }
    Ok(fd)
}

/// One direction: reads frames from `rx`, passes them through `direction`,
/// writes the due ones to `tx`. Runs for the life of the process.
fn forward(rx: &OwnedFd, tx: &OwnedFd, mut direction: Direction<Vec<u8>>, start: Instant, stats: &Stats) {
    let mut buffers = vec![vec![0u8; FRAME_MAX]; BATCH];
    // Spent frames' buffers, reused so a steady stream allocates nothing.
    let mut spare: Vec<Vec<u8>> = Vec::new();
    let mut due: Vec<Vec<u8>> = Vec::with_capacity(BATCH);
    loop {
        let timeout = direction
            .next_due()
            .map(|at| at.saturating_sub(start.elapsed()))
            .unwrap_or(Duration::from_millis(100));
        if !timeout.is_zero() {
            wait_readable(rx, timeout);
        }
        // Read what is waiting (a bounded number of batches, so that due
        // frames are not held back by a flood).
        for _ in 0..8 {
            let received = receive_batch(rx, &mut buffers);
            let now = start.elapsed();
            for (buffer, len) in buffers.iter().zip(&received) {
                let Some(len) = *len else { continue };
                let mut frame = spare.pop().unwrap_or_default();
                frame.clear();
                frame.extend_from_slice(&buffer[..len]);
                match direction.offer(now, len, frame) {
                    Verdict::Queued(_) => {}
                    Verdict::Lost => {
                        stats.lost.fetch_add(1, Ordering::Relaxed);
                    }
                    Verdict::Overflow => {
                        stats.overflow.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            if received.len() < BATCH {
                break;
            }
        }
        let now = start.elapsed();
        loop {
            due.clear();
            while due.len() < BATCH {
                match direction.pop_due(now) {
                    Some(frame) => due.push(frame),
                    None => break,
                }
            }
            if due.is_empty() {
                break;
            }
            let failed = send_batch(tx, &due);
            stats.send_failed.fetch_add(failed as u64, Ordering::Relaxed);
            stats
                .forwarded
                .fetch_add((due.len() - failed) as u64, Ordering::Relaxed);
            for frame in due.drain(..) {
                if spare.len() < 4 * BATCH {
                    spare.push(frame);
                }
            }
        }
    }
}

/// Waits up to `timeout` (microsecond precision) for `fd` to be readable.
fn wait_readable(fd: &OwnedFd, timeout: Duration) {
    let mut pollfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(1) as libc::time_t,
        tv_nsec: if timeout.as_secs() >= 1 {
            0
        } else {
            timeout.subsec_nanos() as libc::c_long
        },
    };
    // SAFETY: one valid pollfd, a valid timespec, no signal mask change.
    unsafe { libc::ppoll(&mut pollfd, 1, &ts, std::ptr::null()) };
}

/// Reads up to a batch without blocking; the length of each frame read,
/// `None` for a frame of our own (outgoing) or one cut short.
fn receive_batch(rx: &OwnedFd, buffers: &mut [Vec<u8>]) -> Vec<Option<usize>> {
    // SAFETY: all-zero is valid for these plain-data structs.
    let mut addrs: Vec<libc::sockaddr_ll> = (0..buffers.len()).map(|_| unsafe { std::mem::zeroed() }).collect();
    let mut iovecs: Vec<libc::iovec> = buffers
        .iter_mut()
        .map(|b| libc::iovec {
            iov_base: b.as_mut_ptr().cast(),
            iov_len: b.len(),
        })
        .collect();
    let mut messages: Vec<libc::mmsghdr> = iovecs
        .iter_mut()
        .zip(addrs.iter_mut())
        .map(|(iov, addr)| {
            // SAFETY: all-zero is valid for mmsghdr; the pointers set below
            // stay valid for the call.
            let mut m: libc::mmsghdr = unsafe { std::mem::zeroed() };
            m.msg_hdr.msg_iov = iov;
            m.msg_hdr.msg_iovlen = 1;
            m.msg_hdr.msg_name = (addr as *mut libc::sockaddr_ll).cast();
            m.msg_hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
            m
        })
        .collect();
    // SAFETY: `messages` points at live iovecs/buffers/addresses of the
    // lengths given; MSG_DONTWAIT never blocks.
    let n = unsafe {
        libc::recvmmsg(
            rx.as_raw_fd(),
            messages.as_mut_ptr(),
            messages.len() as libc::c_uint,
            libc::MSG_DONTWAIT,
            std::ptr::null_mut(),
        )
    };
    if n <= 0 {
        return Vec::new();
    }
    messages[..n as usize]
        .iter()
        .zip(&addrs)
        .map(|(m, addr)| {
            let whole = m.msg_hdr.msg_flags & libc::MSG_TRUNC == 0;
            (whole && addr.sll_pkttype != libc::PACKET_OUTGOING).then_some(m.msg_len as usize)
        })
        .collect()
}

/// Sends the frames in order; returns how many the kernel refused (they are
/// dropped, as a full transmit queue would).
fn send_batch(tx: &OwnedFd, frames: &[Vec<u8>]) -> usize {
    let mut iovecs: Vec<libc::iovec> = frames
        .iter()
        .map(|f| libc::iovec {
            iov_base: f.as_ptr() as *mut libc::c_void,
            iov_len: f.len(),
        })
        .collect();
    let mut messages: Vec<libc::mmsghdr> = iovecs
        .iter_mut()
        .map(|iov| {
            // SAFETY: all-zero is valid for mmsghdr (no address: the bound interface).
            let mut m: libc::mmsghdr = unsafe { std::mem::zeroed() };
            m.msg_hdr.msg_iov = iov;
            m.msg_hdr.msg_iovlen = 1;
            m
        })
        .collect();
    let mut failed = 0;
    let mut next = 0;
    while next < messages.len() {
        // SAFETY: the messages from `next` point at live frames; the kernel
        // only reads them.
        let n = unsafe {
            libc::sendmmsg(
                tx.as_raw_fd(),
                messages[next..].as_mut_ptr(),
                (messages.len() - next) as libc::c_uint,
                0,
            )
        };
        if n > 0 {
            next += n as usize;
        } else if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
            continue;
        } else {
            // This frame is refused (e.g. ENOBUFS): drop it, go on.
            failed += 1;
            next += 1;
        }
    }
    failed
}

/// Blocks SIGINT and SIGTERM in this thread (and the threads it starts).
fn block_stop_signals() -> libc::sigset_t {
    // SAFETY: sigset_t is initialized by sigemptyset before use; the calls
    // only change this thread's signal mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

fn wait_for(signals: &libc::sigset_t) -> Result<(), NetemError> {
    let mut signal = 0;
    // SAFETY: `signals` is an initialized set blocked in this thread.
    let rc = unsafe { libc::sigwait(signals, &mut signal) };
    if rc == 0 {
        Ok(())
    } else {
        Err(NetemError::Signal(io::Error::from_raw_os_error(rc)))
    }
}
