//! Validation: fields exist and are called as their kind allows, and every value's sharding
//! over tensor parallelism fits where it goes.
//!
//! A value is replicated (whole on every rank), split (each rank holds its slice of the last
//! dimension) or token ids. The rules are Megatron-LM's: a column-parallel layer turns a
//! replicated input into a split output, a row-parallel layer a split input into a replicated
//! output, and so on. Errors name the field, the value, where its sharding came from, and the fix.

use syn::ext::IdentExt;

use crate::generate::kind_of;
use crate::model::{Def, Graph, Node, NodeId, NodeOp, ValueId};
use crate::parse::{Builtin, Field, FieldKind, InputType, ModuleImpl, ModuleStruct, ShapeKind};
use crate::pointwise::{Func, Operand, PwOp};
use crate::src_span::{Errors, Src};

/// How a value is held across the tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharding {
    /// Whole on every rank.
    Replicated,
    /// Each rank holds its slice of the last dimension.
    Split,
    /// Token ids (no gradient).
    Ids,
}

/// What validation learned: each value's sharding and each node's field.
#[derive(Debug)]
pub struct Analysis {
    /// Per value.
    pub sharding: Vec<Sharding>,
    /// Per node: the index of the field it calls (field calls, logits, loops).
    pub field: Vec<Option<usize>>,
}

/// Where a value's sharding came from.
#[derive(Clone)]
pub(crate) struct Origin {
    /// A clause for messages, e.g. "it comes from #[column_parallel] `fc1`".
    pub(crate) text: String,
    /// The column-parallel field whose output it is (for the gather_output fix).
    pub(crate) column: Option<String>,
}

/// The sharding analysis under way: what each value is known to be, and the errors so far.
pub(crate) struct Checker<'a> {
    pub(crate) s: &'a ModuleStruct,
    pub(crate) g: &'a Graph,
    pub(crate) sharding: Vec<Option<Sharding>>,
    pub(crate) origin: Vec<Option<Origin>>,
    field: Vec<Option<usize>>,
    pub(crate) errors: Errors,
    /// Per loop body's node, the shardings of its outputs (for their takes).
    body_outputs: std::collections::HashMap<NodeId, Vec<Sharding>>,
    /// Checking a loop body (its inputs: the carried variables and what it reads).
    in_body: bool,
}

/// A call of a field in forward: what a kind's sharding rule reads of it.
pub(crate) struct FieldCall<'a> {
    /// The call's node.
    pub(crate) n: NodeId,
    /// The node itself.
    pub(crate) node: &'a Node,
    /// The field called.
    pub(crate) field: &'a Field,
    /// The field's name, for messages.
    pub(crate) name: String,
}

impl<'a> FieldCall<'a> {
    /// Argument `i`: its value and its source.
    pub(crate) fn arg(&self, i: usize) -> (ValueId, &'a Src) {
        (self.node.args[i], &self.node.arg_srcs[i])
    }

    /// The value the call defines.
    pub(crate) fn out(&self) -> ValueId {
        self.node.output
    }
}

/// A forward of several outputs is not a pipelined module's (its stages pass one tensor on).
pub fn outputs(s: &ModuleStruct, imp: &ModuleImpl) -> syn::Result<()> {
    match (imp.forward.outputs.len(), s.pipeline_field()) {
        (n, Some(p)) if n > 1 => Err(imp.forward.returns.error(format!(
            "a module with a #[pipeline] stack (`{}`) returns one tensor (its stages pass one \
             on), and this forward returns {n}",
            s.fields[p].name()
        ))),
        _ => Ok(()),
    }
}

/// Checks the graph against the struct's fields.
pub fn validate(s: &ModuleStruct, g: &Graph) -> syn::Result<Analysis> {
    validate_with(s, g, None)
}

/// [`validate`], the inputs sharded as `inputs` says (a loop body's: as the values before the
/// loop are) instead of as their types say.
pub fn validate_with(
    s: &ModuleStruct,
    g: &Graph,
    inputs: Option<&[(Sharding, Origin)]>,
) -> syn::Result<Analysis> {
    let mut c = Checker {
        s,
        g,
        sharding: vec![None; g.values.len()],
        origin: vec![None; g.values.len()],
        field: vec![None; g.nodes.len()],
        errors: Errors::default(),
        body_outputs: std::collections::HashMap::new(),
        in_body: inputs.is_some(),
    };
    for (i, &v) in g.inputs.iter().enumerate() {
        let Def::Input { ty, .. } = g.values[v].def else {
            unreachable!("inputs are inputs")
        };
        let (sh, text) = match (inputs, ty) {
            (Some(given), _) => (given[i].0, given[i].1.text.clone()),
            (None, InputType::Tensor) => (
                Sharding::Replicated,
                "forward's `Tensor` inputs are replicated".to_string(),
            ),
            (None, InputType::Ids) => (Sharding::Ids, "it is an `Ids` input".to_string()),
        };
        c.sharding[v] = Some(sh);
        c.origin[v] = Some(Origin { text, column: None });
    }
    for n in 0..g.nodes.len() {
        c.node(n);
    }
    // A loop body's outputs are its carried variables, checked against what they came in as.
    if inputs.is_none() {
        c.outputs();
    }
    c.unused();
    c.config_reads();
    let Checker {
        sharding,
        field,
        errors,
        ..
    } = c;
    errors.finish(())?;
    Ok(Analysis {
        sharding: sharding
            .into_iter()
            .map(|s| s.expect("every value has a sharding when there is no error"))
            .collect(),
        field,
    })
}

/// A sharding in words.
fn describe_sharding(s: Sharding) -> &'static str {
    match s {
        Sharding::Replicated => "replicated",
        Sharding::Split => "split over tensor parallel",
        Sharding::Ids => "token ids (or a mask)",
    }
}

/// What the sharding rule of a call expects of an argument.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Want {
    Replicated,
    Split,
    /// Replicated or split (ops, element-wise builtins).
    Tensor,
    /// Ids or a replicated tensor (replicated layers and sub-modules).
    ReplicatedOrIds,
}

impl Checker<'_> {
    pub(crate) fn describe(&self, v: ValueId) -> String {
        let value = &self.g.values[v];
        if let Some(name) = &value.name {
            return format!("`{name}`");
        }
        match value.def {
            Def::Input { .. } => "the input".into(),
            Def::Node(n) => match &self.g.nodes[n].op {
                NodeOp::Field { field } => format!("the output of `self.{}(..)`", field.unraw()),
                NodeOp::Logits { field } => {
                    format!("the output of `self.{}.logits(..)`", field.unraw())
                }
                NodeOp::Builtin { builtin, .. } => format!("the output of {}", builtin.name()),
                NodeOp::Add | NodeOp::DropoutAdd { .. } => "the sum".into(),
                NodeOp::Pointwise { op, .. } => format!("the output of `{}`", op.site_name()),
                NodeOp::Fused { formula, .. } => format!("`{formula}`"),
                NodeOp::RowSum { .. } => "the sum".into(),
                NodeOp::Shape { op, .. } => format!("the output of {}", op.name()),
                NodeOp::SeqGather => "the gathered input".into(),
                NodeOp::Loop { list, .. } | NodeOp::Body { list, .. } => {
                    format!("the output of the `{}` loop", list.unraw())
                }
                NodeOp::Element { elem, .. } => format!("the output of `{}(..)`", elem.unraw()),
                NodeOp::Take { index } => format!("output {index} of the call"),
            },
        }
    }

    pub(crate) fn set(&mut self, v: ValueId, sharding: Sharding, origin: Origin) {
        self.sharding[v] = Some(sharding);
        self.origin[v] = Some(origin);
    }

    pub(crate) fn origin_text(&self, v: ValueId) -> String {
        self.origin[v]
            .as_ref()
            .map_or_else(String::new, |o| o.text.clone())
    }

    /// How to make the split value `v` replicated.
    fn replicate_fix(&self, v: ValueId) -> String {
        match self.origin[v].as_ref().and_then(|o| o.column.clone()) {
            Some(f) => format!(
                "write `#[column_parallel(gather_output = true)]` on `{f}` to gather its output, or \
                 feed it to a #[row_parallel] layer first"
            ),
            None => "feed it to a #[row_parallel] layer first, which all-reduces it".to_string(),
        }
    }

    /// Checks argument `v` (source `src`) of `who` against `want`; `None` if its sharding is
    /// unknown after an earlier error.
    pub(crate) fn arg(&mut self, who: &str, want: Want, v: ValueId, src: &Src) -> Option<Sharding> {
        let sh = self.sharding[v]?;
        let d = self.describe(v);
        let origin = self.origin_text(v);
        let message = match (want, sh) {
            (Want::Tensor, Sharding::Replicated | Sharding::Split)
            | (Want::Replicated, Sharding::Replicated)
            | (Want::Split, Sharding::Split)
            | (Want::ReplicatedOrIds, Sharding::Replicated | Sharding::Ids) => return Some(sh),
            (_, Sharding::Ids) => format!(
                "{who} needs a tensor, but {d} is token ids (`Ids`); ids go to embeddings and to \
                 cross_entropy's targets"
            ),
            (Want::Split, Sharding::Replicated) => format!(
                "{who} needs its input split over tensor parallel (the output of a \
                 #[column_parallel] layer), but {d} is replicated ({origin}); write \
                 `#[row_parallel(input_is_parallel = false)]` to split it here"
            ),
            (Want::Replicated | Want::ReplicatedOrIds, Sharding::Split) => {
                let fix = if who.starts_with("#[row_parallel") {
                    "remove `input_is_parallel = false` to take the split input as it is".into()
                } else if who.contains("no split attribute") {
                    format!(
                        "{}; or, if the field is an op that works on each rank's part (an `Op`, \
                         such as attention on its heads), mark it #[op]",
                        self.replicate_fix(v)
                    )
                } else {
                    self.replicate_fix(v)
                };
                format!(
                    "{who} needs a replicated input, but {d} is split over tensor parallel \
                     ({origin}); {fix}"
                )
            }
        };
        self.errors.push(src.error(message));
        None
    }

    pub(crate) fn arity(&mut self, n: NodeId, who: &str, want: usize) -> bool {
        let node = &self.g.nodes[n];
        if node.args.len() == want {
            return true;
        }
        self.errors.push(node.src.error(format!(
            "{who} takes {} input{}, not {}",
            if want == 1 { "one" } else { "two" },
            if want == 1 { "" } else { "s" },
            node.args.len()
        )));
        false
    }

    fn find_field(&mut self, ident: &syn::Ident) -> Option<usize> {
        let name = ident.unraw().to_string();
        if let Some(i) = self.s.fields.iter().position(|f| f.name() == name) {
            return Some(i);
        }
        let names: Vec<_> = self.s.fields.iter().map(|f| f.name()).collect();
        self.errors.push(syn::Error::new_spanned(
            ident,
            format!(
                "`{}` has no field `{name}` (its fields: {})",
                self.s.ident,
                if names.is_empty() {
                    "none".into()
                } else {
                    names.join(", ")
                }
            ),
        ));
        None
    }

    fn node(&mut self, n: NodeId) {
        let g = self.g;
        let node = &g.nodes[n];
        let out = node.output;
        let arg = |i: usize| (node.args[i], &node.arg_srcs[i]);
        match &node.op {
            NodeOp::Field { field } => {
                let Some(fi) = self.find_field(field) else {
                    return;
                };
                self.field[n] = Some(fi);
                let field = &self.s.fields[fi];
                let call = FieldCall {
                    n,
                    node,
                    field,
                    name: field.name(),
                };
                kind_of(&field.kind).check_call(self, &call);
                let outputs = g.outputs_of(n);
                if outputs > 1 {
                    self.several_outputs(n, outputs);
                }
            }
            NodeOp::Take { index } => {
                // Each output of a module's call is sharded as the call says (whole on every
                // rank; a #[local] module's, split); a loop body's as the body leaves it.
                let (t, _) = arg(0);
                let body = match g.values[t].def {
                    Def::Node(b) => self.body_outputs.get(&b).map(|o| o[*index]),
                    Def::Input { .. } => None,
                };
                if let (Some(sh), Some(origin)) = (self.sharding[t], self.origin[t].clone()) {
                    self.set(out, body.unwrap_or(sh), origin);
                }
            }
            NodeOp::Element { list, elem } => {
                let Some(fi) = self.stack_field(list) else {
                    return;
                };
                self.field[n] = Some(fi);
                let who = format!(
                    "`{}` (a module of `{}`, whole on every rank)",
                    elem.unraw(),
                    list.unraw()
                );
                for i in 0..node.args.len() {
                    let (v, src) = arg(i);
                    self.arg(&who, Want::ReplicatedOrIds, v, src);
                }
                let text = format!(
                    "it comes from `{}(..)`, a module of `{}`",
                    elem.unraw(),
                    list.unraw()
                );
                self.set(out, Sharding::Replicated, Origin { text, column: None });
            }
            NodeOp::Body {
                list,
                body,
                carried,
                ..
            } => self.body(n, list, body, carried),
            NodeOp::Logits { field } => {
                let Some(fi) = self.find_field(field) else {
                    return;
                };
                self.field[n] = Some(fi);
                let f = &self.s.fields[fi];
                let name = f.name();
                if !matches!(f.kind, FieldKind::Vocab) {
                    self.errors.push(node.src.error(format!(
                        "`.logits` is the tied output layer of a #[vocab_parallel] embedding, but \
                         `{name}` is {}",
                        f.kind.attribute()
                    )));
                    return;
                }
                let who = format!("`self.{name}.logits(..)`");
                if !self.arity(n, &who, 1) {
                    return;
                }
                let (v, src) = arg(0);
                self.arg(&who, Want::Replicated, v, src);
                let text = format!("it comes from `self.{name}.logits(..)`, split by vocabulary");
                self.set(out, Sharding::Split, Origin { text, column: None });
            }
            NodeOp::Builtin { builtin, .. } => match builtin {
                Builtin::Gelu | Builtin::Swiglu | Builtin::Dropout | Builtin::Rope => {
                    let (v, src) = arg(0);
                    if let Some(sh) = self.arg(builtin.name(), Want::Tensor, v, src) {
                        let origin = self.origin[v].clone().expect("known sharding");
                        self.set(out, sh, origin);
                    }
                }
                Builtin::CrossEntropy => {
                    let (logits, lsrc) = arg(0);
                    let (targets, tsrc) = arg(1);
                    let logits_ok = self.arg("cross_entropy's logits", Want::Tensor, logits, lsrc);
                    if let Some(sh) = self.sharding[targets]
                        && sh != Sharding::Ids
                    {
                        self.errors.push(tsrc.error(format!(
                            "cross_entropy's targets are token ids (`Ids`), but {} is a tensor",
                            self.describe(targets)
                        )));
                    }
                    if logits_ok.is_some() {
                        let text = "it comes from cross_entropy".to_string();
                        self.set(out, Sharding::Replicated, Origin { text, column: None });
                    }
                }
                Builtin::ShiftLeft | Builtin::LossMask => {
                    let (v, src) = arg(0);
                    let name = builtin.name();
                    if self.data(name, v, src) {
                        let text = format!("it comes from {name}, data beside the token ids");
                        self.set(out, Sharding::Ids, Origin { text, column: None });
                    }
                }
                Builtin::AuxLoss => {
                    let (x, xsrc) = arg(0);
                    let (losses, lsrc) = arg(1);
                    let (mask, msrc) = arg(2);
                    let who = "aux_loss's per-token losses (cross_entropy's output)";
                    self.arg(who, Want::Replicated, losses, lsrc);
                    self.data("aux_loss's mask", mask, msrc);
                    if let Some(sh) = self.arg("aux_loss's carrier", Want::Tensor, x, xsrc) {
                        let origin = self.origin[x].clone().expect("known sharding");
                        self.set(out, sh, origin);
                    }
                }
            },
            NodeOp::Add | NodeOp::DropoutAdd { .. } => {
                let (a, asrc) = arg(0);
                let (b, bsrc) = arg(1);
                let sa = self.arg("`+`", Want::Tensor, a, asrc);
                let b_user = match node.op {
                    NodeOp::Add => "`+`",
                    _ => Builtin::Dropout.name(),
                };
                let sb = self.arg(b_user, Want::Tensor, b, bsrc);
                let (Some(sa), Some(sb)) = (sa, sb) else {
                    return;
                };
                if sa != sb {
                    let (split, repl) = if sa == Sharding::Split {
                        (a, b)
                    } else {
                        (b, a)
                    };
                    self.errors.push(node.src.error(format!(
                        "`+` needs both sides sharded alike, but {} is split over tensor parallel \
                         ({}) and {} is replicated ({}); {}",
                        self.describe(split),
                        self.origin_text(split),
                        self.describe(repl),
                        self.origin_text(repl),
                        self.replicate_fix(split)
                    )));
                    return;
                }
                let origin = self.origin[a].clone().expect("known sharding");
                self.set(out, sa, origin);
            }
            NodeOp::Pointwise { op, operands, .. } => self.pointwise(n, *op, operands),
            NodeOp::Fused { formula, .. } => {
                self.alike(n, &format!("`{formula}`"), "element-wise math")
            }
            NodeOp::Shape {
                op,
                sizes,
                of_split,
            } => self.shape(n, *op, sizes, of_split.as_ref()),
            // Made after validation from checked nodes (`collectives`); a pipeline's parts are
            // checked again.
            NodeOp::RowSum { .. } => self.alike(n, "`+`", "`+`"),
            NodeOp::SeqGather => {
                let (v, src) = arg(0);
                if self
                    .arg("a column-parallel layer", Want::Replicated, v, src)
                    .is_some()
                {
                    let origin = self.origin[v].clone().expect("known sharding");
                    self.set(out, Sharding::Replicated, origin);
                }
            }
            NodeOp::Loop { list, .. } => {
                let Some(fi) = self.find_field(list) else {
                    return;
                };
                self.field[n] = Some(fi);
                let f = &self.s.fields[fi];
                let name = f.name();
                if !matches!(f.kind, FieldKind::Stack { .. }) {
                    self.errors.push(syn::Error::new_spanned(
                        list,
                        format!(
                            "`{name}` is not a list of modules (a `Vec<..>` field without a split \
                             attribute), so a loop cannot run over it; it is {}",
                            f.kind.attribute()
                        ),
                    ));
                    return;
                }
                let (v, src) = arg(0);
                let who = format!("the modules of `{name}` (they run whole on every rank)");
                self.arg(&who, Want::Replicated, v, src);
                let text = format!("it comes from the `{name}` loop");
                self.set(out, Sharding::Replicated, Origin { text, column: None });
            }
        }
    }

    /// The index of `list`, a list of modules, else an error.
    fn stack_field(&mut self, list: &syn::Ident) -> Option<usize> {
        let fi = self.find_field(list)?;
        let f = &self.s.fields[fi];
        if !matches!(f.kind, FieldKind::Stack { .. }) {
            self.errors.push(syn::Error::new_spanned(
                list,
                format!(
                    "`{}` is not a list of modules (a `Vec<..>` field without a split attribute), \
                     so a loop cannot run over it; it is {}",
                    f.name(),
                    f.kind.attribute()
                ),
            ));
            return None;
        }
        Some(fi)
    }

    /// A loop body over `list`: its graph checked with its inputs sharded as the values before
    /// the loop are, each carried variable leaving the body as it came (ids stay ids, a
    /// replicated tensor replicated).
    fn body(&mut self, n: NodeId, list: &syn::Ident, body: &Graph, carried: &[String]) {
        let node = &self.g.nodes[n];
        let Some(fi) = self.stack_field(list) else {
            return;
        };
        self.field[n] = Some(fi);
        let given: Option<Vec<(Sharding, Origin)>> = node
            .args
            .iter()
            .map(|&v| Some((self.sharding[v]?, self.origin[v].clone()?)))
            .collect();
        let Some(given) = given else {
            return;
        };
        let analysis = match validate_with(self.s, body, Some(&given)) {
            Ok(a) => a,
            Err(e) => {
                self.errors.push(e);
                return;
            }
        };
        let outs: Vec<Sharding> = body.outputs.iter().map(|&v| analysis.sharding[v]).collect();
        for (k, name) in carried.iter().enumerate() {
            if outs[k] != given[k].0 {
                self.errors
                    .push(body.values[body.outputs[k]].src.error(format!(
                    "the loop body leaves `{name}` {}, and it came {}: a carried variable keeps \
                     its kind from one module of `{}` to the next",
                    describe_sharding(outs[k]),
                    describe_sharding(given[k].0),
                    list.unraw()
                )));
            }
        }
        let text = format!("it comes from the `{}` loop", list.unraw());
        let sh = if outs.len() == 1 {
            outs[0]
        } else {
            Sharding::Replicated
        };
        self.set(node.output, sh, Origin { text, column: None });
        self.body_outputs.insert(n, outs);
    }

    /// Whether `v`, read by `who`, is data beside the ids (token ids, a loss mask), else an
    /// error naming it.
    fn data(&mut self, who: &str, v: ValueId, src: &Src) -> bool {
        match self.sharding[v] {
            Some(Sharding::Ids) => true,
            Some(_) => {
                self.errors.push(src.error(format!(
                    "{who} takes token ids or a loss mask (an `Ids` input, or what shift_left or \
                     loss_mask give), but {} is a tensor ({})",
                    self.describe(v),
                    self.origin_text(v)
                )));
                false
            }
            None => false,
        }
    }

    /// A field call bound to `outputs` names (`let (a, b) = self.name(x);`): a module of the
    /// user's (a field without a split attribute, or #[local]), not captured by a graph scope.
    fn several_outputs(&mut self, n: NodeId, outputs: usize) {
        let Some(f) = self.field[n].map(|i| &self.s.fields[i]) else {
            return;
        };
        let name = f.name();
        let src = &self.g.nodes[n].src;
        if !matches!(f.kind, FieldKind::Replicated | FieldKind::Local) {
            self.errors.push(src.error(format!(
                "`self.{name}(..)` is bound to {outputs} names, but `{name}` is {}, which \
                 returns one tensor; a module of yours returns several \
                 (`fn forward(&self, x: Tensor) -> (Tensor, Tensor)`)",
                f.kind.attribute()
            )));
        } else if let Some(scope) = f.graph_scopes.first() {
            self.errors.push(src.error(format!(
                "`self.{name}(..)` returns {outputs} tensors, and graph scope `{}` captures a \
                 call of one output: call a module of one output in the scope",
                scope.name
            )));
        }
    }

    /// An element-wise operation: its tensors sharded alike (all replicated, or all split
    /// over tensor parallel: it works on each rank's part), clamp's bounds scalars.
    fn pointwise(&mut self, n: NodeId, op: PwOp, operands: &[Operand]) {
        let g = self.g;
        let node = &g.nodes[n];
        let who = format!("`{}`", op.site_name());
        if op == PwOp::Func(Func::Clamp)
            && operands[1..]
                .iter()
                .any(|o| !matches!(o, Operand::Scalar(_) | Operand::Const(_)))
        {
            self.errors.push(node.src.error(
                "clamp's bounds are scalars (literals, #[config] values or constants): \
                 `clamp(x, -1.0, 1.0)`; for a bound per element write \
                 `select(x < lo, lo, select(x > hi, hi, x))`",
            ));
            return;
        }
        self.alike(n, &who, "element-wise math");
    }

    /// The tensor arguments of node `n` (called `who` where one is not a tensor; `subject` in
    /// the message when two are sharded differently) sharded alike; its output as them.
    pub(crate) fn alike(&mut self, n: NodeId, who: &str, subject: &str) {
        let g = self.g;
        let node = &g.nodes[n];
        let mut first: Option<(ValueId, Sharding)> = None;
        for (&v, src) in node.args.iter().zip(&node.arg_srcs) {
            let Some(sh) = self.arg(who, Want::Tensor, v, src) else {
                return;
            };
            match first {
                None => first = Some((v, sh)),
                Some((a, sa)) if sa != sh => {
                    let (split, repl) = if sa == Sharding::Split {
                        (a, v)
                    } else {
                        (v, a)
                    };
                    self.errors.push(node.src.error(format!(
                        "{subject} needs its tensors sharded alike, but {} is split over tensor \
                         parallel ({}) and {} is replicated ({}); {}",
                        self.describe(split),
                        self.origin_text(split),
                        self.describe(repl),
                        self.origin_text(repl),
                        self.replicate_fix(split)
                    )));
                    return;
                }
                Some(_) => {}
            }
        }
        if let Some((a, sh)) = first {
            let origin = self.origin[a].clone().expect("known sharding");
            self.set(node.output, sh, origin);
        }
    }

    /// A shape operation: along the features of replicated values only (a split value's
    /// features are cut over the ranks, where the sizes do not fall); per head on values split
    /// alike or replicated; `broadcast_heads` makes a replicated value split by heads.
    fn shape(
        &mut self,
        n: NodeId,
        op: ShapeKind,
        sizes: &[syn::Expr],
        of_split: Option<&(usize, String)>,
    ) {
        let g = self.g;
        let node = &g.nodes[n];
        let who = format!("`{}`", op.name());
        match op {
            ShapeKind::Narrow | ShapeKind::Cat | ShapeKind::ChunkPart(_) => {
                let sizes: Vec<String> = sizes.iter().map(|e| Src::of(e).text()).collect();
                let mut ok = true;
                for (&v, src) in node.args.iter().zip(&node.arg_srcs) {
                    match self.arg(&who, Want::Tensor, v, src) {
                        Some(Sharding::Split) => {
                            ok = false;
                            // A split's parts are one error, the first part's.
                            if of_split.is_some_and(|(part, _)| *part > 0) {
                                continue;
                            }
                            let what = if let Some((_, what)) = of_split {
                                what.clone()
                            } else if op == ShapeKind::Cat {
                                "concatenated".to_string()
                            } else {
                                format!("narrowed to features {}", sizes.join(", "))
                            };
                            self.errors.push(src.error(format!(
                                "{} is split over tensor parallel ({}): its features are cut \
                                 over the ranks, so it cannot be {what} (the cut need not fall \
                                 where the ranks' shards meet); cut or join it per head with \
                                 split_heads/cat_heads (each rank holds whole heads), or gather \
                                 it first: {}",
                                self.describe(v),
                                self.origin_text(v),
                                self.replicate_fix(v)
                            )));
                        }
                        Some(_) => {}
                        None => ok = false,
                    }
                }
                if ok {
                    let v = node.args[0];
                    let origin = self.origin[v].clone().expect("known sharding");
                    self.set(node.output, Sharding::Replicated, origin);
                }
            }
            ShapeKind::HeadPart(_) | ShapeKind::CatHeads => self.alike(n, &who, &who),
            ShapeKind::BroadcastHeads => {
                let (v, src) = (node.args[0], &node.arg_srcs[0]);
                if self
                    .arg(
                        &format!("{who} (its input is one head, whole on every rank)"),
                        Want::Replicated,
                        v,
                        src,
                    )
                    .is_some()
                {
                    let text = "it comes from broadcast_heads, whose heads are split over tensor \
                                parallel"
                        .to_string();
                    self.set(node.output, Sharding::Split, Origin { text, column: None });
                }
            }
        }
    }

    /// The `self.name` scalars read are #[config] fields.
    fn config_reads(&mut self) {
        for ident in &self.g.config_reads {
            let Some(i) = self.find_field(ident) else {
                continue;
            };
            let f = &self.s.fields[i];
            if !matches!(f.kind, FieldKind::Config) {
                let name = f.name();
                self.errors.push(syn::Error::new_spanned(
                    ident,
                    format!(
                        "`self.{name}` is {} and is used as a scalar; the scalars of \
                         element-wise math are #[config] values, literals and constants \
                         (a field is called: `self.{name}(x)`)",
                        f.kind.attribute()
                    ),
                ));
            }
        }
    }

    fn outputs(&mut self) {
        for &v in &self.g.outputs {
            self.output(v);
        }
    }

    fn output(&mut self, v: ValueId) {
        let Some(sh) = self.sharding[v] else { return };
        let src = self.g.output_src.clone();
        let d = self.describe(v);
        match sh {
            Sharding::Replicated => {}
            Sharding::Split => {
                let message = format!(
                    "forward must return a replicated tensor, but {d} is split over tensor \
                     parallel ({}); {}",
                    self.origin_text(v),
                    self.replicate_fix(v)
                );
                self.errors.push(src.error(message));
            }
            Sharding::Ids => {
                self.errors.push(src.error(format!(
                    "forward returns a tensor, but {d} is token ids (`Ids`)"
                )));
            }
        }
    }

    fn unused(&mut self) {
        for (v, value) in self.g.values.iter().enumerate() {
            if !value.uses.is_empty() || self.sharding[v].is_none() {
                continue;
            }
            // A loop's carried variable need not be read after the loop.
            if let Def::Node(n) = value.def
                && let NodeOp::Take { .. } = self.g.nodes[n].op
                && let Def::Node(b) = self.g.values[self.g.nodes[n].args[0]].def
                && matches!(self.g.nodes[b].op, NodeOp::Body { .. })
            {
                continue;
            }
            let d = self.describe(v);
            match value.def {
                Def::Input {
                    ty: InputType::Ids, ..
                } => {}
                Def::Input { .. } if self.in_body => self.errors.push(value.src.error(format!(
                    "the loop body assigns {d} without reading it first: a carried variable \
                     goes from one module to the next, read by the body (a value computed \
                     afresh at each module is a `let` inside the body)"
                ))),
                Def::Input { .. } => self.errors.push(value.src.error(format!(
                    "input {d} is never used: forward's output must depend on every `Tensor` \
                     input (its gradient is returned)"
                ))),
                Def::Node(_) => self.errors.push(value.src.error(format!(
                    "{d} is computed but never used: forward computes only what its output needs"
                ))),
            }
        }
    }
}

/// `#[recompute]` goes on the forward of a module that takes one `Tensor` (a layer of a stack
/// or a field of another module): what it keeps is that input.
pub fn recompute(imp: &ModuleImpl) -> syn::Result<()> {
    let Some(src) = &imp.forward.recompute else {
        return Ok(());
    };
    if imp.forward.outputs.len() > 1 {
        return Err(src.error(format!(
            "#[recompute] reruns a forward of one output, and this one returns {}",
            imp.forward.outputs.len()
        )));
    }
    let inputs: Vec<InputType> = imp.forward.inputs.iter().map(|i| i.ty).collect();
    if inputs != [InputType::Tensor] {
        return Err(src.error(format!(
            "#[recompute] keeps a module's input and reruns its forward from it: it goes on a \
             forward taking one `Tensor`, and this one takes {}",
            imp.forward
                .inputs
                .iter()
                .map(|i| format!("{}: {:?}", i.ident, i.ty))
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    Ok(())
}
