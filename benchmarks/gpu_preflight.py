"""The first step of ``benchmarks/gpu_check.sh``: can this Python run the project on a GPU?

Prints the versions that decide it (Python, torch and its CUDA, the GPUs, transformers), checks
torch against the range ``pyproject.toml`` declares, and imports every module of ``intellect``,
``flows`` and ``tasks``, naming each one that fails with its error: on a machine whose image brings
its own torch (the lent GPU machine's Python has packages this project was not resolved against), a
missing package or an API that this torch lacks is named here in one line, not as a traceback from a
worker minutes later. Exit status: 0 ready, 1 a module or the torch range failed, 2 no CUDA device
(whatever else failed: everything is still checked and printed).

    python benchmarks/gpu_preflight.py
"""

from __future__ import annotations

import importlib
import pkgutil
import platform
import sys
import tomllib
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("intellect", "flows", "tasks")


def torch_requirement(pyproject: Path = ROOT / "pyproject.toml") -> str:
    """The ``torch`` line of the project's runtime dependencies, e.g. ``"torch>=2.6,<2.15"``."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return next(d for d in deps if d.replace(" ", "").lower().startswith(("torch>", "torch<", "torch=", "torch~")))


def modules(packages=PACKAGES) -> list[str]:
    """Every module of ``packages`` under the repository root, packages first, in a stable order."""
    out = []
    for name in packages:
        pkg = importlib.import_module(name)
        out.append(name)
        out += sorted(m.name for m in pkgutil.walk_packages(pkg.__path__, prefix=f"{name}."))
    return out


def import_failures(names: list[str]) -> dict[str, str]:
    """Each module of ``names`` that does not import, with the last line of its error."""
    failed = {}
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - any error is what this check reports
            where = traceback.extract_tb(e.__traceback__)[-1]
            failed[name] = f"{type(e).__name__}: {e} ({Path(where.filename).name}:{where.lineno})"
    return failed


def main() -> int:
    sys.path.insert(0, str(ROOT))
    print(f"python {platform.python_version()} at {sys.executable}")
    import torch  # noqa: PLC0415 - after the Python line, so a missing torch still says which Python lacks it
    from packaging.specifiers import SpecifierSet  # noqa: PLC0415 - same
    from packaging.version import Version  # noqa: PLC0415 - same

    import transformers  # noqa: PLC0415 - same

    status = 0
    req = torch_requirement()
    inside = Version(torch.__version__.split("+")[0]) in SpecifierSet(req.replace(" ", "")[len("torch"):])
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}); the project asks {req}: "
          f"{'inside' if inside else 'OUTSIDE'}")
    print(f"transformers {transformers.__version__}")
    if not inside:
        status = 1
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        print(f"GPUs: {len(names)} x {', '.join(sorted(set(names)))}; bf16: {torch.cuda.is_bf16_supported()}")
    else:
        print("no CUDA device visible to torch")
    names = modules()
    failed = import_failures(names)
    print(f"modules: {len(names) - len(failed)} of {len(names)} import")
    for name, why in failed.items():
        print(f"  {name}: {why}")
    if failed:
        status = 1
    return status if torch.cuda.is_available() else 2


if __name__ == "__main__":
    sys.exit(main())
