"""Metric keys in words, with units: the one home of the names figures, tables and summaries show.

Metrics rows keep their namespaced keys (``policy/train_reward``, ``samples/completions``); figures
never show one. A reward label adds the task's definition of the reward (``Task.reward_label``,
e.g. "-|length difference|, chars" for conciseness), so an axis says what was measured and in what.
"""
from __future__ import annotations

import textwrap
from collections.abc import Iterable, Mapping

REWARD = "reward"
"""The pseudo-key of an axis that holds several rewards at once (the fitness plot)."""

KEY_LABELS: Mapping[str, str] = {
    # x axes
    "generation": "generation",
    "step": "step",
    "samples/completions": "training completions",
    "samples/tokens": "training tokens generated",
    "samples/eval_completions": "scoring completions (greedy)",
    "time/wall_s": "wall-clock time (s)",
    "time/training_s": "training time (s; scoring and checkpoints left out)",
    # rewards: the current solution (ES's mean, GRPO's policy), greedy; the population's members
    REWARD: "reward",
    "policy/train_reward": "greedy reward on train prompts",
    "eval/reward": "greedy reward on eval prompts",
    "eval/accuracy": "greedy accuracy on eval prompts (fraction solved)",
    "validation/reward": "greedy reward on validation prompts",
    # the final mean adapter or policy, greedy, on the held-out problems (heldout.jsonl)
    "heldout/accuracy": "held-out accuracy (fraction solved)",
    "heldout/reward": "held-out mean reward",
    "train/reward_mean": "population mean reward on train prompts",
    "train/reward_best": "best member's reward on train prompts",
    "train/reward_worst": "worst member's reward on train prompts",
    "train/reward_p20": "20th percentile of member rewards",
    "train/reward_p80": "80th percentile of member rewards",
    "train/reward_std": "std of member rewards",
    # distance to the base model
    "policy/kl": "KL to the base model (nats per token)",
    # ES and GRPO internals
    "es/update_norm": "ES update norm (L2)",
    "es/mean_norm": "ES mean norm (L2)",
    "grpo/loss": "GRPO loss",
    "grpo/grad_norm": "gradient norm before clipping (L2)",
    "grpo/clip_fraction": "fraction of clipped ratios",
    "grpo/adapter_norm": "adapter norm (L2)",
    "grpo/zero_std_group_fraction": "fraction of groups with equal rewards",
    "grpo/response_tokens_mean": "mean completion length (tokens)",
    "policy/train_tokens": "tokens of the greedy train completions",
    # time per generation or step, by phase
    "time/generation_s": "time per generation (s)",
    "time/adapters_s": "writing adapters (s)",
    "time/adapters/slots_write_s": "writing the resident slots, on the engine (s)",
    "time/adapters/slots_call_s": "the slot-write call, with its RPC and prefix-cache reset (s)",
    "time/generate_s": "generation (s)",
    "time/rollout_s": "rollouts (s)",
    "time/reward_s": "rewards (s)",
    "time/update_s": "update (s)",
    "time/eval_s": "scoring the mean adapter (s)",
}

PHASE_NAMES: Mapping[str, str] = {
    "time/adapters_s": "adapters", "time/generate_s": "generate", "time/rollout_s": "rollouts",
    "time/reward_s": "reward", "time/update_s": "update", "time/eval_s": "eval",
}
"""Short legend names of the time phases of a generation or step, in the order they run."""

REWARD_KEYS = frozenset(k for k in KEY_LABELS if k == REWARD or k.endswith("reward") or "/reward_" in k)
COUNT_KEYS = frozenset({"samples/completions", "samples/tokens", "samples/eval_completions", "policy/train_tokens"})
INTEGER_KEYS = frozenset({"generation", "step"})


def label(key: str, reward_label: str | None = None) -> str:
    """A metric key in words with its unit; rewards get the task's definition when given."""
    text = KEY_LABELS.get(key) or _fallback(key)
    if reward_label and key in REWARD_KEYS:
        text = f"{text} ({reward_label})"
    return text


def axis_title(key: str, reward_label: str | None = None, width: int = 24) -> str:
    """``label`` for an axis, broken into lines of about ``width`` characters (HTML line breaks), so a
    long title fits beside a short axis; the part in parentheses (a unit or reward definition) is one line."""
    text = label(key, reward_label)
    head, paren, tail = text.rpartition(" (")
    if len(text) <= width:
        return text
    if not (paren and head):
        return "<br>".join(textwrap.wrap(text, width, break_long_words=False))
    return "<br>".join([*textwrap.wrap(head, width, break_long_words=False), f"({tail}"])


def _fallback(key: str) -> str:
    """Words for a key without an entry: "grpo/grad_norm" -> "grad norm (grpo)", "time/x_s" -> "x (s)"."""
    namespace, _, name = key.rpartition("/")
    unit = ""
    if name.endswith("_s"):
        name, unit = name[:-2], " (s)"
    words = name.replace("_", " ").strip() or key.replace("/", " ")
    return f"{words}{unit}" + (f" ({namespace.replace('/', ' ')})" if namespace and namespace != "time" else "")


def axis_format(key: str) -> dict:
    """Tick format of an axis holding ``key``: whole generations, counts as 12k, and plain decimals
    elsewhere (plotly's default would write a KL of 1e-4 as "100µ")."""
    if key in INTEGER_KEYS:
        return {"tickformat": "d"}
    if key in COUNT_KEYS:
        return {"tickformat": "~s"}
    return {"tickformat": "~g"}


def integer_ticks(max_value: float, target: int = 8) -> dict:
    """Ticks on whole numbers only (no "0.5 generation"), about ``target`` of them."""
    step = 1
    for candidate in (1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 5000, 10000):
        step = candidate
        if max_value / candidate <= target:
            break
    return {"tickmode": "linear", "tick0": 0, "dtick": step, "tickformat": "d"}


TINY_MODEL = "tiny-random"
TINY_MODEL_NOTE = "tiny-random: a plumbing check; its rewards mean nothing"
"""What a figure or summary of the tiny random model (``evolm_lib.models``) says of it: its weights are
random, so its rewards show that the code runs, not that a method learns."""


def is_tiny_model(model: object) -> bool:
    """True for the tiny random model, by name or by its folder's name."""
    return model is not None and str(model).rstrip("/").replace("\\", "/").split("/")[-1] == TINY_MODEL


def model_note(models: object) -> str:
    """TINY_MODEL_NOTE where ``models`` (a model name or path, or several) include the tiny random
    model, else an empty string."""
    if isinstance(models, (str, bytes)) or not isinstance(models, Iterable):
        models = [models]
    return TINY_MODEL_NOTE if any(is_tiny_model(m) for m in models) else ""


def model_title(text: str, model: object) -> str:
    """A figure title naming its model in brackets ("ES on conciseness (smollm2-135m-instruct)"); the
    tiny random model is named with TINY_MODEL_NOTE."""
    return f"{text} ({model_note(model) or model})"


def note_model(fig, models: object):
    """``fig`` (a plotly figure) with TINY_MODEL_NOTE after its title where ``models`` include the tiny
    random model; unchanged otherwise."""
    note = model_note(models)
    if note:
        title = fig.layout.title.text
        fig.update_layout(title_text=f"{title} ({note})" if title else note)
    return fig
