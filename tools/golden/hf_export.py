"""transformers runs each `megatron convert --to hf` export as megatron-rs does: for gpt-tiny
trained with each of the Llama family's flag sets (and mixtral-tiny's), the export's
architecture and transformers' greedy tokens against megatron-rs's (`megatron bench generate`,
whose prompt is token i = (7919·i + 13) mod vocab). `tests/cli_convert.rs` holds the other side
in CI: each export imported back computes the trained model's logits bit for bit.

    python3 -m venv venv && venv/bin/pip install torch transformers safetensors
    cargo build --release
    venv/bin/python tools/golden/hf_export.py target/release/megatron OUT_DIR

Prints one line per case and exits non-zero when a case's tokens differ.
"""

import json
import subprocess
import sys
from pathlib import Path

import torch
import transformers

LLAMA = [
    "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--position-embedding-type", "rope",
]

CASES = {
    "gpt2": [],
    "gpt2-untied": ["--untie-embeddings-and-output-weights"],
    "llama-gqa": LLAMA + [
        "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16",
        "--untie-embeddings-and-output-weights", "--rotary-base", "500000",
    ],
    "llama3-scaled": LLAMA + ["--use-rope-scaling", "--rope-scaling-factor", "8"],
    "qwen3": LLAMA + ["--qk-layernorm", "--kv-channels", "16"],
    "qwen2": LLAMA + ["--add-qkv-bias"],
    "mistral-window": LLAMA + ["--window-size", "5,0"],
    "qwen3-window": LLAMA + ["--qk-layernorm", "--window-size", "5,0", "--window-attn-skip-freq", "2"],
    "qwen2-window": LLAMA + ["--add-qkv-bias", "--window-size", "7,0", "--window-attn-skip-freq", "2"],
    "mixtral": ["--model", "mixtral-tiny"],
    "qwen3-moe": ["--model", "mixtral-tiny", "--qk-layernorm", "--moe-layer-freq", "[0,1,1,1]",
                  "--moe-router-pre-softmax"],
}

PROMPT, NEW = 24, 24


def run(*args):
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


def main(megatron, out):
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name, flags in CASES.items():
        ckpt, hf = out / name, out / f"{name}-hf"
        if not ckpt.exists():
            run(megatron, "train", *flags, "--train-iters", "300", "--hidden-dropout", "0",
                "--attention-dropout", "0", "--quiet", "--save", str(ckpt))
        if not hf.exists():
            run(megatron, "convert", "--from", str(ckpt), "--to", "hf", str(hf))
        ours = json.loads(run(megatron, "bench", "generate", "--load", str(ckpt),
                              "--prompt-tokens", str(PROMPT), "--new-tokens", str(NEW), "--json"))
        config = json.loads((hf / "config.json").read_text())
        model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
        vocab = config["vocab_size"]
        prompt = torch.tensor([[(7919 * i + 13) % vocab for i in range(PROMPT)]])
        with torch.no_grad():
            theirs = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                    max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                                    eos_token_id=None)[0, PROMPT:].tolist()
        same = theirs == ours["tokens"]
        failed += not same
        print(f"{name:15} {config['architectures'][0]:22} greedy tokens "
              f"{'equal' if same else 'DIFFER'}: {theirs[:8]}...")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
