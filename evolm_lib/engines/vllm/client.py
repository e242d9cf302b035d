"""The host's one door into vLLM's worker extension: ``WorkerClient``, one method per call.

Every call the host makes into ``worker.WorkerExtension`` (resident LoRA slots, resident weights)
goes through here. The RPC name is taken from the extension's own method (``method.__name__``), so
a reader or a tool follows each call from here to the code that runs inside the engine; no other
module names a worker method as a string.

A tensor-parallel engine has one worker per rank, and ``collective_rpc`` answers once per rank: the
slot calls put the answers together here (timings: the slowest rank; checks: every rank agrees;
slot contents: gathered from the ranks' shards), so callers see one engine.
"""
from __future__ import annotations

import hashlib
import math
from typing import Any, Callable, Mapping, Sequence

from ... import es
from ..weights.resident import gather_snapshots
from .rpc import SlotsUnsupported, WorkerUnsupported, combine_digests, gather_shards, unpack_tensor
from .worker import WorkerExtension as Worker


class WorkerClient:
    """Typed calls into the engine's workers (``LLM.collective_rpc``: one per tensor-parallel rank),
    with the engine in this process or in one of its own alike."""

    def __init__(self, llm):
        self.llm = llm

    def _call_ranks(self, method: Callable, *args) -> list:
        """One extension method's result from every worker (tensor-parallel rank), in rank order."""
        results = list(self.llm.collective_rpc(method.__name__, args=args))
        if not results:
            raise WorkerUnsupported("no worker answered")
        return results

    @staticmethod
    def _slowest(results: Sequence[dict]) -> dict:
        """The ranks' timings as one: each key's largest value (the call ends with its slowest rank)."""
        return {key: max(result[key] for result in results) for key in results[0]}

    # -- resident LoRA slots (worker_slots.LoRASlotsExtension)

    def slots_describe(self) -> dict:
        """vLLM version, device, slot dtype, LoRA limits and modules (``ok`` False with a ``reason`` where
        slots cannot live); under tensor parallelism rank 0's modules (its shards' shapes), after checking
        every rank can host slots and agrees on the slots; ``tp_size``: the ranks that answered."""
        answers = self._call_ranks(Worker.evolm_slots_describe)
        for rank, answer in enumerate(answers):
            if not answer.get("ok"):
                return answer if len(answers) == 1 else {"ok": False, "reason": f"rank {rank}: {answer.get('reason')}"}
        # the ids loaded and pinned (each rank's manager places them in slots of its own choosing)
        shared = {"vllm_version": str, "device": str, "slot_dtype": str, "max_loras": int, "max_lora_rank": int,
                  "lora_index_to_id": lambda ids: sorted(i for i in ids if i is not None), "pinned": sorted}
        for rank, answer in enumerate(answers[1:], start=1):
            differing = [field for field, key in shared.items() if key(answer[field]) != key(answers[0][field])]
            if differing:
                return {"ok": False, "reason": f"rank {rank} differs from rank 0 in {differing}"}
        return {**answers[0], "tp_size": len(answers)}

    def slots_setup(self, key: int, ids: Sequence[int], shapes: Mapping[str, Sequence[int]], alpha: float, rank: int,
                    file_dtype: str, fingerprint_seed: int) -> list[dict]:
        """Take over the loaded slots ``ids`` under ``key``; returns each rank's layout (entries,
        modules, scaling, and the part of each tensor it holds)."""
        # each rank's LoRA manager places the ids in slots of its own choosing: a request names the id
        layouts = self._call_ranks(Worker.evolm_slots_setup, key, list(ids), {k: list(v) for k, v in shapes.items()},
                                   float(alpha), int(rank), file_dtype, fingerprint_seed)
        refused = [(rank, layout["unsupported"]) for rank, layout in enumerate(layouts) if "unsupported" in layout]
        if refused:
            self.slots_release(key)  # the ranks that took them over give them back
            if len(layouts) == 1:
                raise SlotsUnsupported(refused[0][1])
            raise SlotsUnsupported("; ".join(f"rank {rank}: {reason}" for rank, reason in refused))
        return layouts

    def slots_write(self, key: int, mean: Any, rows: Sequence[Sequence[int]], sigmas: Any, noise_device: str,
                    noise_scheme: str) -> dict:
        """Slot i <- mean + sign_i * sigma * noise(seed_i) for each (seed, sign) row, on every rank;
        {"write_s"}: the slowest rank's."""
        return self._slowest(self._call_ranks(Worker.evolm_slots_write, key, mean, [list(r) for r in rows], sigmas,
                                              noise_device, noise_scheme))

    def slots_checksums(self, key: int) -> list[str]:
        """Digest of every slot's bytes (over every rank's shard: ``rpc.combine_digests``)."""
        per_rank = self._call_ranks(Worker.evolm_slots_checksums, key)
        return [combine_digests(digests) for digests in zip(*per_rank)]

    def slots_read(self, key: int, index: int, packed: bool, tensors: Mapping[str, tuple[Sequence[int], bool]]) -> dict:
        """Slot ``index``'s full tensors by PEFT name (``tensors``: name -> (full shape, is lora_A)),
        gathered from every rank's shard (``rpc.gather_shards``); ``packed``: the tensors cross as
        plain data (an engine in another process)."""
        answers = self._call_ranks(Worker.evolm_slots_read, key, index, packed)
        gathered = {}
        for name, (shape, is_a) in tensors.items():
            pieces = [(unpack_tensor(answer["tensors"][name]), answer["shards"][name]) for answer in answers]
            gathered[name] = gather_shards(name, tuple(shape), bool(is_a), pieces)
        return gathered

    def slots_release(self, key: int) -> None:
        """Unpin and unload the slots of ``key`` on every rank."""
        self._call_ranks(Worker.evolm_slots_release, key)

    # -- resident weights (weights.vllm_worker.WeightsExtension): every card of the engine holds its
    # slices of the weights (one card without tensor parallelism); the answers are combined here

    def weights_setup(self, key: int, shapes: Mapping[str, Sequence[int]], noise: str, noise_rank: int,
                      noise_scheme: str) -> dict:
        """A float32 master of the targeted weights under ``key``; returns what the workers found
        (``values``: summed over the cards, ``cards``: how many hold slices)."""
        results = self._call_ranks(Worker.evolm_weights_setup, key, {n: list(s) for n, s in shapes.items()}, noise,
                             noise_rank, noise_scheme)
        return {**results[0], "values": sum(r["values"] for r in results), "cards": len(results)}

    def weights_write(self, key: int, seed: int, sign: int, sigma: float) -> dict:
        """Serve one member written in place; {"write_s"}."""
        return self._slowest(self._call_ranks(Worker.evolm_weights_write, key, seed, sign, float(sigma)))

    def weights_restore(self, key: int) -> dict:
        """Serve the mean again; {"restore_s"}."""
        return self._slowest(self._call_ranks(Worker.evolm_weights_restore, key))

    def weights_step(self, key: int, optimizer: dict, members: Sequence[tuple[int, int]], weights: Sequence[float],
                     sigma: float, form: str) -> dict:
        """The optimizer's step where the weights live; {"update_s", "update_norm"}. Over several
        cards the norm is that of every weight's slices, each slice counted once (a slice that
        several cards hold, e.g. a KV head or a norm, is the same on each)."""
        results = self._call_ranks(Worker.evolm_weights_step, key, optimizer, [tuple(m) for m in members],
                             [float(w) for w in weights], float(sigma), form)
        out = {"update_s": max(r["update_s"] for r in results), "update_norm": results[0]["update_norm"]}
        if len(results) > 1:
            held = {(name, tuple(map(tuple, bounds))): value for r in results for name, bounds, value in r["slice_norms"]}
            out["update_norm"] = math.sqrt(sum(value * value for value in held.values()))
        return out

    def weights_write_slots(self, key: int, slots_key: int, members: Sequence[tuple[int, int]], sigma: float) -> dict:
        """EGGROLL: the members' low-rank noise into the resident slots of ``slots_key``; {"write_s"}."""
        return self._slowest(self._call_ranks(Worker.evolm_weights_write_slots, key, slots_key, [tuple(m) for m in members],
                                        float(sigma)))

    def weights_checksum(self, key: int, shapes: Mapping[str, Sequence[int]]) -> dict:
        """{"master": SHA-256 of the float32 master of the whole weights ``shapes`` (the same digest
        whatever the cards), "restored": every card serves it exactly, "step"}."""
        results = self._call_ranks(Worker.evolm_weights_checksum, key)
        out = {**results[0], "restored": all(r["restored"] for r in results)}
        if len(results) > 1:
            master = self.weights_read(key, shapes)["master"]
            out["master"] = hashlib.sha256(master.numpy().tobytes()).hexdigest()
        return out

    def weights_read(self, key: int, shapes: Mapping[str, Sequence[int]]) -> dict:
        """The master and optimizer buffers of the whole weights ``shapes`` (a full-size snapshot,
        put together from the cards' slices)."""
        results = self._call_ranks(Worker.evolm_weights_read, key)
        if len(results) == 1:
            return {name: value for name, value in results[0].items() if name != "slices"}
        return gather_snapshots(shapes, results)

    def weights_served(self, key: int, shapes: Mapping[str, Sequence[int]]) -> dict:
        """Name -> the whole weight the engine serves now (float32), put together from the cards' slices."""
        flat = gather_snapshots(shapes, self._call_ranks(Worker.evolm_weights_served, key))["master"]
        return es.Layout.of({n: tuple(s) for n, s in shapes.items()}).split(flat)

    def weights_load(self, key: int, snapshot: Mapping[str, Any]) -> dict:
        """Serve the mean of a snapshot made by ``weights_read`` (each card takes its slices); {"restored"}."""
        results = self._call_ranks(Worker.evolm_weights_load, key, dict(snapshot))
        return {"restored": all(r["restored"] for r in results)}

    def weights_release(self, key: int) -> None:
        """Serve the mean and release the workers' masters."""
        self._call_ranks(Worker.evolm_weights_release, key)
