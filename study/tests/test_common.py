"""The study's shared code (study/common): which files are run records, in which order, and which study an
--out file of the runner belongs to."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from study import run_study
from study.common.records import STUDY, load, results_files


def _write(path: Path, *seeds: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rec = {"workers": 4, "inner_steps": 30, "mode": "diloco", "outer_lr": 0.7, "rounds": 10}
    path.write_text("".join(json.dumps({**rec, "seed": s, "source": path.name}) + "\n" for s in seeds))


def test_results_are_every_questions_files_in_the_order_of_their_names(tmp_path):
    _write(tmp_path / "b_question" / "results" / "a.jsonl", 0)
    _write(tmp_path / "a_question" / "results" / "c.jsonl", 0, 1)  # seed 0 again: a.jsonl's is read first
    _write(tmp_path / "a_question" / "results" / "b.jsonl", 2)
    _write(tmp_path / "a_question" / "results" / "spectra" / "s.jsonl", 9)  # a subfolder holds no run records
    assert [f.name for f in results_files(tmp_path)] == ["a.jsonl", "b.jsonl", "c.jsonl"]
    assert [(r["seed"], r["source"]) for r in load(tmp_path)] == [(0, "a.jsonl"), (2, "b.jsonl"), (1, "c.jsonl")]


def test_two_results_files_of_one_name_are_refused(tmp_path):
    _write(tmp_path / "a" / "results" / "x.jsonl", 0)
    _write(tmp_path / "b" / "results" / "x.jsonl", 1)
    with pytest.raises(ValueError, match="x.jsonl"):
        results_files(tmp_path)


def test_the_committed_results_keep_one_name_each():
    files = results_files(STUDY)
    assert files and len({f.name for f in files}) == len(files)
    assert all(f.parent.name == "results" and f.parent.parent.parent == STUDY for f in files)


def test_an_out_file_belongs_to_its_study(tmp_path):
    assert run_study.study_folder(STUDY / "horizon" / "results" / "v6_horizon.jsonl") == STUDY
    assert run_study.study_folder(tmp_path / "r.jsonl") == tmp_path  # anywhere else: a scratch study of its own
    _write(tmp_path / "r.jsonl", 0)
    assert [f.name for f in results_files(tmp_path)] == ["r.jsonl"]


def test_record_of_key_inverts_run_key():
    from study.common.records import record_of_key, run_key
    from study.tests.helpers import study_record

    v3 = study_record("diloco", 0.7, 0.8, 1, 1.5, 1.4, batch=4, mu=0.8) | {"eval_split": "halves"}
    v3["v3"]["outer_schedule"] = "momentum-warmup"
    v1 = {"seed": 2, "workers": 4, "inner_steps": 30, "mode": "isoloco", "outer_lr": 1.8, "rounds": 10}
    for r in (v3, v1):
        back = record_of_key(run_key(r))
        assert run_key(back) == run_key(r)
        assert (back["seed"], back["mode"], back["outer_lr"], back["v3"]) == (
            r["seed"],
            r["mode"],
            r["outer_lr"],
            r.get("v3"),
        )
