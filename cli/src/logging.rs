//! The log output of the `chorus` command and of the examples that run
//! under it: on stderr, in colour only on a terminal (never into a file
//! or a launcher's pipe), filtered by `CHORUS_LOG` (an `EnvFilter`) or, by
//! default, warnings and the notes of long waits (who a rendezvous or a
//! connection waits for, [`chorus_runtime::wait`]).

/// Installs the process's `tracing` subscriber.
pub fn init() {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_env("CHORUS_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(chorus_runtime::wait::default_log_filter()));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}
