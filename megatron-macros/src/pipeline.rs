//! A forward with a `#[pipeline]` stack, cut at its loop into the parts a pipeline stage runs:
//! what comes before the loop (the first stage), the loop (every stage, over its layers) and
//! what comes after (the last stage). Each part is a graph of its own, generated like a whole
//! forward; only the loop's carried value goes from part to part.
//!
//! The checks: the forward runs the stack in exactly one loop; no value computed before the loop
//! other than the carried one is used after it; after the loop, forward's inputs may be read
//! only if they are token ids (they are on every stage), not tensors (their gradient would be
//! split over two stages).

use syn::ext::IdentExt;

use crate::model::{Def, Graph, Node, NodeId, NodeOp, Use, Value, ValueId};
use crate::parse::{FieldKind, InputType, ModuleStruct};
use crate::src_span::Errors;
use crate::validate::{self, Analysis};

/// Which stages hold a field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Presence {
    /// Every stage (ops and config values).
    Always,
    /// The first stage: used only before the loop (or not at all).
    First,
    /// The last stage: used only after the loop.
    Last,
    /// Both ends: used before and after the loop (a tied embedding); the two copies' gradients
    /// are summed over the embedding group.
    Ends,
    /// The stack itself: each stage holds its run of it.
    Stack,
}

/// One part of the cut forward.
pub struct Part {
    /// Its graph (nodes renumbered, inputs as the part takes them).
    pub graph: Graph,
    /// Its sharding analysis.
    pub analysis: Analysis,
    /// Per input of the part: the index of the forward's input it is, or `None` for the
    /// carried value.
    pub sources: Vec<Option<usize>>,
}

/// A forward cut at its `#[pipeline]` loop.
pub struct Cut {
    /// Before the loop: forward's inputs it reads → the carried value.
    pub pre: Part,
    /// The loop: the carried value → the carried value.
    pub layers: Part,
    /// After the loop: the carried value and the ids inputs it reads → forward's output.
    pub post: Part,
    /// Per field of the struct, which stages hold it.
    pub presence: Vec<Presence>,
    /// Per field, whether the part after the loop calls it (not only its output layer, as
    /// multi-token prediction looks the next tokens up in the input embedding).
    pub called_after: Vec<bool>,
}

/// Cuts `g` (validated, analysed as `a`) at the loop over `s`'s `#[pipeline]` field.
pub fn cut(s: &ModuleStruct, g: &Graph, a: &Analysis) -> syn::Result<Cut> {
    let pf = s.pipeline_field().expect("called for pipelined structs");
    let field = &s.fields[pf];
    let name = field.name();
    let mut errors = Errors::default();
    let loops: Vec<NodeId> = (0..g.nodes.len())
        .filter(|&n| matches!(g.nodes[n].op, NodeOp::Loop { .. }) && a.field[n] == Some(pf))
        .collect();
    // A loop of several statements over the stack would carry several values between stages.
    for n in 0..g.nodes.len() {
        if let NodeOp::Body { elem, .. } = &g.nodes[n].op
            && a.field[n] == Some(pf)
        {
            return Err(g.nodes[n].src.error(format!(
                "the loop over the #[pipeline] `{name}` is one assignment `h = {}(h);`: it \
                 carries one value, the one sent from stage to stage (several statements and \
                 carried values go in a loop over another list, or in the modules of the stack)",
                elem.unraw()
            )));
        }
    }
    let Some(&l) = loops.first() else {
        return Err(syn::Error::new_spanned(
            &field.ident,
            format!(
                "`{name}` is #[pipeline], so forward must run it in a loop, `for layer in \
                 &self.{name} {{ h = layer(h); }}`: the loop is where the pipeline stages meet"
            ),
        ));
    };
    for &again in &loops[1..] {
        errors.push(g.nodes[again].src.error(format!(
            "`{name}` is #[pipeline] and runs in one loop only: each stage holds its run of \
             it, and a second loop would need the layers of every stage"
        )));
    }
    let carried_in = g.nodes[l].args[0];
    let carried_out = g.nodes[l].output;
    // Values computed before the loop and used after it.
    for (v, value) in g.values.iter().enumerate() {
        let before = match value.def {
            Def::Node(n) => n < l,
            Def::Input { ty, .. } => {
                if ty == InputType::Tensor {
                    for u in &value.uses {
                        if let Use::Arg { node, arg } = *u
                            && node > l
                        {
                            errors.push(g.nodes[node].arg_srcs[arg].error(format!(
                                "forward's tensor input {} is used after the #[pipeline] `{name}` \
                                 loop, on the last stage; only token ids (`Ids`) inputs reach \
                                 every stage",
                                describe(value)
                            )));
                        }
                    }
                }
                false
            }
        };
        if !before {
            continue;
        }
        for u in &value.uses {
            let (src, after) = match *u {
                Use::Arg { node, arg } => (g.nodes[node].arg_srcs[arg].clone(), node > l),
                Use::Output => (g.output_src.clone(), true),
            };
            if after {
                let why = if v == carried_in {
                    "the value the loop starts from"
                } else {
                    "a value computed before it"
                };
                errors.push(src.error(format!(
                    "{} is {why}, on the first pipeline stage, but it is used after the \
                     #[pipeline] `{name}` loop, on the last; only the loop's carried value goes \
                     from stage to stage",
                    describe(value)
                )));
            }
        }
    }
    errors.finish(())?;

    let (pre, layers, post) = (
        slice(g, 0..l, None, carried_in),
        slice(g, l..l + 1, Some(carried_in), carried_out),
        slice(g, l + 1..g.nodes.len(), Some(carried_out), g.output()),
    );
    let mut presence = vec![Presence::Always; s.fields.len()];
    let mut called_after = vec![false; s.fields.len()];
    for (i, f) in s.fields.iter().enumerate() {
        if matches!(
            f.kind,
            FieldKind::Op | FieldKind::ContextParallel | FieldKind::Config
        ) {
            continue;
        }
        if i == pf {
            presence[i] = Presence::Stack;
            continue;
        }
        let name = f.name();
        let used = |range: std::ops::Range<usize>| {
            range.into_iter().any(|n| {
                a.field[n] == Some(i)
                    || match &g.nodes[n].op {
                        // A field the loop body calls (an embedding shared with the body).
                        NodeOp::Body { body, .. } => body.nodes.iter().any(|b| match &b.op {
                            NodeOp::Field { field } | NodeOp::Logits { field } => {
                                field.unraw() == name
                            }
                            _ => false,
                        }),
                        _ => false,
                    }
            })
        };
        called_after[i] = (l + 1..g.nodes.len()).any(|n| match &g.nodes[n].op {
            NodeOp::Field { .. } => a.field[n] == Some(i),
            NodeOp::Body { body, .. } => body
                .nodes
                .iter()
                .any(|b| matches!(&b.op, NodeOp::Field { field } if field.unraw() == name)),
            _ => false,
        });
        presence[i] = match (used(0..l), used(l + 1..g.nodes.len())) {
            (true, true) => Presence::Ends,
            (false, true) => Presence::Last,
            _ => Presence::First,
        };
    }
    let part = |(graph, sources): (Graph, Vec<Option<usize>>)| -> syn::Result<Part> {
        let analysis = validate::validate(s, &graph)?;
        Ok(Part {
            graph,
            analysis,
            sources,
        })
    };
    Ok(Cut {
        pre: part(pre)?,
        layers: part(layers)?,
        post: part(post)?,
        presence,
        called_after,
    })
}

fn describe(value: &Value) -> String {
    match &value.name {
        Some(n) => format!("`{}`", n),
        None => "a value".to_string(),
    }
}

/// The graph of `g`'s nodes `nodes`, taking `carried` (when given) as its first input, then the
/// inputs of `g` the nodes read, and returning `output`. Returns it and, per input, the index of
/// `g`'s input it is (`None` for the carried value).
fn slice(
    g: &Graph,
    nodes: std::ops::Range<NodeId>,
    carried: Option<ValueId>,
    output: ValueId,
) -> (Graph, Vec<Option<usize>>) {
    let mut map: Vec<Option<ValueId>> = vec![None; g.values.len()];
    let mut values: Vec<Value> = Vec::new();
    let mut inputs = Vec::new();
    let mut sources = Vec::new();
    let mut add_input = |v: ValueId,
                         ty: InputType,
                         source: Option<usize>,
                         map: &mut Vec<Option<ValueId>>,
                         values: &mut Vec<Value>| {
        let index = inputs.len();
        values.push(Value {
            name: g.values[v].name.clone(),
            def: Def::Input { index, ty },
            src: g.values[v].src.clone(),
            uses: Vec::new(),
        });
        map[v] = Some(values.len() - 1);
        inputs.push(values.len() - 1);
        sources.push(source);
    };
    if let Some(c) = carried {
        add_input(c, InputType::Tensor, None, &mut map, &mut values);
    }
    for &v in &g.inputs {
        let Def::Input { index, ty } = g.values[v].def else {
            unreachable!("inputs")
        };
        // An input the part's nodes read, or the part's output itself (a forward whose loop
        // starts from an input has nothing before it).
        let read = v == output
            || g.values[v].uses.iter().any(|u| match *u {
                Use::Arg { node, .. } => nodes.contains(&node),
                Use::Output => false,
            });
        if read {
            add_input(v, ty, Some(index), &mut map, &mut values);
        }
    }
    let mut new_nodes = Vec::new();
    for n in nodes.clone() {
        let node = &g.nodes[n];
        let out = node.output;
        values.push(Value {
            name: g.values[out].name.clone(),
            def: Def::Node(new_nodes.len()),
            src: g.values[out].src.clone(),
            uses: Vec::new(),
        });
        map[out] = Some(values.len() - 1);
        new_nodes.push(Node {
            op: node.op.clone(),
            args: node
                .args
                .iter()
                .map(|&v| map[v].expect("arguments are defined before use"))
                .collect(),
            arg_srcs: node.arg_srcs.clone(),
            output: values.len() - 1,
            site: node.site.clone(),
            src: node.src.clone(),
            deferred: node.deferred,
        });
    }
    let output_src = if nodes.end == g.nodes.len() {
        g.output_src.clone()
    } else {
        g.values[output].src.clone()
    };
    let mut graph = Graph {
        inputs,
        values,
        nodes: new_nodes,
        outputs: vec![map[output].expect("the output is defined in the part")],
        output_src,
        config_reads: Vec::new(),
    };
    for n in 0..graph.nodes.len() {
        for (arg, &v) in graph.nodes[n].args.clone().iter().enumerate() {
            graph.values[v].uses.push(Use::Arg { node: n, arg });
        }
    }
    let out = graph.output();
    graph.values[out].uses.push(Use::Output);
    (graph, sources)
}

/// The stack's field name (for docs).
pub fn stack_name(s: &ModuleStruct) -> String {
    s.fields[s.pipeline_field().expect("pipelined")]
        .ident
        .unraw()
        .to_string()
}
