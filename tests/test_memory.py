"""The memory model: the ZeRO formula, the fitted activation line, calibration and OOM bounds."""

import pytest

from mlautotune.search.memory import MemoryModel, optimizer_bytes

GiB = 2**30
ADAM = {"optimizer": {"type": "AdamW"}}


def model(ds=None, world=8, mp=1, limit=16 * GiB, device="cuda", n=1_000_000_000):
    return MemoryModel(n, n, {**ADAM, **(ds or {})}, world, mp, limit, device)


def test_bf16_is_not_costed_as_fp32():
    fp32 = model().model_states(0)
    bf16 = model({"bf16": {"enabled": True}}).model_states(0)
    assert fp32 == pytest.approx(1e9 * (4 + 4 + 8))
    assert bf16 == pytest.approx(1e9 * (2 + 2 + 4 + 8))


def test_zero_partitions_over_the_data_parallel_degree():
    m = model({"bf16": {"enabled": True}}, world=8, mp=2)  # dp = 4, params per rank halved by mp
    p = 1e9 / 2
    assert m.model_states(1) == pytest.approx(p * (2 + 2 + (4 + 8) / 4))
    assert m.model_states(2) == pytest.approx(p * (2 + (2 + 4 + 8) / 4))
    assert m.model_states(3) == pytest.approx(p * (2 + 2 + 4 + 8) / 4)


def test_offload_is_respected_on_accelerators_not_on_cpu():
    ds = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "nvme"}}}
    assert model(ds).model_states(3) == pytest.approx(4e9 / 8)  # only the partitioned fp32 gradients stay
    assert model(ds, device="cpu").model_states(3) == model(device="cpu").model_states(3)


def test_optimizer_state_bytes():
    assert optimizer_bytes({"type": "Adam"}) == 8
    assert optimizer_bytes({"type": "SGD", "params": {"momentum": 0.9}}) == 4
    assert optimizer_bytes({"type": "SGD"}) == 0
    assert optimizer_bytes({"type": "Adagrad"}) == 4


def test_two_points_fit_the_activation_line_and_predict_the_largest_micro_batch():
    m = model(world=2, n=10_000_000)
    states = m.model_states(0)
    m.observe(0, 1, int(states + 1 * GiB + 100 * 2**20), oom=False)
    m.observe(0, 4, int(states + 1 * GiB + 400 * 2**20), oom=False)
    assert m.per_sample == pytest.approx(100 * 2**20)
    assert m.fixed == pytest.approx(1 * GiB, rel=1e-6)
    assert m.max_micro_batch(0) == int((16 * GiB - 1 * GiB - states) / (100 * 2**20))
    assert m.max_micro_batch(0, cap=8) == 8
    assert m.fits(3, m.max_micro_batch(0))  # stage 3 keeps less per rank


def test_memory_that_grows_faster_at_larger_micro_batches_puts_the_edge_under_it():
    """A CPU rank's RSS grows faster than linearly. Recorded (a one-draw recording of
    benchmarks/landscapes/cpu_gpt-4M_fast.json's workload; z0, 1 rank, limit 1.2 GiB): it fits at 24 and grows 23 MB per sample from 16 to 24, so it runs out
    of memory from 30 on (32 recorded). The line through 1, 4, 8 and 16 says 31 fits; the steepest
    growth seen, 4 -> 8, carried on beyond 8, does not."""
    peaks = {1: 675713024, 4: 728145920, 8: 820371456, 16: 975826944, 24: 1160052736}
    m = MemoryModel(4240896, 4240896, {"optimizer": {"type": "Adam"}}, 1, 1, 1288490188, "cpu")
    for mbs in (1, 4, 8, 16):
        m.observe(0, mbs, peaks[mbs], oom=False)
    over = 24 + (1288490188 - peaks[24]) / ((peaks[24] - peaks[16]) / 8)
    assert 24 <= m.max_micro_batch(0) < over < 30


def test_memory_linear_in_the_micro_batch_keeps_the_line_whatever_each_stage_s_slope():
    """Per-stage slopes differ (fragmentation, buffers); none is curvature: the edge is the line's."""
    m = model(world=2, n=10_000_000)
    for stage, slope in ((0, 100), (2, 110)):
        for mbs in (1, 4, 16):
            m.observe(stage, mbs, int(m.model_states(stage) + 1 * GiB + mbs * slope * 2**20), oom=False)
    for stage in (0, 1, 2, 3):
        assert m.max_micro_batch(stage) == int((16 * GiB - m.predict(stage, 0)) / m.per_sample)


def test_an_edge_probe_that_ran_out_of_memory_moves_every_stage_s_edge_under_it():
    """Seen in a run of the README's first command (2 CPU ranks, limit 1 GiB): z0 ran out of memory at 32
    (its peak, 1093337088 bytes, is recorded here), then z1, with less memory per rank and so not
    bounded by z0's OOM, was sent to 32 too and ran out of memory there. z0's peaks at micro-batch 1
    and 4 were not kept; here they lie in one allocator chunk (6 MB apart), so the line through them
    puts every edge far above 32. The growth from 4 to z0's OOM is the fastest seen: carried on from
    4, it puts z1's edge (and z0's and z3's) under 32."""
    limit = 1 * GiB
    m = MemoryModel(937472, 937472, {"optimizer": {"type": "Adam"}}, 2, 1, limit, "cpu")
    m.observe(0, 1, 749_000_000, oom=False)
    m.observe(0, 4, 755_000_000, oom=False)
    assert m.max_micro_batch(1) > 40
    m.observe(0, 32, 1_093_337_088, oom=True)
    growth = (1_093_337_088 - 755_000_000) / 28
    assert m.max_micro_batch(1) == int(4 + (limit - m.predict(1, 4)) / growth) < 32
    assert m.max_micro_batch(0) < 32 and m.max_micro_batch(3) < 32


def test_calibration_moves_predictions_towards_measurements_and_logs_errors():
    m = model(world=2, n=10_000_000)
    m.observe(0, 1, 2 * GiB, oom=False)
    m.observe(0, 2, int(2.1 * GiB), oom=False)
    before = m.predict(0, 8)
    m.observe(0, 8, 4 * GiB, oom=False)  # activations grow faster than the first two points said
    assert m.predict(0, 8) > before
    assert m.errors()[-1]["measured"] == 4 * GiB and m.errors()[-1]["rel_error"] < 0


def test_an_oom_bounds_the_stage_and_the_stages_that_keep_more():
    m = model(world=2, n=10_000_000, limit=64 * GiB)
    m.observe(1, 1, 2 * GiB, oom=False)
    m.observe(1, 2, int(2.1 * GiB), oom=False)
    assert m.max_micro_batch(1) > 100
    m.observe(1, 50, None, oom=True)  # an accelerator's OOM: no peak
    assert m.max_micro_batch(1) == 49 and m.max_micro_batch(0) == 49
    assert m.max_micro_batch(3) > 49  # stage 3 keeps less per rank: not bounded by it
    assert not m.fits(1, 50) and m.feasible(1)


def test_infeasible_stage():
    m = model(world=1, n=3_000_000_000, limit=16 * GiB)  # 48 GB of fp32 Adam states on one GPU
    m.observe(3, 1, int(m.model_states(3) + GiB), oom=False)
    assert not m.feasible(0)


def test_each_stage_gets_its_own_fixed_part_and_shares_the_per_sample_slope():
    m = model(world=2, n=10_000_000)
    for mbs in (1, 4):
        m.observe(0, mbs, int(m.model_states(0) + 1 * GiB + mbs * 100 * 2**20), oom=False)
    m.observe(2, 4, int(m.model_states(2) + 3 * GiB + 4 * 100 * 2**20), oom=False)  # bigger buffers in z2
    assert m.per_sample == pytest.approx(100 * 2**20)
    assert m.predict(0, 8) == pytest.approx(m.model_states(0) + 1 * GiB + 800 * 2**20)
    assert m.predict(2, 8) == pytest.approx(m.model_states(2) + 3 * GiB + 800 * 2**20)


def test_a_stage_not_run_yet_is_predicted_by_its_nearest_run_stage_not_by_the_average():
    """ZeRO's buffers grow with the stage (a CPU rank's z1-z3 held 80-180 MB more than z0 on the 4M
    landscape): z2's first look, placed by the average of z0 and z1, ran out of memory."""
    m = model(world=2, n=10_000_000)
    for mbs in (1, 4):
        m.observe(0, mbs, int(m.model_states(0) + 1 * GiB + mbs * 100 * 2**20), oom=False)
    m.observe(1, 4, int(m.model_states(1) + 3 * GiB + 4 * 100 * 2**20), oom=False)
    assert m.predict(2, 8) == pytest.approx(m.model_states(2) + 3 * GiB + 800 * 2**20)
    assert m.predict(3, 8) == pytest.approx(m.model_states(3) + 3 * GiB + 800 * 2**20)
    m.observe(3, 4, int(m.model_states(3) + 5 * GiB + 4 * 100 * 2**20), oom=False)
    assert m.predict(2, 8) == pytest.approx(m.model_states(2) + 5 * GiB + 800 * 2**20)  # as near as z1: the higher stage


def test_an_oom_in_a_stage_without_successful_runs_calibrates_its_prediction():
    m = model(world=2, n=10_000_000, limit=16 * GiB)
    for mbs in (1, 4):
        m.observe(0, mbs, int(m.model_states(0) + 1 * GiB + mbs * 100 * 2**20), oom=False)
    predicted = m.max_micro_batch(2)
    # z2 needs 2 GiB more than z0 said: its first run, at the predicted edge, goes over by that much.
    m.observe(2, predicted, int(m.predict(2, predicted) + 2 * GiB), oom=True)
    again = m.max_micro_batch(2)
    assert again <= predicted - 20  # 2 GiB / 100 MiB per sample: about 20 fewer, not one fewer
    assert m.predict(2, again) <= 16 * GiB < m.predict(2, again + 21)


def test_an_oom_without_a_peak_still_bounds_the_stage():
    m = model(world=2, n=10_000_000, limit=16 * GiB)
    m.observe(0, 1, int(m.model_states(0) + 1 * GiB), oom=False)
    m.observe(0, 30, None, oom=True)  # a real accelerator OOM reports no peak
    assert m.max_micro_batch(0) <= 29 and not m.fits(0, 30)
