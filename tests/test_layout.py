"""The layout's guardrails that the import contracts cannot state: every
module is under one of them, long modules (of the package and of the
benchmarks) say why, the tests mirror the source tree (the rule:
``tests/__init__.py``), and the README documents every setting and every
policy option the code has."""

from __future__ import annotations

import ast
import pkgutil
import re
import sys
from pathlib import Path

import vllm_pamer

if sys.version_info >= (3, 11):
    import tomllib
else:  # the test extra installs tomli there
    import tomli as tomllib
from vllm_pamer.core.fields import field_docs
from vllm_pamer.core.policies import available_policies, policy_class
from vllm_pamer.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
LONG = 400  # lines; a longer module states why at its top


def contracts() -> dict[str, dict]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {c["name"]: c for c in config["tool"]["importlinter"]["contracts"]}


def test_every_top_level_module_but_the_adapters_is_barred_from_vllm():
    only_adapters = contracts()["Only the adapters import vLLM"]
    top = {f"vllm_pamer.{m.name}" for m in pkgutil.iter_modules(vllm_pamer.__path__)}
    assert top - set(only_adapters["source_modules"]) == {"vllm_pamer.adapters"}
    assert only_adapters["forbidden_modules"] == ["vllm"]


def test_the_core_is_barred_from_every_other_part_of_the_package():
    pure = contracts()["The core is pure: no vLLM, torch, web or IPC import, and nothing of the package outside it"]
    top = {f"vllm_pamer.{m.name}" for m in pkgutil.iter_modules(vllm_pamer.__path__)}
    assert top - set(pure["forbidden_modules"]) == {"vllm_pamer.core"}


def test_long_modules_say_why_at_their_top():
    unexplained = []
    for path in sorted([*(ROOT / "vllm_pamer").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]):
        lines = path.read_text().splitlines()
        head = "\n".join(lines[:30])
        if len(lines) > LONG and f"longer than {LONG} lines" not in head.lower():
            unexplained.append(f"{path.relative_to(ROOT)} ({len(lines)} lines)")
    assert not unexplained, (
        f"modules over {LONG} lines without a reason at their top (say 'longer than {LONG} lines: why' "
        "in its first 30 lines, or split it): " + ", ".join(unexplained)
    )


TESTS = ROOT / "tests"
WHOLE_PRODUCT = ("e2e", "support")  # folders of tests/ that mirror no package (tests/__init__.py)


def why_misplaced(test: Path) -> str | None:
    """Why ``test``, a file of a mirroring folder of tests/, breaks the rule of
    tests/__init__.py; None when it keeps it."""
    if test.name in ("__init__.py", "conftest.py"):
        return None
    match = re.fullmatch(r"(test|interp)_(\w+)\.py", test.name)
    if not match:
        return "neither a test module (test_*.py) nor a package file: test support belongs in tests/support/"
    folder = test.parent.relative_to(TESTS).parts
    source = ROOT.joinpath(*folder) if folder[:1] == ("benchmarks",) else ROOT.joinpath("vllm_pamer", *folder)
    kind, name = match.groups()
    modules = {module.stem.strip("_") for module in source.glob("*.py")}
    if not any(name == module or name.startswith(module + "_") for module in modules):
        return (
            f"names no module of {source.relative_to(ROOT)}/"
            if source.is_dir()
            else f"no package {source.relative_to(ROOT)}/"
        )
    runner = test.with_name(f"test_{name}.py")
    if kind == "interp" and not (runner.exists() and test.name in runner.read_text()):
        return f"runs in a fresh process, but no test_{name}.py beside it runs it"
    return None


def test_the_tests_mirror_the_source_tree():
    broken = []
    for test in sorted(TESTS.rglob("*.py")):
        relative = test.relative_to(TESTS)
        if relative == Path("test_layout.py") or relative.parts[0] in WHOLE_PRODUCT:
            continue
        reason = why_misplaced(test)
        if reason:
            broken.append(f"tests/{relative}: {reason}")
    for folder in sorted({test.parent for test in TESTS.rglob("*.py")}):
        if not (folder / "__init__.py").exists():
            broken.append(f"{folder.relative_to(ROOT)}/ has no __init__.py (same basenames in two folders clash)")
    assert not broken, "tests outside the rule of tests/__init__.py:\n" + "\n".join(broken)


def test_test_support_holds_no_test_and_no_test_module_imports_another():
    broken = []
    for path in sorted(TESTS.rglob("*.py")):
        relative = path.relative_to(TESTS)
        tree = ast.parse(path.read_text())
        if relative.parts[0] == "support":
            tests = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
            if path.name.startswith("test_") or tests:
                broken.append(f"tests/{relative} holds tests: {tests or path.name}")
            continue
        imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        others = [m for m in imported if m.startswith("tests.") and not m.startswith("tests.support")]
        if others:
            broken.append(f"tests/{relative} imports {', '.join(others)}: shared code belongs in tests/support/")
    assert not broken, "\n".join(broken)


def readme() -> str:
    return (ROOT / "README.md").read_text()


def test_the_readme_lists_every_setting_as_variable_and_flag():
    text = readme()
    for field in Settings.__struct_fields__:
        assert Settings.env_name(field) in text, field
        assert "--pamer-" + field.replace("_", "-") in text, field


def test_the_readme_documents_every_option_of_every_policy():
    text = readme()
    missing = []
    for name in available_policies():
        for config in policy_class(name).config_classes():
            docs = field_docs(config)
            for field in config.__struct_fields__:
                assert field in docs, f"{name}.{field} has no docstring"
                if not re.search(rf"`{field}`", text):
                    missing.append(f"{name}.{field}")
    assert not missing, "policy options the README does not mention: " + ", ".join(missing)


def test_the_readme_lists_every_fallback_rule():
    from vllm_pamer.core.fallback import Fallback

    text = readme()
    assert [rule.action for rule in Fallback if rule.action not in text] == []


def test_the_pre_commit_hooks_are_the_checks_of_make_lint():
    import yaml  # a dependency of vLLM and transformers

    recipe = (ROOT / "Makefile").read_text().split("\nlint:", 1)[1].split("\n\n", 1)[0]
    make_lint = [line.strip().replace("$(VENV)", ".venv") for line in recipe.splitlines()[1:]]
    hooks = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())["repos"][0]["hooks"]
    assert [h["entry"] for h in hooks] == make_lint
