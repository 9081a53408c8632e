//! What each rank publishes at rendezvous, and how a host is identified.

use std::net::IpAddr;

use crate::codec;

/// Identifies a machine (more precisely, one boot of one kernel): ranks with
/// equal `HostId`s share memory and loopback.
#[derive(Debug, Clone, PartialEq, Eq, Hash, bincode::Encode, bincode::Decode)]
pub struct HostId {
    /// The host name, for messages.
    pub hostname: String,
    /// `/proc/sys/kernel/random/boot_id`, so two containers or machines that
    /// share a host name are still told apart (empty where unavailable).
    pub boot_id: String,
}

impl HostId {
    /// This machine's identity.
    pub fn local() -> Self {
        let hostname = gethostname::gethostname().to_string_lossy().into_owned();
        let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|s| s.trim().to_string())
            .unwrap_or_default();
        Self { hostname, boot_id }
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
