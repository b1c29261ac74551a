//! `Linear`: `y = x·Wᵀ + b`, whole, column-parallel or row-parallel.

use crate::backend;
use crate::error::Result;
use crate::invalid;
use crate::module::{
    Builder, ColumnParallel, Cx, Init, Layer, Module, Param, RowParallel, Site, Split, WeightGrad,
    weight_grad::bytes_of,
};
use crate::ops::{as_operand, matmul_into, operand_dtype};
use crate::parallel::GroupKind;
use crate::tensor::{DType, Tensor};
use crate::tensor_parallel::lora::{Beside, LoraAdapter};

/// The logical description of a linear layer.
#[derive(Debug, Clone, PartialEq)]
pub struct LinearSpec {
    /// Input features (logical).
    pub in_features: usize,
    /// Output features (logical).
    pub out_features: usize,
    /// Whether the layer adds a bias.
    pub bias: bool,
    /// Standard deviation of the weight's normal initialisation (the bias starts at zero).
    pub init_std: f32,
    /// Whether the output features are a gated MLP's two halves, `[gate; up]` (`--swiglu`'s
    /// fc1): column-parallel, each rank then holds its part of each half, as Megatron-LM's
    /// `linear_fc1`, so that its output is its own `[gate_r | up_r]` for [`crate::ops::swiglu`].
    pub gated: bool,
    /// Whether the output features are attention's fused QKV laid out per query group
    /// `(groups, queries per group, head size)`: column-parallel over more ranks than groups,
    /// each rank then holds its share of one group's queries and that group's key and value
    /// ([`Split::QueryGroups`]); over fewer, whole groups as any column-parallel layer.
    pub query_groups: Option<(usize, usize, usize)>,
}

impl LinearSpec {
    /// A layer with bias, weights drawn from N(0, 0.02) as in GPT-2 and Megatron-LM.
    pub fn new(in_features: usize, out_features: usize) -> Self {
        LinearSpec {
            in_features,
            out_features,
            bias: true,
            init_std: 0.02,
            gated: false,
            query_groups: None,
        }
    }

    /// Marks the output features as a fused QKV of `groups` query groups of `per_group`
    /// queries of `head_dim` (see [`LinearSpec::query_groups`]).
    pub fn with_query_groups(mut self, groups: usize, per_group: usize, head_dim: usize) -> Self {
        self.query_groups = Some((groups, per_group, head_dim));
        self
    }

    /// Marks the output features as a gated MLP's `[gate; up]` (see [`LinearSpec::gated`]).
    pub fn gated(mut self) -> Self {
        self.gated = true;
        self
    }

    /// Sets whether there is a bias.
    pub fn with_bias(mut self, bias: bool) -> Self {
        self.bias = bias;
        self
    }

    /// Sets the weight's initial standard deviation.
    pub fn with_init_std(mut self, std: f32) -> Self {
        self.init_std = std;
        self
    }
}

/// How this rank holds the layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Whole,
    Column,
    Row,
}

/// A linear layer; the weight is `[out, in]` as in Megatron-LM and PyTorch. Column- and
/// row-parallel, it carries a LoRA adapter when its builder's LoRA config targets it.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Param,
    bias: Option<Param>,
    mode: Mode,
    lora: Option<LoraAdapter>,
}

/// What a linear layer keeps for its backward: its input, and with a LoRA adapter the
/// adapter's whole down-projection (its B's gradient reads it).
#[derive(Debug, Clone)]
pub struct LinearSaved {
    x: Tensor,
    lora: Option<Box<Tensor>>,
}

impl LinearSaved {
    /// What forward kept, with the LoRA adapter's whole down-projection `a` too.
    fn with_lora(self, a: Tensor) -> LinearSaved {
        LinearSaved {
            lora: Some(Box::new(a)),
            ..self
        }
    }

    /// The input and the adapter's down-projection, when forward kept them.
    fn lora_kept(&self) -> Option<(&Tensor, &Tensor)> {
        self.lora.as_deref().map(|a| (&self.x, a))
    }
}

impl Linear {
    fn build_as(spec: &LinearSpec, b: &mut Builder, mode: Mode) -> Result<Linear> {
        let ranks = b.group(GroupKind::Tp).1;
        let tp = if let Some((groups, per_group, head_dim)) = spec.query_groups
            && ranks > groups
        {
            Split::QueryGroups {
                groups,
                per_group,
                head_dim,
            }
        } else if spec.gated {
            Split::Strided {
                dim: 0,
                group: GroupKind::Tp,
                blocks: 2,
            }
        } else {
            Split::Dim {
                dim: 0,
                group: GroupKind::Tp,
            }
        };
        if spec.gated && mode == Mode::Row {
            return invalid!(
                "{}: a gated layer ([gate; up] outputs) is column-parallel, not row-parallel",
                b.name("weight")
            );
        }
        let (weight_split, bias_split) = match mode {
            Mode::Whole => (Split::Replicated, Split::Replicated),
            Mode::Column => (tp, tp),
            Mode::Row => (
                Split::Dim {
                    dim: 1,
                    group: GroupKind::Tp,
                },
                Split::Replicated,
            ),
        };
        let shape = [spec.out_features, spec.in_features];
        let weight = b.param(
            "weight",
            shape,
            weight_split,
            Init::Normal { std: spec.init_std },
            true,
        )?;
        let bias = if spec.bias {
            let bias = b.param("bias", [spec.out_features], bias_split, Init::ZEROS, false)?;
            // A row-parallel bias is added to the reduced output; its gradient comes from the
            // whole output gradient (gathered, with sequence parallelism) on every rank.
            Some(match mode {
                Mode::Row => bias.with_gradient_whole_over_tp(),
                _ => bias,
            })
        } else {
            None
        };
        let lora = match (mode, b.lora()) {
            (_, Some(config)) if config.targets(&b.scope_name()) => {
                let beside = match mode {
                    Mode::Row => Beside::Row,
                    Mode::Column => Beside::Column,
                    Mode::Whole => Beside::Whole,
                };
                let config = config.clone();
                let io = (spec.in_features, spec.out_features);
                Some(LoraAdapter::build(&config, b, beside, io, tp)?)
            }
            _ => None,
        };
        let mut linear = Linear {
            weight,
            bias,
            mode,
            lora,
        };
        // A whole layer reads the activations as they are outside the tensor-parallel region:
        // with sequence parallelism, this rank's shard of the sequence (as a norm does).
        if mode == Mode::Whole {
            crate::module::sequence_parallel_region(&mut linear);
        }
        Ok(linear)
    }

    /// The weight (this rank's part).
    pub fn weight(&self) -> &Param {
        &self.weight
    }

    /// The bias, if any (this rank's part).
    pub fn bias(&self) -> Option<&Param> {
        self.bias.as_ref()
    }

    /// `x` as the rows `[rows, in]` a product reads, and the shape of the output `x·Wᵀ` (`x`'s
    /// with the last dimension `out`); `x`'s last dimension must be the layer's local inputs.
    fn rows(&self, x: &Tensor) -> Result<(Tensor, Vec<usize>)> {
        let w = self.weight.compute_value();
        let (out, inp) = (w.dims()[0], w.dims()[1]);
        let mut dims = x.dims().to_vec();
        match dims.last_mut() {
            Some(last) if *last == inp => *last = out,
            _ => {
                return invalid!(
                    "linear {}: input of shape {} has last dimension ≠ {inp} local input features",
                    self.weight.spec().name,
                    x.shape()
                );
            }
        }
        Ok((x.reshape([x.numel() / inp, inp])?, dims))
    }

    /// `x·Wᵀ` over the last dimension of `x`, without bias (W as products read it: its
    /// compute copy when kept), in `dtype`: f32, or on a GPU bf16 (the f32 accumulator rounded
    /// once).
    fn product(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        let (x2, dims) = self.rows(x)?;
        Ok(self.rows_product(&x2, dtype)?.reshape(dims)?)
    }

    /// `x2·Wᵀ` of the rows [`Linear::rows`] gives, `[rows, out]` in `dtype`.
    fn rows_product(&self, x2: &Tensor, dtype: DType) -> Result<Tensor> {
        let w = self.weight.compute_value();
        let y = Tensor::empty_near([x2.dims()[0], w.dims()[0]], dtype, x2)?;
        matmul_into(1.0, x2, &w.t()?, 0.0, &y)?;
        Ok(y)
    }

    /// `x·Wᵀ + b` in `dtype`: the bias added to the f32 product, the sum rounded once (on a
    /// GPU in the product's epilogue where cuBLASLt can).
    fn biased_product(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        let Some(bias) = &self.bias else {
            return self.product(x, dtype);
        };
        let bias = bias.value().to_f32_contiguous()?;
        let (x2, dims) = self.rows(x)?;
        if backend::of(x).may_fuse_bias() {
            let w = self.weight.compute_value();
            let y = Tensor::empty_near([x2.dims()[0], w.dims()[0]], dtype, x)?;
            if crate::ops::matmul_bias_into(&x2, &w.t()?, &bias, &y)? {
                return Ok(y.reshape(dims)?);
            }
        }
        // The product in f32, then the bias.
        let y = self.rows_product(&x2, DType::F32)?;
        let ops = backend::of(&y);
        if dtype == DType::F32 {
            ops.bias_add_in_place(&y, &bias)?;
            return Ok(y.reshape(dims)?);
        }
        Ok(ops.bias_add_cast(&y, &bias, dtype)?.reshape(dims)?)
    }

    /// The split backward: dx = dy·W in `dx_dtype` (bf16 only on a GPU), and the
    /// accumulation of dW (and db when `with_bias`) to run now or later.
    fn backward_split(
        &self,
        saved: LinearSaved,
        dy: &Tensor,
        with_bias: bool,
        dx_dtype: DType,
    ) -> Result<(Tensor, WeightGrad)> {
        let w = self.weight.compute_value();
        let (out, inp) = (w.dims()[0], w.dims()[1]);
        let rows = saved.x.numel() / inp;
        if dy.numel() != rows * out {
            return invalid!(
                "linear {}: output gradient of shape {} does not fit {rows} rows × {out} outputs",
                self.weight.spec().name,
                dy.shape()
            );
        }
        // dW, dx (and db) all read dy: in the dtype the products take, converted once.
        let dy2 = as_operand(dy)?.reshape([rows, out])?;
        let x2 = saved.x.reshape([rows, inp])?;
        let dx = Tensor::empty_near([rows, inp], dx_dtype, &dy2)?;
        matmul_into(1.0, &dy2, w, 0.0, &dx)?;
        let weight = self.weight.clone();
        let bias = self.bias.clone().filter(|_| with_bias);
        // A frozen layer keeps nothing for a weight-gradient pass it does not run.
        if weight.is_frozen() && bias.as_ref().is_none_or(Param::is_frozen) {
            return Ok((dx.reshape(saved.x.shape().clone())?, WeightGrad::none()));
        }
        let dw = WeightGrad::new(bytes_of(&[&dy2, &x2]), move || {
            weight.accumulate_grad(|grad| Ok(matmul_into(1.0, &dy2.t()?, &x2, 1.0, grad)?))?;
            if let Some(bias) = &bias {
                Linear::accumulate_bias_grad(&dy2, rows, out, bias)?;
            }
            Ok(())
        });
        Ok((dx.reshape(saved.x.shape().clone())?, dw))
    }

    /// `db += Σ_r dy[r, ·]` for `dy[rows, out]`.
    fn accumulate_bias_grad(dy: &Tensor, rows: usize, out: usize, bias: &Param) -> Result<()> {
        bias.accumulate_grad(|grad| backend::of(dy).accumulate_bias_grad(dy, rows, out, grad))
    }

    fn check_mode(&self, want: Mode, what: &str) -> Result<()> {
        if self.mode != want {
            return invalid!(
                "linear {} was built {:?} but called {what}",
                self.weight.spec().name,
                self.mode
            );
        }
        Ok(())
    }

    /// `x·Wᵀ + b` for a layer built as `mode`, in `dtype`.
    fn forward_biased(
        &self,
        mode: Mode,
        what: &str,
        x: &Tensor,
        dtype: DType,
    ) -> Result<(Tensor, LinearSaved)> {
        self.check_mode(mode, what)?;
        let x = as_operand(x)?;
        let y = self.biased_product(&x, dtype)?;
        Ok((y, LinearSaved { x, lora: None }))
    }

    /// `x·Wᵀ` and what the backward keeps: `x` in the dtype the products take (bf16 on a GPU
    /// that multiplies in bf16), converted once for the forward and the weight gradient.
    fn product_saved(&self, x: &Tensor) -> Result<(Tensor, LinearSaved)> {
        let x = as_operand(x)?;
        Ok((self.product(&x, DType::F32)?, LinearSaved { x, lora: None }))
    }
}

impl Module for Linear {
    type Spec = LinearSpec;
    type Saved = LinearSaved;

    /// Its backward converts the output gradient to the products' dtype first.
    const GRADIENT_FEEDS_PRODUCTS: bool = true;

    fn build(spec: &LinearSpec, b: &mut Builder) -> Result<Self> {
        Linear::build_as(spec, b, Mode::Whole)
    }

    fn visit_params<'s>(&'s self, f: &mut dyn FnMut(&'s Param)) {
        f(&self.weight);
        if let Some(b) = &self.bias {
            f(b);
        }
        if let Some(lora) = &self.lora {
            f(lora.a());
            f(lora.b());
        }
    }

    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        f(&mut self.weight);
        if let Some(b) = &mut self.bias {
            f(b);
        }
        if let Some(lora) = &mut self.lora {
            for p in lora.params_mut() {
                f(p);
            }
        }
    }
}

/// A whole layer runs its adapter itself (`y += (α / r)·dropout(x)·Aᵀ·Bᵀ`): A and B are whole
/// on every rank, so no collective is needed; the column- and row-parallel layers' adapters
/// are run by the generated code, which places their collectives.
impl Layer for Linear {
    fn forward(&self, cx: &Cx, site: Site, x: &Tensor) -> Result<(Tensor, LinearSaved)> {
        let (y, saved) = self.forward_biased(Mode::Whole, "unsharded", x, DType::F32)?;
        let Some(lora) = &self.lora else {
            return Ok((y, saved));
        };
        let a = lora.down(cx, site, &saved.x)?;
        lora.add_up(&a, &y, 0)?;
        Ok((y, saved.with_lora(a)))
    }

    fn backward(&self, cx: &Cx, site: Site, saved: LinearSaved, dy: &Tensor) -> Result<Tensor> {
        let kept = saved.lora_kept().map(|(x, a)| (x.clone(), a.clone()));
        let (dx, dw) = self.backward_split(saved, dy, true, DType::F32)?;
        cx.weight_gradient(dw)?;
        let (Some(lora), Some((x, a))) = (&self.lora, kept) else {
            return Ok(dx);
        };
        let (da, dw_b) = lora.backward_up(&a, dy)?;
        let (dx_adapter, dw_a) = lora.backward_down(cx, site, &x, &da)?;
        cx.weight_gradient(dw_b)?;
        cx.weight_gradient(dw_a)?;
        crate::tensor_parallel::lora::add_input_grad(dx, Some(dx_adapter))
    }
}

impl ColumnParallel for Linear {
    fn build_column(spec: &LinearSpec, b: &mut Builder) -> Result<Self> {
        Linear::build_as(spec, b, Mode::Column)
    }

    /// The output is in the products' dtype (bf16 on a GPU that multiplies in bf16): a
    /// column-parallel output is what the next products read (attention's, or the second
    /// layer's after the activation), as Megatron-LM's bf16 activations.
    fn forward_column(&self, _cx: &Cx, _site: Site, x: &Tensor) -> Result<(Tensor, LinearSaved)> {
        self.forward_biased(Mode::Column, "as #[column_parallel]", x, operand_dtype(x))
    }

    fn backward_column_input(
        &self,
        _cx: &Cx,
        _site: Site,
        saved: LinearSaved,
        dy: &Tensor,
    ) -> Result<(Tensor, WeightGrad)> {
        // dx goes to the all-reduce of the f operator and the residual stream: f32.
        self.backward_split(saved, dy, true, DType::F32)
    }

    fn lora(&self) -> Option<&LoraAdapter> {
        self.lora.as_ref()
    }

    fn keep_lora(saved: LinearSaved, a: Tensor) -> LinearSaved {
        saved.with_lora(a)
    }

    fn lora_kept(saved: &LinearSaved) -> Option<(&Tensor, &Tensor)> {
        saved.lora_kept()
    }

    fn map_kept_input(
        saved: LinearSaved,
        f: &dyn Fn(&Tensor) -> Result<Tensor>,
    ) -> Result<LinearSaved> {
        Ok(LinearSaved {
            x: f(&saved.x)?,
            lora: saved.lora,
        })
    }
}

impl RowParallel for Linear {
    fn build_row(spec: &LinearSpec, b: &mut Builder) -> Result<Self> {
        Linear::build_as(spec, b, Mode::Row)
    }

    fn lora(&self) -> Option<&LoraAdapter> {
        self.lora.as_ref()
    }

    fn keep_lora(saved: LinearSaved, a: Tensor) -> LinearSaved {
        saved.with_lora(a)
    }

    fn lora_kept(saved: &LinearSaved) -> Option<(&Tensor, &Tensor)> {
        saved.lora_kept()
    }

    /// With one tensor-parallel rank there is nothing to all-reduce: the bias goes in with the
    /// product (cuBLASLt's epilogue on a GPU, saving a pass over the output), and
    /// [`RowParallel::add_bias`] adds nothing.
    fn forward_row(&self, cx: &Cx, _site: Site, x: &Tensor) -> Result<(Tensor, LinearSaved)> {
        let what = "as #[row_parallel]";
        if cx.tp_size() == 1 {
            return self.forward_biased(Mode::Row, what, x, DType::F32);
        }
        self.check_mode(Mode::Row, what)?;
        self.product_saved(x)
    }

    fn add_bias(&self, cx: &Cx, y: &Tensor) -> Result<()> {
        if y.dtype() != DType::F32 {
            return invalid!(
                "linear {}: bias added to a {} output",
                self.weight.spec().name,
                y.dtype()
            );
        }
        if cx.tp_size() == 1 {
            return Ok(());
        }
        match &self.bias {
            Some(bias) => backend::of(y).bias_add_in_place(y, &bias.value().to_f32_contiguous()?),
            None => Ok(()),
        }
    }

    fn backward_row_input(
        &self,
        _cx: &Cx,
        _site: Site,
        saved: LinearSaved,
        dy: &Tensor,
    ) -> Result<(Tensor, WeightGrad)> {
        // The bias is replicated and dy is the same on every rank: each rank's bias gradient is
        // already the whole one. dx is the gradient of a sharded activation, on its way to the
        // products before it: in their dtype.
        let dx_dtype = operand_dtype(&saved.x);
        self.backward_split(saved, dy, true, dx_dtype)
    }
}
