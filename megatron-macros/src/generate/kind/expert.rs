//! `#[expert_parallel]`: a router and experts split over expert parallelism (Megatron-LM's
//! `MoELayer`). Built by `ExpertParallel::build_experts`; in forward the gate and the route
//! (inside graph scopes `moe_router`/`moe_preprocess` when marked), the dispatch over ep, the
//! local experts with the row exchanges over etp, and the combine; in backward the same in
//! reverse, the routing recorded and the router's backward.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;

use super::{Backward, Call, Forward, Imports, Kind, graph_scope};
use crate::generate::body::Body;
use crate::generate::comment;
use crate::parse::Field;
use crate::validate::{Checker, FieldCall, Origin, Sharding, Want};

/// `#[expert_parallel]` fields.
pub(super) struct Expert;

impl Kind for Expert {
    fn check_call(&self, c: &mut Checker<'_>, call: &FieldCall<'_>) {
        let name = &call.name;
        let who = format!("#[expert_parallel] `{name}`");
        if !c.arity(call.n, &who, 1) {
            return;
        }
        let (v, src) = call.arg(0);
        c.arg(&who, Want::Replicated, v, src);
        let text = format!(
            "it comes from #[expert_parallel] `{name}`, whose combine brings every \
             token's expert outputs back"
        );
        c.set(
            call.out(),
            Sharding::Replicated,
            Origin { text, column: None },
        );
    }

    fn saved_type(&self, rt: &TokenStream, f: &Field) -> TokenStream {
        let ty = &f.ty;
        let t = quote_spanned!(ty.span()=> #rt::moe::ExpertParallel);
        quote!(#rt::moe::ExpertParallelSaved<
            <#ty as #t>::GateSaved,
            <#ty as #t>::RouterSaved,
            <#ty as #t>::LocalSaved,
        >)
    }

    fn capturable(&self, _rt: &TokenStream, _f: &Field) -> Option<TokenStream> {
        Some(quote!(false))
    }

    fn imports(&self, _backward: bool, _ids: bool) -> Imports {
        Imports {
            named: Some(("moe", "ExpertParallel")),
            ..Imports::default()
        }
    }

    fn build(&self, rt: &TokenStream, f: &Field, _indices: TokenStream) -> Option<TokenStream> {
        Some(super::built_by(
            rt,
            f,
            "moe",
            "ExpertParallel",
            "build_experts",
        ))
    }

    fn forward<'a>(&self, call: &Call<'a>, b: &mut Body<'a>, io: &Forward<'_>) {
        let Call {
            cx, n, rt, span: _, ..
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
        let field = cx.field(n);
        let x = args[0];
        let gate = cx.qualified(n, quote!(ExpertParallel::gate));
        let route = cx.qualified(n, quote!(ExpertParallel::route));
        let dispatcher = cx.qualified(n, quote!(ExpertParallel::dispatcher));
        let local = cx.qualified(n, quote!(ExpertParallel::forward_local));
        let span = node.src.span();
        let mut temp = |what: &str| b.locals.temp(&format!("{name}_{what}"), pos, span);
        let (routing, router, rows, plan, group_rows, tp, partial, y, kept, combined) = (
            temp("routing"),
            temp("router"),
            temp("rows"),
            temp("plan"),
            temp("group_rows"),
            temp("tp"),
            temp("partial"),
            temp("y"),
            temp("local"),
            temp("combine"),
        );
        let (logits, gate_kept) = (temp("routed"), temp("gate"));
        let scope = graph_scope(rt, field);
        let rdoc = comment(&format!(
            "`{name}`: #[expert_parallel]. The router where the tokens live: each \
             token's logits and, on a GPU, its experts and weights, the counts and \
             (the dispatcher's preprocessing) the tokens laid out expert-major, with \
             nothing read back{}",
            if scope.is_some() {
                let names: Vec<&str> = field.graph_scopes.iter().map(|s| s.name.as_str()).collect();
                format!(
                    " (graph scope {}: captured and replayed when selected; the \
                     permutation inside the graph when moe_preprocess is).",
                    names.join(", ")
                )
            } else {
                ".".to_string()
            }
        ));
        let chdoc = comment(&format!(
            "`{name}`: the routing placed where the tokens live: on a GPU its counts, \
             drops and losses read back after the router (the device-to-host sync; the \
             weights and the map stay there), or chosen here from the logits on the CPU."
        ));
        let ddoc = comment(&format!(
            "`{name}`: dispatch over ep, by the layer's dispatcher. All-to-all: the \
             per-expert counts, then the rows (laid out expert-major by the router's \
             device, or here) to the ranks holding their experts (uneven splits); \
             all-gather: every rank's tokens, each keeping its experts' rows."
        ));
        let gdoc = comment(&format!(
            "`{name}`: the rows of every rank of the expert-tensor-parallel group \
             (an all-gather with uneven sizes over etp; nothing with one rank)."
        ));
        let ldoc = comment(&format!(
            "`{name}`: this rank's slices of its experts, one grouped product per \
             layer over the group's rows: partial outputs."
        ));
        let sdoc = comment(&format!(
            "`{name}`: the partial outputs summed, each rank's rows back to it (a \
             reduce-scatter with uneven sizes over etp)."
        ));
        let cdoc = comment(&format!(
            "`{name}`: combine. The rows back to their tokens (the reverse all-to-all, or \
             a reduce-scatter, over ep), summed with the routing's weights."
        ));
        b.push(move |nm| {
            let xr = nm.by_ref(x);
            let (o, s) = (nm.pat(out), nm.pat(saved));
            let [
                routing,
                router,
                rows,
                plan,
                group_rows,
                tp,
                partial,
                y,
                kept,
                combined,
            ] = [
                routing, router, rows, plan, group_rows, tp, partial, y, kept, combined,
            ]
            .map(|l| nm.ident(l));
            let (logits, gate_kept) = (nm.ident(logits), nm.ident(gate_kept));
            let gated = match &scope {
                None => quote!(#gate(&#this_field, cx, #site, #xr)?),
                Some(scope) => quote! {
                    #rt::cuda_graphs::forward(
                        cx, #scope, #site, &[#xr],
                        |cx, __in| #gate(&#this_field, cx, #site, &__in[0]),
                    )?
                },
            };
            quote! {
                #rdoc
                let (#logits, #gate_kept) = #gated;
                #chdoc
                let (#routing, #router) = #route(&#this_field, cx, #site, #xr, &#logits)?;
                #ddoc
                let (#rows, #plan) = #rt::moe::dispatch(
                    cx.ep(), #dispatcher(&#this_field), #xr, &#routing,
                    #logits.permuted(),
                )?;
                #gdoc
                let (#group_rows, #tp) = #rt::moe::gather_expert_rows(
                    cx.etp(), &#rows, &#plan.rows_per_local_expert(),
                )?;
                #ldoc
                let (#partial, #kept) =
                    #local(&#this_field, cx, #site, &#group_rows, &#tp)?;
                #sdoc
                let #y = #rt::moe::reduce_scatter_expert_rows(cx.etp(), &#partial, &#tp)?;
                #cdoc
                let (#o, #combined) = #rt::moe::combine(cx.ep(), &#plan, &#y, &#routing)?;
                let #s = #rt::moe::ExpertParallelSaved {
                    routing: #routing,
                    gate: #gate_kept,
                    router: #router,
                    plan: #plan,
                    tp: #tp,
                    local: #kept,
                    combine: #combined,
                };
            }
        });
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
        let field = cx.field(n);
        let d_x = d_args[0].expect("expert-parallel inputs are tensors");
        let local = cx.qualified(n, quote!(ExpertParallel::backward_local_input));
        let route = cx.qualified(n, quote!(ExpertParallel::backward_route));
        let router_grads = cx.qualified(n, quote!(ExpertParallel::router_grads));
        let gate = cx.qualified(n, quote!(ExpertParallel::backward_gate));
        let scope = graph_scope(rt, field);
        let mut temp = |what: &str| b.locals.temp(&format!("d_{name}_{what}"), pos, span);
        let grads = [
            temp("y"),
            temp("probs"),
            temp("group_y"),
            temp("group_rows"),
            temp("rows"),
            temp("tokens"),
            temp("router"),
        ];
        let mut temp = |what: &str| b.locals.temp(&format!("{name}_{what}"), pos, span);
        let kept = [
            temp("gate"),
            temp("routing"),
            temp("router"),
            temp("plan"),
            temp("tp"),
            temp("local"),
            temp("combine"),
            temp("weight_grad"),
        ];
        let cdoc = comment(&format!(
            "`{name}`: combine's backward. The output gradient to the experts' rows (an \
             all-to-all, or an all-gather, over ep) and to the routing's weights."
        ));
        let ddoc = comment(&format!(
            "`{name}`: dispatch's backward. The rows' gradient back to their tokens (an \
             all-to-all, or a reduce-scatter, over ep), each token's copies summed."
        ));
        let rdoc = comment(&format!(
            "`{name}`: the routing recorded in the step's log; the weights' gradient \
             and the auxiliary losses' scale placed where the router's backward \
             reads them."
        ));
        let gtdoc = comment(&format!(
            "`{name}`: the router's backward (the logits' gradient from the weights' \
             and the auxiliary losses'), then the gate's, which adds its part of the \
             input gradient{}",
            if scope.is_some() {
                " (graph scope moe_router's backward)."
            } else {
                "."
            }
        ));
        let gdoc = comment(&format!(
            "`{name}`: the reduce-scatter's backward, the group's output gradients \
             (an all-gather with uneven sizes over etp)."
        ));
        let sdoc = comment(&format!(
            "`{name}`: the gather's backward, the group's partial row gradients \
             summed, each rank's rows back to it (a reduce-scatter over etp)."
        ));
        b.push(move |nm| {
            let (s, dy, dx) = (nm.ident(saved), nm.by_ref(d_y), nm.pat(d_x));
            let [
                d_rows_out,
                d_probs,
                d_group_y,
                d_group_rows,
                d_rows,
                d_tokens,
                d_router,
            ] = grads.map(|l| nm.ident(l));
            let [gate_kept, routing, router, plan, tp, kept, combine, wg] =
                kept.map(|l| nm.ident(l));
            let w_pass = super::weight_pass(
                &format!("`{name}`: the local experts' grouped products"),
                &wg,
            );
            let gated = match &scope {
                None => quote! {{
                    let __d_logits = #route(
                        &#this_field, cx, #site, #router, &#routing,
                        &#d_router[0], &#d_router[1],
                    )?;
                    #gate(&#this_field, cx, #site, #gate_kept, &__d_logits, #d_tokens)?
                }},
                Some(scope) => quote! {
                    #rt::cuda_graphs::backward(
                        cx, #scope, #site, (#gate_kept, #router),
                        &[&#d_router[0], &#d_router[1], &#d_tokens],
                        |cx, (__gate, __router), __in| {
                            let __d_logits = #route(
                                &#this_field, cx, #site, __router, &#routing,
                                &__in[0], &__in[1],
                            )?;
                            #gate(
                                &#this_field, cx, #site, __gate, &__d_logits,
                                __in[2].clone(),
                            )
                        },
                    )?
                },
            };
            quote! {
                let #rt::moe::ExpertParallelSaved {
                    routing: #routing,
                    gate: #gate_kept,
                    router: #router,
                    plan: #plan,
                    tp: #tp,
                    local: #kept,
                    combine: #combine,
                } = #s;
                #cdoc
                let (#d_rows_out, #d_probs) = #rt::moe::combine_backward(
                    cx.ep(), &#plan, &#combine, &#routing, #dy,
                )?;
                #gdoc
                let #d_group_y = #rt::moe::regather_expert_rows(cx.etp(), &#d_rows_out, &#tp)?;
                let (#d_group_rows, #wg) =
                    #local(&#this_field, cx, #site, #kept, &#d_group_y)?;
                #sdoc
                let #d_rows =
                    #rt::moe::reduce_scatter_expert_rows(cx.etp(), &#d_group_rows, &#tp)?;
                #ddoc
                let #d_tokens = #rt::moe::dispatch_backward(cx.ep(), &#plan, &#d_rows)?;
                #w_pass
                #rdoc
                let #d_router =
                    #router_grads(&#this_field, cx, #site, &#routing, &#d_probs, &#d_tokens)?;
                #gtdoc
                let #dx = #gated;
            }
        });
    }
}
