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
        let lora = cx.qualified(n, quote!(RowParallel::lora));
        let keep_lora = cx.qualified(n, quote!(RowParallel::keep_lora));
        let ldoc = comment(&format!(
            "`{name}`: its LoRA adapter, when it carries one (Megatron-Bridge's, beside a \
             row-parallel layer): this rank's columns of A (its input features) give a partial \
             down-projection, all-reduced over tp; this rank's rows of B give its block of the \
             output features, added into its columns of the partial outputs, which g sums."
        ));
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
                let (si, oi) = (nm.ident(saved), nm.ident(out));
                let names = (&o, &oi, &s, &si);
                let adapter = adapter_forward(
                    rt,
                    (&lora, &keep_lora, &site),
                    &this_field,
                    &ldoc,
                    names,
                    &xr,
                );
                quote! {
                    #doc
                    let (#o, #s) = #call(&#this_field, cx, #site, #xr)?;
                    #adapter
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
            let si = nm.ident(saved);
            let adapter = adapter_forward(
                rt,
                (&lora, &keep_lora, &site),
                &this_field,
                &ldoc,
                (&p, &p, &s, &si),
                &xr,
            );
            quote! {
                #scatter
                let (#p, #s) = #call(&#this_field, cx, #site, #xr)?;
                #adapter
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
        let lora = cx.qualified(n, quote!(RowParallel::lora));
        let lora_kept = cx.qualified(n, quote!(RowParallel::lora_kept));
        let adapter_dx = b.locals.temp(&format!("d_{name}_adapter"), pos, span);
        let layer_dx = b.locals.temp(&format!("d_{name}_layer"), pos, span);
        let ldoc = comment(&format!(
            "`{name}`: its LoRA adapter's backward, when it carries one: this rank's columns \
             of the output gradient give B's input gradient, a partial sum over tp, \
             all-reduced; A's input gradient joins the layer's."
        ));
        let adapter_field = this_field.clone();
        let adapter_site = site.clone();
        let adapter = move |s: &TokenStream, dy: &TokenStream, ad: &TokenStream| {
            quote! {
                #ldoc
                let #ad = match #lora(&#adapter_field) {
                    ::std::option::Option::Some(lora) => {
                        let (x, a) = #rt::tensor_parallel::lora::kept(#lora_kept(&#s))?;
                        let dy = #rt::tensor_parallel::split_last_dim(cx, #dy)?;
                        let (da, up) = lora.backward_up(a, &dy)?;
                        #rt::tensor_parallel::all_reduce_tp(cx, &da)?;
                        let (d, down) = lora.backward_down(cx, #adapter_site, x, &da)?;
                        cx.weight_gradient(up.and(down))?;
                        ::std::option::Option::Some(d)
                    }
                    ::std::option::Option::None => ::std::option::Option::None,
                };
            }
        };
        if node.deferred {
            // The gradient arrives gathered, from the sum's backward (`RowSum`) or the caller's.
            b.push(move |nm| {
                let (s, dy, dx, wg) = (
                    nm.ident(saved),
                    nm.by_ref(d_y),
                    nm.pat(d_x),
                    nm.ident(weights),
                );
                let (ad, ld) = (nm.ident(adapter_dx), nm.ident(layer_dx));
                let w_pass = super::weight_pass(&format!("`{name}`"), &wg);
                let adapter = adapter(&quote!(#s), &dy, &quote!(#ad));
                quote! {
                    #adapter
                    let (#ld, #wg) = #call(&#this_field, cx, #site, #s, #dy)?;
                    let #dx = #rt::tensor_parallel::lora::add_input_grad(#ld, #ad)?;
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
            let (ad, ld) = (nm.ident(adapter_dx), nm.ident(layer_dx));
            let adapter = adapter(&quote!(#s), &quote!(&#w), &quote!(#ad));
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
                        #adapter
                        let (#ld, #wg) = #call(&#this_field, cx, #site, #s, &#w)?;
                        let #li = #rt::tensor_parallel::lora::add_input_grad(#ld, #ad)?;
                        #gdoc
                        let #dx = #rt::tensor_parallel::gather_last_dim(cx, &#li)?;
                        #w_pass
                    }
                }
                None => quote! {
                    #doc
                    let #w = #gather;
                    #adapter
                    let (#ld, #wg) = #call(&#this_field, cx, #site, #s, &#w)?;
                    let #dx = #rt::tensor_parallel::lora::add_input_grad(#ld, #ad)?;
                    #w_pass
                },
            }
        });
    }
}

/// The forward of a row-parallel layer's LoRA adapter, when it carries one: statements
/// rebinding the layer's partial outputs and what it kept (`(o, oi, s, si)`: their patterns and
/// names), the adapter having read the layer's input `x`.
fn adapter_forward(
    rt: &TokenStream,
    (lora, keep_lora, site): (&TokenStream, &TokenStream, &TokenStream),
    this_field: &TokenStream,
    doc: &TokenStream,
    (o, oi, s, si): (
        &impl quote::ToTokens,
        &impl quote::ToTokens,
        &impl quote::ToTokens,
        &impl quote::ToTokens,
    ),
    x: &TokenStream,
) -> TokenStream {
    quote! {
        #doc
        let (#o, #s) = match #lora(&#this_field) {
            ::std::option::Option::Some(lora) => {
                let a = lora.down(cx, #site, #x)?;
                #rt::tensor_parallel::all_reduce_tp(cx, &a)?;
                lora.add_up(&a, &#oi, lora.row_columns_at(cx.tp_rank()))?;
                (#oi, #keep_lora(#si, a))
            }
            ::std::option::Option::None => (#oi, #si),
        };
    }
}
