"""A run folder's settings: config.yaml written and read, which changes let a run continue, and the
state a run resumes from (its latest intact checkpoint, with metrics.jsonl made to match it)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from ..config import CONFIG_CLASSES, ConfigError, config_class
from ..lora import AdapterWeights
from .checkpoints import CONFIG_COPY, free_name, latest_intact_checkpoint, list_checkpoints, load_checkpoint, verify_checkpoint
from .durable import fsync_dir, naming
from .metrics_file import read_metrics, rewrite_metrics, row_generation

CONFIG = "config.yaml"
DAMAGED_CONFIG = "config.damaged.yaml"  # a damaged config.yaml, set aside by restore_run_config


class RunFolderDamaged(ConfigError):
    """A file of a run folder does not parse or validate; the message names it, the line, and what to do."""


OLDER_SETTINGS = (("noise_scheme", "per_tensor", "draws noise per tensor"),
                  ("optimizer_step", "formulas", "steps by the formulas term by term"))
"""ES settings added after runs were recorded without them: (name, the value a folder whose settings
lack it loads with, what that value does), so such a run resumes as it began."""

# Settings that do not change the science: a finished run may be extended with other values.
# Where the engines run and how adapters reach them do not change the rows either (tested equal),
# nor where else the rows are streamed (report_to: a run gains TensorBoard with all its rows so far).
# Where GRPO's policy updates is the same maths (equal rows on a CPU); on a GPU it picks other kernels,
# and a run made before the setting existed continues as it ran with policy_process: same.
EXTENDABLE = frozenset({"num_generations", "num_steps", "eval_every", "checkpoint_every", "keep_checkpoints",
                        "engine_host", "num_engines", "ray_address", "adapter_transfer", "score_in_population",
                        "report_to", "policy_process"})


def write_run_config(run_dir: str | Path, config, kind: str) -> None:
    """config.yaml: the resolved settings plus the run's kind (es | grpo)."""
    write_config_data(run_dir, {"kind": kind, **config.to_dict()})


def write_config_data(run_dir: str | Path, data: dict) -> None:
    """config.yaml from settings as plain data (the kind first, then the settings in their config
    class's order, any others after them): how a run writes it, for settings read back from elsewhere
    (a compacted study's run lines, ``tune.restore``) without validating them again."""
    cls = CONFIG_CLASSES.get(data.get("kind", "es"))
    order = ["kind", *(cls.model_fields if cls is not None else ())]
    ordered = {key: data[key] for key in order if key in data}
    ordered.update((key, value) for key, value in data.items() if key not in ordered)
    with naming(Path(run_dir) / CONFIG):
        (Path(run_dir) / CONFIG).write_text(yaml.safe_dump(ordered, sort_keys=False))


def _what_to_do(run_dir: Path) -> str:
    """The ways out of a damaged config.yaml: the copy the newest intact checkpoint keeps, or a new run."""
    copies = [p for p in reversed(list_checkpoints(run_dir)) if verify_checkpoint(p) is None
              and CONFIG_COPY in json.loads((p / "state.json").read_text())]
    restore = (f"restore it from checkpoint {copies[0].name}'s copy with evolm_lib.runs.restore_run_config({str(run_dir)!r}) "
               f"(the damaged file is kept as {DAMAGED_CONFIG}), or " if copies else "restore it from a copy, or ")
    return restore + "start the run again in this folder with overwrite=True (evolm batch --overwrite POINT)"


def read_config_file(run_dir: str | Path) -> dict:
    """config.yaml of a run folder as a mapping; ``RunFolderDamaged`` naming the file, the line and
    what the user can do where it does not parse or holds no mapping of settings."""
    run_dir = Path(run_dir)
    path = run_dir / CONFIG
    try:
        data = yaml.safe_load(path.read_bytes().decode("utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        # the construct that did not close (context) is where the damage is; the parser stops after it
        start, stop = getattr(error, "context_mark", None), getattr(error, "problem_mark", None)
        mark = start or stop
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = " ".join(str(part) for part in (getattr(error, "context", None), getattr(error, "problem", None)) if part)
        problem = problem or str(error).splitlines()[0]
        if start is not None and stop is not None:
            problem += f"; the parser stopped at line {stop.line + 1}, column {stop.column + 1}"
        raise RunFolderDamaged(f"{path}{where}: the run folder's settings do not parse ({problem}); "
                               f"{_what_to_do(run_dir)}") from None
    if not isinstance(data, dict):
        raise RunFolderDamaged(f"{path}, line 1: the run folder's settings are not a mapping of settings "
                               f"(found {type(data).__name__}); {_what_to_do(run_dir)}")
    return data


def read_config_kind(run_dir: str | Path) -> str:
    """'es' or 'grpo', from a run folder's config.yaml."""
    return read_config_file(run_dir).get("kind", "es")


def load_run_config(run_dir: str | Path, cls=None):
    """The settings a run folder was created with (``cls``: the config class; default from its kind);
    ``RunFolderDamaged`` where config.yaml does not parse or its settings do not validate."""
    data = read_config_file(run_dir)
    kind = data.pop("kind", "es")
    data.pop("label", None)  # a display label for analysis, not a setting
    for name, old, _ in OLDER_SETTINGS if kind == "es" else ():
        data.setdefault(name, old)
    try:
        return (cls or config_class(kind)).from_dict(data)
    except ConfigError as error:
        lines = (Path(run_dir) / CONFIG).read_text().splitlines()
        fields = [name.split(".")[0] for name, _ in (error.errors or [])]
        line = next((n for n, text in enumerate(lines, start=1) for f in fields if text.startswith(f"{f}:")), None)
        where = f", line {line}" if line else ""
        raise RunFolderDamaged(f"{Path(run_dir) / CONFIG}{where}: the run folder's settings do not validate ({error}); "
                               f"{_what_to_do(Path(run_dir))}", error.errors) from None


def restore_command(run_dir: str | Path) -> str:
    """The shell command that puts back a run folder's config.yaml (``restore_run_config``), with this
    Python, the one that has evolm_lib."""
    import shlex
    import sys

    return (f"{shlex.quote(sys.executable)} -c "
            f"\"from evolm_lib.runs import restore_run_config; restore_run_config({str(Path(run_dir))!r})\"")


def missing_config(run_dir: str | Path) -> str | None:
    """What to say of a run folder that holds checkpoints but no config.yaml (deleted, or lost with a
    disk): the file, the checkpoints, and the command that restores it from the newest intact copy
    (or, without one, that the run must start again); None when config.yaml is there or the folder holds no run."""
    run_dir = Path(run_dir)
    checkpoints = list_checkpoints(run_dir) if run_dir.is_dir() else []
    if (run_dir / CONFIG).exists() or not checkpoints:
        return None
    copies = [p for p in reversed(checkpoints) if verify_checkpoint(p) is None
              and CONFIG_COPY in json.loads((p / "state.json").read_text())]
    held = f"the folder holds checkpoints up to {checkpoints[-1].name}"
    if not copies:
        return (f"{run_dir / CONFIG} is missing ({held}, none with an intact copy of it): restore it from a copy, "
                "or start the run again (overwrite)")
    return (f"{run_dir / CONFIG} is missing ({held}): restore it from checkpoint {copies[0].name}'s copy with "
            f"`{restore_command(run_dir)}`, then run the same command again; or start the run again (overwrite)")


def restore_run_config(run_dir: str | Path) -> Path:
    """Put back config.yaml from the copy the newest intact checkpoint keeps; a config.yaml there is
    first renamed to config.damaged.yaml (never deleted). Returns the checkpoint used."""
    run_dir = Path(run_dir)
    for checkpoint in reversed(list_checkpoints(run_dir)):
        if verify_checkpoint(checkpoint) is not None:
            continue
        text = json.loads((checkpoint / "state.json").read_text()).get(CONFIG_COPY)
        if text is None:
            continue
        if (run_dir / CONFIG).exists():
            os.replace(run_dir / CONFIG, free_name(run_dir, DAMAGED_CONFIG))
        temporary = run_dir / ".config.yaml.tmp"
        temporary.write_text(text)
        os.replace(temporary, run_dir / CONFIG)
        fsync_dir(run_dir)
        return checkpoint
    raise FileNotFoundError(f"{run_dir} holds no intact checkpoint with a copy of {CONFIG}: restore it from a copy, "
                            "or start the run again with overwrite=True")


def extended_settings(run_dir: str | Path, config) -> list[str]:
    """The settings ``config`` changes in the run that ``run_dir`` holds, all of them ``EXTENDABLE``
    (a larger budget, another cadence: the run may continue with them); ``ConfigError`` naming the
    others, which would make a different run."""
    existing = load_run_config(run_dir, type(config)).to_dict()
    changed = sorted(k for k, v in config.to_dict().items() if existing.get(k) != v)
    fixed = [k for k in changed if k not in EXTENDABLE]
    if fixed:
        recorded = read_config_file(run_dir)
        hint = "".join(f"; it was made before {name} existed and {what}: pass {name}={old!r} to continue it"
                       for name, old, what in OLDER_SETTINGS if name in fixed and name not in recorded)
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
    waited for its scores, is scored again: ``RunState.pending_row``). A damaged line's row comes back
    from the checkpoints or stays marked missing, and its bytes are kept in metrics.damaged.jsonl
    (``read_metrics``, ``rewrite_metrics``)."""
    run_dir = Path(run_dir)
    found = read_config_kind(run_dir)
    if found != kind:
        raise ConfigError(f"{run_dir} holds a {found!r} run, not a {kind.upper()} run")
    config = load_run_config(run_dir, cls)
    adapter, optimizer_tensors, state = load_checkpoint(latest_intact_checkpoint(run_dir))
    if adapter is not None and adapter.spec != config.lora_spec():
        raise ConfigError(f"checkpoint adapter {adapter.spec} does not match config {config.lora_spec()}")
    generation = int(state["generation"])
    rows = [r for r in read_metrics(run_dir) if row_generation(r) <= generation]
    if (not rows or rows[-1].get("generation") != generation) and not state.get("scores_pending"):
        rows.append(state["row"])
    rewrite_metrics(run_dir, rows)
    return RunState(config=config, adapter=adapter, optimizer_tensors=optimizer_tensors, generation=generation,
                    counters=dict(state["counters"]), rows=rows, saved=state)
