//! `#[column_parallel]`: a layer whose output features are split over tensor parallelism
//! (Megatron-LM's `ColumnParallelLinear`). Built by `ColumnParallel::build_column`; in forward,
//! Megatron-LM's f (the identity) before it, or with sequence parallelism the all-gather of the
//! input's sequence shards, and with `gather_output` the all-gather of the output features
//! after; in backward, f's backward: the all-reduce of the input gradient, or with sequence
//! parallelism its reduce-scatter to the shards.

use proc_macro2::TokenStream;
use quote::quote;

use super::{
    Backward, Call, Forward, Imports, Kind, keep_sequence_shard, regather_sequence,
    sequence_gather, sequence_sum,
};
use crate::generate::body::Body;
use crate::generate::comment;
use crate::parse::{Field, FieldKind};
use crate::validate::{Checker, FieldCall, Origin, Sharding, Want};

/// `#[column_parallel]` fields.
pub(super) struct Column;

impl Kind for Column {
    fn check_call(&self, c: &mut Checker<'_>, call: &FieldCall<'_>) {
        let name = &call.name;
        let FieldKind::Column { gather_output } = &call.field.kind else {
            unreachable!("a column field")
        };
        let who = format!("{} `{name}`", call.field.kind.attribute());
        if !c.arity(call.n, &who, 1) {
            return;
        }
        let (v, src) = call.arg(0);
        c.arg(&who, Want::Replicated, v, src);
        let (sh, text, column) = if *gather_output {
            (
                Sharding::Replicated,
                format!("it comes from {who}, which gathers its output"),
                None,
            )
        } else {
            (
                Sharding::Split,
                format!("it comes from {who}"),
                Some(call.name.clone()),
            )
        };
        c.set(call.out(), sh, Origin { text, column });
    }

    fn gradient_feeds_products(&self, rt: &TokenStream, f: &Field) -> Option<TokenStream> {
        Some(super::module_gradient_feeds_products(rt, f))
    }

    fn imports(&self, backward: bool, _ids: bool) -> Imports {
        Imports {
            named: Some(("module", "ColumnParallel")),
            reduce: backward,
            ..Imports::default()
        }
    }

    fn build(&self, rt: &TokenStream, f: &Field, _indices: TokenStream) -> Option<TokenStream> {
        Some(super::built_by(
            rt,
            f,
            "module",
            "ColumnParallel",
            "build_column",
        ))
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
        let FieldKind::Column { gather_output } = &cx.field(n).kind else {
            unreachable!("a column field")
        };
        let x = args[0];
        let call = cx.qualified(n, quote!(ColumnParallel::forward_column));
        let lora = cx.qualified(n, quote!(ColumnParallel::lora));
        let keep_lora = cx.qualified(n, quote!(ColumnParallel::keep_lora));
        let ldoc = comment(&format!(
            "`{name}`: its LoRA adapter, when it carries one (Megatron-Bridge's, beside a \
             column-parallel layer): this rank's rows of A (a slice of the rank) read the \
             whole input, their outputs all-gathered over tp; B's rows are split as the \
             layer's outputs, and add to them."
        ));
        // With gather_output the layer's output goes to a local first, gathered after.
        let (layer_out, gathered) = if *gather_output {
            let local = b
                .locals
                .temp(&format!("{name}_local"), pos, node.src.span());
            (local, Some(out))
        } else {
            (out, None)
        };
        if node.deferred {
            // f ran once before it, for every column-parallel layer reading this value.
            let kept = b.locals.temp(&format!("{name}_kept"), pos, node.src.span());
            let map = cx.qualified(n, quote!(ColumnParallel::map_kept_input));
            let kdoc = comment(&format!(
                "`{name}`: #[column_parallel], on the input gathered above. With sequence \
                 parallelism it keeps this rank's shard of its input, not the gathered sequence \
                 (backward gathers it again), as Megatron-LM does."
            ));
            b.push(move |nm| {
                let (xr, s, o, k) = (
                    nm.by_ref(x),
                    nm.pat(saved),
                    nm.pat(layer_out),
                    nm.ident(kept),
                );
                let keep = keep_sequence_shard(rt, &map, &k, &s);
                let oi = nm.ident(layer_out);
                let adapter = adapter_forward(
                    rt,
                    (&lora, &keep_lora, &site),
                    &this_field,
                    &ldoc,
                    &o,
                    &oi,
                    &k,
                    &xr,
                );
                quote! {
                    let (#o, #k) = #call(&#this_field, cx, #site, #xr)?;
                    #adapter
                    #kdoc
                    #keep
                }
            });
        } else {
            let doc = comment(&format!(
                "`{name}`: #[column_parallel]. f: identity in forward (its backward \
                 all-reduces the input gradient over tp); with sequence parallelism the \
                 all-gather of the input's sequence shards over tp (its backward \
                 reduce-scatters the gradient)."
            ));
            let whole = b
                .locals
                .temp(&format!("{name}_input"), pos, node.src.span());
            let kept = b.locals.temp(&format!("{name}_kept"), pos, node.src.span());
            let map = cx.qualified(n, quote!(ColumnParallel::map_kept_input));
            let kdoc = comment(&format!(
                "`{name}`: with sequence parallelism it keeps this rank's shard of its input, \
                 not the gathered sequence (backward gathers it again), as Megatron-LM does."
            ));
            b.push(move |nm| {
                let (xr, s, o, w) = (
                    nm.by_ref(x),
                    nm.pat(saved),
                    nm.pat(layer_out),
                    nm.ident(whole),
                );
                let k = nm.ident(kept);
                let gather = sequence_gather(rt, &xr, span);
                let keep = keep_sequence_shard(rt, &map, &k, &s);
                let oi = nm.ident(layer_out);
                let wr = quote!(&#w);
                let adapter = adapter_forward(
                    rt,
                    (&lora, &keep_lora, &site),
                    &this_field,
                    &ldoc,
                    &o,
                    &oi,
                    &k,
                    &wr,
                );
                quote! {
                    #doc
                    let #w = #gather;
                    let (#o, #k) = #call(&#this_field, cx, #site, &#w)?;
                    #adapter
                    #kdoc
                    #keep
                }
            });
        }
        if let Some(out) = gathered {
            let gdoc = comment(&format!(
                "`{name}`: gather_output. All-gather of the output features over tp; with \
                 sequence parallelism this rank then keeps its shard of the sequence (the \
                 output is replicated as every layer's outside the tensor-parallel region)."
            ));
            b.push(move |nm| {
                let (l, o) = (nm.ident(layer_out), nm.pat(out));
                quote! {
                    #gdoc
                    let #o = #rt::tensor_parallel::gather_last_dim(cx, &#l)?;
                    let #o = if cx.sequence_parallel() {
                        #rt::tensor_parallel::keep_sequence_shard(cx, &#o)?
                    } else {
                        #o
                    };
                }
            });
        }
    }

    fn backward<'a>(&self, call: &Call<'a>, b: &mut Body<'a>, io: &Backward<'_>) {
        let Call {
            cx, n, rt, span, ..
        } = *call;
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
        let FieldKind::Column { gather_output } = &cx.field(n).kind else {
            unreachable!("a column field")
        };
        let d_x = d_args[0].expect("column-parallel inputs are tensors");
        let deferred = cx.g.nodes[n].deferred;
        let call = cx.qualified(n, quote!(ColumnParallel::backward_column_input));
        let doc = comment(&format!(
            "`{name}`: f's backward, all-reduce of the input gradient over tp; with sequence \
             parallelism its reduce-scatter to the sequence shards."
        ));
        let local = gather_output.then(|| b.locals.temp(&format!("d_{name}_local"), pos, span));
        let partial = b.locals.temp(&format!("d_{name}_partial"), pos, span);
        let weights = b.locals.temp(&format!("{name}_weight_grad"), pos, span);
        let whole = Some(b.locals.temp(&format!("{name}_whole"), pos, span));
        let map = cx.qualified(n, quote!(ColumnParallel::map_kept_input));
        let wdoc = comment(&format!(
            "`{name}`: with sequence parallelism the all-gather of the kept input's sequence \
             shards over tp (the weight's gradient reads the whole sequence)."
        ));
        let lora = cx.qualified(n, quote!(ColumnParallel::lora));
        let lora_kept = cx.qualified(n, quote!(ColumnParallel::lora_kept));
        let adapter_dx = b.locals.temp(&format!("d_{name}_adapter"), pos, span);
        let ldoc = comment(&format!(
            "`{name}`: its LoRA adapter's backward, when it carries one: B's input gradient \
             is a partial sum over tp, all-reduced, then this rank keeps its slice of the \
             rank (the gather's backward); A's input gradient joins the layer's partial one."
        ));
        b.push(move |nm| {
            let (dx, p, wg) = (nm.pat(d_x), nm.ident(partial), nm.ident(weights));
            let ad = nm.ident(adapter_dx);
            let w_pass = super::weight_pass(&format!("`{name}`"), &wg);
            let (regather, s) = match whole {
                Some(w) => {
                    let (si, wi) = (nm.ident(saved), nm.ident(w));
                    let regather = regather_sequence(rt, &map, &si, &wi, span);
                    (
                        quote! {
                            #wdoc
                            #regather
                        },
                        quote!(#wi),
                    )
                }
                None => (quote!(), {
                    let si = nm.ident(saved);
                    quote!(#si)
                }),
            };
            let (split, dy) = match local {
                Some(l) => {
                    let li = nm.ident(l);
                    let dyr = nm.by_ref(d_y);
                    let sdoc = comment(&format!(
                        "`{name}`: gather_output's backward, this rank's slice of the \
                         output gradient's features; with sequence parallelism of the whole \
                         sequence, gathered first."
                    ));
                    (
                        quote! {
                            #sdoc
                            let #li = if cx.sequence_parallel() {
                                let whole = #rt::tensor_parallel::all_gather_sequence(cx, #dyr)?;
                                #rt::tensor_parallel::split_last_dim(cx, &whole)?
                            } else {
                                #rt::tensor_parallel::split_last_dim(cx, #dyr)?
                            };
                        },
                        quote!(&#li),
                    )
                }
                None => (quote!(), nm.by_ref(d_y)),
            };
            let adapter = quote! {
                #ldoc
                let #ad = match #lora(&#this_field) {
                    ::std::option::Option::Some(lora) => {
                        let (x, a) = #rt::tensor_parallel::lora::kept(#lora_kept(&#s))?;
                        let (da, up) = lora.backward_up(a, #dy)?;
                        #rt::tensor_parallel::all_reduce_tp(cx, &da)?;
                        let da = #rt::tensor_parallel::split_last_dim(cx, &da)?;
                        let (d, down) = lora.backward_down(cx, #site, x, &da)?;
                        cx.weight_gradient(up.and(down))?;
                        ::std::option::Option::Some(d)
                    }
                    ::std::option::Option::None => ::std::option::Option::None,
                };
            };
            if deferred {
                // f's backward runs once, on the sum of the readers' input gradients.
                return quote! {
                    #split
                    #regather
                    #adapter
                    let (#p, #wg) = #call(&#this_field, cx, #site, #s, #dy)?;
                    let #dx = #rt::tensor_parallel::lora::add_input_grad(#p, #ad)?;
                    #w_pass
                };
            }
            let sum = sequence_sum(rt, &p, span);
            quote! {
                #split
                #regather
                #adapter
                let (#p, #wg) = #call(&#this_field, cx, #site, #s, #dy)?;
                let #p = #rt::tensor_parallel::lora::add_input_grad(#p, #ad)?;
                #doc
                let #dx = #sum;
                #w_pass
            }
        });
    }
}

/// The forward of a column-parallel layer's LoRA adapter, when it carries one: statements
/// rebinding the layer's output `o` (`oi` its name) and what it kept `k`, the adapter having
/// read the layer's input `x`.
#[allow(clippy::too_many_arguments)]
fn adapter_forward(
    rt: &TokenStream,
    (lora, keep_lora, site): (&TokenStream, &TokenStream, &TokenStream),
    this_field: &TokenStream,
    doc: &TokenStream,
    o: &impl quote::ToTokens,
    oi: &impl quote::ToTokens,
    k: &impl quote::ToTokens,
    x: &TokenStream,
) -> TokenStream {
    quote! {
        #doc
        let (#o, #k) = match #lora(&#this_field) {
            ::std::option::Option::Some(lora) => {
                let down = lora.down(cx, #site, #x)?;
                let a = #rt::tensor_parallel::gather_last_dim(cx, &down)?;
                lora.add_up(&a, &#oi, 0)?;
                (#oi, #keep_lora(#k, a))
            }
            ::std::option::Option::None => (#oi, #k),
        };
    }
}
