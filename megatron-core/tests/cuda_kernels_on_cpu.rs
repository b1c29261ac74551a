#![cfg(target_os = "linux")]
//! The CUDA kernels' own source run on the CPU, against the CPU kernels: `tests/emulated/shim.h`
//! implements the CUDA execution model on threads (a thread per CUDA thread, block barriers,
//! warp shuffles), the C++ compiler builds `src/cuda/cu/*.cu` with it, and the kernels are
//! launched by name with cuLaunchKernel's argument convention. This checks the kernels' logic
//! (indexing, vector and scalar paths, masks, bf16 packing, reductions) on every machine, GPU
//! or not; the GPU tests (`--features cuda -- --ignored`) check the same kernels on a device.
//!
//! Needs a C++20 compiler (`c++`, or `$CXX`).

mod emulated;

use half::bf16;
use megatron_core::kernels::adam::{self as cpu_adam, AdamConfig, AdamScalars};
use megatron_core::kernels::cross_entropy as cpu_ce;
use megatron_core::kernels::dropout::{self as cpu_dropout, LogicalIndex};
use megatron_core::kernels::elementwise as cpu_ew;
use megatron_core::kernels::embedding as cpu_emb;
use megatron_core::kernels::layer_norm as cpu_ln;
use megatron_core::kernels::softmax as cpu_sm;
use megatron_core::rng::DropoutStream;

use emulated::{Arg, launch, launch_3d, mask_args, values};

/// A buffer of f32 or bf16 elements after `offset` leading NaNs (offset 1 breaks the alignment
/// the vector paths need).
enum Buf {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
}

impl Buf {
    fn new(values: &[f32], offset: usize, bf16: bool) -> Buf {
        let mut v = vec![f32::NAN; offset];
        v.extend_from_slice(values);
        if bf16 {
            Buf::Bf16(v.iter().map(|&x| bf16::from_f32(x)).collect())
        } else {
            Buf::F32(v)
        }
    }

    fn nans(n: usize, offset: usize, bf16: bool) -> Buf {
        Buf::new(&vec![f32::NAN; n], offset, bf16)
    }

    /// The pointer to element `offset` and the kernels' `bf16` flag.
    fn arg(&mut self, offset: usize) -> [Arg; 2] {
        match self {
            Buf::F32(v) => [Arg::Ptr(v[offset..].as_mut_ptr().cast()), Arg::I32(0)],
            Buf::Bf16(v) => [Arg::Ptr(v[offset..].as_mut_ptr().cast()), Arg::I32(1)],
        }
    }

    fn values(&self, offset: usize) -> Vec<f32> {
        match self {
            Buf::F32(v) => v[offset..].to_vec(),
            Buf::Bf16(v) => v[offset..].iter().map(|x| x.to_f32()).collect(),
        }
    }
}

/// Threads per row, as the layer norm launchers choose them.
fn row_threads(sk: usize) -> usize {
    (sk.div_ceil(4).div_ceil(32) * 32).clamp(32, 512)
}

/// Threads per row, as the softmax launchers choose them.
fn softmax_threads(sk: usize) -> usize {
    row_threads(sk).min(128)
}

/// Scores with −∞ entries and, every fifth row, a row of only −∞.
fn scores(n: usize, sk: usize, seed: u64) -> Vec<f32> {
    let mut x = values(n, seed, -8.0, 8.0);
    let flags = values(n, seed + 1, 0.0, 1.0);
    for (i, v) in x.iter_mut().enumerate() {
        if (i / sk) % 5 == 4 || flags[i] < 0.1 {
            *v = f32::NEG_INFINITY;
        }
    }
    x
}

fn round(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}

/// `|got − want| ≤ atol + rtol·|want|`, NaN where `want` is NaN, exact zeros where it is zero.
fn assert_close(what: &str, got: &[f32], want: &[f32], rtol: f32, atol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w.is_nan() {
            assert!(g.is_nan(), "{what}[{i}]: {g}, want NaN");
        } else if w == 0.0 {
            assert_eq!(g, 0.0, "{what}[{i}]: want exactly 0");
        } else {
            assert!(
                (g - w).abs() <= atol + rtol * w.abs(),
                "{what}[{i}]: {g}, want {w}"
            );
        }
    }
}

/// Local heads, all heads, the first local head.
type Heads = (usize, usize, usize);

/// (batches, sq, sk, heads): aligned runs and odd ones, a tensor-parallel shard of heads,
/// widths not a multiple of 4.
const SHAPES: [(usize, usize, usize, Heads); 6] = [
    (4, 8, 8, (2, 4, 2)),
    (3, 5, 5, (1, 1, 0)),
    (2, 3, 37, (2, 2, 0)),
    (6, 16, 256, (3, 6, 3)),
    (2, 7, 9, (1, 3, 1)),
    // Rows longer than 4 float4 per thread of the softmax's 128.
    (1, 3, 700, (1, 1, 0)),
];

fn head_mask(batches: usize, sq: usize, sk: usize, (heads, all, first): Heads) -> LogicalIndex {
    LogicalIndex::heads(batches / heads, sq * sk, heads, all, first)
}

/// The fused forward on the CPU-built kernel: (probabilities, dropped).
#[allow(clippy::too_many_arguments)]
fn fused_forward(
    x: &[f32],
    (batches, sq, sk): (usize, usize, usize),
    scale: f32,
    dropout: Option<(f32, &DropoutStream, LogicalIndex)>,
    offset: usize,
    (x16, y16, d16): (bool, bool, Option<bool>),
) -> (Vec<f32>, Option<Vec<f32>>) {
    let n = x.len();
    let mut xb = Buf::new(x, offset, x16);
    let mut yb = Buf::nans(n, offset, y16);
    let mut db = d16.map(|b| Buf::nans(n, offset, b));
    let mut args = Vec::new();
    args.extend(xb.arg(offset));
    args.extend(yb.arg(offset));
    match &mut db {
        Some(d) => args.extend(d.arg(offset)),
        None => args.extend([Arg::Ptr(std::ptr::null_mut()), Arg::I32(0)]),
    }
    let rows = batches * sq;
    args.extend([
        Arg::U64(rows as u64),
        Arg::U64(sq as u64),
        Arg::U64(sk as u64),
        Arg::F32(scale),
        Arg::I32(1),
        // No sliding window.
        Arg::U64(u64::MAX),
    ]);
    args.extend(mask_args(dropout));
    launch("softmax_forward", rows, softmax_threads(sk), args);
    (yb.values(offset), db.map(|d| d.values(offset)))
}

#[test]
fn the_fused_softmax_forward_is_the_cpus_softmax_then_dropout() {
    let stream = DropoutStream::new(1234, &[7, 3]);
    for (batches, sq, sk, heads) in SHAPES {
        let n = batches * sq * sk;
        let x = scores(n, sk, (n + sk) as u64);
        let (scale, p) = (0.41, 0.3);
        let index = head_mask(batches, sq, sk, heads);
        let cpu = |x: &[f32]| {
            let mut probs = vec![0.0; n];
            cpu_sm::softmax_forward(x, batches, sq, sk, scale, true, &mut probs).unwrap();
            let mut dropped = vec![0.0; n];
            cpu_dropout::dropout_forward(&probs, &mut dropped, p, &stream, index).unwrap();
            (probs, dropped)
        };
        let (probs, dropped) = cpu(&x);
        let (probs16, dropped16) = cpu(&round(&x));
        let dims = (batches, sq, sk);
        for offset in [0, 1] {
            let what = format!("{dims:?} heads {heads:?} offset {offset}");
            let mask = Some((p, &stream, index));
            let (y, d) = fused_forward(&x, dims, scale, mask, offset, (false, false, Some(false)));
            assert_close(&what, &y, &probs, 1e-5, 1e-7);
            assert_close(&what, &d.unwrap(), &dropped, 1e-5, 1e-7);
            let (y, d) = fused_forward(&x, dims, scale, None, offset, (false, false, None));
            assert_close(&what, &y, &probs, 1e-5, 1e-7);
            assert!(d.is_none());
            let what = format!("{what} bf16");
            let (y, d) = fused_forward(&x, dims, scale, mask, offset, (true, true, Some(true)));
            assert_close(&what, &y, &round(&probs16), 1e-2, 1e-7);
            assert_close(&what, &d.unwrap(), &round(&dropped16), 1e-2, 1e-7);
        }
    }
}

#[test]
fn the_fused_softmax_backward_is_the_cpus_dropout_then_softmax_backward() {
    let stream = DropoutStream::new(99, &[1, 2, 3]);
    for (batches, sq, sk, heads) in SHAPES {
        let n = batches * sq * sk;
        let (scale, p) = (0.8, 0.25);
        let index = head_mask(batches, sq, sk, heads);
        let mut y = vec![0.0; n];
        cpu_sm::softmax_forward(&scores(n, sk, 3), batches, sq, sk, scale, true, &mut y).unwrap();
        let dy = values(n, 17, -1.0, 1.0);
        let cpu = |y: &[f32], dy: &[f32]| {
            let (mut dropped, mut d_probs) = (vec![0.0; n], vec![0.0; n]);
            cpu_dropout::dropout_pair(y, &mut dropped, dy, &mut d_probs, p, &stream, index)
                .unwrap();
            let mut dx = vec![0.0; n];
            cpu_sm::softmax_backward(y, &d_probs, batches, sq, sk, scale, &mut dx).unwrap();
            (dx, dropped)
        };
        let (dx, dropped) = cpu(&y, &dy);
        let (dx16, dropped16) = cpu(&round(&y), &round(&dy));
        let atol = 1e-5 * dx.iter().fold(1e-30f32, |m, v| m.max(v.abs()));
        // The probabilities are causal: skipping the keys a query does not see (`causal`)
        // gives what the whole rows give.
        for (offset, bf16, causal) in [
            (0, false, false),
            (1, false, true),
            (0, true, true),
            (1, true, false),
            (0, false, true),
        ] {
            {
                let what = format!(
                    "{batches}×{sq}×{sk} heads {heads:?} offset {offset} bf16 {bf16} causal {causal}"
                );
                let mut yb = Buf::new(&y, offset, bf16);
                let mut dyb = Buf::new(&dy, offset, bf16);
                let mut dxb = Buf::nans(n, offset, bf16);
                let mut db = Buf::nans(n, offset, bf16);
                let mut args = Vec::new();
                for b in [&mut yb, &mut dyb, &mut dxb, &mut db] {
                    args.extend(b.arg(offset));
                }
                args.extend([
                    Arg::U64((batches * sq) as u64),
                    Arg::U64(sq as u64),
                    Arg::U64(sk as u64),
                    Arg::F32(scale),
                    Arg::I32(i32::from(causal)),
                    Arg::U64(u64::MAX),
                ]);
                args.extend(mask_args(Some((p, &stream, index))));
                launch("softmax_backward", batches * sq, softmax_threads(sk), args);
                if bf16 {
                    assert_close(&what, &dxb.values(offset), &round(&dx16), 1e-2, 2.0 * atol);
                    assert_close(&what, &db.values(offset), &round(&dropped16), 0.0, 0.0);
                } else {
                    assert_close(&what, &dxb.values(offset), &dx, 1e-5, atol);
                    assert_close(&what, &db.values(offset), &dropped, 1e-6, 0.0);
                }
            }
        }
    }
}

#[test]
fn dropout_drops_the_cpus_elements_bit_for_bit() {
    let stream = DropoutStream::new(42, &[5]);
    // Aligned runs (one Philox block per four elements) and odd ones.
    for index in [
        LogicalIndex::contiguous(4096),
        LogicalIndex::columns(12, 24, 96, 48),
        LogicalIndex::columns(7, 13, 40, 5),
        LogicalIndex::range(3, 101),
    ] {
        let n = index.outer * index.inner;
        let x = values(n, n as u64, -2.0, 2.0);
        let residual = values(n, n as u64 + 1, -2.0, 2.0);
        let mut dropped = vec![0.0; n];
        cpu_dropout::dropout_forward(&x, &mut dropped, 0.3, &stream, index).unwrap();
        let mut summed = vec![0.0; n];
        cpu_dropout::dropout_add_forward(&residual, &x, &mut summed, 0.3, &stream, index).unwrap();
        // Without and with the residual (dropout, and dropout with the residual connection),
        // written in f32 and in bf16 (rounded once).
        for (with_residual, y_bf16, want) in [
            (false, false, dropped.clone()),
            (true, false, summed.clone()),
            (false, true, round(&dropped)),
            (true, true, round(&summed)),
        ] {
            for offset in [0, 1] {
                let mut xb = Buf::new(&x, offset, false);
                let mut yb = Buf::nans(n, offset, y_bf16);
                let mut rb = Buf::new(&residual, offset, false);
                let [xp, _] = xb.arg(offset);
                let [yp, y_flag] = yb.arg(offset);
                let [rp, _] = rb.arg(offset);
                let mut args = vec![
                    xp,
                    yp,
                    y_flag,
                    Arg::Ptr(std::ptr::null_mut()),
                    Arg::Ptr(std::ptr::null_mut()),
                    if with_residual {
                        rp
                    } else {
                        Arg::Ptr(std::ptr::null_mut())
                    },
                    Arg::U64(n as u64),
                ];
                args.extend(mask_args(Some((0.3, &stream, index))));
                launch("dropout_apply", n.div_ceil(256), 256, args);
                let got = yb.values(offset);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                let what = format!("{index:?} offset {offset} residual {with_residual}");
                assert_eq!(bits(&got), bits(&want), "{what} bf16 {y_bf16}");
            }
        }
    }
}

/// `got` is `want` bit for bit, but for NaNs (any NaN where `want` has one).
fn assert_bf16_bits(what: &str, got: &[u16], want: &[u16]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if bf16::from_bits(w).is_nan() {
            assert!(bf16::from_bits(g).is_nan(), "{what}[{i}]: {g:#x}, want NaN");
        } else {
            assert_eq!(g, w, "{what}[{i}]");
        }
    }
}

#[test]
fn bf16_rounding_and_contiguous_casts_are_the_hosts() {
    let mut x = values(1000, 9, -3.0, 3.0);
    let half_ulp = 2f32.powi(-8);
    x.extend([
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
        1.0 + half_ulp,       // a tie: rounds down to the even 1.0
        1.0 + 3.0 * half_ulp, // a tie: rounds up to the even neighbour
        f32::MAX,
        f32::MIN_POSITIVE / 3.0,
    ]);
    let n = x.len();
    let want: Vec<u16> = x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
    let mut out = vec![0u16; n];
    launch(
        "f32_to_bf16",
        n.div_ceil(256),
        256,
        vec![
            Arg::Ptr(x.as_mut_ptr().cast()),
            Arg::Ptr(out.as_mut_ptr().cast()),
            Arg::U64(n as u64),
        ],
    );
    assert_bf16_bits("f32_to_bf16", &out, &want);
    // The same through copy_dense, from element 4 on (16-byte aligned: four elements per thread
    // and a tail) and from element 5 on (one element per thread).
    for first in [4, 5] {
        let m = n - first;
        let mut copied = vec![0u16; m];
        copy_dense(
            x[first..].as_mut_ptr().cast(),
            F32,
            copied.as_mut_ptr().cast(),
            BF16,
            m,
        );
        assert_bf16_bits("copy_dense f32 → bf16", &copied, &want[first..]);
        // And back, widening exactly; then bf16 → bf16 moves the bits.
        let mut wide = vec![0f32; m];
        copy_dense(
            copied.as_mut_ptr().cast(),
            BF16,
            wide.as_mut_ptr().cast(),
            F32,
            m,
        );
        let widened: Vec<u32> = copied.iter().map(|&b| u32::from(b) << 16).collect();
        let got: Vec<u32> = wide.iter().map(|v| v.to_bits()).collect();
        assert_eq!(got, widened, "copy_dense bf16 → f32 from element {first}");
        let mut same = vec![0u16; m];
        copy_dense(
            copied.as_mut_ptr().cast(),
            BF16,
            same.as_mut_ptr().cast(),
            BF16,
            m,
        );
        assert_eq!(same, copied, "copy_dense bf16 → bf16 from element {first}");
    }
    // A strided source: element (i, j, k) of a [3, 4, 5] view with strides (7, 40, 2) from
    // element 3, rounded to bf16 in row-major order.
    #[repr(C)]
    struct View8 {
        dims: [i64; 8],
        strides: [i64; 8],
    }
    let (dims, strides) = ([3usize, 4, 5], [7usize, 40, 2]);
    let mut view = View8 {
        dims: [1; 8],
        strides: [0; 8],
    };
    for d in 0..3 {
        view.dims[d] = dims[d] as i64;
        view.strides[d] = strides[d] as i64;
    }
    // Where each element of the view lies, in row-major order.
    let mut at = Vec::new();
    for i in 0..dims[0] {
        for j in 0..dims[1] {
            for k in 0..dims[2] {
                at.push(3 + i * strides[0] + j * strides[1] + k * strides[2]);
            }
        }
    }
    let expected: Vec<u16> = at.iter().map(|&a| want[a]).collect();
    let mut strided = vec![0u16; expected.len()];
    launch(
        "copy_strided",
        1,
        32,
        vec![
            Arg::Ptr(x.as_mut_ptr().cast()),
            Arg::I32(F32),
            Arg::Ptr(strided.as_mut_ptr().cast()),
            Arg::I32(BF16),
            Arg::U64(expected.len() as u64),
            Arg::I32(3),
            Arg::U64(3),
            Arg::ByValue((&mut view as *mut View8).cast()),
            Arg::I32(2),
        ],
    );
    assert_bf16_bits("copy_strided, a [3, 4, 5] view", &strided, &expected);
    // And back into the same view of a wider bf16 buffer: each element lands where the view
    // puts it, the others stay as they were.
    let mut wide = vec![0xffffu16; want.len()];
    launch(
        "copy_to_strided",
        1,
        32,
        vec![
            Arg::Ptr(strided.as_mut_ptr().cast()),
            Arg::I32(BF16),
            Arg::Ptr(wide.as_mut_ptr().cast()),
            Arg::I32(BF16),
            Arg::U64(expected.len() as u64),
            Arg::I32(3),
            Arg::U64(3),
            Arg::ByValue((&mut view as *mut View8).cast()),
            Arg::I32(2),
        ],
    );
    let mut placed = vec![0xffffu16; want.len()];
    for (&a, &v) in at.iter().zip(&strided) {
        placed[a] = v;
    }
    assert_eq!(wide, placed, "copy_to_strided, a [3, 4, 5] view");
}

/// The copy kernels' element type codes.
const F32: i32 = 0;
const BF16: i32 = 1;
const F16: i32 = 2;

#[test]
fn fp16_conversions_are_the_hosts() {
    use half::f16;
    // Every fp16 widens exactly (NaNs stay NaN).
    let mut all: Vec<u16> = (0..=u16::MAX).collect();
    let n = all.len();
    let mut wide = vec![0f32; n];
    copy_dense(
        all.as_mut_ptr().cast(),
        F16,
        wide.as_mut_ptr().cast(),
        F32,
        n,
    );
    for (i, (&h, &w)) in all.iter().zip(&wide).enumerate() {
        let want = f16::from_bits(h).to_f32();
        assert!(
            w.to_bits() == want.to_bits() || (want.is_nan() && w.is_nan()),
            "fp16 {i:#06x}: {w} vs {want}"
        );
    }
    // f32 rounds to the nearest fp16, ties to even, as the half crate does: random values of
    // every magnitude, every fp16 and the midpoints between neighbours, and the edges.
    let mut x: Vec<f32> = values(4000, 11, -1.0, 1.0)
        .iter()
        .enumerate()
        .map(|(i, v)| v * 2f32.powi(i as i32 % 44 - 28))
        .collect();
    for h in (0..0x7c00u16).step_by(7) {
        let (a, b) = (f16::from_bits(h).to_f32(), f16::from_bits(h + 1).to_f32());
        x.extend([a, -a, (a + b) / 2.0, -(a + b) / 2.0]);
    }
    x.extend([
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
        65504.0,
        65519.0,
        65520.0,
        1e9,
        2f32.powi(-25),
        2f32.powi(-25) * 1.0001,
        2f32.powi(-24) * 1.5,
        2f32.powi(-14) * 0.99999,
        f32::MIN_POSITIVE,
    ]);
    let n = x.len();
    let mut narrow = vec![0u16; n];
    copy_dense(
        x.as_mut_ptr().cast(),
        F32,
        narrow.as_mut_ptr().cast(),
        F16,
        n,
    );
    for (i, (&v, &got)) in x.iter().zip(&narrow).enumerate() {
        let want = f16::from_f32(v);
        assert!(
            got == want.to_bits() || (want.is_nan() && f16::from_bits(got).is_nan()),
            "{i}: f32 {v:e} ({:#010x}) gave {got:#06x}, the host {:#06x}",
            v.to_bits(),
            want.to_bits()
        );
    }
    // fold_f16 adds in f32, in rank order, rounding once.
    let (mut a, mut b): (Vec<u16>, Vec<u16>) = x[..1000]
        .iter()
        .map(|&v| {
            (
                f16::from_f32(v).to_bits(),
                f16::from_f32(v * 0.75 + 0.5).to_bits(),
            )
        })
        .unzip();
    let mut out = vec![0u16; 1000];
    let mut srcs = [a.as_mut_ptr(), b.as_mut_ptr()];
    launch(
        "fold_f16",
        4,
        256,
        vec![
            Arg::Ptr(srcs.as_mut_ptr().cast()),
            Arg::I32(2),
            Arg::Ptr(out.as_mut_ptr().cast()),
            Arg::U64(1000),
            Arg::I32(0),
        ],
    );
    for i in 0..1000 {
        let sum = f16::from_bits(a[i]).to_f32() + f16::from_bits(b[i]).to_f32();
        assert_eq!(out[i], f16::from_f32(sum).to_bits(), "fold_f16 [{i}]");
    }
}

/// `unscale_and_check` of `x` by `scale`: whether it flagged an element.
fn unscale_and_check(x: &mut [f32], scale: f32) -> bool {
    let mut found = [0f32];
    launch(
        "unscale_and_check",
        x.len().div_ceil(256).min(4),
        256,
        vec![
            Arg::Ptr(x.as_mut_ptr().cast()),
            Arg::U64(x.len() as u64),
            Arg::F32(scale),
            Arg::Ptr(found.as_mut_ptr().cast()),
        ],
    );
    found[0] != 0.0
}

#[test]
fn unscale_and_check_scales_and_finds_inf_and_nan() {
    for (bad, want) in [
        (None, false),
        (Some(f32::INFINITY), true),
        (Some(f32::NAN), true),
    ] {
        let mut x = values(3000, 5, -1e6, 1e6);
        if let Some(v) = bad {
            x[2345] = v;
        }
        let want_x: Vec<f32> = x.iter().map(|v| v * 0.25).collect();
        assert_eq!(unscale_and_check(&mut x, 0.25), want, "{bad:?}");
        for (i, (g, w)) in x.iter().zip(&want_x).enumerate() {
            assert!(
                g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                "[{i}]"
            );
        }
    }
    // A finite value that overflows once scaled is found too.
    assert!(unscale_and_check(&mut [1.0, f32::MAX], 4.0));
}

/// `copy_dense` of `n` elements from `src` (type code `src_type`) to `dst`.
fn copy_dense(
    src: *mut std::ffi::c_void,
    src_type: i32,
    dst: *mut std::ffi::c_void,
    dst_type: i32,
    n: usize,
) {
    let bytes = if dst_type == F32 { 4 } else { 2 };
    launch(
        "copy_dense",
        n.div_ceil(256),
        256,
        vec![
            Arg::Ptr(src),
            Arg::I32(src_type),
            Arg::Ptr(dst),
            Arg::I32(dst_type),
            Arg::U64(n as u64),
            Arg::I32(bytes),
        ],
    );
}

/// Pointers to the elements of `v` after `offset`.
fn ptr(v: &mut [f32], offset: usize) -> Arg {
    Arg::Ptr(v[offset..].as_mut_ptr().cast())
}

/// `v` after `offset` leading NaNs.
fn padded(v: &[f32], offset: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; offset];
    out.extend_from_slice(v);
    out
}

/// One bf16 step relative to a value: two f32 results that agree to rounding may round to
/// neighbouring bf16 values.
const BF16_STEP: f32 = 1.0 / 128.0;

/// The CPU's result of an element-wise kernel as a kernel writing `bf16` would give it.
fn as_written(v: Vec<f32>, bf16: bool) -> Vec<f32> {
    if bf16 { round(&v) } else { v }
}

/// The values a kernel reading `bf16` sees.
fn as_read(v: &[f32], bf16: bool) -> Vec<f32> {
    as_written(v.to_vec(), bf16)
}

#[test]
fn gelu_reads_and_writes_f32_or_bf16_as_the_cpu() {
    // Not a multiple of 4 (the tail), offsets 0 and 1 (the 4-wide path and the scalar one).
    let n = 1003;
    let x = values(n, 41, -6.0, 6.0);
    let dy = values(n, 42, -2.0, 2.0);
    for offset in [0, 1] {
        for (x16, y16) in [(false, false), (true, false), (false, true), (true, true)] {
            let what = format!("gelu offset {offset}, bf16 in {x16} out {y16}");
            let mut want = vec![0.0; n];
            cpu_ew::gelu_forward(&as_read(&x, x16), &mut want).unwrap();
            let (mut xb, mut yb) = (Buf::new(&x, offset, x16), Buf::nans(n, offset, y16));
            let mut args = Vec::from(xb.arg(offset));
            args.extend(yb.arg(offset));
            args.push(Arg::U64(n as u64));
            launch("gelu_forward", 2, 64, args);
            let tol = if y16 { BF16_STEP } else { 1e-5 };
            assert_close(&what, &yb.values(offset), &as_written(want, y16), tol, 1e-6);
        }
        for (x16, dy16, dx16) in [
            (false, false, false),
            (true, false, true),
            (true, true, true),
            (false, true, false),
        ] {
            let what = format!("gelu backward offset {offset}, bf16 x {x16} dy {dy16} dx {dx16}");
            let mut want = vec![0.0; n];
            cpu_ew::gelu_backward(&as_read(&x, x16), &as_read(&dy, dy16), &mut want).unwrap();
            let (mut xb, mut dyb, mut dxb) = (
                Buf::new(&x, offset, x16),
                Buf::new(&dy, offset, dy16),
                Buf::nans(n, offset, dx16),
            );
            let mut args = Vec::from(xb.arg(offset));
            args.extend(dyb.arg(offset));
            args.extend(dxb.arg(offset));
            args.push(Arg::U64(n as u64));
            launch("gelu_backward", 2, 64, args);
            let tol = if dx16 { BF16_STEP } else { 1e-5 };
            assert_close(
                &what,
                &dxb.values(offset),
                &as_written(want, dx16),
                tol,
                1e-6,
            );
        }
    }
}

#[test]
fn swiglu_reads_and_writes_f32_or_bf16_as_the_cpu() {
    // Rows of gate and up halves of an odd width; offsets 0 and 1.
    let (rows, ffn) = (7, 13);
    let x = values(rows * 2 * ffn, 51, -6.0, 6.0);
    let dy = values(rows * ffn, 52, -2.0, 2.0);
    let dims = || [Arg::U64(rows as u64), Arg::U64(ffn as u64)];
    for offset in [0, 1] {
        for (x16, y16) in [(false, false), (true, true)] {
            let what = format!("swiglu offset {offset}, bf16 in {x16} out {y16}");
            let mut want = vec![0.0; rows * ffn];
            cpu_ew::swiglu_forward(&as_read(&x, x16), ffn, &mut want).unwrap();
            let mut xb = Buf::new(&x, offset, x16);
            let mut yb = Buf::nans(rows * ffn, offset, y16);
            let mut args = Vec::from(xb.arg(offset));
            args.extend(yb.arg(offset));
            args.extend(dims());
            launch("swiglu_forward", 2, 64, args);
            let tol = if y16 { BF16_STEP } else { 1e-5 };
            assert_close(&what, &yb.values(offset), &as_written(want, y16), tol, 1e-6);

            let what = format!("swiglu backward offset {offset}, bf16 {x16}");
            let mut want = vec![0.0; x.len()];
            cpu_ew::swiglu_backward(&as_read(&x, x16), &as_read(&dy, x16), ffn, &mut want).unwrap();
            let mut dyb = Buf::new(&dy, offset, x16);
            let mut dxb = Buf::nans(x.len(), offset, x16);
            let mut args = Vec::from(xb.arg(offset));
            args.extend(dyb.arg(offset));
            args.extend(dxb.arg(offset));
            args.extend(dims());
            launch("swiglu_backward", 2, 64, args);
            let tol = if x16 { BF16_STEP } else { 1e-5 };
            assert_close(
                &what,
                &dxb.values(offset),
                &as_written(want, x16),
                tol,
                1e-6,
            );
        }
    }
}

#[test]
fn rope_reads_and_writes_f32_or_bf16_as_the_cpu() {
    use megatron_core::kernels::rotary::{self as cpu_rope, RopeLayout};
    // Grouped heads (2 groups of 2 queries, a key, a value), a partial rotary dimension.
    let inv_freq = [1.0f32, 0.3, 0.05];
    for (interleaved, offset_pos, inverse, amplitude) in [
        (false, 0, false, 1.0),
        (true, 5, false, 1.0),
        (false, 3, true, 1.0),
        (true, 2, true, 1.368_888_8),
        (false, 4, false, 0.8),
    ] {
        let l = RopeLayout {
            seq: 6,
            batch: 3,
            groups: 2,
            parts: 4,
            rotated: 3,
            head_dim: 8,
            rot: 6,
            interleaved,
            offset: offset_pos,
            amplitude,
        };
        let n = l.seq * l.batch * l.row();
        let x = values(n, 61, -3.0, 3.0);
        for offset in [0, 1] {
            for bf16 in [false, true] {
                let what = format!("rope {l:?} inverse {inverse}, offset {offset}, bf16 {bf16}");
                let mut want = vec![0.0; n];
                cpu_rope::rope(&as_read(&x, bf16), &mut want, l, &inv_freq, inverse).unwrap();
                let (mut xb, mut yb) = (Buf::new(&x, offset, bf16), Buf::nans(n, offset, bf16));
                let mut args = Vec::from(xb.arg(offset));
                args.extend(yb.arg(offset));
                for d in [
                    l.seq, l.batch, l.groups, l.parts, l.rotated, l.head_dim, l.rot,
                ] {
                    args.push(Arg::U64(d as u64));
                }
                args.push(Arg::I32(i32::from(interleaved)));
                args.push(Arg::U64(offset_pos as u64));
                args.push(Arg::I32(i32::from(inverse)));
                args.push(Arg::F32(amplitude));
                let mut freqs = [0f32; 128];
                freqs[..3].copy_from_slice(&inv_freq);
                args.push(Arg::ByValue(freqs.as_mut_ptr().cast()));
                launch("rope", 2, 64, args);
                let tol = if bf16 { BF16_STEP } else { 1e-5 };
                assert_close(
                    &what,
                    &yb.values(offset),
                    &as_written(want, bf16),
                    tol,
                    1e-6,
                );
            }
        }
    }
}

#[test]
fn grouped_heads_expand_and_reduce_as_the_cpu() {
    use megatron_core::kernels::heads::{self as cpu_heads, GroupedHeads};
    let sh = GroupedHeads {
        rows: 7,
        groups: 3,
        per_group: 4,
        head_dim: 5,
    };
    let x = values(sh.rows * sh.grouped(), 71, -3.0, 3.0);
    let dy = values(sh.rows * sh.per_head(), 72, -3.0, 3.0);
    let dims = || [sh.rows, sh.groups, sh.per_group, sh.head_dim].map(|d| Arg::U64(d as u64));
    for offset in [0, 1] {
        for bf16 in [false, true] {
            let what = format!("expand offset {offset} bf16 {bf16}");
            let mut want = vec![0.0; dy.len()];
            cpu_heads::expand_groups(&as_read(&x, bf16), &mut want, sh).unwrap();
            let (mut xb, mut yb) = (
                Buf::new(&x, offset, bf16),
                Buf::nans(dy.len(), offset, bf16),
            );
            let mut args = Vec::from(xb.arg(offset));
            args.extend(yb.arg(offset));
            args.extend(dims());
            launch("expand_groups", 2, 64, args);
            assert_close(&what, &yb.values(offset), &as_written(want, bf16), 0.0, 0.0);

            let what = format!("reduce offset {offset} bf16 {bf16}");
            let mut want = vec![0.0; x.len()];
            cpu_heads::reduce_groups(&as_read(&dy, bf16), &mut want, sh).unwrap();
            let (mut dyb, mut dxb) = (
                Buf::new(&dy, offset, bf16),
                Buf::nans(x.len(), offset, bf16),
            );
            let mut args = Vec::from(dyb.arg(offset));
            args.extend(dxb.arg(offset));
            args.extend(dims());
            launch("reduce_groups", 2, 64, args);
            let tol = if bf16 { BF16_STEP } else { 0.0 };
            assert_close(
                &what,
                &dxb.values(offset),
                &as_written(want, bf16),
                tol,
                0.0,
            );
        }
    }
}

#[test]
fn bias_adds_in_place_and_into_bf16_as_the_cpu() {
    // Widths a multiple of 4 and not; grids smaller than the matrix in both directions (the
    // kernels stride over rows and columns) and larger.
    for (rows, cols) in [(7, 200), (5, 13), (4, 12), (1, 3)] {
        let n = rows * cols;
        let x = values(n, 51, -3.0, 3.0);
        let bias = values(cols, 52, -1.0, 1.0);
        let mut want = x.clone();
        cpu_ew::bias_add_forward(&mut want, &bias, rows, cols).unwrap();
        for (grid, offset) in [([1, 3, 1], 0), ([2, 9, 1], 1), ([1, 1, 1], 1)] {
            let what = format!("{rows}×{cols} grid {grid:?} offset {offset}");
            let (mut xd, mut bd) = (padded(&x, offset), padded(&bias, offset));
            let dims = [Arg::U64(rows as u64), Arg::U64(cols as u64)];
            let mut args = vec![ptr(&mut xd, offset), ptr(&mut bd, offset)];
            args.extend(dims);
            launch_3d("bias_add_forward", grid, [32, 1, 1], args);
            assert_close(&what, &xd[offset..], &want, 0.0, 0.0);
            for to_bf16 in [false, true] {
                let mut xd = padded(&x, offset);
                let mut y = Buf::nans(n, offset, to_bf16);
                let mut args = vec![ptr(&mut xd, offset), ptr(&mut bd, offset)];
                args.extend(y.arg(offset));
                args.extend([Arg::U64(rows as u64), Arg::U64(cols as u64)]);
                launch_3d("bias_add_cast", grid, [32, 1, 1], args);
                // The f32 sum rounded once: exactly the host's conversion.
                let got = y.values(offset);
                assert_close(&what, &got, &as_written(want.clone(), to_bf16), 0.0, 0.0);
                assert_eq!(&xd[offset..], &x[..], "{what}: the input changed");
            }
        }
    }
}

#[test]
fn adam_scales_the_gradients_and_writes_bf16_copies_as_the_cpu() {
    // Not a multiple of 4; offset 1 takes the scalar path. The CPU step with the same scale,
    // bit for bit, and its parameters rounded to bf16 for the copies.
    let n = 1003;
    let p0 = values(n, 61, -1.0, 1.0);
    let g = values(n, 62, -2.0, 2.0);
    let m0 = values(n, 63, -0.1, 0.1);
    let v0 = values(n, 64, 0.0, 0.01);
    for (offset, grad_scale, decoupled, with_copy) in [
        (0, 0.37, true, true),
        (1, 0.37, false, true),
        (0, 1.0, true, false),
        (1, 1.0, true, false),
    ] {
        let what = format!("offset {offset} scale {grad_scale} decoupled {decoupled}");
        let config = AdamConfig {
            lr: 3e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            step: 4,
            decoupled,
            grad_scale,
        };
        let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
        cpu_adam::adam_step(&mut p, &g, &mut m, &mut v, &config).unwrap();
        let (mut pd, mut gd, mut md, mut vd) = (
            padded(&p0, offset),
            padded(&g, offset),
            padded(&m0, offset),
            padded(&v0, offset),
        );
        let mut copy = Buf::nans(n, offset, true);
        let copy_ptr = if with_copy {
            let [ptr, _bf16_flag] = copy.arg(offset);
            ptr
        } else {
            Arg::Ptr(std::ptr::null_mut())
        };
        let c = AdamScalars::of(&config);
        let mut args = vec![
            ptr(&mut pd, offset),
            ptr(&mut gd, offset),
            ptr(&mut md, offset),
            ptr(&mut vd, offset),
            copy_ptr,
            Arg::U64(n as u64),
            Arg::F32(c.grad_scale),
        ];
        args.extend(
            [
                c.b1,
                c.b2,
                c.omb1,
                c.omb2,
                c.eps,
                c.step_size,
                c.inv_sqrt_bc2,
                c.decay,
                c.l2,
            ]
            .map(Arg::F32),
        );
        launch("adam_step", 2, 64, args);
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&pd[offset..]), bits(&p), "param, {what}");
        assert_eq!(bits(&md[offset..]), bits(&m), "exp_avg, {what}");
        assert_eq!(bits(&vd[offset..]), bits(&v), "exp_avg_sq, {what}");
        if with_copy {
            assert_eq!(copy.values(offset), round(&p), "bf16 copies, {what}");
        } else {
            assert!(copy.values(offset).iter().all(|x| x.is_nan()), "{what}");
        }
    }
}

#[test]
fn layer_norm_forward_and_backward_are_the_cpus() {
    // (rows, hidden): widths not a multiple of 4 or 32, more rows than one gradient chunk.
    for (rows, hidden) in [(5, 37), (4, 768), (300, 64), (70, 96), (1, 3)] {
        let n = rows * hidden;
        let x: Vec<f32> = values(n, 31, -2.0, 2.0)
            .iter()
            .enumerate()
            .map(|(i, v)| v * (1.0 + (i / hidden) as f32 * 0.1) + (i / hidden) as f32)
            .collect();
        let gamma = values(hidden, 32, 0.5, 1.5);
        let beta = values(hidden, 33, -0.5, 0.5);
        let dy = values(n, 34, -1.0, 1.0);
        let eps = 1e-5;
        let (mut y, mut mean, mut rstd) = (vec![0.0; n], vec![0.0; rows], vec![0.0; rows]);
        cpu_ln::layer_norm_forward(
            &x, &gamma, &beta, rows, hidden, eps, &mut y, &mut mean, &mut rstd,
        )
        .unwrap();
        let mut dx = vec![0.0; n];
        let (mut dgamma, mut dbeta) =
            (values(hidden, 35, -1.0, 1.0), values(hidden, 36, -1.0, 1.0));
        let (dgamma0, dbeta0) = (dgamma.clone(), dbeta.clone());
        cpu_ln::layer_norm_backward(
            &dy,
            &x,
            &mean,
            &rstd,
            &gamma,
            rows,
            hidden,
            &mut dx,
            &mut dgamma,
            &mut dbeta,
        )
        .unwrap();
        let threads = row_threads(hidden);
        for offset in [0, 1] {
            let what = format!("{rows}×{hidden} offset {offset}");
            let (mut xd, mut gd, mut bd) = (
                padded(&x, offset),
                padded(&gamma, offset),
                padded(&beta, offset),
            );
            let (mut yd, mut md, mut rd) = (
                vec![f32::NAN; offset + n],
                vec![f32::NAN; offset + rows],
                vec![f32::NAN; offset + rows],
            );
            // The forward into `y` (a pointer and its bf16 flag).
            let mut forward = |[y_ptr, y_flag]: [Arg; 2]| {
                launch(
                    "layer_norm_forward",
                    rows,
                    threads,
                    vec![
                        ptr(&mut xd, offset),
                        ptr(&mut gd, offset),
                        ptr(&mut bd, offset),
                        y_ptr,
                        y_flag,
                        ptr(&mut md, offset),
                        ptr(&mut rd, offset),
                        Arg::U64(rows as u64),
                        Arg::U64(hidden as u64),
                        Arg::F32(eps),
                    ],
                )
            };
            // In f32, and rounded to bf16 for bf16 products.
            let mut y16 = Buf::nans(n, offset, true);
            forward(y16.arg(offset));
            forward([ptr(&mut yd, offset), Arg::I32(F32)]);
            assert_close(&what, &yd[offset..], &y, 1e-5, 1e-5);
            assert_close(&what, &md[offset..], &mean, 1e-5, 1e-6);
            assert_close(&what, &rd[offset..], &rstd, 1e-5, 1e-6);
            // Within one bf16 step: the f32 values agree to rounding, which may fall on either
            // side of a bf16 midpoint.
            assert_close(&what, &y16.values(offset), &round(&y), BF16_STEP, 1e-5);
            // The backward from the CPU's statistics: dx per row, then the parameter gradients
            // through f64 partial sums per chunk of rows, added to what they held.
            let (mut dyd, mut meand, mut rstdd) = (
                padded(&dy, offset),
                padded(&mean, offset),
                padded(&rstd, offset),
            );
            // dx alone, and with another gradient of x added (`plus`).
            let plus = values(n, 37, -2.0, 2.0);
            let dx_plus: Vec<f32> = plus.iter().zip(&dx).map(|(p, d)| p + d).collect();
            let mut plusd = padded(&plus, offset);
            for with_plus in [false, true] {
                let mut dxd = vec![f32::NAN; offset + n];
                let plus_arg = if with_plus {
                    ptr(&mut plusd, offset)
                } else {
                    Arg::Ptr(std::ptr::null_mut())
                };
                launch(
                    "layer_norm_backward_dx",
                    rows,
                    threads,
                    vec![
                        ptr(&mut dyd, offset),
                        ptr(&mut xd, offset),
                        ptr(&mut meand, offset),
                        ptr(&mut rstdd, offset),
                        ptr(&mut gd, offset),
                        plus_arg,
                        ptr(&mut dxd, offset),
                        Arg::U64(rows as u64),
                        Arg::U64(hidden as u64),
                        // Centered: a layer norm (RMSNorm passes 0).
                        Arg::I32(1),
                    ],
                );
                let want = if with_plus { &dx_plus } else { &dx };
                let what = format!("{what} plus {with_plus}");
                assert_close(&what, &dxd[offset..], want, 1e-4, 1e-5);
            }
            let rows_per_chunk = rows.div_ceil(64).max(32);
            let chunks = rows.div_ceil(rows_per_chunk);
            let mut partials = vec![0f64; 2 * chunks * hidden];
            launch_3d(
                "layer_norm_backward_partials",
                [hidden.div_ceil(32), chunks, 1],
                [32, 8, 1],
                vec![
                    ptr(&mut dyd, offset),
                    ptr(&mut xd, offset),
                    ptr(&mut meand, offset),
                    ptr(&mut rstdd, offset),
                    Arg::Ptr(partials.as_mut_ptr().cast()),
                    Arg::U64(rows as u64),
                    Arg::U64(hidden as u64),
                    Arg::U64(rows_per_chunk as u64),
                ],
            );
            let (mut dgd, mut dbd) = (padded(&dgamma0, offset), padded(&dbeta0, offset));
            launch(
                "layer_norm_backward_finalize",
                hidden.div_ceil(256),
                256,
                vec![
                    Arg::Ptr(partials.as_mut_ptr().cast()),
                    ptr(&mut dgd, offset),
                    ptr(&mut dbd, offset),
                    Arg::U64(chunks as u64),
                    Arg::U64(hidden as u64),
                ],
            );
            assert_close(&what, &dgd[offset..], &dgamma, 1e-5, 1e-5);
            assert_close(&what, &dbd[offset..], &dbeta, 1e-5, 1e-5);
        }
    }
}

#[test]
fn embedding_lookup_and_gradient_are_the_cpus_bit_for_bit() {
    // (tokens, hidden, shard start, shard rows): whole tables and vocab-parallel shards, ids
    // outside the shard (zero rows, no gradient), repeated ids, widths not a multiple of 4.
    for (n, hidden, start, v_local) in [(40, 16, 0, 50), (33, 13, 20, 17), (300, 64, 7, 9)] {
        let mut ids: Vec<i64> = values(n, n as u64, -3.0, 60.0)
            .iter()
            .map(|v| v.floor() as i64)
            .collect();
        ids[0] = ids[n - 1];
        let table = values(v_local * hidden, 41, -1.0, 1.0);
        let dout = values(n * hidden, 42, -1.0, 1.0);
        let mut out = vec![0.0; n * hidden];
        cpu_emb::embedding_forward(&ids, &table, start, v_local, hidden, &mut out).unwrap();
        let mut dtable = values(v_local * hidden, 43, -1.0, 1.0);
        let dtable0 = dtable.clone();
        cpu_emb::embedding_backward(&ids, &dout, start, v_local, hidden, &mut dtable).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for offset in [0, 1] {
            let what =
                format!("{n} tokens × {hidden}, rows {start}.. of {v_local}, offset {offset}");
            let (mut t, mut o) = (padded(&table, offset), vec![f32::NAN; offset + n * hidden]);
            let q = hidden.div_ceil(4);
            let threads = q.next_multiple_of(32).min(256);
            launch_3d(
                "embedding_forward",
                [q.div_ceil(threads), n, 1],
                [threads, 1, 1],
                vec![
                    Arg::Ptr(ids.as_mut_ptr().cast()),
                    ptr(&mut t, offset),
                    ptr(&mut o, offset),
                    Arg::U64(n as u64),
                    Arg::U64(hidden as u64),
                    Arg::U64(start as u64),
                    Arg::U64(v_local as u64),
                ],
            );
            assert_eq!(bits(&o[offset..]), bits(&out), "{what}: forward");
            let (mut d, mut dt) = (padded(&dout, offset), padded(&dtable0, offset));
            let tiles = q.div_ceil(256);
            let parts = 1024usize.div_ceil(tiles).min(v_local).min(n).max(1);
            launch_3d(
                "embedding_backward",
                [tiles, parts, 1],
                [256, 1, 1],
                vec![
                    Arg::Ptr(ids.as_mut_ptr().cast()),
                    ptr(&mut d, offset),
                    ptr(&mut dt, offset),
                    Arg::U64(n as u64),
                    Arg::U64(hidden as u64),
                    Arg::U64(start as u64),
                    Arg::U64(v_local as u64),
                    Arg::U64(parts as u64),
                ],
            );
            assert_eq!(bits(&dt[offset..]), bits(&dtable), "{what}: backward");
        }
    }
}

#[test]
fn cross_entropy_and_its_target_check_are_the_cpus() {
    // (rows, vocab): widths not a multiple of 4, rows of only −∞ (NaN losses, as on the CPU).
    for (rows, vocab) in [(6, 37), (5, 256), (3, 1000)] {
        let n = rows * vocab;
        let mut logits = values(n, 51, -6.0, 6.0);
        logits[vocab..2 * vocab].fill(f32::NEG_INFINITY);
        let mut targets: Vec<i64> = (0..rows).map(|r| ((r * 7919) % vocab) as i64).collect();
        let dloss = values(rows, 52, 0.5, 1.5);
        let (mut losses, mut lse) = (vec![0.0; rows], vec![0.0; rows]);
        cpu_ce::cross_entropy_forward(&logits, &targets, rows, vocab, &mut losses, &mut lse)
            .unwrap();
        let mut dlogits = vec![0.0; n];
        cpu_ce::cross_entropy_backward(&logits, &targets, &lse, &dloss, rows, vocab, &mut dlogits)
            .unwrap();
        let threads = vocab.div_ceil(4).next_multiple_of(32).clamp(32, 512);
        let check = |targets: &mut [i64]| -> u64 {
            let mut bad = u64::MAX;
            launch(
                "cross_entropy_check_targets",
                rows.div_ceil(256),
                256,
                vec![
                    Arg::Ptr(targets.as_mut_ptr().cast()),
                    Arg::U64(rows as u64),
                    Arg::U64(vocab as u64),
                    Arg::Ptr((&mut bad as *mut u64).cast()),
                ],
            );
            bad
        };
        for offset in [0, 1] {
            let what = format!("{rows}×{vocab} offset {offset}");
            let mut bad = check(&mut targets);
            assert_eq!(bad, u64::MAX, "{what}: no bad target");
            let mut l = padded(&logits, offset);
            let (mut lo, mut ls) = (vec![f32::NAN; offset + rows], vec![f32::NAN; offset + rows]);
            launch(
                "cross_entropy_forward",
                rows,
                threads,
                vec![
                    ptr(&mut l, offset),
                    Arg::Ptr(targets.as_mut_ptr().cast()),
                    Arg::Ptr((&mut bad as *mut u64).cast()),
                    Arg::U64(vocab as u64),
                    ptr(&mut lo, offset),
                    ptr(&mut ls, offset),
                ],
            );
            assert_close(&what, &lo[offset..], &losses, 1e-5, 1e-6);
            assert_close(&what, &ls[offset..], &lse, 1e-6, 1e-6);
            let (mut lsd, mut dl) = (padded(&lse, offset), padded(&dloss, offset));
            let mut dx = vec![f32::NAN; offset + n];
            launch(
                "cross_entropy_backward",
                rows,
                threads,
                vec![
                    ptr(&mut l, offset),
                    Arg::Ptr(targets.as_mut_ptr().cast()),
                    ptr(&mut lsd, offset),
                    ptr(&mut dl, offset),
                    Arg::Ptr((&mut bad as *mut u64).cast()),
                    Arg::U64(vocab as u64),
                    ptr(&mut dx, offset),
                ],
            );
            assert_close(&what, &dx[offset..], &dlogits, 1e-5, 1e-6);
        }
        // A target outside the vocabulary: the first bad row is found, and the forward leaves
        // its outputs untouched.
        let mut wrong = targets.clone();
        wrong[rows - 1] = vocab as i64;
        wrong[1] = -1;
        let mut bad = check(&mut wrong);
        assert_eq!(bad, 1);
        let mut l = logits.clone();
        let mut lo = vec![7.0f32; rows];
        let mut ls = vec![7.0f32; rows];
        launch(
            "cross_entropy_forward",
            rows,
            threads,
            vec![
                ptr(&mut l, 0),
                Arg::Ptr(wrong.as_mut_ptr().cast()),
                Arg::Ptr((&mut bad as *mut u64).cast()),
                Arg::U64(vocab as u64),
                ptr(&mut lo, 0),
                ptr(&mut ls, 0),
            ],
        );
        assert_eq!((lo, ls), (vec![7.0; rows], vec![7.0; rows]));
    }
}
