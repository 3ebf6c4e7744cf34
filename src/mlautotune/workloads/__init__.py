"""Bundled example training scripts. They are run as files (`deepspeed gpt.py ...`), never imported by the tuner."""

from pathlib import Path

GPT_SCRIPT = Path(__file__).with_name("gpt.py")  # the default workload
