"""The files one LoRA generation runs are exactly those docs/es-loop.md names, stage by stage: the
docs tell the path as it is (a profiler over the second generation of a tiny-random run on a real
vLLM engine, whose resident slots the run set up when it opened)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import evolm_lib
from evolm_lib.config import ESConfig
from evolm_lib.train.es import ESRun

DOC = Path(__file__).resolve().parents[1] / "docs" / "es-loop.md"
SECTION = "## The files one generation passes through"


def documented_stages() -> list[set[str]]:
    """The files each stage of the docs' table names (its third column), by path below evolm_lib/."""
    section = DOC.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if re.match(r"\| \d+ \|", line)]
    return [set(re.findall(r"`([\w/]+\.py)`", row.split("|")[3])) for row in rows]


def files_run_by(call) -> set[str]:
    """The files of evolm_lib whose functions run during ``call()`` (this thread: the engine runs
    in this process, its worker included)."""
    root = Path(evolm_lib.__file__).parent
    seen: set[str] = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(str(root)):
            seen.add(Path(frame.f_code.co_filename).relative_to(root).as_posix())

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen


def test_a_lora_generation_runs_exactly_the_files_the_docs_name(tmp_path):
    stages = documented_stages()
    assert 1 <= len(stages) <= 10 and all(stages)
    config = ESConfig(model="tiny-random", task="conciseness", population_size=4, sigma=0.05, learning_rate=0.2,
                      num_generations=3, max_new_tokens=4, max_model_len=256, kv_cache_gb=0.25, eval_every=1)
    assert config.es_mode == "lora" and config.adapter_transfer == "in_place" and config.score_in_population
    run = ESRun.open(config, tmp_path / "run")
    try:
        run.step()
        ran = files_run_by(run.step)
        assert run.generation == 2
    finally:
        run.close()
    documented = set().union(*stages)
    assert ran == documented, f"run but not named: {sorted(ran - documented)}; named but not run: {sorted(documented - ran)}"
