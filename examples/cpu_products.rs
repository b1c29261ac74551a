//! The CPU's products, f32 and bf16: which kernel this CPU runs, how fast, and what the bf16
//! products promise.
//!
//! It multiplies a GPT-2-small MLP's fc1 (4096 tokens × 768 → 3072) as a linear layer's forward
//! reads it (the weight transposed in place), in f32 and with `--bf16`'s products (both operands
//! rounded to bf16, sums in f32), prints each kernel and rate, and checks that the bf16 product
//! is, bit for bit, the f32 product of the rounded operands (on AMX, whose tiles sum in another
//! order, to f32's precision). Then a decoding step's product: one
//! token's row against a 4096 × 8192 weight stored in bf16 (`megatron generate --bf16`), which
//! streams the weight's 64 MiB as stored, checked bit for bit against the f32 product of the
//! rounded operands, with the rate the weight was read at.
//!
//! ```sh
//! cargo run --release --example cpu_products
//! MEGATRON_KERNEL_ISA=avx512 cargo run --release --example cpu_products   # without the bf16 tile
//! ```

use std::time::Instant;

use megatron::kernels::gemm::{bf16_kernel_name, kernel_name};
use megatron::ops::{cpu_bf16_products, matmul};
use megatron::tensor::{DType, Tensor};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (tokens, hidden, ffn) = (4096, 768, 3072);
    let values = |len: usize, seed: f32| -> Vec<f32> {
        (0..len)
            .map(|i| (i as f32 * 0.618 + seed).sin() * 0.5)
            .collect()
    };
    let x = Tensor::from_vec(values(tokens * hidden, 0.1), [tokens, hidden])?;
    let w = Tensor::from_vec(values(ffn * hidden, 0.7), [ffn, hidden])?;
    let flops = 2.0 * (tokens * hidden * ffn) as f64;

    // Best of three: the first run also fills the caches and the packing buffers.
    let timed = |bf16: bool| -> Result<(Tensor, f64), Box<dyn std::error::Error>> {
        let _products = cpu_bf16_products(bf16);
        let mut best = f64::INFINITY;
        let mut y = matmul(&x, &w.t()?)?;
        for _ in 0..3 {
            let start = Instant::now();
            y = matmul(&x, &w.t()?)?;
            best = best.min(start.elapsed().as_secs_f64());
        }
        Ok((y, flops / best / 1e9))
    };
    let (y32, rate32) = timed(false)?;
    let (y16, rate16) = timed(true)?;
    println!("fc1 forward, {tokens} × {hidden} → {ffn}:");
    println!("  f32   {rate32:>7.1} GFLOP/s on {}", kernel_name());
    println!("  bf16  {rate16:>7.1} GFLOP/s on {}", bf16_kernel_name());

    // The bf16 product is the f32 product of the operands rounded to bf16.
    let rounded = |t: &Tensor| t.to_dtype(DType::BF16)?.to_dtype(DType::F32);
    let want = matmul(&rounded(&x)?, &rounded(&w)?.t()?)?.to_vec::<f32>()?;
    let got = y16.to_vec::<f32>()?;
    if megatron::kernels::isa::Isa::detected().amx() {
        // AMX's tiles sum the same products in an order of their own (docs/guide/cpu-kernels.md):
        // the rounded operands' product to f32's precision, not bit for bit.
        let scale = want.iter().fold(1.0f32, |s, v| s.max(v.abs()));
        let apart = got
            .iter()
            .zip(&want)
            .map(|(g, w)| (g - w).abs())
            .fold(0.0f32, f32::max);
        if apart > 1e-5 * scale {
            return Err(format!(
                "the AMX product is {apart:e} from the f32 product of the rounded operands"
            )
            .into());
        }
        println!(
            "  on AMX: the f32 product of the rounded operands summed in AMX's order, within {apart:.2e}"
        );
    } else if got
        .iter()
        .zip(&want)
        .any(|(g, w)| g.to_bits() != w.to_bits())
    {
        return Err("the bf16 product differs from the f32 product of the rounded operands".into());
    }
    let f32s = y32.to_vec::<f32>()?;
    let largest = f32s
        .iter()
        .zip(&got)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    println!(
        "  the bf16 product is the f32 product of the rounded operands (bit for bit but on AMX); \
         it differs from the f32 product by at most {largest:.2e}"
    );

    // Decoding: one row against a weight stored in bf16, read transposed as a linear layer's
    // forward reads it; best of three after a first run.
    let (inputs, outputs) = (4096, 8192);
    let row = Tensor::from_vec(values(inputs, 0.3), [1, inputs])?;
    let weight = Tensor::from_vec(values(outputs * inputs, 0.9), [outputs, inputs])?;
    let stored = weight.to_dtype(DType::BF16)?;
    let _products = cpu_bf16_products(true);
    let mut step = matmul(&row, &stored.t()?)?;
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let start = Instant::now();
        step = matmul(&row, &stored.t()?)?;
        best = best.min(start.elapsed().as_secs_f64());
    }
    let want = matmul(&rounded(&row)?, &rounded(&weight)?.t()?)?.to_vec::<f32>()?;
    let same = step
        .to_vec::<f32>()?
        .iter()
        .zip(&want)
        .all(|(g, w)| g.to_bits() == w.to_bits());
    if !same {
        return Err("the streamed bf16 weight's product differs from the rounded operands'".into());
    }
    let gbs = (2 * outputs * inputs) as f64 / best / 1e9;
    println!(
        "decoding, 1 × {inputs} → {outputs} against a bf16 weight: {:.2} ms, the weight read at \
         {gbs:.1} GB/s; the f32 product of the rounded operands, bit for bit",
        best * 1e3
    );
    Ok(())
}
