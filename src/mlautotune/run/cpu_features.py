"""DeepSpeed's questions about the CPU, answered once per machine.

Every time DeepSpeed loads one of its C++ ops (the CPU all-reduce at `init_distributed`, the Adam
op, ...), its op builder asks py-cpuinfo for the architecture and the SIMD flags
(`OpBuilder.cpu_arch`, `OpBuilder.simd_width`, `DeepSpeedCPUAdam`). py-cpuinfo answers each call by
starting a new Python process (~1.4 s here), several times per rank, in every experiment. The
answer depends only on the CPU, so the probe puts a cache in front of `cpuinfo.get_cpu_info`: a
file per CPU model and flag set (in mlautotune's cache folder), filled by the first process that
asks. Ranks on other hosts, with other CPUs, have other files.
"""

import hashlib
import json
import os
import platform
from typing import Optional

from mlautotune.files import atomic_write_json

CPU_KEYS = ("vendor_id", "model name", "flags", "features", "cpu implementer", "cpu part", "isa", "uarch")


def cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mlautotune")


def fingerprint(cpuinfo_path: str = "/proc/cpuinfo") -> Optional[str]:
    """What identifies this CPU (architecture, vendor, model, flags), or None where the kernel does
    not say (no /proc/cpuinfo): then nothing is cached."""
    try:
        with open(cpuinfo_path) as f:
            lines = {line.strip() for line in f if line.split(":", 1)[0].strip().lower() in CPU_KEYS}
    except OSError:
        return None
    if not lines:
        return None
    return hashlib.sha256("\n".join([platform.machine(), *sorted(lines)]).encode()).hexdigest()[:20]


def cache_file(folder: Optional[str] = None, cpuinfo_path: str = "/proc/cpuinfo") -> Optional[str]:
    """This CPU's cache file, or None when this CPU has no fingerprint."""
    key = fingerprint(cpuinfo_path)
    return None if key is None else os.path.join(folder or cache_dir(), f"cpuinfo-{key}.json")


def install(folder: Optional[str] = None, cpuinfo_path: str = "/proc/cpuinfo") -> Optional[str]:
    """Answer `cpuinfo.get_cpu_info()` from this CPU's cache file from now on (filled on first use);
    the file's path, or None when nothing is cached (no py-cpuinfo, or no fingerprint)."""
    try:
        import cpuinfo
    except ImportError:
        return None
    path = cache_file(folder, cpuinfo_path)
    if path is None:
        return None
    ask = getattr(cpuinfo.get_cpu_info, "asks", cpuinfo.get_cpu_info)  # installed twice: wrap the original once
    known: dict = {}

    def get_cpu_info() -> dict:
        if not known:
            known.update(_read(path) or _write(path, ask()))
        return dict(known)

    get_cpu_info.asks = ask
    cpuinfo.get_cpu_info = get_cpu_info
    return path


def _read(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and info.get("arch") else None


def _write(path: str, info: dict) -> dict:
    if info.get("arch"):  # py-cpuinfo failed (an empty answer): ask again next time
        try:
            atomic_write_json(path, info)
        except OSError:
            pass  # a read-only home: every process asks, as without the cache
    return info
