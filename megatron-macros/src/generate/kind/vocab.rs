//! `#[vocab_parallel]`: an embedding whose vocabulary rows are split over tensor parallelism
//! (Megatron-LM's `VocabParallelEmbedding`). Built by `VocabParallel::build_vocab`; in forward,
//! the all-reduce of the partial lookups, or with sequence parallelism their reduce-scatter to
//! the sequence shards; the tied output layer (`self.field.logits(h)`) with f before it (with
//! sequence parallelism the all-gather of the shards), whose backward all-reduces the input
//! gradient (or reduce-scatters it).

use proc_macro2::TokenStream;
use quote::quote;

use super::{
    Backward, Call, Forward, Imports, Kind, keep_sequence_shard, regather_sequence,
    sequence_gather, sequence_sum,
};
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
        let Call {
            cx, n, rt, span, ..
        } = *call;
        let site = call.site.clone();
        let this_field = call.this_field.clone();
        let name = call.name.clone();
        let Forward {
            args,
            out,
            saved,
            pos,
        } = *io;
        let ids = args[0];
        let call = cx.qualified(n, quote!(VocabParallel::forward_vocab));
        let doc = comment(&format!(
            "`{name}`: #[vocab_parallel]. All-reduce of the partial lookups over tp \
             (each rank holds its rows of the vocabulary); with sequence parallelism their \
             reduce-scatter to the sequence shards."
        ));
        let partial = b.locals.temp(&format!("{name}_partial"), pos, span);
        b.push(move |nm| {
            let (ir, s, o, p) = (
                nm.by_ref(ids),
                nm.pat(saved),
                nm.pat(out),
                nm.ident(partial),
            );
            let sum = sequence_sum(rt, &p, span);
            quote! {
                let (#p, #s) = #call(&#this_field, cx, #site, #ir)?;
                #doc
                let #o = #sum;
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
            d_y, saved, pos, ..
        } = *io;
        let call = cx.qualified(n, quote!(VocabParallel::backward_vocab));
        let doc = comment(&format!(
            "`{name}`: the all-reduce's backward is the identity (with sequence \
             parallelism the reduce-scatter's is the all-gather of the gradient's shards); \
             token ids have no gradient."
        ));
        let whole = b.locals.temp(&format!("d_{name}_whole"), pos, span);
        b.push(move |nm| {
            let (s, dy, w) = (nm.ident(saved), nm.by_ref(d_y), nm.ident(whole));
            let gather = sequence_gather(rt, &dy, span);
            quote! {
                #doc
                let #w = #gather;
                #call(&#this_field, cx, #site, #s, &#w)?;
            }
        });
    }
}

/// The tied output layer `self.field.logits(h)`: f (the identity) before it, or with sequence
/// parallelism the all-gather of the input's shards.
pub(in crate::generate) fn logits_forward<'a>(call: &Call<'a>, b: &mut Body<'a>, io: &Forward<'_>) {
    let Call {
        cx, n, rt, span, ..
    } = *call;
    let site = call.site.clone();
    let this_field = call.this_field.clone();
    let name = call.name.clone();
    let Forward {
        args,
        out,
        saved,
        pos,
    } = *io;
    let h = args[0];
    let call = cx.qualified(n, quote!(VocabParallel::logits_forward));
    let doc = comment(&format!(
        "`{name}.logits`: the tied output layer, split by vocabulary. f: identity in \
         forward (its backward all-reduces the input gradient over tp); with sequence \
         parallelism the all-gather of the input's sequence shards over tp."
    ));
    let whole = b.locals.temp(&format!("{name}_logits_input"), pos, span);
    let kept = b.locals.temp(&format!("{name}_logits_kept"), pos, span);
    let map = cx.qualified(n, quote!(VocabParallel::map_kept_logits_input));
    let kdoc = comment(&format!(
        "`{name}.logits`: with sequence parallelism it keeps this rank's shard of its input, \
         not the gathered sequence (backward gathers it again), as Megatron-LM's output layer."
    ));
    b.push(move |nm| {
        let (hr, s, o, w) = (nm.by_ref(h), nm.pat(saved), nm.pat(out), nm.ident(whole));
        let k = nm.ident(kept);
        let gather = sequence_gather(rt, &hr, span);
        let keep = keep_sequence_shard(rt, &map, &k, &s);
        quote! {
            #doc
            let #w = #gather;
            let (#o, #k) = #call(&#this_field, cx, #site, &#w)?;
            #kdoc
            #keep
        }
    });
}

/// The tied output layer's backward: f's backward, the all-reduce of the input gradient (with
/// sequence parallelism its reduce-scatter).
pub(in crate::generate) fn logits_backward<'a>(
    call: &Call<'a>,
    b: &mut Body<'a>,
    io: &Backward<'_>,
) {
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
    let d_h = d_args[0].expect("logits inputs are tensors");
    let call = cx.qualified(n, quote!(VocabParallel::logits_backward_input));
    let doc = comment(&format!(
        "`{name}.logits`: f's backward, all-reduce of the input gradient over tp; with \
         sequence parallelism its reduce-scatter to the sequence shards."
    ));
    let partial = b
        .locals
        .temp(&format!("d_{name}_logits_partial"), pos, span);
    let whole = b.locals.temp(&format!("{name}_logits_whole"), pos, span);
    let weights = b
        .locals
        .temp(&format!("{name}_logits_weight_grad"), pos, span);
    let map = cx.qualified(n, quote!(VocabParallel::map_kept_logits_input));
    let wdoc = comment(&format!(
        "`{name}.logits`: with sequence parallelism the all-gather of the kept input's sequence \
         shards over tp (the weight's gradient reads the whole sequence)."
    ));
    b.push(move |nm| {
        let (s, dy, dh, p) = (
            nm.ident(saved),
            nm.by_ref(d_y),
            nm.pat(d_h),
            nm.ident(partial),
        );
        let w = nm.ident(whole);
        let wg = nm.ident(weights);
        let w_pass = super::weight_pass(&format!("`{name}.logits`"), &wg);
        let sum = sequence_sum(rt, &p, span);
        let regather = regather_sequence(rt, &map, &s, &w, span);
        quote! {
            #wdoc
            #regather
            let (#p, #wg) = #call(&#this_field, cx, #site, #w, #dy)?;
            #doc
            let #dh = #sum;
            #w_pass
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
