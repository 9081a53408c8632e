//! The page, sans IO: a [`JobView`] as server-rendered HTML with inline
//! SVG, readable with scripts off; a few lines of inline script only
//! refresh the live part every two seconds. Nothing is loaded from
//! elsewhere.

use std::fmt::Write;

use chorus::train::live::FaultKind;

use super::view::{JobView, MemberState, Phases};

/// Width of the charts, pixels.
const W: f64 = 720.0;
/// Height of each chart, pixels.
const H: f64 = 160.0;

/// Phase colours: detect, re-form, transfer, first step.
const PHASE_COLOURS: [&str; 4] = ["#d95f02", "#7570b3", "#1b9e77", "#e6ab02"];

/// Escapes `text` for HTML.
pub fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// The whole page; `faults` shows the fault form.
pub fn render(view: &JobView, faults: bool) -> String {
    let mut s = String::with_capacity(16 * 1024);
    let _ = write!(
        s,
        "<!doctype html><html lang=en><head><meta charset=utf-8><title>chorus: {run}</title>\
<meta name=viewport content=\"width=device-width\"><style>{STYLE}</style></head><body>\
<h1>chorus job <code>{run}</code></h1><div id=live>{live}</div>",
        run = esc(&view.run_id),
        live = live(view),
    );
    if faults {
        s.push_str(&fault_form(view));
    }
    s.push_str(
        "<script>setInterval(async()=>{try{const r=await fetch('/live');\
if(r.ok)document.getElementById('live').innerHTML=await r.text()}catch(e){}},2000)</script></body></html>",
    );
    s
}

const STYLE: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:1em 2em;color:#222;max-width:1100px}\
h1{font-size:20px}h2{font-size:16px;margin:1.2em 0 .4em}table{border-collapse:collapse}\
td,th{padding:2px 10px;border-bottom:1px solid #ddd;text-align:left}.training{color:#1a7f37}\
.recovering{color:#b35900}.standby{color:#555}.gone{color:#b00}svg{background:#fafafa;border:1px solid #ddd}\
.k{display:inline-block;width:10px;height:10px;margin:0 4px 0 12px}code{font-size:13px}";

/// The part the script refreshes.
pub fn live(view: &JobView) -> String {
    let mut s = String::new();
    let rate = view.step_rate.map_or_else(|| "-".into(), |r| format!("{r:.2}"));
    let _ = write!(
        s,
        "<p>generation <b>{}</b> · {} ranks · {} steps committed · {rate} steps/s{}</p>",
        view.generations
            .last()
            .map_or_else(|| "-".into(), |g| g.generation.to_string()),
        view.ranks().count(),
        view.steps.last().map_or(0, |p| p.step + 1),
        if view.finished { " · <b>finished</b>" } else { "" },
    );
    members(&mut s, view);
    timeline(&mut s, view);
    charts(&mut s, view);
    findings(&mut s, view);
    s
}

fn opt<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(|| "-".into(), |v| v.to_string())
}

fn members(s: &mut String, view: &JobView) {
    s.push_str(
        "<h2>Members</h2><table id=members><tr><th>rank<th>node<th>host<th>pid<th>state<th>heartbeat<th>last step</tr>",
    );
    for m in &view.members {
        let state = match m.state {
            MemberState::Training => "training",
            MemberState::Recovering => "recovering",
            MemberState::Standby => "standby",
            MemberState::Gone => "gone",
        };
        let cause = m.cause.map(|c| format!(" ({})", c.text())).unwrap_or_default();
        let _ = write!(
            s,
            "<tr><td>{}<td>{}<td>{}<td>{}<td class={state}>{state}{cause}<td>{}<td>{}</tr>",
            m.rank
                .map_or_else(|| "-".into(), |r| format!("{r} (g{})", opt(m.generation))),
            opt(m.node),
            esc(&m.host),
            m.pid,
            m.heartbeat_age_ms
                .map_or_else(|| "-".into(), |a| format!("{:.1} s", a / 1e3)),
            opt(m.last_step),
        );
    }
    s.push_str("</table>");
}

fn timeline(s: &mut String, view: &JobView) {
    s.push_str("<h2>Generations</h2><p>");
    for (name, colour) in ["detect", "re-form", "transfer", "first step"]
        .iter()
        .zip(PHASE_COLOURS)
    {
        let _ = write!(s, "<span class=k style=background:{colour}></span>{name}");
    }
    s.push_str("</p><table id=timeline><tr><th>gen<th>ranks<th>why it formed<th>recovery</tr>");
    let longest = view
        .generations
        .iter()
        .filter_map(|g| g.recovery.as_ref())
        .map(Phases::total_ms)
        .fold(1.0f64, f64::max);
    for (i, g) in view.generations.iter().enumerate() {
        let why = match g.changes.is_empty() {
            true if i == 0 => "first".to_string(),
            true => "re-formed, same members".to_string(),
            false => g
                .changes
                .iter()
                .map(|c| match c.rank {
                    Some(rank) => format!("rank {rank} (pid {}) {}", c.process.pid, c.cause.text()),
                    None => format!("pid {} on {} {}", c.process.pid, esc(&c.process.host), c.cause.text()),
                })
                .collect::<Vec<_>>()
                .join(", "),
        };
        let _ = write!(
            s,
            "<tr class=generation><td>g{}<td>{}<td>{why}<td>",
            g.generation, g.world_size
        );
        if let Some(p) = &g.recovery {
            bar(s, p, longest);
        }
        s.push_str("</tr>");
    }
    s.push_str("</table>");
}

/// One recovery as a bar of its phases, scaled to the longest.
fn bar(s: &mut String, p: &Phases, longest: f64) {
    const BAR: f64 = 360.0;
    let phases = [p.detect_ms.unwrap_or(0.0), p.reform_ms, p.transfer_ms, p.first_step_ms];
    let _ = write!(s, "<svg class=recovery width={} height=18 role=img><title>", BAR + 90.0);
    let _ = write!(
        s,
        "detect {} ms, re-form {:.0} ms, transfer {:.0} ms, first step {:.0} ms</title>",
        p.detect_ms.map_or_else(|| "?".into(), |d| format!("{d:.0}")),
        p.reform_ms,
        p.transfer_ms,
        p.first_step_ms
    );
    let mut x = 0.0;
    for (ms, colour) in phases.iter().zip(PHASE_COLOURS) {
        let w = (ms / longest * BAR).max(if *ms > 0.0 { 1.0 } else { 0.0 });
        let _ = write!(s, "<rect x={x:.1} y=2 width={w:.1} height=14 fill={colour}></rect>");
        x += w;
    }
    let _ = write!(
        s,
        "<text x={:.1} y=14 font-size=12>{:.0} ms</text></svg>",
        x + 6.0,
        p.total_ms()
    );
}

/// Loss and step rate over the committed steps, failures marked.
fn charts(s: &mut String, view: &JobView) {
    s.push_str("<h2>Loss and step rate</h2>");
    let Some((first, last)) = view.steps.first().zip(view.steps.last()) else {
        s.push_str("<p>no committed step yet</p>");
        return;
    };
    let (x0, x1) = (first.step as f64, (last.step as f64).max(first.step as f64 + 1.0));
    let sx = |step: f64| 40.0 + (step - x0) / (x1 - x0) * (W - 50.0);
    let losses: Vec<(f64, f64)> = view
        .steps
        .iter()
        .map(|p| (p.step as f64, p.loss.unwrap_or(f64::NAN)))
        .collect();
    // Steps per second between neighbours (a step's rate over the last few).
    let rates: Vec<(f64, f64)> = view
        .steps
        .windows(5)
        .filter_map(|w| {
            let dt = (w[4].at_us - w[0].at_us) as f64 / 1e6;
            (dt > 0.0).then(|| (w[4].step as f64, (w[4].step - w[0].step) as f64 / dt))
        })
        .collect();
    for (id, name, points) in [("loss", "loss", &losses), ("rate", "steps/s", &rates)] {
        let finite: Vec<f64> = points.iter().map(|p| p.1).filter(|v| v.is_finite()).collect();
        let lo = finite.iter().copied().fold(f64::INFINITY, f64::min).min(0.0);
        let hi = finite.iter().copied().fold(f64::NEG_INFINITY, f64::max).max(lo + 1e-9);
        let sy = |v: f64| H - 20.0 - (v - lo) / (hi - lo) * (H - 35.0);
        let _ = write!(
            s,
            "<svg id={id} width={W} height={H} role=img><title>{name} over committed steps</title>\
<text x=4 y=14 font-size=12>{name} (max {hi:.3})</text><text x=40 y={} font-size=11>step {}</text>\
<text x={} y={} font-size=11 text-anchor=end>step {}</text>",
            H - 4.0,
            first.step,
            W - 10.0,
            H - 4.0,
            last.step
        );
        for f in &view.failures {
            let x = sx(f.step as f64);
            let _ = write!(
                s,
                "<line class=failure x1={x:.1} x2={x:.1} y1=18 y2={} stroke=#c00 stroke-dasharray=4,3><title>{}</title></line>",
                H - 20.0,
                esc(&f.what)
            );
        }
        let line: Vec<String> = points
            .iter()
            .filter(|p| p.1.is_finite())
            .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
            .collect();
        let _ = write!(
            s,
            "<polyline fill=none stroke=#1f4e9c stroke-width=1.5 points=\"{}\"></polyline></svg><br>",
            line.join(" ")
        );
    }
}

fn findings(s: &mut String, view: &JobView) {
    s.push_str("<h2>Findings</h2>");
    if view.findings.is_empty() {
        s.push_str("<p>no abort so far</p>");
    } else {
        s.push_str("<ul id=findings>");
        for f in view.findings.iter().take(5) {
            let _ = write!(
                s,
                "<li>g{}: rank {} found: {} (failed ranks {:?})</li>",
                f.generation,
                f.rank,
                esc(&f.reason),
                f.failed_ranks
            );
        }
        s.push_str("</ul>");
    }
    if !view.faults.is_empty() {
        s.push_str("<h2>Faults asked for</h2><ul id=faults>");
        for f in view.faults.iter().rev().take(10) {
            let _ = write!(
                s,
                "<li>{} of rank {} (g{}, pid {} on {}) by {}</li>",
                f.kind.name(),
                f.rank,
                f.generation,
                f.pid,
                esc(&f.host),
                esc(&f.who)
            );
        }
        s.push_str("</ul>");
    }
}

/// The fault buttons: a form that posts with the job secret.
fn fault_form(view: &JobView) -> String {
    let mut s = String::from("<h2>Inject a fault</h2><form method=post action=/api/fault>rank <select name=rank>");
    for m in view.ranks() {
        if let Some(rank) = m.rank {
            let _ = write!(s, "<option value={rank}>{rank} (pid {})</option>", m.pid);
        }
    }
    s.push_str("</select> job secret <input type=password name=secret required> your name <input name=who size=10> ");
    for kind in FaultKind::ALL {
        let _ = write!(s, "<button name=kind value={0}>{0}</button> ", kind.name());
    }
    s.push_str("</form>");
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dashboard::view::{Cause, Change, GenerationView, MemberView, Process, StepPoint};

    fn view() -> JobView {
        JobView {
            run_id: "r<1>".into(),
            now_us: 0,
            finished: false,
            members: vec![MemberView {
                rank: Some(0),
                generation: Some(1),
                node: Some(0),
                host: "h".into(),
                pid: 7,
                state: MemberState::Training,
                cause: None,
                heartbeat_age_ms: Some(250.0),
                last_step: Some(3),
            }],
            generations: vec![GenerationView {
                generation: 1,
                world_size: 1,
                changes: vec![Change {
                    cause: Cause::Killed,
                    rank: Some(1),
                    process: Process {
                        host: "h".into(),
                        pid: 8,
                    },
                }],
                recovery: Some(Phases {
                    detect_ms: Some(10.0),
                    reform_ms: 20.0,
                    transfer_ms: 5.0,
                    first_step_ms: 5.0,
                }),
                started_us: None,
            }],
            steps: (0..10)
                .map(|step| StepPoint {
                    step,
                    loss: Some(1.0 / (step + 1) as f64),
                    generation: 1,
                    at_us: step as i64 * 100_000,
                })
                .collect(),
            step_rate: Some(10.0),
            failures: vec![],
            findings: vec![],
            faults: vec![],
        }
    }

    #[test]
    fn the_page_holds_every_part_escaped_and_the_form_only_when_faults_are_on() {
        let page = render(&view(), false);
        assert!(page.contains("<code>r&lt;1&gt;</code>"));
        assert!(page.contains("rank 1 (pid 8) killed"));
        assert!(page.contains("class=recovery"));
        assert!(page.contains("<svg id=loss"));
        assert!(page.contains("10.00 steps/s"));
        assert!(!page.contains("<form"));
        let page = render(&view(), true);
        assert!(page.contains("<option value=0>0 (pid 7)</option>"));
        assert!(page.contains("value=cut_off"));
        assert!(!page.contains("http"), "nothing is loaded from elsewhere");
    }
}
