//! What this machine can do at best: FMA throughput and memory bandwidth, measured in the same
//! run as a benchmark so the benchmark's figures can be read as fractions of them.

use std::time::{Duration, Instant};

/// Peak f32 FMA throughput of one instruction set (or of its bf16 dot products).
#[derive(Debug, Clone, serde::Serialize)]
pub struct FmaPeak {
    /// Instruction set, e.g. `avx512f`, `avx2+fma` or `avx512bf16` (bf16 pairs).
    pub isa: &'static str,
    /// Vector width in f32 lanes (for AMX, the f32 elements of the four accumulator tiles).
    pub lanes: usize,
    /// Whether the instruction multiplies bf16 pairs into f32 (`vdpbf16ps`: two multiply-adds
    /// a lane) rather than f32.
    pub bf16: bool,
    /// Measured GFLOP/s (a multiply-add counts as 2 flops) over all threads.
    pub gflops: f64,
}

/// Independent FMA chains per thread: enough to hide the FMA latency on both ports.
#[cfg(target_arch = "x86_64")]
const CHAINS: usize = 12;

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_loop_avx2(iters: usize) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_set1_ps(0.0); CHAINS];
    let a = _mm256_set1_ps(0.999_999);
    let b = _mm256_set1_ps(1e-7);
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm256_fmadd_ps(*x, a, b);
        }
    }
    let mut sum = _mm256_setzero_ps();
    for x in acc {
        sum = _mm256_add_ps(sum, x);
    }
    let mut out = [0f32; 8];
    // SAFETY: `out` holds 8 floats.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), sum) };
    out.iter().sum()
}

/// The sum of every lane of the 512-bit chains (what keeps a peak loop from being optimised
/// away).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn sum_chains_512(acc: [std::arch::x86_64::__m512; CHAINS]) -> f32 {
    use std::arch::x86_64::*;
    let mut sum = _mm512_setzero_ps();
    for x in acc {
        sum = _mm512_add_ps(sum, x);
    }
    _mm512_reduce_add_ps(sum)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_loop_avx512(iters: usize) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_set1_ps(0.0); CHAINS];
    let a = _mm512_set1_ps(0.999_999);
    let b = _mm512_set1_ps(1e-7);
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm512_fmadd_ps(*x, a, b);
        }
    }
    sum_chains_512(acc)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn dot_loop_avx512bf16(iters: usize) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_set1_ps(0.0); CHAINS];
    // Pairs of bf16 (1/256, 1/512): sums that stay far from overflow.
    let a = _mm512_castsi512_ps(_mm512_set1_epi32(0x3b80_3b00));
    // SAFETY: the casts reinterpret 512 bits.
    let (a, b) = unsafe {
        (
            std::mem::transmute::<__m512, __m512bh>(a),
            std::mem::transmute::<__m512, __m512bh>(a),
        )
    };
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm512_dpbf16_ps(*x, a, b);
        }
    }
    sum_chains_512(acc)
}

/// AMX's peak: four `tdpbf16ps` a step into four 16 × 16 accumulator tiles, each 16 × 16 × 32
/// multiply-adds, the sources left zero (the configuration the bf16 tile of `megatron-core`
/// uses, 16 rows of 64 bytes in every tile).
///
/// # Safety
/// The CPU runs AMX-BF16 and the process holds the tiles' permission
/// ([`megatron_core::kernels::isa::Isa::amx`] of the detected set, in silicon).
#[cfg(target_arch = "x86_64")]
unsafe fn dot_loop_amx(iters: usize) -> f32 {
    use std::arch::asm;
    #[repr(C, align(64))]
    struct Config([u8; 64]);
    let mut config = Config([0; 64]);
    config.0[0] = 1;
    for t in 0..8 {
        config.0[16 + 2 * t] = 64;
        config.0[48 + t] = 16;
    }
    let mut out = [0u8; 1024];
    // SAFETY: the caller's contract; the one store writes 16 rows of 64 bytes, 64 bytes apart,
    // inside `out`. The statements are not `pure`: the loop runs as written.
    unsafe {
        asm!("ldtilecfg [{0}]", in(reg) config.0.as_ptr(), options(nostack, readonly));
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "tilezero tmm4",
            "tilezero tmm5",
            "tilezero tmm6",
            "tilezero tmm7",
            options(nostack, nomem)
        );
        for _ in 0..iters {
            asm!(
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                options(nostack, nomem)
            );
        }
        asm!("tilestored [{0} + {1}*1], tmm0", in(reg) out.as_mut_ptr(), in(reg) 64usize, options(nostack));
        asm!("tilerelease", options(nostack, nomem));
    }
    f32::from_le_bytes([out[0], out[1], out[2], out[3]])
}

/// The widest f32 peak and the widest bf16 peak of `peaks` (the f32 one where the CPU has no bf16
/// instructions): what a product's rate is a share of.
pub fn widest_peaks(peaks: &[FmaPeak]) -> (f64, f64) {
    let widest = |bf16: bool| {
        peaks
            .iter()
            .filter(|p| p.bf16 == bf16)
            .map(|p| p.gflops)
            .fold(f64::NAN, f64::max)
    };
    match (widest(false), widest(true)) {
        (f32_peak, bf16_peak) if bf16_peak.is_nan() => (f32_peak, f32_peak),
        both => both,
    }
}

/// Measures the FMA peak of every vector instruction set this CPU has, with `threads` threads
/// each running one loop; best of `repeats` runs of about `duration` each.
pub fn fma_peaks(threads: usize, duration: Duration, repeats: usize) -> Vec<FmaPeak> {
    #[cfg(target_arch = "x86_64")]
    {
        type Loop = unsafe fn(usize) -> f32;
        // Each: the name, lanes, bf16 or not, flops a step of the loop on one thread, the loop.
        let mut isas: Vec<(&'static str, usize, bool, usize, Loop)> = Vec::new();
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            isas.push(("avx2+fma", 8, false, CHAINS * 8 * 2, fma_loop_avx2));
        }
        if is_x86_feature_detected!("avx512f") {
            isas.push(("avx512f", 16, false, CHAINS * 16 * 2, fma_loop_avx512));
        }
        if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16") {
            isas.push(("avx512bf16", 16, true, CHAINS * 16 * 4, dot_loop_avx512bf16));
        }
        // Not on the emulator (`MEGATRON_EMULATE_AMX`), which would take hours.
        if megatron_core::kernels::isa::Isa::detected().amx()
            && megatron_core::kernels::isa::amx_in_hardware()
        {
            isas.push(("amx-bf16", 4 * 256, true, 4 * 256 * 32 * 2, dot_loop_amx));
        }
        isas.into_iter()
            .map(|(isa, lanes, bf16, flops, f)| {
                // SAFETY: the instruction set was detected above.
                let run = |iters: usize| run_threads(threads, || unsafe { f(iters) });
                let flops_per_iter = (flops * threads) as f64;
                let calibrate = 100_000;
                let probe = run(calibrate).as_secs_f64().max(1e-6);
                let iters = ((duration.as_secs_f64() / probe) * calibrate as f64).max(1.0) as usize;
                let best = (0..repeats.max(1))
                    .map(|_| run(iters))
                    .min()
                    .unwrap_or(Duration::MAX);
                FmaPeak {
                    isa,
                    lanes,
                    bf16,
                    gflops: flops_per_iter * iters as f64 / best.as_secs_f64() / 1e9,
                }
            })
            .collect()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (threads, duration, repeats);
        Vec::new()
    }
}

/// Wall time of running `f` once on each of `threads` threads at the same time.
fn run_threads(threads: usize, f: impl Fn() -> f32 + Sync) -> Duration {
    let start = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| std::hint::black_box(f()));
        }
    });
    start.elapsed()
}

/// Cuts every buffer into `workers` consecutive shares and gives worker w the w-th share of each,
/// as the in-process collectives divide their work.
pub fn shares(buffers: &mut [Vec<f32>], workers: usize) -> Vec<Vec<&mut [f32]>> {
    let workers = workers.max(1);
    let mut shares: Vec<Vec<&mut [f32]>> = (0..workers).map(|_| Vec::new()).collect();
    for buffer in buffers.iter_mut() {
        let len = buffer.len();
        let mut rest: &mut [f32] = buffer;
        for (w, share) in shares.iter_mut().enumerate() {
            let take = len * (w + 1) / workers - len * w / workers;
            let (head, tail) = rest.split_at_mut(take);
            share.push(head);
            rest = tail;
        }
    }
    shares
}

/// Reads and writes every element of one worker's share once (`x = a·x + b`): the memory traffic
/// an ideal in-place all-reduce needs, with no arithmetic to speak of.
pub fn read_write_pass(share: &mut [&mut [f32]]) {
    for part in share.iter_mut() {
        part.iter_mut().for_each(|x| *x = *x * 0.999_999 + 1e-7);
    }
}

/// Bytes of the buffer a read-bandwidth pass streams: 256 MiB, eight times a large last-level
/// cache, so that the pass reads memory rather than cache.
const READ_PASS_BYTES: usize = 256 << 20;

/// The memory's read bandwidth in GB/s on `threads` threads: each sums its share of a 256 MiB
/// buffer (STREAM's read side, as a decoding step reads its weights), the median of `repeats`
/// passes after one warm-up.
pub fn read_bandwidth(threads: usize, repeats: usize) -> f64 {
    let threads = threads.max(1);
    let buffer = vec![1.0f32; READ_PASS_BYTES / 4];
    let share = buffer.len().div_ceil(threads);
    let pass = || {
        let start = Instant::now();
        std::thread::scope(|s| {
            for part in buffer.chunks(share) {
                s.spawn(move || std::hint::black_box(sum_lanes(part)));
            }
        });
        start.elapsed().as_secs_f64()
    };
    pass();
    let mut times: Vec<f64> = (0..repeats.max(1)).map(|_| pass()).collect();
    times.sort_by(f64::total_cmp);
    READ_PASS_BYTES as f64 / times[times.len() / 2] / 1e9
}

/// The sum of `xs` in 32 independent lanes: adds enough in flight that memory, not their
/// latency, bounds the pass.
fn sum_lanes(xs: &[f32]) -> f32 {
    let mut acc = [0f32; 32];
    let chunks = xs.chunks_exact(32);
    let tail: f32 = chunks.remainder().iter().sum();
    for chunk in chunks {
        for (a, &x) in acc.iter_mut().zip(chunk) {
            *a += x;
        }
    }
    acc.iter().sum::<f32>() + tail
}
