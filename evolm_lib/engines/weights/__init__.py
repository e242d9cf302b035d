"""The model's own weights written in place inside an engine: full-parameter ES and EGGROLL
(``es_mode`` full and eggroll) and GRPO's ``policy_weights: full``. What ES moves through them is
``train.model_weights.ModelWeights``; an engine hands them out from its ``resident_weights``.

The modules, and where each runs:

- ``resident``: the float32 master beside the live tensors, a member written from its seed, the mean
  restored from the master, the update applied where the weights live (``ResidentWeights``), the
  tensor-parallel slices and snapshots; engine-agnostic. It runs in the process that holds the
  weights: the host for the HF engine (``HostWeights``), vLLM's worker otherwise.
- ``vllm``: ``EngineWeights``, the host side of one vLLM engine's weights (names and shapes, calls
  through ``engines.vllm.client.WorkerClient``).
- ``vllm_worker``: ``WeightsExtension``, the same inside vLLM's worker (finds the engine's tensors and
  their tensor-parallel slices, drives ``ResidentWeights``); mixed into the one worker extension
  vLLM loads by name, ``engines.vllm.worker.WorkerExtension``.
- ``ray``: ``RayWeights`` and ``RaySlots``, on the host, for ``RayEngines``: every engine's weights
  (and EGGROLL's slots) as one client; each engine's actor holds an ``EngineWeights`` of its own.

Nothing is imported here: vLLM's worker imports ``vllm_worker`` by way of ``engines.vllm.worker``,
and needs none of the host side.
"""
