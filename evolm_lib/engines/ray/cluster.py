"""Joining a Ray cluster: Ray imported only when asked for (an optional dependency), the address
checked before Ray waits on it, and what one engine's actor needs from the cluster's resources."""
from __future__ import annotations

import math
import os
import socket
from typing import Mapping

INSTALL_HINT = "pip install -e '.[ray]'  (or: pip install ray==2.60.0)"


class RayUnavailableError(ImportError):
    """``engine_host: ray`` was asked for where Ray is not installed."""


def import_ray():
    """The ``ray`` module, or RayUnavailableError saying how to install it."""
    try:
        import ray
    except ImportError as error:
        raise RayUnavailableError(f"engine_host: 'ray' needs Ray, which is not installed here: {INSTALL_HINT}") from error
    return ray


def check_cluster_resources(num_engines: int, resources: dict[str, float], cpus_per_engine: float = 1.0,
                            engines_per_gpu: int = 1, tensor_parallel_size: int = 1) -> dict[str, float]:
    """The resources one engine's actor asks for (1/engines_per_gpu of a GPU where the cluster has
    GPUs, else a CPU slice: engines_per_gpu places nothing on a CPU cluster; an engine split over
    ``tensor_parallel_size`` ranks asks for that many cards, or CPU slices, which Ray gives one actor
    on one node); raises ValueError when the cluster cannot hold ``num_engines`` of them."""
    tp = tensor_parallel_size
    gpus = float(resources.get("GPU", 0))
    if gpus > 0:
        if tp > 1 and engines_per_gpu > 1:
            raise ValueError(f"engines_per_gpu: {engines_per_gpu} engines on one card cannot each be split over "
                             f"tensor_parallel_size={tp} cards; use engines_per_gpu 1 with tensor parallelism")
        cards = num_engines * tp if tp > 1 else math.ceil(num_engines / engines_per_gpu)
        if cards > gpus:
            per_card = ("one engine per GPU" if engines_per_gpu == 1 else f"engines_per_gpu={engines_per_gpu}") \
                if tp == 1 else f"tensor_parallel_size={tp} cards each"
            raise ValueError(f"num_engines: {num_engines} engines need {cards} GPUs ({per_card}) but the Ray cluster "
                             f"has {gpus:g}; use num_engines <= {int(gpus) * engines_per_gpu // tp}, a larger "
                             "engines_per_gpu or more machines (ray start --address=...)")
        return {"num_gpus": tp} if tp > 1 else {"num_gpus": 1 / engines_per_gpu}
    cpus = float(resources.get("CPU", 0))
    if num_engines * cpus_per_engine * tp > cpus:
        raise ValueError(f"num_engines: {num_engines} CPU engines need {num_engines * cpus_per_engine * tp:g} CPUs "
                         f"({cpus_per_engine * tp:g} each) but the Ray cluster has {cpus:g} and no GPU")
    return {"num_cpus": cpus_per_engine * tp}


MPS_DEFAULT_PIPE = "/tmp/nvidia-mps"
"""Where CUDA's MPS control daemon and its clients meet unless ``CUDA_MPS_PIPE_DIRECTORY`` says otherwise."""


def shared_card_warning(engines_per_gpu: int, placement: dict[str, float],
                        environ: Mapping[str, str] = os.environ) -> str | None:
    """What to tell a run whose engines share GPUs (``placement`` from :func:`check_cluster_resources`)
    where no CUDA MPS control daemon is found in this machine's pipe directory (its ``control`` pipe),
    or None. Without MPS a card runs one process's kernels at a time, so engines sharing it overlap
    only their host work."""
    if engines_per_gpu <= 1 or "num_gpus" not in placement:
        return None
    pipe = environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_DEFAULT_PIPE
    if os.path.exists(os.path.join(pipe, "control")):
        return None
    return (f"engines_per_gpu: {engines_per_gpu} engines share each GPU, but no CUDA MPS control daemon was found "
            f"at {pipe}: without MPS a card runs one engine's kernels at a time, so sharing it buys little. Start the "
            "daemon and run with its CUDA_MPS_PIPE_DIRECTORY (docs/engines.md shows how and what it gains), or use one "
            "engine per GPU.")


def check_ray_address(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast, before Ray tries for a minute, when nothing listens at ``host:port``."""
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"ray_address: expected host:port, ray://host:port or auto, got {address!r}")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as error:
        raise ConnectionError(
            f"ray_address: no Ray cluster answers at {address} ({error.strerror or error}); start one with "
            "`ray start --head` on that machine (it prints the address), or leave ray_address empty for a local cluster"
        ) from None
