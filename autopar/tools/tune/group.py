"""``autopar tune`` under an outside ``torchrun`` (one node or many): rank 0 leads, the others follow.

    torchrun --nnodes 2 --nproc-per-node 8 … -m autopar.tools.cli tune SPEC -o plan.json …

Every rank runs the command. Rank 0 captures the model, plans, refits and writes the outputs,
exactly as a spawned tune does; whenever candidates are to be measured it broadcasts them (JSON
text in a byte tensor: nothing is unpickled) and every rank runs them together
(:func:`.ranks.run_candidates`, whose decisions are rank 0's too). A last empty message sends the
followers home. A candidate that kills a rank ends the job here (torchrun's agent stops the
others): there is no parent to start the rest again, as a spawned tune has.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

from autopar.tools.tune.ranks import _Group, probe_machine, run_candidates


def _share(group: _Group, text: str | None) -> str:
    """Rank 0's ``text`` on every rank (the others pass None)."""
    torch = group.torch
    data = (text or "").encode() if group.rank == 0 else b""
    size = int(group.decide(float(len(data))))
    if size == 0:
        return ""
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).clone() if group.rank == 0
           else torch.empty(size, dtype=torch.uint8))
    buf = buf.to(group.device)
    group.dist.broadcast(buf, src=0)
    return bytes(buf.cpu().tolist()).decode()


class _Leader:
    """Rank 0's measure function: broadcast the candidates, then run them beside the followers."""

    def __init__(self, group: _Group, args: argparse.Namespace, prob: Any, deadline: float | None) -> None:
        self.group, self.args, self.prob, self.deadline = group, args, prob, deadline

    def __call__(self, plans: list[tuple[int, str]], probe: bool, cands: list[Any]) -> tuple[list[Any], Any]:
        from autopar.tools.tune.search import describe_progress, fit_together

        together = fit_together(cands, plans)
        message = {"spec": self.prob.spec, "seq_len": self.prob.seq_len, "plans": plans,
                   "graph": self.prob.graph.to_dict(), "steps": self.args.steps, "warmup": self.args.warmup,
                   "deadline": self.deadline, "probe": probe, "together": together}
        _share(self.group, json.dumps(message))
        start, done = describe_progress(cands, lambda: len(cands))
        return _measure(self.group, message, start, done)


def _measure(group: _Group, m: dict[str, Any], start: Any = None, done: Any = None) -> tuple[list[Any], Any]:
    probes = probe_machine(group.dist.get_backend()) if m["probe"] else None
    results = run_candidates(m["spec"], m["seq_len"], [tuple(p) for p in m["plans"]], m["graph"],
                             steps=m["steps"], warmup=m["warmup"], deadline=m["deadline"], together=m["together"],
                             on_start=start, on_done=done)
    return results, probes


def run_under_torchrun(args: argparse.Namespace, nproc: int, problem: Callable[..., Any], tune: Callable[..., Any],
                       write: Callable[..., int]) -> int:
    """Join torchrun's process group; lead on rank 0 (``problem``, ``tune`` and ``write``, the CLI's own
    steps: :mod:`.command`), follow elsewhere."""
    import torch
    import torch.distributed as dist

    from autopar.quiet import QUIET_ENV
    from autopar.tools.host import threads_per_process
    from autopar.tools.tune.launch import KINETO_LOG_ENV

    if os.environ.get(QUIET_ENV) == "1":  # the profiler's own lines, off as in spawned ranks (.launch)
        os.environ.setdefault(KINETO_LOG_ENV, "10")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(threads_per_process(nproc))
    dist.init_process_group(backend)
    group = _Group()
    try:
        if group.rank != 0:
            while True:
                text = _share(group, None)
                if not text:
                    return 0
                _measure(group, json.loads(text))
        try:
            prob = problem(args, nproc)
            deadline = None if args.budget_s is None else time.time() + args.budget_s
            result = tune(args, prob, _Leader(group, args, prob, deadline))
        finally:
            _share(group, "")  # the followers go home, whatever happened here
        return write(args, result)
    finally:
        dist.destroy_process_group()
