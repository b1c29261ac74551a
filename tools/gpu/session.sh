#!/usr/bin/env bash
# One GPU session in one call (run on the GPU machine from the folder tools/gpu/pack.sh fills):
# every GPU test binary on real CUDA, then the benches
# of BENCHMARKS.md "On an NVIDIA H200", each skipped once BUDGET seconds have passed.
# Results: $OUT/tests.log, $OUT/bench.log. Used on 2026-11-30 (twice).
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
# The graph-capture failure at pp 2 (BENCHMARKS.md "On an NVIDIA H200"): gpt_gpu runs it with
# CUDA's default lazy module loading; once more with every module loaded at start.
eager_graphs() {
  local s=$(date +%s)
  CUDA_MODULE_LOADING=EAGER timeout 150 ./gpt_gpu --include-ignored --exact \
      graph_scopes_on_the_gpu_replay_the_eager_run_bit_for_bit > /tmp/graphs.log 2>&1
  echo "=== graph scopes, CUDA_MODULE_LOADING=EAGER rc=$? $(( $(date +%s) - s ))s"
  { echo "=== graph scopes, CUDA_MODULE_LOADING=EAGER"; cat /tmp/graphs.log; } >> "$OUT/tests.log"
  grep -E "panicked|failed:|test result" /tmp/graphs.log | head -4
}
if [ "${TESTS:-1}" = 1 ]; then
  # gpt_gpu (the longest) beside the others, which run one after the other.
  ( THREADS=1 test_bin gpt_gpu 240; eager_graphs ) &
  for t in ${ONLY:-cuda_nvrtc cuda_backend cuda_norm_softmax cuda_embedding_loss_adam cuda_layers_dense cuda_layers_attention_vocab cuda_moe_router nccl_backend bench_gpu elementwise attention_general}; do
    test_bin $t 90
  done
  wait
fi
bench() { # name timeout args... (BIN=megatron-<rev> runs another build)
  local name=$1 t=$2; shift 2
  if [ "$(elapsed)" -gt "$budget" ]; then echo "=== $name skipped at $(elapsed)s"; return; fi
  local s=$(date +%s)
  timeout $t ./${BIN:-megatron} bench "$@" > /tmp/bench.json 2> /tmp/bench.err; local rc=$?
  { echo "=== $name rc=$rc: ${BIN:-megatron} bench $*"; cat /tmp/bench.json /tmp/bench.err; } >> "$OUT/bench.log"
  echo "=== $name rc=$rc $(( $(date +%s) - s ))s $(grep -E '"(tokens_per_s|mfu|peak_gpu_memory_gib|bubble)"' /tmp/bench.json | tr -d '\n ')"
  grep -iE "error" /tmp/bench.err | head -3
}
G="--seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 4 --train-iters 4 --warmup 2 --device cuda --quiet"
# The change of this run, before (the build of REVS) and after, alternated; then what no GPU
# has timed (a step traced, multi-token prediction), in order of worth, until BUDGET.
old=$(ls megatron-* 2>/dev/null | head -1)
qwen() { bench qwen3-0.6b-prof 150 --model qwen3-0.6b $G --profile
         [ -n "$old" ] && BIN=$old bench "qwen3-0.6b-prof@$old" 150 --model qwen3-0.6b $G --profile; }
qwen
bench gpt1.2b 150 --model gpt-1.2b $G
bench gpt1.2b-trace 150 --model gpt-1.2b $G --trace "$OUT/gpt1.2b-trace.json"
bench dsv3-tiny-mtp 60 --model deepseek-v3-tiny --micro-batch-size 8 --train-iters 8 --warmup 3 --device cuda --quiet --mtp-num-layers 1
qwen
bench gpt1.2b-unfused 150 --model gpt-1.2b $G --attention-backend unfused
bench gpt1.2b-prof 150 --model gpt-1.2b $G --profile
echo "total $(elapsed)s"
