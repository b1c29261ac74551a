//! The device seam: every tensor operation whose code differs by device is a method of one of
//! the traits here, implemented once for the host ([`Cpu`], in `cpu/`) and once for a GPU
//! (`crate::cuda::Gpu`, in `cuda/backend/`). The layers, the MoE layer, the optimizer and the
//! communicators ask a tensor for its backend ([`of`]) and call the operation; they never
//! choose a device, and no `cfg` reaches them.
//!
//! This is candle's `Storage` enum over a backend trait, with the enum being the tensor's own
//! storage (host memory, or device memory and the GPU handle that owns it). Without the `cuda`
//! feature the GPU is a stand-in type with no values (`cuda/stand_in.rs`); [`device_ops!`]
//! declares each trait and gives the stand-in its (unreachable) implementation, so a new
//! operation is written once per device and nowhere else.
//!
//! A new family of kernels (RMSNorm, RoPE, SwiGLU) is one more trait here, one file in `cpu/`
//! and one in `cuda/backend/`.

mod cpu;

pub(crate) use cpu::{
    bf16_products as cpu_bf16_products_on, grouped_product as cpu_grouped_product,
    product as cpu_product, set_bf16_products as set_cpu_bf16_products,
};

pub(crate) use attention::AttentionOps;
pub(crate) use cpu::Cpu;

use crate::cuda::DeviceRouting;
use crate::error::Result;
use crate::kernels::adam::AdamConfig;
use crate::kernels::dropout::LogicalIndex;
use crate::kernels::heads::GroupedHeads;
use crate::kernels::rotary::RopeLayout;
use crate::module::Param;
use crate::moe::RouterConfig;
use crate::moe::experts::{ExpertShape, ExpertsSaved};
use crate::ops::FusedKernel;
use crate::rng::DropoutStream;
use crate::tensor::{DType, Result as TensorResult, Tensor};

/// Declares a backend trait and, in a build without CUDA, the stand-in GPU's implementation of
/// it (each method unreachable: the stand-in has no values).
macro_rules! device_ops {
    (
        $(#[$attr:meta])*
        pub(crate) trait $name:ident {
            $(
                $(#[$method_attr:meta])*
                fn $method:ident(&self $(, $arg:ident: $ty:ty)* $(,)?) -> $ret:ty;
            )*
        }
    ) => {
        $(#[$attr])*
        pub(crate) trait $name {
            $(
                $(#[$method_attr])*
                fn $method(&self $(, $arg: $ty)*) -> $ret;
            )*
        }

        #[cfg(not(feature = "cuda"))]
        impl $name for crate::cuda::Gpu {
            $(
                fn $method(&self $(, _: $ty)*) -> $ret {
                    match *self {}
                }
            )*
        }
    };
}

pub(crate) mod attention;

/// `x`'s shape with the last dimension `n` (SwiGLU's output, attention's head layouts; the
/// kernels check that the sizes fit).
pub(crate) fn with_last_dim(x: &Tensor, n: usize) -> Vec<usize> {
    let mut dims = x.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = n;
    }
    dims
}

/// A dropout mask's key: the drop probability, the random stream and where the tensor's
/// elements lie in the unsharded tensor (the mask is regenerated from it, never stored).
pub(crate) type DropoutMask = (f32, DropoutStream, LogicalIndex);

device_ops! {
    /// Element-wise functions of a module's forward and their backwards (`ops::primitives`).
    pub(crate) trait ElementwiseOps {
        /// `a + b` in f32 (same shapes, checked by the caller).
        fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor>;
        /// GeLU (tanh approximation) of `x`, and the input the backward keeps.
        fn gelu(&self, x: &Tensor) -> Result<(Tensor, Tensor)>;
        /// `dy · gelu'(x)` for the kept input `x`.
        fn gelu_backward(&self, x: &Tensor, dy: &Tensor) -> Result<Tensor>;
        /// SwiGLU of `x[.., 2·ffn]` (gate, then up): `silu(gate) · up`, `[.., ffn]`, and the
        /// input the backward keeps.
        fn swiglu(&self, x: &Tensor, ffn: usize) -> Result<(Tensor, Tensor)>;
        /// The gradient of [`ElementwiseOps::swiglu`] for the kept input `x`, `[.., 2·ffn]`.
        fn swiglu_backward(&self, x: &Tensor, dy: &Tensor, ffn: usize) -> Result<Tensor>;
        /// The mask applied to a contiguous f32 `x`, written in `dtype` (f32, or on a GPU
        /// bf16): the forward, or with `backward` the gradient (the same mask).
        fn dropout(&self, x: &Tensor, mask: &DropoutMask, dtype: DType, backward: bool) -> Result<Tensor>;
        /// `residual + mask(x)` of contiguous f32 tensors in one pass.
        fn dropout_add(&self, residual: &Tensor, x: &Tensor, mask: &DropoutMask) -> Result<Tensor>;
        /// Per-row losses (the targets' shape), `logsumexp[rows]` and the targets as the
        /// backward reads them, of contiguous f32 `logits` and i64 `targets`.
        fn cross_entropy(&self, logits: &Tensor, targets: &Tensor, rows: usize, vocab: usize) -> Result<(Tensor, Tensor, Tensor)>;
        /// Gradient of [`ElementwiseOps::cross_entropy`] with respect to the logits.
        fn cross_entropy_backward(&self, logits: &Tensor, targets: &Tensor, logsumexp: &Tensor, dloss: &Tensor, rows: usize, vocab: usize) -> Result<Tensor>;
    }
}

device_ops! {
    /// The element-wise chains `#[megatron::module]` fuses into generated kernels
    /// (`ops::fused`).
    pub(crate) trait FusedOps {
        /// The outputs of `kernel` (its host loop, or its CUDA C on a GPU) over the equally
        /// shaped `inputs` (counts checked by the caller), each of their shape, in f32.
        fn fused(&self, kernel: &'static FusedKernel, inputs: &[&Tensor], scalars: &[f32]) -> Result<Vec<Tensor>>;
    }
}

device_ops! {
    /// What [`Tensor`] itself asks of a GPU that holds its memory: copies and fills.
    pub(crate) trait MemoryOps {
        /// A contiguous host copy of a device tensor (after the work queued on its stream).
        fn download_tensor(&self, t: &Tensor) -> TensorResult<Tensor>;
        /// `dst.copy_from(src)` where either is on this GPU (same shapes, checked by the caller).
        fn copy_tensor(&self, dst: &Tensor, src: &Tensor) -> TensorResult<()>;
        /// Sets every element of a contiguous device tensor to `value`.
        fn fill_tensor(&self, t: &Tensor, value: f32) -> TensorResult<()>;
    }
}

device_ops! {
    /// Matrix products of tensor views (`ops::matmul`).
    pub(crate) trait MatmulOps {
        /// `c = α·(a @ b) + β·c` (see `ops::matmul_into`).
        fn matmul_into(&self, alpha: f32, a: &Tensor, b: &Tensor, beta: f32, c: &Tensor) -> TensorResult<()>;
        /// `c = a @ b + bias` as one product where the device can fuse the bias; `false`,
        /// having done nothing, where it cannot (see `ops::matmul_bias_into`).
        fn matmul_bias_into(&self, a: &Tensor, b: &Tensor, bias: &Tensor, c: &Tensor) -> TensorResult<bool>;
        /// The dtype products multiply their operands in.
        fn products_dtype(&self) -> DType;
        /// Whether [`MatmulOps::matmul_bias_into`] can ever fuse here (worth preparing an
        /// output for it).
        fn may_fuse_bias(&self) -> bool;
    }
}

device_ops! {
    /// A linear layer's bias (`tensor_parallel::linear`); the products are [`MatmulOps`]'.
    pub(crate) trait BiasOps {
        /// `y[r, c] += bias[c]` for a contiguous f32 `y` whose rows are `bias.numel()` long.
        fn bias_add_in_place(&self, y: &Tensor, bias: &Tensor) -> Result<()>;
        /// `y + bias` of a contiguous f32 `y` written in `dtype`, the f32 sum rounded once
        /// (`y` may be overwritten).
        fn bias_add_cast(&self, y: &Tensor, bias: &Tensor, dtype: DType) -> Result<Tensor>;
        /// `grad += Σ_r dy[r, ·]` for `dy[rows, out]`.
        fn accumulate_bias_grad(&self, dy: &Tensor, rows: usize, out: usize, grad: &Tensor) -> Result<()>;
    }
}

device_ops! {
    /// Layer normalisation and RMSNorm over the last dimension (`tensor_parallel::layer_norm`).
    pub(crate) trait NormOps {
        /// `y`, `mean[rows]` and `rstd[rows]` of a contiguous f32 `x` of `rows` rows of `h`,
        /// with f32 `gamma` and `beta`, or without `beta` RMSNorm's (no mean, `mean` 0); `y`
        /// in the products' dtype (on a GPU that multiplies in bf16 the normalised rows are the
        /// next products' operand, rounded once here).
        fn layer_norm(&self, x: &Tensor, gamma: &Tensor, beta: Option<&Tensor>, rows: usize, h: usize, eps: f32) -> Result<(Tensor, Tensor, Tensor)>;
        /// Writes `dx` (plus `plus` when given) and accumulates (`+=`) `dgamma` and `dbeta`,
        /// from the forward's kept `(x, mean, rstd, gamma)`; `grads` is `(dx, dgamma, dbeta)`,
        /// without `dbeta` for RMSNorm.
        fn layer_norm_backward(&self, dy: &Tensor, kept: (&Tensor, &Tensor, &Tensor, &Tensor), plus: Option<&Tensor>, rows: usize, h: usize, grads: (&Tensor, &Tensor, Option<&Tensor>)) -> Result<()>;
    }
}

device_ops! {
    /// The local steps of the fused vocab-parallel cross-entropy
    /// (`tensor_parallel::cross_entropy`); its three all-reduces stay with the layer.
    pub(crate) trait VocabLossOps {
        /// The contiguous targets as the next steps read them (host targets checked against
        /// the `total` padded vocabulary), each row's local logit maximum, and the target's
        /// logit where this rank's slice (from vocabulary entry `start`) holds it, else 0.
        fn vocab_ce_local(&self, logits: &Tensor, targets: &Tensor, start: usize, total: usize) -> Result<(Tensor, Tensor, Tensor)>;
        /// Each row's local `Σ exp(logit − max)` for the all-reduced `max`.
        fn vocab_ce_sum_exp(&self, logits: &Tensor, max: &Tensor) -> Result<Tensor>;
        /// The per-token losses (the targets' shape) and log-sum-exp from the all-reduced
        /// `(max, sum, target_logit)`.
        fn vocab_ce_finish(&self, reduced: (&Tensor, &Tensor, &Tensor), targets: &Tensor, total: usize) -> Result<(Tensor, Tensor)>;
        /// `(softmax − onehot) · dloss` of the kept `(logits, targets, logsumexp)` for the
        /// slice from vocabulary entry `start`, written in `dtype` (f32, or on a GPU bf16).
        fn vocab_ce_backward(&self, kept: (&Tensor, &Tensor, &Tensor), dloss: &Tensor, start: usize, dtype: DType) -> Result<Tensor>;
    }
}

/// Checks that every target lies in the (padded) vocabulary of `total` entries.
pub(crate) fn check_targets(targets: &[i64], total: usize) -> Result<()> {
    if let Some((row, &bad)) = targets
        .iter()
        .enumerate()
        .find(|&(_, &t)| t < 0 || t as usize >= total)
    {
        return crate::invalid!(
            "target {bad} of row {row} is outside the (padded) vocabulary of {total}"
        );
    }
    Ok(())
}

device_ops! {
    /// Where a tensor lives.
    pub(crate) trait PlaceOps {
        /// `t` on this device: itself when it is there, else a copy (an upload to a GPU).
        fn place(&self, t: &Tensor) -> Result<Tensor>;
    }
}

device_ops! {
    /// Table lookups of the embeddings (`tensor_parallel::embedding`) and the output layer's
    /// vocabulary padding.
    pub(crate) trait EmbeddingOps {
        /// The rows of the f32 `table` for i64 `ids` (this shard's `(vocab_start, local_rows)`
        /// rows; others give zeros), `[.., h]`, and the ids as the backward reads them.
        fn embedding_lookup(&self, ids: &Tensor, table: &Tensor, rows: (usize, usize)) -> Result<(Tensor, Tensor)>;
        /// `grad[id − vocab_start] += dy[t]` for each of this shard's ids.
        fn embedding_lookup_backward(&self, ids: &Tensor, dy: &Tensor, rows: (usize, usize), grad: &Tensor) -> Result<()>;
        /// Rows `0..seq` of the position table `[max, h]`, each repeated for `batch` entries:
        /// `[seq, batch, h]`.
        fn positions_forward(&self, table: &Tensor, seq: usize, batch: usize) -> Result<Tensor>;
        /// Adds each position's gradient over the batch into `grad` (in the same order on
        /// every device: bit for bit).
        fn positions_backward(&self, dy: &Tensor, seq: usize, batch: usize, grad: &Tensor) -> Result<()>;
        /// Sets columns `from..cols` of every row of the contiguous f32 `x[.., cols]` to −∞.
        fn mask_columns(&self, x: &Tensor, cols: usize, from: usize) -> Result<()>;
    }
}

device_ops! {
    /// The optimizer's passes over runs of a flat buffer (`optimizer::adamw`).
    pub(crate) trait OptimizerOps {
        /// Multiplies every element of `parts` by `scale`; whether any is not finite.
        fn unscale_and_check(&self, parts: &[Tensor], scale: f32) -> Result<bool>;
        /// One Adam(W) update of f32 `(params, grads, exp_avg, exp_avg_sq)`, also writing the
        /// updated values rounded into the bf16 `copy` when given.
        fn adam_step(&self, state: (&Tensor, &Tensor, &Tensor, &Tensor), copy: Option<&Tensor>, config: &AdamConfig) -> Result<()>;
        /// Σx² over every element of f32 `parts`, in f64.
        fn sum_of_squares(&self, parts: &[Tensor]) -> Result<f64>;
    }
}

device_ops! {
    /// A rank's local experts as grouped products (`moe::experts`): each expert an MLP
    /// `fc2(gelu(fc1(x)))` over its contiguous rows.
    pub(crate) trait ExpertOps {
        /// `[n, hidden]` outputs of the rows `x` (`rows[g]` for local expert g, in order)
        /// through the weights `(fc1 [experts, ffn, hidden], fc2 [experts, hidden, ffn])`, and
        /// what the backward keeps.
        fn experts_forward(&self, shape: &ExpertShape, x: &Tensor, rows: &[usize], weights: (&Tensor, &Tensor)) -> Result<(Tensor, ExpertsSaved)>;
        /// The rows' gradient `[n, hidden]` from the outputs' `dy`, and the accumulation of the
        /// weights' gradients into `params` (`fc1`, `fc2`) to run now or later (the split
        /// backward: [`crate::module::WeightGrad`]).
        fn experts_backward(&self, shape: &ExpertShape, saved: ExpertsSaved, dy: &Tensor, params: (&Param, &Param)) -> Result<(Tensor, crate::module::WeightGrad)>;
    }
}

device_ops! {
    /// Rows of `[n, hidden]` f32 tensors moved by index tables that live where the rows do: the
    /// MoE dispatcher's permutations, the combine and their backwards (`moe::dispatcher`), and
    /// the tables themselves, computed there from the routing's map and the exchanged counts,
    /// so that on a GPU only the counts cross to the host. Index tables are i64; a slot table
    /// `[tokens, k]` names for each token the rows (`-1`: none) it is summed from or scattered
    /// to, in k order.
    pub(crate) trait RowOps {
        /// `out[i] = rows[index[i]]` (zeros where `index[i] < 0`), `[index.numel(), hidden]`.
        fn gather_rows(&self, rows: &Tensor, hidden: usize, index: &Tensor) -> Result<Tensor>;
        /// `out[t] = Σ_k weight[t, k] · rows[slots[t, k]]` over the slots naming a row, in k
        /// order from zeros (weight 1 without `weights`): `[tokens, hidden]`.
        fn sum_rows(&self, rows: &Tensor, hidden: usize, slots: &Tensor, weights: Option<&Tensor>) -> Result<Tensor>;
        /// `dots[t, k] = d[t] · rows[slots[t, k]]` (0 where the slot names no row): `[tokens, k]`.
        fn row_dots(&self, d: &Tensor, rows: &Tensor, hidden: usize, slots: &Tensor) -> Result<Tensor>;
        /// `out[slots[t, k]] = weights[t, k] · d[t]` for the slots naming a row, `[rows, hidden]`
        /// (zeros in the rows none names).
        fn scale_rows(&self, d: &Tensor, hidden: usize, slots: &Tensor, weights: &Tensor, rows: usize) -> Result<Tensor>;
        /// The dispatch's tables for the pairs of `map` (`[tokens, experts]`, i64, 1 where a
        /// token goes) whose experts lie in `experts`, laid out expert-major (each expert's in
        /// token order): the slot table `[tokens, experts]` (each pair's row) and each row's
        /// token (`[rows]`, −1 past the last pair).
        fn expert_slots(&self, map: &Tensor, experts: std::ops::Range<usize>, rows: usize) -> Result<(Tensor, Tensor)>;
        /// The pairs of each expert of `experts` in `map` (`[tokens, experts]`, i64, 1 where a
        /// token goes): `[experts.len()]` i64.
        fn column_counts(&self, map: &Tensor, experts: std::ops::Range<usize>) -> Result<Tensor>;
        /// For `rows` rows received in chunks of `counts` (i64 `[ranks, local]`, rank-major),
        /// the position each has once sorted by local expert (`inverse`) or, for each sorted
        /// position, the received one (an index for [`RowOps::gather_rows`]).
        fn chunk_order(&self, counts: &Tensor, local: usize, rows: usize, inverse: bool) -> Result<Tensor>;
        /// `index[i] = (i mod m)·a + (i / m)·b` for `i < n`, with `(m, a, b)`.
        fn affine_index(&self, n: usize, mab: (usize, usize, usize)) -> Result<Tensor>;
    }
}

device_ops! {
    /// The MoE router where the tokens are (`moe::routed`).
    pub(crate) trait RouterOps {
        /// On a GPU, the gate's logits `[tokens, experts]` of the tokens `x` (`[.., hidden]`)
        /// and their routing, `(seq, config, bias, tp)` as the host router takes them (`tp`:
        /// with sequence parallelism, the group the load-balancing counts are summed over),
        /// nothing read back (a graph can capture them), with `permute` also the rows laid out
        /// expert-major for the all-to-all; `None` on the host, whose router runs on the
        /// logits' values.
        fn route_on_device(&self, x: &Tensor, gate: &Tensor, routing: (usize, &RouterConfig, Option<&Tensor>, Option<&dyn crate::comm::Communicator>), permute: bool) -> Result<Option<(Tensor, DeviceRouting)>>;
    }
}

device_ops! {
    /// Grouped-query attention's fused projection as multi-head attention reads it
    /// (`tensor_parallel::attention`).
    pub(crate) trait GroupedHeadOps {
        /// `qkv` (`[s, b, groups·(per_group + 2)·d]`) with each query head's group's key and
        /// value beside it (`[s, b, groups·per_group·3·d]`); in `qkv`'s dtype on a GPU.
        fn expand_groups(&self, qkv: &Tensor, sh: GroupedHeads) -> Result<Tensor>;
        /// The backward of [`GroupedHeadOps::expand_groups`].
        fn reduce_groups(&self, d_qkv: &Tensor, sh: GroupedHeads) -> Result<Tensor>;
    }
}

device_ops! {
    /// Rotary position embeddings on a fused projection (`tensor_parallel::rotary`).
    pub(crate) trait RotaryOps {
        /// `x` (`[seq, batch, row]` of `layout`) with RoPE applied by the `inv_freq`
        /// frequencies, or with `inverse` turned back (the backward); on a GPU in `x`'s dtype,
        /// on the host in f32.
        fn rope(&self, x: &Tensor, layout: RopeLayout, inv_freq: &[f32], inverse: bool) -> Result<Tensor>;
    }
}

/// Every operation a device provides.
pub(crate) trait Backend:
    AttentionOps
    + BiasOps
    + ElementwiseOps
    + EmbeddingOps
    + ExpertOps
    + FusedOps
    + GroupedHeadOps
    + MatmulOps
    + NormOps
    + OptimizerOps
    + PlaceOps
    + RotaryOps
    + RouterOps
    + RowOps
    + VocabLossOps
    + Sync
{
}

/// The backend of the device that holds `t`.
pub(crate) fn of(t: &Tensor) -> &dyn Backend {
    match t.gpu() {
        Some(gpu) => gpu,
        None => &Cpu,
    }
}

/// The backend of the first of `tensors` that is on a GPU (host operands are uploaded by the
/// GPU's operations), else the host's.
pub(crate) fn of_any<'a>(tensors: &[&'a Tensor]) -> &'a dyn Backend {
    match tensors.iter().find_map(|t| t.gpu()) {
        Some(gpu) => gpu,
        None => &Cpu,
    }
}
