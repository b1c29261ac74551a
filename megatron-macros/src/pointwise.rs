//! The element-wise vocabulary of forward (`+ − × ÷`, `relu`, `exp`, `clamp`, `select`, ...)
//! and the fused kernels generated from a chain of it.
//!
//! A chain (found by `fuse`) is a [`Program`]: instructions over the chain's tensor inputs,
//! its scalars and earlier results. From it come the forward kernel and, by reverse-mode
//! differentiation with each operation's rule ([`partials`]), the backward kernel, each as a
//! host loop (Rust, over slices) and as CUDA C (one thread per element), written from one
//! expression tree ([`Sx`]) so that both devices compute the same formula.

use std::fmt::Write as _;

/// An element-wise function called by name in forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Func {
    Relu,
    Square,
    Silu,
    /// GPT-2's tanh approximation (the `gelu` builtin when it stands alone).
    Gelu,
    GeluErf,
    Sigmoid,
    Tanh,
    Exp,
    Log,
    Sqrt,
    Rsqrt,
    Softplus,
    Abs,
    /// `clamp(x, lo, hi)`, `lo` and `hi` scalars.
    Clamp,
}

/// Every function by its name in forward, with its usage.
pub const FUNCS: [(&str, Func, &str); 14] = [
    ("relu", Func::Relu, "relu(x)"),
    ("square", Func::Square, "square(x)"),
    ("silu", Func::Silu, "silu(x)"),
    ("gelu", Func::Gelu, "gelu(x)"),
    ("gelu_erf", Func::GeluErf, "gelu_erf(x)"),
    ("sigmoid", Func::Sigmoid, "sigmoid(x)"),
    ("tanh", Func::Tanh, "tanh(x)"),
    ("exp", Func::Exp, "exp(x)"),
    ("log", Func::Log, "log(x)"),
    ("sqrt", Func::Sqrt, "sqrt(x)"),
    ("rsqrt", Func::Rsqrt, "rsqrt(x)"),
    ("softplus", Func::Softplus, "softplus(x)"),
    ("abs", Func::Abs, "abs(x)"),
    ("clamp", Func::Clamp, "clamp(x, lo, hi)"),
];

/// The list of element-wise functions, for messages.
pub fn names() -> String {
    let mut s: Vec<&str> = FUNCS.iter().map(|f| f.0).collect();
    s.push("select");
    s.join(", ")
}

impl Func {
    /// The function's name (in forward, in `kernels::pointwise` and, as `pw_name`, in CUDA).
    pub fn name(self) -> &'static str {
        FUNCS
            .iter()
            .find(|f| f.1 == self)
            .map(|f| f.0)
            .expect("every function is listed")
    }

    /// Its arguments.
    pub fn arity(self) -> usize {
        match self {
            Func::Clamp => 3,
            _ => 1,
        }
    }

    /// Whether its derivative is written from its output (so a chain of it alone keeps the
    /// output, not the input).
    pub fn grad_from_output(self) -> bool {
        matches!(
            self,
            Func::Relu | Func::Sigmoid | Func::Tanh | Func::Exp | Func::Sqrt | Func::Rsqrt
        )
    }
}

/// A comparison, `select`'s condition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cmp {
    Lt,
    Le,
    Gt,
    Ge,
}

impl Cmp {
    fn symbol(self) -> &'static str {
        match self {
            Cmp::Lt => "<",
            Cmp::Le => "<=",
            Cmp::Gt => ">",
            Cmp::Ge => ">=",
        }
    }
}

/// One element-wise operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PwOp {
    Add,
    Sub,
    Mul,
    Div,
    Neg,
    Func(Func),
    /// `select(a cmp b, x, y)`: operands `[a, b, x, y]`.
    Select(Cmp),
}

impl PwOp {
    /// A name for the call site that saves it.
    pub fn site_name(self) -> &'static str {
        match self {
            PwOp::Add => "add",
            PwOp::Sub => "sub",
            PwOp::Mul => "mul",
            PwOp::Div => "div",
            PwOp::Neg => "neg",
            PwOp::Func(f) => f.name(),
            PwOp::Select(_) => "select",
        }
    }
}

/// An operand of an instruction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operand {
    /// The chain's `k`-th tensor input.
    Input(usize),
    /// The result of instruction `k`.
    Reg(usize),
    /// The chain's `k`-th scalar.
    Scalar(usize),
    /// A literal, by its `f32` bits (written into the kernels).
    Const(u32),
}

/// One instruction of a chain.
#[derive(Debug, Clone)]
pub struct Inst {
    pub op: PwOp,
    pub operands: Vec<Operand>,
}

/// A chain of element-wise operations: its last instruction is the output.
#[derive(Debug, Clone)]
pub struct Program {
    /// Tensor inputs.
    pub inputs: usize,
    /// Scalars.
    pub scalars: usize,
    pub insts: Vec<Inst>,
}

/// A scalar expression of a kernel, rendered as Rust or as CUDA C.
#[derive(Debug, Clone)]
enum Sx {
    Var(String),
    Lit(&'static str),
    /// A literal of the user's.
    Num(f32),
    Call(&'static str, Vec<Sx>),
    Bin(&'static str, Box<Sx>, Box<Sx>),
    Neg(Box<Sx>),
    /// `select(a cmp b, x, y)`.
    Select(Cmp, Box<[Sx; 4]>),
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Lang {
    Rust,
    Cuda,
    /// As forward wrote it, for docs and messages.
    Formula,
}

impl Sx {
    /// The expression as a statement's right-hand side: without outer parentheses.
    fn render_top(&self, lang: Lang) -> String {
        let text = self.render(lang);
        match self {
            Sx::Bin(..) | Sx::Neg(_) => text[1..text.len() - 1].to_string(),
            _ => text,
        }
    }

    /// The variables it reads.
    fn reads(&self, out: &mut Vec<String>) {
        match self {
            Sx::Var(v) => out.push(v.clone()),
            Sx::Lit(_) | Sx::Num(_) => {}
            Sx::Call(_, args) => args.iter().for_each(|a| a.reads(out)),
            Sx::Bin(_, a, b) => {
                a.reads(out);
                b.reads(out);
            }
            Sx::Neg(a) => a.reads(out),
            Sx::Select(_, args) => args.iter().for_each(|a| a.reads(out)),
        }
    }

    fn var(name: impl Into<String>) -> Sx {
        Sx::Var(name.into())
    }

    fn bin(op: &'static str, a: Sx, b: Sx) -> Sx {
        Sx::Bin(op, Box::new(a), Box::new(b))
    }

    fn call(f: &'static str, args: Vec<Sx>) -> Sx {
        Sx::Call(f, args)
    }

    fn render(&self, lang: Lang) -> String {
        match self {
            Sx::Var(v) => v.clone(),
            Sx::Lit(l) => match lang {
                Lang::Rust | Lang::Formula => l.to_string(),
                Lang::Cuda => format!("{l}f"),
            },
            Sx::Num(x) => {
                // The shortest text that reads back as `x` (with a decimal point or exponent).
                let text = format!("{:?}", x.abs());
                let text = match lang {
                    Lang::Rust => format!("{text}_f32"),
                    Lang::Cuda => format!("{text}f"),
                    Lang::Formula => text,
                };
                if x.is_sign_negative() {
                    format!("(-{text})")
                } else {
                    text
                }
            }
            Sx::Call(f, args) => {
                let args: Vec<String> = args.iter().map(|a| a.render(lang)).collect();
                match lang {
                    Lang::Rust => format!("pw::{f}({})", args.join(", ")),
                    Lang::Cuda => format!("pw_{f}({})", args.join(", ")),
                    Lang::Formula => format!("{f}({})", args.join(", ")),
                }
            }
            Sx::Bin(op, a, b) => format!("({} {op} {})", a.render(lang), b.render(lang)),
            Sx::Neg(a) => format!("(-{})", a.render(lang)),
            Sx::Select(cmp, args) => {
                let [a, b, x, y] = &**args;
                let f = match lang {
                    Lang::Rust => "pw::select",
                    Lang::Cuda => "pw_select",
                    Lang::Formula => "select",
                };
                format!(
                    "{f}({} {} {}, {}, {})",
                    a.render(lang),
                    cmp.symbol(),
                    b.render(lang),
                    x.render(lang),
                    y.render(lang)
                )
            }
        }
    }
}

/// The expression of instruction `inst` over its operands' expressions.
fn value_of(inst: &Inst, ops: &[Sx]) -> Sx {
    let a = || ops[0].clone();
    let b = || ops[1].clone();
    match inst.op {
        PwOp::Add => Sx::bin("+", a(), b()),
        PwOp::Sub => Sx::bin("-", a(), b()),
        PwOp::Mul => Sx::bin("*", a(), b()),
        PwOp::Div => Sx::bin("/", a(), b()),
        PwOp::Neg => Sx::Neg(Box::new(a())),
        PwOp::Func(Func::Square) => Sx::bin("*", a(), a()),
        PwOp::Func(f) => Sx::call(f.name(), ops.to_vec()),
        PwOp::Select(cmp) => Sx::Select(
            cmp,
            Box::new([
                ops[0].clone(),
                ops[1].clone(),
                ops[2].clone(),
                ops[3].clone(),
            ]),
        ),
    }
}

/// The gradient each operand receives from instruction `inst` (value `y`, operands `ops`,
/// output gradient `g`); `None` for an operand that gets none (a comparison's, clamp's bounds).
fn partials(inst: &Inst, ops: &[Sx], y: &Sx, g: &Sx) -> Vec<Option<Sx>> {
    let a = || ops[0].clone();
    let b = || ops[1].clone();
    let g = || g.clone();
    let y = || y.clone();
    let times = |d: Sx| Sx::bin("*", g(), d);
    match inst.op {
        PwOp::Add => vec![Some(g()), Some(g())],
        PwOp::Sub => vec![Some(g()), Some(Sx::Neg(Box::new(g())))],
        PwOp::Mul => vec![Some(times(b())), Some(times(a()))],
        // d(a/b)/db = −(a/b)/b.
        PwOp::Div => vec![
            Some(Sx::bin("/", g(), b())),
            Some(Sx::Neg(Box::new(Sx::bin("/", times(y()), b())))),
        ],
        PwOp::Neg => vec![Some(Sx::Neg(Box::new(g())))],
        PwOp::Func(f) => {
            let d = match f {
                Func::Relu => Sx::call("relu_grad", vec![y()]),
                Func::Square => Sx::bin("*", Sx::Lit("2.0"), a()),
                Func::Silu => Sx::call("silu_grad", vec![a()]),
                Func::Gelu => Sx::call("gelu_grad", vec![a()]),
                Func::GeluErf => Sx::call("gelu_erf_grad", vec![a()]),
                Func::Softplus => Sx::call("softplus_grad", vec![a()]),
                Func::Abs => Sx::call("abs_grad", vec![a()]),
                Func::Sigmoid => Sx::bin("*", y(), Sx::bin("-", Sx::Lit("1.0"), y())),
                Func::Tanh => Sx::bin("-", Sx::Lit("1.0"), Sx::bin("*", y(), y())),
                Func::Exp => y(),
                Func::Log => return vec![Some(Sx::bin("/", g(), a()))],
                Func::Sqrt => Sx::bin("/", Sx::Lit("0.5"), y()),
                Func::Rsqrt => Sx::bin(
                    "*",
                    Sx::Lit("-0.5"),
                    Sx::bin("*", y(), Sx::bin("*", y(), y())),
                ),
                Func::Clamp => {
                    let d = Sx::call("clamp_grad", ops.to_vec());
                    return vec![Some(times(d)), None, None];
                }
            };
            vec![Some(times(d))]
        }
        PwOp::Select(cmp) => {
            let pick = |on_true: Sx, on_false: Sx| {
                Sx::Select(cmp, Box::new([a(), b(), on_true, on_false]))
            };
            vec![
                None,
                None,
                Some(pick(g(), Sx::Lit("0.0"))),
                Some(pick(Sx::Lit("0.0"), g())),
            ]
        }
    }
}

/// The chain as one expression over the names of its inputs and scalars: a result read twice,
/// or named by a `let`, is bound first (`h = relu(self.fc1(..)); h * h`).
pub fn formula(
    p: &Program,
    inputs: &[String],
    scalars: &[String],
    names: &[Option<String>],
) -> String {
    let mut reads = vec![0usize; p.insts.len()];
    for inst in &p.insts {
        for o in &inst.operands {
            if let Operand::Reg(k) = o {
                reads[*k] += 1;
            }
        }
    }
    let mut bindings = Vec::new();
    let mut regs: Vec<Sx> = Vec::new();
    let last = p.insts.len() - 1;
    for (i, inst) in p.insts.iter().enumerate() {
        let ops: Vec<Sx> = inst
            .operands
            .iter()
            .map(|&o| match o {
                Operand::Input(k) => Sx::var(inputs[k].clone()),
                Operand::Scalar(k) => Sx::var(scalars[k].clone()),
                Operand::Reg(k) => regs[k].clone(),
                Operand::Const(bits) => Sx::Num(f32::from_bits(bits)),
            })
            .collect();
        let value = value_of(inst, &ops);
        let name = names.get(i).cloned().flatten();
        if i < last && (reads[i] > 1 || (reads[i] == 1 && name.is_some())) {
            let name = name.unwrap_or_else(|| format!("t{i}"));
            bindings.push(format!("{name} = {}", value.render_top(Lang::Formula)));
            regs.push(Sx::var(name));
        } else {
            regs.push(value);
        }
    }
    bindings.push(regs[last].render_top(Lang::Formula));
    bindings.join("; ")
}

/// What the backward kernel of `p` reads: the output alone when the chain is one function whose
/// derivative comes from its output, else the inputs.
pub fn keeps_output(p: &Program) -> bool {
    match p.insts.as_slice() {
        [inst] => match inst.op {
            PwOp::Func(f) => f.grad_from_output() && inst.operands == [Operand::Input(0)],
            _ => false,
        },
        _ => false,
    }
}

/// A kernel's text in both languages: its statements, then what it writes.
struct Kernel {
    /// Names of the tensors read, in order.
    reads: Vec<String>,
    /// Names of the tensors written and the expression each gets.
    writes: Vec<(String, Sx)>,
    /// `let name = expr;` in order.
    lets: Vec<(String, Sx)>,
    scalars: usize,
}

fn operand_sx(o: Operand, input: &dyn Fn(usize) -> String) -> Sx {
    match o {
        Operand::Input(k) => Sx::var(input(k)),
        Operand::Reg(k) => Sx::var(format!("r{k}")),
        Operand::Scalar(k) => Sx::var(format!("s{k}")),
        Operand::Const(bits) => Sx::Num(f32::from_bits(bits)),
    }
}

fn forward_kernel(p: &Program) -> Kernel {
    let input = |k: usize| format!("x{k}");
    let mut lets = Vec::new();
    for (i, inst) in p.insts.iter().enumerate() {
        let ops: Vec<Sx> = inst
            .operands
            .iter()
            .map(|&o| operand_sx(o, &input))
            .collect();
        lets.push((format!("r{i}"), value_of(inst, &ops)));
    }
    let last = p.insts.len() - 1;
    Kernel {
        reads: (0..p.inputs).map(input).collect(),
        writes: vec![("y0".into(), Sx::var(format!("r{last}")))],
        lets,
        scalars: p.scalars,
    }
}

fn backward_kernel(p: &Program) -> Kernel {
    let keep_output = keeps_output(p);
    let input = |k: usize| format!("x{k}");
    let last = p.insts.len() - 1;
    let mut lets = Vec::new();
    let reads = if keep_output {
        // The output is read, under the name of the last register.
        vec![format!("r{last}"), "dy".into()]
    } else {
        // Recompute the chain from its inputs.
        for (i, inst) in p.insts.iter().enumerate() {
            let ops: Vec<Sx> = inst
                .operands
                .iter()
                .map(|&o| operand_sx(o, &input))
                .collect();
            lets.push((format!("r{i}"), value_of(inst, &ops)));
        }
        let mut r: Vec<String> = (0..p.inputs).map(input).collect();
        r.push("dy".into());
        r
    };
    // Gradient contributions per register and per input, in the order they arrive.
    let mut to_reg: Vec<Vec<Sx>> = vec![Vec::new(); p.insts.len()];
    let mut to_input: Vec<Vec<Sx>> = vec![Vec::new(); p.inputs];
    to_reg[last].push(Sx::var("dy"));
    for (i, inst) in p.insts.iter().enumerate().rev() {
        let contributions = std::mem::take(&mut to_reg[i]);
        if contributions.is_empty() {
            continue;
        }
        let g = if i == last {
            Sx::var("dy")
        } else {
            let name = format!("g{i}");
            lets.push((name.clone(), sum(contributions)));
            Sx::var(name)
        };
        let ops: Vec<Sx> = inst
            .operands
            .iter()
            .map(|&o| operand_sx(o, &input))
            .collect();
        let y = Sx::var(format!("r{i}"));
        for (&o, d) in inst.operands.iter().zip(partials(inst, &ops, &y, &g)) {
            let Some(d) = d else { continue };
            match o {
                Operand::Reg(k) => to_reg[k].push(d),
                Operand::Input(k) => to_input[k].push(d),
                Operand::Scalar(_) | Operand::Const(_) => {}
            }
        }
    }
    let writes: Vec<(String, Sx)> = to_input
        .into_iter()
        .enumerate()
        .map(|(k, c)| {
            let value = if c.is_empty() { Sx::Lit("0.0") } else { sum(c) };
            (format!("d{k}"), value)
        })
        .collect();
    Kernel {
        reads,
        lets: live(lets, &writes),
        writes,
        scalars: p.scalars,
    }
}

/// The statements of `lets` that `writes` need (the backward recomputes only what its
/// derivatives read).
fn live(lets: Vec<(String, Sx)>, writes: &[(String, Sx)]) -> Vec<(String, Sx)> {
    let mut needed = Vec::new();
    for (_, w) in writes {
        w.reads(&mut needed);
    }
    let mut kept = Vec::new();
    for (name, value) in lets.into_iter().rev() {
        if needed.contains(&name) {
            value.reads(&mut needed);
            kept.push((name, value));
        }
    }
    kept.reverse();
    kept
}

fn sum(mut terms: Vec<Sx>) -> Sx {
    let first = terms.remove(0);
    terms.into_iter().fold(first, |acc, t| Sx::bin("+", acc, t))
}

impl Kernel {
    /// The host loop: `fn host(inputs, scalars, outputs)` over equally long slices.
    fn rust(&self, rt: &str) -> String {
        let reads = self.reads.join(", ");
        let scalars: Vec<String> = (0..self.scalars).map(|k| format!("s{k}")).collect();
        let writes: Vec<&str> = self.writes.iter().map(|w| w.0.as_str()).collect();
        let mut s = String::new();
        let _ = writeln!(
            s,
            "fn host(inputs: &[&[f32]], scalars: &[f32], outputs: &mut [&mut [f32]]) {{"
        );
        let _ = writeln!(
            s,
            "let (&[{reads}], &[{}], [{}]) = (inputs, scalars, outputs) else {{ \
             unreachable!(\"ops::fused checks the counts\") }};",
            scalars.join(", "),
            writes.join(", ")
        );
        // The loop, compiled once per instruction set (AVX-512, AVX2, the baseline).
        let params: Vec<String> = self
            .reads
            .iter()
            .map(|r| format!("{r}: &[f32]"))
            .chain(scalars.iter().map(|k| format!("{k}: f32")))
            .chain(writes.iter().map(|w| format!("{w}: &mut [f32]")))
            .collect();
        s.push_str("#[inline(always)]\n");
        let _ = writeln!(s, "fn each({}) {{", params.join(", "));
        let _ = writeln!(s, "use {rt}::kernels::pointwise as pw;");
        // outputs first, then inputs, zipped: `((y0, &x0), &x1)`.
        let mut iter = format!("{}.iter_mut()", writes[0]);
        let mut pat = writes[0].to_string();
        for w in &writes[1..] {
            iter = format!("{iter}.zip({w}.iter_mut())");
            pat = format!("({pat}, {w})");
        }
        for r in &self.reads {
            iter = format!("{iter}.zip({r}.iter())");
            pat = format!("({pat}, &{r})");
        }
        let _ = writeln!(s, "for {pat} in {iter} {{");
        for (name, value) in &self.lets {
            let _ = writeln!(s, "let {name} = {};", value.render_top(Lang::Rust));
        }
        for (name, value) in &self.writes {
            let _ = writeln!(s, "*{name} = {};", value.render_top(Lang::Rust));
        }
        s.push_str("}\n}\n");
        let args: Vec<&str> = self
            .reads
            .iter()
            .map(String::as_str)
            .chain(scalars.iter().map(String::as_str))
            .chain(writes.iter().copied())
            .collect();
        let _ = writeln!(
            s,
            "{rt}::kernels::isa::dispatch(|| each({}));",
            args.join(", ")
        );
        s.push_str("}\n");
        s
    }

    /// The CUDA kernel `name`.
    fn cuda(&self, name: &str) -> String {
        let mut params: Vec<String> = Vec::new();
        for r in &self.reads {
            params.push(format!("const void* __restrict__ {r}_in, int {r}_bf16"));
        }
        for (w, _) in &self.writes {
            params.push(format!("void* __restrict__ {w}_out, int {w}_bf16"));
        }
        for k in 0..self.scalars {
            params.push(format!("float s{k}"));
        }
        params.push("u64 n".into());
        let mut s = String::new();
        let _ = writeln!(
            s,
            "extern \"C\" __global__ void {name}({}) {{",
            params.join(", ")
        );
        s.push_str("    FOR_EACH(i, n) {\n");
        for r in &self.reads {
            let _ = writeln!(s, "        const float {r} = load_in({r}_in, {r}_bf16, i);");
        }
        for (name, value) in &self.lets {
            let _ = writeln!(
                s,
                "        const float {name} = {};",
                value.render(Lang::Cuda)
            );
        }
        for (w, value) in &self.writes {
            let _ = writeln!(
                s,
                "        store_out({w}_out, {w}_bf16, i, {});",
                value.render_top(Lang::Cuda)
            );
        }
        s.push_str("    }\n}\n");
        s
    }
}

/// The generated code of one chain.
pub struct Generated {
    /// The forward's and backward's CUDA kernel names.
    pub names: [String; 2],
    /// Their host loops (Rust source of `fn host`).
    pub host: [String; 2],
    /// Their CUDA C.
    pub cuda: [String; 2],
    /// Whether the backward reads the output (else the inputs).
    pub keeps_output: bool,
}

/// FNV-1a, 64 bits: a kernel name's suffix from its source (same source, same kernel).
fn fnv(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The kernels of `p`, named from `stem` (the module and call site, in lower case).
pub fn generate(p: &Program, stem: &str, rt: &str) -> Generated {
    let kernels = [forward_kernel(p), backward_kernel(p)];
    let body = |k: &Kernel| k.cuda("KERNEL");
    let hash = fnv(&(body(&kernels[0]) + &body(&kernels[1])));
    let names = [
        format!("{stem}_{hash:016x}_forward"),
        format!("{stem}_{hash:016x}_backward"),
    ];
    Generated {
        host: [kernels[0].rust(rt), kernels[1].rust(rt)],
        cuda: [kernels[0].cuda(&names[0]), kernels[1].cuda(&names[1])],
        names,
        keeps_output: keeps_output(p),
    }
}

/// The value of a numeric literal, possibly negated or in parentheses (`2.0`, `-1`, `(0.5)`).
pub fn literal_value(e: &syn::Expr) -> Option<f32> {
    match e {
        syn::Expr::Lit(l) => match &l.lit {
            syn::Lit::Float(f) => f.base10_parse::<f32>().ok(),
            syn::Lit::Int(i) => i.base10_parse::<f32>().ok(),
            _ => None,
        },
        syn::Expr::Paren(p) => literal_value(&p.expr),
        syn::Expr::Group(g) => literal_value(&g.expr),
        syn::Expr::Unary(u) if matches!(u.op, syn::UnOp::Neg(_)) => {
            literal_value(&u.expr).map(|v| -v)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn relu_squared() -> Program {
        Program {
            inputs: 1,
            scalars: 0,
            insts: vec![
                Inst {
                    op: PwOp::Func(Func::Relu),
                    operands: vec![Operand::Input(0)],
                },
                Inst {
                    op: PwOp::Mul,
                    operands: vec![Operand::Reg(0), Operand::Reg(0)],
                },
            ],
        }
    }

    #[test]
    fn backward_sums_the_contributions_of_a_register_used_twice() {
        let g = generate(&relu_squared(), "m_mul", "::megatron");
        assert!(g.host[0].contains("let r1 = r0 * r0;"), "{}", g.host[0]);
        assert!(
            g.host[1].contains("let g0 = (dy * r0) + (dy * r0);"),
            "{}",
            g.host[1]
        );
        // The backward recomputes the ReLU, not the square.
        assert!(!g.host[1].contains("let r1"), "{}", g.host[1]);
        assert!(
            g.host[1].contains("*d0 = g0 * pw::relu_grad(r0);"),
            "{}",
            g.host[1]
        );
        assert!(
            g.cuda[0].contains("const float r0 = pw_relu(x0);"),
            "{}",
            g.cuda[0]
        );
        assert!(!g.keeps_output);
    }

    #[test]
    fn one_function_keeps_its_output() {
        let p = Program {
            inputs: 1,
            scalars: 0,
            insts: vec![Inst {
                op: PwOp::Func(Func::Sigmoid),
                operands: vec![Operand::Input(0)],
            }],
        };
        let g = generate(&p, "m_sigmoid", "::megatron");
        assert!(g.keeps_output);
        assert!(g.host[1].contains("(&[r0, dy]"), "{}", g.host[1]);
    }
}
