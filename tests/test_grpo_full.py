"""GRPO on the model's own weights (``policy_weights: full``): one step is a hand-computed AdamW step,
the engine serves the new weights in place (vLLM and HF), the KL penalty compares with the base model,
checkpoints, the final model folder, SIGKILL and resume, folders written by earlier code resumed (a
LoRA one too), and bad settings named."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from evolm_lib import preflight
from evolm_lib.config import ConfigError, GRPOConfig
from evolm_lib.engines import SamplingSettings
from evolm_lib.engines.weights.resident import targeted_weight_shapes
from evolm_lib.engines.synthetic import SyntheticEngine
from evolm_lib.metrics import without_times
from evolm_lib.runs import list_checkpoints, read_metrics
from evolm_lib.train.grpo import WEIGHTS_PREFIX, GRPORun
from evolm_lib.train.policy import PolicyTrainer, rollout_batch
from helpers_data import assert_rows_close, data_script

TARGETS = ["q_proj", "v_proj", "down_proj"]
FULL = dict(model="tiny-random", task="conciseness", policy_weights="full", target_modules=TARGETS, group_size=4,
            max_new_tokens=6, max_model_len=256, kv_cache_gb=0.0625, learning_rate=0.05, num_steps=2)
ENGINE = dict(max_loras=2, max_lora_rank=8, max_model_len=256, kv_cache_gb=0.0625)


def full_config(**changes) -> GRPOConfig:
    return GRPOConfig.from_dict({**FULL, **changes})


def _rows(run_dir) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in read_metrics(run_dir)]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """An engine of these tests' own (its targeted layers get their weights back, and runs move them)."""
    from evolm_lib.engines.vllm.engine import VLLMEngine

    engine = VLLMEngine(str(tiny_model_dir), **ENGINE)
    yield engine
    engine.close()


# ----------------------------------------------------------------------------- settings


@pytest.mark.parametrize("changes, message", [
    ({"grpo_weights": "most"}, "grpo_weights: None"),
    ({"policy_weights": "lora", "grpo_weights": "all"}, "grpo_weights: 'all' selects model weights"),
    ({"policy_weights": "half"}, "policy_weights"),
])
def test_bad_settings_name_the_field(changes, message):
    with pytest.raises(ConfigError, match=message):
        full_config(**changes)


def test_defaults_and_targets():
    assert GRPOConfig(model="tiny-random").policy_weights == "lora"
    assert full_config().weight_targets() == (tuple(TARGETS), None)
    assert full_config(grpo_weights="all").weight_targets() == ("all", None)
    assert full_config(layers_to_transform=[1]).weight_targets() == (tuple(TARGETS), (1,))


def test_an_engine_that_cannot_write_weights_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="policy_weights: full writes the trained weights into the engine"):
        GRPORun.create(full_config(), tmp_path / "run", engine=SyntheticEngine())


def test_no_room_for_the_master_and_adamw_is_refused_before_the_engine(tiny_model_dir, tmp_path, monkeypatch):
    needed = preflight.policy_weights_bytes(full_config(grpo_weights="all"), tiny_model_dir)
    # the tiny model's float32 copy, gradients, AdamW's moments and the engine's copy: 4 bytes x (model + 4 x trained)
    shapes = targeted_weight_shapes(tiny_model_dir, "all")
    values = sum(torch.Size(s).numel() for s in shapes.values())
    assert needed == 4 * (values + 4 * values)
    with_kl = preflight.policy_weights_bytes(full_config(grpo_weights="all", beta=0.1), tiny_model_dir)
    assert with_kl == needed + 4 * values  # the reference model
    engine_bytes = int(0.0625 * 2**30) + preflight.weights_bytes(tiny_model_dir, preflight.model_config(tiny_model_dir),
                                                                 "float32")
    monkeypatch.setattr(preflight, "_engine_live", lambda: False)
    monkeypatch.setattr(preflight, "_free_memory", lambda cuda: (engine_bytes + needed - 1, 24 * 2**30))
    with pytest.raises(ConfigError, match=r"policy_weights=full: .* need .* GiB of RAM beside the engine, which leaves"):
        GRPORun.create(full_config(grpo_weights="all"), tmp_path / "run")
    assert not (tmp_path / "run").exists()  # refused before the folder and the engine
    monkeypatch.setattr(preflight, "_free_memory", lambda cuda: (engine_bytes + needed + 1, 24 * 2**30))
    preflight.check_engine_settings(full_config(grpo_weights="all"), tiny_model_dir)


# ----------------------------------------------------------------------------- the update, by hand


@pytest.mark.parametrize("selection", [None, "all"])
def test_one_step_is_a_hand_computed_adamw_step(tiny_model_dir, selection):
    from transformers import AutoModelForCausalLM

    config = full_config(grpo_weights=selection, loss_type="reinforce_with_baseline", max_grad_norm=None,
                         learning_rate=1e-3, weight_decay=0.01, micro_batch_size=4)
    trainer = PolicyTrainer(tiny_model_dir, None, config, device="cpu")
    batch = rollout_batch([[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]], [[11, 12], [13], [14, 15, 16], [17, 18]],
                          trainer.pad_token_id)
    advantages = torch.tensor([0.5, -1.0, 1.5, -0.25])
    trainer.train(batch, torch.zeros(4), advantages)

    # the same loss on a fresh transformers model: -A log pi over each response, its mean, the batch's mean
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    params = dict(model.named_parameters())
    names = sorted(targeted_weight_shapes(tiny_model_dir, *config.weight_targets()))
    logits = model(input_ids=batch["input_ids"]).logits  # (4, width, vocab)
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)
    mask = batch["response_mask"].float()
    loss = ((-advantages[:, None] * log_probs * mask).sum(1) / mask.sum(1)).mean()
    gradients = dict(zip(names, torch.autograd.grad(loss, [params[n] for n in names])))
    # AdamW's first step: m = (1 - b1) g, v = (1 - b2) g^2, bias-corrected to g and g^2. Applied to
    # the trainer's own gradient (left in .grad), which must equal this one to float32 rounding: where
    # a gradient is near 0, g / (|g| + eps) turns rounding of g into a visible difference of the step.
    lr, b1, b2, eps, decay = 1e-3, 0.9, 0.999, 1e-8, 0.01
    trained = trainer.weights()
    moved = 0.0
    for name, param in trainer.trained.items():
        g = param.grad
        scale = float(gradients[name].abs().max())
        torch.testing.assert_close(g, gradients[name], atol=1e-5 * scale, rtol=0)
        m_hat, v_hat = (1 - b1) * g / (1 - b1), (1 - b2) * g * g / (1 - b2)
        expected = params[name].detach() * (1 - lr * decay) - lr * m_hat / (v_hat.sqrt() + eps)
        torch.testing.assert_close(trained[name], expected, atol=1e-7, rtol=0)
        moved = max(moved, float((trained[name] - params[name].detach()).abs().max()))
    assert moved > 5e-4  # about lr per weight: the step is not a no-op
    for name, param in trainer.model.named_parameters():
        if name not in trained:
            assert torch.equal(param, params[name]), name  # untrained weights stay the model folder's


# ----------------------------------------------------------------------------- the engine serves the new weights


def test_the_vllm_engine_serves_the_trained_weights_in_place(engine, tmp_path):
    from evolm_lib.engines.hf_engine import HFEngine

    config = full_config(num_steps=2, beta=0.05)
    prompts = ["The capital of France is", "One, two, three,"]
    greedy = SamplingSettings(max_new_tokens=8)
    run = GRPORun.create(config, tmp_path / "run", engine=engine)
    base = [c.token_ids for c in engine.generate(prompts, [None], greedy)[0]]
    rows = run.run()
    assert [r["step"] for r in rows] == [1, 2]
    # the engine sampled step 2's rollouts from the weights step 1 wrote, and the trainer scores them alike
    assert all(r["grpo/engine_logprob_gap"] < 1e-4 for r in rows), [r["grpo/engine_logprob_gap"] for r in rows]
    assert rows[0]["grpo/kl"] == 0.0 and rows[1]["grpo/kl"] > 0  # the reference is the base model
    assert "grpo/weights_norm" in rows[-1] and rows[-1]["time/sync_s"] > 0
    served = [c.token_ids for c in engine.generate(prompts, [None], greedy)[0]]
    assert served != base  # the step moved the weights enough to change greedy completions

    folder = run.save_final()
    saved = load_file(str(folder / "model.safetensors"))
    for name, tensor in run.trainer.weights().items():
        assert torch.equal(saved[name], tensor), name
    with HFEngine(str(folder)) as reference:  # a transformers model holding the trained weights
        assert [c.token_ids for c in reference.generate(prompts, [None], greedy)[0]] == served
    checkpoint = load_file(str(list_checkpoints(tmp_path / "run")[-1] / "optimizer.safetensors"))
    assert {k.removeprefix(WEIGHTS_PREFIX) for k in checkpoint if k.startswith(WEIGHTS_PREFIX)} == set(saved) & set(
        run.trainer.weights())
    run.close()  # a shared engine serves the model folder's weights again
    assert [c.token_ids for c in engine.generate(prompts, [None], greedy)[0]] == base


def test_vllm_loads_the_final_model_folder(engine, tmp_path):
    """The folder save_final writes is a model vLLM serves (a second engine, on the trained model)."""
    from evolm_lib.engines.vllm.engine import VLLMEngine

    run = GRPORun.create(full_config(num_steps=1, grpo_weights="all"), tmp_path / "run", engine=engine)
    run.run()
    folder = run.save_final()
    prompts, greedy = ["Count: one, two,"], SamplingSettings(max_new_tokens=8)
    served = [c.token_ids for c in engine.generate(prompts, [None], greedy)[0]]
    run.close()
    with VLLMEngine(str(folder), max_loras=1, max_lora_rank=8, max_model_len=256, kv_cache_gb=0.0625) as loaded:
        assert [c.token_ids for c in loaded.generate(prompts, [None], greedy)[0]] == served


def test_a_resume_continues_bit_for_bit(engine, tmp_path):
    config = full_config(num_steps=3, checkpoint_every=2)
    whole = GRPORun.create(config, tmp_path / "whole", engine=engine)
    whole.run()
    weights = {k: v.clone() for k, v in whole.trainer.weights().items()}
    whole.close()
    part = GRPORun.create(config, tmp_path / "part", engine=engine)
    part.run(2)
    part.close()
    resumed = GRPORun.open(config, tmp_path / "part", engine=engine)
    assert resumed.generation == 2
    resumed.run()
    for name, tensor in resumed.trainer.weights().items():
        assert torch.equal(tensor, weights[name]), name
    resumed.close()
    assert _rows(tmp_path / "part") == _rows(tmp_path / "whole")


def test_label_logits_leave_the_weights_and_rows_as_the_gather_left_them(tmp_path, monkeypatch):
    """As on a LoRA (test_grpo_run): torch's gather in place of `label_logits`' elementwise backward
    gives the same weights and rows."""
    import evolm_lib.train.policy as policy_module
    from evolm_lib.grpo import primitives

    monkeypatch.setattr(primitives, "_sorted_scatter", lambda grad: True)

    config = full_config(num_steps=2, engine="hf", beta=0.1, micro_batch_size=4)
    ours = GRPORun.create(config, tmp_path / "ours")
    ours.run()
    weights = {k: v.clone() for k, v in ours.trainer.weights().items()}
    ours.close()
    monkeypatch.setattr(policy_module, "label_logits", primitives.gather_labels)
    gathered = GRPORun.create(config, tmp_path / "gathered")
    gathered.run()
    for name, tensor in gathered.trainer.weights().items():
        assert torch.equal(tensor, weights[name]), name
    gathered.close()
    assert _rows(tmp_path / "ours") == _rows(tmp_path / "gathered")
    assert _rows(tmp_path / "ours")[-1]["grpo/grad_norm"] > 0


def test_a_kill_mid_step_resumes_to_the_rows_of_an_uninterrupted_run(tmp_path):
    """SIGKILL inside step 4's update (checkpoints every 2 steps: the resume redoes steps 3 and 4), on the HF engine."""
    import os
    import signal
    import subprocess
    import sys
    import textwrap

    config = full_config(num_steps=4, checkpoint_every=2, engine="hf", grpo_weights="all")
    script = textwrap.dedent(f"""
        import os, signal
        from evolm_lib.config import GRPOConfig
        from evolm_lib.train.grpo import GRPORun
        run = GRPORun.open(GRPOConfig(**{config.to_dict()!r}), {str(tmp_path / 'k')!r})
        run.run(2)
        run.step()
        def dying(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        run.trainer.train = dying
        run.run()
    """)
    process = subprocess.run([sys.executable, "-c", script], env=dict(os.environ), capture_output=True, text=True)
    assert process.returncode == -signal.SIGKILL, process.stderr[-2000:]
    assert [r["step"] for r in read_metrics(tmp_path / "k")] == [0, 1, 2, 3]
    resumed = GRPORun.open(config, tmp_path / "k")
    assert resumed.generation == 2  # step 3 had no checkpoint of its own
    resumed.run()
    resumed.close()
    whole = GRPORun.open(config, tmp_path / "w")
    whole.run()
    whole.close()
    assert _rows(tmp_path / "k") == _rows(tmp_path / "w")


# ----------------------------------------------------------------------------- folders written before the run code's restructuring

BEFORE_GRPO = Path(__file__).with_name("data") / "before_grpo"


def _before_grpo():
    """The settings tests/data/make_before_grpo_runs.py wrote the folders with (one source)."""
    return data_script("make_before_grpo_runs")


@pytest.mark.parametrize("name", ["lora", "full"])
def test_a_grpo_folder_written_before_the_restructuring_resumes_like_an_uninterrupted_run(tmp_path, name, engine):
    """tests/data/before_grpo: a LoRA folder (KL penalty, two micro-batches a step) and a folder of the
    model's own weights (layer 1's q_proj and v_proj, scored every 3 steps), written on vLLM by the code
    before the ES and GRPO run code was restructured (commit 5c54530) and stopped after step 2 of 4.
    Today's code opens them, ends at the weights of an uninterrupted run of today, and the folder holds
    that run's rows (the two old ones included)."""
    import shutil

    old = _before_grpo()
    assert old.ENGINE == ENGINE  # the engine the folders were written on
    config = GRPOConfig.from_dict(old.SETTINGS[name])
    run_dir = tmp_path / "old"
    shutil.copytree(BEFORE_GRPO / name, run_dir)
    resumed = GRPORun.open(config, run_dir, engine=engine)
    assert resumed.generation == old.STOP
    resumed.run()
    trained = {k: v.clone() for k, v in (resumed.trainer.weights() if name == "full" else resumed.policy.tensors).items()}
    resumed.close()  # the shared engine serves the model folder's weights again
    reference = GRPORun.create(config, tmp_path / "reference", engine=engine)
    reference.run()
    expected_weights = reference.trainer.weights() if name == "full" else reference.policy.tensors
    assert trained.keys() == expected_weights.keys()
    for key, value in expected_weights.items():
        torch.testing.assert_close(trained[key], value, rtol=1e-5, atol=1e-6, msg=key)
    reference.close()
    rows, expected = without_times(read_metrics(run_dir)), without_times(read_metrics(tmp_path / "reference"))
    assert [r["step"] for r in rows] == [r["step"] for r in expected] == list(range(config.num_steps + 1))
    assert_rows_close(rows, expected, "step")
