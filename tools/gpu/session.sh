#!/usr/bin/env bash
# One GPU session in one call (run on the GPU machine from the folder tools/gpu/pack.sh fills):
# every GPU test binary on real CUDA, then the benches
# of BENCHMARKS.md "On an NVIDIA H200", each skipped once BUDGET seconds have passed.
# Results: $OUT/tests.log, $OUT/bench.log. Used on 2026-11-30.
cd "$(dirname "$0")"
start=$(date +%s)
budget=${BUDGET:-450}
elapsed() { echo $(( $(date +%s) - start )); }
cuda_libs=$(ls -d /usr/local/cuda*/targets/x86_64-linux/lib /usr/local/cuda/lib64 2>/dev/null | tr '\n' ':')
export LD_LIBRARY_PATH="$cuda_libs/usr/lib/x86_64-linux-gnu:$PWD/lib:${LD_LIBRARY_PATH:-}"
export OMPI_MCA_mca_base_component_path="$PWD/lib/openmpi/openmpi3" OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader
test_bin() { # name timeout
  local s=$(date +%s)
  timeout $2 ./$1 --include-ignored --test-threads=${THREADS:-1} > /tmp/$1.log 2>&1; local rc=$?
  { echo "=== $1 rc=$rc"; cat /tmp/$1.log; } >> "$OUT/tests.log"
  echo "=== $1 rc=$rc $(( $(date +%s) - s ))s: $(grep -E '^test result' /tmp/$1.log | tail -1)"
  grep -E "^test .*FAILED|panicked" -A3 /tmp/$1.log | head -24
}
if [ "${TESTS:-1}" = 1 ]; then
  # gpt_gpu (the longest) beside the others, which run one after the other.
  ( THREADS=1 test_bin gpt_gpu 240 ) &
  for t in ${ONLY:-cuda_nvrtc cuda_backend cuda_norm_softmax cuda_embedding_loss_adam cuda_layers_dense cuda_layers_attention_vocab cuda_moe_router nccl_backend bench_gpu elementwise attention_general}; do
    test_bin $t 90
  done
  wait
fi
bench() { # name timeout args...
  local name=$1 t=$2; shift 2
  if [ "$(elapsed)" -gt "$budget" ]; then echo "=== $name skipped at $(elapsed)s"; return; fi
  local s=$(date +%s)
  timeout $t ./megatron bench "$@" > /tmp/bench.json 2> /tmp/bench.err; local rc=$?
  { echo "=== $name rc=$rc: megatron bench $*"; cat /tmp/bench.json /tmp/bench.err; } >> "$OUT/bench.log"
  echo "=== $name rc=$rc $(( $(date +%s) - s ))s $(grep -E '"(tokens_per_s|mfu|peak_gpu_memory_gib|bubble)"' /tmp/bench.json | tr -d '\n ')"
  grep -iE "error" /tmp/bench.err | head -3
}
G="--seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 4 --train-iters 4 --warmup 2 --device cuda --quiet"
bench att-d0.1 60 attention --device cuda --dropout 0.1
bench att-d0 60 attention --device cuda --dropout 0
bench gpt1.2b-prof 150 --model gpt-1.2b $G --profile
bench qwen3-0.6b-prof 150 --model qwen3-0.6b $G --profile
M="--model gpt2-medium --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 4 --train-iters 6 --warmup 2 --device cuda --quiet --attention-dropout 0"
bench gpt2m-d0-eager 90 $M
bench gpt2m-d0-graphs 90 $M --cuda-graph-scope attn mlp
bench dsv3-tiny 60 --model deepseek-v3-tiny --micro-batch-size 8 --train-iters 8 --warmup 3 --device cuda --quiet
bench moe-tiny-graphs 60 --model gpt-moe-tiny --micro-batch-size 8 --train-iters 8 --warmup 3 --device cuda --quiet --cuda-graph-scope moe_router moe_preprocess
bench att-docs8 60 attention --device cuda --dropout 0 --documents 8
bench gemm 90 gemm --device cuda --repeats 5
bench gpt1.2b 150 --model gpt-1.2b $G
echo "total $(elapsed)s"
