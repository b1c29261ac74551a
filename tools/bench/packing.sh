#!/usr/bin/env bash
# Packed chats against the same chats one per sequence, padded (BENCHMARKS.md, "Packed
# fine-tuning data"): 2000 conversations of varied lengths rendered with Llama 3's template
# (tests/data/chat/llama3), one epoch of llama-tiny on each, the answers' tokens per second.
#
#     tools/bench/packing.sh [MEGATRON_BINARY]
set -euo pipefail
megatron="${1:-target/release/megatron}"
tok="$(dirname "$0")/../../tests/data/chat/llama3"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
python3 - "$dir/chats.jsonl" <<'PY'
import json, random, sys
random.seed(0)
words = "the quick brown fox jumps over the lazy dog what is two plus two four name a colour blue".split()
with open(sys.argv[1], "w") as f:
    for i in range(2000):
        q = " ".join(random.choice(words) for _ in range(random.randint(3, 60)))
        a = " ".join(random.choice(words) for _ in range(random.randint(2, 80)))
        f.write(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n")
PY
for pack in true false; do
    "$megatron" preprocess --chat --input "$dir/chats.jsonl" --tokenizer "$tok" \
        --output-prefix "$dir/chats-$pack" --seq-length 512 --pack "$pack" | head -1
    bins=$("$megatron" data inspect "$dir/chats-$pack" | awk '/sequences/ {print $2}')
    steps=$(( (bins + 15) / 16 ))
    "$megatron" train --model llama-tiny --tokenizer "$tok/tokenizer.json" --data "$dir/chats-$pack" \
        --split 100,0,0 --seq-length 512 --max-position-embeddings 512 --micro-batch-size 4 --global-batch-size 16 \
        --train-iters "$steps" --calculate-per-token-loss --log-json "$dir/log-$pack.jsonl" --quiet >/dev/null
    python3 - "$dir/log-$pack.jsonl" "$pack" "$bins" <<'PY'
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1]) if '"step"' in l and "valid_loss" not in l]
later = steps[1:]  # the first step also fills the allocation pool
seconds = sum((16 * 512) / s["tokens_per_s"] for s in later)
counted = sum(s["counted_tokens"] for s in later)
print(f"pack {sys.argv[2]}: {sys.argv[3]} sequences, {len(steps)} steps; {counted / seconds:,.0f} answer tokens/s, "
      f"{len(later) * 16 * 512 / seconds:,.0f} tokens/s (padding included), {seconds / len(later) * 1000:.0f} ms a step")
PY
done
