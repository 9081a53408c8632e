//! A real etcd server for the `etcd_*` tests: Debian's `etcd-server`
//! (`/usr/bin/etcd`) on free loopback ports with its data in a temporary
//! directory, killed when dropped. The tests that start one are ignored
//! unless asked for (`-- --ignored etcd_`), since the toolchain does not
//! bring etcd; asked for without it, they fail saying what to install.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::free_ports;

const ETCD: &str = "/usr/bin/etcd";

/// One etcd member serving clients on `127.0.0.1:port`.
pub(crate) struct Etcd {
    child: Child,
    dir: tempfile::TempDir,
    /// Its client port.
    pub(crate) port: u16,
}

impl Etcd {
    /// Starts etcd and waits (up to 20 s) until it answers.
    pub(crate) fn start() -> Etcd {
        Etcd::cluster(1).pop().unwrap()
    }

    /// Starts `members` etcd servers forming one cluster and waits (up to
    /// 20 s) until each answers.
    pub(crate) fn cluster(members: usize) -> Vec<Etcd> {
        assert!(
            Path::new(ETCD).exists(),
            "this test needs etcd-server ({ETCD}): `apt-get install -y etcd-server`"
        );
        let ports: Vec<(u16, u16)> = free_ports(2 * members)
            .chunks(2)
            .map(|pair| (pair[0], pair[1]))
            .collect();
        let initial: Vec<String> = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("m{i}=http://127.0.0.1:{peer}"))
            .collect();
        let mut started = Vec::new();
        for (i, &(port, peer)) in ports.iter().enumerate() {
            let dir = tempfile::tempdir().unwrap();
            let client_url = format!("http://127.0.0.1:{port}");
            let peer_url = format!("http://127.0.0.1:{peer}");
            let log = std::fs::File::create(dir.path().join("etcd.log")).unwrap();
            let child = Command::new(ETCD)
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
            started.push(Etcd { child, dir, port });
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

    /// `127.0.0.1:port`.
    pub(crate) fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The `etcd://` init URL of this server under `prefix` (e.g. `/test1`).
    pub(crate) fn url(&self, prefix: &str) -> String {
        format!("etcd://{}{prefix}", self.endpoint())
    }

    /// What etcd printed.
    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default()
    }

    /// Whether a range request gets a JSON reply.
    fn answers(&self) -> bool {
        use std::io::{Read, Write};
        let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
        let body = r#"{"key":"AA=="}"#;
        let request = format!(
            "POST /v3/kv/range HTTP/1.0\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
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
