//! A job read back from its store, as a dashboard or `chorus chaos` sees
//! it: the newest generations and their members, every process's live
//! record, the exits its launchers published and the fault log; and fault
//! requests written, signed with the job secret (see [`super::live`] for
//! the keys).

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use chorus_runtime::rendezvous::elastic::{self, ElasticConfig, ElasticError};
use chorus_runtime::store::{Store, StoreError};
use chorus_transports::auth::JobSecret;
use serde::Serialize;
use thiserror::Error;
use tokio::sync::Mutex;

use super::live::{self, FaultKind, FaultLogEntry, FaultRequest, LiveRecord};
use super::record::unix_us;

/// Generations read back from the newest.
const GENERATIONS: u64 = 32;
/// Processes' records read back from the newest slot.
const SLOTS: i64 = 256;

/// A process, as the elastic rendezvous recorded it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct Process {
    /// Its host name.
    pub host: String,
    /// Its process id.
    pub pid: u32,
}

/// One formed generation: its members by rank.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// Its number.
    pub generation: u64,
    /// Its members, indexed by rank.
    pub members: Vec<Process>,
}

/// Everything read from the store at one moment.
#[derive(Debug, Clone, Default)]
pub struct Observed {
    /// When, microseconds since the Unix epoch.
    pub now_us: i64,
    /// The run.
    pub run_id: String,
    /// The newest formed generations, ascending.
    pub generations: Vec<Generation>,
    /// Every process's live record.
    pub records: Vec<LiveRecord>,
    /// Processes whose exit a launcher published.
    pub exited: Vec<Process>,
    /// The fault log, oldest first.
    pub faults: Vec<FaultLogEntry>,
    /// Whether the members left on purpose (the job finished).
    pub finished: bool,
}

/// Why the store could not be read or written.
#[derive(Debug, Error)]
pub enum SourceError {
    /// The store failed.
    #[error("the job's store: {0}")]
    Store(#[from] StoreError),
    /// An elastic record could not be read.
    #[error("the job's generations: {0}")]
    Elastic(#[from] ElasticError),
    /// No process published yet, and no run id was given.
    #[error(
        "no run has published live progress to this store yet (pass --run-id, or wait for the job to start training)"
    )]
    NoRun,
}

/// A job's store, read for the page (generations, once closed, are
/// cached: they never change).
pub struct StoreSource {
    store: Arc<dyn Store>,
    run_id: Option<String>,
    closed: Mutex<BTreeMap<u64, Vec<Process>>>,
    faults: Mutex<Vec<FaultLogEntry>>,
}

impl StoreSource {
    /// Reads `run_id`'s job from `store` (the newest run that published,
    /// when `None`).
    pub fn new(store: Arc<dyn Store>, run_id: Option<String>) -> Self {
        Self {
            store,
            run_id,
            closed: Mutex::new(BTreeMap::new()),
            faults: Mutex::new(Vec::new()),
        }
    }

    async fn run_id(&self) -> Result<String, SourceError> {
        if let Some(run) = &self.run_id {
            return Ok(run.clone());
        }
        if !self.store.check(&[live::RUN_KEY]).await? {
            return Err(SourceError::NoRun);
        }
        Ok(String::from_utf8_lossy(&self.store.get(live::RUN_KEY).await?).into_owned())
    }

    async fn get_if(&self, key: &str) -> Result<Option<bytes::Bytes>, StoreError> {
        match self.store.check(&[key]).await? {
            true => self.store.get(key).await.map(Some),
            false => Ok(None),
        }
    }

    /// Everything the page shows, read now.
    pub async fn observe(&self) -> Result<Observed, SourceError> {
        let run_id = self.run_id().await?;
        let mut generations = Vec::new();
        if let Some(latest) = elastic::latest(&self.store, &run_id).await? {
            let mut closed = self.closed.lock().await;
            for generation in latest.saturating_sub(GENERATIONS - 1)..=latest {
                if let Some(members) = closed.get(&generation) {
                    generations.push(Generation {
                        generation,
                        members: members.clone(),
                    });
                    continue;
                }
                let config = ElasticConfig {
                    run_id: run_id.clone(),
                    generation,
                    min_world: 1,
                    max_world: 1,
                    last_call: Duration::ZERO,
                    timeout: Duration::from_secs(2),
                    poll: Duration::from_millis(50),
                };
                if let Some(joiners) = elastic::closed_members(&self.store, &config).await? {
                    let members: Vec<Process> = joiners
                        .into_iter()
                        .map(|j| Process {
                            host: j.hostname,
                            pid: j.pid,
                        })
                        .collect();
                    closed.insert(generation, members.clone());
                    generations.push(Generation { generation, members });
                }
            }
        }
        let count = self.store.add(&live::count_key(&run_id), 0).await?;
        let mut records = Vec::new();
        for slot in (count - SLOTS).max(0)..count {
            if let Some(bytes) = self.get_if(&live::record_key(&run_id, slot as u64)).await?
                && let Ok(record) = serde_json::from_slice::<LiveRecord>(&bytes)
            {
                records.push(record);
            }
        }
        let mut known: HashSet<Process> = generations.iter().flat_map(|g| g.members.iter().cloned()).collect();
        known.extend(records.iter().map(|r| Process {
            host: r.host.clone(),
            pid: r.pid,
        }));
        let mut exited = Vec::new();
        for p in known {
            if elastic::has_exited(&*self.store, &run_id, &p.host, p.pid).await? {
                exited.push(p);
            }
        }
        let faults = self.fault_log(&run_id).await?;
        Ok(Observed {
            now_us: unix_us(),
            finished: elastic::is_finished(&*self.store, &run_id).await?,
            run_id,
            generations,
            records,
            exited,
            faults,
        })
    }

    async fn fault_log(&self, run_id: &str) -> Result<Vec<FaultLogEntry>, SourceError> {
        let mut log = self.faults.lock().await;
        let count = self.store.add(&live::fault_log_count_key(run_id), 0).await?.max(0) as usize;
        for index in log.len()..count {
            // An index taken and not yet written is read next time.
            let Some(bytes) = self.get_if(&live::fault_log_key(run_id, index as u64)).await? else {
                break;
            };
            match serde_json::from_slice(&bytes) {
                Ok(entry) => log.push(entry),
                Err(_) => break,
            }
        }
        Ok(log.clone())
    }

    /// Asks `record`'s process, rank `rank` of `generation`, for `kind`,
    /// signed with `secret`, and logs it.
    pub async fn request_fault(
        &self,
        secret: &JobSecret,
        record: &LiveRecord,
        rank: usize,
        generation: u64,
        kind: FaultKind,
        who: &str,
    ) -> Result<(), SourceError> {
        let run_id = self.run_id().await?;
        let at_us = unix_us();
        let request = FaultRequest::signed(
            secret,
            &run_id,
            record.slot,
            at_us as u64,
            record.pid,
            kind,
            who.to_string(),
        );
        let entry = FaultLogEntry {
            at_us,
            kind,
            rank,
            generation,
            pid: record.pid,
            host: record.host.clone(),
            who: who.to_string(),
        };
        // Logged first: the fault must not show up unexplained on the timeline.
        let index = self.store.add(&live::fault_log_count_key(&run_id), 1).await? - 1;
        self.store
            .set(
                &live::fault_log_key(&run_id, index.max(0) as u64),
                &serde_json::to_vec(&entry).expect("an entry serializes"),
            )
            .await?;
        self.store
            .set(
                &live::fault_key(&run_id, record.slot),
                &serde_json::to_vec(&request).expect("a request serializes"),
            )
            .await?;
        Ok(())
    }
}
