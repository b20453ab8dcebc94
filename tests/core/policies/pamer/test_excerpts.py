"""Which lines of archived observations a record keeps (``core/policies/pamer/excerpts.py``)."""

from __future__ import annotations

import json

from vllm_pamer.core.policies.pamer.excerpts import LINE_CHARS, UNIT_COST, choose, units


def test_a_json_result_is_one_line_per_object_without_its_quotes():
    result = {
        "reservation_id": "H9ZU1C",
        "flights": [
            {"flight_number": f"HAT{i:03d}", "date": "2024-05-24", "origin": "MIA", "destination": "EWR", "price": i}
            for i in range(5)
        ],
        "insurance": "no",
    }
    lines = units(json.dumps(result))
    assert lines[0] == "reservation_id: H9ZU1C, insurance: no"
    assert lines[1:] == [
        f"flights: flight_number: HAT{i:03d}, date: 2024-05-24, origin: MIA, destination: EWR, price: {i}"
        for i in range(5)
    ]
    assert units('{"a": 1, "b": {"c": [1, 2]}}') == ["a: 1, b: {c: [1, 2]}"]  # short: one line
    assert units("[1, 2") == ["[1, 2"]  # not JSON after all: a line


def test_text_is_cut_into_stripped_lines_of_bounded_length():
    text = "  first line  \n\n" + "word " * 200 + "\n\tlast"
    lines = units(text)
    assert lines[0] == "first line" and lines[-1] == "last"
    assert all(0 < len(line) <= LINE_CHARS for line in lines)
    assert " ".join(lines[1:-1]).split() == ["word"] * 200


def test_choose_keeps_what_adds_most_within_its_room():
    listing = ["setup.py", "README.md", "src/app/main.py"]
    observations = [listing, listing, ["Traceback: KeyError in src/app/config_loader.py line 42"]]
    picks = choose(observations, [1.0, 1.0, 1.0], known=["README.md"], room=1000)
    kept = {(o, u) for o, u in picks}
    assert (2, 0) in kept  # names seen nowhere else
    assert len({observations[o][u] for o, u in kept}) == len(kept)  # a repeated line once at most
    assert not {(0, 1), (1, 1)} & kept  # the request holds README.md anyway
    assert sum(len(observations[o][u]) + UNIT_COST for o, u in picks) <= 1000


def test_choose_spends_no_more_than_its_room_and_prefers_heavier_steps():
    observations = [[f"alpha_{i} beta_{i}" for i in range(20)], [f"gamma_{i} delta_{i}" for i in range(20)]]
    room = 5 * (len("alpha_0 beta_0") + UNIT_COST)
    picks = choose(observations, [1.0, 3.0], known=(), room=room)
    assert sum(len(observations[o][u]) + UNIT_COST for o, u in picks) <= room
    assert picks and all(o == 1 for o, _ in picks)
    assert choose(observations, [1.0, 1.0], known=(), room=0) == []


def test_a_name_weighs_more_than_a_plain_word():
    observations = [["reading config"], ["read_me config"]]  # as long, as many words
    room = len("read_me config") + UNIT_COST
    assert choose(observations, [1.0, 1.0], known=(), room=room) == [(1, 0)]


def test_a_json_string_keeps_its_lines_and_deep_nesting_is_read_as_text():
    assert units(json.dumps({"output": "first line\nsecond line"})) == ["output: first line", "second line"]
    deep = "[" * 5000 + "]" * 5000  # past what the JSON parser takes: text, not an error
    assert units(deep) and all(len(line) <= LINE_CHARS for line in units(deep))


def test_choose_decides_the_same_in_every_process():
    """Words are summed in one order, so near ties go the same way whatever
    the process's hash seed (a record is written once and shown for many steps)."""
    import subprocess
    import sys

    code = (
        "from vllm_pamer.core.policies.pamer.excerpts import choose\n"
        "obs = [[f'w{i}a w{i}b w{j}c' for j in range(30)] for i in range(8)]\n"
        "print(choose(obs, [1.0] * 8, known=(), room=900))\n"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code], env={"PYTHONHASHSEED": seed}, capture_output=True, text=True, check=True
        ).stdout
        for seed in ("1", "2", "3")
    }
    assert len(outs) == 1
