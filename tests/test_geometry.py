"""evolm_lib.geometry: norms, changed shares, cosines and the barrier by hand; a merged LoRA against
peft's merge; solutions of real runs; the straight path served in place on a vLLM engine (its ends
reproduce the runs' own scores, the engine restored afterwards); drift on another task; bad input."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from evolm_lib import geometry
from evolm_lib.config import ConfigError, ESConfig, GRPOConfig
from evolm_lib.engines import SamplingSettings
from evolm_lib.runs import read_metrics
from evolm_lib.tasks import get_task
from evolm_lib.train.es import ESRun
from evolm_lib.train.grpo import GRPORun

Q0 = "model.layers.0.self_attn.q_proj.weight"
Q1 = "model.layers.1.self_attn.q_proj.weight"
V0 = "model.layers.0.self_attn.v_proj.weight"
TARGETS = ["q_proj", "v_proj", "down_proj"]
COMMON = dict(model="tiny-random", task="conciseness", target_modules=TARGETS, max_new_tokens=6, max_model_len=256,
              kv_cache_gb=0.0625, eval_every=1)


# ----------------------------------------------------------------------------- the maths, by hand


def test_cosine_with_itself_its_negation_and_by_hand():
    a = {Q0: torch.tensor([[1.0, 0.0], [0.0, 0.0]]), Q1: torch.tensor([[0.0, 2.0]])}
    assert geometry.update_cosine(a, a)["overall"] == pytest.approx(1.0, abs=1e-12)
    negated = geometry.update_cosine(a, {k: -v for k, v in a.items()})
    assert negated["overall"] == pytest.approx(-1.0, abs=1e-12)
    assert negated["per_layer"] == {0: pytest.approx(-1.0), 1: pytest.approx(-1.0)}
    # b = [[1, 1], [0, 0]] on layer 0 only, and a weight a does not move (v_proj): a.b = 1, |a| = sqrt 5,
    # |b| = sqrt(2 + 4) -> 1 / sqrt 30; layer 0 alone: 1 / (1 * sqrt 6); layer 1: b has no length there
    b = {Q0: torch.tensor([[1.0, 1.0], [0.0, 0.0]]), V0: torch.tensor([[2.0]])}
    cosine = geometry.update_cosine(a, b)
    assert cosine["overall"] == pytest.approx(1 / math.sqrt(30))
    # chance level over the coordinates compared: q0 4 + q1 2 + v0 1 = 7 -> 1 / sqrt 7
    assert cosine["chance"] == pytest.approx(1 / math.sqrt(7)) and a_chance(a) == pytest.approx(1 / math.sqrt(6))
    assert cosine["per_layer"][0] == pytest.approx(1 / math.sqrt(6)) and math.isnan(cosine["per_layer"][1])
    assert cosine["per_module"]["q_proj"] == pytest.approx(1 / math.sqrt(5 * 2)) and math.isnan(cosine["per_module"]["v_proj"])
    with pytest.raises(ValueError, match="shapes differ"):
        geometry.update_cosine(a, {Q0: torch.zeros(3, 3)})


def a_chance(update) -> float:
    return geometry.update_cosine(update, update)["chance"]


def test_norms_and_changed_shares_by_hand():
    base = {Q0: torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "model.embed_tokens.weight": torch.tensor([[1.0, 1.0]])}
    # q: one value moved by 0.5 (seen in bfloat16), one by 1e-4 (float32 only); embedding: both by 3 and 4
    weights = {Q0: torch.tensor([[1.0 + 1e-4, 2.0], [3.0, 4.5]]), "model.embed_tokens.weight": torch.tensor([[4.0, 5.0]])}
    rows = geometry.update_table(weights, base, "bfloat16")
    by_name = {r["weight"]: r for r in rows}
    q = by_name[Q0]
    assert (q["layer"], q["module"], q["values"]) == (0, "q_proj", 4)
    assert q["norm"] == pytest.approx(math.sqrt(0.25 + 1e-8), rel=1e-5) and q["base_norm"] == pytest.approx(math.sqrt(30))
    assert q["changed_share"] == 0.25  # 1 + 1e-4 rounds to 1 in bfloat16
    assert geometry.update_table(weights, base, "float32")[1]["changed_share"] == 0.5
    embedding = by_name["model.embed_tokens.weight"]
    assert (embedding["layer"], embedding["module"], embedding["norm"], embedding["changed_share"]) == (None, "embed_tokens", 5.0, 1.0)
    whole = geometry.summarize(rows)
    assert whole["norm"] == pytest.approx(math.sqrt(25 + 0.25 + 1e-8), rel=1e-6)
    assert whole["changed_share"] == pytest.approx((0.25 * 4 + 1.0 * 2) / 6)
    assert [g["layer"] for g in geometry.summarize(rows, by="layer")] == [0, None]
    assert [g["module"] for g in geometry.summarize(rows, by="module")] == ["embed_tokens", "q_proj"]


def test_barrier_by_hand():
    assert geometry.path_barrier([0, 0.5, 1], [1.0, 0.0, 1.0]) == 1.0
    assert geometry.path_barrier([0, 0.5, 1], [0.0, 1.5, 2.0]) == 0.0  # above the line: no barrier
    assert geometry.path_barrier([0, 0.25, 0.5, 1], [0.0, 0.0, 0.25, 1.0]) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="from t = 0 to t = 1"):
        geometry.path_barrier([0, 0.5], [1.0, 2.0])


def test_merged_lora_difference_equals_peft_merge_minus_base(tiny_model_dir):
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from evolm_lib.lora import LoraSpec, adapter_shapes, init_adapter

    spec = LoraSpec(target_modules=("q_proj", "down_proj"), rank=2, alpha=3.0)
    shapes = adapter_shapes(tiny_model_dir, spec)
    adapter = init_adapter(spec, shapes, "random_ab", 0, {k: 1.0 for k in shapes}, 0.3)
    delta = geometry.merged_lora_delta(adapter)
    base = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).named_parameters())
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                           LoraConfig(r=2, lora_alpha=3.0, target_modules=["q_proj", "down_proj"]))
    set_peft_model_state_dict(model, adapter.tensors)
    merged = dict(model.merge_and_unload().named_parameters())
    assert len(delta) == 2 * 2  # two modules in each of tiny-random's two layers
    for name, value in delta.items():
        torch.testing.assert_close(value, (merged[name] - base[name]).detach(), atol=1e-6, rtol=0)
        assert float(value.abs().max()) > 1e-3


# ----------------------------------------------------------------------------- real runs on a vLLM engine


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """An engine of these tests' own (runs and paths write its weights in place)."""
    from evolm_lib.engines.vllm.engine import VLLMEngine

    engine = VLLMEngine(str(tiny_model_dir), max_loras=6, max_lora_rank=8, max_model_len=256, kv_cache_gb=0.0625)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def runs(engine, tmp_path_factory):
    """A full-parameter GRPO run, a full-parameter ES run and a LoRA GRPO run on conciseness."""
    root = tmp_path_factory.mktemp("geometry")
    configs = {
        "grpo_full": (GRPORun, GRPOConfig(**COMMON, policy_weights="full", group_size=4, learning_rate=0.05, num_steps=2)),
        "es_full": (ESRun, ESConfig(**COMMON, es_mode="full", population_size=4, sigma=0.1, learning_rate=0.05,
                                    num_generations=2)),
        "grpo_lora": (GRPORun, GRPOConfig(**COMMON, group_size=4, learning_rate=0.05, num_steps=1, lora_rank=2)),
    }
    folders = {}
    for name, (cls, config) in configs.items():
        run = cls.open(config, root / name, engine=engine)
        run.run()
        run.close()
        folders[name] = root / name
    return folders


def test_solutions_of_runs(runs, tiny_model_dir):
    grpo, es, lora = (geometry.load_solution(runs[k]) for k in ("grpo_full", "es_full", "grpo_lora"))
    assert (grpo.label, grpo.form, grpo.generation) == ("grpo full", "full", 2)
    assert (es.label, es.form, es.generation) == ("es full", "full", 2)
    assert (lora.label, lora.form, lora.generation) == ("grpo", "lora", 1)
    assert set(grpo.weights) == set(es.weights)  # the same targets: q, v and down of both layers
    assert all(n.endswith(("q_proj.weight", "v_proj.weight", "down_proj.weight")) for n in lora.weights)
    for solution in (grpo, es, lora):
        assert geometry.summarize(geometry.update_table(solution.weights, solution.base, "float32"))["norm"] > 0
    between = geometry.update_cosine(grpo.delta, es.delta)
    assert -1 <= between["overall"] <= 1 and set(between["per_layer"]) == {0, 1}
    assert geometry.update_cosine(grpo.delta, grpo.delta)["overall"] == pytest.approx(1.0)


def test_the_path_ends_reproduce_the_runs_scores_and_the_engine_is_restored(runs, engine):
    a, b = geometry.load_solution(runs["grpo_full"]), geometry.load_solution(runs["es_full"])
    task = get_task("conciseness")
    prompts, greedy = ["The capital of France is"], SamplingSettings(max_new_tokens=8)
    before = engine.generate(prompts, [None], greedy)[0][0].token_ids
    rows = geometry.interpolation_path(engine, a, b, task, 3, max_new_tokens=6, kl_samples=1)
    assert [r["t"] for r in rows] == [0.0, 0.5, 1.0]
    for row, folder in ((rows[0], runs["grpo_full"]), (rows[-1], runs["es_full"])):
        last = read_metrics(folder)[-1]
        assert (row["eval/reward"], row["policy/train_reward"]) == (last["eval/reward"], last["policy/train_reward"])
    assert all(r["policy/kl"] >= 0 for r in rows)
    barrier = geometry.path_barrier([r["t"] for r in rows], [r["eval/reward"] for r in rows])
    assert barrier >= 0
    assert engine.generate(prompts, [None], greedy)[0][0].token_ids == before  # the base model, as before


def test_a_path_between_other_models_or_forms_is_refused(runs, engine):
    full, lora = geometry.load_solution(runs["grpo_full"]), geometry.load_solution(runs["grpo_lora"])
    with pytest.raises(ConfigError, match="es_mode / policy_weights: the path's ends moved different forms"):
        geometry.interpolation_path(engine, full, lora, get_task("conciseness"))
    other = geometry.Solution(full.run_dir, full.label, "smollm2-135m-instruct", Path("/elsewhere"), "full", 0, {}, {})
    with pytest.raises(ConfigError, match="model: the path's ends are runs of different models"):
        geometry.interpolation_path(engine, full, other, get_task("conciseness"))


def test_drift_on_another_task_per_checkpoint(runs, engine, tmp_path):
    prompts = tmp_path / "other.jsonl"
    prompts.write_text('{"prompt": "Name a colour.", "target": "red", "split": "eval"}\n'
                       '{"prompt": "Name a fruit.", "target": "apple", "split": "eval"}\n')
    es = geometry.off_task_drift(engine, runs["es_full"], str(prompts), num_samples=1)
    assert [r["generation"] for r in es] == [0, 1, 2]  # every snapshot generation, rebuilt from the seed log
    assert abs(es[0]["off_task/kl"]) < 1e-4  # generation 0 is the base model
    grpo = geometry.off_task_drift(engine, runs["grpo_full"], "arithmetic", num_samples=1, max_prompts=2)
    assert [r["generation"] for r in grpo] == [1, 2] and all(r["off_task/kl"] > 0 for r in grpo)  # the kept checkpoints
    lora = geometry.off_task_drift(engine, runs["grpo_lora"], "arithmetic", num_samples=1, max_prompts=2)
    assert [r["generation"] for r in lora] == [0, 1]


def test_an_off_task_source_that_does_not_exist_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="off_task: .*missing.jsonl does not exist"):
        geometry.off_task_source(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ConfigError, match=r"off_task: 'arithmetc' is neither a task \(did you mean arithmetic\?\)"):
        geometry.off_task_source("arithmetc")
    assert geometry.off_task_source("arithmetic").name == "arithmetic"
