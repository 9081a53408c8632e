//! What each rank publishes at rendezvous, and how a host is identified.

use std::net::IpAddr;
use std::os::unix::fs::MetadataExt;

use crate::codec;

/// Where a rank runs, precisely enough to tell which fast paths it shares
/// with another: containers on one machine share a kernel (boot id) but
/// not always a network namespace (loopback) or a `/dev/shm` (shared
/// memory), and `ip netns exec` keeps the host name. Compare with
/// [`HostId::same_network`], [`HostId::same_shm`], [`HostId::same_kernel`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, bincode::Encode, bincode::Decode)]
pub struct HostId {
    /// The host name, for messages.
    pub hostname: String,
    /// `/proc/sys/kernel/random/boot_id`: one boot of one kernel (empty
    /// where unavailable, and then the host name stands in for it).
    pub boot_id: String,
    /// Inode of `/proc/self/ns/net`: loopback reaches exactly the ranks in
    /// the same network namespace (0 where unavailable).
    pub net_ns: u64,
    /// Device and inode of `/dev/shm`: shared-memory rings are seen exactly
    /// by the ranks that mount the same one (0s where unavailable).
    pub shm: (u64, u64),
    /// Inode of `/proc/self/ns/pid`: a pid names the same process only
    /// within one pid namespace (0 where unavailable).
    pub pid_ns: u64,
}

impl HostId {
    /// This process's identity.
    pub fn local() -> Self {
        let hostname = gethostname::gethostname().to_string_lossy().into_owned();
        let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|s| s.trim().to_string())
            .unwrap_or_default();
        let inode = |path: &str| std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()));
        Self {
            hostname,
            boot_id,
            net_ns: inode("/proc/self/ns/net").map_or(0, |(_, ino)| ino),
            shm: inode("/dev/shm").unwrap_or((0, 0)),
            pid_ns: inode("/proc/self/ns/pid").map_or(0, |(_, ino)| ino),
        }
    }

    /// Whether both run on one kernel (so pids and namespaces compare).
    pub fn same_kernel(&self, other: &Self) -> bool {
        if self.boot_id.is_empty() || other.boot_id.is_empty() {
            return self.hostname == other.hostname;
        }
        self.boot_id == other.boot_id
    }

    /// Whether loopback connects the two: one kernel, one network namespace.
    pub fn same_network(&self, other: &Self) -> bool {
        self.same_kernel(other) && self.net_ns == other.net_ns
    }

    /// Whether a pid published by one names a process the other can watch.
    pub fn same_pids(&self, other: &Self) -> bool {
        self.same_kernel(other) && self.pid_ns != 0 && self.pid_ns == other.pid_ns
    }

    /// Whether shared-memory rings work between the two: one mount of
    /// `/dev/shm`, and pids that compare (a ring notices a dead peer by pid).
    pub fn same_shm(&self, other: &Self) -> bool {
        self.same_pids(other) && self.shm != (0, 0) && self.shm == other.shm
    }
}

impl std::fmt::Display for HostId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.hostname)
    }
}

/// One rank's published record: where it is and how to reach it.
#[derive(Debug, Clone, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct PeerRecord {
    /// The rank in this generation.
    pub rank: u32,
    /// The machine it runs on.
    pub host: HostId,
    /// Its process id, for messages.
    pub pid: u32,
    /// Addresses it can be reached at, most preferred first (see
    /// `chorus_transports::netif`): a peer on the same host picks loopback,
    /// a peer elsewhere the first routable one.
    pub addrs: Vec<IpAddr>,
    /// Transport-specific entries (ports, certificate fingerprints), by name.
    pub extras: Vec<(String, Vec<u8>)>,
}

impl PeerRecord {
    /// The entry named `name` in [`PeerRecord::extras`].
    pub fn extra(&self, name: &str) -> Option<&[u8]> {
        self.extras.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_slice())
    }

    /// The wire form stored under the rank's key.
    pub fn encode(&self) -> Vec<u8> {
        codec::encode(self)
    }

    /// Parses a stored record.
    pub fn decode(bytes: &[u8]) -> Result<Self, codec::DecodeError> {
        codec::decode(bytes)
    }
}

/// A process's claim on a rank: enough to name it in an error.
#[derive(Debug, Clone, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct Claimant {
    /// Host name of the claiming process.
    pub hostname: String,
    /// Its process id.
    pub pid: u32,
    /// Random per process, so a restarted process with a reused pid differs.
    pub nonce: u64,
    /// The world size it was started with.
    pub world_size: u32,
    /// The rank it claims.
    pub rank: u32,
}

impl std::fmt::Display for Claimant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rank {} (pid {} on {})", self.rank, self.pid, self.hostname)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_roundtrip() {
        let record = PeerRecord {
            rank: 2,
            host: HostId::local(),
            pid: 42,
            addrs: vec!["10.0.0.2".parse().unwrap(), "127.0.0.1".parse().unwrap()],
            extras: vec![("quic_port".into(), 4242u16.to_le_bytes().to_vec())],
        };
        let decoded = PeerRecord::decode(&record.encode()).unwrap();
        assert_eq!(decoded, record);
        assert_eq!(decoded.extra("quic_port"), Some(&4242u16.to_le_bytes()[..]));
        assert!(PeerRecord::decode(b"garbage").is_err());
    }
}
