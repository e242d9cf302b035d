"""Divergences between token distributions, shared by GRPO's loss and the evaluation of any run."""
from __future__ import annotations

from torch import Tensor
import torch


def kl_k3(policy_log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref): exp(r) - r - 1 with r = ref - policy log-prob; always >= 0.

    Schulman's k3 estimator (http://joschu.net/blog/kl-approx.html): unbiased, and non-negative per token.
    """
    if ref_log_probs.shape != policy_log_probs.shape:
        raise ValueError(f"ref_log_probs {tuple(ref_log_probs.shape)} and policy_log_probs "
                         f"{tuple(policy_log_probs.shape)} differ in shape")
    log_ratio = ref_log_probs - policy_log_probs
    # expm1 keeps precision when the policy is close to the reference (log_ratio near 0)
    return torch.expm1(log_ratio) - log_ratio
