//! The nodes of merged collectives (`crate::collectives`): the sum of several row-parallel
//! layers' partial outputs reduced once, and Megatron-LM's f once for several column-parallel
//! layers reading one value.

use proc_macro2::TokenStream;
use quote::quote;

use super::body::{Body, Ctx};
use super::comment;
use super::kind::{sequence_gather, sequence_sum};
use super::names::LocalId;
use crate::model::{Def, NodeId};
use crate::parse::FieldKind;

/// The row-parallel nodes whose partial outputs the first `partials` arguments of `n` are.
fn rows(cx: &Ctx<'_>, n: NodeId, partials: usize) -> Vec<NodeId> {
    cx.g.nodes[n].args[..partials]
        .iter()
        .map(|&v| match cx.g.values[v].def {
            Def::Node(m) => m,
            Def::Input { .. } => unreachable!("partial outputs come from row-parallel layers"),
        })
        .collect()
}

fn listed(names: &[String]) -> String {
    let quoted: Vec<String> = names.iter().map(|n| format!("`{n}`")).collect();
    match quoted.as_slice() {
        [a, b] => format!("{a} and {b}"),
        _ => quoted.join(", "),
    }
}

/// Forward of a `RowSum`: the partial outputs summed, one reduction over tp, the biases, then
/// the other terms.
pub(super) fn row_sum_forward<'a>(
    cx: &'a Ctx<'a>,
    b: &mut Body<'a>,
    n: NodeId,
    args: &[LocalId],
    out: LocalId,
    pos: usize,
    partials: usize,
) {
    let rt = &cx.root.runtime;
    let span = cx.g.nodes[n].src.span();
    let rows = rows(cx, n, partials);
    let names: Vec<String> = rows.iter().map(|&m| cx.field(m).name()).collect();
    let what = match rows
        .iter()
        .any(|&m| matches!(cx.field(m).kind, FieldKind::PartialOutput))
    {
        true => "row-parallel outputs (of layers, or of #[partial_output] modules' last layers)",
        false => "#[row_parallel] outputs",
    };
    let doc = comment(&format!(
        "{}: {what} summed, so their partial outputs are summed first and g runs once for all \
         of them: one all-reduce over tp (with sequence parallelism one reduce-scatter to the \
         sequence shards), then each layer's bias.",
        listed(&names)
    ));
    let sum = b.locals.temp("partial_sum", pos, span);
    let others = args.len() > partials;
    let reduced = if others {
        b.locals.temp("reduced", pos, span)
    } else {
        out
    };
    let args = args.to_vec();
    b.push(move |nm| {
        let p: Vec<TokenStream> = args[..partials].iter().map(|&l| nm.by_ref(l)).collect();
        let s = nm.ident(sum);
        let (p0, p1) = (&p[0], &p[1]);
        let mut stmts = quote!(let #s = #rt::ops::add(#p0, #p1)?;);
        for pk in &p[2..] {
            stmts.extend(quote!(let #s = #rt::ops::add(&#s, #pk)?;));
        }
        let reduce = sequence_sum(rt, &s, span);
        let r = nm.ident(reduced);
        let rpat = nm.pat(reduced);
        stmts.extend(quote! {
            #doc
            let #rpat = #reduce;
        });
        for &m in &rows {
            let add_bias = match cx.field(m).kind {
                FieldKind::PartialOutput => cx.qualified(m, quote!(PartialOutput::add_output_bias)),
                _ => cx.qualified(m, quote!(RowParallel::add_bias)),
            };
            let field = cx.this_field(m);
            stmts.extend(quote!(#add_bias(&#field, cx, &#r)?;));
        }
        if others {
            let o = nm.ident(out);
            let opat = nm.pat(out);
            let mut acc = quote!(&#r);
            for &t in &args[partials..] {
                let tr = nm.by_ref(t);
                stmts.extend(quote!(let #opat = #rt::ops::add(#acc, #tr)?;));
                acc = quote!(&#o);
            }
        }
        stmts
    });
}

/// Backward of a `RowSum`: g's backward once (with sequence parallelism one all-gather of the
/// output gradient's shards) for every partial output; the other terms get the gradient as it is.
#[allow(clippy::too_many_arguments)]
pub(super) fn row_sum_backward<'a>(
    cx: &'a Ctx<'a>,
    b: &mut Body<'a>,
    n: NodeId,
    d_y: LocalId,
    d_args: &[Option<LocalId>],
    pos: usize,
    partials: usize,
) {
    let rt = &cx.root.runtime;
    let span = cx.g.nodes[n].src.span();
    let names: Vec<String> = rows(cx, n, partials)
        .iter()
        .map(|&m| cx.field(m).name())
        .collect();
    let doc = comment(&format!(
        "{}: g's backward once for all of them: the identity; with sequence parallelism one \
         all-gather of the output gradient's sequence shards over tp.",
        listed(&names)
    ));
    let whole = b.locals.temp("d_whole", pos, span);
    let d_args: Vec<LocalId> = d_args
        .iter()
        .map(|d| d.expect("sums are of tensors"))
        .collect();
    b.push(move |nm| {
        let dy = nm.by_ref(d_y);
        let w = nm.ident(whole);
        let gather = sequence_gather(rt, &dy, span);
        let mut stmts = quote! {
            #doc
            let #w = #gather;
        };
        let others = d_args.len() - partials;
        for (k, &d) in d_args[..partials].iter().enumerate() {
            let dp = nm.pat(d);
            let value = if k + 1 == partials {
                quote!(#w)
            } else {
                quote!(::std::clone::Clone::clone(&#w))
            };
            stmts.extend(quote!(let #dp = #value;));
        }
        for (k, &d) in d_args[partials..].iter().enumerate() {
            let dp = nm.pat(d);
            let value = nm.owned(d_y, k + 1 == others);
            stmts.extend(quote!(let #dp = #value;));
        }
        stmts
    });
}

/// Forward of a `SeqGather`: f once (with sequence parallelism the all-gather of the shards).
pub(super) fn seq_gather_forward<'a>(
    cx: &'a Ctx<'a>,
    b: &mut Body<'a>,
    n: NodeId,
    x: LocalId,
    out: LocalId,
) {
    let rt = &cx.root.runtime;
    let span = cx.g.nodes[n].src.span();
    let readers = column_readers(cx, n);
    let doc = comment(&format!(
        "{}: #[column_parallel] layers reading one value, so f runs once for all of them: the \
         identity; with sequence parallelism one all-gather of the input's sequence shards over \
         tp (its backward reduces the sum of their input gradients once).",
        listed(&readers)
    ));
    b.push(move |nm| {
        let (xr, o) = (nm.by_ref(x), nm.pat(out));
        let gather = sequence_gather(rt, &xr, span);
        quote! {
            #doc
            let #o = #gather;
        }
    });
}

/// Backward of a `SeqGather`: the sum of the readers' input gradients reduced once.
pub(super) fn seq_gather_backward<'a>(
    cx: &'a Ctx<'a>,
    b: &mut Body<'a>,
    n: NodeId,
    d_y: LocalId,
    d_x: LocalId,
    pos: usize,
) {
    let rt = &cx.root.runtime;
    let span = cx.g.nodes[n].src.span();
    let readers = column_readers(cx, n);
    let doc = comment(&format!(
        "{}: f's backward once for all of them: the all-reduce over tp of the sum of their \
         input gradients; with sequence parallelism its reduce-scatter to the sequence shards.",
        listed(&readers)
    ));
    let partial = b.locals.temp("d_partial_sum", pos, span);
    b.push(move |nm| {
        let p = nm.ident(partial);
        let dy = nm.owned(d_y, true);
        let dx = nm.pat(d_x);
        let sum = sequence_sum(rt, &p, span);
        quote! {
            let #p = #dy;
            #doc
            let #dx = #sum;
        }
    });
}

/// The names of the column-parallel fields reading the output of `SeqGather` node `n`.
fn column_readers(cx: &Ctx<'_>, n: NodeId) -> Vec<String> {
    let out = cx.g.nodes[n].output;
    cx.g.values[out]
        .uses
        .iter()
        .filter_map(|u| match u {
            crate::model::Use::Arg { node, .. } => Some(cx.field(*node).name()),
            crate::model::Use::Output => None,
        })
        .collect()
}
