//! The HTTP server (axum): the page, its live part, `/api/job` and
//! `/api/fault`. Each request reads the store afresh; a fault request is
//! checked here (faults on, the job secret, a rank of the newest
//! generation with a live record) before anything is written.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{ConnectInfo, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use chorus::auth::JobSecret;
use chorus::train::live::{self, FaultKind, LiveRecord};

use super::{page, view};
use chorus::train::observe::{Observed, SourceError, StoreSource};

/// What every request handler shares.
pub struct Shared {
    /// The job's store.
    pub source: StoreSource,
    /// The job secret, which a fault request must carry.
    pub secret: Vec<u8>,
    /// Whether faults may be asked for.
    pub faults: bool,
}

/// The routes.
pub fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/", get(page_handler))
        .route("/live", get(live_handler))
        .route("/api/job", get(job_handler))
        .route("/api/fault", post(fault_handler))
        .fallback(|| async { (StatusCode::NOT_FOUND, "no such page: try / or /api/job\n") })
        .with_state(shared)
}

fn unavailable(e: &SourceError) -> Response {
    tracing::warn!(target: "chorus::dashboard", error = %e, "cannot read the job");
    (StatusCode::SERVICE_UNAVAILABLE, format!("cannot read the job: {e}\n")).into_response()
}

async fn page_handler(State(shared): State<Arc<Shared>>) -> Response {
    match shared.source.observe().await {
        Ok(observed) => Html(page::render(&view::build(&observed), shared.faults)).into_response(),
        Err(e) => unavailable(&e),
    }
}

async fn live_handler(State(shared): State<Arc<Shared>>) -> Response {
    match shared.source.observe().await {
        Ok(observed) => Html(page::live(&view::build(&observed))).into_response(),
        Err(e) => unavailable(&e),
    }
}

async fn job_handler(State(shared): State<Arc<Shared>>) -> Response {
    match shared.source.observe().await {
        Ok(observed) => axum::Json(view::build(&observed)).into_response(),
        Err(e) => unavailable(&e),
    }
}

fn refuse(status: StatusCode, message: String) -> Refused {
    tracing::warn!(target: "chorus::dashboard", status = status.as_u16(), "fault request refused: {message}");
    Refused(status, message)
}

/// A fault request's refusal: its status and why, the response's text.
struct Refused(StatusCode, String);

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        (self.0, format!("{}\n", self.1)).into_response()
    }
}

/// `POST /api/fault` with a form body: `rank`, `kind` (kill, freeze,
/// cut_off, slow, corrupt_params, corrupt_grads), `secret` (or the `X-Chorus-Secret` header), `who`
/// (optional, for the log).
async fn fault_handler(
    State(shared): State<Arc<Shared>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let (ask, secret) = match checked_ask(&shared, peer, &headers, &body) {
        Ok(checked) => checked,
        Err(refused) => return refused.into_response(),
    };
    let observed = match shared.source.observe().await {
        Ok(observed) => observed,
        Err(e) => return unavailable(&e),
    };
    let (generation, record) = match target(&observed, ask.rank, &secret) {
        Ok(found) => found,
        Err(refused) => return refused.into_response(),
    };
    let Ask { kind, rank, who } = ask;
    if let Err(e) = shared
        .source
        .request_fault(&secret, record, rank, generation, kind, &who)
        .await
    {
        return unavailable(&e);
    }
    tracing::warn!(target: "chorus::dashboard", kind = kind.name(), rank, pid = record.pid, who = %who, "fault requested");
    (
        StatusCode::OK,
        format!(
            "{} of rank {rank} (pid {} on {}) requested by {who}\n",
            kind.name(),
            record.pid,
            record.host
        ),
    )
        .into_response()
}

/// A fault request that passed the checks: what, on which rank, asked by whom.
struct Ask {
    kind: FaultKind,
    rank: usize,
    who: String,
}

/// The request read from its form, with faults on and the job secret
/// given and right; or the response refusing it.
fn checked_ask(
    shared: &Shared,
    peer: SocketAddr,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<(Ask, JobSecret), Refused> {
    if !shared.faults {
        return Err(refuse(
            StatusCode::FORBIDDEN,
            "faults are off on this dashboard; start it with --dashboard-faults (chorus launch) or --faults (chorus dashboard)".into(),
        ));
    }
    let form_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/x-www-form-urlencoded"));
    if !form_type {
        return Err(refuse(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "send the fault request as application/x-www-form-urlencoded (rank, kind, secret, who)".into(),
        ));
    }
    let form: HashMap<String, String> = form_urlencoded::parse(body).into_owned().collect();
    let given = headers
        .get("x-chorus-secret")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or_else(|| form.get("secret").cloned());
    let Some(given) = given else {
        return Err(refuse(
            StatusCode::UNAUTHORIZED,
            "the job secret is required (secret, or X-Chorus-Secret)".into(),
        ));
    };
    // Compared as HMAC tags: in constant time.
    let secret = JobSecret::new(&shared.secret);
    let probe = b"chorus dashboard secret check";
    if !secret.verify(probe, &JobSecret::new(given.as_bytes()).sign(probe)) {
        return Err(refuse(
            StatusCode::FORBIDDEN,
            "wrong job secret; nothing was injected".into(),
        ));
    }
    let field = |name: &str| form.get(name).map(String::as_str).unwrap_or("");
    let Some(kind) = FaultKind::from_name(field("kind")) else {
        return Err(refuse(
            StatusCode::BAD_REQUEST,
            format!(
                "kind must be one of {} (got {:?})",
                FaultKind::ALL.map(FaultKind::name).join(", "),
                field("kind")
            ),
        ));
    };
    let Ok(rank) = field("rank").trim().parse::<usize>() else {
        return Err(refuse(
            StatusCode::BAD_REQUEST,
            format!("rank must be a number (got {:?})", field("rank")),
        ));
    };
    let who = match field("who").trim() {
        "" => peer.to_string(),
        name => format!("{peer} ({})", name.chars().take(40).collect::<String>()),
    };
    Ok((Ask { kind, rank, who }, secret))
}

/// The newest generation and the live record of its rank `rank`, whose
/// process would obey a request signed with `secret`; or the response
/// saying why there is none.
fn target<'a>(observed: &'a Observed, rank: usize, secret: &JobSecret) -> Result<(u64, &'a LiveRecord), Refused> {
    let Some(newest) = observed.generations.last() else {
        return Err(refuse(StatusCode::CONFLICT, "no generation has formed yet".into()));
    };
    let Some(process) = newest.members.get(rank) else {
        return Err(refuse(
            StatusCode::NOT_FOUND,
            format!(
                "no rank {rank} in generation {} (ranks 0 to {})",
                newest.generation,
                newest.members.len().saturating_sub(1)
            ),
        ));
    };
    let Some(record) = observed
        .records
        .iter()
        .find(|r| r.pid == process.pid && r.host == process.host)
    else {
        return Err(refuse(
            StatusCode::CONFLICT,
            format!(
                "rank {rank} (pid {}) publishes no live progress (it does not train through chorus::train)",
                process.pid
            ),
        ));
    };
    if let Some(tag) = &record.secret_tag
        && *tag != live::secret_tag(secret, &observed.run_id)
    {
        return Err(refuse(
            StatusCode::FORBIDDEN,
            "this dashboard's secret is not the job's; its processes would ignore the request".into(),
        ));
    }
    Ok((newest.generation, record))
}
