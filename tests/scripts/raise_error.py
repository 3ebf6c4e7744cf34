"""A training script that fails at once: the experiment must end as `failed` with this message."""

raise ValueError("tiny script failed on purpose: code 4242")
