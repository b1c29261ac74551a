//! The shape operations of a module's forward along the feature (last) dimension: `narrow`
//! (and `split`, one narrow per part), `cat`, the per-head views `split_heads` and `cat_heads`
//! (the features as heads × per-head sizes, each head cut or joined the same way: per rank
//! when the heads are split over tensor parallelism), and `broadcast_heads` (one vector for
//! every head, as DeepSeek's shared rotary key). Each returns what its backward needs; the
//! backward of a copy is the copy the other way, with zeros where the input had nothing.
//!
//! They are copies on whichever device holds the tensors: on the host each row's run of
//! features copied in one pass; on a device the tensor layer's strided copies, a copy into
//! columns of a larger tensor going through its transpose, whose rows are contiguous (two
//! passes; a kernel of its own is for when a profile asks for it).

use crate::error::Result;
use crate::invalid;
use crate::module::{Cx, Site};
use crate::tensor::{DType, Tensor};

/// A shape operation and its sizes (features, per head, or heads on this rank).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShapeOp {
    /// Features `start..start + len` of the last dimension.
    Narrow {
        /// First feature.
        start: usize,
        /// Features kept.
        len: usize,
    },
    /// Part `part` of `parts` equal parts of the last dimension (`chunk`); kept as the
    /// [`ShapeOp::Narrow`] it is.
    Chunk {
        /// How many parts.
        parts: usize,
        /// Which.
        part: usize,
    },
    /// The inputs side by side along the last dimension.
    Cat,
    /// The features as heads of `sizes.iter().sum()` each: part `part` of every head.
    HeadPart {
        /// Each part's size within a head.
        sizes: Vec<usize>,
        /// Which part.
        part: usize,
    },
    /// Each input's heads (of `sizes[i]` features) joined head by head.
    CatHeads {
        /// Each input's size per head.
        sizes: Vec<usize>,
    },
    /// The input (one head's features) repeated for `heads` heads.
    BroadcastHeads {
        /// Heads of the output (on this rank).
        heads: usize,
    },
}

/// What a shape operation keeps: itself and its inputs' widths.
#[derive(Debug, Clone)]
pub struct ShapeSaved {
    op: ShapeOp,
    widths: Vec<usize>,
    dims: Vec<usize>,
}

/// `t` as rows of `width` features: `[numel / width, width]`.
fn rows(t: &Tensor, width: usize) -> Result<Tensor> {
    let n = t.numel().checked_div(width).unwrap_or(0);
    Ok(t.contiguous()?.reshape([n, width])?)
}

/// A `[rows, width]` tensor near `like` whose columns `start..` hold each of `parts`
/// (`[rows, w]`), zeros elsewhere: on the host each part's rows copied into their places, on a
/// device built as its transpose, whose row blocks are contiguous.
fn place_columns(
    like: &Tensor,
    n: usize,
    width: usize,
    parts: &[(&Tensor, usize)],
) -> Result<Tensor> {
    if like.gpu().is_none() && parts.iter().all(|(p, _)| p.gpu().is_none()) {
        let mut out = vec![0.0f32; n * width];
        for &(part, start) in parts {
            let w = part.last_dim();
            let part = part.to_f32_contiguous()?;
            let src = part.read::<f32>()?;
            for (dst, row) in out.chunks_exact_mut(width).zip(src.chunks_exact(w)) {
                dst[start..start + w].copy_from_slice(row);
            }
        }
        return Ok(Tensor::from_vec(out, [n, width])?);
    }
    let t = Tensor::zeros_near([width, n], DType::F32, like)?;
    for &(part, start) in parts {
        let w = part.last_dim();
        t.narrow(0, start, w)?.copy_from(&part.t()?)?;
    }
    Ok(t.t()?.contiguous()?)
}

/// `parts` (`[n, w_i]` each) side by side near `like`: `[n, Σ w_i]`.
fn side_by_side(like: &Tensor, n: usize, parts: &[Tensor]) -> Result<Tensor> {
    let mut placed = Vec::with_capacity(parts.len());
    let mut at = 0;
    for p in parts {
        placed.push((p, at));
        at += p.last_dim();
    }
    place_columns(like, n, at, &placed)
}

/// Columns `start..start + w` of `x` (`[rows, width]`, contiguous f32), contiguous: on the
/// host each row's run copied, on a device the strided copy.
fn columns(x: &Tensor, start: usize, w: usize) -> Result<Tensor> {
    let [n, width] = *x.dims() else {
        return invalid!(
            "columns of a tensor of shape {}: not [rows, width]",
            x.shape()
        );
    };
    if x.gpu().is_some() || !x.is_contiguous() || x.dtype() != DType::F32 {
        return Ok(x.narrow(1, start, w)?.contiguous()?);
    }
    let src = x.read::<f32>()?;
    let mut out = Vec::with_capacity(n * w);
    for row in src.chunks_exact(width) {
        out.extend_from_slice(&row[start..start + w]);
    }
    Ok(Tensor::from_vec(out, [n, w])?)
}

/// `x`'s shape with the last dimension `width`.
fn with_width(dims: &[usize], width: usize) -> Vec<usize> {
    let mut d = dims.to_vec();
    if let Some(last) = d.last_mut() {
        *last = width;
    }
    d
}

/// The heads of a width `width` of per-head size `per_head`, or an error naming them.
fn heads_of(what: &str, width: usize, per_head: usize) -> Result<usize> {
    if per_head == 0 || !width.is_multiple_of(per_head) {
        return invalid!(
            "{what}: {width} features are not whole heads of {per_head} (this rank's part of the \
             heads, with tensor parallelism)"
        );
    }
    Ok(width / per_head)
}

/// Runs `op` on `xs`: the output and what its backward needs.
pub fn shape(_cx: &Cx, _site: Site, op: ShapeOp, xs: &[&Tensor]) -> Result<(Tensor, ShapeSaved)> {
    let Some(first) = xs.first() else {
        return invalid!("{op:?} has no input");
    };
    let dims = first.dims().to_vec();
    let widths: Vec<usize> = xs.iter().map(|t| t.last_dim()).collect();
    let lead: usize = dims[..dims.len().saturating_sub(1)].iter().product();
    for (i, x) in xs.iter().enumerate() {
        if x.dims()[..x.dims().len().saturating_sub(1)] != dims[..dims.len().saturating_sub(1)] {
            return invalid!(
                "{op:?}: input {i} has shape {}, the first {}: all but the last dimension must agree",
                x.shape(),
                first.shape()
            );
        }
    }
    let op = match op {
        ShapeOp::Chunk { parts, part } => {
            let w = widths[0];
            if parts == 0 || part >= parts || !w.is_multiple_of(parts) {
                return invalid!(
                    "chunk: {w} features ({}) do not cut into {parts} equal parts (part {part} \
                     asked); with tensor parallelism these are this rank's features",
                    first.shape()
                );
            }
            ShapeOp::Narrow {
                start: part * (w / parts),
                len: w / parts,
            }
        }
        op => op,
    };
    // Each input read once, as contiguous f32.
    let inputs: Vec<Tensor> = xs
        .iter()
        .map(|t| Ok(t.to_f32_contiguous()?))
        .collect::<Result<_>>()?;
    let x = &inputs[0];
    let y = match &op {
        ShapeOp::Narrow { start, len } => {
            if start + len > widths[0] {
                return invalid!(
                    "narrow: features {start}..{} of a tensor of {} ({})",
                    start + len,
                    widths[0],
                    first.shape()
                );
            }
            columns(&rows(x, widths[0])?, *start, *len)?.reshape(with_width(&dims, *len))?
        }
        ShapeOp::Chunk { .. } => return invalid!("chunk: resolved to its narrow above"),
        ShapeOp::Cat => {
            let total: usize = widths.iter().sum();
            let parts: Vec<Tensor> = inputs
                .iter()
                .zip(&widths)
                .map(|(t, &w)| rows(t, w))
                .collect::<Result<_>>()?;
            side_by_side(x, lead, &parts)?.reshape(with_width(&dims, total))?
        }
        ShapeOp::HeadPart { sizes, part } => {
            let per_head: usize = sizes.iter().sum();
            let heads = heads_of("split_heads", widths[0], per_head)?;
            let start: usize = sizes[..*part].iter().sum();
            columns(&rows(x, per_head)?, start, sizes[*part])?
                .reshape(with_width(&dims, heads * sizes[*part]))?
        }
        ShapeOp::CatHeads { sizes } => {
            if sizes.len() != xs.len() {
                return invalid!(
                    "cat_heads: {} inputs and {} sizes per head",
                    xs.len(),
                    sizes.len()
                );
            }
            let heads = heads_of("cat_heads", widths[0], sizes[0])?;
            let per_head: usize = sizes.iter().sum();
            let mut parts = Vec::new();
            for (i, (t, &s)) in inputs.iter().zip(sizes).enumerate() {
                if heads_of("cat_heads", widths[i], s)? != heads {
                    return invalid!(
                        "cat_heads: input {i} has {} features, {} heads of {s}, where input 0 \
                         has {heads} heads",
                        widths[i],
                        widths[i] / s
                    );
                }
                parts.push(rows(t, s)?);
            }
            side_by_side(x, lead * heads, &parts)?.reshape(with_width(&dims, heads * per_head))?
        }
        ShapeOp::BroadcastHeads { heads } => {
            let w = widths[0];
            let one = rows(x, w)?;
            let placed: Vec<(&Tensor, usize)> = (0..*heads).map(|h| (&one, h * w)).collect();
            place_columns(x, lead, heads * w, &placed)?.reshape(with_width(&dims, heads * w))?
        }
    };
    Ok((y, ShapeSaved { op, widths, dims }))
}

/// The gradients of a shape operation's `N` inputs, in order.
pub fn shape_backward<const N: usize>(
    _cx: &Cx,
    _site: Site,
    saved: ShapeSaved,
    dy: &Tensor,
) -> Result<[Tensor; N]> {
    let ShapeSaved { op, widths, dims } = saved;
    let lead: usize = dims[..dims.len().saturating_sub(1)].iter().product();
    let dy = dy.to_f32_contiguous()?;
    let grads: Vec<Tensor> = match &op {
        ShapeOp::Narrow { start, .. } => {
            let g = place_columns(
                &dy,
                lead,
                widths[0],
                &[(&rows(&dy, dy.last_dim())?, *start)],
            )?;
            vec![g.reshape(dims.clone())?]
        }
        ShapeOp::Chunk { .. } => return invalid!("chunk: kept as its narrow"),
        ShapeOp::Cat => {
            let d = rows(&dy, widths.iter().sum())?;
            let mut at = 0;
            let mut out = Vec::new();
            for &w in &widths {
                out.push(columns(&d, at, w)?.reshape(with_width(&dims, w))?);
                at += w;
            }
            out
        }
        ShapeOp::HeadPart { sizes, part } => {
            let per_head: usize = sizes.iter().sum();
            let heads = widths[0] / per_head;
            let start: usize = sizes[..*part].iter().sum();
            let d = rows(&dy, sizes[*part])?;
            vec![
                place_columns(&dy, lead * heads, per_head, &[(&d, start)])?
                    .reshape(dims.clone())?,
            ]
        }
        ShapeOp::CatHeads { sizes } => {
            let per_head: usize = sizes.iter().sum();
            let d = rows(&dy, per_head)?;
            let heads = d.dims()[0].checked_div(lead.max(1)).unwrap_or(0);
            let mut at = 0;
            let mut out = Vec::new();
            for &s in sizes {
                out.push(columns(&d, at, s)?.reshape(with_width(&dims, heads * s))?);
                at += s;
            }
            out
        }
        ShapeOp::BroadcastHeads { heads } => {
            let w = widths[0];
            let d = rows(&dy, heads * w)?;
            let mut sum = columns(&d, 0, w)?;
            for h in 1..*heads {
                sum = super::add(&sum, &columns(&d, h * w, w)?)?;
            }
            vec![sum.reshape(dims.clone())?]
        }
    };
    crate::module::gradients(&format!("{op:?}"), grads)
}

/// Heads on this rank of `heads` split over `cx`'s tensor-parallel group (for
/// `broadcast_heads`, whose output is split by heads as a column-parallel layer's).
pub fn local_heads(cx: &Cx, heads: usize) -> Result<usize> {
    let tp = cx.tp_size();
    if tp == 0 || !heads.is_multiple_of(tp) {
        return invalid!(
            "broadcast_heads: {heads} heads do not divide over tensor parallelism of {tp}"
        );
    }
    Ok(heads / tp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::ParallelState;
    use crate::comm::threads::launch;
    use crate::parallel::{ParallelConfig, ParallelLayout};

    fn with_cx(f: impl Fn(&Cx) + Sync) {
        let layout = ParallelLayout::new(&ParallelConfig::new(1)).unwrap();
        launch(1, |w| -> crate::Result<()> {
            let ps = ParallelState::new(&w, &layout)?;
            f(&Cx::new(&ps, 0));
            Ok(())
        })
        .unwrap();
    }

    fn t(v: Vec<f32>, dims: &[usize]) -> Tensor {
        Tensor::from_vec(v, dims.to_vec()).unwrap()
    }

    #[test]
    fn heads_are_cut_and_joined_per_head_and_back() {
        with_cx(|cx| {
            // 2 rows, 2 heads of [a a | b b b].
            let x: Vec<f32> = (0..20).map(|i| i as f32).collect();
            let x = t(x, &[2, 10]);
            let op = |part| ShapeOp::HeadPart {
                sizes: vec![2, 3],
                part,
            };
            let (a, sa) = shape(cx, Site::ROOT, op(0), &[&x]).unwrap();
            let (b, _) = shape(cx, Site::ROOT, op(1), &[&x]).unwrap();
            assert_eq!(
                a.to_vec::<f32>().unwrap(),
                [0., 1., 5., 6., 10., 11., 15., 16.]
            );
            assert_eq!(b.dims(), [2, 6]);
            let sizes = vec![2, 3];
            let (joined, sj) =
                shape(cx, Site::ROOT, ShapeOp::CatHeads { sizes }, &[&a, &b]).unwrap();
            assert_eq!(joined.to_vec::<f32>().unwrap(), x.to_vec::<f32>().unwrap());
            // Backward: the part's gradient back in its place, zeros elsewhere.
            let [da] = shape_backward::<1>(cx, Site::ROOT, sa, &a).unwrap();
            let da = da.to_vec::<f32>().unwrap();
            assert_eq!(&da[..5], [0., 1., 0., 0., 0.]);
            let [ga, gb] = shape_backward::<2>(cx, Site::ROOT, sj, &joined).unwrap();
            assert_eq!(ga.to_vec::<f32>().unwrap(), a.to_vec::<f32>().unwrap());
            assert_eq!(gb.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
        });
    }

    #[test]
    fn cat_narrow_and_broadcast_move_features_and_gradients() {
        with_cx(|cx| {
            let a = t(vec![1., 2., 3., 4.], &[2, 2]);
            let b = t(vec![5., 6.], &[2, 1]);
            let (c, sc) = shape(cx, Site::ROOT, ShapeOp::Cat, &[&a, &b]).unwrap();
            assert_eq!(c.to_vec::<f32>().unwrap(), [1., 2., 5., 3., 4., 6.]);
            let [ga, gb] = shape_backward::<2>(cx, Site::ROOT, sc, &c).unwrap();
            assert_eq!(ga.to_vec::<f32>().unwrap(), [1., 2., 3., 4.]);
            assert_eq!(gb.to_vec::<f32>().unwrap(), [5., 6.]);
            let op = ShapeOp::Narrow { start: 1, len: 2 };
            let (n, sn) = shape(cx, Site::ROOT, op, &[&c]).unwrap();
            assert_eq!(n.to_vec::<f32>().unwrap(), [2., 5., 4., 6.]);
            let [gn] = shape_backward::<1>(cx, Site::ROOT, sn, &n).unwrap();
            assert_eq!(gn.to_vec::<f32>().unwrap(), [0., 2., 5., 0., 4., 6.]);
            let op = ShapeOp::BroadcastHeads { heads: 3 };
            let (r, sr) = shape(cx, Site::ROOT, op, &[&b]).unwrap();
            assert_eq!(r.to_vec::<f32>().unwrap(), [5., 5., 5., 6., 6., 6.]);
            let [gr] = shape_backward::<1>(cx, Site::ROOT, sr, &r).unwrap();
            assert_eq!(gr.to_vec::<f32>().unwrap(), [15., 18.]);
            // Bad sizes are errors naming them.
            let op = ShapeOp::Narrow { start: 2, len: 5 };
            let err = shape(cx, Site::ROOT, op, &[&c]).unwrap_err().to_string();
            assert!(err.contains("features 2..7 of a tensor of 3"), "{err}");
        });
    }

    #[test]
    fn chunk_takes_equal_parts_or_names_the_width() {
        with_cx(|cx| {
            let x = t((0..12).map(|i| i as f32).collect(), &[2, 6]);
            let op = ShapeOp::Chunk { parts: 3, part: 1 };
            let (y, saved) = shape(cx, Site::ROOT, op, &[&x]).unwrap();
            assert_eq!(y.to_vec::<f32>().unwrap(), [2., 3., 8., 9.]);
            let [g] = shape_backward::<1>(cx, Site::ROOT, saved, &y).unwrap();
            let g = g.to_vec::<f32>().unwrap();
            assert_eq!(g, [0., 0., 2., 3., 0., 0., 0., 0., 8., 9., 0., 0.]);
            let op = ShapeOp::Chunk { parts: 4, part: 0 };
            let err = shape(cx, Site::ROOT, op, &[&x]).unwrap_err().to_string();
            assert!(
                err.contains("6 features ([2, 6]) do not cut into 4"),
                "{err}"
            );
        });
    }
}
