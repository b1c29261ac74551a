//! The generated `forward` and `backward`.
//!
//! Both are built as a list of statement groups over symbolic locals (see [`names`]); once every
//! local's definition and last use are known they get their names, and the groups are rendered.
//! The backward walks the forward's nodes in reverse; a value used k times receives k gradient
//! contributions, summed out of place in reverse order of use.

use proc_macro2::{Span, TokenStream};
use quote::quote;
use syn::spanned::Spanned;

use super::names::{LocalId, Locals, Names};
use super::{comment, gradient_type, saved_name};
use crate::model::{Def, Graph, NodeId, NodeOp};
use crate::parse::{Builtin, Field, FieldKind, InputType, ModuleImpl, ModuleStruct};
use crate::root::Root;
use crate::validate::{Analysis, Sharding};

type Render<'a> = Box<dyn Fn(&Names) -> TokenStream + 'a>;

/// The statements of one generated function.
#[derive(Default)]
struct Body<'a> {
    locals: Locals,
    stmts: Vec<Render<'a>>,
    /// (before, after) pairs of a loop-carried variable: one `let mut` variable when both get
    /// the same name.
    carried: Vec<(LocalId, LocalId)>,
}

impl<'a> Body<'a> {
    /// The position of the next statement group (parameters are at 0).
    fn pos(&self) -> usize {
        self.stmts.len() + 1
    }

    fn push(&mut self, render: impl Fn(&Names) -> TokenStream + 'a) {
        self.stmts.push(Box::new(render));
    }

    /// Names the locals and renders the statements.
    fn finish(self) -> (Names, TokenStream) {
        let mut names = self.locals.assign();
        for &(before, after) in &self.carried {
            if carried_in_place(&names, before, after) {
                names.set_mut(before);
            }
        }
        let stmts: Vec<_> = self.stmts.iter().map(|r| r(&names)).collect();
        (names, quote!(#(#stmts)*))
    }
}

/// Whether a loop updates its carried variable in place (`before` becomes `let mut` and
/// `after` is the same variable).
fn carried_in_place(names: &Names, before: LocalId, after: LocalId) -> bool {
    names.name(before) == names.name(after) && !names.is_ref(before)
}

/// What the generator reads.
struct Ctx<'a> {
    root: &'a Root,
    s: &'a ModuleStruct,
    imp: &'a ModuleImpl,
    g: &'a Graph,
    a: &'a Analysis,
}

impl<'a> Ctx<'a> {
    fn field(&self, n: NodeId) -> &'a Field {
        &self.s.fields[self.a.field[n].expect("validated nodes know their field")]
    }

    /// `self.field` with the user's `self`.
    fn this_field(&self, n: NodeId) -> TokenStream {
        let this = &self.imp.forward.self_token;
        let f = &self.field(n).ident;
        quote!(#this.#f)
    }

    /// `site.child("name")` of node `n` (nothing for `+`, which has no site).
    fn site(&self, n: NodeId) -> TokenStream {
        match self.g.nodes[n].site.as_deref() {
            Some(name) => quote!(site.child(#name)),
            None => TokenStream::new(),
        }
    }

    /// `<Type as Trait>::method` for node `n`'s field: a type that lacks the trait is reported
    /// at the field's type, with the trait's message (and once: the struct's `build` names the
    /// same path there).
    fn qualified(&self, n: NodeId, trait_and_method: TokenStream) -> TokenStream {
        let ty = &self.field(n).ty;
        let tokens: Vec<_> = trait_and_method.into_iter().collect();
        let (tr, method) = match tokens.as_slice() {
            [tr, .., method] => (tr, method),
            _ => unreachable!("`Trait::method`"),
        };
        let open = self.spanned(n, quote!(<));
        let rest = self.spanned(n, quote!(as #tr>::#method));
        quote!(#open #ty #rest)
    }

    /// Tokens whose failures should point at node `n`'s field type.
    fn spanned(&self, n: NodeId, tokens: TokenStream) -> TokenStream {
        let sp = self.field(n).ty.span().resolved_at(Span::call_site());
        tokens
            .into_iter()
            .map(|mut t| {
                t.set_span(sp);
                t
            })
            .collect()
    }

    fn kinds(&self) -> impl Iterator<Item = (NodeId, &'a NodeOp, Option<&'a FieldKind>)> + '_ {
        self.g.nodes.iter().enumerate().map(|(n, node)| {
            let kind = self.a.field[n].map(|i| &self.s.fields[i].kind);
            (n, &node.op, kind)
        })
    }

    /// The `use` lines at the top of forward (`backward == false`) or backward.
    fn imports(&self, backward: bool) -> TokenStream {
        let rt = &self.root.runtime;
        let (mut column, mut row, mut vocab, mut op, mut layer, mut lookup) =
            (false, false, false, false, false, false);
        let (mut reduce, mut sharding) = (false, false);
        for (n, o, kind) in self.kinds() {
            match (o, kind) {
                (NodeOp::Field { .. }, Some(FieldKind::Column { .. })) => {
                    column = true;
                    reduce |= backward;
                }
                (NodeOp::Field { .. }, Some(FieldKind::Row { .. })) => {
                    row = true;
                    reduce |= !backward;
                }
                (NodeOp::Field { .. }, Some(FieldKind::Vocab)) => {
                    vocab = true;
                    reduce |= !backward;
                }
                (NodeOp::Logits { .. }, _) => {
                    vocab = true;
                    reduce |= backward;
                }
                (NodeOp::Field { .. }, Some(FieldKind::Op)) => op = true,
                (NodeOp::Field { .. }, Some(FieldKind::Replicated)) => {
                    let args = &self.g.nodes[n].args;
                    if args.len() == 1 && self.a.sharding[args[0]] == Sharding::Ids {
                        lookup = true;
                    } else {
                        layer = true;
                    }
                }
                (NodeOp::Loop { .. }, _) => layer = true,
                (
                    NodeOp::Builtin {
                        builtin: Builtin::Dropout,
                        ..
                    }
                    | NodeOp::DropoutAdd { .. },
                    _,
                ) => sharding |= !backward,
                _ => {}
            }
        }
        let mut named = Vec::new();
        for (present, name) in [
            (column, quote!(ColumnParallel)),
            (row, quote!(RowParallel)),
            (vocab, quote!(VocabParallel)),
            (op, quote!(Op)),
            (sharding, quote!(Sharding)),
        ] {
            if present {
                named.push(name);
            }
        }
        let mut anonymous = Vec::new();
        if layer {
            anonymous.push(quote!(Layer as _));
        }
        if lookup {
            anonymous.push(quote!(Lookup as _));
        }
        let named = (!named.is_empty()).then(|| quote!(use #rt::module::{#(#named),*};));
        let anonymous = (!anonymous.is_empty()).then(|| {
            let doc = comment(
                "Layers and sub-modules without a split attribute are called by method syntax.",
            );
            quote! {
                #doc
                #[allow(unused_imports)]
                use #rt::module::{#(#anonymous),*};
            }
        });
        let reduce = reduce.then(|| quote!(use #rt::comm::ReduceOp;));
        quote!(#named #anonymous #reduce)
    }
}

/// The generated forward, and the names its values got (the backward names gradients after
/// them).
pub struct GeneratedForward {
    /// The `pub fn forward`.
    pub tokens: TokenStream,
    /// Per value, the name of its local in forward.
    pub value_names: Vec<String>,
}

/// The base name of a value's local: the user's name, or `{site}_out`.
fn value_base(g: &Graph, v: usize) -> String {
    let value = &g.values[v];
    if let Some(name) = &value.name {
        return name.clone();
    }
    match value.def {
        Def::Node(n) => match (&g.nodes[n].op, &g.nodes[n].site) {
            (NodeOp::Add | NodeOp::DropoutAdd { .. }, _) | (_, None) => "add_out".into(),
            (_, Some(site)) => format!("{site}_out"),
        },
        Def::Input { .. } => "input".into(),
    }
}

/// Generates `pub fn forward`.
pub fn forward(
    root: &Root,
    s: &ModuleStruct,
    imp: &ModuleImpl,
    g: &Graph,
    a: &Analysis,
) -> GeneratedForward {
    let cx = Ctx { root, s, imp, g, a };
    let cx = &cx;
    let rt = &root.runtime;
    let mut b = Body::default();
    b.locals.fixed("cx", true);
    b.locals.fixed("site", true);
    let mut value_local: Vec<Option<LocalId>> = vec![None; g.values.len()];
    let mut params = Vec::new();
    for (i, &v) in g.inputs.iter().enumerate() {
        let input = &imp.forward.inputs[i];
        let mut base = value_base(g, v);
        if g.values[v].uses.is_empty() {
            base = format!("_{base}");
        }
        let l = b.locals.param(&base, input.ident.span());
        value_local[v] = Some(l);
        params.push((l, input.ty));
    }
    let mut saved_locals = Vec::new();
    for n in 0..g.nodes.len() {
        let pos = b.pos();
        let node = &g.nodes[n];
        let args: Vec<LocalId> = node
            .args
            .iter()
            .map(|&v| value_local[v].expect("arguments are defined before use"))
            .collect();
        for &l in &args {
            b.locals.use_at(l, pos);
        }
        let span = node.src.span();
        let out = b.locals.owned(&value_base(g, node.output), pos, span);
        value_local[node.output] = Some(out);
        let saved = match (&node.op, &node.site) {
            (NodeOp::Add, _) | (_, None) => None,
            (_, Some(site)) => Some(b.locals.owned(site, pos, span)),
        };
        if let Some(sv) = saved {
            saved_locals.push((n, sv));
        }
        forward_node(cx, &mut b, n, &args, out, saved, pos);
    }
    let pos = b.pos();
    let out = value_local[g.output].expect("the output is defined");
    b.locals.use_at(out, pos);
    for &(_, sv) in &saved_locals {
        b.locals.use_at(sv, pos);
    }
    let saved_ty = saved_name(&s.ident);
    {
        let saved_locals = saved_locals.clone();
        let saved_ty = saved_ty.clone();
        b.push(move |nm| {
            let out = nm.owned(out, true);
            let fields = saved_locals.iter().map(|&(n, sv)| {
                let field = super::names::ident(
                    g.nodes[n].site.as_deref().expect("site"),
                    Span::call_site(),
                );
                let local = nm.ident(sv);
                if field == local {
                    quote!(#field)
                } else {
                    quote!(#field: #local)
                }
            });
            quote!(Ok((#out, #saved_ty { #(#fields),* })))
        });
    }
    let (names, stmts) = b.finish();
    let value_names = value_local
        .iter()
        .map(|l| l.map_or_else(String::new, |l| names.name(l).to_string()))
        .collect();
    let params = params.iter().map(|&(l, ty)| {
        let i = names.ident(l);
        match ty {
            InputType::Tensor => quote!(#i: &#rt::tensor::Tensor),
            InputType::Ids => quote!(#i: &#rt::module::Ids),
        }
    });
    let this = &imp.forward.self_token;
    let ident = &s.ident;
    let user_docs: Vec<_> = imp.forward.attrs.iter().collect();
    let docs = if user_docs.is_empty() {
        comment(&format!(
            "Runs [`{ident}`] on this rank's part: returns the output and what \
             [`{ident}::backward`] needs (generated by `#[megatron::module]` from the forward \
             written in the impl)."
        ))
    } else {
        quote!(#(#user_docs)*)
    };
    let imports = cx.imports(false);
    let lint = (imp.forward.inputs.len() > 5).then(|| quote!(#[allow(clippy::too_many_arguments)]));
    let tokens = quote! {
        #docs
        #lint

        pub fn forward(&#this, cx: &#rt::module::Cx<'_>, site: #rt::module::Site, #(#params),*)
            -> #rt::Result<(#rt::tensor::Tensor, #saved_ty)>
        {
            #imports
            #stmts
        }
    };
    GeneratedForward {
        tokens,
        value_names,
    }
}

/// The statements of one node in forward.
fn forward_node<'a>(
    cx: &'a Ctx<'a>,
    b: &mut Body<'a>,
    n: NodeId,
    args: &[LocalId],
    out: LocalId,
    saved: Option<LocalId>,
    pos: usize,
) {
    let rt = &cx.root.runtime;
    let node = &cx.g.nodes[n];
    let site = cx.site(n);
    match &node.op {
        NodeOp::Field { .. } => {
            let field = cx.field(n);
            let this_field = cx.this_field(n);
            let name = field.name();
            let saved = saved.expect("calls save");
            match &field.kind {
                FieldKind::Column { gather_output } => {
                    let x = args[0];
                    let call = cx.qualified(n, quote!(ColumnParallel::forward_column));
                    let doc = comment(&format!(
                        "`{name}`: #[column_parallel]. f: identity in forward (its backward \
                         all-reduces the input gradient over tp)."
                    ));
                    if *gather_output {
                        let local = b
                            .locals
                            .temp(&format!("{name}_local"), pos, node.src.span());
                        let gdoc = comment(&format!(
                            "`{name}`: gather_output. All-gather of the output features over tp."
                        ));
                        b.push(move |nm| {
                            let (xr, l, s, o) =
                                (nm.by_ref(x), nm.ident(local), nm.pat(saved), nm.pat(out));
                            quote! {
                                #doc
                                let (#l, #s) = #call(&#this_field, cx, #site, #xr)?;
                                #gdoc
                                let #o = #rt::tensor_parallel::gather_last_dim(cx, &#l)?;
                            }
                        });
                    } else {
                        b.push(move |nm| {
                            let (xr, s, o) = (nm.by_ref(x), nm.pat(saved), nm.pat(out));
                            quote! {
                                #doc
                                let (#o, #s) = #call(&#this_field, cx, #site, #xr)?;
                            }
                        });
                    }
                }
                FieldKind::Row { input_is_parallel } => {
                    let x = args[0];
                    let call = cx.qualified(n, quote!(RowParallel::forward_row));
                    let add_bias = cx.qualified(n, quote!(RowParallel::add_bias));
                    let doc = comment(&format!(
                        "`{name}`: #[row_parallel]. g: all-reduce of the partial outputs over tp."
                    ));
                    let split = (!input_is_parallel).then(|| {
                        let base = format!("{}_local", value_base(cx.g, node.args[0]));
                        b.locals.temp(&base, pos, node.src.span())
                    });
                    let sdoc = comment(&format!(
                        "`{name}`: input_is_parallel = false. This rank's slice of the input \
                         features (scatter)."
                    ));
                    b.push(move |nm| {
                        let (s, o) = (nm.pat(saved), nm.pat(out));
                        let oi = nm.ident(out);
                        let (scatter, xr) = match split {
                            Some(l) => {
                                let li = nm.ident(l);
                                let xr = nm.by_ref(x);
                                (
                                    quote! {
                                        #sdoc
                                        let #li = #rt::tensor_parallel::split_last_dim(cx, #xr)?;
                                    },
                                    quote!(&#li),
                                )
                            }
                            None => (quote!(), nm.by_ref(x)),
                        };
                        quote! {
                            #scatter
                            let (#o, #s) = #call(&#this_field, cx, #site, #xr)?;
                            #doc
                            cx.tp().all_reduce(&#oi, ReduceOp::Sum)?;
                            #add_bias(&#this_field, cx, &#oi)?;
                        }
                    });
                }
                FieldKind::Vocab => {
                    let ids = args[0];
                    let call = cx.qualified(n, quote!(VocabParallel::forward_vocab));
                    let doc = comment(&format!(
                        "`{name}`: #[vocab_parallel]. All-reduce of the partial lookups over tp \
                         (each rank holds its rows of the vocabulary)."
                    ));
                    b.push(move |nm| {
                        let (ir, s, o, oi) =
                            (nm.by_ref(ids), nm.pat(saved), nm.pat(out), nm.ident(out));
                        quote! {
                            let (#o, #s) = #call(&#this_field, cx, #site, #ir)?;
                            #doc
                            cx.tp().all_reduce(&#oi, ReduceOp::Sum)?;
                        }
                    });
                }
                FieldKind::Replicated => {
                    let args = args.to_vec();
                    let this = &cx.imp.forward.self_token;
                    let f = &field.ident;
                    let method = cx.spanned(n, quote!(forward));
                    b.push(move |nm| {
                        let refs = args.iter().map(|&l| nm.by_ref(l));
                        let (s, o) = (nm.pat(saved), nm.pat(out));
                        quote! {
                            let (#o, #s) = #this.#f.#method(cx, #site, #(#refs),*)?;
                        }
                    });
                }
                FieldKind::Op => {
                    let x = args[0];
                    let call = cx.qualified(n, quote!(Op::forward));
                    b.push(move |nm| {
                        let (xr, s, o) = (nm.by_ref(x), nm.pat(saved), nm.pat(out));
                        quote! {
                            let (#o, #s) = #call(&#this_field, cx, #site, #xr)?;
                        }
                    });
                }
                FieldKind::Stack { .. } | FieldKind::Config => unreachable!("validated"),
            }
        }
        NodeOp::Logits { .. } => {
            let h = args[0];
            let this_field = cx.this_field(n);
            let name = cx.field(n).name();
            let call = cx.qualified(n, quote!(VocabParallel::logits_forward));
            let saved = saved.expect("logits save");
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
        NodeOp::Builtin { builtin, p } => {
            let saved = saved.expect("builtins save");
            match builtin {
                Builtin::Gelu => {
                    let x = args[0];
                    b.push(move |nm| {
                        let (xr, s, o) = (nm.by_ref(x), nm.pat(saved), nm.pat(out));
                        quote!(let (#o, #s) = #rt::ops::gelu(cx, #site, #xr)?;)
                    });
                }
                Builtin::Dropout => {
                    let x = args[0];
                    let p = p.clone().expect("dropout has a probability");
                    let sharding = dropout_sharding(cx, node.args[0]);
                    b.push(move |nm| {
                        let (xr, s, o) = (nm.by_ref(x), nm.pat(saved), nm.pat(out));
                        quote!(let (#o, #s) = #rt::ops::dropout(cx, #site, #xr, #p, #sharding)?;)
                    });
                }
                Builtin::CrossEntropy => {
                    let (logits, targets) = (args[0], args[1]);
                    let split = cx.a.sharding[node.args[0]] == Sharding::Split;
                    b.push(move |nm| {
                        let (lr, tr, s, o) = (nm.by_ref(logits), nm.by_ref(targets), nm.pat(saved), nm.pat(out));
                        if split {
                            let doc = comment(
                                "Vocab-parallel cross-entropy: the logits stay split; three \
                                 all-reduces over tp (row maxima, sums of exponentials, target \
                                 logits) happen inside.",
                            );
                            quote! {
                                #doc
                                let (#o, #s) = #rt::tensor_parallel::vocab_parallel_cross_entropy(cx, #site, #lr, #tr)?;
                            }
                        } else {
                            quote!(let (#o, #s) = #rt::ops::cross_entropy(cx, #site, #lr, #tr)?;)
                        }
                    });
                }
            }
        }
        NodeOp::Add => {
            let (x, y) = (args[0], args[1]);
            b.push(move |nm| {
                let (xr, yr, o) = (nm.by_ref(x), nm.by_ref(y), nm.pat(out));
                quote!(let #o = #rt::ops::add(#xr, #yr)?;)
            });
        }
        NodeOp::DropoutAdd { p } => {
            let (residual, x) = (args[0], args[1]);
            let saved = saved.expect("dropout saves");
            let sharding = dropout_sharding(cx, node.args[1]);
            let doc = comment(
                "`+` of a dropout: dropout and the residual connection in one pass (Megatron's \
                 bias-dropout-add fusion).",
            );
            let p = p.clone();
            b.push(move |nm| {
                let (rr, xr) = (nm.by_ref(residual), nm.by_ref(x));
                let (s, o) = (nm.pat(saved), nm.pat(out));
                quote! {
                    #doc
                    let (#o, #s) = #rt::ops::dropout_add(cx, #site, #rr, #xr, #p, #sharding)?;
                }
            });
        }
        NodeOp::Loop { elem, .. } => {
            let before = args[0];
            let saved = saved.expect("loops save");
            let this_field = cx.this_field(n);
            let span = node.src.span();
            let i = b.locals.temp("i", pos, span);
            let element = b.locals.temp(
                &syn::ext::IdentExt::unraw(elem).to_string(),
                pos,
                elem.span(),
            );
            let step = b.locals.temp("out", pos, span);
            let element_saved = b.locals.temp(
                &format!("{}_saved", syn::ext::IdentExt::unraw(elem)),
                pos,
                span,
            );
            b.carried.push((before, out));
            let name = cx.field(n).name();
            let doc = comment(&format!(
                "`{name}`: each module in turn, at site `{name}.i`; their saved values are kept in \
                 order."
            ));
            b.push(move |nm| {
                let (v, s) = (nm.ident(out), nm.ident(saved));
                let (ii, e, st, es) = (
                    nm.ident(i),
                    nm.ident(element),
                    nm.ident(step),
                    nm.ident(element_saved),
                );
                let init = if carried_in_place(nm, before, out) {
                    quote!()
                } else {
                    let value = nm.owned(before, nm.last_use(before) == pos);
                    quote!(let mut #v = #value;)
                };
                quote! {
                    #doc
                    let mut #s = ::std::vec::Vec::with_capacity(#this_field.len());
                    #init
                    for (#ii, #e) in #this_field.iter().enumerate() {
                        let (#st, #es) = #e.forward(cx, #site.index(#ii), &#v)?;
                        #v = #st;
                        #s.push(#es);
                    }
                }
            });
        }
    }
}

/// Generates `pub fn backward`.
pub fn backward(
    root: &Root,
    s: &ModuleStruct,
    imp: &ModuleImpl,
    g: &Graph,
    a: &Analysis,
    fwd: &GeneratedForward,
) -> TokenStream {
    let cx = Ctx { root, s, imp, g, a };
    let cx = &cx;
    let rt = &root.runtime;
    let mut b = Body::default();
    b.locals.fixed("cx", true);
    b.locals.fixed("site", true);
    b.locals.fixed("saved", false);
    let d_out = b.locals.fixed("d_out", true);

    // The destructured saved values.
    let pos = b.pos();
    let mut saved_local: Vec<Option<LocalId>> = vec![None; g.nodes.len()];
    for (n, node) in g.nodes.iter().enumerate() {
        if matches!(node.op, NodeOp::Add) {
            continue;
        }
        if let Some(site) = &node.site {
            saved_local[n] = Some(b.locals.owned(site, pos, node.src.span()));
        }
    }
    let saved_ty = saved_name(&s.ident);
    {
        let saved_local = saved_local.clone();
        let saved_ty = saved_ty.clone();
        b.push(move |nm| {
            let fields = saved_local.iter().enumerate().filter_map(|(n, l)| {
                let l = (*l)?;
                let field = super::names::ident(
                    g.nodes[n].site.as_deref().expect("site"),
                    Span::call_site(),
                );
                let local = nm.ident(l);
                Some(if field == local {
                    quote!(#field)
                } else {
                    quote!(#field: #local)
                })
            });
            quote!(let #saved_ty { #(#fields),* } = saved;)
        });
    }

    // Gradient contributions per value, in arrival (reverse use) order.
    let expected: Vec<usize> = (0..g.values.len())
        .map(|v| {
            if a.sharding[v] == Sharding::Ids {
                0
            } else {
                g.values[v].uses.len()
            }
        })
        .collect();
    let mut contributions: Vec<Vec<LocalId>> = vec![Vec::new(); g.values.len()];
    contributions[g.output].push(d_out);

    let mut grads = Grads {
        g,
        fwd,
        expected,
        contributions: &mut contributions,
    };
    for n in (0..g.nodes.len()).rev() {
        let node = &g.nodes[n];
        let d_y = grads.total(&mut b, node.output, rt);
        let pos = b.pos();
        b.locals.use_at(d_y, pos);
        let saved = saved_local[n];
        if let Some(sv) = saved {
            b.locals.use_at(sv, pos);
        }
        let span = node.src.span();
        // A layer's input used several times, whose other gradients have all arrived: the layer
        // adds their sum (`backward_plus`), and its result is the input's whole gradient.
        let plus = match (&node.op, cx.a.field[n].map(|i| &cx.s.fields[i].kind)) {
            (NodeOp::Field { .. }, Some(FieldKind::Replicated)) if node.args.len() == 1 => {
                grads.pending_others(&mut b, node.args[0], rt)
            }
            _ => None,
        };
        let d_args: Vec<Option<LocalId>> = match plus {
            Some(p) => {
                b.locals.use_at(p, pos);
                vec![Some(grads.total_with(&mut b, node.args[0], pos, span))]
            }
            None => node
                .args
                .iter()
                .map(|&v| grads.contribution(&mut b, v, pos, span))
                .collect(),
        };
        backward_node(cx, &mut b, n, d_y, saved, &d_args, plus, pos);
    }
    // The input gradients.
    let mut results = Vec::new();
    for &v in &g.inputs {
        let Def::Input { ty, .. } = g.values[v].def else {
            unreachable!("inputs")
        };
        results.push(match ty {
            InputType::Tensor => Some(grads.total(&mut b, v, rt)),
            InputType::Ids => None,
        });
    }
    let pos = b.pos();
    for l in results.iter().flatten() {
        b.locals.use_at(*l, pos);
    }
    b.push(move |nm| {
        let elems: Vec<_> = results
            .iter()
            .map(|r| match r {
                Some(l) => nm.owned(*l, true),
                None => quote!(()),
            })
            .collect();
        match elems.as_slice() {
            [one] => quote!(Ok(#one)),
            _ => quote!(Ok((#(#elems),*))),
        }
    });
    let (_, stmts) = b.finish();

    let this = &imp.forward.self_token;
    let ident = &s.ident;
    let inputs: Vec<InputType> = imp.forward.inputs.iter().map(|i| i.ty).collect();
    let grads_ty = gradient_type(root, &inputs);
    let docs = comment(&format!(
        "The backward of [`{ident}::forward`] (generated by `#[megatron::module]`): consumes \
         what forward saved, accumulates the parameters' gradients and returns the gradient of \
         each input (`()` for ids)."
    ));
    let imports = cx.imports(true);
    quote! {
        #docs

        pub fn backward(&#this, cx: &#rt::module::Cx<'_>, site: #rt::module::Site, saved: #saved_ty, d_out: &#rt::tensor::Tensor)
            -> #rt::Result<#grads_ty>
        {
            #imports
            #stmts
        }
    }
}

/// The gradient bookkeeping of the backward.
struct Grads<'g> {
    g: &'g Graph,
    fwd: &'g GeneratedForward,
    expected: Vec<usize>,
    contributions: &'g mut Vec<Vec<LocalId>>,
}

impl<'g> Grads<'g> {
    /// The sum of the contributions `v` already has when it has several uses and all but one
    /// have contributed (the one left is the caller's), summed as [`Grads::total`] would.
    fn pending_others<'a>(
        &mut self,
        b: &mut Body<'a>,
        v: usize,
        rt: &'a TokenStream,
    ) -> Option<LocalId> {
        let arrived = self.contributions[v].len();
        (self.expected[v] >= 2 && arrived + 1 == self.expected[v]).then(|| self.sum(b, v, rt))
    }

    /// A new local holding `v`'s whole gradient, computed by the node at `pos` from the
    /// contributions [`Grads::pending_others`] summed and its own.
    fn total_with(&mut self, b: &mut Body<'_>, v: usize, pos: usize, span: Span) -> LocalId {
        let name = &self.fwd.value_names[v];
        let l = b.locals.owned(&format!("d_{name}"), pos, span);
        self.contributions[v] = vec![l];
        self.expected[v] = 1;
        l
    }

    /// A new gradient contribution to `v` defined at `pos`, or `None` for ids.
    fn contribution(
        &mut self,
        b: &mut Body<'_>,
        v: usize,
        pos: usize,
        span: Span,
    ) -> Option<LocalId> {
        if self.expected[v] == 0 {
            return None;
        }
        let name = &self.fwd.value_names[v];
        let base = if self.expected[v] == 1 {
            format!("d_{name}")
        } else {
            format!("d_{name}_{}", self.contributions[v].len() + 1)
        };
        let l = b.locals.owned(&base, pos, span);
        self.contributions[v].push(l);
        Some(l)
    }

    /// The whole gradient of `v`: its only contribution, or their sum.
    fn total<'a>(&mut self, b: &mut Body<'a>, v: usize, rt: &'a TokenStream) -> LocalId {
        assert_eq!(
            self.contributions[v].len(),
            self.expected[v],
            "every use of a value has contributed"
        );
        self.sum(b, v, rt)
    }

    /// The contributions `v` has so far, summed in the order they arrived (reverse order of
    /// use) into one local, which replaces them.
    fn sum<'a>(&mut self, b: &mut Body<'a>, v: usize, rt: &'a TokenStream) -> LocalId {
        let cs = self.contributions[v].clone();
        if cs.len() == 1 {
            return cs[0];
        }
        let name = &self.fwd.value_names[v];
        let span = self.g.values[v].src.span();
        let (uses, summed) = (self.expected[v], cs.len());
        let mut acc = cs[0];
        for (j, &c) in cs[1..].iter().enumerate() {
            let pos = b.pos();
            b.locals.use_at(acc, pos);
            b.locals.use_at(c, pos);
            let sum = b.locals.owned(&format!("d_{name}"), pos, span);
            let doc = (j == 0).then(|| {
                comment(&if summed == uses {
                    format!(
                        "`{name}` is used {uses} times: its gradient is the sum of theirs, in \
                         reverse order of use."
                    )
                } else {
                    format!(
                        "`{name}` is used {uses} times: the sum of the gradients of its last \
                         {summed} uses, in reverse order; its first use's backward adds its own."
                    )
                })
            });
            b.push(move |nm| {
                let (s, x, y) = (nm.pat(sum), nm.by_ref(acc), nm.by_ref(c));
                quote! {
                    #doc
                    let #s = #rt::ops::add(#x, #y)?;
                }
            });
            acc = sum;
        }
        self.contributions[v] = vec![acc];
        acc
    }
}

/// The `Sharding` a dropout of value `v` draws its mask with: split by the last dimension when
/// `v` is tensor-parallel split, else replicated.
fn dropout_sharding(cx: &Ctx<'_>, v: usize) -> TokenStream {
    match cx.a.sharding[v] {
        Sharding::Split => quote!(Sharding::SplitLastDim),
        _ => quote!(Sharding::Replicated),
    }
}

/// The statements of one node in backward; `plus`: the other gradient of a layer's input, which
/// the layer adds (`backward_plus`).
#[allow(clippy::too_many_arguments)]
fn backward_node<'a>(
    cx: &'a Ctx<'a>,
    b: &mut Body<'a>,
    n: NodeId,
    d_y: LocalId,
    saved: Option<LocalId>,
    d_args: &[Option<LocalId>],
    plus: Option<LocalId>,
    pos: usize,
) {
    let rt = &cx.root.runtime;
    let node = &cx.g.nodes[n];
    let site = cx.site(n);
    let span = node.src.span();
    match &node.op {
        NodeOp::Field { .. } => {
            let field = cx.field(n);
            let this_field = cx.this_field(n);
            let name = field.name();
            let saved = saved.expect("calls save");
            match &field.kind {
                FieldKind::Column { gather_output } => {
                    let d_x = d_args[0].expect("column-parallel inputs are tensors");
                    let call = cx.qualified(n, quote!(ColumnParallel::backward_column));
                    let doc = comment(&format!(
                        "`{name}`: f's backward, all-reduce of the input gradient over tp."
                    ));
                    let local =
                        gather_output.then(|| b.locals.temp(&format!("d_{name}_local"), pos, span));
                    b.push(move |nm| {
                        let (s, dx, dxi) = (nm.ident(saved), nm.pat(d_x), nm.ident(d_x));
                        let (split, dy) = match local {
                            Some(l) => {
                                let li = nm.ident(l);
                                let dyr = nm.by_ref(d_y);
                                let sdoc = comment(&format!(
                                    "`{name}`: gather_output's backward, this rank's slice of the \
                                     output gradient."
                                ));
                                (
                                    quote! {
                                        #sdoc
                                        let #li = #rt::tensor_parallel::split_last_dim(cx, #dyr)?;
                                    },
                                    quote!(&#li),
                                )
                            }
                            None => (quote!(), nm.by_ref(d_y)),
                        };
                        quote! {
                            #split
                            let #dx = #call(&#this_field, cx, #site, #s, #dy)?;
                            #doc
                            cx.tp().all_reduce(&#dxi, ReduceOp::Sum)?;
                        }
                    });
                }
                FieldKind::Row { input_is_parallel } => {
                    let d_x = d_args[0].expect("row-parallel inputs are tensors");
                    let call = cx.qualified(n, quote!(RowParallel::backward_row));
                    let doc = comment(&format!("`{name}`: g's backward is the identity."));
                    let local = (!input_is_parallel).then(|| {
                        let base = format!("d_{}_local", value_base(cx.g, node.args[0]));
                        b.locals.temp(&base, pos, span)
                    });
                    b.push(move |nm| {
                        let (s, dy, dx) = (nm.ident(saved), nm.by_ref(d_y), nm.pat(d_x));
                        match local {
                            Some(l) => {
                                let li = nm.ident(l);
                                let gdoc = comment(&format!(
                                    "`{name}`: input_is_parallel = false. The scatter's backward, \
                                     all-gather of the input gradient over tp."
                                ));
                                quote! {
                                    #doc
                                    let #li = #call(&#this_field, cx, #site, #s, #dy)?;
                                    #gdoc
                                    let #dx = #rt::tensor_parallel::gather_last_dim(cx, &#li)?;
                                }
                            }
                            None => quote! {
                                #doc
                                let #dx = #call(&#this_field, cx, #site, #s, #dy)?;
                            },
                        }
                    });
                }
                FieldKind::Vocab => {
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
                FieldKind::Replicated => {
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
                    b.push(move |nm| {
                        let (s, dy) = (nm.ident(saved), nm.by_ref(d_y));
                        let extra = plus.map(|p| {
                            let p = nm.by_ref(p);
                            quote!(, #p)
                        });
                        let call = quote!(#this.#f.#method(cx, #site, #s, #dy #extra)?);
                        let pats: Vec<_> = d_args
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
                    });
                }
                FieldKind::Op => {
                    let d_x = d_args[0].expect("op inputs are tensors");
                    let call = cx.qualified(n, quote!(Op::backward));
                    b.push(move |nm| {
                        let (s, dy, dx) = (nm.ident(saved), nm.by_ref(d_y), nm.pat(d_x));
                        quote!(let #dx = #call(&#this_field, cx, #site, #s, #dy)?;)
                    });
                }
                FieldKind::Stack { .. } | FieldKind::Config => unreachable!("validated"),
            }
        }
        NodeOp::Logits { .. } => {
            let d_h = d_args[0].expect("logits inputs are tensors");
            let this_field = cx.this_field(n);
            let name = cx.field(n).name();
            let call = cx.qualified(n, quote!(VocabParallel::logits_backward));
            let saved = saved.expect("logits save");
            let doc = comment(&format!(
                "`{name}.logits`: f's backward, all-reduce of the input gradient over tp."
            ));
            b.push(move |nm| {
                let (s, dy, dh, dhi) =
                    (nm.ident(saved), nm.by_ref(d_y), nm.pat(d_h), nm.ident(d_h));
                quote! {
                    let #dh = #call(&#this_field, cx, #site, #s, #dy)?;
                    #doc
                    cx.tp().all_reduce(&#dhi, ReduceOp::Sum)?;
                }
            });
        }
        NodeOp::Builtin { builtin, .. } => {
            let saved = saved.expect("builtins save");
            let d_x = d_args[0].expect("builtin inputs are tensors");
            let split = cx.a.sharding[node.args[0]] == Sharding::Split;
            // The split logits' gradient in the products' dtype when their layer only
            // multiplies it (the tied output layer).
            let (function, extra) = match builtin {
                Builtin::Gelu => (quote!(#rt::ops::gelu_backward), None),
                Builtin::Dropout => (quote!(#rt::ops::dropout_backward), None),
                Builtin::CrossEntropy if split => {
                    let feeds = super::feeds_products(cx.root, cx.s, cx.g, cx.a, node.args[0]);
                    (
                        quote!(#rt::tensor_parallel::vocab_parallel_cross_entropy_backward_to),
                        Some(quote!(, #feeds)),
                    )
                }
                Builtin::CrossEntropy => (quote!(#rt::ops::cross_entropy_backward), None),
            };
            b.push(move |nm| {
                let (s, dy, dx) = (nm.ident(saved), nm.by_ref(d_y), nm.pat(d_x));
                quote!(let #dx = #function(cx, #site, #s, #dy #extra)?;)
            });
        }
        NodeOp::DropoutAdd { .. } => {
            let saved = saved.expect("dropout saves");
            let (d_a, d_b) = (
                d_args[0].expect("sums are of tensors"),
                d_args[1].expect("sums are of tensors"),
            );
            let doc = comment(
                "`+` of a dropout: the gradient flows to the residual as it is and through the \
                 dropout's mask to the branch (in the products' dtype when the branch's \
                 backward only multiplies it).",
            );
            let feeds = super::feeds_products(cx.root, cx.s, cx.g, cx.a, node.args[1]);
            b.push(move |nm| {
                let (s, dy, a, bb) = (nm.ident(saved), nm.by_ref(d_y), nm.pat(d_a), nm.pat(d_b));
                quote! {
                    #doc
                    let (#a, #bb) = #rt::ops::dropout_add_backward(cx, #site, #s, #dy, #feeds)?;
                }
            });
        }
        NodeOp::Add => {
            let (d_a, d_b) = (
                d_args[0].expect("sums are of tensors"),
                d_args[1].expect("sums are of tensors"),
            );
            let doc = comment("`+`: the gradient flows to both sides.");
            b.push(move |nm| {
                let (a, bb) = (nm.pat(d_a), nm.pat(d_b));
                let (first, second) = (nm.owned(d_y, false), nm.owned(d_y, true));
                quote! {
                    #doc
                    let #a = #first;
                    let #bb = #second;
                }
            });
        }
        NodeOp::Loop { elem, .. } => {
            let d_before = d_args[0].expect("loops carry tensors");
            let saved = saved.expect("loops save");
            let this_field = cx.this_field(n);
            let i = b.locals.temp("i", pos, span);
            let element = b.locals.temp(
                &syn::ext::IdentExt::unraw(elem).to_string(),
                pos,
                elem.span(),
            );
            let element_saved = b.locals.temp(
                &format!("{}_saved", syn::ext::IdentExt::unraw(elem)),
                pos,
                span,
            );
            b.carried.push((d_y, d_before));
            let name = cx.field(n).name();
            let doc = comment(&format!(
                "`{name}`: each module's backward, last module first."
            ));
            b.push(move |nm| {
                let (s, v) = (nm.ident(saved), nm.ident(d_before));
                let (ii, e, es) = (nm.ident(i), nm.ident(element), nm.ident(element_saved));
                let init = if carried_in_place(nm, d_y, d_before) {
                    quote!()
                } else {
                    let value = nm.owned(d_y, true);
                    quote!(let mut #v = #value;)
                };
                quote! {
                    #doc
                    #init
                    for (#ii, (#e, #es)) in #this_field.iter().zip(#s).enumerate().rev() {
                        #v = #e.backward(cx, #site.index(#ii), #es, &#v)?;
                    }
                }
            });
        }
    }
}
