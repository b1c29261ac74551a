//! LoRA (Hu et al., 2021): a low-rank update `(α / r)·B·A` beside a linear layer's frozen weight,
//! `y = x·Wᵀ + (α / r)·(x·Aᵀ)·Bᵀ`, with A `[r, in]` drawn (Xavier's normal) and B `[out, r]`
//! starting at zero, so that the adapted model starts as the base.
//!
//! Split over tensor parallelism as Megatron-Bridge splits its adapters
//! (`ParallelLinearAdapter`, `peft/utils.py`):
//!
//! - beside a **column-parallel** layer (`linear_qkv`, `linear_fc1`): A is split over the rank
//!   (`[r / tp, in]`, so r must divide by tp), its output all-gathered to the whole rank; B is
//!   split over the output features as the layer's weight is (`[out / tp, r]`: whole query
//!   groups, or each rank's gate and up rows), its output added to the rank's outputs. In
//!   backward, B's input gradient is all-reduced, then each rank keeps its slice of the rank
//!   (the gather's backward); A's input gradient joins the layer's partial one, all-reduced by f.
//! - beside a **row-parallel** layer (`linear_proj`, `linear_fc2`): A is split over the input
//!   features (`[r, in / tp]`), its partial outputs all-reduced to the whole rank; B is split
//!   over the output features (`[out / tp, r]`). Bridge all-gathers B's outputs and adds them to
//!   the layer's reduced output; here each rank adds its B's outputs into its own columns of the
//!   layer's partial outputs before g, whose all-reduce (or reduce-scatter) then carries them
//!   to every rank: the same sum, one collective fewer. In backward, each rank's columns of the
//!   output gradient give B's input gradient, all-reduced.
//!
//! No matrix is replicated, so no adapter gradient is summed over tensor parallelism, with or
//! without sequence parallelism (the column side reads the gathered sequence as the layer
//! does; the row side reads the layer's split input). The collectives themselves are in the
//! code `#[megatron::module]` generates around the layer (docs/expanded-lora.md): this file
//! holds the local products.

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::invalid;
use crate::module::{
    Builder, Cx, Init, Param, Sharding, Site, Split, WeightGrad, weight_grad::bytes_of,
};
use crate::ops::{self, matmul_into};
use crate::parallel::GroupKind;
use crate::tensor::{DType, Tensor};

/// Which linear layers carry an adapter, and its shape (PEFT's `LoraConfig`, Megatron-Bridge's
/// `LoRA`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraConfig {
    /// The adapters' rank r.
    pub rank: usize,
    /// α: an adapter's output is scaled by α / r.
    pub alpha: f32,
    /// Dropout on an adapter's input (PEFT's `lora_dropout`).
    #[serde(default)]
    pub dropout: f32,
    /// The layers that carry one, by the end of their names (`attn.qkv`, `fc2`): a layer whose
    /// dotted name is one of them or ends with `.` and one of them.
    pub targets: Vec<String>,
}

impl LoraConfig {
    /// α / r, what an adapter's output is multiplied by.
    pub fn scale(&self) -> f32 {
        self.alpha / self.rank.max(1) as f32
    }

    /// Whether the layer named `layer` (its dotted name, e.g. `blocks.3.mlp.fc1`) carries one.
    pub fn targets(&self, layer: &str) -> bool {
        self.targets.iter().any(|t| {
            layer == t
                || layer
                    .strip_suffix(t.as_str())
                    .is_some_and(|rest| rest.ends_with('.'))
        })
    }
}

/// Whether `name` is an adapter's parameter (`….lora_a.weight`, `….lora_b.weight`).
pub fn is_adapter_param(name: &str) -> bool {
    name.ends_with(".lora_a.weight")
        || name.ends_with(".lora_b.weight")
        || name.starts_with("lora_a.")
        || name.starts_with("lora_b.")
}

/// Which kind of layer an adapter sits beside.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Beside {
    /// A column-parallel layer: A split over the rank, B over the outputs.
    Column,
    /// A row-parallel layer: A split over the inputs, B over the outputs.
    Row,
    /// A whole (replicated) layer, as multi-latent attention's down projections: A and B
    /// whole on every rank, read and written outside the tensor-parallel region (with sequence
    /// parallelism on the rank's shard of the sequence, their gradients summed over tp as the
    /// layer's own).
    Whole,
}

/// An adapter's two matrices on this rank, and its scale.
#[derive(Debug, Clone)]
pub struct LoraAdapter {
    a: Param,
    b: Param,
    scale: f32,
    /// Dropout on the adapter's input (PEFT's and Bridge's `dropout`, before A).
    dropout: f32,
    beside: Beside,
}

impl LoraAdapter {
    /// Builds the adapter of a layer of `in_features → out_features` in `b`'s scope (its
    /// parameters `lora_a.weight` and `lora_b.weight` beside the layer's), B split as
    /// `out_split` (the layer weight's split of its output rows, beside a column-parallel
    /// layer).
    pub fn build(
        config: &LoraConfig,
        b: &mut Builder,
        beside: Beside,
        (in_features, out_features): (usize, usize),
        out_split: Split,
    ) -> Result<LoraAdapter> {
        let r = config.rank;
        let tp = b.group(GroupKind::Tp).1;
        if r == 0 {
            return invalid!("{}: a LoRA rank of 0 adapts nothing", b.name("lora_a"));
        }
        if r > in_features.min(out_features) {
            return invalid!(
                "{}: LoRA rank {r} is larger than the layer ({in_features} inputs, \
                 {out_features} outputs): a low-rank update needs r ≤ {}",
                b.name("lora_a"),
                in_features.min(out_features)
            );
        }
        if beside == Beside::Column && !r.is_multiple_of(tp) {
            return invalid!(
                "{}: LoRA rank {r} beside a column-parallel layer is split over tp = {tp} (A's \
                 rows, as Megatron-Bridge splits them): choose a rank divisible by {tp}",
                b.name("lora_a")
            );
        }
        let split = |dim| Split::Dim {
            dim,
            group: GroupKind::Tp,
        };
        let (a_split, b_split) = match beside {
            Beside::Column => (split(0), out_split),
            Beside::Row => (split(1), split(0)),
            Beside::Whole => (Split::Replicated, Split::Replicated),
        };
        // Xavier's normal for A (Megatron-Bridge's `lora_A_init_method`), zeros for B.
        let std = (2.0 / (in_features + r) as f32).sqrt();
        let a = b.scoped("lora_a", |b| {
            b.param(
                "weight",
                [r, in_features],
                a_split,
                Init::Normal { std },
                true,
            )
        })?;
        let bm = b.scoped("lora_b", |b| {
            b.param("weight", [out_features, r], b_split, Init::ZEROS, true)
        })?;
        Ok(LoraAdapter {
            a,
            b: bm,
            scale: config.scale(),
            dropout: config.dropout,
            beside,
        })
    }

    /// A, `[r, in]` (this rank's part).
    pub fn a(&self) -> &Param {
        &self.a
    }

    /// B, `[out, r]` (this rank's part).
    pub fn b(&self) -> &Param {
        &self.b
    }

    /// A and B, mutably (in visit order).
    pub fn params_mut(&mut self) -> [&mut Param; 2] {
        [&mut self.a, &mut self.b]
    }

    /// α / r.
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// Which kind of layer it sits beside.
    pub fn beside(&self) -> Beside {
        self.beside
    }

    /// The first of this rank's output columns among the layer's whole outputs, beside a
    /// row-parallel layer (whose partial outputs have them all): `tp_rank · out / tp`.
    pub fn row_columns_at(&self, tp_rank: usize) -> usize {
        tp_rank * self.b.spec().local.dims()[0]
    }

    /// `x` `[.., in]` as rows `[n, in]`.
    fn rows(x: &Tensor, cols: usize, what: &str) -> Result<Tensor> {
        if x.last_dim() != cols {
            return invalid!(
                "LoRA {what}: input of shape {} has last dimension ≠ {cols}",
                x.shape()
            );
        }
        Ok(x.reshape([x.numel() / cols.max(1), cols])?)
    }

    /// The adapter's input: `x` with LoRA's dropout in training (its mask drawn at the site
    /// `site.child("lora_dropout")` for each element where it lies in the whole input: beside
    /// a column-parallel layer the gathered input, the whole sequence with sequence
    /// parallelism too; beside a row-parallel one the rank's input features), in `x`'s dtype,
    /// and what the mask's backward needs.
    fn dropped(&self, cx: &Cx, site: Site, x: &Tensor) -> Result<(Tensor, ops::DropoutSaved)> {
        let sharding = match self.beside {
            Beside::Column => Sharding::Gathered,
            Beside::Row => Sharding::SplitLastDim,
            Beside::Whole => Sharding::Replicated,
        };
        let (y, saved) = ops::dropout(cx, site.child("lora_dropout"), x, self.dropout, sharding)?;
        let y = match y.dtype() == x.dtype() {
            true => y,
            false => y.to_dtype(x.dtype())?,
        };
        Ok((y, saved))
    }

    /// `dropout(x)·Aᵀ` for this rank's A, f32 `[rows, r_local]`: beside a column-parallel layer
    /// this rank's slice of the rank (all-gathered after), beside a row-parallel one a partial
    /// sum (all-reduced after). `site` is the layer's.
    pub fn down(&self, cx: &Cx, site: Site, x: &Tensor) -> Result<Tensor> {
        let (x, _) = self.dropped(cx, site, x)?;
        let a = self.a.compute_value();
        let (r, inp) = (a.dims()[0], a.dims()[1]);
        let x2 = Self::rows(&x, inp, "down-projection")?;
        let out = Tensor::empty_near([x2.dims()[0], r], DType::F32, &x2)?;
        matmul_into(1.0, &x2, &a.t()?, 0.0, &out)?;
        Ok(out)
    }

    /// Adds `(α / r)·a·Bᵀ` (`a` the whole `[rows, r]`) to the columns `at..` of `y` (`[.., n]`,
    /// f32): all of them beside a column-parallel layer, this rank's block of the partial
    /// outputs beside a row-parallel one.
    pub fn add_up(&self, a: &Tensor, y: &Tensor, at: usize) -> Result<()> {
        let bm = self.b.compute_value();
        let (out, r) = (bm.dims()[0], bm.dims()[1]);
        let cols = y.last_dim();
        if at + out > cols || !y.is_contiguous() {
            return invalid!(
                "LoRA up-projection: {out} outputs at column {at} do not fit an output of \
                 shape {} (contiguous)",
                y.shape()
            );
        }
        let a2 = Self::rows(a, r, "up-projection")?;
        // The sum in f32 (a 16-bit output widened, then rounded once).
        let wide = match y.dtype() {
            DType::F32 => y.clone(),
            _ => y.to_dtype(DType::F32)?,
        };
        let y2 = wide.reshape([wide.numel() / cols.max(1), cols])?;
        let block = y2.narrow(1, at, out)?;
        matmul_into(self.scale, &a2, &bm.t()?, 1.0, &block)?;
        if y.dtype() != DType::F32 {
            y.copy_from(&wide)?;
        }
        Ok(())
    }

    /// B's backward for `dy` (this rank's `[rows, out_local]` of the output gradient): the
    /// gradient of `a` (`(α / r)·dy·B`, `[rows, r]`, a partial sum over tp: all-reduced after),
    /// and B's weight gradient `(α / r)·dyᵀ·a`.
    pub fn backward_up(&self, a: &Tensor, dy: &Tensor) -> Result<(Tensor, WeightGrad)> {
        let bm = self.b.compute_value();
        let (out, r) = (bm.dims()[0], bm.dims()[1]);
        let dy2 = Self::rows(&dy.to_f32_contiguous()?, out, "up-projection's backward")?;
        let a2 = Self::rows(a, r, "up-projection's backward")?;
        let da = Tensor::empty_near([dy2.dims()[0], r], DType::F32, &dy2)?;
        matmul_into(self.scale, &dy2, bm, 0.0, &da)?;
        let (b, scale) = (self.b.clone(), self.scale);
        let dw = if b.is_frozen() {
            WeightGrad::none()
        } else {
            WeightGrad::new(bytes_of(&[&dy2, &a2]), move || {
                b.accumulate_grad(|g| Ok(matmul_into(scale, &dy2.t()?, &a2, 1.0, g)?))
            })
        };
        Ok((da, dw))
    }

    /// A's backward for `da` (the gradient of this rank's `[rows, r_local]` down-projection)
    /// and the input `x` it read (its dropout drawn again at the layer's `site`): the input's
    /// gradient `dropout'(da·A)` (shaped as `x`, f32; a partial sum beside a column-parallel
    /// layer, this rank's input features beside a row-parallel one), and A's weight gradient
    /// `daᵀ·dropout(x)`.
    pub fn backward_down(
        &self,
        cx: &Cx,
        site: Site,
        x: &Tensor,
        da: &Tensor,
    ) -> Result<(Tensor, WeightGrad)> {
        let (dropped, mask) = self.dropped(cx, site, x)?;
        let a = self.a.compute_value();
        let (r, inp) = (a.dims()[0], a.dims()[1]);
        let x2 = Self::rows(&dropped, inp, "down-projection's backward")?;
        let da2 = Self::rows(da, r, "down-projection's backward")?;
        let dx = Tensor::empty_near([x2.dims()[0], inp], DType::F32, &x2)?;
        matmul_into(1.0, &da2, a, 0.0, &dx)?;
        let am = self.a.clone();
        let dw = if am.is_frozen() {
            WeightGrad::none()
        } else {
            WeightGrad::new(bytes_of(&[&da2, &x2]), move || {
                am.accumulate_grad(|g| Ok(matmul_into(1.0, &da2.t()?, &x2, 1.0, g)?))
            })
        };
        let dx = dx.reshape(x.shape().clone())?;
        let dx = ops::dropout_backward(cx, site.child("lora_dropout"), mask, &dx)?;
        Ok((dx, dw))
    }
}

/// The input and down-projection a layer kept for its adapter's backward, or an error saying
/// forward kept none.
pub fn kept<'s>(kept: Option<(&'s Tensor, &'s Tensor)>) -> Result<(&'s Tensor, &'s Tensor)> {
    match kept {
        Some(k) => Ok(k),
        None => invalid!("a LoRA adapter's backward ran without what its forward keeps"),
    }
}

/// `dx` plus the adapter's input gradient, when there is one, in `dx`'s dtype.
pub fn add_input_grad(dx: Tensor, adapter: Option<Tensor>) -> Result<Tensor> {
    match adapter {
        None => Ok(dx),
        Some(d) => {
            let sum = crate::ops::add(&dx.to_dtype(DType::F32)?, &d.to_dtype(DType::F32)?)?;
            Ok(sum.to_dtype(dx.dtype())?)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_match_whole_name_parts() {
        let c = LoraConfig {
            rank: 8,
            alpha: 16.0,
            dropout: 0.0,
            targets: vec!["attn.qkv".into(), "fc2".into()],
        };
        assert!(c.targets("blocks.0.attn.qkv"));
        assert!(c.targets("blocks.11.mlp.fc2"));
        assert!(!c.targets("blocks.0.mlp.xfc2"));
        assert!(!c.targets("blocks.0.attn.proj"));
        assert_eq!(c.scale(), 2.0);
        assert!(is_adapter_param("blocks.0.attn.qkv.lora_a.weight"));
        assert!(!is_adapter_param("blocks.0.attn.qkv.weight"));
    }
}
