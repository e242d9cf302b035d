"""A study continued from its compacted files (``tune.restore``): a small study run for real on
tiny-random, compacted, restored and compacted again gives the same lines and trials, and nothing
is left to run; a trial under way when compacted runs again with its setting, to the rows an
uninterrupted study wrote, the others kept; a folder in the
way or a compact that does not fit the spec is refused before anything is written."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_tune_study import write_spec

from evolm_lib import tune
from evolm_lib.runs import read_metrics
from evolm_lib.tune.compact import RUNS, TRIALS, _read_gzip_lines, _write_gzip_lines, compact_study, run_folders
from evolm_lib.tune.restore import RESTORED, UNDER_WAY, main as restore_main, restore_study


def _smallest(spec: dict) -> None:
    """ES only, with its two trials, two reruns, their continuations and the control: every stage a
    restore writes, at the fewest runs."""
    spec["tune"].update(space={"es": {"sigma": {"log": [0.005, 0.2]}}}, primary=[])


def _load(path: Path, out: Path | None = None):
    return tune.load_tune_spec(path, methods=["es"], out=out)


@pytest.fixture(scope="module")
def study(tmp_path_factory, tiny_vllm):
    """(spec path, the study run for real, its compacted folder, its summary)."""
    root = tmp_path_factory.mktemp("restore")
    path = write_spec(root, _smallest)
    spec = _load(path)
    quiet = lambda line: None  # noqa: E731
    assert tune.tune(spec, tiny_vllm, log=quiet) == {"es": 2}
    tune.run_finals(spec, tiny_vllm, log=quiet)
    tune.run_extras(spec, tiny_vllm, log=quiet)
    summary = tune.summarize(spec)
    compact = root / "compact"
    compact_study(spec.out, compact)
    return path, spec.out, compact, summary


def _metrics(study: Path) -> dict[str, bytes]:
    return {str(f.relative_to(study)): (f / "metrics.jsonl").read_bytes() for f in run_folders(study)}


def test_a_restored_study_compacts_to_the_same_lines_and_has_nothing_left_to_run(study, tmp_path, tiny_vllm, capsys):
    path, original, compact, summary = study
    restored = tmp_path / "restored"
    assert restore_main([str(compact), str(path), "--out", str(restored), "--methods", "es"]) == 0
    printed = capsys.readouterr().out
    assert f"restored 2 trials (es 2) and 8 runs (control 2, final 2, long 2, trial 2) into {restored}" in printed
    assert not (tmp_path / ".restored.restoring").exists()
    record = json.loads((restored / RESTORED).read_text())
    assert record["left_out"] == {} and record["trials"] == {"es": 2}

    again = tmp_path / "again"
    compact_study(restored, again)
    # every line as the original compacted it: settings, rows, held-out scores and flags, placement,
    # KL, the continued runs' shared rows and where they came from
    assert _read_gzip_lines(again / RUNS) == _read_gzip_lines(compact / RUNS)
    before, after = _read_gzip_lines(compact / TRIALS), _read_gzip_lines(again / TRIALS)
    assert after == before and [row["intermediate_values"] for row in after] != [{}, {}]
    # a trial's folder named within the study, not where the study lay: the same file, byte for byte
    assert [row["run_dir"] for row in after] == ["trials/es/trial_0000", "trials/es/trial_0001"]
    assert (again / TRIALS).read_bytes() == (compact / TRIALS).read_bytes()
    best = tune.best_trial(_load(path), "es")  # by hand: the winner's number, value and setting, exactly
    spec = _load(path, restored)
    restored_best = tune.best_trial(spec, "es")
    assert (restored_best.number, restored_best.value, restored_best.params) == (best.number, best.value, best.params)
    assert restored_best.user_attrs["run_dir"] == str(restored / "trials" / "es" / f"trial_{best.number:04d}")

    kept = _metrics(restored)
    assert tune.outstanding(spec) == []
    quiet = lambda line: None  # noqa: E731
    assert tune.tune(spec, tiny_vllm, log=quiet) == {"es": 0}
    tune.run_finals(spec, tiny_vllm, log=quiet)
    tune.run_extras(spec, tiny_vllm, log=quiet)
    assert _metrics(restored) == kept  # no run started, none written again
    again_summary = tune.summarize(spec)
    entry, was = again_summary["methods"]["es"], summary["methods"]["es"]
    assert {k: entry[k] for k in ("trials", "complete", "pruned", "failed", "winner")} == {
        k: was[k] for k in ("trials", "complete", "pruned", "failed", "winner")}
    for stage in ("final", "long", "control"):  # the held-out rewards were kept to 6 significant digits
        rows = again_summary[stage] if stage == "final" else again_summary[stage]["final"]
        want = summary[stage] if stage == "final" else summary[stage]["final"]
        assert [row["seeds"] for row in rows] == [row["seeds"] for row in want] == [2]
        for column in ("mean", "ci_low", "ci_high", "t_low", "t_high"):
            assert [row[column] for row in rows] == pytest.approx([row[column] for row in want], rel=1e-5, nan_ok=True)


def test_a_trial_under_way_when_compacted_runs_again_with_its_setting_to_the_same_rows(study, tmp_path, tiny_vllm, capsys):
    path, original, compact, _ = study
    cut = tmp_path / "cut"
    shutil.copytree(compact, cut)
    rows = _read_gzip_lines(compact / TRIALS)
    rows[1].update(state="running", value=None, seconds=None, run_dir=None)  # killed mid-trial with the lease
    _write_gzip_lines(cut / TRIALS, rows)
    restored = tmp_path / "restored"
    restored.mkdir()  # an empty folder is taken
    spec = _load(path, restored)
    record = restore_study(cut, spec, log=print)
    assert "trials under way when compacted, restored as failed and queued again" in capsys.readouterr().out
    assert record["under_way_trials"] == {"es": [1]}
    assert record["left_out"] == {"trials/es/trial_0001/seed100": "its trial was under way when compacted"}
    assert not (restored / "trials" / "es" / "trial_0001").exists()
    first = (restored / "trials" / "es" / "trial_0000" / "seed100" / "metrics.jsonl").read_bytes()
    failed, queued = tune.load_study(spec, "es").get_trials()[1:]
    assert failed.state.name == "FAIL" and failed.user_attrs[UNDER_WAY] and "error" not in failed.user_attrs
    assert queued.state.name == "WAITING" and queued.params == rows[1]["params"] and UNDER_WAY not in queued.user_attrs
    assert queued.system_attrs["failed_trial"] == 1

    assert tune.tune(spec, tiny_vllm, log=lambda line: None) == {"es": 1}  # exactly the trial under way, again
    trials = tune.study_trials(spec, "es")
    assert [(t["number"], t["state"], t["retries"]) for t in trials] == [(0, "complete", None), (1, "fail", None),
                                                                         (2, "complete", 1)]
    assert trials[0]["value"] == rows[0]["value"] and trials[0]["params"] == rows[0]["params"]  # kept, not run again
    assert (restored / "trials" / "es" / "trial_0000" / "seed100" / "metrics.jsonl").read_bytes() == first
    # the retry ran in the first attempt's folder, from the start, to the rows the uninterrupted study wrote
    untimed = lambda folder: [{k: v for k, v in row.items() if not k.startswith("time/")}  # noqa: E731
                              for row in read_metrics(folder)]
    folder = Path("trials") / "es" / "trial_0001" / "seed100"
    assert untimed(restored / folder) == untimed(original / folder)
    assert trials[2]["value"] == _read_gzip_lines(compact / TRIALS)[1]["value"]
    assert not (restored / "trials" / "es" / "trial_0002").exists()


def test_a_folder_in_the_way_or_a_compact_the_spec_does_not_fit_is_refused_before_any_file(study, tmp_path, capsys):
    path, _, compact, _ = study
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine\n")
    with pytest.raises(FileExistsError, match="not empty"):
        restore_study(compact, _load(path, busy))
    assert [p.name for p in busy.iterdir()] == ["notes.txt"] and (busy / "notes.txt").read_text() == "mine\n"
    assert not (tmp_path / ".busy.restoring").exists()

    rows = _read_gzip_lines(compact / TRIALS)
    for change, message in ((lambda row: row.update(method="es_full"), "'es_full', which the spec .* does not tune"),
                            (lambda row: row["params"].update(momentum=0.5), "'momentum', which the spec does not search"),
                            (lambda row: row["params"].update(sigma=0.5), "0.5 of parameter 'sigma' isn't contained")):
        bad = tmp_path / "bad"
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(compact, bad)
        changed = json.loads(json.dumps(rows))
        change(changed[0])
        _write_gzip_lines(bad / TRIALS, changed)
        out = tmp_path / "never"
        with pytest.raises(ValueError, match=message):
            restore_study(bad, _load(path, out))
        assert not out.exists() and not (tmp_path / ".never.restoring").exists()
    assert restore_main([str(tmp_path / "busy"), str(path), "--out", str(tmp_path / "never"), "--methods", "es"]) == 1  # no runs.jsonl.gz
    assert "no runs.jsonl.gz" in capsys.readouterr().err and not (tmp_path / "never").exists()


def test_full_es_under_way_goes_on_from_its_compacted_checkpoint_to_the_rows_of_an_unbroken_run(study, tmp_path, tiny_vllm,
                                                                                                 capsys):
    """ES on the model's own weights keeps no tensors in its checkpoints (its mean is the seed log
    replayed), so a compacted line carries what such a run under way goes on from; a LoRA run's
    checkpoint holds the adapter, so that run begins again."""
    import optuna

    from evolm_lib.config import ESConfig
    from evolm_lib.tune.compact import scalar_row

    path = study[0]
    common = dict(model="tiny-random", task="conciseness", population_size=4, sigma=0.1, learning_rate=0.05,
                  lora_rank=1, target_modules=["q_proj", "v_proj"], max_new_tokens=6, max_model_len=256,
                  kv_cache_gb=0.0625, eval_every=1, num_generations=3, checkpoint_every=1, optimizer="adam")
    full, lora = ESConfig(**common, es_mode="full"), ESConfig(**common)
    from evolm_lib.train.es import ESRun

    whole = ESRun.open(full, tmp_path / "whole", evaluator=tiny_vllm)
    whole.run()
    whole.close()
    out = tmp_path / "study"
    out.mkdir()
    optuna.create_study(storage=f"sqlite:///{out / 'optuna.db'}", study_name="es")  # a study with no trial yet
    for config, method in ((full, "es_full"), (lora, "es_lora")):
        cut = ESRun.open(config, out / "final" / method / "seed0", evaluator=tiny_vllm)
        cut.run(2)  # the machine goes back after generation 2, and its pack with the checkout
        cut.close()

    compacted = tmp_path / "compact"
    manifest = compact_study(out, compacted)
    lines = {line["path"]: line for line in _read_gzip_lines(compacted / RUNS)}
    carried = lines["final/es_full/seed0"]["resume"]
    assert carried["checkpoint"] == "000002" and set(carried["files"]) == {"state.json", "manifest.json"}
    assert carried["text"]["seed_log.jsonl"] == (out / "final" / "es_full" / "seed0" / "seed_log.jsonl").read_text()
    assert lines["final/es_lora/seed0"]["resume"] is None and manifest["resumable"] == 1

    restored = tmp_path / "restored"
    record = restore_study(compacted, _load(path, restored), log=print)
    assert record["resumed"] == {"final/es_full/seed0": 2}
    assert record["left_out"] == {"final/es_lora/seed0": "no held-out scores: under way when compacted"}
    assert "1 runs under way go on from their checkpoints: final/es_full/seed0 at 2" in capsys.readouterr().out
    folder = restored / "final" / "es_full" / "seed0"
    run = ESRun.open(full, folder, evaluator=tiny_vllm)
    assert run.generation == 2  # from the carried checkpoint, the weights replayed from the seed log
    run.run()
    run.close()
    # the rows before the checkpoint were kept to 6 significant digits; compacted, every row is the unbroken run's
    untimed = lambda folder: [scalar_row({k: v for k, v in row.items() if not k.startswith("time/")})  # noqa: E731
                              for row in read_metrics(folder)]
    assert untimed(folder) == untimed(tmp_path / "whole")
    assert (folder / "seed_log.jsonl").read_text() == (tmp_path / "whole" / "seed_log.jsonl").read_text()
