"""The study's run records: one JSON object a line in each question's results/*.jsonl, written by run_study.py.

read_jsonl reads one file; run_key is what makes a run that run (record_of_key, its inverse); results_files lists
every results file of the study in one order and load reads their runs once; plain tells the runs every summary before
study v6 reads.
"""

from __future__ import annotations

import json
from pathlib import Path

#: the study folder: study/<question>/results/*.jsonl are its run records
STUDY = Path(__file__).resolve().parents[1]


def read_jsonl(path: Path) -> list[dict]:
    """The run records of one results file. ValueError naming the file and line for a line that is
    not a JSON object (a run cut off while it was written: delete that line and rerun the job)."""
    out = []
    for i, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path}:{i}: not a JSON record ({e.msg}); a run cut off while it was written? "
                "delete the line and run the job again"
            ) from None
        if not isinstance(r, dict):
            raise ValueError(f"{path}:{i}: a {type(r).__name__}, not a run record (a JSON object)")
        out.append(r)
    return out


def run_key(r: dict) -> tuple:
    """What makes a run the run it is: its config (records from before the selection / test split
    lack eval_split: they were scored on 64 windows over the whole held-out text), and study v3's
    regime settings and outer momentum ("v3")."""
    v3 = r.get("v3")
    return (
        r["seed"],
        r["workers"],
        r["inner_steps"],
        r["mode"],
        r["outer_lr"],
        r.get("study", "v1"),
        r.get("init", "gpt2"),
        r.get("vocab", 256),
        r["rounds"],
        r.get("eval_split", "whole"),
        r.get("eval_windows", 64),
        None if v3 is None else tuple(sorted(v3.items())),
    )


def record_of_key(key: tuple) -> dict:
    """The record fields a run key holds: run_key's inverse (a claim file holds a key, study/.claims)."""
    seed, workers, inner_steps, mode, outer_lr, study, init, vocab, rounds, split, windows, v3 = key
    return dict(seed=seed, workers=workers, inner_steps=inner_steps, mode=mode, outer_lr=outer_lr, study=study,
                init=init, vocab=vocab, rounds=rounds, eval_split=split, eval_windows=windows,
                v3=None if v3 is None else dict(v3))  # fmt: skip


def results_files(study: Path = STUDY) -> list[Path]:
    """Every run-record file of the study in `study`: each question's results/*.jsonl (and any *.jsonl in
    `study` itself: a scratch study's, run_study.study_folder), in the order of their names. That is the order
    the one results folder listed them in before the study was split by question, and it matters: a run two
    processes both executed is kept as first read. Two files of one name would make the order ambiguous."""
    files = sorted([*study.glob("*/results/*.jsonl"), *study.glob("*.jsonl")], key=lambda f: f.name)
    names = [f.name for f in files]
    if len(set(names)) != len(names):
        raise ValueError(f"{study}: two results files share a name: {sorted(n for n in names if names.count(n) > 1)}")
    return files


def load(study: Path = STUDY) -> list[dict]:
    """The runs of every results file of the study (results_files), each once (a run two processes both
    executed is kept as first read)."""
    recs, seen = [], set()
    for f in results_files(study):
        for r in read_jsonl(f):
            k = run_key(r)
            if k not in seen:
                seen.add(k)
                recs.append(r)
    return recs


def plain(r: dict) -> bool:
    """A run at a constant outer schedule with an uncompressed exchange and every worker delivering alike: what every
    study before v6 ran, and all that their summaries (v2 to v5) read. Study v6's scheduled runs and the
    compressed-exchange runs have their own."""
    v3 = r.get("v3") or {}
    return (
        not {"compress", "drop", "faulty", "merge_clip"} & set(v3)
        and v3.get("outer_schedule", "constant") == "constant"
    )
