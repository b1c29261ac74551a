//! The router and the all-to-all dispatcher's preprocessing on a GPU (`cu/moe.cu`): from the
//! gate's logits, each token's top-k experts and weights, the capacity, the load-balancing and
//! z losses, each expert's count, and the tokens permuted expert-major for the all-to-all, all
//! on the device with nothing read back, so that the graph scopes `moe_router` and
//! `moe_preprocess` capture them. [`DeviceRouting::placed`] is the device-to-host sync after
//! the graph (Megatron-LM's `cuda_dtoh_point = "before_ep_alltoall"`): the counts, the drops
//! and the losses read back, the weights and the map left on the device for the eager
//! all-to-all and combine; [`DeviceRouting::read_back`] reads everything, the same [`Routing`]
//! the host's [`crate::moe::route`] gives.

use crate::backend::RouterOps;
use crate::comm::{Communicator, ReduceOp};
use crate::cuda::Gpu;
use crate::cuda::kernels::moe::{self as k, Capacity, RouteDims, ScoreMode, TopK};
use crate::error::Result;
use crate::ops::matmul_into;
use crate::tensor::{DType, Tensor};

use crate::moe::router::{RoutingParts, aux_groups, check_route};
use crate::moe::{PlacedRouting, RouterConfig, Routing, ScoreFunction};

impl RouterOps for Gpu {
    /// The gate's product on cuBLAS, then [`DeviceRouting`]: nothing read back.
    fn route_on_device(
        &self,
        x: &Tensor,
        gate: &Tensor,
        (seq, config, bias, tp): (
            usize,
            &RouterConfig,
            Option<&Tensor>,
            Option<&dyn Communicator>,
        ),
        permute: bool,
    ) -> Result<Option<(Tensor, DeviceRouting)>> {
        let h = gate.dims()[1];
        let rows = x.to_f32_contiguous()?.reshape([x.numel() / h, h])?;
        let logits = Tensor::empty_on([rows.dims()[0], config.num_experts], DType::F32, self)?;
        matmul_into(1.0, &rows, &gate.t()?, 0.0, &logits)?;
        let mut routing = DeviceRouting::new(&logits, seq, config, bias, tp)?;
        if permute {
            routing = routing.with_permuted(&rows)?;
        }
        Ok(Some((logits, routing)))
    }
}

/// A routing computed on the device: every part of a [`Routing`] as a device tensor, and the
/// permuted tokens when they were asked for.
#[derive(Debug, Clone)]
pub struct DeviceRouting {
    dims: RouteDims,
    mode: ScoreMode,
    /// The top-k scaling factor.
    scale: f32,
    z_coeff: Option<f32>,
    probs: Tensor,
    map: Tensor,
    chosen: Tensor,
    scores: Tensor,
    tokens_per_expert: Tensor,
    dropped: Tensor,
    losses: Tensor,
    aux: Option<(Tensor, Tensor)>,
    lse: Option<Tensor>,
    permuted: Option<Tensor>,
    /// The most rows the routing can send.
    rows_bound: usize,
}

impl DeviceRouting {
    /// Routes the tokens whose `logits` (`[tokens, experts]`, f32, on a GPU) the gate gave, in
    /// sequences of `seq` tokens, as `config` says (with the expert bias `bias` when enabled).
    /// With `tp` (sequence parallelism: this rank's shard of the sequence), the load-balancing
    /// counts are summed over its ranks and the z loss's coefficient divided by them, as
    /// [`crate::moe::route_partitioned`] does.
    pub fn new(
        logits: &Tensor,
        seq: usize,
        config: &RouterConfig,
        bias: Option<&Tensor>,
        tp: Option<&dyn Communicator>,
    ) -> Result<DeviceRouting> {
        let Some(gpu) = logits.gpu() else {
            return crate::invalid!("the device router takes logits on a GPU");
        };
        let bias = bias.filter(|_| config.expert_bias);
        let t = check_route(config, logits.numel(), seq, bias.map(Tensor::numel))?;
        let dims = RouteDims {
            tokens: t,
            experts: config.num_experts,
            topk: config.topk,
        };
        let (e, topk) = (dims.experts, dims.topk);
        let mode = match (config.score_function, config.pre_softmax) {
            (ScoreFunction::Softmax, false) => ScoreMode::SoftmaxAfterTopK,
            (ScoreFunction::Softmax, true) => ScoreMode::SoftmaxBeforeTopK,
            (ScoreFunction::Sigmoid, _) => ScoreMode::Sigmoid,
        };
        let score_width = if mode == ScoreMode::SoftmaxAfterTopK {
            topk
        } else {
            e
        };
        let new = |shape: &[usize], dtype| Tensor::empty_near(shape.to_vec(), dtype, logits);
        let (probs, map, chosen, scores) = (
            new(&[t, e], DType::F32)?,
            new(&[t, e], DType::I64)?,
            new(&[t, topk], DType::I64)?,
            new(&[t, score_width], DType::F32)?,
        );
        let scale = config.topk_scaling_factor.unwrap_or(1.0);
        {
            let logits = logits.device_read::<f32>()?;
            let bias = bias.map(|b| b.device_read::<f32>()).transpose()?;
            let (mut p, mut m, mut c, mut s) = (
                probs.device_write::<f32>()?,
                map.device_write::<i64>()?,
                chosen.device_write::<i64>()?,
                scores.device_write::<f32>()?,
            );
            k::route_topk(
                gpu,
                &logits.view(),
                bias.as_ref().map(|b| b.view()).as_ref(),
                dims,
                mode,
                scale,
                config.group_limited,
                TopK {
                    probs: &mut p.view_mut(),
                    map: &mut m.view_mut(),
                    chosen: &mut c.view_mut(),
                    scores: &mut s.view_mut(),
                },
            )?;
        }
        let (tokens_per_expert, dropped) = apply_capacity(&probs, &map, dims, config)?;
        let ranks = tp.map_or(1, |tp| tp.size());
        let z_coeff = config.z_loss_coeff.map(|c| c / ranks as f32);
        let (losses, aux, lse) = router_losses(logits, dims, (seq, tp), config, z_coeff)?;
        Ok(DeviceRouting {
            dims,
            mode,
            scale,
            z_coeff,
            probs,
            map,
            chosen,
            scores,
            tokens_per_expert,
            dropped,
            losses,
            aux,
            lse,
            permuted: None,
            rows_bound: permuted_rows(dims, config),
        })
    }

    /// The routing with the `tokens` (`[tokens, hidden]`) laid out expert-major for the
    /// all-to-all dispatcher (each expert's rows in token order): the dispatcher's
    /// preprocessing, on the device.
    pub fn with_permuted(mut self, tokens: &Tensor) -> Result<DeviceRouting> {
        self.permuted = Some(permute(tokens, &self.map, self.dims, self.rows_bound)?);
        Ok(self)
    }

    /// The router's backward on the device: the gradient of the `logits` this routing came from
    /// (`[tokens, experts]`), from the weights' gradient `dprobs` (`[tokens, experts]`, f32)
    /// and the losses' gradients scaled by `loss_scale` (one f32 on the device, so that a graph
    /// replays the current one), as [`crate::moe::route_backward`] computes it on the host.
    pub fn backward(
        &self,
        logits: &Tensor,
        dprobs: &Tensor,
        loss_scale: &Tensor,
    ) -> Result<Tensor> {
        let Some(gpu) = logits.gpu() else {
            return crate::invalid!("the device router's backward takes logits on a GPU");
        };
        let dlogits = Tensor::empty_near(logits.shape().clone(), DType::F32, logits)?;
        let (logits, map, chosen, scores) = (
            logits.device_read::<f32>()?,
            self.map.device_read::<i64>()?,
            self.chosen.device_read::<i64>()?,
            self.scores.device_read::<f32>()?,
        );
        let aux = self
            .aux
            .as_ref()
            .map(|(s, g)| -> Result<_> { Ok((s.device_read::<f32>()?, g.device_read::<f32>()?)) })
            .transpose()?;
        let aux_views = aux.as_ref().map(|(s, g)| (s.view(), g.view()));
        let lse = self
            .lse
            .as_ref()
            .map(|l| l.device_read::<f32>())
            .transpose()?;
        let lse_view = lse.as_ref().map(|l| l.view());
        let (logits_view, map_view, chosen_view, scores_view) =
            (logits.view(), map.view(), chosen.view(), scores.view());
        k::route_backward(
            gpu,
            k::RouteSaved {
                logits: &logits_view,
                map: &map_view,
                chosen: &chosen_view,
                scores: &scores_view,
                aux: aux_views.as_ref().map(|(s, g)| (s, g)),
                z: lse_view.as_ref().zip(self.z_coeff),
            },
            &dprobs.to_f32_contiguous()?.device_read::<f32>()?.view(),
            &loss_scale.device_read::<f32>()?.view(),
            self.dims,
            self.mode,
            self.scale,
            &mut dlogits.device_write::<f32>()?.view_mut(),
        )?;
        Ok(dlogits)
    }

    /// The tokens laid out expert-major (`[rows, hidden]`, f32; the rows past the routed ones
    /// are zeros), when they were asked for.
    pub fn permuted(&self) -> Option<&Tensor> {
        self.permuted.as_ref()
    }

    /// The routing as the dispatcher reads it: the weights and the map stay on the device; the
    /// counts (the all-to-all's splits), the drops and the losses are read back (the
    /// device-to-host sync, Megatron-LM's read of `tokens_per_expert` before the all-to-all).
    pub fn placed(&self) -> Result<PlacedRouting> {
        let RouteDims {
            tokens, experts, ..
        } = self.dims;
        let count = |v: Vec<i64>| v.into_iter().map(|c| c.max(0) as usize).collect::<Vec<_>>();
        let losses = self.losses.to_vec::<f32>()?;
        Ok(PlacedRouting {
            tokens,
            experts,
            tokens_per_expert: count(self.tokens_per_expert.to_vec::<i64>()?),
            aux_loss: losses[0],
            z_loss: losses[1],
            dropped: count(self.dropped.to_vec::<i64>()?).iter().sum(),
            probs: self.probs.clone(),
            map: self.map.clone(),
            counts: self.tokens_per_expert.clone(),
        })
    }

    /// The whole routing, read back to the host, to compare with the host router's: the
    /// weights, where each token goes, the counts, the losses, the drops. What the backward
    /// reads stays on the device: [`crate::moe::route_backward`] refuses this routing,
    /// [`DeviceRouting::backward`] takes it.
    pub fn read_back(&self) -> Result<Routing> {
        let placed = self.placed()?;
        Ok(Routing::from_parts(RoutingParts {
            tokens: placed.tokens,
            experts: placed.experts,
            probs: placed.probs.to_vec::<f32>()?,
            map: placed
                .map
                .to_vec::<i64>()?
                .iter()
                .map(|&m| m != 0)
                .collect(),
            tokens_per_expert: placed.tokens_per_expert,
            aux_loss: placed.aux_loss,
            z_loss: placed.z_loss,
            dropped: placed.dropped,
            chosen: Vec::new(),
            scores: Vec::new(),
            aux_grad: Vec::new(),
            aux_scores: Vec::new(),
            lse: Vec::new(),
            z_coeff: self.z_coeff.unwrap_or(0.0),
        }))
    }
}

/// Applies `config`'s capacity to the top-k's `probs` and `map` (`[tokens, experts]`, in
/// place), as the host router does; returns each expert's tokens and the chosen pairs it
/// dropped (`[experts]` each).
fn apply_capacity(
    probs: &Tensor,
    map: &Tensor,
    dims: RouteDims,
    config: &RouterConfig,
) -> Result<(Tensor, Tensor)> {
    let gpu = map.gpu().expect("the routing lives on a GPU");
    let (t, e) = (dims.tokens, dims.experts);
    let capacity = config.capacity(t);
    let keep = match capacity {
        Some(c) if c <= t => {
            let keep = Tensor::empty_near([t, e], DType::I64, map)?;
            k::route_keep(
                gpu,
                &probs.device_read::<f32>()?.view(),
                &map.device_read::<i64>()?.view(),
                dims,
                c,
                config.drop_policy == crate::moe::DropPolicy::Position,
                &mut keep.device_write::<i64>()?.view_mut(),
            )?;
            Some(keep)
        }
        _ => None,
    };
    let keep = keep.as_ref().map(|k| k.device_read::<i64>()).transpose()?;
    let keep = keep.as_ref().map(|k| k.view());
    let applied = match (&keep, capacity) {
        (Some(keep), _) => Capacity::Keep {
            keep,
            pad: config.pad_to_capacity,
        },
        (None, Some(c)) if config.pad_to_capacity && c > t => Capacity::All,
        _ => Capacity::Unlimited,
    };
    let tokens_per_expert = Tensor::empty_near([e], DType::I64, map)?;
    let dropped = Tensor::empty_near([e], DType::I64, map)?;
    k::route_counts(
        gpu,
        &mut probs.device_write::<f32>()?.view_mut(),
        &mut map.device_write::<i64>()?.view_mut(),
        applied,
        dims,
        &mut tokens_per_expert.device_write::<i64>()?.view_mut(),
        &mut dropped.device_write::<i64>()?.view_mut(),
    )?;
    Ok((tokens_per_expert, dropped))
}

/// What [`router_losses`] gives: the losses `[2]` (aux, z), the load-balancing loss's scores and
/// gradient (`[tokens, experts]` each) when it is on, and each token's log-sum-exp when the z
/// loss is.
type Losses = (Tensor, Option<(Tensor, Tensor)>, Option<Tensor>);

/// The load-balancing and z losses of the tokens whose `logits` these are, in sequences of
/// `seq`, as the host router computes them.
fn router_losses(
    logits: &Tensor,
    dims: RouteDims,
    (seq, tp): (usize, Option<&dyn Communicator>),
    config: &RouterConfig,
    z_coeff: Option<f32>,
) -> Result<Losses> {
    let gpu = logits.gpu().expect("the routing lives on a GPU");
    let (t, e) = (dims.tokens, dims.experts);
    let new = |shape: &[usize], dtype| Tensor::empty_near(shape.to_vec(), dtype, logits);
    let logits_view = logits.device_read::<f32>()?;
    let ranks = tp.map_or(1, |tp| tp.size());
    let aux = match aux_groups(config, t, seq, ranks) {
        Some(groups) => {
            let (scores, chosen) = (new(&[t, e], DType::F32)?, new(&[t, dims.topk], DType::I64)?);
            k::aux_scores(
                gpu,
                &logits_view.view(),
                dims,
                config.score_function == ScoreFunction::Sigmoid,
                &mut scores.device_write::<f32>()?.view_mut(),
                &mut chosen.device_write::<i64>()?.view_mut(),
            )?;
            let counts = new(&[groups.groups, e], DType::F32)?;
            k::aux_counts(
                gpu,
                &chosen.device_read::<i64>()?.view(),
                dims,
                groups.groups,
                &mut counts.device_write::<f32>()?.view_mut(),
            )?;
            // Sequence parallelism: every rank's tokens counted (Megatron-LM's all-reduce of
            // tokens_per_expert over the tp·cp group).
            if let Some(tp) = tp.filter(|tp| tp.size() > 1) {
                tp.all_reduce(&counts, ReduceOp::Sum)?;
            }
            Some((scores, counts, new(&[t, e], DType::F32)?, groups))
        }
        None => None,
    };
    let lse = match config.z_loss_coeff {
        Some(_) => {
            let lse = new(&[t], DType::F32)?;
            k::logsumexp(
                gpu,
                &logits_view.view(),
                dims,
                &mut lse.device_write::<f32>()?.view_mut(),
            )?;
            Some(lse)
        }
        None => None,
    };
    let losses = new(&[2], DType::F32)?;
    {
        let mut aux_slices = aux
            .as_ref()
            .map(|(s, c, g, groups)| -> Result<_> {
                Ok((
                    s.device_read::<f32>()?,
                    c.device_read::<f32>()?,
                    g.device_write::<f32>()?,
                    *groups,
                ))
            })
            .transpose()?;
        let (scores_view, counts_view, mut grad_view);
        let aux_arg = match &mut aux_slices {
            Some((s, c, g, groups)) => {
                (scores_view, counts_view, grad_view) = (s.view(), c.view(), g.view_mut());
                Some(k::AuxLoss {
                    scores: &scores_view,
                    counts: &counts_view,
                    groups: groups.groups,
                    factor: groups.factor,
                    grad: &mut grad_view,
                })
            }
            None => None,
        };
        let lse_slice = lse.as_ref().map(|l| l.device_read::<f32>()).transpose()?;
        let lse_view = lse_slice.as_ref().map(|l| l.view());
        k::route_losses(
            gpu,
            dims,
            aux_arg,
            lse_view.as_ref().zip(z_coeff),
            &mut losses.device_write::<f32>()?.view_mut(),
        )?;
    }
    Ok((losses, aux.map(|(s, _, g, _)| (s, g)), lse))
}

/// The most rows a routing of `dims` by `config` sends: tokens × top-k, or every expert's
/// capacity when padded to it.
fn permuted_rows(dims: RouteDims, config: &RouterConfig) -> usize {
    match config.capacity(dims.tokens) {
        Some(c) if config.pad_to_capacity => dims.experts * c.min(dims.tokens),
        _ => dims.tokens * dims.topk,
    }
}

/// `x` (`[tokens, hidden]`) laid out expert-major as `map` routes it, in a buffer of `rows`
/// rows (as many as the routing can send).
fn permute(x: &Tensor, map: &Tensor, dims: RouteDims, rows: usize) -> Result<Tensor> {
    let gpu = map.gpu().expect("the routing lives on a GPU");
    let t = dims.tokens;
    let hidden = x.numel() / t.max(1);
    if x.numel() != t * hidden {
        return crate::invalid!(
            "the dispatcher's preprocessing takes [{t} tokens, hidden], got {}",
            x.shape()
        );
    }
    let x = x.to_f32_contiguous()?;
    let source = Tensor::empty_near([rows], DType::I64, map)?;
    let slots = Tensor::empty_near([t, dims.experts], DType::I64, map)?;
    let out = Tensor::empty_near([rows, hidden], DType::F32, map)?;
    k::permute(
        gpu,
        &x.device_read::<f32>()?.view(),
        &map.device_read::<i64>()?.view(),
        dims,
        hidden,
        &mut slots.device_write::<i64>()?.view_mut(),
        &mut source.device_write::<i64>()?.view_mut(),
        &mut out.device_write::<f32>()?.view_mut(),
    )?;
    Ok(out)
}
