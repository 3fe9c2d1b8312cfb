"""Helpers the study's tests share: a study v3 run record as run_study.py writes it."""

from __future__ import annotations


def study_record(mode, lr, momentum, seed, sel, test, *, outer_s=None, **cell) -> dict:
    """A study v3 run record as run_study.py writes it: K 4, H 30, 10 rounds, bytes, GPT-2 init; `cell`
    overrides its v3 cell (default 16 × 64 bytes, AdamW 3e-3, the tiny model); sel/test: the final
    selection and test losses; outer_s: the outer step's seconds in all (v5 records carry it)."""
    return {
        "study": "v3",
        "mode": mode,
        "outer_lr": lr,
        "outer_momentum": momentum,
        "seed": seed,
        "workers": 4,
        "inner_steps": 30,
        "rounds": 10,
        "vocab": 256,
        "init": "gpt2",
        "final_loss": sel,
        "final_test_loss": test,
        "outer_step_s": outer_s,
        "v3": {"batch": 16, "seq_len": 64, "inner": "adamw", "inner_lr": 3e-3, "model": "tiny", **cell},
    }
