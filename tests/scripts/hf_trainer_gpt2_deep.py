"""The HF Trainer tiny GPT-2 (hf_trainer_gpt2.py) with eight layers and 128 tokens, so that activations
are most of a CPU rank's per-sample memory and activation checkpointing shrinks it measurably."""

from hf_trainer_gpt2 import RandomTokens, train
from transformers import GPT2Config, GPT2LMHeadModel


def main():
    train(GPT2LMHeadModel(GPT2Config(n_layer=8, n_embd=64, n_head=4, vocab_size=256, n_positions=128)), RandomTokens(seq_len=128))


if __name__ == "__main__":
    main()
