//! [`TcpStoreServer`]: a store server speaking PyTorch's TCPStore protocol.
//!
//! One task accepts; one task per connection decodes requests with
//! [`protocol::decode_request`], applies them to the shared [`KvState`] and
//! writes replies. A `WAIT` that cannot complete at once registers the
//! connection's channel as the wait token; the connection task writes
//! `STOP_WAITING` when the state fires it, and keeps serving other requests
//! (`CANCEL_WAIT` in particular) meanwhile.
//!
//! A connection is closed, with its reason logged, when it breaks the
//! protocol (garbage, unknown query, oversized lengths), does not send
//! `VALIDATE` within the handshake timeout, or asks for something the state
//! refuses (`ADD` on text). Nothing a client sends can stop the server or
//! make it allocate beyond [`Limits`].

use std::collections::HashSet;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use super::super::protocol::{self, Limits, ProtocolError, Reply, Request};
use super::super::state::{KvState, WaitId};

/// A wait token: the connection's channel and the wait's own number on it.
type Token = (mpsc::UnboundedSender<u64>, u64);
type State = KvState<Token>;

/// Server settings.
#[derive(Debug, Clone)]
pub struct TcpStoreServerOptions {
    /// Size limits on keys, values and requests.
    pub limits: Limits,
    /// How long a new connection may stay silent before `VALIDATE`.
    pub handshake_timeout: Duration,
    /// Most connections served at once; more are closed on accept.
    pub max_connections: usize,
    /// How long [`TcpStoreServer::shutdown`] lets connected clients finish
    /// before closing them.
    pub shutdown_grace: Duration,
}

impl Default for TcpStoreServerOptions {
    fn default() -> Self {
        Self {
            limits: Limits::default(),
            handshake_timeout: Duration::from_secs(30),
            max_connections: 65_536,
            shutdown_grace: Duration::from_secs(5),
        }
    }
}

struct Shared {
    state: Mutex<State>,
    options: TcpStoreServerOptions,
    /// How many connections are open; shutdown waits for it to reach 0.
    connections: watch::Sender<usize>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing panics while holding the lock; keep serving if it ever does.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// A running store server. [`TcpStoreServer::shutdown`] stops accepting and
/// lets connected clients finish; dropping it closes everything at once.
#[derive(Debug)]
pub struct TcpStoreServer {
    local_addr: SocketAddr,
    shutdown: watch::Sender<bool>,
    accept_task: Option<JoinHandle<()>>,
    connections: watch::Receiver<usize>,
    grace: Duration,
}

impl TcpStoreServer {
    /// Binds `addr` (port 0 picks a free port) and serves on the current tokio runtime.
    pub async fn bind(addr: SocketAddr, options: TcpStoreServerOptions) -> io::Result<Self> {
        let listener = bind_listener(addr)?;
        Ok(Self::serve(listener, options))
    }

    /// Serves on an already bound listener.
    pub fn serve(listener: TcpListener, options: TcpStoreServerOptions) -> Self {
        raise_fd_limit();
        let local_addr = listener
            .local_addr()
            .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
        let shared = Arc::new(Shared {
            state: Mutex::new(KvState::new(options.limits.max_value)),
            options,
            connections: watch::Sender::new(0),
        });
        let connections = shared.connections.subscribe();
        let grace = shared.options.shutdown_grace;
        let (shutdown, stop) = watch::channel(false);
        let accept_task = tokio::spawn(accept_loop(listener, shared, stop));
        tracing::debug!(%local_addr, "store server listening");
        Self {
            local_addr,
            shutdown,
            accept_task: Some(accept_task),
            connections,
            grace,
        }
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops accepting, waits up to the grace period for connected clients to
    /// leave (a rank that hosts the store must not cut off ranks still reading
    /// their last reply), then closes the rest.
    pub async fn shutdown(mut self) {
        if let Some(task) = self.accept_task.take() {
            task.abort();
            let _ = task.await;
        }
        let _ = tokio::time::timeout(self.grace, self.connections.wait_for(|&open| open == 0)).await;
        let _ = self.shutdown.send(true);
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        let _ = self.shutdown.send(true);
        if let Some(task) = &self.accept_task {
            task.abort();
        }
    }
}

/// Binds with SO_REUSEADDR (a restarted job reuses its port at once) and a deep backlog.
fn bind_listener(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = socket2::Socket::new(socket2::Domain::for_address(addr), socket2::Type::STREAM, None)?;
    socket.set_reuse_address(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(4096)?;
    TcpListener::from_std(socket.into())
}

/// Lifts the soft open-file limit to the hard one: a store serves one
/// connection per rank, and 1024 is a common soft default.
fn raise_fd_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write the struct we pass.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    loop {
        let accepted = tokio::select! {
            _ = stop.changed() => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                if *shared.connections.borrow() >= shared.options.max_connections {
                    tracing::warn!(%peer, limit = shared.options.max_connections, "store: connection refused, too many connections");
                    continue;
                }
                shared.connections.send_modify(|open| *open += 1);
                let _ = stream.set_nodelay(true);
                let shared = shared.clone();
                let stop = stop.clone();
                tokio::spawn(async move {
                    match serve_connection(stream, &shared, stop).await {
                        Ok(()) => tracing::trace!(%peer, "store: client disconnected"),
                        Err(reason) => tracing::warn!(%peer, %reason, "store: closing connection"),
                    }
                    shared.connections.send_modify(|open| *open -= 1);
                });
            }
            Err(err) => {
                // EMFILE and friends: back off instead of spinning; connections already open keep working.
                tracing::warn!(error = %err, "store: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Why a connection was closed by the server.
#[derive(Debug, thiserror::Error)]
enum CloseReason {
    #[error("protocol error: {0}")]
    Protocol(#[from] ProtocolError),
    #[error("io error: {0}")]
    Io(#[from] io::Error),
    #[error("no VALIDATE within {0:?}")]
    SilentClient(Duration),
    #[error("refused {op}: {source}")]
    Refused {
        op: &'static str,
        source: super::super::state::StateError,
    },
}

struct Connection<'a> {
    shared: &'a Shared,
    waits: HashSet<WaitId>,
    /// Wait numbers on this connection, to map a fired token back to its id.
    wait_ids: std::collections::HashMap<u64, WaitId>,
    next_wait: u64,
    wake_tx: mpsc::UnboundedSender<u64>,
}

impl Drop for Connection<'_> {
    fn drop(&mut self) {
        // A client gone mid-wait leaves nothing registered behind.
        if !self.waits.is_empty() {
            let mut state = self.shared.lock();
            for id in self.waits.drain() {
                state.cancel_wait(id);
            }
        }
    }
}

async fn serve_connection(
    mut stream: TcpStream,
    shared: &Shared,
    mut stop: watch::Receiver<bool>,
) -> Result<(), CloseReason> {
    let limits = shared.options.limits;
    let mut inbuf = BytesMut::with_capacity(8 * 1024);
    let mut outbuf = BytesMut::with_capacity(8 * 1024);
    let (wake_tx, mut wake_rx) = mpsc::unbounded_channel();
    let mut conn = Connection {
        shared,
        waits: HashSet::new(),
        wait_ids: Default::default(),
        next_wait: 0,
        wake_tx,
    };

    // Handshake: the first message must be VALIDATE with the magic.
    let handshake = async {
        loop {
            if let Some(request) = protocol::decode_request(&mut inbuf, &limits)? {
                return match request {
                    Request::Validate {
                        magic: protocol::VALIDATION_MAGIC,
                    } => Ok(()),
                    other => Err(CloseReason::Protocol(ProtocolError::BadHandshake(format!("{other:?}")))),
                };
            }
            if stream.read_buf(&mut inbuf).await? == 0 {
                return Err(CloseReason::Io(io::ErrorKind::UnexpectedEof.into()));
            }
        }
    };
    match tokio::time::timeout(shared.options.handshake_timeout, handshake).await {
        Ok(Ok(())) => {}
        Ok(Err(CloseReason::Io(e))) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
        Ok(Err(reason)) => return Err(reason),
        Err(_) => return Err(CloseReason::SilentClient(shared.options.handshake_timeout)),
    }

    loop {
        while let Some(request) = protocol::decode_request(&mut inbuf, &limits)? {
            conn.handle(request, &mut outbuf)?;
        }
        if !outbuf.is_empty() {
            stream.write_all_buf(&mut outbuf).await?;
        }
        tokio::select! {
            read = stream.read_buf(&mut inbuf) => {
                if read? == 0 {
                    return Ok(());
                }
            }
            Some(number) = wake_rx.recv() => {
                if let Some(id) = conn.wait_ids.remove(&number) {
                    conn.waits.remove(&id);
                    protocol::encode_reply(&Reply::U8(protocol::WAIT_STOP_WAITING), &mut outbuf);
                }
            }
            _ = stop.changed() => {
                // Waits completed before the stop are answered, so a rank
                // released by the last barrier hears it before the server goes.
                while let Ok(number) = wake_rx.try_recv() {
                    if conn.wait_ids.remove(&number).is_some() {
                        protocol::encode_reply(&Reply::U8(protocol::WAIT_STOP_WAITING), &mut outbuf);
                    }
                }
                stream.write_all_buf(&mut outbuf).await?;
                return Ok(());
            }
        }
    }
}

fn wake(tokens: Vec<Token>) {
    for (channel, number) in tokens {
        // The connection may be gone; its waits were cancelled on drop.
        let _ = channel.send(number);
    }
}

impl Connection<'_> {
    fn handle(&mut self, request: Request, out: &mut BytesMut) -> Result<(), CloseReason> {
        let reply = match request {
            Request::Validate { .. } => Reply::Nothing,
            Request::Set { key, value } => {
                let woken = self.shared.lock().set(key, value);
                wake(woken);
                Reply::Nothing
            }
            Request::CompareSet { key, expected, desired } => {
                let (current, woken) = self.shared.lock().compare_set(key, expected, desired);
                wake(woken);
                Reply::Value(current)
            }
            // PyTorch's server answers a missing key with an empty value.
            Request::Get { key } => Reply::Value(self.shared.lock().get(&key).unwrap_or_default()),
            Request::Add { key, delta } => {
                let result = self.shared.lock().add(key, delta);
                let (value, woken) = result.map_err(|source| CloseReason::Refused { op: "ADD", source })?;
                wake(woken);
                Reply::I64(value)
            }
            Request::Check { keys } => Reply::U8(if self.shared.lock().check(&keys) {
                protocol::CHECK_READY
            } else {
                protocol::CHECK_NOT_READY
            }),
            Request::Wait { keys } => {
                let number = self.next_wait_number();
                let registered = self.shared.lock().register_wait(&keys, (self.wake_tx.clone(), number));
                self.waiting(number, registered.ok())
            }
            Request::GetNumKeys => Reply::I64(self.shared.lock().num_keys()),
            Request::DeleteKey { key } => Reply::I64(self.shared.lock().delete(&key)),
            Request::Append { key, value } => {
                let result = self.shared.lock().append(key, &value);
                wake(result.map_err(|source| CloseReason::Refused { op: "APPEND", source })?);
                Reply::Nothing
            }
            Request::MultiGet { keys } => {
                let state = self.shared.lock();
                Reply::Values(keys.iter().map(|k| state.get(k).unwrap_or_default()).collect())
            }
            Request::MultiSet { pairs } => {
                let woken: Vec<_> = {
                    let mut state = self.shared.lock();
                    pairs
                        .into_iter()
                        .flat_map(|(key, value)| state.set(key, value))
                        .collect()
                };
                wake(woken);
                Reply::Nothing
            }
            Request::CancelWait => self.cancel_waits(),
            Request::Ping { nonce } => Reply::U32(nonce),
            Request::QueuePush { key, value } => {
                let woken = self.shared.lock().queue_push(key, value);
                wake(woken);
                Reply::Nothing
            }
            Request::QueuePop { key } => match self.shared.lock().queue_pop(&key) {
                Some((len_before, value)) => Reply::PoppedFrom { len_before, value },
                None => Reply::Popped(None),
            },
            Request::QueueLen { key } => Reply::I64(self.shared.lock().queue_len(&key)),
            Request::ListKeys => Reply::Keys(self.shared.lock().keys()),
            Request::Barrier { key, world_size } => {
                let number = self.next_wait_number();
                let result = self
                    .shared
                    .lock()
                    .barrier(key, world_size, (self.wake_tx.clone(), number));
                let (registered, woken) = result.map_err(|source| CloseReason::Refused { op: "BARRIER", source })?;
                wake(woken);
                self.waiting(number, registered.ok())
            }
        };
        protocol::encode_reply(&reply, out);
        Ok(())
    }

    /// The number of this connection's next wait, which its wake-up names.
    fn next_wait_number(&mut self) -> u64 {
        self.next_wait += 1;
        self.next_wait - 1
    }

    /// The reply to a wait (`WAIT`, `BARRIER`) the store registered as `id`
    /// (answered once it is woken), or did not (already satisfied).
    fn waiting(&mut self, number: u64, id: Option<WaitId>) -> Reply {
        match id {
            None => Reply::U8(protocol::WAIT_STOP_WAITING),
            Some(id) => {
                self.waits.insert(id);
                self.wait_ids.insert(number, id);
                Reply::Nothing
            }
        }
    }

    fn cancel_waits(&mut self) -> Reply {
        let mut state = self.shared.lock();
        for id in self.waits.drain() {
            state.cancel_wait(id);
        }
        self.wait_ids.clear();
        Reply::U8(protocol::WAIT_CANCELED)
    }
}
