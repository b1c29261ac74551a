#!/usr/bin/env bash
# The experiment the H200 run of 2026-11-30 left for the next GPU: gpt_gpu's graph-scope test
# failed at pp 2 (two thread ranks on one GPU, each capturing) with
# CUBLAS_STATUS_EXECUTION_FAILED. If CUDA's lazy module loading is the cause (a rank's first use
# of a kernel loading its module while the other rank captures), the test passes with
# CUDA_MODULE_LOADING=EAGER and fails with the default, each time. Run from target/gpu on the
# GPU machine after tools/gpu/pack.sh.
cd "$(dirname "$0")"
cuda_libs=$(ls -d /usr/local/cuda*/targets/x86_64-linux/lib /usr/local/cuda/lib64 2>/dev/null | tr '\n' ':')
export LD_LIBRARY_PATH="$cuda_libs/usr/lib/x86_64-linux-gnu:$PWD/lib:${LD_LIBRARY_PATH:-}"
for mode in LAZY EAGER LAZY EAGER; do
  s=$(date +%s)
  CUDA_MODULE_LOADING=$mode timeout 120 ./gpt_gpu --include-ignored --exact \
      graph_scopes_on_the_gpu_replay_the_eager_run_bit_for_bit > /tmp/graphs.log 2>&1
  echo "=== CUDA_MODULE_LOADING=$mode rc=$? $(( $(date +%s) - s ))s"
  grep -E "panicked|failed:|test result" /tmp/graphs.log | head -4
done
