"""Tests for evolm_lib.train.scoring_plan: the scoring plan on its own (whether a generation scores its
mean after the update, or rides the previous mean's scoring in its population's call, and on which
prompt sets), and a run's rows following it."""
from __future__ import annotations

import pytest

from evolm_lib.config import ESConfig
from evolm_lib.engines.synthetic import SyntheticEngine
from evolm_lib.runs import read_metrics
from evolm_lib.train.es import ESRun
from evolm_lib.train.scoring_plan import ScoringSettings, scored_means, scoring_plan


def _plans(settings: ScoringSettings, last: int, scored=()) -> list[tuple[bool, bool]]:
    return [(p.ride, p.after) for p in (scoring_plan(g, settings, scored) for g in range(1, last + 1))]


def test_a_separate_call_scores_every_eval_every_and_the_budgets_last_mean():
    assert _plans(ScoringSettings(eval_every=2, budget=5), 5) == [
        (False, False), (False, True), (False, False), (False, True), (False, True)]
    # eval_every 0: only the end of the budget; a run extended past it scores every further generation
    assert [p[1] for p in _plans(ScoringSettings(eval_every=0, budget=3), 5)] == [False, False, True, True, True]


def test_riding_scores_the_mean_a_generation_starts_from_in_its_own_call():
    settings = ScoringSettings(eval_every=1, budget=4, rides=True)
    # generation 1 starts from mean 0 (scored when the run was made); generation 4 is the budget's
    # last: it does not ride, its new mean is scored right after it
    assert _plans(settings, 4) == [(False, False), (True, False), (True, False), (False, True)]
    assert _plans(ScoringSettings(eval_every=2, budget=6, rides=True), 6) == [
        (False, False), (False, False), (True, False), (False, False), (True, False), (False, True)]


def test_a_mean_already_scored_is_not_scored_again():
    riding = ScoringSettings(eval_every=1, budget=4, rides=True)
    assert not scoring_plan(3, riding, scored={2}).ride
    assert not scoring_plan(4, riding, scored={4}).after  # an extended run's last mean, scored before
    assert scoring_plan(5, riding, scored={4}).after
    rows = [{"generation": 3, "eval/reward": 1.0}, {"generation": 4, "policy/generation": 3, "eval/reward": 2.0},
            {"generation": 5}]
    assert scored_means(rows) == {3}


@pytest.mark.parametrize("validation", [False, True])
def test_the_plan_names_the_prompt_sets_a_scoring_covers(validation):
    plan = scoring_plan(2, ScoringSettings(eval_every=1, budget=3, validation=validation))
    assert plan.sets == (("train", "eval", "validation") if validation else ("train", "eval"))


class _Batching(SyntheticEngine):
    batches_grids = True  # the mean's scoring rides in the population's call


@pytest.mark.parametrize("engine", [SyntheticEngine, _Batching])
def test_a_runs_rows_hold_the_scores_its_plan_gives(tmp_path, engine):
    config = ESConfig(model="tiny-random", target_modules=("q_proj", "v_proj"), sigma=0.02, learning_rate=0.05,
                      population_size=4, num_generations=5, eval_every=2, seed=3)
    run = ESRun.create(config, tmp_path / "run", engine=engine())
    plans = {g: run.scoring_plan(g) for g in range(1, 6)}
    run.run()
    run.close()
    rows = read_metrics(tmp_path / "run")
    for row in rows[1:]:
        plan = plans[row["generation"]]
        assert ("policy/generation" in row) == plan.ride
        assert ("time/eval_s" in row) == plan.after  # a call of its own
        assert ("eval/reward" in row) == (plan.ride or plan.after)
    assert any(p.ride for p in plans.values()) == (engine is _Batching)
