#!/usr/bin/env bash
# A training step of megatron-rs against the same model in PyTorch eager (benches/pytorch_gpt.py),
# the two run alternately, ROUNDS rounds, each pinned to the same cores (taskset: 1 thread on
# core 0, 2 threads on cores 0 and 1), in f32 and in bf16 (megatron-rs's --bf16; PyTorch's
# autocast to bf16). One step: 4 sequences of 128 tokens, forward, backward, clipping, AdamW,
# dropout 0.1; each side reports its median step's tokens/s after 2 warm-up steps.
#
#   cargo build --release
#   tools/bench/train_step_vs_torch.sh PYTHON [ROUNDS] [MODELS] [PRECISIONS]   (PYTHON: with torch)
#
# MODELS defaults to "gpt-tiny l4-h512-v50k gpt2-small", PRECISIONS to "f32 bf16". Prints one line
# per run, then the median over the rounds of each case and megatron-rs's ratio to PyTorch.
set -euo pipefail
py=$1
rounds=${2:-3}
models=${3:-gpt-tiny l4-h512-v50k gpt2-small}
precisions=${4:-f32 bf16}
bin=${BIN:-target/release/megatron}
runs=$(mktemp)
trap 'rm -f "$runs"' EXIT

megatron_model() {
    case $1 in
        gpt-tiny) echo "--model gpt-tiny" ;;
        l4-h512-v50k) echo "--model gpt2-small --num-layers 4 --hidden-size 512 --num-attention-heads 8" ;;
        gpt2-small) echo "--model gpt2-small" ;;
        *) echo "unknown model $1" >&2; exit 2 ;;
    esac
}
steps() { case $1 in gpt2-small) echo 3 ;; *) echo 10 ;; esac; }

for round in $(seq "$rounds"); do
    for model in $models; do
        for threads in 1 2; do
            cpus=$([ "$threads" = 1 ] && echo 0 || echo 0,1)
            for precision in $precisions; do
                flag=$([ "$precision" = bf16 ] && echo --bf16 || true)
                # shellcheck disable=SC2046
                ours=$(taskset -c "$cpus" "$bin" bench $(megatron_model "$model") --seq-length 128 \
                    --micro-batch-size 4 --global-batch-size 4 --train-iters "$(steps "$model")" \
                    --warmup 2 $flag |
                    python3 -c 'import json, sys; print(round(json.load(sys.stdin)["tokens_per_s"], 1))')
                theirs=$(taskset -c "$cpus" "$py" benches/pytorch_gpt.py --model "$model" \
                    --threads "$threads" --steps "$(steps "$model")" $flag |
                    sed -E 's/.* ([0-9.]+) tokens\/s.*/\1/')
                echo "$round $model $threads $precision $ours $theirs" | tee -a "$runs"
            done
        done
    done
done

python3 - "$runs" <<'PY'
import statistics, sys
cases = {}
for line in open(sys.argv[1]):
    _, model, threads, precision, ours, theirs = line.split()
    cases.setdefault((model, int(threads), precision), []).append((float(ours), float(theirs)))
print("| model | threads | precision | megatron-rs tokens/s | PyTorch eager tokens/s | ratio |")
print("| --- | --- | --- | --- | --- | --- |")
for (model, threads, precision), runs in cases.items():
    ours = statistics.median(r[0] for r in runs)
    theirs = statistics.median(r[1] for r in runs)
    print(f"| {model} | {threads} | {precision} | {ours:,.0f} | {theirs:,.0f} | {ours / theirs:.2f}× |")
PY
