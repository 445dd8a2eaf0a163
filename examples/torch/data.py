"""The examples' data: examples/finetune/data/gpl-3.0.txt (~35 KB of English, no download) as byte tokens (a
vocabulary of 256 needs no tokenizer), or through a Hugging Face tokenizer; windows of `seq` + 1 tokens."""

import pathlib

import torch

TEXT = pathlib.Path(__file__).resolve().parents[1] / "finetune" / "data" / "gpl-3.0.txt"


def tokens(tokenizer=None):
    text = TEXT.read_text()
    if tokenizer is None:
        return torch.tensor(list(text.encode()), dtype=torch.long)
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)


class Windows(torch.utils.data.Dataset):
    """Consecutive windows of seq tokens (labels = inputs: the model shifts them)."""

    def __init__(self, ids, seq):
        self.ids, self.seq = ids, seq

    def __len__(self):
        return (len(self.ids) - 1) // self.seq

    def __getitem__(self, i):
        window = self.ids[i * self.seq:(i + 1) * self.seq]
        return {"input_ids": window, "labels": window.clone()}
