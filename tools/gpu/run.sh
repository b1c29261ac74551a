#!/usr/bin/env bash
# GPU checks, run on the GPU machine from the folder tools/gpu/pack.sh filled (target/gpu): every
# GPU test (full output in $OUT/tests.log), the product bench (cuBLAS shapes, and biased layers
# with and without cuBLASLt's epilogue), the attention bench, gpt-1.2b benches ($OUT/bench.log).
# Knobs: TESTS=0 skips tests; ONLY="a b" limits test binaries; TT=seconds per test binary;
# GEMM=0 skips the product bench; ATT=0 skips the attention bench; DROPOUTS="0.1 0" its dropouts; BINS="megatron other" CLI
# builds to compare (pack.sh's REVS builds megatron-<rev>); BENCH="name[@bin]:args;..." replaces the benches; NCU="regex" also profiles
# the attention bench's kernels matching it with Nsight Compute ($OUT/ncu.csv: speed of light,
# occupancy, warp stall reasons), e.g. NCU="flash".
# Results: $OUT/tests.log (every test binary's output, one after the other) and $OUT/bench.log
# (every bench's JSON and stderr): the device tool returns at most 8 files from $OUT, so
# nothing is written per test or per bench.
cd "$(dirname "$0")"
cuda_libs=$(ls -d /usr/local/cuda*/targets/x86_64-linux/lib /usr/local/cuda/lib64 2>/dev/null | tr '\n' ':')
export LD_LIBRARY_PATH="$cuda_libs/usr/lib/x86_64-linux-gnu:$PWD/lib:${LD_LIBRARY_PATH:-}"
export OMPI_MCA_mca_base_component_path="$PWD/lib/openmpi/openmpi3" OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
if [ "${TESTS:-1}" = 1 ]; then
# Every test binary pack.sh put here (all executables but the CLI builds, megatron*).
tests=$(find . -maxdepth 1 -type f -perm -u+x ! -name 'megatron*' ! -name run.sh -printf '%f\n' | sort)
for t in ${ONLY:-$tests}; do
  s=$(date +%s)
  timeout ${TT:-100} ./$t --include-ignored --test-threads=1 > /tmp/test.log 2>&1; rc=$?
  { echo "=== $t rc=$rc"; cat /tmp/test.log; } >> "$OUT/tests.log"
  echo "=== $t rc=$rc $(( $(date +%s) - s ))s: $(grep -E '^test result' /tmp/test.log | tail -1)"
  grep -E "^test .*FAILED|panicked" -A2 /tmp/test.log | head -20
done
fi
if [ "${GEMM:-1}" = 1 ]; then
  echo "=== bench gemm"; timeout 120 ./megatron bench gemm --device cuda --repeats 7 2>&1 | tee -a "$OUT/bench.log"
fi
G="--model gpt-1.2b --seq-length 2048 --max-position-embeddings 2048 --train-iters 4 --warmup 2 --device cuda --quiet"
if [ "${ATT:-1}" = 1 ]; then for bin in ${BINS:-megatron}; do for dp in ${DROPOUTS:-0.1}; do
  echo "=== $bin bench attention --dropout $dp"; timeout 120 ./$bin bench attention --device cuda --dropout $dp 2>&1 | tail -3
done; done; fi
IFS=';' read -ra runs <<< "${BENCH:-mb4:--micro-batch-size 4;mb4unfused:--micro-batch-size 4 --attention-backend unfused;mb4prof:--micro-batch-size 4 --profile}"
for r in "${runs[@]}"; do
  name=${r%%:*}; args=${r#*:}; s=$(date +%s); bin=megatron
  case $name in *@*) bin=${name#*@}; name=${name%@*};; esac
  timeout 150 ./$bin bench $G $args > /tmp/bench.json 2> /tmp/bench.err; rc=$?
  { echo "=== $name rc=$rc: $bin bench $G $args"; cat /tmp/bench.json /tmp/bench.err; } >> "$OUT/bench.log"
  echo "=== $name rc=$rc $(( $(date +%s) - s ))s $(grep -E '"(tokens_per_s|mfu|peak_gpu_memory_gib)"' /tmp/bench.json | tr -d '\n ')"
  grep -iE "error" /tmp/bench.err | head -3
done
if [ -n "${NCU:-}" ]; then
  ncu_bin=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  echo "=== ncu $NCU (${ncu_bin:-not found})"
  if [ -n "$ncu_bin" ]; then
    timeout 400 "$ncu_bin" --kernel-name "regex:$NCU" --launch-count 6 --csv --page details \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section SchedulerStats --section MemoryWorkloadAnalysis \
      ./megatron bench attention --device cuda --repeats 1 > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
    echo "rc=$? $(wc -l < "$OUT/ncu.csv") lines"
  fi
fi
