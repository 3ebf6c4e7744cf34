"""The full run's planned length and the samples' length in tokens, as the user gave them: the
autotuning section's planned_steps / planned_samples / planned_tokens, else a Hugging Face Trainer
script's own --max_steps or --num_train_epochs; the sequence length from the script's arguments."""

from dataclasses import dataclass
from typing import Any, List, Optional

from mlautotune.inputs.scriptargs import get_flag

SEQUENCE_FLAGS = ("--seq_len", "--seq_length", "--block_size", "--max_seq_length")  # the bundled workload's, HF run_clm's, run_mlm's / run_glue's


@dataclass(frozen=True)
class Planned:
    unit: str  # steps | samples | tokens | epochs
    amount: float
    source: str  # where it was read, for the summary: "autotuning.planned_steps", "the script's --max_steps"


def planned_length(at: Any, script_args: List[str], hf_trainer: bool) -> Optional[Planned]:
    """The first of: autotuning.planned_steps/samples/tokens (validated, at most one), a Trainer
    script's --max_steps (when positive: it overrides the epochs, as in the Trainer), its
    --num_train_epochs. None when none is given."""
    for unit in ("steps", "samples", "tokens"):
        value = at.get(f"planned_{unit}")
        if value is not None:
            return Planned(unit, float(value), f"autotuning.planned_{unit}")
    if not hf_trainer:
        return None
    steps = _number(get_flag(script_args, "--max_steps"), int)
    if steps is not None and steps > 0:
        return Planned("steps", float(steps), "the script's --max_steps")
    epochs = _number(get_flag(script_args, "--num_train_epochs"), float)
    if epochs is not None and epochs > 0:
        return Planned("epochs", epochs, "the script's --num_train_epochs")
    return None


def sequence_length(script_args: List[str]) -> Optional[tuple]:
    """(tokens per sample, the flag it came from) when the script's arguments give it; None otherwise
    (a script's default is not known here)."""
    for flag in SEQUENCE_FLAGS:
        value = _number(get_flag(script_args, flag), int)
        if value is not None and value > 0:
            return value, flag
    return None


def _number(text: Optional[str], kind):
    if text is None:
        return None
    try:
        return kind(text)
    except ValueError:
        return None
