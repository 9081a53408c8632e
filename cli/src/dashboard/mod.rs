//! The dashboard: a live page of a running job (`chorus launch
//! --dashboard ADDR`, `chorus dashboard --store HOST:PORT`), read from the
//! job's store alone, so a launcher and an outside watcher show the same.
//!
//! Data path: the elastic rendezvous's records give the generations and
//! their members (`rendezvous::elastic`), the launchers' published exits
//! who is gone, and each training process's live record
//! ([`chorus::train::live`]) its steps, recoveries with phases and the
//! aborts its supervision found; the dashboard's own fault log says which
//! fault it asked for and who asked. Faults go through the store too,
//! signed with the job secret, and the target process carries them out.
//!
//! # Layout
//! - reading the store and writing fault requests is the library's
//!   [`chorus::train::observe`] (`chorus chaos` asks for faults through it
//!   too).
//! - [`view`]: sans IO; what was read ([`view::Observed`]) into the
//!   page's data ([`view::JobView`]): members and their states, the
//!   timeline with causes and recovery phases, steps, findings.
//! - [`page`]: sans IO; the page as HTML with inline SVG.
//! - [`server`]: the axum routes.
//! - this file: binding and serving in a task of its own ([`start`]).
//!
//! # Security
//! It binds to loopback unless told otherwise, and its callers warn when it
//! does not ([`Dashboard::exposure_warning`]);
//! anyone who reaches it can watch the job. Faults are off unless asked
//! for, and then need the job secret with each request.

pub mod page;
pub mod server;
pub mod view;

use std::net::SocketAddr;
use std::sync::Arc;

use chorus::store::Store;
use chorus::train::observe::StoreSource;
use thiserror::Error;

/// Why the dashboard could not start.
#[derive(Debug, Error)]
pub enum DashboardError {
    /// The address is not `IP:PORT` (or `localhost:PORT`).
    #[error("dashboard address {0:?}: give IP:PORT, e.g. 127.0.0.1:0 (a free port)")]
    Address(String),
    /// It cannot listen there.
    #[error("cannot serve the dashboard on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// How a dashboard serves.
#[derive(Debug, Clone)]
pub struct DashboardOptions {
    /// Where it listens (`127.0.0.1:0`: a free port on loopback).
    pub addr: String,
    /// Whether faults may be asked for (with the job secret).
    pub faults: bool,
    /// The job secret.
    pub secret: String,
    /// The run to show (the newest that published, when `None`).
    pub run_id: Option<String>,
}

/// A dashboard serving in a task of its own.
#[derive(Debug)]
pub struct Dashboard {
    /// Where it listens.
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Dashboard {
    /// Its page's URL.
    pub fn url(&self) -> String {
        format!("http://{}/", self.addr)
    }

    /// The warning to print when it listens beyond loopback, where anyone
    /// who reaches it can watch the job.
    pub fn exposure_warning(&self) -> Option<String> {
        (!self.addr.ip().is_loopback()).then(|| {
            format!(
                "warning: the dashboard listens on {}, beyond loopback: anyone who reaches it can watch the job",
                self.addr
            )
        })
    }

    /// Serves until the process ends or the server fails (logged).
    pub async fn wait(mut self) {
        let _ = (&mut self.task).await;
    }
}

impl Drop for Dashboard {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The address to listen on: `IP:PORT`, `localhost:PORT` meaning loopback.
pub fn parse_addr(addr: &str) -> Result<SocketAddr, DashboardError> {
    let spelled = match addr.strip_prefix("localhost:") {
        Some(port) => format!("127.0.0.1:{port}"),
        None => addr.to_string(),
    };
    spelled.parse().map_err(|_| DashboardError::Address(addr.to_string()))
}

/// Binds and serves the dashboard of the job on `store` in a task of its
/// own: its failure is logged and never reaches the caller's job.
pub async fn start(store: Arc<dyn Store>, options: &DashboardOptions) -> Result<Dashboard, DashboardError> {
    let wanted = parse_addr(&options.addr)?;
    let listener = tokio::net::TcpListener::bind(wanted)
        .await
        .map_err(|source| DashboardError::Bind { addr: wanted, source })?;
    let addr = listener
        .local_addr()
        .map_err(|source| DashboardError::Bind { addr: wanted, source })?;
    let shared = Arc::new(server::Shared {
        source: StoreSource::new(store, options.run_id.clone()),
        secret: options.secret.as_bytes().to_vec(),
        faults: options.faults,
    });
    let app = server::router(shared).into_make_service_with_connect_info::<SocketAddr>();
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(target: "chorus::dashboard", error = %e, "the dashboard stopped; the job goes on");
        }
    });
    Ok(Dashboard { addr, task })
}
