"""The base model on a study's held-out problems, the reference beside its tuned methods:

    python -m evolm_lib.tune.base_answers SPEC [--model MODEL] [--out FILE]

The spec's task, model and ``max_new_tokens`` (its first method's, which every method shares); the
base model, without adapter, answers each held-out problem greedily. Prints the mean reward and
success, and the shares of empty answers and of answers that hold their target
(``analysis.ANSWER_FLAGS``, where it can judge every answer); ``--out`` writes the lines as a run's
heldout.jsonl, never over an earlier file. Written as the study's ``BASE_HELDOUT``, an export
(``evolm tune export``) keeps their summary: the tables' and the answers figure's reference.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from ..analysis import heldout_summary
from ..scoring import evaluate_adapter
from ..sweep import evaluation_lines, make_shared_engine
from ..tasks import get_task
from .final import BASE_HELDOUT
from .spec import TuneSpec, load_tune_spec


def _first_run(spec: TuneSpec):
    return next(iter(spec.tuning_runs.values()))[0]


def base_answers(spec: TuneSpec, engine) -> dict[str, Any]:
    """{"lines": heldout.jsonl's lines of the base model (generation 0), "summary": their
    ``analysis.heldout_summary``}."""
    config = _first_run(spec).config
    task = get_task(config.task, **config.task_options)
    examples = task.eval_examples()
    result = evaluate_adapter(engine, task, None, examples, max_new_tokens=config.max_new_tokens)
    lines = evaluation_lines(examples, result, 0)
    return {"lines": lines, "summary": heldout_summary(lines)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evolm_lib.tune.base_answers", description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", help="a tune spec (papermill_runs/tune_study_*_gpu.yaml)")
    parser.add_argument("--model", help="another model than the spec's (tiny-random for a quick check)")
    parser.add_argument("--out", type=Path,
                        help=f"write the lines here, as a run's heldout.jsonl (a study's: STUDY/{BASE_HELDOUT})")
    args = parser.parse_args(argv)
    if args.out and args.out.exists():
        print(f"error: --out {args.out} exists: move it aside to score the base model again", file=sys.stderr)
        return 2
    try:
        spec = load_tune_spec(args.spec, overrides={"model": args.model} if args.model else None)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    engine = make_shared_engine([_first_run(spec)])
    try:
        found = base_answers(spec, engine)
    finally:
        engine.close()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps(line) + "\n" for line in found["lines"]))
    print(json.dumps(found["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
