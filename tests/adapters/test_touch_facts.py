"""The adapters' touch points hold in the installed vLLM's source, and in
every series the table serves, by the facts recorded from its wheel
(``vllm_pamer/adapters/touch_facts.py``): in every run the facts must cover
each series and each touch point as it is now; where the wheel is at hand
(cached, or downloaded by the ``network`` test) they must be what it holds."""

from __future__ import annotations

import pytest

from vllm_pamer.adapters import ADAPTERS
from vllm_pamer.adapters.touch_facts import (
    RECORD_COMMAND,
    TouchPoint,
    cached_wheel,
    check,
    check_all,
    download_wheel,
    installed_reader,
    load_facts,
    problems,
    read_facts,
    stale,
    touch_points,
)

SERIES = sorted(ADAPTERS)


def test_the_checker_finds_what_is_missing():
    source = "class A:\n    def f(self, x):\n        self.y = x.compute_logits()\n"
    assert check(source, TouchPoint("a.py", "A.f", ("x", "y", "compute_logits"))) is None
    assert "lacks z" in check(source, TouchPoint("a.py", "A.f", ("x", "z")))
    assert "no A.g" in check(source, TouchPoint("a.py", "A.g"))
    assert check_all([TouchPoint("b.py", "")], {}.__getitem__) == ["b.py: no such file"]


def test_touch_points_hold_in_the_installed_vllm():
    from vllm_pamer.adapters import vllm_series

    points = touch_points(ADAPTERS[vllm_series()])
    assert [p for p in check_all(points, installed_reader()) if p] == []


@pytest.mark.parametrize("series", SERIES)
def test_recorded_facts_cover_the_series_and_hold(series):
    package = ADAPTERS[series]
    facts = load_facts(package).get(series)
    assert facts is not None, f"no facts for vLLM {series}: run {RECORD_COMMAND} {series}.0"
    assert stale(facts, touch_points(package)) == [], f"touch points changed: run {RECORD_COMMAND}"
    assert problems(facts) == []


def test_a_touch_point_missing_from_the_facts_is_caught():
    points = (TouchPoint("a.py", "A", ("x",)), TouchPoint("a.py", "B"))
    facts = {"touch_points": [{"path": "a.py", "qualname": "A", "names": ["x"], "problem": None}]}
    assert stale(facts, points) == ["not recorded: a.py B []"]
    changed = (TouchPoint("a.py", "A", ("x", "y")),)
    assert stale(facts, changed) == ["not recorded: a.py A ['x', 'y']", "no longer a touch point: a.py A ['x']"]
    facts["touch_points"][0]["problem"] = "a.py: A lacks x"
    assert problems(facts) == ["a.py: A lacks x"]


@pytest.mark.network
@pytest.mark.parametrize("series", SERIES)
def test_recorded_facts_are_what_the_wheel_holds(series):
    """The wheel from the cache, else downloaded into it (skipped offline)."""
    package = ADAPTERS[series]
    recorded = load_facts(package).get(series)
    assert recorded is not None, f"no facts for vLLM {series}: {RECORD_COMMAND} {series}.0"
    try:
        wheel = cached_wheel(recorded["version"], recorded["wheel"]) or download_wheel(recorded["version"])
    except FileNotFoundError as error:
        pytest.skip(str(error))
    read = read_facts(touch_points(package), recorded["version"], wheel)
    if wheel.name == recorded["wheel"]:  # another platform's wheel has another digest, the same source
        assert read["sha256"] == recorded["sha256"], f"{wheel} is not the wheel the facts were read from"
    assert read["touch_points"] == recorded["touch_points"], f"the facts differ from {wheel.name}: {RECORD_COMMAND}"


def test_the_recorder_records_no_series_whose_touch_points_do_not_hold(tmp_path, monkeypatch, capsys):
    """A series mapped to a package whose touch points its wheel lacks is
    refused, and its facts file is left as it was: that series needs a package
    of its own."""
    import zipfile

    from vllm_pamer.adapters import touch_facts

    wheel = tmp_path / "vllm-9.9.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("vllm/__init__.py", "")  # none of the touch points' files
    package = ADAPTERS[SERIES[0]]
    before = touch_facts.facts_path(package).read_text()
    monkeypatch.setitem(touch_facts.ADAPTERS, "9.9", package)
    monkeypatch.setattr(touch_facts, "download_wheel", lambda version: wheel)
    assert touch_facts.record(["9.9.0"]) == 1
    assert touch_facts.facts_path(package).read_text() == before
    assert "nothing recorded" in capsys.readouterr().err
