//! The shape operations of forward (`ops::shape`): `narrow` (each part of `split`), the parts of
//! `chunk`, `cat`,
//! the parts of `split_heads`, `cat_heads`, and `broadcast_heads`, which turns one head whole on
//! every rank into this rank's heads: Megatron-LM's f around it (with sequence parallelism the
//! all-gather of the shards; in backward the all-reduce, or the reduce-scatter, of the
//! gradient summed over this rank's heads).

use proc_macro2::TokenStream;
use quote::quote;

use super::body::{Body, Ctx};
use super::comment;
use super::kind::{sequence_gather, sequence_sum};
use super::names::LocalId;
use crate::model::NodeId;
use crate::parse::ShapeKind;

/// `ShapeOp { .. }` of the node's kind and sizes.
fn shape_op(rt: &TokenStream, op: ShapeKind, sizes: &[syn::Expr]) -> TokenStream {
    match op {
        ShapeKind::Narrow => {
            let (start, len) = (&sizes[0], &sizes[1]);
            quote!(#rt::ops::ShapeOp::Narrow { start: #start, len: #len })
        }
        ShapeKind::Cat => quote!(#rt::ops::ShapeOp::Cat),
        ShapeKind::ChunkPart(part) => {
            let (parts, part) = (&sizes[0], proc_macro2::Literal::usize_unsuffixed(part));
            quote!(#rt::ops::ShapeOp::Chunk { parts: #parts, part: #part })
        }
        ShapeKind::HeadPart(part) => {
            let part = proc_macro2::Literal::usize_unsuffixed(part);
            quote!(#rt::ops::ShapeOp::HeadPart { sizes: ::std::vec![#(#sizes),*], part: #part })
        }
        ShapeKind::CatHeads => {
            quote!(#rt::ops::ShapeOp::CatHeads { sizes: ::std::vec![#(#sizes),*] })
        }
        ShapeKind::BroadcastHeads => {
            let heads = &sizes[0];
            quote!(#rt::ops::ShapeOp::BroadcastHeads {
                heads: #rt::ops::shape::local_heads(cx, #heads)?,
            })
        }
    }
}

/// The forward of a shape node.
#[allow(clippy::too_many_arguments)]
pub(super) fn forward<'a>(
    cx: &'a Ctx<'a>,
    b: &mut Body<'a>,
    n: NodeId,
    (op, sizes): (ShapeKind, &'a [syn::Expr]),
    args: &[LocalId],
    out: LocalId,
    saved: LocalId,
    pos: usize,
) {
    let rt = &cx.root.runtime;
    let span = cx.g.nodes[n].src.span();
    let site = cx.site(n);
    let args = args.to_vec();
    let whole = (op == ShapeKind::BroadcastHeads).then(|| b.locals.temp("one_head", pos, span));
    let doc = comment(
        "broadcast_heads: f before it (this rank's heads are split over tensor parallel): the \
         identity; with sequence parallelism the all-gather of the input's sequence shards over \
         tp (its backward reduces the gradient summed over this rank's heads).",
    );
    b.push(move |nm| {
        let call = shape_op(rt, op, sizes);
        let (s, o) = (nm.pat(saved), nm.pat(out));
        match whole {
            Some(w) => {
                let (xr, wi) = (nm.by_ref(args[0]), nm.ident(w));
                let gather = sequence_gather(rt, &xr, span);
                quote! {
                    #doc
                    let #wi = #gather;
                    let (#o, #s) = #rt::ops::shape(cx, #site, #call, &[&#wi])?;
                }
            }
            None => {
                let refs = args.iter().map(|&a| nm.by_ref(a));
                quote!(let (#o, #s) = #rt::ops::shape(cx, #site, #call, &[#(#refs),*])?;)
            }
        }
    });
}

/// The backward of a shape node.
#[allow(clippy::too_many_arguments)]
pub(super) fn backward<'a>(
    cx: &'a Ctx<'a>,
    b: &mut Body<'a>,
    n: NodeId,
    op: ShapeKind,
    d_y: LocalId,
    saved: LocalId,
    d_args: &[Option<LocalId>],
    pos: usize,
) {
    let rt = &cx.root.runtime;
    let span = cx.g.nodes[n].src.span();
    let site = cx.site(n);
    let d_args: Vec<LocalId> = d_args
        .iter()
        .map(|d| d.expect("shape operations move tensors"))
        .collect();
    let partial =
        (op == ShapeKind::BroadcastHeads).then(|| b.locals.temp("d_heads_sum", pos, span));
    let doc = comment(
        "broadcast_heads: f's backward, the all-reduce over tp of the gradient summed over this \
         rank's heads; with sequence parallelism its reduce-scatter to the sequence shards.",
    );
    b.push(move |nm| {
        let (s, dy) = (nm.ident(saved), nm.by_ref(d_y));
        let n = proc_macro2::Literal::usize_unsuffixed(d_args.len());
        match partial {
            Some(p) => {
                let (pi, dx) = (nm.ident(p), nm.pat(d_args[0]));
                let sum = sequence_sum(rt, &pi, span);
                quote! {
                    let [#pi] = #rt::ops::shape_backward::<1>(cx, #site, #s, #dy)?;
                    #doc
                    let #dx = #sum;
                }
            }
            None => {
                let grads = d_args.iter().map(|&d| nm.pat(d));
                quote!(let [#(#grads),*] = #rt::ops::shape_backward::<#n>(cx, #site, #s, #dy)?;)
            }
        }
    });
}
