#![cfg(target_os = "linux")]
//! The flash-attention kernels (`src/cuda/cu/flash_attention.cu`) run on the CPU through the
//! CUDA emulation (`tests/emulated`, tensor-core products included), against attention computed
//! the plain way from the same bf16 inputs: scores, the CPU's causal softmax and dropout masks,
//! f64 products. Forward output and log-sum-exp, and the gradients of q, k and v, for every head
//! size the kernels have, partial tiles, tensor-parallel shards of heads, with and without
//! dropout. Every launch also passes the emulation's shared-memory race check (a missing
//! barrier or copy wait fails it; the last test shows the check itself reporting). Needs a
//! C++20 compiler (`c++`, or `$CXX`).

mod emulated;

use half::bf16;
use megatron_core::kernels::dropout::{self as cpu_dropout, LogicalIndex};
use megatron_core::kernels::softmax as cpu_sm;
use megatron_core::rng::DropoutStream;

use emulated::{
    Arg, launch, launch_3d, mask_args, round_keys, tiles_walked, try_launch_3d, values,
};

/// One attention call: batch, sequence, local heads, all heads, the first local head, head size.
#[derive(Debug, Clone, Copy)]
struct Case {
    batch: usize,
    seq: usize,
    heads: usize,
    all_heads: usize,
    first_head: usize,
    d: usize,
}

impl Case {
    const fn new(
        batch: usize,
        seq: usize,
        (heads, all_heads, first_head): (usize, usize, usize),
        d: usize,
    ) -> Case {
        Case {
            batch,
            seq,
            heads,
            all_heads,
            first_head,
            d,
        }
    }

    /// Elements of the fused projection `[s, b, heads, 3, d]`.
    fn qkv_len(&self) -> usize {
        self.seq * self.batch * self.heads * 3 * self.d
    }

    /// Elements of the output `[s, b, heads, d]`.
    fn out_len(&self) -> usize {
        self.seq * self.batch * self.heads * self.d
    }

    /// Offset of element `e` of part `part` (0 q, 1 k, 2 v) of head `h`, batch entry `b`,
    /// position `i` in the fused projection.
    fn qkv_at(&self, i: usize, b: usize, h: usize, part: usize, e: usize) -> usize {
        (((i * self.batch + b) * self.heads + h) * 3 + part) * self.d + e
    }

    fn out_at(&self, i: usize, b: usize, h: usize, e: usize) -> usize {
        ((i * self.batch + b) * self.heads + h) * self.d + e
    }

    /// The element strides (seq, batch, head) of the fused projection and of the output.
    fn strides(&self) -> ([i64; 3], [i64; 3]) {
        let (b, h, d) = (self.batch as i64, self.heads as i64, self.d as i64);
        ([b * h * 3 * d, h * 3 * d, 3 * d], [b * h * d, h * d, d])
    }

    /// Where this rank's `[b, heads, s, s]` attention weights sit among all heads'.
    fn index(&self) -> LogicalIndex {
        LogicalIndex::heads(
            self.batch,
            self.seq * self.seq,
            self.heads,
            self.all_heads,
            self.first_head,
        )
    }

    fn scale(&self) -> f32 {
        1.0 / (self.d as f32).sqrt()
    }

    /// The kernels' grid: (row tiles of 64, heads, batch).
    fn grid(&self) -> [usize; 3] {
        [self.seq.div_ceil(64), self.heads, self.batch]
    }
}

/// Two query tiles (the second partial) over a tensor-parallel shard of heads; odd lengths; one
/// case per head size the kernels have; one sequence of three key tiles, so that the forward
/// streams a tile into a stage it has used before.
const CASES: [Case; 4] = [
    Case::new(2, 80, (2, 4, 2), 64),
    Case::new(1, 37, (1, 1, 0), 96),
    Case::new(1, 70, (1, 3, 1), 128),
    Case::new(1, 150, (2, 2, 0), 32),
];

/// `|got − want| ≤ tol·(|want| + max |want|)`: products of bf16 operands against f64 ones.
fn assert_near(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let top = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (w.abs() + top),
            "{what}[{i}]: {g}, want {w} (largest {top})"
        );
    }
}

/// Attention computed the plain way from the (bf16) fused projection, per (batch entry, head)
/// `[s, s]` blocks of a `[b, heads, s, s]` buffer, as the CPU's attention op lays them out.
struct Reference {
    case: Case,
    qkv: Vec<f32>,
    probs: Vec<f32>,
    dropped: Vec<f32>,
    dropout: Option<(f32, DropoutStream)>,
    /// Per batch entry and position, the first key it sees (its document's first position).
    first: Vec<usize>,
}

impl Reference {
    /// Attention of `qkv`; with `documents` (per batch entry and position, its document's
    /// first position and the position after its last) each query sees its own document only.
    fn new(
        case: Case,
        qkv: &[bf16],
        dropout: Option<(f32, DropoutStream)>,
        documents: &[(usize, usize)],
    ) -> Reference {
        let qkv: Vec<f32> = qkv.iter().map(|x| x.to_f32()).collect();
        let (s, bh) = (case.seq, case.batch * case.heads);
        let first: Vec<usize> = match documents.is_empty() {
            true => vec![0; case.batch * s],
            false => documents.iter().map(|d| d.0).collect(),
        };
        let mut scores = vec![0.0f32; bh * s * s];
        for b in 0..case.batch {
            for h in 0..case.heads {
                for i in 0..s {
                    for j in 0..s {
                        scores[((b * case.heads + h) * s + i) * s + j] = match j < first[b * s + i]
                        {
                            true => f32::NEG_INFINITY,
                            false => Self::dot(&case, &qkv, (i, 0), (j, 1), b, h) as f32,
                        };
                    }
                }
            }
        }
        let mut probs = vec![0.0; scores.len()];
        cpu_sm::softmax_forward(&scores, bh, s, s, case.scale(), true, &mut probs).unwrap();
        let dropped = Self::mask(&case, &dropout, &probs);
        Reference {
            case,
            qkv,
            probs,
            dropped,
            dropout,
            first,
        }
    }

    /// Σ_e part_a(i)[e] · part_b(j)[e] of head h, batch entry b.
    fn dot(
        case: &Case,
        qkv: &[f32],
        (i, pa): (usize, usize),
        (j, pb): (usize, usize),
        b: usize,
        h: usize,
    ) -> f64 {
        (0..case.d)
            .map(|e| {
                qkv[case.qkv_at(i, b, h, pa, e)] as f64 * qkv[case.qkv_at(j, b, h, pb, e)] as f64
            })
            .sum()
    }

    /// The attention dropout of a `[b, heads, s, s]` buffer (unchanged without one).
    fn mask(case: &Case, dropout: &Option<(f32, DropoutStream)>, x: &[f32]) -> Vec<f32> {
        let Some((p, stream)) = dropout else {
            return x.to_vec();
        };
        let mut y = vec![0.0; x.len()];
        cpu_dropout::dropout_forward(x, &mut y, *p, stream, case.index()).unwrap();
        y
    }

    fn weight(&self, w: &[f32], b: usize, h: usize, i: usize, j: usize) -> f64 {
        let s = self.case.seq;
        w[((b * self.case.heads + h) * s + i) * s + j] as f64
    }

    /// The output `[s, b, heads·d]` and the log-sum-exp `[b, heads, s]` of the scaled scores.
    fn forward(&self) -> (Vec<f32>, Vec<f32>) {
        let c = self.case;
        let mut out = vec![0.0; c.out_len()];
        let mut lse = vec![0.0; c.batch * c.heads * c.seq];
        for b in 0..c.batch {
            for h in 0..c.heads {
                for i in 0..c.seq {
                    for e in 0..c.d {
                        out[c.out_at(i, b, h, e)] = (0..=i)
                            .map(|j| {
                                self.weight(&self.dropped, b, h, i, j)
                                    * self.qkv[c.qkv_at(j, b, h, 2, e)] as f64
                            })
                            .sum::<f64>()
                            as f32;
                    }
                    let scaled: Vec<f64> = (self.first[b * c.seq + i]..=i)
                        .map(|j| Self::dot(&c, &self.qkv, (i, 0), (j, 1), b, h) * c.scale() as f64)
                        .collect();
                    let m = scaled.iter().fold(f64::NEG_INFINITY, |a, &v| a.max(v));
                    let sum: f64 = scaled.iter().map(|v| (v - m).exp()).sum();
                    lse[(b * c.heads + h) * c.seq + i] = (m + sum.ln()) as f32;
                }
            }
        }
        (out, lse)
    }

    /// The gradient of the fused projection `[s, b, heads·3·d]` from the output's.
    fn backward(&self, d_out: &[f32]) -> Vec<f32> {
        let c = self.case;
        let s = c.seq;
        // d(dropped) = d_out · vᵀ, through the dropout, then through the softmax.
        let mut d_dropped = vec![0.0f32; self.probs.len()];
        for b in 0..c.batch {
            for h in 0..c.heads {
                for i in 0..s {
                    for j in 0..s {
                        d_dropped[((b * c.heads + h) * s + i) * s + j] = (0..c.d)
                            .map(|e| {
                                d_out[c.out_at(i, b, h, e)] as f64
                                    * self.qkv[c.qkv_at(j, b, h, 2, e)] as f64
                            })
                            .sum::<f64>()
                            as f32;
                    }
                }
            }
        }
        let d_probs = Self::mask(&c, &self.dropout, &d_dropped);
        let mut d_scores = vec![0.0; d_probs.len()];
        cpu_sm::softmax_backward(
            &self.probs,
            &d_probs,
            c.batch * c.heads,
            s,
            s,
            c.scale(),
            &mut d_scores,
        )
        .unwrap();
        let mut dqkv = vec![0.0; c.qkv_len()];
        for b in 0..c.batch {
            for h in 0..c.heads {
                for i in 0..s {
                    for e in 0..c.d {
                        // dq = d_scores · k, dk = d_scoresᵀ · q, dv = droppedᵀ · d_out.
                        let dq: f64 = (0..s)
                            .map(|j| {
                                self.weight(&d_scores, b, h, i, j)
                                    * self.qkv[c.qkv_at(j, b, h, 1, e)] as f64
                            })
                            .sum();
                        let dk: f64 = (0..s)
                            .map(|j| {
                                self.weight(&d_scores, b, h, j, i)
                                    * self.qkv[c.qkv_at(j, b, h, 0, e)] as f64
                            })
                            .sum();
                        let dv: f64 = (0..s)
                            .map(|j| {
                                self.weight(&self.dropped, b, h, j, i)
                                    * d_out[c.out_at(j, b, h, e)] as f64
                            })
                            .sum();
                        dqkv[c.qkv_at(i, b, h, 0, e)] = dq as f32;
                        dqkv[c.qkv_at(i, b, h, 1, e)] = dk as f32;
                        dqkv[c.qkv_at(i, b, h, 2, e)] = dv as f32;
                    }
                }
            }
        }
        dqkv
    }
}

/// The arguments every flash kernel starts with: the fused projection and its strides.
fn qkv_args(case: &Case, qkv: &mut [bf16]) -> Vec<Arg> {
    let ([ss, bs, hs], _) = case.strides();
    vec![
        Arg::Ptr(qkv.as_mut_ptr().cast()),
        Arg::I64(ss),
        Arg::I64(bs),
        Arg::I64(hs),
    ]
}

/// The output strides.
fn out_strides(case: &Case) -> [Arg; 3] {
    let (_, [ss, bs, hs]) = case.strides();
    [Arg::I64(ss), Arg::I64(bs), Arg::I64(hs)]
}

/// The sizes, scale and mask every flash kernel ends with.
fn tail_args(case: &Case, dropout: &Option<(f32, DropoutStream)>) -> Vec<Arg> {
    let mut args = vec![
        Arg::U64(case.seq as u64),
        Arg::U64(case.heads as u64),
        Arg::I32(case.d as i32),
        Arg::F32(case.scale()),
        // The window: the whole sequence (none).
        Arg::U32(case.seq as u32),
    ];
    args.extend(mask_args(
        dropout.as_ref().map(|(p, s)| (*p, s, case.index())),
    ));
    args
}

/// Elements before an output buffer's start: 1 where `qkv` is off 4-byte alignment, so that
/// the outputs are too (the kernels' one-element stores) when the inputs are.
fn shift(qkv: &[bf16]) -> usize {
    (qkv.as_ptr() as usize / 2) % 2
}

/// What the flash forward gives: the output, the log-sum-exp, and with dropout the kept
/// elements as bits (64-bit words per head, block of 64 keys and query; rows up to the sequence
/// rounded up to 64).
struct Forward {
    out: Vec<bf16>,
    lse: Vec<f32>,
    keep: Vec<u64>,
}

impl Forward {
    /// Word `keep` of query i, key block kb of head bh: the kernels' keep_word_at.
    fn keep_word(case: &Case, bh: usize, kb: usize, i: usize) -> usize {
        let blocks = case.seq.div_ceil(64);
        (bh * blocks + kb) * blocks * 64 + i
    }

    /// Where the kernels take the words: null without dropout.
    fn keep_arg(&mut self) -> Arg {
        Arg::Ptr(if self.keep.is_empty() {
            std::ptr::null_mut()
        } else {
            self.keep.as_mut_ptr().cast()
        })
    }
}

/// The flash forward on the CPU-built kernel.
/// The documents' table as the kernels read it (`first | end << 32` per batch entry and
/// position), or a null pointer for none.
fn documents_arg(documents: &mut [u64]) -> Arg {
    match documents.is_empty() {
        true => Arg::Ptr(std::ptr::null_mut()),
        false => Arg::Ptr(documents.as_mut_ptr().cast()),
    }
}

fn flash_forward(
    case: &Case,
    qkv: &mut [bf16],
    dropout: &Option<(f32, DropoutStream)>,
    documents: &mut [u64],
) -> Forward {
    let shift = shift(qkv);
    let words = Forward::keep_word(case, case.batch * case.heads, 0, 0);
    let mut got = Forward {
        out: vec![bf16::NAN; shift + case.out_len()],
        lse: vec![f32::NAN; case.batch * case.heads * case.seq],
        keep: vec![u64::MAX; if dropout.is_some() { words } else { 0 }],
    };
    let mut args = qkv_args(case, qkv);
    args.push(Arg::Ptr(got.out[shift..].as_mut_ptr().cast()));
    args.extend(out_strides(case));
    args.push(Arg::Ptr(got.lse.as_mut_ptr().cast()));
    args.push(got.keep_arg());
    args.extend(tail_args(case, dropout));
    let mut keys = round_keys(dropout.as_ref().map(|(_, s)| s));
    args.push(Arg::ByValue(keys.as_mut_ptr().cast()));
    args.push(documents_arg(documents));
    launch_3d("flash_forward", case.grid(), [128, 1, 1], args);
    got.out.drain(..shift);
    got
}

/// Checks the forward's kept-element bits against the CPU's dropout mask: every word a query
/// has for the key blocks it sees, bit for bit over the keys of the sequence.
fn assert_keep_bits(
    what: &str,
    case: &Case,
    dropout: &Option<(f32, DropoutStream)>,
    got: &Forward,
) {
    if dropout.is_none() {
        return;
    }
    let (s, bh) = (case.seq, case.batch * case.heads);
    let kept = Reference::mask(case, dropout, &vec![1.0; bh * s * s]);
    for h in 0..bh {
        for i in 0..s {
            for kb in 0..=i / 64 {
                let word = got.keep[Forward::keep_word(case, h, kb, i)];
                for j in 64 * kb..(64 * kb + 64).min(s) {
                    let want = kept[(h * s + i) * s + j] != 0.0;
                    assert_eq!(
                        (word >> (j - 64 * kb)) & 1 == 1,
                        want,
                        "{what}: kept bit of head {h}, query {i}, key {j}"
                    );
                }
            }
        }
    }
}

/// The flash backward on the CPU-built kernels: the fused projection's gradient, from `d_out`
/// handed over in f32 or (with `d_out_bf16`) rounded to bf16, over chunks of `chunk` queries
/// (a multiple of 64).
#[allow(clippy::too_many_arguments)]
fn flash_backward(
    case: &Case,
    qkv: &mut [bf16],
    forward: &mut Forward,
    d_out: &mut [f32],
    d_out_bf16: bool,
    dropout: &Option<(f32, DropoutStream)>,
    chunk: usize,
    documents: &mut [u64],
) -> Vec<f32> {
    let rows = case.batch * case.heads * case.seq;
    let mut d_out16 = vec![bf16::NAN; case.out_len()];
    let mut delta = vec![f32::NAN; rows];
    let mut d_out_in: Vec<bf16> = d_out.iter().map(|&x| bf16::from_f32(x)).collect();
    let d_out_ptr = if d_out_bf16 {
        d_out_in.as_mut_ptr().cast()
    } else {
        d_out.as_mut_ptr().cast()
    };
    let mut args = vec![
        Arg::Ptr(forward.out.as_mut_ptr().cast()),
        Arg::Ptr(d_out_ptr),
        Arg::I32(i32::from(d_out_bf16)),
        Arg::Ptr(d_out16.as_mut_ptr().cast()),
    ];
    args.extend(out_strides(case));
    args.extend([
        Arg::Ptr(delta.as_mut_ptr().cast()),
        Arg::U64(case.seq as u64),
        Arg::U64(case.heads as u64),
        Arg::U64(case.batch as u64),
        Arg::U64(case.d as u64),
    ]);
    launch("flash_backward_prepare", 3, 256, args);

    // The score gradients pass through a buffer of `chunk` query columns per key row (rows
    // up to the sequence rounded up to 64), both kernels running once per chunk of queries.
    let rows = case.seq.div_ceil(64) * 64;
    let chunk = chunk.min(rows);
    let mut ds = vec![bf16::NAN; case.batch * case.heads * rows * chunk];
    let shift = shift(qkv);
    let mut dqkv = vec![bf16::NAN; shift + case.qkv_len()];
    let keep_scale = dropout
        .as_ref()
        .map_or(1.0, |(p, _)| cpu_dropout::keep_scale(*p));
    for c_begin in (0..rows).step_by(chunk) {
        let c_end = (c_begin + chunk).min(rows);
        let mut args = qkv_args(case, qkv);
        args.push(Arg::Ptr(d_out16.as_mut_ptr().cast()));
        args.extend(out_strides(case));
        args.extend([
            Arg::Ptr(forward.lse.as_mut_ptr().cast()),
            Arg::Ptr(delta.as_mut_ptr().cast()),
            Arg::Ptr(dqkv[shift..].as_mut_ptr().cast()),
            Arg::Ptr(ds.as_mut_ptr().cast()),
            Arg::U32(chunk as u32),
            Arg::U32(c_begin as u32),
            Arg::U32(c_end as u32),
            Arg::U64(case.seq as u64),
            Arg::U64(case.heads as u64),
            Arg::I32(case.d as i32),
            Arg::F32(case.scale()),
            Arg::U32(case.seq as u32),
            forward.keep_arg(),
            Arg::F32(keep_scale),
            documents_arg(documents),
        ]);
        let [_, heads, batch] = case.grid();
        launch_3d(
            "flash_backward_kv",
            [c_end / 64, heads, batch],
            [128, 1, 1],
            args,
        );

        let mut args = qkv_args(case, qkv);
        args.extend([
            Arg::Ptr(ds.as_mut_ptr().cast()),
            Arg::U32(chunk as u32),
            Arg::U32(c_begin as u32),
            Arg::Ptr(dqkv[shift..].as_mut_ptr().cast()),
            Arg::U64(case.seq as u64),
            Arg::U64(case.heads as u64),
            Arg::I32(case.d as i32),
            // The window: none.
            Arg::U32(case.seq as u32),
            documents_arg(documents),
        ]);
        let blocks = (c_end.min(case.seq) - c_begin).div_ceil(64);
        launch_3d(
            "flash_backward_q",
            [blocks, heads, batch],
            [128, 1, 1],
            args,
        );
    }
    widen(&dqkv[shift..])
}

fn widen(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

#[test]
fn flash_attention_is_plain_attention_forward_and_backward() {
    for (n, case) in CASES.into_iter().enumerate() {
        let seed = 10 * n as u64;
        let qkv: Vec<bf16> = values(case.qkv_len(), seed, -2.0, 2.0)
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        // bf16 values, so that handing them over in f32 or in bf16 must give the same bits.
        let mut d_out: Vec<f32> = values(case.out_len(), seed + 1, -1.0, 1.0)
            .into_iter()
            .map(|x| bf16::from_f32(x).to_f32())
            .collect();
        // Offset 1 puts the rows off 16-byte alignment: the kernels' 2-byte load path.
        for offset in [0, 1] {
            let mut buf = vec![bf16::NAN; offset];
            buf.extend_from_slice(&qkv);
            let qkv_at = &mut buf[offset..];
            for dropout in [None, Some((0.3, DropoutStream::new(77 + seed, &[4, 1])))] {
                let what = format!("{case:?} offset {offset} dropout {}", dropout.is_some());
                let reference = Reference::new(case, &qkv, dropout, &[]);
                let (out, lse) = reference.forward();
                let mut got = flash_forward(&case, qkv_at, &dropout, &mut []);
                assert_near(&format!("{what}: output"), &widen(&got.out), &out, 1e-2);
                assert_near(&format!("{what}: log-sum-exp"), &got.lse, &lse, 1e-5);
                assert_keep_bits(&what, &case, &dropout, &got);
                // The gradients of bf16 products: the reference's d_out as the kernels round it.
                let d_out16: Vec<f32> = d_out.iter().map(|&x| bf16::from_f32(x).to_f32()).collect();
                let want = reference.backward(&d_out16);
                let whole = usize::MAX;
                let dqkv = flash_backward(
                    &case,
                    qkv_at,
                    &mut got,
                    &mut d_out,
                    false,
                    &dropout,
                    whole,
                    &mut [],
                );
                assert_near(&format!("{what}: gradient"), &dqkv, &want, 2e-2);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                let from16 = flash_backward(
                    &case,
                    qkv_at,
                    &mut got,
                    &mut d_out,
                    true,
                    &dropout,
                    whole,
                    &mut [],
                );
                assert!(bits(&from16) == bits(&dqkv), "{what}: bf16 d_out");
                // Queries in chunks of 64: the key and value gradients summed over chunks, the
                // query gradients as before (each query's row of scores is in one chunk).
                if case.seq > 64 {
                    let chunked = flash_backward(
                        &case,
                        qkv_at,
                        &mut got,
                        &mut d_out,
                        false,
                        &dropout,
                        64,
                        &mut [],
                    );
                    assert_near(
                        &format!("{what}: gradient in chunks"),
                        &chunked,
                        &want,
                        2e-2,
                    );
                    // Key and value gradients rounded to bf16 once per chunk.
                    assert_near(
                        &format!("{what}: chunks against one"),
                        &chunked,
                        &dqkv,
                        1e-2,
                    );
                    let dq = |v: &[f32]| {
                        (0..case.qkv_len())
                            .filter(|e| (e / case.d) % 3 == 0)
                            .map(|e| v[e].to_bits())
                            .collect::<Vec<_>>()
                    };
                    assert!(dq(&chunked) == dq(&dqkv), "{what}: chunked dq");
                }
            }
        }
    }
}

/// Per batch entry and position, its document's first position and the position after its
/// last, for documents starting at `starts` (each sample's first start 0).
fn spans_of(seq: usize, starts: &[&[usize]]) -> Vec<(usize, usize)> {
    starts
        .iter()
        .flat_map(|st| {
            let ends = st[1..].iter().copied().chain([seq]);
            st.iter()
                .zip(ends)
                .flat_map(|(&a, b)| std::iter::repeat_n((a, b), b - a))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The kernels' table of `spans` (`first | end << 32`).
fn table(spans: &[(usize, usize)]) -> Vec<u64> {
    spans
        .iter()
        .map(|&(a, b)| a as u64 | (b as u64) << 32)
        .collect()
}

/// The forward's tiles of 64 keys a block of 64 queries walks: from the one holding its first
/// query's first key to the one holding its last query (one head, one batch entry).
fn forward_tiles(seq: usize, spans: &[(usize, usize)]) -> u64 {
    (0..seq)
        .step_by(64)
        .map(|q0| ((q0 + 63).min(seq - 1) / 64 - spans[q0].0 / 64 + 1) as u64)
        .sum()
}

/// Packed documents in one launch each way (the kernels' document table): each query sees only
/// its own document's keys, as the reference with the other pairs masked, whole or in chunks of
/// queries; the forward walks only the key tiles some query of a block sees (from its first
/// query's document on), and the backward fewer tiles than one document of the whole length.
#[test]
fn packed_documents_attend_apart_in_one_launch_and_skip_the_tiles_outside() {
    let case = Case::new(2, 200, (2, 2, 0), 64);
    let spans = spans_of(case.seq, &[&[0, 5, 70, 71, 150], &[0, 130]]);
    let mut docs = table(&spans);
    let qkv: Vec<bf16> = values(case.qkv_len(), 91, -2.0, 2.0)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    let mut d_out: Vec<f32> = values(case.out_len(), 92, -1.0, 1.0)
        .into_iter()
        .map(|x| bf16::from_f32(x).to_f32())
        .collect();
    let reference = Reference::new(case, &qkv, None, &spans);
    let (out, lse) = reference.forward();
    let want = reference.backward(&d_out);
    let mut qkv_at = qkv.clone();
    let walked = |f: &mut dyn FnMut()| {
        let before = tiles_walked();
        f();
        tiles_walked() - before
    };
    let mut got = None;
    let packed_forward =
        walked(&mut || got = Some(flash_forward(&case, &mut qkv_at, &None, &mut docs)));
    let mut got = got.expect("ran");
    assert_near("packed: output", &widen(&got.out), &out, 1e-2);
    assert_near("packed: log-sum-exp", &got.lse, &lse, 1e-5);
    let heads = (case.batch * case.heads) as u64 / 2;
    let expected = heads
        * (forward_tiles(case.seq, &spans[..case.seq])
            + forward_tiles(case.seq, &spans[case.seq..]));
    assert_eq!(packed_forward, expected, "forward tiles");
    let mut packed_backward = 0;
    for chunk in [usize::MAX, 64] {
        let mut dqkv = Vec::new();
        packed_backward = walked(&mut || {
            dqkv = flash_backward(
                &case,
                &mut qkv_at,
                &mut got,
                &mut d_out,
                false,
                &None,
                chunk,
                &mut docs,
            )
        });
        assert_near(
            &format!("packed: gradient, chunks of {chunk}"),
            &dqkv,
            &want,
            2e-2,
        );
    }
    // One document a sequence: every tile up to the diagonal.
    let mut whole = None;
    let whole_forward =
        walked(&mut || whole = Some(flash_forward(&case, &mut qkv_at, &None, &mut [])));
    let mut whole = whole.expect("ran");
    let whole_backward = walked(&mut || {
        flash_backward(
            &case,
            &mut qkv_at,
            &mut whole,
            &mut d_out,
            false,
            &None,
            64,
            &mut [],
        );
    });
    let one = spans_of(case.seq, &[&[0]]);
    assert_eq!(whole_forward, 2 * heads * forward_tiles(case.seq, &one));
    assert!(packed_forward < whole_forward && packed_backward < whole_backward);

    // Many short documents against one long one, at a length where it counts: 1024 positions
    // as 16 documents of 64, or as one.
    let long = Case::new(1, 1024, (1, 1, 0), 32);
    let mut qkv: Vec<bf16> = values(long.qkv_len(), 93, -2.0, 2.0)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    let short: Vec<usize> = (0..long.seq).step_by(64).collect();
    let mut counts = Vec::new();
    for starts in [&short[..], &[0]] {
        let spans = spans_of(long.seq, &[starts]);
        let mut docs = table(&spans);
        let tiles = walked(&mut || {
            flash_forward(&long, &mut qkv, &None, &mut docs);
        });
        assert_eq!(tiles, forward_tiles(long.seq, &spans));
        counts.push(tiles);
    }
    eprintln!(
        "forward tiles of 64 × 64 at 1024 positions: 16 documents of 64 walk {}, one of 1024 \
         walks {}",
        counts[0], counts[1]
    );
    assert_eq!(counts, [16, 136]);
}

/// The race check behind every emulated launch (`tests/emulated/shim.h`) reports shared memory
/// that two threads touch between the same two barriers, one of them writing, and an
/// asynchronous copy read by another thread before its own thread waited for it; the same
/// exchanges with the barrier and the wait pass and give the neighbours' values.
#[test]
fn the_race_check_reports_what_a_missing_barrier_or_copy_wait_leaves_unordered() {
    const THREADS: usize = 64;
    let run = |async_copy: bool, wait: bool, sync: bool| {
        let mut input: Vec<u32> = (0..THREADS as u32).map(|t| 1000 + t).collect();
        let mut out = vec![0u32; THREADS];
        let flag = |b: bool| Arg::I32(b.into());
        let args = vec![
            Arg::Ptr(input.as_mut_ptr().cast()),
            Arg::Ptr(out.as_mut_ptr().cast()),
            flag(async_copy),
            flag(wait),
            flag(sync),
        ];
        try_launch_3d(
            "emu_race_check_neighbours",
            [1, 1, 1],
            [THREADS, 1, 1],
            args,
        )
        .map(|()| out)
    };
    let neighbours: Vec<u32> = (0..THREADS as u32)
        .map(|t| 1000 + (t + 1) % THREADS as u32)
        .collect();
    for async_copy in [false, true] {
        assert_eq!(run(async_copy, true, true).as_ref(), Ok(&neighbours));
    }
    let races = [
        ("a store, no barrier", run(false, true, false)),
        ("a copy, no barrier", run(true, true, false)),
        ("a copy not waited for", run(true, false, true)),
    ];
    for (what, result) in races {
        let report = result.expect_err(what);
        assert!(
            report.contains("with no barrier between") && report.contains("written by thread"),
            "{what}: {report}"
        );
    }
}

#[test]
fn a_barrier_some_threads_never_reach_is_reported_as_a_deadlock() {
    let run = |early: bool| {
        try_launch_3d(
            "emu_deadlock_check",
            [2, 1, 1],
            [64, 1, 1],
            vec![Arg::I32(early.into())],
        )
    };
    assert_eq!(run(false), Ok(()));
    let report = run(true).expect_err("thread 0 returns before the barrier");
    assert!(
        report.starts_with("deadlock: block (0, 0, 0): 63 of 64 threads wait at a barrier"),
        "{report}"
    );
}
