"""GRPO on the same LoRA adapters, engine, tasks and run folders as ES.

``primitives`` (pure policy-gradient maths, CS336 names), ``trainer`` (the policy as transformers +
peft: log-probs, gradients, AdamW), ``run`` (``GRPORun``: rollouts, update, metrics, checkpoints).
"""
