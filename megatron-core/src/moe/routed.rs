//! [`RoutedExperts`]: a MoE layer's router and routed experts as one `#[expert_parallel]`
//! layer (Megatron-LM's `TopKRouter` and `GroupedMLP` under `MoELayer`), in f32 on the device
//! of its weights (the experts through `ExpertOps` (the device seam)).
//!
//! Its parameters: the router's gate `router.weight` `[experts, hidden]`, whole on every rank
//! (a dense parameter, reduced over data parallelism), and the experts' `fc1.weight`
//! `[experts, ffn, hidden]` (gated experts: `[experts, 2·ffn, hidden]`, the gate's rows then
//! the up projection's) and `fc2.weight` `[experts, hidden, ffn]`, whose first dimension
//! (the expert) is split over the expert-parallel group, rank r holding the logical experts
//! r·E/ep .. (r + 1)·E/ep, and each expert's hidden layer over the expert-tensor-parallel group
//! (fc1 by its outputs, each rank its part of the gate and of the up projection; fc2 by its
//! inputs). Checkpoints hold logical experts whatever the ep and
//! etp they were saved at, and the experts' gradients go to the expert buffers, reduced over
//! expert data parallelism.

use super::ExpertParallel;
use super::dispatcher::{CombineSaved, Dispatch, DispatcherKind, placed};
use super::expert_lora::{ExpertAdapter, Factors};
use super::expert_tp::TpRows;
use super::experts::{ExpertShape, ExpertsSaved};
use super::{
    Partition, PlacedRouting, RouterConfig, RouterError, Routing, route_backward, route_partitioned,
};
use crate::backend;
use crate::comm::ReduceOp;
use crate::cuda::DeviceRouting;
use crate::cuda_graphs::{GraphScope, captures};
use crate::error::Result;
use crate::invalid;
// The router's products stay f32 in a bf16 run (Megatron-LM's `--moe-router-dtype fp32`).
use crate::kernels::gemm::product;
use crate::module::{Builder, Cx, Init, Module, Param, Site, Split, WeightGrad};
use crate::parallel::GroupKind;
use crate::tensor::{DType, Tensor, TensorRead};
use crate::tensor_parallel::lora::Beside;

/// What an `#[expert_parallel]` call keeps for its backward: the routing, what the router and
/// the local experts keep, the dispatch plan and the combine's rows.
#[derive(Debug, Clone)]
pub struct ExpertParallelSaved<G, R, L> {
    /// The routing of the call's tokens, where they live.
    pub routing: PlacedRouting,
    /// What the router's gate keeps.
    pub gate: G,
    /// What the router keeps.
    pub router: R,
    /// Where the dispatcher sent the rows.
    pub plan: Dispatch,
    /// Where the expert-tensor-parallel group's rows came from.
    pub tp: TpRows,
    /// What the local experts keep.
    pub local: L,
    /// What the combine keeps.
    pub combine: CombineSaved,
}

/// Whether parameter `name` is a router's expert bias: moved each step by the token counts
/// (Megatron-LM's aux-loss-free balancing, a buffer there), not by a gradient, so that it keeps
/// moving when the weights around it are frozen (LoRA's base).
pub fn is_expert_bias(name: &str) -> bool {
    name.ends_with("router.expert_bias")
}

/// What [`RoutedExperts`] is built from.
#[derive(Debug, Clone, PartialEq)]
pub struct RoutedExpertsSpec {
    /// The router's settings (experts, top-k, scores, losses, capacity).
    pub router: RouterConfig,
    /// The model's hidden size.
    pub hidden: usize,
    /// Each expert's hidden layer (`--moe-ffn-hidden-size`).
    pub ffn: usize,
    /// Gated experts (`--swiglu`: SwiGLU instead of GeLU, fc1 twice as wide).
    pub gated: bool,
    /// The standard deviation of the gate's and fc1's initial values.
    pub init_std: f32,
    /// The standard deviation of fc2's (the residual branch's output layer).
    pub out_init_std: f32,
    /// How tokens reach the experts (`--moe-token-dispatcher-type`).
    pub dispatcher: DispatcherKind,
}

/// A MoE layer's router and this rank's routed experts (see the module's documentation).
#[derive(Debug, Clone)]
pub struct RoutedExperts {
    gate: Param,
    /// The aux-loss-free expert bias `[experts]` (with `--moe-router-enable-expert-bias`): a
    /// parameter the optimizer leaves alone (no gradient, no weight decay), moved after each
    /// step towards the mean load by [`crate::training::Trainer`], saved with the model.
    expert_bias: Option<Param>,
    fc1: Param,
    fc2: Param,
    /// LoRA beside fc1 and fc2, one adapter per expert, when the builder's LoRA config targets
    /// them (`mlp.experts.fc1`, `mlp.experts.fc2`; see [`super::expert_lora`]).
    lora: [Option<ExpertAdapter>; 2],
    router: RouterConfig,
    local: ExpertShape,
    dispatcher: DispatcherKind,
}

/// What the router's gate keeps: its input.
#[derive(Debug, Clone)]
pub struct GateSaved {
    x: Tensor,
}

/// What the router's gate hands the rest of the layer (a graph scope's outputs): each token's
/// logits and, on a GPU, the routing computed from them there, with the tokens laid out
/// expert-major for the all-to-all dispatcher (the dispatcher's preprocessing).
#[derive(Debug, Clone)]
pub struct RouterOutput {
    logits: Tensor,
    device: Option<DeviceRouting>,
}

impl RouterOutput {
    /// The logits `[tokens, experts]` alone: the routing is chosen from them afterwards.
    pub fn new(logits: Tensor) -> RouterOutput {
        RouterOutput {
            logits,
            device: None,
        }
    }

    /// The logits and the routing the device computed from them.
    pub fn on_device(logits: Tensor, routing: DeviceRouting) -> RouterOutput {
        RouterOutput {
            logits,
            device: Some(routing),
        }
    }

    /// The logits `[tokens, experts]`, where the tokens live.
    pub fn logits(&self) -> &Tensor {
        &self.logits
    }

    /// The routing the device computed, if it did.
    pub fn device(&self) -> Option<&DeviceRouting> {
        self.device.as_ref()
    }

    /// The tokens laid out expert-major on the device (`[rows, hidden]`, f32, zeros past the
    /// routed rows), for the all-to-all dispatcher, if the gate's device did it.
    pub fn permuted(&self) -> Option<&Tensor> {
        self.device.as_ref().and_then(DeviceRouting::permuted)
    }
}

/// What the router keeps: the logits, and what the routing kept for the backward: on the CPU
/// the host router's routing and the logits' values, on a GPU the device's routing.
#[derive(Debug, Clone)]
pub struct RouterSaved {
    like: Tensor,
    kept: RouterKept,
}

/// What the router's backward reads of its forward, where it ran.
#[derive(Debug, Clone)]
enum RouterKept {
    Host {
        routing: Box<Routing>,
        logits: Vec<f32>,
    },
    Device(Box<DeviceRouting>),
}

impl RoutedExperts {
    /// fc1 and fc2 as the grouped products read them with the adapters merged in: for a layer
    /// with an adapter a parameter of the merged values and a zero gradient of its own (the
    /// merged weight's, which the adapters' gradients come from), else the weight itself; and
    /// the adapters' factors the merge read.
    fn merged_weights(&self, cx: &Cx) -> Result<([Param; 2], [Option<Factors>; 2])> {
        let mut out = [self.fc1.clone(), self.fc2.clone()];
        let mut factors = [None, None];
        for ((w, adapter), f) in out.iter_mut().zip(&self.lora).zip(&mut factors) {
            if let Some(adapter) = adapter {
                let read = adapter.factors(cx.etp())?;
                let merged = adapter.merged(w, &read)?;
                let mut spec = w.spec().clone();
                spec.frozen = false;
                let grad = Tensor::zeros_near(spec.local.clone(), DType::F32, &merged)?;
                let mut p = Param::new(spec, merged.clone())?;
                p.rebind(merged, grad, None)?;
                *w = p;
                *f = Some(read);
            }
        }
        Ok((out, factors))
    }

    /// The local experts' backward with adapters: the grouped backward on the merged weights,
    /// its weight gradients run now (the adapters' need a sum over expert tensor parallelism,
    /// a collective, which runs in the backward pass), and from the merged weights' gradients
    /// the adapters' and, for a base that is not frozen, its own.
    fn backward_with_adapters(
        &self,
        cx: &Cx,
        saved: ExpertsSaved,
        dy: &Tensor,
    ) -> Result<(Tensor, WeightGrad)> {
        let (merged, factors) = self.merged_weights(cx)?;
        let (dx, dw) = backend::of(self.fc1.compute_value()).experts_backward(
            &self.local,
            saved,
            dy,
            (&merged[0], &merged[1]),
        )?;
        dw.run()?;
        let bases = [&self.fc1, &self.fc2];
        for (((adapter, m), base), f) in self.lora.iter().zip(&merged).zip(bases).zip(&factors) {
            let (Some(adapter), Some(f)) = (adapter, f) else {
                continue;
            };
            adapter.backward(m.grad(), f, cx.etp())?;
            base.accumulate_grad(|grad| {
                let sum = crate::ops::add(grad, m.grad())?;
                Ok(grad.copy_from(&sum)?)
            })?;
        }
        Ok((dx, WeightGrad::none()))
    }

    /// This rank's part on the expert-parallel and expert-tensor-parallel groups `b` knows.
    fn build_with(spec: &RoutedExpertsSpec, b: &mut Builder) -> Result<Self> {
        let RoutedExpertsSpec {
            router,
            hidden,
            ffn,
            gated,
            init_std,
            out_init_std,
            dispatcher,
        } = *spec;
        router.validate()?;
        let (experts, ep, etp) = (
            router.num_experts,
            b.group(GroupKind::Ep).1,
            b.group(GroupKind::Etp).1,
        );
        if !experts.is_multiple_of(ep) {
            return invalid!(
                "--num-experts {experts} is not divisible by the expert-parallel size {ep}"
            );
        }
        if !ffn.is_multiple_of(etp) {
            return invalid!(
                "--moe-ffn-hidden-size {ffn} is not divisible by the expert-tensor-parallel size \
                 {etp}"
            );
        }
        // Each expert's fc1 split by its outputs (each block: gated experts' gate and up), fc2
        // by its inputs (column and row parallel).
        let local = ExpertShape {
            experts: experts / ep,
            hidden,
            ffn: ffn / etp,
            gated,
        };
        let blocks = if gated { 2 } else { 1 };
        let fc1_split = Split::Experts { dim: 1, blocks };
        let fc2_split = Split::Experts { dim: 2, blocks: 1 };
        let normal = |std| Init::Normal { std };
        let lora = b.lora().cloned();
        let adapter = |b: &mut Builder, layer: &str, beside, (inp, out), split| match &lora {
            Some(config) if config.targets(&b.name(layer)) => b
                .scoped(layer, |b| {
                    ExpertAdapter::build(config, b, beside, (experts, inp, out), split)
                })
                .map(Some),
            _ => Ok(None),
        };
        Ok(RoutedExperts {
            // With sequence parallelism the router sees this rank's shard of the tokens: its
            // gradient is summed over tp.
            gate: b.scoped("router", |b| {
                b.param(
                    "weight",
                    [experts, hidden],
                    Split::Replicated,
                    normal(init_std),
                    true,
                )?
                .in_sequence_parallel_region()
            })?,
            expert_bias: router
                .expert_bias
                .then(|| {
                    b.scoped("router", |b| {
                        // Moved by the token counts, not by a gradient.
                        b.param(
                            "expert_bias",
                            [experts],
                            Split::Replicated,
                            Init::ZEROS,
                            false,
                        )
                        .map(Param::with_gradient_whole_over_tp)
                    })
                })
                .transpose()?,
            fc1: b.scoped("fc1", |b| {
                b.param(
                    "weight",
                    [experts, blocks * ffn, hidden],
                    fc1_split,
                    normal(init_std),
                    true,
                )
            })?,
            fc2: b.scoped("fc2", |b| {
                b.param(
                    "weight",
                    [experts, hidden, ffn],
                    fc2_split,
                    normal(out_init_std),
                    true,
                )
            })?,
            lora: [
                adapter(b, "fc1", Beside::Column, (hidden, blocks * ffn), fc1_split)?,
                adapter(b, "fc2", Beside::Row, (ffn, hidden), fc2_split)?,
            ],
            router,
            local,
            dispatcher,
        })
    }
}

impl Module for RoutedExperts {
    type Spec = RoutedExpertsSpec;
    type Saved = ExpertParallelSaved<GateSaved, RouterSaved, ExpertsSaved>;
    /// The dispatch's sizes are known only at run time.
    const CAPTURABLE: bool = false;

    /// Every expert whole on this rank (expert groups of one).
    fn build(spec: &RoutedExpertsSpec, b: &mut Builder) -> Result<Self> {
        let mut whole = b
            .clone()
            .with_group(GroupKind::Ep, 0, 1)
            .with_group(GroupKind::Etp, 0, 1);
        RoutedExperts::build_with(spec, &mut whole)
    }

    fn visit_params<'s>(&'s self, f: &mut dyn FnMut(&'s Param)) {
        f(&self.gate);
        if let Some(bias) = &self.expert_bias {
            f(bias);
        }
        f(&self.fc1);
        f(&self.fc2);
        for adapter in self.lora.iter().flatten() {
            adapter.params().into_iter().for_each(&mut *f);
        }
    }

    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        f(&mut self.gate);
        if let Some(bias) = &mut self.expert_bias {
            f(bias);
        }
        f(&mut self.fc1);
        f(&mut self.fc2);
        for adapter in self.lora.iter_mut().flatten() {
            adapter.params_mut().into_iter().for_each(&mut *f);
        }
    }
}

/// A tensor's values as f32 on the host, where the layer computes: borrowed when they are
/// there already (the f32 weights, read every call), else a copy (widened from 16 bits, or from
/// a GPU, the results going back).
pub(crate) enum HostF32<'a> {
    Borrowed(TensorRead<'a, f32>),
    Copied(Vec<f32>),
}

impl std::ops::Deref for HostF32<'_> {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match self {
            HostF32::Borrowed(values) => values,
            HostF32::Copied(values) => values,
        }
    }
}

/// `t`'s values as f32 on the host (see [`HostF32`]).
pub(crate) fn host_f32(t: &Tensor) -> Result<HostF32<'_>> {
    match t.read::<f32>() {
        Ok(values) => Ok(HostF32::Borrowed(values)),
        Err(_) => Ok(HostF32::Copied(t.to_vec_f32()?)),
    }
}

/// The sequence length of tokens `x` of shape `dims` holding `tokens` tokens: `[seq, batch,
/// hidden]` tokens are in sequence-first order, anything else is one sequence.
fn sequence_length(dims: &[usize], tokens: usize) -> usize {
    if dims.len() == 3 { dims[0] } else { tokens }
}

/// Adds `f`'s contribution into `p`'s gradient: in place for an f32 host gradient, else on a
/// host copy written back (widened and rounded back when 16-bit, copied from and to a GPU).
pub(crate) fn accumulate(p: &Param, f: impl FnOnce(&mut [f32]) -> Result<()>) -> Result<()> {
    // A frozen parameter's contribution lands in a scratch, dropped (the kernels that fill
    // several gradients at once still fill the others).
    if p.is_frozen() {
        return f(&mut vec![0.0; p.spec().local.numel()]);
    }
    p.gradient_to_be_written()?;
    let grad = p.grad();
    if grad.dtype() == DType::F32 && grad.gpu().is_none() {
        f(&mut grad.write::<f32>()?)?;
    } else {
        let mut host = grad.to_vec_f32()?;
        f(&mut host)?;
        grad.copy_from(&placed(
            Tensor::from_vec(host, grad.shape().clone())?,
            grad,
        )?)?;
    }
    p.gradient_written()
}

impl ExpertParallel for RoutedExperts {
    type GateSaved = GateSaved;
    type RouterSaved = RouterSaved;
    type LocalSaved = ExpertsSaved;

    fn build_experts(spec: &RoutedExpertsSpec, b: &mut Builder) -> Result<Self> {
        RoutedExperts::build_with(spec, b)
    }

    fn dispatcher(&self) -> DispatcherKind {
        self.dispatcher
    }

    fn gate(&self, cx: &Cx, _site: Site, x: &Tensor) -> Result<(RouterOutput, GateSaved)> {
        let (e, h) = (self.router.num_experts, self.local.hidden);
        // Megatron-LM refuses MoE with tensor parallelism but not sequence parallelism; without
        // it the tensor-parallel ranks' gradients of the experts and the router would not be
        // what one rank's are (the library's check of what the command line checks first).
        let tp = cx.parallel().groups().config().tp;
        if cx.training() && tp > 1 && !cx.parallel().sequence_parallel() {
            return invalid!(
                "MoE layers with tensor-parallel size {tp} need sequence parallelism (Megatron-LM \
                 refuses to train them without it): ParallelState::with_sequence_parallel(true), \
                 or tensor-parallel size 1 with expert and data parallelism"
            );
        }
        let dims = x.dims();
        if dims.len() < 2 || dims[dims.len() - 1] != h {
            return invalid!("the router takes [.., hidden {h}], got {}", x.shape());
        }
        let tokens = x.numel() / h;
        let saved = GateSaved { x: x.clone() };
        // On a GPU: the logits, the routing and (for the all-to-all) the tokens laid out
        // expert-major, with no read-back, so that a graph can capture them. With the router's
        // graph alone (moe_router without moe_preprocess), the tokens are laid out after the
        // read-back, by the dispatcher, as Megatron-LM's dispatcher does then.
        let router_graph_only =
            captures(cx, GraphScope::MoeRouter) && !captures(cx, GraphScope::MoePreprocess);
        let permute = self.dispatcher == DispatcherKind::AllToAll && !router_graph_only;
        let routing = (
            sequence_length(dims, tokens),
            &self.router,
            self.expert_bias.as_ref().map(Param::value),
            cx.parallel().token_split(),
        );
        let gate = self.gate.compute_value();
        if let Some((logits, routing)) =
            backend::of(x).route_on_device(x, gate, routing, permute)?
        {
            return Ok((RouterOutput::on_device(logits, routing), saved));
        }
        let values = host_f32(x)?;
        let gate = host_f32(self.gate.compute_value())?;
        let mut logits = vec![0.0f32; tokens * e];
        product(
            false,
            &values,
            (tokens, h, false),
            &gate,
            (e, h, true),
            0.0,
            &mut logits,
        )?;
        Ok((
            RouterOutput::new(Tensor::from_vec(logits, [tokens, e])?),
            saved,
        ))
    }

    fn route(
        &self,
        cx: &Cx,
        _site: Site,
        x: &Tensor,
        gated: &RouterOutput,
    ) -> Result<(PlacedRouting, RouterSaved)> {
        let logits = gated.logits();
        if let Some(device) = gated.device() {
            let saved = RouterSaved {
                like: logits.clone(),
                kept: RouterKept::Device(Box::new(device.clone())),
            };
            return Ok((device.placed()?, saved));
        }
        let host = host_f32(logits)?.to_vec();
        let seq = sequence_length(x.dims(), logits.dims()[0]);
        let bias = self
            .expert_bias
            .as_ref()
            .map(|b| host_f32(b.value()))
            .transpose()?;
        // Sequence or context parallelism: this rank routes its part of the sequences; the
        // load-balancing counts are summed over the ranks that hold the rest.
        let split = cx.parallel().token_split();
        let sum_counts = |counts: &mut [f32]| -> std::result::Result<(), RouterError> {
            let t = Tensor::from_slice(counts, [counts.len()])
                .map_err(|e| RouterError::Counts(e.to_string()))?;
            split
                .ok_or_else(|| RouterError::Counts("no group holds the rest".into()))?
                .all_reduce(&t, ReduceOp::Sum)
                .map_err(|e| RouterError::Counts(e.to_string()))?;
            let summed = t
                .to_vec::<f32>()
                .map_err(|e| RouterError::Counts(e.to_string()))?;
            counts.copy_from_slice(&summed);
            Ok(())
        };
        let partition = match split {
            Some(group) => Partition {
                ranks: group.size(),
                sum_counts: &sum_counts,
            },
            None => Partition::WHOLE,
        };
        let routing = route_partitioned(&host, seq, &self.router, bias.as_deref(), partition)?;
        Ok((
            routing.placed(x)?,
            RouterSaved {
                like: logits.clone(),
                kept: RouterKept::Host {
                    routing: Box::new(routing),
                    logits: host,
                },
            },
        ))
    }

    fn forward_local(
        &self,
        cx: &Cx,
        _site: Site,
        rows: &Tensor,
        tp: &TpRows,
    ) -> Result<(Tensor, ExpertsSaved)> {
        if self.lora.iter().any(Option::is_some) {
            let ([fc1, fc2], _) = self.merged_weights(cx)?;
            let weights = (fc1.compute_value(), fc2.compute_value());
            return backend::of(weights.0).experts_forward(
                &self.local,
                rows,
                &tp.rows_per_local_expert(),
                weights,
            );
        }
        let weights = (self.fc1.compute_value(), self.fc2.compute_value());
        backend::of(weights.0).experts_forward(
            &self.local,
            rows,
            &tp.rows_per_local_expert(),
            weights,
        )
    }

    fn backward_local_input(
        &self,
        cx: &Cx,
        _site: Site,
        saved: ExpertsSaved,
        dy: &Tensor,
    ) -> Result<(Tensor, WeightGrad)> {
        if self.lora.iter().any(Option::is_some) {
            return self.backward_with_adapters(cx, saved, dy);
        }
        backend::of(self.fc1.compute_value()).experts_backward(
            &self.local,
            saved,
            dy,
            (&self.fc1, &self.fc2),
        )
    }

    fn router_grads(
        &self,
        cx: &Cx,
        _site: Site,
        routing: &PlacedRouting,
        dprobs: &Tensor,
        like: &Tensor,
    ) -> Result<[Tensor; 2]> {
        if let Some(log) = cx.routing_log() {
            log.record(routing, self.router.topk);
            if let Some(bias) = &self.expert_bias {
                log.record_load(
                    &bias.spec().name,
                    &routing.tokens_per_expert,
                    self.router.bias_update_rate,
                );
            }
        }
        let shape = [routing.tokens, routing.experts];
        Ok([
            placed(dprobs.reshape(shape)?, like)?,
            placed(Tensor::from_vec(vec![cx.aux_loss_scale()], [1])?, like)?,
        ])
    }

    fn backward_route(
        &self,
        _cx: &Cx,
        _site: Site,
        saved: RouterSaved,
        _routing: &PlacedRouting,
        dprobs: &Tensor,
        loss_scale: &Tensor,
    ) -> Result<Tensor> {
        let (routing, logits) = match &saved.kept {
            RouterKept::Device(device) => {
                return device.backward(&saved.like, dprobs, loss_scale);
            }
            RouterKept::Host { routing, logits } => (routing, logits),
        };
        let &[scale] = loss_scale.to_vec_f32()?.as_slice() else {
            return invalid!(
                "the router's loss scale is one value, got {}",
                loss_scale.shape()
            );
        };
        let dlogits = route_backward(routing, logits, &host_f32(dprobs)?, scale, &self.router)?;
        let shape = saved.like.shape().clone();
        placed(Tensor::from_vec(dlogits, shape)?, &saved.like)
    }

    fn backward_gate(
        &self,
        _cx: &Cx,
        _site: Site,
        saved: GateSaved,
        dlogits: &Tensor,
        dx: Tensor,
    ) -> Result<Tensor> {
        let (e, h) = (self.router.num_experts, self.local.hidden);
        let tokens = dlogits.dims()[0];
        // logits = x · gateᵀ: dgate += dlogitsᵀ · x, dx += dlogits · gate.
        if dx.gpu().is_some() {
            let rows = saved.x.to_f32_contiguous()?.reshape([tokens, h])?;
            let dlogits = dlogits.to_f32_contiguous()?;
            self.gate.accumulate_grad(|dgate| {
                Ok(crate::ops::matmul_into(
                    1.0,
                    &dlogits.t()?,
                    &rows,
                    1.0,
                    dgate,
                )?)
            })?;
            let dx = dx.to_f32_contiguous()?;
            let d = dx.reshape([tokens, h])?;
            crate::ops::matmul_into(1.0, &dlogits, self.gate.compute_value(), 1.0, &d)?;
            return Ok(dx);
        }
        let dlogits = host_f32(dlogits)?;
        let x = host_f32(&saved.x)?;
        accumulate(&self.gate, |dgate| {
            product(
                false,
                &dlogits,
                (tokens, e, true),
                &x,
                (tokens, h, false),
                1.0,
                dgate,
            )?;
            Ok(())
        })?;
        let gate = host_f32(self.gate.compute_value())?;
        let mut d = dx.to_vec_f32()?;
        product(
            false,
            &dlogits,
            (tokens, e, false),
            &gate,
            (e, h, false),
            1.0,
            &mut d,
        )?;
        placed(Tensor::from_vec(d, dx.shape().clone())?, &dx)
    }
}
