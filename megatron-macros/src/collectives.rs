//! One collective where one suffices: rewrites the graph so that
//!
//! - the outputs of several row-parallel layers that are summed (`x + self.a(h) + self.b(n)`,
//!   the parallel block of GPT-J and PaLM) are summed as partial outputs and reduced over tp
//!   once (all-reduce, or with sequence parallelism one reduce-scatter), their biases added
//!   after: a [`NodeOp::RowSum`]; in backward the output gradient is gathered once for all of
//!   them;
//! - a value read by several column-parallel layers (`self.q(n)`, `self.kv(n)`) passes
//!   Megatron-LM's f once, a [`NodeOp::SeqGather`]: with sequence parallelism its shards are
//!   gathered once; in backward the layers' input gradients are summed, then reduced once.
//!
//! The layers so joined are marked `deferred`: their own collective is the new node's. The sums
//! are reassociated (the partial outputs first), so a result differs from the unmerged one by
//! the order of f32 additions; tensor-parallel runs still match tp 1 to that order.

use crate::fuse::compact;
use crate::model::{Def, Graph, Node, NodeId, NodeOp, Use, Value, ValueId};
use crate::parse::{FieldKind, ModuleStruct};
use crate::src_span::Src;
use crate::validate::{Analysis, Sharding};

/// A sum of row-parallel outputs (and other terms) to reduce once.
struct Sum {
    /// The add whose result is the sum.
    root: NodeId,
    /// The row-parallel outputs, left to right.
    rows: Vec<(ValueId, Src)>,
    /// The other terms, left to right.
    others: Vec<(ValueId, Src)>,
    /// The adds of the sum, the root among them.
    adds: Vec<NodeId>,
}

/// The graph with its merged collectives.
pub fn merge(s: &ModuleStruct, mut g: Graph, a: Analysis) -> (Graph, Analysis) {
    let kind = |n: NodeId| a.field[n].map(|i| &s.fields[i].kind);
    let def = |g: &Graph, v: ValueId| match g.values[v].def {
        Def::Node(n) => Some(n),
        Def::Input { .. } => None,
    };
    let only_user = |g: &Graph, v: ValueId| match g.values[v].uses.as_slice() {
        [Use::Arg { node, .. }] => Some(*node),
        _ => None,
    };
    let is_add = |g: &Graph, n: NodeId| matches!(g.nodes[n].op, NodeOp::Add);
    // An add whose result only another add reads is inside a sum.
    let inner = |g: &Graph, n: NodeId| {
        is_add(g, n) && only_user(g, g.nodes[n].output).is_some_and(|u| is_add(g, u))
    };

    // Sums with two or more row-parallel outputs: root add -> (row leaves, other leaves, adds).
    let mut sums: Vec<Sum> = Vec::new();
    for root in 0..g.nodes.len() {
        if !is_add(&g, root) || inner(&g, root) {
            continue;
        }
        let (mut leaves, mut adds) = (Vec::new(), Vec::new());
        let mut stack = vec![root];
        while let Some(n) = stack.pop() {
            adds.push(n);
            // Right to left on the stack, so that leaves come out left to right.
            for (&v, src) in g.nodes[n].args.iter().zip(&g.nodes[n].arg_srcs).rev() {
                match def(&g, v) {
                    Some(m) if inner(&g, m) && only_user(&g, v) == Some(n) => stack.push(m),
                    _ => leaves.push((v, src.clone())),
                }
            }
        }
        leaves.reverse();
        let row = |v: ValueId| {
            def(&g, v).is_some_and(|m| {
                matches!(g.nodes[m].op, NodeOp::Field { .. })
                    && matches!(
                        kind(m),
                        Some(
                            FieldKind::Row {
                                input_is_parallel: true
                            } | FieldKind::PartialOutput
                        )
                    )
                    && g.values[v].uses.len() == 1
            })
        };
        let (rows, others): (Vec<_>, Vec<_>) = leaves.into_iter().partition(|(v, _)| row(*v));
        if rows.len() >= 2 {
            sums.push(Sum {
                root,
                rows,
                others,
                adds,
            });
        }
    }

    // Values read by two or more column-parallel layers (whose outputs are split).
    let column = |n: NodeId| {
        matches!(g.nodes[n].op, NodeOp::Field { .. })
            && matches!(
                kind(n),
                Some(FieldKind::Column {
                    gather_output: false
                })
            )
    };
    let mut shared: Vec<(ValueId, Vec<NodeId>)> = Vec::new();
    for v in 0..g.values.len() {
        let readers: Vec<NodeId> = g.values[v]
            .uses
            .iter()
            .filter_map(|u| match u {
                Use::Arg { node, arg: 0 } if column(*node) => Some(*node),
                _ => None,
            })
            .collect();
        // (A column-parallel layer has one input: each reader is a node of its own.)
        if readers.len() >= 2 && a.sharding[v] == Sharding::Replicated {
            shared.push((v, readers));
        }
    }
    if sums.is_empty() && shared.is_empty() {
        return (g, a);
    }

    let mut sharding = a.sharding.clone();
    // The gathered value of each shared input, made before its first reader.
    let mut gathered: Vec<(ValueId, ValueId, NodeId)> = Vec::new();
    for (v, readers) in &shared {
        let src = g.values[*v].src.clone();
        g.values.push(Value {
            name: None,
            def: Def::Node(usize::MAX),
            src,
            uses: Vec::new(),
        });
        sharding.push(Sharding::Replicated);
        gathered.push((*v, g.values.len() - 1, readers[0]));
    }
    let deferred_rows: Vec<NodeId> = sums
        .iter()
        .flat_map(|sum| sum.rows.iter().filter_map(|(v, _)| def(&g, *v)))
        .collect();
    let removed: Vec<NodeId> = sums
        .iter()
        .flat_map(|sum| sum.adds.iter().copied().filter(move |n| *n != sum.root))
        .collect();
    let mut nodes = Vec::new();
    let mut field = Vec::new();
    for n in 0..g.nodes.len() {
        if removed.contains(&n) {
            continue;
        }
        for &(v, whole, first) in &gathered {
            if first == n {
                nodes.push(Node {
                    op: NodeOp::SeqGather,
                    args: vec![v],
                    arg_srcs: vec![g.values[v].src.clone()],
                    output: whole,
                    site: None,
                    src: g.values[v].src.clone(),
                    deferred: false,
                });
                field.push(None);
            }
        }
        let node = &g.nodes[n];
        if let Some(Sum { rows, others, .. }) = sums.iter().find(|sum| sum.root == n) {
            let (args, arg_srcs): (Vec<ValueId>, Vec<Src>) =
                rows.iter().chain(others).cloned().unzip();
            nodes.push(Node {
                op: NodeOp::RowSum {
                    partials: rows.len(),
                },
                args,
                arg_srcs,
                output: node.output,
                site: None,
                src: node.src.clone(),
                deferred: false,
            });
            field.push(None);
            continue;
        }
        let mut args = node.args.clone();
        let mut deferred = deferred_rows.contains(&n);
        if let Some(&(_, whole, _)) = gathered
            .iter()
            .find(|(v, _, _)| column(n) && args.first() == Some(v))
        {
            args[0] = whole;
            deferred = true;
        }
        nodes.push(Node {
            args,
            deferred,
            ..node.clone()
        });
        field.push(a.field[n]);
    }
    compact(g, nodes, field, sharding)
}
