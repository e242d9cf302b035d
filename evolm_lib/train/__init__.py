"""Runs: the loop ES and GRPO share (``loop.RunLoop``), ``es.ESRun`` (ask, evaluate, tell, commit),
what ES moves behind one protocol (``es_parameters.ESParameters``: ``LoraMean``, and
``model_weights.ModelWeights`` for full-parameter ES and EGGROLL), ``grpo.GRPORun`` and its
transformers + peft policy (``policy``).

This layer joins the pure maths (``es``, ``grpo``, ``zo``, ``tasks``) with the engines and run
folders; the modules one generation passes through are listed in ``docs/es-loop.md``.
"""
