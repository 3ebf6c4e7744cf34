"""Ranks on other hosts end with their experiment: the lifeline between each rank and the tuner.

A "remote rank" here is a real process that holds the lifeline as the probe does and sleeps; it must
end when the tuner cuts the experiment's line, and when the tuner process itself dies (SIGKILL)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

from mlautotune.run.lifeline import SHM_DIR, Lifeline

RANK = textwrap.dedent("""
    import sys, time
    from mlautotune.run.lifeline import hold
    host, port, token = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    assert hold((host, port), token)
    print("holding", flush=True)
    time.sleep(120)
""")

TUNER = textwrap.dedent("""
    import time
    from mlautotune.run.lifeline import tuner_lifeline
    host, port = tuner_lifeline().address
    print(host, port, flush=True)
    time.sleep(120)
""")


BUFFER_RANK = textwrap.dedent("""
    import sys, time
    from mlautotune.run.lifeline import hold
    open(sys.argv[1], "wb").close()  # what DeepSpeed's shm all-reduce creates, and never removes
    if len(sys.argv) > 2:
        assert hold((sys.argv[2], int(sys.argv[3])), sys.argv[4])
    print("holding", flush=True)
    time.sleep(120)
""")


def start_rank(host, port, token, wait_until_holding=True):
    # its own session, like ranks that another node's launcher started: the tuner cannot signal them
    rank = subprocess.Popen([sys.executable, "-c", RANK, host, str(port), token], stdout=subprocess.PIPE, text=True, start_new_session=True)
    if wait_until_holding:
        assert rank.stdout.readline().strip() == "holding"
    return rank


def ended_within(proc, seconds):
    try:
        proc.wait(timeout=seconds)
        return True
    except subprocess.TimeoutExpired:
        proc.kill()
        return False


def test_cutting_an_experiment_ends_its_ranks_and_only_them():
    lifeline = Lifeline()
    host, port = lifeline.address
    mine, other = start_rank(host, port, "exp-a"), start_rank(host, port, "exp-b")
    deadline = time.monotonic() + 10
    while (lifeline.connected("exp-a"), lifeline.connected("exp-b")) != (1, 1) and time.monotonic() < deadline:
        time.sleep(0.05)
    lifeline.cut("exp-a")
    assert ended_within(mine, 10) and mine.returncode == -signal.SIGKILL
    assert other.poll() is None  # another experiment's rank keeps running
    lifeline.cut("exp-b")
    assert ended_within(other, 10)


def test_a_rank_that_connects_after_its_experiment_ended_ends_at_once():
    lifeline = Lifeline()
    host, port = lifeline.address
    lifeline.cut("late")
    rank = start_rank(host, port, "late", wait_until_holding=False)  # it may be gone before it can say so
    assert ended_within(rank, 10)


def test_ranks_end_when_the_tuner_is_killed():
    tuner = subprocess.Popen([sys.executable, "-c", TUNER], stdout=subprocess.PIPE, text=True)
    host, port = tuner.stdout.readline().split()
    rank = start_rank(host, int(port), "exp")
    tuner.send_signal(signal.SIGKILL)
    tuner.wait()
    assert ended_within(rank, 10)
    assert not psutil.pid_exists(rank.pid) or psutil.Process(rank.pid).status() == psutil.STATUS_ZOMBIE


def test_the_rank_that_ends_its_experiment_removes_every_ranks_shared_memory_buffer_on_its_host():
    """One rank sees the line cut and kills its group; its peer, killed before it could remove its own
    all-reduce buffer, must not leave it behind (66 MiB of RAM per rank and experiment)."""
    lifeline = Lifeline()
    host, port = lifeline.address
    master_port = str(50000 + os.getpid() % 10000)
    buffers = [SHM_DIR / f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{master_port}_{r}" for r in (0, 1)]
    env = lambda rank: {**os.environ, "MASTER_PORT": master_port, "RANK": str(rank)}
    holder = subprocess.Popen([sys.executable, "-c", BUFFER_RANK, str(buffers[0]), host, str(port), "exp"],
                              stdout=subprocess.PIPE, text=True, env=env(0), process_group=0)
    peer = subprocess.Popen([sys.executable, "-c", BUFFER_RANK, str(buffers[1])], stdout=subprocess.PIPE, text=True, env=env(1),
                            process_group=holder.pid)
    try:
        assert peer.stdout.readline().strip() == "holding" and holder.stdout.readline().strip() == "holding"
        assert all(b.exists() for b in buffers)
        lifeline.cut("exp")
        assert ended_within(holder, 10) and ended_within(peer, 10)
        assert [b for b in buffers if b.exists()] == []
    finally:
        for b in buffers:
            b.unlink(missing_ok=True)
