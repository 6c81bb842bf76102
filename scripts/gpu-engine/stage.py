"""Stage vLLM 0.26.0 and LMCache 0.5.6 for the device machine, which has no network.

Here (network to the package registry, `zip` on the PATH):

    python3 scripts/gpu-engine/stage.py pack

downloads the pinned wheels of `requirements.txt` for the device's Python 3.12,
drops the two members of vLLM's wheel a Hopper run never loads (FlashAttention 2,
123 MiB: Hopper runs FlashAttention 3; the Rust front end, 15 MiB: `vllm.LLM` does
not start it), and writes the lot as numbered parts under `.gpu-stage/part-K/`
(ignored by git), each small enough for one device call's carry (64 MiB with
the working tree). It prints the device calls.

On the device, one call per part, in a row (a warm machine keeps /tmp between
calls; it goes back after 30 s idle, and then the parts must be carried again):

    python3 scripts/gpu-engine/stage.py receive

moves the carried part into /tmp/gpu-engine/parts; once every part is there it
checks them against the manifest and installs every wheel with
``pip --no-deps --target /tmp/gpu-engine/site``. `run.sh` then puts that folder
on the path.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
STAGE = REPO / ".gpu-stage"
DEVICE = Path("/tmp/gpu-engine")
PART_BYTES = 58 << 20  # one call carries 64 MiB, the working tree (~3 MiB) included
# The device image's Python and the wheel tags its pip accepts.
PYTHON_VERSION = "3.12"
PLATFORMS = ["manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64",
             "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_5_x86_64",
             "manylinux1_x86_64"]
# vLLM members a Hopper engine never opens.
UNUSED_IN_VLLM = ["vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs"]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pack() -> None:
    wheels = STAGE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
               PYTHON_VERSION, "--implementation", "cp", "-d", str(wheels), "-r", str(HERE / "requirements.txt")]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    subprocess.run(command, check=True)
    (vllm_wheel,) = wheels.glob("vllm-0.26.0-*.whl")
    slim = STAGE / "slim"
    shutil.rmtree(slim, ignore_errors=True)
    slim.mkdir()
    for wheel in wheels.glob("*.whl"):
        shutil.copy(wheel, slim / wheel.name)
    subprocess.run(["zip", "-q", "-d", str(slim / vllm_wheel.name), *UNUSED_IN_VLLM], check=True)

    # One stream of every wheel, cut into parts: the device joins them in order.
    names = sorted(wheel.name for wheel in slim.glob("*.whl"))
    stream = STAGE / "payload.tar"
    subprocess.run(["tar", "-cf", str(stream), "-C", str(slim), *names], check=True)
    for old in STAGE.glob("part-*"):
        shutil.rmtree(old)
    parts = []
    with stream.open("rb") as handle:
        while block := handle.read(PART_BYTES):
            folder = STAGE / f"part-{len(parts) + 1}"
            folder.mkdir()
            (folder / "payload").write_bytes(block)
            parts.append(hashlib.sha256(block).hexdigest())
    manifest = {"parts": parts, "payload_sha256": _sha256(stream), "wheels": names}
    for index in range(len(parts)):
        (STAGE / f"part-{index + 1}" / "manifest.json").write_text(json.dumps(manifest, indent=1))
    stream.unlink()
    shutil.rmtree(slim)
    print(f"{len(names)} wheels in {len(parts)} parts under {STAGE}. Device calls, in a row:")
    for index in range(len(parts)):
        print(f"  run(command='python3 scripts/gpu-engine/stage.py receive', carry=['.gpu-stage/part-{index + 1}'])")


def receive() -> None:
    carried = sorted(STAGE.glob("part-*"))
    if not carried:
        raise SystemExit("stage.py receive: no .gpu-stage/part-K was carried into this call")
    manifest = json.loads((carried[0] / "manifest.json").read_text())
    site = DEVICE / "site"
    stamp = site / ".payload-sha256"
    if stamp.exists() and stamp.read_text() == manifest["payload_sha256"]:
        print(f"{site} holds this payload already")
        return
    parts = DEVICE / "parts"
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
    stream = DEVICE / "payload.tar"
    with stream.open("wb") as out:
        for index in range(1, len(manifest["parts"]) + 1):
            out.write((parts / f"{index:03d}").read_bytes())
    if _sha256(stream) != manifest["payload_sha256"]:
        raise SystemExit("stage.py receive: the joined parts do not match the manifest")
    wheels = DEVICE / "wheels"
    wheels.mkdir(exist_ok=True)
    subprocess.run(["tar", "-xf", str(stream), "-C", str(wheels)], check=True)
    stream.unlink()
    shutil.rmtree(parts)
    shutil.rmtree(site, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site),
                    *(str(wheels / name) for name in manifest["wheels"])], check=True,
                   env={**os.environ, "PIP_NO_WARN_SCRIPT_LOCATION": "1"})
    stamp.write_text(manifest["payload_sha256"])
    print(f"installed {len(manifest['wheels'])} wheels into {site}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["pack", "receive"], help="pack: here; receive: on the device machine")
    {"pack": pack, "receive": receive}[parser.parse_args(argv).step]()


if __name__ == "__main__":
    main()
