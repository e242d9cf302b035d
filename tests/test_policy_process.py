"""The GRPO policy in a process of its own (``policy_process: own``): the settings, the shared trained
weights, the same rows as the policy in the run's process (LoRA and full weights, on a real vLLM
engine), the same rows on a rerun, a resume from a checkpoint the child's state went into, the child
started without vLLM's batch-invariant settings, and its death as a clear error."""
from __future__ import annotations

import os
import pickle
import shutil
import signal
from pathlib import Path

import pytest
import torch

from evolm_lib.config import ConfigError, GRPOConfig
from evolm_lib.runs import read_metrics
from evolm_lib.engines.synthetic import SyntheticEngine
from evolm_lib.train.grpo import GRPORun
from evolm_lib.train.policy import PolicyTrainer, attention_implementation, rollout_batch
from evolm_lib.train.policy_process import PolicyProcess, PolicyProcessDied, policy_in_own_process

TINY = dict(model="tiny-random", task="conciseness", target_modules=["q_proj", "v_proj"], lora_rank=2, lora_alpha=2.0,
            group_size=4, max_new_tokens=6, max_model_len=256, kv_cache_gb=0.0625, learning_rate=0.05, num_steps=2,
            deterministic=True)
FULL = dict(TINY, policy_weights="full", target_modules=["q_proj", "v_proj", "down_proj"])


def _rows(run_dir) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in read_metrics(run_dir)]


def _ended(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """An engine of these tests' own (full-weight runs move its weights, and give them back at close)."""
    from evolm_lib.engines.vllm.engine import VLLMEngine

    engine = VLLMEngine(str(tiny_model_dir), max_loras=2, max_lora_rank=8, max_model_len=256, kv_cache_gb=0.0625)
    yield engine
    engine.close()


# ----------------------------------------------------------------------------- settings


def test_settings_are_checked_and_auto_keeps_cpu_runs_in_one_process():
    with pytest.raises(ConfigError, match="policy_process"):
        GRPOConfig.from_dict({**TINY, "policy_process": "child"})
    with pytest.raises(ConfigError, match="deterministic_update: True sets torch in the policy's own process"):
        GRPOConfig.from_dict({**TINY, "policy_process": "same", "deterministic_update": True})
    assert GRPOConfig.from_dict({"model": "tiny-random"}).policy_process == "auto"
    assert policy_in_own_process(GRPOConfig.from_dict({**TINY, "policy_process": "own"}))
    assert not policy_in_own_process(GRPOConfig.from_dict({**TINY, "policy_process": "same"}))
    # auto: own only where a GPU engine in this process runs batch-invariant
    assert policy_in_own_process(GRPOConfig.from_dict(TINY)) == torch.cuda.is_available()
    assert not policy_in_own_process(GRPOConfig.from_dict({**TINY, "deterministic": False}))


def test_a_run_continues_with_its_policy_in_another_process(tmp_path):
    """policy_process is extendable: a run made with the policy here continues with it in its own
    process (a GPU run from before the setting existed goes on with ``same``)."""
    config = GRPOConfig.from_dict({**TINY, "policy_process": "same", "num_steps": 1, "loss_type": "no_baseline",
                                   "normalize_by_std": False})
    GRPORun.create(config, tmp_path / "run", engine=SyntheticEngine()).close()
    run = GRPORun.open(config.replace(policy_process="own", num_steps=2), tmp_path / "run", engine=SyntheticEngine())
    try:
        assert isinstance(run.trainer, PolicyProcess)
        assert run.run()[-1]["step"] == 2
    finally:
        run.close()


def test_cublas_keeps_its_deterministic_workspace_setting_except_where_the_default_is_the_same_size(monkeypatch):
    """_start_cublas drops CUBLAS_WORKSPACE_CONFIG, once cuBLAS has started, only on a card whose default
    workspace is the 32 MiB ":4096:8" asks for (Hopper); a CPU or another card keeps it, and nothing
    starts there."""
    from evolm_lib.train import policy_process

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", policy_process.DETERMINISTIC_CUBLAS_WORKSPACE)
    assert policy_process._start_cublas(torch.device("cpu")) == {}
    for capability in ((8, 0), (8, 9), (10, 0), (12, 0), (9, 1)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, capability=capability: capability)
        assert policy_process._start_cublas(torch.device("cuda", 0)) == {}, capability  # no CUDA touched here
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert policy_process.SAME_DEFAULT_WORKSPACE == ((9, 0),)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    assert policy_process._start_cublas(torch.device("cuda", 0)) == {}  # nothing set, nothing to drop or start


CHOSEN_WORKSPACE = """
#include <cstddef>
#include <cstdlib>
namespace at { namespace cuda {
__attribute__((noinline)) size_t parseChosenWorkspaceSize() { return std::getenv("CUBLAS_WORKSPACE_CONFIG") ? 1 : 2; }
size_t getChosenWorkspaceSize() { %s }
}}
"""


@pytest.mark.skipif(not all(shutil.which(tool) for tool in ("g++", "nm", "objdump")), reason="needs g++, nm and objdump")
def test_the_build_check_tells_a_parse_on_every_call_from_a_kept_size(tmp_path, capsys):
    """scripts/torch_cublas_workspace.py on two real shared libraries built here: one whose
    getChosenWorkspaceSize parses on every call (as torch 2.11's), one that keeps the size in a static."""
    import importlib.util
    import subprocess

    script = Path(__file__).resolve().parents[1] / "scripts" / "torch_cublas_workspace.py"
    spec = importlib.util.spec_from_file_location("torch_cublas_workspace", script)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    bodies = {"every_call": "return parseChosenWorkspaceSize();",
              "kept": "static size_t size = parseChosenWorkspaceSize(); return size;"}
    for name, body in bodies.items():
        (tmp_path / f"{name}.cpp").write_text(CHOSEN_WORKSPACE % body)
        subprocess.run(["g++", "-O2", "-fPIC", "-shared", "-o", str(tmp_path / f"lib{name}.so"), str(tmp_path / f"{name}.cpp")],
                       check=True)
    assert check.main([str(tmp_path / "libevery_call.so")])["parsed_every_call"] is True
    assert "parses CUBLAS_WORKSPACE_CONFIG on every call" in capsys.readouterr().out
    kept = check.main([str(tmp_path / "libkept.so"), "--json", str(tmp_path / "kept.json")])
    assert kept["parsed_every_call"] is False and "guard variable" in kept["disassembly"]
    assert "keeps the parsed size" in capsys.readouterr().out
    timed = check.time_parse(calls=50)  # the copy of torch 2.11's parse gives 32 MiB both ways, or raises
    assert set(timed) == {"set", "unset"} and all(micros >= 0 for micros in timed.values())
    with pytest.raises(SystemExit, match="does not export"):
        check.function_body(tmp_path / "libkept.so", symbol="_ZN2at4cuda9somethingEv")


# ----------------------------------------------------------------------------- the proxy on its own


def test_the_child_updates_the_shared_weights_as_the_trainer_here_does(tiny_model_dir, monkeypatch):
    """One full-weight step in the child and one here, on the same batch: the parent's view of the
    child's weights moved, bit for bit as the trainer here; AdamW's state alike; the child started
    without the batch-invariant environment; its errors keep their type; close ends it."""
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")  # as vLLM's batch-invariant mode leaves them
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    config = GRPOConfig.from_dict({**FULL, "loss_type": "reinforce_with_baseline", "deterministic_update": True})
    child = PolicyProcess(tiny_model_dir, None, config)
    here = PolicyTrainer(tiny_model_dir, None, config)
    try:
        assert child.settings["batch_invariant"] is None and child.settings["deterministic_algorithms"] is True
        assert child.settings["cublas_workspace_config"] == ":4096:8"  # its own, not vLLM's :16:8
        assert (child.full, child.vocab_size, child.pad_token_id) == (True, here.vocab_size, here.pad_token_id)
        batch = rollout_batch([[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]], [[11, 12], [13], [14, 15], [16, 17]],
                              here.pad_token_id)
        advantages = torch.tensor([0.5, -1.0, 1.5, -0.25])
        view = child.weights()
        before = child.flat_weights().clone()
        assert torch.equal(before, here.flat_weights())
        stats = child.train(batch, torch.zeros(4), advantages)
        expected = here.train(batch, torch.zeros(4), advantages)
        assert not torch.equal(child.flat_weights(), before)  # the parent sees the child's update in place
        assert torch.equal(child.flat_weights(), here.flat_weights())
        for name, tensor in here.weights().items():
            assert torch.equal(view[name], tensor), name  # a view taken before the step: live
        assert stats["grpo/loss"] == expected["grpo/loss"]
        for (a, mask_a), (b, mask_b) in zip(stats["_first_pass"], expected["_first_pass"]):
            assert torch.equal(a, b) and torch.equal(mask_a, mask_b)
        theirs, ours = child.optimizer_tensors(), here.optimizer_tensors()
        assert set(theirs) == set(ours) and all(torch.equal(theirs[k], ours[k]) for k in ours)
        with pytest.raises(ValueError, match="weights do not fit the policy") as raised:
            child.set_weights({"not.a.weight": torch.zeros(1)})
        assert "raised in the policy process" in raised.value.__notes__[0]
        assert child.encode("One, two,") == here.encode("One, two,")
        # a call interrupted in the parent (Ctrl-C) leaves its reply behind: the next call skips it
        child._calls += 1
        child._connection.send_bytes(pickle.dumps((child._calls, "set_weights", ({"not.a.weight": torch.zeros(1)},))))
        assert set(child.optimizer_tensors()) == set(ours)
    finally:
        child.close()
    assert _ended(child.pid)


def test_the_child_shares_its_lora_tensors_and_a_steps_adapter_is_read_without_a_call(tiny_model_dir):
    """A LoRA step in the child and one here, on the same batch: the parent reads the child's adapter
    from the tensors it shares (no call crosses the socket for it), bit for bit the trainer's here,
    and a view taken before the step is live; the adapter is a copy, which the next step leaves be."""
    from evolm_lib.lora import adapter_shapes, init_adapter

    config = GRPOConfig.from_dict({**TINY, "loss_type": "reinforce_with_baseline", "policy_process": "own"})
    shapes = adapter_shapes(tiny_model_dir, config.lora_spec())
    adapter = init_adapter(config.lora_spec(), shapes, "random_ab", 0, {k: 1.0 for k in shapes}, 0.2)
    child = PolicyProcess(tiny_model_dir, adapter, config)
    here = PolicyTrainer(tiny_model_dir, adapter, config)
    try:
        assert not child.full and set(child._shared) == set(adapter.tensors)
        view = dict(child._shared)
        batch = rollout_batch([[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]], [[11, 12], [13], [14, 15], [16, 17]],
                              here.pad_token_id)
        advantages = torch.tensor([0.5, -1.0, 1.5, -0.25])
        child.train(batch, torch.zeros(4), advantages)
        here.train(batch, torch.zeros(4), advantages)
        calls = child._calls
        theirs, ours = child.adapter(), here.adapter()
        assert child._calls == calls  # read from the shared tensors, not asked for
        assert theirs.spec == ours.spec and set(theirs.tensors) == set(ours.tensors)
        assert all(torch.equal(theirs.tensors[k], ours.tensors[k]) for k in ours.tensors)
        assert any(not torch.equal(theirs.tensors[k], adapter.tensors[k]) for k in ours.tensors)  # the step moved it
        assert all(torch.equal(view[k], ours.tensors[k]) for k in ours.tensors)  # a view taken before the step: live
        child.train(batch, torch.zeros(4), advantages)
        assert all(torch.equal(theirs.tensors[k], ours.tensors[k]) for k in ours.tensors)  # a copy: not moved again
        assert any(not torch.equal(view[k], ours.tensors[k]) for k in ours.tensors)
    finally:
        child.close()
    assert _ended(child.pid)


def test_shared_lora_tensors_must_be_the_trained_parameters_own_memory():
    """The child shares views of what the optimizer moves; a copy would leave the parent reading the
    first adapter for ever, so it is refused before any step."""
    from evolm_lib.train.policy_process import _views_of_trained

    model = torch.nn.Linear(3, 2)
    model.bias.requires_grad_(False)
    views = {"weight": model.weight.detach()}
    assert _views_of_trained(views, model) is views
    for tensors in ({"weight": model.weight.detach().clone()}, {"bias": model.bias.detach()}):
        with pytest.raises(RuntimeError, match=r"the LoRA tensors \['(weight|bias)'\] are not the trained parameters"):
            _views_of_trained(tensors, model)


def test_eager_policy_attention_trains_as_the_fused_kernel_does(tiny_model_dir):
    """policy_attention picks the trained model's attention: eager computes what sdpa computes (float32
    on the CPU: the same loss and weights to rounding), through matmuls and a softmax."""
    config = GRPOConfig.from_dict({**FULL, "loss_type": "reinforce_with_baseline"})
    with pytest.raises(ConfigError, match="policy_attention"):
        config.replace(policy_attention="flash")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert attention_implementation(config, cuda) == attention_implementation(config, cpu) == "sdpa"
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:  # auto: eager only where deterministic algorithms would slow a GPU's fused backward
        torch.use_deterministic_algorithms(True)
        assert (attention_implementation(config, cuda), attention_implementation(config, cpu)) == ("eager", "sdpa")
        assert attention_implementation(config.replace(policy_attention="sdpa"), cuda) == "sdpa"
    finally:
        torch.use_deterministic_algorithms(deterministic)
    fused, eager = (PolicyTrainer(tiny_model_dir, None, config.replace(policy_attention=a)) for a in ("sdpa", "eager"))
    assert (fused.model.config._attn_implementation, eager.model.config._attn_implementation) == ("sdpa", "eager")
    batch = rollout_batch([[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]], [[11, 12], [13], [14, 15], [16, 17]],
                          fused.pad_token_id)
    advantages = torch.tensor([0.5, -1.0, 1.5, -0.25])
    losses = [trainer.train(batch, torch.zeros(4), advantages)["grpo/loss"] for trainer in (fused, eager)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5, abs=1e-6)
    step = fused.flat_weights() - PolicyTrainer(tiny_model_dir, None, config).flat_weights()
    apart = fused.flat_weights() - eager.flat_weights()
    assert step.abs().max() > 0.01 and apart.abs().max() < 1e-3 * step.abs().max()  # AdamW: steps of about lr


# ----------------------------------------------------------------------------- runs: same rows, reruns, resume


def test_lora_rows_are_those_of_the_policy_in_the_run_process_and_repeat(engine, tmp_path):
    config = GRPOConfig.from_dict(TINY)
    for name, where in (("same", "same"), ("own", "own"), ("own_again", "own")):
        run = GRPORun.create(config.replace(policy_process=where), tmp_path / name, engine=engine)
        assert isinstance(run.trainer, PolicyProcess) == (where == "own")
        rows = run.run()
        assert rows[-1]["grpo/grad_norm"] > 0 and rows[-1]["grpo/engine_logprob_gap"] < 1e-3
        pid = getattr(run.trainer, "pid", None)
        run.close()
        assert pid is None or _ended(pid)  # closing the run ends its policy process
    assert _rows(tmp_path / "own") == _rows(tmp_path / "same")
    assert _rows(tmp_path / "own_again") == _rows(tmp_path / "own")


def test_full_weights_resume_from_a_checkpoint_of_the_child(engine, tmp_path):
    """Own process, 2 steps, closed, resumed (weights and AdamW's state back into a new child), 1 more
    step: the rows and weights of 3 uninterrupted steps with the policy in the run's process."""
    config = GRPOConfig.from_dict({**FULL, "num_steps": 3})
    whole = GRPORun.create(config.replace(policy_process="same"), tmp_path / "whole", engine=engine)
    whole.run()
    weights = {k: v.clone() for k, v in whole.trainer.weights().items()}
    whole.close()
    own = config.replace(policy_process="own")
    part = GRPORun.create(own, tmp_path / "part", engine=engine)
    part.run(2)
    part.close()
    resumed = GRPORun.open(own, tmp_path / "part", engine=engine)
    assert resumed.generation == 2 and isinstance(resumed.trainer, PolicyProcess)
    resumed.run()
    for name, tensor in resumed.trainer.weights().items():
        assert torch.equal(tensor, weights[name]), name
    resumed.close()
    assert _rows(tmp_path / "part") == _rows(tmp_path / "whole")


# ----------------------------------------------------------------------------- faults


def test_the_child_dying_is_a_clear_error_not_a_hang(tmp_path):
    config = GRPOConfig.from_dict({**TINY, "policy_process": "own", "loss_type": "no_baseline",
                                   "normalize_by_std": False})
    run = GRPORun.create(config, tmp_path / "run", engine=SyntheticEngine())
    run.step()
    os.kill(run.trainer.pid, signal.SIGKILL)
    with pytest.raises(PolicyProcessDied, match=r"the policy process \(pid \d+.*was killed by SIGKILL during train"):
        run.step()
    with pytest.raises(PolicyProcessDied, match="policy process"):  # and at every later call, at once
        run.trainer.adapter()
    run.close()
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [0, 1]


# ----------------------------------------------------------------------------- the benchmark


def test_the_update_ratios_and_row_comparisons_by_hand():
    from evolm_lib.benchmark.grpo_update import ratios

    def run(update_s, rows):
        return {"runs": {"lora/64": {"update_s": update_s, "rows": rows}}}

    summary = ratios({"not_deterministic": run(0.4, [{"a": 0}]), "deterministic_same": run(1.0, [{"a": 2}]),
                      "deterministic_own": run(0.44, [{"a": 1}]), "deterministic_own_rerun": run(0.5, [{"a": 1}]),
                      "deterministic_own_loose": run(0.42, [{"a": 3}]), "deterministic_own_loose_rerun": run(0.42, [{"a": 3}])})
    assert summary["update_over_baseline"]["lora/64"] == pytest.approx(
        {"deterministic_same": 2.5, "deterministic_own": 1.1, "deterministic_own_rerun": 1.25,
         "deterministic_own_loose": 1.05, "deterministic_own_loose_rerun": 1.05})
    assert summary["rows_identical"]["lora/64"] == {  # each against its reference: the loose runs repeat each other
        "deterministic_own_rerun": True, "deterministic_same": False, "deterministic_own_loose": False,
        "deterministic_own_loose_rerun": True}
    assert summary["goal_met"]["lora/64"] is True  # 1.1 <= 1.15
    assert ratios({"deterministic_own": run(0.5, [])})["goal_met"]["lora/64"] is None  # no baseline measured


def test_the_grpo_update_benchmark_runs_each_configuration_in_a_process_of_its_own(tmp_path, capsys):
    import json
    import statistics

    from evolm_lib.benchmark import main as benchmark

    out = tmp_path / "grpo_update.json"
    result = benchmark(["grpo-update", "--model", "tiny-random", "--steps", "2", "--prompts", "2", "--group-size", "4",
                        "--micro-batch-sizes", "8", "--examples", "8", "--new-tokens", "4", "--policy-weights", "lora,full",
                        "--configurations", "not_deterministic,deterministic_own", "--json", str(out)])
    printed = capsys.readouterr().out
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    configurations = result["configurations"]
    assert list(configurations) == ["not_deterministic", "deterministic_own"]
    free, own = (configurations[label]["runs"]["lora/8"] for label in configurations)
    for measured in (free, own):
        assert len(measured["update_s_steps"]) == 1  # 2 steps, the first not timed
        assert measured["update_s"] == statistics.median(measured["update_s_steps"]) > 0
        assert measured["sync_s"] is None and "rows" not in measured  # LoRA: nothing written into the engine
    for label in configurations:  # the model's own weights, on the same engine after the LoRA run
        full = configurations[label]["runs"]["full/8"]
        assert len(full["sync_s_steps"]) == 1 and full["sync_s"] > 0 and full["update_s"] > 0
    assert set(result["update_over_baseline"]) == {"lora/8", "full/8"}
    ratio = own["update_s"] / free["update_s"]
    assert result["update_over_baseline"]["lora/8"] == {"deterministic_own": pytest.approx(ratio)}
    assert result["goal_met"]["lora/8"] == (ratio <= 1.15)
    assert configurations["not_deterministic"]["policy_settings"] is None  # the policy in the engine's process
    assert configurations["deterministic_own"]["policy_settings"]["deterministic_algorithms"] is True
    assert f"({ratio:.2f}x)" in printed and "lora/8" in printed
    logs = tmp_path / "grpo_update_logs"  # kept beside the JSON: where a command stopped early spent its time
    for label in configurations:
        progress = (logs / f"{label}.log").read_text()
        assert f"{label}: engine ready after " in progress and f"{label}: lora/8 2 steps done after " in progress
        assert f"{label}: full/8 2 steps done after " in progress


@pytest.mark.parametrize("argv, message", [(["--steps", "1"], "--steps"), (["--micro-batch-sizes", "3"], "divide"),
                                           (["--configurations", "fast"], "--configurations"),
                                           (["--policy-weights", "half"], "--policy-weights")])
def test_the_grpo_update_benchmark_refuses_bad_options(argv, message, capsys):
    from evolm_lib.benchmark import main as benchmark

    with pytest.raises(SystemExit):
        benchmark(["grpo-update", *argv])
    assert message in capsys.readouterr().err
