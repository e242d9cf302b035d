"""Hand-computed checks of the CS336-style policy-gradient primitives."""
import math
from types import SimpleNamespace

import pytest
import torch

from evolm_lib.grpo import primitives
from evolm_lib.grpo.primitives import (
    compute_entropy,
    compute_grpo_clip_loss,
    compute_group_normalized_rewards,
    compute_naive_policy_gradient_loss,
    compute_policy_gradient_loss,
    gather_labels,
    get_response_log_probs,
    grpo_microbatch_train_step,
    KL_PENALTIES,
    kl_k3,
    kl_penalty,
    label_logits,
    masked_mean,
    masked_normalize,
    sft_microbatch_train_step,
    tokenize_prompt_and_output,
)

LN2 = math.log(2.0)


def close(actual, expected, atol=1e-6):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0, equal_nan=True)


# ---------------------------------------------------------------- tokenisation


class WordTokenizer:
    """Whitespace tokenizer over a fixed vocabulary; adds BOS when asked, like Llama-style tokenizers."""

    def __init__(self, pad_token_id=0, bos_token_id=None, eos_token_id=None):
        self.vocab = {"a": 1, "b": 2, "c": 3, "d": 4, "e": 5, "f": 6, "g": 7}
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id

    def __call__(self, text, add_special_tokens=True):
        ids = [self.vocab[word] for word in text.split()]
        if add_special_tokens and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return {"input_ids": ids}


def test_tokenize_prompt_and_output_fake_tokenizer():
    # full sequences: [a b | d] -> [1, 2, 4, pad], [c | e f g] -> [3, 5, 6, 7]
    out = tokenize_prompt_and_output(["a b", "c"], ["d", "e f g"], WordTokenizer(pad_token_id=0))
    assert out["input_ids"].tolist() == [[1, 2, 4], [3, 5, 6]]
    assert out["labels"].tolist() == [[2, 4, 0], [5, 6, 7]]
    assert out["response_mask"].tolist() == [[False, True, False], [True, True, True]]
    assert out["response_mask"].dtype == torch.bool


def test_tokenize_bos_only_on_prompt_and_eos_fallback_for_padding():
    tokenizer = WordTokenizer(pad_token_id=None, bos_token_id=8, eos_token_id=9)
    out = tokenize_prompt_and_output(["a", "a b"], ["c", "d"], tokenizer)
    # full: [8 1 | 3 9], [8 1 2 | 4]: no BOS before the output, padding with eos
    assert out["input_ids"].tolist() == [[8, 1, 3], [8, 1, 2]]
    assert out["labels"].tolist() == [[1, 3, 9], [1, 2, 4]]
    assert out["response_mask"].tolist() == [[False, True, False], [False, False, True]]


def test_tokenize_with_real_transformers_tokenizer_built_offline():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "<s>": 2, "what": 3, "is": 4, "2+2": 5, "?": 6, "4": 7}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    backend.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>")

    out = tokenize_prompt_and_output(["what is 2+2 ?", "is"], [" 4", "4 4"], tokenizer)
    # full: [2 3 4 5 6 | 7], [2 4 | 7 7 pad pad]
    assert out["input_ids"].tolist() == [[2, 3, 4, 5, 6], [2, 4, 7, 7, 0]]
    assert out["labels"].tolist() == [[3, 4, 5, 6, 7], [4, 7, 7, 0, 0]]
    assert out["response_mask"].tolist() == [
        [False, False, False, False, True],
        [False, True, True, False, False],
    ]


def test_tokenize_length_mismatch_raises():
    with pytest.raises(ValueError, match="2 prompts but 1 outputs"):
        tokenize_prompt_and_output(["a", "b"], ["c"], WordTokenizer())


# ---------------------------------------------------------------- entropy and log-probs


def test_entropy_uniform_one_hot_and_dyadic():
    logits = torch.tensor(
        [
            [0.0, 0.0, 0.0, 0.0],  # uniform over 4: ln 4
            [0.0, -math.inf, -math.inf, -math.inf],  # exactly one-hot: 0, not NaN
            [1000.0, 0.0, 0.0, 0.0],  # near one-hot with huge logits: stable
            [math.log(0.5), math.log(0.25), math.log(0.125), math.log(0.125)],  # 1.75 ln 2
        ]
    )
    close(compute_entropy(logits), [2 * LN2, 0.0, 0.0, 1.75 * LN2])


class TableModel(torch.nn.Module):
    """Causal LM stand-in: the next-token logits depend only on the current token, via a fixed table."""

    def __init__(self, table):
        super().__init__()
        self.table = torch.nn.Parameter(table)

    def forward(self, input_ids):
        return SimpleNamespace(logits=self.table[input_ids])  # (batch, seq, vocab)


def test_get_response_log_probs_and_entropy():
    table = torch.log(
        torch.tensor(
            [
                [0.25, 0.25, 0.25, 0.25],
                [0.5, 0.25, 0.125, 0.125],
                [0.1, 0.2, 0.3, 0.4],
            ]
        )
    )
    model = TableModel(table)
    input_ids = torch.tensor([[0, 1, 2], [1, 1, 0]])
    labels = torch.tensor([[1, 0, 3], [3, 1, 2]])
    out = get_response_log_probs(model, input_ids, labels, return_token_entropy=True)
    expected = torch.log(torch.tensor([[0.25, 0.5, 0.4], [0.125, 0.25, 0.25]]))
    close(out["log_probs"], expected)
    h_dyadic = 1.75 * LN2
    h_third = -sum(p * math.log(p) for p in (0.1, 0.2, 0.3, 0.4))
    close(out["token_entropy"], [[2 * LN2, h_dyadic, h_third], [h_dyadic, h_dyadic, 2 * LN2]])
    assert "token_entropy" not in get_response_log_probs(model, input_ids, labels)
    out["log_probs"].sum().backward()
    assert model.table.grad is not None


def test_label_logits_by_hand(label_backward):
    logits = torch.tensor([[[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]], requires_grad=True)  # (1, 2, 3)
    labels = torch.tensor([[2, 0]])
    picked = label_logits(logits, labels, label_backward)
    assert picked.tolist() == [[3.0, 4.0]]
    (picked * torch.tensor([[-2.0, 0.5]])).sum().backward()
    assert logits.grad.tolist() == [[[0.0, 0.0, -2.0], [0.5, 0.0, 0.0]]]


@pytest.fixture(params=[None, True], ids=["scatter-on-a-cpu", "elementwise"])
def label_backward(request):
    """Both of `label_logits`' backwards: the scatter this CPU picks, and the elementwise choice picked
    where torch's deterministic algorithms would sort the scatter (CUDA)."""
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(3, 5, 11), (2, 7), (4, 1, 3, 9)])
def test_label_logits_give_the_gathers_values_and_gradient_bit_for_bit(dtype, shape, label_backward):
    torch.manual_seed(0)
    logits = torch.randn(*shape, dtype=dtype)
    labels = torch.randint(0, shape[-1], shape[:-1])
    weights = torch.randn(shape[:-1], dtype=dtype)
    weights.view(-1)[0] = -0.0  # a -0.0 gradient: the gather's scatter adds it into +0.0
    for minus_logsumexp in (False, True):  # the label's logit alone, and its log-probability as the trainer takes it
        grads = []
        for pick in (lambda x: gather_labels(x, labels), lambda x: label_logits(x, labels, label_backward)):
            x = logits.clone().requires_grad_()
            picked = pick(x) - torch.logsumexp(x, dim=-1) if minus_logsumexp else pick(x)
            (picked * weights).sum().backward()
            grads.append((picked.detach(), x.grad))
        (gathered, gather_grad), (ours, our_grad) = grads
        assert torch.equal(gathered, ours)
        assert torch.equal(gather_grad.view(-1).view(torch.uint8), our_grad.view(-1).view(torch.uint8))  # signs of zero too


def test_label_logits_backward_scatters_nothing_where_deterministic_algorithms_would_sort_the_scatter(monkeypatch):
    """Where torch's deterministic algorithms turn the gather's backward scatter into a sorted
    index_put (CUDA), ours dispatches neither; elsewhere it scatters as the gather's backward does."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Dispatched(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    labels = torch.tensor([[1, 0, 2]])

    def backward_ops(pick) -> str:
        total = pick(torch.randn(1, 3, 4, requires_grad=True)).sum()
        with Dispatched() as dispatched:
            total.backward()
        return " ".join(dispatched.ops)

    def gather(x):
        return gather_labels(x, labels)

    def ours(x):
        return label_logits(x, labels)

    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert "scatter_add" in backward_ops(gather) and "scatter_add" in backward_ops(ours)  # a CPU: one kernel
        assert not primitives._sorted_scatter(torch.zeros(1))
        monkeypatch.setattr(primitives, "_sorted_scatter", lambda grad: True)  # as on CUDA
        elementwise = backward_ops(ours)
    finally:
        torch.use_deterministic_algorithms(was)
    assert "scatter" not in elementwise and "index_put" not in elementwise and "where" in elementwise


# ---------------------------------------------------------------- masked reductions

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[True, False, True], [False, False, False]])


def test_masked_mean_over_dims_and_empty_slices():
    close(masked_mean(VALUES, MASK), 2.0)
    close(masked_mean(VALUES, MASK, dim=1), [2.0, math.nan])  # empty row: NaN, not 0
    close(masked_mean(VALUES, MASK, dim=0), [1.0, math.nan, 3.0])
    close(masked_mean(VALUES, MASK, dim=-1), [2.0, math.nan])
    with pytest.raises(ValueError, match="all-False"):
        masked_mean(VALUES, torch.zeros_like(MASK))


def test_masked_normalize_over_dims():
    close(masked_normalize(VALUES, MASK, normalize_constant=2.0), 2.0)
    close(masked_normalize(VALUES, MASK, dim=1, normalize_constant=2.0), [2.0, 0.0])
    close(masked_normalize(VALUES, MASK, dim=0), [1.0, 0.0, 3.0])


def test_masked_reductions_ignore_non_finite_masked_out_values():
    values = torch.tensor([[-1.0, -math.inf], [math.nan, -3.0]])
    mask = torch.tensor([[True, False], [False, True]])
    close(masked_normalize(values, mask, dim=1), [-1.0, -3.0])
    close(masked_mean(values, mask), -2.0)


# ---------------------------------------------------------------- group-normalised rewards

REWARDS = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0]


def reward_dict(response, truth):
    return {"reward": float(response == truth), "format_reward": 1.0, "answer_reward": float(response == truth)}


def responses_for(rewards):
    return ["x" if r else "y" for r in rewards], ["x"] * len(rewards)


def test_group_normalized_rewards_with_std():
    # group 1: mean 0.5, unbiased var = 4 * 0.5^2 / 3 = 1/3, std = 1/sqrt(3) -> +-0.5 * sqrt(3)
    # group 2: mean 0.75, unbiased var = (3 * 0.25^2 + 0.75^2) / 3 = 0.25, std = 0.5
    responses, truths = responses_for(REWARDS)
    advantages, raw, meta = compute_group_normalized_rewards(reward_dict, responses, truths, 4, 0.0, True)
    half_root3 = 0.5 * math.sqrt(3.0)
    close(advantages, [half_root3, -half_root3, -half_root3, half_root3, 0.5, 0.5, 0.5, -1.5], atol=1e-5)
    close(raw, REWARDS)
    # overall: mean 5/8, unbiased var = (5 * 0.375^2 + 3 * 0.625^2) / 7 = 1.875 / 7
    assert meta["reward_mean"] == pytest.approx(0.625)
    assert meta["reward_std"] == pytest.approx(math.sqrt(1.875 / 7))
    assert (meta["reward_max"], meta["reward_min"]) == (1.0, 0.0)
    assert meta["zero_std_group_fraction"] == 0.0


def test_group_normalized_rewards_without_std_and_float_reward_fn():
    responses, truths = responses_for(REWARDS)
    advantages, _, _ = compute_group_normalized_rewards(
        lambda response, truth: float(response == truth), responses, truths, 4, 1e-6, False
    )
    close(advantages, [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75])


def test_group_normalized_rewards_equal_group_gives_zero_not_nan():
    responses, truths = responses_for([1.0, 1.0, 0.0, 1.0])
    advantages, _, meta = compute_group_normalized_rewards(reward_dict, responses, truths, 2, 1e-6, True)
    # group 2: rewards 0 and 1: mean 0.5, unbiased std sqrt(0.5)
    d = 0.5 / (math.sqrt(0.5) + 1e-6)
    close(advantages, [0.0, 0.0, -d, d])
    assert meta["zero_std_group_fraction"] == 0.5


def test_group_normalized_rewards_errors():
    responses, truths = responses_for(REWARDS)
    with pytest.raises(ValueError, match="group_size 3 does not divide the rollout batch of 8"):
        compute_group_normalized_rewards(reward_dict, responses, truths, 3, 1e-6, True)
    with pytest.raises(ValueError, match="8 rollout_responses but 7"):
        compute_group_normalized_rewards(reward_dict, responses, truths[:7], 4, 1e-6, True)
    with pytest.raises(ValueError, match="'reward' key"):
        compute_group_normalized_rewards(lambda r, t: {"score": 1.0}, responses, truths, 4, 1e-6, True)


# ---------------------------------------------------------------- per-token losses


def test_naive_policy_gradient_loss_broadcasts_over_sequence():
    advantages = torch.tensor([[2.0], [-1.0]])
    log_probs = torch.tensor([[-1.0, -0.5], [-2.0, -3.0]])
    close(compute_naive_policy_gradient_loss(advantages, log_probs), [[2.0, 1.0], [-2.0, -3.0]])
    close(compute_naive_policy_gradient_loss(advantages.flatten(), log_probs), [[2.0, 1.0], [-2.0, -3.0]])


def test_grpo_clip_on_both_sides_for_both_signs():
    # cliprange 0.2: ratios 1.5 (above 1.2), 0.5 (below 0.8), 1.0 (inside)
    ratios = torch.tensor([[1.5, 0.5, 1.0], [1.5, 0.5, 1.0]])
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -2.0, -0.5]])
    policy = old + ratios.log()
    advantages = torch.tensor([[2.0], [-2.0]])
    loss, meta = compute_grpo_clip_loss(advantages, policy, old, cliprange=0.2)
    # A = 2:  min(3.0, 2.4) = 2.4 (clipped); min(1.0, 1.6) = 1.0; min(2, 2) = 2
    # A = -2: min(-3.0, -2.4) = -3.0; min(-1.0, -1.6) = -1.6 (clipped); -2
    close(loss, [[-2.4, -1.0, -2.0], [3.0, 1.6, 2.0]], atol=1e-5)
    assert meta["clipped"].tolist() == [[True, False, False], [False, True, False]]
    close(meta["clip_fraction"], 2 / 6)


def test_policy_gradient_loss_dispatch():
    log_probs = torch.tensor([[-1.0, -2.0]])
    rewards = torch.tensor([[3.0]])
    advantages = torch.tensor([[0.5]])
    loss, _ = compute_policy_gradient_loss(log_probs, "no_baseline", raw_rewards=rewards)
    close(loss, [[3.0, 6.0]])
    loss, _ = compute_policy_gradient_loss(log_probs, "reinforce_with_baseline", advantages=advantages)
    close(loss, [[0.5, 1.0]])
    loss, meta = compute_policy_gradient_loss(
        log_probs, "grpo_clip", advantages=advantages, old_log_probs=log_probs, cliprange=0.2
    )
    close(loss, [[-0.5, -0.5]])
    assert "clipped" in meta


def test_policy_gradient_loss_errors():
    log_probs = torch.zeros(2, 3)
    advantages = torch.ones(2, 1)
    with pytest.raises(ValueError, match="requires old_log_probs"):
        compute_policy_gradient_loss(log_probs, "grpo_clip", advantages=advantages, cliprange=0.2)
    with pytest.raises(ValueError, match="requires cliprange"):
        compute_policy_gradient_loss(log_probs, "grpo_clip", advantages=advantages, old_log_probs=log_probs)
    with pytest.raises(ValueError, match="requires raw_rewards"):
        compute_policy_gradient_loss(log_probs, "no_baseline", advantages=advantages)
    with pytest.raises(ValueError, match="requires advantages"):
        compute_policy_gradient_loss(log_probs, "reinforce_with_baseline", raw_rewards=advantages)
    with pytest.raises(ValueError, match="no_baseline, reinforce_with_baseline, grpo_clip"):
        compute_policy_gradient_loss(log_probs, "ppo", advantages=advantages)
    with pytest.raises(ValueError, match=r"advantages must have shape \(2, 1\)"):
        compute_policy_gradient_loss(log_probs, "reinforce_with_baseline", advantages=torch.ones(3, 1))
    with pytest.raises(ValueError, match="old_log_probs .* differ in shape"):
        compute_policy_gradient_loss(
            log_probs, "grpo_clip", advantages=advantages, old_log_probs=torch.zeros(2, 4), cliprange=0.2
        )


def test_kl_k3_values():
    policy = torch.tensor([-1.0, -1.0, -1.0])
    ref = policy + torch.tensor([0.0, LN2, -LN2])
    # r = ln 2: 2 - ln 2 - 1; r = -ln 2: 0.5 + ln 2 - 1
    close(kl_k3(policy, ref), [0.0, 1.0 - LN2, LN2 - 0.5])
    with pytest.raises(ValueError, match="differ in shape"):
        kl_k3(policy, ref[:2])


# ---------------------------------------------------------------- micro-batch train steps


def test_sft_microbatch_train_step_value_and_gradient():
    log_probs = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False], [False, True, True]])
    loss, meta = sft_microbatch_train_step(log_probs, mask, gradient_accumulation_steps=2, normalize_constant=2.0)
    # per-example sums -3, -11; / 2 -> -1.5, -5.5; negated mean 3.5; / 2 accumulation steps
    close(loss, 1.75)
    # d loss / d logp = -mask / (constant * batch * accumulation) = -1/8
    close(log_probs.grad, -mask.float() / 8)
    assert meta["response_tokens"].item() == 4


GRPO_LOG_PROBS = [[-1.0, -2.0], [-1.0, -3.0]]
GRPO_MASK = torch.tensor([[True, True], [True, False]])
GRPO_ADVANTAGES = torch.tensor([[1.0], [-2.0]])


@pytest.mark.parametrize(
    "length_normalization, normalize_constant, expected",
    [
        # per-token loss [[1, 2], [-2, (-6 masked)]]
        ("sequence_mean", None, (1.5 + -2.0) / 2),
        ("constant", 4.0, (3.0 / 4 + -2.0 / 4) / 2),
        ("token_mean", None, (1.0 + 2.0 - 2.0) / 3),
    ],
)
def test_grpo_microbatch_length_normalizations(length_normalization, normalize_constant, expected):
    log_probs = torch.tensor(GRPO_LOG_PROBS, requires_grad=True)
    loss, _ = grpo_microbatch_train_step(
        log_probs,
        GRPO_MASK,
        1,
        "reinforce_with_baseline",
        advantages=GRPO_ADVANTAGES,
        length_normalization=length_normalization,
        normalize_constant=normalize_constant,
    )
    close(loss, expected)
    assert log_probs.grad[1, 1] == 0.0  # masked token gets no gradient


def test_grpo_microbatch_kl_penalty():
    log_probs = torch.tensor(GRPO_LOG_PROBS, requires_grad=True)
    ref = torch.tensor(GRPO_LOG_PROBS) + torch.tensor([[LN2, 0.0], [-LN2, 5.0]])
    loss, meta = grpo_microbatch_train_step(
        log_probs, GRPO_MASK, 1, "reinforce_with_baseline", advantages=GRPO_ADVANTAGES, beta=0.1, ref_log_probs=ref
    )
    k_plus, k_minus = 1.0 - LN2, LN2 - 0.5
    close(loss, ((1.0 + 2.0 + 0.1 * k_plus) / 2 + (-2.0 + 0.1 * k_minus)) / 2)
    close(meta["kl"], (k_plus + k_minus) / 3)


def test_kl_penalty_forms_by_hand():
    # one token, log pi = x = 0, log pi_ref = ln 2: k3 = e^(ln 2) - ln 2 - 1 = 1 - ln 2, dk3/dx = 1 - e^(ln 2) = -1
    x = torch.zeros(1, 1, requires_grad=True)
    ref = torch.full((1, 1), LN2)
    k3 = kl_penalty(x, ref)
    k3.sum().backward()
    close(k3, [[1.0 - LN2]])
    close(x.grad, [[-1.0]])
    # on-policy the ratio is 1 with pi's gradient: same value, gradient k3 * 1 + dk3/dx = (1 - ln 2) - 1
    x.grad = None
    ratio = kl_penalty(x, ref, form="ratio_k3")
    ratio.sum().backward()
    close(ratio, [[1.0 - LN2]])
    close(x.grad, [[-LN2]])
    # off-policy: rollouts drawn at log pi_old = -ln 2, so the ratio is 2: value 2 k3, gradient 2 (k3 + dk3/dx)
    x.grad = None
    moved = kl_penalty(x, ref, old_log_probs=torch.full((1, 1), -LN2), form="ratio_k3")
    moved.sum().backward()
    close(moved, [[2 * (1.0 - LN2)]])
    close(x.grad, [[-2 * LN2]])
    with pytest.raises(ValueError, match="kl_penalty"):
        kl_penalty(x, ref, form="k2")


def test_grpo_microbatch_ratio_k3_changes_the_gradient_not_the_reported_kl():
    ref = torch.tensor(GRPO_LOG_PROBS) + torch.tensor([[LN2, 0.0], [-LN2, 5.0]])
    results = {}
    for form in KL_PENALTIES:
        log_probs = torch.tensor(GRPO_LOG_PROBS, requires_grad=True)
        loss, meta = grpo_microbatch_train_step(log_probs, GRPO_MASK, 1, "reinforce_with_baseline",
                                                advantages=GRPO_ADVANTAGES, beta=0.1, ref_log_probs=ref, kl_form=form)
        results[form] = (loss, meta["kl"], log_probs.grad.clone())
    close(results["k3"][0], results["ratio_k3"][0])  # on-policy: the same loss value
    close(results["k3"][1], results["ratio_k3"][1])  # and the same reported KL
    # token (0, 0): k3 = 1 - ln 2, dk3 = -1; the ratio form adds beta * k3 / 2 (the sequence mean over 2 tokens, / 2 rows)
    difference = results["ratio_k3"][2] - results["k3"][2]
    close(difference[0, 0], 0.1 * (1.0 - LN2) / 2 / 2)


def test_grpo_microbatch_clip_fraction_counts_response_tokens_only():
    old = torch.zeros(1, 3)
    log_probs = torch.full((1, 3), math.log(1.5), requires_grad=True)  # every ratio 1.5 is clipped for A > 0
    mask = torch.tensor([[True, True, False]])
    _, meta = grpo_microbatch_train_step(
        log_probs, mask, 1, "grpo_clip", advantages=torch.ones(1, 1), old_log_probs=old, cliprange=0.2
    )
    close(meta["clip_fraction"], 1.0)
    close(log_probs.grad, torch.zeros(1, 3))  # clipped tokens give no gradient


@pytest.mark.parametrize("loss_type", ["no_baseline", "reinforce_with_baseline", "grpo_clip"])
def test_grpo_two_microbatches_accumulate_like_one_batch(loss_type):
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(4, 5, generator=generator) - 1.0
    mask = torch.rand(4, 5, generator=generator) > 0.3
    mask[:, 0] = True  # every response has at least one token
    per_example = torch.randn(4, 1, generator=generator)
    old = values + 0.3 * torch.randn(4, 5, generator=generator)
    kwargs = dict(cliprange=0.2) if loss_type == "grpo_clip" else {}

    def step(rows, accumulation, log_probs):
        grpo_microbatch_train_step(
            log_probs[rows],
            mask[rows],
            accumulation,
            loss_type,
            raw_rewards=per_example[rows],
            advantages=per_example[rows],
            old_log_probs=old[rows] if loss_type == "grpo_clip" else None,
            **kwargs,
        )

    whole = values.clone().requires_grad_(True)
    step(slice(0, 4), 1, whole)
    split = values.clone().requires_grad_(True)
    step(slice(0, 2), 2, split)
    step(slice(2, 4), 2, split)
    torch.testing.assert_close(split.grad, whole.grad, atol=1e-6, rtol=0)
    assert whole.grad.abs().sum() > 0


def test_grpo_microbatch_errors():
    log_probs = torch.tensor(GRPO_LOG_PROBS, requires_grad=True)
    common = dict(advantages=GRPO_ADVANTAGES)
    with pytest.raises(ValueError, match="requires ref_log_probs"):
        grpo_microbatch_train_step(log_probs, GRPO_MASK, 1, "reinforce_with_baseline", beta=0.1, **common)
    with pytest.raises(ValueError, match="requires normalize_constant"):
        grpo_microbatch_train_step(
            log_probs, GRPO_MASK, 1, "reinforce_with_baseline", length_normalization="constant", **common
        )
    with pytest.raises(ValueError, match="sequence_mean, constant, token_mean"):
        grpo_microbatch_train_step(
            log_probs, GRPO_MASK, 1, "reinforce_with_baseline", length_normalization="max", **common
        )
    with pytest.raises(ValueError, match="response_mask .* differ in shape"):
        grpo_microbatch_train_step(log_probs, GRPO_MASK[:, :1], 1, "reinforce_with_baseline", **common)
    with pytest.raises(ValueError, match=r"rows \[1\] have no response tokens"):
        empty_row = torch.tensor([[True, False], [False, False]])
        grpo_microbatch_train_step(log_probs, empty_row, 1, "reinforce_with_baseline", **common)
    with pytest.raises(ValueError, match="requires old_log_probs"):
        grpo_microbatch_train_step(log_probs, GRPO_MASK, 1, "grpo_clip", cliprange=0.2, **common)
