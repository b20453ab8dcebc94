"""The texts of the TF-IDF control (``training/controls.py``)."""

from __future__ import annotations

from vllm_pamer.training.controls import recent2_texts


def test_recent2_texts_are_prefix_plus_two_recent_blocks():
    messages = [
        {"role": "system", "content": "SYSTEM"},
        {"role": "user", "content": "TASK"},
    ]
    for k in range(1, 5):
        messages.append({"role": "assistant", "content": f"ACTION{k}"})
        messages.append({"role": "user", "content": f"RESULT{k}"})
    texts = recent2_texts([{"id": "t-1", "messages": messages}])
    # decision before ACTION4 (message 8): P + blocks 2 and 3; block 1 is old
    text = texts[("t-1", 8)]
    assert "SYSTEM" in text and "TASK" in text and "ACTION2" in text and "RESULT3" in text
    assert "ACTION1" not in text and "ACTION4" not in text
    assert set(texts) == {("t-1", 2), ("t-1", 4), ("t-1", 6), ("t-1", 8)}
    assert "ACTION1" in texts[("t-1", 6)] and texts[("t-1", 2)] == "system: SYSTEM\nuser: TASK"
