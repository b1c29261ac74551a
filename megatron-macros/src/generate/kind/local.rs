//! `#[local]`: a layer (or module) with replicated parameters that runs on this rank's part of
//! values split over tensor parallelism, one or several, and gives its output the same split
//! (the norms of this rank's query and key heads). It is visited and called as a replicated
//! layer ([`super::replicated`]); its inputs must be split, and its build differs: its
//! parameters' gradients come from this rank's part of the inputs, so `module::build_local`
//! marks every one to be summed over tensor parallelism (`Param::mark_tensor_parallel_partial`),
//! whatever the layer does itself.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;

use super::replicated::Replicated;
use super::{Backward, Call, Forward, Imports, Kind};
use crate::generate::body::Body;
use crate::parse::Field;
use crate::validate::{Checker, FieldCall, Sharding, Want};

/// `#[local]` fields.
pub(super) struct Local;

impl Kind for Local {
    /// A sub-module may hold stacks.
    fn visit_stacked(&self, rt: &TokenStream, f: &Field) -> TokenStream {
        super::visit_stacked_of(rt, f)
    }

    fn check_call(&self, c: &mut Checker<'_>, call: &FieldCall<'_>) {
        let who = format!("#[local] `{}`", call.name);
        let mut split = true;
        for i in 0..call.node.args.len() {
            let (v, src) = call.arg(i);
            match c.arg(&who, Want::Tensor, v, src) {
                Some(Sharding::Split) => {}
                Some(_) => {
                    split = false;
                    c.errors.push(src.error(format!(
                        "{who} runs on this rank's part of a split value (its parameters' \
                         gradients are summed over tensor parallel), but {} is whole on every \
                         rank ({}); a layer on a whole value takes no attribute",
                        c.describe(v),
                        c.origin_text(v)
                    )));
                }
                None => split = false,
            }
        }
        if split {
            let (v, _) = call.arg(0);
            let origin = c.origin[v].clone().expect("known sharding");
            c.set(call.out(), Sharding::Split, origin);
        }
    }

    fn capturable(&self, rt: &TokenStream, f: &Field) -> Option<TokenStream> {
        Replicated.capturable(rt, f)
    }

    fn checks(&self, rt: &TokenStream, f: &Field) -> Option<TokenStream> {
        Replicated.checks(rt, f)
    }

    fn gradient_feeds_products(&self, rt: &TokenStream, f: &Field) -> Option<TokenStream> {
        Replicated.gradient_feeds_products(rt, f)
    }

    fn imports(&self, backward: bool, ids: bool) -> Imports {
        Replicated.imports(backward, ids)
    }

    fn build(&self, rt: &TokenStream, f: &Field, _indices: TokenStream) -> Option<TokenStream> {
        let (name, scope, ty) = (&f.ident, f.name(), &f.ty);
        let path = quote_spanned!(ty.span()=> #rt::module::build_local::<#ty>);
        Some(quote!(b.scoped(#scope, |b| #path(&spec.#name, b))))
    }

    fn forward<'a>(&self, call: &Call<'a>, b: &mut Body<'a>, io: &Forward<'_>) {
        Replicated.forward(call, b, io)
    }

    fn backward<'a>(&self, call: &Call<'a>, b: &mut Body<'a>, io: &Backward<'_>) {
        Replicated.backward(call, b, io)
    }
}
