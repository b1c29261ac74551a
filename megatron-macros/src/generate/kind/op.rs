//! `#[op]`: a parameterless op (`module::Op`), its value its configuration, cloned from the spec;
//! called by `Op::forward` and `Op::backward`. And `#[config]`: plain data, cloned from the spec,
//! never called.

use proc_macro2::TokenStream;
use quote::quote;

use super::{Backward, Call, Forward, Imports, Kind};
use crate::generate::body::Body;
use crate::parse::Field;
use crate::validate::{Checker, FieldCall, Want};

/// `#[op]` fields.
pub(super) struct Op;

impl Kind for Op {
    fn check_call(&self, c: &mut Checker<'_>, call: &FieldCall<'_>) {
        let name = &call.name;
        let who = format!("#[op] `{name}`");
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
            named: Some(("module", "Op")),
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
        let x = args[0];
        let call = cx.qualified(n, quote!(Op::forward));
        b.push(move |nm| {
            let (xr, s, o) = (nm.by_ref(x), nm.pat(saved), nm.pat(out));
            quote! {
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
        let d_x = d_args[0].expect("op inputs are tensors");
        let call = cx.qualified(n, quote!(Op::backward));
        b.push(move |nm| {
            let (s, dy, dx) = (nm.ident(saved), nm.by_ref(d_y), nm.pat(d_x));
            quote!(let #dx = #call(&#this_field, cx, #site, #s, #dy)?;)
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
