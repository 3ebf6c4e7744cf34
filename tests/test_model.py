"""The throughput model (search/model.py): a GP on log throughput whose kernel adds what the stage and sizes
give to what the knobs give, with the memory pressure as an input. Pure logic, no launches."""

import math

from mlautotune.search.model import Encoder, Observation, ThroughputModel

KNOBS = {"overlap_comm": [True, False], "reduce_bucket_size": [50_000_000, 500_000_000]}


def p(mbs, oc, rb=500_000_000, stage=2):
    return {"stage": stage, "micro_batch": mbs, "gas": 1, "overlap_comm": oc, "reduce_bucket_size": rb}


def fitted(points, pressure=None):
    obs = [Observation(params, math.log(value), 0.01**2) for params, value in points]
    return ThroughputModel(Encoder(KNOBS), 0, pressure).fit(obs)


def test_a_knob_effect_measured_at_small_micro_batches_carries_to_large_ones():
    """overlap_comm is worth +20% at micro-batches 2 and 4; at 64 only the plain knobs ran, along a curve that
    zigzags (allocator steps): the model must expect overlap_comm to win at 64 too. A product kernel, whose
    micro-batch length scale the zigzag makes short, forgets the effect that far away."""
    plain = {2: 10.0, 4: 14.0, 8: 11.0, 16: 16.0, 32: 12.0, 64: 17.0}
    points = [(p(m, False), v) for m, v in plain.items()] + [(p(m, True), 1.2 * plain[m]) for m in (2, 4)]
    mu, _ = fitted(points).predict([p(64, True), p(64, False)])
    assert mu[0] - mu[1] > math.log(1.12)


def test_memory_pressure_lets_the_model_expect_a_drop_near_the_edge():
    """The plain knobs' throughput grows until memory is nearly full (micro-batch 16), then falls. overlap_comm
    holds more buffers, so its memory is nearly full at 12 already: with the pressure as an input, the model
    expects overlap_comm at 12 to be slower than at 8 (by the micro-batch alone it would be faster)."""
    fill = {False: {2: 0.2, 4: 0.3, 8: 0.5, 12: 0.7, 16: 0.97}, True: {2: 0.3, 4: 0.45, 8: 0.75, 12: 0.97}}
    pressure = lambda q: fill[q["overlap_comm"]][q["micro_batch"]]  # noqa: E731
    value = {2: 10.0, 4: 14.0, 8: 19.0, 12: 22.0, 16: 15.0}
    points = [(p(m, False), value[m]) for m in (2, 4, 8, 12, 16)] + [(p(m, True), value[m] * 1.05) for m in (2, 4, 8)]
    (at12, at8), _ = fitted(points, pressure).predict([p(12, True), p(8, True)])
    assert at12 < at8


def test_a_slowdown_seen_where_one_stage_fills_memory_is_expected_where_another_fills_it_as_much():
    """ZeRO-2 rises with the micro-batch until memory is 97% full at 16, where the allocator thrashes and
    it falls by 40%. ZeRO-3 rose up to 24 (75% full); at 32 it would be 97% full. The pressure has its
    own part of the kernel, the same whatever fills memory, so the model is sure that ZeRO-3 at 32 is
    slower than its best measured value by a wide margin. With the pressure among the stage and sizes'
    inputs, ZeRO-2's fall says little of ZeRO-3, and 32's interval reaches up to 24's value."""
    fill = {2: {2: 0.3, 4: 0.4, 8: 0.6, 12: 0.8, 16: 0.97}, 3: {2: 0.2, 4: 0.25, 8: 0.35, 16: 0.55, 24: 0.75, 32: 0.97}}
    zero2 = {2: 10.0, 4: 14.0, 8: 19.0, 12: 22.0, 16: 13.0}
    zero3 = {2: 8.0, 4: 11.0, 8: 15.0, 16: 19.0, 24: 21.0}
    points = [(p(m, False), v) for m, v in zero2.items()] + [(p(m, False, stage=3), v) for m, v in zero3.items()]
    model = fitted(points, lambda q: fill[q["stage"]][q["micro_batch"]])
    (mu,), (sd,) = model.predict([p(32, False, stage=3)])
    assert math.exp(mu + 1.96 * sd) < 0.8 * zero3[24]


def test_six_measurements_cannot_rule_out_a_stage_seen_once():
    """Six measurements, as a session's first on a generated landscape: ZeRO-1 at micro-batch 1, 2 and 4
    (rising), ZeRO-0, 2 and 3 once each at micro-batch 1, a little below ZeRO-1. ZeRO-3 at micro-batch 4 is
    unmeasured: its 95% interval must still reach above the best measured value, or the search never runs
    it (on that landscape it is the optimum). Fitted by the marginal likelihood alone, the stages'
    amplitude collapses to a 1% spread and it does not; the hyperparameters' prior (MAP) keeps it open."""
    from mlautotune.search import model as module

    knobs = {"reduce_bucket_size": [5e7, 5e8, 1e9], "allgather_bucket_size": [5e7, 5e8, 1e9]}

    def q(stage, mbs, rb=5e8, ag=5e8):
        return {"stage": stage, "micro_batch": mbs, "gas": 4 // mbs, "reduce_bucket_size": rb, "allgather_bucket_size": ag}

    points = [(q(0, 1), 0.635), (q(3, 1, 5e7), 0.595), (q(1, 1, 1e9), 0.695), (q(2, 1, 1e9, 1e9), 0.604),
              (q(1, 2, 5e7), 0.747), (q(1, 4, 5e7, 5e7), 0.777)]
    obs = [Observation(params, math.log(value), 0.02**2) for params, value in points]

    def upper(prior_sd):
        old, module.PRIOR_LOG_SD = module.PRIOR_LOG_SD, prior_sd
        try:
            mu, sd = ThroughputModel(Encoder(knobs), 0).fit(obs).predict([q(3, 4, 5e7)])
        finally:
            module.PRIOR_LOG_SD = old
        return mu[0] + 1.96 * sd[0]

    assert upper(module.PRIOR_LOG_SD) > math.log(0.777)
    assert upper(1e6) < math.log(0.777)  # the likelihood alone: the failure the prior mends


def test_an_earlier_session_s_many_measurements_leave_today_s_value_as_uncertain_as_its_discrepancy():
    """A warm start from another GPU count: the earlier session measured micro-batch 8 twenty times, today
    nothing yet. Its landscape is today's plus a smooth discrepancy (prior sd 0.25), which does not average
    away over repeats, so today's value there keeps about that uncertainty; taken as independent blurred
    observations, twenty of them would make it sure to 0.25 / sqrt(20) = 0.06."""
    today = [(p(m, False), v) for m, v in {2: 10.0, 4: 14.0}.items()]
    obs = [Observation(q, math.log(v), 0.01**2) for q, v in today]
    obs += [Observation(p(8, True), math.log(20.0), 0.01**2, earlier=True) for _ in range(20)]
    model = ThroughputModel(Encoder(KNOBS), 0, discrepancy=0.25**2).fit(obs)
    (mu,), (sd,) = model.predict([p(8, True)])
    assert sd > 0.15 and abs(mu - math.log(20.0)) < 0.5
    cold = ThroughputModel(Encoder(KNOBS), 0).fit(obs[:2])
    assert cold.X([p(8, True)]).shape == model.X([p(8, True)]).shape[:1] + (model.X([p(8, True)]).shape[1] - 1,)


def test_a_peak_just_below_the_memory_edge_stays_possible():
    """Throughput rises to micro-batch 16 (65% of memory full) and falls at 32 (99%: the allocator retries).
    24 (85% full) is untried: the peak often lies there, just below the edge. Its 95% interval must reach
    above the best measured value, or the search never runs it. With the fill itself as the input, 85% lies
    between 65% and 99%, and the model interpolates the fall; the input is the log of the free share, so
    near the limit configurations are far apart and the fall at 32 says little of 24."""
    fill = {4: 0.3, 8: 0.45, 16: 0.65, 24: 0.85, 32: 0.99}
    value = {4: 8.0, 8: 11.0, 16: 14.0, 32: 8.0}
    points = [(p(m, False), v) for m, v in value.items()] + [(p(m, True), v * 1.03) for m, v in value.items() if m <= 8]
    model = fitted(points, lambda q: fill[q["micro_batch"]])
    (mu,), (sd,) = model.predict([p(24, False)])
    assert math.exp(mu + 1.96 * sd) > max(value.values())
