"""Golden files for `megatron preprocess --chat` (tests/chat_data.rs), made by Hugging Face
transformers itself: for the chat templates of Llama 3, Qwen3 and Mistral (each kept as its
model's `tokenizer_config.json` with a small stand-in tokenizer that knows the family's special
tokens), what `apply_chat_template` renders and tokenizes for a set of conversations, and the
answer-only documents of each (TRL's and Megatron-Bridge's rule for templates without generation
markers: the tokens of assistant turn i are those of the conversation rendered up to and
including turn i, less those of the conversation up to turn i with the generation prompt). Where
every such rendering is a prefix of the whole conversation's, the conversation is one document
with every answer counted; where the template renders a turn differently once later turns follow
it (Qwen3 drops earlier turns' thinking), each assistant turn is a document of its own: the
conversation rendered up to it, only its answer counted.

    python3 -m venv venv && venv/bin/pip install transformers tokenizers jinja2
    venv/bin/python tools/golden/chat_templates.py tests/data/chat

Each family lands in OUT/<name>/: tokenizer.json (made here, deterministic),
tokenizer_config.json (the template, the family's special tokens) and golden.json. Beside
Llama 3's, a tiny random Llama over that tokenizer (config.json, model.safetensors), saved by
transformers: what `examples/finetune_chat.rs` imports and fine-tunes.
"""

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ "
    "'[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
    "roles are supported!') }}{% endif %}{% endfor %}"
)

FAMILIES = {
    "llama3": dict(
        template=LLAMA3,
        special=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                 "<|end_header_id|>", "<|eot_id|>"],
        config=dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"),
    ),
    "qwen3": dict(
        template=None,  # read from qwen3_template.jinja beside this script's output
        special=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                 "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
        config=dict(bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>"),
    ),
    "mistral": dict(
        template=MISTRAL,
        special=["<unk>", "<s>", "</s>"],
        config=dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>"),
    ),
}

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}],
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "  Name a colour. "},
        {"role": "assistant", "content": "Blue."},
    ],
    [
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi, how can I help?"},
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": "One, two, three."},
    ],
    [{"role": "user", "content": "Unicode: naïve café ✓"}, {"role": "assistant", "content": "Noted ✓"}],
    [
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "reasoning_content": "two and two", "content": "Four."},
        {"role": "user", "content": "And three plus one?"},
        {"role": "assistant", "reasoning_content": "three and one", "content": "Four too."},
    ],
]

TEXT = (
    "the quick brown fox jumps over the lazy dog what is two plus two four name a colour blue "
    "hello hi how can i help count to three one two three you answer briefly unicode naive cafe "
)


def make_tokenizer(special):
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT] * 20, trainer)
    return tok


def answer_documents(tok, messages, kwargs):
    """The conversation's documents under the rule above: a list of {ids, mask}."""
    def ids(msgs, gen):
        return tok.apply_chat_template(
            msgs, tokenize=True, add_generation_prompt=gen, return_dict=False, **kwargs
        )
    full = ids(messages, False)
    mask = [0] * len(full)
    turns = []
    stable = True
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        upto = ids(messages[: i + 1], False)
        prompt = ids(messages[:i], True)
        if prompt != upto[: len(prompt)]:
            return None
        stable = stable and upto == full[: len(upto)]
        turns.append(dict(ids=upto, mask=[0] * len(prompt) + [1] * (len(upto) - len(prompt))))
        for k in range(len(prompt), len(upto)):
            if k < len(mask):
                mask[k] = 1
    return [dict(ids=full, mask=mask)] if stable else turns


def make_model(d, tok):
    """A tiny random Llama over the stand-in tokenizer, saved as transformers saves it."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        bos_token_id=tok.convert_tokens_to_ids("<|begin_of_text|>"),
        eos_token_id=tok.convert_tokens_to_ids("<|eot_id|>"),
    )
    LlamaForCausalLM(config).save_pretrained(str(d))


def main(out):
    out = Path(out)
    for name, fam in FAMILIES.items():
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        template = fam["template"] or (d / "template.jinja").read_text()
        make_tokenizer(fam["special"]).save(str(d / "tokenizer.json"))
        config = dict(fam["config"])
        config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=template)
        (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        tok = AutoTokenizer.from_pretrained(str(d))
        cases = []
        for messages in CONVERSATIONS:
            for gen in [False, True]:
                try:
                    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
                    ids = tok.apply_chat_template(
                        messages, tokenize=True, add_generation_prompt=gen, return_dict=False
                    )
                    error = None
                except Exception as e:  # the template raised
                    text, ids, error = None, None, str(e)
                case = dict(messages=messages, add_generation_prompt=gen, text=text, ids=ids, error=error)
                if not gen and error is None:
                    case["answer_documents"] = answer_documents(tok, messages, {})
                cases.append(case)
        # A role the template rejects, and roles out of order.
        for messages in [[{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}],
                         [{"role": "assistant", "content": "first"}]]:
            try:
                text = tok.apply_chat_template(messages, tokenize=False)
                cases.append(dict(messages=messages, add_generation_prompt=False, text=text, ids=None, error=None))
            except Exception as e:
                cases.append(dict(messages=messages, add_generation_prompt=False, text=None, ids=None, error=str(e)))
        (d / "golden.json").write_text(json.dumps(cases, indent=1, ensure_ascii=False) + "\n")
        if name == "llama3":
            make_model(d, tok)
        print(name, len(cases), "cases")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/data/chat")
