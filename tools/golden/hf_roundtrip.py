"""A round trip through megatron-rs, checked by transformers: a tiny random GPT-2 and each
tiny random model of tests/data/hf (every supported architecture) saved again by transformers in float32 and in
bfloat16, whole and in shards, with a generation config and a tokenizer's files, then
`megatron convert` in and straight back out. The export must hold the same tensors byte for
byte in the same dtype, a config that AutoConfig reads as the same (to_dict equal but for `_name_or_path`), and the
same generation config and tokenizer files; the model it loads must give the same logits.

    python3 -m venv venv && venv/bin/pip install torch transformers safetensors
    cargo build --release
    venv/bin/python tools/golden/hf_roundtrip.py target/release/megatron OUT_DIR

Prints one line per case; exits non-zero when one differs.
"""

import filecmp
import json
import subprocess
import sys
from pathlib import Path

import torch
import transformers
from safetensors import safe_open

NAMES = ["gpt2", "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "mistral_window",
         "qwen2_window"]
CARRIED = ["generation_config.json", "tokenizer_config.json", "special_tokens_map.json"]


def tensors(d):
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                out[k] = st.get_tensor(k)
    return out


def main(megatron, out):
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    golden = Path(__file__).resolve().parents[2] / "tests" / "data" / "hf"
    for name in NAMES:
        for dtype, shard in [(torch.float32, None), (torch.bfloat16, "20KB")]:
            case = f"{name}-{str(dtype)[6:]}-{'sharded' if shard else 'whole'}"
            src, ckpt, back = out / case, out / f"{case}-ckpt", out / f"{case}-back"
            for d in (src, ckpt, back):
                subprocess.run(["rm", "-rf", str(d)], check=True)
            if name == "gpt2":
                torch.manual_seed(0)
                model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
                    vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=4)).to(dtype).eval()
            else:
                model = transformers.AutoModelForCausalLM.from_pretrained(golden / name,
                                                                          dtype=dtype)
            model.generation_config = transformers.GenerationConfig(
                bos_token_id=1, eos_token_id=[2, 3], temperature=0.6, top_p=0.9, do_sample=True)
            model.config.bos_token_id, model.config.eos_token_id = 1, 2
            kwargs = {"max_shard_size": shard} if shard else {}
            model.save_pretrained(src, **kwargs)
            (src / "tokenizer_config.json").write_text(json.dumps(
                {"chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
                 "model_max_length": 64}, indent=2))
            (src / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>"}))
            run = lambda *a: subprocess.run([megatron, *a], check=True, capture_output=True,
                                            text=True).stdout
            run("convert", "--from", "hf", str(src), "--to", str(ckpt))
            flags = ["--max-shard-size", shard] if shard else []
            said = run("convert", "--from", str(ckpt), "--to", "hf", str(back), *flags)
            a, b = tensors(src), tensors(back)
            same_tensors = a.keys() == b.keys() and all(
                a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
            # Every field but where it was read from.
            ca = transformers.AutoConfig.from_pretrained(src).to_dict()
            cb = transformers.AutoConfig.from_pretrained(back).to_dict()
            ca.pop("_name_or_path"), cb.pop("_name_or_path")
            same_config = ca == cb
            same_files = all(filecmp.cmp(src / f, back / f, shallow=False) for f in CARRIED)
            tokens = torch.tensor([[3, 17, 42, 5, 63, 0, 21, 9]])
            with torch.no_grad():
                la = model.eval()(tokens).logits
                lb = transformers.AutoModelForCausalLM.from_pretrained(back, dtype=dtype)(
                    tokens).logits
            same_logits = torch.equal(la, lb)
            ok = same_tensors and same_config and same_files and same_logits
            failed += not ok
            peak = [l for l in said.splitlines() if l.startswith("peak")]
            print(f"{case:28} tensors {'equal' if same_tensors else 'DIFFER'}, config "
                  f"{'equal' if same_config else 'DIFFERS'}, files "
                  f"{'equal' if same_files else 'DIFFER'}, logits "
                  f"{'equal' if same_logits else 'DIFFER'}; {peak[0] if peak else ''}")
            if not same_config:
                for k in sorted(set(ca) | set(cb)):
                    if ca.get(k) != cb.get(k):
                        print(f"    {k}: {ca.get(k)!r} -> {cb.get(k)!r}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
