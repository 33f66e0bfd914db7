"""services.report without matplotlib (the plots extra, which the service images leave out)."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from services import report


def test_without_matplotlib_the_report_names_the_extra(tmp_path, monkeypatch, capsys):
    rows = [{"step": 1, "reward/mean": 0.1}, {"step": 2, "reward/mean": 0.3}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # any import of it raises ImportError
    with pytest.raises(ImportError, match=r"rlhf-pipeline\[plots\]"):
        report.draw(tmp_path)
    assert report.main(argparse.Namespace(run_dir=str(tmp_path))) == 1
    out, err = capsys.readouterr()
    assert out == report.summary(rows) + "\n"  # the summary needs no matplotlib
    assert "rlhf report: " in err and "pip install 'rlhf-pipeline[plots]'" in err
    assert not list(tmp_path.glob("*.png"))
