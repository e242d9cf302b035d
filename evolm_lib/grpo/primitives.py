"""Policy-gradient primitives for GRPO and SFT, named and shaped as in Stanford CS336 (spring 2025) assignment 5.

References:
- CS336 assignment 5 (alignment): https://github.com/stanford-cs336/assignment5-alignment
- GRPO (DeepSeekMath): https://arxiv.org/abs/2402.03300
- Dr. GRPO, constant length normaliser: https://arxiv.org/abs/2503.20783
- DAPO, token-level mean: https://arxiv.org/abs/2503.14476
- k3 KL estimator: http://joschu.net/blog/kl-approx.html
- k3 times the importance ratio (an unbiased gradient of the reverse KL once the policy has left the
  rollouts' policy): TRL's ``GRPOConfig.use_bias_correction_kl``

Sign convention: rewards and advantages are maximised; every `loss` here is minimised, so it is the
negated objective. Functions are pure except the two `*_microbatch_train_step`, which call `backward()`.
"""
from __future__ import annotations

from typing import Any, Callable, Literal

import torch
from torch import Tensor

from ..divergence import kl_k3  # GRPO's KL penalty; kept importable from here

LossType = Literal["no_baseline", "reinforce_with_baseline", "grpo_clip"]
LOSS_TYPES: tuple[str, ...] = ("no_baseline", "reinforce_with_baseline", "grpo_clip")

LengthNormalization = Literal["sequence_mean", "constant", "token_mean"]
LENGTH_NORMALIZATIONS: tuple[str, ...] = ("sequence_mean", "constant", "token_mean")

KLPenalty = Literal["k3", "ratio_k3"]
KL_PENALTIES: tuple[str, ...] = ("k3", "ratio_k3")


def kl_penalty(policy_log_probs: Tensor, ref_log_probs: Tensor, old_log_probs: Tensor | None = None,
               form: KLPenalty = "k3") -> Tensor:
    """The per-token KL term GRPO adds to its loss (times beta), (batch, seq).

    "k3": Schulman's k3 estimate as DeepSeekMath's GRPO adds it (TRL's ``loss_type="grpo"``).
    "ratio_k3": k3 times the importance ratio pi / pi_old (``old_log_probs``, the rollouts' policy;
    None: on-policy, the ratio is 1 in value but carries pi's gradient), TRL's
    ``use_bias_correction_kl``. The two have the same value on-policy; their gradients differ once the
    policy has moved from the reference: d(ratio k3) = k3 d(log pi) + d(k3).
    """
    kl = kl_k3(policy_log_probs, ref_log_probs.detach())
    if form == "k3":
        return kl
    if form != "ratio_k3":
        raise ValueError(f"kl_penalty: one of {', '.join(KL_PENALTIES)}, got {form!r}")
    old = policy_log_probs.detach() if old_log_probs is None else old_log_probs.detach()
    return torch.exp(policy_log_probs - old) * kl


# ---------------------------------------------------------------- tokenisation and log-probs


def tokenize_prompt_and_output(prompt_strs: list[str], output_strs: list[str], tokenizer: Any) -> dict[str, Tensor]:
    """Tokenise prompts and outputs separately, concatenate, right-pad, and shift into inputs and labels."""
    if len(prompt_strs) != len(output_strs):
        raise ValueError(f"got {len(prompt_strs)} prompts but {len(output_strs)} outputs")
    if not prompt_strs:
        raise ValueError("prompt_strs is empty")
    pad_id = getattr(tokenizer, "pad_token_id", None)
    if pad_id is None:
        # padding is masked out of the loss, so any valid id works; eos is what most causal LMs use
        pad_id = getattr(tokenizer, "eos_token_id", None)
    if pad_id is None:
        raise ValueError("tokenizer has neither pad_token_id nor eos_token_id to pad with")

    sequences: list[list[int]] = []
    prompt_lengths: list[int] = []
    for prompt, output in zip(prompt_strs, output_strs):
        prompt_ids = list(tokenizer(prompt)["input_ids"])
        # no special tokens on the output: a BOS-adding tokenizer would otherwise put BOS mid-sequence
        output_ids = list(tokenizer(output, add_special_tokens=False)["input_ids"])
        sequences.append(prompt_ids + output_ids)
        prompt_lengths.append(len(prompt_ids))

    max_len = max(len(s) for s in sequences)
    full = torch.full((len(sequences), max_len), pad_id, dtype=torch.long)  # (batch, max_len)
    output_mask = torch.zeros((len(sequences), max_len), dtype=torch.bool)  # (batch, max_len)
    for row, (seq, n_prompt) in enumerate(zip(sequences, prompt_lengths)):
        full[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        output_mask[row, n_prompt : len(seq)] = True

    return {
        "input_ids": full[:, :-1],  # (batch, max_len - 1)
        "labels": full[:, 1:],  # (batch, max_len - 1): labels[t] is the token predicted at input position t
        "response_mask": output_mask[:, 1:],  # (batch, max_len - 1), aligned with labels
    }


def compute_entropy(logits: Tensor) -> Tensor:
    """Entropy of the next-token distribution at each position: (..., vocab) -> (...)."""
    log_probs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)  # (..., vocab)
    probs = log_probs.exp()
    # a -inf logit has p = 0 and log p = -inf; 0 * log 0 is 0 by convention, not NaN
    safe_log_probs = torch.where(probs > 0, log_probs, torch.zeros_like(log_probs))
    return -(probs * safe_log_probs).sum(dim=-1)


def gather_labels(logits: Tensor, labels: Tensor) -> Tensor:
    """torch's own gather of each label's logit, (..., vocab) and (...) -> (...): its backward scatters
    (what `label_logits` keeps the forward of, and replaces the backward of where that is slow)."""
    return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def _sorted_scatter(grad: Tensor) -> bool:
    """Whether torch would scatter ``grad`` through a sorted ``index_put_``: its deterministic
    algorithms on, on a CUDA or XPU device (elsewhere the scatter stays one kernel)."""
    return torch.are_deterministic_algorithms_enabled() and grad.device.type in ("cuda", "xpu")


class _LabelLogits(torch.autograd.Function):
    """``logits.gather(-1, labels[..., None])[..., 0]`` with a backward that scatters nothing where
    scattering is slow.

    The gather's own backward adds the gradient into zeros at the labels (``scatter_add``). Under
    ``torch.use_deterministic_algorithms`` on CUDA, torch replaces that atomic scatter with a sorted
    ``index_put_`` (index tensors for every dimension, a radix sort, and in some torch versions a
    range check that waits on the card), once per micro-batch. Each position has exactly one label, so
    the same gradient is an elementwise choice against the vocabulary: deterministic by construction,
    and bit for bit what the scatter gives. Elsewhere the scatter is one kernel, cheaper than the
    choice's two passes over the vocabulary, and this backward does what the gather's does.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, elementwise: bool | None) -> Tensor:
        ctx.save_for_backward(labels)
        ctx.vocab, ctx.elementwise = logits.shape[-1], elementwise
        return gather_labels(logits, labels)  # (..., ) as labels

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (labels,) = ctx.saved_tensors
        if not (_sorted_scatter(grad) if ctx.elementwise is None else ctx.elementwise):
            shape = (*labels.shape, ctx.vocab)
            return grad.new_zeros(shape).scatter_add_(-1, labels.unsqueeze(-1), grad.unsqueeze(-1)), None, None
        is_label = labels.unsqueeze(-1) == torch.arange(ctx.vocab, device=labels.device)  # (..., vocab)
        # + 0.0: the scatter adds into +0.0, which turns a -0.0 gradient into +0.0; so does this
        return torch.where(is_label, grad.unsqueeze(-1) + 0.0, 0.0), None, None  # (..., vocab)


def label_logits(logits: Tensor, labels: Tensor, elementwise: bool | None = None) -> Tensor:
    """The logit of each label: (..., vocab) and (...) -> (...), differentiable in `logits`.

    `elementwise` picks the backward: the choice against the vocabulary (True) or the gather's scatter
    (False); None, the default, picks the choice where torch would sort the scatter (`_sorted_scatter`)."""
    return _LabelLogits.apply(logits, labels, elementwise)


def get_response_log_probs(
    model: torch.nn.Module, input_ids: Tensor, labels: Tensor, return_token_entropy: bool = False
) -> dict[str, Tensor]:
    """Log-probability of each label under `model(input_ids).logits`, and optionally the per-position entropy."""
    _check_same_shape(input_ids, labels, "input_ids", "labels")
    logits = model(input_ids).logits  # (batch, seq, vocab)
    # gather-then-logsumexp avoids materialising a second (batch, seq, vocab) tensor of log-softmax;
    # computed in the logits' dtype: upcast in the model if bf16 precision matters for ratios
    result = {"log_probs": label_logits(logits, labels) - torch.logsumexp(logits, dim=-1)}  # (batch, seq)
    if return_token_entropy:
        result["token_entropy"] = compute_entropy(logits)  # (batch, seq)
    return result


# ---------------------------------------------------------------- masked reductions


def masked_normalize(
    tensor: Tensor, mask: Tensor, dim: int | None = None, normalize_constant: float = 1.0
) -> Tensor:
    """Sum of `tensor` over elements where `mask` is True, along `dim` (all if None), divided by a constant."""
    if normalize_constant == 0:
        raise ValueError("normalize_constant must be non-zero")
    # where() rather than multiply: a masked-out -inf or NaN (e.g. log-prob of padding) must not leak in
    masked = torch.where(mask.bool(), tensor, torch.zeros_like(tensor))
    total = masked.sum() if dim is None else masked.sum(dim=dim)
    return total / normalize_constant


def masked_mean(tensor: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `tensor` over elements where `mask` is True; a slice with no True element gives NaN.

    With `dim=None` an all-False mask raises ValueError; along a `dim`, all-False slices are NaN rather
    than a silent 0, so an empty response shows up instead of pulling averages towards zero.
    """
    mask = mask.bool().expand_as(tensor)
    masked = torch.where(mask, tensor, torch.zeros_like(tensor))
    if dim is None:
        count = mask.sum()
        if count.item() == 0:
            raise ValueError("masked_mean over all elements with an all-False mask is undefined")
        return masked.sum() / count
    return masked.sum(dim=dim) / mask.sum(dim=dim)  # 0 / 0 -> NaN for an all-False slice


# ---------------------------------------------------------------- rewards and advantages


def compute_group_normalized_rewards(
    reward_fn: Callable[[str, str], dict[str, float] | float],
    rollout_responses: list[str],
    repeated_ground_truths: list[str],
    group_size: int,
    advantage_eps: float,
    normalize_by_std: bool,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Score rollouts and turn rewards into group-relative advantages: (r - group mean) [/ (group std + eps)].

    Rollouts are laid out group by group: responses [k * group_size, (k + 1) * group_size) share a prompt.
    The std is unbiased (torch.std default), as in CS336. Returns (advantages, raw_rewards, metadata),
    both tensors of shape (rollout_batch_size,).
    """
    n = len(rollout_responses)
    if n != len(repeated_ground_truths):
        raise ValueError(f"got {n} rollout_responses but {len(repeated_ground_truths)} repeated_ground_truths")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if n == 0 or n % group_size != 0:
        raise ValueError(
            f"group_size {group_size} does not divide the rollout batch of {n} responses; "
            "each prompt must have exactly group_size responses"
        )
    if normalize_by_std and group_size < 2:
        raise ValueError("normalize_by_std needs group_size >= 2: the unbiased std of one sample is undefined")

    rewards = []
    for response, truth in zip(rollout_responses, repeated_ground_truths):
        scored = reward_fn(response, truth)
        if isinstance(scored, dict):
            if "reward" not in scored:
                raise ValueError(f"reward_fn returned a dict without a 'reward' key: {sorted(scored)}")
            scored = scored["reward"]
        rewards.append(float(scored))
    raw_rewards = torch.tensor(rewards, dtype=torch.float32)  # (n,)

    grouped = raw_rewards.view(n // group_size, group_size)  # (n_groups, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_by_std:
        group_std = grouped.std(dim=1, keepdim=True)  # (n_groups, 1), unbiased
        # all-equal rewards: std 0, advantage 0 / eps = 0, not NaN
        centred = centred / (group_std + advantage_eps)
    advantages = centred.reshape(n)

    group_std_for_stats = grouped.std(dim=1) if group_size > 1 else torch.zeros(n // group_size)
    metadata = {
        "reward_mean": raw_rewards.mean().item(),
        "reward_std": raw_rewards.std().item() if n > 1 else 0.0,
        "reward_max": raw_rewards.max().item(),
        "reward_min": raw_rewards.min().item(),
        # groups whose rewards are all equal give no learning signal
        "zero_std_group_fraction": (group_std_for_stats == 0).float().mean().item(),
    }
    return advantages, raw_rewards, metadata


# ---------------------------------------------------------------- per-token losses


def _as_column(values: Tensor, batch_size: int, name: str) -> Tensor:
    """Reshape per-example values of shape (batch,) or (batch, 1) to (batch, 1), or raise ValueError."""
    if values.shape not in ((batch_size,), (batch_size, 1)):
        raise ValueError(f"{name} must have shape ({batch_size}, 1) or ({batch_size},), got {tuple(values.shape)}")
    return values.reshape(batch_size, 1)


def _check_log_probs(policy_log_probs: Tensor) -> None:
    if policy_log_probs.dim() != 2:
        raise ValueError(f"policy_log_probs must be (batch, seq), got shape {tuple(policy_log_probs.shape)}")


def compute_naive_policy_gradient_loss(raw_rewards_or_advantages: Tensor, policy_log_probs: Tensor) -> Tensor:
    """Per-token REINFORCE loss -A * log pi, with A of shape (batch, 1) broadcast over the sequence."""
    _check_log_probs(policy_log_probs)
    weights = _as_column(raw_rewards_or_advantages, policy_log_probs.shape[0], "raw_rewards_or_advantages")
    return -weights * policy_log_probs  # (batch, seq)


def compute_grpo_clip_loss(
    advantages: Tensor, policy_log_probs: Tensor, old_log_probs: Tensor, cliprange: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token clipped surrogate -min(ratio * A, clip(ratio, 1 - c, 1 + c) * A), ratio = pi / pi_old."""
    _check_log_probs(policy_log_probs)
    _check_same_shape(old_log_probs, policy_log_probs, "old_log_probs", "policy_log_probs")
    if cliprange < 0:
        raise ValueError(f"cliprange must be >= 0, got {cliprange}")
    advantages = _as_column(advantages, policy_log_probs.shape[0], "advantages")
    # the gradient flows through the current policy only
    ratio = torch.exp(policy_log_probs - old_log_probs.detach())  # (batch, seq)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange) * advantages
    is_clipped = clipped < unclipped  # the min picked the clipped term: this token gives no gradient
    loss = -torch.minimum(unclipped, clipped)  # (batch, seq)
    return loss, {"clipped": is_clipped, "clip_fraction": is_clipped.float().mean(), "ratio": ratio.detach()}


def compute_policy_gradient_loss(
    policy_log_probs: Tensor,
    loss_type: LossType,
    raw_rewards: Tensor | None = None,
    advantages: Tensor | None = None,
    old_log_probs: Tensor | None = None,
    cliprange: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token loss (batch, seq) for `loss_type` in no_baseline, reinforce_with_baseline, grpo_clip."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; valid: {', '.join(LOSS_TYPES)}")
    required = {
        "no_baseline": {"raw_rewards": raw_rewards},
        "reinforce_with_baseline": {"advantages": advantages},
        "grpo_clip": {"advantages": advantages, "old_log_probs": old_log_probs, "cliprange": cliprange},
    }[loss_type]
    missing = [name for name, value in required.items() if value is None]
    if missing:
        raise ValueError(f"loss_type {loss_type!r} requires {', '.join(missing)}")

    if loss_type == "no_baseline":
        return compute_naive_policy_gradient_loss(raw_rewards, policy_log_probs), {}
    if loss_type == "reinforce_with_baseline":
        return compute_naive_policy_gradient_loss(advantages, policy_log_probs), {}
    return compute_grpo_clip_loss(advantages, policy_log_probs, old_log_probs, cliprange)


# ---------------------------------------------------------------- micro-batch train steps


def _check_same_shape(tensor: Tensor, reference: Tensor, name: str, reference_name: str) -> None:
    """Raise ValueError naming both tensors when their shapes differ."""
    if tensor.shape != reference.shape:
        raise ValueError(f"{name} {tuple(tensor.shape)} and {reference_name} {tuple(reference.shape)} differ in shape")


def empty_response_rows(response_mask: Tensor) -> list[int]:
    """The rows of a mask without a response token (their sequence mean is undefined)."""
    return (~response_mask.any(dim=-1)).nonzero().flatten().tolist()


def _check_train_step(policy_log_probs: Tensor, response_mask: Tensor, gradient_accumulation_steps: int) -> None:
    _check_log_probs(policy_log_probs)
    _check_same_shape(response_mask, policy_log_probs, "response_mask", "policy_log_probs")
    if gradient_accumulation_steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}")


def sft_microbatch_train_step(
    policy_log_probs: Tensor,
    response_mask: Tensor,
    gradient_accumulation_steps: int,
    normalize_constant: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SFT step: batch mean of -(response log-prob sum / normalize_constant), / accumulation steps; calls backward()."""
    _check_train_step(policy_log_probs, response_mask, gradient_accumulation_steps)
    per_example_nll = -masked_normalize(policy_log_probs, response_mask, dim=-1, normalize_constant=normalize_constant)
    loss = per_example_nll.mean() / gradient_accumulation_steps
    loss.backward()
    return loss.detach(), {"response_tokens": response_mask.bool().sum()}


def grpo_microbatch_train_step(
    policy_log_probs: Tensor,
    response_mask: Tensor,
    gradient_accumulation_steps: int,
    loss_type: LossType,
    raw_rewards: Tensor | None = None,
    advantages: Tensor | None = None,
    old_log_probs: Tensor | None = None,
    cliprange: float | None = None,
    *,
    length_normalization: LengthNormalization = "sequence_mean",
    normalize_constant: float | None = None,
    beta: float = 0.0,
    ref_log_probs: Tensor | None = None,
    kl_form: KLPenalty = "k3",
    mask_checked: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Policy-gradient micro-batch step: per-token loss (+ beta * k3), length-normalised, / accumulation; backward().

    length_normalization:
      - "sequence_mean" (CS336, GRPO): mean over each response's tokens, then mean over the batch;
        a response with no tokens raises ValueError (its mean is undefined).
      - "constant" (Dr. GRPO): sum over each response's tokens / `normalize_constant` (e.g. the maximum
        generation length), then mean over the batch.
      - "token_mean" (DAPO): sum over all response tokens of the micro-batch / their count; with
        gradient accumulation this weights micro-batches equally, not tokens.
    With `ref_log_probs`, the k3 KL is reported in metadata["kl"]; `beta > 0` adds beta times the KL
    term to the loss, `kl_penalty` of form `kl_form` ("k3", or "ratio_k3": times the importance ratio).
    `mask_checked`: the caller has checked the mask's rows where it was made (no response without
    tokens under "sequence_mean"), so the check, which reads the mask back from the device, is skipped.
    """
    _check_train_step(policy_log_probs, response_mask, gradient_accumulation_steps)
    if length_normalization not in LENGTH_NORMALIZATIONS:
        raise ValueError(
            f"unknown length_normalization {length_normalization!r}; valid: {', '.join(LENGTH_NORMALIZATIONS)}"
        )
    if length_normalization == "constant" and normalize_constant is None:
        raise ValueError("length_normalization='constant' requires normalize_constant (e.g. max generation length)")
    if length_normalization != "constant" and normalize_constant is not None:
        raise ValueError("normalize_constant only applies to length_normalization='constant'")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta > 0 and ref_log_probs is None:
        raise ValueError("beta > 0 requires ref_log_probs for the KL penalty")

    mask = response_mask.bool()
    per_token_loss, metadata = compute_policy_gradient_loss(
        policy_log_probs, loss_type, raw_rewards, advantages, old_log_probs, cliprange
    )  # (batch, seq)
    metadata = dict(metadata)
    token_count = mask.sum()
    if ref_log_probs is not None:
        kl = kl_k3(policy_log_probs, ref_log_probs.detach())  # (batch, seq)
        if beta > 0:
            term = kl if kl_form == "k3" else kl_penalty(policy_log_probs, ref_log_probs, old_log_probs, kl_form)
            per_token_loss = per_token_loss + beta * term
        metadata["kl"] = masked_normalize(kl.detach(), mask) / token_count  # NaN if no response tokens
    if "clipped" in metadata:
        # the clip fraction that matters is over response tokens, not padding
        metadata["clip_fraction"] = (metadata["clipped"] & mask).sum() / token_count

    if length_normalization == "sequence_mean":
        empty_rows = [] if mask_checked else empty_response_rows(mask)
        if empty_rows:
            raise ValueError(
                f"response_mask rows {empty_rows} have no response tokens, so their sequence mean is undefined; "
                "drop them or use length_normalization='constant'"
            )
        per_example = masked_mean(per_token_loss, mask, dim=-1)  # (batch,)
        loss = per_example.mean()
    elif length_normalization == "constant":
        per_example = masked_normalize(per_token_loss, mask, dim=-1, normalize_constant=normalize_constant)  # (batch,)
        loss = per_example.mean()
    else:
        loss = masked_mean(per_token_loss, mask)  # raises on an all-empty micro-batch

    loss = loss / gradient_accumulation_steps
    loss.backward()
    metadata["loss_unscaled"] = loss.detach() * gradient_accumulation_steps
    return loss.detach(), metadata
