//! `chorus trace DIR [--json]`: prints the report [`chorus::trace`] makes
//! of the flight-recorder dumps in DIR.

use std::io::{self, Write as _};
use std::path::Path;
use std::process::ExitCode;

use chorus::trace::{Report, analyze, load_dir};
use chorus_runtime::flight::RankDump;
use serde::Serialize;

/// `chorus trace DIR [--json]`: prints the report; exit code 0 when the
/// dumps gave a verdict (including "nothing is stuck"), 1 when there are no
/// usable dumps. Unreadable files are listed with their path and reason.
pub fn main(dir: &Path, json: bool) -> ExitCode {
    let loaded = match load_dir(dir) {
        Ok(loaded) => loaded,
        Err(error) => {
            eprintln!("chorus trace: {error}");
            return ExitCode::FAILURE;
        }
    };
    let dumps: Vec<RankDump> = loaded.dumps.into_iter().map(|(_, dump)| dump).collect();
    let report = analyze(&dumps);
    let mut out = String::new();
    if json {
        let value = TraceJson {
            body: match &report {
                Some(report) => TraceBody::Report(report),
                None => TraceBody::Error { error: no_dumps(dir) },
            },
            unreadable: loaded
                .unreadable
                .iter()
                .map(|e| UnreadableJson {
                    path: e.path().display().to_string(),
                    error: e.to_string(),
                })
                .collect(),
        };
        out = serde_json::to_string(&value).expect("the report has string keys and no floats");
        out.push('\n');
    } else {
        if let Some(report) = &report {
            out = report.to_string();
        }
        for error in &loaded.unreadable {
            out.push_str(&format!("unreadable: {error}\n"));
        }
    }
    // Not `print!`, which panics when the reader went away (`| head`): a
    // closed pipe is the reader's choice, not a failure of the analysis.
    let _ = io::stdout().lock().write_all(out.as_bytes());
    match report {
        Some(_) => ExitCode::SUCCESS,
        None => {
            eprintln!("chorus trace: {}", no_dumps(dir));
            ExitCode::FAILURE
        }
    }
}

fn no_dumps(dir: &Path) -> String {
    format!(
        "no readable flight-recorder dumps (chorus-trace-g<generation>-r<rank>.json) in {}",
        dir.display()
    )
}

/// `chorus trace --json`: the report or the reason there is none, and the
/// files that could not be read.
#[derive(Serialize)]
struct TraceJson<'a> {
    #[serde(flatten)]
    body: TraceBody<'a>,
    unreadable: Vec<UnreadableJson>,
}

#[derive(Serialize)]
#[serde(untagged)]
enum TraceBody<'a> {
    Report(&'a Report),
    Error { error: String },
}

#[derive(Serialize)]
struct UnreadableJson {
    path: String,
    error: String,
}
