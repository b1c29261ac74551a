//! Names of the generated locals: the user's names where it has them, short readable ones
//! otherwise, shadowing like hand-written Rust where that is safe.
//!
//! Each local has a preferred base name, the position of the statement defining it and the
//! position of its last use. A name is given to a local unless another local holding it is still
//! used at or after the new one's definition; reusing a name whose previous holder is dead is a
//! plain `let` shadowing (`let (h, ln_f) = self.ln_f.forward(.., &h)?;`). Otherwise `_1`, `_2`,
//! ... are appended.

use std::collections::HashSet;

use proc_macro2::{Span, TokenStream};
use quote::quote;
use syn::Ident;

/// Index of a local.
pub type LocalId = usize;

struct Local {
    base: String,
    def: usize,
    last: usize,
    /// Must not shadow anything used at its own position (temporaries inside a statement group
    /// and loop-internal names).
    strict: bool,
    /// A `&Tensor` parameter rather than an owned tensor.
    reference: bool,
    /// A fixed name (`cx`, `site`, ...) live everywhere.
    fixed: bool,
    span: Span,
}

/// The locals of one generated function, before naming.
#[derive(Default)]
pub struct Locals {
    items: Vec<Local>,
}

impl Locals {
    fn push(&mut self, local: Local) -> LocalId {
        self.items.push(local);
        self.items.len() - 1
    }

    /// A name that is always taken (`cx`, `site`, `saved`, `d_out`).
    pub fn fixed(&mut self, name: &str, reference: bool) -> LocalId {
        self.push(Local {
            base: name.into(),
            def: 0,
            last: usize::MAX,
            strict: false,
            reference,
            fixed: true,
            span: Span::call_site(),
        })
    }

    /// A parameter (a reference), defined before every statement.
    pub fn param(&mut self, base: &str, span: Span) -> LocalId {
        self.push(Local {
            base: base.into(),
            def: 0,
            last: 0,
            strict: false,
            reference: true,
            fixed: false,
            span,
        })
    }

    /// An owned local defined by the statement at `pos`.
    pub fn owned(&mut self, base: &str, pos: usize, span: Span) -> LocalId {
        self.push(Local {
            base: base.into(),
            def: pos,
            last: pos,
            strict: false,
            reference: false,
            fixed: false,
            span,
        })
    }

    /// A local that must not shadow anything live at `pos` (a temporary within the statements
    /// of `pos`, or a name inside a loop body).
    pub fn temp(&mut self, base: &str, pos: usize, span: Span) -> LocalId {
        let id = self.owned(base, pos, span);
        self.items[id].strict = true;
        id
    }

    /// Records a use of `id` at `pos`.
    pub fn use_at(&mut self, id: LocalId, pos: usize) {
        let l = &mut self.items[id];
        l.last = l.last.max(pos);
    }

    /// Gives every local its name.
    pub fn assign(self) -> Names {
        let n = self.items.len();
        let mut names: Vec<Option<String>> = vec![None; n];
        let mut order: Vec<LocalId> = (0..n).collect();
        order.sort_by_key(|&i| (!self.items[i].fixed, self.items[i].def, i));
        for &b in &order {
            let local = &self.items[b];
            if local.fixed {
                names[b] = Some(local.base.clone());
                continue;
            }
            let conflicts = |candidate: &str| {
                order.iter().any(|&a| {
                    let Some(name) = &names[a] else { return false };
                    if name != candidate {
                        return false;
                    }
                    let other = &self.items[a];
                    let dead = other.last < local.def
                        || (other.last == local.def && other.def < local.def && !local.strict);
                    other.fixed || !dead
                })
            };
            let mut candidate = local.base.clone();
            let mut k = 0;
            while conflicts(&candidate) {
                k += 1;
                candidate = format!("{}_{k}", local.base);
            }
            names[b] = Some(candidate);
        }
        Names {
            names: names.into_iter().map(|n| n.expect("all named")).collect(),
            spans: self.items.iter().map(|l| l.span).collect(),
            reference: self.items.iter().map(|l| l.reference).collect(),
            last: self.items.iter().map(|l| l.last).collect(),
            mutable: HashSet::new(),
        }
    }
}

/// The names of a function's locals.
pub struct Names {
    names: Vec<String>,
    spans: Vec<Span>,
    reference: Vec<bool>,
    last: Vec<usize>,
    mutable: HashSet<LocalId>,
}

/// An identifier for generated code: call-site hygiene (so that generated locals see each
/// other), located at `at` for messages; raw if the name is a keyword.
pub fn ident(name: &str, at: Span) -> Ident {
    let span = Span::call_site().located_at(at);
    if syn::parse_str::<Ident>(name).is_ok() {
        Ident::new(name, span)
    } else {
        Ident::new_raw(name, span)
    }
}

impl Names {
    /// The name of `id`.
    pub fn name(&self, id: LocalId) -> &str {
        &self.names[id]
    }

    /// The identifier of `id`.
    pub fn ident(&self, id: LocalId) -> Ident {
        ident(&self.names[id], self.spans[id])
    }

    /// Whether `id` is a `&Tensor` parameter.
    pub fn is_ref(&self, id: LocalId) -> bool {
        self.reference[id]
    }

    /// The position of the last use of `id`.
    pub fn last_use(&self, id: LocalId) -> usize {
        self.last[id]
    }

    /// Declares `id` `let mut`.
    pub fn set_mut(&mut self, id: LocalId) {
        self.mutable.insert(id);
    }

    /// The pattern binding `id`: `x` or `mut x`.
    pub fn pat(&self, id: LocalId) -> TokenStream {
        let i = self.ident(id);
        if self.mutable.contains(&id) {
            quote!(mut #i)
        } else {
            quote!(#i)
        }
    }

    /// `id` as a `&Tensor`: the parameter itself, or a borrow of an owned local.
    pub fn by_ref(&self, id: LocalId) -> TokenStream {
        let i = self.ident(id);
        if self.reference[id] {
            quote!(#i)
        } else {
            quote!(&#i)
        }
    }

    /// `id` as an owned tensor, moved (the last use of an owned local) or cloned (cheap: the
    /// clone shares storage).
    pub fn owned(&self, id: LocalId, last_use: bool) -> TokenStream {
        let i = self.ident(id);
        if self.reference[id] || !last_use {
            quote!(#i.clone())
        } else {
            quote!(#i)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shadowing_only_when_the_previous_holder_is_dead() {
        let mut l = Locals::default();
        let cx = l.fixed("cx", true);
        let x = l.param("x", Span::call_site());
        let h1 = l.owned("h", 1, Span::call_site());
        l.use_at(x, 1);
        let h2 = l.owned("h", 2, Span::call_site());
        l.use_at(h1, 2);
        let h3 = l.owned("h", 3, Span::call_site());
        l.use_at(h2, 4);
        let tmp = l.temp("x", 4, Span::call_site());
        let c = l.owned("cx", 5, Span::call_site());
        let names = l.assign();
        assert_eq!(names.name(cx), "cx");
        assert_eq!(names.name(h1), "h");
        assert_eq!(names.name(h2), "h", "h1 is dead once h2 is defined");
        assert_eq!(names.name(h3), "h_1", "h2 is used after h3's definition");
        assert_eq!(names.name(tmp), "x", "x is dead at 4");
        assert_eq!(names.name(c), "cx_1");
    }

    #[test]
    fn temporaries_do_not_shadow_what_their_statement_uses() {
        let mut l = Locals::default();
        let h = l.owned("h", 1, Span::call_site());
        l.use_at(h, 2);
        let t = l.temp("h", 2, Span::call_site());
        let out = l.owned("h", 2, Span::call_site());
        let names = l.assign();
        assert_eq!(names.name(t), "h_1");
        assert_eq!(
            names.name(out),
            "h",
            "a result may shadow its statement's input"
        );
    }
}
