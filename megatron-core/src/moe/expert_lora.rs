//! LoRA beside the routed experts' layers: one adapter per expert, `W_e + (α / r)·B_e·A_e`,
//! as Megatron-LM's per-expert `linear_fc1` and `linear_fc2` get from Megatron-Bridge, and as
//! PEFT adapts transformers' fused expert weights (`target_parameters`).
//!
//! The experts run as grouped products over all of a rank's experts at once, so the adapters
//! are applied in the merged form PEFT uses for expert weights: each step the layer adds
//! `(α / r)·B_e·A_e` to a copy of every local expert's weight and runs the grouped products on
//! it; in backward the gradient of that merged weight, `G_e`, gives the adapters'
//! (`dB_e = (α / r)·G_e·A_eᵀ`, `dA_e = (α / r)·B_eᵀ·G_e`). The merged copy lives for one layer's
//! forward or backward; nothing of the base gets a gradient or optimizer state.
//!
//! Split over expert tensor parallelism as Bridge splits a dense layer's adapter over tp
//! (see [`crate::tensor_parallel::lora`]), expert by expert:
//!
//! - beside **fc1** (column-parallel over etp): A `[E, r, hidden]` split over the rank (r / etp
//!   rows each), B `[E, fc1 rows, r]` over the outputs as fc1's rows (each rank's gate and up
//!   rows). The merged slice needs all of A: all-gathered over etp in forward; A's gradient,
//!   partial on each rank, is reduce-scattered back to the rank's rows.
//! - beside **fc2** (row-parallel over etp): A `[E, r, ffn]` split over the inputs as fc2's
//!   columns, B `[E, hidden, r]` over the outputs (hidden / etp rows each). The merged slice
//!   needs all of B: all-gathered; B's partial gradient reduce-scattered.
//!
//! Over expert parallelism each rank holds its experts' adapters whole, reduced over expert
//! data parallelism as the experts' weights are. With one rank per expert-tensor-parallel group
//! nothing is exchanged.

use crate::comm::{Communicator, ReduceOp};
use crate::error::Result;
use crate::invalid;
use crate::module::{Builder, Init, Param, Split};
use crate::ops::matmul_into;
use crate::parallel::GroupKind;
use crate::tensor::{DType, Tensor};
use crate::tensor_parallel::lora::{Beside, LoraConfig};

/// An adapter's A and B as its merge reads them (see [`ExpertAdapter::factors`]).
#[derive(Debug, Clone)]
pub struct Factors {
    a: Tensor,
    b: Tensor,
}

/// One layer's adapters, one per local expert (see the module's documentation).
#[derive(Debug, Clone)]
pub struct ExpertAdapter {
    a: Param,
    b: Param,
    scale: f32,
    beside: Side,
}

/// The experts' layer an adapter sits beside.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    /// fc1, column-parallel over etp.
    Fc1,
    /// fc2, row-parallel over etp.
    Fc2,
}

impl ExpertAdapter {
    /// Builds the adapters of the experts' layer of `in_features → out_features` per expert in
    /// `b`'s scope (`lora_a.weight` `[experts, r, in]` and `lora_b.weight` `[experts, out, r]`
    /// beside the layer's weight), B's rows beside fc1 split as `out_split` (fc1's).
    pub fn build(
        config: &LoraConfig,
        b: &mut Builder,
        beside: Beside,
        (experts, in_features, out_features): (usize, usize, usize),
        out_split: Split,
    ) -> Result<ExpertAdapter> {
        let r = config.rank;
        let etp = b.group(GroupKind::Etp).1;
        if r == 0 {
            return invalid!("{}: a LoRA rank of 0 adapts nothing", b.name("lora_a"));
        }
        if config.dropout > 0.0 {
            return invalid!(
                "{}: LoRA dropout {} beside the experts: their adapters are merged into each \
                 expert's weight, which cannot drop the adapters' input alone (PEFT's \
                 target_parameters refuses it too)",
                b.name("lora_a"),
                config.dropout
            );
        }
        if r > in_features.min(out_features) {
            return invalid!(
                "{}: LoRA rank {r} is larger than each expert's layer ({in_features} inputs, \
                 {out_features} outputs): a low-rank update needs r ≤ {}",
                b.name("lora_a"),
                in_features.min(out_features)
            );
        }
        let side = match beside {
            Beside::Column => Side::Fc1,
            Beside::Row => Side::Fc2,
            Beside::Whole => {
                return invalid!(
                    "{}: the experts' layers are split over etp; an adapter sits beside their \
                     column-parallel fc1 or row-parallel fc2",
                    b.name("lora_a")
                );
            }
        };
        let (a_split, b_split) = match side {
            Side::Fc1 => {
                if !r.is_multiple_of(etp) {
                    return invalid!(
                        "{}: LoRA rank {r} beside the experts' fc1 is split over the expert \
                         tensor-parallel size {etp} (A's rows, as Megatron-Bridge splits \
                         them): choose a rank divisible by {etp}",
                        b.name("lora_a")
                    );
                }
                (Split::Experts { dim: 1, blocks: 1 }, out_split)
            }
            Side::Fc2 => {
                if !out_features.is_multiple_of(etp) {
                    return invalid!(
                        "{}: B's {out_features} rows beside the experts' fc2 are split over the \
                         expert tensor-parallel size {etp}, which does not divide them",
                        b.name("lora_b")
                    );
                }
                (
                    Split::Experts { dim: 2, blocks: 1 },
                    Split::Experts { dim: 1, blocks: 1 },
                )
            }
        };
        // Xavier's normal for each expert's A (Megatron-Bridge's `lora_A_init_method`), zeros
        // for B: the adapted experts start as the base's.
        let std = (2.0 / (in_features + r) as f32).sqrt();
        let a = b.scoped("lora_a", |b| {
            b.param(
                "weight",
                [experts, r, in_features],
                a_split,
                Init::Normal { std },
                true,
            )
        })?;
        let bm = b.scoped("lora_b", |b| {
            b.param(
                "weight",
                [experts, out_features, r],
                b_split,
                Init::ZEROS,
                true,
            )
        })?;
        Ok(ExpertAdapter {
            a,
            b: bm,
            scale: config.scale(),
            beside: side,
        })
    }

    /// A and B (in visit order).
    pub fn params(&self) -> [&Param; 2] {
        [&self.a, &self.b]
    }

    /// A and B, mutably (in visit order).
    pub fn params_mut(&mut self) -> [&mut Param; 2] {
        [&mut self.a, &mut self.b]
    }

    /// A and B as the merge and its backward read them: f32 `[experts, .., ..]`, the split
    /// factor gathered whole over `etp` (one exchange, shared by the layer's backward and the
    /// adapters' gradients).
    pub fn factors(&self, etp: &dyn Communicator) -> Result<Factors> {
        let (split, held) = match self.beside {
            Side::Fc1 => (&self.a, &self.b),
            Side::Fc2 => (&self.b, &self.a),
        };
        let whole = gather_dim1(etp, &split.compute_value().to_f32_contiguous()?)?;
        let held = held.compute_value().to_f32_contiguous()?;
        Ok(match self.beside {
            Side::Fc1 => Factors { a: whole, b: held },
            Side::Fc2 => Factors { a: held, b: whole },
        })
    }

    /// This rank's slice of every local expert's weight with its adapter merged in,
    /// `W_e + (α / r)·B_e·A_e` (summed in f32, then in `w`'s compute dtype), from
    /// [`ExpertAdapter::factors`].
    pub fn merged(&self, w: &Param, Factors { a, b }: &Factors) -> Result<Tensor> {
        let base = w.compute_value();
        let sum = Tensor::empty_near(base.shape().clone(), DType::F32, base)?;
        sum.copy_from(&base.to_dtype(DType::F32)?)?;
        for e in 0..sum.dims()[0] {
            matmul_into(
                self.scale,
                &expert(b, e)?,
                &expert(a, e)?,
                1.0,
                &expert(&sum, e)?,
            )?;
        }
        Ok(match base.dtype() {
            DType::F32 => sum,
            dtype => sum.to_dtype(dtype)?,
        })
    }

    /// Accumulates the adapters' gradients from `g`, the gradient of the merged weight
    /// (`[experts, out, in]` of this rank's slice, f32): the held factor's from this rank's
    /// slice, the split one's summed over `etp` and scattered back to each rank's part.
    pub fn backward(
        &self,
        g: &Tensor,
        Factors { a, b }: &Factors,
        etp: &dyn Communicator,
    ) -> Result<()> {
        let s = self.scale;
        // dB_e = s·G_e·A_eᵀ and dA_e = s·B_eᵀ·G_e, into `into` (`beta`: 1 adds, 0 writes).
        let grad_b = |into: &Tensor, beta: f32| -> Result<()> {
            for e in 0..g.dims()[0] {
                matmul_into(
                    s,
                    &expert(g, e)?,
                    &expert(a, e)?.t()?,
                    beta,
                    &expert(into, e)?,
                )?;
            }
            Ok(())
        };
        let grad_a = |into: &Tensor, beta: f32| -> Result<()> {
            for e in 0..g.dims()[0] {
                matmul_into(
                    s,
                    &expert(b, e)?.t()?,
                    &expert(g, e)?,
                    beta,
                    &expert(into, e)?,
                )?;
            }
            Ok(())
        };
        // The held factor's gradient comes whole from this rank's slice; the split one's is
        // partial (this rank's rows or columns of G): summed over etp, each keeping its part.
        let (split, like) = match self.beside {
            Side::Fc1 => {
                self.b.accumulate_grad(|grad| grad_b(grad, 1.0))?;
                (&self.a, &a)
            }
            Side::Fc2 => {
                self.a.accumulate_grad(|grad| grad_a(grad, 1.0))?;
                (&self.b, &b)
            }
        };
        if split.is_frozen() {
            return Ok(());
        }
        let partial = Tensor::empty_near(like.shape().clone(), DType::F32, like)?;
        match self.beside {
            Side::Fc1 => grad_a(&partial, 0.0)?,
            Side::Fc2 => grad_b(&partial, 0.0)?,
        }
        let part = reduce_scatter_dim1(etp, &partial)?;
        split.accumulate_grad(|grad| {
            let sum = crate::ops::add(grad, &part)?;
            Ok(grad.copy_from(&sum)?)
        })
    }
}

/// Expert `e` of `[experts, rows, cols]`: a `[rows, cols]` view.
fn expert(t: &Tensor, e: usize) -> Result<Tensor> {
    let (rows, cols) = (t.dims()[1], t.dims()[2]);
    Ok(t.narrow(0, e, 1)?.reshape([rows, cols])?)
}

/// The run of `[experts, rows, cols]`'s flat elements that is expert `e`'s rows
/// `at..at + n`.
fn rows_of(
    flat: &Tensor,
    (rows, cols): (usize, usize),
    e: usize,
    at: usize,
    n: usize,
) -> Result<Tensor> {
    Ok(flat.narrow(0, (e * rows + at) * cols, n * cols)?)
}

/// Every rank's `[experts, d, cols]` of `comm` side by side along dimension 1:
/// `[experts, ranks·d, cols]` (rank order).
fn gather_dim1(comm: &dyn Communicator, t: &Tensor) -> Result<Tensor> {
    let n = comm.size();
    if n == 1 {
        return Ok(t.clone());
    }
    let (experts, d, cols) = (t.dims()[0], t.dims()[1], t.dims()[2]);
    let all = Tensor::empty_near([n * experts * d * cols], DType::F32, t)?;
    comm.all_gather(&t.reshape([experts * d * cols])?, &all)?;
    let out = Tensor::empty_near([experts, n * d, cols], DType::F32, t)?;
    let flat = out.reshape([experts * n * d * cols])?;
    for i in 0..n {
        let from = all.narrow(0, i * experts * d * cols, experts * d * cols)?;
        for e in 0..experts {
            rows_of(&flat, (n * d, cols), e, i * d, d)?.copy_from(&rows_of(
                &from,
                (d, cols),
                e,
                0,
                d,
            )?)?;
        }
    }
    Ok(out)
}

/// The sum over `comm` of `[experts, ranks·d, cols]`, each rank keeping its `[experts, d,
/// cols]` (the backward of [`gather_dim1`]).
fn reduce_scatter_dim1(comm: &dyn Communicator, t: &Tensor) -> Result<Tensor> {
    let n = comm.size();
    if n == 1 {
        return Ok(t.clone());
    }
    let (experts, whole, cols) = (t.dims()[0], t.dims()[1], t.dims()[2]);
    let d = whole / n;
    let flat = t.reshape([experts * whole * cols])?;
    let by_rank = Tensor::empty_near([n * experts * d * cols], DType::F32, t)?;
    for i in 0..n {
        let to = by_rank.narrow(0, i * experts * d * cols, experts * d * cols)?;
        for e in 0..experts {
            rows_of(&to, (d, cols), e, 0, d)?.copy_from(&rows_of(
                &flat,
                (whole, cols),
                e,
                i * d,
                d,
            )?)?;
        }
    }
    let out = Tensor::empty_near([experts, d, cols], DType::F32, t)?;
    comm.reduce_scatter(&by_rank, &out.reshape([experts * d * cols])?, ReduceOp::Sum)?;
    Ok(out)
}
