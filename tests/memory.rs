//! Shared memory on one host: a `/dev/shm` too small for a rank's rings is
//! a named error before forming, a small one gets smaller rings, and rings
//! left by a job killed with SIGKILL while forming are gone once the
//! launcher ends or the next job starts.
//!
//! Each test runs in a mount namespace of its own with a small tmpfs over
//! `/dev/shm` (as a container's), so it sees no other job's rings; that
//! needs root (`unshare --mount`), and without it the test says so and
//! passes: the sizing rules are unit-tested in `chorus::mesh`, the sweep in
//! `chorus_transports::shm`. Every child runs under a deadline.

use std::process::Command;

mod common;
use common::{LAUNCHER, chorus_bin, free_ports, joined, run};

/// Runs `script` under `sh -eu` in a private mount namespace with an
/// 8 MiB tmpfs on `/dev/shm`; `None` where this user cannot.
fn in_small_shm(script: &str, secs: u64) -> Option<std::process::Output> {
    let allowed = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "true"])
        .status()
        .is_ok_and(|s| s.success());
    if !allowed {
        eprintln!("skipped: unshare --mount is not allowed here (run as root to test)");
        return None;
    }
    let script = format!("mount -t tmpfs -o size=8M tmpfs /dev/shm\n{script}");
    let ports = free_ports(4);
    let mut command = Command::new("unshare");
    command
        .args(["--mount", "--propagation", "private", "sh", "-eu", "-c", &script])
        .env("CHORUS", chorus_bin())
        .envs(
            ["PORT", "PORT2", "PORT3", "PORT4"]
                .into_iter()
                .zip(ports.iter().map(u16::to_string)),
        )
        .env_remove("CHORUS_SHM_BUDGET")
        .env_remove("CHORUS_TRANSPORT");
    Some(run(&mut command, secs, "the shared-memory script", LAUNCHER))
}

const SELFTEST: &str = r#""$CHORUS" launch --nproc-per-node 2 --master-port "$PORT" -- "$CHORUS" selftest --timeout 30 --counts 13 --dtypes float32"#;

#[test]
fn a_rank_without_room_for_its_rings_fails_before_forming_with_the_named_error() {
    // 7 of the 8 MiB are taken: the two ranks' 2 MiB rings (half the
    // tmpfs is the budget) do not fit; once freed they do.
    let script = format!(
        "dd if=/dev/zero of=/dev/shm/filler bs=1M count=7 2>/dev/null\n\
         if {SELFTEST}; then echo FORMED-FULL; fi\n\
         rm /dev/shm/filler\n\
         {SELFTEST}\n\
         echo FORMED-EMPTY"
    );
    let Some(output) = in_small_shm(&script, 120) else {
        return;
    };
    let all = joined(&output);
    assert!(output.status.success(), "{all}");
    assert!(!all.contains("FORMED-FULL"), "formed without room:\n{all}");
    for part in [
        "this rank's 1 shared-memory rings of 2.0 MiB need 2.0 MiB and /dev/shm has 1.0 MiB free",
        "lower CHORUS_SHM_BUDGET",
    ] {
        assert!(all.contains(part), "{part:?} not in:\n{all}");
    }
    assert!(!all.contains("SIGBUS") && !all.contains("signal: 7"), "{all}");
    assert_eq!(all.matches("checks passed").count(), 2, "the small rings work:\n{all}");
    assert!(all.contains("FORMED-EMPTY"), "{all}");
}

#[test]
fn rings_of_a_job_killed_while_forming_are_removed_by_the_launcher_and_by_the_next_job() {
    // Rank 2 uses QUIC, so ranks 0 and 1 wait forever for it to attach to
    // their rings to it: SIGKILL then leaves those two files behind.
    let script = r#"
rings() { ls /dev/shm | grep -c -- '^chorus-.*-to-' || true; }
leave_rings() {
  cat > /dev/shm/worker.sh <<'EOF'
#!/bin/sh
if [ "$LOCAL_RANK" = 2 ]; then export CHORUS_TRANSPORT=quic; fi
exec "$CHORUS" selftest --timeout 60 --counts 13 --dtypes float32
EOF
  chmod +x /dev/shm/worker.sh
  setsid "$CHORUS" launch --nproc-per-node 3 --master-port "$1" -- /dev/shm/worker.sh >/dev/null 2>&1 &
  launcher=$!
  i=0
  while [ "$(ls /dev/shm | grep -c -- '-to-2$' || true)" -lt 2 ]; do
    i=$((i + 1)); [ $i -lt 1200 ] || { echo "no rings appeared"; exit 1; }
    sleep 0.05
  done
  # Past the moment their headers are written (magic last).
  sleep 0.2
  # The launcher's workers die with it (PR_SET_PDEATHSIG).
  kill -9 "$launcher"
  wait "$launcher" || true
  sleep 1
  rm /dev/shm/worker.sh
  echo "LEFT=$(rings)"
}
leave_rings "$PORT"
"$CHORUS" launch --nproc-per-node 1 --master-port "$PORT2" -- true
echo "AFTER-LAUNCH=$(rings)"
leave_rings "$PORT3"
RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT="$PORT4" "$CHORUS" selftest --timeout 30 --counts 13 --dtypes float32 &
peer=$!
RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT="$PORT4" "$CHORUS" selftest --timeout 30 --counts 13 --dtypes float32
wait $peer
echo "AFTER-NEXT-JOB=$(rings)"
"#;
    let Some(output) = in_small_shm(script, 240) else {
        return;
    };
    let all = joined(&output);
    assert!(output.status.success(), "{all}");
    assert_eq!(
        all.matches("LEFT=2").count(),
        2,
        "the killed jobs left their rings:\n{all}"
    );
    assert!(all.contains("AFTER-LAUNCH=0"), "{all}");
    assert!(all.contains("AFTER-NEXT-JOB=0"), "{all}");
    assert_eq!(all.matches("checks passed").count(), 2, "{all}");
}
