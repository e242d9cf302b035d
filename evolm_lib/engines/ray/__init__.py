"""Past one engine: calls sharded over K vLLM engines, each in a Ray actor on one GPU, a share of one
(``engines_per_gpu`` engines on a card, each with its own copy of the weights; they start one after
another) or one CPU slice, surviving a lost engine. Behind the same ``Engine`` protocol as one engine, so ES and GRPO
runs use it unchanged (``engine_host: ray`` in their settings).

How a call travels:
- A :class:`Population` is split into K balanced blocks of members (``Population.split``). Its mean
  adapter goes into Ray's object store ONCE per call; each engine receives a reference to it and its
  members' seeds and signs, and makes the members' weights itself.
- A list of adapters is split by adapters when it has at least K of them; otherwise (the mean
  adapter's greedy scoring, GRPO rollouts of one policy) by prompts, each block keeping its requests'
  global prompt indices, so seeded sampling draws exactly what one engine would.
- Completions come back in member (adapter) and prompt order; the runner sees one complete table.

The model's own weights as the ES mean (``es_mode`` full and eggroll): every engine keeps its own
float32 master of the mean (``engines.weights``). An update goes to every engine as seeds and shaped
fitness, and each computes the same new mean where its weights live, so no full-size tensor crosses
the network; a snapshot is read from one engine, and loaded into all of them (through the object
store, once). ``run_members`` gives each engine a contiguous block of the members (written from their
seeds one after another, or into its EGGROLL slots) and a block of the mean's scoring prompts, all in
one concurrent call.

Faults: an engine's actor that dies (killed, out of memory, node lost) is restarted by Ray
(``max_restarts``) and the shards it held are resubmitted once it answers again. A shard lost
``max_attempts`` times, or an engine that stays dead, raises :class:`EngineLostError`; nothing of that
call reaches the runner, so a run keeps its last finished generation (checkpointed by
``RunLoop.commit``) and resumes from it when started again. An engine that held a run's mean (es_mode
full or eggroll) comes back without it and is given it back before its call is resubmitted
(``RayWeights.rebuild``: from an engine that holds it, else from the run folder's newest snapshot and
seed log, checked by checksum against the other engines); only where that fails does the call end
with :class:`EngineLostError`.

Ray is optional (``pip install -e '.[ray]'``) and imported only when ``RayEngines`` is built.
Qiu et al. 2025 (arXiv 2509.24372) run one vLLM engine per GPU under Ray; EGGROLL's vLLM port
(Sarkar et al. 2025) shards the population over Ray engines; neither survives a lost engine.

The modules, each with one job: ``cluster`` (Ray's import, the address, resources), ``sharding`` (a
call shared out and put back, pure), ``actor`` (one engine's actor and its environment), ``pool``
(the actors called together, lost ones brought back), ``engines`` (``RayEngines``: all of them
behind the one ``Engine`` protocol); the mean inside every engine is ``engines.weights.ray``.
Nothing is imported here: Ray's workers import ``actor`` by name.
"""
