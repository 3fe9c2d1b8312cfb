"""DiLoCo in one process: K simulated workers each take H inner AdamW steps on their own data, then
one outer step on the averaged pseudo-gradient Δ = mean_k(θ − θ_k), with torch.optim.SGD (DiLoCo)
or IsoLoCo. A small MLP learns the classes a fixed random teacher gives, on a CPU; shows its progress.

    python examples/diloco_minimal.py --rounds 30 --workers 4 --inner 20
"""

import argparse
import copy
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from isoloco_kernels import IsoLoCo

torch.manual_seed(0)
TEACHER = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8)).requires_grad_(False)
X_TEST = torch.randn(2048, 32)
label = lambda x: TEACHER(x).argmax(-1)  # the class the teacher gives
say = partial(print, flush=True)  # progress shows at once, also when the output is piped


def train(make_outer, rounds: int, workers: int = 4, inner: int = 20, seed: int = 0, log=say) -> float:
    """Held-out cross-entropy after `rounds` DiLoCo rounds with make_outer(params); logs every 5th round."""
    torch.manual_seed(seed)  # the same init and data for every outer optimizer
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 8))
    outer = make_outer(model.parameters())
    replicas = [copy.deepcopy(model) for _ in range(workers)]
    inner_opts = [torch.optim.AdamW(r.parameters(), lr=3e-3) for r in replicas]  # kept across rounds
    for rnd in range(1, rounds + 1):
        for replica, opt in zip(replicas, inner_opts):
            replica.load_state_dict(model.state_dict())  # every round starts from the global weights
            for _ in range(inner):
                x = torch.randn(16, 32)  # each worker draws its own batches
                loss = F.cross_entropy(replica(x), label(x))
                opt.zero_grad()
                loss.backward()
                opt.step()
        for p, *local in zip(model.parameters(), *(r.parameters() for r in replicas)):
            p.grad = torch.stack([p.detach() - q.detach() for q in local]).mean(0)  # global − local
        outer.step()
        outer.zero_grad()
        _ = rnd % 5 and rnd < rounds or log(f"  round {rnd}/{rounds}")  # progress, and the last round
    with torch.no_grad():
        return F.cross_entropy(model(X_TEST), label(X_TEST)).item()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, default in (("--rounds", 30), ("--workers", 4), ("--inner", 20)):
        ap.add_argument(flag, type=int, default=default)
    a = ap.parse_args()
    for name, make in (
        ("DiLoCo  (SGD lr 0.7, momentum 0.9)", partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)),
        ("IsoLoCo (lr 1.8, momentum 0.8)", partial(IsoLoCo, lr=1.8, momentum=0.8, nesterov=True)),
    ):
        say(name)
        print(f"{name}: held-out loss {train(make, a.rounds, a.workers, a.inner):.5f}")
