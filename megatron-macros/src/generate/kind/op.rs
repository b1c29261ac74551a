//! `#[op]`: a parameterless op (`module::Op`), its value its configuration, cloned from the spec;
//! called by `Op::forward` and `Op::backward`. `#[context_parallel]`: the same for an op that
//! mixes a sequence's positions (attention), called by `ContextParallel::forward_chunks` and
//! `ContextParallel::backward_chunks` (`context_parallel::ContextParallel`), which run it on a
//! context-parallel rank's chunks and exchange keys and values over the group. And
//! `#[config]`: plain data, cloned from the spec, never called.

use proc_macro2::{Ident, Span, TokenStream};
use quote::quote;

use super::{Backward, Call, Forward, Imports, Kind};
use crate::generate::body::Body;
use crate::generate::comment;
use crate::parse::Field;
use crate::validate::{Checker, FieldCall, Want};

/// Fields of parameterless ops: the runtime trait that calls them and its methods.
pub(crate) struct Op {
    /// The attribute, for messages.
    attribute: &'static str,
    /// What the generated call says of itself (none: nothing).
    says: Option<&'static str>,
    /// The runtime's module holding the trait, and the trait.
    named: (&'static str, &'static str),
    /// The forward's and the backward's methods.
    methods: (&'static str, &'static str),
    /// The runtime's module and trait of a call with several inputs (`MultiOp`'s kind), whose
    /// methods are named as `methods`.
    multi: (&'static str, &'static str),
}

/// `#[op]` fields: `module::Op`.
pub(super) const OP: Op = Op {
    attribute: "#[op]",
    says: None,
    named: ("module", "Op"),
    methods: ("forward", "backward"),
    multi: ("module", "MultiOp"),
};

/// `#[context_parallel]` fields: `context_parallel::ContextParallel`.
pub(super) const CONTEXT_PARALLEL: Op = Op {
    attribute: "#[context_parallel]",
    says: Some(
        "#[context_parallel]. On this rank's chunks of the sequence (all of it at cp 1): \
         keys and values exchanged over the context-parallel group as --cp-comm-type says \
         (p2p: a ring of send/recv; all_gather: all_gather, in backward all_gather and \
         reduce_scatter; a2a: all_to_all of the projection and of the context).",
    ),
    named: ("context_parallel", "ContextParallel"),
    methods: ("forward_chunks", "backward_chunks"),
    multi: ("context_parallel", "ContextParallelMulti"),
};

impl Op {
    /// `Trait::method` of the runtime trait (of `multi` for a call with several inputs).
    fn method(&self, method: &str, several: bool) -> TokenStream {
        let named = if several { self.multi } else { self.named };
        let tr = Ident::new(named.1, Span::call_site());
        let m = Ident::new(method, Span::call_site());
        quote!(#tr::#m)
    }

    /// What a call of several inputs imports: `multi`'s trait.
    pub(crate) fn multi_imports(&self) -> Imports {
        Imports {
            named: Some(self.multi),
            ..Imports::default()
        }
    }
}

impl Kind for Op {
    fn check_call(&self, c: &mut Checker<'_>, call: &FieldCall<'_>) {
        let name = &call.name;
        let who = format!("{} `{name}`", self.attribute);
        if call.node.args.len() > 1 {
            // A `MultiOp` (or `ContextParallelMulti`): its inputs sharded alike, its output as
            // them.
            c.alike(call.n, &who, &who);
            return;
        }
        if !c.arity(call.n, &who, 1) {
            return;
        }
        let (v, src) = call.arg(0);
        if let Some(sh) = c.arg(&who, Want::Tensor, v, src) {
            let origin = c.origin[v].clone().expect("known sharding");
            c.set(call.out(), sh, origin);
        }
    }

    fn has_params(&self) -> bool {
        false
    }

    fn spec_type(&self, _rt: &TokenStream, f: &Field) -> TokenStream {
        let ty = &f.ty;
        quote!(#ty)
    }

    fn saved_type(&self, rt: &TokenStream, f: &Field) -> TokenStream {
        let ty = &f.ty;
        quote!(<#ty as #rt::module::Op>::Saved)
    }

    fn imports(&self, _backward: bool, _ids: bool) -> Imports {
        Imports {
            named: Some(self.named),
            ..Imports::default()
        }
    }

    fn build(&self, _rt: &TokenStream, _f: &Field, _indices: TokenStream) -> Option<TokenStream> {
        None
    }

    fn forward<'a>(&self, call: &Call<'a>, b: &mut Body<'a>, io: &Forward<'_>) {
        let Call { cx, n, .. } = *call;
        let site = call.site.clone();
        let this_field = call.this_field.clone();
        let Forward {
            args, out, saved, ..
        } = *io;
        let doc = self
            .says
            .map(|says| comment(&format!("`{}`: {says}", cx.field(n).name())));
        if args.len() > 1 {
            let call = cx.qualified(n, self.method(self.methods.0, true));
            let args = args.to_vec();
            b.push(move |nm| {
                let refs = args.iter().map(|&a| nm.by_ref(a));
                let (s, o) = (nm.pat(saved), nm.pat(out));
                quote! {
                    #doc
                    let (#o, #s) = #call(&#this_field, cx, #site, &[#(#refs),*])?;
                }
            });
            return;
        }
        let x = args[0];
        let call = cx.qualified(n, self.method(self.methods.0, false));
        b.push(move |nm| {
            let (xr, s, o) = (nm.by_ref(x), nm.pat(saved), nm.pat(out));
            quote! {
                #doc
                let (#o, #s) = #call(&#this_field, cx, #site, #xr)?;
            }
        });
    }

    fn backward<'a>(&self, call: &Call<'a>, b: &mut Body<'a>, io: &Backward<'_>) {
        let Call { cx, n, .. } = *call;
        let site = call.site.clone();
        let this_field = call.this_field.clone();
        let Backward {
            d_y, saved, d_args, ..
        } = *io;
        let doc = self.says.map(|_| {
            comment(&format!(
                "`{}`: the backward of #[context_parallel]: the keys' and values' gradients \
                 summed over the ranks whose queries saw them (p2p: round the ring with their \
                 blocks; all_gather: reduce_scatter; a2a: all_to_all back).",
                cx.field(n).name()
            ))
        });
        if d_args.len() > 1 {
            let rt = &cx.root.runtime;
            let call = cx.qualified(n, self.method(self.methods.1, true));
            let name = cx.field(n).name();
            let count = proc_macro2::Literal::usize_unsuffixed(d_args.len());
            let d_args: Vec<_> = d_args
                .iter()
                .map(|d| d.expect("op inputs are tensors"))
                .collect();
            b.push(move |nm| {
                let (s, dy) = (nm.ident(saved), nm.by_ref(d_y));
                let grads = d_args.iter().map(|&d| nm.pat(d));
                quote! {
                    #doc
                    let [#(#grads),*] = #rt::module::gradients::<#count>(
                        #name,
                        #call(&#this_field, cx, #site, #s, #dy)?,
                    )?;
                }
            });
            return;
        }
        let d_x = d_args[0].expect("op inputs are tensors");
        let call = cx.qualified(n, self.method(self.methods.1, false));
        b.push(move |nm| {
            let (s, dy, dx) = (nm.ident(saved), nm.by_ref(d_y), nm.pat(d_x));
            quote! {
                #doc
                let #dx = #call(&#this_field, cx, #site, #s, #dy)?;
            }
        });
    }
}

/// `#[config]` fields: plain data, cloned from the spec, never called.
pub(super) struct Config;

impl Kind for Config {
    fn check_call(&self, c: &mut Checker<'_>, call: &FieldCall<'_>) {
        let name = &call.name;
        c.errors.push(call.node.src.error(format!(
            "`{name}` is #[config] data, not a layer: use it as a value, e.g. \
             `dropout(x, self.{name})`, not as a call"
        )));
    }

    fn has_params(&self) -> bool {
        false
    }

    fn spec_type(&self, _rt: &TokenStream, f: &Field) -> TokenStream {
        let ty = &f.ty;
        quote!(#ty)
    }

    fn build(&self, _rt: &TokenStream, _f: &Field, _indices: TokenStream) -> Option<TokenStream> {
        None
    }
}
