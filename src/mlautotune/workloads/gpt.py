"""A small GPT-style decoder trained with DeepSpeed on synthetic tokens: mlautotune's bundled workload.

Launch it like any DeepSpeed script:
    deepspeed --num_gpus 2 gpt.py --deepspeed_config ds_config.json --per_device_train_batch_size 4
Like the Hugging Face Trainer, it fills "auto" batch values in the ds_config from its own flags.
Nothing is downloaded: the tokens are random, made here from --seed.
"""

import argparse
import json
import math
import sys

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator


class Block(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.out = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        # Explicit attention (not scaled_dot_product_attention) so the flops profiler sees every matmul.
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab_size, seq_len, hidden, layers, heads, tie_weights=True):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, hidden)
        self.pos = nn.Embedding(seq_len, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab_size, bias=False)
        if tie_weights:
            self.head.weight = self.tok.weight
        for m in self.modules():  # GPT-2's initialisation keeps the first loss near ln(vocab_size)
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num_layers", type=int, default=2)
    p.add_argument("--hidden_size", type=int, default=128)
    p.add_argument("--num_heads", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--vocab_size", type=int, default=4096)
    p.add_argument("--untied", action="store_true", help="separate output head instead of tied embeddings")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps to train (mlautotune ends an experiment once it is measured)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--per_device_train_batch_size", type=int, default=4)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--log_interval", type=int, default=10)
    p.add_argument("--local_rank", type=int, default=-1)
    p = deepspeed.add_config_arguments(p)
    return p.parse_args(hf_style_deepspeed_flag(sys.argv[1:]))


def hf_style_deepspeed_flag(argv):
    """Accept the Hugging Face form `--deepspeed ds.json` too (DeepSpeed's is `--deepspeed --deepspeed_config ds.json`)."""
    out = []
    for i, a in enumerate(argv):
        if a == "--deepspeed" and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            out += ["--deepspeed", "--deepspeed_config"]
        else:
            out.append(a)
    return out


def load_ds_config(args):
    """The ds_config as a dict, with "auto" batch values filled from the flags (as the HF Trainer does)."""
    if args.deepspeed_config is None:
        raise SystemExit("gpt.py needs --deepspeed_config <ds_config.json>")
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    if config.get("train_micro_batch_size_per_gpu") == "auto":
        config["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
    if config.get("gradient_accumulation_steps") == "auto":
        config["gradient_accumulation_steps"] = args.gradient_accumulation_steps
    if config.get("train_batch_size") == "auto":
        del config["train_batch_size"]
    return config


def main():
    args = parse_args()
    config = load_ds_config(args)
    args.deepspeed_config = None  # the dict below is the config; DeepSpeed refuses a path and a dict together
    print(f"gpt.py flags: per_device_train_batch_size={args.per_device_train_batch_size} "
          f"gradient_accumulation_steps={args.gradient_accumulation_steps}", flush=True)

    torch.manual_seed(args.seed)
    model = GPT(args.vocab_size, args.seq_len, args.hidden_size, args.num_layers, args.num_heads, not args.untied)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(), config=config)

    device = get_accelerator().device_name(engine.local_rank)
    mbs, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    gen = torch.Generator().manual_seed(args.seed + engine.global_rank)  # each rank its own data shard

    for step in range(1, args.steps + 1):
        for _ in range(gas):
            tokens = torch.randint(args.vocab_size, (mbs, args.seq_len + 1), generator=gen).to(device)
            loss = engine(tokens[:, :-1], tokens[:, 1:])  # integer token ids: nothing to cast to bf16/fp16
            engine.backward(loss)
            engine.step()
        if engine.global_rank == 0 and (step % args.log_interval == 0 or step == 1):
            print(f"step {step} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
