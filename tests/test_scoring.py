"""Tests for evolm_lib.scoring: pass@k by hand, success thresholds, evaluate_adapter and the
engine-side KL to the base model on tiny-random (vLLM)."""
from __future__ import annotations

import math
from itertools import combinations

import pytest
import torch

from evolm_lib.scoring import (
    default_success_threshold,
    evaluate_adapter,
    mean_kl_to_base,
    pass_at_k,
    score_adapters,
    success,
)
from evolm_lib.lora import LoraSpec, adapter_shapes, init_adapter
from evolm_lib.engines.synthetic import SyntheticEngine
from evolm_lib.tasks import get_task

SPEC = LoraSpec(("q_proj", "v_proj"), rank=2, alpha=2.0)


# ----------------------------------------------------------------------------- pass@k


@pytest.mark.parametrize(
    "n, c, k, expected",
    [(5, 2, 1, 0.4), (5, 2, 2, 0.7), (5, 0, 3, 0.0), (5, 3, 3, 1.0), (5, 5, 1, 1.0), (1, 1, 1, 1.0), (10, 1, 10, 1.0)],
)
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_equals_the_fraction_of_k_subsets_with_a_success():
    n, c = 7, 3
    samples = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(combinations(samples, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
        assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))


@pytest.mark.parametrize("n, c, k", [(5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_success_thresholds_per_task():
    assert default_success_threshold(get_task("conciseness")) == 0.0
    assert default_success_threshold(get_task("countdown", num_train=2, num_eval=2)) == 1.0
    assert success(0.0, 0.0) and not success(-1.0, 0.0)
    assert success(1.1, 1.0) and not success(0.1, 1.0)  # countdown: format alone is no success


# ----------------------------------------------------------------------------- evaluate_adapter


def test_evaluate_adapter_with_the_synthetic_engine():
    task = get_task("conciseness")
    examples = task.eval_examples()
    result = evaluate_adapter(SyntheticEngine(), task, None, examples, max_new_tokens=8)
    # the synthetic base model (None) answers with 1 + 4 * max_new_tokens = 33 characters
    assert result["rewards"] == [-abs(33.0 - len(e.target)) for e in examples]
    assert result["accuracy"] == 0.0 and result["pass@1"] == 0.0 and result["success_threshold"] == 0.0
    loose = evaluate_adapter(SyntheticEngine(), task, None, examples, max_new_tokens=8, success_threshold=-30)
    assert loose["accuracy"] == pytest.approx(sum(len(e.target) >= 3 for e in examples) / len(examples))
    with pytest.raises(ValueError, match="temperature"):
        evaluate_adapter(SyntheticEngine(), task, None, examples, max_new_tokens=8, num_samples=4)
    with pytest.raises(ValueError, match="k_values"):
        evaluate_adapter(SyntheticEngine(), task, None, examples, max_new_tokens=8, num_samples=2, temperature=1.0,
                         k_values=(3,))


def test_evaluate_adapter_on_tiny_random(tiny_vllm):
    task = get_task("conciseness")
    examples = task.eval_examples()[:3]
    shapes = adapter_shapes(tiny_vllm.model_dir, SPEC)
    adapter = init_adapter(SPEC, shapes, "peft_default", 0)
    result = evaluate_adapter(tiny_vllm, task, adapter, examples, max_new_tokens=6, num_samples=4, temperature=1.0,
                              seed=3, k_values=(1, 2, 4), success_threshold=-3.0)
    (greedy,) = score_adapters(tiny_vllm, task, adapter, [examples], 6)
    assert result["rewards"] == list(greedy.rewards) and result["reward"] == pytest.approx(greedy.mean)
    assert result["accuracy"] == pytest.approx(sum(r >= -3.0 for r in greedy.rewards) / 3)
    assert len(result["sample_rewards"]) == 3 and all(len(row) == 4 for row in result["sample_rewards"])
    successes = [sum(r >= -3.0 for r in row) for row in result["sample_rewards"]]
    assert result["pass@1"] == pytest.approx(sum(successes) / 12)  # pass@1 is the mean success rate
    assert result["pass@4"] == pytest.approx(sum(c > 0 for c in successes) / 3)
    assert result["pass@1"] <= result["pass@2"] <= result["pass@4"]
    again = evaluate_adapter(tiny_vllm, task, adapter, examples, max_new_tokens=6, num_samples=4, temperature=1.0,
                             seed=3, k_values=(1,), success_threshold=-3.0)
    assert again["sample_rewards"] == result["sample_rewards"]  # seeded


# ----------------------------------------------------------------------------- KL to the base model


def test_mean_kl_to_base_is_zero_for_a_zero_adapter_and_positive_otherwise(tiny_vllm):
    task = get_task("conciseness")
    examples = task.train_examples()
    shapes = adapter_shapes(tiny_vllm.model_dir, SPEC)
    zero_b = init_adapter(SPEC, shapes, "peft_default", 0)  # B = 0: the base model exactly
    assert mean_kl_to_base(tiny_vllm, task, zero_b, examples, num_samples=2, max_new_tokens=6) == pytest.approx(0.0, abs=1e-5)
    perturbed = init_adapter(SPEC, shapes, "random_ab", 0, {k: 1.0 for k in shapes}, 0.3)
    kl = mean_kl_to_base(tiny_vllm, task, perturbed, examples, num_samples=2, max_new_tokens=6)
    assert kl > 0.01
    # the k3 estimate is the mean of exp(r) - r - 1 >= 0 with r = base - adapter log-prob of each token
    assert math.isfinite(kl)


def test_mean_kl_to_base_needs_a_scoring_engine():
    task = get_task("conciseness")
    adapter = init_adapter(SPEC, {"x.lora_A.weight": (2, 4)}, "peft_default", 0)
    with pytest.raises(TypeError, match="encode"):
        mean_kl_to_base(SyntheticEngine(), task, adapter, task.train_examples())
