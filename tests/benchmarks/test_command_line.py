"""The benchmarks' shared command line: the options a benchmark names, the --json report."""

import json

import pytest

from benchmarks.command_line import parser, write_report


def test_shared_options_take_the_benchmarks_defaults_and_json_is_written(tmp_path):
    ap = parser("doc\n  kept as written", seconds=2.5, port=8999)
    a = ap.parse_args(["--port", "9000"])
    assert (a.seconds, a.port, a.json) == (2.5, 9000, None)
    assert "  kept as written" in ap.format_help()
    assert not hasattr(a, "rounds")  # not named: not an option
    out = tmp_path / "r.json"
    write_report(ap.parse_args(["--json", str(out)]).json, {"run": tmp_path, "x": [1, 2]})
    assert json.loads(out.read_text()) == {"run": str(tmp_path), "x": [1, 2]}
    write_report(None, {"never": "written"})  # no --json: nothing


def test_an_unknown_shared_option_and_no_report_flag():
    with pytest.raises(TypeError, match="no shared option"):
        parser("doc", secnds=1.0)
    with pytest.raises(SystemExit):
        parser("doc", report=False).parse_args(["--json", "x"])
