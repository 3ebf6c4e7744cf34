"""Host names from a hostfile and from launcher.include/exclude, checked before anything reaches ssh,
pdsh or DeepSpeed's runner: each must be a host name or an IP address, so that nothing from these
inputs is ever read as an option (`-oProxyCommand=...` would run its command inside ssh)."""

import ipaddress
import re
from pathlib import Path
from typing import Dict

from mlautotune.errors import UserError

# RFC 1123 labels (underscores allowed, as container and cluster names use them), dot-separated.
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOSTNAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")
_LINE = re.compile(r"(\S+)\s+slots=(\S+)")
HOSTFILE_FORM = "Each line must read '<hostname> slots=<number of GPUs>', e.g. 'worker-1 slots=8' (a host name or an IP address)."


def is_host(name: str) -> bool:
    """A host name (RFC 1123, at most 253 characters) or an IPv4/IPv6 address; never something starting with `-`."""
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    return len(name) <= 253 and _HOSTNAME.fullmatch(name) is not None


def read_hostfile(path: Path) -> Dict[str, int]:
    """The hostfile's hosts and slots, each line checked (DeepSpeed's own parser reads `slots=1.5` as 1)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as e:
        raise UserError(f"The hostfile {str(path)!r} cannot be read ({e.strerror}).", "Check its permissions, or pass another launcher.hostfile.")
    pool: Dict[str, int] = {}
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.fullmatch(line)
        if not m:
            raise UserError(f"The hostfile {str(path)!r} is malformed: line {number} ({_show(line)}) is not '<host> slots=<n>'.", HOSTFILE_FORM)
        host, slots = m.groups()
        if not is_host(host):
            raise UserError(f"The hostfile {str(path)!r} names the host {_show(host)} on line {number}, which is not a host name or an IP address.",
                            "Write the node's host name (letters, digits, - and _, dot-separated, not starting with -) or its address; " + HOSTFILE_FORM)
        if not slots.isdigit() or int(slots) < 1:
            raise UserError(f"The hostfile {str(path)!r} is malformed: host {host!r} has slots={_show(slots)} on line {number}, which is not a whole number of GPUs of at least 1.",
                            HOSTFILE_FORM)
        if host in pool:
            raise UserError(f"The hostfile {str(path)!r} lists host {host!r} twice (line {number}); DeepSpeed refuses that.", "Keep one line per host.")
        pool[host] = int(slots)
    if not pool:
        raise UserError(f"The hostfile {str(path)!r} lists no hosts.", HOSTFILE_FORM)
    return pool


def check_selection(text: str, key: str) -> None:
    """launcher.include/exclude: `host[:slot,slot]` parts joined by `@` (DeepSpeed's syntax), each host checked."""
    for part in text.split("@"):
        host, _, slots = part.partition(":")
        if not is_host(host):
            raise UserError(f"launcher.{key}={_show(text)} names {_show(host)}, which is not a host name or an IP address.",
                            f"Write launcher.{key} as DeepSpeed does, e.g. 'worker-1:0,1@worker-2' (host names, optionally with slot numbers).")
        if slots and not all(s.strip().isdigit() for s in slots.split(",")):
            raise UserError(f"launcher.{key}={_show(text)} gives host {host!r} the slots {_show(slots)}, which are not slot numbers.",
                            f"Write launcher.{key} like 'worker-1:0,1@worker-2' (comma-separated slot numbers after the colon).")


def _show(text: str) -> str:
    return repr(text if len(text) <= 80 else text[:77] + "...")
