//! A field without a split attribute (or `#[replicated]`): a layer or sub-module whole on every
//! rank. Built by `Module::build`, its replicated parameters then marked as living in the
//! sequence-parallel region (with sequence parallelism it reads the shard: the gradients are
//! summed over tp); called by method syntax (a sub-module's generated forward, a
//! layer's `Layer`/`Lookup` method), through a graph scope's boundary when marked; in backward,
//! a layer of one input adds the input's other gradients itself (`backward_plus`).

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;

use super::{Backward, Call, Forward, Imports, Kind, graph_scope};
use crate::generate::body::Body;
use crate::generate::comment;
use crate::parse::Field;
use crate::validate::{Checker, FieldCall, Origin, Sharding, Want};

/// Replicated fields.
pub(crate) struct Replicated;

impl Kind for Replicated {
    /// A sub-module may hold stacks.
    fn visit_stacked(&self, rt: &TokenStream, f: &Field) -> TokenStream {
        super::visit_stacked_of(rt, f)
    }

    fn check_call(&self, c: &mut Checker<'_>, call: &FieldCall<'_>) {
        let name = &call.name;
        let who = format!("`{name}` (no split attribute: it runs whole on every rank)");
        for i in 0..call.node.args.len() {
            let (v, src) = call.arg(i);
            c.arg(&who, Want::ReplicatedOrIds, v, src);
        }
        let text = format!("it comes from `{name}`, which runs whole on every rank");
        c.set(
            call.out(),
            Sharding::Replicated,
            Origin { text, column: None },
        );
    }

    fn capturable(&self, rt: &TokenStream, f: &Field) -> Option<TokenStream> {
        let ty = &f.ty;
        Some(quote_spanned!(ty.span()=> <#ty as #rt::module::Module>::CAPTURABLE))
    }

    fn checks(&self, rt: &TokenStream, f: &Field) -> Option<TokenStream> {
        if f.graph_scopes.is_empty() {
            return None;
        }
        let ty = &f.ty;
        Some(quote_spanned! {ty.span()=>
            const _: () = ::std::assert!(
                <#ty as #rt::module::Module>::CAPTURABLE,
                "#[graph_scope] cannot capture this module: it holds an #[expert_parallel] \
                 layer, whose dispatch is an all-to-all with sizes known only at run time \
                 (mark the expert field #[graph_scope(moe_router)] instead)"
            );
        })
    }

    fn adds_other_gradients(&self) -> bool {
        true
    }

    fn gradient_feeds_products(&self, rt: &TokenStream, f: &Field) -> Option<TokenStream> {
        Some(super::module_gradient_feeds_products(rt, f))
    }

    fn imports(&self, _backward: bool, ids: bool) -> Imports {
        Imports {
            layer: !ids,
            lookup: ids,
            ..Imports::default()
        }
    }

    /// Built, then its replicated parameters marked as living in the sequence-parallel region
    /// (a field without a split attribute reads the sequence shard with sequence parallelism;
    /// `module::sequence_parallel_region` leaves alone what a sub-module marked otherwise).
    fn build(&self, rt: &TokenStream, f: &Field, _indices: TokenStream) -> Option<TokenStream> {
        let (name, scope, ty) = (&f.ident, f.name(), &f.ty);
        let path = quote_spanned!(ty.span()=> #rt::module::build_whole::<#ty>);
        Some(quote!(b.scoped(#scope, |b| #path(&spec.#name, b))))
    }

    fn forward<'a>(&self, call: &Call<'a>, b: &mut Body<'a>, io: &Forward<'_>) {
        let Call { cx, n, rt, .. } = *call;
        let site = call.site.clone();
        let name = call.name.clone();
        let Forward {
            args, out, saved, ..
        } = *io;
        let field = cx.field(n);
        let args = args.to_vec();
        let this = &cx.imp.forward.self_token;
        let f = &field.ident;
        let method = cx.spanned(n, quote!(forward));
        let scope = graph_scope(rt, field);
        let doc = scope.as_ref().map(|_| {
            comment(&format!(
                "`{name}`: graph scope `{}`. Eager the first time; with the scope \
                 selected (--cuda-graph-scope), captured in this microbatch's \
                 in-flight slot the second time, its input copied into the slot's \
                 static buffer, and replayed after.",
                field.graph_scopes[0].name
            ))
        });
        b.push(move |nm| {
            let refs: Vec<_> = args.iter().map(|&l| nm.by_ref(l)).collect();
            let (s, o) = (nm.pat(saved), nm.pat(out));
            match &scope {
                None => quote! {
                    let (#o, #s) = #this.#f.#method(cx, #site, #(#refs),*)?;
                },
                Some(scope) => {
                    let ins = (0..refs.len()).map(|i| quote!(&__in[#i]));
                    quote! {
                        #doc
                        let (#o, #s) = #rt::cuda_graphs::forward(
                            cx, #scope, #site, &[#(#refs),*],
                            |cx, __in| #this.#f.#method(cx, #site, #(#ins),*),
                        )?;
                    }
                }
            }
        });
    }

    fn backward<'a>(&self, call: &Call<'a>, b: &mut Body<'a>, io: &Backward<'_>) {
        let Call { cx, n, rt, .. } = *call;
        let site = call.site.clone();
        let name = call.name.clone();
        let Backward {
            d_y,
            d_ys,
            saved,
            d_args,
            plus,
            ..
        } = *io;
        let d_ys = d_ys.to_vec();
        let field = cx.field(n);
        let d_args = d_args.to_vec();
        let this = &cx.imp.forward.self_token;
        let f = &field.ident;
        let method = match plus {
            Some(_) => cx.spanned(n, quote!(backward_plus)),
            None => cx.spanned(n, quote!(backward)),
        };
        let doc = plus.map(|_| {
            comment(&format!(
                "`{name}`: its input's other gradient is added in its backward's pass."
            ))
        });
        let scope = graph_scope(rt, field);
        let sdoc = scope.as_ref().map(|_| {
            comment(&format!(
                "`{name}`: graph scope `{}`'s backward, captured and replayed as \
                 its forward (a replay reads the slot's saved buffers).",
                field.graph_scopes[0].name
            ))
        });
        b.push(move |nm| {
            let s = nm.ident(saved);
            // A module of several outputs takes each one's gradient.
            let dy = match d_ys.as_slice() {
                [] => nm.by_ref(d_y),
                several => {
                    let refs = several.iter().map(|&d| nm.by_ref(d));
                    quote!((#(#refs),*))
                }
            };
            let extra = plus.map(|p| {
                let p = nm.by_ref(p);
                quote!(, #p)
            });
            let call = match &scope {
                None => quote!(#this.#f.#method(cx, #site, #s, #dy #extra)?),
                Some(scope) => {
                    let (grads, extra_in) = match plus {
                        Some(p) => {
                            let p = nm.by_ref(p);
                            (quote!(&[#dy, #p]), quote!(, &__in[1]))
                        }
                        None => (quote!(&[#dy]), quote!()),
                    };
                    quote! {
                        #rt::cuda_graphs::backward(
                            cx, #scope, #site, #s, #grads,
                            |cx, __saved, __in| #this.#f.#method(
                                cx, #site, __saved, &__in[0] #extra_in
                            ),
                        )?
                    }
                }
            };
            super::bind_gradients(nm, &d_args, call, quote!(#doc #sdoc))
        });
    }
}
