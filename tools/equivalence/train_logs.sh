#!/usr/bin/env bash
# Equivalence runs for refactors that must not change a bit: each layout trains 6 steps on a fixed
# text file and its `--log-json` lines (loss, lr, grad norm, MoE and graph statistics; the
# throughput dropped) go to OUT/NAME.log. Run it before and after a change and compare:
#   tools/equivalence/train_logs.sh DATA.txt /tmp/before BIN   (BIN: a megatron binary)
#   diff -r /tmp/before /tmp/after --include='*.log'
set -euo pipefail
data=$1; out=$2; bin=${3:-target/release/megatron}; mkdir -p "$out"
common=(--data "$data" --train-iters 6 --global-batch-size 8 --quiet --eval-interval 1000)
run() {
    local name=$1; shift
    "$bin" train "${common[@]}" "$@" --log-json "$out/$name.json" >/dev/null 2>"$out/$name.err" \
        || { echo "FAIL $name"; cat "$out/$name.err"; return; }
    sed -E 's/,?"tokens_per_s":[^,}]*//' "$out/$name.json" > "$out/$name.log"
}
run base
run tp2 --tp 2
run pp2 --pp 2 --num-layers 4
run vpp --pp 2 --vpp 2 --num-layers 4
run dp2dist --dp 2 --use-distributed-optimizer
run bf16 --tp 2 --bf16
run fp16 --dp 2 --fp16
run recompute --tp 2 --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
run moe --model gpt-moe-tiny --ep 2 --dp 2
run moe_etp --model gpt-moe-tiny --ep 2 --etp 2 --dp 4 --global-batch-size 16
run moe_a2a --model gpt-moe-tiny --ep 2 --dp 2 --moe-token-dispatcher-type alltoall
run all --tp 2 --pp 2 --dp 2 --num-layers 4 --use-distributed-optimizer --bf16
run graphs --tp 2 --cuda-graph-scope attn
