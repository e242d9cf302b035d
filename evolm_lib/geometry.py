"""The geometry of a solution: what a run changed in the model, and how two runs' changes relate.

Hoy, Wang & Pan 2026 (arXiv 2604.01499) find that full-parameter ES and GRPO reach similar accuracy
with very different updates: ES moves the weights more, the two directions are nearly orthogonal,
and the straight line between the two solutions has no loss barrier. This module measures the same
things on run folders:

- ``load_solution``: a run's weights against the base model, as full weight differences (a LoRA's
  merged ``B A * scaling``, or the moved weights themselves);
- ``update_table`` and ``summarize``: per weight, per layer and per module type, the Frobenius norm
  of the update and the share of weights that changed at all in the engine's dtype;
- ``update_cosine``: the cosine between two updates, overall, per layer and per module type, with its
  chance level 1 / sqrt(d) (two random directions in d dimensions);
- ``interpolation_path`` and ``path_barrier``: held-out reward and KL to the base model at points of
  ``(1 - t) theta_A + t theta_B``, served by the resident engine (the weights written in place and
  restored exactly afterwards), and the largest drop below the line between the ends;
- ``off_task_drift``: KL to the base model on another task's prompts, per checkpoint of a run;
  ``solution_drift``: the same for one solution, served in place as a path's points are.

The maths (norms, cosines, barrier) are pure functions on named tensors; reading folders and serving
weights are kept apart from them.
"""
from __future__ import annotations

import math
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import torch

from .config import ConfigError, did_you_mean
from .engines.weights.resident import targeted_weight_shapes
from .scoring import mean_kl_to_base, score_adapters
from .lora import AdapterWeights, read_base_weights
from .models import resolve_model
from .runs import latest_intact_checkpoint, list_checkpoints, load_checkpoint, load_run_config, read_config_kind
from .tasks import Task, get_task, list_tasks

_LAYER = re.compile(r"\.layers\.(\d+)\.")

# ----------------------------------------------------------------------------- a run's solution


@dataclass(frozen=True)
class Solution:
    """A run's weights beside the base model's, float32, for every weight the run moved (HF names)."""

    run_dir: Path
    label: str  # "es", "es full", "grpo", "grpo full", ...
    model: str  # the run's ``model`` setting
    model_dir: Path
    form: str  # "lora" (an adapter, merged) or "full" (the model's own weights)
    generation: int
    weights: dict[str, torch.Tensor]
    base: dict[str, torch.Tensor]

    @property
    def delta(self) -> dict[str, torch.Tensor]:
        """The update: the run's weights minus the base model's."""
        return {name: self.weights[name] - self.base[name] for name in self.weights}


def merged_lora_delta(adapter: AdapterWeights) -> dict[str, torch.Tensor]:
    """HF weight name -> ``B A * scaling`` (float32): what merging the adapter adds to each weight."""
    delta = {}
    for name, a in adapter.tensors.items():
        if ".lora_A." not in name:
            continue
        b = adapter.tensors[name.replace(".lora_A.", ".lora_B.")]
        weight = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        delta[weight] = (b.double() @ a.double()).mul_(adapter.spec.scaling).float()  # (out, in)
    return delta


def _holds_weights(run_dir: Path, newest: Path) -> bool:
    return (newest / "adapter").exists() or read_config_kind(run_dir) == "grpo"


def checkpoint_holds_weights(run_dir: str | Path) -> bool:
    """Whether a run's newest checkpoint holds its solution's weights itself (``load_solution`` reads
    them there): a LoRA run's adapter, or GRPO's float32 weights; ES on the model's own weights keeps
    them in its snapshots instead, its checkpoints holding no tensors."""
    found = list_checkpoints(run_dir)
    return bool(found) and _holds_weights(Path(run_dir), found[-1])


def solution_on_disk(run_dir: str | Path) -> bool:
    """Whether ``load_solution`` finds a run's solution in its folder: a checkpoint holding the weights
    (``checkpoint_holds_weights``), or for ES on the model's own weights a checkpoint beside the snapshot
    of its generation, or final_model/."""
    from .train.model_weights import SNAPSHOTS

    run_dir = Path(run_dir)
    found = list_checkpoints(run_dir)
    if not found:
        return False
    snapshot = run_dir / SNAPSHOTS / f"{int(found[-1].name.split('.')[0]):06d}.safetensors"
    return (_holds_weights(run_dir, found[-1]) or snapshot.is_file()
            or (run_dir / "final_model" / "model.safetensors").is_file())


def load_solution(run_dir: str | Path) -> Solution:
    """The run's weights at its latest checkpoint: a LoRA run's adapter merged into the base weights;
    GRPO with policy_weights full from the checkpoint's float32 weights; ES with es_mode full or
    eggroll from the snapshot of that generation (the float32 mean), else its final_model folder."""
    from .analysis import method_label

    run_dir = Path(run_dir)
    kind = read_config_kind(run_dir)
    config = load_run_config(run_dir)
    model_dir = resolve_model(config.model)
    checkpoint = latest_intact_checkpoint(run_dir)
    adapter, tensors, state = load_checkpoint(checkpoint)
    generation = int(state.get("generation", int(checkpoint.name)))
    label = method_label({**config.to_dict(), "kind": kind})
    if adapter is not None:
        delta = merged_lora_delta(adapter)
        base = {name: value.float() for name, value in read_base_weights(model_dir, sorted(delta)).items()}
        weights = {name: base[name] + delta[name] for name in delta}
        return Solution(run_dir, label, config.model, model_dir, "lora", generation, weights, base)
    if kind == "grpo":
        from .train.grpo import WEIGHTS_PREFIX

        weights = {k.removeprefix(WEIGHTS_PREFIX): v.float() for k, v in tensors.items() if k.startswith(WEIGHTS_PREFIX)}
    else:
        weights = _es_weights(run_dir, config, model_dir, generation)
    base = {name: value.float() for name, value in read_base_weights(model_dir, sorted(weights)).items()}
    return Solution(run_dir, label, config.model, model_dir, "full", generation, weights, base)


def _es_weights(run_dir: Path, config, model_dir: Path, generation: int) -> dict[str, torch.Tensor]:
    """An ES run's mean of ``generation`` as named float32 tensors: its snapshot, else final_model/."""
    from safetensors.torch import load_file

    from . import es
    from .train.model_weights import SNAPSHOTS

    shapes = targeted_weight_shapes(model_dir, *config.weight_targets())
    snapshot = Path(run_dir) / SNAPSHOTS / f"{generation:06d}.safetensors"
    if snapshot.exists():
        return {k: v.clone() for k, v in es.Layout.of(shapes).split(load_file(str(snapshot))["master"]).items()}
    final = Path(run_dir) / "final_model" / "model.safetensors"
    if final.exists():
        saved = load_file(str(final))
        return {name: saved[name].float() for name in shapes}
    raise ValueError(f"{run_dir}: no snapshot of generation {generation} and no final_model/ (a run stopped between "
                     "snapshots: finish it, or call save_final, to measure its weights)")


# ----------------------------------------------------------------------------- norms and directions


def layer_index(name: str) -> int | None:
    """The transformer layer a weight belongs to (None: embeddings, the final norm, the LM head)."""
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def module_type(name: str) -> str:
    """The kind of module a weight belongs to: q_proj, down_proj, input_layernorm, embed_tokens, ..."""
    return name.removesuffix(".weight").removesuffix(".bias").rsplit(".", 1)[-1]


def update_table(weights: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor],
                 dtype: str | torch.dtype = "bfloat16") -> list[dict]:
    """One row per weight: layer, module, number of values, the update's Frobenius norm, the base
    weight's, and the share of values that differ from the base once both are cast to ``dtype`` (an
    update below the dtype's resolution does not reach the engine)."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    rows = []
    for name in sorted(weights):
        new, old = weights[name].float(), base[name].float()
        changed = (new.to(dtype) != old.to(dtype)).sum()
        rows.append({"weight": name, "layer": layer_index(name), "module": module_type(name), "values": new.numel(),
                     "norm": float(torch.linalg.vector_norm(new - old, dtype=torch.float64)),
                     "base_norm": float(torch.linalg.vector_norm(old, dtype=torch.float64)),
                     "changed_share": float(changed) / new.numel()})
    return rows


def summarize(rows: Sequence[dict], by: str | None = None) -> list[dict] | dict:
    """``update_table``'s rows combined: norms as the root of the summed squares, the changed share
    weighted by values. ``by`` None: one dict for the whole update; "layer" or "module": one per group."""
    def combine(group: Sequence[dict]) -> dict:
        values = sum(r["values"] for r in group)
        return {"values": values, "norm": math.sqrt(sum(r["norm"] ** 2 for r in group)),
                "base_norm": math.sqrt(sum(r["base_norm"] ** 2 for r in group)),
                "changed_share": sum(r["changed_share"] * r["values"] for r in group) / values}

    if by is None:
        return combine(rows)
    if by not in ("layer", "module"):
        raise ValueError(f"by: 'layer', 'module' or None, got {by!r}")
    groups: dict = {}
    for row in rows:
        groups.setdefault(row[by], []).append(row)
    ordered = sorted(groups, key=lambda key: (key is None, key if key is not None else 0)) if by == "layer" else sorted(groups)
    return [{by: key, **combine(groups[key])} for key in ordered]


def update_cosine(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> dict:
    """The cosine between two updates (named tensors; a weight one of them does not move counts as 0
    there): ``overall``, ``per_layer`` {layer: cosine} and ``per_module`` {module: cosine}. An update
    with no length in a group has no direction there: NaN. ``chance``: 1 / sqrt(d) over the d
    coordinates compared, the typical size of the cosine between two unrelated random directions in
    that many dimensions (its standard deviation), the level to read ``overall`` against."""
    names = sorted(set(a) | set(b))
    coordinates = sum((a[name] if name in a else b[name]).numel() for name in names)
    sums: dict = {}  # group -> [a.b, a.a, b.b] in float64

    def add(group, x: torch.Tensor | None, y: torch.Tensor | None) -> None:
        entry = sums.setdefault(group, [0.0, 0.0, 0.0])
        x64 = x.double().reshape(-1) if x is not None else None
        y64 = y.double().reshape(-1) if y is not None else None
        if x64 is not None and y64 is not None:
            entry[0] += float(x64 @ y64)
        entry[1] += float(x64 @ x64) if x64 is not None else 0.0
        entry[2] += float(y64 @ y64) if y64 is not None else 0.0

    for name in names:
        x, y = a.get(name), b.get(name)
        if x is not None and y is not None and x.shape != y.shape:
            raise ValueError(f"{name}: the updates' shapes differ ({tuple(x.shape)} and {tuple(y.shape)})")
        for group in (("all",), ("layer", layer_index(name)), ("module", module_type(name))):
            add(group, x, y)

    def cosine(entry) -> float:
        dot, aa, bb = entry
        return dot / math.sqrt(aa * bb) if aa > 0 and bb > 0 else float("nan")

    layers = sorted((key[1] for key in sums if key[0] == "layer"), key=lambda k: (k is None, k or 0))
    modules = sorted(key[1] for key in sums if key[0] == "module")
    return {"overall": cosine(sums[("all",)]) if names else float("nan"),
            "chance": 1 / math.sqrt(coordinates) if coordinates else float("nan"),
            "per_layer": {layer: cosine(sums[("layer", layer)]) for layer in layers},
            "per_module": {module: cosine(sums[("module", module)]) for module in modules}}


def path_barrier(ts: Sequence[float], values: Sequence[float]) -> float:
    """The largest drop of ``values`` (a reward: higher is better) below the straight line between
    its ends, over the points ``ts`` (from 0 to 1); 0 when no point lies below the line."""
    if len(ts) != len(values) or len(ts) < 2 or ts[0] != 0 or ts[-1] != 1:
        raise ValueError(f"a path needs points from t = 0 to t = 1 and one value each, got {list(ts)}")
    first, last = values[0], values[-1]
    return max(max((1 - t) * first + t * last - v for t, v in zip(ts, values)), 0.0)


# ----------------------------------------------------------------------------- served by the engine


def _resident_targets(names: Sequence[str]) -> tuple:
    """(target modules, layers) of the engine weights that cover ``names``: the projections of the
    layers they name, or ("all", None) where a name is no projection of a layer."""
    layers = {layer_index(n) for n in names}
    if None in layers or not all(module_type(n).endswith("_proj") for n in names):
        return "all", None
    return tuple(sorted({module_type(n) for n in names})), tuple(sorted(layers))


def check_path_ends(a: Solution, b: Solution) -> None:
    """A path needs two solutions of one model and one form (both LoRA, or both the model's weights)."""
    if a.model_dir != b.model_dir:
        raise ConfigError(f"model: the path's ends are runs of different models ({a.model} in {a.run_dir}, "
                          f"{b.model} in {b.run_dir}); a straight path needs one model")
    if a.form != b.form:
        raise ConfigError(f"es_mode / policy_weights: the path's ends moved different forms ({a.label}: {a.form} in "
                          f"{a.run_dir}, {b.label}: {b.form} in {b.run_dir}); compare LoRA with LoRA, or the model's "
                          "own weights with the model's own weights")


@contextmanager
def _resident(engine, model_dir: Path, names: Sequence[str]) -> Iterator[tuple]:
    """(the engine's resident weights covering ``names``, a function that lays named weights out as
    they hold them: sorted names back to back, the base model's value where a name is missing)."""
    targets, layers = _resident_targets(names)
    weights = engine.resident_weights(targets, noise="full", layers_to_transform=layers)
    try:
        order = sorted(weights.shapes)
        base = {name: value.float() for name, value in read_base_weights(model_dir, order).items()}
        yield weights, lambda named: torch.cat([named.get(n, base[n]).reshape(-1) for n in order])
    finally:
        weights.close()


@contextmanager
def _serving(weights, flat: torch.Tensor) -> Iterator[None]:
    """Inside the block the engine's resident ``weights`` serve ``flat``; afterwards what they served before."""
    saved = weights.read()
    weights.load({"master": flat})
    try:
        yield
    finally:
        weights.load(saved)


def interpolation_path(engine, a: Solution, b: Solution, task: Task, points: int | Sequence[float] = 5, *,
                       max_new_tokens: int = 64, kl_samples: int = 0, seed: int = 0) -> list[dict]:
    """Held-out and train greedy rewards (and, with ``kl_samples`` > 0, KL to the base model on the
    held-out prompts) at each ``t`` of ``(1 - t) theta_A + t theta_B``, the weights written into the
    engine in place (``resident_weights``); afterwards the engine serves exactly what it served before.
    Scoring is ``RunLoop.score``'s call (train and held-out prompts in one call), so at t = 0 and 1
    a full-weight solution's scores are its run's own. Returns one row per point."""
    check_path_ends(a, b)
    ts = [i / (points - 1) for i in range(points)] if isinstance(points, int) else [float(t) for t in points]
    if isinstance(points, int) and points < 2:
        raise ValueError(f"points: at least 2 (the ends), got {points}")
    with _resident(engine, a.model_dir, sorted(set(a.weights) | set(b.weights))) as (weights, flat):
        theta_a, theta_b, base_flat = flat(a.weights), flat(b.weights), flat({})
        rows = []
        for t in ts:
            point = theta_a * (1 - t) + theta_b * t  # t = 0 and 1 give each end bit for bit
            with _serving(weights, point):
                train, held_out = score_adapters(engine, task, None, [task.train_examples(), task.eval_examples()],
                                                 max_new_tokens)
                row = {"t": t, "eval/reward": held_out.mean, "policy/train_reward": train.mean}
                if kl_samples > 0:
                    row["policy/kl"] = mean_kl_to_base(engine, task, None, task.eval_examples(), num_samples=kl_samples,
                                                       max_new_tokens=max_new_tokens, seed=seed,
                                                       serving_base=lambda: _serving(weights, base_flat))
            rows.append(row)
        return rows


def drift_prompts(task: Task, max_prompts: int | None = None) -> list:
    """The prompts the drift is measured on: the task's held-out examples (its training ones where it
    has none), the first ``max_prompts``."""
    return list(task.eval_examples() or task.train_examples())[:max_prompts]


def solution_drift(engine, solution: Solution, task: Task, *, num_samples: int = 2, max_prompts: int | None = None,
                   max_new_tokens: int = 64, seed: int = 0) -> float:
    """KL to the base model on ``task``'s held-out prompts (another task's: the drift off the task the
    run trained on) of a solution, its weights written into the engine in place as
    ``interpolation_path`` serves a point (a LoRA merged); afterwards the engine serves exactly what
    it served before. One number for one solution; ``off_task_drift`` follows a run's checkpoints."""
    examples = drift_prompts(task, max_prompts)
    with _resident(engine, solution.model_dir, sorted(solution.weights)) as (weights, flat):
        base_flat = flat({})
        with _serving(weights, flat(solution.weights)):
            return mean_kl_to_base(engine, task, None, examples, num_samples=num_samples,
                                   max_new_tokens=max_new_tokens, seed=seed,
                                   serving_base=lambda: _serving(weights, base_flat))


def off_task_source(off_task: str | Path) -> Task:
    """Another task to measure drift on: a registered task's name, or a JSONL file of prompts (with
    ``target`` and ``split`` as a JSONL task has them); anything else is a ConfigError naming off_task."""
    text = str(off_task)
    if text in list_tasks():
        return get_task(text)
    if text.endswith(".jsonl") or "/" in text:
        if not Path(text).is_file():
            raise ConfigError(f"off_task: {text} does not exist (a JSONL file of prompts, or one of the tasks "
                              f"{', '.join(list_tasks())})")
        return get_task("jsonl", path=text)
    raise ConfigError(f"off_task: {text!r} is neither a task{did_you_mean(text, list_tasks())} nor a JSONL file; "
                      f"tasks: {', '.join(list_tasks())}")


def off_task_drift(engine, run_dir: str | Path, off_task: str | Path | Task, *, num_samples: int = 2,
                   max_prompts: int | None = None, max_new_tokens: int | None = None) -> list[dict]:
    """KL to the base model on another task's held-out prompts, per kept checkpoint of a run (ES full and
    eggroll: every snapshot generation, rebuilt from the seed log): one row per generation, with
    ``off_task/kl``. The run is opened (its folder's writer lock held meanwhile) and closed again."""
    from .sweep import model_weights_of
    from .train.es import ESRun
    from .train.grpo import GRPORun

    task = off_task if isinstance(off_task, Task) else off_task_source(off_task)
    examples = drift_prompts(task, max_prompts)
    kind = read_config_kind(run_dir)
    run = (ESRun if kind == "es" else GRPORun).resume(run_dir, engine=engine)
    rows = []
    try:
        tokens = max_new_tokens or run.config.max_new_tokens

        def kl(adapter, serving_base=None) -> float:
            return mean_kl_to_base(engine, task, adapter, examples, num_samples=num_samples, max_new_tokens=tokens,
                                   seed=run.config.seed, serving_base=serving_base)

        weights = model_weights_of(run)
        if weights is not None:
            every = run.config.checkpoint_every
            wanted = [g for g in range(run.generation + 1) if g % every == 0 or g == run.generation]
            for generation in weights.replay(wanted):
                rows.append({"generation": generation, "off_task/kl": kl(None, weights.serving_base)})
        else:
            for checkpoint in list_checkpoints(run_dir):
                rows.append({"generation": int(checkpoint.name), "off_task/kl": kl(load_checkpoint(checkpoint)[0])})
    finally:
        run.close()
    return rows
