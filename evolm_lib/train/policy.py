"""The GRPO policy as transformers (+ peft): log-probs, gradients and AdamW on the LoRA tensors, or
on the model weights themselves (``policy_weights: full``).

Works on token ids (not text), so it trains on exactly the tokens the engine sampled. The policy
sits on the GPU when one is present (``device``), in float32: with ``policy_weights: full`` the
trained weights are themselves the float32 master that AdamW moves, and the engine is handed them
cast to its dtype after each step (``flat_weights``).
"""
from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Sequence

import torch

from ..config import GRPOConfig
from ..engines.base import PromptEncoder
from ..lora import AdapterWeights
from ..types import Completion
from ..grpo.primitives import empty_response_rows, grpo_microbatch_train_step, label_logits


# ---------------------------------------------------------------------------- batches and AdamW state


def rollout_batch(
    prompt_token_ids: Sequence[Sequence[int]], completion_token_ids: Sequence[Sequence[int]], pad_token_id: int
) -> dict[str, torch.Tensor]:
    """Token ids (not text) -> right-padded input_ids, labels and response_mask, as `tokenize_prompt_and_output`.

    Working on ids keeps the trainer on exactly the tokens the engine sampled (re-tokenising the
    decoded text can split it differently).
    """
    if len(prompt_token_ids) != len(completion_token_ids) or not prompt_token_ids:
        raise ValueError(f"got {len(prompt_token_ids)} prompts and {len(completion_token_ids)} completions")
    sequences = [list(p) + list(c) for p, c in zip(prompt_token_ids, completion_token_ids)]
    width = max(len(s) for s in sequences)
    full = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)  # (batch, width)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)  # (batch, width)
    for row, (seq, prompt) in enumerate(zip(sequences, prompt_token_ids)):
        full[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[row, len(prompt) : len(seq)] = True
    return {"input_ids": full[:, :-1], "labels": full[:, 1:], "response_mask": mask[:, 1:]}


def response_spans(response_mask: torch.Tensor, slices: Sequence[slice],
                   length_normalization: str = "sequence_mean") -> list[tuple[int, int]]:
    """Each micro-batch's (first, end) columns, from its first response token to past its last, read
    from the rollout batch's mask; raises ValueError for a micro-batch without response tokens, or
    (``sequence_mean``, whose per-response mean needs a token) for a response without any."""
    spans = []
    for rows in slices:
        mask = response_mask[rows]
        columns = mask.any(dim=0).nonzero().flatten()
        if columns.numel() == 0:
            raise ValueError("a micro-batch has no response tokens")
        if length_normalization == "sequence_mean":
            empty_rows = [rows.start + r for r in empty_response_rows(mask)]
            if empty_rows:
                raise ValueError(f"rollout rows {empty_rows} have no response tokens, so their sequence mean is "
                                 "undefined; use length_normalization 'constant' or 'token_mean'")
        spans.append((int(columns[0]), int(columns[-1]) + 1))
    return spans


def optimizer_state_to_tensors(optimizer: torch.optim.Optimizer, names: dict[torch.nn.Parameter, str]) -> dict[str, torch.Tensor]:
    """AdamW's per-parameter state as flat named tensors ('<param name>/exp_avg', ...) for safetensors."""
    tensors = {}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            tensors[f"{names[param]}/{key}"] = value.detach().cpu().clone() if torch.is_tensor(value) else torch.tensor(value)
    return tensors


def optimizer_state_from_tensors(optimizer: torch.optim.Optimizer, names: dict[torch.nn.Parameter, str],
                                 tensors: dict[str, torch.Tensor]) -> None:
    """Load state written by :func:`optimizer_state_to_tensors` into a freshly built optimizer."""
    state_dict = optimizer.state_dict()
    order = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, param in enumerate(order):
        prefix = names[param] + "/"
        entries = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        if entries:
            state[index] = entries
    known = {names[p] for p in order}
    stray = sorted({k.rsplit("/", 1)[0] for k in tensors} - known)
    if stray:
        raise ValueError(f"optimizer state for unknown parameters: {stray[:3]}")
    state_dict["state"] = state
    optimizer.load_state_dict(state_dict)


# ---------------------------------------------------------------------------- the trainer


def adapter_copy(spec, tensors: dict[str, torch.Tensor]) -> AdapterWeights:
    """An adapter of float32 host copies of ``tensors`` (LoRA tensors, PEFT-named, wherever they live):
    what a run keeps of its policy after a step."""
    return AdapterWeights(spec, {k: v.float().cpu().clone() for k, v in tensors.items()})


def attention_implementation(config: GRPOConfig, device: torch.device) -> str:
    """The policy's attention (``policy_attention``): ``auto`` is eager where torch's deterministic
    algorithms are on and the policy is on a GPU, where they force the fused kernel's backward onto a
    slow path (docs/measurements.md); on a CPU the fused kernel's backward is deterministic as it is."""
    if config.policy_attention != "auto":
        return config.policy_attention
    return "eager" if device.type == "cuda" and torch.are_deterministic_algorithms_enabled() else "sdpa"


class PolicyTrainer:
    """The policy as transformers (float32): log-probs, gradients and AdamW on the LoRA tensors (peft),
    or, with ``policy_weights: full`` (``adapter`` None), on the model weights in ``grpo_weights``."""

    def __init__(self, model_dir: Path, adapter: AdapterWeights | None, config: GRPOConfig, device: str | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.config = config
        self.full = config.policy_weights == "full"
        if self.full != (adapter is None):
            raise ValueError(f"policy_weights {config.policy_weights!r} "
                             f"{'trains the model weights: no adapter' if self.full else 'needs an adapter'}")
        self.spec = None if adapter is None else adapter.spec
        # The update belongs on the GPU when there is one: on the host it dominates a GPU run's step.
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else self.tokenizer.eos_token_id
        self.attention = attention_implementation(config, self.device)
        load = dict(dtype=torch.float32, attn_implementation=self.attention)
        base = AutoModelForCausalLM.from_pretrained(model_dir, **load)
        self.vocab_size = base.get_output_embeddings().weight.shape[0]
        self.reference = None  # full: the base model the KL penalty compares with (LoRA: the adapter disabled)
        if self.full:
            self.model = base.to(self.device)
            self.trained = self._select_trained(model_dir)
            if config.beta > 0:
                self.reference = AutoModelForCausalLM.from_pretrained(model_dir, **load).to(self.device)
                self.reference.eval().requires_grad_(False)
        else:
            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(
                r=adapter.spec.rank,
                lora_alpha=adapter.spec.alpha,
                target_modules=list(adapter.spec.target_modules),
                layers_to_transform=list(adapter.spec.layers_to_transform) if adapter.spec.layers_to_transform is not None else None,
                lora_dropout=0.0,
            )
            self.model = get_peft_model(base, lora).to(self.device)
            self.set_adapter(adapter)
        self.model.eval()  # no dropout anywhere: gradients still flow, and results are deterministic
        self.parameters = [p for p in self.model.parameters() if p.requires_grad]
        self.names = {p: n for n, p in self.model.named_parameters() if p.requires_grad}
        self.optimizer = torch.optim.AdamW(
            self.parameters, lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2),
            weight_decay=config.weight_decay,
        )

    def _select_trained(self, model_dir: Path) -> dict[str, torch.nn.Parameter]:
        """Only the weights of ``grpo_weights`` require gradients (HF names, as the engine's weights are named)."""
        from ..engines.weights.resident import targeted_weight_shapes

        targets, layers = self.config.weight_targets()
        shapes = targeted_weight_shapes(model_dir, targets, layers)
        params = dict(self.model.named_parameters())  # a tied LM head appears once, as the embedding
        missing = sorted(set(shapes) - set(params))
        if missing:
            raise ValueError(f"the policy model has no parameter {missing[:3]} (it has e.g. {sorted(params)[:3]})")
        for name, param in params.items():
            param.requires_grad_(name in shapes)
        return {name: params[name] for name in sorted(shapes)}

    def weights(self) -> dict[str, torch.Tensor]:
        """policy_weights full: the trained weights (float32, on the trainer's device; live, not copies)."""
        return {name: param.detach() for name, param in self.trained.items()}

    def flat_weights(self) -> torch.Tensor:
        """policy_weights full: the trained weights as one float32 vector on the trainer's device, in
        sorted-name order (the layout of the engine's resident weights, ``es.Layout``)."""
        return torch.cat([param.detach().reshape(-1) for param in self.trained.values()])

    @torch.no_grad()
    def set_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """policy_weights full: set the trained weights (a checkpoint's)."""
        if set(tensors) != set(self.trained):
            raise ValueError(f"weights do not fit the policy: unexpected {sorted(set(tensors) - set(self.trained))[:3]}, "
                             f"missing {sorted(set(self.trained) - set(tensors))[:3]}")
        for name, param in self.trained.items():
            param.copy_(tensors[name].to(param.device, param.dtype))

    def save_model(self, out: Path, dtype: str) -> Path:
        """policy_weights full: the policy as a model folder transformers and vLLM load (safetensors in
        ``dtype``, config, tokenizer), written to a staging folder and renamed into place."""
        import os
        import shutil
        import tempfile

        out = Path(out)
        staging = Path(tempfile.mkdtemp(prefix=".final-", dir=out.parent))
        state = {name: tensor.detach().to("cpu", getattr(torch, dtype)) for name, tensor in self.model.state_dict().items()}
        self.model.save_pretrained(staging, state_dict=state)
        self.tokenizer.save_pretrained(staging)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
        return out

    def set_adapter(self, adapter: AdapterWeights) -> None:
        """Copy an adapter's tensors into the peft model."""
        from peft import set_peft_model_state_dict

        with torch.no_grad():
            result = set_peft_model_state_dict(self.model, {k: v.float().to(self.device) for k, v in adapter.tensors.items()})
        missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k]
        if result.unexpected_keys or missing:
            raise ValueError(f"adapter does not fit the model: unexpected {result.unexpected_keys[:3]}, missing {missing[:3]}")

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The LoRA tensors, PEFT-named as the engine loads them (float32, on the trainer's device; live
        views of the trained parameters, not copies)."""
        from peft import get_peft_model_state_dict

        return {k: v.detach() for k, v in get_peft_model_state_dict(self.model).items()}

    def adapter(self) -> AdapterWeights:
        """The current LoRA tensors, PEFT-named, as the engine loads them (host copies)."""
        return adapter_copy(self.spec, self.adapter_tensors())

    def encode(self, prompt) -> list[int]:
        """Prompt token ids, for engines that do not tokenise (the synthetic one)."""
        return PromptEncoder(self.tokenizer).encode(prompt)

    def _log_probs(self, batch: dict, rows: slice, span: tuple[int, int], *, grad: bool,
                   base: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs, mask) of one micro-batch over ``span``, the columns from its first response
        token to its last (``response_spans``).

        As `get_response_log_probs` with logits / temperature (the policy that sampled), but the
        vocabulary projection runs on response positions only: prompt logits are never needed.
        """
        first, width = span
        mask = batch["response_mask"][rows, first:width]
        input_ids, labels = batch["input_ids"][rows, :width], batch["labels"][rows, first:width]
        model = self.reference if base and self.full else self.model
        adapter_off = self.model.disable_adapter() if base and not self.full else contextlib.nullcontext()
        with torch.set_grad_enabled(grad), adapter_off:
            logits = model(input_ids=input_ids, logits_to_keep=width - first).logits  # (micro, kept, vocab)
            if self.config.temperature != 1.0:
                logits = logits / self.config.temperature
            log_probs = label_logits(logits, labels) - torch.logsumexp(logits, dim=-1)  # (micro, kept)
        return log_probs, mask  # (micro, kept) each

    def train(self, batch: dict, raw_rewards: torch.Tensor, advantages: torch.Tensor) -> dict:
        """Epochs of micro-batched, gradient-accumulated updates on one rollout batch; returns stats.

        Everything read back from the device (losses, clip fractions, KLs, gradient norms) is read
        once, after the last optimizer step is queued: the host queues the next kernels while the
        card runs the last ones, instead of waiting for each micro-batch."""
        config = self.config
        n = batch["input_ids"].shape[0]
        micro = config.micro_batch_size or config.group_size
        if n % micro:
            raise ValueError(f"micro_batch_size {micro} does not divide the rollout batch of {n}")
        slices = [slice(s, s + micro) for s in range(0, n, micro)]
        # the rollout batch's mask is read where it was made (the host), before the batch moves
        spans = response_spans(batch["response_mask"], slices, config.length_normalization)
        batch = {k: v.to(self.device) for k, v in batch.items()}
        raw_rewards, advantages = raw_rewards.to(self.device), advantages.to(self.device)
        accumulation = len(slices)
        # the batch's policy before any update: pi_old of the ratio, and the reference for KL
        old = [self._log_probs(batch, s, span, grad=False)[0] for s, span in zip(slices, spans)] \
            if config.loss_type == "grpo_clip" and config.epochs_per_batch > 1 else None
        ref = [self._log_probs(batch, s, span, grad=False, base=True)[0] for s, span in zip(slices, spans)] \
            if config.beta > 0 else None
        first_pass: list[tuple[torch.Tensor, torch.Tensor]] = []
        losses, clip_fractions, kls, grad_norms = [], [], [], []  # per epoch, tensors on the device
        for epoch in range(config.epochs_per_batch):
            self.optimizer.zero_grad(set_to_none=True)
            epoch_losses = []
            for i, (rows, span) in enumerate(zip(slices, spans)):
                log_probs, mask = self._log_probs(batch, rows, span, grad=True)
                if epoch == 0:
                    first_pass.append((log_probs.detach(), mask))
                old_log_probs = None
                if config.loss_type == "grpo_clip":
                    # one epoch is on-policy: pi_old is this very forward pass, detached (ratio 1)
                    old_log_probs = old[i] if old is not None else log_probs.detach()
                loss, meta = grpo_microbatch_train_step(
                    log_probs, mask, accumulation, config.loss_type,
                    raw_rewards=raw_rewards[rows], advantages=advantages[rows], old_log_probs=old_log_probs,
                    cliprange=config.cliprange if config.loss_type == "grpo_clip" else None,
                    length_normalization=config.length_normalization,
                    normalize_constant=float(config.max_new_tokens) if config.length_normalization == "constant" else None,
                    beta=config.beta, ref_log_probs=ref[i] if ref is not None else None,
                    kl_form=config.kl_penalty, mask_checked=True,
                )
                epoch_losses.append(loss)
                if "clip_fraction" in meta:
                    clip_fractions.append(meta["clip_fraction"])
                if "kl" in meta:
                    kls.append(meta["kl"])
            grad_norms.append(torch.nn.utils.clip_grad_norm_(self.parameters, config.max_grad_norm or math.inf))
            self.optimizer.step()
            losses.append(epoch_losses)
        # read back once; summed in Python in the order a per-micro-batch read would have summed them
        epoch_sums = [sum((float(loss) for loss in epoch_losses), 0.0) for epoch_losses in losses]
        norms, clip_fractions, kls = [float(v) for v in grad_norms], [float(v) for v in clip_fractions], [float(v) for v in kls]
        stats = {
            "grpo/loss": sum(epoch_sums) / len(epoch_sums),
            "grpo/grad_norm": sum(norms) / len(norms),
            "grpo/clip_fraction": sum(clip_fractions) / len(clip_fractions) if clip_fractions else 0.0,
        }
        if kls:
            stats["grpo/kl"] = sum(kls) / len(kls)
        stats["_first_pass"] = first_pass
        return stats

    def close(self) -> None:
        """Nothing to end: the model goes with this object (a ``PolicyProcess`` ends its process here)."""

    def optimizer_tensors(self) -> dict[str, torch.Tensor]:
        """AdamW state as named tensors."""
        return optimizer_state_to_tensors(self.optimizer, self.names)

    def load_optimizer_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore AdamW state saved by :meth:`optimizer_tensors`."""
        optimizer_state_from_tensors(self.optimizer, self.names, tensors)


def engine_logprob_gap(completions: Sequence[Completion], first_pass: list[tuple[torch.Tensor, torch.Tensor]],
                        config: GRPOConfig) -> float | None:
    """Mean |trainer - engine| log-prob of the sampled tokens before the update (comparable at T = 1 only:
    the engine reports untempered log-probs)."""
    if config.temperature != 1.0 or any(c.logprobs is None for c in completions):
        return None
    total, count, row = 0.0, 0, 0
    for log_probs, mask in first_pass:  # (micro, kept) each
        for r in range(log_probs.shape[0]):
            trainer = log_probs[r][mask[r]].cpu()
            engine = torch.tensor(completions[row].logprobs, dtype=trainer.dtype)
            if engine.shape != trainer.shape:
                return None
            total += float((trainer - engine).abs().sum())
            count += engine.numel()
            row += 1
    return total / count if count else None
