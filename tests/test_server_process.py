from vllm_pamer.server_process import first_traceback


def test_first_traceback_starts_where_the_dead_child_said_why(tmp_path):
    log = tmp_path / "serve.log"
    lines = ["INFO starting\n"] * 5 + [
        "Process ApiServer_0:\n",
        "Traceback (most recent call last):\n",
        '  File "x.py", line 1, in <module>\n',
        "OSError: address in use\n",
    ]
    log.write_text("".join(lines + ["INFO shutdown\n"] * 100 + ["Traceback (most recent call last):\n", "later\n"]))
    assert first_traceback(log, lines=3) == "".join(lines[6:9])
    log.write_text("INFO fine\n")
    assert first_traceback(log) == ""
