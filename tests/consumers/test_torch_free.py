"""The predictor package imports no torch: every module of ``consumers/``, in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_CHILD = textwrap.dedent("""
    import importlib, json, pkgutil, sys
    import consumers
    names = ["consumers"] + [m.name for m in
                             pkgutil.walk_packages(consumers.__path__, "consumers.")]
    # walk_packages imports the subpackages it walks into; then each module in turn
    culprit = "a subpackage (imported by the walk)" if "torch" in sys.modules else None
    for name in names:
        importlib.import_module(name)
        if culprit is None and "torch" in sys.modules:
            culprit = name
    print(json.dumps({"modules": names, "torch_by": culprit}))
""")


def _module_files() -> set[str]:
    """Dotted names of the .py files under consumers/ (packages by their __init__) and of
    the C extensions built there."""
    out = set()
    for path in (REPO / "consumers").rglob("*"):
        suffix = next((s for s in (".py", *EXTENSION_SUFFIXES) if path.name.endswith(s)), None)
        if suffix is None:
            continue
        parts = list(path.relative_to(REPO).parts)
        parts[-1] = parts[-1][: -len(suffix)]
        if parts[-1] == "__init__":
            parts.pop()
        out.add(".".join(parts))
    return out


def test_every_consumers_module_imports_without_torch():
    done = subprocess.run([sys.executable, "-c", _CHILD], cwd=REPO, check=True,
                          capture_output=True, text=True)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(got["modules"]) == _module_files()  # the walk saw every module
    assert got["torch_by"] is None, f"importing {got['torch_by']} imported torch"
