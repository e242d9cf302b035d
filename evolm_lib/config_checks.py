"""The errors of settings and the checks the config classes share: a ConfigError that names the
field (from pydantic's ValidationError, each bad field by its path), the nearest valid name for a
misspelt one, and the weight selections (``es_weights``, ``grpo_weights``). Re-exported by
`evolm_lib.config`, where the settings themselves live."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

RENAMED_SETTINGS = {"evaluator": "engine_host"}
"""Settings by an older name -> their name now: the config.yaml of older run folders, older specs and
checkpoints' copies of the settings read as they did."""


class ConfigError(ValueError):
    """A setting is invalid; the message names the field.

    ``errors`` holds (field path, message) pairs where the error came from a config class, so a
    caller that knows where a field was written (e.g. a notebook's ``settings`` mapping, a sweep's
    ``es:`` section) can name that place with :meth:`located`."""

    def __init__(self, message: str, errors: list[tuple[str, str]] | None = None, config_name: str = ""):
        super().__init__(message)
        self.errors = list(errors or [])
        self.config_name = config_name

    @classmethod
    def from_errors(cls, config_name: str, errors: list[tuple[str, str]]) -> "ConfigError":
        """"invalid ESConfig: sigma: ...; lora_rank: ..." from (field path, message) pairs."""
        return cls(_error_text(config_name, errors), errors, config_name)

    def located(self, paths: dict[str, str]) -> "ConfigError":
        """The same error with each field renamed to its path in ``paths`` (field -> path), where given."""
        if not self.errors:
            return self
        return ConfigError.from_errors(self.config_name, [(paths.get(f, f), m) for f, m in self.errors])


def config_error(cls: type[BaseModel], error: ValidationError) -> ConfigError:
    """A ConfigError naming every bad field: its path (``task_options.path``), or, for a check over
    several fields, the field its message starts with; a misspelt name gets the nearest valid one."""
    fields = list(cls.model_fields)
    errors = []
    for item in error.errors():
        field = ".".join(str(p) for p in item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown setting" + did_you_mean(field, fields)
        elif not field:  # a model-level check: its message starts with the field it is about
            field, message = _leading_field(message, fields)
        errors.append((field, message))
    return ConfigError.from_errors(cls.__name__, errors)


def _leading_field(message: str, fields: list[str]) -> tuple[str, str]:
    """("population_size", "must be even ...") from "population_size must be even ..." or
    "population_size: must be ..."; ("(settings)", message) when it names no field first."""
    for name in sorted(fields, key=len, reverse=True):
        if not message.startswith(name) or message[len(name):len(name) + 1] not in (":", ".", " "):
            continue
        head, colon, rest = message.partition(": ")
        if colon and " " not in head:  # "task_options.path: ..." names a nested field by its path
            return head, rest
        return name, message[len(name) + 1:].strip()
    return "(settings)", message


def _error_text(name: str, errors: list[tuple[str, str]]) -> str:
    return f"invalid {name}: " + "; ".join(f"{field}: {message}" for field, message in errors)


def did_you_mean(name: str, valid: list[str] | tuple[str, ...]) -> str:
    """" (did you mean sigma?)" for a misspelt name close to a valid one (difflib), else ""."""
    import difflib

    close = difflib.get_close_matches(str(name), [str(v) for v in valid], n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def check_weight_selection(field: str, selection: str | None) -> None:
    """Fail unless a weight selection is None (the LoRA target_modules) or "all"."""
    if selection not in (None, "all"):
        raise ValueError(f"{field}: None (the LoRA target_modules) or 'all', got {selection!r}")


def renamed_settings(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with settings given by an older name (``RENAMED_SETTINGS``) under their name now; a
    setting given under both names with different values is refused, naming both."""
    if not any(old in data for old in RENAMED_SETTINGS):
        return data
    data = dict(data)
    for old, new in RENAMED_SETTINGS.items():
        if old in data:
            value = data.pop(old)
            if new in data and data[new] != value:
                raise ConfigError(f"{old}: the older name of {new}, given as {value!r} beside {new}: {data[new]!r}; "
                                  f"keep {new} only", [(old, f"the older name of {new}")])
            data.setdefault(new, value)
    return data
