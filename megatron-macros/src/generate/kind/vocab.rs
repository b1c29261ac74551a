//! `#[vocab_parallel]`: an embedding whose vocabulary rows are split over tensor parallelism
//! (Megatron-LM's `VocabParallelEmbedding`). Built by `VocabParallel::build_vocab`; in forward,
//! the all-reduce of the partial lookups; the tied output layer (`self.field.logits(h)`) with f
//! before it, whose backward all-reduces the input gradient.

use proc_macro2::TokenStream;
use quote::quote;

use super::{Backward, Call, Forward, Imports, Kind, tp_sum};
use crate::generate::body::Body;
use crate::generate::comment;
use crate::parse::Field;
use crate::validate::{Checker, FieldCall, Origin, Sharding};

/// `#[vocab_parallel]` fields.
pub(super) struct Vocab;

impl Kind for Vocab {
    fn check_call(&self, c: &mut Checker<'_>, call: &FieldCall<'_>) {
        let name = &call.name;
        let who = format!("#[vocab_parallel] `{name}`");
        if !c.arity(call.n, &who, 1) {
            return;
        }
        let (v, src) = call.arg(0);
        if c.sharding[v].is_some_and(|s| s != Sharding::Ids) {
            c.errors.push(src.error(format!(
                "{who} looks up token ids, but {} is a tensor; the tied output \
                 layer is `self.{name}.logits(h)`",
                c.describe(v)
            )));
        }
        let text = format!(
            "it comes from #[vocab_parallel] `{name}`, whose partial lookups are \
             all-reduced"
        );
        c.set(
            call.out(),
            Sharding::Replicated,
            Origin { text, column: None },
        );
    }

    fn imports(&self, backward: bool, _ids: bool) -> Imports {
        Imports {
            named: Some(("module", "VocabParallel")),
            reduce: !backward,
            ..Imports::default()
        }
    }

    fn build(&self, rt: &TokenStream, f: &Field, _indices: TokenStream) -> Option<TokenStream> {
        Some(super::built_by(
            rt,
            f,
            "module",
            "VocabParallel",
            "build_vocab",
        ))
    }

    fn forward<'a>(&self, call: &Call<'a>, b: &mut Body<'a>, io: &Forward<'_>) {
        let Call { cx, n, span, .. } = *call;
        let site = call.site.clone();
        let this_field = call.this_field.clone();
        let name = call.name.clone();
        let Forward {
            args, out, saved, ..
        } = *io;
        let ids = args[0];
        let call = cx.qualified(n, quote!(VocabParallel::forward_vocab));
        let doc = comment(&format!(
            "`{name}`: #[vocab_parallel]. All-reduce of the partial lookups over tp \
             (each rank holds its rows of the vocabulary)."
        ));
        b.push(move |nm| {
            let (ir, s, o, oi) = (nm.by_ref(ids), nm.pat(saved), nm.pat(out), nm.ident(out));
            let reduce = tp_sum(&oi, span);
            quote! {
                let (#o, #s) = #call(&#this_field, cx, #site, #ir)?;
                #doc
                #reduce
            }
        });
    }

    fn backward<'a>(&self, call: &Call<'a>, b: &mut Body<'a>, io: &Backward<'_>) {
        let Call { cx, n, .. } = *call;
        let site = call.site.clone();
        let this_field = call.this_field.clone();
        let name = call.name.clone();
        let Backward { d_y, saved, .. } = *io;
        let call = cx.qualified(n, quote!(VocabParallel::backward_vocab));
        let doc = comment(&format!(
            "`{name}`: the all-reduce's backward is the identity; token ids have no \
             gradient."
        ));
        b.push(move |nm| {
            let (s, dy) = (nm.ident(saved), nm.by_ref(d_y));
            quote! {
                #doc
                #call(&#this_field, cx, #site, #s, #dy)?;
            }
        });
    }
}

/// The tied output layer `self.field.logits(h)`: f (the identity) before it.
pub(in crate::generate) fn logits_forward<'a>(call: &Call<'a>, b: &mut Body<'a>, io: &Forward<'_>) {
    let Call { cx, n, .. } = *call;
    let site = call.site.clone();
    let this_field = call.this_field.clone();
    let name = call.name.clone();
    let Forward {
        args, out, saved, ..
    } = *io;
    let h = args[0];
    let call = cx.qualified(n, quote!(VocabParallel::logits_forward));
    let doc = comment(&format!(
        "`{name}.logits`: the tied output layer, split by vocabulary. f: identity in \
         forward (its backward all-reduces the input gradient over tp)."
    ));
    b.push(move |nm| {
        let (hr, s, o) = (nm.by_ref(h), nm.pat(saved), nm.pat(out));
        quote! {
            #doc
            let (#o, #s) = #call(&#this_field, cx, #site, #hr)?;
        }
    });
}

/// The tied output layer's backward: f's backward, the all-reduce of the input gradient.
pub(in crate::generate) fn logits_backward<'a>(
    call: &Call<'a>,
    b: &mut Body<'a>,
    io: &Backward<'_>,
) {
    let Call { cx, n, span, .. } = *call;
    let site = call.site.clone();
    let this_field = call.this_field.clone();
    let name = call.name.clone();
    let Backward {
        d_y, saved, d_args, ..
    } = *io;
    let d_h = d_args[0].expect("logits inputs are tensors");
    let call = cx.qualified(n, quote!(VocabParallel::logits_backward));
    let doc = comment(&format!(
        "`{name}.logits`: f's backward, all-reduce of the input gradient over tp."
    ));
    b.push(move |nm| {
        let (s, dy, dh, dhi) = (nm.ident(saved), nm.by_ref(d_y), nm.pat(d_h), nm.ident(d_h));
        let reduce = tp_sum(&dhi, span);
        quote! {
            let #dh = #call(&#this_field, cx, #site, #s, #dy)?;
            #doc
            #reduce
        }
    });
}

/// What a call of the tied output layer imports: `VocabParallel`, and `ReduceOp` in backward
/// (f's backward).
pub(in crate::generate) fn logits_imports(backward: bool) -> super::Imports {
    super::Imports {
        named: Some(("module", "VocabParallel")),
        reduce: backward,
        ..super::Imports::default()
    }
}
