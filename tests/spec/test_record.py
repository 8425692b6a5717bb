"""`Metrics` reads as a read-only mapping of the quantities that are set: keys, equality and JSON."""

from __future__ import annotations

import json
import math

from service.spec.record import Metrics, Observation


def test_metrics_iterate_compare_and_serialise_as_a_mapping_of_set_quantities():
    m = Metrics.model_validate({"tokens_per_s": 3, "loss": math.nan, "extra_q": 2.5, "note": "x"})
    assert set(m) == {"tokens_per_s", "extra_q"}  # NaN and non-numbers are "not measured"
    assert list(m) == m.keys() == ["tokens_per_s", "extra_q"]
    assert m == {"tokens_per_s": 3.0, "extra_q": 2.5} and m != {"tokens_per_s": 3.0}
    assert dict(m) == {"tokens_per_s": 3.0, "extra_q": 2.5} and len(m) == 2
    assert Metrics() == {} and not Metrics()
    assert m == Metrics.model_validate(dict(m)) and hash(m) == hash(Metrics.model_validate(dict(m)))
    assert json.loads(m.model_dump_json()) == {"tokens_per_s": 3.0, "extra_q": 2.5}


def test_observation_from_a_report_splits_measured_from_predicted():
    row = {
        "tokens_per_s": 10.0,
        "measured_peak_memory_bytes_per_rank": 5.0,
        "predicted_tokens_per_s": 12.0,
        "step": 3,
        "done": False,
    }
    obs = Observation.from_report(row)
    assert obs.measured == {"tokens_per_s": 10.0, "peak_memory_bytes_per_rank": 5.0}
    assert obs.predicted == {"tokens_per_s": 12.0}
    assert obs.flat("trial_") == {
        "trial_measured_tokens_per_s": 10.0,
        "trial_measured_peak_memory_bytes_per_rank": 5.0,
        "trial_predicted_tokens_per_s": 12.0,
    }
