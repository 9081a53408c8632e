//! A real etcd server for the `etcd_*` tests: Debian's `etcd-server`
//! (`/usr/bin/etcd`) on free loopback ports, or on simulated hosts
//! ([`Etcd::cluster_on`]), with its data in a temporary directory, killed
//! when dropped. The tests that start one are ignored unless asked for
//! (`-- --ignored etcd_`), since the toolchain does not bring etcd; asked
//! for without it, they fail saying what to install.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::cluster::{Cluster, on_host};
use super::free_ports;

const ETCD: &str = "/usr/bin/etcd";

/// etcd's client and peer ports on a simulated host (its own address).
const HOST_PORTS: (u16, u16) = (2379, 2380);

/// One etcd member serving clients on `addr:port`.
pub(crate) struct Etcd {
    child: Child,
    dir: tempfile::TempDir,
    /// Its client address.
    addr: String,
    /// Its client port.
    pub(crate) port: u16,
    /// The simulated host it runs on (cluster prefix, host), if any.
    host: Option<(String, usize)>,
}

/// Where one member listens, and how to start a program where it runs.
struct Member {
    addr: String,
    port: u16,
    peer: u16,
    host: Option<(String, usize)>,
}

impl Etcd {
    /// Starts etcd and waits (up to 20 s) until it answers.
    pub(crate) fn start() -> Etcd {
        Etcd::cluster(1).pop().unwrap()
    }

    /// Starts `members` etcd servers on loopback forming one cluster and
    /// waits (up to 20 s) until each answers.
    pub(crate) fn cluster(members: usize) -> Vec<Etcd> {
        let members = free_ports(2 * members)
            .chunks(2)
            .map(|pair| Member {
                addr: "127.0.0.1".into(),
                port: pair[0],
                peer: pair[1],
                host: None,
            })
            .collect();
        Etcd::start_members(members)
    }

    /// Starts one member on each of `hosts` of `cluster` (on its `eth0`
    /// address, ports 2379 and 2380), forming one etcd cluster, and waits
    /// (up to 20 s) until each answers.
    pub(crate) fn cluster_on(cluster: &Cluster, hosts: &[usize]) -> Vec<Etcd> {
        let members = hosts
            .iter()
            .map(|&host| Member {
                addr: cluster.addr(host),
                port: HOST_PORTS.0,
                peer: HOST_PORTS.1,
                host: Some((cluster.prefix().to_string(), host)),
            })
            .collect();
        Etcd::start_members(members)
    }

    fn start_members(members: Vec<Member>) -> Vec<Etcd> {
        assert!(
            Path::new(ETCD).exists(),
            "this test needs etcd-server ({ETCD}): `apt-get install -y etcd-server`"
        );
        let initial: Vec<String> = members
            .iter()
            .enumerate()
            .map(|(i, m)| format!("m{i}=http://{}:{}", m.addr, m.peer))
            .collect();
        let mut started = Vec::new();
        for (i, member) in members.into_iter().enumerate() {
            let dir = tempfile::tempdir().unwrap();
            let client_url = format!("http://{}:{}", member.addr, member.port);
            let peer_url = format!("http://{}:{}", member.addr, member.peer);
            let log = std::fs::File::create(dir.path().join("etcd.log")).unwrap();
            let mut command = match &member.host {
                Some((prefix, host)) => on_host(prefix, *host, ETCD),
                None => Command::new(ETCD),
            };
            let child = command
                .args(["--name", &format!("m{i}"), "--data-dir"])
                .arg(dir.path().join("data"))
                .args(["--listen-client-urls", &client_url])
                .args(["--advertise-client-urls", &client_url])
                .args(["--listen-peer-urls", &peer_url])
                .args(["--initial-advertise-peer-urls", &peer_url])
                .args(["--initial-cluster", &initial.join(",")])
                .args(["--logger", "zap", "--log-level", "error"])
                .stdin(Stdio::null())
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .unwrap_or_else(|e| panic!("start {ETCD}: {e}"));
            started.push(Etcd {
                child,
                dir,
                addr: member.addr,
                port: member.port,
                host: member.host,
            });
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        for etcd in &mut started {
            while !etcd.answers() {
                if let Some(status) = etcd.child.try_wait().unwrap() {
                    panic!("etcd exited with {status}:\n{}", etcd.log());
                }
                assert!(
                    Instant::now() < deadline,
                    "etcd did not answer within 20s:\n{}",
                    etcd.log()
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        started
    }

    /// SIGKILLs this member.
    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// `addr:port`.
    pub(crate) fn endpoint(&self) -> String {
        format!("{}:{}", self.addr, self.port)
    }

    /// The `etcd://` init URL of this server under `prefix` (e.g. `/test1`).
    pub(crate) fn url(&self, prefix: &str) -> String {
        format!("etcd://{}{prefix}", self.endpoint())
    }

    /// What etcd printed.
    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default()
    }

    /// Whether a range request gets a JSON reply (asked from the member's
    /// simulated host when it runs on one: nothing else reaches it).
    fn answers(&self) -> bool {
        const BODY: &str = r#"{"key":"AA=="}"#;
        let request = format!(
            "POST /v3/kv/range HTTP/1.0\r\nContent-Length: {}\r\n\r\n{BODY}",
            BODY.len()
        );
        if let Some((prefix, host)) = &self.host {
            let probe = format!(
                "exec 3<>/dev/tcp/{}/{} && printf '{}' >&3 && timeout 2 head -c 12 <&3",
                self.addr,
                self.port,
                request.replace("\r\n", "\\r\\n")
            );
            let reply = on_host(prefix, *host, "bash").args(["-c", &probe]).output();
            return reply.is_ok_and(|r| r.stdout.starts_with(b"HTTP/1.0 200"));
        }
        use std::io::{Read, Write};
        let Ok(mut stream) = std::net::TcpStream::connect((self.addr.as_str(), self.port)) else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
        let mut reply = String::new();
        stream.write_all(request.as_bytes()).is_ok()
            && stream.read_to_string(&mut reply).is_ok()
            && reply.starts_with("HTTP/1.0 200")
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
