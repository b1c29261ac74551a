//! The MoE router's and the all-to-all dispatcher's preprocessing kernels (`cu/moe.cu`): top-k
//! routing, capacity, the counts, the load-balancing and z losses, and the tokens' permutation
//! expert-major, as [`crate::moe::route`] and [`crate::moe::dispatch`] compute them on the host.
//! Nothing is read back (a graph can capture them); [`crate::cuda::DeviceRouting`] strings them together.

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};

use super::{NULL, check_len, cover, launch, launch_args, product};
use crate::cuda::{Gpu, Result};

/// How the router scores the logits (`moe.cu`'s `mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScoreMode {
    /// Softmax over the chosen experts (Megatron-LM's default).
    SoftmaxAfterTopK = 0,
    /// Softmax over all experts, then the top-k (`--moe-router-pre-softmax`).
    SoftmaxBeforeTopK = 1,
    /// Sigmoid of each logit, normalised over the chosen experts.
    Sigmoid = 2,
}

/// The routing's shape: tokens, experts and the top-k.
#[derive(Debug, Clone, Copy)]
pub struct RouteDims {
    /// Tokens routed.
    pub tokens: usize,
    /// Experts.
    pub experts: usize,
    /// Experts per token.
    pub topk: usize,
}

impl RouteDims {
    fn describe(&self) -> String {
        let RouteDims {
            tokens,
            experts,
            topk,
        } = self;
        format!("{tokens} tokens × {experts} experts, top-{topk}")
    }

    /// `tokens × experts`.
    fn cells(&self, kernel: &'static str) -> Result<usize> {
        product(kernel, &[self.tokens, self.experts])
    }

    /// `tokens × topk`.
    fn picks(&self, kernel: &'static str) -> Result<usize> {
        product(kernel, &[self.tokens, self.topk])
    }

    /// The scores [`route_topk`] keeps for `mode`: `tokens × experts` before a top-k,
    /// `tokens × topk` after it.
    fn score_cells(&self, kernel: &'static str, mode: ScoreMode) -> Result<usize> {
        match mode {
            ScoreMode::SoftmaxAfterTopK => self.picks(kernel),
            _ => self.cells(kernel),
        }
    }

    /// Tokens, experts and top-k as the kernels take them.
    fn args(&self) -> (u64, u64, u64) {
        (self.tokens as u64, self.experts as u64, self.topk as u64)
    }
}

/// The top-k outputs of [`route_topk`].
pub struct TopK<'a, 'b> {
    /// `[tokens, experts]`: each token's weights, 0 where it does not go.
    pub probs: &'a mut CudaViewMut<'b, f32>,
    /// `[tokens, experts]`: 1 where the token goes.
    pub map: &'a mut CudaViewMut<'b, i64>,
    /// `[tokens, topk]`: each token's experts, best first.
    pub chosen: &'a mut CudaViewMut<'b, i64>,
    /// The scores the backward reads: `[tokens, experts]` before a top-k, `[tokens, topk]` after.
    pub scores: &'a mut CudaViewMut<'b, f32>,
}

/// Each token's top-k experts and weights from its `logits` (`[tokens, experts]`), scored by
/// `mode`; `bias` (`[experts]`, sigmoid scores only) moves the choice.
#[allow(clippy::too_many_arguments)]
pub fn route_topk(
    gpu: &Gpu,
    logits: &CudaView<f32>,
    bias: Option<&CudaView<f32>>,
    dims: RouteDims,
    mode: ScoreMode,
    scale: f32,
    groups: Option<crate::moe::GroupLimited>,
    out: TopK<'_, '_>,
) -> Result<()> {
    const K: &str = "moe_route_topk";
    let cells = dims.cells(K)?;
    let describe = || dims.describe();
    let score_cells = dims.score_cells(K, mode)?;
    check_len(K, "logits", logits.len(), cells, describe)?;
    if let Some(bias) = bias {
        check_len(K, "bias", bias.len(), dims.experts, describe)?;
    }
    check_len(K, "probs", out.probs.len(), cells, describe)?;
    check_len(K, "map", out.map.len(), cells, describe)?;
    let chosen = dims.picks(K)?;
    check_len(K, "chosen", out.chosen.len(), chosen, describe)?;
    check_len(K, "scores", out.scores.len(), score_cells, describe)?;
    if dims.tokens == 0 {
        return Ok(());
    }
    let ((t, e, k), m) = (dims.args(), mode as i32);
    let mut args = launch_args(gpu, K)?;
    args.arg(logits);
    match bias {
        Some(bias) => args.arg(bias),
        None => args.arg(&NULL),
    };
    // Group-limited routing: the groups and those each token keeps (0, 0: plain top-k).
    let (g, gk) = groups.map_or((0u64, 0u64), |g| (g.groups as u64, g.topk as u64));
    args.arg(&t)
        .arg(&e)
        .arg(&k)
        .arg(&m)
        .arg(&scale)
        .arg(&g)
        .arg(&gk);
    args.arg(out.probs)
        .arg(out.map)
        .arg(out.chosen)
        .arg(out.scores);
    launch(K, args, cover(dims.tokens))
}

/// Capacity: `keep[t, e] = 1` where token `t` is among expert `e`'s first `capacity` by
/// probability (or, `by_position`, routed tokens first in token order).
pub fn route_keep(
    gpu: &Gpu,
    probs: &CudaView<f32>,
    map: &CudaView<i64>,
    dims: RouteDims,
    capacity: usize,
    by_position: bool,
    keep: &mut CudaViewMut<i64>,
) -> Result<()> {
    const K: &str = "moe_route_keep";
    let cells = dims.cells(K)?;
    let describe = || dims.describe();
    check_len(K, "probs", probs.len(), cells, describe)?;
    check_len(K, "map", map.len(), cells, describe)?;
    check_len(K, "keep", keep.len(), cells, describe)?;
    if cells == 0 {
        return Ok(());
    }
    let ((t, e, _), c, p) = (dims.args(), capacity as u64, i32::from(by_position));
    let mut args = launch_args(gpu, K)?;
    args.arg(probs)
        .arg(map)
        .arg(&t)
        .arg(&e)
        .arg(&c)
        .arg(&p)
        .arg(keep);
    launch(K, args, cover(cells))
}

/// What capacity does to the top-k's choice in [`route_counts`].
#[derive(Debug, Clone, Copy)]
pub enum Capacity<'a, 'b> {
    /// Nothing (no capacity, or one that holds every token).
    Unlimited,
    /// Every token goes to every expert (padding to a capacity above the tokens).
    All,
    /// The tokens [`route_keep`] kept (with `pad`, wherever kept, routed or not).
    Keep {
        /// `[tokens, experts]`.
        keep: &'a CudaView<'b, i64>,
        /// `--moe-pad-expert-input-to-capacity`.
        pad: bool,
    },
}

/// Applies `capacity` to `probs` and `map`, and counts each expert's tokens
/// (`tokens_per_expert[experts]`) and the chosen pairs capacity dropped (`dropped[experts]`).
pub fn route_counts(
    gpu: &Gpu,
    probs: &mut CudaViewMut<f32>,
    map: &mut CudaViewMut<i64>,
    capacity: Capacity<'_, '_>,
    dims: RouteDims,
    tokens_per_expert: &mut CudaViewMut<i64>,
    dropped: &mut CudaViewMut<i64>,
) -> Result<()> {
    const K: &str = "moe_route_counts";
    let cells = dims.cells(K)?;
    let describe = || dims.describe();
    check_len(K, "probs", probs.len(), cells, describe)?;
    check_len(K, "map", map.len(), cells, describe)?;
    check_len(
        K,
        "tokens_per_expert",
        tokens_per_expert.len(),
        dims.experts,
        describe,
    )?;
    check_len(K, "dropped", dropped.len(), dims.experts, describe)?;
    if dims.experts == 0 {
        return Ok(());
    }
    let (t, e, _) = dims.args();
    let mut args = launch_args(gpu, K)?;
    args.arg(probs).arg(map);
    let (all, pad) = match capacity {
        Capacity::Unlimited => {
            args.arg(&NULL);
            (0i32, 0i32)
        }
        Capacity::All => {
            args.arg(&NULL);
            (1, 0)
        }
        Capacity::Keep { keep, pad } => {
            check_len(K, "keep", keep.len(), cells, describe)?;
            args.arg(keep);
            (0, i32::from(pad))
        }
    };
    args.arg(&t).arg(&e).arg(&all).arg(&pad);
    args.arg(tokens_per_expert).arg(dropped);
    launch(K, args, cover(dims.experts))
}

/// The load-balancing loss's scores `[tokens, experts]` (softmax, or `sigmoid`s normalised)
/// and each token's fresh top-k of them `[tokens, topk]`.
pub fn aux_scores(
    gpu: &Gpu,
    logits: &CudaView<f32>,
    dims: RouteDims,
    sigmoid: bool,
    scores: &mut CudaViewMut<f32>,
    chosen: &mut CudaViewMut<i64>,
) -> Result<()> {
    const K: &str = "moe_aux_scores";
    let cells = dims.cells(K)?;
    let describe = || dims.describe();
    check_len(K, "logits", logits.len(), cells, describe)?;
    check_len(K, "scores", scores.len(), cells, describe)?;
    let picks = dims.picks(K)?;
    check_len(K, "chosen", chosen.len(), picks, describe)?;
    if dims.tokens == 0 {
        return Ok(());
    }
    let ((t, e, k), s) = (dims.args(), i32::from(sigmoid));
    let mut args = launch_args(gpu, K)?;
    args.arg(logits).arg(&t).arg(&e).arg(&k).arg(&s);
    args.arg(scores).arg(chosen);
    launch(K, args, cover(dims.tokens))
}

/// `counts[groups, experts]`: the tokens of each group (the micro-batch, or each of `groups`
/// sequences) whose top-k `chosen` holds the expert.
pub fn aux_counts(
    gpu: &Gpu,
    chosen: &CudaView<i64>,
    dims: RouteDims,
    groups: usize,
    counts: &mut CudaViewMut<f32>,
) -> Result<()> {
    const K: &str = "moe_aux_counts";
    let describe = || format!("{}, {groups} groups", dims.describe());
    let picks = dims.picks(K)?;
    check_len(K, "chosen", chosen.len(), picks, describe)?;
    let cells = product(K, &[groups, dims.experts])?;
    check_len(K, "counts", counts.len(), cells, describe)?;
    if cells == 0 {
        return Ok(());
    }
    let ((t, e, k), g) = (dims.args(), groups as u64);
    let mut args = launch_args(gpu, K)?;
    args.arg(chosen).arg(&t).arg(&e).arg(&k).arg(&g).arg(counts);
    launch(K, args, cover(cells))
}

/// Each token's log-sum-exp of its logits, `lse[tokens]`.
pub fn logsumexp(
    gpu: &Gpu,
    logits: &CudaView<f32>,
    dims: RouteDims,
    lse: &mut CudaViewMut<f32>,
) -> Result<()> {
    const K: &str = "moe_logsumexp";
    let describe = || dims.describe();
    check_len(K, "logits", logits.len(), dims.cells(K)?, describe)?;
    check_len(K, "lse", lse.len(), dims.tokens, describe)?;
    if dims.tokens == 0 {
        return Ok(());
    }
    let (t, e, _) = dims.args();
    let mut args = launch_args(gpu, K)?;
    args.arg(logits).arg(&t).arg(&e).arg(lse);
    launch(K, args, cover(dims.tokens))
}

/// The load-balancing loss's inputs for [`route_losses`]: its scores, the groups' counts, the
/// factor, and where its gradient goes.
pub struct AuxLoss<'a, 'b> {
    /// `[tokens, experts]` from [`aux_scores`].
    pub scores: &'a CudaView<'b, f32>,
    /// `[groups, experts]` from [`aux_counts`].
    pub counts: &'a CudaView<'b, f32>,
    /// Groups (1: the micro-batch).
    pub groups: usize,
    /// `experts · coeff / (topk · per_group²) / groups`.
    pub factor: f32,
    /// `[tokens, experts]`: the loss's gradient with respect to the scores.
    pub grad: &'a mut CudaViewMut<'b, f32>,
}

/// `losses[2]`: the load-balancing loss (0 without `aux`) and the z loss `Σ lse² / tokens ·
/// coeff` (0 without `z`), each summed in token order.
pub fn route_losses(
    gpu: &Gpu,
    dims: RouteDims,
    aux: Option<AuxLoss<'_, '_>>,
    z: Option<(&CudaView<f32>, f32)>,
    losses: &mut CudaViewMut<f32>,
) -> Result<()> {
    const K: &str = "moe_route_losses";
    let cells = dims.cells(K)?;
    let describe = || dims.describe();
    check_len(K, "losses", losses.len(), 2, describe)?;
    let (t, e, _) = dims.args();
    let mut args = launch_args(gpu, K)?;
    let (mut groups, mut factor) = (1u64, 0.0f32);
    match &aux {
        Some(aux) => {
            check_len(K, "scores", aux.scores.len(), cells, describe)?;
            let counts = product(K, &[aux.groups, dims.experts])?;
            check_len(K, "counts", aux.counts.len(), counts, describe)?;
            check_len(K, "aux_grad", aux.grad.len(), cells, describe)?;
            (groups, factor) = (aux.groups as u64, aux.factor);
            args.arg(aux.scores).arg(aux.counts);
        }
        None => {
            args.arg(&NULL).arg(&NULL);
        }
    }
    args.arg(&t).arg(&e).arg(&groups).arg(&factor);
    let z_coeff = match z {
        Some((lse, coeff)) => {
            check_len(K, "lse", lse.len(), dims.tokens, describe)?;
            args.arg(lse);
            coeff
        }
        None => {
            args.arg(&NULL);
            0.0
        }
    };
    args.arg(&z_coeff);
    match aux {
        Some(aux) => args.arg(aux.grad),
        None => args.arg(&NULL),
    };
    args.arg(losses);
    launch(K, args, cover(1))
}

/// The dispatch's index tables for the experts `experts` (a range of `map`'s columns, checked by
/// the caller) of
/// `map` (`[tokens, experts]`, 1 where a token goes): those pairs laid out expert-major (each
/// expert's in token order), `slots[tokens, experts]` holding each pair's row (−1 for the
/// others) and `source[rows]` each row's token (−1 past the last).
pub fn expert_slots(
    gpu: &Gpu,
    map: &CudaView<i64>,
    (tokens, all): (usize, usize),
    experts: std::ops::Range<usize>,
    slots: &mut CudaViewMut<i64>,
    source: &mut CudaViewMut<i64>,
) -> Result<()> {
    const K: &str = "moe_expert_slots";
    let rows = source.len();
    let describe = || format!("{tokens} tokens × {all} experts ({experts:?}), {rows} rows");
    let cells = product(K, &[tokens, all])?;
    check_len(K, "map", map.len(), cells, describe)?;
    check_len(K, "slots", slots.len(), cells, describe)?;
    if cells == 0 || experts.is_empty() {
        return Ok(());
    }
    let (t, e, first, count, r) = (
        tokens as u64,
        all as u64,
        experts.start as u64,
        experts.len() as u64,
        rows as u64,
    );
    let mut args = launch_args(gpu, K)?;
    args.arg(map)
        .arg(&t)
        .arg(&e)
        .arg(&first)
        .arg(&count)
        .arg(&r);
    args.arg(slots).arg(source);
    launch(K, args, cover(all))
}

/// `counts[j]` = the pairs of expert `experts.start + j` in `map` (`[tokens, experts]`, 1 where a
/// token goes), for the experts `experts` (checked by the caller).
pub fn column_counts(
    gpu: &Gpu,
    map: &CudaView<i64>,
    (tokens, all): (usize, usize),
    experts: std::ops::Range<usize>,
    counts: &mut CudaViewMut<i64>,
) -> Result<()> {
    const K: &str = "moe_column_counts";
    let describe = || format!("{tokens} tokens × {all} experts ({experts:?})");
    check_len(K, "map", map.len(), product(K, &[tokens, all])?, describe)?;
    check_len(K, "counts", counts.len(), experts.len(), describe)?;
    if experts.is_empty() {
        return Ok(());
    }
    let (t, e, first, count) = (
        tokens as u64,
        all as u64,
        experts.start as u64,
        experts.len() as u64,
    );
    let mut args = launch_args(gpu, K)?;
    args.arg(map)
        .arg(&t)
        .arg(&e)
        .arg(&first)
        .arg(&count)
        .arg(counts);
    launch(K, args, cover(experts.len()))
}

/// The regrouping of rows received in chunks of `counts` (`[ranks, local]`: rows from each rank
/// for each local expert, rank-major): `index[rows]` maps each position sorted by local expert
/// to its received position, or with `inverse` each received position to its sorted one.
pub fn chunk_order(
    gpu: &Gpu,
    counts: &CudaView<i64>,
    (ranks, local): (usize, usize),
    inverse: bool,
    index: &mut CudaViewMut<i64>,
) -> Result<()> {
    const K: &str = "moe_chunk_order";
    let describe = || {
        format!(
            "{ranks} ranks × {local} local experts, {} rows",
            index.len()
        )
    };
    check_len(
        K,
        "counts",
        counts.len(),
        product(K, &[ranks, local])?,
        describe,
    )?;
    if ranks * local == 0 {
        return Ok(());
    }
    let (r, l, inv) = (ranks as u64, local as u64, u64::from(inverse));
    let mut args = launch_args(gpu, K)?;
    args.arg(counts).arg(&r).arg(&l).arg(&inv).arg(index);
    launch(K, args, cover(ranks * local))
}

/// `index[i] = (i mod m)·a + (i / m)·b` for every `i` of `index`.
pub fn affine_index(
    gpu: &Gpu,
    (m, a, b): (usize, usize, usize),
    index: &mut CudaViewMut<i64>,
) -> Result<()> {
    const K: &str = "moe_affine_index";
    let n = index.len();
    if n == 0 {
        return Ok(());
    }
    let (n64, m, a, b) = (n as u64, m.max(1) as u64, a as u64, b as u64);
    let mut args = launch_args(gpu, K)?;
    args.arg(&n64).arg(&m).arg(&a).arg(&b).arg(index);
    launch(K, args, cover(n))
}

/// The tokens `x` (`[tokens, hidden]`, f32) laid out expert-major as `map` routes them (each
/// expert's in token order) into `out` (`[rows, hidden]`, zeros past the last routed row), each
/// row's token in `source[rows]` (−1 past the last) and each pair's row in `slots`.
#[allow(clippy::too_many_arguments)]
pub fn permute(
    gpu: &Gpu,
    x: &CudaView<f32>,
    map: &CudaView<i64>,
    dims: RouteDims,
    hidden: usize,
    slots: &mut CudaViewMut<i64>,
    source: &mut CudaViewMut<i64>,
    out: &mut CudaViewMut<f32>,
) -> Result<()> {
    const R: &str = "moe_permute_rows";
    let rows = source.len();
    let describe = || format!("{}, hidden {hidden}, {rows} rows", dims.describe());
    check_len(
        R,
        "x",
        x.len(),
        product(R, &[dims.tokens, hidden])?,
        describe,
    )?;
    if dims.experts == 0 {
        return Ok(());
    }
    expert_slots(
        gpu,
        map,
        (dims.tokens, dims.experts),
        0..dims.experts,
        slots,
        source,
    )?;
    gather_rows(gpu, x, &source.as_view(), hidden, out)
}

/// What the router's forward kept, for [`route_backward`].
pub struct RouteSaved<'a, 'b> {
    /// `[tokens, experts]`: the logits.
    pub logits: &'a CudaView<'b, f32>,
    /// `[tokens, experts]`: 1 where a token went (after capacity).
    pub map: &'a CudaView<'b, i64>,
    /// `[tokens, topk]`: each token's experts, best first.
    pub chosen: &'a CudaView<'b, i64>,
    /// The scores [`route_topk`] wrote.
    pub scores: &'a CudaView<'b, f32>,
    /// The load-balancing loss's scores and gradient (`[tokens, experts]` each), with the loss.
    pub aux: Option<(&'a CudaView<'b, f32>, &'a CudaView<'b, f32>)>,
    /// Each token's log-sum-exp and the z loss's coefficient, with the z loss.
    pub z: Option<(&'a CudaView<'b, f32>, f32)>,
}

/// The router's backward: `dlogits[tokens, experts]` from the weights' gradient `dprobs`
/// (`[tokens, experts]`), plus `loss_scale[0]` (on the device) times the losses' gradients.
#[allow(clippy::too_many_arguments)]
pub fn route_backward(
    gpu: &Gpu,
    saved: RouteSaved<'_, '_>,
    dprobs: &CudaView<f32>,
    loss_scale: &CudaView<f32>,
    dims: RouteDims,
    mode: ScoreMode,
    scale: f32,
    dlogits: &mut CudaViewMut<f32>,
) -> Result<()> {
    const K: &str = "moe_route_backward";
    let cells = dims.cells(K)?;
    let describe = || dims.describe();
    let score_cells = dims.score_cells(K, mode)?;
    check_len(K, "logits", saved.logits.len(), cells, describe)?;
    check_len(K, "map", saved.map.len(), cells, describe)?;
    let picks = dims.picks(K)?;
    check_len(K, "chosen", saved.chosen.len(), picks, describe)?;
    check_len(K, "scores", saved.scores.len(), score_cells, describe)?;
    check_len(K, "dprobs", dprobs.len(), cells, describe)?;
    check_len(K, "loss_scale", loss_scale.len(), 1, describe)?;
    check_len(K, "dlogits", dlogits.len(), cells, describe)?;
    if dims.tokens == 0 {
        return Ok(());
    }
    let ((t, e, k), m) = (dims.args(), mode as i32);
    let mut args = launch_args(gpu, K)?;
    args.arg(saved.logits)
        .arg(dprobs)
        .arg(saved.map)
        .arg(saved.chosen);
    args.arg(saved.scores);
    match saved.aux {
        Some((scores, grad)) => {
            check_len(K, "aux_scores", scores.len(), cells, describe)?;
            check_len(K, "aux_grad", grad.len(), cells, describe)?;
            args.arg(scores).arg(grad)
        }
        None => args.arg(&NULL).arg(&NULL),
    };
    let z_coeff = match saved.z {
        Some((lse, coeff)) => {
            check_len(K, "lse", lse.len(), dims.tokens, describe)?;
            args.arg(lse);
            coeff
        }
        None => {
            args.arg(&NULL);
            0.0
        }
    };
    args.arg(loss_scale)
        .arg(&t)
        .arg(&e)
        .arg(&k)
        .arg(&m)
        .arg(&scale);
    args.arg(&z_coeff).arg(dlogits);
    launch(K, args, cover(dims.tokens))
}

/// `out[r, :] = x[source[r], :]` for rows of `hidden` f32 (`out` `[source.len(), hidden]`;
/// zeros where `source[r] < 0`): a permutation or selection of rows.
pub fn gather_rows(
    gpu: &Gpu,
    x: &CudaView<f32>,
    source: &CudaView<i64>,
    hidden: usize,
    out: &mut CudaViewMut<f32>,
) -> Result<()> {
    const R: &str = "moe_permute_rows";
    let rows = source.len();
    let describe = || format!("{rows} rows of {hidden}");
    check_len(R, "out", out.len(), product(R, &[rows, hidden])?, describe)?;
    if rows == 0 || hidden == 0 {
        return Ok(());
    }
    let (r, h) = (rows as u64, hidden as u64);
    let mut args = launch_args(gpu, R)?;
    args.arg(x).arg(source).arg(&r).arg(&h).arg(out);
    launch(R, args, cover(rows * hidden))
}

/// The pairs' dimensions of [`slot_sum`], [`slot_dots`] and [`slot_scale`]: `slots` is
/// `[tokens, k]`, rows of `hidden`.
#[derive(Debug, Clone, Copy)]
pub struct SlotDims {
    /// Tokens.
    pub tokens: usize,
    /// Slots of each token.
    pub k: usize,
    /// Each row's length.
    pub hidden: usize,
}

impl SlotDims {
    fn describe(&self) -> String {
        format!(
            "{} tokens × {} slots, rows of {}",
            self.tokens, self.k, self.hidden
        )
    }

    fn args(&self) -> (u64, u64, u64) {
        (self.tokens as u64, self.k as u64, self.hidden as u64)
    }
}

/// The combine: `out[t, :] = Σ_k weight[t, k] · rows[slots[t, k], :]` over the slots that name
/// a row, in k order (weight 1 without `weights`; `out` is `[tokens, hidden]`).
pub fn slot_sum(
    gpu: &Gpu,
    rows: &CudaView<f32>,
    slots: &CudaView<i64>,
    weights: Option<&CudaView<f32>>,
    dims: SlotDims,
    out: &mut CudaViewMut<f32>,
) -> Result<()> {
    const K: &str = "moe_slot_sum";
    let describe = || dims.describe();
    let pairs = product(K, &[dims.tokens, dims.k])?;
    check_len(K, "slots", slots.len(), pairs, describe)?;
    if let Some(w) = weights {
        check_len(K, "weights", w.len(), pairs, describe)?;
    }
    check_len(
        K,
        "out",
        out.len(),
        product(K, &[dims.tokens, dims.hidden])?,
        describe,
    )?;
    if out.is_empty() {
        return Ok(());
    }
    let (t, k, h) = dims.args();
    let mut args = launch_args(gpu, K)?;
    args.arg(rows).arg(slots);
    match weights {
        Some(w) => args.arg(w),
        None => args.arg(&NULL),
    };
    args.arg(&t).arg(&k).arg(&h).arg(out);
    launch(K, args, cover(dims.tokens * dims.hidden))
}

/// `dots[t, k] = d[t, :] · rows[slots[t, k], :]` (0 where the slot names no row).
pub fn slot_dots(
    gpu: &Gpu,
    d: &CudaView<f32>,
    rows: &CudaView<f32>,
    slots: &CudaView<i64>,
    dims: SlotDims,
    dots: &mut CudaViewMut<f32>,
) -> Result<()> {
    const K: &str = "moe_slot_dots";
    let describe = || dims.describe();
    let pairs = product(K, &[dims.tokens, dims.k])?;
    check_len(K, "slots", slots.len(), pairs, describe)?;
    check_len(
        K,
        "d",
        d.len(),
        product(K, &[dims.tokens, dims.hidden])?,
        describe,
    )?;
    check_len(K, "dots", dots.len(), pairs, describe)?;
    if pairs == 0 {
        return Ok(());
    }
    let (t, k, h) = dims.args();
    let mut args = launch_args(gpu, K)?;
    args.arg(d)
        .arg(rows)
        .arg(slots)
        .arg(&t)
        .arg(&k)
        .arg(&h)
        .arg(dots);
    launch(K, args, cover(pairs))
}

/// `out[slots[t, k], :] = weights[t, k] · d[t, :]` for every slot that names a row (`out` is
/// `[rows, hidden]`; rows no slot names are left as they are).
pub fn slot_scale(
    gpu: &Gpu,
    d: &CudaView<f32>,
    slots: &CudaView<i64>,
    weights: &CudaView<f32>,
    dims: SlotDims,
    out: &mut CudaViewMut<f32>,
) -> Result<()> {
    const K: &str = "moe_slot_scale";
    let describe = || dims.describe();
    let pairs = product(K, &[dims.tokens, dims.k])?;
    check_len(K, "slots", slots.len(), pairs, describe)?;
    check_len(K, "weights", weights.len(), pairs, describe)?;
    check_len(
        K,
        "d",
        d.len(),
        product(K, &[dims.tokens, dims.hidden])?,
        describe,
    )?;
    if pairs == 0 || dims.hidden == 0 {
        return Ok(());
    }
    let (t, k, h) = dims.args();
    let mut args = launch_args(gpu, K)?;
    args.arg(d)
        .arg(slots)
        .arg(weights)
        .arg(&t)
        .arg(&k)
        .arg(&h)
        .arg(out);
    launch(K, args, cover(pairs * dims.hidden))
}
