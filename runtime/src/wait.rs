//! Long waits say what they wait for: a rank whose peers have not
//! arrived would otherwise sit out its timeout (300 s by default) without
//! a word. A wait takes [`Notes`] and, each time one is due, logs at info
//! level under the target [`TARGET`] who it waits for and how long is left
//! (`waiting for ranks 1, 3 of 4 at tcp://10.0.0.1:29500; 30 s of 300 s`).
//! Programs that log only warnings by default let this target through
//! (the `chorus` command, the examples).

use std::time::Duration;

use tokio::time::Instant;

/// The `tracing` target of the notes, for filters (`chorus::wait=info`).
pub const TARGET: &str = "chorus::wait";

/// The log filter of the programs that show warnings and these notes
/// (the `chorus` command, the examples, the Python package) where
/// `CHORUS_LOG` names none.
pub fn default_log_filter() -> String {
    format!("warn,{TARGET}=info")
}

/// The first note comes after this long: shorter waits are normal.
pub const FIRST: Duration = Duration::from_secs(5);

/// Then one every this long.
pub const EVERY: Duration = Duration::from_secs(15);

/// When the notes of one wait are due: [`FIRST`] after it started, then
/// every [`EVERY`].
#[derive(Debug, Clone)]
pub struct Notes {
    started: Instant,
    total: Duration,
    next: Instant,
}

impl Notes {
    /// The notes of a wait starting now that gives up after `total`.
    pub fn new(total: Duration) -> Self {
        let started = Instant::now();
        Self {
            started,
            total,
            next: started + FIRST,
        }
    }

    /// When the next note is due.
    pub fn next_at(&self) -> Instant {
        self.next
    }

    /// Whether a note is due now; if so, the one after it is scheduled.
    pub fn due(&mut self) -> bool {
        let now = Instant::now();
        if now < self.next {
            return false;
        }
        while self.next <= now {
            self.next += EVERY;
        }
        true
    }

    /// How far the wait is: `30 s of 300 s`.
    pub fn progress(&self) -> String {
        format!(
            "{} s of {} s",
            self.started.elapsed().as_secs(),
            self.total.as_secs_f64().round()
        )
    }
}

/// Runs `future` (a wait that gives up after `total`), logging `what()`
/// with the progress each time a note is due while it is pending.
pub async fn noting<F: std::future::Future>(future: F, total: Duration, what: impl Fn() -> String) -> F::Output {
    let mut notes = Notes::new(total);
    let mut future = std::pin::pin!(future);
    loop {
        tokio::select! {
            output = &mut future => return output,
            () = tokio::time::sleep_until(notes.next_at()) => {
                if notes.due() {
                    let what = what();
                    tracing::info!(target: TARGET, "{what}; {}", notes.progress());
                }
            }
        }
    }
}

/// `1, 3` (or `1-3` for a run, `0-2, 5` for a mix): ranks to read at a glance.
pub fn rank_list(ranks: &[usize]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        parts.push(match j - i {
            0 => ranks[i].to_string(),
            1 => format!("{}, {}", ranks[i], ranks[j]),
            _ => format!("{}-{}", ranks[i], ranks[j]),
        });
        i = j + 1;
    }
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn notes_come_after_five_seconds_then_every_fifteen() {
        let mut notes = Notes::new(Duration::from_secs(300));
        assert!(!notes.due());
        tokio::time::sleep(Duration::from_millis(4900)).await;
        assert!(!notes.due());
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(notes.due());
        assert_eq!(notes.progress(), "5 s of 300 s");
        assert!(!notes.due(), "one note per interval");
        tokio::time::sleep_until(notes.next_at()).await;
        assert!(notes.due());
        assert_eq!(notes.progress(), "20 s of 300 s");
        // A wait that overslept several intervals notes once.
        tokio::time::sleep(Duration::from_secs(40)).await;
        assert!(notes.due());
        assert!(!notes.due());
    }

    #[tokio::test(start_paused = true)]
    async fn a_pending_wait_is_noted_and_a_finished_one_returns() {
        let asked = std::sync::atomic::AtomicUsize::new(0);
        let what = || {
            asked.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            "connecting".to_string()
        };
        let slow = tokio::time::sleep(Duration::from_secs(21));
        noting(slow, Duration::from_secs(60), what).await;
        // At 5 s and 20 s.
        assert_eq!(asked.load(std::sync::atomic::Ordering::Relaxed), 2);
        assert_eq!(noting(async { 7 }, Duration::from_secs(60), || unreachable!()).await, 7);
    }

    #[test]
    fn rank_lists_read_at_a_glance() {
        assert_eq!(rank_list(&[1, 3]), "1, 3");
        assert_eq!(rank_list(&[0, 1, 2, 5]), "0-2, 5");
        assert_eq!(rank_list(&[4, 5]), "4, 5");
        assert_eq!(rank_list(&[]), "");
    }
}
