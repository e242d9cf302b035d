"""The one class vLLM mixes into its worker, loaded by its dotted name (``EXTENSION``, passed as
``worker_extension_cls``): resident LoRA slots (``worker_slots``) and resident weights
(``engines.weights.vllm_worker``) in one worker, so EGGROLL can write factors into the slots beside
the mean's weights."""
from __future__ import annotations

from .worker_slots import LoRASlotsExtension
from ..weights.vllm_worker import WeightsExtension


class WorkerExtension(LoRASlotsExtension, WeightsExtension):
    """What vLLM mixes into its worker (``worker_extension_cls=EXTENSION``): resident LoRA slots and
    resident weights, called from the host through ``LLM.collective_rpc``."""


EXTENSION = f"{WorkerExtension.__module__}.{WorkerExtension.__qualname__}"
"""The ``worker_extension_cls`` an engine must be started with to host resident slots and weights."""
