//! Detecting how this rank was started: torchrun (or `chorus launch`), plain
//! `MASTER_ADDR`/`RANK`/`WORLD_SIZE`, Kubeflow, Slurm, Open MPI or MPICH.
//!
//! Sans-IO: everything reads variables through a lookup function, so tests
//! use maps; [`detect_from_process_env`] is the one wrapper over the process
//! environment. An empty (or all-blank) value counts as unset, since job
//! templates often export variables they leave empty. `PET_*` variables are
//! torchrun's flags, read by the launcher, not here.

use std::fmt;
use std::str::FromStr;

/// An environment lookup: the value of a variable, or `None` when unset.
type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The most hosts a node list, or entries a tasks-per-node spec, may expand
/// to: the values come from the environment, and a forged range such as
/// `n[0-99999999999]` must not exhaust memory.
const MAX_EXPANSION: usize = 1_000_000;

/// Longest value quoted in an error message.
const MAX_QUOTED: usize = 200;

/// What started this rank, judged from the variables it set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Launcher {
    /// torchrun (torchelastic) or `chorus launch`, which sets the same
    /// variables.
    Torchelastic,
    /// Plain `MASTER_ADDR`/`MASTER_PORT`/`RANK`/`WORLD_SIZE`, set by hand or
    /// by a script.
    Env,
    /// A Kubeflow PyTorchJob (one rank per pod).
    Kubeflow,
    /// Slurm's `srun`.
    Slurm,
    /// Open MPI's `mpirun`.
    OpenMpi,
    /// MPICH's Hydra (`mpiexec`), or another PMI launcher.
    Mpich,
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Launcher::Torchelastic => "torchrun",
            Launcher::Env => "env",
            Launcher::Kubeflow => "Kubeflow PyTorchJob",
            Launcher::Slurm => "Slurm",
            Launcher::OpenMpi => "Open MPI",
            Launcher::Mpich => "MPICH/PMI",
        })
    }
}

/// This rank's place in the job, as its launcher described it. Validated:
/// `rank < world_size`, `local_rank < local_world_size <= world_size`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// What started this rank.
    pub launcher: Launcher,
    /// This rank, `0..world_size`.
    pub rank: usize,
    /// Number of ranks in the job.
    pub world_size: usize,
    /// This rank's index among the ranks on its node.
    pub local_rank: usize,
    /// Number of ranks on this node.
    pub local_world_size: usize,
    /// This node's index. Exact for torchrun (`GROUP_RANK`), Slurm and plain
    /// env (`GROUP_RANK`, else 0); the rank itself for Kubeflow (a pod is a
    /// node). MPI launchers export no node index, so for them it is
    /// `rank / local_world_size`: right for the default placement (each node
    /// filled before the next) with equal counts per node.
    pub node_rank: usize,
    /// Where the master (rank 0's store) listens, when the launcher says.
    pub master_addr: Option<String>,
    /// The master's port, when the launcher says.
    pub master_port: Option<u16>,
    /// How many times torchrun restarted the group (0 elsewhere).
    pub restart_count: u64,
    /// The launcher's id for this run (`TORCHELASTIC_RUN_ID`, Slurm's
    /// `SLURM_JOB_ID`).
    pub run_id: Option<String>,
}

/// Whether the launcher already serves the store at MASTER_ADDR:MASTER_PORT
/// (`TORCHELASTIC_USE_AGENT_STORE`, set by torchrun and `chorus launch`), so
/// rank 0 must connect to it rather than serve one itself.
pub fn uses_agent_store(lookup: &dyn Fn(&str) -> Option<String>) -> bool {
    lookup("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| matches!(v.trim(), "True" | "true" | "1"))
}

/// The launcher environment is incomplete or inconsistent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvError {
    /// A variable the detected launcher needs is unset.
    #[error("{var} is not set: {}", missing_hint(.var, *.launcher))]
    Missing {
        /// The unset variable.
        var: &'static str,
        /// The launcher the other variables pointed to.
        launcher: Launcher,
    },
    /// A variable is set to a value that cannot be right.
    #[error("{var}={value} {reason}")]
    Invalid {
        /// The variable.
        var: String,
        /// Its value (long values shortened).
        value: String,
        /// What is wrong and what to set instead, continuing the sentence
        /// `VAR=value ...`.
        reason: String,
    },
}

/// How to fix a missing variable, by launcher.
fn missing_hint(var: &str, launcher: Launcher) -> String {
    match (launcher, var) {
        (Launcher::Env, "RANK") => {
            "torchrun sets it for each worker; set RANK (0..WORLD_SIZE) or use tcp://host:port?rank=R&world_size=N".to_string()
        }
        (Launcher::Env, "WORLD_SIZE") => {
            "torchrun sets it for each worker; set WORLD_SIZE to the number of ranks or use tcp://host:port?rank=R&world_size=N".to_string()
        }
        (Launcher::Torchelastic, _) => {
            format!("torchrun sets it with RANK and LOCAL_RANK; set {var} as torchrun would")
        }
        (Launcher::Env, "MASTER_ADDR" | "MASTER_PORT") => {
            "a launcher sets it for each rank: start the ranks with `chorus launch --nproc-per-node N -- PROGRAM` \
             (or torchrun), or set MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE yourself, \
             or use tcp://host:port?rank=R&world_size=N"
                .to_string()
        }
        (Launcher::Env | Launcher::Kubeflow, "LOCAL_WORLD_SIZE") => {
            "LOCAL_RANK is above 0, so set LOCAL_WORLD_SIZE to the number of ranks on this node"
                .to_string()
        }
        (Launcher::Slurm, _) => format!(
            "srun sets it for each task; start the ranks with srun, not directly from the batch script, or set {var}"
        ),
        (Launcher::OpenMpi, _) => {
            format!("mpirun sets it for each process; start the ranks with mpirun or set {var}")
        }
        (Launcher::Mpich, _) => {
            format!("mpiexec (Hydra) sets it for each process; start the ranks with mpiexec or set {var}")
        }
        _ => format!("{launcher} needs it; set {var}"),
    }
}

/// An [`EnvError::Invalid`], quoting at most [`MAX_QUOTED`] characters of
/// the value.
fn invalid(var: &str, value: &str, reason: impl Into<String>) -> EnvError {
    let value = match value.char_indices().nth(MAX_QUOTED) {
        Some((cut, _)) => format!("{}...", &value[..cut]),
        None => value.to_string(),
    };
    EnvError::Invalid {
        var: var.to_string(),
        value,
        reason: reason.into(),
    }
}

/// The variable's trimmed value; empty counts as unset.
fn get(lookup: Lookup<'_>, var: &str) -> Option<String> {
    lookup(var).map(|v| v.trim().to_string()).filter(|v| !v.is_empty())
}

fn is_set(lookup: Lookup<'_>, var: &str) -> bool {
    get(lookup, var).is_some()
}

fn parse_int<T: FromStr>(var: &str, value: &str) -> Result<T, EnvError> {
    value
        .parse()
        .map_err(|_| invalid(var, value, "is not a non-negative integer"))
}

fn opt_int<T: FromStr>(lookup: Lookup<'_>, var: &str) -> Result<Option<T>, EnvError> {
    get(lookup, var).map(|v| parse_int(var, &v)).transpose()
}

fn req_int<T: FromStr>(lookup: Lookup<'_>, var: &'static str, launcher: Launcher) -> Result<T, EnvError> {
    opt_int(lookup, var)?.ok_or(EnvError::Missing { var, launcher })
}

fn opt_port(lookup: Lookup<'_>, var: &str) -> Result<Option<u16>, EnvError> {
    let Some(value) = get(lookup, var) else {
        return Ok(None);
    };
    match value.parse::<u16>() {
        Ok(port) if port != 0 => Ok(Some(port)),
        _ => Err(invalid(var, &value, "is not a TCP port: use a number from 1 to 65535")),
    }
}

/// A local rank and local size. The size defaults to 1 only when the local
/// rank is 0: with a higher local rank, 1 would be a guess that is certainly
/// wrong.
fn local_pair(
    lookup: Lookup<'_>,
    rank_var: &'static str,
    size_var: &'static str,
    launcher: Launcher,
) -> Result<(usize, usize), EnvError> {
    let local_rank = opt_int(lookup, rank_var)?.unwrap_or(0);
    let local_world_size = match opt_int(lookup, size_var)? {
        Some(n) => n,
        None if local_rank == 0 => 1,
        None => {
            return Err(EnvError::Missing {
                var: size_var,
                launcher,
            });
        }
    };
    Ok((local_rank, local_world_size))
}

/// The variables a launcher's numbers came from, for messages.
struct Names {
    rank: &'static str,
    world: &'static str,
    local_rank: &'static str,
    local_world: &'static str,
}

const TORCH_NAMES: Names = Names {
    rank: "RANK",
    world: "WORLD_SIZE",
    local_rank: "LOCAL_RANK",
    local_world: "LOCAL_WORLD_SIZE",
};

fn validate(env: LaunchEnv, names: &Names) -> Result<LaunchEnv, EnvError> {
    let Names {
        rank,
        world,
        local_rank,
        local_world,
    } = *names;
    if env.world_size == 0 {
        return Err(invalid(world, "0", "is not allowed: a job has at least one rank"));
    }
    if env.rank >= env.world_size {
        return Err(invalid(
            rank,
            &env.rank.to_string(),
            format!("but {world}={}: ranks go from 0 to {world}-1", env.world_size),
        ));
    }
    if env.local_world_size == 0 {
        return Err(invalid(
            local_world,
            "0",
            "is not allowed: a node runs at least one rank",
        ));
    }
    if env.local_rank >= env.local_world_size {
        return Err(invalid(
            local_rank,
            &env.local_rank.to_string(),
            format!(
                "but {local_world}={}: local ranks go from 0 to {local_world}-1",
                env.local_world_size
            ),
        ));
    }
    if env.local_world_size > env.world_size {
        return Err(invalid(
            local_world,
            &env.local_world_size.to_string(),
            format!(
                "but {world}={}: a node cannot run more ranks than the whole job",
                env.world_size
            ),
        ));
    }
    Ok(env)
}

/// Detects the launcher from the variables `lookup` returns, and reads this
/// rank's place in the job. First match wins:
///
/// 1. torchrun: `RANK`, `GROUP_RANK`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE` all
///    set (then `WORLD_SIZE` is required).
/// 2. Kubeflow: `KUBERNETES_PORT`, `MASTER_ADDR`, `MASTER_PORT`,
///    `WORLD_SIZE`, `RANK` all set.
/// 3. Plain env: `RANK` set, or `WORLD_SIZE` or `MASTER_ADDR` set while no
///    scheduler below is detected (so a Slurm or MPI job that exports
///    `MASTER_ADDR` for its ranks is still read from the scheduler's
///    variables). `RANK` and `WORLD_SIZE` are then required.
/// 4. Slurm: `SLURM_PROCID` and `SLURM_NTASKS` set.
/// 5. Open MPI: `OMPI_COMM_WORLD_RANK` and `OMPI_COMM_WORLD_SIZE` set.
/// 6. MPICH/PMI: `PMI_RANK` and `PMI_SIZE` set.
///
/// `Ok(None)` when nothing matches: the caller needs an explicit init method.
pub fn detect(lookup: &dyn Fn(&str) -> Option<String>) -> Result<Option<LaunchEnv>, EnvError> {
    let all_set = |vars: &[&str]| vars.iter().all(|v| is_set(lookup, v));
    let env = if all_set(&["RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"]) {
        torchelastic(lookup)?
    } else if all_set(&["KUBERNETES_PORT", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"]) {
        kubeflow(lookup)?
    } else if is_set(lookup, "RANK")
        || ((is_set(lookup, "WORLD_SIZE") || is_set(lookup, "MASTER_ADDR")) && scheduler(lookup).is_none())
    {
        plain_env(lookup)?
    } else {
        match scheduler(lookup) {
            Some(Launcher::Slurm) => slurm(lookup)?,
            Some(Launcher::OpenMpi) => open_mpi(lookup)?,
            Some(_) => mpich(lookup)?,
            None => return Ok(None),
        }
    };
    Ok(Some(env))
}

/// [`detect`] over this process's environment (variables that are not
/// valid UTF-8 count as unset).
pub fn detect_from_process_env() -> Result<Option<LaunchEnv>, EnvError> {
    detect(&|var| std::env::var(var).ok())
}

/// The scheduler whose rank variables are set, if any, in detection order.
fn scheduler(lookup: Lookup<'_>) -> Option<Launcher> {
    let both = |a: &str, b: &str| is_set(lookup, a) && is_set(lookup, b);
    if both("SLURM_PROCID", "SLURM_NTASKS") {
        Some(Launcher::Slurm)
    } else if both("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE") {
        Some(Launcher::OpenMpi)
    } else if both("PMI_RANK", "PMI_SIZE") {
        Some(Launcher::Mpich)
    } else {
        None
    }
}

fn torchelastic(lookup: Lookup<'_>) -> Result<LaunchEnv, EnvError> {
    let launcher = Launcher::Torchelastic;
    let env = LaunchEnv {
        launcher,
        rank: req_int(lookup, "RANK", launcher)?,
        world_size: req_int(lookup, "WORLD_SIZE", launcher)?,
        local_rank: req_int(lookup, "LOCAL_RANK", launcher)?,
        local_world_size: req_int(lookup, "LOCAL_WORLD_SIZE", launcher)?,
        node_rank: req_int(lookup, "GROUP_RANK", launcher)?,
        master_addr: get(lookup, "MASTER_ADDR"),
        master_port: opt_port(lookup, "MASTER_PORT")?,
        restart_count: opt_int(lookup, "TORCHELASTIC_RESTART_COUNT")?.unwrap_or(0),
        run_id: get(lookup, "TORCHELASTIC_RUN_ID"),
    };
    validate(env, &TORCH_NAMES)
}

fn kubeflow(lookup: Lookup<'_>) -> Result<LaunchEnv, EnvError> {
    let launcher = Launcher::Kubeflow;
    let rank = req_int(lookup, "RANK", launcher)?;
    let (local_rank, local_world_size) = local_pair(lookup, "LOCAL_RANK", "LOCAL_WORLD_SIZE", launcher)?;
    let env = LaunchEnv {
        launcher,
        rank,
        world_size: req_int(lookup, "WORLD_SIZE", launcher)?,
        local_rank,
        local_world_size,
        node_rank: rank,
        master_addr: get(lookup, "MASTER_ADDR"),
        master_port: opt_port(lookup, "MASTER_PORT")?,
        restart_count: 0,
        run_id: None,
    };
    validate(env, &TORCH_NAMES)
}

fn plain_env(lookup: Lookup<'_>) -> Result<LaunchEnv, EnvError> {
    let launcher = Launcher::Env;
    let rank = req_int(lookup, "RANK", launcher)?;
    let world_size = req_int(lookup, "WORLD_SIZE", launcher)?;
    let (local_rank, local_world_size) = local_pair(lookup, "LOCAL_RANK", "LOCAL_WORLD_SIZE", launcher)?;
    let env = LaunchEnv {
        launcher,
        rank,
        world_size,
        local_rank,
        local_world_size,
        node_rank: opt_int(lookup, "GROUP_RANK")?.unwrap_or(0),
        master_addr: get(lookup, "MASTER_ADDR"),
        master_port: opt_port(lookup, "MASTER_PORT")?,
        restart_count: 0,
        run_id: None,
    };
    validate(env, &TORCH_NAMES)
}

fn slurm(lookup: Lookup<'_>) -> Result<LaunchEnv, EnvError> {
    const STEP_TASKS: &str = "SLURM_STEP_TASKS_PER_NODE";
    const NTASKS_PER_NODE: &str = "SLURM_NTASKS_PER_NODE";
    let launcher = Launcher::Slurm;
    let local_rank = req_int(lookup, "SLURM_LOCALID", launcher)?;
    let node_rank: usize = req_int(lookup, "SLURM_NODEID", launcher)?;

    let (local_world_size, local_world_var) = if let Some(spec) = get(lookup, STEP_TASKS) {
        let counts = tasks_per_node(&spec).map_err(|reason| invalid(STEP_TASKS, &spec, reason))?;
        let count = counts.get(node_rank).copied().ok_or_else(|| {
            invalid(
                STEP_TASKS,
                &spec,
                format!(
                    "lists {} nodes but SLURM_NODEID={node_rank}: the step's variables disagree; start the ranks with srun",
                    counts.len()
                ),
            )
        })?;
        (count, STEP_TASKS)
    } else if let Some(n) = opt_int(lookup, NTASKS_PER_NODE)? {
        (n, NTASKS_PER_NODE)
    } else if local_rank == 0 {
        (1, STEP_TASKS)
    } else {
        return Err(EnvError::Missing {
            var: STEP_TASKS,
            launcher,
        });
    };

    let master_addr = match get(lookup, "MASTER_ADDR") {
        Some(addr) => Some(addr),
        None => first_slurm_host(lookup)?,
    };
    let env = LaunchEnv {
        launcher,
        rank: req_int(lookup, "SLURM_PROCID", launcher)?,
        world_size: req_int(lookup, "SLURM_NTASKS", launcher)?,
        local_rank,
        local_world_size,
        node_rank,
        master_addr,
        master_port: opt_port(lookup, "MASTER_PORT")?,
        restart_count: 0,
        run_id: get(lookup, "SLURM_JOB_ID"),
    };
    let names = Names {
        rank: "SLURM_PROCID",
        world: "SLURM_NTASKS",
        local_rank: "SLURM_LOCALID",
        local_world: local_world_var,
    };
    validate(env, &names)
}

/// The first host of the step's node list (where task 0 runs), else of the
/// job's.
fn first_slurm_host(lookup: Lookup<'_>) -> Result<Option<String>, EnvError> {
    for var in ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"] {
        if let Some(list) = get(lookup, var) {
            let hosts = expand_nodelist(&list).map_err(|reason| invalid(var, &list, reason))?;
            return Ok(hosts.into_iter().next());
        }
    }
    Ok(None)
}

fn open_mpi(lookup: Lookup<'_>) -> Result<LaunchEnv, EnvError> {
    let names = Names {
        rank: "OMPI_COMM_WORLD_RANK",
        world: "OMPI_COMM_WORLD_SIZE",
        local_rank: "OMPI_COMM_WORLD_LOCAL_RANK",
        local_world: "OMPI_COMM_WORLD_LOCAL_SIZE",
    };
    mpi(lookup, Launcher::OpenMpi, &names)
}

fn mpich(lookup: Lookup<'_>) -> Result<LaunchEnv, EnvError> {
    let names = Names {
        rank: "PMI_RANK",
        world: "PMI_SIZE",
        local_rank: "MPI_LOCALRANKID",
        local_world: "MPI_LOCALNRANKS",
    };
    mpi(lookup, Launcher::Mpich, &names)
}

/// Open MPI and MPICH differ only in variable names. Neither exports a node
/// index (`OMPI_COMM_WORLD_NODE_RANK` is a rank among all jobs' processes on
/// the node, not the node's index), hence the estimate documented on
/// [`LaunchEnv::node_rank`].
fn mpi(lookup: Lookup<'_>, launcher: Launcher, names: &Names) -> Result<LaunchEnv, EnvError> {
    let rank = req_int(lookup, names.rank, launcher)?;
    let (local_rank, local_world_size) = local_pair(lookup, names.local_rank, names.local_world, launcher)?;
    let env = LaunchEnv {
        launcher,
        rank,
        world_size: req_int(lookup, names.world, launcher)?,
        local_rank,
        local_world_size,
        node_rank: 0,
        master_addr: get(lookup, "MASTER_ADDR"),
        master_port: opt_port(lookup, "MASTER_PORT")?,
        restart_count: 0,
        run_id: None,
    };
    let mut env = validate(env, names)?;
    // Validation guarantees local_world_size >= 1.
    env.node_rank = env.rank / env.local_world_size;
    Ok(env)
}

/// Expands a Slurm host list such as `gnode[10,20-22],other[01-02],solo`
/// into host names, in order, keeping zero padding (`n[008-010]` gives
/// `n008 n009 n010`). Several bracket groups in one name expand to every
/// combination. An empty list gives no hosts. Malformed lists, and lists of
/// more than 1,000,000 hosts, are [`EnvError::Invalid`] (naming
/// `SLURM_JOB_NODELIST`).
pub fn parse_slurm_nodelist(list: &str) -> Result<Vec<String>, EnvError> {
    expand_nodelist(list).map_err(|reason| invalid("SLURM_JOB_NODELIST", list, reason))
}

/// Expands Slurm's tasks-per-node spec (`2(x3),1` gives `[2, 2, 2, 1]`), one
/// count per node in node order. An empty spec gives no counts. Malformed
/// specs, and specs of more than 1,000,000 nodes, are [`EnvError::Invalid`]
/// (naming `SLURM_STEP_TASKS_PER_NODE`).
pub fn parse_slurm_tasks_per_node(spec: &str) -> Result<Vec<usize>, EnvError> {
    tasks_per_node(spec).map_err(|reason| invalid("SLURM_STEP_TASKS_PER_NODE", spec, reason))
}

/// One piece of a host pattern: literal text, or a bracketed set of numbers.
enum Part<'a> {
    Literal(&'a str),
    /// Inclusive ranges, each with the zero-padded width of its lower bound.
    Numbers(Vec<(u64, u64, usize)>),
}

const NODELIST_FORM: &str = "expected a Slurm host list such as gnode[10,20-22],other01";

/// [`parse_slurm_nodelist`], with errors as the reason text of an
/// [`EnvError::Invalid`].
fn expand_nodelist(list: &str) -> Result<Vec<String>, String> {
    let list = list.trim();
    if list.is_empty() {
        return Ok(Vec::new());
    }
    let mut patterns = Vec::new();
    let mut total: usize = 0;
    for entry in split_top_level(list)? {
        let parts = parse_host_pattern(entry)?;
        // Count before expanding anything, so the bound holds for memory too.
        let count = parts
            .iter()
            .try_fold(1usize, |acc, part| acc.checked_mul(part_len(part)?))
            .and_then(|n| total.checked_add(n));
        total = match count {
            Some(n) if n <= MAX_EXPANSION => n,
            _ => return Err(too_many("hosts")),
        };
        patterns.push(parts);
    }
    let mut hosts = Vec::with_capacity(total);
    for parts in &patterns {
        let mut names = vec![String::new()];
        for part in parts {
            names = match part {
                Part::Literal(text) => names.into_iter().map(|n| n + *text).collect(),
                Part::Numbers(ranges) => names
                    .iter()
                    .flat_map(|prefix| {
                        ranges
                            .iter()
                            .flat_map(move |&(lo, hi, width)| (lo..=hi).map(move |i| format!("{prefix}{i:0width$}")))
                    })
                    .collect(),
            };
        }
        hosts.extend(names);
    }
    Ok(hosts)
}

fn too_many(what: &str) -> String {
    format!("expands to more than {MAX_EXPANSION} {what}; the value is corrupt or forged")
}

/// How many names a part expands to (`None` on overflow).
fn part_len(part: &Part<'_>) -> Option<usize> {
    match part {
        Part::Literal(_) => Some(1),
        Part::Numbers(ranges) => ranges.iter().try_fold(0usize, |acc, &(lo, hi, _)| {
            let n = usize::try_from((hi - lo).checked_add(1)?).ok()?;
            acc.checked_add(n)
        }),
    }
}

/// Splits at commas outside brackets, checking that brackets pair up.
fn split_top_level(list: &str) -> Result<Vec<&str>, String> {
    let mut entries = Vec::new();
    let mut start = 0;
    let mut open = None;
    for (i, c) in list.char_indices() {
        match (c, open) {
            ('[', None) => open = Some(i),
            ('[', Some(_)) => {
                return Err(format!(
                    "is not a valid node list: nested '[' at byte {i}; {NODELIST_FORM}"
                ));
            }
            (']', Some(_)) => open = None,
            (']', None) => {
                return Err(format!(
                    "is not a valid node list: ']' at byte {i} has no '['; {NODELIST_FORM}"
                ));
            }
            (',', None) => {
                entries.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if let Some(i) = open {
        return Err(format!(
            "is not a valid node list: '[' at byte {i} is never closed; {NODELIST_FORM}"
        ));
    }
    entries.push(&list[start..]);
    Ok(entries)
}

/// Parses one entry (`gnode[10,20-22]`, `solo`) whose brackets are known to
/// pair up without nesting.
fn parse_host_pattern(entry: &str) -> Result<Vec<Part<'_>>, String> {
    let bad = |what: String| format!("is not a valid node list: {what}; {NODELIST_FORM}");
    let entry = entry.trim();
    if entry.is_empty() {
        return Err(bad("it has an empty entry".to_string()));
    }
    if entry.contains(char::is_whitespace) {
        return Err(bad(format!("{entry:?} contains a space")));
    }
    let mut parts = Vec::new();
    let mut rest = entry;
    while let Some(open) = rest.find('[') {
        if open > 0 {
            parts.push(Part::Literal(&rest[..open]));
        }
        let close = open
            + rest[open..]
                .find(']')
                .expect("split_top_level checked that brackets pair up");
        let mut ranges = Vec::new();
        for item in rest[open + 1..close].split(',') {
            ranges.push(parse_range(item).map_err(|what| bad(format!("{what} in {entry:?}")))?);
        }
        parts.push(Part::Numbers(ranges));
        rest = &rest[close + 1..];
    }
    if !rest.is_empty() {
        parts.push(Part::Literal(rest));
    }
    Ok(parts)
}

/// Parses `N` or `N-M` inside brackets into (lo, hi, width).
fn parse_range(item: &str) -> Result<(u64, u64, usize), String> {
    let number = |s: &str| -> Result<u64, String> {
        if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!("{item:?} is not a number or a range N-M"));
        }
        s.parse().map_err(|_| format!("{s} is too large"))
    };
    let (lo_text, hi_text) = item.split_once('-').unwrap_or((item, item));
    let (lo, hi) = (number(lo_text)?, number(hi_text)?);
    if lo > hi {
        return Err(format!("range {item} goes down (write {hi_text}-{lo_text})"));
    }
    Ok((lo, hi, lo_text.len()))
}

/// [`parse_slurm_tasks_per_node`], with errors as the reason text of an
/// [`EnvError::Invalid`].
fn tasks_per_node(spec: &str) -> Result<Vec<usize>, String> {
    let spec = spec.trim();
    if spec.is_empty() {
        return Ok(Vec::new());
    }
    let bad = |item: &str| {
        format!("is not a valid tasks-per-node spec: {item:?} is not N or N(xM); expected a list such as 2(x3),1")
    };
    let mut runs = Vec::new();
    let mut total: usize = 0;
    for item in spec.split(',') {
        let item = item.trim();
        let (count, repeat) = match item.split_once("(x") {
            Some((count, repeat)) => {
                let repeat = repeat.strip_suffix(')').ok_or_else(|| bad(item))?;
                (count, repeat.parse::<usize>().map_err(|_| bad(item))?)
            }
            None => (item, 1),
        };
        let count = count.parse::<usize>().map_err(|_| bad(item))?;
        if repeat == 0 {
            return Err(bad(item));
        }
        total = match total.checked_add(repeat) {
            Some(n) if n <= MAX_EXPANSION => n,
            _ => return Err(too_many("nodes")),
        };
        runs.push((count, repeat));
    }
    let mut counts = Vec::with_capacity(total);
    for (count, repeat) in runs {
        counts.extend(std::iter::repeat_n(count, repeat));
    }
    Ok(counts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn run(pairs: &[(&str, &str)]) -> Result<Option<LaunchEnv>, EnvError> {
        let map: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        detect(&move |k| map.get(k).cloned())
    }

    fn ok(pairs: &[(&str, &str)]) -> LaunchEnv {
        run(pairs).unwrap().expect("a launcher is detected")
    }

    fn err(pairs: &[(&str, &str)]) -> String {
        run(pairs).unwrap_err().to_string()
    }

    const TORCHRUN: &[(&str, &str)] = &[
        ("RANK", "5"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("GROUP_RANK", "1"),
        ("GROUP_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "10.0.0.1"),
        ("MASTER_PORT", "29500"),
        ("TORCHELASTIC_RESTART_COUNT", "2"),
        ("TORCHELASTIC_RUN_ID", "job-7"),
    ];

    fn with(
        base: &[(&'static str, &'static str)],
        extra: &[(&'static str, &'static str)],
    ) -> Vec<(&'static str, &'static str)> {
        let mut v: Vec<_> = base
            .iter()
            .filter(|(k, _)| !extra.iter().any(|(e, _)| e == k))
            .copied()
            .collect();
        v.extend_from_slice(extra);
        v
    }

    fn without(base: &[(&'static str, &'static str)], var: &str) -> Vec<(&'static str, &'static str)> {
        base.iter().filter(|(k, _)| *k != var).copied().collect()
    }

    #[test]
    fn nothing_set_is_none() {
        assert_eq!(run(&[]).unwrap(), None);
        assert_eq!(run(&[("HOME", "/root"), ("RANK", " ")]).unwrap(), None);
    }

    #[test]
    fn torchrun() {
        let env = ok(TORCHRUN);
        assert_eq!(
            env,
            LaunchEnv {
                launcher: Launcher::Torchelastic,
                rank: 5,
                world_size: 8,
                local_rank: 1,
                local_world_size: 4,
                node_rank: 1,
                master_addr: Some("10.0.0.1".into()),
                master_port: Some(29500),
                restart_count: 2,
                run_id: Some("job-7".into()),
            }
        );
        let bare = ok(&without(
            &without(&without(TORCHRUN, "MASTER_ADDR"), "MASTER_PORT"),
            "TORCHELASTIC_RESTART_COUNT",
        ));
        assert_eq!(
            (bare.master_addr, bare.master_port, bare.restart_count),
            (None, None, 0)
        );
        assert_eq!(
            err(&without(TORCHRUN, "WORLD_SIZE")),
            "WORLD_SIZE is not set: torchrun sets it with RANK and LOCAL_RANK; set WORLD_SIZE as torchrun would"
        );
    }

    #[test]
    fn kubeflow() {
        let pairs = [
            ("KUBERNETES_PORT", "tcp://10.96.0.1:443"),
            ("MASTER_ADDR", "job-master-0"),
            ("MASTER_PORT", "23456"),
            ("WORLD_SIZE", "3"),
            ("RANK", "2"),
        ];
        let env = ok(&pairs);
        assert_eq!(env.launcher, Launcher::Kubeflow);
        assert_eq!((env.rank, env.world_size, env.node_rank), (2, 3, 2));
        assert_eq!((env.local_rank, env.local_world_size), (0, 1));
        assert_eq!(env.master_addr.as_deref(), Some("job-master-0"));
        assert_eq!(env.master_port, Some(23456));
        let env = ok(&with(&pairs, &[("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")]));
        assert_eq!(env.launcher, Launcher::Kubeflow);
    }

    #[test]
    fn plain_env() {
        let env = ok(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "host0"),
            ("MASTER_PORT", "29500"),
        ]);
        assert_eq!(
            env,
            LaunchEnv {
                launcher: Launcher::Env,
                rank: 1,
                world_size: 2,
                local_rank: 0,
                local_world_size: 1,
                node_rank: 0,
                master_addr: Some("host0".into()),
                master_port: Some(29500),
                restart_count: 0,
                run_id: None,
            }
        );
        let env = ok(&[
            ("RANK", " 3 "),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
        ]);
        assert_eq!(
            (env.rank, env.local_rank, env.local_world_size, env.node_rank),
            (3, 1, 2, 0)
        );
        let env = ok(&[("RANK", "3"), ("WORLD_SIZE", "4"), ("GROUP_RANK", "1")]);
        assert_eq!(env.node_rank, 1);
    }

    #[test]
    fn plain_env_missing() {
        assert_eq!(
            err(&[("WORLD_SIZE", "4")]),
            "RANK is not set: torchrun sets it for each worker; set RANK (0..WORLD_SIZE) or use tcp://host:port?rank=R&world_size=N"
        );
        assert!(err(&[("MASTER_ADDR", "h")]).starts_with("RANK is not set"));
        assert!(err(&[("RANK", "0")]).starts_with("WORLD_SIZE is not set: "));
        assert_eq!(
            run(&[("RANK", "0")]).unwrap_err(),
            EnvError::Missing {
                var: "WORLD_SIZE",
                launcher: Launcher::Env
            }
        );
        assert_eq!(
            err(&[("RANK", "1"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "1")]),
            "LOCAL_WORLD_SIZE is not set: LOCAL_RANK is above 0, so set LOCAL_WORLD_SIZE to the number of ranks on this node"
        );
    }

    #[test]
    fn order_torchelastic_beats_kubeflow_beats_env() {
        let k8s = with(TORCHRUN, &[("KUBERNETES_PORT", "tcp://10.96.0.1:443")]);
        assert_eq!(ok(&k8s).launcher, Launcher::Torchelastic);
        let kubeflow = without(&k8s, "GROUP_RANK");
        assert_eq!(ok(&kubeflow).launcher, Launcher::Kubeflow);
        let env = without(&kubeflow, "KUBERNETES_PORT");
        assert_eq!(ok(&env).launcher, Launcher::Env);
    }

    #[test]
    fn order_env_beats_schedulers_but_partial_env_defers() {
        let slurm = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "0"),
        ];
        assert_eq!(
            ok(&with(&slurm, &[("RANK", "1"), ("WORLD_SIZE", "4")])).launcher,
            Launcher::Env
        );
        // A batch script exporting MASTER_ADDR/MASTER_PORT for srun'd ranks.
        let env = ok(&with(&slurm, &[("MASTER_ADDR", "n1"), ("MASTER_PORT", "1234")]));
        assert_eq!(env.launcher, Launcher::Slurm);
        assert_eq!((env.master_addr.as_deref(), env.master_port), (Some("n1"), Some(1234)));
        let mpi = [
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("WORLD_SIZE", "2"),
        ];
        assert_eq!(ok(&mpi).launcher, Launcher::OpenMpi);
        assert_eq!(ok(&with(&slurm, &mpi)).launcher, Launcher::Slurm);
    }

    const SLURM: &[(&str, &str)] = &[
        ("SLURM_PROCID", "5"),
        ("SLURM_NTASKS", "7"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NODEID", "2"),
        ("SLURM_STEP_TASKS_PER_NODE", "2(x3),1"),
        ("SLURM_STEP_NODELIST", "gnode[10,20-22]"),
        ("SLURM_JOB_NODELIST", "other[01-09]"),
        ("SLURM_JOB_ID", "4242"),
    ];

    #[test]
    fn slurm() {
        let env = ok(SLURM);
        assert_eq!(
            env,
            LaunchEnv {
                launcher: Launcher::Slurm,
                rank: 5,
                world_size: 7,
                local_rank: 1,
                local_world_size: 2,
                node_rank: 2,
                master_addr: Some("gnode10".into()),
                master_port: None,
                restart_count: 0,
                run_id: Some("4242".into()),
            }
        );
        let job_list = without(SLURM, "SLURM_STEP_NODELIST");
        assert_eq!(ok(&job_list).master_addr.as_deref(), Some("other01"));
        let no_list = without(&job_list, "SLURM_JOB_NODELIST");
        assert_eq!(ok(&no_list).master_addr, None);
        let last_node = with(
            SLURM,
            &[("SLURM_NODEID", "3"), ("SLURM_LOCALID", "0"), ("SLURM_PROCID", "6")],
        );
        assert_eq!(ok(&last_node).local_world_size, 1);
    }

    #[test]
    fn slurm_local_size_fallbacks() {
        let no_step = without(SLURM, "SLURM_STEP_TASKS_PER_NODE");
        let env = ok(&with(&no_step, &[("SLURM_NTASKS_PER_NODE", "3")]));
        assert_eq!(env.local_world_size, 3);
        assert_eq!(
            err(&no_step),
            "SLURM_STEP_TASKS_PER_NODE is not set: srun sets it for each task; start the ranks with srun, not directly from the batch script, or set SLURM_STEP_TASKS_PER_NODE"
        );
        let env = ok(&with(&no_step, &[("SLURM_LOCALID", "0")]));
        assert_eq!(env.local_world_size, 1);
    }

    #[test]
    fn slurm_errors() {
        assert!(err(&without(SLURM, "SLURM_LOCALID")).starts_with("SLURM_LOCALID is not set: srun sets it"));
        assert!(err(&without(SLURM, "SLURM_NODEID")).starts_with("SLURM_NODEID is not set"));
        assert_eq!(
            err(&with(SLURM, &[("SLURM_PROCID", "7")])),
            "SLURM_PROCID=7 but SLURM_NTASKS=7: ranks go from 0 to SLURM_NTASKS-1"
        );
        assert_eq!(
            err(&with(SLURM, &[("SLURM_LOCALID", "2")])),
            "SLURM_LOCALID=2 but SLURM_STEP_TASKS_PER_NODE=2: local ranks go from 0 to SLURM_STEP_TASKS_PER_NODE-1"
        );
        assert!(
            err(&with(SLURM, &[("SLURM_NODEID", "4")]))
                .starts_with("SLURM_STEP_TASKS_PER_NODE=2(x3),1 lists 4 nodes but SLURM_NODEID=4")
        );
        assert!(
            err(&with(SLURM, &[("SLURM_STEP_TASKS_PER_NODE", "2(x")]))
                .starts_with("SLURM_STEP_TASKS_PER_NODE=2(x is not a valid tasks-per-node spec")
        );
        assert!(
            err(&with(SLURM, &[("SLURM_STEP_NODELIST", "a[1-")]))
                .starts_with("SLURM_STEP_NODELIST=a[1- is not a valid node list: '[' at byte 1 is never closed")
        );
    }

    #[test]
    fn open_mpi() {
        let pairs = [
            ("OMPI_COMM_WORLD_RANK", "6"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "2"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
            ("OMPI_COMM_WORLD_NODE_RANK", "2"),
            ("MASTER_ADDR", "n0"),
            ("MASTER_PORT", "29500"),
        ];
        let env = ok(&pairs);
        assert_eq!(env.launcher, Launcher::OpenMpi);
        assert_eq!(
            (env.rank, env.world_size, env.local_rank, env.local_world_size),
            (6, 8, 2, 4)
        );
        assert_eq!(env.node_rank, 1, "rank / local size, not OMPI_COMM_WORLD_NODE_RANK");
        assert_eq!((env.master_addr.as_deref(), env.master_port), (Some("n0"), Some(29500)));
        assert_eq!(
            err(&with(&pairs, &[("OMPI_COMM_WORLD_LOCAL_SIZE", "0")])),
            "OMPI_COMM_WORLD_LOCAL_SIZE=0 is not allowed: a node runs at least one rank"
        );
        assert!(
            err(&without(&pairs, "OMPI_COMM_WORLD_LOCAL_SIZE"))
                .starts_with("OMPI_COMM_WORLD_LOCAL_SIZE is not set: mpirun sets it")
        );
    }

    #[test]
    fn mpich() {
        let env = ok(&[("PMI_RANK", "3"), ("PMI_SIZE", "4")]);
        assert_eq!(env.launcher, Launcher::Mpich);
        assert_eq!(
            (
                env.rank,
                env.world_size,
                env.local_rank,
                env.local_world_size,
                env.node_rank
            ),
            (3, 4, 0, 1, 3)
        );
        let env = ok(&[
            ("PMI_RANK", "3"),
            ("PMI_SIZE", "4"),
            ("MPI_LOCALRANKID", "1"),
            ("MPI_LOCALNRANKS", "2"),
        ]);
        assert_eq!((env.local_rank, env.local_world_size, env.node_rank), (1, 2, 1));
        assert!(
            err(&[("PMI_RANK", "3"), ("PMI_SIZE", "4"), ("MPI_LOCALRANKID", "1")])
                .starts_with("MPI_LOCALNRANKS is not set: mpiexec (Hydra) sets it")
        );
        assert_eq!(
            err(&[("PMI_RANK", "4"), ("PMI_SIZE", "4")]),
            "PMI_RANK=4 but PMI_SIZE=4: ranks go from 0 to PMI_SIZE-1"
        );
    }

    #[test]
    fn validation_errors() {
        let base = [("RANK", "0"), ("WORLD_SIZE", "4")];
        assert_eq!(
            err(&with(&base, &[("RANK", "5")])),
            "RANK=5 but WORLD_SIZE=4: ranks go from 0 to WORLD_SIZE-1"
        );
        assert_eq!(
            err(&with(&base, &[("WORLD_SIZE", "0")])),
            "WORLD_SIZE=0 is not allowed: a job has at least one rank"
        );
        assert_eq!(
            err(&with(&base, &[("RANK", "-1")])),
            "RANK=-1 is not a non-negative integer"
        );
        assert_eq!(
            err(&with(&base, &[("WORLD_SIZE", "four")])),
            "WORLD_SIZE=four is not a non-negative integer"
        );
        assert_eq!(
            run(&with(&base, &[("RANK", "x")])).unwrap_err(),
            EnvError::Invalid {
                var: "RANK".into(),
                value: "x".into(),
                reason: "is not a non-negative integer".into()
            }
        );
        assert_eq!(
            err(&with(&base, &[("LOCAL_RANK", "2"), ("LOCAL_WORLD_SIZE", "2")])),
            "LOCAL_RANK=2 but LOCAL_WORLD_SIZE=2: local ranks go from 0 to LOCAL_WORLD_SIZE-1"
        );
        assert_eq!(
            err(&with(&base, &[("LOCAL_WORLD_SIZE", "8")])),
            "LOCAL_WORLD_SIZE=8 but WORLD_SIZE=4: a node cannot run more ranks than the whole job"
        );
        for port in ["0", "65536", "http", "-1"] {
            assert_eq!(
                err(&with(&base, &[("MASTER_PORT", port)])),
                format!("MASTER_PORT={port} is not a TCP port: use a number from 1 to 65535")
            );
        }
        assert_eq!(ok(&with(&base, &[("MASTER_PORT", "65535")])).master_port, Some(65535));
        assert_eq!(ok(&with(&base, &[("MASTER_PORT", "1")])).master_port, Some(1));
        let restart = with(TORCHRUN, &[("TORCHELASTIC_RESTART_COUNT", "again")]);
        assert_eq!(
            err(&restart),
            "TORCHELASTIC_RESTART_COUNT=again is not a non-negative integer"
        );
        assert_eq!(
            err(&with(TORCHRUN, &[("GROUP_RANK", "1.5")])),
            "GROUP_RANK=1.5 is not a non-negative integer"
        );
    }

    #[test]
    fn long_values_are_shortened_in_messages() {
        let long = "9".repeat(5000);
        let msg = run(&[("RANK", long.as_str()), ("WORLD_SIZE", "1")])
            .unwrap_err()
            .to_string();
        assert!(msg.len() < 300, "{msg}");
        assert!(msg.starts_with(&format!("RANK={}...", "9".repeat(MAX_QUOTED))));
    }

    #[test]
    fn launcher_names() {
        let names: Vec<String> = [
            Launcher::Torchelastic,
            Launcher::Env,
            Launcher::Kubeflow,
            Launcher::Slurm,
            Launcher::OpenMpi,
            Launcher::Mpich,
        ]
        .iter()
        .map(ToString::to_string)
        .collect();
        assert_eq!(
            names,
            [
                "torchrun",
                "env",
                "Kubeflow PyTorchJob",
                "Slurm",
                "Open MPI",
                "MPICH/PMI"
            ]
        );
    }

    fn hosts(list: &str) -> Vec<String> {
        parse_slurm_nodelist(list).unwrap()
    }

    #[test]
    fn nodelist_expansion() {
        assert_eq!(
            hosts("gnode[10,20-22],other[01-02],solo"),
            ["gnode10", "gnode20", "gnode21", "gnode22", "other01", "other02", "solo"]
        );
        assert_eq!(hosts("n[008-010]"), ["n008", "n009", "n010"]);
        assert_eq!(hosts("n[8-10]"), ["n8", "n9", "n10"]);
        assert_eq!(hosts("n[099-101]"), ["n099", "n100", "n101"]);
        assert_eq!(hosts("solo"), ["solo"]);
        assert_eq!(hosts("a,b"), ["a", "b"]);
        assert_eq!(
            hosts("rack[1-2]-n[1,3]"),
            ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]
        );
        assert_eq!(hosts("n[1-2].cluster"), ["n1.cluster", "n2.cluster"]);
        assert_eq!(hosts("[1-2]"), ["1", "2"]);
        assert_eq!(hosts("n[5]"), ["n5"]);
        assert!(hosts("").is_empty());
        assert!(hosts("  ").is_empty());
        assert_eq!(hosts(&format!("n[1-{MAX_EXPANSION}]")).len(), MAX_EXPANSION);
    }

    #[test]
    fn nodelist_malformed() {
        for bad in [
            "a[1-",
            "a[3-1]",
            "a]",
            "a[[1]]",
            "a[]",
            "a[1,,2]",
            "a[x]",
            "a[1-2-3]",
            "a[-1]",
            "a[1-]",
            "a,,b",
            "a,",
            ",a",
            "a b",
            "a[99999999999999999999]",
        ] {
            let e = parse_slurm_nodelist(bad).unwrap_err();
            let msg = e.to_string();
            assert!(matches!(e, EnvError::Invalid { .. }), "{bad:?}");
            assert!(msg.starts_with(&format!("SLURM_JOB_NODELIST={bad} ")), "{msg}");
            assert!(msg.contains("gnode[10,20-22]"), "says what is expected: {msg}");
        }
        assert!(
            parse_slurm_nodelist("a[3-1]")
                .unwrap_err()
                .to_string()
                .contains("write 1-3")
        );
    }

    #[test]
    fn nodelist_huge_ranges_are_refused_before_expanding() {
        for huge in [
            format!("n[1-{}]", MAX_EXPANSION + 1),
            "n[0-18446744073709551615]".to_string(),
            "n[0-999999],m[0-999999]".to_string(),
            "a[0-9999]b[0-9999]".to_string(),
            "a[0-999]b[0-999]c[0-999]d[0-999]e[0-999]f[0-999]g[0-999]".to_string(),
        ] {
            let msg = parse_slurm_nodelist(&huge).unwrap_err().to_string();
            assert!(msg.contains("more than 1000000 hosts"), "{msg}");
        }
    }

    #[test]
    fn tasks_per_node() {
        let parse = |s: &str| parse_slurm_tasks_per_node(s).unwrap();
        assert_eq!(parse("2(x3),1"), [2, 2, 2, 1]);
        assert_eq!(parse("4"), [4]);
        assert_eq!(parse("1, 3(x2)"), [1, 3, 3]);
        assert_eq!(parse("8(x1)"), [8]);
        assert!(parse("").is_empty());
        assert_eq!(parse(&format!("1(x{MAX_EXPANSION})")).len(), MAX_EXPANSION);
        for bad in ["2(x3", "2x3", "(x3)", "2(x0)", "a", "2,,1", "2(x-1)", "2(y3)", "-2"] {
            let msg = parse_slurm_tasks_per_node(bad).unwrap_err().to_string();
            assert!(
                msg.starts_with(&format!("SLURM_STEP_TASKS_PER_NODE={bad} is not a valid")),
                "{msg}"
            );
        }
        for huge in [
            format!("1(x{})", MAX_EXPANSION + 1),
            "1(x999999),1(x999999)".to_string(),
            format!("1(x{})", usize::MAX),
        ] {
            let msg = parse_slurm_tasks_per_node(&huge).unwrap_err().to_string();
            assert!(msg.contains("more than 1000000 nodes"), "{msg}");
        }
    }
}
