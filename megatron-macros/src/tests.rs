//! Unit tests of the parse → model → validate → generate pipeline on modules written as strings.

use crate::generate;
use crate::model::{self, Def, Graph, NodeOp, Use};
use crate::parse::{self, FieldKind, ModuleImpl, ModuleStruct};
use crate::root::Root;
use crate::validate::{self, Analysis, Sharding};

const MLP: &str = "pub struct Mlp { #[column_parallel] fc1: Linear, #[row_parallel] fc2: Linear }";

const GPT: &str = "pub struct Gpt {
    #[vocab_parallel] wte: Embedding,
    wpe: PositionEmbedding,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    #[config] embedding_dropout: f32,
}";

const GPT_IMPL: &str = "impl Gpt {
    fn forward(&self, tokens: Ids, targets: Ids) -> Tensor {
        let x = self.wte(tokens) + self.wpe(tokens);
        let mut h = dropout(x, self.embedding_dropout);
        for block in &self.blocks { h = block(h); }
        let h = self.ln_f(h);
        cross_entropy(self.wte.logits(h), targets)
    }
}";

/// A struct with every kind of field, for error tests.
const ALL: &str = "struct All {
    #[column_parallel] col: Linear,
    #[column_parallel(gather_output = true)] colg: Linear,
    #[row_parallel] row: Linear,
    #[row_parallel(input_is_parallel = false)] rows: Linear,
    #[vocab_parallel] emb: Embedding,
    ln: LayerNorm,
    stack: Vec<Block>,
    #[op] core: CausalSelfAttention,
    #[config] p: f32,
}";

fn parse_struct(s: &str) -> syn::Result<ModuleStruct> {
    parse::parse_struct(syn::parse_str(s).expect("a struct"))
}

fn parse_impl(i: &str) -> syn::Result<ModuleImpl> {
    parse::parse_impl(syn::parse_str(i).expect("an impl"))
}

/// The struct, impl, graph and analysis, or every error message.
fn analyse(s: &str, i: &str) -> Result<(ModuleStruct, ModuleImpl, Graph, Analysis), Vec<String>> {
    let all = || -> syn::Result<_> {
        let s = parse_struct(s)?;
        let imp = parse_impl(i)?;
        let g = model::build(&imp.forward)?;
        let a = validate::validate(&s, &g)?;
        Ok((s, imp, g, a))
    };
    all().map_err(|e| e.into_iter().map(|e| e.to_string()).collect())
}

fn errors(s: &str, i: &str) -> Vec<String> {
    match analyse(s, i) {
        Ok(_) => panic!("expected errors"),
        Err(e) => e,
    }
}

/// The one error of a forward over `ALL`.
fn all_error(forward: &str) -> String {
    let e = errors(ALL, &format!("impl All {{ {forward} }}"));
    assert_eq!(e.len(), 1, "{e:#?}");
    e.into_iter().next().unwrap()
}

fn op_name(op: &NodeOp) -> String {
    match op {
        NodeOp::Field { field } => format!("self.{field}"),
        NodeOp::Logits { field } => format!("self.{field}.logits"),
        NodeOp::Builtin { builtin, .. } => builtin.name().to_string(),
        NodeOp::Add => "+".into(),
        NodeOp::DropoutAdd { .. } => "+ dropout".into(),
        NodeOp::Loop { list, .. } => format!("for &self.{list}"),
        NodeOp::Pointwise { op, .. } => op.site_name().to_string(),
        NodeOp::Fused { formula, .. } => format!("fused {formula}"),
        NodeOp::RowSum { .. } => "+ reduced once".into(),
        NodeOp::SeqGather => "f once".into(),
        NodeOp::Shape { op, .. } => op.name().into(),
        NodeOp::Take { index } => format!(".{index}"),
        NodeOp::Element { elem, .. } => format!("{elem}(..)"),
        NodeOp::Body { list, carried, .. } => format!("for &self.{list} carrying {carried:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// parse
// ---------------------------------------------------------------------------------------------

#[test]
fn field_attributes_give_kinds_and_are_stripped() {
    let s = parse_struct(ALL).unwrap();
    let kinds: Vec<_> = s.fields.iter().map(|f| f.kind.attribute()).collect();
    assert_eq!(
        kinds,
        [
            "#[column_parallel]",
            "#[column_parallel(gather_output = true)]",
            "#[row_parallel]",
            "#[row_parallel(input_is_parallel = false)]",
            "#[vocab_parallel]",
            "a replicated layer or module (no attribute)",
            "a list of modules (`Vec<..>`)",
            "#[op]",
            "#[config]",
        ]
    );
    assert!(s.fields.iter().all(|f| f.attrs.is_empty()));
    let doc = parse_struct("struct M { /// docs\n #[replicated] #[allow(unused)] l: Vec<Linear> }")
        .unwrap();
    assert!(matches!(doc.fields[0].kind, FieldKind::Stack { .. }));
    assert_eq!(
        doc.fields[0].attrs.len(),
        2,
        "docs and other attributes are kept"
    );
}

#[test]
fn struct_errors_name_the_problem() {
    let e = |s: &str| {
        parse_struct(s)
            .err()
            .expect("an error")
            .into_iter()
            .map(|e| e.to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        e("struct M { #[column_parallel] #[row_parallel] fc: Linear }"),
        [
            "`fc` has two kinds: #[column_parallel] and #[row_parallel]; a field takes one of \
          #[column_parallel], #[row_parallel], #[vocab_parallel], #[expert_parallel], \
          #[replicated], #[local], #[partial_output], #[pipeline], #[op], #[context_parallel], #[config]"
        ]
    );
    assert_eq!(
        e("struct M { #[column_parallel(gather = true)] fc: Linear }"),
        [
            "unknown option `gather` of #[column_parallel]; its option is `gather_output = \
          true|false`"
        ]
    );
    assert_eq!(
        e("struct M { #[row_parallel(input_is_parallel = false, input_is_parallel)] fc: Linear }"),
        ["option `input_is_parallel` of #[row_parallel] is given twice"]
    );
    assert_eq!(
        e("struct M { #[vocab_parallel(x)] fc: Linear }"),
        ["#[vocab_parallel] takes no options"]
    );
    assert!(e("struct M<T> { fc: T }")[0].contains("cannot be generic"));
    assert!(e("struct M(Linear);")[0].contains("named fields"));
    assert!(
        e("struct M { #[graph_scope(attention)] a: Attention }")[0]
            .contains("unknown graph scope `attention`")
    );
    assert!(
        e("struct M { #[graph_scope(moe_router)] a: Attention }")[0]
            .contains("marks the router of an #[expert_parallel] field")
    );
    assert!(
        e("struct M { #[graph_scope(attn, mlp)] a: Attention }")[0]
            .contains("one call, captured as one scope")
    );
    assert!(
        e("struct M { #[expert_parallel] #[graph_scope(attn)] e: RoutedExperts }")[0]
            .contains("sizes are known only at run time")
    );
    assert!(
        e("struct M { #[expert_parallel] #[graph_scope(moe_preprocess)] e: RoutedExperts }")[0]
            .contains("give moe_router too")
    );
    assert!(
        e("struct M { #[column_parallel] #[graph_scope(attn)] fc: Linear }")[0]
            .contains("not #[column_parallel] `fc`")
    );
    assert!(e("struct M { #[graph_scope] a: Attention }")[0].contains("names its scope"));
    assert_eq!(
        e("struct M { #[expert_parallel(topk = 2)] e: RoutedExperts }"),
        ["#[expert_parallel] takes no options"]
    );
    // Errors of several fields are reported together.
    assert_eq!(e("struct M { #[op(x)] a: A, #[config = 1] b: B }").len(), 2);
}

#[test]
fn forward_statements_outside_the_dsl_are_errors_naming_the_construct() {
    let one = |body: &str| {
        let e = parse_impl(&format!(
            "impl M {{ fn forward(&self, x: Tensor) -> Tensor {{ {body} }} }}"
        ))
        .err()
        .expect("an error");
        e.into_iter().next().unwrap().to_string()
    };
    let first_words = |body: &str| one(body).split(';').next().unwrap().to_string();
    assert_eq!(
        first_words("if true { x } else { x }"),
        "`if` is not supported in forward"
    );
    assert_eq!(
        first_words("let y = match x { _ => x }; y"),
        "`match` is not supported in forward"
    );
    assert!(one("let (a, b) = x; a").starts_with("a tuple `let` binds the parts of `split"));
    assert!(one("split(x, [A, B])").starts_with("split gives one tensor per size"));
    assert_eq!(
        first_words("return x;"),
        "`return` is not supported in forward"
    );
    assert_eq!(
        first_words("println!(\"\"); x"),
        "a macro call is not supported in forward"
    );
    assert_eq!(
        first_words("let f = |y| y; x"),
        "a closure is not supported in forward"
    );
    assert_eq!(
        first_words("while true {} x"),
        "`while` is not supported in forward"
    );
    assert_eq!(
        first_words("x.relu()"),
        "method calls on tensors (`.relu(..)`) are not supported in forward"
    );
    assert!(one("x % x").starts_with("`%` is not supported in forward"));
    assert!(one("x > x").starts_with("a comparison is the condition of `select"));
    assert!(one("relu(x, x)").starts_with("relu takes one argument: `relu(x)`"));
    assert!(one("select(x, x, x)").starts_with("select's first argument is a comparison"));
    assert!(one("swish(x)").starts_with("unknown function `swish` in forward"));
    assert!(one("gelu(x, x)").starts_with("gelu takes 1 argument, `gelu(x)`, not 2"));
    assert!(one("let y = x;").starts_with("forward ends with its output expression"));
    assert!(
        one("for b in &self.l { b(x); } x")
            .starts_with("a loop body holds `let name = expr;` and `name = expr;` statements")
    );
    assert!(one("for b in &self.l { if true { x = b(x); } } x").contains("a loop body holds"));
    assert!(one("for b in self.l.iter() { x = b(x); } x").contains("`&self.list`"));
    assert!(one("self.fc.forward(x)").contains("the only method of a field is `.logits(h)`"));
}

#[test]
fn forward_signatures_outside_the_dsl_are_errors() {
    let e = |sig: &str| {
        parse_impl(&format!("impl M {{ {sig} {{ x }} }}"))
            .err()
            .expect("an error")
            .into_iter()
            .next()
            .unwrap()
            .to_string()
    };
    assert!(e("fn forward(&mut self, x: Tensor) -> Tensor").starts_with("forward takes `&self`"));
    assert!(e("fn forward(&self, x: f32) -> Tensor").starts_with("forward's inputs are `Tensor`"));
    assert!(e("fn forward(&self, x: Tensor)").starts_with("forward returns a `Tensor`"));
    assert!(
        e("fn forward<T>(&self, x: Tensor) -> Tensor").starts_with("forward cannot be generic")
    );
    assert!(e("fn forwards(&self, x: Tensor) -> Tensor").contains("has none"));
    assert!(
        e("fn forward(&self, x: Tensor) -> Tensor { x } fn backward(&self)").contains("generated")
    );
}

// ---------------------------------------------------------------------------------------------
// model
// ---------------------------------------------------------------------------------------------

#[test]
fn gpt_forward_is_an_ssa_graph_in_evaluation_order() {
    let (_, _, g, a) = analyse(GPT, GPT_IMPL).unwrap();
    let nodes: Vec<_> = g
        .nodes
        .iter()
        .map(|n| (op_name(&n.op), n.site.clone().unwrap_or_default()))
        .collect();
    let expected = [
        ("self.wte", "wte"),
        ("self.wpe", "wpe"),
        ("+", ""),
        ("dropout", "dropout"),
        ("for &self.blocks", "blocks"),
        ("self.ln_f", "ln_f"),
        ("self.wte.logits", "wte_logits"),
        ("cross_entropy", "cross_entropy"),
    ];
    let expected: Vec<_> = expected
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    assert_eq!(nodes, expected);
    // Inputs, then one value per node.
    assert_eq!(g.values.len(), 2 + g.nodes.len());
    let names: Vec<_> = g
        .values
        .iter()
        .map(|v| v.name.clone().unwrap_or_default())
        .collect();
    assert_eq!(
        names,
        ["tokens", "targets", "", "", "x", "h", "h", "h", "", ""]
    );
    // `tokens` is used by both lookups, `targets` by the loss.
    let tokens = &g.values[g.inputs[0]];
    assert_eq!(
        tokens.uses,
        [Use::Arg { node: 0, arg: 0 }, Use::Arg { node: 1, arg: 0 }]
    );
    // The loop's input is the dropout's output; its output feeds ln_f.
    let lp = &g.nodes[4];
    assert_eq!(g.values[lp.args[0]].def, Def::Node(3));
    assert_eq!(g.nodes[5].args, [lp.output]);
    assert_eq!(g.values[g.output()].uses, [Use::Output]);
    let sh: Vec<_> = g
        .values
        .iter()
        .enumerate()
        .map(|(v, _)| a.sharding[v])
        .collect();
    use Sharding::{Ids, Replicated as R, Split};
    assert_eq!(sh, [Ids, Ids, R, R, R, R, R, R, Split, R]);
}

#[test]
fn variables_alias_values_and_reassignment_defines_new_ones() {
    let (_, _, g, _) = analyse(
        MLP,
        "impl Mlp { fn forward(&self, x: Tensor) -> Tensor {
            let y = x;
            let mut h = self.fc1(y);
            h = gelu(h);
            let h2 = self.fc2(h);
            h2
        } }",
    )
    .unwrap();
    assert_eq!(g.nodes.len(), 3);
    assert_eq!(g.nodes[0].args, [g.inputs[0]], "`y` is `x`");
    assert_eq!(g.values[g.nodes[1].output].name.as_deref(), Some("h"));
    assert_eq!(g.output(), g.nodes[2].output);
    assert_eq!(g.values[g.output()].name.as_deref(), Some("h2"));
}

#[test]
fn repeated_call_sites_get_numbered_names() {
    let (_, _, g, _) = analyse(
        "struct M { ln: LayerNorm, #[config] p: f32 }",
        "impl M { fn forward(&self, x: Tensor) -> Tensor {
            let a = dropout(self.ln(x), self.p);
            dropout(self.ln(a), self.p) + gelu(a)
        } }",
    )
    .unwrap();
    let sites: Vec<_> = g
        .nodes
        .iter()
        .filter_map(|n| Some((op_name(&n.op), n.site.clone()?)))
        .collect();
    // The second dropout fuses with the sum, which comes after gelu, but its site is named
    // where the dropout is, before gelu's: the names are those of the unfused forward.
    let want = [
        ("self.ln", "ln"),
        ("dropout", "dropout"),
        ("self.ln", "ln_1"),
        ("gelu", "gelu"),
        ("+ dropout", "dropout_1"),
    ];
    let want: Vec<_> = want.map(|(o, s)| (o.to_string(), s.to_string())).into();
    assert_eq!(sites, want);
}

#[test]
fn a_dropout_beside_a_sum_fuses_with_it() {
    let s = "struct M { ln: LayerNorm, f: Linear, #[config] p: f32 }";
    // Either side; with dropouts on both sides the right one fuses; a dropout bound to a name
    // first does not.
    let cases = [
        (
            "x + dropout(self.f(x), self.p)",
            vec!["self.f", "+ dropout"],
            Some(("self.f", "dropout")),
        ),
        (
            "dropout(self.f(x), self.p) + self.ln(x)",
            vec!["self.f", "self.ln", "+ dropout"],
            Some(("self.f", "dropout")),
        ),
        (
            "dropout(self.f(x), self.p) + dropout(self.ln(x), self.p)",
            vec!["self.f", "dropout", "self.ln", "+ dropout"],
            Some(("self.ln", "dropout_1")),
        ),
        (
            "let d = dropout(x, self.p); x + d",
            vec!["dropout", "+"],
            None,
        ),
    ];
    for (body, want, fused) in cases {
        let imp = format!("impl M {{ fn forward(&self, x: Tensor) -> Tensor {{ {body} }} }}");
        let (_, _, g, _) = analyse(s, &imp).unwrap_or_else(|e| panic!("{body}: {e:?}"));
        let ops: Vec<_> = g.nodes.iter().map(|n| op_name(&n.op)).collect();
        assert_eq!(ops, want, "{body}");
        let Some((branch_op, site)) = fused else {
            continue;
        };
        // The fused node takes [residual, branch]: the branch is the dropout's input.
        let node = g.nodes.last().expect("nodes");
        let Def::Node(n) = g.values[node.args[1]].def else {
            panic!("{body}: the branch is a node's output")
        };
        assert_eq!(op_name(&g.nodes[n].op), branch_op, "{body}");
        assert_eq!(node.site.as_deref(), Some(site), "{body}");
    }
}

#[test]
fn unknown_and_immutable_variables_are_errors() {
    assert_eq!(
        errors(
            MLP,
            "impl Mlp { fn forward(&self, x: Tensor) -> Tensor { self.fc2(y) } }"
        ),
        [
            "cannot find `y` in forward: it is neither an input nor bound by a `let` above (known \
          here: x)"
        ]
    );
    assert_eq!(
        errors(
            MLP,
            "impl Mlp { fn forward(&self, x: Tensor) -> Tensor { let h = x; h = self.fc1(h); h } }"
        ),
        ["`h` is assigned but not declared `let mut`"]
    );
}

// ---------------------------------------------------------------------------------------------
// validate
// ---------------------------------------------------------------------------------------------

#[test]
fn mlp_sharding_goes_replicated_split_replicated() {
    let (_, _, g, a) = analyse(
        MLP,
        "impl Mlp { fn forward(&self, x: Tensor) -> Tensor { let h = gelu(self.fc1(x)); self.fc2(h) } }",
    )
    .unwrap();
    assert_eq!(
        a.sharding,
        [
            Sharding::Replicated,
            Sharding::Split,
            Sharding::Split,
            Sharding::Replicated
        ]
    );
    assert_eq!(a.field[0], Some(0));
    assert_eq!(a.field[1], None);
    assert_eq!(g.values[2].name.as_deref(), Some("h"));
}

#[test]
fn row_parallel_fed_a_replicated_value() {
    assert_eq!(
        all_error("fn forward(&self, x: Tensor) -> Tensor { self.row(x) }"),
        "#[row_parallel] `row` needs its input split over tensor parallel (the output of a \
         #[column_parallel] layer), but `x` is replicated (forward's `Tensor` inputs are \
         replicated); write `#[row_parallel(input_is_parallel = false)]` to split it here"
    );
    assert_eq!(
        all_error("fn forward(&self, x: Tensor) -> Tensor { let h = self.ln(x); self.row(h) }"),
        "#[row_parallel] `row` needs its input split over tensor parallel (the output of a \
         #[column_parallel] layer), but `h` is replicated (it comes from `ln`, which runs whole \
         on every rank); write `#[row_parallel(input_is_parallel = false)]` to split it here"
    );
}

#[test]
fn column_parallel_fed_a_split_value() {
    assert_eq!(
        all_error(
            "fn forward(&self, x: Tensor) -> Tensor { let h = gelu(self.col(x)); self.row(self.col(h)) }"
        ),
        "#[column_parallel] `col` needs a replicated input, but `h` is split over tensor parallel \
         (it comes from #[column_parallel] `col`); write `#[column_parallel(gather_output = \
         true)]` on `col` to gather its output, or feed it to a #[row_parallel] layer first"
    );
}

#[test]
fn mixing_split_and_replicated_in_a_sum() {
    assert_eq!(
        all_error("fn forward(&self, x: Tensor) -> Tensor { self.rows(x + self.col(x)) }"),
        "`+` needs both sides sharded alike, but the output of `self.col(..)` is split over \
         tensor parallel (it comes from #[column_parallel] `col`) and `x` is replicated \
         (forward's `Tensor` inputs are replicated); write `#[column_parallel(gather_output = \
         true)]` on `col` to gather its output, or feed it to a #[row_parallel] layer first"
    );
}

#[test]
fn returning_a_split_value() {
    assert_eq!(
        all_error("fn forward(&self, x: Tensor) -> Tensor { let y = self.core(self.col(x)); y }"),
        "forward must return a replicated tensor, but `y` is split over tensor parallel (it comes \
         from #[column_parallel] `col`); write `#[column_parallel(gather_output = true)]` on \
         `col` to gather its output, or feed it to a #[row_parallel] layer first"
    );
}

#[test]
fn the_other_sharding_rules() {
    // Replicated layers need replicated inputs.
    assert!(
        all_error("fn forward(&self, x: Tensor) -> Tensor { self.ln(self.col(x)) }").starts_with(
            "`ln` (no split attribute: it runs whole on every rank) needs a replicated input"
        )
    );
    // input_is_parallel = false takes a replicated input and refuses a split one.
    assert!(
        analyse(
            ALL,
            "impl All { fn forward(&self, x: Tensor) -> Tensor { self.rows(x) } }"
        )
        .is_ok()
    );
    assert!(
        all_error("fn forward(&self, x: Tensor) -> Tensor { self.rows(self.col(x)) }")
            .ends_with("remove `input_is_parallel = false` to take the split input as it is")
    );
    // gather_output makes the output replicated.
    assert!(
        analyse(
            ALL,
            "impl All { fn forward(&self, x: Tensor) -> Tensor { self.ln(self.colg(x)) } }"
        )
        .is_ok()
    );
    // Ops keep the sharding; the lookup needs ids; logits need replicated input.
    assert!(analyse(ALL, "impl All { fn forward(&self, x: Tensor) -> Tensor { self.row(self.core(self.col(x))) } }").is_ok());
    assert_eq!(
        all_error("fn forward(&self, x: Tensor) -> Tensor { self.emb(x) }"),
        "#[vocab_parallel] `emb` looks up token ids, but `x` is a tensor; the tied output layer \
         is `self.emb.logits(h)`"
    );
    assert!(
        all_error("fn forward(&self, t: Ids) -> Tensor { gelu(t) }")
            .starts_with("gelu needs a tensor, but `t` is token ids (`Ids`)")
    );
    assert!(
        all_error("fn forward(&self, t: Ids, x: Tensor) -> Tensor { x + t }")
            .starts_with("`+` needs a tensor, but `t` is token ids (`Ids`)")
    );
    assert_eq!(
        all_error("fn forward(&self, x: Tensor) -> Tensor { cross_entropy(x, x) }"),
        "cross_entropy's targets are token ids (`Ids`), but `x` is a tensor"
    );
    assert!(
        all_error(
            "fn forward(&self, t: Ids, x: Tensor) -> Tensor { cross_entropy(self.emb.logits(self.col(x)), t) }"
        )
            .starts_with("`self.emb.logits(..)` needs a replicated input")
    );
    assert_eq!(
        all_error("fn forward(&self, t: Ids) -> Tensor { t }"),
        "forward returns a tensor, but `t` is token ids (`Ids`)"
    );
    // Vocab-parallel logits into cross_entropy are fine and replicated after.
    assert!(analyse(ALL, "impl All { fn forward(&self, t: Ids, x: Tensor) -> Tensor { cross_entropy(self.emb.logits(x + self.emb(t)), t) } }").is_ok());
}

#[test]
fn fields_are_called_as_their_kind_allows() {
    assert_eq!(
        all_error("fn forward(&self, x: Tensor) -> Tensor { self.col.logits(x) }"),
        "`.logits` is the tied output layer of a #[vocab_parallel] embedding, but `col` is \
         #[column_parallel]"
    );
    assert_eq!(
        all_error("fn forward(&self, x: Tensor) -> Tensor { self.fc3(x) }"),
        "`All` has no field `fc3` (its fields: col, colg, row, rows, emb, ln, stack, core, p)"
    );
    assert_eq!(
        all_error("fn forward(&self, x: Tensor) -> Tensor { self.p(x) }"),
        "`p` is #[config] data, not a layer: use it as a value, e.g. `dropout(x, self.p)`, not \
         as a call"
    );
    assert!(
        all_error("fn forward(&self, x: Tensor) -> Tensor { self.stack(x) }")
            .starts_with("`stack` is a list of modules: run it with a loop")
    );
    assert!(
        all_error("fn forward(&self, x: Tensor) -> Tensor { let mut h = x; for l in &self.ln { h = l(h); } h }")
            .starts_with("`ln` is not a list of modules")
    );
    assert_eq!(
        all_error("fn forward(&self, x: Tensor) -> Tensor { self.col(x, x) }"),
        "#[column_parallel] `col` takes one input, not 2"
    );
}

#[test]
fn unused_values_and_inputs_are_errors_but_unused_ids_are_not() {
    assert_eq!(
        all_error("fn forward(&self, x: Tensor) -> Tensor { let y = self.ln(x); x }"),
        "`y` is computed but never used: forward computes only what its output needs"
    );
    assert!(
        all_error("fn forward(&self, x: Tensor, z: Tensor) -> Tensor { self.ln(x) }")
            .starts_with("input `z` is never used")
    );
    assert!(
        analyse(
            ALL,
            "impl All { fn forward(&self, x: Tensor, t: Ids) -> Tensor { self.ln(x) } }"
        )
        .is_ok()
    );
}

#[test]
fn errors_do_not_cascade() {
    // One bad call: its output's sharding is unknown, so its users report nothing more.
    let e = errors(
        ALL,
        "impl All { fn forward(&self, x: Tensor) -> Tensor { let h = self.row(x); let y = gelu(h); self.row(y) } }",
    );
    assert_eq!(e.len(), 2, "{e:#?}");
    // Independent errors are all reported.
    let e = errors(
        ALL,
        "impl All { fn forward(&self, x: Tensor) -> Tensor { self.fc3(x) + self.fc4(x) } }",
    );
    assert_eq!(e.len(), 2, "{e:#?}");
}

// ---------------------------------------------------------------------------------------------
// generate
// ---------------------------------------------------------------------------------------------

fn root() -> Root {
    Root {
        runtime: quote::quote!(::megatron),
        macros: quote::quote!(::megatron),
    }
}

/// The generated impl items, without whitespace.
fn generated(s: &str, i: &str) -> String {
    let (s, imp, g, a) = analyse(s, i).unwrap();
    squash(
        &generate::impl_items(&root(), &s, &imp, &g, &a)
            .expect("generates")
            .to_string(),
    )
}

/// `s` without whitespace (token spacing differs between written and generated code).
fn squash(s: &str) -> String {
    s.split_whitespace().collect()
}

#[test]
fn mlp_expansion_has_f_and_g_where_megatron_puts_them() {
    let out = generated(
        MLP,
        "impl Mlp { fn forward(&self, x: Tensor) -> Tensor { let h = gelu(self.fc1(x)); self.fc2(h) } }",
    );
    for expected in [
        "pub struct MlpSaved { # [doc = \" What `self.fc1(..)` keeps.\"] pub fc1 : < Linear as :: megatron :: module :: Module > :: Saved",
        "let fc1_input = if cx . sequence_parallel () { :: megatron :: tensor_parallel :: all_gather_sequence (cx , x) ? } else { :: std :: clone :: Clone :: clone (x) } ;",
        "let (fc1_out , fc1_kept) = < Linear as ColumnParallel > :: forward_column (& self . fc1 , cx , site . child (\"fc1\") , & fc1_input) ? ;",
        "let fc1 = if cx . sequence_parallel () { < Linear as ColumnParallel > :: map_kept_input (fc1_kept , & | x | :: megatron :: tensor_parallel :: keep_sequence_shard (cx , x)) ? } else { fc1_kept } ;",
        "let (h , gelu) = :: megatron :: ops :: gelu (cx , site . child (\"gelu\") , & fc1_out) ? ;",
        "let (fc2_partial , fc2) = < Linear as RowParallel > :: forward_row (& self . fc2 , cx , site . child (\"fc2\") , & h) ? ;",
        "let fc2_out = if cx . sequence_parallel () { :: megatron :: tensor_parallel :: reduce_scatter_sequence (cx , & fc2_partial) ? } else { cx . tp () . all_reduce (& fc2_partial , ReduceOp :: Sum) ? ; fc2_partial } ; < Linear as RowParallel > :: add_bias (& self . fc2 , cx , & fc2_out) ? ;",
        "Ok ((fc2_out , MlpSaved { fc1 , gelu , fc2 }))",
        "let MlpSaved { fc1 , gelu , fc2 } = saved ;",
        "let d_fc2_whole = if cx . sequence_parallel () { :: megatron :: tensor_parallel :: all_gather_sequence (cx , d_out) ? } else { :: std :: clone :: Clone :: clone (d_out) } ;",
        "let (d_fc2_layer , fc2_weight_grad) = < Linear as RowParallel > :: backward_row_input (& self . fc2 , cx , site . child (\"fc2\") , fc2 , & d_fc2_whole) ? ;",
        // A LoRA adapter's input gradient joins the layer's, when the layer carries one.
        "let d_h = :: megatron :: tensor_parallel :: lora :: add_input_grad (d_fc2_layer , d_fc2_adapter) ? ;",
        "cx . weight_gradient (fc2_weight_grad) ? ;",
        "let d_fc1_out = :: megatron :: ops :: gelu_backward (cx , site . child (\"gelu\") , gelu , & d_h) ? ;",
        "let fc1_whole = if cx . sequence_parallel () { < Linear as ColumnParallel > :: map_kept_input (fc1 , & | x | :: megatron :: tensor_parallel :: all_gather_sequence (cx , x)) ? } else { fc1 } ;",
        "let (d_fc1_partial , fc1_weight_grad) = < Linear as ColumnParallel > :: backward_column_input (& self . fc1 , cx , site . child (\"fc1\") , fc1_whole , & d_fc1_out) ? ;",
        // The input gradient's all-reduce (B) before the weight gradients (W), which need none.
        "let d_x = if cx . sequence_parallel () { :: megatron :: tensor_parallel :: reduce_scatter_sequence (cx , & d_fc1_partial) ? } else { cx . tp () . all_reduce (& d_fc1_partial , ReduceOp :: Sum) ? ; d_fc1_partial } ;",
        "cx . weight_gradient (fc1_weight_grad) ? ; Ok (d_x)",
    ] {
        let expected = squash(expected);
        assert!(out.contains(&expected), "missing\n{expected}\nin\n{out}");
    }
    // Exactly one all-reduce each way, and with sequence parallelism one all-gather and one
    // reduce-scatter each way in its place (in forward and backward; the module's
    // `PartialOutput` functions after them leave fc2's to the caller).
    let (out, partial) = out
        .split_once("fn__forward_partial")
        .expect("the MLP ends in a row-parallel layer: PartialOutput");
    // (A LoRA adapter's all-reduces, `all_reduce_tp`, run only beside a layer that carries
    // one: three in each, counted apart.)
    let reduces = |s: &str| s.matches("all_reduce").count() - s.matches("all_reduce_tp").count();
    assert_eq!(reduces(partial), 1, "fc1's input gradient");
    assert_eq!(reduces(out), 2);
    assert_eq!(partial.matches("all_reduce_tp").count(), 3);
    assert_eq!(out.matches("all_reduce_tp").count(), 3);
    // (and the kept input's shard gathered again before fc1's backward)
    assert_eq!(out.matches("all_gather_sequence").count(), 3);
    assert_eq!(out.matches("reduce_scatter_sequence").count(), 2);
}

#[test]
fn shadowed_names_stay_readable_and_unambiguous() {
    let out = generated(
        "struct M { a: LayerNorm, b: LayerNorm, c: LayerNorm }",
        "impl M { fn forward(&self, x: Tensor) -> Tensor {
            let h = self.a(x);
            let y = h;
            let h = self.b(h);
            self.c(h) + y
        } }",
    );
    // The first `h` is still used (through `y`) after the second is defined: the second gets
    // another name.
    assert!(
        out.contains(&squash(
            "let (h, a) = self.a.forward(cx, site.child(\"a\"), x)?;"
        )),
        "{out}"
    );
    assert!(
        out.contains(&squash(
            "let (h_1, b) = self.b.forward(cx, site.child(\"b\"), &h)?;"
        )),
        "{out}"
    );
    assert!(
        out.contains(&squash("let add_out = ::megatron::ops::add(&c_out, &h)?;")),
        "{out}"
    );
    // In backward, `h` receives two contributions, in reverse order of use; the first one's
    // name is taken by then, so `h_1`'s gradient is `d_h_1_1`. The layer that makes the second
    // adds the first in its own backward (`backward_plus`): its result is `h`'s whole gradient.
    for line in [
        "let d_c_out = d_out.clone(); let d_h_1 = d_out.clone();",
        "let d_h_1_1 = self.c.backward(cx, site.child(\"c\"), c, &d_c_out)?;",
        "let d_h = self.b.backward_plus(cx, site.child(\"b\"), b, &d_h_1_1, &d_h_1)?;",
        "let d_x = self.a.backward(cx, site.child(\"a\"), a, &d_h)?;",
    ] {
        assert!(out.contains(&squash(line)), "{line}\n{out}");
    }
}

#[test]
fn a_layer_adds_the_sum_of_its_inputs_other_gradients() {
    let out = generated(
        "struct M { a: LayerNorm, b: LayerNorm }",
        "impl M { fn forward(&self, x: Tensor) -> Tensor {
            let h = self.a(x);
            let y = self.b(h);
            (y + h) + h
        } }",
    );
    // `h` has three uses: the two later ones' gradients are summed first (in reverse order of
    // use), and `b`, its first use, adds that sum in its backward.
    for line in [
        "let d_h = ::megatron::ops::add(&d_h_1, &d_h_2)?;",
        "let d_h_1 = self.b.backward_plus(cx, site.child(\"b\"), b, &d_y, &d_h)?;",
        "let d_x = self.a.backward(cx, site.child(\"a\"), a, &d_h_1)?;",
    ] {
        assert!(out.contains(&squash(line)), "{line}\n{out}");
    }
    assert!(!out.contains("backward(cx, site.child(\"b\")"), "{out}");
}

#[test]
fn a_saved_name_equal_to_a_value_name_is_renamed_locally() {
    let out = generated(
        "struct M { fc: LayerNorm }",
        "impl M { fn forward(&self, x: Tensor) -> Tensor { let fc = self.fc(x); gelu(fc) } }",
    );
    assert!(
        out.contains(&squash(
            "let (fc, fc_1) = self.fc.forward(cx, site.child(\"fc\"), x)?;"
        )),
        "{out}"
    );
    assert!(out.contains(&squash("MSaved { fc: fc_1, gelu }")), "{out}");
}

#[test]
fn the_struct_items_build_with_the_field_attributes() {
    let s = parse_struct(GPT).unwrap();
    let out = squash(
        &generate::struct_items(
            &root(),
            &s,
            &quote::quote!(
                struct Gpt {}
            ),
        )
        .to_string(),
    );
    for expected in [
        "pub struct GptSpec",
        "pub blocks : :: std :: vec :: Vec < < Block as :: megatron :: module :: Module > :: Spec >",
        "pub embedding_dropout : f32",
        "wte : b . scoped (\"wte\" , | b | < Embedding as :: megatron :: module :: VocabParallel > :: build_vocab (& spec . wte , b)) ?",
        "type Saved = GptSaved ;",
        "macro_rules ! __megatron_module_Gpt",
        ":: megatron :: __module_impl ! { struct Gpt { } ; $ ($ impl_tokens) * }",
        "for m in & self . blocks { < Block as :: megatron :: module :: Module > :: visit_params (m , f) ; }",
        "embedding_dropout : :: std :: clone :: Clone :: clone (& spec . embedding_dropout)",
    ] {
        let expected = squash(expected);
        assert!(out.contains(&expected), "missing\n{expected}\nin\n{out}");
    }
}
