//! Sans-IO: the environment each worker gets, as torchrun gives it, plus
//! `CHORUS_JOB_SECRET`, and under `--restart-policy worker` the elastic
//! bounds of the workers' group (`CHORUS_MIN_WORLD`, `CHORUS_MAX_WORLD`).

use std::path::{Path, PathBuf};

/// What every worker of one node in one attempt shares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobEnv {
    /// `ROLE_NAME`.
    pub role: String,
    /// Workers on each node (equal on every node).
    pub nproc_per_node: usize,
    /// This node's rank (`GROUP_RANK`).
    pub node_rank: usize,
    /// Nodes in the job (`GROUP_WORLD_SIZE`).
    pub nnodes: usize,
    /// Where the launcher's store listens.
    pub master_addr: String,
    /// Its port.
    pub master_port: u16,
    /// `CHORUS_STORE`: the store's URL when no launcher serves it (etcd);
    /// chorus workers meet there instead of at `MASTER_ADDR:MASTER_PORT`.
    pub store_url: Option<String>,
    /// `TORCHELASTIC_RESTART_COUNT`.
    pub restart_count: u64,
    /// `TORCHELASTIC_MAX_RESTARTS`.
    pub max_restarts: u64,
    /// `TORCHELASTIC_RUN_ID`.
    pub run_id: String,
    /// `CHORUS_JOB_SECRET`.
    pub secret: String,
    /// This attempt's directory; each rank's `TORCHELASTIC_ERROR_FILE` is
    /// `<attempt_dir>/<rank>/error.json`.
    pub attempt_dir: PathBuf,
    /// `CHORUS_MIN_WORLD` and `CHORUS_MAX_WORLD`: the bounds on the size of
    /// an elastic group's generation, set only under `--restart-policy
    /// worker`, where the workers re-form by themselves as nodes leave and
    /// join (`--nnodes MIN:MAX` times `--nproc-per-node`).
    pub elastic_world: Option<(usize, usize)>,
    /// `CHORUS_ELASTIC_JOIN=1`: the workers join a running elastic group as
    /// new members (a relaunched worker, a node that joined later) rather
    /// than form its first generation, even before the group has published
    /// one.
    pub join_running: bool,
}

/// Set for workers that join a running elastic group.
pub const JOIN_ENV: &str = "CHORUS_ELASTIC_JOIN";
/// Scopes the workers' elastic groups to one attempt (`--restart-policy all`).
pub const SCOPE_ENV: &str = "CHORUS_ELASTIC_SCOPE";

/// Fewest ranks a generation of the workers' elastic group may have.
pub const MIN_WORLD_ENV: &str = "CHORUS_MIN_WORLD";
/// Most ranks a generation of the workers' elastic group admits.
pub const MAX_WORLD_ENV: &str = "CHORUS_MAX_WORLD";

/// The signals the launcher forwards, as torchrun names them in
/// `TORCHELASTIC_SIGNALS_TO_HANDLE`.
pub const SIGNALS_TO_HANDLE: &str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT";

impl JobEnv {
    /// The global rank of `local_rank` on this node.
    pub fn rank(&self, local_rank: usize) -> usize {
        self.node_rank * self.nproc_per_node + local_rank
    }

    /// Number of ranks in the job.
    pub fn world_size(&self) -> usize {
        self.nnodes * self.nproc_per_node
    }

    /// The same job in attempt `attempt` (`TORCHELASTIC_RESTART_COUNT`),
    /// with its files under `run_dir`'s `attempt_<attempt>`.
    pub fn for_attempt(&self, attempt: u64, run_dir: &Path) -> JobEnv {
        JobEnv {
            restart_count: attempt,
            attempt_dir: attempt_dir(run_dir, attempt),
            ..self.clone()
        }
    }

    /// Where `rank` writes its error report (`TORCHELASTIC_ERROR_FILE`).
    pub fn error_file(&self, rank: usize) -> PathBuf {
        rank_dir(&self.attempt_dir, rank).join("error.json")
    }

    /// The variables set for `local_rank`; `parent` reads the launcher's own
    /// environment, which workers inherit and which decides the defaults
    /// (`OMP_NUM_THREADS`, `TORCH_NCCL_ASYNC_ERROR_HANDLING`).
    pub fn for_worker(&self, local_rank: usize, parent: &dyn Fn(&str) -> Option<String>) -> Vec<(String, String)> {
        let rank = self.rank(local_rank).to_string();
        let world = self.world_size().to_string();
        let mut vars: Vec<(&str, String)> = vec![
            ("RANK", rank.clone()),
            ("LOCAL_RANK", local_rank.to_string()),
            ("WORLD_SIZE", world.clone()),
            ("LOCAL_WORLD_SIZE", self.nproc_per_node.to_string()),
            ("GROUP_RANK", self.node_rank.to_string()),
            ("GROUP_WORLD_SIZE", self.nnodes.to_string()),
            // One role per job: its ranks are the job's.
            ("ROLE_RANK", rank.clone()),
            ("ROLE_NAME", self.role.clone()),
            ("ROLE_WORLD_SIZE", world),
            ("MASTER_ADDR", self.master_addr.clone()),
            ("MASTER_PORT", self.master_port.to_string()),
            ("TORCHELASTIC_RESTART_COUNT", self.restart_count.to_string()),
            ("TORCHELASTIC_MAX_RESTARTS", self.max_restarts.to_string()),
            ("TORCHELASTIC_RUN_ID", self.run_id.clone()),
            ("TORCHELASTIC_USE_AGENT_STORE", "True".to_string()),
            ("TORCHELASTIC_SIGNALS_TO_HANDLE", SIGNALS_TO_HANDLE.to_string()),
            (
                "TORCHELASTIC_ERROR_FILE",
                self.error_file(self.rank(local_rank)).display().to_string(),
            ),
            (
                "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                parent("TORCH_NCCL_ASYNC_ERROR_HANDLING").unwrap_or_else(|| "1".to_string()),
            ),
            ("CHORUS_JOB_SECRET", self.secret.clone()),
        ];
        if let Some(url) = &self.store_url {
            vars.push((chorus_runtime::rendezvous::STORE_ENV, url.clone()));
        }
        if let Some((min, max)) = self.elastic_world {
            vars.push((MIN_WORLD_ENV, min.to_string()));
            vars.push((MAX_WORLD_ENV, max.to_string()));
            // A joiner receives its state by cross-memory writes into its
            // tensors, which run 3x faster into huge pages (a 100 MiB
            // state from 3 sources: 21 against 73 ms): torch backs its CPU
            // tensors of 2 MiB and more with them when this is set.
            if parent(THP_ENV).is_none() {
                vars.push((THP_ENV, "1".to_string()));
            }
        }
        if self.join_running {
            vars.push((JOIN_ENV, "1".to_string()));
        }
        if let Some(scope) = self.elastic_scope() {
            vars.push((SCOPE_ENV, scope));
        }
        if self.nproc_per_node > 1 && parent("OMP_NUM_THREADS").is_none() {
            vars.push(("OMP_NUM_THREADS", "1".to_string()));
        }
        vars.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
    }
}

/// torch's switch for huge pages under its CPU tensors.
const THP_ENV: &str = "THP_MEM_ALLOC_ENABLE";

impl JobEnv {
    /// Under the all policy each attempt is a new job: its elastic groups
    /// must not meet the previous attempt's (whose ranks may have begun a
    /// restart of their own before the launcher stopped them).
    fn elastic_scope(&self) -> Option<String> {
        (self.elastic_world.is_none() && self.restart_count > 0).then(|| format!("attempt{}", self.restart_count))
    }

    /// The run ids the workers' groups use in the store: a plain group's
    /// (`TORCHELASTIC_RUN_ID`), and an elastic group's when it is scoped.
    pub fn group_run_ids(&self) -> Vec<String> {
        let mut ids = vec![self.run_id.clone()];
        ids.extend(self.elastic_scope().map(|scope| format!("{}/{scope}", self.run_id)));
        ids
    }
}

/// `<run_dir>/attempt_<attempt>`: one attempt's files.
pub fn attempt_dir(run_dir: &Path, attempt: u64) -> PathBuf {
    run_dir.join(format!("attempt_{attempt}"))
}

/// `<attempt_dir>/<rank>`: a rank's log and error files.
pub fn rank_dir(attempt_dir: &Path, rank: usize) -> PathBuf {
    attempt_dir.join(rank.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job() -> JobEnv {
        JobEnv {
            role: "trainer".into(),
            nproc_per_node: 3,
            node_rank: 1,
            nnodes: 2,
            master_addr: "n0".into(),
            master_port: 29500,
            store_url: None,
            restart_count: 2,
            max_restarts: 5,
            run_id: "job".into(),
            secret: "ab".into(),
            attempt_dir: PathBuf::from("/l/job/attempt_2"),
            elastic_world: None,
            join_running: false,
        }
    }

    fn get<'a>(vars: &'a [(String, String)], key: &str) -> Option<&'a str> {
        vars.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    #[test]
    fn ranks_follow_node_rank_and_local_rank() {
        let vars = job().for_worker(2, &|_| None);
        for (key, value) in [
            ("RANK", "5"),
            ("LOCAL_RANK", "2"),
            ("WORLD_SIZE", "6"),
            ("LOCAL_WORLD_SIZE", "3"),
            ("GROUP_RANK", "1"),
            ("GROUP_WORLD_SIZE", "2"),
            ("ROLE_RANK", "5"),
            ("ROLE_NAME", "trainer"),
            ("ROLE_WORLD_SIZE", "6"),
            ("MASTER_ADDR", "n0"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
            ("TORCHELASTIC_MAX_RESTARTS", "5"),
            ("TORCHELASTIC_RUN_ID", "job"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCHELASTIC_ERROR_FILE", "/l/job/attempt_2/5/error.json"),
            ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            ("OMP_NUM_THREADS", "1"),
            ("CHORUS_JOB_SECRET", "ab"),
        ] {
            assert_eq!(get(&vars, key), Some(value), "{key}");
        }
    }

    #[test]
    fn a_relaunch_advances_only_the_restart_count_and_directory() {
        let next = job().for_attempt(3, Path::new("/l/job"));
        let vars = next.for_worker(1, &|_| None);
        assert_eq!(get(&vars, "TORCHELASTIC_RESTART_COUNT"), Some("3"));
        assert_eq!(
            get(&vars, "TORCHELASTIC_ERROR_FILE"),
            Some("/l/job/attempt_3/4/error.json")
        );
        let before = job().for_worker(1, &|_| None);
        let differ: Vec<&str> = before
            .iter()
            .zip(&vars)
            .filter(|(a, b)| a != b)
            .map(|(a, _)| a.0.as_str())
            .collect();
        // Under the all policy the attempt's elastic scope moves with it.
        assert_eq!(
            differ,
            [
                "TORCHELASTIC_RESTART_COUNT",
                "TORCHELASTIC_ERROR_FILE",
                "CHORUS_ELASTIC_SCOPE"
            ]
        );
    }

    #[test]
    fn a_store_in_etcd_is_named_in_chorus_store() {
        assert_eq!(get(&job().for_worker(0, &|_| None), "CHORUS_STORE"), None);
        let etcd = JobEnv {
            store_url: Some("etcd://e1:2379/p".into()),
            ..job()
        };
        assert_eq!(
            get(&etcd.for_worker(0, &|_| None), "CHORUS_STORE"),
            Some("etcd://e1:2379/p")
        );
    }

    #[test]
    fn elastic_bounds_only_when_given() {
        let plain = job().for_worker(0, &|_| None);
        assert_eq!(get(&plain, MIN_WORLD_ENV), None, "torchrun's variables only");
        let elastic = JobEnv {
            elastic_world: Some((3, 9)),
            ..job()
        };
        let vars = elastic.for_worker(0, &|_| None);
        assert_eq!(get(&vars, MIN_WORLD_ENV), Some("3"));
        assert_eq!(get(&vars, MAX_WORLD_ENV), Some("9"));
        assert_eq!(get(&plain, THP_ENV), None, "torchrun's variables only");
        assert_eq!(get(&vars, THP_ENV), Some("1"), "a joiner's tensors on huge pages");
        let chosen = elastic.for_worker(0, &|name| (name == THP_ENV).then(|| "0".to_string()));
        assert_eq!(get(&chosen, THP_ENV), None, "the user's own choice is inherited");
        assert_eq!(get(&vars, JOIN_ENV), None);
        let joining = JobEnv {
            join_running: true,
            ..elastic
        };
        assert_eq!(get(&joining.for_worker(0, &|_| None), JOIN_ENV), Some("1"));
        // The worker policy keeps one group across relaunches: no scope.
        let relaunched = JobEnv {
            restart_count: 2,
            ..joining
        };
        assert_eq!(get(&relaunched.for_worker(0, &|_| None), SCOPE_ENV), None);
    }

    #[test]
    fn every_attempt_after_the_first_scopes_its_elastic_groups_under_the_all_policy() {
        let first = JobEnv {
            restart_count: 0,
            ..job()
        };
        assert_eq!(
            get(&first.for_worker(0, &|_| None), SCOPE_ENV),
            None,
            "torchrun's variables only"
        );
        let again = JobEnv {
            restart_count: 3,
            ..job()
        };
        assert_eq!(get(&again.for_worker(0, &|_| None), SCOPE_ENV), Some("attempt3"));
    }

    #[test]
    fn user_settings_are_kept() {
        let parent = |k: &str| match k {
            "OMP_NUM_THREADS" => Some("4".to_string()),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING" => Some("3".to_string()),
            _ => None,
        };
        let vars = job().for_worker(0, &parent);
        assert_eq!(get(&vars, "OMP_NUM_THREADS"), None, "inherited, not overridden");
        assert_eq!(get(&vars, "TORCH_NCCL_ASYNC_ERROR_HANDLING"), Some("3"));
        let single = JobEnv {
            nproc_per_node: 1,
            ..job()
        };
        assert_eq!(get(&single.for_worker(0, &|_| None), "OMP_NUM_THREADS"), None);
    }
}
