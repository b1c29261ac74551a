//! `#[partial_output]`: a module of the user's whose forward ends in a row-parallel layer
//! (`module::PartialOutput`, which `#[megatron::module]` implements for such a module). It runs
//! whole on every rank as a field without attribute does, but hands its last layer's partial
//! output over unreduced, so that the caller runs g: alone, the all-reduce (with sequence
//! parallelism the reduce-scatter) and the bias after it; added to other partial outputs (GPT-J's
//! and PaLM's parallel block written with sub-modules, `x + self.attn(n) + self.mlp(n)`), one
//! reduction for all of them (`crate::collectives`). In backward g's backward: the identity, or
//! with sequence parallelism the all-gather of the output gradient's shards, once for the sum.

use proc_macro2::TokenStream;
use quote::quote;

use super::replicated::Replicated;
use super::{Backward, Call, Forward, Imports, Kind, sequence_gather, sequence_sum};
use crate::generate::body::Body;
use crate::generate::comment;
use crate::parse::Field;
use crate::validate::{Checker, FieldCall, Origin, Sharding, Want};

/// `#[partial_output]` fields.
pub(super) struct Partial;

impl Kind for Partial {
    fn check_call(&self, c: &mut Checker<'_>, call: &FieldCall<'_>) {
        let name = &call.name;
        let who = format!("#[partial_output] `{name}` (a module, whole on every rank)");
        if !c.arity(call.n, &who, 1) {
            return;
        }
        let (v, src) = call.arg(0);
        c.arg(&who, Want::Replicated, v, src);
        let text = format!(
            "it comes from #[partial_output] `{name}`, whose last layer's partial outputs are \
             reduced here"
        );
        c.set(
            call.out(),
            Sharding::Replicated,
            Origin { text, column: None },
        );
    }

    fn capturable(&self, rt: &TokenStream, f: &Field) -> Option<TokenStream> {
        Replicated.capturable(rt, f)
    }

    fn imports(&self, backward: bool, _ids: bool) -> Imports {
        Imports {
            named: Some(("module", "PartialOutput")),
            reduce: !backward,
            ..Imports::default()
        }
    }

    fn build(&self, rt: &TokenStream, f: &Field, indices: TokenStream) -> Option<TokenStream> {
        Replicated.build(rt, f, indices)
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
        let x = args[0];
        let forward = cx.qualified(n, quote!(PartialOutput::forward_partial));
        if node.deferred {
            // Reduced with the other partial outputs of the sum it is in (`RowSum`).
            let doc = comment(&format!(
                "`{name}`: #[partial_output]. Its last layer's partial outputs are summed with \
                 the other partial outputs of the sum below, which runs g once for all of them."
            ));
            b.push(move |nm| {
                let (s, o, xr) = (nm.pat(saved), nm.pat(out), nm.by_ref(x));
                quote! {
                    #doc
                    let (#o, #s) = #forward(&#this_field, cx, #site, #xr)?;
                }
            });
            return;
        }
        let add_bias = cx.qualified(n, quote!(PartialOutput::add_output_bias));
        let doc = comment(&format!(
            "`{name}`: #[partial_output]. g: all-reduce of its last layer's partial outputs over \
             tp; with sequence parallelism their reduce-scatter to the sequence shards."
        ));
        let partial = b
            .locals
            .temp(&format!("{name}_partial"), pos, node.src.span());
        b.push(move |nm| {
            let (s, o, p, xr) = (nm.pat(saved), nm.pat(out), nm.ident(partial), nm.by_ref(x));
            let oi = nm.ident(out);
            let sum = sequence_sum(rt, &p, span);
            quote! {
                let (#p, #s) = #forward(&#this_field, cx, #site, #xr)?;
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
        let d_x = d_args[0].expect("module inputs are tensors");
        let backward = cx.qualified(n, quote!(PartialOutput::backward_partial));
        if node.deferred {
            // The gradient arrives gathered, from the sum's backward (`RowSum`).
            b.push(move |nm| {
                let (s, dy, dx) = (nm.ident(saved), nm.by_ref(d_y), nm.pat(d_x));
                quote!(let #dx = #backward(&#this_field, cx, #site, #s, #dy)?;)
            });
            return;
        }
        let doc = comment(&format!(
            "`{name}`: g's backward is the identity; with sequence parallelism the all-gather \
             of the output gradient's sequence shards over tp."
        ));
        let whole = b.locals.temp(&format!("d_{name}_whole"), pos, span);
        b.push(move |nm| {
            let (s, dy, dx, w) = (
                nm.ident(saved),
                nm.by_ref(d_y),
                nm.pat(d_x),
                nm.ident(whole),
            );
            let gather = sequence_gather(rt, &dy, span);
            quote! {
                #doc
                let #w = #gather;
                let #dx = #backward(&#this_field, cx, #site, #s, &#w)?;
            }
        });
    }
}
