"""Stage an engine stack for the device machine, which has no network.

Two stacks (``--stack``):

* ``gpu``: vLLM 0.26.0 and LMCache 0.5.6 for the device's Python 3.12 and its CUDA
  torch (`requirements.txt` here), the two members of vLLM's wheel a Hopper run never
  loads dropped (FlashAttention 2, 123 MiB: Hopper runs FlashAttention 3; the Rust
  front end, 15 MiB: `vllm.LLM` does not start it).  `run.sh` runs it.
* ``d``: stack D of the tests (vLLM's CPU build 0.32.0, torch 2.13.0+cpu, LMCache
  0.5.6: ``requirements/stack-d.txt``) with the Python 3.11 it runs on, for the
  device's host CPU (Intel AMX: vLLM keeps its prefix caching on for DeepSeek-V4 only
  there).  Triton is left out (no CPU backend: vLLM takes its placeholders, as it
  does here), and OpenCV (images only); this project is staged as a wheel too (its
  start-up hook; the code the tests run is the carried checkout).  `stack-d.sh` runs
  the tests with it.

Here (network to the package registry, `zip` on the PATH):

    python3 scripts/gpu-engine/stage.py pack --stack gpu|d

downloads the pinned wheels, writes them (and for stack D the interpreter) as one
stream cut into numbered parts under `.gpu-stage/<stack>/part-K/` (ignored by git),
each small enough for one device call's carry (64 MiB with the working tree), and
prints the device calls.

On the device, one call per part, in a row (a warm machine keeps /tmp between
calls; it goes back after 30 s idle, and then the parts must be carried again):

    python3 scripts/gpu-engine/stage.py receive --stack gpu|d

moves the carried part into /tmp/gpu-engine/<stack>/parts; once every part is there
it checks them against the manifest and installs every wheel with ``pip --no-deps``:
into /tmp/gpu-engine/<stack>/site (gpu; `run.sh` puts it on the path), or into the
carried interpreter's own site-packages (d: every process it starts finds them).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PART_BYTES = 58 << 20  # one call carries 64 MiB, the working tree (~3 MiB) included
PLATFORMS = ["manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64", "linux_x86_64"]
INTERPRETER = "python.tar.xz"


@dataclass(frozen=True)
class Stack:
    python_version: str
    requirements: tuple[str, ...]        # requirement files (relative to the repository) and pins
    left_out: tuple[str, ...] = ()       # project names of the files not staged
    trimmed: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (wheel glob, members dropped from it)
    interpreter: str | None = None       # also carry this venv's Python (the one the wheels are for)


STACKS = {
    "gpu": Stack("3.12", ("scripts/gpu-engine/requirements.txt",),
                 trimmed=(("vllm-0.26.0-*.whl", ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs")),)),
    "d": Stack("3.11", ("requirements/stack-d.txt", "torch==2.13.0+cpu", "setuptools==84.2.1"),  # a venv has setuptools
               left_out=("triton", "opencv-python-headless"), interpreter=".venvs/stack-d"),
}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _requirements(stack: Stack, out: Path) -> Path:
    """One requirements file of the stack's pins, less the projects left out."""
    lines = []
    for source in stack.requirements:
        path = REPO / source
        for line in (path.read_text().splitlines() if path.exists() else [source]):
            name = line.split("==")[0].strip().lower().replace("_", "-")
            if line.strip() and not line.startswith("#") and name not in stack.left_out:
                lines.append(line.strip())
    out.write_text("\n".join(lines) + "\n")
    return out


def _interpreter(stack: Stack, out: Path) -> None:
    """The stack's Python (its base installation, without site-packages, tests and build files)."""
    base = Path(subprocess.run([str(REPO / stack.interpreter / "bin" / "python"), "-c", "import sys; print(sys.base_prefix)"],
                               check=True, capture_output=True, text=True).stdout.strip())
    stdlib = f"lib/python{stack.python_version}"
    excluded = [f"{stdlib}/site-packages/*", f"{stdlib}/test", f"{stdlib}/idlelib", f"{stdlib}/tkinter",
                f"{stdlib}/turtledemo", f"{stdlib}/ensurepip", f"{stdlib}/config-*", "*/__pycache__", "lib/*.a"]
    subprocess.run(["tar", "-cJf", str(out), "-C", str(base), *(f"--exclude={pattern}" for pattern in excluded),
                    "bin", "lib", "include"], check=True)


def pack(name: str) -> None:
    stack = STACKS[name]
    stage = REPO / ".gpu-stage" / name
    wheels = stage / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
               stack.python_version, "--implementation", "cp", "-d", str(wheels),
               "-r", str(_requirements(stack, stage / "requirements.txt"))]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    subprocess.run(command, check=True)
    slim = stage / "slim"
    shutil.rmtree(slim, ignore_errors=True)
    slim.mkdir()
    for wheel in wheels.glob("*.whl"):
        shutil.copy(wheel, slim / wheel.name)
    for pattern, members in stack.trimmed:
        (wheel,) = slim.glob(pattern)
        subprocess.run(["zip", "-q", "-d", str(wheel), *members], check=True)
    if stack.interpreter:  # and this project, for its start-up hook and vLLM plugin in every engine process
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(slim), str(REPO)], check=True)
    names = sorted(wheel.name for wheel in slim.glob("*.whl"))
    if stack.interpreter:
        _interpreter(stack, slim / INTERPRETER)
        names.append(INTERPRETER)

    # One stream of every file, cut into parts: the device joins them in order.
    stream = stage / "payload.tar"
    subprocess.run(["tar", "-cf", str(stream), "-C", str(slim), *names], check=True)
    for old in stage.glob("part-*"):
        shutil.rmtree(old)
    parts = []
    with stream.open("rb") as handle:
        while block := handle.read(PART_BYTES):
            folder = stage / f"part-{len(parts) + 1}"
            folder.mkdir()
            (folder / "payload").write_bytes(block)
            parts.append(hashlib.sha256(block).hexdigest())
    manifest = {"stack": name, "parts": parts, "payload_sha256": _sha256(stream),
                "wheels": [wheel for wheel in names if wheel.endswith(".whl")], "interpreter": bool(stack.interpreter)}
    for index in range(len(parts)):
        (stage / f"part-{index + 1}" / "manifest.json").write_text(json.dumps(manifest, indent=1))
    stream.unlink()
    shutil.rmtree(slim)
    print(f"{len(manifest['wheels'])} wheels in {len(parts)} parts under {stage}. Device calls, in a row:")
    for index in range(len(parts)):
        print(f"  run(command='python3 scripts/gpu-engine/stage.py receive --stack {name}', "
              f"carry=['.gpu-stage/{name}/part-{index + 1}'])")


def receive(name: str) -> None:
    stack = STACKS[name]
    carried = sorted((REPO / ".gpu-stage" / name).glob("part-*"))
    if not carried:
        raise SystemExit(f"stage.py receive: no .gpu-stage/{name}/part-K was carried into this call")
    manifest = json.loads((carried[0] / "manifest.json").read_text())
    device = Path("/tmp/gpu-engine") / name
    stamp = device / ".payload-sha256"
    if stamp.exists() and stamp.read_text() == manifest["payload_sha256"]:
        print(f"{device} holds this payload already")
        return
    parts = device / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    for folder in carried:  # a warm machine keeps the parts earlier calls carried: each is copied once
        index = int(folder.name.split("-")[1])
        if (parts / f"{index:03d}").exists():
            continue
        expected = manifest["parts"][index - 1]
        if _sha256(folder / "payload") != expected:
            raise SystemExit(f"stage.py receive: {folder.name} does not match its manifest (sha256 {expected})")
        shutil.copy(folder / "payload", parts / f"{index:03d}")
    have = sorted(int(path.name) for path in parts.iterdir())
    missing = [index for index in range(1, len(manifest["parts"]) + 1) if index not in have]
    if missing:
        print(f"received parts {have}; still to carry: {missing}")
        return
    stream = device / "payload.tar"
    with stream.open("wb") as out:
        for index in range(1, len(manifest["parts"]) + 1):
            out.write((parts / f"{index:03d}").read_bytes())
    if _sha256(stream) != manifest["payload_sha256"]:
        raise SystemExit("stage.py receive: the joined parts do not match the manifest")
    files = device / "files"
    files.mkdir(exist_ok=True)
    subprocess.run(["tar", "-xf", str(stream), "-C", str(files)], check=True)
    stream.unlink()
    shutil.rmtree(parts)
    if stack.interpreter:
        python = device / "python"
        shutil.rmtree(python, ignore_errors=True)
        python.mkdir()
        subprocess.run(["tar", "-xJf", str(files / INTERPRETER), "-C", str(python)], check=True)
        site = python / "lib" / f"python{stack.python_version}" / "site-packages"
    else:
        site = device / "site"
        shutil.rmtree(site, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site),
                    "--python-version", stack.python_version, "--implementation", "cp", "--only-binary=:all:",
                    *(str(files / wheel) for wheel in manifest["wheels"])], check=True,
                   env={**os.environ, "PIP_NO_WARN_SCRIPT_LOCATION": "1"})
    stamp.write_text(manifest["payload_sha256"])
    print(f"installed {len(manifest['wheels'])} wheels into {site}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["pack", "receive"], help="pack: here; receive: on the device machine")
    parser.add_argument("--stack", choices=sorted(STACKS), default="gpu", help="which stack (default: gpu)")
    options = parser.parse_args(argv)
    {"pack": pack, "receive": receive}[options.step](options.stack)


if __name__ == "__main__":
    main()
