"""What the adapters read of vLLM, checked in vLLM's source text (never
imported), and the facts recorded from it.

Each adapter package lists what it reads (``<package>/touch_points.py``);
``check`` looks for a touch point's names in the syntax tree of one source
file. Its facts (``<package>/touch_points.json``) hold, per vLLM series that
``ADAPTERS`` maps to the package, the wheel read (file name and sha256) and
what each touch point found in it. ``tests/adapters/test_touch_facts.py``
checks in every run that the facts cover every series of the table and every
touch point as it is now, and checks them against the wheel itself when it is
at hand.

Re-record the facts (after a touch point changed) with

    python -m vllm_pamer.adapters.touch_facts

which reads again the version each series was recorded from; name versions to
record a series anew (``python -m vllm_pamer.adapters.touch_facts 0.34.0``,
after mapping ``0.34`` in ``ADAPTERS``). A wheel is downloaded once, with
``pip download --no-deps``, into the cache's ``wheels/`` (``PAMER_CACHE``,
default ``~/.cache/vllm-pamer``).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib
import importlib.util
import json
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from vllm_pamer.adapters import ADAPTERS

RECORD_COMMAND = "python -m vllm_pamer.adapters.touch_facts"


class TouchPoint(NamedTuple):
    path: str
    """Source file under the ``vllm`` package."""
    qualname: str
    """A module-level class or function, or ``Class.method``; "" for the module."""
    names: tuple[str, ...] = ()
    """Identifiers or string constants that must occur in it."""
    why: str = ""


Reader = Callable[[str], str]
"""A source file's text by its path under the ``vllm`` package."""


# -- the check, on source text ------------------------------------------------------------


def _names(node: ast.AST) -> set[str]:
    """Every identifier and string constant in ``node``."""
    found: set[str] = set()
    for child in ast.walk(node):
        if isinstance(child, ast.Name):
            found.add(child.id)
        elif isinstance(child, ast.Attribute):
            found.add(child.attr)
        elif isinstance(child, ast.arg):
            found.add(child.arg)
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.add(child.name)
        elif isinstance(child, ast.Constant) and isinstance(child.value, str):
            found.add(child.value)
    return found


def _find(tree: ast.Module, qualname: str) -> ast.AST | None:
    node: ast.AST = tree
    for part in [p for p in qualname.split(".") if p]:
        body = getattr(node, "body", [])
        match = [
            n for n in body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and n.name == part
        ]
        if not match:
            return None
        node = match[0]
    return node


def check(source: str, point: TouchPoint) -> str | None:
    """What is missing for ``point`` in ``source`` (None: it holds)."""
    node = _find(ast.parse(source), point.qualname)
    if node is None:
        return f"{point.path}: no {point.qualname}"
    missing = sorted(set(point.names) - _names(node))
    return f"{point.path}: {point.qualname or 'module'} lacks {', '.join(missing)}" if missing else None


def check_all(points: Iterable[TouchPoint], read: Reader) -> list[str | None]:
    """``check`` of each point, its file read by ``read``."""
    results: list[str | None] = []
    for point in points:
        try:
            results.append(check(read(point.path), point))
        except (FileNotFoundError, KeyError):
            results.append(f"{point.path}: no such file")
    return results


def installed_reader() -> Reader:
    """The installed vLLM's source files (found, not imported)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("vLLM is not installed")
    root = Path(next(iter(spec.submodule_search_locations)))
    return lambda path: (root / path).read_text()


def wheel_reader(wheel: Path) -> Reader:
    archive = zipfile.ZipFile(wheel)
    return lambda path: archive.read(f"vllm/{path}").decode()


# -- wheels --------------------------------------------------------------------------------


def wheel_cache() -> Path:
    from vllm_pamer.settings import Settings

    return Settings.from_env().cache_root / "wheels"


def cached_wheel(version: str, name: str | None = None) -> Path | None:
    """vLLM ``version``'s wheel in the cache (the file ``name`` where given)."""
    wheels = [wheel_cache() / name] if name else sorted(wheel_cache().glob(f"vllm-{version}-*.whl"))
    return next((w for w in wheels if w.is_file()), None)


def download_wheel(version: str) -> Path:
    """vLLM ``version``'s wheel, downloaded into the cache unless there."""
    found = cached_wheel(version)
    if found is not None:
        return found
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", f"vllm=={version}"]
    result = subprocess.run([*command, "-d", str(wheel_cache())], capture_output=True, text=True, timeout=900)
    found = cached_wheel(version)
    if result.returncode or found is None:
        raise FileNotFoundError(f"vLLM {version}'s wheel could not be downloaded: {result.stderr.strip()[-300:]}")
    return found


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# -- the facts -----------------------------------------------------------------------------


def touch_points(package: str) -> tuple[TouchPoint, ...]:
    module = importlib.import_module(f"{__package__}.{package}.touch_points")
    return tuple(module.TOUCH_POINTS)


def facts_path(package: str) -> Path:
    return Path(__file__).with_name(package) / "touch_points.json"


def load_facts(package: str) -> dict[str, Any]:
    """Series -> its recorded facts ({} when none are recorded)."""
    path = facts_path(package)
    return json.loads(path.read_text()) if path.is_file() else {}


def read_facts(points: Sequence[TouchPoint], version: str, wheel: Path) -> dict[str, Any]:
    """The facts of ``points`` in ``wheel`` (vLLM ``version``)."""
    results = check_all(points, wheel_reader(wheel))
    entries = [
        {"path": p.path, "qualname": p.qualname, "names": list(p.names), "problem": problem}
        for p, problem in zip(points, results)
    ]
    return {"version": version, "wheel": wheel.name, "sha256": sha256(wheel), "touch_points": entries}


def _key(entry: dict[str, Any]) -> tuple[str, str, tuple[str, ...]]:
    return entry["path"], entry["qualname"], tuple(sorted(entry["names"]))


def stale(facts: dict[str, Any], points: Sequence[TouchPoint]) -> list[str]:
    """How recorded ``facts`` differ from ``points`` as they are now (a touch
    point added, changed or removed since the recording)."""
    recorded = {_key(e) for e in facts.get("touch_points", [])}
    current = {(p.path, p.qualname, tuple(sorted(p.names))) for p in points}
    return [f"not recorded: {k[0]} {k[1] or 'module'} {list(k[2])}" for k in sorted(current - recorded)] + [
        f"no longer a touch point: {k[0]} {k[1] or 'module'} {list(k[2])}" for k in sorted(recorded - current)
    ]


def problems(facts: dict[str, Any]) -> list[str]:
    """The touch points that did not hold where ``facts`` were read."""
    return [e["problem"] for e in facts.get("touch_points", []) if e["problem"]]


def record(versions: Sequence[str]) -> int:
    """Record the facts of ``versions`` (every recorded one when empty) into
    their packages' fact files; 1 when a touch point does not hold in one."""
    if not versions:
        versions = sorted({f["version"] for p in set(ADAPTERS.values()) for f in load_facts(p).values()})
        if not versions:
            raise SystemExit(f"no facts recorded yet: name the versions to read ({RECORD_COMMAND} 0.33.0)")
    failed = False
    for version in versions:
        series = ".".join(version.split(".")[:2])
        if series not in ADAPTERS:
            raise SystemExit(f"vLLM {series} is not in ADAPTERS (vllm_pamer/adapters/__init__.py): map it first")
        package = ADAPTERS[series]
        facts = load_facts(package)
        read = read_facts(touch_points(package), version, download_wheel(version))
        found = problems(read)
        if found:  # not recorded: a series whose touch points differ needs a package of its own
            failed = True
            print(f"vLLM {version}: {package}'s touch points do not hold, nothing recorded:", file=sys.stderr)
            for problem in found:
                print(f"  does not hold: {problem}", file=sys.stderr)
            print("  a package of its own serves it (docs/design.md, 'Add a vLLM series')", file=sys.stderr)
            continue
        facts[series] = read
        facts_path(package).write_text(json.dumps(dict(sorted(facts.items())), indent=1) + "\n")
        print(f"{facts_path(package)}: vLLM {version} recorded ({read['wheel']})")
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_pamer.adapters.touch_facts",
        description="Record what each adapter package's touch points find in vLLM's wheels (touch_points.json).",
    )
    parser.add_argument(
        "versions", nargs="*", metavar="X.Y.Z", help="vLLM versions to read (default: every one recorded so far)"
    )
    return record(parser.parse_args(argv).versions)


if __name__ == "__main__":
    sys.exit(main())
