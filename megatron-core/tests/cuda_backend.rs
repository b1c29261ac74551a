//! The CUDA backend against the CPU backend: element-wise kernels, dropout masks (bit for bit),
//! cuBLAS products, graph replay (bit for bit), device tensors, and the device-local
//! communicator (several thread ranks on one GPU) against the thread backend (bit for bit).
//!
//! Every test needs a GPU: they are ignored by default and run with
//! `cargo test -p megatron-core --features cuda --test cuda_backend -- --ignored` on a GPU machine.
#![cfg(feature = "cuda")]

mod support;

use std::sync::Arc;

use half::bf16;
use megatron_core::comm::gpu_local::LocalGpu;
use megatron_core::comm::threads::launch;
use megatron_core::comm::{ReduceOp, World};
use megatron_core::cuda::blas::{Blas, MatmulShape};
use megatron_core::cuda::graph::Graph;
use megatron_core::cuda::kernels::operand::{In, Out};
use megatron_core::cuda::kernels::{dropout as gdrop, elementwise as gew};
use megatron_core::cuda::{CudaError, CudaSlice};
use megatron_core::kernels::dropout::{self as cdrop, LogicalIndex};
use megatron_core::kernels::elementwise as cew;
use megatron_core::kernels::gemm::{MatMut, MatRef, gemm};
use megatron_core::rng::DropoutStream;
use megatron_core::tensor::{DType, Device, Tensor, TensorError};
use support::gpu;

type R<T = ()> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Deterministic values in about [-3, 3].
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 6.0 - 3.0
        })
        .collect()
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn gelu_add_bias_casts_and_norms_match_the_cpu() -> R {
    let g = gpu();
    for n in [1, 3, 4, 37, 4096, 100_003] {
        let x = values(n, 1);
        let dy = values(n, 2);
        let (dx_cpu, y_cpu) = {
            let mut y = vec![0.0; n];
            let mut dx = vec![0.0; n];
            cew::gelu_forward(&x, &mut y)?;
            cew::gelu_backward(&x, &dy, &mut dx)?;
            (dx, y)
        };
        let xd = g.upload(&x)?;
        let dyd = g.upload(&dy)?;
        let mut yd = g.zeros::<f32>(n)?;
        let mut dxd = g.zeros::<f32>(n)?;
        gew::gelu_forward(&g, In::F32(&xd.as_view()), Out::F32(&mut yd.as_view_mut()))?;
        gew::gelu_backward(
            &g,
            In::F32(&xd.as_view()),
            In::F32(&dyd.as_view()),
            Out::F32(&mut dxd.as_view_mut()),
        )?;
        support::assert_close_rel(&g.download(&yd)?, &y_cpu, 1e-5, "gelu forward");
        support::assert_close_rel(&g.download(&dxd)?, &dx_cpu, 1e-5, "gelu backward");

        let mut sum = g.zeros::<f32>(n)?;
        gew::add(&g, &xd.as_view(), &dyd.as_view(), &mut sum.as_view_mut())?;
        let expected: Vec<f32> = x.iter().zip(&dy).map(|(a, b)| a + b).collect();
        assert_eq!(g.download(&sum)?, expected, "add is exact");
        // Unaligned views take the scalar path and give the same sums.
        if n > 8 {
            let mut out = g.zeros::<f32>(n - 1)?;
            gew::add(&g, &xd.slice(1..), &dyd.slice(1..), &mut out.as_view_mut())?;
            assert_eq!(g.download(&out)?, expected[1..].to_vec());
        }

        let mut half = g.zeros::<bf16>(n)?;
        gew::f32_to_bf16(&g, &xd.as_view(), &mut half.as_view_mut())?;
        let expected: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        assert_eq!(g.download(&half)?, expected, "bf16 rounding is half's");
        let mut back = g.zeros::<f32>(n)?;
        gew::bf16_to_f32(&g, &half.as_view(), &mut back.as_view_mut())?;
        let widened: Vec<f32> = expected.iter().map(|v| v.to_f32()).collect();
        assert_eq!(g.download(&back)?, widened);

        let norm = gew::sum_of_squares(&g, &xd.as_view())?;
        let cpu = cew::sum_of_squares(&x);
        assert!(
            (norm - cpu).abs() <= 1e-12 * cpu.max(1.0),
            "{norm} vs {cpu}"
        );
    }
    // Several parts read back once: each part's sum, added in order, whatever the part sizes
    // (empty, under a block, over several blocks).
    let x = values(200_000, 5);
    let xd = g.upload(&x)?;
    let bounds = [
        (0, 0),
        (3, 40),
        (40, 131_075),
        (131_075, 131_076),
        (150_000, 200_000),
    ];
    let parts: Vec<_> = bounds.iter().map(|&(a, b)| xd.slice(a..b)).collect();
    let mut each = 0.0;
    for p in &parts {
        each += gew::sum_of_squares(&g, p)?;
    }
    let together = gew::sum_of_squares_of(&g, &parts)?;
    assert_eq!(together.to_bits(), each.to_bits(), "{together} vs {each}");
    let cpu: f64 = bounds
        .iter()
        .map(|&(a, b)| cew::sum_of_squares(&x[a..b]))
        .sum();
    assert!((together - cpu).abs() <= 1e-12 * cpu, "{together} vs {cpu}");
    assert_eq!(gew::sum_of_squares_of(&g, &[])?, 0.0);
    let (rows, cols) = (33, 70);
    let x = values(rows * cols, 3);
    let bias = values(cols, 4);
    let mut cpu = x.clone();
    cew::bias_add_forward(&mut cpu, &bias, rows, cols)?;
    let mut xd = g.upload(&x)?;
    gew::bias_add_forward(
        &g,
        &mut xd.as_view_mut(),
        &g.upload(&bias)?.as_view(),
        rows,
        cols,
    )?;
    assert_eq!(g.download(&xd)?, cpu);
    let mut db_cpu = vec![0.0; cols];
    cew::bias_add_backward(&x, rows, cols, &mut db_cpu)?;
    let mut db = g.zeros::<f32>(cols)?;
    gew::bias_add_backward(
        &g,
        &g.upload(&x)?.as_view(),
        rows,
        cols,
        &mut db.as_view_mut(),
    )?;
    support::assert_close_rel(&g.download(&db)?, &db_cpu, 1e-5, "bias backward");
    Ok(())
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn dropout_masks_are_the_cpus_bit_for_bit() -> R {
    let g = gpu();
    let stream = DropoutStream::new(1234, &[3, 0, 7, 1]);
    let words = g.download(&gdrop::philox_words(&g, &stream, 5, 1003)?)?;
    let cpu: Vec<u32> = (5..1008).map(|i| stream.word(i)).collect();
    assert_eq!(words, cpu, "Philox words");
    for (p, index) in [
        (0.1, LogicalIndex::contiguous(10_001)),
        (0.5, LogicalIndex::columns(17, 24, 96, 48)),
        (0.0, LogicalIndex::contiguous(64)),
        (0.9, LogicalIndex::range(1 << 40, 513)),
        // Runs of multiples of 4: one Philox block per thread, 16-byte accesses.
        (0.1, LogicalIndex::contiguous(4096)),
        (0.3, LogicalIndex::range(8, 4000)),
    ] {
        let n = index.outer * index.inner;
        let x = values(n, 5);
        let mut y_cpu = vec![0.0; n];
        cdrop::dropout_forward(&x, &mut y_cpu, p, &stream, index)?;
        let xd = g.upload(&x)?;
        let mut yd = g.zeros::<f32>(n)?;
        let y_out = Out::F32(&mut yd.as_view_mut());
        gdrop::dropout_forward(&g, &xd.as_view(), y_out, p, &stream, index)?;
        let y = g.download(&yd)?;
        assert_eq!(
            y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            y_cpu.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "dropout p={p} {index:?}"
        );
        let mut dx = g.zeros::<f32>(n)?;
        gdrop::dropout_backward(
            &g,
            &xd.as_view(),
            Out::F32(&mut dx.as_view_mut()),
            p,
            &stream,
            index,
        )?;
        assert_eq!(g.download(&dx)?, y, "the backward regenerates the mask");
    }
    let err = gdrop::dropout_forward(
        &g,
        &g.upload(&[1.0f32; 4])?.as_view(),
        Out::F32(&mut g.zeros::<f32>(3)?.as_view_mut()),
        0.1,
        &stream,
        LogicalIndex::contiguous(4),
    )
    .expect_err("wrong length");
    assert!(
        err.to_string().contains("`y` has 3 elements, expected 4"),
        "{err}"
    );
    Ok(())
}

/// The CPU product of row-major `[m, k] × [k, n]` with optional transposes.
fn cpu_matmul(a: &[f32], b: &[f32], s: &MatmulShape) -> R<Vec<f32>> {
    let mut c = vec![0.0; s.m * s.n];
    let a = if s.trans_a {
        MatRef::row_major(a, s.k, s.m)?.t()
    } else {
        MatRef::row_major(a, s.m, s.k)?
    };
    let b = if s.trans_b {
        MatRef::row_major(b, s.n, s.k)?.t()
    } else {
        MatRef::row_major(b, s.k, s.n)?
    };
    gemm(s.alpha, a, b, 0.0, MatMut::row_major(&mut c, s.m, s.n)?)?;
    Ok(c)
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn cublas_products_match_the_cpu_gemm() -> R {
    let g = gpu();
    let blas = Blas::new(&g)?;
    for (m, n, k) in [(1, 1, 1), (7, 5, 3), (64, 96, 128), (130, 257, 65)] {
        for (trans_a, trans_b) in [(false, false), (true, false), (false, true), (true, true)] {
            let shape = MatmulShape {
                trans_a,
                trans_b,
                ..MatmulShape::new(m, n, k)
            };
            let a = values(m * k, 7);
            let b = values(k * n, 8);
            let cpu = cpu_matmul(&a, &b, &shape)?;
            let mut c = g.zeros::<f32>(m * n)?;
            blas.matmul(
                shape,
                &g.upload(&a)?.as_view(),
                &g.upload(&b)?.as_view(),
                &mut c.as_view_mut(),
            )?;
            support::assert_close_rel(&g.download(&c)?, &cpu, 1e-4, "f32 matmul");
            // bf16 inputs, f32 accumulation: the CPU product of the rounded inputs.
            let round = |v: &[f32]| -> Vec<bf16> { v.iter().map(|&x| bf16::from_f32(x)).collect() };
            let (ah, bh) = (round(&a), round(&b));
            let widen = |v: &[bf16]| -> Vec<f32> { v.iter().map(|x| x.to_f32()).collect() };
            let cpu = cpu_matmul(&widen(&ah), &widen(&bh), &shape)?;
            blas.matmul(
                shape,
                &g.upload(&ah)?.as_view(),
                &g.upload(&bh)?.as_view(),
                &mut c.as_view_mut(),
            )?;
            support::assert_close_rel(&g.download(&c)?, &cpu, 1e-4, "bf16 matmul");
        }
    }
    let err = blas
        .matmul(
            MatmulShape::new(2, 2, 2),
            &g.zeros::<f32>(3)?.as_view(),
            &g.zeros::<f32>(4)?.as_view(),
            &mut g.zeros::<f32>(4)?.as_view_mut(),
        )
        .expect_err("A too short");
    assert!(
        err.to_string().contains("`a` has 3 elements, expected 4"),
        "{err}"
    );
    Ok(())
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn cublaslt_adds_the_bias_in_the_products_epilogue() -> R {
    use megatron_core::ops::matmul_bias_into;
    // A handle of its own: the products' dtype and the epilogue switch are per handle.
    let g = gpu().with_new_stream()?;
    for (m, n, k) in [(1, 1, 1), (7, 5, 3), (64, 96, 128), (130, 257, 65)] {
        // x [m, k] times the transpose of a weight [n, k] (read in place), as a linear layer.
        let (x, w, bias) = (values(m * k, 31), values(n * k, 32), values(n, 33));
        let shape = MatmulShape {
            trans_b: true,
            ..MatmulShape::new(m, n, k)
        };
        for bf16_products in [false, true] {
            g.set_bf16_products(bf16_products);
            let round =
                |v: &[f32]| -> Vec<f32> { v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect() };
            let (xr, wr) = if bf16_products {
                (round(&x), round(&w))
            } else {
                (x.clone(), w.clone())
            };
            let mut want = cpu_matmul(&xr, &wr, &shape)?;
            for (i, v) in want.iter_mut().enumerate() {
                *v += bias[i % n];
            }
            // Operands at the start of their buffers, and one row (or element) into them, as
            // views into flat parameter buffers are: cuBLASLt must be told their alignment.
            let (skip, shapes) = (shape.m % 2, [[m, k], [n, k]]);
            let after_a_row = |v: &[f32], [rows, cols]: [usize; 2]| -> R<Tensor> {
                let mut data = vec![0.0; skip * cols];
                data.extend_from_slice(v);
                Ok(Tensor::from_vec(data, [rows + skip, cols])?
                    .to_gpu(&g)?
                    .narrow(0, skip, rows)?)
            };
            let xd = after_a_row(&x, shapes[0])?;
            let wd = after_a_row(&w, shapes[1])?;
            let bd = after_a_row(&bias, [n, 1])?.reshape([n])?;
            let outputs: &[DType] = if bf16_products {
                &[DType::F32, DType::BF16]
            } else {
                &[DType::F32]
            };
            for &dtype in outputs {
                let what = format!("{m}×{n}×{k}, bf16 products {bf16_products}, {dtype:?} out");
                let c = Tensor::full([m, n], 7.0, dtype).to_gpu(&g)?;
                g.set_bias_epilogues(true);
                if !matmul_bias_into(&xd, &wd.t()?, &bd, &c)? {
                    // cuBLASLt may have no algorithm for a problem: the layer then adds the
                    // bias itself, and nothing is written here. With an f32 output, layers'
                    // shapes (multiples of 8, as 64×96×128) must take the epilogue. With a
                    // bf16 output (the f32 bias is not D's type) neither an H100 (2026-11-27)
                    // nor an H200 (2026-11-30) had one for any shape, and the emulated
                    // cuBLASLt refuses it as they do.
                    assert!(
                        dtype == DType::BF16 || m % 8 != 0 || n % 8 != 0 || k % 8 != 0,
                        "{what}: no bias epilogue"
                    );
                    assert!(c.to_vec_f32()?.iter().all(|&v| v == 7.0), "{what}: written");
                    eprintln!("{what}: no cuBLASLt algorithm with the bias epilogue");
                    continue;
                }
                let got = c.to_vec_f32()?;
                if dtype == DType::BF16 {
                    // The f32 sum rounded once: within half a bf16 step of the exact one.
                    support::assert_close_rel(&got, &want, 1.0 / 256.0, &what);
                } else {
                    support::assert_close_rel(&got, &want, 1e-4, &what);
                }
                // Switched off, it leaves the product to the caller and writes nothing.
                let untouched = Tensor::full([m, n], 7.0, dtype).to_gpu(&g)?;
                g.set_bias_epilogues(false);
                assert!(!matmul_bias_into(&xd, &wd.t()?, &bd, &untouched)?, "{what}");
                assert!(untouched.to_vec_f32()?.iter().all(|&v| v == 7.0), "{what}");
            }
        }
    }
    g.set_bias_epilogues(true);
    let x = Tensor::zeros([2, 3], DType::F32).to_gpu(&g)?;
    let w = Tensor::zeros([4, 3], DType::F32).to_gpu(&g)?;
    let short = Tensor::zeros([3], DType::F32).to_gpu(&g)?;
    let c = Tensor::empty_on([2, 4], DType::F32, &g)?;
    let err = matmul_bias_into(&x, &w.t()?, &short, &c).expect_err("a bias of 3 for 4 columns");
    assert!(
        err.to_string()
            .contains("the bias has 3 elements, the product [2, 4] has 4 columns"),
        "{err}"
    );
    Ok(())
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn a_captured_graph_replays_the_eager_result_bit_for_bit() -> R {
    let g = gpu();
    let blas = Blas::new(&g)?;
    let (m, n, k) = (64, 48, 32);
    let a = g.upload(&values(m * k, 9))?;
    let b = g.upload(&values(k * n, 10))?;
    let mut c = g.zeros::<f32>(m * n)?;
    let mut y = g.zeros::<f32>(m * n)?;
    let stream = DropoutStream::new(7, &[1]);
    let region = |c: &mut CudaSlice<f32>, y: &mut CudaSlice<f32>| -> Result<(), CudaError> {
        blas.matmul(
            MatmulShape::new(m, n, k),
            &a.as_view(),
            &b.as_view(),
            &mut c.as_view_mut(),
        )?;
        gew::gelu_forward(&g, In::F32(&c.as_view()), Out::F32(&mut y.as_view_mut()))?;
        gdrop::dropout_forward(
            &g,
            &c.as_view(),
            Out::F32(&mut y.as_view_mut()),
            0.1,
            &stream,
            LogicalIndex::contiguous(m * n),
        )
    };
    // Warm-up, eagerly: the reference.
    region(&mut c, &mut y)?;
    let eager = g.download(&y)?;
    gew::fill(&g, &mut y.as_view_mut(), 0.0)?;
    let graph = Graph::capture(&g, "a test region", || region(&mut c, &mut y))?;
    assert!(
        g.download(&y)?.iter().all(|&v| v == 0.0),
        "capture runs nothing"
    );
    for _ in 0..3 {
        graph.replay()?;
        let replayed = g.download(&y)?;
        assert_eq!(
            replayed.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            eager.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        gew::fill(&g, &mut y.as_view_mut(), 0.0)?;
    }
    Ok(())
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn device_tensors_round_trip_and_refuse_host_reads() -> R {
    let g = gpu();
    let host = Tensor::from_vec(values(24, 11), [4, 6])?;
    let dev = host.to_gpu(&g)?;
    assert_eq!(dev.device(), Device::Cuda(0));
    assert_eq!(dev.shape(), host.shape());
    let back = dev.to_host()?;
    assert_eq!(back.to_vec::<f32>()?, host.to_vec::<f32>()?);
    let Err(err) = dev.read::<f32>() else {
        panic!("a host read of device memory must fail")
    };
    assert!(matches!(err, TensorError::Device { .. }), "{err}");
    assert!(err.to_string().contains("cuda:0"), "{err}");
    // to_vec downloads.
    assert_eq!(dev.to_vec::<f32>()?, host.to_vec::<f32>()?);
    // Strided device views copy, convert and fill on the device.
    let t = dev.t()?;
    assert_eq!(
        t.contiguous()?.to_vec::<f32>()?,
        host.t()?.contiguous()?.to_vec::<f32>()?
    );
    let half = t.to_dtype(DType::BF16)?;
    assert_eq!(half.device(), Device::Cuda(0));
    assert_eq!(
        half.to_vec::<bf16>()?,
        host.t()?.to_dtype(DType::BF16)?.to_vec::<bf16>()?
    );
    // Contiguous sources (from the start, and a row range after it) take the kernel's
    // index-free path.
    for (dev_view, host_view) in [
        (dev.clone(), host.clone()),
        (dev.narrow(0, 1, 2)?, host.narrow(0, 1, 2)?),
    ] {
        assert_eq!(
            dev_view.to_dtype(DType::BF16)?.to_vec::<bf16>()?,
            host_view.to_dtype(DType::BF16)?.to_vec::<bf16>()?
        );
        assert_eq!(
            dev_view
                .to_dtype(DType::BF16)?
                .to_dtype(DType::F32)?
                .to_vec::<f32>()?,
            host_view
                .to_dtype(DType::BF16)?
                .to_dtype(DType::F32)?
                .to_vec::<f32>()?
        );
    }
    let filled = Tensor::zeros_on([5], DType::I64, &g)?;
    filled.fill(7.0)?;
    assert_eq!(filled.to_vec::<i64>()?, vec![7; 5]);
    let up = Tensor::zeros_on([6, 4], DType::F32, &g)?;
    up.copy_from(&host.t()?)?;
    assert_eq!(
        up.to_vec::<f32>()?,
        host.t()?.contiguous()?.to_vec::<f32>()?
    );
    // Products of device views: transposed and batched, as on the host.
    let w = Tensor::from_vec(values(6 * 5, 12), [5, 6])?;
    let x = Tensor::from_vec(values(3 * 4 * 6, 13), [3, 4, 6])?;
    let cpu = megatron_core::ops::matmul(&x, &w.t()?)?;
    let gpu_out = megatron_core::ops::matmul(&x.to_gpu(&g)?, &w.to_gpu(&g)?.t()?)?;
    assert_eq!(gpu_out.device(), Device::Cuda(0));
    support::assert_close_rel(
        &gpu_out.to_vec::<f32>()?,
        &cpu.to_vec::<f32>()?,
        1e-5,
        "device matmul",
    );
    // Into a bf16 output: bf16 operands, the f32 accumulator rounded once.
    let c16 = Tensor::empty_on([3, 4, 5], DType::BF16, &g)?;
    megatron_core::ops::matmul_into(1.0, &x.to_gpu(&g)?, &w.to_gpu(&g)?.t()?, 0.0, &c16)?;
    let rounded = |t: &Tensor| -> R<Tensor> { Ok(t.to_dtype(DType::BF16)?.to_dtype(DType::F32)?) };
    let want = megatron_core::ops::matmul(&rounded(&x)?, &rounded(&w)?.t()?)?;
    assert_eq!(c16.dtype(), DType::BF16);
    support::assert_close_rel(
        &c16.to_vec_f32()?,
        &rounded(&want)?.to_vec::<f32>()?,
        1e-2,
        "matmul into bf16",
    );
    let scores = megatron_core::ops::matmul(&x, &x.transpose(1, 2)?)?;
    let xd = x.to_gpu(&g)?;
    let gpu_scores = megatron_core::ops::matmul(&xd, &xd.transpose(1, 2)?)?;
    support::assert_close_rel(
        &gpu_scores.to_vec::<f32>()?,
        &scores.to_vec::<f32>()?,
        1e-5,
        "batched",
    );
    // A narrowed device view copies back its rows.
    let rows = dev.narrow(0, 1, 2)?.to_host()?;
    assert_eq!(
        rows.to_vec::<f32>()?,
        host.narrow(0, 1, 2)?.contiguous()?.to_vec::<f32>()?
    );
    Ok(())
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn the_profiler_times_kernels_and_products_by_name() -> R {
    use megatron_core::cuda::profile;
    let g = gpu();
    let x = Tensor::from_vec(values(64 * 48, 21), [64, 48])?.to_gpu(&g)?;
    let w = Tensor::from_vec(values(32 * 48, 22), [32, 48])?.to_gpu(&g)?;
    let bias = Tensor::from_vec(values(32, 23), [32])?.to_gpu(&g)?;
    let biased = Tensor::empty_on([64, 32], DType::F32, &g)?;
    profile::start();
    for _ in 0..3 {
        let y = megatron_core::ops::matmul(&x, &w.t()?)?;
        y.fill(0.5)?;
        assert!(megatron_core::ops::matmul_bias_into(
            &x,
            &w.t()?,
            &bias,
            &biased
        )?);
    }
    let p = profile::stop()?;
    let row = |name: &str| p.row(name).ok_or_else(|| format!("no row {name} in {p}"));
    let gemm = row("gemm 64×32×48×1 f32→f32")?;
    assert_eq!(gemm.calls, 3);
    assert_eq!(gemm.flops, 3.0 * 2.0 * 64.0 * 32.0 * 48.0);
    assert!(gemm.ms > 0.0 && gemm.tflops().is_some(), "{p}");
    let with_bias = row("gemm+bias 64×32×48 f32→f32")?;
    assert_eq!(with_bias.calls, 3);
    assert_eq!(with_bias.flops, gemm.flops);
    let fill = row("fill_bits")?;
    assert_eq!(fill.calls, 3);
    assert!(fill.ms > 0.0 && fill.tflops().is_none(), "{p}");
    // Off again: nothing more is recorded.
    megatron_core::ops::matmul(&x, &w.t()?)?;
    assert!(profile::stop()?.rows.is_empty());
    Ok(())
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn the_peak_memory_counts_a_large_tensor() -> R {
    let g = gpu();
    let bytes = 256usize << 20;
    let t = Tensor::zeros_on([bytes / 4], DType::F32, &g)?;
    g.synchronize()?;
    let peak = g.peak_memory()?;
    assert!(
        peak >= bytes as u64,
        "peak {peak} below one {bytes}-byte tensor"
    );
    drop(t);
    // A high-water mark: freeing does not lower it.
    g.synchronize()?;
    assert!(g.peak_memory()? >= peak);
    Ok(())
}

/// Per rank, the bit patterns of each result tensor.
type RankBits = Vec<Vec<Vec<u64>>>;

/// Runs `body` on `n` thread ranks twice: on host tensors with the thread backend, and on
/// device tensors with the device-local communicator; returns both results per rank.
fn on_both(
    n: usize,
    body: impl Fn(&dyn World, &dyn Fn(Tensor) -> R<Tensor>) -> R<Vec<Tensor>> + Sync,
) -> (RankBits, RankBits) {
    let bits = |ts: Vec<Tensor>| -> Vec<Vec<u64>> {
        ts.iter()
            .map(|t| {
                let t = t.to_host().expect("to host");
                match t.dtype() {
                    DType::F32 => t
                        .to_vec::<f32>()
                        .unwrap()
                        .iter()
                        .map(|v| v.to_bits().into())
                        .collect(),
                    DType::BF16 => t
                        .to_vec::<bf16>()
                        .unwrap()
                        .iter()
                        .map(|v| v.to_bits().into())
                        .collect(),
                    DType::I64 => t
                        .to_vec::<i64>()
                        .unwrap()
                        .iter()
                        .map(|&v| v as u64)
                        .collect(),
                    DType::F16 => t
                        .to_vec::<half::f16>()
                        .unwrap()
                        .iter()
                        .map(|v| v.to_bits().into())
                        .collect(),
                }
            })
            .collect()
    };
    let host = launch(n, |w| -> R<Vec<Vec<u64>>> {
        Ok(bits(body(&w, &|t| Ok(t))?))
    })
    .expect("host run");
    let shared = LocalGpu::new(&gpu());
    let device = launch(n, |w| -> R<Vec<Vec<u64>>> {
        let world = shared.world(Arc::new(w))?;
        let g = world.gpu().clone();
        Ok(bits(body(&world, &move |t| Ok(t.to_gpu(&g)?))?))
    })
    .expect("device run");
    (host, device)
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn the_device_local_communicator_equals_the_thread_backend_bit_for_bit() {
    for n in [1, 2, 4] {
        let (host, device) = on_both(n, |w, put| {
            let ranks: Vec<usize> = (0..w.size()).collect();
            let c = w.communicator("world", &ranks)?;
            let me = w.rank();
            let mut out = Vec::new();
            for dtype in [DType::F32, DType::BF16, DType::F16, DType::I64] {
                for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
                    let t =
                        put(Tensor::from_vec(values(1001, me as u64), [1001])?.to_dtype(dtype)?)?;
                    c.all_reduce(&t, op)?;
                    out.push(t);
                }
                let input =
                    put(Tensor::from_vec(values(5, 10 + me as u64), [5])?.to_dtype(dtype)?)?;
                let gathered = put(Tensor::zeros([5 * w.size()], dtype))?;
                c.all_gather(&input, &gathered)?;
                out.push(gathered);
                let wide = put(Tensor::from_vec(
                    values(3 * w.size(), 20 + me as u64),
                    [3 * w.size()],
                )?
                .to_dtype(dtype)?)?;
                let part = put(Tensor::zeros([3], dtype))?;
                c.reduce_scatter(&wide, &part, ReduceOp::Sum)?;
                out.push(part);
                let b = put(Tensor::from_vec(values(9, 30 + me as u64), [9])?.to_dtype(dtype)?)?;
                c.broadcast(&b, w.size() - 1)?;
                out.push(b);
            }
            // Uneven all-to-all: rank i sends i + j + 1 elements to rank j.
            let n = w.size();
            let send: Vec<usize> = (0..n).map(|j| me + j + 1).collect();
            let recv: Vec<usize> = (0..n).map(|i| i + me + 1).collect();
            let input = put(Tensor::from_vec(
                values(send.iter().sum(), 40 + me as u64),
                [send.iter().sum::<usize>()],
            )?)?;
            let output = put(Tensor::zeros([recv.iter().sum::<usize>()], DType::F32))?;
            c.all_to_all(&input, &send, &output, &recv)?;
            out.push(output);
            if n > 1 {
                let next = (me + 1) % n;
                let prev = (me + n - 1) % n;
                let msg = put(Tensor::from_vec(values(17, 50 + me as u64), [17])?)?;
                let got = put(Tensor::zeros([17], DType::F32))?;
                // Both directions at once: sends never wait for their receives.
                c.send(&msg, next)?;
                c.recv(&got, prev)?;
                out.push(got);
            }
            c.barrier()?;
            Ok(out)
        });
        assert_eq!(device, host, "{n} ranks");
    }
}

/// Started collectives on the device-local communicator run on the handle's progress thread
/// and its communication stream: a start returns before the other members have started (rank
/// 0 starts only once rank 1's message says it has: a start that waited for the members would
/// never get there), other groups' calls go on meanwhile, a blocking call on the group comes
/// after the started ones, and every result is the thread backend's bit for bit.
#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn started_collectives_on_the_device_local_communicator_run_while_the_rank_goes_on() {
    let (host, device) = on_both(2, |w, put| {
        let ranks: Vec<usize> = (0..w.size()).collect();
        let dp = w.communicator("dp", &ranks)?;
        let other = w.communicator("other", &ranks)?;
        let me = w.rank();
        let flag = Tensor::zeros([1], DType::F32);
        if me == 0 {
            // Rank 1 has started its collectives before rank 0 starts any.
            other.recv(&put(flag.clone())?, 1)?;
        }
        let reduced = put(Tensor::from_vec(values(4099, me as u64), [4099])?)?;
        let wide = put(Tensor::from_vec(values(2 * 301, 7 + me as u64), [2 * 301])?)?;
        let part = put(Tensor::zeros([301], DType::F32))?;
        let input = put(Tensor::from_vec(values(33, 11 + me as u64), [33])?)?;
        let gathered = put(Tensor::zeros([2 * 33], DType::F32))?;
        let started = [
            dp.start_all_reduce(&reduced, ReduceOp::Sum)?,
            dp.start_reduce_scatter(&wide, &part, ReduceOp::Sum)?,
            dp.start_all_gather(&input, &gathered)?,
        ];
        if me == 1 {
            other.send(&put(flag)?, 0)?;
        }
        // Another group's call while they are in flight, and the group's own after them.
        let meanwhile = put(Tensor::from_vec(values(5, 20 + me as u64), [5])?)?;
        other.all_reduce(&meanwhile, ReduceOp::Max)?;
        let after = put(Tensor::from_vec(values(7, 30 + me as u64), [7])?)?;
        dp.all_reduce(&after, ReduceOp::Sum)?;
        for pending in started {
            pending.wait()?;
        }
        Ok(vec![reduced, part, gathered, meanwhile, after])
    });
    assert_eq!(device, host);
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn the_device_local_communicator_reports_mismatches_on_every_rank() {
    let shared = LocalGpu::new(&gpu());
    let errs = launch(2, |w| -> R<String> {
        let world = shared.world(Arc::new(w))?;
        let c = world.communicator("tp", &[0, 1])?;
        let len = if world.rank() == 0 { 5 } else { 6 };
        let t = Tensor::zeros([len], DType::F32).to_gpu(world.gpu())?;
        let err = c.all_reduce(&t, ReduceOp::Sum).expect_err("sizes differ");
        // The group goes on after a mismatch.
        let ok = Tensor::full([3], 1.0, DType::F32).to_gpu(world.gpu())?;
        c.all_reduce(&ok, ReduceOp::Sum)?;
        assert_eq!(ok.to_host()?.to_vec::<f32>()?, vec![2.0; 3]);
        Ok(err.to_string())
    })
    .expect("both ranks");
    for e in &errs {
        assert!(e.contains("f32 × 5") && e.contains("f32 × 6"), "{e}");
    }
}

/// Work on two streams is ordered only by an event: a buffer written on one stream and read on
/// another after waiting for an event recorded behind the write holds the written values; read
/// without that wait, the emulated GPU refuses the read (on a GPU it is a race: either order).
#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn buffers_shared_by_two_streams_need_an_event_between_their_uses() -> R {
    use cudarc::driver::sys::CUevent_flags;
    let a = gpu();
    let b = a.with_new_stream()?;
    let source = Tensor::full([4096], 2.5, DType::F32).to_gpu(&a)?;
    // Written on stream a by a kernel, with no synchronisation after it.
    let shared = Tensor::zeros_on([4096], DType::F32, &a)?;
    shared.copy_from(&source)?;
    let ready = a
        .stream()
        .record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))?;
    b.stream().wait(&ready)?;
    let out = Tensor::zeros_on([4096], DType::F32, &b)?;
    out.copy_from(&shared)?;
    assert_eq!(out.to_host()?.to_vec::<f32>()?, vec![2.5; 4096]);
    if support::device::requested() {
        let again = Tensor::zeros_on([4096], DType::F32, &a)?;
        again.copy_from(&source)?;
        let unordered = Tensor::zeros_on([4096], DType::F32, &b)?;
        let err = unordered
            .copy_from(&again)
            .expect_err("a read on stream b of a buffer stream a writes, with no event");
        assert!(
            err.to_string().contains("CUDA_ERROR_LAUNCH_FAILED"),
            "{err}"
        );
    }
    Ok(())
}

/// Multi-token prediction's ops on device tensors: `shift_left` of ids and of a mask,
/// `loss_mask` and `aux_loss`'s gradient give what the host gives, on the device.
#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn shifted_ids_and_masks_on_the_device_equal_the_hosts() -> R {
    use megatron_core::comm::ParallelState;
    use megatron_core::module::Cx;
    use megatron_core::ops::{loss_mask, shift_left};
    use megatron_core::parallel::{ParallelConfig, ParallelLayout};
    let layout = ParallelLayout::new(&ParallelConfig::new(1))?;
    let g = gpu();
    launch(1, |w| -> R {
        let ps = ParallelState::new(&w, &layout)?;
        let cx = Cx::new(&ps, 1);
        let ids = Tensor::from_vec((0..12).map(|i| i as i64 + 3).collect(), [4, 3])?;
        let on_device = ids.to_gpu(&g)?;
        let shifted = shift_left(&cx, &on_device)?;
        assert!(matches!(shifted.device(), Device::Cuda(_)));
        assert_eq!(
            shifted.to_vec::<i64>()?,
            shift_left(&cx, &ids)?.to_vec::<i64>()?
        );
        let mask = loss_mask(&cx, &on_device)?;
        assert!(matches!(mask.device(), Device::Cuda(_)));
        let shifted_mask = shift_left(&cx, &mask)?.to_vec::<f32>()?;
        assert_eq!(shifted_mask, [[1.0f32; 9].as_slice(), &[0.0; 3]].concat());
        // The auxiliary loss's gradient lands where its losses live.
        let losses = Tensor::from_vec(values(12, 7), [4, 3])?;
        let carrier = Tensor::from_vec(values(5, 8), [5])?.to_gpu(&g)?;
        let masked = shift_left(&cx, &mask)?;
        let on_host = aux_loss_grad(&cx, &carrier, &losses, &masked)?;
        let on_gpu = aux_loss_grad(&cx, &carrier, &losses.to_gpu(&g)?, &masked)?;
        assert!(matches!(on_gpu.device(), Device::Cuda(_)));
        assert_eq!(on_gpu.to_vec::<f32>()?, on_host.to_vec::<f32>()?);
        Ok(())
    })?;
    Ok(())
}

/// The per-token losses' gradient of `aux_loss` (weight 0.5) over `losses` and `mask`.
fn aux_loss_grad(
    cx: &megatron_core::module::Cx,
    carrier: &Tensor,
    losses: &Tensor,
    mask: &Tensor,
) -> R<Tensor> {
    use megatron_core::module::Site;
    use megatron_core::ops::{aux_loss, aux_loss_backward};
    let (_, saved) = aux_loss(cx, Site::ROOT, "mtp_1", carrier, (losses, mask), 0.5)?;
    Ok(aux_loss_backward(cx, Site::ROOT, saved, carrier)?.1)
}
