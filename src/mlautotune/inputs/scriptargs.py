"""Reading and rewriting the training script's own flags (argument lists, never shell strings)."""

from typing import List, Optional

DEEPSPEED_CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed-config", "--deepspeed")


def get_flag(args: List[str], flag: str) -> Optional[str]:
    """The value of `flag` in `args` (`--flag v` or `--flag=v`); the last one wins, as with argparse."""
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a[len(flag) + 1 :]
    return value


def set_flag(args: List[str], flag: str, value: str) -> List[str]:
    """A copy of `args` with every occurrence of `flag` set to `value`, or the flag appended."""
    out, found, i = [], False, 0
    while i < len(args):
        a = args[i]
        if a == flag and i + 1 < len(args):
            out += [flag, value]
            found, i = True, i + 2
            continue
        if a.startswith(flag + "="):
            out.append(f"{flag}={value}")
            found = True
        else:
            out.append(a)
        i += 1
    if not found:
        out += [flag, value]
    return out


def set_deepspeed_config(args: List[str], path: str) -> List[str]:
    """Point the script's `--deepspeed_config`/`--deepspeed` at `path` (adding `--deepspeed_config` if neither is there).

    `--deepspeed` followed by another flag is a boolean switch (DeepSpeed's add_config_arguments);
    only a `--deepspeed <path>` with a value is rewritten.
    """
    out = list(args)
    replaced = False
    for flag in DEEPSPEED_CONFIG_FLAGS:
        v = get_flag(out, flag)
        if v is not None and not v.startswith("--"):
            out, replaced = set_flag(out, flag, path), True
    if not replaced:
        out += ["--deepspeed_config", path]
    return out
