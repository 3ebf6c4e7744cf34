"""A Hugging Face Trainer script as users write them: a tiny GPT-2 built from a config (nothing is
downloaded), random tokens, `--deepspeed ds.json` and the Trainer's own flags."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainingArguments


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n=4096, seq_len=32, vocab=256):
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, vocab, (n, seq_len), generator=g)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.data[i]}


def main():
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=256, n_positions=32))
    Trainer(model=model, args=args, train_dataset=RandomTokens()).train()


if __name__ == "__main__":
    main()
