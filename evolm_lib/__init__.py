"""EvoLM: Evolution Strategies over LoRA populations, with a GRPO baseline."""
__version__ = "0.1.0"
