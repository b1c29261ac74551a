//! Parsing: syn's items into the module's fields and its forward's statements.
//!
//! Nothing here knows about sharding; it only checks that the input has a shape the DSL accepts
//! and reports, with the span of the construct, what it does not accept.

use syn::ext::IdentExt;
use syn::{Attribute, Ident, Token, Type, Visibility};

use crate::pointwise::{self, Cmp, Func, PwOp};
use crate::src_span::{Errors, Src};

/// What forward's statements may be (repeated in errors).
pub const STATEMENTS_HELP: &str = "forward accepts `let name = expr;`, `let mut name = expr;`, \
     `name = expr;` on a `let mut` name, loops `for elem in &self.list { var = elem(var); }` and a \
     final output expression";

/// What forward's expressions may be (repeated in errors).
pub const EXPRESSIONS_HELP: &str = "forward's expressions are calls of fields `self.field(..)`, \
     `self.field.logits(h)`, the builtins `swiglu(x)`, `dropout(x, p)`, `rope(x, cfg)` and \
     `cross_entropy(logits, targets)`, the shape operations (`let (a, b) = split(x, [A, B]);`, \
     `split_heads`, `narrow(x, start, len)`, `cat(a, b)`, `cat_heads(a, b, [A, B])`, \
     `broadcast_heads(x, heads)`), element-wise math (`a + b`, `a - b`, `a * b`, `a / b`, \
     `-a`, with tensors or scalars such as `2.0`, `self.config_value` or `CONSTANT`; relu, \
     square, silu, gelu, gelu_erf, sigmoid, tanh, exp, log, sqrt, rsqrt, softplus, abs, \
     `clamp(x, lo, hi)`, `select(a > b, x, y)`), parentheses and variable names";

// ---------------------------------------------------------------------------------------------
// The struct
// ---------------------------------------------------------------------------------------------

/// A `#[megatron::module]` struct.
pub struct ModuleStruct {
    /// Outer attributes other than the macro's own (docs, derives), kept on the struct.
    pub attrs: Vec<Attribute>,
    /// The struct's visibility; the generated Spec and Saved structs share it.
    pub vis: Visibility,
    /// The struct's name.
    pub ident: Ident,
    /// The fields, in order (parameters are visited in this order).
    pub fields: Vec<Field>,
}

/// One field and what its attribute makes of it.
pub struct Field {
    /// Attributes other than the DSL's (docs, `#[allow]`), kept.
    pub attrs: Vec<Attribute>,
    /// The field's visibility, kept.
    pub vis: Visibility,
    /// The field's name.
    pub ident: Ident,
    /// The field's type as written.
    pub ty: Type,
    /// What the field is.
    pub kind: FieldKind,
    /// `#[graph_scope(..)]`: the scope its call is (`attn`, `mlp`; `moe_router` and
    /// `moe_preprocess` on an `#[expert_parallel]` field), if any.
    pub graph_scopes: Vec<GraphScopeName>,
}

/// A scope named in `#[graph_scope(..)]`, with where it was written.
#[derive(Clone)]
pub struct GraphScopeName {
    /// `attn`, `mlp`, `moe_router` or `moe_preprocess`.
    pub name: String,
    /// The name's span.
    pub span: proc_macro2::Span,
}

impl GraphScopeName {
    /// The runtime's `GraphScope` variant.
    pub fn variant(&self) -> &'static str {
        match self.name.as_str() {
            "attn" => "Attn",
            "mlp" => "Mlp",
            "moe_router" => "MoeRouter",
            _ => "MoePreprocess",
        }
    }
}

/// The scopes `#[graph_scope(..)]` takes.
const GRAPH_SCOPES: [&str; 4] = ["attn", "mlp", "moe_router", "moe_preprocess"];

/// Parses `#[graph_scope(attn)]` or `#[graph_scope(moe_router, moe_preprocess)]`.
fn parse_graph_scope(attr: &Attribute) -> syn::Result<Vec<GraphScopeName>> {
    let syn::Meta::List(_) = &attr.meta else {
        return Err(syn::Error::new_spanned(
            attr,
            "#[graph_scope(..)] names its scope: one of attn, mlp, moe_router, moe_preprocess",
        ));
    };
    let mut names: Vec<GraphScopeName> = Vec::new();
    attr.parse_nested_meta(|meta| {
        let Some(ident) = meta.path.get_ident() else {
            return Err(meta.error("a graph scope is one of attn, mlp, moe_router, moe_preprocess"));
        };
        let name = ident.to_string();
        if !GRAPH_SCOPES.contains(&name.as_str()) {
            return Err(meta.error(format!(
                "unknown graph scope `{name}`: the scopes are attn, mlp, moe_router and \
                 moe_preprocess"
            )));
        }
        if names.iter().any(|n| n.name == name) {
            return Err(meta.error(format!("graph scope `{name}` is named twice")));
        }
        names.push(GraphScopeName {
            name,
            span: ident.span(),
        });
        Ok(())
    })?;
    Ok(names)
}

/// Checks that a field's scopes fit its kind: attention and dense MLPs are whole calls of a
/// replicated sub-module, the MoE scopes the router (and preprocessing) of an expert layer.
fn check_graph_scopes(
    ident: &Ident,
    kind: &FieldKind,
    scopes: &[GraphScopeName],
    errors: &mut Errors,
) {
    let field = ident.unraw();
    let moe = |s: &GraphScopeName| s.name.starts_with("moe_");
    match kind {
        FieldKind::Replicated => {
            if let Some(s) = scopes.iter().find(|s| moe(s)) {
                errors.push(syn::Error::new(
                    s.span,
                    format!(
                        "graph scope `{}` marks the router of an #[expert_parallel] field, but \
                         `{field}` is a replicated module (give it attn or mlp)",
                        s.name
                    ),
                ));
            } else if let [_, second, ..] = scopes {
                errors.push(syn::Error::new(
                    second.span,
                    format!(
                        "`{field}` is one call, captured as one scope: give it one of attn, mlp"
                    ),
                ));
            }
        }
        FieldKind::Expert => {
            if let Some(s) = scopes.iter().find(|s| !moe(s)) {
                errors.push(syn::Error::new(
                    s.span,
                    format!(
                        "graph scope `{}` cannot hold `{field}`: an #[expert_parallel] layer's \
                         dispatch is an all-to-all whose sizes are known only at run time, and \
                         a graph replays fixed sizes; capture its router with moe_router \
                         (and moe_preprocess)",
                        s.name
                    ),
                ));
            } else if scopes.iter().all(|s| s.name != "moe_router") {
                errors.push(syn::Error::new(
                    scopes[0].span,
                    "moe_preprocess is captured in the router's graph: give moe_router too",
                ));
            }
        }
        other => errors.push(syn::Error::new(
            scopes[0].span,
            format!(
                "#[graph_scope] marks a replicated sub-module (attn, mlp) or an \
                 #[expert_parallel] layer (moe_router, moe_preprocess), not {} `{field}`",
                other.attribute()
            ),
        )),
    }
}

impl Field {
    /// The field's name without `r#`.
    pub fn name(&self) -> String {
        self.ident.unraw().to_string()
    }

    /// Whether the field is the `#[pipeline]` stack.
    pub fn is_pipeline(&self) -> bool {
        matches!(self.kind, FieldKind::Stack { pipeline: true, .. })
    }
}

impl ModuleStruct {
    /// The index of the `#[pipeline]` field, if the struct has one.
    pub fn pipeline_field(&self) -> Option<usize> {
        self.fields.iter().position(Field::is_pipeline)
    }
}

/// What a field is, from its attribute.
#[derive(Clone)]
pub enum FieldKind {
    /// `#[column_parallel]`: output features split over tensor parallelism.
    Column {
        /// All-gather the output after the layer.
        gather_output: bool,
    },
    /// `#[row_parallel]`: input features split; partial outputs all-reduced.
    Row {
        /// The input arrives split (the usual case); `false` splits a replicated input first.
        input_is_parallel: bool,
    },
    /// `#[vocab_parallel]`: an embedding whose vocabulary rows are split.
    Vocab,
    /// `#[expert_parallel]`: a router and experts split over expert parallelism; tokens go to
    /// their experts and back by the dispatcher's all-to-alls.
    Expert,
    /// No attribute or `#[replicated]`: a layer or a sub-module, whole on every rank.
    Replicated,
    /// `#[local]`: a layer with replicated parameters that runs on whatever this rank holds of
    /// its input (split over tensor parallelism or not) and keeps that split: the
    /// qk-layernorm of this rank's heads.
    Local,
    /// `#[partial_output]`: a module of the user's whose output is a row-parallel layer's,
    /// handed over unreduced: the caller reduces it over tp (once with the other partial
    /// outputs it is added to).
    PartialOutput,
    /// A `Vec<T>` without attribute (or `#[replicated]`): a stack of sub-modules; with
    /// `#[pipeline]`, the stack pipeline parallelism cuts into stages.
    Stack {
        /// The element type `T`.
        elem: Box<Type>,
        /// `#[pipeline]`: each pipeline stage holds and runs a run of the stack's modules.
        pipeline: bool,
    },
    /// `#[op]`: a parameterless op; its value is its configuration.
    Op,
    /// `#[context_parallel]`: a parameterless op that mixes a sequence's positions (attention)
    /// and runs on a context-parallel rank's chunks, exchanging keys and values over the
    /// context-parallel group.
    ContextParallel,
    /// `#[config]`: plain data copied from the spec.
    Config,
}

impl FieldKind {
    /// The attribute as written, for messages.
    pub fn attribute(&self) -> &'static str {
        match self {
            FieldKind::Column {
                gather_output: false,
            } => "#[column_parallel]",
            FieldKind::Column {
                gather_output: true,
            } => "#[column_parallel(gather_output = true)]",
            FieldKind::Row {
                input_is_parallel: true,
            } => "#[row_parallel]",
            FieldKind::Row {
                input_is_parallel: false,
            } => "#[row_parallel(input_is_parallel = false)]",
            FieldKind::Vocab => "#[vocab_parallel]",
            FieldKind::Expert => "#[expert_parallel]",
            FieldKind::Replicated => "a replicated layer or module (no attribute)",
            FieldKind::Local => "#[local]",
            FieldKind::PartialOutput => "#[partial_output]",
            FieldKind::Stack {
                pipeline: false, ..
            } => "a list of modules (`Vec<..>`)",
            FieldKind::Stack { pipeline: true, .. } => "#[pipeline]",
            FieldKind::Op => "#[op]",
            FieldKind::ContextParallel => "#[context_parallel]",
            FieldKind::Config => "#[config]",
        }
    }
}

/// The DSL's field attributes.
const KIND_ATTRIBUTES: [&str; 11] = [
    "column_parallel",
    "row_parallel",
    "vocab_parallel",
    "expert_parallel",
    "replicated",
    "local",
    "partial_output",
    "pipeline",
    "op",
    "context_parallel",
    "config",
];

/// The kinds a field may take, for messages.
const KINDS_HELP: &str = "#[column_parallel], #[row_parallel], #[vocab_parallel], \
     #[expert_parallel], #[replicated], #[local], #[partial_output], #[pipeline], #[op], \
     #[context_parallel], #[config]";

/// Parses a struct given to `#[megatron::module]`.
pub fn parse_struct(item: syn::ItemStruct) -> syn::Result<ModuleStruct> {
    let mut errors = Errors::default();
    if !item.generics.params.is_empty() || item.generics.where_clause.is_some() {
        errors.push(syn::Error::new_spanned(
            &item.generics,
            "#[megatron::module] structs cannot be generic: a module's fields are concrete layers, \
             modules, ops and config values",
        ));
    }
    let named = match item.fields {
        syn::Fields::Named(named) => named,
        syn::Fields::Unnamed(f) => {
            errors.push(syn::Error::new_spanned(
                f,
                "#[megatron::module] needs a struct with named fields: the names become parameter \
                 names and call sites (`self.fc1(x)`)",
            ));
            return Err(errors.finish(()).unwrap_err());
        }
        syn::Fields::Unit => {
            errors.push(syn::Error::new_spanned(
                &item.ident,
                "#[megatron::module] needs a struct with named fields, e.g. `struct Mlp { \
                 #[column_parallel] fc1: Linear, #[row_parallel] fc2: Linear }`",
            ));
            return Err(errors.finish(()).unwrap_err());
        }
    };
    let mut fields: Vec<Field> = Vec::new();
    for field in named.named {
        let span = Src::of(&field);
        match parse_field(field) {
            Ok(f) => {
                if f.is_pipeline()
                    && let Some(first) = fields.iter().find(|f| f.is_pipeline())
                {
                    errors.push(span.error(format!(
                        "`{}` and `{}` are both #[pipeline]; a model has one stack that pipeline \
                         parallelism cuts into stages",
                        first.name(),
                        f.name()
                    )));
                }
                fields.push(f)
            }
            Err(e) => errors.push(e),
        }
    }
    errors.finish(ModuleStruct {
        attrs: item.attrs,
        vis: item.vis,
        ident: item.ident,
        fields,
    })
}

/// Parses one field's attributes into its kind.
fn parse_field(field: syn::Field) -> syn::Result<Field> {
    let ident = field.ident.clone().expect("named fields have names");
    let mut errors = Errors::default();
    let mut kept = Vec::new();
    let mut kind: Option<(FieldKind, &'static str, Src)> = None;
    let mut graph_scopes: Option<Vec<GraphScopeName>> = None;
    for attr in field.attrs {
        let Some(name) = attr.path().get_ident().map(|i| i.to_string()) else {
            kept.push(attr);
            continue;
        };
        if name == "graph_scope" {
            if graph_scopes.is_some() {
                errors.push(syn::Error::new_spanned(
                    &attr,
                    "`#[graph_scope]` is given twice: list the scopes in one",
                ));
                continue;
            }
            match parse_graph_scope(&attr) {
                Ok(names) => graph_scopes = Some(names),
                Err(e) => errors.push(e),
            }
            continue;
        }
        let Some(attr_name) = KIND_ATTRIBUTES.iter().find(|a| **a == name) else {
            kept.push(attr);
            continue;
        };
        let parsed = match parse_kind_attribute(attr_name, &attr) {
            Ok(k) => k,
            Err(e) => {
                errors.push(e);
                continue;
            }
        };
        if let Some((_, first, _)) = &kind {
            errors.push(syn::Error::new_spanned(
                &attr,
                format!(
                    "`{}` has two kinds: #[{first}] and #[{attr_name}]; a field takes one of \
                     {KINDS_HELP}",
                    ident.unraw()
                ),
            ));
            continue;
        }
        kind = Some((parsed, attr_name, Src::of(&attr)));
    }
    let kind = match kind {
        Some((FieldKind::Replicated, _, _)) | None => match vec_element(&field.ty) {
            Some(elem) => FieldKind::Stack {
                elem: Box::new(elem.clone()),
                pipeline: false,
            },
            None => FieldKind::Replicated,
        },
        Some((FieldKind::Stack { pipeline: true, .. }, _, src)) => match vec_element(&field.ty) {
            Some(elem) => FieldKind::Stack {
                elem: Box::new(elem.clone()),
                pipeline: true,
            },
            None => {
                errors.push(src.error(format!(
                    "#[pipeline] marks the list of layers pipeline parallelism cuts into stages, a \
                     `Vec<..>` of modules, but `{}` is not a `Vec`",
                    ident.unraw()
                )));
                FieldKind::Replicated
            }
        },
        Some((k, _, _)) => k,
    };
    let graph_scopes = graph_scopes.unwrap_or_default();
    if !graph_scopes.is_empty() {
        check_graph_scopes(&ident, &kind, &graph_scopes, &mut errors);
    }
    errors.finish(Field {
        attrs: kept,
        vis: field.vis,
        ident,
        ty: field.ty,
        kind,
        graph_scopes,
    })
}

/// Parses `#[column_parallel(gather_output = true)]` and its siblings.
fn parse_kind_attribute(name: &str, attr: &Attribute) -> syn::Result<FieldKind> {
    let options: &[&str] = match name {
        "column_parallel" => &["gather_output"],
        "row_parallel" => &["input_is_parallel"],
        _ => &[],
    };
    let mut gather_output = None;
    let mut input_is_parallel = None;
    match &attr.meta {
        syn::Meta::Path(_) => {}
        syn::Meta::NameValue(nv) => {
            return Err(syn::Error::new_spanned(
                nv,
                format!("#[{name}] takes no value{}", options_help(name, options)),
            ));
        }
        syn::Meta::List(list) => {
            if options.is_empty() {
                return Err(syn::Error::new_spanned(
                    list,
                    format!("#[{name}] takes no options"),
                ));
            }
            list.parse_nested_meta(|meta| {
                let option = meta.path.get_ident().map(|i| i.to_string());
                let slot = match option.as_deref() {
                    Some("gather_output") if name == "column_parallel" => &mut gather_output,
                    Some("input_is_parallel") if name == "row_parallel" => &mut input_is_parallel,
                    _ => {
                        let written = meta
                            .path
                            .segments
                            .iter()
                            .map(|s| s.ident.to_string())
                            .collect::<Vec<_>>()
                            .join("::");
                        return Err(meta.error(format!(
                            "unknown option `{written}` of #[{name}]{}",
                            options_help(name, options)
                        )));
                    }
                };
                if slot.is_some() {
                    return Err(meta.error(format!(
                        "option `{}` of #[{name}] is given twice",
                        option.unwrap_or_default()
                    )));
                }
                let value = if meta.input.peek(Token![=]) {
                    meta.value()?.parse::<syn::LitBool>()?.value
                } else {
                    true
                };
                *slot = Some(value);
                Ok(())
            })?;
        }
    }
    Ok(match name {
        "column_parallel" => FieldKind::Column {
            gather_output: gather_output.unwrap_or(false),
        },
        "row_parallel" => FieldKind::Row {
            input_is_parallel: input_is_parallel.unwrap_or(true),
        },
        "vocab_parallel" => FieldKind::Vocab,
        "expert_parallel" => FieldKind::Expert,
        "replicated" => FieldKind::Replicated,
        "local" => FieldKind::Local,
        "partial_output" => FieldKind::PartialOutput,
        // The element type is read from the field's type by the caller.
        "pipeline" => FieldKind::Stack {
            elem: Box::new(Type::Verbatim(proc_macro2::TokenStream::new())),
            pipeline: true,
        },
        "op" => FieldKind::Op,
        "context_parallel" => FieldKind::ContextParallel,
        "config" => FieldKind::Config,
        _ => unreachable!("only the DSL's attributes are parsed"),
    })
}

fn options_help(name: &str, options: &[&str]) -> String {
    match options {
        [] => format!("; write #[{name}]"),
        [one] => format!("; its option is `{one} = true|false`"),
        _ => format!("; its options are {}", options.join(", ")),
    }
}

/// `T` if `ty` is `Vec<T>` (any path ending in `Vec`).
fn vec_element(ty: &Type) -> Option<&Type> {
    let Type::Path(p) = ty else { return None };
    if p.qself.is_some() {
        return None;
    }
    let last = p.path.segments.last()?;
    if last.ident != "Vec" {
        return None;
    }
    let syn::PathArguments::AngleBracketed(args) = &last.arguments else {
        return None;
    };
    match args.args.iter().collect::<Vec<_>>().as_slice() {
        [syn::GenericArgument::Type(t)] => Some(t),
        _ => None,
    }
}

// ---------------------------------------------------------------------------------------------
// The impl
// ---------------------------------------------------------------------------------------------

/// A `#[megatron::module]` impl: its forward, and any other items (kept as written).
pub struct ModuleImpl {
    /// Attributes on the impl, kept.
    pub attrs: Vec<Attribute>,
    /// The type the impl is for.
    pub self_ident: Ident,
    /// The forward.
    pub forward: Forward,
    /// Other items of the impl, kept as written.
    pub others: Vec<syn::ImplItem>,
}

/// The type a forward input has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputType {
    /// `Tensor`: activations, replicated, with a gradient.
    Tensor,
    /// `Ids`: token ids, no gradient.
    Ids,
}

/// One input of forward.
pub struct Input {
    /// Its name.
    pub ident: Ident,
    /// Its type.
    pub ty: InputType,
    /// The `name: Type` tokens.
    pub src: Src,
}

/// The parsed `fn forward`.
pub struct Forward {
    /// Attributes of the user's forward (docs), put on the generated forward.
    pub attrs: Vec<Attribute>,
    /// `#[recompute]`: the module keeps only its input, and its backward reruns the forward.
    pub recompute: Option<Src>,
    /// The `self` of the receiver: generated code uses this token so that `self` in user
    /// expressions (dropout probabilities) resolves to the generated method's receiver.
    pub self_token: Token![self],
    /// The inputs, in order.
    pub inputs: Vec<Input>,
    /// The statements before the output.
    pub stmts: Vec<Stmt>,
    /// The output expressions: one, or with `-> (Tensor, Tensor, ..)` the tuple's.
    pub outputs: Vec<Expr>,
    /// The return type as written, for errors.
    pub returns: Src,
}

/// A statement of forward.
pub enum Stmt {
    /// `let [mut] name = expr;`
    Let {
        /// The bound name.
        name: Ident,
        /// Whether it was `let mut`.
        mutable: bool,
        /// The value.
        expr: Expr,
    },
    /// `let (a, b, ..) = self.name(..);`: the outputs of a module returning several.
    LetOutputs {
        /// The bound names, one per output.
        names: Vec<Ident>,
        /// The field call (an [`Expr::FieldCall`]).
        call: Expr,
    },
    /// `let (a, b, ..) = split(x, [A, B, ..]);` or `split_heads(..)`: one value per part.
    LetParts {
        /// The bound names, one per part.
        names: Vec<Ident>,
        /// The split.
        split: Split,
    },
    /// `name = expr;`
    Assign {
        /// The assigned name.
        name: Ident,
        /// The value.
        expr: Expr,
        /// The statement.
        src: Src,
    },
    /// A loop of several statements over a list of modules: each module's run of the body,
    /// in order, carrying the variables the body assigns (`let mut` before the loop) from one
    /// module to the next; `elem(..)` calls the module.
    Body {
        /// The element's name.
        elem: Ident,
        /// The `Vec` field.
        list: Ident,
        /// The body's statements (`let` and assignments).
        stmts: Vec<Stmt>,
        /// The whole loop.
        src: Src,
    },
    /// `for elem in &self.list { var = elem(var); }`
    Loop {
        /// The element's name.
        elem: Ident,
        /// The `Vec` field.
        list: Ident,
        /// The loop-carried variable.
        var: Ident,
        /// The whole loop.
        src: Src,
    },
}

/// An expression of forward.
pub enum Expr {
    /// A variable.
    Var(Ident),
    /// `self.field(args..)`.
    FieldCall {
        /// The called field.
        field: Ident,
        /// The arguments.
        args: Vec<Expr>,
        /// The call.
        src: Src,
    },
    /// `self.field.logits(arg)`.
    Logits {
        /// The embedding field.
        field: Ident,
        /// The hidden states.
        args: Vec<Expr>,
        /// The call.
        src: Src,
    },
    /// `gelu(..)`, `swiglu(..)`, `dropout(..)`, `cross_entropy(..)`, `rope(..)`,
    /// `shift_left(..)`, `loss_mask(..)`, `aux_loss(..)`.
    Builtin {
        /// Which.
        builtin: Builtin,
        /// The tensor (and ids) arguments.
        args: Vec<Expr>,
        /// dropout's probability, rope's config, aux_loss's weight: evaluated as written.
        p: Option<Box<syn::Expr>>,
        /// aux_loss's name in the step's metrics.
        label: Option<syn::LitStr>,
        /// The call.
        src: Src,
    },
    /// `a + b` of two tensors.
    Add {
        /// Left side.
        lhs: Box<Expr>,
        /// Right side.
        rhs: Box<Expr>,
        /// The whole expression.
        src: Src,
    },
    /// `a - b`, `a * b`, `a / b`, and `+` with a scalar side.
    Arith {
        /// Which.
        op: PwOp,
        /// Left side.
        lhs: Box<Expr>,
        /// Right side.
        rhs: Box<Expr>,
        /// The whole expression.
        src: Src,
    },
    /// `-x` of a tensor.
    Neg {
        /// The operand.
        arg: Box<Expr>,
        /// The whole expression.
        src: Src,
    },
    /// An element-wise function: `relu(x)`, `clamp(x, lo, hi)`.
    Pointwise {
        /// Which.
        func: Func,
        /// Its arguments (tensors or scalars).
        args: Vec<Expr>,
        /// The call.
        src: Src,
    },
    /// `select(a cmp b, x, y)`: `x` where the comparison holds, else `y`.
    Select {
        /// The comparison.
        cmp: Cmp,
        /// `[a, b, x, y]`.
        args: Vec<Expr>,
        /// The call.
        src: Src,
    },
    /// A shape operation along the features: `narrow(x, start, len)`, `cat(a, b, ..)`,
    /// `cat_heads(a, b, .., [A, B, ..])`, `broadcast_heads(x, heads)`.
    Shape {
        /// Which.
        op: ShapeKind,
        /// The tensor arguments.
        args: Vec<Expr>,
        /// Its sizes, Rust expressions of `usize` (start and length; per-head sizes; heads).
        sizes: Vec<syn::Expr>,
        /// The call.
        src: Src,
    },
    /// `elem(args..)` in a loop body: the list's module of this iteration.
    Element {
        /// The element's name.
        elem: Ident,
        /// The arguments.
        args: Vec<Expr>,
        /// The call.
        src: Src,
    },
    /// A scalar: a literal, a #[config] value `self.name`, a constant `NAME` or `path::NAME`, or
    /// arithmetic of them; evaluated as Rust, as an `f32`.
    Scalar {
        /// The expression, as written.
        expr: Box<syn::Expr>,
        /// The `self.name` it reads (checked to be #[config] fields).
        config: Vec<Ident>,
    },
}

impl Expr {
    /// The expression's source tokens, for errors.
    pub fn src(&self) -> Src {
        match self {
            Expr::Var(i) => Src::of(i),
            Expr::FieldCall { src, .. }
            | Expr::Logits { src, .. }
            | Expr::Builtin { src, .. }
            | Expr::Add { src, .. }
            | Expr::Arith { src, .. }
            | Expr::Neg { src, .. }
            | Expr::Pointwise { src, .. }
            | Expr::Select { src, .. }
            | Expr::Shape { src, .. }
            | Expr::Element { src, .. } => src.clone(),
            Expr::Scalar { expr, .. } => Src::of(expr),
        }
    }
}

/// A shape operation of forward along the feature dimension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShapeKind {
    /// `narrow(x, start, len)`, and each part of `split(x, [..])`.
    Narrow,
    /// `cat(a, b, ..)`.
    Cat,
    /// Part `k` of `split_heads(x, [..])`.
    HeadPart(usize),
    /// Part `k` of `chunk(x, n)`: the `k`-th of `n` equal parts of the features.
    ChunkPart(usize),
    /// `cat_heads(a, b, .., [..])`.
    CatHeads,
    /// `broadcast_heads(x, heads)`.
    BroadcastHeads,
}

impl ShapeKind {
    /// Its name in forward.
    pub fn name(self) -> &'static str {
        match self {
            ShapeKind::Narrow => "narrow",
            ShapeKind::Cat => "cat",
            ShapeKind::HeadPart(_) => "split_heads",
            ShapeKind::ChunkPart(_) => "chunk",
            ShapeKind::CatHeads => "cat_heads",
            ShapeKind::BroadcastHeads => "broadcast_heads",
        }
    }
}

/// `split(x, [A, B, ..])` (features), `split_heads(x, [A, B, ..])` (each head's features) or
/// `chunk(x, n)` (`n` equal parts of the features).
pub struct Split {
    /// The value split.
    pub x: Box<Expr>,
    /// How.
    pub how: SplitHow,
    /// The call.
    pub src: Src,
}

/// How `let (a, b, ..) = ..` cuts a value.
pub enum SplitHow {
    /// `split(x, [A, B, ..])`: the parts' sizes.
    Sizes(Vec<syn::Expr>),
    /// `split_heads(x, [A, B, ..])`: each part's size within a head.
    Heads(Vec<syn::Expr>),
    /// `chunk(x, n)`: `n` equal parts, `n` the literal written.
    Chunks(syn::LitInt),
}

/// The builtin functions of forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Builtin {
    /// `gelu(x)`.
    Gelu,
    /// `swiglu(x)`: `silu(gate) · up` of `x`'s halves `[gate | up]`.
    Swiglu,
    /// `dropout(x, p)`.
    Dropout,
    /// `cross_entropy(logits, targets)`.
    CrossEntropy,
    /// `rope(x, cfg)`: rotary embeddings on each head of `x` (`cfg`: a `megatron::ops::Rope`).
    Rope,
    /// `shift_left(ids)`: ids (or a loss mask) one position earlier along the sequence, the
    /// last position zero (multi-token prediction's next tokens).
    ShiftLeft,
    /// `loss_mask(targets)`: the 0/1 weights of the targets (the data's loss mask, or ones).
    LossMask,
    /// `aux_loss(x, losses, mask, weight, "name")`: `x` unchanged, carrying the auxiliary loss
    /// `weight · Σ(mask · losses) / Σ mask` (multi-token prediction's depth losses).
    AuxLoss,
}

impl Builtin {
    /// The function's name.
    pub fn name(self) -> &'static str {
        match self {
            Builtin::Gelu => "gelu",
            Builtin::Swiglu => "swiglu",
            Builtin::Dropout => "dropout",
            Builtin::CrossEntropy => "cross_entropy",
            Builtin::Rope => "rope",
            Builtin::ShiftLeft => "shift_left",
            Builtin::LossMask => "loss_mask",
            Builtin::AuxLoss => "aux_loss",
        }
    }
}

/// Parses an impl given to `#[megatron::module]`.
pub fn parse_impl(item: syn::ItemImpl) -> syn::Result<ModuleImpl> {
    let mut errors = Errors::default();
    if let Some((_, path, _)) = &item.trait_ {
        return Err(syn::Error::new_spanned(
            path,
            "#[megatron::module] goes on the inherent `impl Name { fn forward(..) }` of a module, \
             not on a trait impl",
        ));
    }
    if !item.generics.params.is_empty() || item.generics.where_clause.is_some() {
        errors.push(syn::Error::new_spanned(
            &item.generics,
            "#[megatron::module] impls cannot be generic",
        ));
    }
    if let Some(u) = &item.unsafety {
        errors.push(syn::Error::new_spanned(
            u,
            "#[megatron::module] impls cannot be unsafe",
        ));
    }
    let self_ident = match &*item.self_ty {
        Type::Path(p) if p.qself.is_none() && p.path.get_ident().is_some() => {
            p.path.get_ident().expect("checked").clone()
        }
        other => {
            errors.push(syn::Error::new_spanned(
                other,
                "#[megatron::module] impls are for a module struct named in the same module, e.g. \
                 `impl Mlp`",
            ));
            return Err(errors.finish(()).unwrap_err());
        }
    };
    let mut forward = None;
    let mut others = Vec::new();
    for impl_item in item.items {
        match impl_item {
            syn::ImplItem::Fn(f) if f.sig.ident == "forward" => {
                if forward.is_some() {
                    errors.push(syn::Error::new_spanned(
                        &f.sig.ident,
                        "forward is defined twice",
                    ));
                    continue;
                }
                match parse_forward(f) {
                    Ok(fw) => forward = Some(fw),
                    Err(e) => errors.push(e),
                }
            }
            syn::ImplItem::Fn(f) if f.sig.ident == "backward" => {
                errors.push(syn::Error::new_spanned(
                    &f.sig.ident,
                    "backward is generated from forward by #[megatron::module]; remove this one \
                     (a hand-written backward belongs to an #[op])",
                ));
            }
            other => others.push(other),
        }
    }
    if forward.is_none() && errors.is_empty() {
        errors.push(syn::Error::new(
            self_ident.span(),
            format!(
                "a #[megatron::module] impl defines `fn forward(&self, x: Tensor) -> Tensor`; \
                 `impl {self_ident}` has none"
            ),
        ));
    }
    let forward = errors.finish(forward)?.expect("checked");
    Ok(ModuleImpl {
        attrs: item.attrs,
        self_ident,
        forward,
        others,
    })
}

/// Parses `fn forward(&self, x: Tensor, ..) -> Tensor { .. }`.
fn parse_forward(f: syn::ImplItemFn) -> syn::Result<Forward> {
    let mut errors = Errors::default();
    let sig = &f.sig;
    for (present, what) in [
        (sig.constness.as_ref().map(Src::of), "const"),
        (sig.asyncness.as_ref().map(Src::of), "async"),
        (sig.unsafety.as_ref().map(Src::of), "unsafe"),
        (sig.abi.as_ref().map(Src::of), "extern"),
        (sig.variadic.as_ref().map(Src::of), "variadic"),
    ] {
        if let Some(src) = present {
            errors.push(src.error(format!("forward cannot be {what}")));
        }
    }
    if !sig.generics.params.is_empty() || sig.generics.where_clause.is_some() {
        errors.push(syn::Error::new_spanned(
            &sig.generics,
            "forward cannot be generic: its inputs are `Tensor`s and `Ids`",
        ));
    }
    let mut self_token = None;
    let mut inputs = Vec::new();
    for (i, arg) in sig.inputs.iter().enumerate() {
        match arg {
            syn::FnArg::Receiver(r) => {
                if r.reference.is_none() || r.mutability.is_some() || r.colon_token.is_some() {
                    errors.push(syn::Error::new_spanned(
                        r,
                        "forward takes `&self`: a forward reads the parameters, a backward \
                         accumulates their gradients",
                    ));
                }
                self_token = Some(r.self_token);
            }
            syn::FnArg::Typed(t) => {
                if i == 0 {
                    errors.push(syn::Error::new_spanned(
                        t,
                        "forward's first parameter is `&self`",
                    ));
                }
                match parse_input(t) {
                    Ok(input) => inputs.push(input),
                    Err(e) => errors.push(e),
                }
            }
        }
    }
    if self_token.is_none() && sig.inputs.is_empty() {
        errors.push(syn::Error::new_spanned(
            &sig.ident,
            "forward takes `&self` and its inputs: `fn forward(&self, x: Tensor) -> Tensor`",
        ));
    }
    let is_tensor = |ty: &Type| type_name(ty).as_deref() == Some("Tensor");
    let (returned, returns) = match &sig.output {
        syn::ReturnType::Type(_, ty) if is_tensor(ty) => (Some(1), Src::of(ty)),
        syn::ReturnType::Type(_, ty) => match &**ty {
            Type::Tuple(t) if t.elems.len() >= 2 && t.elems.iter().all(is_tensor) => {
                (Some(t.elems.len()), Src::of(ty))
            }
            _ => {
                errors.push(syn::Error::new_spanned(
                    ty,
                    "forward returns a `Tensor`, or several as a tuple `(Tensor, Tensor)` (the \
                     generated forward returns them with the saved activations, in a `Result`)",
                ));
                (None, Src::of(ty))
            }
        },
        syn::ReturnType::Default => {
            errors.push(syn::Error::new(
                sig.paren_token.span.close(),
                "forward returns a `Tensor`: write `-> Tensor`",
            ));
            (None, Src::of(&sig.ident))
        }
    };
    let body = parse_body(&f.block);
    let (stmts, outputs) = match body {
        Ok(b) => b,
        Err(e) => {
            errors.push(e);
            return Err(errors.finish(()).unwrap_err());
        }
    };
    if let Some(n) = returned
        && n != outputs.len()
    {
        let tail = outputs
            .last()
            .map(Expr::src)
            .unwrap_or_else(|| returns.clone());
        errors.push(tail.error(format!(
            "forward returns {n} tensor{} but ends with {} value{}: end with {}",
            if n == 1 { "" } else { "s" },
            outputs.len(),
            if outputs.len() == 1 { "" } else { "s" },
            if n == 1 {
                "one expression".to_string()
            } else {
                format!("a tuple of {n}, `(a, b)`")
            }
        )));
    }
    let mut recompute = None;
    let mut attrs = Vec::new();
    for attr in f.attrs {
        if !attr.path().is_ident("recompute") {
            attrs.push(attr);
            continue;
        }
        if !matches!(attr.meta, syn::Meta::Path(_)) {
            errors.push(syn::Error::new_spanned(
                &attr,
                "#[recompute] takes no arguments (which layers recompute at run time is \
                 --recompute-granularity / --recompute-method / --recompute-num-layers)",
            ));
        } else if recompute.is_some() {
            errors.push(syn::Error::new_spanned(
                &attr,
                "#[recompute] is given twice",
            ));
        } else {
            recompute = Some(Src::of(&attr));
        }
    }
    let self_token = errors
        .finish(self_token)?
        .expect("a forward with inputs has a receiver");
    Ok(Forward {
        attrs,
        recompute,
        self_token,
        inputs,
        stmts,
        outputs,
        returns,
    })
}

/// The single-identifier name of a type (`Tensor`, `megatron::tensor::Tensor` → `Tensor`).
fn type_name(ty: &Type) -> Option<String> {
    match ty {
        Type::Path(p) if p.qself.is_none() => {
            let last = p.path.segments.last()?;
            matches!(last.arguments, syn::PathArguments::None).then(|| last.ident.to_string())
        }
        Type::Group(g) => type_name(&g.elem),
        Type::Paren(p) => type_name(&p.elem),
        _ => None,
    }
}

fn parse_input(t: &syn::PatType) -> syn::Result<Input> {
    let ident = match &*t.pat {
        syn::Pat::Ident(p)
            if p.by_ref.is_none() && p.mutability.is_none() && p.subpat.is_none() =>
        {
            p.ident.clone()
        }
        other => {
            return Err(syn::Error::new_spanned(
                other,
                "forward's inputs are plain names: `x: Tensor`, `tokens: Ids`",
            ));
        }
    };
    let ty = match type_name(&t.ty).as_deref() {
        Some("Tensor") => InputType::Tensor,
        Some("Ids") => InputType::Ids,
        _ => {
            return Err(syn::Error::new_spanned(
                &t.ty,
                "forward's inputs are `Tensor` (activations, replicated over tensor parallel) or \
                 `Ids` (token ids, no gradient)",
            ));
        }
    };
    Ok(Input {
        ident,
        ty,
        src: Src::of(t),
    })
}

/// The name of a construct that forward does not accept.
fn construct(e: &syn::Expr) -> &'static str {
    use syn::Expr as E;
    match e {
        E::Array(_) => "an array",
        E::Assign(_) => "an assignment",
        E::Async(_) => "an async block",
        E::Await(_) => "`.await`",
        E::Binary(_) => "this operator",
        E::Block(_) => "a block",
        E::Break(_) => "`break`",
        E::Call(_) => "this call",
        E::Cast(_) => "a cast",
        E::Closure(_) => "a closure",
        E::Const(_) => "a const block",
        E::Continue(_) => "`continue`",
        E::Field(_) => "a field access",
        E::ForLoop(_) => "this `for` loop",
        E::If(_) => "`if`",
        E::Index(_) => "indexing",
        E::Infer(_) => "`_`",
        E::Let(_) => "`let` in an expression",
        E::Lit(_) => "a literal",
        E::Loop(_) => "`loop`",
        E::Macro(_) => "a macro call",
        E::Match(_) => "`match`",
        E::MethodCall(_) => "a method call",
        E::Paren(_) => "parentheses",
        E::Path(_) => "this path",
        E::Range(_) => "a range",
        E::RawAddr(_) => "a raw address",
        E::Reference(_) => "a reference",
        E::Repeat(_) => "an array",
        E::Return(_) => "`return`",
        E::Struct(_) => "a struct literal",
        E::Try(_) => "`?`",
        E::TryBlock(_) => "a try block",
        E::Tuple(_) => "a tuple",
        E::Unary(_) => "a unary operator",
        E::Unsafe(_) => "an unsafe block",
        E::While(_) => "`while`",
        E::Yield(_) => "`yield`",
        _ => "this expression",
    }
}

fn unsupported_statement(src: &impl quote::ToTokens, what: &str) -> syn::Error {
    syn::Error::new_spanned(
        src,
        format!("{what} is not supported in forward; {STATEMENTS_HELP}"),
    )
}

fn unsupported_expression(e: &syn::Expr) -> syn::Error {
    use syn::Expr as E;
    let help = match e {
        E::If(_)
        | E::Match(_)
        | E::While(_)
        | E::Loop(_)
        | E::ForLoop(_)
        | E::Return(_)
        | E::Break(_)
        | E::Continue(_)
        | E::Block(_)
        | E::Unsafe(_)
        | E::Async(_)
        | E::TryBlock(_)
        | E::Closure(_) => format!(
            "forward is straight-line code, from which the backward is generated; \
             {STATEMENTS_HELP}; {EXPRESSIONS_HELP}"
        ),
        _ => EXPRESSIONS_HELP.to_string(),
    };
    syn::Error::new_spanned(
        e,
        format!("{} is not supported in forward; {help}", construct(e)),
    )
}

/// Parses forward's body into statements and the output expression.
fn parse_body(block: &syn::Block) -> syn::Result<(Vec<Stmt>, Vec<Expr>)> {
    let mut errors = Errors::default();
    let mut stmts = Vec::new();
    let mut output = None;
    let n = block.stmts.len();
    for (i, stmt) in block.stmts.iter().enumerate() {
        let last = i + 1 == n;
        match stmt {
            syn::Stmt::Local(local) => match parse_let(local) {
                Ok(s) => stmts.push(s),
                Err(e) => errors.push(e),
            },
            syn::Stmt::Item(item) => {
                errors.push(unsupported_statement(item, "an item"));
            }
            syn::Stmt::Macro(m) => {
                errors.push(unsupported_statement(m, "a macro call"));
            }
            syn::Stmt::Expr(syn::Expr::ForLoop(l), _) => match parse_loop(l) {
                Ok(s) => stmts.push(s),
                Err(e) => errors.push(e),
            },
            syn::Stmt::Expr(syn::Expr::Assign(a), Some(_)) => match parse_assign(a) {
                Ok(s) => stmts.push(s),
                Err(e) => errors.push(e),
            },
            syn::Stmt::Expr(syn::Expr::Tuple(t), None) if last && t.elems.len() >= 2 => {
                match t
                    .elems
                    .iter()
                    .map(parse_expr)
                    .collect::<syn::Result<Vec<_>>>()
                {
                    Ok(xs) => output = Some(xs),
                    Err(err) => errors.push(err),
                }
            }
            syn::Stmt::Expr(e, None) if last => match parse_expr(e) {
                Ok(x) => output = Some(vec![x]),
                Err(err) => errors.push(err),
            },
            syn::Stmt::Expr(e, semi) => {
                let what = match e {
                    syn::Expr::If(_)
                    | syn::Expr::Match(_)
                    | syn::Expr::While(_)
                    | syn::Expr::Loop(_)
                    | syn::Expr::Return(_)
                    | syn::Expr::Block(_)
                    | syn::Expr::Unsafe(_)
                    | syn::Expr::Macro(_)
                    | syn::Expr::Break(_)
                    | syn::Expr::Continue(_)
                    | syn::Expr::Closure(_) => construct(e),
                    _ if semi.is_some() && last => {
                        errors.push(syn::Error::new_spanned(
                            stmt,
                            "forward ends with its output expression, without `;`",
                        ));
                        continue;
                    }
                    _ if semi.is_some() => "an expression statement (its value would be unused)",
                    _ => "an expression before the end",
                };
                errors.push(unsupported_statement(stmt, what));
            }
        }
    }
    if output.is_none() && errors.is_empty() {
        let span = block.brace_token.span.close();
        errors.push(syn::Error::new(
            span,
            "forward ends with its output expression (e.g. `self.fc2(h)`), without `;`",
        ));
    }
    let output = errors.finish(output)?.expect("checked");
    Ok((stmts, output))
}

fn parse_let(local: &syn::Local) -> syn::Result<Stmt> {
    if let Some(attr) = local.attrs.first() {
        return Err(unsupported_statement(attr, "an attribute on a statement"));
    }
    let (pat, ty) = match &local.pat {
        syn::Pat::Type(t) => (&*t.pat, Some(&t.ty)),
        p => (p, None),
    };
    if let Some(ty) = ty
        && type_name(ty).as_deref() != Some("Tensor")
    {
        return Err(syn::Error::new_spanned(
            ty,
            "`let` in forward binds tensors: leave the type out or write `Tensor`",
        ));
    }
    let (name, mutable) = match pat {
        syn::Pat::Ident(p) if p.by_ref.is_none() && p.subpat.is_none() => {
            (p.ident.clone(), p.mutability.is_some())
        }
        syn::Pat::Tuple(t) => return parse_let_parts(local, t),
        other => {
            return Err(unsupported_statement(other, "this pattern"));
        }
    };
    let Some(init) = &local.init else {
        return Err(unsupported_statement(local, "a `let` without a value"));
    };
    if let Some((else_token, _)) = &init.diverge {
        return Err(unsupported_statement(else_token, "`let .. else`"));
    }
    let expr = parse_expr(&init.expr)?;
    Ok(Stmt::Let {
        name,
        mutable,
        expr,
    })
}

fn parse_assign(a: &syn::ExprAssign) -> syn::Result<Stmt> {
    let name = match plain_ident(&a.left) {
        Some(i) => i,
        None => {
            return Err(syn::Error::new_spanned(
                &a.left,
                "forward assigns to plain names: `h = expr;`",
            ));
        }
    };
    Ok(Stmt::Assign {
        name,
        expr: parse_expr(&a.right)?,
        src: Src::of(a),
    })
}

/// The loop form forward accepts.
const LOOP_FORM: &str = "forward's loops run over a list of modules, `for elem in &self.list { \
                         var = elem(var); }`, or with a body of several statements carrying \
                         several variables";

fn parse_loop(l: &syn::ExprForLoop) -> syn::Result<Stmt> {
    let src = Src::of(l);
    if let Some(label) = &l.label {
        return Err(syn::Error::new_spanned(
            label,
            format!("loop labels are not supported; {LOOP_FORM}"),
        ));
    }
    let elem = match &*l.pat {
        syn::Pat::Ident(p)
            if p.by_ref.is_none() && p.mutability.is_none() && p.subpat.is_none() =>
        {
            p.ident.clone()
        }
        other => {
            return Err(syn::Error::new_spanned(
                other,
                format!("the loop element is a plain name; {LOOP_FORM}"),
            ));
        }
    };
    let list = match &*l.expr {
        syn::Expr::Reference(r) if r.mutability.is_none() => self_field(&r.expr),
        _ => None,
    };
    let Some(list) = list else {
        return Err(syn::Error::new_spanned(
            &l.expr,
            format!("a loop runs over a list field by reference, `&self.list`; {LOOP_FORM}"),
        ));
    };
    if let Some(var) = single_assignment(l, &elem) {
        return Ok(Stmt::Loop {
            elem,
            list,
            var,
            src,
        });
    }
    // A body of several statements: `let`s and assignments, the element called by its name.
    let previous = LOOP_ELEMENT.with(|e| e.replace(Some(elem.clone())));
    let stmts = parse_body_stmts(&l.body);
    LOOP_ELEMENT.with(|e| *e.borrow_mut() = previous);
    Ok(Stmt::Body {
        elem,
        list,
        stmts: stmts?,
        src,
    })
}

std::thread_local! {
    /// The element's name while a loop body is parsed (its calls are the module's).
    static LOOP_ELEMENT: std::cell::RefCell<Option<Ident>> = const { std::cell::RefCell::new(None) };
}

/// `var` if the loop's body is `var = elem(var);` alone (the loop a #[pipeline] stack runs).
fn single_assignment(l: &syn::ExprForLoop, elem: &Ident) -> Option<Ident> {
    let [syn::Stmt::Expr(syn::Expr::Assign(assign), _)] = l.body.stmts.as_slice() else {
        return None;
    };
    let var = plain_ident(&assign.left)?;
    let syn::Expr::Call(call) = &*assign.right else {
        return None;
    };
    let callee_ok = plain_ident(&call.func).is_some_and(|f| f == *elem);
    let args: Vec<_> = call.args.iter().collect();
    let arg_ok = matches!(args.as_slice(), [a] if plain_ident(a).is_some_and(|a| a == var));
    (callee_ok && arg_ok).then_some(var)
}

/// A loop body's statements: `let name = expr;` and `name = expr;`.
fn parse_body_stmts(block: &syn::Block) -> syn::Result<Vec<Stmt>> {
    let mut errors = Errors::default();
    let mut stmts = Vec::new();
    for stmt in &block.stmts {
        let parsed = match stmt {
            syn::Stmt::Local(local) => parse_let(local),
            syn::Stmt::Expr(syn::Expr::Assign(a), Some(_)) => parse_assign(a),
            other => Err(syn::Error::new_spanned(
                other,
                format!(
                    "a loop body holds `let name = expr;` and `name = expr;` statements (the \
                     names assigned are carried from one module to the next); {LOOP_FORM}"
                ),
            )),
        };
        match parsed {
            Ok(s) => stmts.push(s),
            Err(e) => errors.push(e),
        }
    }
    errors.finish(stmts)
}

/// `name` if `e` is a single identifier.
fn plain_ident(e: &syn::Expr) -> Option<Ident> {
    match e {
        syn::Expr::Path(p) if p.qself.is_none() && p.attrs.is_empty() => {
            p.path.get_ident().cloned()
        }
        _ => None,
    }
}

/// `field` if `e` is `self.field`.
pub(crate) fn self_field(e: &syn::Expr) -> Option<Ident> {
    match e {
        syn::Expr::Field(f) if is_self(&f.base) => match &f.member {
            syn::Member::Named(i) => Some(i.clone()),
            syn::Member::Unnamed(_) => None,
        },
        _ => None,
    }
}

fn is_self(e: &syn::Expr) -> bool {
    matches!(e, syn::Expr::Path(p) if p.qself.is_none() && p.path.is_ident("self"))
}

/// Parses one expression of forward.
pub fn parse_expr(e: &syn::Expr) -> syn::Result<Expr> {
    if let Some(config) = scalar_reads(e) {
        return Ok(Expr::Scalar {
            expr: Box::new(e.clone()),
            config,
        });
    }
    match e {
        syn::Expr::Paren(p) if p.attrs.is_empty() => parse_expr(&p.expr),
        syn::Expr::Group(g) => parse_expr(&g.expr),
        syn::Expr::Path(_) if plain_ident(e).is_some() => {
            let ident = plain_ident(e).expect("checked");
            if ident == "self" {
                return Err(syn::Error::new_spanned(
                    e,
                    format!("`self` is not a value in forward; {EXPRESSIONS_HELP}"),
                ));
            }
            Ok(Expr::Var(ident))
        }
        syn::Expr::Unary(u) if matches!(u.op, syn::UnOp::Neg(_)) => Ok(Expr::Neg {
            arg: Box::new(parse_expr(&u.expr)?),
            src: Src::of(e),
        }),
        syn::Expr::Binary(b) => {
            let op = match b.op {
                syn::BinOp::Add(_) => PwOp::Add,
                syn::BinOp::Sub(_) => PwOp::Sub,
                syn::BinOp::Mul(_) => PwOp::Mul,
                syn::BinOp::Div(_) => PwOp::Div,
                syn::BinOp::Lt(_) | syn::BinOp::Le(_) | syn::BinOp::Gt(_) | syn::BinOp::Ge(_) => {
                    return Err(syn::Error::new_spanned(
                        e,
                        "a comparison is the condition of `select(a > b, x, y)`, and nothing \
                         else in forward",
                    ));
                }
                op => {
                    return Err(syn::Error::new_spanned(
                        op,
                        format!(
                            "`{}` is not supported in forward; {EXPRESSIONS_HELP}",
                            quote::quote!(#op)
                        ),
                    ));
                }
            };
            let (lhs, rhs) = (parse_expr(&b.left), parse_expr(&b.right));
            let (lhs, rhs) = (Box::new(lhs?), Box::new(rhs?));
            let tensors =
                !matches!(*lhs, Expr::Scalar { .. }) && !matches!(*rhs, Expr::Scalar { .. });
            Ok(if op == PwOp::Add && tensors {
                Expr::Add {
                    lhs,
                    rhs,
                    src: Src::of(e),
                }
            } else {
                Expr::Arith {
                    op,
                    lhs,
                    rhs,
                    src: Src::of(e),
                }
            })
        }
        syn::Expr::MethodCall(m) => parse_method_call(m, e),
        syn::Expr::Call(c) => parse_call(c, e),
        other => Err(unsupported_expression(other)),
    }
}

fn parse_args(args: &syn::punctuated::Punctuated<syn::Expr, Token![,]>) -> syn::Result<Vec<Expr>> {
    let mut errors = Errors::default();
    let mut out = Vec::new();
    for a in args {
        match parse_expr(a) {
            Ok(x) => out.push(x),
            Err(e) => errors.push(e),
        }
    }
    errors.finish(out)
}

fn parse_method_call(m: &syn::ExprMethodCall, e: &syn::Expr) -> syn::Result<Expr> {
    if let Some(t) = &m.turbofish {
        return Err(syn::Error::new_spanned(
            t,
            "forward's calls take no type arguments",
        ));
    }
    if is_self(&m.receiver) {
        // `self.fc1(x)` is a method-call expression in Rust's grammar.
        return Ok(Expr::FieldCall {
            field: m.method.clone(),
            args: parse_args(&m.args)?,
            src: Src::of(e),
        });
    }
    if let Some(field) = self_field(&m.receiver) {
        if m.method == "logits" {
            return Ok(Expr::Logits {
                field,
                args: parse_args(&m.args)?,
                src: Src::of(e),
            });
        }
        return Err(syn::Error::new_spanned(
            &m.method,
            format!(
                "`self.{}.{}(..)` is not supported in forward: the only method of a field is \
                 `.logits(h)`, the tied output layer of a #[vocab_parallel] embedding; call the \
                 field itself with `self.{0}(x)`",
                field.unraw(),
                m.method.unraw()
            ),
        ));
    }
    Err(syn::Error::new_spanned(
        e,
        format!(
            "method calls on tensors (`.{}(..)`) are not supported in forward; {EXPRESSIONS_HELP}",
            m.method.unraw()
        ),
    ))
}

fn parse_call(c: &syn::ExprCall, e: &syn::Expr) -> syn::Result<Expr> {
    // `(self.fc1)(x)` is a field call too.
    let mut func = &*c.func;
    while let syn::Expr::Paren(p) = func {
        func = &p.expr;
    }
    if let Some(field) = self_field(func) {
        return Ok(Expr::FieldCall {
            field,
            args: parse_args(&c.args)?,
            src: Src::of(e),
        });
    }
    let Some(name) = plain_ident(func) else {
        return Err(syn::Error::new_spanned(
            &c.func,
            format!("forward cannot call this; {EXPRESSIONS_HELP}"),
        ));
    };
    if LOOP_ELEMENT.with(|e| e.borrow().as_ref() == Some(&name)) {
        return Ok(Expr::Element {
            elem: name,
            args: parse_args(&c.args)?,
            src: Src::of(e),
        });
    }
    let builtin = match name.to_string().as_str() {
        "gelu" => Builtin::Gelu,
        "swiglu" => Builtin::Swiglu,
        "dropout" => Builtin::Dropout,
        "cross_entropy" => Builtin::CrossEntropy,
        "rope" => Builtin::Rope,
        "shift_left" => Builtin::ShiftLeft,
        "loss_mask" => Builtin::LossMask,
        "aux_loss" => Builtin::AuxLoss,
        "select" => return parse_select(c, e),
        "split" | "split_heads" => {
            return Err(syn::Error::new_spanned(
                e,
                format!(
                    "{name} gives one tensor per size: bind them together, `let (a, b) = \
                     {name}(x, [A, B]);`"
                ),
            ));
        }
        "narrow" | "cat" | "cat_heads" | "broadcast_heads" => {
            return parse_shape(&name.to_string(), c, e);
        }
        other => {
            if let Some(&(_, func, usage)) = pointwise::FUNCS.iter().find(|f| f.0 == other) {
                if c.args.len() != func.arity() {
                    return Err(syn::Error::new_spanned(
                        e,
                        format!(
                            "{other} takes {}: `{usage}`",
                            plural(func.arity(), "argument")
                        ),
                    ));
                }
                return Ok(Expr::Pointwise {
                    func,
                    args: parse_args(&c.args)?,
                    src: Src::of(e),
                });
            }
            return Err(syn::Error::new_spanned(
                &c.func,
                format!(
                    "unknown function `{other}` in forward: the builtins are swiglu, dropout, \
                     cross_entropy, rope, shift_left, loss_mask and aux_loss, the shape operations split, split_heads, narrow, \
                     cat, cat_heads and broadcast_heads, the element-wise functions {} (with \
                     `+ - * /`, fused into generated kernels), and fields are called as \
                     `self.field(x)` (a loop element only inside its loop); other math is an op \
                     of your own: a type implementing `megatron::module::Op` (or `MultiOp` for \
                     several inputs: its forward and backward) in a field marked #[op], called \
                     as `self.field(x)`",
                    pointwise::names()
                ),
            ));
        }
    };
    let (want, usage) = match builtin {
        Builtin::Gelu => (1, "gelu(x)"),
        Builtin::Swiglu => (1, "swiglu(x)"),
        Builtin::Dropout => (2, "dropout(x, p)"),
        Builtin::CrossEntropy => (2, "cross_entropy(logits, targets)"),
        Builtin::Rope => (2, "rope(x, cfg)"),
        Builtin::ShiftLeft => (1, "shift_left(ids)"),
        Builtin::LossMask => (1, "loss_mask(targets)"),
        Builtin::AuxLoss => (5, "aux_loss(x, losses, mask, weight, \"name\")"),
    };
    if c.args.len() != want {
        return Err(syn::Error::new_spanned(
            e,
            format!(
                "{} takes {want} argument{}, `{usage}`, not {}",
                builtin.name(),
                if want == 1 { "" } else { "s" },
                c.args.len()
            ),
        ));
    }
    let (args, p, label) = match builtin {
        Builtin::Dropout | Builtin::Rope => (
            vec![parse_expr(&c.args[0])?],
            Some(Box::new(c.args[1].clone())),
            None,
        ),
        Builtin::AuxLoss => {
            let label = match &c.args[4] {
                syn::Expr::Lit(syn::ExprLit {
                    lit: syn::Lit::Str(name),
                    ..
                }) if !name.value().is_empty() => name.clone(),
                other => {
                    return Err(syn::Error::new_spanned(
                        other,
                        "aux_loss's last argument is the loss's name in the step's metrics, a \
                         string literal such as \"mtp_1\"",
                    ));
                }
            };
            let tensors: Vec<syn::Expr> = c.args.iter().take(3).cloned().collect();
            let tensors = tensors.iter().map(parse_expr).collect::<syn::Result<_>>()?;
            (tensors, Some(Box::new(c.args[3].clone())), Some(label))
        }
        _ => (parse_args(&c.args)?, None, None),
    };
    Ok(Expr::Builtin {
        builtin,
        args,
        p,
        label,
        src: Src::of(e),
    })
}

/// `n thing` or `n things`.
pub(crate) fn plural(n: usize, thing: &str) -> String {
    if n == 1 {
        format!("one {thing}")
    } else {
        format!("{n} {thing}s")
    }
}

/// `select(a cmp b, x, y)`.
fn parse_select(c: &syn::ExprCall, e: &syn::Expr) -> syn::Result<Expr> {
    const USAGE: &str = "`select(a > b, x, y)`: `x` where the comparison holds, else `y` \
                         (`<`, `<=`, `>`, `>=` between tensors or scalars)";
    if c.args.len() != 3 {
        return Err(syn::Error::new_spanned(
            e,
            format!("select takes 3 arguments, {USAGE}"),
        ));
    }
    let mut cond = &c.args[0];
    while let syn::Expr::Paren(p) = cond {
        cond = &p.expr;
    }
    let syn::Expr::Binary(b) = cond else {
        return Err(syn::Error::new_spanned(
            cond,
            format!("select's first argument is a comparison, {USAGE}"),
        ));
    };
    let cmp = match b.op {
        syn::BinOp::Lt(_) => Cmp::Lt,
        syn::BinOp::Le(_) => Cmp::Le,
        syn::BinOp::Gt(_) => Cmp::Gt,
        syn::BinOp::Ge(_) => Cmp::Ge,
        _ => {
            return Err(syn::Error::new_spanned(
                cond,
                format!("select's first argument is a comparison, {USAGE}"),
            ));
        }
    };
    let args = [&*b.left, &*b.right, &c.args[1], &c.args[2]]
        .into_iter()
        .map(parse_expr)
        .collect::<syn::Result<Vec<_>>>()?;
    Ok(Expr::Select {
        cmp,
        args,
        src: Src::of(e),
    })
}

/// The #[config] fields a scalar expression reads, or `None` when `e` is not a scalar: a
/// numeric literal, `self.name` (not called), a constant (an upper-case name or a path), or
/// `-`, `+ - * /`, parentheses and `as` casts of scalars.
fn scalar_reads(e: &syn::Expr) -> Option<Vec<Ident>> {
    match e {
        syn::Expr::Lit(l) => match &l.lit {
            syn::Lit::Int(_) | syn::Lit::Float(_) => Some(Vec::new()),
            _ => None,
        },
        syn::Expr::Field(_) => self_field(e).map(|f| vec![f]),
        syn::Expr::Path(p) if p.qself.is_none() => {
            let segments = &p.path.segments;
            let last = segments.last()?.ident.to_string();
            let constant = last.len() > 1
                && last.chars().any(|c| c.is_ascii_uppercase())
                && last
                    .chars()
                    .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
            (constant && segments.iter().all(|s| s.arguments.is_none())).then(Vec::new)
        }
        syn::Expr::Paren(p) => scalar_reads(&p.expr),
        syn::Expr::Group(g) => scalar_reads(&g.expr),
        syn::Expr::Cast(c) => scalar_reads(&c.expr),
        syn::Expr::Unary(u) if matches!(u.op, syn::UnOp::Neg(_)) => scalar_reads(&u.expr),
        syn::Expr::Binary(b)
            if matches!(
                b.op,
                syn::BinOp::Add(_) | syn::BinOp::Sub(_) | syn::BinOp::Mul(_) | syn::BinOp::Div(_)
            ) =>
        {
            let mut reads = scalar_reads(&b.left)?;
            reads.extend(scalar_reads(&b.right)?);
            Some(reads)
        }
        _ => None,
    }
}

/// `let (a, b, ..) = split(x, [A, B, ..]);`, `split_heads`, `chunk(x, n)`, or the outputs of a
/// field call `self.name(..)` of a module returning several.
fn parse_let_parts(local: &syn::Local, t: &syn::PatTuple) -> syn::Result<Stmt> {
    const FORM: &str = "a tuple `let` binds the parts of `split(x, [A, B])`, \
                        `split_heads(x, [A, B])` or `chunk(x, 2)`, or the outputs of a module of \
                        yours that returns several: `let (a, b) = split(x, [A, B]);`, \
                        `let (q, k) = self.project(x);`";
    let mut names = Vec::new();
    for p in &t.elems {
        match p {
            syn::Pat::Ident(i)
                if i.by_ref.is_none() && i.subpat.is_none() && i.mutability.is_none() =>
            {
                names.push(i.ident.clone())
            }
            other => {
                return Err(syn::Error::new_spanned(
                    other,
                    format!("{FORM}, each part a plain name"),
                ));
            }
        }
    }
    let Some(init) = &local.init else {
        return Err(unsupported_statement(local, "a `let` without a value"));
    };
    let call = match &*init.expr {
        syn::Expr::Call(c) => c,
        syn::Expr::MethodCall(_) => {
            if names.len() < 2 {
                return Err(syn::Error::new_spanned(
                    t,
                    "a module's outputs are bound two or more at a time, \
                     `let (a, b) = self.name(x);`; a module of one output is bound by a name, \
                     `let a = self.name(x);`",
                ));
            }
            return match parse_expr(&init.expr)? {
                call @ Expr::FieldCall { .. } => Ok(Stmt::LetOutputs { names, call }),
                _ => Err(syn::Error::new_spanned(&init.expr, FORM)),
            };
        }
        other => return Err(syn::Error::new_spanned(other, FORM)),
    };
    let fname = plain_ident(&call.func)
        .map(|i| i.to_string())
        .unwrap_or_default();
    if !matches!(fname.as_str(), "split" | "split_heads" | "chunk") {
        return Err(syn::Error::new_spanned(&call.func, FORM));
    }
    let [x, second] = [call.args.first(), call.args.get(1)];
    let (Some(x), Some(second), 2) = (x, second, call.args.len()) else {
        let form = match fname.as_str() {
            "chunk" => "the value and the number of parts: `chunk(x, 2)`",
            _ => "the value and the parts' sizes: `{fname}(x, [A, B])`",
        };
        return Err(syn::Error::new_spanned(
            call,
            format!("{fname} takes {}", form.replace("{fname}", &fname)),
        ));
    };
    let (how, parts) = if fname == "chunk" {
        let n = match second {
            syn::Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Int(n),
                ..
            }) => n.clone(),
            other => {
                return Err(syn::Error::new_spanned(
                    other,
                    "chunk's number of parts is an integer literal, as many as the names bound: \
                     `let (a, b) = chunk(x, 2);`",
                ));
            }
        };
        let count = n.base10_parse::<usize>()?;
        (SplitHow::Chunks(n), count)
    } else {
        let sizes = size_list(second, &fname)?;
        let count = sizes.len();
        match fname.as_str() {
            "split" => (SplitHow::Sizes(sizes), count),
            _ => (SplitHow::Heads(sizes), count),
        }
    };
    if parts != names.len() {
        let unit = if fname == "chunk" { "parts" } else { "sizes" };
        return Err(syn::Error::new_spanned(
            t,
            format!(
                "{} names bind the parts of {fname} into {parts} {unit}: one name per part",
                names.len(),
            ),
        ));
    }
    Ok(Stmt::LetParts {
        names,
        split: Split {
            x: Box::new(parse_expr(x)?),
            how,
            src: Src::of(call),
        },
    })
}

/// `[A, B, ..]`: the sizes of `what`'s parts.
fn size_list(e: &syn::Expr, what: &str) -> syn::Result<Vec<syn::Expr>> {
    match e {
        syn::Expr::Array(a) if a.elems.len() >= 2 => Ok(a.elems.iter().cloned().collect()),
        _ => Err(syn::Error::new_spanned(
            e,
            format!("{what}'s sizes are an array of two or more `usize` values: `[A, B]`"),
        )),
    }
}

/// `narrow(x, start, len)`, `cat(a, b, ..)`, `cat_heads(a, b, .., [A, B, ..])`,
/// `broadcast_heads(x, heads)`.
fn parse_shape(name: &str, c: &syn::ExprCall, e: &syn::Expr) -> syn::Result<Expr> {
    let args: Vec<&syn::Expr> = c.args.iter().collect();
    let usage = |u: &str| syn::Error::new_spanned(e, format!("{name} takes {u}"));
    let (op, tensors, sizes) = match name {
        "narrow" => match args.as_slice() {
            [x, start, len] => (
                ShapeKind::Narrow,
                vec![*x],
                vec![(*start).clone(), (*len).clone()],
            ),
            _ => {
                return Err(usage(
                    "the value, the first feature and the length: `narrow(x, start, len)`",
                ));
            }
        },
        "cat" => {
            if args.len() < 2 {
                return Err(usage("two or more values: `cat(a, b)`"));
            }
            (ShapeKind::Cat, args, Vec::new())
        }
        "cat_heads" => match args.split_last() {
            Some((sizes, tensors)) if tensors.len() >= 2 => {
                let sizes = size_list(sizes, name)?;
                if sizes.len() != tensors.len() {
                    return Err(usage(&format!(
                        "one size per head for each value: {} values, {} sizes",
                        tensors.len(),
                        sizes.len()
                    )));
                }
                (ShapeKind::CatHeads, tensors.to_vec(), sizes)
            }
            _ => {
                return Err(usage(
                    "two or more values and their sizes per head: `cat_heads(a, b, [A, B])`",
                ));
            }
        },
        _ => match args.as_slice() {
            [x, heads] => (ShapeKind::BroadcastHeads, vec![*x], vec![(*heads).clone()]),
            _ => {
                return Err(usage(
                    "the value and the heads: `broadcast_heads(x, heads)`",
                ));
            }
        },
    };
    let args = tensors
        .into_iter()
        .map(parse_expr)
        .collect::<syn::Result<Vec<_>>>()?;
    Ok(Expr::Shape {
        op,
        args,
        sizes,
        src: Src::of(e),
    })
}
