"""The layout's guardrails that the import contracts cannot state: every
module is under one of them, long modules (of the package and of the
benchmarks) say why, and the README documents every setting and every policy
option the code has."""

from __future__ import annotations

import pkgutil
import re
from pathlib import Path

import tomllib

import vllm_pamer
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


def test_long_modules_say_why_at_their_top():
    unexplained = []
    for path in sorted([*(ROOT / "vllm_pamer").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]):
        lines = path.read_text().splitlines()
        head = "\n".join(lines[:30])
        if len(lines) > LONG and f"longer than {LONG} lines" not in head.lower():
            unexplained.append(f"{path.relative_to(ROOT)} ({len(lines)} lines)")
    assert not unexplained, "modules over ~400 lines without a reason at their top: " + ", ".join(unexplained)


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
