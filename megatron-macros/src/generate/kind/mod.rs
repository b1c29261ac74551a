//! The expansion by field kind: one file per kind of field, as serde_derive keeps one file per
//! shape of input. Each holds everything the expansion does with a field of its kind: how it is
//! built, how its parameters are visited, and what a call of it becomes in the generated forward
//! and backward, collectives included. A new parallel kind is one new file here, one variant of
//! [`FieldKind`], and its line in [`of`].

mod column;
mod expert;
mod local;
pub(crate) mod op;
mod partial;
mod replicated;
mod row;
pub(super) mod stack;
pub(super) mod vocab;

use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;

use super::body::{Body, Ctx};
use super::names::{LocalId, Names};
use crate::model::NodeId;
use crate::parse::{Field, FieldKind};
use crate::validate::{Checker, FieldCall};

/// What the expansion generates for one kind of field.
pub(crate) trait Kind {
    /// The `Result` of building field `f` in the builder's scope of its name (`indices`: a
    /// stack's modules this instance builds); `None` for a field without parameters, which is
    /// cloned from the spec.
    fn build(&self, rt: &TokenStream, f: &Field, indices: TokenStream) -> Option<TokenStream>;

    /// The calls of `f` (`visit_params`, or `visit_params_mut` when `mutable`) on the field's
    /// parameters, in the order of the flat buffers.
    fn visit(&self, rt: &TokenStream, f: &Field, mutable: bool) -> TokenStream {
        let (name, ty) = (&f.ident, &f.ty);
        let (method, borrow) = visit_method(mutable);
        quote!(<#ty as #rt::module::Module>::#method(#borrow self.#name, f);)
    }

    /// The call of `f` on the parameters the field's stacks hold (`visit_stacked_params`: the
    /// units of gathering of sharded parameters); nothing for a layer, which holds none.
    fn visit_stacked(&self, _rt: &TokenStream, _f: &Field) -> TokenStream {
        quote!()
    }

    /// Checks `call` (its arguments' sharding against the kind's rule) and sets the sharding of
    /// its output, or reports why the field cannot be called that way.
    fn check_call(&self, c: &mut Checker<'_>, call: &FieldCall<'_>);

    /// Whether the field holds parameters (built by the builder, visited); `false` for values
    /// cloned from the spec.
    fn has_params(&self) -> bool {
        true
    }

    /// The type of the field's entry in the module's spec.
    fn spec_type(&self, rt: &TokenStream, f: &Field) -> TokenStream {
        let ty = &f.ty;
        quote_spanned!(ty.span()=> <#ty as #rt::module::Module>::Spec)
    }

    /// The type of what a call of the field keeps for its backward.
    fn saved_type(&self, rt: &TokenStream, f: &Field) -> TokenStream {
        let ty = &f.ty;
        quote!(<#ty as #rt::module::Module>::Saved)
    }

    /// Whether a graph may capture the field (an expression, `None`: nothing to say, a layer).
    fn capturable(&self, _rt: &TokenStream, _f: &Field) -> Option<TokenStream> {
        None
    }

    /// Compile-time assertions the field's type must meet (after the struct), if any.
    fn checks(&self, _rt: &TokenStream, _f: &Field) -> Option<TokenStream> {
        None
    }

    /// Whether a call of the field on one input adds that input's other gradients itself
    /// (`backward_plus`: a layer norm in its input-gradient kernel) instead of a separate sum.
    fn adds_other_gradients(&self) -> bool {
        false
    }

    /// Whether the backward of a call of the field reads its output's gradient only as a
    /// product's operand (an expression), when that output has one use; `None`: it does not.
    fn gradient_feeds_products(&self, rt: &TokenStream, f: &Field) -> Option<TokenStream> {
        let _ = (rt, f);
        None
    }

    /// What the generated forward (`backward == false`) or backward imports for a call of the
    /// field, `ids` when its one argument is token ids.
    fn imports(&self, backward: bool, ids: bool) -> Imports {
        let _ = (backward, ids);
        Imports::default()
    }

    /// The forward statements of `call` on `io.args`: defines `io.out` and what backward needs
    /// in `io.saved`.
    fn forward<'a>(&self, _call: &Call<'a>, _b: &mut Body<'a>, _io: &Forward<'_>) {
        unreachable!("validated: this kind of field is not called")
    }

    /// The backward statements of `call` from the gradient `io.d_y` of its output: defines the
    /// gradients `io.d_args` of its tensor arguments (`io.plus`: another gradient of a layer's
    /// single input, which the layer adds).
    fn backward<'a>(&self, _call: &Call<'a>, _b: &mut Body<'a>, _io: &Backward<'_>) {
        unreachable!("validated: this kind of field is not called")
    }
}

/// A call of a field (or of its tied logits, or a loop over a stack) in the generated forward or
/// backward: what every kind's code reads of it.
#[derive(Clone)]
pub(crate) struct Call<'a> {
    /// The generator's context.
    pub(crate) cx: &'a Ctx<'a>,
    /// The call's node.
    pub(crate) n: NodeId,
    /// The runtime's path.
    pub(crate) rt: &'a TokenStream,
    /// `site.child("name")`: the call's site.
    pub(crate) site: TokenStream,
    /// The span of the call in the user's forward.
    pub(crate) span: Span,
    /// `self.field`, with the user's `self`.
    pub(crate) this_field: TokenStream,
    /// The field's name.
    pub(crate) name: String,
}

impl<'a> Call<'a> {
    /// Call `n` in `cx`'s graph.
    pub(crate) fn new(cx: &'a Ctx<'a>, n: NodeId) -> Call<'a> {
        Call {
            cx,
            n,
            rt: &cx.root.runtime,
            site: cx.site(n),
            span: cx.g.nodes[n].src.span(),
            this_field: cx.this_field(n),
            name: cx.field(n).name(),
        }
    }
}

/// The forward's locals of a call: its arguments, its output, what it saves, its position.
#[derive(Clone, Copy)]
pub(crate) struct Forward<'l> {
    pub(crate) args: &'l [LocalId],
    pub(crate) out: LocalId,
    pub(crate) saved: LocalId,
    pub(crate) pos: usize,
}

/// The backward's locals of a call: its output's gradient, what forward saved, its arguments'
/// gradients, another gradient of its single input (see [`Kind::adds_other_gradients`]), its
/// position.
#[derive(Clone, Copy)]
pub(crate) struct Backward<'l> {
    pub(crate) d_y: LocalId,
    /// For a call returning several outputs (a module of the user's), each one's gradient
    /// (`d_y` is the first); empty otherwise.
    pub(crate) d_ys: &'l [LocalId],
    pub(crate) saved: LocalId,
    pub(crate) d_args: &'l [Option<LocalId>],
    pub(crate) plus: Option<LocalId>,
    pub(crate) pos: usize,
}

/// What a generated function imports for its calls of a field.
#[derive(Default)]
pub(crate) struct Imports {
    /// The trait its calls name, and the runtime's module holding it (`("module",
    /// "ColumnParallel")`, `("moe", "ExpertParallel")`, ...).
    pub named: Option<(&'static str, &'static str)>,
    /// `comm::ReduceOp`, for an all-reduce it makes.
    pub reduce: bool,
    /// `module::Layer`, for a layer or sub-module called by method syntax.
    pub layer: bool,
    /// `module::Lookup`, for a lookup called by method syntax.
    pub lookup: bool,
}

/// The parameterless ops' kinds (`#[op]`, `#[context_parallel]`), whose calls may take several
/// inputs; `None` for the others.
pub(crate) fn op_kind(kind: &FieldKind) -> Option<&'static op::Op> {
    match kind {
        FieldKind::Op => Some(&op::OP),
        FieldKind::ContextParallel => Some(&op::CONTEXT_PARALLEL),
        _ => None,
    }
}

/// The implementation of a field kind.
pub(crate) fn of(kind: &FieldKind) -> &'static dyn Kind {
    match kind {
        FieldKind::Column { .. } => &column::Column,
        FieldKind::Row { .. } => &row::Row,
        FieldKind::Vocab => &vocab::Vocab,
        FieldKind::Expert => &expert::Expert,
        FieldKind::Replicated => &replicated::Replicated,
        FieldKind::Local => &local::Local,
        FieldKind::PartialOutput => &partial::Partial,
        FieldKind::Stack { .. } => &stack::Stack,
        FieldKind::Op => &op::OP,
        FieldKind::ContextParallel => &op::CONTEXT_PARALLEL,
        FieldKind::Config => &op::Config,
    }
}

/// `b.scoped("name", |b| <Type as runtime::room::Trait>::constructor(&spec.name, b))`: building
/// a field in its name's scope with the constructor of `room::trait_`, the path spanned at the
/// field's type (a type that lacks the trait is reported there, with the trait's message).
fn built_by(
    rt: &TokenStream,
    f: &Field,
    room: &str,
    trait_: &str,
    constructor: &str,
) -> TokenStream {
    let (name, scope, ty) = (&f.ident, f.name(), &f.ty);
    let [room, trait_, constructor] =
        [room, trait_, constructor].map(|word| syn::Ident::new(word, ty.span()));
    let path = quote_spanned!(ty.span()=> <#ty as #rt::#room::#trait_>::#constructor);
    quote!(b.scoped(#scope, |b| #path(&spec.#name, b)))
}

/// `Module::GRADIENT_FEEDS_PRODUCTS` of the field's type: what a layer says of its backward.
fn module_gradient_feeds_products(rt: &TokenStream, f: &Field) -> TokenStream {
    let ty = &f.ty;
    quote!(<#ty as #rt::module::Module>::GRADIENT_FEEDS_PRODUCTS)
}

/// A sub-module's `visit_stacked_params` (its stacks' parameters, numbered on).
fn visit_stacked_of(rt: &TokenStream, f: &Field) -> TokenStream {
    let (name, ty) = (&f.ident, &f.ty);
    quote!(<#ty as #rt::module::Module>::visit_stacked_params(&self.#name, units, f);)
}

/// `visit_params` and `&`, or `visit_params_mut` and `&mut`.
fn visit_method(mutable: bool) -> (TokenStream, TokenStream) {
    if mutable {
        (quote!(visit_params_mut), quote!(&mut))
    } else {
        (quote!(visit_params), quote!(&))
    }
}

/// The runtime's `GraphScope` for a field's `#[graph_scope(..)]` (the router's for an expert
/// layer, whose preprocessing is captured with it), spanned at the name; `None` without one.
pub(super) fn graph_scope(rt: &TokenStream, field: &Field) -> Option<TokenStream> {
    let first = field.graph_scopes.first()?;
    let scope = if matches!(field.kind, FieldKind::Expert) {
        field
            .graph_scopes
            .iter()
            .find(|s| s.name == "moe_router")
            .unwrap_or(first)
    } else {
        first
    };
    let variant = proc_macro2::Ident::new(scope.variant(), scope.span);
    Some(quote!(#rt::cuda_graphs::GraphScope::#variant))
}

/// `cx.tp().all_reduce(&x, ReduceOp::Sum)?;`, the method named at `span` (the user's call in
/// forward): the communicator's `#[track_caller]` location, which a recording world logs
/// (docs/collectives.md), is then the forward's line that makes the call.
pub(super) fn tp_sum(x: &impl quote::ToTokens, span: Span) -> TokenStream {
    let call = quote::quote_spanned!(span=> .all_reduce(&#x, ReduceOp::Sum));
    quote!(cx.tp()#call?;)
}

/// With sequence parallelism the whole sequence gathered from the ranks' shards, else `x` itself:
/// `if cx.sequence_parallel() { all_gather_sequence(cx, x)? } else { x.clone() }`, the gather
/// called at `span` (its `#[track_caller]` location is the forward's line, as [`tp_sum`]'s).
/// `x` is a `&Tensor` expression.
pub(super) fn sequence_gather(rt: &TokenStream, x: &TokenStream, span: Span) -> TokenStream {
    // `cx` interpolated keeps the generated code's hygiene; the call itself is at `span`.
    let cx = quote!(cx);
    let gather = quote::quote_spanned!(span=> #rt::tensor_parallel::all_gather_sequence(#cx, #x));
    quote! {
        if cx.sequence_parallel() {
            #gather?
        } else {
            ::std::clone::Clone::clone(#x)
        }
    }
}

/// `|x| all_gather_sequence(cx, x)`, the gather called at `span`: a closure for
/// `ColumnParallel::map_kept_input`.
pub(super) fn sequence_gather_fn(rt: &TokenStream, span: Span) -> TokenStream {
    let (cx, x) = (quote!(cx), quote!(x));
    let gather = quote::quote_spanned!(span=> #rt::tensor_parallel::all_gather_sequence(#cx, #x));
    quote!(|#x| #gather)
}

/// The sum over tp of the partial values `partial`: with sequence parallelism a reduce-scatter
/// that leaves this rank its shard of the sequence, else the all-reduce ([`tp_sum`]) in place;
/// an expression of the result, the collectives called at `span`.
pub(super) fn sequence_sum(
    rt: &TokenStream,
    partial: &impl quote::ToTokens,
    span: Span,
) -> TokenStream {
    let cx = quote!(cx);
    let scatter = quote::quote_spanned!(span=>
        #rt::tensor_parallel::reduce_scatter_sequence(#cx, &#partial)
    );
    let reduce = tp_sum(partial, span);
    quote! {
        if cx.sequence_parallel() {
            #scatter?
        } else {
            #reduce
            #partial
        }
    }
}

/// A statement that refuses sequence parallelism for `what` (a field option Megatron-LM also
/// refuses with it), naming it.
pub(super) fn refuse_sequence_parallel(rt: &TokenStream, what: &str) -> TokenStream {
    quote! {
        if cx.sequence_parallel() {
            return ::std::result::Result::Err(#rt::Error::Invalid(
                ::std::string::String::from(#what),
            ));
        }
    }
}

/// `let out = ..;` what a layer that read the gathered sequence keeps: with sequence parallelism
/// its kept input replaced by this rank's shard through `map` (`map_kept_input`, or the tied
/// output layer's), else `kept` as it is.
pub(super) fn keep_sequence_shard(
    rt: &TokenStream,
    map: &TokenStream,
    kept: &impl quote::ToTokens,
    out: &impl quote::ToTokens,
) -> TokenStream {
    quote! {
        let #out = if cx.sequence_parallel() {
            #map(#kept, &|x| #rt::tensor_parallel::keep_sequence_shard(cx, x))?
        } else {
            #kept
        };
    }
}

/// `let whole = ..;` before such a layer's backward: with sequence parallelism `saved` with its
/// kept shard gathered again (the all-gather called at `span`), else `saved` as it is.
pub(super) fn regather_sequence(
    rt: &TokenStream,
    map: &TokenStream,
    saved: &impl quote::ToTokens,
    whole: &impl quote::ToTokens,
    span: Span,
) -> TokenStream {
    let gather = sequence_gather_fn(rt, span);
    quote! {
        let #whole = if cx.sequence_parallel() {
            #map(#saved, &#gather)?
        } else {
            #saved
        };
    }
}

/// The weight-gradient half of a linear layer's split backward (`W`, after its input gradient
/// `B`), `what` naming the layer in its comment: `weights`, what the layer's `*_input` backward
/// handed back, run at once or put off to a zero-bubble schedule's weight-gradient pass by the
/// context. No collective: local products.
pub(super) fn weight_pass(what: &str, weights: &impl quote::ToTokens) -> TokenStream {
    let doc = crate::generate::comment(&format!(
        "{what}: W, the weight gradients (local products, no collective): now, or in a \
         zero-bubble schedule's weight-gradient pass."
    ));
    quote! {
        #doc
        cx.weight_gradient(#weights)?;
    }
}

/// A backward `call`'s input gradients bound to their locals (`_` for ids; `doc` before the one
/// of a single input), or the bare `call;` when no input is a tensor.
pub(in crate::generate) fn bind_gradients(
    nm: &Names,
    d_args: &[Option<LocalId>],
    call: TokenStream,
    doc: TokenStream,
) -> TokenStream {
    let pats: Vec<TokenStream> = d_args
        .iter()
        .map(|d| match d {
            Some(l) => nm.pat(*l),
            None => quote!(_),
        })
        .collect();
    if d_args.iter().all(Option::is_none) {
        quote!(#call;)
    } else if let [one] = pats.as_slice() {
        quote!(#doc let #one = #call;)
    } else {
        quote!(let (#(#pats),*) = #call;)
    }
}
