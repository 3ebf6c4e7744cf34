"""mlautotune: find the fastest DeepSpeed configuration for an unchanged training script."""

__version__ = "0.1.0"
