//! NUMA binding (`chorus launch --numa-binding`, the benches' ranks): the
//! CPUs each worker process may run on, in torchrun's four modes
//! (`torch/numa/binding.py`, PyTorch 2.8+).
//!
//! Binding matters to chorus beyond memory locality: a rank's threads hand
//! work to each other (the caller to its actor, a socket or ring to the
//! actor), and on a virtual machine whose idle CPUs halt, waking a thread on
//! another CPU costs 20-45 us against 3 us on the same one
//! (bench/HISTORY.md §19). A worker bound to its own CPUs keeps its threads
//! together and out of the other workers' way.
//!
//! # Rules
//! 1. A worker's NUMA node: torchrun takes the node of the accelerator whose
//!    index is `LOCAL_RANK`. Here local rank i takes the i-th NVIDIA GPU in
//!    PCI order (`nvidia-smi`'s order) when the host has one for every local
//!    rank; otherwise (CPU ranks) the local ranks are dealt to the NUMA
//!    nodes in order, in equal blocks, as GPUs usually sit (0-3 on node 0,
//!    4-7 on node 1).
//! 2. Only the CPUs the launcher may use count (`sched_getaffinity`: a
//!    cgroup, `taskset` or Slurm's binding narrows them); a worker whose
//!    node keeps none of them is an error.
//! 3. `node`: every CPU of the worker's node. `socket`: every CPU of the
//!    nodes in the package of the worker's node.
//! 4. `exclusive`: the node's physical cores (SMT siblings stay together),
//!    in order of their first CPU, split into consecutive shares among the
//!    node's workers; the first `cores % workers` take one core more. Fewer
//!    cores than workers is an error, as in torchrun.
//! 5. `core-complex`: the node's last-level caches, largest first (then by
//!    first CPU); the node's j-th worker takes cache `j % caches`.
//! 6. The binding is set in the child between `fork` and `exec`, so every
//!    thread the worker starts inherits it.

use std::collections::BTreeSet;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use thiserror::Error;

/// torchrun's `--numa-binding` modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NumaBinding {
    /// Every CPU of the worker's NUMA node.
    Node,
    /// Every CPU of the package holding the worker's node.
    Socket,
    /// A share of the node's physical cores no other worker has.
    Exclusive,
    /// One last-level cache's CPUs.
    CoreComplex,
}

impl NumaBinding {
    /// The spellings, for help and errors.
    pub const CHOICES: &'static str = "node, socket, exclusive or core-complex";

    /// The name torchrun gives it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Node => "node",
            Self::Socket => "socket",
            Self::Exclusive => "exclusive",
            Self::CoreComplex => "core-complex",
        }
    }
}

impl fmt::Display for NumaBinding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for NumaBinding {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.trim() {
            "node" => Ok(Self::Node),
            "socket" => Ok(Self::Socket),
            "exclusive" => Ok(Self::Exclusive),
            "core-complex" | "core_complex" => Ok(Self::CoreComplex),
            other => Err(format!("unknown NUMA binding {other:?}; give {}", Self::CHOICES)),
        }
    }
}

/// Why no binding could be worked out.
#[derive(Debug, Error)]
pub enum BindingError {
    /// A topology file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        source: std::io::Error,
    },
    /// A topology file holds something else than expected.
    #[error("{path} holds {text:?}, not a CPU list or number")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What it holds.
        text: String,
    },
    /// The launcher may run on no CPU it can describe.
    #[error("no usable CPU found (sched_getaffinity and /sys/devices/system/cpu disagree)")]
    NoCpus,
    /// A worker's node (its GPU's) has no CPU the launcher may use.
    #[error("NUMA node {node} has no CPU this launcher may use (its affinity or cgroup leaves none there)")]
    NodeWithoutCpus {
        /// The node.
        node: usize,
    },
    /// `exclusive` with more workers on a node than it has cores.
    #[error(
        "--numa-binding exclusive: NUMA node {node} has {cores} usable physical cores for {workers} workers; \
         use fewer workers per node, or --numa-binding node"
    )]
    TooFewCores {
        /// The node.
        node: usize,
        /// Its usable physical cores.
        cores: usize,
        /// The workers dealt to it.
        workers: usize,
    },
}

/// One usable logical CPU and where it sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cpu {
    /// Logical CPU number.
    pub id: usize,
    /// NUMA node.
    pub node: usize,
    /// Package (socket).
    pub package: usize,
    /// Physical core, named by its first logical CPU.
    pub core: usize,
    /// Last-level cache, named by its first logical CPU.
    pub cache: usize,
}

/// The usable CPUs of this host and the NUMA node of each GPU.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Topology {
    /// Usable CPUs, by id.
    pub cpus: Vec<Cpu>,
    /// The NUMA node of each NVIDIA GPU, in PCI order.
    pub gpu_nodes: Vec<usize>,
}

impl Topology {
    /// The node of `local_rank` of `local_world` (rule 1).
    fn node_of(&self, local_rank: usize, local_world: usize) -> usize {
        if self.gpu_nodes.len() >= local_world {
            return self.gpu_nodes[local_rank];
        }
        let nodes: Vec<usize> = self
            .cpus
            .iter()
            .map(|c| c.node)
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        nodes[local_rank * nodes.len() / local_world]
    }

    /// The CPUs `local_rank` of `local_world` is bound to under `mode`, ascending.
    pub fn cpus_for(
        &self,
        mode: NumaBinding,
        local_rank: usize,
        local_world: usize,
    ) -> Result<Vec<usize>, BindingError> {
        if self.cpus.is_empty() {
            return Err(BindingError::NoCpus);
        }
        let node = self.node_of(local_rank, local_world);
        let on_node = || self.cpus.iter().filter(move |c| c.node == node);
        if on_node().next().is_none() {
            return Err(BindingError::NodeWithoutCpus { node });
        }
        // The node's workers, and this one's place among them.
        let workers: Vec<usize> = (0..local_world)
            .filter(|&r| self.node_of(r, local_world) == node)
            .collect();
        let place = workers.iter().position(|&r| r == local_rank).unwrap_or(0);
        let chosen: Vec<usize> = match mode {
            NumaBinding::Node => on_node().map(|c| c.id).collect(),
            NumaBinding::Socket => {
                let packages: BTreeSet<usize> = on_node().map(|c| c.package).collect();
                let nodes: BTreeSet<usize> = self
                    .cpus
                    .iter()
                    .filter(|c| packages.contains(&c.package))
                    .map(|c| c.node)
                    .collect();
                self.cpus
                    .iter()
                    .filter(|c| nodes.contains(&c.node))
                    .map(|c| c.id)
                    .collect()
            }
            NumaBinding::Exclusive => {
                let cores: Vec<usize> = on_node().map(|c| c.core).collect::<BTreeSet<_>>().into_iter().collect();
                if cores.len() < workers.len() {
                    return Err(BindingError::TooFewCores {
                        node,
                        cores: cores.len(),
                        workers: workers.len(),
                    });
                }
                let (share, extra) = (cores.len() / workers.len(), cores.len() % workers.len());
                let start = place * share + place.min(extra);
                let mine = &cores[start..start + share + usize::from(place < extra)];
                on_node().filter(|c| mine.contains(&c.core)).map(|c| c.id).collect()
            }
            NumaBinding::CoreComplex => {
                let mut caches: Vec<(usize, usize)> = on_node()
                    .map(|c| c.cache)
                    .collect::<BTreeSet<_>>()
                    .into_iter()
                    .map(|cache| (on_node().filter(|c| c.cache == cache).count(), cache))
                    .collect();
                caches.sort_by_key(|&(size, first)| (std::cmp::Reverse(size), first));
                let cache = caches[place % caches.len()].1;
                on_node().filter(|c| c.cache == cache).map(|c| c.id).collect()
            }
        };
        Ok(chosen)
    }

    /// Every local rank's CPUs under `mode`.
    pub fn plan(&self, mode: NumaBinding, local_world: usize) -> Result<Vec<Vec<usize>>, BindingError> {
        (0..local_world)
            .map(|rank| self.cpus_for(mode, rank, local_world))
            .collect()
    }

    /// This host's topology from `/sys`, limited to the CPUs this process may use.
    pub fn read() -> Result<Self, BindingError> {
        Self::read_from(Path::new("/sys"), &allowed_cpus())
    }

    /// The topology under `sys` (a `/sys` tree) for the CPUs in `allowed`.
    pub fn read_from(sys: &Path, allowed: &[usize]) -> Result<Self, BindingError> {
        let cpu_dir = sys.join("devices/system/cpu");
        let mut cpus = Vec::new();
        for &id in allowed {
            let dir = cpu_dir.join(format!("cpu{id}"));
            if !dir.exists() {
                continue;
            }
            let topology = dir.join("topology");
            let first_of = |path: &Path| -> Result<usize, BindingError> {
                read_cpu_list(path)?
                    .first()
                    .copied()
                    .ok_or_else(|| parse_error(path, ""))
            };
            cpus.push(Cpu {
                id,
                node: node_of_cpu(&dir)?,
                // -1 (unknown) reads as package 0.
                package: read_number(&topology.join("physical_package_id"))?.max(0) as usize,
                core: first_of(&topology.join("thread_siblings_list"))?,
                cache: match last_level_cache(&dir.join("cache"))? {
                    Some(path) => first_of(&path)?,
                    None => usize::MAX,
                },
            });
        }
        if cpus.is_empty() {
            return Err(BindingError::NoCpus);
        }
        Ok(Self {
            cpus,
            gpu_nodes: gpu_nodes(&sys.join("bus/pci/devices"))?,
        })
    }
}

/// The CPUs this process may run on.
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: sched_getaffinity writes at most `size_of::<cpu_set_t>()`
    // bytes into the zeroed set it is given.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&cpu| libc::CPU_ISSET(cpu, &set))
            .collect()
    }
}

/// `cpus` as a `cpu_set_t`, for [`bind_current_process`].
pub fn cpu_set(cpus: &[usize]) -> libc::cpu_set_t {
    // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET ignores CPUs
    // past CPU_SETSIZE.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &cpu in cpus {
            libc::CPU_SET(cpu, &mut set);
        }
        set
    }
}

/// Binds the calling thread, and so every thread and process it starts
/// afterwards, to `set`. Async-signal-safe: for `pre_exec`.
pub fn bind_current_process(set: &libc::cpu_set_t) -> std::io::Result<()> {
    // SAFETY: sched_setaffinity reads `size_of::<cpu_set_t>()` bytes of `set`.
    if unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), set) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `0-3,8` from `[0, 1, 2, 3, 8]` (numactl's and sysfs's notation).
pub fn format_cpu_list(cpus: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            cpus[i].to_string()
        } else {
            format!("{}-{}", cpus[i], cpus[j])
        });
        i = j + 1;
    }
    parts.join(",")
}

/// `[0, 1, 2, 3, 8]` from `0-3,8`; `None` when it is not such a list.
pub fn parse_cpu_list(text: &str) -> Option<Vec<usize>> {
    let text = text.trim();
    if text.is_empty() {
        return Some(Vec::new());
    }
    let mut cpus = BTreeSet::new();
    for part in text.split(',') {
        match part.split_once('-') {
            Some((low, high)) => {
                let (low, high) = (low.parse::<usize>().ok()?, high.parse::<usize>().ok()?);
                if low > high {
                    return None;
                }
                cpus.extend(low..=high);
            }
            None => {
                cpus.insert(part.parse().ok()?);
            }
        }
    }
    Some(cpus.into_iter().collect())
}

fn read(path: &Path) -> Result<String, BindingError> {
    std::fs::read_to_string(path).map_err(|source| BindingError::Read {
        path: path.to_path_buf(),
        source,
    })
}

fn parse_error(path: &Path, text: &str) -> BindingError {
    BindingError::Parse {
        path: path.to_path_buf(),
        text: text.trim().to_string(),
    }
}

fn read_cpu_list(path: &Path) -> Result<Vec<usize>, BindingError> {
    let text = read(path)?;
    parse_cpu_list(&text).ok_or_else(|| parse_error(path, &text))
}

fn read_number(path: &Path) -> Result<i64, BindingError> {
    let text = read(path)?;
    text.trim().parse().map_err(|_| parse_error(path, &text))
}

/// The node a CPU's directory links to (`nodeN`); node 0 on kernels without NUMA.
fn node_of_cpu(dir: &Path) -> Result<usize, BindingError> {
    let entries = std::fs::read_dir(dir).map_err(|source| BindingError::Read {
        path: dir.to_path_buf(),
        source,
    })?;
    Ok(entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.strip_prefix("node")?.parse().ok())
        .min()
        .unwrap_or(0))
}

/// The `shared_cpu_list` of the highest-level data or unified cache under
/// `cache_dir`, if the kernel describes any.
fn last_level_cache(cache_dir: &Path) -> Result<Option<PathBuf>, BindingError> {
    let Ok(entries) = std::fs::read_dir(cache_dir) else {
        return Ok(None);
    };
    let mut best: Option<(i64, PathBuf)> = None;
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name();
        let is_index = name
            .to_str()
            .and_then(|n| n.strip_prefix("index"))
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
        if !is_index {
            continue;
        }
        let dir = entry.path();
        if !matches!(read(&dir.join("type"))?.trim(), "Unified" | "Data") {
            continue;
        }
        let level = read_number(&dir.join("level"))?;
        if best.as_ref().is_none_or(|(best, _)| level > *best) {
            best = Some((level, dir.join("shared_cpu_list")));
        }
    }
    Ok(best.map(|(_, path)| path))
}

/// The NUMA node of each NVIDIA display or 3D controller under `pci_dir`, in
/// PCI address order (nodes the kernel does not know read as 0).
fn gpu_nodes(pci_dir: &Path) -> Result<Vec<usize>, BindingError> {
    let Ok(entries) = std::fs::read_dir(pci_dir) else {
        return Ok(Vec::new());
    };
    let mut devices: Vec<PathBuf> = entries.filter_map(Result::ok).map(|e| e.path()).collect();
    devices.sort();
    let mut nodes = Vec::new();
    for device in devices {
        let field = |name: &str| std::fs::read_to_string(device.join(name)).unwrap_or_default();
        let (vendor, class) = (field("vendor"), field("class"));
        let gpu = vendor.trim() == "0x10de" && (class.starts_with("0x0300") || class.starts_with("0x0302"));
        if gpu {
            nodes.push(read_number(&device.join("numa_node")).map_or(0, |n| n.max(0) as usize));
        }
    }
    Ok(nodes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `sockets` packages of `nodes_per_socket` nodes of `cores_per_node`
    /// cores with `threads` SMT threads each; CPUs numbered like Linux does
    /// (every core's first thread, then every core's second thread), one L3
    /// per `cores_per_cache` cores.
    fn host(
        sockets: usize,
        nodes_per_socket: usize,
        cores_per_node: usize,
        threads: usize,
        cores_per_cache: usize,
    ) -> Topology {
        let cores = sockets * nodes_per_socket * cores_per_node;
        let mut cpus = Vec::new();
        for thread in 0..threads {
            for core in 0..cores {
                let node = core / cores_per_node;
                cpus.push(Cpu {
                    id: thread * cores + core,
                    node,
                    package: node / nodes_per_socket,
                    core,
                    cache: core / cores_per_cache * cores_per_cache,
                });
            }
        }
        cpus.sort_by_key(|c| c.id);
        Topology {
            cpus,
            gpu_nodes: Vec::new(),
        }
    }

    fn plan(topology: &Topology, mode: NumaBinding, world: usize) -> Vec<String> {
        topology
            .plan(mode, world)
            .unwrap()
            .iter()
            .map(|cpus| format_cpu_list(cpus))
            .collect()
    }

    #[test]
    fn cpu_lists_read_and_write_like_sysfs() {
        assert_eq!(parse_cpu_list("0-3,8,10-11\n"), Some(vec![0, 1, 2, 3, 8, 10, 11]));
        assert_eq!(parse_cpu_list(""), Some(vec![]));
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("a"), None);
        assert_eq!(format_cpu_list(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(format_cpu_list(&[5]), "5");
        assert_eq!("core_complex".parse::<NumaBinding>(), Ok(NumaBinding::CoreComplex));
        assert!("cores".parse::<NumaBinding>().unwrap_err().contains("exclusive"));
    }

    #[test]
    fn exclusive_gives_each_worker_its_own_cores_on_a_two_core_host() {
        let two = host(1, 1, 2, 1, 2);
        assert_eq!(plan(&two, NumaBinding::Exclusive, 2), ["0", "1"]);
        assert_eq!(plan(&two, NumaBinding::Exclusive, 1), ["0-1"]);
        assert!(matches!(
            two.plan(NumaBinding::Exclusive, 4),
            Err(BindingError::TooFewCores {
                node: 0,
                cores: 2,
                workers: 4
            })
        ));
        assert_eq!(plan(&two, NumaBinding::Node, 4), ["0-1"; 4]);
    }

    #[test]
    fn exclusive_keeps_smt_siblings_together_and_spreads_the_remainder_first() {
        // 2 nodes x 5 cores x 2 threads: CPUs 0-9 first threads, 10-19 siblings.
        let smt = host(1, 2, 5, 2, 5);
        // 4 CPU ranks: 0-1 on node 0 (3 + 2 cores), 2-3 on node 1.
        assert_eq!(
            plan(&smt, NumaBinding::Exclusive, 4),
            ["0-2,10-12", "3-4,13-14", "5-7,15-17", "8-9,18-19"]
        );
        assert_eq!(
            plan(&smt, NumaBinding::Node, 4),
            ["0-4,10-14", "0-4,10-14", "5-9,15-19", "5-9,15-19"]
        );
        // Both nodes share one package.
        assert_eq!(plan(&smt, NumaBinding::Socket, 2), ["0-19", "0-19"]);
    }

    #[test]
    fn gpus_decide_the_node_when_every_local_rank_has_one() {
        let mut two_sockets = host(2, 1, 4, 1, 4);
        two_sockets.gpu_nodes = vec![1, 1, 0, 0];
        assert_eq!(plan(&two_sockets, NumaBinding::Node, 4), ["4-7", "4-7", "0-3", "0-3"]);
        assert_eq!(
            plan(&two_sockets, NumaBinding::Exclusive, 4),
            ["4-5", "6-7", "0-1", "2-3"]
        );
        assert_eq!(plan(&two_sockets, NumaBinding::Socket, 4), ["4-7", "4-7", "0-3", "0-3"]);
        // More ranks than GPUs: CPU ranks, dealt in order.
        assert_eq!(
            plan(&two_sockets, NumaBinding::Node, 8)[..5],
            ["0-3", "0-3", "0-3", "0-3", "4-7"]
        );
    }

    #[test]
    fn core_complex_hands_out_last_level_caches_largest_first() {
        // One node, 8 cores, L3s of 4 cores; a 9th CPU with a cache of its own.
        let mut ccx = host(1, 1, 8, 1, 4);
        ccx.cpus.push(Cpu {
            id: 8,
            node: 0,
            package: 0,
            core: 8,
            cache: 8,
        });
        assert_eq!(plan(&ccx, NumaBinding::CoreComplex, 4), ["0-3", "4-7", "8", "0-3"]);
    }

    #[test]
    fn reads_a_sysfs_tree_and_keeps_only_the_allowed_cpus() {
        let root = std::env::temp_dir().join(format!("chorus-binding-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let write = |path: &str, text: &str| {
            let path = root.join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        };
        // 4 CPUs, two SMT pairs (0,2) and (1,3), nodes 0 and 1, one L3 each.
        for cpu in 0..4 {
            let dir = format!("devices/system/cpu/cpu{cpu}");
            std::fs::create_dir_all(root.join(format!("{dir}/node{}", cpu % 2))).unwrap();
            write(&format!("{dir}/topology/physical_package_id"), "0\n");
            write(
                &format!("{dir}/topology/thread_siblings_list"),
                &format!("{},{}\n", cpu % 2, cpu % 2 + 2),
            );
            write(&format!("{dir}/cache/index0/type"), "Instruction\n");
            write(&format!("{dir}/cache/index0/level"), "1\n");
            write(&format!("{dir}/cache/index3/type"), "Unified\n");
            write(&format!("{dir}/cache/index3/level"), "3\n");
            write(
                &format!("{dir}/cache/index3/shared_cpu_list"),
                &format!("{},{}\n", cpu % 2, cpu % 2 + 2),
            );
        }
        write("bus/pci/devices/0000:41:00.0/vendor", "0x10de\n");
        write("bus/pci/devices/0000:41:00.0/class", "0x030200\n");
        write("bus/pci/devices/0000:41:00.0/numa_node", "1\n");
        write("bus/pci/devices/0000:01:00.0/vendor", "0x10de\n");
        write("bus/pci/devices/0000:01:00.0/class", "0x030000\n");
        write("bus/pci/devices/0000:01:00.0/numa_node", "-1\n");
        write("bus/pci/devices/0000:02:00.0/vendor", "0x8086\n");
        write("bus/pci/devices/0000:02:00.0/class", "0x030000\n");

        let topology = Topology::read_from(&root, &[0, 1, 2, 3, 9]).unwrap();
        assert_eq!(topology.gpu_nodes, [0, 1]);
        assert_eq!(
            topology.cpus[2],
            Cpu {
                id: 2,
                node: 0,
                package: 0,
                core: 0,
                cache: 0
            }
        );
        assert_eq!(plan(&topology, NumaBinding::Node, 2), ["0,2", "1,3"]);
        // GPU 0 sits on node 0, whose CPUs this launcher may not use.
        let narrowed = Topology::read_from(&root, &[1, 3]).unwrap();
        assert_eq!(narrowed.cpus_for(NumaBinding::Exclusive, 1, 2).unwrap(), [1, 3]);
        assert!(matches!(
            narrowed.cpus_for(NumaBinding::Node, 0, 2),
            Err(BindingError::NodeWithoutCpus { node: 0 })
        ));

        write("devices/system/cpu/cpu0/topology/thread_siblings_list", "zero\n");
        assert!(matches!(
            Topology::read_from(&root, &[0]),
            Err(BindingError::Parse { text, .. }) if text == "zero"
        ));
        assert!(matches!(Topology::read_from(&root, &[7]), Err(BindingError::NoCpus)));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn this_host_reads_and_binds_a_child_where_it_was_told() {
        let topology = Topology::read().expect("this host's /sys");
        let cpus = topology.cpus_for(NumaBinding::Node, 0, 1).unwrap();
        assert!(!cpus.is_empty());
        let last = *cpus.last().unwrap();
        let set = cpu_set(&[last]);
        let mut command = std::process::Command::new("sh");
        command.args(["-c", "grep Cpus_allowed_list /proc/self/status"]);
        // SAFETY: the closure only calls sched_setaffinity.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut command, move || bind_current_process(&set));
        }
        let out = command.output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            text.split_whitespace().last(),
            Some(last.to_string().as_str()),
            "{text}"
        );
    }
}
