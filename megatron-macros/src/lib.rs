//! Procedural macros of megatron-rs: `#[megatron::module]` on a struct and on its impl.
//!
//! A user writes a module as a struct whose field attributes say how each layer is split over
//! tensor parallelism, and an impl with a straight-line `forward`:
//!
//! ```ignore
//! use megatron::prelude::*;
//!
//! #[megatron::module]
//! pub struct Mlp {
//!     #[column_parallel] fc1: Linear,
//!     #[row_parallel]    fc2: Linear,
//! }
//!
//! #[megatron::module]
//! impl Mlp {
//!     fn forward(&self, x: Tensor) -> Tensor {
//!         let h = gelu(self.fc1(x));
//!         self.fc2(h)
//!     }
//! }
//! ```
//!
//! The struct attribute emits the struct (without the DSL's attributes), `MlpSpec` (what it is
//! built from), `impl Module for Mlp` (build with the right split, parameter visits) and a
//! `macro_rules!` callback carrying the struct's tokens. The impl attribute hands the impl to
//! that callback, which calls `__module_impl!` with both: it emits `MlpSaved` (what forward
//! keeps for backward) and the inherent `forward` and `backward`, with every tensor-parallel
//! collective where Megatron-LM puts it (and, for a forward of one tensor input,
//! `backward_plus`, the input gradient plus another, which callers use when that input has
//! several uses). **The impl must come after the struct, in the same
//! module** (the callback is a `macro_rules!` in textual scope).
//!
//! Inside, the crate runs like a compiler: `parse` (syn into fields and forward statements),
//! `model` (forward as an SSA dataflow graph), `validate` (sharding analysis, errors with
//! spans) and `generate` (quote; one file per kind of field in `generate/kind/`).

mod collectives;
mod expansion_out;
mod fuse;
mod generate;
mod model;
mod parse;
mod pipeline;
mod pointwise;
mod root;
mod src_span;
mod validate;

#[cfg(test)]
mod expanded_docs;
#[cfg(test)]
mod tests;

use proc_macro::TokenStream;
use proc_macro2::TokenStream as TokenStream2;
use quote::quote;

use crate::parse::InputType;
use crate::root::Root;

/// Turns a struct into a megatron module, or generates the forward and backward of its impl.
///
/// On a struct with named fields, each field takes at most one of:
///
/// | attribute | the field is | built with |
/// | --- | --- | --- |
/// | `#[column_parallel]`, `#[column_parallel(gather_output = true)]` | a layer whose output features are split (`ColumnParallel`) | `build_column` |
/// | `#[row_parallel]`, `#[row_parallel(input_is_parallel = false)]` | a layer whose input features are split (`RowParallel`) | `build_row` |
/// | `#[vocab_parallel]` | an embedding whose vocabulary rows are split (`VocabParallel`) | `build_vocab` |
/// | `#[expert_parallel]` | a router and experts split over expert parallelism (`ExpertParallel`); its call is the route, the dispatcher's all-to-alls over `cx.ep()`, the local experts and the combine (docs/expanded-moe.md) | `build_experts` |
/// | none or `#[replicated]` | a layer or sub-module, whole on every rank; `Vec<T>`: a stack | `Module::build` |
/// | `#[pipeline]` on a `Vec<T>` | the stack pipeline parallelism cuts into stages (one per model) | the builder's stage's run of it |
/// | `#[op]` | a parameterless op (`Op`), its value its configuration | cloned from the spec |
/// | `#[config]` | plain data | cloned from the spec |
///
/// On the impl (after the struct, in the same module), `fn forward(&self, x: Tensor, ..) ->
/// Tensor` is straight-line code: `let` statements, loops `for elem in &self.list { h =
/// elem(h); }` and a final expression, built from field calls `self.field(x)`, the tied output
/// layer `self.wte.logits(h)`, `gelu(x)`, `dropout(x, p)`, `cross_entropy(logits, targets)`,
/// `a + b`, parentheses and variables. A sum with a dropout written on one side,
/// `x + dropout(y, p)`, becomes one `ops::dropout_add` (dropout and the residual connection in
/// one pass, as Megatron-LM fuses them; same mask, same result). Misplaced sharding (a row-parallel layer fed a replicated
/// value, a split value returned, ...) is a compile error naming the value and the fix.
///
/// With a `#[pipeline]` stack, the impl also gets the parts a pipeline stage runs:
/// `forward_pre` (before the stack's loop: the first stage), `forward_layers` (the run of the
/// stack an instance holds) and `forward_post` (after the loop: the last stage), each with its
/// backward and Saved struct, and `impl Pipelined` (docs/expanded-pipeline.md).
#[proc_macro_attribute]
pub fn module(attr: TokenStream, item: TokenStream) -> TokenStream {
    let attr = TokenStream2::from(attr);
    let item = TokenStream2::from(item);
    let root = Root::find();
    let mut out = TokenStream2::new();
    if !attr.is_empty() {
        out.extend(
            syn::Error::new_spanned(&attr, "#[megatron::module] takes no arguments")
                .to_compile_error(),
        );
    }
    out.extend(match syn::parse2::<syn::Item>(item.clone()) {
        Ok(syn::Item::Struct(s)) => expand_struct(&root, s, &item),
        Ok(syn::Item::Impl(i)) => expand_impl(i),
        Ok(other) => {
            let e = syn::Error::new_spanned(
                item_head(&other),
                "#[megatron::module] goes on a struct with named fields and on its `impl`",
            );
            let mut t = quote!(#other);
            t.extend(e.to_compile_error());
            t
        }
        Err(e) => {
            let mut t = item;
            t.extend(e.to_compile_error());
            t
        }
    });
    out.into()
}

/// The first tokens of an item, for an error span that does not cover its whole body.
fn item_head(item: &syn::Item) -> TokenStream2 {
    match item {
        syn::Item::Enum(e) => {
            let (t, i) = (&e.enum_token, &e.ident);
            quote!(#t #i)
        }
        syn::Item::Fn(f) => {
            let sig = &f.sig;
            quote!(#sig)
        }
        syn::Item::Union(u) => {
            let (t, i) = (&u.union_token, &u.ident);
            quote!(#t #i)
        }
        syn::Item::Trait(t) => {
            let (k, i) = (&t.trait_token, &t.ident);
            quote!(#k #i)
        }
        other => quote!(#other),
    }
}

/// The DSL's field attributes and those it reserves.
const DSL_ATTRIBUTES: [&str; 9] = [
    "column_parallel",
    "row_parallel",
    "vocab_parallel",
    "replicated",
    "pipeline",
    "op",
    "config",
    "expert_parallel",
    "graph_scope",
];

fn expand_struct(root: &Root, item: syn::ItemStruct, original: &TokenStream2) -> TokenStream2 {
    let ident = item.ident.clone();
    let mut stripped = item.clone();
    for field in stripped.fields.iter_mut() {
        field
            .attrs
            .retain(|a| !DSL_ATTRIBUTES.iter().any(|name| a.path().is_ident(name)));
    }
    match parse::parse_struct(item) {
        Ok(s) => {
            let items = generate::struct_items(root, &s, original);
            let written = expansion_out::write_if_asked(&ident.to_string(), &items);
            let track = expansion_out::track();
            quote!(#items #track #written)
        }
        Err(e) => generate::struct_error_items(Some(&ident), quote!(#stripped), e),
    }
}

fn expand_impl(item: syn::ItemImpl) -> TokenStream2 {
    let callback = match &*item.self_ty {
        syn::Type::Path(p) if p.qself.is_none() => p.path.get_ident().cloned(),
        _ => None,
    };
    match callback {
        Some(ident) if item.trait_.is_none() => {
            let name = generate::callback_name(&ident);
            quote!(#name! { #item })
        }
        // Not `impl Name`: report why without the callback.
        _ => match parse::parse_impl(item) {
            Err(e) => e.to_compile_error(),
            Ok(imp) => syn::Error::new_spanned(
                &imp.self_ident,
                "#[megatron::module] impls are for a module struct named in the same module",
            )
            .to_compile_error(),
        },
    }
}

/// `__module_impl! { <struct tokens> ; <impl tokens> }`: the second half of
/// `#[megatron::module]`, called by the struct's callback with both items.
#[doc(hidden)]
#[proc_macro]
pub fn __module_impl(input: TokenStream) -> TokenStream {
    let root = Root::find();
    module_impl(&root, input.into()).into()
}

/// Splits `<struct> ; <impl>`.
struct Both {
    item_struct: syn::ItemStruct,
    item_impl: syn::ItemImpl,
}

impl syn::parse::Parse for Both {
    fn parse(input: syn::parse::ParseStream) -> syn::Result<Self> {
        let item_struct = input.parse()?;
        input.parse::<syn::Token![;]>()?;
        let item_impl = input.parse()?;
        Ok(Both {
            item_struct,
            item_impl,
        })
    }
}

fn module_impl(root: &Root, input: TokenStream2) -> TokenStream2 {
    let both: Both = match syn::parse2(input) {
        Ok(b) => b,
        Err(e) => return e.to_compile_error(),
    };
    let original = {
        let item = &both.item_struct;
        quote!(#item)
    };
    let s = match parse::parse_struct(both.item_struct) {
        Ok(s) => s,
        // The struct's own expansion reports its errors.
        Err(_) => return TokenStream2::new(),
    };
    let signature = forward_input_types(&both.item_impl);
    let result = parse::parse_impl(both.item_impl).and_then(|imp| {
        validate::recompute(&imp)?;
        validate::outputs(&s, &imp)?;
        let g = model::build(&imp.forward)?;
        let a = validate::validate(&s, &g)?;
        let (g, a) = fuse::fuse(g, a);
        let (g, a) = collectives::merge(&s, g, a);
        generate::impl_items(root, &s, &imp, &g, &a)
    });
    match result {
        Ok(tokens) => {
            // The module's whole expansion, the struct's items then the impl's, for a user
            // who asked to see it (MEGATRON_EXPAND_DIR).
            let whole = {
                let items = generate::struct_items(root, &s, &original);
                quote!(#items #tokens)
            };
            let written = expansion_out::write_if_asked(&s.ident.to_string(), &whole);
            quote!(#tokens #written)
        }
        Err(e) => generate::impl_error_items(root, &s, signature.as_ref(), e),
    }
}

/// The input types of the impl's forward and how many tensors it returns, when its signature is
/// well formed (for the placeholders emitted next to errors).
fn forward_input_types(item: &syn::ItemImpl) -> Option<(Vec<InputType>, usize)> {
    let f = item.items.iter().find_map(|i| match i {
        syn::ImplItem::Fn(f) if f.sig.ident == "forward" => Some(f),
        _ => None,
    })?;
    let mut out = Vec::new();
    for arg in f.sig.inputs.iter().skip(1) {
        let syn::FnArg::Typed(t) = arg else {
            return None;
        };
        let syn::Type::Path(p) = &*t.ty else {
            return None;
        };
        match p.path.segments.last()?.ident.to_string().as_str() {
            "Tensor" => out.push(InputType::Tensor),
            "Ids" => out.push(InputType::Ids),
            _ => return None,
        }
    }
    let outputs = match &f.sig.output {
        syn::ReturnType::Type(_, ty) => match &**ty {
            syn::Type::Tuple(t) if t.elems.len() >= 2 => t.elems.len(),
            _ => 1,
        },
        syn::ReturnType::Default => 1,
    };
    Some((out, outputs))
}
