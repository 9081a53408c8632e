//! The collectives of `torch.distributed`, on [`ProcessGroup`].
//!
//! Each call submits an operation to the rank's actor and returns a [`Work`]
//! at once (PyTorch's `async_op=True`): await it, or [`Work::wait`] with a
//! timeout. Operations run in submission order. Buffers are moved in and
//! handed back; the handle is `Send` and works from any tokio runtime.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use chorus_actors::driver::CollectiveError;
use chorus_actors::rank::Collective;
use chorus_runtime::collective::{CollectiveKind, DType, ReduceOp};

use crate::group::ProcessGroup;
use crate::tensor::Tensor;

type Pending<T> = Pin<Box<dyn Future<Output = Result<T, CollectiveError>> + Send>>;

/// An operation in flight.
#[must_use = "a collective runs whether or not its Work is awaited, but its result and errors are in the Work"]
pub struct Work<T> {
    pending: Pending<T>,
}

impl<T> std::fmt::Debug for Work<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Work(..)")
    }
}

impl<T: Send + 'static> Work<T> {
    fn new(pending: impl Future<Output = Result<T, CollectiveError>> + Send + 'static) -> Self {
        Self {
            pending: Box::pin(pending),
        }
    }

    fn failed(error: CollectiveError) -> Self {
        Self::new(async move { Err(error) })
    }

    /// Waits up to `timeout` (PyTorch's `work.wait(timeout)`); the operation
    /// keeps its own deadline either way.
    pub async fn wait(self, timeout: Duration) -> Result<T, CollectiveError> {
        match tokio::time::timeout(timeout, self).await {
            Ok(result) => result,
            Err(_) => Err(CollectiveError::Broken(format!("work not finished within {timeout:?}"))),
        }
    }
}

impl<T> Future for Work<T> {
    type Output = Result<T, CollectiveError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.pending.as_mut().poll(cx)
    }
}

fn length_error(what: &str, detail: String) -> CollectiveError {
    CollectiveError::Protocol {
        peer: usize::MAX,
        reason: format!("{what}: {detail}"),
    }
}

impl ProcessGroup {
    fn submit(&self, op: Collective) -> Work<Vec<u8>> {
        let request = self.actor.send(op);
        Work::new(async move {
            request
                .await
                .map_err(|_| CollectiveError::Broken("the rank's actor has stopped".into()))?
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn collective(
        &self,
        kind: CollectiveKind,
        dtype: DType,
        count: usize,
        root: Option<usize>,
        op: Option<ReduceOp>,
        input: Bytes,
        output: Vec<u8>,
    ) -> Work<Vec<u8>> {
        self.submit(Collective {
            kind,
            dtype,
            count,
            root,
            op,
            input,
            output,
            timeout: None,
        })
    }

    /// Every rank ends with the reduction of every rank's `tensor`.
    pub fn all_reduce(&self, tensor: Tensor, op: ReduceOp) -> Work<Tensor> {
        let (dtype, count) = (tensor.dtype(), tensor.len());
        let work = self.collective(
            CollectiveKind::AllReduce,
            dtype,
            count,
            None,
            Some(op),
            Bytes::new(),
            tensor.into_bytes(),
        );
        Work::new(async move { Ok(Tensor::from_bytes(dtype, work.await?)) })
    }

    /// Every rank ends with `root`'s `tensor`.
    pub fn broadcast(&self, tensor: Tensor, root: usize) -> Work<Tensor> {
        let (dtype, count) = (tensor.dtype(), tensor.len());
        let work = self.collective(
            CollectiveKind::Broadcast,
            dtype,
            count,
            Some(root),
            None,
            Bytes::new(),
            tensor.into_bytes(),
        );
        Work::new(async move { Ok(Tensor::from_bytes(dtype, work.await?)) })
    }

    /// `root` ends with the reduction; other ranks' tensors come back unspecified.
    pub fn reduce(&self, tensor: Tensor, root: usize, op: ReduceOp) -> Work<Tensor> {
        let (dtype, count) = (tensor.dtype(), tensor.len());
        let work = self.collective(
            CollectiveKind::Reduce,
            dtype,
            count,
            Some(root),
            Some(op),
            Bytes::new(),
            tensor.into_bytes(),
        );
        Work::new(async move { Ok(Tensor::from_bytes(dtype, work.await?)) })
    }

    /// Every rank ends with every rank's `tensor`, concatenated in rank order.
    pub fn all_gather(&self, tensor: Tensor) -> Work<Tensor> {
        let (dtype, count) = (tensor.dtype(), tensor.len());
        let output = vec![0; tensor.as_bytes().len() * self.world_size()];
        let work = self.collective(
            CollectiveKind::AllGather,
            dtype,
            count,
            None,
            None,
            Bytes::from(tensor.into_bytes()),
            output,
        );
        Work::new(async move { Ok(Tensor::from_bytes(dtype, work.await?)) })
    }

    /// `root` ends with every rank's `tensor` concatenated in rank order; the
    /// other ranks get an empty tensor.
    pub fn gather(&self, tensor: Tensor, root: usize) -> Work<Tensor> {
        let (dtype, count) = (tensor.dtype(), tensor.len());
        let output = if self.rank() == root {
            vec![0; tensor.as_bytes().len() * self.world_size()]
        } else {
            Vec::new()
        };
        let work = self.collective(
            CollectiveKind::Gather,
            dtype,
            count,
            Some(root),
            None,
            Bytes::from(tensor.into_bytes()),
            output,
        );
        Work::new(async move { Ok(Tensor::from_bytes(dtype, work.await?)) })
    }

    /// Rank `i` ends with block `i` of `root`'s `chunks` (`count * world`
    /// elements; other ranks pass `None`).
    pub fn scatter(&self, chunks: Option<Tensor>, dtype: DType, count: usize, root: usize) -> Work<Tensor> {
        let input = match (chunks, self.rank() == root) {
            (Some(t), true) if t.dtype() == dtype && t.len() == count * self.world_size() => {
                Bytes::from(t.into_bytes())
            }
            (Some(t), true) => {
                return Work::failed(length_error(
                    "scatter",
                    format!(
                        "the root's tensor must be {} x {dtype}, not {} x {}",
                        count * self.world_size(),
                        t.len(),
                        t.dtype()
                    ),
                ));
            }
            (None, true) => return Work::failed(length_error("scatter", "the root must pass the chunks".into())),
            (_, false) => Bytes::new(),
        };
        let work = self.collective(
            CollectiveKind::Scatter,
            dtype,
            count,
            Some(root),
            None,
            input,
            vec![0; count * dtype.size()],
        );
        Work::new(async move { Ok(Tensor::from_bytes(dtype, work.await?)) })
    }

    /// Rank `i` ends with the reduction of every rank's block `i` of
    /// `tensor` (`count * world` elements; returns `count`).
    pub fn reduce_scatter(&self, tensor: Tensor, op: ReduceOp) -> Work<Tensor> {
        let (dtype, world, rank) = (tensor.dtype(), self.world_size(), self.rank());
        if !tensor.len().is_multiple_of(world) {
            return Work::failed(length_error(
                "reduce_scatter",
                format!("{} elements do not split into {world} equal blocks", tensor.len()),
            ));
        }
        let count = tensor.len() / world;
        let work = self.collective(
            CollectiveKind::ReduceScatter,
            dtype,
            count,
            None,
            Some(op),
            Bytes::new(),
            tensor.into_bytes(),
        );
        Work::new(async move {
            let bytes = work.await?;
            let block = count * dtype.size();
            Ok(Tensor::from_bytes(
                dtype,
                bytes[rank * block..(rank + 1) * block].to_vec(),
            ))
        })
    }

    /// Block `j` of this rank's `tensor` goes to rank `j`; block `i` of the
    /// result comes from rank `i`.
    pub fn all_to_all(&self, tensor: Tensor) -> Work<Tensor> {
        let (dtype, world) = (tensor.dtype(), self.world_size());
        if !tensor.len().is_multiple_of(world) {
            return Work::failed(length_error(
                "all_to_all",
                format!("{} elements do not split into {world} equal blocks", tensor.len()),
            ));
        }
        let count = tensor.len() / world;
        let output = vec![0; tensor.as_bytes().len()];
        let work = self.collective(
            CollectiveKind::AllToAll,
            dtype,
            count,
            None,
            None,
            Bytes::from(tensor.into_bytes()),
            output,
        );
        Work::new(async move { Ok(Tensor::from_bytes(dtype, work.await?)) })
    }

    /// Returns once every rank has entered.
    pub fn barrier(&self) -> Work<()> {
        let work = self.collective(
            CollectiveKind::Barrier,
            DType::UInt8,
            0,
            None,
            None,
            Bytes::new(),
            Vec::new(),
        );
        Work::new(async move { work.await.map(drop) })
    }

    /// Sends `tensor` to rank `to` (matched by its `recv` from this rank).
    pub fn send(&self, tensor: Tensor, to: usize) -> Work<()> {
        let (dtype, count) = (tensor.dtype(), tensor.len());
        let work = self.collective(
            CollectiveKind::Send,
            dtype,
            count,
            Some(to),
            None,
            Bytes::from(tensor.into_bytes()),
            Vec::new(),
        );
        Work::new(async move { work.await.map(drop) })
    }

    /// Receives `count` elements of `dtype` from rank `from`.
    pub fn recv(&self, dtype: DType, count: usize, from: usize) -> Work<Tensor> {
        let work = self.collective(
            CollectiveKind::Recv,
            dtype,
            count,
            Some(from),
            None,
            Bytes::new(),
            vec![0; count * dtype.size()],
        );
        Work::new(async move { Ok(Tensor::from_bytes(dtype, work.await?)) })
    }
}
