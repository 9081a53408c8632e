//! Elastic rendezvous: who forms generation g+1 after generation g failed.
//!
//! Like torchelastic's c10d rendezvous, on the job's store, under
//! `chorus/<run id>/g<generation>/elastic/` (so generations never mix, and
//! the peer exchange of [`rendezvous`](super::rendezvous) for the same
//! generation, under `.../g<generation>/peer/...`, never sees these keys):
//! - `count`: `add(1)` by each participant; the result is its arrival index;
//! - `joiner/<index>`: its [`Joiner`] record (old rank, host, pid, nonce);
//! - `newcomers`: `add(1)` by each participant without an old rank, which
//!   running groups poll to admit it (`newcomers`);
//! - `closed`: compare-set once with the number admitted; the first writer
//!   wins, so every participant reads the same membership.
//!
//! The decisions are pure functions ([`decide`], [`assign_ranks`], over
//! the rules every round that re-forms shares: [`super::membership`]) fed
//! with store reads and the time waited; [`join`] is the thin IO loop.
//! - The generation closes as soon as `max_world` joined; or as soon as at
//!   least `min_world` joined and every member of the previous generation
//!   is accounted for (it joined, or a participant saw it fail), so
//!   survivors of a known failure do not wait for ranks that are gone; or
//!   once at least `min_world` joined and the last-call window has passed
//!   since this participant saw `min_world` reached (whoever's rule fires
//!   first closes it, with the count it reads then).
//! - Arrivals past the admitted count are late: [`ElasticError::Late`], and
//!   they try the next generation.
//! - Ranks are dense and stable: survivors keep their relative order by old
//!   rank, joiners follow in arrival order.
//! - Fewer than `min_world` within the timeout is an error naming who came.
//! - A group never forks (SV-16): generation g closes only with a quorum of
//!   the newest generation that closed before it (its *reference*, read from
//!   the store, the one place every participant agrees on): more than half
//!   of the reference's members, or every member of it that is still alive,
//!   the others seen to fail by a member who joined or their exit published
//!   in the store by their launcher ([`publish_exit`]). A participant that
//!   is not a member of the reference counts as a newcomer, so a running
//!   group admits it (SV-13) instead of it forming a second job. Without a
//!   quorum within the timeout the participant fails naming who is missing.
//!
//! [`LATEST_KEY`] holds the newest formed generation, so a process that
//! starts late (a relaunched worker, a new node) knows which one to join.

use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;

use super::membership::{self, Claim};
use crate::store::{PrefixStore, Store, StoreError};
use crate::wait::{self, Notes};

/// Key (under `chorus/<run id>/`) holding the newest formed generation, in decimal.
pub const LATEST_KEY: &str = "elastic/latest";

/// One participant of an elastic generation, as it announced itself.
#[derive(Debug, Clone, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct Joiner {
    /// Its rank in the previous generation (`None` for a new process).
    pub old_rank: Option<u32>,
    /// The generation `old_rank` and `previous_world` refer to: the last
    /// one it was admitted to (`None` for a new process and for the first
    /// generation a process joins).
    pub previous_generation: Option<u64>,
    /// Its host name, for messages.
    pub hostname: String,
    /// Its process id, for messages.
    pub pid: u32,
    /// Tells two participants of one process apart (ranks in one process).
    pub nonce: u64,
    /// The world size of the generation it comes from (`None` for a new process).
    pub previous_world: Option<u32>,
    /// Ranks of that generation it saw fail (empty when it knows of none).
    pub failed: Vec<u32>,
}

impl std::fmt::Display for Joiner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.old_rank {
            Some(rank) => write!(f, "old rank {rank} (pid {} on {})", self.pid, self.hostname),
            None => write!(f, "a new process (pid {} on {})", self.pid, self.hostname),
        }
    }
}

/// The bounds and timing of one elastic rendezvous.
#[derive(Debug, Clone)]
pub struct ElasticConfig {
    /// Names the job in the store.
    pub run_id: String,
    /// The generation being formed.
    pub generation: u64,
    /// Fewest members the generation may close with.
    pub min_world: usize,
    /// Most members; the generation closes at once when they joined.
    pub max_world: usize,
    /// How long to wait for more once `min_world` joined.
    pub last_call: Duration,
    /// Limit on the whole rendezvous.
    pub timeout: Duration,
    /// Interval between store reads while waiting.
    pub poll: Duration,
}

/// Why an elastic rendezvous failed.
#[derive(Debug, Error)]
pub enum ElasticError {
    /// `min_world` or `max_world` make no sense.
    #[error("elastic bounds min_world={min_world}, max_world={max_world}: need 1 <= min_world <= max_world")]
    BadBounds {
        /// The lower bound given.
        min_world: usize,
        /// The upper bound given.
        max_world: usize,
    },
    /// Fewer than `min_world` participants came in time.
    #[error("generation {generation} could not form: {} of min_world {min_world} joined within {waited:?}: [{}]", came.len(), came.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "))]
    TooFew {
        /// The generation.
        generation: u64,
        /// The lower bound.
        min_world: usize,
        /// Who came, in arrival order.
        came: Vec<Joiner>,
        /// How long this participant waited.
        waited: Duration,
    },
    /// The job's members left on purpose (it finished) before this
    /// participant could join: there is nothing left to join.
    #[error("run {run_id:?} finished (its members left on purpose) before this process could join it")]
    Finished {
        /// The run.
        run_id: String,
    },
    /// The generation closed before this participant arrived.
    #[error(
        "generation {generation} closed with {admitted} members before this process (arrival {arrival}) joined; it waits for the next one"
    )]
    Late {
        /// The generation.
        generation: u64,
        /// How many were admitted.
        admitted: usize,
        /// This participant's arrival index.
        arrival: usize,
    },
    /// The participants hold no quorum of the reference generation (SV-16).
    #[error(
        "generation {generation} could not form within {waited:?}: it needs more than half of generation {reference}'s {reference_world} members, or all of them still alive, and {} of them joined; not joined, not seen to fail and no exit published: [{}]; a process that is not a member joins the running group as a newcomer",
        joined_members,
        missing.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
    )]
    NoQuorum {
        /// The generation.
        generation: u64,
        /// The newest generation that closed before it.
        reference: u64,
        /// How many members the reference had.
        reference_world: usize,
        /// How many of them joined.
        joined_members: usize,
        /// The reference's members unaccounted for.
        missing: Vec<Joiner>,
        /// How long this participant waited.
        waited: Duration,
    },
    /// A stored record does not decode.
    #[error("generation {generation}: unreadable elastic record {key} ({reason}); is another chorus version running?")]
    BadRecord {
        /// The generation.
        generation: u64,
        /// The key.
        key: String,
        /// Why.
        reason: String,
    },
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// What a participant does next, given what it read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Close the generation with this many members.
    Close(usize),
    /// Read again later.
    Wait,
    /// Give up: fewer than `min_world` came in time.
    TooFew,
    /// Give up: no quorum of the reference generation came in time (SV-16).
    NoQuorum,
}

/// The closing rule. `joined`: arrivals so far; `accounted`: whether
/// [`accounted_for`] holds for them; `quorate`: whether they hold a quorum
/// of the reference generation ([`Reference::quorate`]); `since_min`: how
/// long ago this participant first saw `min_world` arrivals (`None`: not
/// yet); `waited`: time since it joined.
pub fn decide(
    config: &ElasticConfig,
    joined: usize,
    accounted: bool,
    quorate: bool,
    since_min: Option<Duration>,
    waited: Duration,
) -> Step {
    if joined < config.min_world && waited >= config.timeout {
        return Step::TooFew;
    }
    if !quorate {
        return if waited >= config.timeout {
            Step::NoQuorum
        } else {
            Step::Wait
        };
    }
    let bounds = (config.min_world, config.max_world);
    match membership::closes_with(joined, bounds, accounted, since_min, config.last_call) {
        Some(n) => Step::Close(n),
        None => Step::Wait,
    }
}

/// The newest generation that closed before the one being formed, with its
/// members by rank: the generation a new one must hold a quorum of (SV-16).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    /// Its number.
    pub generation: u64,
    /// Its members, indexed by their rank in it.
    pub members: Vec<Joiner>,
}

impl Reference {
    /// Whether `joiner` was admitted to this generation.
    pub fn is_member(&self, joiner: &Joiner) -> bool {
        joiner.previous_generation == Some(self.generation)
    }

    /// Ranks of this generation that did not join among `joined` and that
    /// no joining member saw fail: the ones a quorum waits for, unless a
    /// majority joined or their exits are published.
    pub fn unaccounted(&self, joined: &[Joiner]) -> Vec<usize> {
        let members: Vec<&Joiner> = joined.iter().filter(|j| self.is_member(j)).collect();
        let failed = credible_failures(&members);
        (0..self.members.len() as u32)
            .filter(|rank| !members.iter().any(|m| m.old_rank == Some(*rank)) && !failed.contains(rank))
            .map(|rank| rank as usize)
            .collect()
    }

    /// Whether `joined` may form the next generation without forking the
    /// group: more than half of this generation's members joined, or every
    /// member that did not is accounted for (seen to fail by a member who
    /// joined, or its rank is in `exited`: its exit was published).
    pub fn quorate(&self, joined: &[Joiner], exited: &[usize]) -> bool {
        let members = joined.iter().filter(|j| self.is_member(j)).count();
        members * 2 > self.members.len() || self.unaccounted(joined).iter().all(|rank| exited.contains(rank))
    }
}

/// The ranks `members` (of one generation) saw fail, taking the word only
/// of members no other one saw fail: a process cut off from the rest (its
/// own links cut, a partition on its side) sees every peer go, and its
/// word would close the next generation without a healthy rank that is
/// merely a moment late.
fn credible_failures(members: &[&Joiner]) -> Vec<u32> {
    let seen_failing = |j: &Joiner| {
        j.old_rank
            .is_some_and(|rank| members.iter().any(|m| m.failed.contains(&rank)))
    };
    members
        .iter()
        .filter(|m| !seen_failing(m))
        .flat_map(|m| m.failed.iter().copied())
        .collect()
}

/// The members among `members` that come from the newest generation any
/// of them comes from: an old rank of an older one names another process.
fn from_newest(members: &[Joiner]) -> Vec<&Joiner> {
    let survivors = || members.iter().filter(|m| m.old_rank.is_some());
    let Some(newest) = survivors().map(|m| m.previous_generation).max() else {
        return Vec::new();
    };
    survivors().filter(|m| m.previous_generation == newest).collect()
}

/// Whether every rank of the previous generation is accounted for among
/// `members`: it joined, or one of them that no other saw fail saw it
/// fail. The previous generation is the newest any of them comes from;
/// false when none comes from one (there is nobody to account for, and
/// the last call decides).
pub fn accounted_for(members: &[Joiner]) -> bool {
    let from_it = from_newest(members);
    let Some(previous_world) = from_it.iter().filter_map(|m| m.previous_world).max() else {
        return false;
    };
    let failed = credible_failures(&from_it);
    (0..previous_world).all(|rank| from_it.iter().any(|m| m.old_rank == Some(rank)) || failed.contains(&rank))
}

/// New dense ranks for the admitted participants, given in arrival order:
/// `result[i]` is the new rank of `members[i]`. Survivors (with an old rank
/// in the newest generation any comes from) come first, by old rank; new
/// processes, and those of an older generation, follow in arrival order
/// ([`membership::places`]).
pub fn assign_ranks(members: &[Joiner]) -> Vec<usize> {
    let newest = from_newest(members).first().map(|m| m.previous_generation);
    let claims: Vec<Claim> = members
        .iter()
        .map(|m| Claim {
            fixed: None,
            previous: m
                .old_rank
                .filter(|_| Some(m.previous_generation) == newest)
                .map(|r| r as usize),
        })
        .collect();
    let mut ranks = vec![0; members.len()];
    for (new_rank, i) in membership::places(&claims, members.len()).into_iter().enumerate() {
        ranks[i] = new_rank;
    }
    ranks
}

/// The outcome: this participant's place in the new generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admission {
    /// The generation formed.
    pub generation: u64,
    /// This participant's new rank.
    pub rank: usize,
    /// Every member, indexed by new rank.
    pub members: Vec<Joiner>,
}

impl Admission {
    /// How many members.
    pub fn world_size(&self) -> usize {
        self.members.len()
    }
}

fn scoped(store: Arc<dyn Store>, config: &ElasticConfig) -> PrefixStore {
    PrefixStore::new(
        format!("chorus/{}/g{}/elastic", config.run_id, config.generation),
        store,
    )
}

/// How many new processes (no old rank: a relaunched worker, a new node)
/// have announced themselves for `config.generation`; a running group polls
/// this to learn that someone waits to join. Survivors of a failure that
/// already joined do not count.
pub async fn newcomers(store: Arc<dyn Store>, config: &ElasticConfig) -> Result<usize, StoreError> {
    let scoped = scoped(store, config);
    if !scoped.check(&["newcomers"]).await? {
        return Ok(0);
    }
    Ok(scoped.add("newcomers", 0).await?.max(0) as usize)
}

/// How many have joined `config.generation` while it forms (a group
/// re-forming after a failure, or a joiner waiting): 0 when nobody has yet,
/// or when it closed.
pub async fn forming(store: Arc<dyn Store>, config: &ElasticConfig) -> Result<usize, StoreError> {
    let scoped = scoped(store, config);
    if !scoped.check(&["count"]).await? || scoped.check(&["closed"]).await? {
        return Ok(0);
    }
    Ok(scoped.add("count", 0).await?.max(0) as usize)
}

/// The newest formed generation of `run_id`, if any formed through [`join`].
pub async fn latest(store: &Arc<dyn Store>, run_id: &str) -> Result<Option<u64>, StoreError> {
    let key = format!("chorus/{run_id}/{LATEST_KEY}");
    if !store.check(&[&key]).await? {
        return Ok(None);
    }
    let value = store.get(&key).await?;
    Ok(String::from_utf8_lossy(&value).trim().parse().ok())
}

/// Records `generation` as the newest formed one (every member calls it
/// after forming; they all write the same value).
pub async fn publish_latest(store: &Arc<dyn Store>, run_id: &str, generation: u64) -> Result<(), StoreError> {
    store
        .set(
            &format!("chorus/{run_id}/{LATEST_KEY}"),
            generation.to_string().as_bytes(),
        )
        .await
}

fn finished_key(run_id: &str) -> String {
    format!("chorus/{run_id}/finished")
}

/// Records that the job's members left on purpose: a process still waiting
/// to join (a relaunched worker that came too late) stops waiting with
/// [`ElasticError::Finished`].
pub async fn publish_finished(store: &dyn Store, run_id: &str) -> Result<(), StoreError> {
    store.set(&finished_key(run_id), b"1").await
}

/// Whether `run_id`'s members left on purpose ([`publish_finished`]).
pub async fn is_finished(store: &dyn Store, run_id: &str) -> Result<bool, StoreError> {
    store.check(&[&finished_key(run_id)]).await
}

/// The key a launcher sets when a worker process of `run_id` exits.
fn exit_key(run_id: &str, hostname: &str, pid: u32) -> String {
    format!("chorus/{run_id}/exited/{hostname}/{pid}")
}

/// Counts the exits published for `run_id`: a rank polls this one key and
/// looks at its peers' exit keys only when it moved.
fn exit_count_key(run_id: &str) -> String {
    format!("chorus/{run_id}/exits")
}

/// What a launcher knows of a worker's exit.
#[derive(Debug, Clone, Default, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct Exit {
    /// The processes (host name, pid) the worker blamed for its group's
    /// abort before it exited (its error file names them): it exited
    /// because of them, and a peer blames them, not it. Empty when it
    /// named none: it failed itself, as far as anyone knows.
    pub blamed: Vec<(String, u32)>,
}

/// Publishes that process `pid` on `hostname`, a worker of `run_id`, has
/// exited: its launcher saw it, so an elastic rendezvous need not wait for
/// it (SV-16), and ranks on other hosts fail it at once instead of waiting
/// out the heartbeat window (or, when it exited after blaming others,
/// blame those: [`exit_of`]).
pub async fn publish_exit(
    store: &dyn Store,
    run_id: &str,
    hostname: &str,
    pid: u32,
    exit: &Exit,
) -> Result<(), StoreError> {
    store
        .set(&exit_key(run_id, hostname, pid), &crate::codec::encode(exit))
        .await?;
    store.add(&exit_count_key(run_id), 1).await.map(drop)
}

/// What was published of process `pid`'s exit on `hostname`, if it
/// exited ([`publish_exit`]). A record that does not decode is an exit
/// that blamed no one: the exit itself is what counts.
pub async fn exit_of(store: &dyn Store, run_id: &str, hostname: &str, pid: u32) -> Result<Option<Exit>, StoreError> {
    let key = exit_key(run_id, hostname, pid);
    if !store.check(&[&key]).await? {
        return Ok(None);
    }
    let record = store.get(&key).await?;
    Ok(Some(crate::codec::decode(&record).unwrap_or_default()))
}

/// How many exits were published for `run_id` ([`publish_exit`]).
pub async fn exit_count(store: &dyn Store, run_id: &str) -> Result<i64, StoreError> {
    store.add(&exit_count_key(run_id), 0).await
}

/// Whether [`publish_exit`] was called for process `pid` on `hostname`.
pub async fn has_exited(store: &dyn Store, run_id: &str, hostname: &str, pid: u32) -> Result<bool, StoreError> {
    store.check(&[&exit_key(run_id, hostname, pid)]).await
}

/// The newest generation below `config.generation` that closed, with its
/// members (SV-16); `None` when none did (the group's first generation).
pub async fn reference(store: &Arc<dyn Store>, config: &ElasticConfig) -> Result<Option<Reference>, ElasticError> {
    for generation in (0..config.generation).rev() {
        let earlier = ElasticConfig {
            generation,
            ..config.clone()
        };
        if let Some(members) = closed_members(store, &earlier).await? {
            return Ok(Some(Reference { generation, members }));
        }
    }
    Ok(None)
}

/// The members of `config.generation`, indexed by rank, once it closed;
/// `None` while it has not. For watching a job (a dashboard) as well as
/// for [`reference()`].
pub async fn closed_members(
    store: &Arc<dyn Store>,
    config: &ElasticConfig,
) -> Result<Option<Vec<Joiner>>, ElasticError> {
    let scoped = scoped(store.clone(), config);
    if !scoped.check(&["closed"]).await? {
        return Ok(None);
    }
    let admitted = parse_count(&scoped.get("closed").await?, config)?;
    let arrivals = read_members(&scoped, config, admitted).await?;
    let ranks = assign_ranks(&arrivals);
    let mut members: Vec<(usize, Joiner)> = ranks.into_iter().zip(arrivals).collect();
    members.sort_by_key(|(rank, _)| *rank);
    Ok(Some(members.into_iter().map(|(_, m)| m).collect()))
}

async fn read_members(scoped: &PrefixStore, config: &ElasticConfig, count: usize) -> Result<Vec<Joiner>, ElasticError> {
    let keys: Vec<String> = (0..count).map(|i| format!("joiner/{i}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    // A participant sets its record right after taking its index: it is due.
    scoped.wait_timeout(&refs, config.timeout).await?;
    let values = scoped.multi_get(&refs).await?;
    values
        .iter()
        .zip(&keys)
        .map(|(bytes, key)| {
            crate::codec::decode(bytes).map_err(|e| ElasticError::BadRecord {
                generation: config.generation,
                key: key.clone(),
                reason: e.to_string(),
            })
        })
        .collect()
}

/// Announces `me` for `config.generation` and waits until the generation
/// closes; returns this participant's place, or why it has none.
pub async fn join(store: Arc<dyn Store>, config: &ElasticConfig, me: Joiner) -> Result<Admission, ElasticError> {
    if config.min_world == 0 || config.min_world > config.max_world {
        return Err(ElasticError::BadBounds {
            min_world: config.min_world,
            max_world: config.max_world,
        });
    }
    let reference = reference(&store, config).await?;
    let scoped = scoped(store.clone(), config);
    let arrival = (scoped.add("count", 1).await? - 1) as usize;
    scoped
        .set(&format!("joiner/{arrival}"), &crate::codec::encode(&me))
        .await?;
    // Not a member of the generation this one grows from: a running group
    // must admit it (SV-13), whatever rank it held in an older one.
    let newcomer = match &reference {
        Some(reference) => !reference.is_member(&me),
        None => me.old_rank.is_none(),
    };
    if newcomer {
        scoped.add("newcomers", 1).await?;
    }
    let admitted = Waiting::new(store.as_ref(), &scoped, config, reference)
        .until_closed()
        .await?;
    if arrival >= admitted {
        return Err(ElasticError::Late {
            generation: config.generation,
            admitted,
            arrival,
        });
    }
    let members = read_members(&scoped, config, admitted).await?;
    let ranks = assign_ranks(&members);
    let mut ordered: Vec<(usize, Joiner)> = ranks.iter().copied().zip(members).collect();
    ordered.sort_by_key(|(rank, _)| *rank);
    Ok(Admission {
        generation: config.generation,
        rank: ranks[arrival],
        members: ordered.into_iter().map(|(_, m)| m).collect(),
    })
}

/// A participant waiting for its generation to close, and what it has
/// seen of the others so far.
struct Waiting<'a> {
    store: &'a dyn Store,
    scoped: &'a PrefixStore,
    config: &'a ElasticConfig,
    /// The generation this one grows from, if any.
    reference: Option<Reference>,
    started: tokio::time::Instant,
    notes: Notes,
    /// When `min_world` participants had joined.
    min_seen: Option<tokio::time::Instant>,
    /// The arrivals read so far, and whether they account for the previous generation.
    members: Vec<Joiner>,
    accounted: bool,
    quorate: bool,
}

impl<'a> Waiting<'a> {
    fn new(
        store: &'a dyn Store,
        scoped: &'a PrefixStore,
        config: &'a ElasticConfig,
        reference: Option<Reference>,
    ) -> Self {
        Self {
            store,
            scoped,
            config,
            started: tokio::time::Instant::now(),
            notes: Notes::new(config.timeout),
            min_seen: None,
            members: Vec::new(),
            accounted: false,
            quorate: reference.is_none(),
            reference,
        }
    }

    /// Polls until the generation closes, closing it when [`decide`] says
    /// so; returns how many it admitted.
    async fn until_closed(mut self) -> Result<usize, ElasticError> {
        let config = self.config;
        loop {
            if self.store.check(&[&finished_key(&config.run_id)]).await? {
                return Err(ElasticError::Finished {
                    run_id: config.run_id.clone(),
                });
            }
            if self.scoped.check(&["closed"]).await? {
                let value = self.scoped.get("closed").await?;
                return parse_count(&value, config);
            }
            let joined = self.look().await?;
            match decide(
                config,
                joined,
                self.accounted,
                self.quorate,
                self.min_seen.map(|t| t.elapsed()),
                self.started.elapsed(),
            ) {
                Step::Close(n) => {
                    let agreed = self.scoped.compare_set("closed", b"", n.to_string().as_bytes()).await?;
                    return parse_count(&agreed, config);
                }
                Step::TooFew => {
                    return Err(ElasticError::TooFew {
                        generation: config.generation,
                        min_world: config.min_world,
                        came: read_members(self.scoped, config, joined).await?,
                        waited: self.started.elapsed(),
                    });
                }
                Step::NoQuorum => return Err(self.no_quorum()),
                Step::Wait => {
                    if self.notes.due() {
                        self.note_waiting(joined);
                    }
                    tokio::time::sleep(config.poll).await
                }
            }
        }
    }

    /// Reads how many joined, and once they are enough, who they are and
    /// whether they account for the reference; returns how many joined.
    async fn look(&mut self) -> Result<usize, ElasticError> {
        let config = self.config;
        let joined = self.scoped.add("count", 0).await?.max(0) as usize;
        if joined >= config.min_world && self.min_seen.is_none() {
            self.min_seen = Some(tokio::time::Instant::now());
        }
        let counted = joined.min(config.max_world);
        if joined >= config.min_world && self.members.len() != counted {
            self.members = read_members(self.scoped, config, counted).await?;
            self.accounted = accounted_for(&self.members);
        }
        if let (Some(reference), false, true) = (
            &self.reference,
            self.quorate && self.accounted,
            joined >= config.min_world,
        ) {
            let mut exited = Vec::new();
            let unaccounted = reference.unaccounted(&self.members);
            for &rank in &unaccounted {
                let member = &reference.members[rank];
                if has_exited(self.store, &config.run_id, &member.hostname, member.pid).await? {
                    exited.push(rank);
                }
            }
            self.quorate = reference.quorate(&self.members, &exited);
            // A published exit accounts for its member as a seen failure does.
            self.accounted |= exited.len() == unaccounted.len();
        }
        Ok(joined)
    }

    /// Why the generation cannot form: too few of the reference's members.
    fn no_quorum(self) -> ElasticError {
        let reference = self.reference.expect("only a reference can lack a quorum");
        ElasticError::NoQuorum {
            generation: self.config.generation,
            reference: reference.generation,
            reference_world: reference.members.len(),
            joined_members: self.members.iter().filter(|m| reference.is_member(m)).count(),
            missing: reference
                .unaccounted(&self.members)
                .into_iter()
                .map(|rank| reference.members[rank].clone())
                .collect(),
            waited: self.started.elapsed(),
        }
    }

    /// Says whom the generation waits for, `joined` having joined.
    fn note_waiting(&self, joined: usize) {
        let config = self.config;
        let missing = match &self.reference {
            Some(reference) if joined >= config.min_world => {
                Some((reference.generation, reference.unaccounted(&self.members)))
            }
            _ => None,
        };
        let waiting_for = match missing {
            Some((previous, missing)) if !missing.is_empty() => format!(
                "{joined} joined; waiting for ranks {} of generation {previous} to rejoin or be known failed",
                wait::rank_list(&missing),
            ),
            _ => format!(
                "{} joined, {}..{} may form it",
                joined, config.min_world, config.max_world
            ),
        };
        tracing::info!(
            target: wait::TARGET,
            "waiting for ranks to form generation {} at {}: {waiting_for}; {}",
            config.generation,
            self.store.location(),
            self.notes.progress()
        );
    }
}

fn parse_count(value: &[u8], config: &ElasticConfig) -> Result<usize, ElasticError> {
    String::from_utf8_lossy(value)
        .trim()
        .parse()
        .map_err(|_| ElasticError::BadRecord {
            generation: config.generation,
            key: "closed".into(),
            reason: format!("{:?} is not a count", String::from_utf8_lossy(value)),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::HashStore;

    fn config(min_world: usize, max_world: usize) -> ElasticConfig {
        ElasticConfig {
            run_id: "t".into(),
            generation: 1,
            min_world,
            max_world,
            last_call: Duration::from_millis(200),
            timeout: Duration::from_secs(2),
            poll: Duration::from_millis(5),
        }
    }

    fn joiner(old_rank: Option<u32>, pid: u32) -> Joiner {
        Joiner {
            old_rank,
            previous_generation: None,
            hostname: "h".into(),
            pid,
            nonce: pid as u64,
            previous_world: None,
            failed: Vec::new(),
        }
    }

    /// A survivor of a generation of `world` ranks that saw `failed` fail.
    fn survivor(old_rank: u32, world: u32, failed: &[u32]) -> Joiner {
        Joiner {
            previous_world: Some(world),
            failed: failed.to_vec(),
            ..joiner(Some(old_rank), old_rank)
        }
    }

    #[test]
    fn sv11_the_closing_rule() {
        let c = config(2, 4);
        let ms = Duration::from_millis;
        assert_eq!(decide(&c, 4, false, true, None, ms(0)), Step::Close(4));
        assert_eq!(
            decide(&c, 5, false, true, Some(ms(0)), ms(0)),
            Step::Close(4),
            "arrivals past max_world are late"
        );
        assert_eq!(
            decide(&c, 3, false, true, Some(ms(100)), ms(100)),
            Step::Wait,
            "last call still open"
        );
        assert_eq!(
            decide(&c, 3, true, true, Some(ms(0)), ms(0)),
            Step::Close(3),
            "everyone accounted for: no last call"
        );
        assert_eq!(
            decide(&c, 1, true, true, None, ms(0)),
            Step::Wait,
            "accounted but below min_world"
        );
        assert_eq!(decide(&c, 3, false, true, Some(ms(200)), ms(300)), Step::Close(3));
        assert_eq!(decide(&c, 1, false, true, None, ms(1999)), Step::Wait);
        assert_eq!(decide(&c, 1, false, true, None, ms(2000)), Step::TooFew);
        assert_eq!(
            decide(&c, 4, true, false, Some(ms(0)), ms(0)),
            Step::Wait,
            "no quorum: not even max_world closes"
        );
        assert_eq!(decide(&c, 3, true, false, Some(ms(0)), ms(2000)), Step::NoQuorum);
    }

    /// Old rank `rank` of generation `generation` (of `world` ranks), which saw `failed` fail.
    fn member(generation: u64, rank: u32, world: u32, failed: &[u32]) -> Joiner {
        Joiner {
            previous_generation: Some(generation),
            nonce: 100 + rank as u64,
            ..survivor(rank, world, failed)
        }
    }

    fn reference(generation: u64, world: u32) -> Reference {
        Reference {
            generation,
            members: (0..world)
                .map(|r| member(generation.saturating_sub(1), r, world, &[]))
                .collect(),
        }
    }

    #[test]
    fn sv16_a_quorum_is_a_majority_or_every_member_still_alive() {
        let g1 = reference(1, 4);
        // Two of four, the third of their host dead, the fourth unaccounted: no quorum.
        let half = [member(1, 0, 4, &[3]), member(1, 1, 4, &[3])];
        assert!(!g1.quorate(&half, &[]));
        assert_eq!(g1.unaccounted(&half), vec![2]);
        // Rank 2's launcher published its exit: every member still alive joined.
        assert!(g1.quorate(&half, &[2]));
        // Three of four: a majority.
        assert!(g1.quorate(&[half[0].clone(), half[1].clone(), member(1, 2, 4, &[])], &[]));
        // Members of an older generation are not members of the reference:
        // they are newcomers, and hold no quorum however many they are.
        let older = [member(0, 2, 4, &[0, 1]), member(0, 3, 4, &[0, 1])];
        assert!(!g1.quorate(&older, &[]));
        assert!(!g1.is_member(&older[0]) && g1.is_member(&half[0]));
        // Every member exited: newcomers may start afresh.
        assert!(g1.quorate(&[joiner(None, 9)], &[0, 1, 2, 3]));
    }

    /// Closes generation `c.generation` with `members` in the store, as a
    /// finished elastic rendezvous leaves it.
    async fn closed(store: &HashStore, c: &ElasticConfig, members: &[Joiner]) {
        let store: Arc<dyn Store> = Arc::new(store.clone());
        let scoped = scoped(store, c);
        for (i, m) in members.iter().enumerate() {
            scoped.add("count", 1).await.unwrap();
            scoped
                .set(&format!("joiner/{i}"), &crate::codec::encode(m))
                .await
                .unwrap();
        }
        scoped
            .set("closed", members.len().to_string().as_bytes())
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn sv16_half_a_generation_waits_for_the_rest_instead_of_forking() {
        let store = HashStore::default();
        let mut c = config(2, 4);
        c.last_call = Duration::from_millis(50);
        c.generation = 1;
        closed(&store, &c, &reference(1, 4).members).await;
        c.generation = 2;
        // Ranks 0 and 1 (node 0) saw rank 3 die; rank 2 (node 1) comes later.
        let early = {
            let (store, c) = (Arc::new(store.clone()) as Arc<dyn Store>, c.clone());
            tokio::spawn(async move {
                let (a, b) = tokio::join!(
                    join(store.clone(), &c, member(1, 0, 4, &[3])),
                    join(store, &c, member(1, 1, 4, &[3]))
                );
                (a, b)
            })
        };
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(!early.is_finished(), "two of four closed a generation without rank 2");
        let last = join(Arc::new(store.clone()), &c, member(1, 2, 4, &[])).await.unwrap();
        let (a, b) = early.await.unwrap();
        assert_eq!(
            (a.unwrap().world_size(), b.unwrap().world_size(), last.world_size()),
            (3, 3, 3)
        );
        assert_eq!(last.rank, 2);
    }

    #[tokio::test]
    async fn sv16_stragglers_of_an_older_generation_are_newcomers_and_cannot_form_alone() {
        let store = HashStore::default();
        let mut c = config(2, 4);
        c.last_call = Duration::from_millis(50);
        c.timeout = Duration::from_millis(500);
        c.generation = 2;
        // Generation 2 formed with old ranks 0 and 1 of generation 1.
        closed(&store, &c, &[member(1, 0, 4, &[2, 3]), member(1, 1, 4, &[2, 3])]).await;
        c.generation = 3;
        let store: Arc<dyn Store> = Arc::new(store);
        let (a, b) = tokio::join!(
            join(store.clone(), &c, member(1, 2, 4, &[0, 1])),
            join(store.clone(), &c, member(1, 3, 4, &[0, 1]))
        );
        let text = a.unwrap_err().to_string();
        assert!(matches!(b, Err(ElasticError::NoQuorum { .. })), "{b:?}");
        assert!(
            text.contains("generation 2's 2 members") && text.contains("0 of them joined"),
            "{text}"
        );
        // The running generation 2 sees them waiting, and admits them (SV-13).
        assert_eq!(newcomers(store, &c).await.unwrap(), 2);
    }

    #[tokio::test]
    async fn sv16_a_published_exit_stands_for_the_dead_member() {
        let store = HashStore::default();
        let mut c = config(1, 2);
        c.last_call = Duration::from_secs(60);
        c.generation = 1;
        let g1 = reference(1, 2);
        closed(&store, &c, &g1.members).await;
        c.generation = 2;
        let store: Arc<dyn Store> = Arc::new(store);
        // Rank 0 alone is half of two, and saw nothing fail: it waits ...
        let alone = tokio::spawn({
            let (store, c) = (store.clone(), c.clone());
            async move { join(store, &c, member(1, 0, 2, &[])).await }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!alone.is_finished());
        // ... until rank 1's launcher publishes its exit.
        publish_exit(
            store.as_ref(),
            &c.run_id,
            &g1.members[1].hostname,
            g1.members[1].pid,
            &Exit::default(),
        )
        .await
        .unwrap();
        let admitted = within(alone).await;
        assert_eq!(admitted.unwrap().world_size(), 1);
    }

    #[tokio::test]
    async fn an_exit_says_whom_the_worker_blamed_and_a_bad_record_blames_no_one() {
        let store = HashStore::default();
        assert_eq!(exit_of(&store, "run", "h1", 7).await.unwrap(), None);
        let exit = Exit {
            blamed: vec![("h2".into(), 8), ("h3".into(), 9)],
        };
        publish_exit(&store, "run", "h1", 7, &exit).await.unwrap();
        assert_eq!(exit_of(&store, "run", "h1", 7).await.unwrap(), Some(exit));
        assert!(has_exited(&store, "run", "h1", 7).await.unwrap());
        assert_eq!(exit_count(&store, "run").await.unwrap(), 1);
        store.set(&exit_key("run", "h4", 1), b"1").await.unwrap();
        assert_eq!(exit_of(&store, "run", "h4", 1).await.unwrap(), Some(Exit::default()));
    }

    async fn within<T>(task: tokio::task::JoinHandle<T>) -> T {
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("the rendezvous did not finish within 5 s")
            .unwrap()
    }

    #[test]
    fn sv11_survivors_account_for_the_previous_generation() {
        // Generation of 4, rank 2 died: the three survivors account for it.
        let all = [survivor(0, 4, &[2]), survivor(1, 4, &[2]), survivor(3, 4, &[])];
        assert!(accounted_for(&all));
        // Rank 3 has not come and nobody saw it fail: wait for it.
        assert!(!accounted_for(&all[..2]));
        // Anyone's word suffices; a new process adds no knowledge.
        assert!(accounted_for(&[survivor(0, 2, &[1])]));
        assert!(!accounted_for(&[joiner(None, 9)]));
        assert!(!accounted_for(&[]));
    }

    #[test]
    fn a_member_others_saw_fail_cannot_account_for_a_healthy_late_rank() {
        // Rank 3 cut its own links: it saw rank 0 go, the others saw it go.
        // Rank 0 is alive and a moment late: wait for it.
        let cut = [member(0, 1, 4, &[3]), member(0, 2, 4, &[3]), member(0, 3, 4, &[0])];
        assert!(!accounted_for(&cut));
        let g0 = reference(0, 4);
        assert_eq!(g0.unaccounted(&cut), vec![0]);
        let all = [cut.as_slice(), &[member(0, 0, 4, &[3])]].concat();
        assert!(accounted_for(&all) && g0.unaccounted(&all).is_empty());
        // A killed rank: the survivors, whom nobody saw fail, account for it.
        let killed = [member(0, 0, 4, &[3]), member(0, 1, 4, &[3]), member(0, 2, 4, &[3])];
        assert!(accounted_for(&killed) && g0.unaccounted(&killed).is_empty());
    }

    #[test]
    fn an_old_rank_of_an_older_generation_names_another_process() {
        // Generation 1 (ranks 0..3) forms its successor beside it with a
        // process left out of it, whose old rank 0 is generation 0's: the
        // successor waits for generation 1's rank 0.
        let stale = member(0, 0, 4, &[3]);
        let arrivals = [stale.clone(), member(1, 1, 3, &[]), member(1, 2, 3, &[])];
        assert!(!accounted_for(&arrivals));
        let all = [arrivals.as_slice(), &[member(1, 0, 3, &[])]].concat();
        assert!(accounted_for(&all));
        // It is placed as a new process, after generation 1's members.
        assert_eq!(assign_ranks(&all), vec![3, 1, 2, 0]);
    }

    #[test]
    fn sv10_ranks_are_dense_and_stable() {
        // Arrival order: new A, old 3, old 0, new B, old 2.
        let members = [
            joiner(None, 10),
            joiner(Some(3), 3),
            joiner(Some(0), 0),
            joiner(None, 11),
            joiner(Some(2), 2),
        ];
        assert_eq!(assign_ranks(&members), vec![3, 2, 0, 4, 1]);
    }

    async fn run(store: &HashStore, c: &ElasticConfig, who: Vec<Joiner>) -> Vec<Result<Admission, ElasticError>> {
        let tasks: Vec<_> = who
            .into_iter()
            .map(|j| {
                let (store, c) = (Arc::new(store.clone()) as Arc<dyn Store>, c.clone());
                tokio::spawn(async move { join(store, &c, j).await })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    }

    #[tokio::test]
    async fn a_generation_is_forming_from_its_first_arrival_until_it_closes() {
        let store: Arc<dyn Store> = Arc::new(HashStore::default());
        let mut c = config(2, 2);
        c.last_call = Duration::from_secs(60);
        assert_eq!(forming(store.clone(), &c).await.unwrap(), 0, "nobody came yet");
        let first = tokio::spawn({
            let (store, c) = (store.clone(), c.clone());
            async move { join(store, &c, joiner(Some(0), 0)).await }
        });
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while forming(store.clone(), &c).await.unwrap() == 0 {
            assert!(tokio::time::Instant::now() < deadline, "the first arrival never showed");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let second = tokio::time::timeout(Duration::from_secs(5), join(store.clone(), &c, joiner(Some(1), 1))).await;
        assert_eq!(second.expect("closing hung").unwrap().world_size(), 2);
        first.await.unwrap().unwrap();
        assert_eq!(
            forming(store.clone(), &c).await.unwrap(),
            0,
            "closed: no longer forming"
        );
    }

    #[tokio::test]
    async fn sv11_closes_at_max_world_at_once_and_agrees_on_members() {
        let store = HashStore::default();
        let mut c = config(2, 3);
        c.last_call = Duration::from_secs(60);
        let started = std::time::Instant::now();
        let out = run(
            &store,
            &c,
            vec![joiner(Some(2), 2), joiner(Some(0), 0), joiner(None, 7)],
        )
        .await;
        assert!(started.elapsed() < Duration::from_secs(1));
        let admissions: Vec<Admission> = out.into_iter().map(Result::unwrap).collect();
        let mut ranks: Vec<usize> = admissions.iter().map(|a| a.rank).collect();
        ranks.sort_unstable();
        assert_eq!(ranks, vec![0, 1, 2]);
        let pids: Vec<u32> = admissions[0].members.iter().map(|m| m.pid).collect();
        assert_eq!(pids, vec![0, 2, 7]);
        assert!(admissions.iter().all(|a| a.members == admissions[0].members));
    }

    #[tokio::test]
    async fn sv11_closes_with_min_world_after_last_call_and_late_arrivals_wait() {
        let store = HashStore::default();
        let c = config(2, 4);
        let out = run(&store, &c, vec![joiner(Some(1), 1), joiner(Some(3), 3)]).await;
        assert!(
            out.iter().all(|a| a.as_ref().is_ok_and(|a| a.world_size() == 2)),
            "{out:?}"
        );
        let late = join(Arc::new(store.clone()), &c, joiner(None, 9)).await.unwrap_err();
        assert!(
            matches!(
                late,
                ElasticError::Late {
                    admitted: 2,
                    arrival: 2,
                    ..
                }
            ),
            "{late}"
        );
    }

    #[tokio::test]
    async fn sv11_survivors_of_a_known_failure_close_without_the_last_call() {
        let store = HashStore::default();
        let mut c = config(2, 4);
        c.last_call = Duration::from_secs(60);
        let started = std::time::Instant::now();
        let out = run(
            &store,
            &c,
            vec![survivor(3, 4, &[1]), survivor(0, 4, &[1]), survivor(2, 4, &[])],
        )
        .await;
        assert!(started.elapsed() < Duration::from_secs(5), "waited for the last call");
        let ranks: Vec<usize> = out.into_iter().map(|a| a.unwrap().rank).collect();
        assert_eq!(ranks, vec![2, 0, 1]);
    }

    #[tokio::test]
    async fn sv11_too_few_names_who_came() {
        let store = HashStore::default();
        let mut c = config(3, 3);
        c.timeout = Duration::from_millis(300);
        let err = join(Arc::new(store.clone()), &c, joiner(Some(1), 41))
            .await
            .unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, ElasticError::TooFew { .. }), "{text}");
        assert!(
            text.contains("1 of min_world 3") && text.contains("old rank 1 (pid 41"),
            "{text}"
        );
        let bad = join(Arc::new(store), &config(3, 2), joiner(None, 1)).await.unwrap_err();
        assert!(matches!(bad, ElasticError::BadBounds { .. }), "{bad}");
    }

    #[tokio::test]
    async fn latest_generation_round_trips() {
        let store: Arc<dyn Store> = Arc::new(HashStore::default());
        assert_eq!(latest(&store, "t").await.unwrap(), None);
        publish_latest(&store, "t", 3).await.unwrap();
        assert_eq!(latest(&store, "t").await.unwrap(), Some(3));
        assert_eq!(newcomers(store, &config(1, 2)).await.unwrap(), 0);
    }
}
