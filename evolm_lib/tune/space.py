"""A method's search space as the spec writes it, checked, and drawn from by an Optuna trial.

    sigma: {log: [0.005, 0.2]}         # log-uniform float, 0 < low < high
    momentum: {uniform: [0.0, 0.9]}    # uniform float, low < high
    lora_rank: {int: [1, 8]}           # uniform integer, low < high
    optimizer: [sgd, adam]             # one of the listed values
    split: ["30x8", "30x32", "8x30"]   # population (or group) x prompts per member, at the same budget

Every error names the parameter by its path in the spec (``tune.space.es_lora.sigma``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

KINDS = ("log", "uniform", "int")
"""The range kinds a parameter may name; a list instead is a choice among its values."""
SPLIT = "split"
"""A searched split of a generation's (or step's) completions, each choice "SIZExPROMPTS": SIZE members
(GRPO: a group of SIZE) each scored on PROMPTS training prompts; the generations (steps) follow from
the budget, so every choice trains on the same number of completions."""


def parse_split(path: str, value: Any) -> tuple[int, int]:
    """(size, prompts) from a split choice "SIZExPROMPTS" such as "30x8"; ValueError naming ``path``."""
    parts = value.split("x") if isinstance(value, str) else []
    if len(parts) != 2 or not all(part.isdigit() and int(part) >= 1 for part in parts):
        raise ValueError(f"{path}: each choice is \"SIZExPROMPTS\" (population or group size x prompts per member, "
                         f"e.g. \"30x8\"), got {value!r}")
    return int(parts[0]), int(parts[1])


@dataclass(frozen=True)
class Parameter:
    """One searched setting: a range (``kind`` log, uniform or int, with ``low`` and ``high``) or a
    choice (``kind`` "choice", with ``choices``)."""

    name: str
    kind: str
    low: float | None = None
    high: float | None = None
    choices: tuple = ()

    def distribution(self):
        """The Optuna distribution this setting is drawn from: what ``suggest`` asks a trial for, and
        what a trial imported from an export (``evolm tune import``) is recorded under."""
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        if self.kind == "choice":
            return CategoricalDistribution(list(self.choices))
        if self.kind == "int":
            return IntDistribution(int(self.low), int(self.high))
        return FloatDistribution(self.low, self.high, log=self.kind == "log")

    def suggest(self, trial) -> Any:
        """The value an Optuna trial draws for this setting (from ``distribution``)."""
        from optuna.distributions import CategoricalDistribution, IntDistribution

        drawn = self.distribution()
        if isinstance(drawn, CategoricalDistribution):
            return trial.suggest_categorical(self.name, list(drawn.choices))
        if isinstance(drawn, IntDistribution):
            return trial.suggest_int(self.name, drawn.low, drawn.high, log=drawn.log)
        return trial.suggest_float(self.name, drawn.low, drawn.high, log=drawn.log)

    def probes(self) -> list:
        """The values a dry run builds a config with: both ends of a range, every choice."""
        if self.kind == "choice":
            return list(self.choices)
        ends = [self.low, self.high]
        return [int(v) for v in ends] if self.kind == "int" else ends


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def parse_parameter(path: str, name: str, value: Any) -> Parameter:
    """A Parameter from the spec's value for ``name``; ValueError naming ``path`` when it is not one."""
    if isinstance(value, list):
        if not value:
            raise ValueError(f"{path}: an empty list of choices")
        if len({repr(v) for v in value}) != len(value):
            raise ValueError(f"{path}: a choice listed twice in {value}")
        if name == SPLIT:
            for choice in value:
                parse_split(path, choice)
        return Parameter(name, "choice", choices=tuple(value))
    if name == SPLIT:
        raise ValueError(f"{path}: a list of \"SIZExPROMPTS\" choices, e.g. [\"30x8\", \"8x30\"]; got {value!r}")
    if not isinstance(value, dict) or len(value) != 1:
        raise ValueError(f"{path}: a list of choices or one of {{log: [low, high]}}, {{uniform: [low, high]}}, "
                         f"{{int: [low, high]}}; got {value!r}")
    (kind, bounds), = value.items()
    if kind not in KINDS:
        from ..config import did_you_mean

        raise ValueError(f"{path}: unknown range {kind!r}{did_you_mean(kind, KINDS)}; one of {', '.join(KINDS)}")
    if not (isinstance(bounds, list) and len(bounds) == 2 and all(_number(b) for b in bounds)):
        raise ValueError(f"{path}: {kind} needs [low, high], two finite numbers; got {bounds!r}")
    low, high = bounds
    if not low < high:
        raise ValueError(f"{path}: an empty range [{low}, {high}]: low must be below high")
    if kind == "log" and low <= 0:
        raise ValueError(f"{path}: a log range must lie above 0 (log 0 is -inf); got [{low}, {high}]")
    if kind == "int" and not (float(low).is_integer() and float(high).is_integer()):
        raise ValueError(f"{path}: int needs whole numbers; got [{low}, {high}]")
    return Parameter(name, kind, float(low), float(high))


def parse_space(path: str, space: Any) -> list[Parameter]:
    """A method's parameters from ``{setting: range or choices}``; ValueError naming each bad one."""
    if not isinstance(space, dict) or not space:
        raise ValueError(f"{path}: a mapping of settings to search, e.g. {{sigma: {{log: [0.005, 0.2]}}}}; got {space!r}")
    return [parse_parameter(f"{path}.{name}", str(name), value) for name, value in space.items()]
