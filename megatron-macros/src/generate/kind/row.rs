//! `#[row_parallel]`: a layer whose input features are split over tensor parallelism
//! (Megatron-LM's `RowParallelLinear`). Built by `RowParallel::build_row`; in forward, the
//! scatter of a replicated input when `input_is_parallel = false`, then g: the all-reduce of the
//! partial outputs, or with sequence parallelism their reduce-scatter to the sequence shards,
//! and the bias added once; in backward, g's backward: the identity, or with sequence
//! parallelism the all-gather of the output gradient's shards.

use proc_macro2::TokenStream;
use quote::quote;

use super::{
    Backward, Call, Forward, Imports, Kind, refuse_sequence_parallel, sequence_gather, sequence_sum,
};
use crate::generate::body::{Body, value_base};
use crate::generate::comment;
use crate::model::{NodeOp, Use};
use crate::parse::{Field, FieldKind};
use crate::validate::{Checker, FieldCall, Origin, Sharding, Want};

/// `#[row_parallel]` fields.
pub(super) struct Row;

impl Kind for Row {
    fn check_call(&self, c: &mut Checker<'_>, call: &FieldCall<'_>) {
        let name = &call.name;
        let FieldKind::Row { input_is_parallel } = &call.field.kind else {
            unreachable!("a row field")
        };
        let who = format!("{} `{name}`", call.field.kind.attribute());
        if !c.arity(call.n, &who, 1) {
            return;
        }
        let (v, src) = call.arg(0);
        let want = if *input_is_parallel {
            Want::Split
        } else {
            Want::Replicated
        };
        c.arg(&who, want, v, src);
        let text = format!(
            "it comes from #[row_parallel] `{name}`, whose partial outputs are \
             all-reduced"
        );
        c.set(
            call.out(),
            Sharding::Replicated,
            Origin { text, column: None },
        );
    }

    fn gradient_feeds_products(&self, rt: &TokenStream, f: &Field) -> Option<TokenStream> {
        Some(super::module_gradient_feeds_products(rt, f))
    }

    fn imports(&self, backward: bool, _ids: bool) -> Imports {
        Imports {
            named: Some(("module", "RowParallel")),
            reduce: !backward,
            ..Imports::default()
        }
    }

    fn build(&self, rt: &TokenStream, f: &Field, _indices: TokenStream) -> Option<TokenStream> {
        Some(super::built_by(rt, f, "module", "RowParallel", "build_row"))
    }

    fn forward<'a>(&self, call: &Call<'a>, b: &mut Body<'a>, io: &Forward<'_>) {
        let Call {
            cx, n, rt, span, ..
        } = *call;
        let node = &cx.g.nodes[n];
        let site = call.site.clone();
        let this_field = call.this_field.clone();
        let name = call.name.clone();
        let Forward {
            args,
            out,
            saved,
            pos,
        } = *io;
        let FieldKind::Row { input_is_parallel } = &cx.field(n).kind else {
            unreachable!("a row field")
        };
        let x = args[0];
        let call = cx.qualified(n, quote!(RowParallel::forward_row));
        let add_bias = cx.qualified(n, quote!(RowParallel::add_bias));
        let doc = comment(&format!(
            "`{name}`: #[row_parallel]. g: all-reduce of the partial outputs over tp; with \
             sequence parallelism their reduce-scatter to the sequence shards."
        ));
        let split = (!input_is_parallel).then(|| {
            let base = format!("{}_local", value_base(cx.g, node.args[0]));
            b.locals.temp(&base, pos, node.src.span())
        });
        let sdoc = comment(&format!(
            "`{name}`: input_is_parallel = false. This rank's slice of the input \
             features (scatter)."
        ));
        let refuse = refuse_sequence_parallel(
            rt,
            &format!(
                "#[row_parallel(input_is_parallel = false)] `{name}` splits a whole input: it \
                 cannot run with sequence parallelism"
            ),
        );
        if node.deferred {
            // Reduced with the other row-parallel outputs of the sum it is in (`RowSum`), or by
            // the caller of the module it ends (`PartialOutput`).
            let summed = cx.g.values[node.output].uses.iter().any(|u| {
                matches!(u, Use::Arg { node, .. } if matches!(cx.g.nodes[*node].op, NodeOp::RowSum { .. }))
            });
            let doc = comment(&if summed {
                format!(
                    "`{name}`: #[row_parallel]. Its partial outputs are summed with the other \
                     row-parallel outputs of the sum below, which runs g once for all of them."
                )
            } else {
                format!(
                    "`{name}`: #[row_parallel]. Its partial outputs are returned unreduced and \
                     without the bias: the caller runs g (`PartialOutput`)."
                )
            });
            b.push(move |nm| {
                let (s, o, xr) = (nm.pat(saved), nm.pat(out), nm.by_ref(x));
                quote! {
                    #doc
                    let (#o, #s) = #call(&#this_field, cx, #site, #xr)?;
                }
            });
            return;
        }
        let partial = b
            .locals
            .temp(&format!("{name}_partial"), pos, node.src.span());
        b.push(move |nm| {
            let (s, o, p) = (nm.pat(saved), nm.pat(out), nm.ident(partial));
            let oi = nm.ident(out);
            let (scatter, xr) = match split {
                Some(l) => {
                    let li = nm.ident(l);
                    let xr = nm.by_ref(x);
                    (
                        quote! {
                            #refuse
                            #sdoc
                            let #li = #rt::tensor_parallel::split_last_dim(cx, #xr)?;
                        },
                        quote!(&#li),
                    )
                }
                None => (quote!(), nm.by_ref(x)),
            };
            let sum = sequence_sum(rt, &p, span);
            quote! {
                #scatter
                let (#p, #s) = #call(&#this_field, cx, #site, #xr)?;
                #doc
                let #o = #sum;
                #add_bias(&#this_field, cx, &#oi)?;
            }
        });
    }

    fn backward<'a>(&self, call: &Call<'a>, b: &mut Body<'a>, io: &Backward<'_>) {
        let Call {
            cx, n, rt, span, ..
        } = *call;
        let node = &cx.g.nodes[n];
        let site = call.site.clone();
        let this_field = call.this_field.clone();
        let name = call.name.clone();
        let Backward {
            d_y,
            saved,
            d_args,
            pos,
            ..
        } = *io;
        let FieldKind::Row { input_is_parallel } = &cx.field(n).kind else {
            unreachable!("a row field")
        };
        let d_x = d_args[0].expect("row-parallel inputs are tensors");
        let call = cx.qualified(n, quote!(RowParallel::backward_row_input));
        let doc = comment(&format!(
            "`{name}`: g's backward is the identity; with sequence parallelism the \
             all-gather of the output gradient's sequence shards over tp."
        ));
        let local = (!input_is_parallel).then(|| {
            let base = format!("d_{}_local", value_base(cx.g, node.args[0]));
            b.locals.temp(&base, pos, span)
        });
        let weights = b.locals.temp(&format!("{name}_weight_grad"), pos, span);
        if node.deferred {
            // The gradient arrives gathered, from the sum's backward (`RowSum`) or the caller's.
            b.push(move |nm| {
                let (s, dy, dx, wg) = (
                    nm.ident(saved),
                    nm.by_ref(d_y),
                    nm.pat(d_x),
                    nm.ident(weights),
                );
                let w_pass = super::weight_pass(&format!("`{name}`"), &wg);
                quote! {
                    let (#dx, #wg) = #call(&#this_field, cx, #site, #s, #dy)?;
                    #w_pass
                }
            });
            return;
        }
        let whole = b.locals.temp(&format!("d_{name}_whole"), pos, span);
        b.push(move |nm| {
            let (s, dy, dx, w) = (
                nm.ident(saved),
                nm.by_ref(d_y),
                nm.pat(d_x),
                nm.ident(whole),
            );
            let gather = sequence_gather(rt, &dy, span);
            let wg = nm.ident(weights);
            let w_pass = super::weight_pass(&format!("`{name}`"), &wg);
            match local {
                Some(l) => {
                    let li = nm.ident(l);
                    let gdoc = comment(&format!(
                        "`{name}`: input_is_parallel = false. The scatter's backward, \
                         all-gather of the input gradient over tp."
                    ));
                    quote! {
                        #doc
                        let #w = #gather;
                        let (#li, #wg) = #call(&#this_field, cx, #site, #s, &#w)?;
                        #gdoc
                        let #dx = #rt::tensor_parallel::gather_last_dim(cx, &#li)?;
                        #w_pass
                    }
                }
                None => quote! {
                    #doc
                    let #w = #gather;
                    let (#dx, #wg) = #call(&#this_field, cx, #site, #s, &#w)?;
                    #w_pass
                },
            }
        });
    }
}
