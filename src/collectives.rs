//! The collectives of `torch.distributed`, on [`ProcessGroup`].
//!
//! Each call submits an operation to the rank's actor and returns a [`Work`]
//! at once (PyTorch's `async_op=True`): await it, or [`Work::wait`] with a
//! timeout. Operations run in submission order. Buffers are moved in and
//! handed back; the handle is `Send` and works from any tokio runtime.
//!
//! # Cancel safety
//!
//! The collectives themselves are not `async`: each submits at once and
//! returns a [`Work`]. What dropping a [`Work`] (or a future awaiting it,
//! such as [`Work::wait`] or a `select!` branch) does depends on whether
//! the rank's actor has started the operation; see [`Work`].

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use chorus_actors::buffer::Buffer;
use chorus_actors::driver::CollectiveError;
use chorus_actors::rank::{Collective, Completed, Submit};
use chorus_runtime::collective::{CollectiveKind, DType, ReduceOp};

use crate::group::ProcessGroup;
use crate::tensor::Tensor;

type Pending<T> = Pin<Box<dyn Future<Output = Result<T, CollectiveError>> + Send>>;

/// An operation in flight.
///
/// # Cancel safety
///
/// Cancel safe in the sense that matters to the peers: the operation is
/// queued when the collective is called and runs in its turn whether or
/// not the `Work` is kept (RA-1), as a `torch.distributed` collective does.
/// Dropping the `Work` (or a future awaiting it: a `select!`, a
/// [`Work::wait`] that gave up) loses only its result and error: the
/// operation completes, or fails by its own deadline, with the peers, and
/// later operations queue behind it in step.
#[must_use = "the operation runs whether or not its Work is kept, but its result and errors are in the Work"]
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
    ///
    /// # Cancel safety
    ///
    /// As [`Work`]'s: giving up here after the operation started leaves it
    /// running in the background.
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

/// An operation of `kind` over `count` elements of `dtype` per rank, with
/// no root, operator or buffers yet (in-place operations fill `output`).
fn operation(kind: CollectiveKind, dtype: DType, count: usize) -> Collective {
    Collective {
        kind,
        dtype,
        count,
        root: None,
        op: None,
        input: Bytes::new(),
        output: Buffer::default(),
        timeout: None,
        tag: 0,
    }
}

impl ProcessGroup {
    fn submit_completed(&self, op: Collective) -> Work<Completed> {
        let (reply, result) = tokio::sync::oneshot::channel();
        // Queued now and run in its turn whether or not the Work is kept (RA-1).
        self.actor.do_send(Submit { op, reply });
        Work::new(async move {
            result
                .await
                .map_err(|_| CollectiveError::Broken("the rank's actor has stopped".into()))?
        })
    }

    fn submit(&self, op: Collective) -> Work<Buffer> {
        let work = self.submit_completed(op);
        Work::new(async move { Ok(work.await?.output) })
    }

    /// Submits a receive as given ([`submit_tensor`](Self::submit_tensor)),
    /// `root: None` taking the first message of its tag from any rank, and
    /// hands back its output and the rank it came from.
    pub fn submit_recv(&self, op: Collective) -> Work<(Tensor, usize)> {
        let dtype = op.dtype;
        let work = self.submit_completed(op);
        Work::new(async move {
            let completed = work.await?;
            let from = completed
                .peer
                .ok_or_else(|| CollectiveError::Broken("a receive named no sender".into()))?;
            Ok((Tensor::from_buffer(dtype, completed.output), from))
        })
    }

    /// Submits `op` as given, its buffers included, and hands its output
    /// back as a tensor of its dtype: the entry point for bindings, which
    /// lend their own memory ([`Tensor::from_raw_parts`], then
    /// [`Tensor::into_shared`] for the input and [`Tensor::into_buffer`]
    /// for the output) so it is reduced in place. Buffer lengths are
    /// checked against the operation before anything runs
    /// ([`CollectiveError::BufferSize`]).
    pub fn submit_tensor(&self, op: Collective) -> Work<Tensor> {
        let dtype = op.dtype;
        let work = self.submit(op);
        Work::new(async move { Ok(Tensor::from_buffer(dtype, work.await?)) })
    }

    /// Submits `op`, whose output is of no interest.
    fn submit_unit(&self, op: Collective) -> Work<()> {
        let work = self.submit(op);
        Work::new(async move { work.await.map(drop) })
    }

    /// `tensor`'s elements as `world` equal blocks, or an error naming `what`.
    fn blocks(&self, what: &str, tensor: &Tensor) -> Result<usize, CollectiveError> {
        let world = self.world_size();
        if tensor.len().is_multiple_of(world) {
            Ok(tensor.len() / world)
        } else {
            Err(length_error(
                what,
                format!("{} elements do not split into {world} equal blocks", tensor.len()),
            ))
        }
    }

    /// Every rank ends with the reduction of every rank's `tensor`.
    pub fn all_reduce(&self, tensor: Tensor, op: ReduceOp) -> Work<Tensor> {
        self.submit_tensor(
            Collective {
                op: Some(op),
                ..operation(CollectiveKind::AllReduce, tensor.dtype(), tensor.len())
            }
            .with_output(tensor),
        )
    }

    /// Out of place, as NCCL's `ncclAllReduce(sendbuff, recvbuff)`: every
    /// rank ends with the reduction of every rank's `input` in `output`,
    /// which is handed back. `input` (elements of `output`'s dtype, as many)
    /// is only read, so a caller that keeps it shares it (`Bytes::clone`)
    /// instead of copying it into `output` first: the first reduction of
    /// each region reads it. `output`'s contents before do not matter. Other
    /// ranks may call [`all_reduce`](Self::all_reduce) for the same operation.
    pub fn all_reduce_into(&self, input: Bytes, output: Tensor, op: ReduceOp) -> Work<Tensor> {
        let want = output.as_bytes().len();
        if input.len() != want {
            return Work::failed(length_error(
                "all_reduce_into",
                format!("the input has {} bytes, the output {want}", input.len()),
            ));
        }
        self.submit_tensor(
            Collective {
                op: Some(op),
                input,
                ..operation(CollectiveKind::AllReduce, output.dtype(), output.len())
            }
            .with_output(output),
        )
    }

    /// Every rank ends with `root`'s `tensor`.
    pub fn broadcast(&self, tensor: Tensor, root: usize) -> Work<Tensor> {
        self.submit_tensor(
            Collective {
                root: Some(root),
                ..operation(CollectiveKind::Broadcast, tensor.dtype(), tensor.len())
            }
            .with_output(tensor),
        )
    }

    /// `root` ends with the reduction; other ranks' tensors come back unspecified.
    pub fn reduce(&self, tensor: Tensor, root: usize, op: ReduceOp) -> Work<Tensor> {
        self.submit_tensor(
            Collective {
                root: Some(root),
                op: Some(op),
                ..operation(CollectiveKind::Reduce, tensor.dtype(), tensor.len())
            }
            .with_output(tensor),
        )
    }

    /// Every rank ends with every rank's `tensor`, concatenated in rank order.
    pub fn all_gather(&self, tensor: Tensor) -> Work<Tensor> {
        self.submit_tensor(
            Collective {
                output: vec![0; tensor.as_bytes().len() * self.world_size()].into(),
                ..operation(CollectiveKind::AllGather, tensor.dtype(), tensor.len())
            }
            .with_input(tensor),
        )
    }

    /// `root` ends with every rank's `tensor` concatenated in rank order; the
    /// other ranks get an empty tensor.
    pub fn gather(&self, tensor: Tensor, root: usize) -> Work<Tensor> {
        let gathered = if self.rank() == root {
            tensor.as_bytes().len() * self.world_size()
        } else {
            0
        };
        self.submit_tensor(
            Collective {
                root: Some(root),
                output: vec![0; gathered].into(),
                ..operation(CollectiveKind::Gather, tensor.dtype(), tensor.len())
            }
            .with_input(tensor),
        )
    }

    /// Rank `i` ends with block `i` of `root`'s `chunks` (`count * world`
    /// elements; other ranks pass `None`).
    pub fn scatter(&self, chunks: Option<Tensor>, dtype: DType, count: usize, root: usize) -> Work<Tensor> {
        let scatter = Collective {
            root: Some(root),
            output: vec![0; count * dtype.size()].into(),
            ..operation(CollectiveKind::Scatter, dtype, count)
        };
        match (chunks, self.rank() == root) {
            (Some(t), true) if t.dtype() == dtype && t.len() == count * self.world_size() => {
                self.submit_tensor(scatter.with_input(t))
            }
            (Some(t), true) => Work::failed(length_error(
                "scatter",
                format!(
                    "the root's tensor must be {} x {dtype}, not {} x {}",
                    count * self.world_size(),
                    t.len(),
                    t.dtype()
                ),
            )),
            (None, true) => Work::failed(length_error("scatter", "the root must pass the chunks".into())),
            (_, false) => self.submit_tensor(scatter),
        }
    }

    /// Rank `i` ends with the reduction of every rank's block `i` of
    /// `tensor` (`count * world` elements; returns `count`).
    pub fn reduce_scatter(&self, tensor: Tensor, op: ReduceOp) -> Work<Tensor> {
        let count = match self.blocks("reduce_scatter", &tensor) {
            Ok(count) => count,
            Err(e) => return Work::failed(e),
        };
        let (dtype, rank) = (tensor.dtype(), self.rank());
        let work = self.submit(
            Collective {
                op: Some(op),
                ..operation(CollectiveKind::ReduceScatter, dtype, count)
            }
            .with_output(tensor),
        );
        Work::new(async move {
            let block = count * dtype.size();
            Ok(Tensor::from_bytes(
                dtype,
                work.await?[rank * block..(rank + 1) * block].to_vec(),
            ))
        })
    }

    /// Block `j` of this rank's `tensor` goes to rank `j`; block `i` of the
    /// result comes from rank `i`.
    pub fn all_to_all(&self, tensor: Tensor) -> Work<Tensor> {
        let count = match self.blocks("all_to_all", &tensor) {
            Ok(count) => count,
            Err(e) => return Work::failed(e),
        };
        self.submit_tensor(
            Collective {
                output: vec![0; tensor.as_bytes().len()].into(),
                ..operation(CollectiveKind::AllToAll, tensor.dtype(), count)
            }
            .with_input(tensor),
        )
    }

    /// Returns once every rank has entered.
    pub fn barrier(&self) -> Work<()> {
        self.submit_unit(operation(CollectiveKind::Barrier, DType::UInt8, 0))
    }

    /// Sends `tensor` to rank `to` (matched by its `recv` from this rank).
    /// Sends and receives run as soon as they are submitted, beside the
    /// collectives (a receive may be posted before its send, on either
    /// side); those between two ranks with one tag pair up in order.
    pub fn send(&self, tensor: Tensor, to: usize) -> Work<()> {
        self.send_tagged(tensor, to, 0)
    }

    /// [`send`](Self::send) with a tag: only a receive of the same tag
    /// takes it.
    pub fn send_tagged(&self, tensor: Tensor, to: usize, tag: u64) -> Work<()> {
        self.submit_unit(
            Collective {
                root: Some(to),
                tag,
                ..operation(CollectiveKind::Send, tensor.dtype(), tensor.len())
            }
            .with_input(tensor),
        )
    }

    /// Receives `count` elements of `dtype` from rank `from`.
    pub fn recv(&self, dtype: DType, count: usize, from: usize) -> Work<Tensor> {
        self.recv_tagged(dtype, count, from, 0)
    }

    /// [`recv`](Self::recv) of the messages sent with `tag`.
    pub fn recv_tagged(&self, dtype: DType, count: usize, from: usize, tag: u64) -> Work<Tensor> {
        self.submit_tensor(Collective {
            root: Some(from),
            tag,
            output: vec![0; count * dtype.size()].into(),
            ..operation(CollectiveKind::Recv, dtype, count)
        })
    }

    /// Receives the first message sent to this rank with `tag` by any rank:
    /// the tensor and its sender.
    pub fn recv_any(&self, dtype: DType, count: usize, tag: u64) -> Work<(Tensor, usize)> {
        self.submit_recv(Collective {
            tag,
            output: vec![0; count * dtype.size()].into(),
            ..operation(CollectiveKind::Recv, dtype, count)
        })
    }
}

/// Moving a tensor's buffer into an operation, without a copy.
trait Buffers {
    /// `tensor` as the read-only input.
    fn with_input(self, tensor: Tensor) -> Self;
    /// `tensor` as the in-place output.
    fn with_output(self, tensor: Tensor) -> Self;
}

impl Buffers for Collective {
    fn with_input(self, tensor: Tensor) -> Self {
        Collective {
            input: tensor.into_shared(),
            ..self
        }
    }

    fn with_output(self, tensor: Tensor) -> Self {
        Collective {
            output: tensor.into_buffer(),
            ..self
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::{CollectiveError, InitOptions, ReduceOp, Tensor, spawn_with};
    use std::time::Duration;

    fn first(tensor: &Tensor) -> f32 {
        tensor.to_vec::<f32>().expect("float32")[0]
    }

    async fn within<T>(what: &str, run: impl std::future::Future<Output = T>) -> T {
        tokio::time::timeout(Duration::from_secs(60), run)
            .await
            .unwrap_or_else(|_| panic!("{what} did not end within 60 s"))
    }

    /// A `Work` dropped after its operation started: the operation still
    /// runs with the peers, and the next one follows it in step.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_work_dropped_once_started_completes_in_the_background() {
        let sums = within(
            "2 ranks, one giving up on a started all-reduce",
            spawn_with(2, InitOptions::default(), |pg| async move {
                let rank = pg.rank() as f32;
                if pg.rank() == 0 {
                    // Rank 1 comes after 500 ms: this wait gives up half-way.
                    let gave_up = pg
                        .all_reduce(Tensor::from_slice(&[1.0f32]), ReduceOp::Sum)
                        .wait(Duration::from_millis(100))
                        .await;
                    assert!(gave_up.is_err(), "rank 1 had not come yet");
                } else {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    let first_sum = pg.all_reduce(Tensor::from_slice(&[10.0f32]), ReduceOp::Sum).await?;
                    assert_eq!(first(&first_sum), 11.0, "rank 0's dropped all-reduce ran");
                }
                let next = pg
                    .all_reduce(Tensor::from_slice(&[100.0 + rank]), ReduceOp::Sum)
                    .await?;
                Ok::<_, CollectiveError>(first(&next))
            }),
        )
        .await
        .expect("the group forms");
        for (rank, sum) in sums.into_iter().enumerate() {
            assert_eq!(sum.expect("in step"), 201.0, "rank {rank}");
        }
    }

    /// A `Work` dropped before the actor took it up: the operation runs in
    /// its turn all the same, so the ranks stay in step (RA-1).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ra1_a_work_dropped_before_it_started_still_runs_in_its_turn() {
        let options = InitOptions::default().collective_timeout(Duration::from_secs(10));
        let results = within(
            "2 ranks, one dropping a Work at once",
            spawn_with(2, options, |pg| async move {
                if pg.rank() == 0 {
                    drop(pg.all_reduce(Tensor::from_slice(&[1.0f32]), ReduceOp::Sum));
                    let sum = pg.all_reduce(Tensor::from_slice(&[2.0f32]), ReduceOp::Sum).await?;
                    return Ok::<_, CollectiveError>(vec![first(&sum)]);
                }
                let one = pg.all_reduce(Tensor::from_slice(&[10.0f32]), ReduceOp::Sum).await?;
                let two = pg.all_reduce(Tensor::from_slice(&[20.0f32]), ReduceOp::Sum).await?;
                Ok(vec![first(&one), first(&two)])
            }),
        )
        .await
        .expect("the group forms");
        let sums: Vec<Vec<f32>> = results
            .into_iter()
            .map(|r| r.expect("every all-reduce in step"))
            .collect();
        assert_eq!(
            sums,
            [vec![22.0], vec![11.0, 22.0]],
            "rank 0's dropped all-reduce did not run in its turn"
        );
    }
}
