//! Flight-recorder dumps (`RankDump::parse`), the JSON files `chorus trace`
//! reads from a trace directory, and their file names
//! (`parse_dump_file_name`).
//!
//! Input: the file's bytes. The fuzzer's dictionary (`flight_dump.dict`)
//! holds the member names and state words.
//!
//! Checks, besides "no panic" (deep nesting, huge numbers, bad UTF-8 are
//! typed errors):
//! - a parsed dump has `rank < world` and entries whose times match their
//!   states;
//! - a parsed dump, encoded again, parses back to itself;
//! - a file name that parses names a dump whose own file name parses back
//!   to the same generation and rank.
#![no_main]

use chorus_runtime::flight::{EntryState, RankDump, dump_file_name, parse_dump_file_name};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(name) = std::str::from_utf8(data)
        && let Some((generation, rank)) = parse_dump_file_name(name)
    {
        assert_eq!(
            parse_dump_file_name(&dump_file_name(generation, rank)),
            Some((generation, rank))
        );
    }

    let Ok(dump) = RankDump::parse(data) else {
        return;
    };
    assert!(dump.rank < dump.world);
    for entry in &dump.entries {
        match entry.state {
            EntryState::Scheduled => {}
            EntryState::Started => assert!(entry.started_at.is_some()),
            EntryState::Completed | EntryState::Failed(_) => {
                assert!(entry.completed_at.is_some());
                if entry.state == EntryState::Completed {
                    assert!(entry.started_at.is_some());
                }
            }
        }
    }
    let encoded = dump.encode();
    assert!(serde_json::from_slice::<serde_json::Value>(&encoded).is_ok());
    assert_eq!(RankDump::parse(&encoded), Ok(dump));
});
