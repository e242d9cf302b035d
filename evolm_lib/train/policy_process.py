"""The GRPO policy in a process of its own (``policy_process: own``), behind the methods the run uses.

Why: with ``deterministic: true`` a GPU engine starts vLLM's batch-invariant mode, which changes the
whole process it runs in (cuBLAS workspaces limited through the environment, BLAS library and kernel
overrides): a policy sharing that process updated 1.2-2.3 times slower. ``PolicyProcess`` starts the
:class:`~evolm_lib.train.policy.PolicyTrainer` in a child whose environment carries none of that
mode's settings (``BATCH_INVARIANT_SETTINGS``): a fresh interpreter, started with ``subprocess`` (not
multiprocessing's spawn, which would import the caller's main script again), with this one's
``sys.path``, talking over a socket pair; torch runs there with a training determinism of
its own (``deterministic_update``).

What crosses the pipe: commands and small tensors (a step's token ids and rewards, AdamW's state for
a checkpoint), pickled on both ends. The trained tensors cross once, the model's weights with
``policy_weights: full`` or the LoRA tensors: the child shares them (CUDA IPC on a GPU, shared memory
on a CPU) and updates them in place; the parent reads them after each reply, which the child sends
only once its device has finished (``torch.cuda.synchronize``), so a step's adapter is read where it
lies rather than pickled through the socket. The child dying surfaces as ``PolicyProcessDied`` at
the next call, never as a hang.
"""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import traceback
import weakref
from pathlib import Path
from typing import Any

import torch

from ..config import GRPOConfig
from ..engines.base import PromptEncoder
from ..env import child_environment
from ..lora import AdapterWeights
from .policy import adapter_copy

BATCH_INVARIANT_SETTINGS = (
    "VLLM_BATCH_INVARIANT", "CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "VLLM_ALLREDUCE_USE_SYMM_MEM",
    "VLLM_CUSTOM_ALLREDUCE_ALGO", "VLLM_USE_AOT_COMPILE", "NCCL_LAUNCH_MODE", "NCCL_COLLNET_ENABLE", "NCCL_NVLS_ENABLE",
    "NCCL_P2P_NET_DISABLE", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_PROTO", "NCCL_ALGO", "NCCL_NTHREADS",
    "NCCL_SOCKET_NTHREADS",
)
"""Environment variables vLLM's batch-invariant mode sets for its process (``override_envs_for_invariance``
and ``enable_batch_invariant_mode`` in vLLM 0.26-0.32's ``batch_invariant.py``); the policy's process
starts without them. Its torch flags and aten overrides are per process: a fresh interpreter has none."""
DETERMINISTIC_CUBLAS_WORKSPACE = ":4096:8"
"""What ``torch.use_deterministic_algorithms`` needs of cuBLAS on CUDA >= 10.2 (torch's reproducibility
notes); a full-size workspace, unlike the batch-invariant mode's ``:16:8``."""
SAME_DEFAULT_WORKSPACE = ((9, 0),)
"""Compute capabilities where torch's default cuBLAS workspace is the size ``:4096:8`` asks for, 32 MiB
(Hopper: torch 2.11's rule; later versions add 10.x and 12.x), so the setting can go once cuBLAS has
started (``_start_cublas``)."""
CALLS = ("train", "set_weights", "optimizer_tensors", "load_optimizer_tensors", "save_model")
"""The trainer's methods the parent may call in the child."""
STOP_SECONDS = 30.0
"""How long ``close`` waits for the child to end by itself before it is terminated."""


class PolicyProcessDied(RuntimeError):
    """The policy's process ended while the run still needed it."""


def policy_in_own_process(config: GRPOConfig) -> bool:
    """Whether a run of ``config`` updates its policy in a process of its own: ``own``; ``auto`` when
    ``deterministic`` puts a local GPU vLLM engine, in this process, in batch-invariant mode."""
    if config.policy_process != "auto":
        return config.policy_process == "own"
    return (config.deterministic and config.engine == "vllm" and config.engine_host == "local"
            and torch.cuda.is_available())


def make_policy(model_dir: Path, adapter: AdapterWeights | None, config: GRPOConfig):
    """The run's policy: a ``PolicyTrainer`` here, or a ``PolicyProcess`` (see ``policy_in_own_process``)."""
    from .policy import PolicyTrainer

    if policy_in_own_process(config):
        return PolicyProcess(model_dir, adapter, config)
    return PolicyTrainer(model_dir, adapter, config)


def deterministic_update(config: GRPOConfig) -> bool:
    """Whether the policy's own process runs torch with deterministic algorithms (``deterministic_update``,
    None: as ``deterministic``)."""
    return config.deterministic if config.deterministic_update is None else config.deterministic_update


# ---------------------------------------------------------------------------- the child


def _training_settings(deterministic_update: bool, threads: int) -> dict[str, Any]:
    """Set the child's torch up before any CUDA work; returns what it set (the benchmark reports it)."""
    torch.set_num_threads(threads)  # the parent's count: a CPU update is then the same sums in the same order
    if deterministic_update:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = DETERMINISTIC_CUBLAS_WORKSPACE  # read when cuBLAS starts
        # strict, not warn_only: attention's backward then takes its deterministic path instead of warning
        torch.use_deterministic_algorithms(True)
        # the mode would also fill every new tensor with NaN (a kernel per allocation, in an update bound
        # by launches); the policy's ops write before they read, so that fill changes no result
        torch.utils.deterministic.fill_uninitialized_memory = False
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    return {"deterministic_algorithms": torch.are_deterministic_algorithms_enabled(), "threads": torch.get_num_threads(),
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            "batch_invariant": os.environ.get("VLLM_BATCH_INVARIANT")}


def _start_cublas(device: torch.device) -> dict[str, Any]:
    """Start cuBLAS on ``device`` under the deterministic setting, then drop the setting where torch's
    default workspace has the same size; returns what changed (nothing on a CPU or another card).

    torch 2.11 reads ``CUBLAS_WORKSPACE_CONFIG`` again, and parses it with a ``std::regex``, on every
    cuBLAS call (``at::cuda::getChosenWorkspaceSize`` is not cached there): some 30 microseconds of
    host time a matmul, in an update bound by the host, against nothing when it is unset. What the
    setting is for is read once: torch's check that deterministic algorithms may call cuBLAS (cached
    at the first call), and each (handle, stream)'s workspace, made at its first call. So one matmul
    and its backward start cuBLAS on this thread and on autograd's, and then the setting goes where
    the default workspace is the same 32 MiB: every later call finds the same workspace and passes
    cuBLAS the same size, so it picks the same algorithms and the update gives the same numbers. A
    torch that checked the setting on every call would refuse the next matmul: the setting is then
    put back, as it was. ``scripts/torch_cublas_workspace.py`` reads which rule a torch build has
    (2.13 keeps the parsed size)."""
    if ("CUBLAS_WORKSPACE_CONFIG" not in os.environ or device.type != "cuda"
            or torch.cuda.get_device_capability(device) not in SAME_DEFAULT_WORKSPACE):
        return {}

    def matmul_and_backward() -> None:  # the forward on this thread, the backward on autograd's device thread
        start = torch.ones(8, 8, device=device, requires_grad=True)
        (start @ start).sum().backward()
        torch.cuda.synchronize(device)

    matmul_and_backward()
    setting = os.environ.pop("CUBLAS_WORKSPACE_CONFIG")
    try:
        matmul_and_backward()  # a torch that checked the setting on every call would refuse here
    except RuntimeError:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = setting
        return {"cublas_workspace_config_kept": "torch checks it on every cuBLAS call"}
    return {"cublas_workspace_config": None, "cublas_workspace_config_at_start": setting}


def _views_of_trained(tensors: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``tensors`` where each is a trained parameter's own memory (what the parent reads after each
    step must be what the optimizer moved); a copy among them fails here, before any step, rather than
    leaving the parent a stale adapter."""
    trained = {param.data_ptr() for param in model.parameters() if param.requires_grad}
    copies = sorted(name for name, tensor in tensors.items() if tensor.data_ptr() not in trained)
    if copies:
        raise RuntimeError(f"the LoRA tensors {copies[:3]} are not the trained parameters' own memory, so "
                           "the run could not read the policy's steps from them")
    return tensors


def _send(connection, message: Any) -> None:
    connection.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _error_message(error: BaseException) -> tuple:
    """("error", the exception pickled, or a RuntimeError saying what it was, and the child's traceback)."""
    text = "".join(traceback.format_exception(error))
    try:
        pickle.loads(pickle.dumps(error))
        return ("error", error, text)
    except Exception:  # an exception that does not pickle: its type and message
        return ("error", RuntimeError(f"{type(error).__name__}: {error}"), text)


def _to_host(value: Any) -> Any:
    """Tensors of a reply on the host (the parent may hold no CUDA context of its own for them)."""
    if torch.is_tensor(value):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_host(v) for v in value)
    return value


def serve(fd: int) -> None:
    """The child's entry (``python -c``): the policy's loop on the socket ``fd`` from the parent."""
    from multiprocessing import current_process
    from multiprocessing.connection import Connection

    connection = Connection(fd)
    model_dir, adapter, config, device, threads, authkey = pickle.loads(connection.recv_bytes())
    current_process().authkey = authkey  # the parent fetches shared-memory descriptors with its own key
    _serve(connection, model_dir, adapter, config, device, threads)


def _serve(connection, model_dir: str, adapter: bytes, config: dict, device: str | None, threads: int) -> None:
    """Build the trainer, share its trained weights, then answer calls until told to stop or the
    parent's end of the socket closes (the parent ended)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  registers torch's tensor reductions with ForkingPickler

    from .policy import PolicyTrainer

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the run in the parent, which then closes us
    try:
        config = GRPOConfig.from_dict(config)
        settings = _training_settings(deterministic_update(config), threads)
        trainer = PolicyTrainer(Path(model_dir), pickle.loads(adapter), config, device)
        if deterministic_update(config):
            settings.update(_start_cublas(trainer.device))
        shared = trainer.weights() if trainer.full else _views_of_trained(trainer.adapter_tensors(), trainer.model)
        if trainer.device.type == "cpu":  # in place: the optimizer keeps the same parameters
            for tensor in shared.values():
                tensor.share_memory_()
    except BaseException as error:
        _send(connection, (0, *_error_message(error)))
        return
    _send(connection, (0, "ok", {"full": trainer.full, "spec": trainer.spec, "vocab_size": trainer.vocab_size,
                              "pad_token_id": trainer.pad_token_id, "device": str(trainer.device),
                              "settings": {**settings, "attention": trainer.attention}}))
    # torch's reductions: CUDA IPC handles or shared-memory file descriptors, once
    connection.send_bytes(bytes(ForkingPickler.dumps(shared)))
    while True:
        try:
            number, name, args = pickle.loads(connection.recv_bytes())
        except (EOFError, OSError):
            break
        if name == "close":
            break
        try:
            if name not in CALLS:
                raise ValueError(f"the policy process answers {', '.join(CALLS)}, not {name!r}")
            result = _to_host(getattr(trainer, name)(*args))
            if trainer.device.type == "cuda":
                torch.cuda.synchronize(trainer.device)  # the parent reads the shared weights after this reply
            reply = ("ok", result)
        except BaseException as error:
            reply = _error_message(error)
        try:
            _send(connection, (number, *reply))
        except (BrokenPipeError, OSError):
            break
    shared = None
    connection.close()


# ---------------------------------------------------------------------------- the parent's proxy


class PolicyProcess:
    """A ``PolicyTrainer`` in a child process, with the methods and attributes ``GRPORun`` uses:
    ``train``, ``adapter``, ``weights``, ``flat_weights``, ``set_weights``, ``optimizer_tensors``,
    ``load_optimizer_tensors``, ``save_model``, ``encode``, ``close``; ``full``, ``spec``,
    ``vocab_size``, ``pad_token_id``, ``device``."""

    def __init__(self, model_dir: Path, adapter: AdapterWeights | None, config: GRPOConfig, device: str | None = None):
        import socket
        from multiprocessing import current_process
        from multiprocessing.connection import Connection

        from transformers import AutoTokenizer

        ours, theirs = socket.socketpair()
        code = (f"import sys; sys.path[:0] = {sys.path!r}; "
                f"from evolm_lib.train.policy_process import serve; serve({theirs.fileno()})")
        environment = {k: v for k, v in child_environment().items() if k not in BATCH_INVARIANT_SETTINGS}
        self._process = subprocess.Popen([sys.executable, "-c", code], env=environment, pass_fds=(theirs.fileno(),))
        theirs.close()  # the child's end lives in the child only: its death closes the socket
        self._connection = Connection(ours.detach())
        self._finalizer = weakref.finalize(self, _stop, self._process, self._connection)
        self.pid = self._process.pid
        self._shared: dict[str, torch.Tensor] | None = None
        self._calls = 0  # each call's number: a reply to an interrupted call is skipped, never taken for the next's
        try:
            # the adapter as bytes: torch's reductions would move its tensors into shared memory
            _send(self._connection, (str(model_dir), pickle.dumps(adapter), config.to_dict(), device,
                                     torch.get_num_threads(), bytes(current_process().authkey)))
            info = self._reply("start")
            self.full, self.spec, self.vocab_size = info["full"], info["spec"], info["vocab_size"]
            self.pad_token_id, self.device, self.settings = info["pad_token_id"], torch.device(info["device"]), info["settings"]
            self.attention = self.settings["attention"]
            self._shared = pickle.loads(self._receive("start"))  # the trained tensors, shared
        except BaseException:
            self.close()
            raise
        self.config = config
        self._encoder = PromptEncoder(AutoTokenizer.from_pretrained(model_dir))  # the child's tokenizer, here

    # --- the pipe -------------------------------------------------------------------------------
    def _receive(self, what: str) -> bytes:
        """The child's next message, or ``PolicyProcessDied`` once it has ended without one."""
        try:
            return self._connection.recv_bytes()
        except (EOFError, OSError):  # the child's end closed: it ended, or is ending
            pass
        try:
            self._process.wait(timeout=STOP_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        raise self._died(what)

    def _reply(self, what: str) -> Any:
        while True:
            number, status, *payload = pickle.loads(self._receive(what))
            if number == self._calls:
                break
        if status == "error":
            error, text = payload
            error.add_note(f"(raised in the policy process, pid {self.pid}:)\n{text}")
            raise error
        return payload[0]

    def _alive(self, what: str) -> None:
        """``PolicyProcessDied`` where the child has ended: its shared tensors hold no answer then."""
        if self._process.poll() is not None:
            raise self._died(what)

    def _call(self, name: str, *args) -> Any:
        self._alive(name)
        try:
            self._calls += 1
            _send(self._connection, (self._calls, name, args))
        except (BrokenPipeError, OSError):
            raise self._died(name) from None
        return self._reply(name)

    def _died(self, what: str) -> PolicyProcessDied:
        code = self._process.poll()
        how = (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exited with code {code}" if code is not None else "stopped answering")
        return PolicyProcessDied(
            f"the policy process (pid {self.pid}, GRPO's policy update in a process of its own: policy_process) "
            f"{how} during {what}; the run's state is its latest checkpoint: open the run again to resume it")

    # --- the trainer's methods --------------------------------------------------------------------
    def train(self, batch: dict, raw_rewards: torch.Tensor, advantages: torch.Tensor) -> dict:
        """``PolicyTrainer.train`` in the child; the first pass's log-probs come back on the host."""
        return self._call("train", batch, raw_rewards, advantages)

    def adapter(self) -> AdapterWeights:
        """The current LoRA tensors (host copies), as ``PolicyTrainer.adapter``: read from the tensors
        the child shares, no call."""
        self._alive("adapter")
        return adapter_copy(self.spec, self._shared)

    def weights(self) -> dict[str, torch.Tensor]:
        """policy_weights full: the child's trained weights, shared (live, not copies; read them between
        calls, and not after ``close``: on a GPU they are the child's memory)."""
        self._alive("weights")
        return dict(self._shared)

    def flat_weights(self) -> torch.Tensor:
        """policy_weights full: the trained weights as one float32 vector in sorted-name order, on the
        child's device (a copy made here, from the shared tensors)."""
        self._alive("flat_weights")
        return torch.cat([tensor.reshape(-1) for tensor in self._shared.values()])

    def set_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """policy_weights full: set the trained weights (a checkpoint's)."""
        self._call("set_weights", {k: v.detach().cpu() for k, v in tensors.items()})

    def optimizer_tensors(self) -> dict[str, torch.Tensor]:
        """AdamW state as named host tensors."""
        return self._call("optimizer_tensors")

    def load_optimizer_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore AdamW state saved by :meth:`optimizer_tensors`."""
        self._call("load_optimizer_tensors", tensors)

    def save_model(self, out: Path, dtype: str) -> Path:
        """policy_weights full: the child writes the policy as a model folder."""
        return Path(self._call("save_model", str(out), dtype))

    def encode(self, prompt) -> list[int]:
        """Prompt token ids, with the model's tokenizer (loaded here: no round trip per prompt)."""
        return self._encoder.encode(prompt)

    def close(self) -> None:
        """Drop the shared weights, then end the child (asked first, terminated after ``STOP_SECONDS``)."""
        self._shared = None  # before the child ends: it owns the memory the views point into
        self._finalizer()


def _stop(process: subprocess.Popen, connection) -> None:
    """End the policy's process: ask, wait, then terminate and kill."""
    if process.poll() is None:
        try:
            _send(connection, (-1, "close", ()))
        except (BrokenPipeError, OSError):
            pass
    connection.close()  # a child still reading gets EOF and ends as well
    for stop in (None, process.terminate, process.kill):
        if stop is not None:
            stop()
        try:
            process.wait(timeout=STOP_SECONDS if stop is None else 5)
            return
        except subprocess.TimeoutExpired:
            continue
