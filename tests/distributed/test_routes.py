"""The DTensor route "auto" picks (distributed/routes.py), on modelled bytes and flatten time."""

from __future__ import annotations

import pytest

from isoloco_kernels.distributed import routes as R

# llama-1b's matrices, FSDP-sharded on dim 0 (the embedding and head take the Gram, not weighed here)
LLAMA_1B = [(2048, 2048), (8192, 2048), (2048, 8192)]


@pytest.mark.parametrize("shape", LLAMA_1B)
def test_auto_weighs_the_gathers_fewer_bytes_against_its_repeated_flatten(shape):
    # bfloat16 grads on 2 ranks: the owner route sends 1.5× the gather's bytes (results come back
    # in float32) ...
    owner, gather = R.owner_bytes(shape, 0, 2, 2), R.gather_bytes(shape, 0, 2, 2)
    assert owner == pytest.approx(1.5 * gather)
    # ... but every rank would flatten every matrix in the gather: modelled slower, so owner
    assert R.route_seconds("owner", shape, 0, 2, 2) < R.route_seconds("gather", shape, 0, 2, 2)
    assert R.route_for(shape, 0, 2, 2) == "owner"


def test_auto_takes_the_gather_where_it_is_modelled_faster():
    # two rows sharded over 2 ranks: a flatten of next to nothing, so the fewer bytes decide
    assert R.route_seconds("gather", (2, 4096), 0, 2, 2) < R.route_seconds("owner", (2, 4096), 0, 2, 2)
    assert R.route_for((2, 4096), 0, 2, 2) == "gather"
    # float32 grads on 8 ranks: the owner route sends W/2 = 4× fewer bytes and flattens once
    assert R.route_for((2048, 8192), 0, 8, 4) == "owner"
    assert R.route_for((2048, 8192), 0, 2, 2, "gram") == "owner"  # short side sharded: never Gram
