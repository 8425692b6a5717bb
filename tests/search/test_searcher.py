"""PlanSearcher (Tune's Searcher interface, driven directly): only candidates, each once, in the
algorithm's order; bayes goes through Ray Tune's OptunaSearch and learns from what it measures."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from service.search.searcher import PlanSearcher

FIELDS = {"zero_stage": [0, 1, 2, 3], "micro_batch": [1, 2, 4, 8], "recompute": ["none", "full"]}
POINTS = [dict(zip(FIELDS, combo, strict=True)) for combo in itertools.product(*FIELDS.values())]


def objective(point: dict) -> float:
    """A made-up throughput: grows with micro-batch, recompute costs a third, ZeRO-3 a bit."""
    speed = 100.0 * point["micro_batch"] ** 0.8 * (0.75 if point["recompute"] == "full" else 1.0)
    return speed * (0.9 if point["zero_stage"] == 3 else 1.0)


# ZeRO-2 with micro-batch 8 is "pruned": never a candidate.
CANDIDATES = [
    (f"k{i}", p) for i, p in enumerate(POINTS) if not (p["zero_stage"] == 2 and p["micro_batch"] == 8)
]
BY_KEY = dict(CANDIDATES)


def drive(searcher: PlanSearcher, n: int, fail: set[str] = frozenset()) -> list[str]:
    """Runs `n` sequential trials against `objective`; keys in `fail` end as OOM."""
    keys = []
    for t in range(n):
        suggestion = searcher.suggest(f"t{t}")
        if suggestion == "FINISHED":
            break
        key = suggestion["plan"]
        keys.append(key)
        if key in fail:
            searcher.on_trial_complete(f"t{t}", {"trial_status": "oom", "done": 1.0})
            continue
        searcher.on_trial_result(f"t{t}", {"tokens_per_s": objective(BY_KEY[key]), "step": 1})
        searcher.on_trial_complete(f"t{t}", {"trial_status": "ok", "done": 1.0})
    return keys


def test_grid_follows_the_given_order_and_finishes() -> None:
    searcher = PlanSearcher(CANDIDATES, FIELDS, "grid", "tokens_per_s", "max")
    keys = drive(searcher, 100)
    assert keys == [k for k, _ in CANDIDATES]
    assert searcher.suggest("again") == "FINISHED"


def test_random_is_a_seeded_permutation_without_repeats() -> None:
    a = drive(PlanSearcher(CANDIDATES, FIELDS, "random", "tokens_per_s", "max", seed=3), 100)
    b = drive(PlanSearcher(CANDIDATES, FIELDS, "random", "tokens_per_s", "max", seed=3), 100)
    c = drive(PlanSearcher(CANDIDATES, FIELDS, "random", "tokens_per_s", "max", seed=4), 100)
    assert a == b and a != c
    assert sorted(a) == sorted(k for k, _ in CANDIDATES)


def test_bayes_never_launches_pruned_or_repeated_plans_and_warm_starts_from_the_model() -> None:
    ranked = sorted(CANDIDATES, key=lambda kp: -objective(kp[1]))  # a perfect "model" order
    searcher = PlanSearcher(ranked, FIELDS, "bayes", "tokens_per_s", "max", seed=0, warm_start=2)
    keys = drive(searcher, len(CANDIDATES) + 5)
    assert keys[:2] == [ranked[0][0], ranked[1][0]]
    assert len(keys) == len(set(keys)) == len(CANDIDATES)
    assert all(k in BY_KEY for k in keys)


def test_bayes_finds_a_top_plan_from_a_bad_start() -> None:
    worst_first = sorted(CANDIDATES, key=lambda kp: objective(kp[1]))
    searcher = PlanSearcher(worst_first, FIELDS, "bayes", "tokens_per_s", "max", seed=1, warm_start=2)
    keys = drive(searcher, 16)
    best = max(objective(p) for _, p in CANDIDATES)
    found = max(objective(BY_KEY[k]) for k in keys)
    assert found >= 0.9 * best  # 16 of 30 trials; TPE moves to large micro-batches


def test_infeasible_trials_score_the_penalty() -> None:
    searcher = PlanSearcher(CANDIDATES, FIELDS, "grid", "tokens_per_s", "max")
    keys = drive(searcher, 3, fail={CANDIDATES[1][0]})
    assert searcher._values[keys[1]] == 0.0
    assert searcher._values[keys[0]] == pytest.approx(objective(BY_KEY[keys[0]]))


@pytest.mark.parametrize("algorithm", ["grid", "bayes"])
def test_a_plan_the_cluster_never_placed_scores_nothing(algorithm: str) -> None:
    searcher = PlanSearcher(CANDIDATES, FIELDS, algorithm, "tokens_per_s", "max")
    key = searcher.suggest("t0")["plan"]
    searcher.on_trial_complete("t0", {"trial_status": "unschedulable", "done": 1.0})
    assert key not in searcher._values  # not a measured 0 tokens/s


def test_save_and_restore_keep_what_was_launched(tmp_path: Path) -> None:
    searcher = PlanSearcher(CANDIDATES, FIELDS, "bayes", "tokens_per_s", "max", seed=0)
    first = drive(searcher, 3)
    searcher.save(str(tmp_path / "s.pkl"))
    again = PlanSearcher(CANDIDATES, FIELDS, "bayes", "tokens_per_s", "max", seed=0)
    again.restore(str(tmp_path / "s.pkl"))
    assert again.launched_keys() == first
    more = [again.suggest(f"n{i}")["plan"] for i in range(3)]
    assert not set(more) & set(first)
