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
//! The decisions are pure functions ([`decide`], [`assign_ranks`]) fed
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
//!
//! [`LATEST_KEY`] holds the newest formed generation, so a process that
//! starts late (a relaunched worker, a new node) knows which one to join.

use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;

use crate::store::{PrefixStore, Store, StoreError};

/// Key (under `chorus/<run id>/`) holding the newest formed generation, in decimal.
pub const LATEST_KEY: &str = "elastic/latest";

/// One participant of an elastic generation, as it announced itself.
#[derive(Debug, Clone, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct Joiner {
    /// Its rank in the previous generation (`None` for a new process).
    pub old_rank: Option<u32>,
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
}

/// The closing rule. `joined`: arrivals so far; `accounted`: whether
/// [`accounted_for`] holds for them; `since_min`: how long ago this
/// participant first saw `min_world` arrivals (`None`: not yet); `waited`:
/// time since it joined.
pub fn decide(
    config: &ElasticConfig,
    joined: usize,
    accounted: bool,
    since_min: Option<Duration>,
    waited: Duration,
) -> Step {
    if joined >= config.max_world {
        return Step::Close(config.max_world);
    }
    if joined >= config.min_world && (accounted || since_min.is_some_and(|d| d >= config.last_call)) {
        return Step::Close(joined);
    }
    if joined < config.min_world && waited >= config.timeout {
        return Step::TooFew;
    }
    Step::Wait
}

/// Whether every rank of the previous generation is accounted for among
/// `members`: it joined, or one of them saw it fail. False when no member
/// comes from a previous generation (there is nobody to account for, and
/// the last call decides).
pub fn accounted_for(members: &[Joiner]) -> bool {
    let Some(previous_world) = members.iter().filter_map(|m| m.previous_world).max() else {
        return false;
    };
    (0..previous_world).all(|rank| {
        members
            .iter()
            .any(|m| m.old_rank == Some(rank) || m.failed.contains(&rank))
    })
}

/// New dense ranks for the admitted participants, given in arrival order:
/// `result[i]` is the new rank of `members[i]`. Survivors (with an old rank)
/// come first, by old rank; new processes follow in arrival order.
pub fn assign_ranks(members: &[Joiner]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..members.len()).collect();
    // Stable sort: equal keys (two new processes) keep their arrival order.
    order.sort_by_key(|&i| match members[i].old_rank {
        Some(rank) => (0, rank as usize),
        None => (1, 0),
    });
    let mut ranks = vec![0; members.len()];
    for (new_rank, &i) in order.iter().enumerate() {
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
    let scoped = scoped(store, config);
    let arrival = (scoped.add("count", 1).await? - 1) as usize;
    scoped
        .set(&format!("joiner/{arrival}"), &crate::codec::encode(&me))
        .await?;
    if me.old_rank.is_none() {
        scoped.add("newcomers", 1).await?;
    }
    let started = tokio::time::Instant::now();
    let mut min_seen: Option<tokio::time::Instant> = None;
    // Whether the arrivals counted so far account for the previous generation.
    let mut accounted = (0, false);
    let admitted = loop {
        if scoped.check(&["closed"]).await? {
            let value = scoped.get("closed").await?;
            break parse_count(&value, config)?;
        }
        let joined = scoped.add("count", 0).await?.max(0) as usize;
        if joined >= config.min_world && min_seen.is_none() {
            min_seen = Some(tokio::time::Instant::now());
        }
        if joined >= config.min_world && joined < config.max_world && accounted.0 != joined {
            accounted = (joined, accounted_for(&read_members(&scoped, config, joined).await?));
        }
        match decide(
            config,
            joined,
            accounted.1,
            min_seen.map(|t| t.elapsed()),
            started.elapsed(),
        ) {
            Step::Close(n) => {
                let agreed = scoped.compare_set("closed", b"", n.to_string().as_bytes()).await?;
                break parse_count(&agreed, config)?;
            }
            Step::TooFew => {
                return Err(ElasticError::TooFew {
                    generation: config.generation,
                    min_world: config.min_world,
                    came: read_members(&scoped, config, joined).await?,
                    waited: started.elapsed(),
                });
            }
            Step::Wait => tokio::time::sleep(config.poll).await,
        }
    };
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
        assert_eq!(decide(&c, 4, false, None, ms(0)), Step::Close(4));
        assert_eq!(
            decide(&c, 5, false, Some(ms(0)), ms(0)),
            Step::Close(4),
            "arrivals past max_world are late"
        );
        assert_eq!(
            decide(&c, 3, false, Some(ms(100)), ms(100)),
            Step::Wait,
            "last call still open"
        );
        assert_eq!(
            decide(&c, 3, true, Some(ms(0)), ms(0)),
            Step::Close(3),
            "everyone accounted for: no last call"
        );
        assert_eq!(
            decide(&c, 1, true, None, ms(0)),
            Step::Wait,
            "accounted but below min_world"
        );
        assert_eq!(decide(&c, 3, false, Some(ms(200)), ms(300)), Step::Close(3));
        assert_eq!(decide(&c, 1, false, None, ms(1999)), Step::Wait);
        assert_eq!(decide(&c, 1, false, None, ms(2000)), Step::TooFew);
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
