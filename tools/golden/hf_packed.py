"""Golden files for packed documents (tests/hf_packed.rs), made by Hugging Face transformers
itself on the tiny random models of tools/golden/hf_llama.py: three documents packed into one
sequence, and for each document alone the logits transformers computes and its loss with the
labels of the uncounted tokens set to -100.

    venv/bin/python tools/golden/hf_packed.py tests/data/hf llama qwen3

Writes OUT/<name>/packed.json: the documents (token ids), which targets count (`counted[i]`:
whether the token after position i of the document counts), per document the logits
[len, vocab] and transformers' loss, and the masked mean over all documents.
"""

import json
import sys
from pathlib import Path

import torch
import transformers

DOCUMENTS = [[3, 17, 42, 5, 63], [0, 21, 9, 33, 12, 7, 50], [11, 2, 40, 8]]
# Which targets count, per document (the last position of a document predicts nothing of it).
COUNTED = [[1, 1, 0, 1, 0], [0, 1, 1, 1, 0, 1, 0], [1, 1, 1, 0]]


def main(out, names):
    out = Path(out)
    for name in names:
        d = out / name
        model = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
        model.eval()
        logits, losses, total, count = [], [], 0.0, 0
        for doc, counted in zip(DOCUMENTS, COUNTED):
            ids = torch.tensor([doc])
            # transformers shifts the labels: labels[i + 1] is the target of position i.
            labels = [-100] + [t if c else -100 for t, c in zip(doc[1:], counted[:-1])]
            with torch.no_grad():
                res = model(ids, labels=torch.tensor([labels]))
            logits.append(res.logits[0].tolist())
            n = sum(counted[:-1])
            losses.append(res.loss.item())
            total += res.loss.item() * n
            count += n
        ref = dict(
            transformers=transformers.__version__,
            documents=DOCUMENTS,
            counted=COUNTED,
            logits=logits,
            losses=losses,
            masked_mean_loss=total / count,
        )
        (d / "packed.json").write_text(json.dumps(ref) + "\n")
        print(name, "documents", len(DOCUMENTS), "loss", total / count)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or ["llama", "qwen3"])
