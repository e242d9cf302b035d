"""Scoring any adapter (ES or GRPO) on a task's prompts: greedy reward and accuracy, pass@k over
samples, and the KL to the base model estimated from the engine's own log-probs.

References:
- pass@k, unbiased estimator: Chen et al. 2021, "Evaluating Large Language Models Trained on Code",
  https://arxiv.org/abs/2107.03374
- k3 KL estimator: http://joschu.net/blog/kl-approx.html
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager, Sequence

import torch

from .engines import Engine, SamplingSettings, TokenScorer
from .divergence import kl_k3
from .es import NOISE_DEVICE
from .lora import AdapterWeights
from .tasks import Example, Task
from .types import Completion


@dataclass(frozen=True)
class AdapterScore:
    """Rewards of one adapter on a list of examples."""

    rewards: tuple[float, ...]
    completions: tuple[Completion, ...]

    @property
    def mean(self) -> float:
        return sum(self.rewards) / len(self.rewards) if self.rewards else float("nan")

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.completions)


def score_adapters(
    engine: Engine,
    task: Task,
    adapter: AdapterWeights | None,
    example_sets: Sequence[Sequence[Example]],
    max_new_tokens: int,
) -> list[AdapterScore]:
    """Greedy rewards of one adapter on several example lists, in ONE engine call."""
    prompts, adapters, sampling = scoring_grid(task, adapter, example_sets, max_new_tokens)
    return scores_of(task, engine.generate(prompts, adapters, sampling)[0], example_sets)


def scoring_grid(task: Task, adapter: AdapterWeights | None, example_sets: Sequence[Sequence[Example]],
                 max_new_tokens: int) -> tuple[list, list, SamplingSettings]:
    """The (prompts, [adapter], greedy sampling) grid that scores one adapter on several example
    lists; it can ride in another call's ``generate_grids`` (e.g. an ES population's)."""
    flat = [example for examples in example_sets for example in examples]
    return [task.prompt(e) for e in flat], [adapter], SamplingSettings(max_new_tokens=max_new_tokens, temperature=0.0)


def scores_of(task: Task, completions: Sequence, example_sets: Sequence[Sequence[Example]]) -> list[AdapterScore]:
    """One :class:`AdapterScore` per example list from the completions of a :func:`scoring_grid`."""
    flat = [example for examples in example_sets for example in examples]
    rewards = task.reward_fn([c.text for c in completions], flat)
    scores, start = [], 0
    for examples in example_sets:
        end = start + len(examples)
        scores.append(AdapterScore(tuple(rewards[start:end]), tuple(completions[start:end])))
        start = end
    return scores


# ---------------------------------------------------------------------------- accuracy and pass@k


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c succeed: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021)."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0  # every draw of k samples holds a success
    # the product form avoids the huge binomials of the ratio
    failure = 1.0
    for i in range(n - c + 1, n + 1):
        failure *= 1.0 - k / i
    return 1.0 - failure


def default_success_threshold(task: Task) -> float:
    """Reward at or above which a completion counts as solved, as the task declares it."""
    if task.success_threshold is None:
        raise ValueError(f"task {task.name!r} declares no success threshold: pass success_threshold")
    return float(task.success_threshold)


def success(reward: float, threshold: float) -> bool:
    """Whether a reward counts as a solved example."""
    return reward >= threshold


def evaluate_adapter(
    engine: Engine,
    task: Task,
    adapter: AdapterWeights | None,
    examples: Sequence[Example],
    *,
    max_new_tokens: int,
    num_samples: int = 1,
    temperature: float = 0.0,
    seed: int = 0,
    k_values: Sequence[int] = (1,),
    success_threshold: float | None = None,
) -> dict:
    """Greedy reward and accuracy of an adapter, and with samples (``temperature > 0``) their mean
    reward, accuracy and unbiased pass@k per k in ``k_values``; a flat dict of floats and lists."""
    if not examples:
        raise ValueError("examples is empty")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if num_samples > 1 and temperature == 0:
        raise ValueError("num_samples > 1 needs temperature > 0: greedy samples are all the same")
    sampled = temperature > 0
    bad_k = [k for k in k_values if not 1 <= k <= (num_samples if sampled else 1)]
    if bad_k:
        raise ValueError(f"k_values {bad_k} out of range: pass@k needs 1 <= k <= num_samples ({num_samples})")
    threshold = default_success_threshold(task) if success_threshold is None else float(success_threshold)

    (greedy,) = score_adapters(engine, task, adapter, [examples], max_new_tokens)
    solved = [success(r, threshold) for r in greedy.rewards]
    result = {
        "reward": greedy.mean,
        "accuracy": sum(solved) / len(solved),
        "rewards": list(greedy.rewards),
        "completions": [c.text for c in greedy.completions],
        "num_examples": len(examples),
        "success_threshold": threshold,
        "tokens": greedy.num_tokens,
    }
    if not sampled:
        result["pass@1"] = result["accuracy"]  # one greedy sample: pass@1 is the accuracy
        return result

    repeated = [e for e in examples for _ in range(num_samples)]
    sampling = SamplingSettings(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    completions = engine.generate([task.prompt(e) for e in repeated], [adapter], sampling)[0]
    rewards = task.reward_fn([c.text for c in completions], repeated)
    per_example = [rewards[i * num_samples : (i + 1) * num_samples] for i in range(len(examples))]
    successes = [sum(success(r, threshold) for r in row) for row in per_example]
    result.update({
        "num_samples": num_samples,
        "temperature": temperature,
        "sample_reward": sum(rewards) / len(rewards),
        "sample_accuracy": sum(successes) / len(rewards),
        "sample_rewards": per_example,
        "sample_tokens": sum(c.num_tokens for c in completions),
    })
    for k in k_values:
        result[f"pass@{k}"] = sum(pass_at_k(num_samples, c, k) for c in successes) / len(successes)
    return result


# ---------------------------------------------------------------------------- KL to the base model


def mean_kl_to_base(
    engine: Engine,
    task: Task,
    adapter: AdapterWeights,
    examples: Sequence[Example],
    num_samples: int = 4,
    temperature: float = 1.0,
    max_new_tokens: int = 64,
    seed: int = 0,
    serving_base: Callable[[], ContextManager] | None = None,
) -> float:
    """Mean per-token KL(adapter || base), k3 estimate, from the engine's log-probs of the adapter's samples.

    Samples come from the adapter (with their log-probs); the base model then scores those very tokens
    (``engine.prompt_logprobs``). The engine reports untempered log-probs, so the estimate is
    unbiased at temperature 1 only. When the policy is the engine's own weights (``adapter`` None,
    ES modes full and eggroll), ``serving_base`` is a context in which the engine serves the base
    model's weights (``ModelWeights.serving_base``); the base's scoring runs inside it.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to sample the adapter's distribution, got {temperature}")
    if not isinstance(engine, TokenScorer):
        raise TypeError(f"{type(engine).__name__} is no TokenScorer (encode, prompt_logprobs): "
                        "mean_kl_to_base needs an engine that scores tokens")
    repeated = [e for e in examples for _ in range(num_samples)]
    prompts = [task.prompt(e) for e in repeated]
    sampling = SamplingSettings(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, logprobs=True)
    completions = engine.generate(prompts, [adapter], sampling)[0]
    if any(c.logprobs is None for c in completions):
        raise TypeError(f"{type(engine).__name__} returned no sampled-token log-probs")
    prompt_ids = [engine.encode(p) for p in prompts]
    with serving_base() if serving_base is not None else nullcontext():
        base = engine.prompt_logprobs(prompt_ids, [c.token_ids for c in completions], adapter=None)
    policy = torch.tensor([lp for c in completions for lp in c.logprobs], dtype=torch.float64)  # (tokens,)
    reference = torch.tensor([lp for row in base for lp in row], dtype=torch.float64)  # (tokens,)
    if policy.numel() == 0:
        raise ValueError("the adapter produced no tokens to measure the KL on")
    return float(kl_k3(policy, reference).mean())


# ---------------------------------------------------------------------------- a population's first look


@dataclass(frozen=True)
class PopulationPreview:
    """Greedy completions of a population around one adapter, and what they say about its diversity."""

    members: tuple
    examples: tuple[Example, ...]
    completions: tuple[tuple[Completion, ...], ...]  # [member][example]
    rewards: tuple[tuple[float, ...], ...]  # [member][example]
    adapter_norm: float

    def statistics(self) -> dict[str, float]:
        """Adapter norm, distinct completions per prompt, and the spread of members' mean rewards."""
        means = [sum(r) / len(r) for r in self.rewards]  # (members,)
        mean = sum(means) / len(means)
        distinct = sum(len({row[i].text for row in self.completions}) for i in range(len(self.examples)))
        return {
            "adapter norm": self.adapter_norm,
            "distinct completions per prompt": distinct / len(self.examples),
            "reward mean": mean,
            "reward std": (sum((m - mean) ** 2 for m in means) / len(means)) ** 0.5,
            "reward min": min(means),
            "reward max": max(means),
        }

    def rows(self) -> list[dict]:
        """One row per (member, prompt): member index, sign, prompt, completion and reward."""
        return [{"member": j, "sign": member.sign, "prompt": example.prompt, "completion": self.completions[j][i].text,
                 "reward": self.rewards[j][i]}
                for j, member in enumerate(self.members) for i, example in enumerate(self.examples)]


def preview_population(engine: Engine, task: Task, adapter: AdapterWeights, members: Sequence,
                       sigmas, examples: Sequence[Example], max_new_tokens: int,
                       noise_device: str = NOISE_DEVICE, noise_scheme: str = "flat") -> PopulationPreview:
    """Members' adapters (adapter + sigma x their seeded noise) scored greedily on ``examples`` in ONE engine call."""
    from .es import perturb

    population = [AdapterWeights(adapter.spec, perturb(dict(adapter.tensors), m, sigmas, noise_device, noise_scheme))
                  for m in members]
    sampling = SamplingSettings(max_new_tokens=max_new_tokens, temperature=0.0)
    table = engine.generate([task.prompt(e) for e in examples], population, sampling)
    rewards = tuple(tuple(task.reward_fn([c.text for c in row], list(examples))) for row in table)
    norm = float(sum((t.float() ** 2).sum() for t in adapter.tensors.values()) ** 0.5)
    return PopulationPreview(tuple(members), tuple(examples), tuple(tuple(row) for row in table), rewards, norm)
