//! Started collectives of the device backends (NCCL's and the device-local communicator's):
//! the handle's progress thread ([`super::progress`]) runs each on a communication stream of
//! its own, which waits for an event recorded on the rank's stream at the start; the wait
//! orders the rank's stream after an event recorded behind the call, and only then drops the
//! call's tensors, whose memory is freed on the rank's stream (which must not reuse it before).

use std::sync::Arc;

use parking_lot::Mutex;

use super::progress::Progress;
use super::{CallDesc, CommError, OpKind, Pending, ReduceOp, Result};
use crate::cuda::Gpu;
use crate::tensor::Tensor;

/// A device backend's handle, as its started collectives need it.
pub(crate) trait StreamStart: Sized + Send + 'static {
    /// The stream the handle's calls run on: the rank's, or the communication stream of the
    /// progress thread's runner handle.
    fn gpu(&self) -> &Gpu;

    /// The group's name.
    fn group(&self) -> &str;

    /// Checks that `t` is a tensor this backend moves, naming `op` otherwise.
    fn check_started(&self, op: &'static str, t: &Tensor) -> Result<()>;

    /// Starts `call` (described as `desc`) on the progress thread, keeping `keep` (its tensors)
    /// until the wait has ordered the rank's stream after it.
    fn start(
        &self,
        desc: &CallDesc,
        keep: Vec<Tensor>,
        call: impl FnOnce(&Self) -> Result<()> + Send + 'static,
    ) -> Result<Pending>;

    /// The started all-reduce: `call` runs the handle's blocking one.
    fn start_all_reduce_with(
        &self,
        tensor: &Tensor,
        op: ReduceOp,
        call: fn(&Self, &Tensor, ReduceOp) -> Result<()>,
    ) -> Result<Pending> {
        self.check_started("all_reduce", tensor)?;
        let desc = CallDesc::of(OpKind::AllReduce, tensor, Some(op), None);
        let t = tensor.clone();
        self.start(&desc, vec![tensor.clone()], move |c| call(c, &t, op))
    }

    /// The started reduce-scatter: `call` runs the handle's blocking one.
    fn start_reduce_scatter_with(
        &self,
        (input, output): (&Tensor, &Tensor),
        op: ReduceOp,
        call: fn(&Self, &Tensor, &Tensor, ReduceOp) -> Result<()>,
    ) -> Result<Pending> {
        self.check_started("reduce_scatter", input)?;
        self.check_started("reduce_scatter", output)?;
        let desc = CallDesc::of(OpKind::ReduceScatter, output, Some(op), None);
        let (i, o) = (input.clone(), output.clone());
        let keep = vec![input.clone(), output.clone()];
        self.start(&desc, keep, move |c| call(c, &i, &o, op))
    }

    /// The started all-gather: `call` runs the handle's blocking one.
    fn start_all_gather_with(
        &self,
        (input, output): (&Tensor, &Tensor),
        call: fn(&Self, &Tensor, &Tensor) -> Result<()>,
    ) -> Result<Pending> {
        self.check_started("all_gather", input)?;
        self.check_started("all_gather", output)?;
        let desc = CallDesc::of(OpKind::AllGather, input, None, None);
        let (i, o) = (input.clone(), output.clone());
        let keep = vec![input.clone(), output.clone()];
        self.start(&desc, keep, move |c| call(c, &i, &o))
    }
}

/// A CUDA call's failure on `group`.
fn cuda(group: &str, call: &'static str, e: impl std::fmt::Debug) -> CommError {
    CommError::Backend {
        group: group.to_string(),
        library: "CUDA",
        call,
        message: format!("{e:?}"),
    }
}

/// Runs `call` on `progress`'s thread with the runner handle `runner()` makes at the first
/// start (whose [`StreamStart::gpu`] is the communication stream), ordered after what `rank`'s
/// stream was given so far; the returned [`Pending`] orders `rank`'s stream after the call at
/// the wait, then drops `keep`.
pub(crate) fn on_comm_stream<C: StreamStart>(
    progress: &Progress<C>,
    (rank, group): (&Gpu, &str),
    desc: &CallDesc,
    runner: impl FnOnce() -> (C, String),
    keep: Vec<Tensor>,
    call: impl FnOnce(&C) -> Result<()> + Send + 'static,
) -> Result<Pending> {
    let ready = rank
        .stream()
        .record_event(None)
        .map_err(|e| cuda(group, "cuEventRecord", e))?;
    // The event the communication stream records after the call, which the rank's stream
    // waits for at the wait.
    let done = Arc::new(Mutex::new(None));
    let recorded = Arc::clone(&done);
    let pending = progress.start(group, desc, runner, move |c| {
        let stream = c.gpu().stream();
        c.gpu()
            .context()
            .bind_to_thread()
            .map_err(|e| cuda(c.group(), "cuCtxSetCurrent", e))?;
        stream
            .wait(&ready)
            .map_err(|e| cuda(c.group(), "cuStreamWaitEvent", e))?;
        call(c)?;
        let event = stream
            .record_event(None)
            .map_err(|e| cuda(c.group(), "cuEventRecord", e))?;
        *recorded.lock() = Some(event);
        Ok(())
    })?;
    let (stream, group) = (Arc::clone(rank.stream()), group.to_string());
    Ok(pending.after(move || {
        let Some(event) = done.lock().take() else {
            return Ok(());
        };
        let ordered = stream
            .wait(&event)
            .map_err(|e| cuda(&group, "cuStreamWaitEvent", e));
        drop(keep);
        ordered
    }))
}
