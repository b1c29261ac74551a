//! Megatron-LM's `--qk-layernorm` (Qwen3's `q_norm` and `k_norm`): every query head and every
//! key head normalised over its own `head_dim` elements, one weight for all the queries and one
//! for all the keys, before rotary embeddings; the values untouched.
//!
//! It works on attention's fused projection as the column-parallel QKV layer leaves it on a
//! tensor-parallel rank: blocks of `per_group` queries, a key and a value (with more ranks than
//! key/value groups, one block of the rank's share of its group's queries). Its
//! weights are replicated, but each rank's gradient comes from its own heads: held as a
//! `#[local]` field, they are marked to be summed over tensor parallelism
//! ([`crate::module::build_local`], [`crate::module::ParamSpec::tensor_parallel_partial`]).
//! Without the flag it is the identity, with no parameters.

use crate::error::Result;
use crate::invalid;
use crate::module::{Builder, Cx, Layer, Module, Param, Site};
use crate::tensor::Tensor;
use crate::tensor_parallel::{LayerNorm, LayerNormSaved, LayerNormSpec};

/// What a [`QkNorm`] is built from.
#[derive(Debug, Clone, PartialEq)]
pub enum QkNormSpec {
    /// No norm: the identity.
    Off,
    /// A norm of `norm.hidden` (the head size) for the queries and one for the keys, with
    /// `per_group` queries in each block of the projection.
    On {
        /// The norms' spec (LayerNorm or RMSNorm, ε), `hidden` the head size.
        norm: LayerNormSpec,
        /// Query heads per group (1 for multi-head attention).
        per_group: usize,
        /// Key/value groups (the heads for multi-head attention).
        groups: usize,
    },
}

/// The query and key norms of `--qk-layernorm`, or the identity.
#[derive(Debug, Clone)]
pub struct QkNorm {
    norms: Option<(LayerNorm, LayerNorm)>,
    per_group: usize,
}

/// What [`QkNorm`]'s forward keeps: the two norms' saved values.
#[derive(Debug, Clone)]
pub struct QkNormSaved {
    kept: Option<(LayerNormSaved, LayerNormSaved)>,
}

impl Module for QkNorm {
    type Spec = QkNormSpec;
    type Saved = QkNormSaved;

    fn build(spec: &QkNormSpec, b: &mut Builder) -> Result<Self> {
        let QkNormSpec::On {
            norm,
            per_group,
            groups,
        } = spec
        else {
            return Ok(QkNorm {
                norms: None,
                per_group: 1,
            });
        };
        // Its gradients are this rank's heads' part: the `#[local]` field that holds it marks
        // them to be summed over tp (`module::build_local`).
        let q = b.scoped("q_norm", |b| LayerNorm::build(norm, b))?;
        let k = b.scoped("k_norm", |b| LayerNorm::build(norm, b))?;
        // With more tensor-parallel ranks than groups, a rank's block holds its share of one
        // group's queries.
        let tp = b.group(crate::parallel::GroupKind::Tp).1;
        let per_group = match tp > *groups && *groups > 0 {
            true => per_group * groups / tp,
            false => *per_group,
        };
        Ok(QkNorm {
            norms: Some((q, k)),
            per_group,
        })
    }

    fn visit_params<'s>(&'s self, f: &mut dyn FnMut(&'s Param)) {
        if let Some((q, k)) = &self.norms {
            q.visit_params(f);
            k.visit_params(f);
        }
    }

    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        if let Some((q, k)) = &mut self.norms {
            q.visit_params_mut(f);
            k.visit_params_mut(f);
        }
    }
}

impl QkNorm {
    /// `x` `[s, b, groups·(per_group + 2)·d]` viewed as `[rows, per_group + 2, d]`: one row per
    /// block of the projection, its queries, key and value side by side. The norms read the
    /// queries and the keys through strided views of it (each head's `d` elements stay
    /// contiguous), so the projection is never reordered.
    fn blocks(&self, x: &Tensor, d: usize) -> Result<Tensor> {
        let slots = self.per_group + 2;
        let width = x.last_dim();
        if x.dims().len() != 3 || !width.is_multiple_of(slots * d) {
            return invalid!(
                "qk-layernorm: projection of shape {} is not blocks of {} queries, a key and a \
                 value of {d}",
                x.shape(),
                self.per_group
            );
        }
        let rows = x.numel() / (slots * d);
        Ok(x.contiguous()?.reshape([rows, slots, d])?)
    }

    /// The normed queries and key and the values, each `[rows, n, d]`, written side by side
    /// into a new tensor of the projection's shape `like` (in the queries' dtype).
    fn joined(parts: [&Tensor; 3], blocks: &Tensor, like: &Tensor) -> Result<Tensor> {
        let out = Tensor::empty_near(blocks.shape().clone(), parts[0].dtype(), like)?;
        let mut at = 0;
        for p in parts {
            let n = p.dims()[1];
            out.narrow(1, at, n)?.copy_from(p)?;
            at += n;
        }
        Ok(out.reshape(like.shape().clone())?)
    }
}

impl Layer for QkNorm {
    fn forward(&self, cx: &Cx, site: Site, x: &Tensor) -> Result<(Tensor, QkNormSaved)> {
        let Some((qn, kn)) = &self.norms else {
            return Ok((x.clone(), QkNormSaved { kept: None }));
        };
        let m = self.per_group;
        let blocks = self.blocks(x, qn.hidden())?;
        let (q, q_saved) = qn.forward(cx, site.child("q_norm"), &blocks.narrow(1, 0, m)?)?;
        let (k, k_saved) = kn.forward(cx, site.child("k_norm"), &blocks.narrow(1, m, 1)?)?;
        // The values as the norms wrote the rest (the products' dtype on a GPU).
        let y = Self::joined([&q, &k, &blocks.narrow(1, m + 1, 1)?], &blocks, x)?;
        Ok((
            y,
            QkNormSaved {
                kept: Some((q_saved, k_saved)),
            },
        ))
    }

    fn backward(&self, cx: &Cx, site: Site, saved: QkNormSaved, dy: &Tensor) -> Result<Tensor> {
        let (Some((qn, kn)), Some((q_saved, k_saved))) = (&self.norms, saved.kept) else {
            return Ok(dy.clone());
        };
        let m = self.per_group;
        let blocks = self.blocks(dy, qn.hidden())?;
        let dq = qn.backward(cx, site.child("q_norm"), q_saved, &blocks.narrow(1, 0, m)?)?;
        let dk = kn.backward(cx, site.child("k_norm"), k_saved, &blocks.narrow(1, m, 1)?)?;
        Self::joined([&dq, &dk, &blocks.narrow(1, m + 1, 1)?], &blocks, dy)
    }
}
