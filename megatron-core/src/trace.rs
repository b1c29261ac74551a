//! One step's timeline, per rank: its passes (forwards, backwards, weight gradients), the
//! step's phases (the walk, the gradient reduction, the optimizer) and every collective each of
//! its communicators ran, written as a Chrome trace (the JSON `chrome://tracing` and
//! ui.perfetto.dev open) so that where communication sits beside compute can be seen.
//!
//! A [`Trace`] records a rank's spans only between its [`Trace::start`] and [`Trace::stop`]
//! (the thread ranks of a process share one trace and its time origin, each starting and
//! stopping on its own). The passes and phases
//! reach it through the context ([`crate::module::Cx::with_trace`]) and the trainer
//! ([`crate::training::Trainer::set_trace`]); the collectives through a [`TracingWorld`], which
//! wraps any [`World`] and times each call of its communicators on the host (on a GPU, the
//! time to queue the call: the device's own timeline is not read). Each rank is a process of
//! the trace; its tracks (Chrome's threads) are `step`, `compute` and one per group (`comm
//! tp`, `comm pp`, ...).

use std::collections::{BTreeMap, BTreeSet};
use std::panic::Location;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::comm::{CallDesc, CommStats, Communicator, OpKind, Pending, ReduceOp, Result, World};
use crate::tensor::Tensor;

/// One timed interval of one rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Span {
    /// The global rank.
    pub rank: usize,
    /// Its track: `step`, `compute`, or `comm {group}`.
    pub track: String,
    /// What ran.
    pub name: String,
    /// Start, in microseconds since the trace started.
    pub start_us: f64,
    /// Duration, in microseconds.
    pub dur_us: f64,
    /// Details (a collective's bytes, a pass's chunk and microbatch).
    pub args: BTreeMap<String, Value>,
}

/// The spans of the ranks that record into it (the thread ranks of a process share one).
#[derive(Debug, Default)]
pub struct Trace {
    /// The ranks recording now.
    on: Mutex<BTreeSet<usize>>,
    /// The time origin: the first start.
    epoch: OnceLock<Instant>,
    spans: Mutex<Vec<Span>>,
}

impl Trace {
    /// A trace that records nothing until [`Trace::start`].
    pub fn new() -> Arc<Trace> {
        Arc::new(Trace::default())
    }

    /// Records `rank`'s spans from now on (the first rank to start sets the time origin).
    pub fn start(&self, rank: usize) {
        self.epoch.get_or_init(Instant::now);
        self.on
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(rank);
    }

    /// Stops recording `rank`'s spans.
    pub fn stop(&self, rank: usize) {
        self.on
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&rank);
    }

    /// Whether `rank`'s spans are recorded now.
    pub fn recording(&self, rank: usize) -> bool {
        self.on
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&rank)
    }

    /// Records `name` on `rank`'s `track` from `start` to `end`, when recording.
    pub fn record(
        &self,
        rank: usize,
        track: &str,
        name: String,
        (start, end): (Instant, Instant),
        args: BTreeMap<String, Value>,
    ) {
        let (true, Some(&epoch)) = (self.recording(rank), self.epoch.get()) else {
            return;
        };
        let us = |t: Instant| t.saturating_duration_since(epoch).as_secs_f64() * 1e6;
        let span = Span {
            rank,
            track: track.to_string(),
            name,
            start_us: us(start),
            dur_us: (us(end) - us(start)).max(0.0),
            args,
        };
        self.spans
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(span);
    }

    /// Runs `f`, recording it as `name` on `rank`'s `track`.
    pub fn timed<T>(&self, rank: usize, track: &str, name: &str, f: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = f();
        self.record(
            rank,
            track,
            name.to_string(),
            (start, Instant::now()),
            BTreeMap::new(),
        );
        out
    }

    /// The spans of `rank` recorded so far.
    pub fn spans_of(&self, rank: usize) -> Vec<Span> {
        let spans = self.spans.lock().unwrap_or_else(|p| p.into_inner());
        spans.iter().filter(|s| s.rank == rank).cloned().collect()
    }
}

/// The Chrome trace of `spans`: each rank a process (`rank r`), each track a thread, each span
/// a complete event (`ph: X`, microseconds).
pub fn chrome(spans: &[Span]) -> Value {
    let mut tracks: BTreeMap<(usize, String), usize> = BTreeMap::new();
    for s in spans {
        let next = tracks.keys().filter(|(r, _)| *r == s.rank).count();
        tracks.entry((s.rank, s.track.clone())).or_insert(next);
    }
    // `step` above `compute` above the groups.
    let order = |track: &str| match track {
        "step" => 0,
        "compute" => 1,
        _ => 2,
    };
    let mut events = Vec::new();
    let ranks: std::collections::BTreeSet<usize> = spans.iter().map(|s| s.rank).collect();
    for rank in ranks {
        events.push(json!({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": format!("rank {rank}")}}));
        events.push(json!({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}}));
    }
    for ((rank, track), tid) in &tracks {
        events.push(json!({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": track}}));
        events.push(json!({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid, "args": {"sort_index": order(track) * 1000 + tid}}));
    }
    for s in spans {
        let tid = tracks[&(s.rank, s.track.clone())];
        let cat = match s.track.as_str() {
            "step" | "compute" => s.track.as_str(),
            _ => "comm",
        };
        events.push(json!({
            "name": s.name,
            "cat": cat,
            "ph": "X",
            "ts": s.start_us,
            "dur": s.dur_us,
            "pid": s.rank,
            "tid": tid,
            "args": s.args,
        }));
    }
    json!({"traceEvents": events, "displayTimeUnit": "ms"})
}

/// A world whose communicators record each call into a [`Trace`] (when it records): the call's
/// kind, size and group, on the track `comm {group}` of the rank. The calls themselves are the
/// inner world's, unchanged.
pub struct TracingWorld<'a> {
    inner: &'a dyn World,
    trace: Arc<Trace>,
}

impl<'a> TracingWorld<'a> {
    /// Wraps `inner`, recording into `trace`.
    pub fn new(inner: &'a dyn World, trace: Arc<Trace>) -> Self {
        TracingWorld { inner, trace }
    }
}

impl World for TracingWorld<'_> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn communicator(&self, name: &str, ranks: &[usize]) -> Result<Arc<dyn Communicator>> {
        Ok(Arc::new(Traced {
            inner: self.inner.communicator(name, ranks)?,
            trace: self.trace.clone(),
            rank: self.inner.rank(),
            track: format!("comm {name}"),
        }))
    }
}

/// A communicator timing each call.
struct Traced {
    inner: Arc<dyn Communicator>,
    trace: Arc<Trace>,
    rank: usize,
    track: String,
}

impl Traced {
    /// What a span of call `desc` says beside its name: the group, the bytes, the line.
    fn args(&self, desc: &CallDesc, caller: &Location<'_>) -> BTreeMap<String, Value> {
        let mut args = BTreeMap::new();
        args.insert("group".into(), json!(self.inner.name()));
        args.insert("bytes".into(), json!(desc.count * desc.dtype.size()));
        args.insert("caller".into(), json!(caller.to_string()));
        args
    }

    /// Runs `call`, recording it as `desc` with the line that asked for it.
    #[track_caller]
    fn timed<T>(&self, desc: CallDesc, call: impl FnOnce() -> Result<T>) -> Result<T> {
        if !self.trace.recording(self.rank) {
            return call();
        }
        let args = self.args(&desc, Location::caller());
        let start = Instant::now();
        let out = call();
        let ran = (start, Instant::now());
        self.trace
            .record(self.rank, &self.track, desc.to_string(), ran, args);
        out
    }

    /// Starts `call`, recording it as `desc` over the interval it really ran in (on the
    /// backend's progress thread, while the rank computes), once it is waited for. One started
    /// before the trace records and waited for while it does (a parameter gather started after
    /// the previous step's update) is recorded from the trace's start, and says so.
    #[track_caller]
    fn started(&self, desc: CallDesc, call: impl FnOnce() -> Result<Pending>) -> Result<Pending> {
        let mut args = self.args(&desc, Location::caller());
        if !self.trace.recording(self.rank) {
            args.insert("started".into(), json!("before the traced step"));
        }
        let (trace, rank, track) = (self.trace.clone(), self.rank, self.track.clone());
        let name = format!("{desc} (started)");
        Ok(call()?.then(move |ran| trace.record(rank, &track, name, ran, args)))
    }
}

impl Communicator for Traced {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn ranks(&self) -> &[usize] {
        self.inner.ranks()
    }

    fn index(&self) -> usize {
        self.inner.index()
    }

    fn place(&self, tensor: &Tensor) -> Result<Tensor> {
        self.inner.place(tensor)
    }

    #[track_caller]
    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        let desc = CallDesc::of(OpKind::AllReduce, tensor, Some(op), None);
        self.timed(desc, || self.inner.all_reduce(tensor, op))
    }

    #[track_caller]
    fn all_gather(&self, input: &Tensor, output: &Tensor) -> Result<()> {
        let desc = CallDesc::of(OpKind::AllGather, input, None, None);
        self.timed(desc, || self.inner.all_gather(input, output))
    }

    #[track_caller]
    fn reduce_scatter(&self, input: &Tensor, output: &Tensor, op: ReduceOp) -> Result<()> {
        let desc = CallDesc::of(OpKind::ReduceScatter, output, Some(op), None);
        self.timed(desc, || self.inner.reduce_scatter(input, output, op))
    }

    #[track_caller]
    fn start_all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Pending> {
        let desc = CallDesc::of(OpKind::AllReduce, tensor, Some(op), None);
        self.started(desc, || self.inner.start_all_reduce(tensor, op))
    }

    #[track_caller]
    fn start_all_gather(&self, input: &Tensor, output: &Tensor) -> Result<Pending> {
        let desc = CallDesc::of(OpKind::AllGather, input, None, None);
        self.started(desc, || self.inner.start_all_gather(input, output))
    }

    #[track_caller]
    fn start_reduce_scatter(
        &self,
        input: &Tensor,
        output: &Tensor,
        op: ReduceOp,
    ) -> Result<Pending> {
        let desc = CallDesc::of(OpKind::ReduceScatter, output, Some(op), None);
        self.started(desc, || self.inner.start_reduce_scatter(input, output, op))
    }

    #[track_caller]
    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<()> {
        let desc = CallDesc::of(OpKind::Broadcast, tensor, None, Some(root));
        self.timed(desc, || self.inner.broadcast(tensor, root))
    }

    #[track_caller]
    fn all_to_all(
        &self,
        input: &Tensor,
        send_splits: &[usize],
        output: &Tensor,
        recv_splits: &[usize],
    ) -> Result<()> {
        let desc = CallDesc::of(OpKind::AllToAll, input, None, None);
        self.timed(desc, || {
            self.inner
                .all_to_all(input, send_splits, output, recv_splits)
        })
    }

    #[track_caller]
    fn send(&self, tensor: &Tensor, dst: usize) -> Result<()> {
        let desc = CallDesc::of(OpKind::Send, tensor, None, Some(dst));
        self.timed(desc, || self.inner.send(tensor, dst))
    }

    #[track_caller]
    fn recv(&self, tensor: &Tensor, src: usize) -> Result<()> {
        let desc = CallDesc::of(OpKind::Recv, tensor, None, Some(src));
        self.timed(desc, || self.inner.recv(tensor, src))
    }

    #[track_caller]
    fn exchange(&self, sends: &[(&Tensor, usize)], recvs: &[(&Tensor, usize)]) -> Result<()> {
        let s: Vec<&Tensor> = sends.iter().map(|(t, _)| *t).collect();
        let r: Vec<&Tensor> = recvs.iter().map(|(t, _)| *t).collect();
        self.timed(exchange_desc(&s, &r), || self.inner.exchange(sends, recvs))
    }

    #[track_caller]
    fn exchange_owned(
        &self,
        sends: Vec<(Tensor, usize)>,
        recvs: Vec<(Tensor, usize)>,
    ) -> Result<Vec<Tensor>> {
        let desc = {
            let s: Vec<&Tensor> = sends.iter().map(|(t, _)| t).collect();
            let r: Vec<&Tensor> = recvs.iter().map(|(t, _)| t).collect();
            exchange_desc(&s, &r)
        };
        self.timed(desc, || self.inner.exchange_owned(sends, recvs))
    }

    fn rendezvous(&self) -> bool {
        self.inner.rendezvous()
    }

    #[track_caller]
    fn barrier(&self) -> Result<()> {
        self.timed(CallDesc::barrier(), || self.inner.barrier())
    }

    fn flush(&self) -> Result<()> {
        self.inner.flush()
    }

    fn stats(&self) -> CommStats {
        self.inner.stats()
    }
}

/// A point-to-point exchange, described by its sends (their elements together), or by its
/// receives when it sends nothing.
fn exchange_desc(sends: &[&Tensor], recvs: &[&Tensor]) -> CallDesc {
    let (kind, tensors) = match sends.is_empty() {
        true => (OpKind::Recv, recvs),
        false => (OpKind::Send, sends),
    };
    match tensors.first() {
        Some(first) => CallDesc {
            count: tensors.iter().map(|t| t.numel()).sum(),
            ..CallDesc::of(kind, first, None, None)
        },
        None => CallDesc::barrier(),
    }
}
