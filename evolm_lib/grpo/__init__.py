"""GRPO's pure maths: policy-gradient primitives with CS336 names (``primitives``).

The run that drives them (rollouts from the engine, the transformers + peft policy, checkpoints)
is ``evolm_lib.train.grpo.GRPORun``; the policy itself is ``evolm_lib.train.policy``.
"""
