//! Fusion: each chain of element-wise operations becomes one node, run as one generated kernel
//! forward and one backward (see [`crate::pointwise`]).
//!
//! An element-wise node joins the node that uses it when that node is element-wise too and is
//! its only user (it may read it several times: `h * h`). The chains are then trees of
//! element-wise nodes with one output each. `+` and `gelu` join a chain that has other
//! element-wise operations; alone they stay the builtins they are (a residual `+` saves
//! nothing, and a lone `gelu` keeps its kernels and bf16 output).

use std::collections::HashMap;

use quote::ToTokens;

use crate::model::{Def, Graph, Node, NodeOp, Use, ValueId};
use crate::parse::Builtin;
use crate::pointwise::{Func, Inst, Operand, Program, PwOp};
use crate::validate::Analysis;

/// Whether node `op` can be part of a chain.
fn elementwise(op: &NodeOp) -> bool {
    matches!(
        op,
        NodeOp::Pointwise { .. }
            | NodeOp::Add
            | NodeOp::Builtin {
                builtin: Builtin::Gelu,
                ..
            }
    )
}

/// The graph with its element-wise chains fused, and the analysis carried over.
pub fn fuse(g: Graph, a: Analysis) -> (Graph, Analysis) {
    let n_nodes = g.nodes.len();
    // The node each element-wise node joins.
    let joins: Vec<Option<usize>> = (0..n_nodes)
        .map(|n| {
            let node = &g.nodes[n];
            if !elementwise(&node.op) {
                return None;
            }
            let uses = &g.values[node.output].uses;
            let Some(Use::Arg { node: user, .. }) = uses.first() else {
                return None;
            };
            let one_user = uses
                .iter()
                .all(|u| matches!(u, Use::Arg { node, .. } if node == user));
            (one_user && elementwise(&g.nodes[*user].op)).then_some(*user)
        })
        .collect();
    let root = |mut n: usize| {
        while let Some(next) = joins[n] {
            n = next;
        }
        n
    };
    let mut members: HashMap<usize, Vec<usize>> = HashMap::new();
    for n in 0..n_nodes {
        if elementwise(&g.nodes[n].op) {
            members.entry(root(n)).or_default().push(n);
        }
    }
    // Chains with an element-wise operation beyond `+` and `gelu`.
    members.retain(|_, ms| {
        ms.iter()
            .any(|&m| matches!(g.nodes[m].op, NodeOp::Pointwise { .. }))
    });
    let fused_into: HashMap<usize, usize> = members
        .iter()
        .flat_map(|(&r, ms)| ms.iter().map(move |&m| (m, r)))
        .collect();

    let mut sites: Vec<String> = g.nodes.iter().filter_map(|n| n.site.clone()).collect();
    let mut nodes: Vec<Node> = Vec::new();
    let mut field: Vec<Option<usize>> = Vec::new();
    for n in 0..n_nodes {
        match fused_into.get(&n) {
            Some(&r) if r == n => {
                nodes.push(chain(&g, &members[&r], &mut sites));
                field.push(None);
            }
            Some(_) => {}
            None => {
                nodes.push(g.nodes[n].clone());
                field.push(a.field[n]);
            }
        }
    }
    compact(g, nodes, field, a.sharding)
}

/// The fused node of the chain `ms` (node indices in evaluation order; the last is the root).
fn chain(g: &Graph, ms: &[usize], sites: &mut Vec<String>) -> Node {
    let root = &g.nodes[*ms.last().expect("a chain has nodes")];
    let reg_of: HashMap<ValueId, usize> = ms
        .iter()
        .enumerate()
        .map(|(i, &m)| (g.nodes[m].output, i))
        .collect();
    let mut inputs: Vec<ValueId> = Vec::new();
    let mut arg_srcs = Vec::new();
    let mut scalars: Vec<syn::Expr> = Vec::new();
    let mut insts = Vec::new();
    // Per member, its register.
    let mut regs: Vec<usize> = Vec::new();
    for (position, &m) in ms.iter().enumerate() {
        let node = &g.nodes[m];
        let tensor = |k: usize, inputs: &mut Vec<ValueId>, arg_srcs: &mut Vec<_>| {
            let v = node.args[k];
            if let Some(&j) = reg_of.get(&v) {
                return Operand::Reg(regs[j]);
            }
            let i = match inputs.iter().position(|&x| x == v) {
                Some(i) => i,
                None => {
                    inputs.push(v);
                    arg_srcs.push(node.arg_srcs[k].clone());
                    inputs.len() - 1
                }
            };
            Operand::Input(i)
        };
        let inst = match &node.op {
            NodeOp::Pointwise {
                op,
                operands,
                scalars: own,
            } => {
                let operands = operands
                    .iter()
                    .map(|o| match *o {
                        Operand::Input(k) => tensor(k, &mut inputs, &mut arg_srcs),
                        // One scalar per distinct expression.
                        Operand::Scalar(k) => {
                            let text = own[k].to_token_stream().to_string();
                            let at = scalars
                                .iter()
                                .position(|s| s.to_token_stream().to_string() == text);
                            Operand::Scalar(at.unwrap_or_else(|| {
                                scalars.push(own[k].clone());
                                scalars.len() - 1
                            }))
                        }
                        Operand::Const(bits) => Operand::Const(bits),
                        Operand::Reg(_) => unreachable!("model nodes read arguments"),
                    })
                    .collect();
                Inst { op: *op, operands }
            }
            NodeOp::Add => Inst {
                op: PwOp::Add,
                operands: vec![
                    tensor(0, &mut inputs, &mut arg_srcs),
                    tensor(1, &mut inputs, &mut arg_srcs),
                ],
            },
            NodeOp::Builtin { .. } => Inst {
                op: PwOp::Func(Func::Gelu),
                operands: vec![tensor(0, &mut inputs, &mut arg_srcs)],
            },
            _ => unreachable!("chains are of element-wise nodes"),
        };
        // The same operation on the same operands is computed once (`abs(a)` written twice).
        // (Not the chain's output, which is its last instruction.)
        let same = insts
            .iter()
            .position(|i: &Inst| i.op == inst.op && i.operands == inst.operands);
        let reg = match same {
            Some(r) if position + 1 < ms.len() => r,
            _ => {
                insts.push(inst);
                insts.len() - 1
            }
        };
        regs.push(reg);
    }
    let input_names: Vec<String> = inputs.iter().map(|&v| describe(g, v)).collect();
    let scalar_names: Vec<String> = scalars
        .iter()
        .map(|e| crate::src_span::Src::of(e).text())
        .collect();
    // A register's name: the `let` of the first member computing it.
    let mut reg_names: Vec<Option<String>> = vec![None; insts.len()];
    for (position, &m) in ms.iter().enumerate() {
        let r = regs[position];
        if reg_names[r].is_none() {
            reg_names[r] = g.values[g.nodes[m].output].name.clone();
        }
    }
    // A `+` at the root: name the chain after it.
    let site = root
        .site
        .clone()
        .unwrap_or_else(|| crate::model::unique_site(sites, "add"));
    let program = Program {
        inputs: inputs.len(),
        scalars: scalars.len(),
        insts,
    };
    Node {
        op: NodeOp::Fused {
            program: program.clone(),
            scalars,
            formula: crate::pointwise::formula(&program, &input_names, &scalar_names, &reg_names),
        },
        args: inputs,
        arg_srcs,
        output: root.output,
        site: Some(site),
        src: root.src.clone(),
        deferred: false,
    }
}

/// The graph of `nodes` (`field`: each one's field), keeping only the values they and the inputs
/// define, with the analysis renumbered.
pub fn compact(
    g: Graph,
    mut nodes: Vec<Node>,
    field: Vec<Option<usize>>,
    sharding: Vec<crate::validate::Sharding>,
) -> (Graph, Analysis) {
    let mut keep: Vec<Option<ValueId>> = vec![None; g.values.len()];
    let mut order: Vec<ValueId> = g.inputs.clone();
    order.extend(nodes.iter().map(|n| n.output));
    for (new, &old) in order.iter().enumerate() {
        keep[old] = Some(new);
    }
    let map = |v: ValueId| keep[v].expect("kept values are defined");
    let mut values = Vec::new();
    let mut new_sharding = Vec::new();
    let mut old_values: Vec<Option<crate::model::Value>> = g.values.into_iter().map(Some).collect();
    for (i, &old) in order.iter().enumerate() {
        let mut v = old_values[old].take().expect("each value once");
        v.uses.clear();
        if i >= g.inputs.len() {
            v.def = Def::Node(i - g.inputs.len());
        }
        values.push(v);
        new_sharding.push(sharding[old]);
    }
    for node in &mut nodes {
        node.output = map(node.output);
        for a in &mut node.args {
            *a = map(*a);
        }
    }
    for (n, node) in nodes.iter().enumerate() {
        for (arg, &v) in node.args.iter().enumerate() {
            values[v].uses.push(Use::Arg { node: n, arg });
        }
    }
    let outputs: Vec<ValueId> = g.outputs.iter().map(|&v| map(v)).collect();
    for &v in &outputs {
        values[v].uses.push(Use::Output);
    }
    let graph = Graph {
        inputs: g.inputs.iter().map(|&v| map(v)).collect(),
        values,
        nodes,
        outputs,
        output_src: g.output_src,
        config_reads: g.config_reads,
    };
    (
        graph,
        Analysis {
            sharding: new_sharding,
            field,
        },
    )
}

/// A chain input's name: its `let` name, or the call that makes it.
fn describe(g: &Graph, v: ValueId) -> String {
    let value = &g.values[v];
    if let Some(name) = &value.name {
        return name.clone();
    }
    match value.def {
        Def::Node(n) => match &g.nodes[n].op {
            NodeOp::Field { field } => format!("self.{}(..)", syn::ext::IdentExt::unraw(field)),
            NodeOp::Logits { field } => {
                format!("self.{}.logits(..)", syn::ext::IdentExt::unraw(field))
            }
            NodeOp::Builtin { builtin, .. } => format!("{}(..)", builtin.name()),
            _ => g.nodes[n].site.clone().unwrap_or_else(|| "the sum".into()),
        },
        Def::Input { .. } => "input".into(),
    }
}
