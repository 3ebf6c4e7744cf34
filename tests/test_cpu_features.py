"""The per-machine cache in front of py-cpuinfo, which DeepSpeed's op loading asks in every rank."""

import json
import subprocess
import sys

from mlautotune.run import cpu_features

ASK = """
import json, sys, time
import cpuinfo
from mlautotune.run import cpu_features
path = cpu_features.install(sys.argv[1])
from cpuinfo import get_cpu_info  # as DeepSpeed's op builders import it, inside their methods
start = time.perf_counter()
info = get_cpu_info()
print(json.dumps({"path": path, "arch": info.get("arch"), "flags": info.get("flags"), "marker": info.get("marker"),
                  "seconds": time.perf_counter() - start}))
"""


def ask(folder) -> dict:
    out = subprocess.run([sys.executable, "-c", ASK, str(folder)], capture_output=True, text=True, check=True).stdout
    return json.loads(out.splitlines()[-1])


def test_the_first_process_fills_the_cache_and_the_next_ones_read_it(tmp_path):
    first = ask(tmp_path)
    cached = json.loads(open(first["path"]).read())
    assert first["arch"] and cached["arch"] == first["arch"] and cached["flags"] == first["flags"]
    cached["marker"] = "from the file"
    open(first["path"], "w").write(json.dumps(cached))
    second = ask(tmp_path)
    assert second["path"] == first["path"] and second["marker"] == "from the file"  # py-cpuinfo was not asked again


def test_a_broken_cache_file_is_asked_again_and_rewritten(tmp_path):
    path = ask(tmp_path)["path"]
    open(path, "w").write("{not json")
    again = ask(tmp_path)
    assert again["arch"] and json.loads(open(path).read())["arch"] == again["arch"]


def test_another_cpu_has_another_file_and_the_clock_speed_does_not_count(tmp_path):
    intel = "vendor_id\t: GenuineIntel\nmodel name\t: Xeon\ncpu MHz\t\t: 2000.1\nflags\t\t: fpu avx2\n"
    (tmp_path / "a").write_text(intel * 2)
    (tmp_path / "b").write_text(intel.replace("2000.1", "3100.7") * 2)
    (tmp_path / "c").write_text(intel.replace("avx2", "avx2 avx512f") * 2)
    a, b, c = (cpu_features.fingerprint(str(tmp_path / n)) for n in "abc")
    assert a == b != c and a is not None


def test_without_proc_cpuinfo_nothing_is_cached(tmp_path):
    import cpuinfo

    before = cpuinfo.get_cpu_info
    assert cpu_features.install(str(tmp_path), cpuinfo_path=str(tmp_path / "missing")) is None
    assert cpuinfo.get_cpu_info is before and list(tmp_path.iterdir()) == []


def test_installed_twice_wraps_py_cpuinfo_once(tmp_path, monkeypatch):
    import cpuinfo

    calls = []
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: calls.append(1) or {"arch": "X86_64", "flags": ["avx2"]})
    cpu_features.install(str(tmp_path / "one"))
    cpu_features.install(str(tmp_path / "two"))
    assert cpuinfo.get_cpu_info() == cpuinfo.get_cpu_info() == {"arch": "X86_64", "flags": ["avx2"]}
    assert len(calls) == 1 and [p.name.startswith("cpuinfo-") for p in (tmp_path / "two").iterdir()] == [True]
