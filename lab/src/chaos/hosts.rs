//! Simulated hosts for `chorus chaos --hosts N` (root only): each host a
//! network namespace, with a mount namespace of its own per launcher
//! whose `/dev/shm` is the host's tmpfs and a host name of its own, so that
//! ranks on different hosts talk over the network, never shared memory.
//!
//! ```text
//!  host i (netns)        link i (netns)                 switch (netns)
//!  eth0 10.78.0.i  ----  a ==kbr (or chorus netem)== b  ----  p<i> == br0 10.78.0.254 (the store)
//! ```
//!
//! The store is served by `chorus chaos` on the switch's bridge, which no
//! fault touches. A partition takes `b` down, cutting the host off from
//! the other hosts and the store alike; a lossy or slow link puts
//! `chorus netem` between `a` and `b` instead of the kernel bridge (this
//! kernel may lack `sch_netem`, so impairing is done in userspace), until
//! the fault is undone. Every host's `eth0` hands the link one frame per
//! transmission (`gso_max_segs 1`), as a real link carries them and as
//! `chorus netem` forwards them.
//!
//! Everything is made with `ip` and removed when [`Hosts`] drops: the
//! impairers, the processes left in the namespaces, the namespaces (their
//! veths with them) and the hosts' tmpfs mounts.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use chorus::process::{self, Signal};
use thiserror::Error;

/// The store's address on the switch.
pub const STORE_ADDR: std::net::Ipv4Addr = std::net::Ipv4Addr::new(10, 78, 0, 254);

/// Why simulated hosts could not be made or changed.
#[derive(Debug, Error)]
pub enum HostsError {
    /// Namespaces, veths and mounts need root.
    #[error("--hosts needs root (network namespaces, veths and tmpfs mounts); run as root or use --nodes")]
    NotRoot,
    /// `ip` or a mount failed.
    #[error("{what}: {why}")]
    Setup {
        /// What was being done.
        what: String,
        /// Its error output.
        why: String,
    },
}

fn setup(what: impl Into<String>, why: impl ToString) -> HostsError {
    HostsError::Setup {
        what: what.into(),
        why: why.to_string(),
    }
}

/// One simulated host's impairer, while its link is impaired.
struct Host {
    netem: Option<Child>,
}

/// `count` simulated hosts, numbered from 1, and their switch.
pub struct Hosts {
    /// Names every namespace: `<prefix>-h<i>`, `-l<i>`, `-sw`.
    prefix: String,
    /// Where the hosts' `/dev/shm` tmpfs are mounted in this namespace.
    root: PathBuf,
    hosts: Vec<Host>,
}

/// Runs `ip` with `args`.
fn ip(args: &[&str]) -> Result<(), HostsError> {
    let output = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| setup("running ip (iproute2)", e))?;
    match output.status.success() {
        true => Ok(()),
        false => Err(setup(
            format!("ip {}", args.join(" ")),
            String::from_utf8_lossy(&output.stderr).trim(),
        )),
    }
}

fn mount(source: &str, target: &Path, fstype: Option<&str>, flags: libc::c_ulong, data: &str) -> std::io::Result<()> {
    let cstr = |s: &str| CString::new(s).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput));
    let (source, target, data) = (cstr(source)?, cstr(&target.display().to_string())?, cstr(data)?);
    let fstype = fstype.map(cstr).transpose()?;
    // SAFETY: every pointer is a valid C string or null, alive for the call.
    let rc = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            fstype.as_ref().map_or(std::ptr::null(), |f| f.as_ptr()),
            flags,
            data.as_ptr().cast(),
        )
    };
    match rc {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

impl Hosts {
    /// Makes `count` hosts named after `tag` (unique per run: a pid), their
    /// `/dev/shm` tmpfs under `root`. Whatever was made is removed on error.
    pub fn up(tag: &str, count: usize, root: &Path) -> Result<Hosts, HostsError> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err(HostsError::NotRoot);
        }
        let mut hosts = Hosts {
            prefix: format!("chaos{tag}"),
            root: root.to_path_buf(),
            hosts: Vec::new(),
        };
        hosts.make(count)?;
        Ok(hosts)
    }

    fn make(&mut self, count: usize) -> Result<(), HostsError> {
        let sw = self.switch();
        ip(&["netns", "add", &sw])?;
        ip(&["-n", &sw, "link", "set", "dev", "lo", "up"])?;
        ip(&["-n", &sw, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &sw, "addr", "add", &format!("{STORE_ADDR}/24"), "dev", "br0"])?;
        ip(&["-n", &sw, "link", "set", "dev", "br0", "up"])?;
        for i in 1..=count {
            let (host, link, port) = (self.host_ns(i), self.link_ns(i), format!("p{i}"));
            // Pushed first, so that a failure below still removes what it made.
            self.hosts.push(Host { netem: None });
            ip(&["netns", "add", &host])?;
            ip(&["netns", "add", &link])?;
            ip(&["-n", &host, "link", "set", "dev", "lo", "up"])?;
            ip(&[
                "link", "add", "name", "eth0", "netns", &host, "type", "veth", "peer", "name", "a", "netns", &link,
            ])?;
            ip(&[
                "link", "add", "name", "b", "netns", &link, "type", "veth", "peer", "name", &port, "netns", &sw,
            ])?;
            ip(&["-n", &host, "addr", "add", &format!("10.78.0.{i}/24"), "dev", "eth0"])?;
            ip(&["-n", &host, "link", "set", "dev", "eth0", "gso_max_segs", "1"])?;
            ip(&["-n", &host, "link", "set", "dev", "eth0", "up"])?;
            ip(&["-n", &link, "link", "add", "kbr", "type", "bridge"])?;
            for dev in ["a", "b", "kbr"] {
                ip(&["-n", &link, "link", "set", "dev", dev, "up"])?;
            }
            self.bridge(i, true)?;
            ip(&["-n", &sw, "link", "set", "dev", &port, "master", "br0"])?;
            ip(&["-n", &sw, "link", "set", "dev", &port, "up"])?;
            let shm = self.shm(i);
            std::fs::create_dir_all(&shm).map_err(|e| setup(format!("creating {}", shm.display()), e))?;
            mount("tmpfs", &shm, Some("tmpfs"), 0, "size=1g,mode=1777")
                .map_err(|e| setup(format!("mounting a tmpfs on {}", shm.display()), e))?;
        }
        Ok(())
    }

    fn switch(&self) -> String {
        format!("{}-sw", self.prefix)
    }

    fn host_ns(&self, i: usize) -> String {
        format!("{}-h{i}", self.prefix)
    }

    fn link_ns(&self, i: usize) -> String {
        format!("{}-l{i}", self.prefix)
    }

    /// Hosts, numbered `1..=count()`.
    pub fn count(&self) -> usize {
        self.hosts.len()
    }

    /// Host `i`'s `/dev/shm`, as this namespace sees it.
    pub fn shm(&self, i: usize) -> PathBuf {
        self.root.join(format!("h{i}-shm"))
    }

    /// Host `i`'s name.
    pub fn hostname(&self, i: usize) -> String {
        format!("{}-host{i}", self.prefix)
    }

    /// The inode of each host's network namespace: a process in one of
    /// them is the run's.
    pub fn net_inodes(&self) -> Vec<u64> {
        use std::os::unix::fs::MetadataExt;
        (1..=self.count())
            .filter_map(|i| std::fs::metadata(format!("/run/netns/{}", self.host_ns(i))).ok())
            .map(|m| m.ino())
            .collect()
    }

    /// A listener on the switch's bridge (`port` 0: any), for the store.
    pub fn listen_on_switch(&self, port: u16) -> Result<std::net::TcpListener, HostsError> {
        let ns = File::open(format!("/run/netns/{}", self.switch()))
            .map_err(|e| setup("opening the switch's namespace", e))?;
        // A thread of its own enters the namespace: the socket stays in it,
        // and this thread's namespace is left alone.
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    // SAFETY: setns on this thread only, with an open namespace fd.
                    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                        return Err(setup(
                            "entering the switch's namespace",
                            std::io::Error::last_os_error(),
                        ));
                    }
                    std::net::TcpListener::bind((STORE_ADDR, port))
                        .map_err(|e| setup("binding the store on the switch", e))
                })
                .join()
                .unwrap_or_else(|_| Err(setup("binding the store on the switch", "the thread panicked")))
        })
    }

    /// `command` set to start on host `i`: in its network namespace, in a
    /// mount namespace of its own with the host's tmpfs on `/dev/shm`, with
    /// the host's name. Spawn it while the returned file (the namespace,
    /// entered in the child) is alive.
    pub fn enter(&self, i: usize, command: &mut Command) -> Result<File, HostsError> {
        let ns = File::open(format!("/run/netns/{}", self.host_ns(i)))
            .map_err(|e| setup(format!("opening host {i}'s namespace"), e))?;
        let fd = ns.as_raw_fd();
        let cstr = |s: String| CString::new(s).map_err(|e| setup("a path with a NUL", e));
        let shm = cstr(self.shm(i).display().to_string())?;
        let (dev_shm, root) = (cstr("/dev/shm".into())?, cstr("/".into())?);
        let name = self.hostname(i);
        // SAFETY: only system calls between fork and exec, on memory made
        // before the fork.
        unsafe {
            command.pre_exec(move || {
                let check = |rc: libc::c_int| match rc {
                    0 => Ok(()),
                    _ => Err(std::io::Error::last_os_error()),
                };
                check(libc::setns(fd, libc::CLONE_NEWNET))?;
                check(libc::unshare(libc::CLONE_NEWNS | libc::CLONE_NEWUTS))?;
                // Mounts made here stay here.
                check(libc::mount(
                    std::ptr::null(),
                    root.as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null(),
                ))?;
                check(libc::mount(
                    shm.as_ptr(),
                    dev_shm.as_ptr(),
                    std::ptr::null(),
                    libc::MS_BIND,
                    std::ptr::null(),
                ))?;
                check(libc::sethostname(name.as_ptr().cast(), name.len()))
            });
        }
        Ok(ns)
    }

    /// Joins or parts host `i`'s link's two sides through the kernel bridge.
    fn bridge(&self, i: usize, join: bool) -> Result<(), HostsError> {
        let link = self.link_ns(i);
        for dev in ["a", "b"] {
            match join {
                true => ip(&["-n", &link, "link", "set", "dev", dev, "master", "kbr"])?,
                false => ip(&["-n", &link, "link", "set", "dev", dev, "nomaster"])?,
            }
        }
        Ok(())
    }

    /// Takes host `i` off the network (`cut`) or puts it back.
    pub fn partition(&self, i: usize, cut: bool) -> Result<(), HostsError> {
        ip(&[
            "-n",
            &self.link_ns(i),
            "link",
            "set",
            "dev",
            "b",
            if cut { "down" } else { "up" },
        ])
    }

    /// Puts `chorus netem` (`chorus`, with `flags`) on host `i`'s link
    /// instead of the kernel bridge; `log` gets its output.
    pub fn impair(&mut self, i: usize, chorus: &Path, flags: &[String], log: File) -> Result<u32, HostsError> {
        self.bridge(i, false)?;
        let ns = File::open(format!("/run/netns/{}", self.link_ns(i)))
            .map_err(|e| setup(format!("opening link {i}'s namespace"), e))?;
        let fd = ns.as_raw_fd();
        let mut command = Command::new(chorus);
        command
            .args(["netem", "--a", "a", "--b", "b"])
            .args(flags)
            .stdin(Stdio::null())
            .stderr(log.try_clone().map_err(|e| setup("the impairer's log", e))?)
            .stdout(log);
        // SAFETY: only system calls between fork and exec.
        unsafe {
            command.pre_exec(move || {
                if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        match command.spawn() {
            Ok(child) => {
                let pid = child.id();
                self.hosts[i - 1].netem = Some(child);
                Ok(pid)
            }
            Err(e) => {
                let _ = self.bridge(i, true);
                Err(setup(format!("starting {} netem", chorus.display()), e))
            }
        }
    }

    /// Whether host `i`'s link is impaired now.
    pub fn impaired(&self, i: usize) -> bool {
        self.hosts[i - 1].netem.is_some()
    }

    /// Stops host `i`'s impairer and joins its link through the kernel
    /// bridge again.
    pub fn clear(&mut self, i: usize) -> Result<(), HostsError> {
        if let Some(mut netem) = self.hosts[i - 1].netem.take() {
            let _ = netem.kill();
            let _ = netem.wait();
            self.bridge(i, true)?;
        }
        Ok(())
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for i in 1..=self.count() {
            if let Some(mut netem) = self.hosts[i - 1].netem.take() {
                let _ = netem.kill();
                let _ = netem.wait();
            }
        }
        let mut names = vec![self.switch()];
        for i in 1..=self.count() {
            names.extend([self.host_ns(i), self.link_ns(i)]);
        }
        for name in names {
            // A process left in a namespace would keep it alive.
            if let Ok(output) = Command::new("ip").args(["netns", "pids", &name]).output() {
                for pid in String::from_utf8_lossy(&output.stdout).split_whitespace() {
                    if let Ok(pid) = pid.parse::<i32>() {
                        process::signal(pid, Signal::SIGKILL);
                    }
                }
            }
            let _ = ip(&["netns", "del", &name]);
        }
        for i in 1..=self.count() {
            let shm = self.shm(i);
            if let Ok(path) = CString::new(shm.display().to_string()) {
                // SAFETY: a valid C string; a lazy unmount, in case a dying
                // process still holds a file there.
                unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH) };
            }
            let _ = std::fs::remove_dir(&shm);
        }
        let _ = std::fs::remove_dir(&self.root);
    }
}
