//! The records launchers write in a job's store to meet in rounds (see
//! [`nodes`](super::nodes)' key layout), as text, sans IO: a round's
//! `joiners` lines, its `closed` group and its `end`. Parsing is total:
//! whatever the store holds reads as some record (a torn or foreign value
//! reads as a failure or as no members), and every record reads back as
//! written.

use super::plan::Arrival;

/// Why a round ended, as `a<n>/end` holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RoundEnd {
    /// A worker failed (or a node left, which its peers' workers see as a
    /// failure): counts against `--max-restarts`.
    Failure(String),
    /// The group restarts to admit a waiting node: free, as in torchrun.
    Membership(String),
}

impl RoundEnd {
    /// As `a<n>/end` holds it.
    pub fn encode(&self) -> String {
        match self {
            RoundEnd::Failure(what) => format!("failure {what}"),
            RoundEnd::Membership(what) => format!("membership {what}"),
        }
    }

    /// From `a<n>/end`'s text; any other text is a failure it describes.
    pub fn parse(text: &str) -> RoundEnd {
        match text.split_once(' ') {
            Some(("membership", what)) => RoundEnd::Membership(what.to_string()),
            Some(("failure", what)) => RoundEnd::Failure(what.to_string()),
            _ => RoundEnd::Failure(text.to_string()),
        }
    }

    /// What happened, for messages.
    pub fn what(&self) -> &str {
        match self {
            RoundEnd::Failure(what) | RoundEnd::Membership(what) => what,
        }
    }
}

/// A member of a formed round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// The launcher (`host:pid`).
    pub id: String,
    /// Its `--nproc-per-node`.
    pub nproc: usize,
}

/// What `a<n>/closed` holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Closed {
    /// The round formed with these members, in node rank order.
    Formed {
        /// `TORCHELASTIC_RESTART_COUNT` in this round.
        restarts: u64,
        /// Its nodes.
        members: Vec<Member>,
    },
    /// The job ended before the round formed.
    Ended(String),
}

impl Closed {
    /// As `a<n>/closed` holds it.
    pub fn encode(&self) -> String {
        match self {
            Closed::Formed { restarts, members } => {
                let mut text = format!("restarts {restarts}\n");
                for m in members {
                    text.push_str(&format!("{} {}\n", m.id, m.nproc));
                }
                text
            }
            Closed::Ended(why) => format!("ended {why}"),
        }
    }

    /// From `a<n>/closed`'s text: a line that is not a member is skipped,
    /// a count that does not parse is 0 (the text is the store's, which
    /// only launchers write).
    pub fn parse(text: &str) -> Closed {
        if let Some(why) = text.strip_prefix("ended ") {
            return Closed::Ended(why.to_string());
        }
        let mut lines = text.lines();
        let restarts = lines
            .next()
            .and_then(|l| l.strip_prefix("restarts "))
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        let members = lines
            .filter_map(|l| l.split_once(' '))
            .map(|(id, nproc)| Member {
                id: id.to_string(),
                nproc: nproc.parse().unwrap_or(0),
            })
            .collect();
        Closed::Formed { restarts, members }
    }
}

/// The launchers in a round's `joiners` text, in arrival order: each once,
/// less those that withdrew.
pub fn parse_joiners(text: &str) -> Vec<Arrival> {
    let mut arrivals: Vec<Arrival> = Vec::new();
    for line in text.lines() {
        let mut words = line.split(' ');
        match (words.next(), words.next()) {
            (Some("+"), Some(id)) if !arrivals.iter().any(|a| a.id == id) => {
                let nproc = words.next().and_then(|n| n.parse().ok()).unwrap_or(0);
                let node_rank = words.next().and_then(|r| r.parse().ok());
                arrivals.push(Arrival {
                    id: id.to_string(),
                    nproc,
                    node_rank,
                });
            }
            (Some("-"), Some(id)) => arrivals.retain(|a| a.id != id),
            _ => {}
        }
    }
    arrivals
}

/// `arrival`'s line in a round's `joiners`.
pub fn joiner_line(arrival: &Arrival) -> String {
    let rank = arrival.node_rank.map_or("-".to_string(), |r| r.to_string());
    format!("+ {} {} {rank}\n", arrival.id, arrival.nproc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_read_back_as_written() {
        let closed = Closed::Formed {
            restarts: 2,
            members: vec![
                Member {
                    id: "h:1".into(),
                    nproc: 2,
                },
                Member {
                    id: "h:2".into(),
                    nproc: 2,
                },
            ],
        };
        assert_eq!(Closed::parse(&closed.encode()), closed);
        let ended = Closed::Ended("rank 1 failed".into());
        assert_eq!(Closed::parse(&ended.encode()), ended);
        for end in [RoundEnd::Failure("a b".into()), RoundEnd::Membership("c d".into())] {
            assert_eq!(RoundEnd::parse(&end.encode()), end);
        }
        let arrivals = parse_joiners("+ a 2 -\n+ b 2 1\n+ a 2 -\n- a\n+ c 2 -\n");
        let ids: Vec<_> = arrivals.iter().map(|a| (a.id.as_str(), a.node_rank)).collect();
        assert_eq!(ids, [("b", Some(1)), ("c", None)]);
    }
}
