"""vLLM as the engine: a whole population (N adapters x M prompts) in ONE batched call, its members
as adapter files or written in place into resident LoRA slots, and the model's own weights written
in place as the ES mean.

The modules, each with one job, dependencies pointing one way (down this list):

- ``rpc``: what crosses between the host and vLLM's worker (errors, tensors and settings as plain
  data, the slots' stored form, fingerprint and digests);
- ``worker_slots``: the worker side of resident LoRA slots; ``worker``: the one ``WorkerExtension``
  vLLM loads by its dotted name (``EXTENSION``), those slots with the worker side of the model's own
  weights (``engines.weights.vllm_worker``);
- ``client``: ``WorkerClient``, the host's one door into the worker, a method per extension call;
- ``requests``: the request loop, every grid of a call in one ``LLM.generate``;
- ``adapters``: adapters handed over as files; ``slots``: populations in resident LoRA slots, the
  host side (the model's own weights, host side: ``engines.weights.vllm``);
- ``startup``: the engine's arguments and start; ``workarounds``: vLLM bugs, each with its version;
- ``engine``: ``VLLMEngine``, behind the ``Engine`` protocol.

Nothing is imported here: vLLM's worker imports ``worker`` by name, and needs none of the host side.
"""
