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


def train(model, dataset):
    """Train with the command line's TrainingArguments, then shut the process group down as PyTorch's
    distributed docs ask: left to interpreter exit, a gloo rank sometimes aborts in teardown
    ("terminate called without an active exception") after training has finished."""
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    Trainer(model=model, args=args, train_dataset=dataset).train()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def main():
    train(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=256, n_positions=32)), RandomTokens())


if __name__ == "__main__":
    main()
