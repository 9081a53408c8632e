//! The TCP store: PyTorch's TCPStore wire protocol over tokio sockets.

mod client;
mod server;

pub use client::{TcpStore, TcpStoreOptions};
pub use server::{TcpStoreServer, TcpStoreServerOptions};
