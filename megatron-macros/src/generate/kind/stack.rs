//! A `Vec` of sub-modules (a stack, `#[pipeline]` when pipeline parallelism cuts it): built
//! module by module in the scopes `name.i` (a pipeline stage builds the indices it holds),
//! visited in order, and run by the forward's loop `for m in &self.field { h = m(h); }`, which
//! becomes `module::stack_forward` and `module::stack_backward` (activation recompute is theirs).

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;

use super::{Backward, Call, Forward, Kind};
use crate::generate::body::{Body, carried_in_place};
use crate::generate::comment;
use crate::model::NodeOp;
use crate::parse::{Field, FieldKind};
use crate::validate::{Checker, FieldCall};

/// Stack fields.
pub(super) struct Stack;

impl Kind for Stack {
    fn check_call(&self, c: &mut Checker<'_>, call: &FieldCall<'_>) {
        let name = &call.name;
        c.errors.push(call.node.src.error(format!(
            "`{name}` is a list of modules: run it with a loop, `for layer in \
             &self.{name} {{ h = layer(h); }}`"
        )));
    }

    fn spec_type(&self, rt: &TokenStream, f: &Field) -> TokenStream {
        let elem = element(f);
        let ty = &f.ty;
        quote_spanned!(ty.span()=> ::std::vec::Vec<<#elem as #rt::module::Module>::Spec>)
    }

    fn saved_type(&self, rt: &TokenStream, f: &Field) -> TokenStream {
        let elem = element(f);
        quote!(#rt::module::StackSaved<<#elem as #rt::module::Module>::Saved>)
    }

    fn capturable(&self, rt: &TokenStream, f: &Field) -> Option<TokenStream> {
        let elem = element(f);
        let ty = &f.ty;
        Some(quote_spanned!(ty.span()=> <#elem as #rt::module::Module>::CAPTURABLE))
    }

    fn build(&self, rt: &TokenStream, f: &Field, indices: TokenStream) -> Option<TokenStream> {
        let elem = element(f);
        let (name, scope) = (&f.ident, f.name());
        let build = quote_spanned!(elem.span()=> #rt::module::build_whole::<#elem>);
        Some(quote! {
            b.scoped(#scope, |b| {
                let mut list = ::std::vec::Vec::with_capacity(spec.#name.len());
                for i in #indices {
                    list.push(b.scoped(&i.to_string(), |b| #build(&spec.#name[i], b))?);
                }
                ::std::result::Result::Ok(list)
            })
        })
    }

    fn visit_stacked(&self, rt: &TokenStream, f: &Field) -> TokenStream {
        let elem = element(f);
        let name = &f.ident;
        quote! {
            for m in &self.#name {
                *units += 1;
                let unit = *units;
                <#elem as #rt::module::Module>::visit_params(m, &mut |p| f(p, unit));
            }
        }
    }

    fn visit(&self, rt: &TokenStream, f: &Field, mutable: bool) -> TokenStream {
        let elem = element(f);
        let name = &f.ident;
        let (method, borrow) = super::visit_method(mutable);
        quote! {
            for m in #borrow self.#name {
                <#elem as #rt::module::Module>::#method(m, f);
            }
        }
    }
}

/// What the loops' documentation says of `cx.unit`.
const UNIT: &str = "With sharded parameters (`optim_grads_params`) each module is a unit of \
                    gathering: `cx.unit` gathers its parameters (starting the next module's \
                    gather with `--overlap-param-gather`) until `_unit` is dropped; without, \
                    it does nothing.";

/// The loop over the stack: `module::stack_forward`.
pub(in crate::generate) fn loop_forward<'a>(call: &Call<'a>, b: &mut Body<'a>, io: &Forward<'_>) {
    let Call {
        cx, n, rt, span: _, ..
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
    let before = args[0];
    let span = node.src.span();
    let i = b.locals.temp("i", pos, span);
    let x = b.locals.temp("x", pos, span);
    let step = b.locals.temp("out", pos, span);
    b.carried.push((before, out));
    let doc = if cx.field(n).is_pipeline() {
        comment(&format!(
            "`{name}` (#[pipeline]): each module this stage holds in turn, at site \
             `{name}.i` with `i` the module's index in the whole stack (the same sites, \
             dropout masks and parameter names as without a pipeline); what they save is \
             kept, or with activation recompute only the input of each recomputed group \
             of modules (`cx.recompute()`). {UNIT}"
        ))
    } else {
        comment(&format!(
            "`{name}`: each module in turn, at site `{name}.i`; what they save is kept, or \
             with activation recompute only the input of each recomputed group of modules \
             (`cx.recompute()`). {UNIT}"
        ))
    };
    let first = cx.first_index(n);
    b.push(move |nm| {
        let (v, s) = (nm.ident(out), nm.ident(saved));
        let (ii, xx, st) = (nm.ident(i), nm.ident(x), nm.ident(step));
        let init = if carried_in_place(nm, before, out) {
            quote!()
        } else {
            let value = nm.owned(before, nm.last_use(before) == pos);
            quote!(let mut #v = #value;)
        };
        quote! {
            #init
            #doc
            let (#st, #s) = #rt::module::stack_forward(
                cx,
                #this_field.len(),
                #v,
                |#ii, #xx| {
                    let _unit = cx.unit(&#this_field, #ii, #ii.checked_add(1))?;
                    #this_field[#ii].forward(cx, #site.index(#first #ii), #xx)
                },
            )?;
            #v = #st;
        }
    });
}

/// The loop's backward: `module::stack_backward`, last module first.
pub(in crate::generate) fn loop_backward<'a>(call: &Call<'a>, b: &mut Body<'a>, io: &Backward<'_>) {
    let Call {
        cx, n, rt, span, ..
    } = *call;
    let _node = &cx.g.nodes[n];
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
    let NodeOp::Loop { elem, .. } = &cx.g.nodes[n].op else {
        unreachable!("a loop node")
    };
    let d_before = d_args[0].expect("loops carry tensors");
    let i = b.locals.temp("i", pos, span);
    let x = b.locals.temp("x", pos, span);
    let element_saved = b.locals.temp(
        &format!("{}_saved", syn::ext::IdentExt::unraw(elem)),
        pos,
        span,
    );
    let dy = b.locals.temp("dy", pos, span);
    let d_in = b.locals.temp("d_in", pos, span);
    b.carried.push((d_y, d_before));
    let doc = comment(&format!(
        "`{name}`: each module's backward, last module first (a recomputed group's \
         forward rerun first, from its input). {UNIT}"
    ));
    let first = cx.first_index(n);
    b.push(move |nm| {
        let (s, v) = (nm.ident(saved), nm.ident(d_before));
        let (ii, xx) = (nm.ident(i), nm.ident(x));
        let (es, dd, din) = (nm.ident(element_saved), nm.ident(dy), nm.ident(d_in));
        let init = if carried_in_place(nm, d_y, d_before) {
            quote!()
        } else {
            let value = nm.owned(d_y, true);
            quote!(let mut #v = #value;)
        };
        quote! {
            #init
            #doc
            let #din = #rt::module::stack_backward(
                #s,
                #v,
                |#ii, #xx| {
                    let _unit = cx.unit(&#this_field, #ii, #ii.checked_sub(1))?;
                    #this_field[#ii].forward(cx, #site.index(#first #ii), #xx)
                },
                |#ii, #es, #dd| {
                    let _unit = cx.unit(&#this_field, #ii, #ii.checked_sub(1))?;
                    #this_field[#ii].backward(cx, #site.index(#first #ii), #es, #dd)
                },
            )?;
            #v = #din;
        }
    });
}

/// The module type of a stack field's elements.
fn element(f: &Field) -> &syn::Type {
    match &f.kind {
        FieldKind::Stack { elem, .. } => elem,
        _ => unreachable!("a stack field"),
    }
}
