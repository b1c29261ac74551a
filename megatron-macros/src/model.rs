//! The model: forward as an SSA dataflow graph.
//!
//! Every tensor computed in forward is one [`Value`], defined once (by an input or a [`Node`])
//! and used by later nodes or as the output. Variables are names for values: `let y = x;`
//! names the same value twice, a reassignment or a loop defines a new value. The backward
//! walks the nodes in reverse, and a value with several uses gets the sum of their gradients.

use std::collections::HashMap;

use syn::Ident;
use syn::ext::IdentExt;

use crate::parse::{Builtin, Expr, Forward, InputType, ShapeKind, SplitHow, Stmt};
use crate::pointwise::{Operand, Program, PwOp};
use crate::src_span::{Errors, Src};

/// Index of a value in [`Graph::values`].
pub type ValueId = usize;
/// Index of a node in [`Graph::nodes`].
pub type NodeId = usize;

/// A forward as a dataflow graph.
#[derive(Clone)]
pub struct Graph {
    /// The input values, in signature order.
    pub inputs: Vec<ValueId>,
    /// Every value.
    pub values: Vec<Value>,
    /// The operations, in evaluation order.
    pub nodes: Vec<Node>,
    /// The values forward returns: one, or several (`-> (Tensor, Tensor)`).
    pub outputs: Vec<ValueId>,
    /// forward's output expression.
    pub output_src: Src,
    /// The `self.name` scalars of element-wise math read (checked to be #[config] fields).
    pub config_reads: Vec<Ident>,
}

/// One value (a tensor or token ids).
#[derive(Debug, Clone)]
pub struct Value {
    /// The user's name for it (input name or first `let` binding), if any.
    pub name: Option<String>,
    /// What defines it.
    pub def: Def,
    /// Where it is defined.
    pub src: Src,
    /// Where it is used, in evaluation order.
    pub uses: Vec<Use>,
}

/// What defines a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Def {
    /// The `index`-th input of forward.
    Input {
        /// Position in the signature.
        index: usize,
        /// Its declared type.
        ty: InputType,
    },
    /// The output of a node.
    Node(NodeId),
}

/// A use of a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Use {
    /// Argument `arg` of node `node`.
    Arg {
        /// The using node.
        node: NodeId,
        /// The argument position.
        arg: usize,
    },
    /// Forward's output.
    Output,
}

/// One operation of forward.
#[derive(Clone)]
pub struct Node {
    /// What it does.
    pub op: NodeOp,
    /// Its tensor arguments.
    pub args: Vec<ValueId>,
    /// The source of each argument, for errors.
    pub arg_srcs: Vec<Src>,
    /// The value it defines.
    pub output: ValueId,
    /// The name of its call site: its field in the Saved struct and its `Site` child name
    /// (`fc1`, `gelu`, `dropout_1`, `wte_logits`); `None` for `+`, which saves nothing.
    pub site: Option<String>,
    /// The expression or statement.
    pub src: Src,
    /// For a row-parallel layer, its partial outputs are reduced by the [`NodeOp::RowSum`] that
    /// reads them; for a column-parallel layer, its input is gathered, and its input gradient
    /// reduced, by the [`NodeOp::SeqGather`] before it: one collective for several layers.
    pub deferred: bool,
}

/// The operation of a node.
#[derive(Clone)]
pub enum NodeOp {
    /// `self.field(args..)`.
    Field {
        /// The field.
        field: Ident,
    },
    /// `self.field.logits(h)`.
    Logits {
        /// The embedding field.
        field: Ident,
    },
    /// A builtin function.
    Builtin {
        /// Which.
        builtin: Builtin,
        /// dropout's probability, rope's config, aux_loss's weight.
        p: Option<Box<syn::Expr>>,
        /// aux_loss's name in the step's metrics.
        label: Option<syn::LitStr>,
    },
    /// `a + b`.
    Add,
    /// `a + dropout(b, p)` or `dropout(b, p) + a` in one pass: args `[a, b]`, the site is the
    /// dropout's (Megatron-LM's bias-dropout-add fusion; the mask and result are the unfused
    /// ones).
    DropoutAdd {
        /// dropout's probability expression.
        p: Box<syn::Expr>,
    },
    /// An element-wise operation: `a * b`, `relu(x)`, `x / 2.0`, `select(a > 0.0, x, y)`.
    Pointwise {
        /// Which.
        op: PwOp,
        /// Its operands: tensor arguments (`Operand::Input(k)`: the node's `k`-th argument) and
        /// scalars (`Operand::Scalar(k)`: `scalars[k]`).
        operands: Vec<Operand>,
        /// The scalar expressions, as written.
        scalars: Vec<syn::Expr>,
    },
    /// A chain of element-wise operations fused into one generated kernel each way (made by
    /// `fuse` from `Pointwise` nodes and the `+` and `gelu` around them); args are the chain's
    /// tensor inputs.
    Fused {
        /// The chain.
        program: Program,
        /// Its scalar expressions, as written.
        scalars: Vec<syn::Expr>,
        /// The chain's source, for docs and messages.
        formula: String,
    },
    /// A shape operation along the features (`ops::shape`): `narrow` (each part of `split`),
    /// `cat`, a part of `split_heads`, `cat_heads`, `broadcast_heads`.
    Shape {
        /// Which.
        op: ShapeKind,
        /// Its sizes, Rust expressions of `usize`.
        sizes: Vec<syn::Expr>,
        /// For a part of `split(x, [..])` or `chunk(x, n)`: which, and what the cut is (for
        /// messages: "split at sizes [A, B]").
        of_split: Option<(usize, String)>,
    },
    /// Output `index` of a field call returning several (`let (a, b) = self.name(x);`): its
    /// argument is the call's output, the tuple of them.
    Take {
        /// Which output.
        index: usize,
    },
    /// A sum of terms of which the first `partials` are row-parallel layers' partial outputs:
    /// they are summed, reduced over tp once (all-reduce, or with sequence parallelism
    /// reduce-scatter), their biases added, then the other terms.
    RowSum {
        /// How many of the arguments are partial outputs.
        partials: usize,
    },
    /// Megatron-LM's f once for several column-parallel layers reading one value: the identity
    /// (with sequence parallelism the all-gather of the shards) forward; backward, the all-reduce
    /// (reduce-scatter) of the sum of their input gradients.
    SeqGather,
    /// `elem(args..)` in a loop body ([`NodeOp::Body`]'s graph): the list's module of the
    /// iteration.
    Element {
        /// The `Vec` field.
        list: Ident,
        /// The element's name.
        elem: Ident,
    },
    /// A loop of several statements: `body` run once per module of `list`, in order. Its
    /// arguments are the carried variables' values before the loop (the body's first `carried`
    /// inputs) then the values the body reads from before it (its other inputs, the same at
    /// every iteration); its output, the carried variables' values after the loop (their
    /// [`NodeOp::Take`]s when there are several).
    Body {
        /// The `Vec` field.
        list: Ident,
        /// The element's name.
        elem: Ident,
        /// The body, as a graph of its own.
        body: Box<Graph>,
        /// The carried variables' names, in the body's input and output order.
        carried: Vec<String>,
    },
    /// `for elem in &self.list { var = elem(var); }`.
    Loop {
        /// The `Vec` field.
        list: Ident,
        /// The element's name.
        elem: Ident,
    },
}

/// A variable of forward: a name bound to a value.
struct Binding {
    value: ValueId,
    mutable: bool,
}

struct Builder {
    graph: Graph,
    env: HashMap<String, Binding>,
    sites: Vec<String>,
    errors: Errors,
    /// In a loop body: the variables before the loop, read as the body's further inputs (each
    /// outer value once: its input here).
    outer: Option<Outer>,
}

/// What a loop body reads from before the loop.
struct Outer {
    /// The enclosing forward's variables.
    env: HashMap<String, ValueId>,
    /// The outer values read, in the body's input order after the carried ones.
    read: Vec<ValueId>,
    /// The element's name and its list.
    elem: Ident,
    list: Ident,
}

/// Builds the graph of a forward; errors name unknown and immutable variables.
pub fn build(forward: &Forward) -> syn::Result<Graph> {
    let mut b = Builder {
        graph: Graph {
            inputs: Vec::new(),
            values: Vec::new(),
            nodes: Vec::new(),
            outputs: Vec::new(),
            output_src: match forward.outputs.as_slice() {
                [one] => one.src(),
                _ => forward.returns.clone(),
            },
            config_reads: Vec::new(),
        },
        env: HashMap::new(),
        sites: Vec::new(),
        errors: Errors::default(),
        outer: None,
    };
    for (index, input) in forward.inputs.iter().enumerate() {
        let name = input.ident.unraw().to_string();
        if b.env.contains_key(&name) {
            b.errors.push(syn::Error::new_spanned(
                &input.ident,
                format!("forward has two inputs named `{name}`"),
            ));
            continue;
        }
        let v = b.new_value(
            Some(name.clone()),
            Def::Input {
                index,
                ty: input.ty,
            },
            input.src.clone(),
        );
        b.graph.inputs.push(v);
        b.env.insert(
            name,
            Binding {
                value: v,
                mutable: false,
            },
        );
    }
    for stmt in &forward.stmts {
        b.stmt(stmt);
    }
    let outputs: Vec<Option<ValueId>> = forward.outputs.iter().map(|o| b.expr(o)).collect();
    let mut graph = b.graph;
    graph.outputs = outputs.into_iter().flatten().collect();
    b.errors.finish(())?;
    record_uses(&mut graph);
    Ok(graph)
}

/// Each value's uses, in evaluation order.
fn record_uses(graph: &mut Graph) {
    for n in 0..graph.nodes.len() {
        for (arg, &v) in graph.nodes[n].args.clone().iter().enumerate() {
            graph.values[v].uses.push(Use::Arg { node: n, arg });
        }
    }
    for &v in &graph.outputs.clone() {
        graph.values[v].uses.push(Use::Output);
    }
}

/// The names a loop body assigns (`name = expr;`), in order of their first assignment.
fn assigned(stmts: &[Stmt]) -> Vec<Ident> {
    let mut names: Vec<Ident> = Vec::new();
    for stmt in stmts {
        if let Stmt::Assign { name, .. } = stmt
            && !names.iter().any(|n| n.unraw() == name.unraw())
        {
            names.push(name.clone());
        }
    }
    names
}

/// `base`, or the first of `base_1`, `base_2`, ... not among `sites`, added to them.
pub(crate) fn unique_site(sites: &mut Vec<String>, base: &str) -> String {
    let mut name = base.to_string();
    let mut k = 0;
    while sites.contains(&name) {
        k += 1;
        name = format!("{base}_{k}");
    }
    sites.push(name.clone());
    name
}

impl Graph {
    /// The value forward returns, for a forward of one output (a pipelined module's, whose
    /// stages pass one tensor on).
    pub fn output(&self) -> ValueId {
        self.outputs[0]
    }

    /// How many outputs node `n` returns: the [`NodeOp::Take`]s of its output (1 for a node
    /// whose output is one tensor).
    pub fn outputs_of(&self, n: NodeId) -> usize {
        let v = self.nodes[n].output;
        let takes = self.values[v]
            .uses
            .iter()
            .filter(|u| match u {
                Use::Arg { node, .. } => matches!(self.nodes[*node].op, NodeOp::Take { .. }),
                Use::Output => false,
            })
            .count();
        takes.max(1)
    }
}

impl Builder {
    fn new_value(&mut self, name: Option<String>, def: Def, src: Src) -> ValueId {
        self.graph.values.push(Value {
            name,
            def,
            src,
            uses: Vec::new(),
        });
        self.graph.values.len() - 1
    }

    /// A unique call-site name: `base`, then `base_1`, `base_2`, ...
    fn site(&mut self, base: &str) -> String {
        unique_site(&mut self.sites, base)
    }

    fn node(
        &mut self,
        op: NodeOp,
        args: Vec<(ValueId, Src)>,
        site: Option<String>,
        src: Src,
    ) -> ValueId {
        let n = self.graph.nodes.len();
        let output = self.new_value(None, Def::Node(n), src.clone());
        let (args, arg_srcs) = args.into_iter().unzip();
        self.graph.nodes.push(Node {
            op,
            args,
            arg_srcs,
            output,
            site,
            src,
            deferred: false,
        });
        output
    }

    fn lookup(&mut self, ident: &Ident) -> Option<&Binding> {
        let name = ident.unraw().to_string();
        // In a loop body, a value from before the loop becomes an input of the body.
        if !self.env.contains_key(&name)
            && let Some(outer) = &mut self.outer
            && let Some(&v) = outer.env.get(&name)
        {
            outer.read.push(v);
            let index = self.graph.inputs.len();
            let input = self.new_value(
                Some(name.clone()),
                Def::Input {
                    index,
                    ty: InputType::Tensor,
                },
                Src::of(ident),
            );
            self.graph.inputs.push(input);
            self.env.insert(
                name.clone(),
                Binding {
                    value: input,
                    mutable: false,
                },
            );
        }
        if !self.env.contains_key(&name) {
            let known: Vec<_> = {
                let mut k: Vec<_> = self.env.keys().cloned().collect();
                k.sort();
                k
            };
            self.errors.push(syn::Error::new_spanned(
                ident,
                format!(
                    "cannot find `{name}` in forward: it is neither an input nor bound by a `let` \
                     above (known here: {})",
                    if known.is_empty() {
                        "none".to_string()
                    } else {
                        known.join(", ")
                    }
                ),
            ));
            return None;
        }
        self.env.get(&name)
    }

    /// Binds `name` to `v` (naming the value after it if it has no name yet).
    fn bind(&mut self, name: &Ident, v: ValueId, mutable: bool) {
        self.name_value(v, name);
        self.env
            .insert(name.unraw().to_string(), Binding { value: v, mutable });
    }

    /// Names `v` after `name` if it has no name yet.
    fn name_value(&mut self, v: ValueId, name: &Ident) {
        let value = &mut self.graph.values[v];
        if value.name.is_none() {
            value.name = Some(name.unraw().to_string());
        }
    }

    fn stmt(&mut self, stmt: &Stmt) {
        match stmt {
            Stmt::Let {
                name,
                mutable,
                expr,
            } => {
                let Some(v) = self.expr(expr) else { return };
                self.bind(name, v, *mutable);
            }
            Stmt::LetOutputs { names, call } => {
                let Some(t) = self.expr(call) else { return };
                let src = call.src();
                for (index, name) in names.iter().enumerate() {
                    let op = NodeOp::Take { index };
                    let v = self.node(op, vec![(t, src.clone())], None, Src::of(name));
                    self.bind(name, v, false);
                }
            }
            Stmt::LetParts { names, split } => {
                let Some(x) = self.expr(&split.x) else { return };
                let arg_src = split.x.src();
                // What a part is cut by, for messages, and its call sites' name.
                let (what, base) = match &split.how {
                    SplitHow::Heads(_) => (None, "split_heads"),
                    SplitHow::Chunks(n) => (Some(format!("chunked into {n} equal parts")), "chunk"),
                    SplitHow::Sizes(sizes) => {
                        let texts: Vec<String> = sizes.iter().map(|e| Src::of(e).text()).collect();
                        (
                            Some(format!("split at sizes [{}]", texts.join(", "))),
                            "split",
                        )
                    }
                };
                for (k, name) in names.iter().enumerate() {
                    let (op, sizes) = match &split.how {
                        SplitHow::Heads(sizes) => (ShapeKind::HeadPart(k), sizes.clone()),
                        SplitHow::Chunks(n) => {
                            (ShapeKind::ChunkPart(k), vec![syn::parse_quote!(#n)])
                        }
                        SplitHow::Sizes(sizes) => {
                            let before = &sizes[..k];
                            let start: syn::Expr = if before.is_empty() {
                                syn::parse_quote!(0)
                            } else {
                                syn::parse_quote!(#(#before)+*)
                            };
                            (ShapeKind::Narrow, vec![start, sizes[k].clone()])
                        }
                    };
                    let of_split = what.clone().map(|w| (k, w));
                    let site = self.site(base);
                    let shape = NodeOp::Shape {
                        op,
                        sizes,
                        of_split,
                    };
                    let v = self.node(
                        shape,
                        vec![(x, arg_src.clone())],
                        Some(site),
                        split.src.clone(),
                    );
                    self.bind(name, v, false);
                }
            }
            Stmt::Assign { name, expr, src } => {
                let value = self.expr(expr);
                let Some(binding) = self.lookup(name) else {
                    return;
                };
                if !binding.mutable {
                    self.errors.push(src.error(format!(
                        "`{}` is assigned but not declared `let mut`",
                        name.unraw()
                    )));
                    return;
                }
                let Some(v) = value else { return };
                self.name_value(v, name);
                self.env
                    .get_mut(&name.unraw().to_string())
                    .expect("looked up")
                    .value = v;
            }
            Stmt::Body {
                elem,
                list,
                stmts,
                src,
            } => self.body(elem, list, stmts, src),
            Stmt::Loop {
                elem,
                list,
                var,
                src,
            } => {
                let Some(binding) = self.lookup(var) else {
                    return;
                };
                if !binding.mutable {
                    self.errors.push(syn::Error::new_spanned(
                        var,
                        format!(
                            "the loop assigns `{}`, which is not declared `let mut`",
                            var.unraw()
                        ),
                    ));
                    return;
                }
                let input = binding.value;
                let site = self.site(&list.unraw().to_string());
                let v = self.node(
                    NodeOp::Loop {
                        list: list.clone(),
                        elem: elem.clone(),
                    },
                    vec![(input, Src::of(var))],
                    Some(site),
                    src.clone(),
                );
                self.name_value(v, var);
                self.env
                    .get_mut(&var.unraw().to_string())
                    .expect("looked up")
                    .value = v;
            }
        }
    }

    /// A loop of several statements: its body built as a graph of its own (the carried
    /// variables its first inputs and its outputs, what it reads from before the loop its
    /// further inputs), then one node running it over the list.
    fn body(&mut self, elem: &Ident, list: &Ident, stmts: &[Stmt], src: &Src) {
        if self.outer.is_some() {
            self.errors
                .push(src.error("a loop body cannot hold another loop".to_string()));
            return;
        }
        let carried = assigned(stmts);
        let mut starts = Vec::new();
        for name in &carried {
            let Some(binding) = self.lookup(name) else {
                return;
            };
            if !binding.mutable {
                self.errors.push(syn::Error::new_spanned(
                    name,
                    format!(
                        "the loop body assigns `{}`, which is carried from one module of `{}` to \
                         the next: declare it `let mut` before the loop",
                        name.unraw(),
                        list.unraw()
                    ),
                ));
                return;
            }
            starts.push((binding.value, Src::of(name)));
        }
        if carried.is_empty() {
            self.errors.push(src.error(format!(
                "the loop body assigns no variable declared before it, so nothing of it would \
                 be used: a loop carries what it assigns, `h = {}(h);`",
                elem.unraw()
            )));
            return;
        }
        let mut inner = Builder {
            graph: Graph {
                inputs: Vec::new(),
                values: Vec::new(),
                nodes: Vec::new(),
                outputs: Vec::new(),
                output_src: src.clone(),
                config_reads: Vec::new(),
            },
            env: HashMap::new(),
            sites: Vec::new(),
            errors: Errors::default(),
            outer: Some(Outer {
                env: self.env.iter().map(|(k, b)| (k.clone(), b.value)).collect(),
                read: Vec::new(),
                elem: elem.clone(),
                list: list.clone(),
            }),
        };
        for (index, name) in carried.iter().enumerate() {
            let v = inner.new_value(
                Some(name.unraw().to_string()),
                Def::Input {
                    index,
                    ty: InputType::Tensor,
                },
                Src::of(name),
            );
            inner.graph.inputs.push(v);
            inner.bind(name, v, true);
        }
        for stmt in stmts {
            inner.stmt(stmt);
        }
        let outputs: Vec<ValueId> = carried
            .iter()
            .map(|name| inner.env[&name.unraw().to_string()].value)
            .collect();
        inner.graph.outputs = outputs;
        let Builder {
            mut graph,
            errors,
            outer,
            ..
        } = inner;
        if let Err(e) = errors.finish(()) {
            self.errors.push(e);
            return;
        }
        record_uses(&mut graph);
        // The body's call sites under the list's name: its Saved fields and fused kernels
        // apart from the forward's own.
        let prefix = list.unraw().to_string();
        for node in &mut graph.nodes {
            if let Some(site) = &mut node.site {
                *site = format!("{prefix}_{site}");
            }
        }
        let read = outer.expect("a body's").read;
        let mut args = starts;
        args.extend(read.into_iter().map(|v| (v, src.clone())));
        let names: Vec<String> = carried.iter().map(|n| n.unraw().to_string()).collect();
        let site = self.site(&list.unraw().to_string());
        let op = NodeOp::Body {
            list: list.clone(),
            elem: elem.clone(),
            body: Box::new(graph),
            carried: names,
        };
        let out = self.node(op, args, Some(site), src.clone());
        if carried.len() == 1 {
            self.name_value(out, &carried[0]);
            self.rebind(&carried[0], out);
            return;
        }
        for (index, name) in carried.iter().enumerate() {
            let v = self.node(
                NodeOp::Take { index },
                vec![(out, src.clone())],
                None,
                Src::of(name),
            );
            self.name_value(v, name);
            self.rebind(name, v);
        }
    }

    /// Points the `let mut` variable `name` at `v`.
    fn rebind(&mut self, name: &Ident, v: ValueId) {
        if let Some(b) = self.env.get_mut(&name.unraw().to_string()) {
            b.value = v;
        }
    }

    fn args(&mut self, args: &[Expr]) -> Option<Vec<(ValueId, Src)>> {
        let mut out = Vec::new();
        let mut ok = true;
        for a in args {
            match self.expr(a) {
                Some(v) => out.push((v, a.src())),
                None => ok = false,
            }
        }
        ok.then_some(out)
    }

    /// The fused node of `residual + dropout(branch, p)`, `args = [residual, branch]`.
    fn dropout_add(
        &mut self,
        p: &syn::Expr,
        args: Vec<(ValueId, Src)>,
        site: String,
        src: &Src,
    ) -> ValueId {
        let op = NodeOp::DropoutAdd {
            p: Box::new(p.clone()),
        };
        self.node(op, args, Some(site), src.clone())
    }

    /// The value of an expression (new nodes in evaluation order); `None` after an error.
    fn expr(&mut self, expr: &Expr) -> Option<ValueId> {
        match expr {
            Expr::Var(ident) => self.lookup(ident).map(|b| b.value),
            Expr::FieldCall { field, args, src } => {
                let args = self.args(args)?;
                let site = self.site(&field.unraw().to_string());
                Some(self.node(
                    NodeOp::Field {
                        field: field.clone(),
                    },
                    args,
                    Some(site),
                    src.clone(),
                ))
            }
            Expr::Logits { field, args, src } => {
                let args = self.args(args)?;
                let site = self.site(&format!("{}_logits", field.unraw()));
                Some(self.node(
                    NodeOp::Logits {
                        field: field.clone(),
                    },
                    args,
                    Some(site),
                    src.clone(),
                ))
            }
            Expr::Builtin {
                builtin,
                args,
                p,
                label,
                src,
            } => {
                let args = self.args(args)?;
                // The data builtins keep nothing and have no backward: no call site.
                let site = match builtin {
                    Builtin::ShiftLeft | Builtin::LossMask => None,
                    _ => Some(self.site(builtin.name())),
                };
                Some(self.node(
                    NodeOp::Builtin {
                        builtin: *builtin,
                        p: p.clone(),
                        label: label.clone(),
                    },
                    args,
                    site,
                    src.clone(),
                ))
            }
            Expr::Element { elem, args, src } => {
                let args = self.args(args)?;
                let Some(outer) = &self.outer else {
                    self.errors.push(src.error(format!(
                        "`{}` is a loop's element: call it inside its loop",
                        elem.unraw()
                    )));
                    return None;
                };
                let list = outer.list.clone();
                let elem = outer.elem.clone();
                let site = self.site(&elem.unraw().to_string());
                Some(self.node(
                    NodeOp::Element { list, elem },
                    args,
                    Some(site),
                    src.clone(),
                ))
            }
            Expr::Arith { op, lhs, rhs, src } => self.pointwise(*op, &[lhs, rhs], src),
            Expr::Neg { arg, src } => self.pointwise(PwOp::Neg, &[arg], src),
            Expr::Pointwise { func, args, src } => {
                let args: Vec<&Expr> = args.iter().collect();
                self.pointwise(PwOp::Func(*func), &args, src)
            }
            Expr::Select { cmp, args, src } => {
                let args: Vec<&Expr> = args.iter().collect();
                self.pointwise(PwOp::Select(*cmp), &args, src)
            }
            Expr::Shape {
                op,
                args,
                sizes,
                src,
            } => {
                let args = self.args(args)?;
                let site = self.site(op.name());
                let op = NodeOp::Shape {
                    op: *op,
                    sizes: sizes.clone(),
                    of_split: None,
                };
                Some(self.node(op, args, Some(site), src.clone()))
            }
            Expr::Scalar { expr, config } => {
                let message = match (config.as_slice(), crate::parse::self_field(expr).is_some()) {
                    ([field], true) => format!(
                        "`self.{0}` is used without a call; forward calls fields, \
                         `self.{0}(x)` (#[config] values are scalars: operands of element-wise \
                         math, or where a Rust value is expected, such as dropout's probability)",
                        field.unraw()
                    ),
                    _ => "this is a scalar, where forward needs a tensor (scalars are operands \
                          of element-wise math: `x * 2.0`)"
                        .to_string(),
                };
                self.errors.push(syn::Error::new_spanned(expr, message));
                None
            }
            Expr::Add { lhs, rhs, src } => {
                // A dropout on either side fuses with the sum (the right one when both are);
                // sites are named in evaluation order, as without the fusion.
                if let Some((x, p)) = dropout_call(rhs) {
                    let a = self.expr(lhs);
                    let b = self.expr(x);
                    let site = self.site(Builtin::Dropout.name());
                    let args = vec![(a?, lhs.src()), (b?, x.src())];
                    return Some(self.dropout_add(p, args, site, src));
                }
                if let Some((x, p)) = dropout_call(lhs) {
                    let b = self.expr(x);
                    let site = self.site(Builtin::Dropout.name());
                    let a = self.expr(rhs);
                    let args = vec![(a?, rhs.src()), (b?, x.src())];
                    return Some(self.dropout_add(p, args, site, src));
                }
                let a = self.expr(lhs);
                let b = self.expr(rhs);
                let (a, b) = (a?, b?);
                Some(self.node(
                    NodeOp::Add,
                    vec![(a, lhs.src()), (b, rhs.src())],
                    None,
                    src.clone(),
                ))
            }
        }
    }
}

/// An operand of element-wise math: a tensor value, or a scalar expression.
enum Opd {
    Value(ValueId, Src),
    Scalar(syn::Expr),
}

impl Builder {
    fn operand(&mut self, e: &Expr) -> Option<Opd> {
        match e {
            Expr::Scalar { expr, config } => {
                self.graph.config_reads.extend(config.iter().cloned());
                Some(Opd::Scalar((**expr).clone()))
            }
            _ => self.expr(e).map(|v| Opd::Value(v, e.src())),
        }
    }

    /// The node of an element-wise operation on `args`, at least one of them a tensor.
    fn pointwise(&mut self, op: PwOp, args: &[&Expr], src: &Src) -> Option<ValueId> {
        let opds: Vec<Option<Opd>> = args.iter().map(|a| self.operand(a)).collect();
        let opds: Vec<Opd> = opds.into_iter().collect::<Option<_>>()?;
        let (mut operands, mut tensors, mut scalars) = (Vec::new(), Vec::new(), Vec::new());
        for o in opds {
            match o {
                Opd::Value(v, src) => {
                    operands.push(Operand::Input(tensors.len()));
                    tensors.push((v, src));
                }
                Opd::Scalar(e) => match crate::pointwise::literal_value(&e) {
                    Some(v) => operands.push(Operand::Const(v.to_bits())),
                    None => {
                        operands.push(Operand::Scalar(scalars.len()));
                        scalars.push(e);
                    }
                },
            }
        }
        if tensors.is_empty() {
            self.errors.push(src.error(
                "element-wise math in forward needs a tensor operand: this is all scalars \
                 (compute it in Rust, in a #[config] value or a constant)",
            ));
            return None;
        }
        let site = self.site(op.site_name());
        let op = NodeOp::Pointwise {
            op,
            operands,
            scalars,
        };
        Some(self.node(op, tensors, Some(site), src.clone()))
    }
}

/// `dropout(x, p)`'s tensor argument and probability, if `expr` is that call.
fn dropout_call(expr: &Expr) -> Option<(&Expr, &syn::Expr)> {
    match expr {
        Expr::Builtin {
            builtin: Builtin::Dropout,
            args,
            p: Some(p),
            ..
        } => match args.as_slice() {
            [x] => Some((x, &**p)),
            _ => None,
        },
        _ => None,
    }
}
