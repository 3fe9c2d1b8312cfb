"""The reference loop's CLI (train/cli.py): a combination it cannot run is refused before any training."""

from __future__ import annotations

import pytest

# -- 5. the CLI checks every combination before any training -------------------------------------------


CLI_SMALL = "-H 2 -R 1 --batch 2 --seq-len 16 --eval-windows 8 --max-bytes 60000 --quiet --threads 1".split()


def test_merge_with_no_merging_mode_is_refused_before_training(capsys, tmp_path):
    from isoloco_kernels.train.cli import main

    with pytest.raises(SystemExit) as e:
        main(CLI_SMALL + ["--mode", "ddp,diloco", "--merge", "tsv", "--out", str(tmp_path)])
    assert e.value.code == 2 and "--merge tsv applies to the Iso-C modes" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


@pytest.mark.parametrize("flag", [["--compress", "int4"], ["--outer-schedule", "warmup-cosine"]], ids=lambda f: f[0])
def test_an_outer_option_for_ddp_alone_is_refused_before_training(capsys, tmp_path, flag):
    """--compress and --outer-schedule shape the outer step; DDP has none, so giving them is a mistake, said at once."""
    from isoloco_kernels.train.cli import main

    with pytest.raises(SystemExit) as e:
        main(CLI_SMALL + ["--mode", "ddp", *flag, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{flag[0]} {flag[1]} applies to the modes with an outer step" in err, err
    assert not (tmp_path / "results.json").exists()
