"""A run folder's settings: config.yaml written and read, which changes let a run continue, and the
state a run resumes from (its latest intact checkpoint, with metrics.jsonl made to match it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from ..config import ConfigError, config_class
from ..lora import AdapterWeights
from .checkpoints import latest_intact_checkpoint, load_checkpoint
from .metrics_file import read_metrics, rewrite_metrics


# Settings that do not change the science: a finished run may be extended with other values.
# Where the engines run and how adapters reach them do not change the rows either (tested equal),
# nor where else the rows are streamed (report_to: a run gains TensorBoard with all its rows so far).
EXTENDABLE = frozenset({"num_generations", "num_steps", "eval_every", "checkpoint_every", "keep_checkpoints",
                        "evaluator", "num_engines", "ray_address", "adapter_transfer", "score_in_population",
                        "report_to"})


def write_run_config(run_dir: str | Path, config, kind: str) -> None:
    """config.yaml: the resolved settings plus the run's kind (es | grpo)."""
    (Path(run_dir) / "config.yaml").write_text(yaml.safe_dump({"kind": kind, **config.to_dict()}, sort_keys=False))


def read_config_kind(run_dir: str | Path) -> str:
    """'es' or 'grpo', from a run folder's config.yaml."""
    data = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
    return data.get("kind", "es")


def load_run_config(run_dir: str | Path, cls=None):
    """The settings a run folder was created with (``cls``: the config class; default from its kind)."""
    data = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
    kind = data.pop("kind", "es")
    data.pop("label", None)  # a display label for analysis, not a setting
    if kind == "es" and "noise_scheme" not in data:
        data["noise_scheme"] = "per_tensor"  # runs recorded before the setting existed drew noise tensor by tensor
    return (cls or config_class(kind)).from_dict(data)


def extended_settings(run_dir: str | Path, config) -> list[str]:
    """The settings ``config`` changes in the run that ``run_dir`` holds, all of them ``EXTENDABLE``
    (a larger budget, another cadence: the run may continue with them); ``ConfigError`` naming the
    others, which would make a different run."""
    existing = load_run_config(run_dir, type(config)).to_dict()
    changed = sorted(k for k, v in config.to_dict().items() if existing.get(k) != v)
    fixed = [k for k in changed if k not in EXTENDABLE]
    if fixed:
        hint = ("; it was made before noise_scheme existed and draws noise per tensor: pass "
                "noise_scheme='per_tensor' to continue it" if "noise_scheme" in fixed
                and existing.get("noise_scheme") == "per_tensor" else "")
        if "deterministic" in fixed and existing.get("deterministic"):
            hint += ("; it ran with deterministic decoding, and continuing it without would give rows an "
                     "uninterrupted run cannot: pass deterministic=True")
        raise ConfigError(f"{run_dir} holds a run with other settings ({', '.join(fixed)}); "
                          f"use another run_dir or overwrite=True{hint}")
    return changed


@dataclass(frozen=True)
class RunState:
    """What a run is built from: a new run's settings and first adapter, or what its latest checkpoint holds."""

    config: Any
    """The run's settings (ESConfig or GRPOConfig)."""
    adapter: AdapterWeights | None
    """The adapter the run moves (the ES mean, the GRPO policy); None when it moves the model's own weights."""
    optimizer_tensors: dict[str, torch.Tensor] | None = None
    """The optimizer's state as named tensors; None: a fresh optimizer."""
    generation: int = 0
    """Generations (ES) or steps (GRPO) done."""
    counters: dict = field(default_factory=dict)
    """Sample counters and wall clock (completions, tokens, eval_completions, wall_s)."""
    rows: list[dict] = field(default_factory=list)
    """The metrics rows so far, as metrics.jsonl now holds them."""
    saved: dict = field(default_factory=dict)
    """The checkpoint's state.json ({} for a new run): what the run kinds keep beyond the loop's."""

    def pending_row(self) -> dict | None:
        """A checkpoint of the earlier layout whose row waited for its scores (they rode in the next
        engine call) and never reached metrics.jsonl: the row, to be scored again on resume; else None."""
        logged = bool(self.rows) and self.rows[-1].get("generation") == self.generation
        return dict(self.saved["row"]) if self.saved.get("scores_pending") and not logged else None


def load_latest(run_dir: str | Path, kind: str, cls) -> RunState:
    """The state of a run folder's latest intact checkpoint (``kind``: es | grpo; ``cls``: its config
    class; a damaged newer one is set aside: ``latest_intact_checkpoint``).

    metrics.jsonl is made to match it: rows past the checkpoint come from a generation whose
    checkpoint never landed and are dropped (that generation reruns); a row lost between
    checkpoint and log comes back from state.json (or, in a folder of the earlier layout whose row
    waited for its scores, is scored again: ``RunState.pending_row``)."""
    run_dir = Path(run_dir)
    found = read_config_kind(run_dir)
    if found != kind:
        raise ConfigError(f"{run_dir} holds a {found!r} run, not a {kind.upper()} run")
    config = load_run_config(run_dir, cls)
    adapter, optimizer_tensors, state = load_checkpoint(latest_intact_checkpoint(run_dir))
    if adapter is not None and adapter.spec != config.lora_spec():
        raise ConfigError(f"checkpoint adapter {adapter.spec} does not match config {config.lora_spec()}")
    generation = int(state["generation"])
    rows = [r for r in read_metrics(run_dir) if r.get("generation", -1) <= generation]
    if (not rows or rows[-1].get("generation") != generation) and not state.get("scores_pending"):
        rows.append(state["row"])
    rewrite_metrics(run_dir, rows)
    return RunState(config=config, adapter=adapter, optimizer_tensors=optimizer_tensors, generation=generation,
                    counters=dict(state["counters"]), rows=rows, saved=state)
