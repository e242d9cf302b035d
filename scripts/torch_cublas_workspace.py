"""Does a torch build read ``CUBLAS_WORKSPACE_CONFIG`` again on every cuBLAS call?

torch's deterministic algorithms need ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (or ``:16:8``). In some
builds ``at::cuda::getChosenWorkspaceSize``, which every cuBLAS call reaches through
``getCurrentCUDABlasHandle``, parses that variable each time with a ``std::regex``; later builds keep
the parsed size in a function-local static. This reads the answer from the build itself, with no GPU:
``getChosenWorkspaceSize`` disassembled (``nm`` and ``objdump``) is either cached (it reads a guard
variable) or parsed on every call (no guard). ``--time-parse`` also times a copy of the parse
(compiled with ``g++ -O2``), with the variable set and unset, on this machine's CPU.

    python scripts/torch_cublas_workspace.py torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl --time-parse
    python scripts/torch_cublas_workspace.py /path/to/torch/lib/libtorch_cuda.so

A wheel is read without installing it (``pip download torch==VERSION --no-deps`` fetches one);
``evolm_lib.train.policy_process._start_cublas`` is what the answer is for.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SYMBOL = "_ZN2at4cuda22getChosenWorkspaceSizeEv"
"""at::cuda::getChosenWorkspaceSize(), mangled."""
PARSE = """
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <regex>
#include <string>
// torch 2.11's at::cuda::parseChosenWorkspaceSize, its CUDA branch without the device query
static size_t parse() {
  const char* value = std::getenv("CUBLAS_WORKSPACE_CONFIG");
  if (!value) return 4096 * 8 * 1024;
  size_t total = 0;
  const std::string config(value);
  std::regex exp(":([0-9]+):([0-9]+)");
  std::sregex_iterator next(config.begin(), config.end(), exp), end;
  for (; next != end; ++next) {
    std::smatch match = *next;
    total += std::stoull(match.str(1)) * 1024 * std::stoull(match.str(2));
  }
  return total;
}
int main(int argc, char** argv) {
  const int calls = argc > 1 ? std::atoi(argv[1]) : 20000;
  size_t sum = 0;
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < calls; i++) sum += parse();
  auto end = std::chrono::steady_clock::now();
  std::printf("%.4f %zu\\n", std::chrono::duration<double, std::micro>(end - start).count() / calls, sum / calls);
}
"""


def library(path: Path, folder: Path) -> Path:
    """``libtorch_cuda.so`` itself, or taken out of a torch wheel into ``folder``."""
    if path.suffix != ".whl":
        return path
    with zipfile.ZipFile(path) as wheel:
        name = next((n for n in wheel.namelist() if n.endswith("/lib/libtorch_cuda.so")), None)
        if name is None:
            raise SystemExit(f"{path} holds no lib/libtorch_cuda.so (a CPU build has no cuBLAS)")
        return Path(wheel.extract(name, folder))


def function_body(lib: Path, symbol: str = SYMBOL) -> str:
    """The disassembly of ``symbol`` in ``lib``, from its address to the next symbol."""
    listing = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    match = re.search(rf"^([0-9a-f]+) T {re.escape(symbol)}$", listing, re.MULTILINE)
    if match is None:
        raise SystemExit(f"{lib} does not export {symbol}")
    start = int(match.group(1), 16)
    text = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", f"--start-address={start:#x}",
                           f"--stop-address={start + 512:#x}", str(lib)], capture_output=True, text=True, check=True).stdout
    body = text.split(">:\n", 1)[-1]
    return re.split(r"\n\n[0-9a-f]+ <", body, maxsplit=1)[0]


def parsed_every_call(body: str) -> bool:
    """Whether the disassembled ``getChosenWorkspaceSize`` parses on every call: it reaches
    ``parseChosenWorkspaceSize`` and reads no guard variable (a function-local static has one)."""
    return "parseChosenWorkspaceSize" in body and "guard variable" not in body and "__cxa_guard" not in body


def time_parse(calls: int = 20000) -> dict[str, float]:
    """Microseconds a parse, the variable set to ``:4096:8`` and unset (``g++ -O2`` on this CPU)."""
    with tempfile.TemporaryDirectory() as folder:
        source, program = Path(folder) / "parse.cpp", Path(folder) / "parse"
        source.write_text(PARSE)
        subprocess.run(["g++", "-O2", "-o", str(program), str(source)], check=True)
        results = {}
        for label, value in (("set", ":4096:8"), ("unset", None)):
            env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
            if value is not None:
                env["CUBLAS_WORKSPACE_CONFIG"] = value
            out = subprocess.run([str(program), str(calls)], env=env, capture_output=True, text=True, check=True).stdout
            micros, size = out.split()
            if int(size) != 32 * 1024 * 1024:
                raise RuntimeError(f"the parse gave {size} bytes, not 32 MiB")
            results[label] = float(micros)
        return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("build", type=Path, help="a torch wheel or its lib/libtorch_cuda.so")
    parser.add_argument("--time-parse", action="store_true", help="also time a copy of the parse on this CPU (g++)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not args.build.exists():
        parser.error(f"no such file: {args.build}")
    with tempfile.TemporaryDirectory() as folder:
        body = function_body(library(args.build, Path(folder)))
    result = {"build": args.build.name, "parsed_every_call": parsed_every_call(body), "disassembly": body.strip()}
    print(f"{args.build.name}: at::cuda::getChosenWorkspaceSize "
          + ("parses CUBLAS_WORKSPACE_CONFIG on every call" if result["parsed_every_call"] else "keeps the parsed size"))
    if args.time_parse:
        result["parse_us"] = time_parse()
        print(f"one parse on this CPU: {result['parse_us']['set']:.2f} us with the variable set, "
              f"{result['parse_us']['unset']:.2f} us unset")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
