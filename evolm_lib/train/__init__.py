"""Runs: the loop ES and GRPO share (``loop.RunLoop``), ``es.ESRun`` (ask, evaluate, tell),
``grpo.GRPORun`` and its transformers + peft policy (``policy``).

This layer joins the pure maths (``es``, ``grpo``, ``zo``, ``tasks``) with the engines and run folders;
one generation reads through three files: ``train/es.py`` (the loop's steps), ``es/core.py`` (the
update) and the engine's write (``engines/``).
"""
