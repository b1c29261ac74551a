"""LoRA out of megatron-rs, checked by transformers and PEFT: the tiny Llama and the tiny
Mixtral of tests/data/hf (whose experts' fc1 and fc2 get adapters too, PEFT's
`target_parameters` on transformers' fused expert weights) each imported, fine-tuned with `megatron train --lora-rank 4` (the base frozen) on a small token
dataset, then written with `megatron convert --to peft` and `--to hf --merge-lora`.

- PEFT's `PeftModel.from_pretrained` loads the adapter on the transformers base; its logits
  equal those of the merged export loaded by transformers (to f32 rounding), and
  `merge_and_unload()`'s weights equal the merged export's;
- its greedy continuation equals megatron-rs's (`megatron bench generate` on the LoRA
  checkpoint, whose prompt is token i = (7919·i + 13) mod vocab);
- an adapter PEFT made itself (beside o_proj and down_proj, or o_proj and the experts' fused
  weights; B drawn at random) goes in with
  `megatron convert --from peft --base` and continues greedily as PEFT does.

    python3 -m venv venv && venv/bin/pip install torch transformers safetensors peft
    cargo build --release
    venv/bin/python tools/golden/lora_peft.py target/release/megatron OUT_DIR

Prints what it compared; exits non-zero when something differs.
"""

import json
import struct
import subprocess
import sys
from pathlib import Path

import peft
import torch
import transformers

HF = Path(__file__).resolve().parents[2] / "tests" / "data" / "hf"
PROMPT, NEW = 12, 12


def write_dataset(prefix):
    """Megatron-LM's indexed dataset of 64 documents of tokens below 64 (uint16)."""
    docs = [[(d * 7 + (j % 12) * 5) % 64 for j in range(96)] for d in range(64)]
    with open(f"{prefix}.bin", "wb") as f:
        for doc in docs:
            f.write(struct.pack(f"<{len(doc)}H", *doc))
    sizes = [len(d) for d in docs]
    pointers, at = [], 0
    for s in sizes:
        pointers.append(at)
        at += 2 * s
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8))
        f.write(struct.pack("<QQ", len(docs), len(docs) + 1))
        f.write(struct.pack(f"<{len(sizes)}i", *sizes))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(docs) + 1}q", *range(len(docs) + 1)))


def run(*args):
    return subprocess.run([str(a) for a in args], check=True, capture_output=True,
                          text=True).stdout


def main(megatron, root):
    subprocess.run(["rm", "-rf", str(root)], check=True)
    failed = False
    for name, own in [
        ("llama", dict(target_modules=["o_proj", "down_proj"])),
        ("mixtral", dict(target_modules=["o_proj"],
                         target_parameters=["experts.gate_up_proj", "experts.down_proj"])),
    ]:
        print(f"{name}:")
        failed |= check(megatron, HF / name, root / name, own)
    sys.exit(1 if failed else 0)


def check(megatron, GOLDEN, out, own):
    out.mkdir(parents=True)
    write_dataset(out / "tokens")
    run(megatron, "convert", "--from", "hf", GOLDEN, "--to", out / "base")
    run(megatron, "train", "--quiet", "--load", out / "base", "--data", out / "tokens",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--lr", "2e-2", "--train-iters", "30", "--lora-rank", "4", "--lora-alpha", "8",
        "--save", out / "lora")
    run(megatron, "convert", "--from", out / "lora", "--to", "peft", out / "peft")
    run(megatron, "convert", "--from", out / "lora", "--to", "hf", out / "merged", "--merge-lora")
    base = transformers.AutoModelForCausalLM.from_pretrained(GOLDEN, dtype=torch.float32).eval()
    vocab = base.config.vocab_size
    tokens = torch.tensor([[(7919 * i + 13) % vocab for i in range(PROMPT)]])
    with torch.no_grad():
        plain = base(tokens).logits
    # PEFT wraps the base in place: its logits are taken first.
    model = peft.PeftModel.from_pretrained(base, out / "peft").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(out / "merged",
                                                               dtype=torch.float32).eval()
    with torch.no_grad():
        a, b = model(tokens).logits, merged(tokens).logits
    moved = (a - plain).abs().max().item()
    worst = (a - b).abs().max().item()
    scale = b.abs().max().item()
    failed = worst > 1e-5 * scale or moved < 1e-3
    print(f"PEFT adapter on the transformers base vs the merged export: largest logit difference "
          f"{worst:.2e} of {scale:.2f}; the adapter moves the logits by up to {moved:.3f}")
    unloaded = model.merge_and_unload().state_dict()
    merged_sd = merged.state_dict()
    diff = max((unloaded[k] - merged_sd[k]).abs().max().item() for k in merged_sd)
    failed |= diff > 1e-6
    print(f"merge_and_unload's weights vs the merged export: largest difference {diff:.2e}")
    ours = json.loads(run(megatron, "bench", "generate", "--load", out / "lora",
                          "--prompt-tokens", PROMPT, "--new-tokens", NEW, "--json"))["tokens"]
    with torch.no_grad():
        theirs = model.generate(input_ids=tokens, attention_mask=torch.ones_like(tokens),
                                max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                                eos_token_id=None)[0, PROMPT:].tolist()
    same = theirs == ours
    failed |= not same
    print(f"greedy tokens, PEFT on transformers vs megatron-rs: {'equal' if same else 'DIFFER'} "
          f"{theirs} {ours}")
    torch.manual_seed(0)
    fresh = transformers.AutoModelForCausalLM.from_pretrained(GOLDEN, dtype=torch.float32).eval()
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **own)
    made = peft.get_peft_model(fresh, config).eval()
    made.save_pretrained(out / "made")
    run(megatron, "convert", "--from", "peft", out / "made", "--to", out / "made-ckpt",
        "--base", out / "base")
    ours = json.loads(run(megatron, "bench", "generate", "--load", out / "made-ckpt",
                          "--prompt-tokens", PROMPT, "--new-tokens", NEW, "--json"))["tokens"]
    with torch.no_grad():
        theirs = made.generate(input_ids=tokens, attention_mask=torch.ones_like(tokens),
                               max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                               eos_token_id=None)[0, PROMPT:].tolist()
    same = theirs == ours
    failed |= not same
    print(f"greedy tokens, PEFT's own adapter on transformers vs imported into megatron-rs: "
          f"{'equal' if same else 'DIFFER'} {theirs} {ours}")
    return failed


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
