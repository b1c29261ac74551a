//! `#[local]`: a layer with replicated parameters that runs on whatever this rank holds of its
//! input, split over tensor parallelism or not, and gives its output the same split (the norms
//! of this rank's query and key heads). It is built, visited and called as a replicated layer
//! ([`super::replicated`]); only the rule on its input differs. Its parameters' gradients come
//! from this rank's part of the input: the layer marks them to be summed over tensor
//! parallelism (`Param::mark_tensor_parallel_partial`).

use proc_macro2::TokenStream;

use super::replicated::Replicated;
use super::{Backward, Call, Forward, Imports, Kind};
use crate::generate::body::Body;
use crate::parse::Field;
use crate::validate::{Checker, FieldCall, Want};

/// `#[local]` fields.
pub(super) struct Local;

impl Kind for Local {
    fn check_call(&self, c: &mut Checker<'_>, call: &FieldCall<'_>) {
        let who = format!("#[local] `{}`", call.name);
        if !c.arity(call.n, &who, 1) {
            return;
        }
        let (v, src) = call.arg(0);
        if let Some(sh) = c.arg(&who, Want::Tensor, v, src) {
            let origin = c.origin[v].clone().expect("known sharding");
            c.set(call.out(), sh, origin);
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

    fn build(&self, rt: &TokenStream, f: &Field, indices: TokenStream) -> Option<TokenStream> {
        Replicated.build(rt, f, indices)
    }

    fn forward<'a>(&self, call: &Call<'a>, b: &mut Body<'a>, io: &Forward<'_>) {
        Replicated.forward(call, b, io)
    }

    fn backward<'a>(&self, call: &Call<'a>, b: &mut Body<'a>, io: &Backward<'_>) {
        Replicated.backward(call, b, io)
    }
}
