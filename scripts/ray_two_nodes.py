"""Several machines, rehearsed on one: a Ray cluster of two nodes on this host (a head and a worker,
one CPU each, as `ray start --head` and `ray start --address=...` make on two machines), then the
README's multi-machine commands against it:

``evolm batch`` runs the stepper notebook (tiny-random, engine_host ray, 2 engines, ray_address)
against that cluster, headless through papermill, to a finished run, whose two engines ran one on
each node (the run's placement.jsonl says where each engine ran).

    python scripts/ray_two_nodes.py --out /tmp/two_nodes      # about 1.5 minutes on 2 CPU cores
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

SPEC = {
    "notebook": "notebooks/03_es_stepper.py",
    "name": "two_nodes",
    "parameters": {"model": "tiny-random", "task": "conciseness", "population_size": 4, "num_generations": 2,
                   "max_new_tokens": 8, "max_model_len": 256, "kv_cache_gb": 0.1, "seed": 0,
                   "engine_host": "ray", "num_engines": 2},
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        print(f"cluster at {cluster.address}: 2 nodes, 1 CPU each", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        spec = {**SPEC, "parameters": {**SPEC["parameters"], "ray_address": cluster.address}}
        (args.out / "spec.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
        batch = subprocess.run([sys.executable, "-m", "evolm_lib.cli", "batch", str(args.out / "spec.yaml"),
                                "--out", str(args.out / "batch")], cwd=Path(__file__).resolve().parents[1],
                               env=os.environ.copy(), capture_output=True, text=True)
        print(batch.stdout[-2000:], batch.stderr[-2000:] if batch.returncode else "", flush=True)
        summary = json.loads((args.out / "batch" / "summary.json").read_text())
        statuses = [row["status"] for row in (summary if isinstance(summary, list) else summary.get("runs", []))]
        if batch.returncode or statuses != ["ok"]:
            raise SystemExit(f"the batch against the two-node cluster failed: rc {batch.returncode}, {statuses}")
        placement = args.out / "batch" / SPEC["name"] / "run" / "placement.jsonl"
        lines = [json.loads(line) for line in placement.read_text().splitlines()]
        nodes = [info["node"] for info in lines[-1].get("engines", [])]
        print(f"engines on nodes {json.dumps(nodes)}", flush=True)
        if len(nodes) != 2 or len(set(nodes)) != 2:
            raise SystemExit(f"expected the run's two engines on two nodes, got {nodes} ({placement})")
        print("two-node cluster: the batch run finished, its engines on both nodes", flush=True)
    finally:
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
