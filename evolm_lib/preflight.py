"""Engine settings checked before any work: the context length against the model's, the KV cache
against what one sequence and one population need, and memory against what the machine has free
(on a GPU shared by ``engines_per_gpu`` engines: for all of them, and how many of them fit,
``engines_that_fit``).

Each failure is a ConfigError that names the project's own settings (``max_model_len``,
``kv_cache_gb``, ``gpu_memory_utilization``, ``max_new_tokens``, ``engines_per_gpu``), raised before a run folder exists
and before an engine starts: vLLM would otherwise fail later with its own names ("Try increasing
gpu_memory_utilization" for a KV cache that is too small). A need that only slows a run down (a
population that does not fit the KV cache at once) is a warning.
"""
from __future__ import annotations

import functools
import math
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import ConfigError
from .engines.memory_plan import (BLOCK_TOKENS, DTYPE_BYTES, ENGINE_ALLOWANCE_BYTES, GIB, check_memory_plan, model_config,
                                  plan_for_run)
from .engines.sizing import EngineSizing

# rope scalings that extend the context beyond max_position_embeddings (as vLLM derives it)
_EXTENDING_ROPE = {"linear", "dynamic", "yarn", "ntk", "dynamic_ntk"}


@dataclass(frozen=True)
class EngineFootprint:
    """One engine's memory on a card, whatever share of it vLLM is given: what counts how many
    engines one card holds (``engines_that_fit``)."""

    weights: int
    """The model's weights in the engine's dtype."""
    master: int
    """es_mode full / eggroll: the float32 master, one member's noise and the optimizer's buffers (else 0)."""
    kv_cache: int
    """KV cache for the engine's share of a call's sequences, each max_model_len tokens long."""
    allowance: int = ENGINE_ALLOWANCE_BYTES
    """CUDA context, CUDA graphs, activations (ENGINE_ALLOWANCE_BYTES)."""

    @property
    def total(self) -> int:
        """Bytes the engine takes on its card."""
        return self.weights + self.master + self.kv_cache + self.allowance

    def describe(self) -> str:
        """"5.5 GiB (weights 1 GiB, ...)" for messages."""
        return (f"{_gib(self.total)} (weights {_gib(self.weights)}, float32 master and buffers {_gib(self.master)}, "
                f"KV cache {_gib(self.kv_cache)}, CUDA graphs and activations {_gib(self.allowance)})")


def engine_footprint(weights: int, master: int, kv_bytes_per_token: int, sequences: int, max_model_len: int,
                     allowance: int = ENGINE_ALLOWANCE_BYTES) -> EngineFootprint:
    """One engine's memory: its weights, its master (es_mode full / eggroll), the KV cache of
    ``sequences`` sequences of ``max_model_len`` tokens (whole KV blocks) and the allowance."""
    kv_cache = sequences * math.ceil(max_model_len / BLOCK_TOKENS) * BLOCK_TOKENS * kv_bytes_per_token
    return EngineFootprint(weights, master, kv_cache, allowance)


def engines_that_fit(card_bytes: int, footprint: EngineFootprint) -> int:
    """The largest engines_per_gpu whose engines all fit in ``card_bytes`` (0: not even one)."""
    return max(card_bytes // footprint.total, 0)


class EngineWarning(UserWarning):
    """A setting that works but slows the run down (e.g. a population that does not fit the KV cache at once)."""


@dataclass(frozen=True)
class EngineBudget:
    """What the checks measured: limits of the model and machine, needs of the run."""

    context_length: int | None
    """Longest sequence the model supports (max_position_embeddings, with rope scaling)."""
    kv_bytes_per_token: int | None
    """KV cache bytes one token takes in every layer, in the engine's dtype."""
    kv_cache_bytes: int | None
    """KV cache the engine will get (None: sized by vLLM from gpu_memory_utilization)."""
    longest_prompt_tokens: int | None
    """Longest train or eval prompt of the task, chat template included."""
    requests_per_call: int
    """Requests of the largest engine call (population or group x prompts)."""
    weights_bytes: int | None
    """The model's weights in the engine's dtype."""

    @property
    def kv_tokens(self) -> int | None:
        """Tokens the KV cache holds."""
        if self.kv_cache_bytes is None or not self.kv_bytes_per_token:
            return None
        return self.kv_cache_bytes // self.kv_bytes_per_token


def context_length(config: dict[str, Any]) -> int | None:
    """The model's longest sequence: max_position_embeddings (or its older names), times an extending rope scaling."""
    length = next((config[k] for k in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
                   if isinstance(config.get(k), int)), None)
    if length is None:
        return None
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in _EXTENDING_ROPE and isinstance(scaling.get("factor"), (int, float)):
        base = scaling.get("original_max_position_embeddings", length) if kind == "yarn" else length
        length = int(base * scaling["factor"])
    return length


def kv_bytes_per_token(config: dict[str, Any], dtype: str) -> int | None:
    """K and V of one token in every attention layer: 2 x layers x KV heads x head size x dtype bytes."""
    layers, heads = config.get("num_hidden_layers"), config.get("num_attention_heads")
    if not (isinstance(layers, int) and isinstance(heads, int)):
        return None
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config.get("hidden_size", 0) // heads
    return 2 * layers * kv_heads * head_dim * DTYPE_BYTES.get(dtype, 4)


def weights_bytes(model_dir: str | Path, config: dict[str, Any], dtype: str) -> int | None:
    """The weight files' size, converted to the engine's dtype."""
    files = list(Path(model_dir).glob("*.safetensors")) or list(Path(model_dir).glob("*.bin"))
    if not files:
        return None
    stored = str(config.get("torch_dtype") or config.get("dtype") or "float32").removeprefix("torch.")
    size = sum(f.stat().st_size for f in files)
    return int(size * DTYPE_BYTES.get(dtype, 4) / DTYPE_BYTES.get(stored, 4))


@functools.lru_cache(maxsize=8)
def _tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def longest_prompt_tokens(model_dir: str | Path, task) -> int | None:
    """Tokens of the task's longest train or eval prompt, rendered as the engine renders it (None: no tokenizer)."""
    from .engines.base import PromptEncoder

    try:
        encoder = PromptEncoder(_tokenizer(str(model_dir)))
        examples = task.train_examples() + task.eval_examples()
        return max((len(encoder.encode(task.prompt(e))) for e in examples), default=0)
    except Exception:  # noqa: BLE001 - no tokenizer or no chat template: the engine reports it itself
        return None


def requests_per_call(config, num_train: int) -> int:
    """Requests of one training call: population (ES) or group (GRPO) x the prompts of a step."""
    prompts = min(config.prompts_per_step or num_train, num_train) or 1
    members = getattr(config, "population_size", None) or getattr(config, "group_size", 1)
    return members * prompts


def _gib(value: float) -> str:
    return f"{value / GIB:.3g} GiB"


def _round_up_gib(value: float) -> float:
    """A kv_cache_gb to suggest: the need rounded up to 2 significant digits."""
    gib = value / GIB
    digits = 1 - int(math.floor(math.log10(gib))) if gib > 0 else 0
    return math.ceil(gib * 10**digits) / 10**digits


def _engine_live() -> bool:
    """True while a vLLM engine runs in this process (a run may share it: memory is already taken)."""
    module = sys.modules.get("evolm_lib.engines.vllm.engine")
    return bool(module is not None and getattr(module.VLLMEngine, "_live_engines", 0) > 0)


def _free_memory(cuda: bool) -> tuple[int, int] | None:
    """(free, total) bytes of the GPU, or of RAM on a CPU machine."""
    try:
        if cuda:
            import torch

            return tuple(int(v) for v in torch.cuda.mem_get_info())
        import psutil

        memory = psutil.virtual_memory()
        return int(memory.available), int(memory.total)
    except Exception:  # noqa: BLE001 - unknown: the engine checks it itself
        return None


def check_engine_settings(config, model_dir: str | Path, task=None, *, cuda: bool | None = None) -> EngineBudget:
    """Check a run's engine settings against the model and the machine; raise ConfigError naming the
    setting to change, warn when the population will not fit the KV cache at once. Returns what it measured."""
    model_dir = Path(model_dir)
    if task is None:
        from .tasks import get_task

        task = get_task(config.task, **config.task_options)
    if cuda is None:
        from .env import has_cuda

        cuda = has_cuda()
    model = model_config(model_dir)
    where = model_dir / "config.json"
    context = context_length(model)
    per_token = kv_bytes_per_token(model, config.dtype)
    weights = weights_bytes(model_dir, model, config.dtype)
    requests = requests_per_call(config, len(task.train_examples()))
    prompt = longest_prompt_tokens(model_dir, task)

    if config.engine != "vllm":  # the HF engine has no context limit of its own and no KV cache to size
        return EngineBudget(context, per_token, None, prompt, requests, weights)

    if context is not None and config.max_model_len > context:
        raise ConfigError(f"max_model_len={config.max_model_len} is longer than the model's context "
                          f"(max_position_embeddings={context} in {where}): set max_model_len <= {context}")
    if config.max_new_tokens >= config.max_model_len:
        raise ConfigError(f"max_new_tokens={config.max_new_tokens} leaves no room for a prompt in "
                          f"max_model_len={config.max_model_len}: raise max_model_len or lower max_new_tokens")
    if prompt is not None and prompt + config.max_new_tokens > config.max_model_len:
        raise ConfigError(
            f"max_model_len={config.max_model_len} is too short for the task's longest prompt ({prompt} tokens) "
            f"plus max_new_tokens={config.max_new_tokens}: raise max_model_len to at least "
            f"{prompt + config.max_new_tokens} or lower max_new_tokens")

    memory_asked = EngineSizing.from_config(config).memory(cuda)  # what the engine will ask for, exactly
    kv_gb, kv_bytes = memory_asked.kv_cache_gb, memory_asked.kv_cache_bytes
    budget = EngineBudget(context, per_token, kv_bytes, prompt, requests, weights)

    if kv_bytes is not None and per_token:
        one_sequence = math.ceil(config.max_model_len / BLOCK_TOKENS) * BLOCK_TOKENS * per_token
        if kv_bytes < one_sequence:
            raise ConfigError(
                f"kv_cache_gb={kv_gb:g} holds {budget.kv_tokens:,} tokens of KV cache for this model "
                f"({per_token:,} bytes a token), fewer than one sequence of max_model_len={config.max_model_len}: "
                f"raise kv_cache_gb to at least {_round_up_gib(one_sequence):g} or lower max_model_len")
        sequence = (prompt or 0) + config.max_new_tokens
        if prompt is not None and requests * sequence > budget.kv_tokens:
            at_once = max(1, budget.kv_tokens // sequence)
            warnings.warn(
                f"kv_cache_gb={kv_gb:g} holds {budget.kv_tokens:,} tokens: {at_once} of the {requests} requests of a "
                f"generation (up to {sequence} tokens each) run at once, the rest wait; kv_cache_gb="
                f"{_round_up_gib(requests * sequence * per_token):g} would run them together",
                EngineWarning, stacklevel=2)

    memory = None if _engine_live() else _free_memory(cuda)
    # engines that share one card (engine_host ray on a GPU): every check below is for all of them
    per_card = config.engines_per_gpu if cuda and config.engine_host == "ray" else 1
    engines = "" if per_card == 1 else f" for each of engines_per_gpu={per_card} engines on the card"
    if memory is not None and cuda:  # a card's share of each engine, term by term, at its tensor_parallel_size
        import torch

        plan = plan_for_run(config, model_dir, sequences=math.ceil(requests / config.num_engines))
        # cards present (a machine told it has a card without torch seeing one: the engine's own count)
        check_memory_plan(plan, card_bytes=memory[0], cards=torch.cuda.device_count() or config.tensor_parallel_size)
    if memory is not None and cuda and config.tensor_parallel_size > 1:
        return budget  # the checks below count the whole model on one card; the plan above splits it
    # (on a CPU every rank shares the host's memory: the whole model is what they need together)
    if memory is not None:
        free, total = memory
        device = "GPU memory" if cuda else "RAM"
        if per_card > 1 and per_token:
            check_engines_per_gpu(config, model_dir, free, weights or 0, per_token, requests)
        if kv_bytes is not None and per_card * (kv_bytes + (weights or 0)) > free:
            raise ConfigError(
                f"kv_cache_gb={kv_gb:g} plus the model's weights ({_gib(weights or 0)}){engines} need more than the "
                f"{_gib(free)} of {device} free now: lower kv_cache_gb" + (" or engines_per_gpu" if engines else ""))
        if kv_bytes is None:
            utilization = memory_asked.gpu_memory_utilization
            share = "share of GPU memory" if cuda else "share of RAM (on a CPU)"
            if per_card * utilization * total > free:
                raise ConfigError(
                    f"gpu_memory_utilization={utilization:g} asks for {_gib(utilization * total)}, the engine's "
                    f"{share}{engines}, but {_gib(free)} are free now: lower gpu_memory_utilization"
                    + ("" if cuda else " or set kv_cache_gb") + (" or engines_per_gpu" if engines else ""))
            if weights is not None and utilization * total < weights:
                raise ConfigError(
                    f"gpu_memory_utilization={utilization:g} gives the engine {_gib(utilization * total)}, less "
                    f"than the model's weights ({_gib(weights)}): raise gpu_memory_utilization")
        engine = kv_bytes + (weights or 0) if kv_bytes is not None else memory_asked.gpu_memory_utilization * total
        beside = None  # (what the run keeps beside the engine, its bytes, the settings that make it smaller)
        if getattr(config, "es_mode", "lora") != "lora":
            beside = (f"es_mode={config.es_mode}: the float32 master of the moved weights and one member's noise "
                      "(and the optimizer's buffers)", weights_mode_bytes(config, model_dir),
                      "move fewer weights (es_weights, target_modules)")
        elif getattr(config, "policy_weights", "lora") == "full":
            beside = ("policy_weights=full: the float32 policy model, the gradients and AdamW's two moments of the "
                      "trained weights and the engine's float32 copy of them"
                      + (" and the KL reference model" if config.beta > 0 else ""), policy_weights_bytes(config, model_dir),
                      "train fewer weights (grpo_weights, target_modules, layers_to_transform)")
        if beside is not None and per_card * beside[1] > free - per_card * engine:
            what, needed, fewer = beside
            raise ConfigError(
                f"{what} need {_gib(needed)} of {device} beside the engine{engines}, which leaves "
                f"{_gib(max(free - per_card * engine, 0))} of the {_gib(free)} free now: lower gpu_memory_utilization "
                f"or kv_cache_gb, or {fewer}" + (", or lower engines_per_gpu" if engines else ""))
    return budget


def check_engines_per_gpu(config, model_dir: str | Path, free: int, weights: int, kv_bytes_per_token: int,
                          requests: int) -> EngineFootprint:
    """Refuse an engines_per_gpu whose engines do not fit the card's free memory (``engines_that_fit``
    of one engine's footprint: its share of a call's sequences, each max_model_len long, an upper
    bound in es_mode full, where an engine serves one member at a time); returns the footprint."""
    master = weights_mode_bytes(config, model_dir) if getattr(config, "es_mode", "lora") != "lora" else 0
    sequences = math.ceil(requests / config.num_engines)
    footprint = engine_footprint(weights, master, kv_bytes_per_token, sequences, config.max_model_len)
    fit = engines_that_fit(free, footprint)
    if config.engines_per_gpu > fit:
        raise ConfigError(
            f"engines_per_gpu={config.engines_per_gpu} engines need {_gib(config.engines_per_gpu * footprint.total)} of "
            f"GPU memory, {footprint.describe()} each for {sequences} sequences of max_model_len="
            f"{config.max_model_len}, but the card has {_gib(free)} free now, which hold {fit}: set engines_per_gpu <= "
            f"{fit}" + ("" if fit else ", or move fewer weights, or lower max_model_len"))
    return footprint


def policy_weights_bytes(config, model_dir: str | Path) -> int:
    """Bytes GRPO with policy_weights full keeps beside the engine: the float32 policy model, and for
    each trained weight its gradient, AdamW's two moments and the engine's float32 copy (its master);
    with beta > 0 a float32 reference model too."""
    from .engines.weights.resident import targeted_weight_shapes

    model = sum(math.prod(shape) for shape in targeted_weight_shapes(model_dir, "all").values())
    targets, layers = config.weight_targets()
    trained = sum(math.prod(shape) for shape in targeted_weight_shapes(model_dir, targets, layers).values())
    return 4 * (model * (2 if config.beta > 0 else 1) + 4 * trained)


def weights_mode_bytes(config, model_dir: str | Path) -> int:
    """Bytes es_mode full or eggroll keeps beside the engine: the float32 master of the moved weights,
    one member's float32 noise, and Adam's two moments or SGD momentum's buffer."""
    from .engines.weights.resident import targeted_weight_shapes

    targets, layers = config.weight_targets()
    values = sum(math.prod(shape) for shape in targeted_weight_shapes(model_dir, targets, layers).values())
    buffers = 2 if config.optimizer == "adam" else (1 if config.momentum > 0 else 0)
    return 4 * values * (2 + buffers)


# --------------------------------------------------------------------------- sizes a machine can hold

REQUEST_HOST_BYTES = 4 * 2**10
"""Host memory one request of an engine call holds at least, beside its tokens: vLLM's request,
sampling parameters and output objects, and the run's completion text, reward and details."""
TOKEN_HOST_BYTES = 40
"""Host memory one token of a request holds at least: its id as a Python int in vLLM's token lists
(a pointer and the int) and its share of the completion's text."""
METRICS_ROW_BYTES = 2 * 2**10
"""Host memory one metrics row takes when the run, its plots and summaries read the rows back."""

@dataclass(frozen=True)
class RunSizes:
    """What a run's sizes ask of the machine (``check_run_sizes``), in bytes."""

    requests: int
    """Requests of the run's largest engine call (``engines.sizing.largest_call``)."""
    sequence_tokens: int
    """Tokens of one request: its longest prompt (where the tokenizer is at hand) plus max_new_tokens."""
    host_bytes: int
    """Host memory the run needs at least: the largest call's requests, its metrics rows and, on a CPU,
    the engine's LoRA slots."""
    card_bytes: int
    """Memory on the card the engine's LoRA slots need at least (0 on a CPU)."""
    completions: int
    """Training completions the run plans: generations (steps) x population (group) x prompts per step."""


def _size_fields(config) -> list[str]:
    """The sizes of a run's settings that the memory check can name, most likely culprit first."""
    members = "population_size" if hasattr(config, "population_size") else "group_size"
    length = "num_generations" if hasattr(config, "num_generations") else "num_steps"
    return [members, "prompts_per_step", "max_new_tokens", length]


def lora_slot_bytes(config, model_dir: str | Path | None) -> int:
    """Bytes of one of the engine's LoRA slots (its rank, vLLM's next supported one, over every target
    weight: rank x (in + out) values in the engine's dtype); 0 without a local model folder."""
    if model_dir is None or getattr(config, "engine", "vllm") != "vllm":
        return 0
    from .engines.weights.resident import targeted_weight_shapes

    try:
        shapes = targeted_weight_shapes(model_dir, config.target_modules, config.layers_to_transform)
    except Exception:  # noqa: BLE001 - a model folder it cannot read: the engine check names it
        return 0
    rank = EngineSizing.from_config(config).engine_lora_rank
    return rank * sum(sum(shape[:2]) for shape in shapes.values() if len(shape) == 2) * DTYPE_BYTES.get(config.dtype, 4)


def _run_needs(config, sizes: dict[str, int], task_sizes: tuple[int, int, int], prompt_tokens: int,
               slot_bytes: int, cuda: bool) -> RunSizes:
    """RunSizes of ``config`` with the sizes in ``sizes`` (field -> value) in place of its own."""
    from .engines.sizing import largest_call

    sized = config.model_copy(update=sizes)  # no validation: a pure function of the sizes
    requests = largest_call(sized, *task_sizes)
    tokens = prompt_tokens + sized.max_new_tokens
    calls = requests * (REQUEST_HOST_BYTES + tokens * TOKEN_HOST_BYTES)
    length = getattr(sized, "num_generations", None) or getattr(sized, "num_steps", 1)
    members = getattr(sized, "population_size", None) or getattr(sized, "group_size", 1)
    slots = 0
    if slot_bytes:
        slots = EngineSizing.from_config(config).replace(
            max_loras=members + 1 if hasattr(sized, "population_size") else 1).engine_loras * slot_bytes
    prompts = min(sized.prompts_per_step or task_sizes[0], task_sizes[0]) or 1
    host = calls + length * METRICS_ROW_BYTES + (0 if cuda else slots)
    return RunSizes(requests, tokens, host, slots if cuda else 0, length * members * prompts)


def _largest_fitting(fits, current: int) -> int:
    """The largest value in 1..current for which ``fits`` holds (0: not even 1); ``fits`` grows false with the value."""
    if not fits(1):
        return 0
    low, high = 1, current
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def check_run_sizes(config, model_dir: str | Path | None = None, *, cuda: bool | None = None,
                    host_bytes: int | None = None, card_bytes: int | None = None, tokenize: bool = True) -> RunSizes:
    """Refuse sizes no run on this machine can hold, before any engine starts or anything is allocated:
    population_size (group_size), prompts_per_step, max_new_tokens and num_generations (num_steps), through
    the requests of the run's largest call, its metrics rows and the engine's LoRA slots, against the
    host's memory (``psutil``) and, on a GPU, the card's. A ConfigError names the field and the largest
    value that fits. ``model_dir`` (a local model folder) adds the prompts' tokens and the LoRA slots;
    ``host_bytes`` and ``card_bytes`` replace the machine's totals; ``tokenize`` False leaves the prompts'
    tokens out (no tokenizer loaded: a lower bound still). Returns what it measured."""
    if cuda is None:
        from .env import has_cuda

        cuda = has_cuda()
    if host_bytes is None:
        import psutil

        host_bytes = int(psutil.virtual_memory().total)
    if card_bytes is None and cuda:
        memory = _free_memory(True)
        card_bytes = memory[1] if memory else None
    from .tasks import get_task

    task = get_task(config.task, **config.task_options)
    task_sizes = (len(task.train_examples()), len(task.eval_examples()), len(task.validation_examples()))
    prompt_tokens = 0
    if tokenize and model_dir is not None and _tokenizer_is_local(model_dir):
        prompt_tokens = longest_prompt_tokens(model_dir, task) or 0
    slot_bytes = lora_slot_bytes(config, model_dir)
    current = {name: getattr(config, name) for name in _size_fields(config)}
    current = {name: value for name, value in current.items() if value is not None}

    def needs(**sizes: int) -> RunSizes:
        return _run_needs(config, {**current, **sizes}, task_sizes, prompt_tokens, slot_bytes, cuda)

    def fits(sizes: RunSizes) -> bool:
        return sizes.host_bytes <= host_bytes and (card_bytes is None or sizes.card_bytes <= card_bytes)

    found = needs()
    if fits(found):
        return found
    # the field that is furthest out of range: the one whose largest fitting value is the smallest share of its own
    largest = {name: _largest_fitting(lambda v, name=name: fits(needs(**{name: v})), value)
               for name, value in current.items()}
    culprits = sorted((name for name in largest if largest[name]), key=lambda n: largest[n] / current[n])
    where = (f"{_gib(found.host_bytes)} of host memory (this machine has {_gib(host_bytes)})"
             if found.host_bytes > host_bytes else
             f"{_gib(found.card_bytes)} of GPU memory for the engine's LoRA slots (the card has {_gib(card_bytes)})")
    what = (f"its largest engine call holds {found.requests:,} requests of up to {found.sequence_tokens:,} tokens, "
            f"it writes {getattr(config, 'num_generations', None) or getattr(config, 'num_steps', 1):,} metrics rows")
    if culprits:
        name = culprits[0]
        raise ConfigError(f"{name}={current[name]:,} is more than this machine can hold: {what}, which needs at "
                          f"least {where}; the largest {name} that fits is {largest[name]:,}",
                          [(name, f"at most {largest[name]:,} on this machine, got {current[name]:,}")])
    raise ConfigError(f"{', '.join(f'{n}={v:,}' for n, v in current.items())}: {what}, which needs at least {where}, "
                      "more than this machine can hold even with any one of them at 1; lower them")


def _tokenizer_is_local(model_dir: str | Path) -> bool:
    """True when the model folder holds its tokenizer (loading it costs no download)."""
    folder = Path(model_dir)
    return any((folder / name).exists() for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))
