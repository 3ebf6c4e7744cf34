"""DeepSpeed's JIT ops are built once per machine, before any experiment, never inside one."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.utils.cpp_extension import _get_build_directory

from mlautotune.run import ops


def test_needed_follows_the_optimizer_and_its_offload():
    assert ops.needed(None) == ["ShareMemCommBuilder"]
    assert ops.needed({"optimizer": {"type": "AdamW"}}) == ["ShareMemCommBuilder", "FusedAdamBuilder"]
    offload = {"optimizer": {"type": "Adam"}, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert ops.needed(offload) == ["ShareMemCommBuilder", "CPUAdamBuilder"]
    assert ops.needed({"optimizer": {"type": "Adagrad"}}) == ["ShareMemCommBuilder"]  # only under offload
    torch_adam = {"optimizer": {"type": "Adam", "params": {"torch_adam": True}}, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    assert ops.needed(torch_adam) == ["ShareMemCommBuilder"]  # on a GPU, no FusedAdam JIT build before the first experiment
    assert ops.needed({"optimizer": {"type": "SGD"}, "zero_optimization": "not a dict"}) == ["ShareMemCommBuilder"]


def test_a_fresh_extension_cache_has_everything_unbuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert ops.unbuilt(["ShareMemCommBuilder", "FusedAdamBuilder", "NoSuchBuilder"]) == ["ShareMemCommBuilder", "FusedAdamBuilder"]


def test_a_lock_left_by_a_killed_build_is_stale_and_a_held_one_is_not(tmp_path, monkeypatch):
    """torch's FileBaton keeps its lock open while it builds: an old lock that nobody holds was left by a killed build."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = Path(_get_build_directory("deepspeed_shm_comm", verbose=False)) / "lock"
    holder = subprocess.Popen([sys.executable, "-c", "import os, sys, time; os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); print(flush=True); time.sleep(60)",
                               str(lock)], stdout=subprocess.PIPE)
    try:
        holder.stdout.readline()  # the lock is created and held
        os.utime(lock, (time.time() - 3600, time.time() - 3600))
        assert ops.stale_locks(["ShareMemCommBuilder"]) == []  # a build is running right now, however long
    finally:
        holder.kill()
        holder.wait()
    assert ops.stale_locks(["ShareMemCommBuilder"]) == [str(lock)]  # its builder is gone
    assert ops.on_local_disk(str(lock))
    half_a_minute_ago = time.time() - 30
    os.utime(lock, (half_a_minute_ago, half_a_minute_ago))
    assert ops.stale_locks(["ShareMemCommBuilder"]) == [str(lock)]  # on a local disk no other machine may hold it
    os.utime(lock)
    assert ops.stale_locks(["ShareMemCommBuilder"]) == []  # too young: its holder may have started while the processes were looked at


def test_only_a_file_system_of_this_machine_s_own_counts_as_a_local_disk():
    import psutil

    kinds = {p.mountpoint: p.fstype for p in psutil.disk_partitions(all=True)}
    assert ops.on_local_disk("/dev/shm/x") == (kinds.get("/dev/shm") == "tmpfs")
    assert not ops.on_local_disk("/proc/self/status")  # proc: not a disk at all
    assert "nfs" not in ops.LOCAL_FILESYSTEMS and "nfs4" not in ops.LOCAL_FILESYSTEMS and "lustre" not in ops.LOCAL_FILESYSTEMS


def test_a_build_made_by_another_installation_counts_as_unbuilt(tmp_path, monkeypatch):
    """Another virtualenv's build (other source paths in build.ninja): torch would rebuild it on first use."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build = Path(_get_build_directory("fused_adam", verbose=False))
    (build / "fused_adam.so").write_bytes(b"")
    (build / "build.ninja").write_text("cflags = -I/elsewhere/.venv/lib/python3.11/site-packages/deepspeed/ops/csrc/includes\n")
    assert ops.unbuilt(["FusedAdamBuilder"]) == ["FusedAdamBuilder"]
    real = Path(_get_build_directory("fused_adam", verbose=False))
    import deepspeed
    import torch

    here = [str(Path(m.__file__).parent) for m in (deepspeed, torch)]
    built_by_ninja(real, "fused_adam.so", "# " + " ".join(f"-I{p}/include" for p in here))
    assert ops.unbuilt(["FusedAdamBuilder"]) == []


def built_by_ninja(build: Path, output: str, comment: str) -> Path:
    """A build folder like torch's: a build.ninja (with `comment` in it) that makes `output` from a
    source file, built by the ninja on PATH, the one torch runs. Returns the source."""
    source = build / "source.cpp"
    source.write_text("int x;\n")
    (build / output).unlink(missing_ok=True)
    (build / "build.ninja").write_text(f"{comment}\nrule copy\n  command = cp $in $out\nbuild {output}: copy {source}\n")
    subprocess.run([shutil.which("ninja"), "-C", str(build)], check=True, capture_output=True)
    return source


def test_a_build_that_the_ninja_on_path_would_redo_counts_as_unbuilt(tmp_path, monkeypatch):
    """Two ninja versions (pip's in the virtualenv, the system's) each rebuild what the other built:
    whether the cache is current is ninja's own answer (a dry run), not the files' presence."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    import deepspeed
    import torch

    build = Path(_get_build_directory("fused_adam", verbose=False))
    source = built_by_ninja(build, "fused_adam.so", "# " + " ".join(f"-I{Path(m.__file__).parent}/include" for m in (deepspeed, torch)))
    assert ops.unbuilt(["FusedAdamBuilder"]) == []
    later = time.time() + 60
    os.utime(source, (later, later))  # ninja would build again: here a newer source, there another version's log
    assert ops.unbuilt(["FusedAdamBuilder"]) == ["FusedAdamBuilder"]
    assert "no work to do" not in subprocess.run([shutil.which("ninja"), "-C", str(build), "-n"], capture_output=True, text=True).stdout


@pytest.mark.e2e
def test_a_build_waits_out_a_lock_that_a_killed_rank_left_and_removes_it(tmp_path):
    """A rank SIGKILLed while it loaded an op (every rank takes torch's lock for a moment) leaves the
    lock. The next session's build of a missing op went straight to torch's load, which waits on a
    lock forever: 30 minutes, the build's timeout (a resumed session in CI). Here the op's objects
    are kept, so its build is a quick relink."""
    assert ops.unbuilt(["ShareMemCommBuilder", "FusedAdamBuilder"]) == [], "setup.sh builds the ops"
    cache = tmp_path / "torch_extensions"
    shutil.copytree(Path(_get_build_directory("fused_adam", verbose=False)).parent, cache, ignore=shutil.ignore_patterns("lock"))
    (cache / "fused_adam" / "fused_adam.so").unlink()
    (cache / "fused_adam" / "lock").touch()  # just left: younger than its grace
    config = tmp_path / "ds.json"
    config.write_text('{"optimizer": {"type": "AdamW"}}')
    done = subprocess.run([sys.executable, "-m", "mlautotune.run.ops", str(config)], env={**os.environ, "TORCH_EXTENSIONS_DIR": str(cache)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "waiting for" in done.stdout and "left by a DeepSpeed op build that was killed" in done.stdout, done.stdout
    assert (cache / "fused_adam" / "fused_adam.so").is_file() and not (cache / "fused_adam" / "lock").exists()


@pytest.mark.e2e
def test_a_session_builds_missing_ops_before_its_first_experiment(tmp_path):
    """A machine whose cache lacks fused_adam (its objects kept, so the build is a quick relink):
    the command says it builds, builds before the experiment starts, and the experiment runs."""
    assert ops.unbuilt(["ShareMemCommBuilder", "FusedAdamBuilder"]) == [], "setup.sh builds the ops"
    real_cache = Path(_get_build_directory("fused_adam", verbose=False)).parent
    cache = tmp_path / "torch_extensions"
    shutil.copytree(real_cache, cache, ignore=shutil.ignore_patterns("lock"))  # a build in progress elsewhere
    (cache / "fused_adam" / "fused_adam.so").unlink()

    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(cache)}
    argv = [sys.executable, "-m", "mlautotune", "experiment", "launcher.num_gpus=2", "tracking.enabled=false",
            "script_args=--num_layers 1 --hidden_size 32 --num_heads 2 --seq_len 32 --vocab_size 256"]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "building DeepSpeed's CPU ops (FusedAdamBuilder), once per machine" in out
    assert out.index("DeepSpeed's ops built") < out.index("mlautotune: running")  # before, not inside, the experiment
    assert (cache / "fused_adam" / "fused_adam.so").is_file()
    assert "status: ok" in out
    assert "-laio" not in out and "gcc " not in out  # DeepSpeed's op compatibility probe compiles quietly


def test_an_environment_gets_its_own_op_cache_when_the_default_holds_another_environments_build(tmp_path, monkeypatch):
    """Two virtualenvs on one machine shared torch's default cache, one build per op: each switch rebuilt
    the ops (67-193 s). The second environment now builds in a cache of its own, said once; an
    environment whose build the default holds keeps using it."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "unset")
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    build = Path(ops._comm_build_dir())
    assert str(build).startswith(str(tmp_path))
    build.mkdir(parents=True, exist_ok=True)  # torch's look at the folder creates it
    (build / "build.ninja").write_text("cflags = -I/other/venv/lib/python3.11/site-packages/deepspeed/ops/csrc\n")
    said = []
    ops.environment_cache(said.append)
    own = os.environ["TORCH_EXTENSIONS_DIR"]
    assert Path(own).parent == tmp_path / "torch_extensions" and Path(own).name.startswith("env-")
    assert len(said) == 1 and "another environment's build" in said[0] and own in said[0]

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    import deepspeed
    import torch

    (build / "build.ninja").write_text(f"cflags = -I{os.path.dirname(deepspeed.__file__)} -I{os.path.dirname(torch.__file__)}\n")
    ops.environment_cache(said.append)
    assert "TORCH_EXTENSIONS_DIR" not in os.environ  # the default holds this environment's build


def test_a_build_made_through_the_real_path_is_not_one_through_a_link(tmp_path, monkeypatch):
    """A `.venv` that links to the environment imports DeepSpeed from the link's path: torch writes
    that path into build.ninja, so a build made through the real path would be compiled again on first
    use, inside an experiment and against its timeout: it is not this process's build, and the
    session builds the ops before any experiment."""
    import deepspeed
    import torch

    here = [os.path.abspath(os.path.dirname(m.__file__)) for m in (deepspeed, torch)]
    (tmp_path / "build.ninja").write_text(f"cflags = -I{here[0]} -I{here[1]}\n")
    assert ops.built_here(str(tmp_path))
    link = tmp_path / "venv-link"
    link.symlink_to(Path(deepspeed.__file__).parents[1])  # site-packages, through a link
    monkeypatch.setattr(deepspeed, "__file__", str(link / "deepspeed" / "__init__.py"))
    assert not ops.built_here(str(tmp_path))
    (tmp_path / "build.ninja").write_text(f"cflags = -I{link / 'deepspeed'} -I{here[1]}\n")
    assert ops.built_here(str(tmp_path))
