//! `Src`: the tokens a piece of the model came from, for error spans.

use proc_macro2::{Span, TokenStream};
use quote::ToTokens;

/// The source tokens of an expression, statement or attribute.
///
/// Errors built from it cover the whole construct (first to last token), also on stable Rust
/// where spans cannot be joined.
#[derive(Clone)]
pub struct Src(TokenStream);

impl Src {
    /// The tokens of `t`.
    pub fn of(t: &impl ToTokens) -> Src {
        Src(t.to_token_stream())
    }

    /// An error covering the construct.
    pub fn error(&self, message: impl std::fmt::Display) -> syn::Error {
        if self.0.is_empty() {
            syn::Error::new(Span::call_site(), message)
        } else {
            syn::Error::new_spanned(&self.0, message)
        }
    }

    /// The tokens as text, spaced as written in Rust (`relu(h) * relu(h)`).
    pub fn text(&self) -> String {
        let raw = self.0.to_string();
        let mut out = String::with_capacity(raw.len());
        let mut chars = raw.chars().peekable();
        while let Some(c) = chars.next() {
            let next = chars.peek().copied();
            let prev = out.chars().last();
            let drop = c == ' '
                && (matches!(next, Some(')' | ',' | '.'))
                    || matches!(prev, Some('(' | '.'))
                    || next == Some('(') && prev.is_some_and(|p| p.is_alphanumeric() || p == '_'));
            if !drop {
                out.push(c);
            }
        }
        out
    }

    /// The span of the first token (where generated code that stands for it points).
    pub fn span(&self) -> Span {
        self.0
            .clone()
            .into_iter()
            .next()
            .map_or_else(Span::call_site, |t| t.span())
    }
}

impl std::fmt::Debug for Src {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "`{}`", self.0)
    }
}

/// Collects errors so that one expansion reports all of them.
#[derive(Default)]
pub struct Errors(Option<syn::Error>);

impl Errors {
    /// Adds an error.
    pub fn push(&mut self, e: syn::Error) {
        match &mut self.0 {
            Some(all) => all.combine(e),
            None => self.0 = Some(e),
        }
    }

    /// Whether any error was added.
    pub fn is_empty(&self) -> bool {
        self.0.is_none()
    }

    /// `Err` with every error, or `Ok(value)`.
    pub fn finish<T>(self, value: T) -> syn::Result<T> {
        match self.0 {
            Some(e) => Err(e),
            None => Ok(value),
        }
    }
}
