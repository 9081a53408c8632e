//! The file store's on-disk log (`FileStore`, `runtime/src/store/file.rs`),
//! through the public API: its parser (`Inner::sync`) reads the file
//! directly, with no pure function to call, so each run writes a real file
//! (under `/dev/shm` where there is one) and opens a store on it.
//!
//! Input: byte 0 picks the mode and the limits; the rest is file content.
//! - Mode "live": a member opens the store, the rest is appended to the log
//!   behind its back (what a foreign writer or a damaged disk leaves), then
//!   that member reads and a second member opens and replays the whole log.
//! - Mode "stale": the rest is the whole file, with no member alive, then a
//!   member opens it.
//!
//! Checks, besides "no panic, no allocation past the limits":
//! - every failure is `StoreError::CorruptFile`, never an IO error;
//! - live: after a successful read the store still works (a torn final
//!   record is cut away, not kept), and both members agree on the contents;
//! - stale: a file that starts like a chorus store (or is empty) is reset and
//!   opens; any other file is refused and left byte for byte as it was.
#![no_main]

use std::path::PathBuf;
use std::sync::LazyLock;
use std::time::Duration;

use chorus_runtime::store::protocol::Limits;
use chorus_runtime::store::{FileStore, FileStoreOptions, Store, StoreError};
use libfuzzer_sys::fuzz_target;

const MAGIC: &[u8] = b"CHORUSFS";

static RUNTIME: LazyLock<tokio::runtime::Runtime> = LazyLock::new(|| {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a tokio runtime")
});

static DIR: LazyLock<PathBuf> = LazyLock::new(|| {
    let base = if std::path::Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let dir = base.join(format!("chorus-fuzz-file-store-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    dir
});

fn options(selector: u8) -> FileStoreOptions {
    let limits = if selector & 2 == 0 {
        Limits::default()
    } else {
        Limits {
            max_key: 16,
            max_value: 64,
            ..Limits::default()
        }
    };
    FileStoreOptions {
        timeout: Duration::from_secs(5),
        limits,
    }
}

fn corrupt_or<T: std::fmt::Debug>(result: Result<T, StoreError>) -> Option<T> {
    match result {
        Ok(value) => Some(value),
        Err(StoreError::CorruptFile { .. }) => None,
        Err(other) => panic!("expected CorruptFile, got {other:?}"),
    }
}

async fn contents(store: &FileStore) -> Option<(i64, bool, i64)> {
    let keys = corrupt_or(store.num_keys().await)?;
    let has_k = corrupt_or(store.check(&["k"]).await)?;
    let queue = corrupt_or(store.queue_len("q").await)?;
    Some((keys, has_k, queue))
}

async fn live(path: &PathBuf, options: FileStoreOptions, tail: &[u8]) {
    let a = FileStore::open(path, options).await.expect("opening a fresh store");
    a.set("seed", b"1").await.expect("a first write");
    {
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(path)
            .expect("the data file");
        file.write_all(tail).expect("appending");
    }
    let seen_by_a = contents(&a).await;
    if seen_by_a.is_some() {
        // The log read cleanly (a torn tail was cut away): writes go on.
        a.set("after", b"2").await.expect("a write after a clean read");
        assert_eq!(a.get("after").await.expect("reading it back"), &b"2"[..]);
        let b = corrupt_or(FileStore::open(path, options).await).expect("a second member after a clean read");
        let seen_by_b = contents(&b).await.expect("the second member reads the same log");
        assert_eq!(seen_by_b, contents(&a).await.expect("the first member still reads"));
        let _ = b.close().await;
    } else {
        // Stays corrupt for everyone while a member holds it.
        assert!(corrupt_or(FileStore::open(path, options).await).is_none());
    }
    let _ = a.close().await;
}

async fn stale(path: &PathBuf, options: FileStoreOptions, file: &[u8]) {
    std::fs::write(path, file).expect("writing the stale file");
    let chorus_like = file[..file.len().min(MAGIC.len())] == MAGIC[..file.len().min(MAGIC.len())];
    match corrupt_or(FileStore::open(path, options).await) {
        Some(store) => {
            assert!(chorus_like, "a foreign file was taken over");
            assert_eq!(contents(&store).await, Some((0, false, 0)), "a reset store is empty");
            let _ = store.close().await;
        }
        None => {
            assert!(!chorus_like, "a stale chorus file was refused");
            assert_eq!(
                std::fs::read(path).expect("the refused file"),
                file,
                "a refused file was changed"
            );
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let path = DIR.join("store");
    let options = options(selector);
    RUNTIME.block_on(async {
        if selector & 1 == 0 {
            live(&path, options, rest).await;
        } else {
            stale(&path, options, rest).await;
        }
    });
    // Whatever a failed close left behind, the next run starts clean.
    for name in ["store", "store.members"] {
        let _ = std::fs::remove_file(DIR.join(name));
    }
});
