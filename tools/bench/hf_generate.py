"""transformers' greedy `generate` timed as `megatron bench generate` times megatron-rs's, on the
same weights (BENCHMARKS.md, "Generation").

    venv/bin/python tools/bench/hf_generate.py make DIR --shape tiny|100m
    megatron convert --from hf DIR --to CKPT
    megatron bench generate --load CKPT --threads 2
    venv/bin/python tools/bench/hf_generate.py time DIR --threads 2
    megatron bench generate --load CKPT --threads 2 --bf16
    venv/bin/python tools/bench/hf_generate.py time DIR --threads 2 --bf16

`make` saves a random Llama (f32) of llama-tiny's shape (4 layers, hidden 128, 4 heads in 2
key/value groups, SwiGLU 320, vocabulary 256) or of about 100M parameters (12 layers, hidden
768, 12 heads in 4 groups, SwiGLU 2048, vocabulary 32,000). `time` runs the prompt megatron-rs
uses (token i = (7919·i + 13) mod vocab) through generate with its KV cache after a warm-up,
each new token's time taken as generate hands it out (a streamer), as megatron-rs times its
own: the rate is the N − 1 steps from the first new token to the last. It prints one JSON
object with the greedy tokens, which the same weights make equal to megatron-rs's. With --bf16
the model is loaded in bf16 (transformers computes its activations in bf16 too, megatron-rs
in f32 with bf16 products), so the greedy tokens may part after a while.
"""

import argparse
import json
import time

import torch
import transformers

SHAPES = {
    "tiny": dict(
        num_hidden_layers=4,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=320,
        vocab_size=256,
        max_position_embeddings=256,
    ),
    "100m": dict(
        num_hidden_layers=12,
        hidden_size=768,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2048,
        vocab_size=32000,
        max_position_embeddings=2048,
    ),
}


def make(directory: str, shape: str) -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        **SHAPES[shape],
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(directory)
    print(sum(p.numel() for p in model.parameters()), "parameters in", directory)


class Times(transformers.generation.streamers.BaseStreamer):
    """The time each new token is handed out (generate hands out the prompt first)."""

    def __init__(self, start):
        self.start, self.calls, self.times = start, 0, []

    def put(self, value):
        self.calls += 1
        if self.calls > 1:
            self.times.append(time.perf_counter() - self.start)

    def end(self):
        pass


def timed(model, prompt, n: int):
    start = time.perf_counter()
    times = Times(start)
    with torch.no_grad():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
            streamer=times,
        )
    return times.times, out[0, prompt.shape[1] :].tolist()


def run(directory: str, prompt_tokens: int, new_tokens: int, threads: int, bf16: bool) -> None:
    torch.set_num_threads(threads)
    dtype = torch.bfloat16 if bf16 else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
    vocab = model.config.vocab_size
    prompt = torch.tensor([[(7919 * i + 13) % vocab for i in range(prompt_tokens)]])
    timed(model, prompt, 1)
    times, tokens = timed(model, prompt, new_tokens)
    first, last = times[0], times[-1]
    print(
        json.dumps(
            {
                "transformers": transformers.__version__,
                "torch": torch.__version__,
                "threads": threads,
                "dtype": str(dtype),
                "prompt_tokens": prompt_tokens,
                "new_tokens": new_tokens,
                "first_token_s": first,
                "decode_tokens_per_s": (new_tokens - 1) / (last - first),
                "tokens": tokens,
            }
        )
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make")
    m.add_argument("dir")
    m.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    t = sub.add_parser("time")
    t.add_argument("dir")
    t.add_argument("--prompt-tokens", type=int, default=32)
    t.add_argument("--new-tokens", type=int, default=64)
    t.add_argument("--threads", type=int, default=2)
    t.add_argument("--bf16", action="store_true")
    a = parser.parse_args()
    if a.command == "make":
        make(a.dir, a.shape)
    else:
        run(a.dir, a.prompt_tokens, a.new_tokens, a.threads, a.bf16)
