//! Errors that print readably wherever they end up.
//!
//! A program whose `main` returns `Result<(), Box<dyn Error>>` prints its
//! error with `Debug`; a derived `Debug` shows the error's structure
//! (`Rendezvous(Env(Missing { var: "MASTER_ADDR", .. }))`), not its
//! message. The public errors a user meets first implement `Debug` as
//! [`report`] instead (as `anyhow` does), so that pattern, `unwrap` and
//! `expect` all print the message and its causes.

/// `error` and its causes on one line, each cause once: chorus's messages
/// often quote their cause already, which `{:#}` or a "Caused by" list would
/// print a second time.
pub fn report(error: &(dyn std::error::Error + 'static)) -> String {
    let mut report = error.to_string();
    let mut cause = error.source();
    while let Some(next) = cause {
        let text = next.to_string();
        if !report.contains(&text) {
            report.push_str(": ");
            report.push_str(&text);
        }
        cause = next.source();
    }
    report
}

/// Implements `Debug` for each error type as its [`report`](crate::error::report).
#[macro_export]
macro_rules! debug_as_report {
    ($($error:ty),+ $(,)?) => {
        $(impl ::std::fmt::Debug for $error {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(&$crate::error::report(self))
            }
        })+
    };
}

#[cfg(test)]
mod tests {
    #[derive(thiserror::Error)]
    #[error("reading the plan: {source}")]
    struct Quoting {
        source: std::io::Error,
    }

    #[derive(thiserror::Error)]
    #[error("starting the job")]
    struct Wrapping(#[source] Quoting);

    crate::debug_as_report!(Quoting, Wrapping);

    #[test]
    fn each_cause_is_reported_once_and_debug_is_the_report() {
        let error = Wrapping(Quoting {
            source: std::io::Error::other("disk on fire"),
        });
        assert_eq!(
            super::report(&error),
            "starting the job: reading the plan: disk on fire"
        );
        assert_eq!(format!("{error:?}"), super::report(&error));
    }
}
