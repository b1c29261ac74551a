//! One collective where one suffices (issue 46, section 5): in GPT-J's and PaLM's parallel
//! block, written flat, the attention's and the MLP's row-parallel outputs are summed, so the
//! generated forward sums their partial outputs and reduces them once (and, with sequence
//! parallelism, gathers the output gradient once in backward); the norm's output feeds two
//! column-parallel layers, so it is gathered once (sequence parallelism) and their input
//! gradients are summed and reduced once. Checked by counting the tensor-parallel group's calls
//! of one forward and backward, and by tp 2 (with and without sequence parallelism) following
//! tp 1 to the order of f32 sums.

mod support;

use megatron::audit;
use megatron::comm::ParallelState;
use megatron::comm::recording::{Call, RecordingWorld};
use megatron::comm::threads::launch;
use megatron::distributed::sum_sequence_parallel_gradients;
use megatron::models::gpt::{Attention, AttentionSpec, Mlp, MlpSpec};
use megatron::module::{Builder, Cx, Module, Site};
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::prelude::*;
use megatron::tensor::Tensor;

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// The parallel block: one norm feeds the attention and the MLP, both added to the residual.
#[megatron::module]
pub struct ParallelBlock {
    ln: LayerNorm,
    #[column_parallel]
    qkv: Linear,
    #[context_parallel]
    core: CausalSelfAttention,
    #[row_parallel]
    proj: Linear,
    #[column_parallel]
    fc1: Linear,
    #[row_parallel]
    fc2: Linear,
}

#[megatron::module]
impl ParallelBlock {
    fn forward(&self, x: Tensor) -> Tensor {
        let n = self.ln(x);
        x + self.proj(self.core(self.qkv(n))) + self.fc2(gelu(self.fc1(n)))
    }
}

const SEQ: usize = 8;
const BATCH: usize = 2;
const H: usize = 16;
const HEADS: usize = 4;

/// The parallel block written with its branches as sub-modules (GPT's attention and MLP): their
/// partial outputs are summed across the module boundary and reduced once.
#[megatron::module]
pub struct ModularBlock {
    ln: LayerNorm,
    #[partial_output]
    attn: Attention,
    #[partial_output]
    mlp: Mlp,
}

#[megatron::module]
impl ModularBlock {
    fn forward(&self, x: Tensor) -> Tensor {
        let n = self.ln(x);
        x + self.attn(n) + self.mlp(n)
    }
}

/// A block under test: its spec, forward and backward.
trait Block: Module {
    fn spec() -> Self::Spec;
    fn run(&self, cx: &Cx, x: &Tensor) -> megatron::Result<(Tensor, Self::Saved)>;
    fn back(&self, cx: &Cx, saved: Self::Saved, dy: &Tensor) -> megatron::Result<Tensor>;
}

impl Block for ParallelBlock {
    fn spec() -> ParallelBlockSpec {
        ParallelBlockSpec {
            ln: LayerNormSpec::new(H),
            qkv: LinearSpec::new(H, 3 * H),
            core: CausalSelfAttention::new(HEADS, 0.0),
            proj: LinearSpec::new(H, H),
            fc1: LinearSpec::new(H, 4 * H),
            fc2: LinearSpec::new(4 * H, H),
        }
    }
    fn run(&self, cx: &Cx, x: &Tensor) -> megatron::Result<(Tensor, Self::Saved)> {
        self.forward(cx, Site::ROOT, x)
    }
    fn back(&self, cx: &Cx, saved: Self::Saved, dy: &Tensor) -> megatron::Result<Tensor> {
        self.backward(cx, Site::ROOT, saved, dy)
    }
}

impl Block for ModularBlock {
    fn spec() -> ModularBlockSpec {
        ModularBlockSpec {
            ln: LayerNormSpec::new(H),
            attn: AttentionSpec {
                qkv: LinearSpec::new(H, 3 * H),
                qk_norm: QkNormSpec::Off,
                core: CausalSelfAttention::new(HEADS, 0.0),
                proj: LinearSpec::new(H, H),
            },
            mlp: MlpSpec {
                fc1: LinearSpec::new(H, 4 * H),
                fc2: LinearSpec::new(4 * H, H),
            },
        }
    }
    fn run(&self, cx: &Cx, x: &Tensor) -> megatron::Result<(Tensor, Self::Saved)> {
        self.forward(cx, Site::ROOT, x)
    }
    fn back(&self, cx: &Cx, saved: Self::Saved, dy: &Tensor) -> megatron::Result<Tensor> {
        self.backward(cx, Site::ROOT, saved, dy)
    }
}

fn values(salt: usize) -> Vec<f32> {
    (0..SEQ * BATCH * H)
        .map(|i| (((i * 7919 + salt * 104_729) % 2003) as f32 / 2003.0 - 0.5) * 2.0)
        .collect()
}

/// What one run gives: the last step's output and input gradient (the whole sequence), every
/// replicated parameter of rank 0, and the tensor-parallel calls of the first step's forward
/// and of its backward (their kinds, and the calls).
struct Run {
    y: Vec<f32>,
    dx: Vec<f32>,
    replicated: Vec<(String, Vec<f32>)>,
    forward_calls: Vec<String>,
    backward_calls: Vec<String>,
    recorded: (Vec<Call>, Vec<Call>),
}

fn train<M: Block>(tp: usize, sp: bool, steps: usize) -> Run {
    let layout = ParallelLayout::new(&ParallelConfig::new(tp).with_tp(tp)).unwrap();
    let per_rank = launch(tp, |w| -> R<Run> {
        let recording = RecordingWorld::new(&w);
        let ps = ParallelState::new(&recording, &layout)?.with_sequence_parallel(sp);
        let model = M::build(&M::spec(), &mut Builder::for_rank(5, ps.groups()))?;
        let rank = ps.groups().tp_rank();
        let rows = if sp { SEQ / tp } else { SEQ };
        let part = |all: Vec<f32>| {
            let n = rows * BATCH * H;
            let start = if sp { rank * n } else { 0 };
            all[start..start + n].to_vec()
        };
        let tp_only =
            |log: Vec<Call>| -> Vec<Call> { log.into_iter().filter(|c| c.group == "tp").collect() };
        let kinds = |calls: &[Call]| -> Vec<String> {
            calls.iter().map(|c| c.desc.kind.to_string()).collect()
        };
        let mut run = Run {
            y: Vec::new(),
            dx: Vec::new(),
            replicated: Vec::new(),
            forward_calls: Vec::new(),
            backward_calls: Vec::new(),
            recorded: (Vec::new(), Vec::new()),
        };
        recording.log().take();
        for step in 0..steps {
            let cx = Cx::new(&ps, step as u64);
            let x = Tensor::from_vec(part(values(step)), [rows, BATCH, H])?;
            let dy = Tensor::from_vec(part(values(step + 50)), [rows, BATCH, H])?;
            let (y, saved) = model.run(&cx, &x)?;
            let forward = tp_only(recording.log().take());
            let dx = model.back(&cx, saved, &dy)?;
            let backward = tp_only(recording.log().take());
            if step == 0 {
                (run.forward_calls, run.backward_calls) = (kinds(&forward), kinds(&backward));
                run.recorded = (forward, backward);
            }
            sum_sequence_parallel_gradients(std::slice::from_ref(&model), &ps)?;
            recording.log().take();
            (run.y, run.dx) = (y.to_vec()?, dx.to_vec()?);
            support::descend(&model, 0.05);
        }
        model.visit_params(&mut |p| {
            if p.spec().split == megatron::module::Split::Replicated {
                run.replicated
                    .push((p.spec().name.clone(), p.value().to_vec::<f32>().unwrap()));
            }
        });
        Ok(run)
    })
    .unwrap();
    let mut ranks = per_rank.into_iter();
    let mut first = ranks.next().expect("rank 0");
    if sp {
        // The sequence shards, in rank order.
        for other in ranks {
            first.y.extend(other.y);
            first.dx.extend(other.dx);
        }
    }
    first
}

fn count(calls: &[String], kind: &str) -> usize {
    calls.iter().filter(|c| c.as_str() == kind).count()
}

#[test]
fn summed_row_parallel_outputs_are_reduced_once_and_a_shared_input_gathered_once() {
    let plain = train::<ParallelBlock>(2, false, 1);
    // Forward: one all-reduce for the two row-parallel layers (not one each).
    assert_eq!(plain.forward_calls, ["all_reduce"], "forward");
    // Backward: one all-reduce of the two column-parallel layers' summed input gradients.
    assert_eq!(plain.backward_calls, ["all_reduce"], "backward");

    let sp = train::<ParallelBlock>(2, true, 1);
    // Forward: the norm's output gathered once for qkv and fc1, one reduce-scatter of the
    // summed partial outputs.
    assert_eq!(
        count(&sp.forward_calls, "all_gather"),
        1,
        "{:?}",
        sp.forward_calls
    );
    assert_eq!(
        count(&sp.forward_calls, "reduce_scatter"),
        1,
        "{:?}",
        sp.forward_calls
    );
    assert_eq!(sp.forward_calls.len(), 2, "{:?}", sp.forward_calls);
    // Backward: the output gradient gathered once for proj and fc2, each column-parallel
    // layer's kept shard gathered again for its weight gradient (as Megatron-LM does), one
    // reduce-scatter of the summed input gradients.
    assert_eq!(
        count(&sp.backward_calls, "all_gather"),
        3,
        "{:?}",
        sp.backward_calls
    );
    assert_eq!(
        count(&sp.backward_calls, "reduce_scatter"),
        1,
        "{:?}",
        sp.backward_calls
    );
    assert_eq!(sp.backward_calls.len(), 4, "{:?}", sp.backward_calls);
}

#[test]
fn the_parallel_block_trains_at_tp_2_as_at_tp_1() {
    let one = train::<ParallelBlock>(1, false, 4);
    for sp in [false, true] {
        let two = train::<ParallelBlock>(2, sp, 4);
        for (what, got, want) in [
            ("output", &two.y, &one.y),
            ("input gradient", &two.dx, &one.dx),
        ] {
            assert_eq!(got.len(), want.len());
            let worst = support::max_abs_diff(got, want);
            // The sums are reassociated (partial outputs first): equal up to f32 rounding.
            assert!(worst < 2e-5, "tp 2 (sp {sp}): {what} {worst} from tp 1");
        }
        for ((name, got), (_, want)) in two.replicated.iter().zip(&one.replicated) {
            let worst = support::max_abs_diff(got, want);
            assert!(worst < 2e-5, "tp 2 (sp {sp}): {name} {worst} from tp 1");
        }
    }
}

const DOCUMENT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/docs/collectives-parallel-block.md"
);

/// docs/collectives-parallel-block.md: the tensor-parallel calls of one forward and backward of
/// the parallel block at tp 2 with sequence parallelism, as recorded now.
#[test]
fn the_parallel_block_document_is_a_recorded_step() {
    let (forward, backward) = train::<ParallelBlock>(2, true, 1).recorded;
    let fresh = format!(
        "# The collectives of a parallel block\n\n\
         The tensor-parallel calls of one forward and one backward of GPT-J's and PaLM's parallel \
         block, `x + proj(attn(qkv(ln(x)))) + fc2(gelu(fc1(ln(x))))` written flat in the DSL \
         (`tests/merged_collectives.rs`, as `examples/custom_model.rs`), at tp 2 with sequence \
         parallelism, on rank 0. The two row-parallel outputs are summed before one \
         reduce-scatter, and the layer norm's output, read by both column-parallel layers, is \
         gathered once; in backward the output gradient is gathered once for both row-parallel \
         layers, each column-parallel layer gathers its kept input shard again for its weight \
         gradient (as Megatron-LM does), and the two input gradients are summed before one \
         reduce-scatter. GPT's block, whose branches are added one at a time, makes two of \
         each ([collectives.md](collectives.md)). The expansion: \
         [expanded-parallel-block.md](expanded-parallel-block.md).\n\n\
         This file is generated: `cargo test --test merged_collectives` records the calls again \
         and fails when it differs; `MEGATRON_BLESS=1 cargo test --test merged_collectives` \
         rewrites it.\n\n\
         ## Forward: {} calls\n\n{}\n## Backward: {} calls\n\n{}",
        forward.len(),
        audit::table(&forward),
        backward.len(),
        audit::table(&backward),
    );
    if std::env::var_os("MEGATRON_BLESS").is_some() {
        std::fs::write(DOCUMENT, &fresh).expect("writing docs/collectives-parallel-block.md");
        return;
    }
    let committed = std::fs::read_to_string(DOCUMENT).unwrap_or_default();
    assert!(
        committed == fresh,
        "docs/collectives-parallel-block.md differs from the calls recorded now: regenerate it \
         with `MEGATRON_BLESS=1 cargo test --test merged_collectives` and commit it"
    );
}

#[test]
fn sub_modules_hand_their_partial_outputs_over_and_the_sum_is_reduced_once() {
    let plain = train::<ModularBlock>(2, false, 1);
    // Forward: one all-reduce for the two branches' partial outputs (not one each).
    assert_eq!(plain.forward_calls, ["all_reduce"], "forward");
    // Backward: each branch reduces its own input gradient (its column-parallel layer is inside
    // it), so two all-reduces; g's backward is the identity.
    assert_eq!(
        plain.backward_calls,
        ["all_reduce", "all_reduce"],
        "backward"
    );
    let sp = train::<ModularBlock>(2, true, 1);
    // Forward: each branch gathers the norm's output itself, one reduce-scatter of the sum.
    assert_eq!(
        sp.forward_calls,
        ["all_gather", "all_gather", "reduce_scatter"],
        "forward"
    );
    // Backward: the output gradient gathered once for both branches.
    let gathers = count(&sp.backward_calls, "all_gather");
    assert_eq!(gathers, 3, "{:?}", sp.backward_calls);
    // And it trains at tp 2 as at tp 1.
    let one = train::<ModularBlock>(1, false, 4);
    for sp in [false, true] {
        let two = train::<ModularBlock>(2, sp, 4);
        let worst =
            support::max_abs_diff(&two.y, &one.y).max(support::max_abs_diff(&two.dx, &one.dx));
        assert!(worst < 2e-5, "tp 2 (sp {sp}): {worst} from tp 1");
        for ((name, got), (_, want)) in two.replicated.iter().zip(&one.replicated) {
            let worst = support::max_abs_diff(got, want);
            assert!(worst < 2e-5, "tp 2 (sp {sp}): {name} {worst} from tp 1");
        }
    }
}
