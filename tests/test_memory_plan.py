"""The memory plan a card: shapes from a config alone, each term by hand on a small Qwen2 config, tensor
parallelism halving what it splits and not what vLLM replicates, the refusals, and the ``plan`` benchmark."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from evolm_lib import preflight
from evolm_lib.config import ConfigError, ESConfig, GRPOConfig
from evolm_lib.engines.memory_plan import (ModelShape, PlanSettings, check_memory_plan, memory_plan, model_shapes,
                                           plan_for_run, smallest_tensor_parallel_size)
from evolm_lib.lora import base_weight_shapes

# Qwen2 (q/k/v biases, untied head): hidden 64, MLP 128, 2 layers, 4 heads of 16, 2 KV heads, vocab 1000
SMALL = dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512, tie_word_embeddings=False)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def small():
    return ModelShape.of(SMALL, name="small")


def settings(**changes) -> PlanSettings:
    base = dict(mode="full", dtype="bfloat16", population=4, lora_rank=1, sequences=3, max_model_len=100, allowance=1000)
    return PlanSettings(**{**base, **changes})


def test_shapes_from_config_equal_the_tiny_models_files(tiny_model_dir):
    # tied embeddings: the output head is the embedding, stored once and counted once
    assert model_shapes(tiny_model_dir) == base_weight_shapes(tiny_model_dir, matrices_only=False)
    assert model_shapes(preflight.model_config(tiny_model_dir)) == base_weight_shapes(tiny_model_dir, matrices_only=False)


def test_small_model_terms_by_hand(small):
    # every weight, HF's count: embed and lm_head 1000 x 64 each; a layer: q 64x64+64, k and v 32x64+32,
    # o 64x64, gate/up 128x64, down 64x128, two norms of 64; the final norm 64
    layer = (4096 + 64) + 2 * (2048 + 32) + 4096 + 3 * 8192 + 2 * 64  # 37,120
    assert sum(math.prod(s) for s in small.shapes.values()) == 2 * 64000 + 2 * layer + 64 == 202304
    plan = memory_plan(small, settings())
    # weights: the vocabulary padded to 1024 rows (vLLM pads to a multiple of 64), bfloat16
    assert plan.weights == 2 * (2 * 1024 * 64 + 2 * layer + 64) == 410752
    moved = 2 * (4096 + 2 * 2048 + 4096 + 3 * 8192)  # the seven projections of both layers: 73,728 values
    assert plan.master == 4 * moved == 294912
    assert plan.optimizer == 0  # plain sgd
    assert plan.temporaries == 2 * 4 * 8192  # tiled: noise and gradient of the largest moved tensor (gate/up/down)
    # LoRA slots: (population 4 + mean 1 + zero 1) x 2 in place = 12 slots of rank 1 over every projection,
    # rank x (in + out): q 128, k 96, v 96, o 128, gate/up/down 192 each, two layers
    assert plan.lora_slots == 12 * 1 * 2 * (128 + 96 + 96 + 128 + 3 * 192) * 2 == 49152
    # KV: 3 sequences x 100 tokens in whole blocks of 16 (112); 2 x 2 layers x 2 KV heads x 16 x 2 bytes a token
    assert plan.kv_cache == 3 * 112 * (2 * 2 * 2 * 16 * 2) == 86016
    assert plan.trainer == 0 and plan.allowance == 1000
    assert plan.total == 410752 + 294912 + 65536 + 49152 + 86016 + 1000
    assert memory_plan(small, settings(optimizer="adam")).optimizer == 8 * moved
    assert memory_plan(small, settings(momentum=0.9)).optimizer == 4 * moved
    assert memory_plan(small, settings(noise_scheme="flat")).temporaries == 2 * 4 * moved
    # rank 5 slots are vLLM's next supported rank, 8
    assert memory_plan(small, settings(mode="lora", lora_rank=5)).lora_slots == 8 * plan.lora_slots
    assert memory_plan(small, settings(mode="lora")).master == 0


def test_tensor_parallel_halves_what_it_splits_and_not_what_it_replicates(small):
    one, two, four = (memory_plan(small, settings(tensor_parallel_size=tp)) for tp in (1, 2, 4))
    norms = 2 * 2 * 64 + 64  # replicated on every rank
    # TP 2: every weight but the norms split in two (the 1024 padded vocabulary rows split evenly)
    assert 2 * two.weights - one.weights == 2 * norms
    assert two.master == one.master // 2 and two.temporaries == one.temporaries // 2
    assert two.kv_cache == one.kv_cache // 2  # one of the two KV heads a rank
    # slots: column-parallel layers split B (out), row-parallel ones A (in): q 32+64, k and v 16+64, o 64+32,
    # gate/up 64+64, down 64+64
    assert two.lora_slots == 12 * 2 * (96 + 80 + 80 + 96 + 3 * 128) * 2
    # TP 4 with 2 KV heads: each rank holds one whole KV head (each head on two ranks), k and v 16 x 64 + 16 a rank
    kv_replicas = 2 * 2 * 2 * (16 * 64 + 16)  # layers x (k, v) x 2 extra copies: 4 ranks hold the 2 heads twice
    assert 4 * four.weights - one.weights == 2 * (3 * norms + kv_replicas)
    assert four.kv_cache == two.kv_cache  # a whole head a rank: the KV cache stops shrinking
    assert small.tensor_parallel_sizes(8) == [1, 2, 4]  # 4 heads: 8 ranks cannot split them


def test_grpo_terms_match_the_preflight_sums_at_one_card(tiny_model_dir):
    config = GRPOConfig(model="tiny-random", policy_weights="full", beta=0.1)
    plan = plan_for_run(config, tiny_model_dir, sequences=2)
    assert plan.master + plan.trainer == preflight.policy_weights_bytes(config, tiny_model_dir)
    es = ESConfig(model="tiny-random", es_mode="full", optimizer="adam", noise_scheme="flat")
    plan = plan_for_run(es, tiny_model_dir, sequences=2)
    # preflight counts the master, one member's noise and Adam's moments; the plan adds the gradient
    assert plan.master + plan.optimizer + plan.temporaries // 2 == preflight.weights_mode_bytes(es, tiny_model_dir)
    lora = plan_for_run(GRPOConfig(model="tiny-random"), tiny_model_dir, sequences=2)
    assert lora.trainer >= 4 * sum(math.prod(s) for s in lora.model.shapes.values())  # the float32 policy model


def test_refusal_names_the_smallest_tensor_parallel_size(small):
    one, two = (memory_plan(small, settings(tensor_parallel_size=tp)) for tp in (1, 2))
    card = (one.total + two.total) // 2
    assert smallest_tensor_parallel_size(small, settings(), card, 4) == 2
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=1: .* set tensor_parallel_size=2") as error:
        check_memory_plan(one, card, cards=4)
    assert error.value.errors[0][0] == "tensor_parallel_size"
    assert check_memory_plan(two, card, cards=4) is two
    # one card present: nothing fits; the message names what takes most at the widest split
    widest = one.at(1)
    with pytest.raises(ConfigError, match="at no tensor_parallel_size up to the 1 cards present") as error:
        check_memory_plan(one, card, cards=1)
    assert "the weights" in str(error.value) and widest.dominant() == "weights"
    # a moved master that dominates: move fewer weights
    heavy = settings(target_modules="all", allowance=0)
    plan = memory_plan(small, heavy)
    with pytest.raises(ConfigError, match="the float32 master of the moved weights .*move fewer weights"):
        check_memory_plan(plan, plan.total // 3, cards=1)


def test_more_cards_than_present_and_flat_noise_split_are_refused(small):
    plan = memory_plan(small, settings(tensor_parallel_size=4))
    with pytest.raises(ConfigError, match=r"over 4 cards, but 2 are present: set tensor_parallel_size <= 2"):
        check_memory_plan(plan, 10**12, cards=2)
    with pytest.raises(ConfigError, match="noise_scheme=flat .* set noise_scheme tiled"):
        memory_plan(small, settings(noise_scheme="flat", tensor_parallel_size=2))
    with pytest.raises(ConfigError, match="tensor_parallel_size=8 does not split"):
        memory_plan(small, settings(tensor_parallel_size=8))
    with pytest.raises(ConfigError, match="mode: must be one of"):
        settings(mode="fully")


def test_plan_subcommand_prints_and_writes_the_table(tmp_path):
    out = tmp_path / "plan.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "evolm_lib.benchmark", "plan", "--models", "7b", "--modes", "lora,full",
                           "--json", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    rows = {(r["mode"], r["tensor_parallel_size"]): r for r in report["rows"]}
    # Qwen2.5-7B: embedding and head 152,064 x 3,584 each (a multiple of 64 rows already); a layer q and o
    # 3,584^2, k and v 512 x 3,584, q/k/v biases, gate/up/down 18,944 x 3,584, two norms; the final norm
    layer = 2 * 3584**2 + 2 * 512 * 3584 + (3584 + 2 * 512) + 3 * 18944 * 3584 + 2 * 3584
    values = 2 * 152064 * 3584 + 28 * layer + 3584
    assert values == 7_615_616_512
    lora = rows[("lora", 1)]
    assert lora["weights_gib"] * 2**30 == pytest.approx(2 * values) and 15.2e9 < 2 * values < 15.3e9
    assert rows[("full", 1)]["master_gib"] * 2**30 == pytest.approx(4 * 28 * (layer - 3584 - 2 * 512 - 2 * 3584))
    assert rows[("full", 1)]["fits"] is True
    assert "does not split" in rows[("full", 8)]["skipped"]  # 28 heads over 8 ranks
    assert report["smallest"]["Qwen2.5-7B"] == {"lora": 1, "full": 1}
    assert "Qwen2.5-7B   full        1" in done.stdout and "smallest tensor_parallel_size" in done.stdout
