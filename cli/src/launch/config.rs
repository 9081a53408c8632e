//! Sans-IO: `chorus launch`'s command line and `PET_*` variables into a
//! [`LaunchConfig`], the way torchrun reads them.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use thiserror::Error;

use chorus::binding::NumaBinding;

/// torchrun's default port for a `--rdzv-endpoint` without one.
pub const DEFAULT_RDZV_PORT: u16 = 29400;

/// torchrun's default master port (static rendezvous).
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// The command line is wrong; each message says what to change.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ConfigError {
    /// A flag chorus launch does not know.
    #[error(
        "unknown flag {0}; see `chorus launch --help` (put the program's own flags after the program or after `--`)"
    )]
    UnknownFlag(String),
    /// A flag that takes a value came last.
    #[error("{0} needs a value, e.g. {0}=VALUE")]
    MissingValue(String),
    /// A value that cannot be right.
    #[error("{flag} {value}: {hint}")]
    Invalid {
        /// The flag (or `PET_*` variable) as spelled.
        flag: String,
        /// The value given.
        value: String,
        /// What to give instead.
        hint: String,
    },
    /// No program after the flags.
    #[error("no program to launch; usage: chorus launch [flags] [--] PROGRAM [ARGS...]")]
    NoProgram,
}

/// Which output streams a `--tee` / `--redirects` value names (torchrun's
/// `Std`: 0 none, 1 stdout, 2 stderr, 3 both).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Streams {
    /// Standard output.
    pub stdout: bool,
    /// Standard error.
    pub stderr: bool,
}

impl Streams {
    /// Both streams.
    pub const BOTH: Streams = Streams {
        stdout: true,
        stderr: true,
    };

    fn parse(flag: &str, value: &str) -> Result<Self, ConfigError> {
        match value.trim() {
            "0" => Ok(Streams::default()),
            "1" => Ok(Streams {
                stdout: true,
                stderr: false,
            }),
            "2" => Ok(Streams {
                stdout: false,
                stderr: true,
            }),
            "3" => Ok(Streams::BOTH),
            _ => Err(invalid(
                flag,
                value,
                "give 0 (none), 1 (stdout), 2 (stderr) or 3 (both)",
            )),
        }
    }

    /// Whether the stream (stdout when `stdout`, else stderr) is named.
    pub fn has(&self, stdout: bool) -> bool {
        if stdout { self.stdout } else { self.stderr }
    }
}

/// The rendezvous backend named by `--rdzv-backend`; chorus serves static
/// and c10d with its own store, so they differ only in defaults (see
/// [`LaunchConfig::store_plan`]); etcd is served by etcd.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// torchrun's default: node 0 serves the store at the master address.
    Static,
    /// The first launcher to bind the endpoint serves the store.
    C10d,
    /// The store is in etcd at the endpoint: no launcher serves it, so no
    /// launcher's loss takes it away.
    Etcd,
}

/// What `--restart-policy` restarts after a worker fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RestartPolicy {
    /// torchrun's behaviour (the default): stop every worker and restart
    /// the whole group.
    #[default]
    All,
    /// Relaunch only the failed worker, in its local rank slot, while the
    /// others keep running; an elastic program (`ElasticGroup`) takes it
    /// into its next generation. With several nodes, nodes also leave and
    /// join without restarting the others' workers (see `launch::nodes`).
    Worker,
}

/// Who serves the job's store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreRole {
    /// This launcher must serve it (one node, or node rank 0 of a static
    /// rendezvous); failing to bind is an error.
    Host,
    /// Another launcher serves it.
    Client,
    /// Whoever binds the port first serves it, if the address is local;
    /// the others connect (torchrun's c10d backend).
    FirstToBind,
}

/// Where the job's store is and who serves it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorePlan {
    /// Host name or address, given to workers as `MASTER_ADDR`.
    pub host: String,
    /// Port; 0 picks a free one (single node only).
    pub port: u16,
    /// Who serves it.
    pub role: StoreRole,
    /// The `etcd://` URL of the store, when it is in etcd (then nobody serves it).
    pub etcd: Option<String>,
}

/// The number of CPUs and GPUs, for `--nproc-per-node auto|cpu|gpu`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostFacts {
    /// Usable CPUs.
    pub cpus: usize,
    /// GPUs found (0 when none).
    pub gpus: usize,
}

/// Everything a launcher needs, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchConfig {
    /// Workers started on this node.
    pub nproc_per_node: usize,
    /// Fewest nodes the job starts with.
    pub min_nodes: usize,
    /// Most nodes the job takes.
    pub max_nodes: usize,
    /// This node's rank when given; otherwise assigned through the store.
    pub node_rank: Option<usize>,
    /// `--master-addr`.
    pub master_addr: String,
    /// `--master-port`, when given.
    pub master_port: Option<u16>,
    /// `--rdzv-backend`.
    pub backend: Backend,
    /// `--rdzv-endpoint` as host and port (its first endpoint, for etcd).
    pub rdzv_endpoint: Option<(String, u16)>,
    /// With `--rdzv-backend etcd`, the store's `etcd://` URL (every endpoint
    /// of `--rdzv-endpoint`, and its prefix).
    pub etcd_url: Option<String>,
    /// `--rdzv-id`, when given.
    pub rdzv_id: Option<String>,
    /// `--standalone`.
    pub standalone: bool,
    /// How long to wait for every node (`--rdzv-conf join_timeout=S`, torchrun's default 600 s).
    pub join_timeout: Duration,
    /// How long, once `min_nodes` are in, to wait for more
    /// (`--rdzv-conf last_call_timeout=S`, default 30 s).
    pub last_call_timeout: Duration,
    /// How long another launcher's keep-alive may stand still before it is
    /// taken for hung (`--rdzv-conf keep_alive_interval=S,keep_alive_max_attempt=N`,
    /// their product, torchrun's default 5 s x 3).
    pub keep_alive_timeout: Duration,
    /// Restarts allowed after failures, for the whole job: group restarts,
    /// or worker relaunches with [`RestartPolicy::Worker`].
    pub max_restarts: u64,
    /// `--restart-policy`: what a restart restarts.
    pub restart_policy: RestartPolicy,
    /// `--standby N`: warm standby workers kept per node under
    /// [`RestartPolicy::Worker`]; a failed worker's slot is taken by one at
    /// once instead of a process started then.
    pub standby: usize,
    /// Fork replacement workers (relaunches, new standbys) of a Python
    /// script from a pre-started interpreter that has imported torch;
    /// `--no-fork-server` starts them afresh.
    pub fork_server: bool,
    /// How often a multi-node launcher looks at the store for other nodes' news.
    pub monitor_interval: Duration,
    /// Grace period between SIGTERM and SIGKILL when stopping workers.
    pub shutdown_timeout: Duration,
    /// `--numa-binding`: the CPUs each worker is bound to (none when `None`).
    pub numa_binding: Option<NumaBinding>,
    /// Where per-rank logs go.
    pub log_dir: Option<PathBuf>,
    /// Streams shown on the console and written to the log files.
    pub tee: Streams,
    /// Streams written only to the log files.
    pub redirects: Streams,
    /// Local ranks whose console output is shown (all when `None`).
    pub local_ranks_filter: Option<BTreeSet<usize>>,
    /// `ROLE_NAME`.
    pub role: String,
    /// Append `--local-rank=N` to each worker's arguments (`torch.distributed.launch`).
    pub pass_local_rank_arg: bool,
    /// File holding the job secret (multi-node).
    pub job_secret_file: Option<PathBuf>,
    /// `--dashboard ADDR`: serve the job's live page there.
    pub dashboard: Option<String>,
    /// `--dashboard-faults`: the page may inject faults (with the job secret).
    pub dashboard_faults: bool,
    /// The worker command before `--local-rank` (`python3 -u script.py` for a script).
    pub command: Vec<String>,
    /// The program's own arguments.
    pub args: Vec<String>,
}

/// What the command line asked for.
#[derive(Debug, Clone, PartialEq)]
pub enum Parsed {
    /// `--help`.
    Help,
    /// Launch a job.
    Launch(Box<LaunchConfig>),
}

/// `chorus launch --help`.
pub const USAGE: &str = "\
usage: chorus launch [flags] [--] PROGRAM [ARGS...]

Starts --nproc-per-node workers with torchrun's environment (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, ...). A PROGRAM ending in .py runs under python3 -u
(or $PYTHON_EXEC), as torchrun does. Flags take dashes or underscores, and each
is also read from PET_<NAME> (e.g. PET_NNODES); the command line wins.

  --nproc-per-node N|auto|cpu|gpu  workers on this node (default 1)
  --nnodes N|MIN:MAX               nodes in the job (default 1); with MIN:MAX
                                   nodes may leave and join while it runs
  --node-rank R                    this node's rank, --nnodes N only (default:
                                   assigned in the store, dense in each round)
  --master-addr HOST               store address (default 127.0.0.1)
  --master-port PORT               store port (default 29500; a free one on one node)
  --standalone                     one node, free port on localhost
  --rdzv-backend static|c10d|etcd  who serves the store (default static); etcd:
                                   the store is in etcd, no launcher serves it
  --rdzv-endpoint HOST[:PORT]      store address (port default 29400); for etcd
                                   HOST[:PORT][,HOST[:PORT]...][/PREFIX] (port 2379)
  --rdzv-id ID                     run id (TORCHELASTIC_RUN_ID)
  --rdzv-conf join_timeout=S,last_call_timeout=S,keep_alive_interval=S,keep_alive_max_attempt=N
                                   waits for nodes (600, 30 s); a launcher whose
                                   keep-alive stands still for interval x attempts
                                   (5 s x 3) is taken for hung
  --max-restarts N                 restarts after failures, per job (default 0)
  --restart-policy all|worker      restart the whole group (default, as torchrun)
                                   or relaunch only the failed worker, which
                                   joins an elastic program's next generation;
                                   with several nodes, nodes leave and join
                                   without restarting the others' workers
  --standby N                      keep N warm standby workers per node
                                   (--restart-policy worker): each starts the
                                   program, which waits in its elastic group's
                                   init until a worker fails, then takes its
                                   slot at once (default 0)
  --no-fork-server                 start replacement workers afresh; by default,
                                   with --restart-policy worker and a Python
                                   script, they are forked from a pre-started
                                   python that has imported torch
  --monitor-interval S             store polling period, multi-node (default 0.1)
  --shutdown-timeout S             SIGTERM to SIGKILL grace (default 30)
  --numa-binding MODE              bind each worker to CPUs (default: unbound):
                                   node, socket, exclusive (cores of its own)
                                   or core-complex (one last-level cache)
  --log-dir DIR                    write DIR/RUN_ID/attempt_N/RANK/{stdout,stderr}.log
  --tee 0-3, --redirects 0-3       streams teed / only written to the log files
  --local-ranks-filter 0,1         show only these local ranks' output
  --role NAME                      ROLE_NAME (default \"default\")
  --job-secret-file PATH           multi-node job secret (or CHORUS_JOB_SECRET)
  --dashboard ADDR                 serve the job's live page at ADDR (127.0.0.1:0:
                                   a free port; the URL is printed)
  --dashboard-faults               let the page inject faults (with the job secret)
  --pass-local-rank-arg            append --local-rank=N (torch.distributed.launch)
  --use-env                        accepted for torch.distributed.launch scripts
  --no-python, -m/--module         run PROGRAM as is / as a python module
";

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Value,
    Switch,
}

/// Every flag, by its dashed name.
const FLAGS: &[(&str, Kind)] = &[
    ("nproc-per-node", Kind::Value),
    ("nnodes", Kind::Value),
    ("node-rank", Kind::Value),
    ("master-addr", Kind::Value),
    ("master-port", Kind::Value),
    ("rdzv-backend", Kind::Value),
    ("rdzv-endpoint", Kind::Value),
    ("rdzv-id", Kind::Value),
    ("rdzv-conf", Kind::Value),
    ("max-restarts", Kind::Value),
    ("restart-policy", Kind::Value),
    ("standby", Kind::Value),
    ("monitor-interval", Kind::Value),
    ("shutdown-timeout", Kind::Value),
    ("numa-binding", Kind::Value),
    ("log-dir", Kind::Value),
    ("tee", Kind::Value),
    ("redirects", Kind::Value),
    ("local-ranks-filter", Kind::Value),
    ("role", Kind::Value),
    ("job-secret-file", Kind::Value),
    ("dashboard", Kind::Value),
    ("dashboard-faults", Kind::Switch),
    ("standalone", Kind::Switch),
    ("pass-local-rank-arg", Kind::Switch),
    ("use-env", Kind::Switch),
    ("no-python", Kind::Switch),
    ("no-fork-server", Kind::Switch),
    ("module", Kind::Switch),
    ("help", Kind::Switch),
];

fn invalid(flag: &str, value: &str, hint: &str) -> ConfigError {
    ConfigError::Invalid {
        flag: flag.to_string(),
        value: value.to_string(),
        hint: hint.to_string(),
    }
}

/// Flags as given: (dashed name, spelling, value).
type Flags = Vec<(&'static str, String, String)>;

/// Flags as given, and the `PET_*` variables behind them.
struct Given<'a> {
    flags: Flags,
    lookup: &'a dyn Fn(&str) -> Option<String>,
}

impl Given<'_> {
    /// The value of `name` and how it was spelled: command line first, then
    /// `PET_<NAME>` (the last spelling wins, as with argparse).
    fn get(&self, name: &str) -> Option<(String, String)> {
        if let Some((_, spelled, value)) = self.flags.iter().rev().find(|(n, _, _)| *n == name) {
            return Some((spelled.clone(), value.clone()));
        }
        let var = format!("PET_{}", name.replace('-', "_").to_uppercase());
        (self.lookup)(&var).filter(|v| !v.trim().is_empty()).map(|v| (var, v))
    }

    fn switch(&self, name: &str) -> Result<bool, ConfigError> {
        match self.get(name) {
            None => Ok(false),
            Some((spelled, value)) if spelled.starts_with("PET_") => match value.trim() {
                "1" | "true" | "True" => Ok(true),
                "0" | "false" | "False" => Ok(false),
                _ => Err(invalid(&spelled, &value, "set it to 1 or 0")),
            },
            Some(_) => Ok(true),
        }
    }

    fn number<T: std::str::FromStr>(&self, name: &str, hint: &str) -> Result<Option<T>, ConfigError> {
        self.get(name)
            .map(|(spelled, value)| value.trim().parse().map_err(|_| invalid(&spelled, &value, hint)))
            .transpose()
    }

    fn seconds(&self, name: &str, default: f64) -> Result<Duration, ConfigError> {
        let seconds = self
            .number::<f64>(name, "give a number of seconds, e.g. 0.1")?
            .unwrap_or(default);
        Duration::try_from_secs_f64(seconds)
            .map_err(|_| invalid(name, &seconds.to_string(), "give a non-negative number of seconds"))
    }
}

/// Splits the arguments after `launch` into flags and the program.
fn split(args: &[String]) -> Result<(Flags, Vec<String>), ConfigError> {
    let mut flags = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let arg = &args[i];
        if arg == "--" {
            return Ok((flags, args[i + 1..].to_vec()));
        }
        if !arg.starts_with('-') || arg == "-" {
            return Ok((flags, args[i..].to_vec()));
        }
        let (spelled, inline) = match arg.split_once('=') {
            Some((flag, value)) => (flag, Some(value.to_string())),
            None => (arg.as_str(), None),
        };
        let name = match spelled {
            "-m" => "module".to_string(),
            "-h" => "help".to_string(),
            "-t" => "tee".to_string(),
            "-r" => "redirects".to_string(),
            _ if spelled.starts_with("--") => spelled[2..].replace('_', "-"),
            _ => return Err(ConfigError::UnknownFlag(arg.clone())),
        };
        let Some(&(name, kind)) = FLAGS.iter().find(|(n, _)| *n == name) else {
            return Err(ConfigError::UnknownFlag(spelled.to_string()));
        };
        let value = match (kind, inline) {
            (Kind::Switch, None) => String::new(),
            (Kind::Switch, Some(_)) => return Err(invalid(spelled, arg, "this flag takes no value")),
            (Kind::Value, Some(value)) => value,
            (Kind::Value, None) => {
                i += 1;
                args.get(i)
                    .cloned()
                    .ok_or_else(|| ConfigError::MissingValue(spelled.to_string()))?
            }
        };
        flags.push((name, spelled.to_string(), value));
        i += 1;
    }
    Ok((flags, Vec::new()))
}

/// A host name or address and a port.
type HostPort = (String, u16);

/// Parses `host[:port]` (IPv6 in brackets).
fn host_port(flag: &str, text: &str, default_port: u16) -> Result<HostPort, ConfigError> {
    let bad = || invalid(flag, text, "give HOST or HOST:PORT, e.g. node0:29400 or [::1]:29400");
    let (host, port) = if let Some(rest) = text.strip_prefix('[') {
        let (host, after) = rest.split_once(']').ok_or_else(bad)?;
        (host, after.strip_prefix(':'))
    } else {
        match text.rsplit_once(':') {
            Some((host, port)) if !host.contains(':') => (host, Some(port)),
            _ => (text, None),
        }
    };
    if host.is_empty() {
        return Err(bad());
    }
    let port = match port {
        Some(port) => port.parse().map_err(|_| bad())?,
        None => default_port,
    };
    Ok((host.to_string(), port))
}

/// Reads `args` (everything after `launch`) and the `PET_*` variables
/// through `lookup` into a validated configuration.
pub fn parse(args: &[String], lookup: &dyn Fn(&str) -> Option<String>, host: HostFacts) -> Result<Parsed, ConfigError> {
    let (flags, program) = split(args)?;
    let given = Given { flags, lookup };
    if given.flags.iter().any(|(n, _, _)| *n == "help") {
        return Ok(Parsed::Help);
    }

    // Each step validates one flag or group; their order decides which
    // error a command line with several mistakes reports.
    let nproc_per_node = given.nproc_per_node(host)?;
    let (min_nodes, max_nodes) = given.nnodes()?;
    let node_rank = given.node_rank(min_nodes, max_nodes)?;
    let backend = given.backend()?;
    let (rdzv_endpoint, etcd_url) = given.rdzv_endpoint(backend)?;
    let waits = given.rdzv_conf()?;
    let restart_policy = given.restart_policy()?;
    let standby = given.standby(restart_policy)?;
    let local_ranks_filter = given.local_ranks_filter()?;
    let standalone = given.standalone(max_nodes)?;
    let command = given.command(&program)?;
    let tee = given.get("tee").map(|(s, v)| Streams::parse(&s, &v)).transpose()?;
    let redirects = given
        .get("redirects")
        .map(|(s, v)| Streams::parse(&s, &v))
        .transpose()?
        .unwrap_or_default();
    let log_dir = given.get("log-dir").map(|(_, v)| PathBuf::from(v));

    Ok(Parsed::Launch(Box::new(LaunchConfig {
        nproc_per_node,
        min_nodes,
        max_nodes,
        node_rank,
        master_addr: given
            .get("master-addr")
            .map_or_else(|| "127.0.0.1".to_string(), |(_, v)| v),
        master_port: given.number("master-port", "give a port number, 1..65535")?,
        backend,
        rdzv_endpoint,
        etcd_url,
        rdzv_id: given.get("rdzv-id").map(|(_, v)| v),
        standalone,
        join_timeout: waits.join_timeout,
        last_call_timeout: waits.last_call_timeout,
        keep_alive_timeout: waits.keep_alive_interval * waits.keep_alive_max_attempt,
        max_restarts: given
            .number("max-restarts", "give a number of restarts, 0 or more")?
            .unwrap_or(0),
        restart_policy,
        standby,
        fork_server: !given.switch("no-fork-server")?,
        monitor_interval: given.seconds("monitor-interval", 0.1)?,
        shutdown_timeout: given.seconds("shutdown-timeout", 30.0)?,
        numa_binding: given.numa_binding()?,
        // With a log directory and no --tee, both streams go to the files too.
        tee: tee.unwrap_or(if log_dir.is_some() {
            Streams::BOTH
        } else {
            Streams::default()
        }),
        log_dir,
        redirects,
        local_ranks_filter,
        role: given.get("role").map_or_else(|| "default".to_string(), |(_, v)| v),
        pass_local_rank_arg: given.switch("pass-local-rank-arg")?,
        job_secret_file: given.get("job-secret-file").map(|(_, v)| PathBuf::from(v)),
        dashboard: given.get("dashboard").map(|(_, v)| v),
        dashboard_faults: given.switch("dashboard-faults")?,
        command,
        args: program[1..].to_vec(),
    })))
}

/// `--rdzv-conf`'s waits, torchrun's defaults where not given.
struct RdzvWaits {
    join_timeout: Duration,
    last_call_timeout: Duration,
    keep_alive_interval: Duration,
    keep_alive_max_attempt: u32,
}

impl Default for RdzvWaits {
    fn default() -> Self {
        RdzvWaits {
            join_timeout: Duration::from_secs(600),
            last_call_timeout: Duration::from_secs(30),
            keep_alive_interval: Duration::from_secs(5),
            keep_alive_max_attempt: 3,
        }
    }
}

/// The steps of [`parse`], one flag (or group of flags) each.
impl Given<'_> {
    fn nproc_per_node(&self, host: HostFacts) -> Result<usize, ConfigError> {
        let Some((spelled, value)) = self.get("nproc-per-node") else {
            return Ok(1);
        };
        match value.trim() {
            "auto" | "cpu" => Ok(host.cpus),
            "gpu" if host.gpus > 0 => Ok(host.gpus),
            "gpu" => Err(invalid(&spelled, &value, "no GPU found; give a number, or auto/cpu")),
            n => match n.parse::<usize>() {
                Ok(n) if n > 0 => Ok(n),
                _ => Err(invalid(&spelled, &value, "give a positive number, or auto, cpu or gpu")),
            },
        }
    }

    /// `--nnodes` as (min, max).
    fn nnodes(&self) -> Result<(usize, usize), ConfigError> {
        let Some((spelled, value)) = self.get("nnodes") else {
            return Ok((1, 1));
        };
        let hint = "give N or MIN:MAX with 0 < MIN <= MAX, e.g. 2 or 1:4";
        let number = |s: &str| s.trim().parse::<usize>().map_err(|_| invalid(&spelled, &value, hint));
        let (min, max) = match value.split_once(':') {
            Some((min, max)) => (number(min)?, number(max)?),
            None => (number(&value)?, number(&value)?),
        };
        if min == 0 || min > max {
            return Err(invalid(&spelled, &value, hint));
        }
        Ok((min, max))
    }

    fn node_rank(&self, min_nodes: usize, max_nodes: usize) -> Result<Option<usize>, ConfigError> {
        let node_rank: Option<usize> = self.number("node-rank", "give a node rank, 0..nnodes")?;
        if let Some(rank) = node_rank {
            if rank >= max_nodes {
                return Err(invalid(
                    "--node-rank",
                    &rank.to_string(),
                    &format!("it must be below --nnodes ({max_nodes})"),
                ));
            }
            // An elastic job hands out dense node ranks anew in every round.
            if min_nodes != max_nodes {
                return Err(invalid(
                    "--node-rank",
                    &rank.to_string(),
                    "with --nnodes MIN:MAX node ranks are handed out at each restart; drop --node-rank, or give --nnodes N",
                ));
            }
        }
        Ok(node_rank)
    }

    fn backend(&self) -> Result<Backend, ConfigError> {
        match self.get("rdzv-backend") {
            None => Ok(Backend::Static),
            Some((spelled, value)) => match value.trim() {
                "static" => Ok(Backend::Static),
                "c10d" => Ok(Backend::C10d),
                "etcd" => Ok(Backend::Etcd),
                _ => Err(invalid(&spelled, &value, "give static, c10d or etcd")),
            },
        }
    }

    /// `--rdzv-endpoint` as host and port, and with etcd the store's `etcd://` URL.
    fn rdzv_endpoint(&self, backend: Backend) -> Result<(Option<HostPort>, Option<String>), ConfigError> {
        let endpoint = self.get("rdzv-endpoint").filter(|(_, v)| !v.trim().is_empty());
        match (backend, endpoint) {
            (Backend::Etcd, None) => Err(invalid(
                "--rdzv-backend",
                "etcd",
                "give etcd's address with --rdzv-endpoint HOST[:PORT][,HOST[:PORT]...][/PREFIX]",
            )),
            (Backend::Etcd, Some((spelled, value))) => {
                let (endpoints, prefix) = chorus_runtime::store::parse_endpoints(value.trim())
                    .map_err(|hint| invalid(&spelled, &value, &hint))?;
                let first = host_port(&spelled, &endpoints[0], chorus_runtime::store::DEFAULT_ETCD_PORT)?;
                Ok((Some(first), Some(format!("etcd://{}{prefix}", endpoints.join(",")))))
            }
            (_, endpoint) => Ok((
                endpoint
                    .map(|(spelled, value)| host_port(&spelled, value.trim(), DEFAULT_RDZV_PORT))
                    .transpose()?,
                None,
            )),
        }
    }

    fn rdzv_conf(&self) -> Result<RdzvWaits, ConfigError> {
        let mut waits = RdzvWaits::default();
        let Some((spelled, value)) = self.get("rdzv-conf") else {
            return Ok(waits);
        };
        for pair in value.split(',').filter(|p| !p.trim().is_empty()) {
            let hint = "give join_timeout, last_call_timeout, keep_alive_interval (seconds) and/or \
                        keep_alive_max_attempt (a count) as KEY=VALUE, comma separated";
            let (key, number) = pair.split_once('=').ok_or_else(|| invalid(&spelled, &value, hint))?;
            if key.trim() == "keep_alive_max_attempt" {
                waits.keep_alive_max_attempt = number
                    .trim()
                    .parse()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| invalid(&spelled, &value, hint))?;
                continue;
            }
            let seconds = number
                .trim()
                .parse::<f64>()
                .ok()
                .and_then(|s| Duration::try_from_secs_f64(s).ok())
                .ok_or_else(|| invalid(&spelled, &value, hint))?;
            match key.trim() {
                "join_timeout" => waits.join_timeout = seconds,
                "last_call_timeout" => waits.last_call_timeout = seconds,
                "keep_alive_interval" => waits.keep_alive_interval = seconds,
                _ => return Err(invalid(&spelled, &value, hint)),
            }
        }
        Ok(waits)
    }

    fn restart_policy(&self) -> Result<RestartPolicy, ConfigError> {
        match self.get("restart-policy") {
            None => Ok(RestartPolicy::All),
            Some((spelled, value)) => match value.trim() {
                "all" => Ok(RestartPolicy::All),
                "worker" => Ok(RestartPolicy::Worker),
                _ => Err(invalid(
                    &spelled,
                    &value,
                    "give all (restart the whole group, as torchrun) or worker (relaunch only the failed worker)",
                )),
            },
        }
    }

    fn standby(&self, restart_policy: RestartPolicy) -> Result<usize, ConfigError> {
        let standby = self
            .number::<usize>("standby", "give a number of standby workers, 0 or more")?
            .unwrap_or(0);
        if standby > 0 && restart_policy != RestartPolicy::Worker {
            return Err(invalid(
                "--standby",
                &standby.to_string(),
                "standby workers replace one failed worker; add --restart-policy worker",
            ));
        }
        Ok(standby)
    }

    fn local_ranks_filter(&self) -> Result<Option<BTreeSet<usize>>, ConfigError> {
        self.get("local-ranks-filter")
            .map(|(spelled, value)| {
                value
                    .split(',')
                    .map(|r| r.trim().parse::<usize>())
                    .collect::<Result<BTreeSet<_>, _>>()
                    .map_err(|_| invalid(&spelled, &value, "give local ranks separated by commas, e.g. 0,1"))
            })
            .transpose()
    }

    fn standalone(&self, max_nodes: usize) -> Result<bool, ConfigError> {
        let standalone = self.switch("standalone")?;
        if standalone && max_nodes > 1 {
            return Err(invalid(
                "--standalone",
                "",
                "it runs one node; drop --nnodes or --standalone",
            ));
        }
        Ok(standalone)
    }

    /// The worker command before its arguments: the program, under python
    /// for a script or a module.
    fn command(&self, program: &[String]) -> Result<Vec<String>, ConfigError> {
        if program.is_empty() {
            return Err(ConfigError::NoProgram);
        }
        let python = (self.lookup)("PYTHON_EXEC").unwrap_or_else(|| "python3".to_string());
        let module = self.switch("module")?;
        let no_python = self.switch("no-python")?;
        if module && no_python {
            return Err(invalid(
                "--module",
                "",
                "it runs a python module; drop --module or --no-python",
            ));
        }
        let mut command = Vec::new();
        if module {
            command.extend([python, "-u".to_string(), "-m".to_string()]);
        } else if !no_python && program[0].ends_with(".py") {
            command.extend([python, "-u".to_string()]);
        }
        command.push(program[0].clone());
        Ok(command)
    }

    fn numa_binding(&self) -> Result<Option<NumaBinding>, ConfigError> {
        self.get("numa-binding")
            .map(|(spelled, value)| {
                value
                    .parse()
                    .map_err(|_| invalid(&spelled, &value, &format!("give {}", NumaBinding::CHOICES)))
            })
            .transpose()
    }
}

impl LaunchConfig {
    /// Where the store is and who serves it, as torchrun decides:
    /// `--standalone`, or one node without `--master-port` or an endpoint,
    /// takes a free port on loopback; a static rendezvous is served by node
    /// 0 at the master address; c10d (and static without `--node-rank`) by
    /// the first launcher that binds the endpoint.
    pub fn store_plan(&self) -> StorePlan {
        if let (Some(url), Some((host, port))) = (&self.etcd_url, &self.rdzv_endpoint) {
            return StorePlan {
                host: host.clone(),
                port: *port,
                role: StoreRole::Client,
                etcd: Some(url.clone()),
            };
        }
        if self.standalone || (self.max_nodes == 1 && self.master_port.is_none() && self.rdzv_endpoint.is_none()) {
            return StorePlan {
                host: "127.0.0.1".to_string(),
                port: 0,
                role: StoreRole::Host,
                etcd: None,
            };
        }
        let (host, port) = match &self.rdzv_endpoint {
            Some((host, port)) => (host.clone(), *port),
            None => (
                self.master_addr.clone(),
                self.master_port.unwrap_or(DEFAULT_MASTER_PORT),
            ),
        };
        let role = match (self.max_nodes, self.backend, self.node_rank) {
            (1, _, _) => StoreRole::Host,
            (_, Backend::Static, Some(0)) => StoreRole::Host,
            (_, Backend::Static, Some(_)) => StoreRole::Client,
            _ => StoreRole::FirstToBind,
        };
        StorePlan {
            host,
            port,
            role,
            etcd: None,
        }
    }

    /// The run id (`TORCHELASTIC_RUN_ID`): `--rdzv-id`, else torchrun's
    /// `none`, or `fresh` where torchrun makes a fresh one (standalone and a
    /// single node on a free port).
    pub fn run_id(&self, fresh: impl FnOnce() -> String) -> String {
        match &self.rdzv_id {
            Some(id) => id.clone(),
            None if self.store_plan().port == 0 => fresh(),
            None => "none".to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOST: HostFacts = HostFacts { cpus: 8, gpus: 0 };

    fn parse_with(args: &str, env: &[(&str, &str)]) -> Result<Parsed, ConfigError> {
        let args: Vec<String> = args.split_whitespace().map(String::from).collect();
        let env: Vec<(String, String)> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        parse(
            &args,
            &|k| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()),
            HOST,
        )
    }

    fn config(args: &str, env: &[(&str, &str)]) -> LaunchConfig {
        match parse_with(args, env) {
            Ok(Parsed::Launch(config)) => *config,
            other => panic!("{args}: {other:?}"),
        }
    }

    #[test]
    fn dashes_underscores_equals_and_program_without_separator() {
        let c = config(
            "--nproc_per_node=3 --nnodes 1:2 --master-port 1234 prog -x --nnodes 9",
            &[],
        );
        assert_eq!((c.nproc_per_node, c.min_nodes, c.max_nodes), (3, 1, 2));
        assert_eq!(c.master_port, Some(1234));
        assert_eq!(c.command, ["prog"]);
        assert_eq!(c.args, ["-x", "--nnodes", "9"]);
        let c = config("--standalone -- prog --help", &[]);
        assert!(c.standalone);
        assert_eq!(c.args, ["--help"]);
    }

    #[test]
    fn pet_variables_fill_in_and_the_command_line_wins() {
        let env = [
            ("PET_NPROC_PER_NODE", "4"),
            ("PET_MAX_RESTARTS", "2"),
            ("PET_STANDALONE", "1"),
        ];
        let c = config("prog", &env);
        assert_eq!((c.nproc_per_node, c.max_restarts, c.standalone), (4, 2, true));
        let c = config("--nproc-per-node 2 prog", &env);
        assert_eq!(c.nproc_per_node, 2);
    }

    #[test]
    fn numa_binding_takes_torchruns_modes_from_the_flag_or_pet() {
        assert_eq!(config("prog", &[]).numa_binding, None);
        assert_eq!(
            config("--numa_binding=core-complex prog", &[]).numa_binding,
            Some(NumaBinding::CoreComplex)
        );
        let env = [("PET_NUMA_BINDING", "exclusive")];
        assert_eq!(config("prog", &env).numa_binding, Some(NumaBinding::Exclusive));
        assert_eq!(
            config("--numa-binding node prog", &env).numa_binding,
            Some(NumaBinding::Node)
        );
        let Err(ConfigError::Invalid { flag, hint, .. }) = parse_with("--numa-binding cores prog", &[]) else {
            panic!("--numa-binding cores was taken");
        };
        assert_eq!(flag, "--numa-binding");
        assert!(hint.contains("exclusive"), "{hint}");
    }

    #[test]
    fn nproc_auto_cpu_gpu() {
        assert_eq!(config("--nproc-per-node auto p", &[]).nproc_per_node, 8);
        assert_eq!(config("--nproc-per-node cpu p", &[]).nproc_per_node, 8);
        assert!(matches!(
            parse_with("--nproc-per-node gpu p", &[]),
            Err(ConfigError::Invalid { .. })
        ));
        let args = ["--nproc-per-node".to_string(), "gpu".into(), "p".into()];
        let Ok(Parsed::Launch(c)) = parse(&args, &|_| None, HostFacts { cpus: 8, gpus: 2 }) else {
            panic!()
        };
        assert_eq!(c.nproc_per_node, 2);
    }

    #[test]
    fn bad_input_says_what_to_change() {
        let error = parse_with("--nnodes 3:2 p", &[]).unwrap_err().to_string();
        assert!(error.contains("MIN <= MAX"), "{error}");
        assert!(matches!(parse_with("--frobnicate p", &[]), Err(ConfigError::UnknownFlag(f)) if f == "--frobnicate"));
        assert!(matches!(parse_with("--nnodes", &[]), Err(ConfigError::MissingValue(_))));
        assert!(matches!(parse_with("--nnodes 2", &[]), Err(ConfigError::NoProgram)));
        assert!(parse_with("--tee 4 p", &[]).is_err());
        assert!(parse_with("--node-rank 2 --nnodes 2 p", &[]).is_err());
        let error = parse_with("--node-rank 0 --nnodes 1:2 p", &[]).unwrap_err().to_string();
        assert!(error.contains("drop --node-rank, or give --nnodes N"), "{error}");
        assert!(parse_with("--rdzv-backend etcd p", &[]).is_err());
        assert!(parse_with("--rdzv-backend zookeeper p", &[]).is_err());
        let error = parse_with("p", &[("PET_NNODES", "x")]).unwrap_err().to_string();
        assert!(error.starts_with("PET_NNODES x"), "{error}");
    }

    #[test]
    fn python_scripts_run_under_python_as_with_torchrun() {
        assert_eq!(config("train.py --lr 1", &[]).command, ["python3", "-u", "train.py"]);
        assert_eq!(
            config("-m pkg.train", &[("PYTHON_EXEC", "py")]).command,
            ["py", "-u", "-m", "pkg.train"]
        );
        assert_eq!(config("--no-python train.py", &[]).command, ["train.py"]);
    }

    #[test]
    fn store_plan_follows_torchrun() {
        let plan = config("p", &[]).store_plan();
        assert_eq!((plan.port, plan.role), (0, StoreRole::Host));
        let plan = config("--master-port 7000 p", &[]).store_plan();
        assert_eq!(
            (plan.host.as_str(), plan.port, plan.role),
            ("127.0.0.1", 7000, StoreRole::Host)
        );
        let plan = config("--nnodes 2 --master-addr n0 p", &[]).store_plan();
        assert_eq!(
            (plan.host.as_str(), plan.port, plan.role),
            ("n0", 29500, StoreRole::FirstToBind)
        );
        assert_eq!(
            config("--nnodes 2 --node-rank 0 p", &[]).store_plan().role,
            StoreRole::Host
        );
        assert_eq!(
            config("--nnodes 2 --node-rank 1 p", &[]).store_plan().role,
            StoreRole::Client
        );
        let plan = config("--nnodes 2 --rdzv-backend c10d --rdzv-endpoint [::1] p", &[]).store_plan();
        assert_eq!(
            (plan.host.as_str(), plan.port, plan.role),
            ("::1", 29400, StoreRole::FirstToBind)
        );
        let plan = config("--nnodes 1:2 --rdzv-backend etcd --rdzv-endpoint e1,e2:7/jobs p", &[]).store_plan();
        assert_eq!(
            (plan.host.as_str(), plan.port, plan.role),
            ("e1", 2379, StoreRole::Client)
        );
        assert_eq!(plan.etcd.as_deref(), Some("etcd://e1:2379,e2:7/jobs"));
        assert!(parse_with("--rdzv-backend etcd --rdzv-endpoint e1:x p", &[]).is_err());
    }

    #[test]
    fn run_id_defaults_like_torchrun() {
        assert_eq!(config("--master-port 7000 p", &[]).run_id(|| "x".into()), "none");
        assert_eq!(config("p", &[]).run_id(|| "fresh".into()), "fresh");
        assert_eq!(config("--rdzv-id job p", &[]).run_id(|| "x".into()), "job");
    }

    #[test]
    fn replacements_are_forked_unless_told_not_to() {
        assert!(config("--restart-policy worker p.py", &[]).fork_server);
        assert!(!config("--restart-policy worker --no-fork-server p.py", &[]).fork_server);
        assert!(!config("--restart-policy worker p.py", &[("PET_NO_FORK_SERVER", "1")]).fork_server);
    }

    #[test]
    fn standby_needs_the_worker_policy() {
        assert_eq!(config("p", &[]).standby, 0);
        assert_eq!(config("--restart-policy worker --standby 2 p", &[]).standby, 2);
        assert_eq!(config("--restart-policy worker p", &[("PET_STANDBY", "1")]).standby, 1);
        assert!(parse_with("--standby 1 p", &[]).is_err());
        assert!(parse_with("--restart-policy worker --standby x p", &[]).is_err());
    }

    #[test]
    fn restart_policy_defaults_to_all_and_worker_works_with_several_nodes() {
        assert_eq!(config("p", &[]).restart_policy, RestartPolicy::All);
        assert_eq!(
            config("--restart-policy worker p", &[]).restart_policy,
            RestartPolicy::Worker
        );
        assert_eq!(
            config("--restart_policy=all p", &[("PET_RESTART_POLICY", "worker")]).restart_policy,
            RestartPolicy::All
        );
        assert_eq!(
            config("p", &[("PET_RESTART_POLICY", "worker")]).restart_policy,
            RestartPolicy::Worker
        );
        assert!(parse_with("--restart-policy some p", &[]).is_err());
        for nnodes in ["2", "1:2"] {
            let line = format!("--nnodes {nnodes} --restart-policy worker p");
            assert_eq!(config(&line, &[]).restart_policy, RestartPolicy::Worker, "{line}");
        }
    }

    #[test]
    fn rdzv_conf_timeouts() {
        let c = config("p", &[]);
        assert_eq!(
            (c.join_timeout, c.last_call_timeout, c.keep_alive_timeout),
            (
                Duration::from_secs(600),
                Duration::from_secs(30),
                Duration::from_secs(15)
            )
        );
        let c = config(
            "--rdzv-conf join_timeout=5,last_call_timeout=0.5,keep_alive_interval=0.25,keep_alive_max_attempt=4 p",
            &[],
        );
        assert_eq!(
            (c.join_timeout, c.last_call_timeout, c.keep_alive_timeout),
            (
                Duration::from_secs(5),
                Duration::from_millis(500),
                Duration::from_secs(1)
            )
        );
        assert!(parse_with("--rdzv-conf keep_alive_max_attempt=0 p", &[]).is_err());
        assert!(parse_with("--rdzv-conf close_timeout=1 p", &[]).is_err());
    }

    #[test]
    fn log_dir_tees_both_streams_unless_told() {
        let c = config("--log-dir /tmp/l p", &[]);
        assert_eq!(c.tee, Streams::BOTH);
        assert!(!config("--log-dir /tmp/l --tee 1 p", &[]).tee.stderr);
        assert_eq!(config("p", &[]).tee, Streams::default());
    }
}
