#![no_main]
//! The launchers' round records (`chorus_cli::launch::records`), text that
//! any process able to write the job's store could have written: a round's
//! `joiners` lines, its `closed` group and its `end`. The first byte picks
//! the parser; the rest, read as UTF-8 lossily (as the launcher reads the
//! store), is its input.
//!
//! Beyond "no panic" (parsing is total): a parsed record is a fixed point,
//! written and read back it is itself; `parse_joiners` names each launcher
//! once, and only one whose last line about it is not a withdrawal.

use chorus_cli::launch::records::{Closed, RoundEnd, joiner_line, parse_joiners};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let text = String::from_utf8_lossy(rest);
    match selector % 3 {
        0 => {
            let closed = Closed::parse(&text);
            assert_eq!(Closed::parse(&closed.encode()), closed, "{text:?}");
        }
        1 => {
            let end = RoundEnd::parse(&text);
            assert_eq!(RoundEnd::parse(&end.encode()), end, "{text:?}");
        }
        _ => {
            let arrivals = parse_joiners(&text);
            for (i, a) in arrivals.iter().enumerate() {
                assert!(arrivals[..i].iter().all(|b| b.id != a.id), "{} twice in {text:?}", a.id);
                let last = text.lines().rev().find(|l| {
                    let mut words = l.split(' ');
                    matches!(words.next(), Some("+" | "-")) && words.next() == Some(a.id.as_str())
                });
                assert!(last.is_some_and(|l| l.starts_with('+')), "{} withdrew in {text:?}", a.id);
            }
            let written: String = arrivals.iter().map(joiner_line).collect();
            assert_eq!(parse_joiners(&written), arrivals, "{text:?}");
        }
    }
});
