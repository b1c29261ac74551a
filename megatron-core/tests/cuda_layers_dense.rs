#![cfg(feature = "cuda")]
//! GPU parity of the dense layers and primitives: each layer built on the host, a clone moved to
//! the GPU, both run forward and backward on the same inputs; outputs, input gradients and
//! accumulated parameter gradients agree to f32 rounding, dropout masks exactly. Needs a GPU:
//! `cargo test -p megatron-core --features cuda --test cuda_layers_dense -- --ignored`.

mod support;

use half::bf16;
use megatron_core::comm::ParallelState;
use megatron_core::cuda::Gpu;
use megatron_core::module::{
    Builder, ColumnParallel, Cx, Layer, Module, Param, RowParallel, Sharding, Site, params_to_gpu,
};
use megatron_core::ops;
use megatron_core::tensor::{DType, Tensor};
use megatron_core::tensor_parallel::{LayerNorm, LayerNormSpec, Linear, LinearSpec};
use support::{det, gpu, tensor};

type R = Result<(), Box<dyn std::error::Error>>;

/// Asserts `|got − want| ≤ tol·(|want| + max|want|)` everywhere.
fn close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (w.abs() + scale),
            "{what}[{i}]: GPU {g} vs CPU {w} (scale {scale})"
        );
    }
}

/// Checks that `t` lives on the GPU and returns its elements.
fn device_values(t: &Tensor, what: &str) -> Vec<f32> {
    assert!(t.gpu().is_some(), "{what} is not on the GPU");
    t.to_vec::<f32>().unwrap()
}

/// Every parameter's name and gradient.
fn grads<M: Module>(m: &M) -> Vec<(String, Vec<f32>)> {
    let mut out = Vec::new();
    m.visit_params(&mut |p: &Param| {
        out.push((p.spec().name.clone(), p.grad().to_vec::<f32>().unwrap()));
    });
    out
}

/// The host model's gradients against the device model's (which must be on the GPU).
fn compare_grads<M: Module>(host: &M, device: &M, tol: f32) {
    device.visit_params(&mut |p: &Param| {
        assert!(
            p.value().gpu().is_some(),
            "{} value on the host",
            p.spec().name
        );
        assert!(
            p.grad().gpu().is_some(),
            "{} grad on the host",
            p.spec().name
        );
    });
    for ((name, h), (_, d)) in grads(host).iter().zip(&grads(device)) {
        assert!(h.iter().any(|&v| v != 0.0), "{name}: zero gradient");
        close(d, h, tol, name);
    }
}

/// A host-built layer and its clone with the parameters moved to the GPU.
fn pair<M: Module + Clone>(
    gpu: &Gpu,
    build: impl FnOnce(&mut Builder) -> megatron_core::Result<M>,
) -> (M, M) {
    let ps = ParallelState::solo();
    let mut b = Builder::for_rank(99, ps.groups());
    let host = build(&mut b).unwrap();
    let mut device = host.clone();
    params_to_gpu(&mut device, gpu).unwrap();
    (host, device)
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn whole_linear_matches_the_cpu() -> R {
    let g = gpu();
    let ps = ParallelState::solo();
    let cx = Cx::new(&ps, 1234);
    let (s, b, h, f) = (5, 3, 24, 40);
    let (host, device) = pair(&g, |bld| {
        bld.scoped("fc", |b| Linear::build(&LinearSpec::new(h, f), b))
    });
    // The weights start random, the bias at zero: give the bias values too.
    host.bias()
        .unwrap()
        .value()
        .copy_from(&tensor(det(f, 9), &[f]))?;
    device
        .bias()
        .unwrap()
        .value()
        .copy_from(&tensor(det(f, 9), &[f]))?;
    // [b, s, h] from [s, b, h], made contiguous on each side (a strided copy on the device).
    let base = tensor(det(s * b * h, 1), &[s, b, h]);
    let x_host = base.transpose(0, 1)?.contiguous()?;
    let x_dev = base.to_gpu(&g)?.transpose(0, 1)?.contiguous()?;
    let dy = tensor(det(b * s * f, 2), &[b, s, f]);
    let dy_dev = dy.to_gpu(&g)?;
    // Two microbatches: the gradients accumulate.
    for _ in 0..2 {
        let (y_h, saved_h) = host.forward(&cx, Site::ROOT, &x_host)?;
        let (y_d, saved_d) = device.forward(&cx, Site::ROOT, &x_dev)?;
        assert_eq!(y_d.dims(), y_h.dims());
        close(&device_values(&y_d, "y"), &y_h.to_vec()?, 1e-5, "linear y");
        let dx_h = host.backward(&cx, Site::ROOT, saved_h, &dy)?;
        let dx_d = device.backward(&cx, Site::ROOT, saved_d, &dy_dev)?;
        assert_eq!(dx_d.dims(), dx_h.dims());
        close(
            &device_values(&dx_d, "dx"),
            &dx_h.to_vec()?,
            1e-5,
            "linear dx",
        );
    }
    compare_grads(&host, &device, 1e-5);
    Ok(())
}

/// Megatron-LM's MLP: a column-parallel layer, GeLU, a row-parallel layer.
#[derive(Clone)]
struct Mlp {
    fc1: Linear,
    fc2: Linear,
}

impl Module for Mlp {
    type Spec = ();
    type Saved = ();
    fn build(_: &(), _: &mut Builder) -> megatron_core::Result<Self> {
        unreachable!()
    }
    fn visit_params<'s>(&'s self, f: &mut dyn FnMut(&'s Param)) {
        self.fc1.visit_params(f);
        self.fc2.visit_params(f);
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        self.fc1.visit_params_mut(f);
        self.fc2.visit_params_mut(f);
    }
}

/// An `h → f → h` MLP on the host and its copy on `g`, with the same non-zero biases.
fn mlp_pair(g: &Gpu, h: usize, f: usize) -> megatron_core::Result<(Mlp, Mlp)> {
    let (host, device) = pair(g, |bld| {
        Ok(Mlp {
            fc1: bld.scoped("fc1", |b| Linear::build_column(&LinearSpec::new(h, f), b))?,
            fc2: bld.scoped("fc2", |b| Linear::build_row(&LinearSpec::new(f, h), b))?,
        })
    });
    for (m, dev) in [(&host, None), (&device, Some(g))] {
        for (p, n, salt) in [(&m.fc1, f, 3), (&m.fc2, h, 4)] {
            let v = tensor(det(n, salt), &[n]);
            let v = match dev {
                Some(g) => v.to_gpu(g)?,
                None => v,
            };
            p.bias().unwrap().value().copy_from(&v)?;
        }
    }
    Ok((host, device))
}

/// The MLP forward and backward as the DSL's generated code runs it: every intermediate
/// (fc1's output, GeLU's, fc2's output, and their gradients back to the input's), in order.
fn mlp_steps(cx: &Cx, m: &Mlp, x: &Tensor, dy: &Tensor) -> megatron_core::Result<Vec<Tensor>> {
    let site = Site::ROOT;
    let (a, fc1_saved) = m.fc1.forward_column(cx, site, x)?;
    let (gl, gelu_saved) = ops::gelu(cx, site, &a)?;
    let (y, fc2_saved) = m.fc2.forward_row(cx, site, &gl)?;
    m.fc2.add_bias(cx, &y)?;
    let dg = m.fc2.backward_row(cx, site, fc2_saved, dy)?;
    let da = ops::gelu_backward(cx, site, gelu_saved, &dg)?;
    let dx = m.fc1.backward_column(cx, site, fc1_saved, &da)?;
    Ok(vec![a, gl, y, dg, da, dx])
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn column_then_row_linear_with_gelu_matches_the_cpu() -> R {
    let g = gpu();
    let ps = ParallelState::solo();
    let cx = Cx::new(&ps, 1234);
    let (s, b, h, f) = (4, 2, 32, 64);
    let (host, device) = mlp_pair(&g, h, f)?;
    let x = tensor(det(s * b * h, 1), &[s, b, h]);
    let dy = tensor(det(s * b * h, 2), &[s, b, h]);
    for _ in 0..2 {
        let on_host = mlp_steps(&cx, &host, &x, &dy)?;
        let on_device = mlp_steps(&cx, &device, &x.to_gpu(&g)?, &dy.to_gpu(&g)?)?;
        let (y_h, dx_h) = (&on_host[2], &on_host[5]);
        let (y_d, dx_d) = (&on_device[2], &on_device[5]);
        close(&device_values(y_d, "y"), &y_h.to_vec()?, 1e-5, "mlp y");
        close(&device_values(dx_d, "dx"), &dx_h.to_vec()?, 1e-5, "mlp dx");
    }
    compare_grads(&host, &device, 1e-5);
    Ok(())
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn with_bf16_products_layers_hand_the_next_products_bf16() -> R {
    // Biases added in the products' cuBLASLt epilogue (the default), and by a kernel after
    // the product: the same dtypes and values.
    for epilogues in [true, false] {
        // A handle of its own: the products' dtype is per handle.
        let g = gpu().with_new_stream()?;
        g.set_bf16_products(true);
        g.set_bias_epilogues(epilogues);
        bf16_mlp_matches_the_cpu(&g)?;
    }
    Ok(())
}

fn bf16_mlp_matches_the_cpu(g: &Gpu) -> R {
    let ps = ParallelState::solo();
    let cx = Cx::new(&ps, 1234);
    let (s, b, h, f) = (5, 2, 64, 96);
    let (ln_host, ln_device) = pair(g, |bld| {
        bld.scoped("ln", |b| LayerNorm::build(&LayerNormSpec::new(h), b))
    });
    let (host, device) = mlp_pair(g, h, f)?;
    let x = tensor(
        det(s * b * h, 5).iter().map(|v| 2.0 * v + 0.3).collect(),
        &[s, b, h],
    );
    let dy = tensor(det(s * b * h, 6), &[s, b, h]);
    let (n_h, _) = ln_host.forward(&cx, Site::ROOT, &x)?;
    let (n_d, _) = ln_device.forward(&cx, Site::ROOT, &x.to_gpu(g)?)?;
    assert_eq!(n_d.dtype(), DType::BF16, "layer norm output");
    close(&n_d.to_vec_f32()?, &n_h.to_vec()?, 1e-2, "ln y");
    let on_host = mlp_steps(&cx, &host, &n_h, &dy)?;
    let on_device = mlp_steps(&cx, &device, &n_d, &dy.to_gpu(g)?)?;
    // What products read next is bf16; what is summed across ranks or reaches the residual
    // stream is f32.
    let names = [
        "fc1 output",
        "gelu output",
        "fc2 output",
        "fc2 dx",
        "gelu dx",
        "fc1 dx",
    ];
    let dtypes = [
        DType::BF16,
        DType::BF16,
        DType::F32,
        DType::BF16,
        DType::BF16,
        DType::F32,
    ];
    for ((name, want), (d, h)) in names.iter().zip(dtypes).zip(on_device.iter().zip(&on_host)) {
        assert_eq!(d.dtype(), want, "{name}");
        assert!(d.gpu().is_some(), "{name} is not on the GPU");
        close(&d.to_vec_f32()?, &h.to_vec()?, 3e-2, name);
    }
    compare_grads(&host, &device, 3e-2);
    Ok(())
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn linear_without_bias_matches_the_cpu() -> R {
    let g = gpu();
    let ps = ParallelState::solo();
    let cx = Cx::new(&ps, 1234);
    let (rows, h, f) = (7, 16, 12);
    let (host, device) = pair(&g, |bld| {
        bld.scoped("proj", |b| {
            Linear::build(&LinearSpec::new(h, f).with_bias(false), b)
        })
    });
    let x = tensor(det(rows * h, 5), &[rows, h]);
    let dy = tensor(det(rows * f, 6), &[rows, f]);
    let (y_h, saved_h) = host.forward(&cx, Site::ROOT, &x)?;
    let (y_d, saved_d) = device.forward(&cx, Site::ROOT, &x.to_gpu(&g)?)?;
    close(&device_values(&y_d, "y"), &y_h.to_vec()?, 1e-5, "y");
    let dx_h = host.backward(&cx, Site::ROOT, saved_h, &dy)?;
    let dx_d = device.backward(&cx, Site::ROOT, saved_d, &dy.to_gpu(&g)?)?;
    close(&device_values(&dx_d, "dx"), &dx_h.to_vec()?, 1e-5, "dx");
    compare_grads(&host, &device, 1e-5);
    Ok(())
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn layer_norm_matches_the_cpu() -> R {
    let g = gpu();
    let ps = ParallelState::solo();
    let cx = Cx::new(&ps, 1234);
    let (s, b, h) = (6, 3, 96);
    let (host, device) = pair(&g, |bld| {
        bld.scoped("ln", |b| LayerNorm::build(&LayerNormSpec::new(h), b))
    });
    // Non-trivial γ and β on both.
    for (m, on_gpu) in [(&host, false), (&device, true)] {
        let mut salt = 20;
        m.visit_params(&mut |p: &Param| {
            let v = tensor(det(h, salt).iter().map(|v| v + 1.0).collect(), &[h]);
            let v = if on_gpu { v.to_gpu(&g).unwrap() } else { v };
            p.value().copy_from(&v).unwrap();
            salt += 1;
        });
    }
    let x = tensor(
        det(s * b * h, 7).iter().map(|v| 3.0 * v + 0.5).collect(),
        &[s, b, h],
    );
    let dy = tensor(det(s * b * h, 8), &[s, b, h]);
    for _ in 0..2 {
        let (y_h, saved_h) = host.forward(&cx, Site::ROOT, &x)?;
        let (y_d, saved_d) = device.forward(&cx, Site::ROOT, &x.to_gpu(&g)?)?;
        close(&device_values(&y_d, "y"), &y_h.to_vec()?, 1e-5, "ln y");
        let dx_h = host.backward(&cx, Site::ROOT, saved_h, &dy)?;
        let dx_d = device.backward(&cx, Site::ROOT, saved_d, &dy.to_gpu(&g)?)?;
        close(&device_values(&dx_d, "dx"), &dx_h.to_vec()?, 1e-5, "ln dx");
    }
    compare_grads(&host, &device, 1e-5);
    Ok(())
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn add_and_gelu_match_the_cpu() -> R {
    let g = gpu();
    let ps = ParallelState::solo();
    let cx = Cx::new(&ps, 1234);
    let n = 4 * 257;
    let a = tensor(det(n, 1).iter().map(|v| 4.0 * v).collect(), &[4, 257]);
    let b = tensor(det(n, 2), &[4, 257]);
    let sum_h = ops::add(&a, &b)?;
    let sum_d = ops::add(&a.to_gpu(&g)?, &b.to_gpu(&g)?)?;
    assert_eq!(device_values(&sum_d, "a + b"), sum_h.to_vec::<f32>()?);
    // A transposed operand is made contiguous on the device.
    let bt = tensor(det(n, 2), &[257, 4]);
    let sum_h = ops::add(&a, &bt.t()?)?;
    let sum_d = ops::add(&a.to_gpu(&g)?, &bt.to_gpu(&g)?.t()?)?;
    assert_eq!(device_values(&sum_d, "a + bᵀ"), sum_h.to_vec::<f32>()?);

    let dy = tensor(det(n, 3), &[4, 257]);
    let (y_h, saved_h) = ops::gelu(&cx, Site::ROOT, &a)?;
    let (y_d, saved_d) = ops::gelu(&cx, Site::ROOT, &a.to_gpu(&g)?)?;
    close(&device_values(&y_d, "gelu"), &y_h.to_vec()?, 1e-5, "gelu");
    let dx_h = ops::gelu_backward(&cx, Site::ROOT, saved_h, &dy)?;
    let dx_d = ops::gelu_backward(&cx, Site::ROOT, saved_d, &dy.to_gpu(&g)?)?;
    close(
        &device_values(&dx_d, "gelu dx"),
        &dx_h.to_vec()?,
        1e-5,
        "gelu dx",
    );
    Ok(())
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn dropout_masks_match_the_cpu_exactly() -> R {
    let g = gpu();
    let ps = ParallelState::solo();
    let cx = Cx::new(&ps, 1234).at(3, 1);
    let (rows, cols) = (37, 129);
    let x = tensor(det(rows * cols, 1), &[rows, cols]);
    let dy = tensor(det(rows * cols, 2), &[rows, cols]);
    for (p, sharding) in [
        (0.1, Sharding::Replicated),
        (0.5, Sharding::SplitLastDim),
        (0.0, Sharding::Replicated),
    ] {
        let site = Site::ROOT.child("drop");
        let (y_h, saved_h) = ops::dropout(&cx, site, &x, p, sharding)?;
        let (y_d, saved_d) = ops::dropout(&cx, site, &x.to_gpu(&g)?, p, sharding)?;
        let dx_h = ops::dropout_backward(&cx, site, saved_h, &dy)?;
        let dx_d = ops::dropout_backward(&cx, site, saved_d, &dy.to_gpu(&g)?)?;
        for (what, got, want) in [
            ("y", device_values(&y_d, "y"), y_h.to_vec::<f32>()?),
            ("dx", device_values(&dx_d, "dx"), dx_h.to_vec::<f32>()?),
        ] {
            let dropped = want.iter().filter(|&&v| v == 0.0).count();
            if p > 0.0 {
                assert!(dropped > 0, "p {p}: nothing dropped");
            }
            for (i, (&gv, &w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(
                    gv == 0.0,
                    w == 0.0,
                    "p {p} {what}[{i}]: GPU {gv} vs CPU {w}"
                );
            }
            close(&got, &want, 1e-6, &format!("dropout {what} p {p}"));
        }
    }
    // Evaluation: the identity, on the device.
    let (y, _) = ops::dropout(
        &cx.eval(),
        Site::ROOT,
        &x.to_gpu(&g)?,
        0.5,
        Sharding::Replicated,
    )?;
    assert_eq!(device_values(&y, "eval"), x.to_vec::<f32>()?);
    Ok(())
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn dropout_with_the_residual_is_the_cpus_dropout_then_sum_bit_for_bit() -> R {
    let g = gpu();
    let ps = ParallelState::solo();
    let cx = Cx::new(&ps, 99).at(2, 0);
    let (rows, cols) = (37, 128);
    let residual = tensor(det(rows * cols, 3), &[rows, cols]);
    let x = tensor(det(rows * cols, 4), &[rows, cols]);
    let dy = tensor(det(rows * cols, 5), &[rows, cols]);
    // The first element whose bits differ, and how many do.
    let same_bits = |what: &str, got: Vec<f32>, want: Vec<f32>| {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        let differ: Vec<_> = (0..got.len())
            .filter(|&i| got[i].to_bits() != want[i].to_bits())
            .collect();
        if let Some(&i) = differ.first() {
            let n = differ.len();
            panic!(
                "{what}: {n} elements differ, first [{i}]: {} vs {}",
                got[i], want[i]
            );
        }
    };
    let site = Site::ROOT.child("drop");
    for (p, sharding, cx) in [
        (0.1, Sharding::Replicated, cx.at(2, 0)),
        (0.5, Sharding::SplitLastDim, cx.at(2, 0)),
        (0.0, Sharding::Replicated, cx.at(2, 0)),
        (0.5, Sharding::Replicated, cx.eval()),
    ] {
        // The CPU's unfused pair is the reference.
        let (dropped, saved) = ops::dropout(&cx, site, &x, p, sharding)?;
        let want = ops::add(&residual, &dropped)?.to_vec::<f32>()?;
        let want_dx = ops::dropout_backward(&cx, site, saved, &dy)?.to_vec::<f32>()?;
        let (rd, xd) = (residual.to_gpu(&g)?, x.to_gpu(&g)?);
        let (y, saved) = ops::dropout_add(&cx, site, &rd, &xd, p, sharding)?;
        let saved_again = saved.clone();
        let (d_residual, dx) = ops::dropout_add_backward(&cx, site, saved, &dy.to_gpu(&g)?, false)?;
        let what = format!("p {p} {sharding:?} training {}", cx.training());
        same_bits(&format!("y, {what}"), device_values(&y, "y"), want);
        same_bits(
            &format!("dx, {what}"),
            device_values(&dx, "dx"),
            want_dx.clone(),
        );
        // For a branch whose backward feeds products, on a handle that multiplies in bf16: the
        // gradient in bf16, the CPU's rounded once (without dropout it is `dy` as it is).
        let b16 = g.with_new_stream()?;
        b16.set_bf16_products(true);
        let dy16 = dy.to_gpu(&b16)?;
        let (_, dx) = ops::dropout_add_backward(&cx, site, saved_again, &dy16, true)?;
        if p > 0.0 && cx.training() {
            assert_eq!(dx.dtype(), DType::BF16, "{what}");
            let rounded = Tensor::from_vec(want_dx, [rows, cols])?.to_dtype(DType::BF16)?;
            let (got, want) = (dx.to_vec::<bf16>()?, rounded.to_vec::<bf16>()?);
            let bits = |v: Vec<bf16>| v.into_iter().map(bf16::to_bits).collect::<Vec<_>>();
            assert_eq!(bits(got), bits(want), "dx in bf16, {what}");
        }
        let d_residual = device_values(&d_residual, "d_residual");
        same_bits(
            &format!("d_residual, {what}"),
            d_residual,
            dy.to_vec::<f32>()?,
        );
    }
    // Shapes that differ are an error naming both.
    let short = tensor(det(rows * cols, 6), &[cols, rows]).to_gpu(&g)?;
    let e = ops::dropout_add(&cx, site, &short, &x.to_gpu(&g)?, 0.1, Sharding::Replicated)
        .unwrap_err()
        .to_string();
    assert!(e.contains("[128, 37]") && e.contains("[37, 128]"), "{e}");
    Ok(())
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn cross_entropy_matches_the_cpu() -> R {
    let g = gpu();
    let ps = ParallelState::solo();
    let cx = Cx::new(&ps, 1234);
    let (s, b, v) = (5, 3, 1000);
    let logits = tensor(
        det(s * b * v, 1).iter().map(|x| 6.0 * x).collect(),
        &[s, b, v],
    );
    let ids: Vec<i64> = (0..s * b).map(|i| ((i * 389 + 17) % v) as i64).collect();
    let targets = Tensor::from_vec(ids, [s, b])?;
    let dloss = tensor(det(s * b, 2), &[s, b]);
    let (loss_h, saved_h) = ops::cross_entropy(&cx, Site::ROOT, &logits, &targets)?;
    for targets_d in [targets.clone(), targets.to_gpu(&g)?] {
        let (loss_d, saved_d) =
            ops::cross_entropy(&cx, Site::ROOT, &logits.to_gpu(&g)?, &targets_d)?;
        assert_eq!(loss_d.dims(), loss_h.dims());
        close(
            &device_values(&loss_d, "losses"),
            &loss_h.to_vec()?,
            1e-5,
            "losses",
        );
        let dl_h = ops::cross_entropy_backward(&cx, Site::ROOT, saved_h.clone(), &dloss)?;
        let dl_d = ops::cross_entropy_backward(&cx, Site::ROOT, saved_d, &dloss.to_gpu(&g)?)?;
        close(
            &device_values(&dl_d, "dlogits"),
            &dl_h.to_vec()?,
            1e-5,
            "dlogits",
        );
    }
    // A target outside the vocabulary is the CPU's error on the device too.
    let bad = Tensor::from_vec(vec![v as i64; s * b], [s, b])?;
    assert!(ops::cross_entropy(&cx, Site::ROOT, &logits.to_gpu(&g)?, &bad).is_err());
    Ok(())
}
