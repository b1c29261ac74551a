//! The scope boundary the macros generate: [`forward`] and [`backward`] run a scoped field's
//! call eagerly the first time a (site, slot, pass) is met, capture it the second time and
//! replay it after, with the inputs copied into static buffers.
//!
//! On a GPU (the inputs on a device) the capture is a CUDA graph of the rank's stream: the
//! scope's outputs and saved activations are the graph's own buffers, kept by the runtime and
//! handed out again at each replay. Their slot is not reused before the microbatch's backward
//! has run (see [`super::SlotPlan`]), so a replay never overwrites what a live microbatch still
//! reads. On the CPU a scope is a boundary that counts what a GPU would capture and replay
//! and runs its body eagerly: every model runs everywhere, and the counts are the same.
//!
//! What a capture allocates comes from the device's graph memory pool, which every graph of
//! the process shares; a graph frees its previous launch's allocations when it is launched
//! again (it is instantiated with auto-free on launch) and allocates them at the same
//! addresses, so the outputs the runtime keeps stay valid until their slot's next replay. That
//! is CUDA's documented behaviour of graph memory nodes; it has run on the emulated GPU only
//! (whose captured allocations are plain, never-freed buffers), not yet on a real one. Collectives inside a scope are captured
//! with NCCL (recorded, run at each replay); the device-local communicator refuses them, and a
//! dropout draw inside a capture is an error (a graph would replay its masks). The parameters
//! a graph reads are the ones the optimizer updates in place (values, bf16 compute copies,
//! the distributed optimizer's all-gathered shards), so no hook has to run before a replay.

use std::any::Any;
use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use crate::Result;
use crate::cuda::graph::Graph;
use crate::module::{Cx, Site};
use crate::pipeline_parallel::Pass;
use crate::tensor::{Device, Tensor};

use super::{GraphScope, ScopeSet};

/// What a rank's scopes did since the runtime was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// First uses of a (site, slot, pass), run eagerly (kernels loaded, workspaces allocated).
    pub warmups: usize,
    /// Forward graphs captured.
    pub forward_captures: usize,
    /// Backward graphs captured.
    pub backward_captures: usize,
    /// Replays of captured graphs.
    pub replays: usize,
    /// Static input buffers of the forward graphs.
    pub static_inputs: usize,
    /// Static output-gradient buffers of the backward graphs (one set per site).
    pub static_grads: usize,
    /// Bytes of all static buffers.
    pub static_bytes: u64,
}

impl GraphStats {
    /// Forward and backward graphs captured.
    pub fn graphs(&self) -> usize {
        self.forward_captures + self.backward_captures
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    site: Site,
    slot: usize,
    pass: Pass,
}

/// A captured scope: the graph (none on the CPU), its static inputs, and its outputs.
struct Captured {
    graph: Option<Graph>,
    inputs: Vec<Tensor>,
    outputs: Box<dyn Any + Send>,
}

// SAFETY: a captured graph is only replayed by the rank that captured it, under the runtime's
// lock; the CUDA driver's graph handles may be used from any thread.
unsafe impl Send for Captured {}

enum Use {
    /// Run once, eagerly.
    Warm,
    /// Captured.
    Captured(Captured),
}

#[derive(Default)]
struct State {
    uses: HashMap<Key, Use>,
    /// The backward graphs' static output-gradient buffers, shared by a site's slots.
    grads: HashMap<Site, Vec<Tensor>>,
    /// The scope being captured now, if any.
    capturing: Option<GraphScope>,
    /// The random draws seen in the capture under way.
    random_draws: HashSet<Site>,
    stats: GraphStats,
}

/// A rank's graph scopes: which are selected, and what was captured.
pub struct GraphRuntime {
    scopes: ScopeSet,
    state: Mutex<State>,
}

impl std::fmt::Debug for GraphRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GraphRuntime")
            .field("scopes", &self.scopes)
            .field("stats", &self.stats())
            .finish()
    }
}

impl GraphRuntime {
    /// A runtime capturing `scopes` (none: every scope runs eagerly, uncounted).
    pub fn new(scopes: ScopeSet) -> GraphRuntime {
        GraphRuntime {
            scopes,
            state: Mutex::new(State::default()),
        }
    }

    /// The selected scopes.
    pub fn scopes(&self) -> ScopeSet {
        self.scopes
    }

    /// What the scopes did so far.
    pub fn stats(&self) -> GraphStats {
        self.lock().stats
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while the lock was held left nothing half-written that matters here.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Notes that `site` draws random numbers (a dropout mask) now: inside a capture that is
    /// an error, reported when the capture ends.
    pub(crate) fn note_random_draw(&self, site: Site) {
        let mut state = self.lock();
        if state.capturing.is_some() {
            state.random_draws.insert(site);
        }
    }

    fn run<T: Clone + Send + 'static>(
        &self,
        cx: &Cx,
        scope: GraphScope,
        key: Key,
        inputs: &[&Tensor],
        body: impl FnOnce(&Cx, &[Tensor]) -> Result<T>,
    ) -> Result<T> {
        let on_gpu = inputs.first().and_then(|x| x.gpu()).is_some();
        if on_gpu && scope == GraphScope::Attn && cx.documents().is_some() {
            return crate::invalid!(
                "graph scope {scope} with packed documents (--reset-position-ids, \
                 --reset-attention-mask or packed data): a captured graph would replay the \
                 positions and document boundaries of the microbatch it captured (leave {scope} \
                 out of --cuda-graph-scope)"
            );
        }
        let mut state = self.lock();
        let captured = match state.uses.get(&key) {
            None => None,
            Some(Use::Warm) => Some(false),
            Some(Use::Captured(_)) => Some(true),
        };
        match captured {
            None => {
                state.uses.insert(key, Use::Warm);
                state.stats.warmups += 1;
                drop(state);
                body(cx, &owned(inputs))
            }
            Some(true) => {
                state.stats.replays += 1;
                let Some(Use::Captured(captured)) = state.uses.get(&key) else {
                    unreachable!("checked above")
                };
                for (fixed, x) in captured.inputs.iter().zip(inputs) {
                    if fixed.shape() != x.shape() {
                        return crate::invalid!(
                            "graph scope {scope}: the input of {:?} was {} when it was captured \
                             and is {} now (a graph replays fixed shapes)",
                            key.site,
                            fixed.shape(),
                            x.shape()
                        );
                    }
                }
                if let Some(graph) = &captured.graph {
                    for (fixed, x) in captured.inputs.iter().zip(inputs) {
                        fixed.copy_from(x)?;
                    }
                    graph.replay()?;
                    return Ok(captured
                        .outputs
                        .downcast_ref::<T>()
                        .expect("a site's scope always returns the same type")
                        .clone());
                }
                drop(state);
                body(cx, &owned(inputs))
            }
            Some(false) => {
                let inputs = self.static_inputs(&mut state, key, inputs)?;
                match key.pass {
                    Pass::Forward => state.stats.forward_captures += 1,
                    Pass::Backward | Pass::Weight => state.stats.backward_captures += 1,
                }
                if let Some(gpu) = inputs.first().and_then(|x| x.gpu()).cloned() {
                    state.random_draws.clear();
                    state.capturing = Some(scope);
                    drop(state);
                    let mut out = None;
                    let graph = Graph::capture(&gpu, scope.name(), || -> Result<()> {
                        out = Some(body(cx, &inputs)?);
                        Ok(())
                    });
                    let mut state = self.lock();
                    state.capturing = None;
                    if let Some(site) = state.random_draws.iter().next() {
                        return crate::invalid!(
                            "graph scope {scope} draws a dropout mask at {site:?}: a captured \
                             graph would replay the same mask every time (set that dropout to 0, \
                             or leave {scope} out of --cuda-graph-scope)"
                        );
                    }
                    let graph = graph?;
                    let out = out.expect("a captured region that succeeded returned its outputs");
                    graph.replay()?;
                    state.uses.insert(
                        key,
                        Use::Captured(Captured {
                            graph: Some(graph),
                            inputs,
                            outputs: Box::new(out.clone()),
                        }),
                    );
                    return Ok(out);
                }
                state.uses.insert(
                    key,
                    Use::Captured(Captured {
                        graph: None,
                        inputs: inputs.clone(),
                        outputs: Box::new(()),
                    }),
                );
                drop(state);
                body(cx, &inputs)
            }
        }
    }

    /// The static buffers a capture of `key` reads its inputs from, filled with `inputs`: a
    /// forward's own (its saved activations may alias them until its backward), a backward's
    /// shared by the site's slots (consumed by the replay right after the copy). On the CPU
    /// they are counted, and the inputs themselves are used.
    fn static_inputs(
        &self,
        state: &mut State,
        key: Key,
        inputs: &[&Tensor],
    ) -> Result<Vec<Tensor>> {
        let bytes: u64 = inputs
            .iter()
            .map(|x| (x.numel() * x.dtype().size()) as u64)
            .sum();
        let on_gpu = inputs.first().is_some_and(|x| x.device() != Device::Cpu);
        let fresh = |inputs: &[&Tensor]| -> Result<Vec<Tensor>> {
            if on_gpu {
                inputs.iter().map(|x| Ok(x.deep_clone()?)).collect()
            } else {
                Ok(owned(inputs))
            }
        };
        match key.pass {
            Pass::Forward => {
                state.stats.static_inputs += inputs.len();
                state.stats.static_bytes += bytes;
                fresh(inputs)
            }
            Pass::Backward | Pass::Weight => match state.grads.get(&key.site) {
                Some(shared) if on_gpu => {
                    for (fixed, x) in shared.iter().zip(inputs) {
                        fixed.copy_from(x)?;
                    }
                    Ok(shared.clone())
                }
                Some(_) => Ok(owned(inputs)),
                None => {
                    state.stats.static_grads += inputs.len();
                    state.stats.static_bytes += bytes;
                    let made = fresh(inputs)?;
                    state.grads.insert(key.site, made.clone());
                    Ok(made)
                }
            },
        }
    }
}

fn owned(inputs: &[&Tensor]) -> Vec<Tensor> {
    inputs.iter().map(|&x| x.clone()).collect()
}

/// The runtime that captures `scope` in this context, if any: training, the scope selected.
fn selected<'a>(cx: &Cx<'a>, scope: GraphScope) -> Option<&'a GraphRuntime> {
    cx.graphs()
        .filter(|rt| cx.training() && rt.scopes.contains(scope))
}

/// Whether this context captures `scope` (training, with the scope selected): what a layer
/// asks to put its work inside or after a graph.
pub fn captures(cx: &Cx, scope: GraphScope) -> bool {
    selected(cx, scope).is_some()
}

/// The forward of a `#[graph_scope(..)]` field at `site`: `body` on `inputs`, eagerly unless
/// the run selected `scope`; then run once, captured in this microbatch's slot, replayed.
pub fn forward<T: Clone + Send + 'static>(
    cx: &Cx,
    scope: GraphScope,
    site: Site,
    inputs: &[&Tensor],
    body: impl FnOnce(&Cx, &[Tensor]) -> Result<T>,
) -> Result<T> {
    match selected(cx, scope) {
        None => body(cx, &owned(inputs)),
        Some(rt) => {
            let key = Key {
                site,
                slot: cx.graph_slot(),
                pass: Pass::Forward,
            };
            rt.run(cx, scope, key, inputs, body)
        }
    }
}

/// The backward of a `#[graph_scope(..)]` field at `site`: `body` on what the forward saved and
/// the gradients `inputs`, as [`forward`] runs the forward. A replay does not read `saved`: the
/// graph reads the buffers its slot's forward graph wrote.
pub fn backward<S, T: Clone + Send + 'static>(
    cx: &Cx,
    scope: GraphScope,
    site: Site,
    saved: S,
    inputs: &[&Tensor],
    body: impl FnOnce(&Cx, S, &[Tensor]) -> Result<T>,
) -> Result<T> {
    match selected(cx, scope) {
        None => body(cx, saved, &owned(inputs)),
        Some(rt) => {
            let key = Key {
                site,
                slot: cx.graph_slot(),
                pass: Pass::Backward,
            };
            rt.run(cx, scope, key, inputs, |cx, x| body(cx, saved, x))
        }
    }
}
