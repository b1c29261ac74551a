//! Element-wise math in forward (issue 46, section 1): `+ − × ÷` between tensors and with
//! scalars, and the element-wise functions, fused by `#[megatron::module]` into one generated
//! kernel each way. Checked against independent references: the forward against the same
//! operations applied one at a time (`kernels::pointwise` over whole vectors: the same bits) and
//! against f64 arithmetic; the backward against central finite differences of the f64 forward;
//! a ReLU² MLP at tp 2 (with and without sequence parallelism) against tp 1.

mod support;

use megatron::comm::ParallelState;
use megatron::comm::threads::launch;
use megatron::distributed::sum_sequence_parallel_gradients;
use megatron::kernels::pointwise as pw;
use megatron::module::{Builder, Cx, Module, Site};
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::prelude::*;
use megatron::tensor::Tensor;

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const SCALE: f32 = 0.75;

/// Two inputs, a #[config] scalar, a constant, and every element-wise function.
#[megatron::module]
pub struct Everything {
    #[config]
    alpha: f32,
}

#[megatron::module]
impl Everything {
    fn forward(&self, a: Tensor, b: Tensor) -> Tensor {
        let g = sigmoid(b);
        let t = a * g - self.alpha * tanh(a) / (1.0 + square(b));
        let u = clamp(exp(a) - 1.0, -0.5, 2.0) + select(a > b, silu(a), gelu_erf(b));
        let v = softplus(-a) + abs(b) * sqrt(abs(a) + 1.0) + rsqrt(square(a) + 1.0);
        let w = log(abs(b) + 1.0) + relu(a - b) * SCALE + gelu(a);
        t + u + v + w
    }
}

/// The same forward in f64, written directly.
fn reference(alpha: f64, a: f64, b: f64) -> f64 {
    let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
    let erf_gelu = |x: f64| 0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2));
    let tanh_gelu = |x: f64| {
        0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
    };
    let t = a * sig(b) - alpha * a.tanh() / (1.0 + b * b);
    let u = (a.exp() - 1.0).clamp(-0.5, 2.0) + if a > b { a * sig(a) } else { erf_gelu(b) };
    let v = (1.0 + (-a).exp()).ln() + b.abs() * (a.abs() + 1.0).sqrt() + 1.0 / (a * a + 1.0).sqrt();
    let w = (b.abs() + 1.0).ln() + (a - b).max(0.0) * f64::from(SCALE) + tanh_gelu(a);
    t + u + v + w
}

/// erf by its Maclaurin series (|x| ≤ 3 here: converged to f64 precision).
fn erf(x: f64) -> f64 {
    let (mut term, mut sum) = (x, x);
    for n in 1..200 {
        term *= -x * x / n as f64;
        sum += term / (2 * n + 1) as f64;
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

/// Inputs away from the kinks (`a = b`, `|a| = 0`, `exp(a) − 1 ∈ {−0.5, 2}`, `a = b` for relu),
/// so that finite differences see a smooth function.
fn inputs(n: usize) -> (Vec<f32>, Vec<f32>) {
    let a = (0..n)
        .map(|i| ((i * 37 % 101) as f32 / 101.0 - 0.5) * 2.4 + 0.013)
        .collect::<Vec<_>>();
    let b = (0..n)
        .map(|i| ((i * 59 % 97) as f32 / 97.0 - 0.5) * 2.8 - 0.021)
        .collect::<Vec<_>>();
    (a, b)
}

fn smooth(a: f32, b: f32) -> bool {
    let e = f64::from(a).exp() - 1.0;
    (a - b).abs() > 0.05
        && a.abs() > 0.05
        && b.abs() > 0.05
        && (e + 0.5).abs() > 0.05
        && (e - 2.0).abs() > 0.05
}

/// Runs `Everything` forward and backward on one rank: its output and the inputs' gradients
/// for the output gradient `dy`.
fn run(alpha: f32, a: &[f32], b: &[f32], dy: &[f32]) -> R<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    run_on(alpha, a, b, dy, &Ok)
}

/// [`run`] with the inputs and the output gradient placed by `place` (on a GPU).
fn run_on(
    alpha: f32,
    a: &[f32],
    b: &[f32],
    dy: &[f32],
    place: &(dyn Fn(Tensor) -> megatron::Result<Tensor> + Sync),
) -> R<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    let layout = ParallelLayout::new(&ParallelConfig::new(1))?;
    let (a, b, dy) = (a.to_vec(), b.to_vec(), dy.to_vec());
    let mut out = launch(1, move |w| -> R<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let ps = ParallelState::new(&w, &layout)?;
        let m = Everything::build(
            &EverythingSpec { alpha },
            &mut Builder::for_rank(1, ps.groups()),
        )?;
        let cx = Cx::new(&ps, 0);
        let shape = [a.len() / 4, 2, 2];
        let ta = place(Tensor::from_vec(a.clone(), shape)?)?;
        let tb = place(Tensor::from_vec(b.clone(), shape)?)?;
        let (y, saved) = m.forward(&cx, Site::ROOT, &ta, &tb)?;
        let dy = place(Tensor::from_vec(dy.clone(), shape)?)?;
        let (da, db) = m.backward(&cx, Site::ROOT, saved, &dy)?;
        for t in [&y, &da, &db] {
            assert_eq!(
                t.gpu().is_some(),
                ta.gpu().is_some(),
                "outputs lie where inputs do"
            );
        }
        Ok((y.to_vec()?, da.to_vec()?, db.to_vec()?))
    })
    .map_err(|e| e.to_string())?;
    Ok(out.remove(0))
}

#[test]
fn a_fused_chain_computes_the_bits_of_its_operations_one_at_a_time() {
    let n = 400;
    let (a, b) = inputs(n);
    let alpha = 0.3f32;
    let (y, _, _) = run(alpha, &a, &b, &vec![1.0; n]).unwrap();
    // Each operation over whole vectors, in forward's order: what unfused kernels would do.
    let map = |x: &[f32], f: fn(f32) -> f32| x.iter().map(|&v| f(v)).collect::<Vec<f32>>();
    let zip = |x: &[f32], y: &[f32], f: fn(f32, f32) -> f32| {
        x.iter()
            .zip(y)
            .map(|(&p, &q)| f(p, q))
            .collect::<Vec<f32>>()
    };
    let scale = |x: &[f32], s: f32| x.iter().map(|&v| v * s).collect::<Vec<f32>>();
    let shift = |x: &[f32], s: f32| x.iter().map(|&v| v + s).collect::<Vec<f32>>();
    let add = |x: &[f32], y: &[f32]| zip(x, y, |p, q| p + q);
    let g = map(&b, pw::sigmoid);
    let ag = zip(&a, &g, |p, q| p * q);
    let th = scale(&map(&a, pw::tanh), alpha);
    let den = map(&b, |v| 1.0 + v * v);
    let t = zip(&ag, &zip(&th, &den, |p, q| p / q), |p, q| p - q);
    let e = map(&map(&a, pw::exp), |v| pw::clamp(v - 1.0, -0.5, 2.0));
    let sel: Vec<f32> = a
        .iter()
        .zip(&b)
        .map(|(&p, &q)| pw::select(p > q, pw::silu(p), pw::gelu_erf(q)))
        .collect();
    let u = add(&e, &sel);
    let v1 = map(&map(&a, |v| -v), pw::softplus);
    let v2 = zip(
        &map(&b, pw::abs),
        &map(&shift(&map(&a, pw::abs), 1.0), pw::sqrt),
        |p, q| p * q,
    );
    let v3 = map(&map(&a, |v| v * v + 1.0), pw::rsqrt);
    let v = add(&add(&v1, &v2), &v3);
    let w1 = map(&shift(&map(&b, pw::abs), 1.0), pw::log);
    let w2 = scale(&map(&zip(&a, &b, |p, q| p - q), pw::relu), SCALE);
    let w = add(&add(&w1, &w2), &map(&a, pw::gelu));
    let want = add(&add(&add(&t, &u), &v), &w);
    for (i, (got, want)) in y.iter().zip(&want).enumerate() {
        assert_eq!(
            got.to_bits(),
            want.to_bits(),
            "element {i}: {got} vs {want}"
        );
    }
}

#[test]
fn tensors_of_different_shapes_are_an_error_naming_them() {
    let layout = ParallelLayout::new(&ParallelConfig::new(1)).unwrap();
    let err = launch(1, |w| -> R<String> {
        let ps = ParallelState::new(&w, &layout)?;
        let m = Everything::build(
            &EverythingSpec { alpha: 1.0 },
            &mut Builder::for_rank(1, ps.groups()),
        )?;
        let cx = Cx::new(&ps, 0);
        let a = Tensor::from_vec(vec![1.0f32; 8], [2, 2, 2])?;
        let b = Tensor::from_vec(vec![1.0f32; 12], [2, 2, 3])?;
        Ok(m.forward(&cx, Site::ROOT, &a, &b)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default())
    })
    .unwrap()
    .remove(0);
    assert!(
        err.contains("[2, 2, 3]") && err.contains("[2, 2, 2]") && err.contains("one shape"),
        "{err}"
    );
}

#[test]
fn forward_matches_f64_and_backward_matches_finite_differences() {
    let n = 400;
    let (a, b) = inputs(n);
    let alpha = 0.3f32;
    let dy: Vec<f32> = (0..n).map(|i| ((i * 13 % 7) as f32 - 3.0) / 3.0).collect();
    let (y, da, db) = run(alpha, &a, &b, &dy).unwrap();
    let alpha = f64::from(alpha);
    let mut checked = 0;
    for i in 0..n {
        let (x, z) = (f64::from(a[i]), f64::from(b[i]));
        let want = reference(alpha, x, z);
        assert!(
            (f64::from(y[i]) - want).abs() < 2e-5 * (1.0 + want.abs()),
            "y[{i}] = {} vs {want}",
            y[i]
        );
        if !smooth(a[i], b[i]) {
            continue;
        }
        let h = 1e-5;
        let d_a = (reference(alpha, x + h, z) - reference(alpha, x - h, z)) / (2.0 * h);
        let d_b = (reference(alpha, x, z + h) - reference(alpha, x, z - h)) / (2.0 * h);
        let g = f64::from(dy[i]);
        for (name, got, want) in [("a", da[i], g * d_a), ("b", db[i], g * d_b)] {
            assert!(
                (f64::from(got) - want).abs() < 1e-4 * (1.0 + want.abs()),
                "d{name}[{i}] = {got}, finite differences {want} (a {}, b {})",
                a[i],
                b[i]
            );
        }
        checked += 1;
    }
    assert!(checked > 300, "only {checked} smooth points");
}

/// modded-nanogpt's MLP: ReLU², the square fused with the ReLU into one kernel.
#[megatron::module]
pub struct Relu2Mlp {
    #[column_parallel]
    fc1: Linear,
    #[row_parallel]
    fc2: Linear,
}

#[megatron::module]
impl Relu2Mlp {
    fn forward(&self, x: Tensor) -> Tensor {
        let h = relu(self.fc1(x));
        self.fc2(h * h)
    }
}

const SEQ: usize = 8;
const BATCH: usize = 2;
const H: usize = 16;

fn values(salt: usize) -> Vec<f32> {
    (0..SEQ * BATCH * H)
        .map(|i| (((i * 7919 + salt * 104_729) % 2003) as f32 / 2003.0 - 0.5) * 2.0)
        .collect()
}

/// Rank 0's output and the replicated input's gradient, and every weight after `steps`
/// steps of gradient descent on Σ y ⊙ c, at tp `tp` (with sequence parallelism when `sp`).
fn train_mlp<M: Module>(
    spec: &M::Spec,
    run: &Step<M>,
    tp: usize,
    sp: bool,
    steps: usize,
) -> (Vec<f32>, Vec<f32>)
where
    M::Spec: Sync,
{
    let layout = ParallelLayout::new(&ParallelConfig::new(tp).with_tp(tp)).unwrap();
    let mut per_rank = launch(tp, |w| -> R<(Vec<f32>, Vec<f32>)> {
        let ps = ParallelState::new(&w, &layout)?.with_sequence_parallel(sp);
        let model = M::build(spec, &mut Builder::for_rank(5, ps.groups()))?;
        let rank = ps.groups().tp_rank();
        let rows = if sp { SEQ / tp } else { SEQ };
        let part = |all: Vec<f32>| {
            let n = rows * BATCH * H;
            let start = if sp { rank * n } else { 0 };
            all[start..start + n].to_vec()
        };
        let (mut y_out, mut dx_out) = (Vec::new(), Vec::new());
        for step in 0..steps {
            let cx = Cx::new(&ps, step as u64);
            let x = Tensor::from_vec(part(values(step)), [rows, BATCH, H])?;
            let dy = Tensor::from_vec(part(values(step + 50)), [rows, BATCH, H])?;
            let (y, dx) = run(&model, &cx, &x, &dy)?;
            sum_sequence_parallel_gradients(std::slice::from_ref(&model), &ps)?;
            y_out = y.to_vec()?;
            dx_out = dx.to_vec()?;
            support::descend(&model, 0.05);
        }
        Ok((y_out, dx_out))
    })
    .unwrap();
    if sp {
        // Put the sequence shards back together.
        let (mut y, mut dx) = (Vec::new(), Vec::new());
        for (a, b) in per_rank {
            y.extend(a);
            dx.extend(b);
        }
        (y, dx)
    } else {
        per_rank.remove(0)
    }
}

/// A GeGLU MLP written out: the gate of element-wise math over two column-parallel outputs
/// (split alike, so it runs on each rank's part with no collective) and a #[config] scale.
#[megatron::module]
pub struct GeGlu {
    #[column_parallel]
    gate: Linear,
    #[column_parallel]
    up: Linear,
    #[row_parallel]
    down: Linear,
    #[config]
    scale: f32,
}

#[megatron::module]
impl GeGlu {
    fn forward(&self, x: Tensor) -> Tensor {
        self.down(gelu_erf(self.gate(x)) * self.up(x) * self.scale)
    }
}

/// A module's forward and backward: its output and its input's gradient for `dy`.
type Step<M> = dyn Fn(&M, &Cx, &Tensor, &Tensor) -> megatron::Result<(Tensor, Tensor)> + Sync;

/// [`Step`] of a generated module.
macro_rules! step {
    ($m:ty) => {
        &|m: &$m, cx: &Cx, x: &Tensor, dy: &Tensor| {
            let (y, saved) = m.forward(cx, Site::ROOT, x)?;
            Ok((y, m.backward(cx, Site::ROOT, saved, dy)?))
        }
    };
}

/// Trains `M` at tp 1, then at tp 2 without and with sequence parallelism: the same outputs
/// and input gradients.
fn follows_one_rank<M: Module>(spec: &M::Spec, step: &Step<M>)
where
    M::Spec: Sync,
{
    let one = train_mlp::<M>(spec, step, 1, false, 4);
    for sp in [false, true] {
        let two = train_mlp::<M>(spec, step, 2, sp, 4);
        for (what, got, want) in [
            ("output", &two.0, &one.0),
            ("input gradient", &two.1, &one.1),
        ] {
            assert_eq!(got.len(), want.len());
            let worst = support::max_abs_diff(got, want);
            assert!(worst < 1e-5, "tp 2 (sp {sp}): {what} {worst} from one rank");
        }
    }
}

#[test]
fn relu_squared_mlp_trains_at_tp_2_as_on_one_rank() {
    let spec = Relu2MlpSpec {
        fc1: LinearSpec::new(H, 4 * H),
        fc2: LinearSpec::new(4 * H, H),
    };
    follows_one_rank::<Relu2Mlp>(&spec, step!(Relu2Mlp));
}

#[test]
fn element_wise_math_over_split_values_trains_at_tp_2_as_on_one_rank() {
    let spec = GeGluSpec {
        gate: LinearSpec::new(H, 2 * H),
        up: LinearSpec::new(H, 2 * H),
        down: LinearSpec::new(2 * H, H),
        scale: 0.8,
    };
    follows_one_rank::<GeGlu>(&spec, step!(GeGlu));
}

#[cfg(feature = "cuda")]
#[path = "../megatron-core/tests/emulated/device.rs"]
mod device;

/// The generated CUDA C (compiled by NVRTC, run on the GPU or, with `MEGATRON_EMULATED_GPU=1`,
/// on the emulated one) computes what the generated host loop does.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn fused_kernels_on_the_gpu_follow_the_host_loops() {
    device::install_if_requested(std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/megatron-core"
    )));
    let gpu = megatron::cuda::Gpu::new(0).expect("GPU 0");
    let n = 4096 + 4;
    let (a, b) = inputs(n);
    let dy: Vec<f32> = (0..n).map(|i| ((i * 13 % 7) as f32 - 3.0) / 3.0).collect();
    let host = run(0.3, &a, &b, &dy).unwrap();
    let on_gpu = run_on(0.3, &a, &b, &dy, &|t| t.to_gpu(&gpu)).unwrap();
    for (what, got, want) in [
        ("output", &on_gpu.0, &host.0),
        ("d a", &on_gpu.1, &host.1),
        ("d b", &on_gpu.2, &host.2),
    ] {
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 2e-5 * (1.0 + w.abs()),
                "{what}[{i}]: GPU {g}, host {w}"
            );
        }
    }
}
