"""torch.matmul on `megatron bench gemm`'s shapes, with the same transposes (BENCHMARKS.md, GEMM):
f32, and bf16 operands (f32 accumulation, oneDNN's AVX512_BF16 or AMX kernels where the CPU has
them), median and best of REPEATS timed runs after one warm-up, GFLOP/s.

    venv/bin/python tools/bench/torch_gemm.py --threads 2 [--repeats 7]
"""

import argparse
import time

import torch

# (name, m, k, n, A transposed, B transposed): src/bench/gemm.rs's SHAPES.
SHAPES = [
    ("square 1024³", 1024, 1024, 1024, False, False),
    ("fc1 forward  Y = X·Wᵀ", 4096, 768, 3072, False, True),
    ("fc1 backward dX = dY·W", 4096, 3072, 768, False, False),
    ("fc1 backward dW = dYᵀ·X", 3072, 4096, 768, True, False),
]


def operand(rows, cols, transposed, dtype):
    if transposed:
        return torch.randn(cols, rows).to(dtype).t()
    return torch.randn(rows, cols).to(dtype)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s)")
    for dtype in (torch.float32, torch.bfloat16):
        for name, m, k, n, ta, tb in SHAPES:
            a, b = operand(m, k, ta, dtype), operand(k, n, tb, dtype)
            torch.matmul(a, b)
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                torch.matmul(a, b)
                times.append(time.perf_counter() - start)
            times.sort()
            flops = 2 * m * k * n
            print(f"  {name:<26} {str(dtype).removeprefix('torch.'):<9} {m}×{k}×{n:<6} "
                  f"median {flops / times[len(times) // 2] / 1e9:7.1f}  "
                  f"best {flops / times[0] / 1e9:7.1f} GFLOP/s")


if __name__ == "__main__":
    main()
