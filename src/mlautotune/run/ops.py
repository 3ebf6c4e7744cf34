"""DeepSpeed's JIT-built ops: which ones an experiment will load, whether this machine has built
them, and building them once, outside any experiment.

A DeepSpeed wheel ships its C++ ops as sources; the first run that needs one compiles it into
torch's extension cache (`TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`), which on
CPU takes about 100 s for the shm comm op alone. Done inside an experiment, that time would count
against its timeout and its wall time, so setup and the session build them first.

    python -m mlautotune.run.ops [ds_config.json]    # build what that config needs (setup.sh runs this)
"""

import os
import shutil
import subprocess
import sys
from typing import Any, Dict, List, Optional

# The optimizer op DeepSpeed's engine loads for a ds_config optimizer type (runtime/engine.py
# _configure_basic_optimizer): fused on the accelerator, the CPU one under optimizer offload.
OPTIMIZER_OPS = {
    "adam": ("FusedAdamBuilder", "CPUAdamBuilder"),
    "adamw": ("FusedAdamBuilder", "CPUAdamBuilder"),
    "lamb": ("FusedLambBuilder", None),
    "lion": ("FusedLionBuilder", "CPULionBuilder"),
    "adagrad": (None, "CPUAdagradBuilder"),
}
COMM_OP = "ShareMemCommBuilder"  # loaded by deepspeed.comm's torch backend at init (CPU accelerator)
# A build lock that no process here holds open is stale once older than this: on a local disk a few
# seconds (a process that takes a lock while we look is missed by the look), on a shared one (NFS,
# Lustre, ...) long enough for a build that another machine may be running in the same cache.
LOCAL_LOCK_GRACE_S = 10.0
SHARED_LOCK_GRACE_S = 120.0
STALE_LOCK_SWEEP_S = 10.0  # how often a running experiment that has measured nothing yet looks for one
LOCAL_FILESYSTEMS = {"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "tmpfs", "ramfs", "overlay", "jfs", "reiserfs"}


def needed(ds_config: Optional[Dict[str, Any]]) -> List[str]:
    """The op builders (class names) an experiment with this ds_config will load."""
    names = [COMM_OP]
    ds_config = ds_config or {}
    optimizer = ds_config.get("optimizer") if isinstance(ds_config.get("optimizer"), dict) else {}
    zero = ds_config.get("zero_optimization") if isinstance(ds_config.get("zero_optimization"), dict) else {}
    offload = zero.get("offload_optimizer") if isinstance(zero.get("offload_optimizer"), dict) else {}
    kind = str(optimizer.get("type", "")).lower()
    if kind in ("adam", "adamw") and isinstance(optimizer.get("params"), dict) and optimizer["params"].get("torch_adam"):
        return names  # torch's own Adam, offloaded or not (engine.get_optimizer_configuration): no op to build
    fused, cpu = OPTIMIZER_OPS.get(kind, (None, None))
    op = cpu if str(offload.get("device", "none")).lower() == "cpu" else fused
    return names + ([op] if op else [])


def _builder(name: str):
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(name)
    return None if builder is None or type(builder).__name__ == "NotImplementedBuilder" else builder


def unbuilt(names: List[str]) -> List[str]:
    """Those of `names` this machine would compile on first use: compatible, not shipped prebuilt,
    and not in torch's extension cache yet."""
    from deepspeed.git_version_info import installed_ops
    from torch.utils.cpp_extension import _get_build_directory

    compatible = compatible_ops()
    missing = []
    for name in names:
        builder = _builder(name)
        if builder is None or installed_ops.get(builder.name) or not compatible.get(builder.NAME, False):
            continue
        build_dir = _get_build_directory(builder.name, verbose=False)
        if not any(p.endswith(".so") for p in _listdir(build_dir)) or not built_here(build_dir) or not up_to_date(build_dir):
            missing.append(name)
    return missing


def compatible_ops() -> Dict[str, bool]:
    """DeepSpeed's compatibility of every op with this machine. Working it out compiles test programs
    (async_io links against libaio), and distutils echoes their gcc command lines on standard output
    when something has raised its log level: they are kept off the console."""
    import deepspeed.ops

    sys.stdout.flush()
    saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    try:
        return dict(deepspeed.ops.__compatible_ops__)
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def built_here(build_dir: str) -> bool:
    """The cached build was made from this installation's DeepSpeed and torch, by the paths this process
    imports them from: another virtualenv's build has other source and include paths in its
    build.ninja, and so has a build made through the real path of an environment this process reaches
    through a link (a linked .venv); torch would rebuild either on first use, inside an experiment."""
    import deepspeed
    import torch

    try:
        with open(os.path.join(build_dir, "build.ninja")) as f:
            text = f.read()
    except OSError:
        return False
    return all(os.path.abspath(os.path.dirname(m.__file__)) in text for m in (deepspeed, torch))


def up_to_date(build_dir: str) -> bool:
    """The ninja on PATH, the one torch runs in the ranks, has nothing to do in the build folder (a dry
    run). A cache that another ninja version built (pip's in a virtualenv, the system's) is rebuilt on
    first use: the two versions do not read each other's logs the same way."""
    ninja = shutil.which("ninja")
    if ninja is None:
        return True  # torch cannot build without it either, and says so
    try:
        run = subprocess.run([ninja, "-C", build_dir, "-n"], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return run.returncode == 0 and "no work to do" in run.stdout


def _locks(names: List[str]) -> List[str]:
    """The build locks torch takes for these op builders' cache folders (a builder this machine lacks has none)."""
    from torch.utils.cpp_extension import _get_build_directory

    return [os.path.join(_get_build_directory(b.name, verbose=False), "lock") for b in map(_builder, names) if b is not None]


def on_local_disk(path: str) -> bool:
    """The file system that holds `path` is one only this machine writes to."""
    import psutil

    real = os.path.realpath(path)
    mounts = [p for p in psutil.disk_partitions(all=True) if real == p.mountpoint or real.startswith(p.mountpoint.rstrip("/") + "/")]
    return bool(mounts) and max(mounts, key=lambda p: len(p.mountpoint)).fstype in LOCAL_FILESYSTEMS


def stale_locks(names: List[str]) -> List[str]:
    """Build locks left by a build that was killed: torch waits on such a lock forever, so every
    experiment would hang at start-up. torch's FileBaton holds its lock file open until the build
    is over, so a lock no process here holds open, and older than its grace, is stale."""
    return _stale(_locks(names))


def _stale(locks: List[str]) -> List[str]:
    import time

    found = []
    for lock in locks:
        try:
            age = time.time() - os.path.getmtime(lock)  # OSError: no lock
            if age > (LOCAL_LOCK_GRACE_S if on_local_disk(lock) else SHARED_LOCK_GRACE_S) and not _held_open(lock):
                found.append(lock)
        except OSError:
            pass
    return found


def remove_stale_locks(ds_config: Optional[Dict[str, Any]], say) -> None:
    """Remove the stale locks of the ops this config loads. Every rank takes the lock for a moment
    when it loads an op, even a built one: a rank killed in that moment (its worker SIGKILLed, an
    experiment timed out) leaves it, and the ranks already waiting on it go on once it is gone."""
    _remove(stale_locks(needed(ds_config)), say)


def _remove(locks: List[str], say) -> None:
    for lock in locks:
        say(f"mlautotune: removing {lock}, left by a DeepSpeed op build that was killed (it would make every experiment wait forever)")
        try:
            os.unlink(lock)
        except FileNotFoundError:
            pass  # another worker removed it first


def wait_for_locks(names: List[str], say) -> None:
    """Until no build lock of these ops is left: a build would wait on one forever, like torch. A
    stale one is removed once past its grace; a live one is another process's build of the op."""
    import time

    locks, told = _locks(names), False
    while present := [lock for lock in locks if os.path.exists(lock)]:
        _remove(_stale(present), say)
        if not told and any(os.path.exists(lock) for lock in present):
            say(f"mlautotune: waiting for {', '.join(present)}: another process is building the op, or a killed build left the lock "
                f"(removed once no process holds it and it is {LOCAL_LOCK_GRACE_S:.0f} s old, {SHARED_LOCK_GRACE_S:.0f} s on a shared file system)")
            told = True
        time.sleep(1.0)


def _held_open(path: str) -> bool:
    import psutil

    real = os.path.realpath(path)
    for p in psutil.process_iter():
        try:
            if any(f.path == real for f in p.open_files()):
                return True
        except psutil.Error:
            continue
    return False


def _listdir(path: str) -> List[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def build(names: List[str], timeout_s: float = 1800.0) -> subprocess.CompletedProcess:
    """Compile the ops in a child process (a failed build must not take the tuner down with it)."""
    return subprocess.run([sys.executable, "-m", "mlautotune.run.ops", "--builders", *names], capture_output=True, text=True,
                          timeout=timeout_s, stdin=subprocess.DEVNULL)


def environment_cache(say) -> None:
    """Give this environment an extension cache of its own when torch's shared default holds another
    environment's build of the ops (another virtualenv's DeepSpeed or torch): the two would rebuild
    each other's ops at every switch (one build per op in that cache). TORCH_EXTENSIONS_DIR, set here,
    is inherited by every experiment; one the user set is left alone."""
    from torch.utils.cpp_extension import get_default_build_root

    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return
    import hashlib

    default = get_default_build_root()
    own = os.path.join(default, "env-" + hashlib.sha256(os.path.abspath(sys.prefix).encode()).hexdigest()[:10])  # a link: a cache of its own
    fresh = not os.path.isdir(own)  # (torch's look at a build folder creates it)
    if not ((not fresh and _comm_build_here(own)) or _comm_build_elsewhere(default)):
        return
    os.environ["TORCH_EXTENSIONS_DIR"] = own
    if fresh:
        say(f"mlautotune: {default} holds another environment's build of DeepSpeed's ops; this environment ({sys.prefix}) builds its own in {own}, "
            "so the two do not rebuild each other's.")


def _comm_build_dir() -> Optional[str]:
    from torch.utils.cpp_extension import _get_build_directory

    builder = _builder(COMM_OP)
    return _get_build_directory(builder.name, verbose=False) if builder is not None else None


def _comm_build_here(root: str) -> bool:
    """root holds this environment's build of the comm op."""
    saved = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = root
    try:
        build_dir = _comm_build_dir()
        return build_dir is not None and os.path.isdir(build_dir) and built_here(build_dir)
    finally:
        os.environ.pop("TORCH_EXTENSIONS_DIR") if saved is None else os.environ.__setitem__("TORCH_EXTENSIONS_DIR", saved)


def _comm_build_elsewhere(root: str) -> bool:
    """root (torch's default cache) holds another environment's build of the comm op."""
    saved = os.environ.pop("TORCH_EXTENSIONS_DIR", None)
    try:
        build_dir = _comm_build_dir()
        return build_dir is not None and os.path.isfile(os.path.join(build_dir, "build.ninja")) and not built_here(build_dir)
    finally:
        if saved is not None:
            os.environ["TORCH_EXTENSIONS_DIR"] = saved


def ensure_built(ds_config: Optional[Dict[str, Any]], say) -> float:
    """Build what an experiment with this config would compile on first use; return the seconds spent.
    A build that fails is reported and left to the experiments (which then fail with DeepSpeed's own error)."""
    import time

    environment_cache(say)
    remove_stale_locks(ds_config, say)
    missing = unbuilt(needed(ds_config))
    if not missing:
        return 0.0
    started = time.monotonic()
    wait_for_locks(missing, say)
    say(f"mlautotune: building DeepSpeed's {accelerator()} ops ({', '.join(missing)}), once per machine; this time is not part of any experiment ...")
    try:
        done = build(missing)
        ok, detail = done.returncode == 0, (done.stderr or done.stdout).strip().splitlines()[-3:]
    except subprocess.TimeoutExpired:
        ok, detail = False, ["the build took over 30 minutes"]
    seconds = time.monotonic() - started
    say(f"mlautotune: DeepSpeed's ops built in {seconds:.0f} s" if ok else
        f"mlautotune: warning: building DeepSpeed's ops failed; experiments will build them themselves: {' | '.join(detail)}")
    return seconds


def accelerator_name() -> str:
    """DeepSpeed's accelerator here: "cpu", "cuda", ..."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name()


def accelerator() -> str:
    name = accelerator_name()
    return "CPU" if name == "cpu" else name.upper()


def main(argv: List[str]) -> None:
    if argv[:1] == ["--builders"]:
        for name in argv[1:]:
            _builder(name).load(verbose=False)
        return
    import hjson

    from mlautotune.inputs.config import BUNDLED_CONFIG

    path = argv[0] if argv else BUNDLED_CONFIG
    with open(path) as f:
        ds_config = hjson.loads(f.read())
    if not ensure_built(ds_config, print):
        print("mlautotune: DeepSpeed's ops are already built on this machine")


if __name__ == "__main__":
    main(sys.argv[1:])
