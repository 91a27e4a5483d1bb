"""What the ``autopar`` command line takes: every verb's options, their defaults and help (parsing only;
:mod:`autopar.tools.cli` runs the verbs). Light to import: ``show`` parses its line before any planner loads."""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

# the cluster plan, compare and explain price on without --cluster: autopar.planning.api.DEFAULT_CLUSTER (not
# imported here: the parser is built before the planner, and `show` never imports it)
PLAN_CLUSTER = "a100-80g"


class UsageError(Exception):
    """argparse's complaint, raised instead of printing usage and exiting."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see `{self.prog} --help`)")




def _add_problem_args(p: argparse.ArgumentParser) -> None:
    """Options shared by ``plan`` and ``compare``: the model, the cluster, the training step."""
    p.add_argument("spec", metavar="SPEC",
                   help="FILE.py:FUNCTION or MODULE:FUNCTION returning (model, inputs), or a Hugging Face "
                        "config.json or model directory")
    p.add_argument("--world-size", type=int, required=True, metavar="N", help="number of devices (ranks)")
    p.add_argument("--cluster", default=None, metavar="NAME|FILE",
                   help="preset name (a100-80g, h100-80g, cpu, …) or a .json/.toml cluster file (default: "
                        f"{PLAN_CLUSTER}, whichever machine runs autopar)")
    p.add_argument("--nodes", type=int, default=None, metavar="K", help="spread the ranks over K nodes")
    p.add_argument("--batch-size", type=int, default=None, metavar="B",
                   help="global batch in samples per step (default: world size)")
    p.add_argument("--seq-len", type=int, default=None, metavar="S", help="passed to the spec function")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="training precision (default: bf16)")
    p.add_argument("--memory-gb", type=float, default=None, metavar="X",
                   help="per-rank memory budget in GiB (default: device memory less the reserve)")
    p.add_argument("--pin", action="append", default=[], metavar="K=V",
                   help="fix part of the plan, e.g. tp=8 or 'blocks.*:zero=3' (repeatable)")
    p.add_argument("--time-limit", type=float, default=30.0, metavar="S", help="solver time limit in seconds")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _add_float8(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--float8", nargs="?", const="tensorwise", choices=("tensorwise", "rowwise"), default=None,
                   metavar="RECIPE", help=help)


def parser() -> argparse.ArgumentParser:
    from autopar import __version__

    parser = _Parser(prog="autopar", description="Plan how to parallelise a PyTorch model's training.")
    parser.add_argument("--version", action="version", version=f"autopar {__version__}")
    _add_verbose(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    plan = sub.add_parser("plan", help="find the fastest plan that fits",
                          description=f"Find the fastest plan that fits, priced on {PLAN_CLUSTER} unless --cluster "
                                      "names another cluster.")
    _add_problem_args(plan)
    plan.add_argument("-o", "--output", default=None, metavar="PLAN.json", help="write the plan as JSON")
    plan.add_argument("--compile", action="store_true",
                      help="price each block under torch.compile (plans the compiled runtime runs only)")
    _add_float8(plan, "float8 matmuls (torchao) for the blocks' linears, tensorwise (default) or rowwise "
                      "scaling; needs a device with float8 (SM 8.9+), emulated on cpu")
    show = sub.add_parser("show", help="print a saved plan")
    show.add_argument("plan", metavar="PLAN.json")
    show.add_argument("--json", action="store_true", help="print the plan's JSON")
    _add_picture_args(show)
    compare = sub.add_parser("compare", help="the chosen plan beside DDP, ZeRO and Megatron baselines")
    _add_problem_args(compare)
    compare.add_argument("--html", default=None, metavar="REPORT.html",
                         help="also draw every fitting row's timeline, memory and layers in one HTML file")
    _add_explain_and_diff(sub)
    run = sub.add_parser("run", help="launch a training script on N local processes (torchrun)")
    run.add_argument("script", metavar="SCRIPT")
    run.add_argument("--nproc", type=int, required=True, metavar="N", help="processes (ranks) to start")
    run.add_argument("--max-restarts", type=int, default=0, metavar="R",
                     help="restart every rank up to R times when one fails (torchrun's elastic agent)")
    run.add_argument("args", nargs="*", metavar="ARGS", help="the script's arguments (after --)")
    run.add_argument("--compile", action="store_true",
                     help="torch.compile each block: the script's autopar.compile defaults to torch_compile=True")
    _add_float8(run, "float8 linears: the script's autopar.compile defaults to float8=RECIPE")
    verify = sub.add_parser("verify", help="run a plan on N gloo processes against one process",
                            description="Run a plan on N local gloo processes against one process, in fp32; the "
                                        "plan is solved for the cpu cluster unless --cluster or --plan says "
                                        "otherwise.")
    _add_problem_args(verify)
    verify.add_argument("--plan", default=None, metavar="PLAN.json", help="verify this plan (else solve)")
    verify.add_argument("--steps", type=int, default=3, metavar="K", help="SGD steps to compare")
    verify.add_argument("--compile", action="store_true",
                        help="plan priced compiled, each block run under torch.compile (DDP, ZeRO and pipeline plans)")
    _add_float8(verify, "plan and run the blocks' linears in float8 (torchao's CPU emulation), against one "
                        "process converted alike")
    verify.add_argument("--loss", default=None, metavar="FILE.py:FUNCTION",
                        help="loss_fn(output, targets) for both sides (default: the one that fits the output)")
    verify.set_defaults(dtype="fp32")
    for action in verify._actions:  # verify's own defaults: the batch of the example inputs, this machine's CPUs
        if action.dest == "batch_size":
            action.help = "global batch in samples per step (default: the example inputs' batch)"
        if action.dest == "cluster":
            action.help = ("preset name or cluster file the plan is solved for (default: cpu, the gloo processes "
                           "verify runs here; --plan's own cluster when given)")
        if action.dest == "dtype":
            action.help = "precision the plan is priced in (default: fp32, the precision verify runs in)"
    calibrate = sub.add_parser("calibrate", help="measure this machine and write a cluster file")
    calibrate.add_argument("--nproc", type=int, required=True, metavar="N",
                           help="ranks to measure with, started together as training starts them")
    calibrate.add_argument("-o", "--output", default=None, metavar="CLUSTER.json",
                           help="write the cluster file here (default: print its JSON)")
    calibrate.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                           help="process group backend (auto: NCCL when there is a GPU per rank)")
    calibrate.add_argument("--name", default=None,
                           help="the cluster's name (default: the -o file's stem, else HOST-BACKEND-xN)")
    calibrate.add_argument("--quick", action="store_true",
                           help="fewer sizes and repetitions: rougher figures, faster (6-9 s with 2 ranks on 2 cores)")
    from autopar.tools.tune import command as tune_command  # no heavy imports: its search loads when it runs

    tune_command.add_metrics_arguments(calibrate)
    tune = sub.add_parser("tune", help="measure the best candidates here, refit the cluster, keep the fastest")
    _add_problem_args(tune)
    tune_command.add_arguments(tune)
    for command in sub.choices.values():  # after the verb too: `autopar plan … -v`
        _add_verbose(command, default=argparse.SUPPRESS)
    return parser


def _add_verbose(p: argparse.ArgumentParser, default: object = False) -> None:
    p.add_argument("-v", "--verbose", action="store_true", default=default,
                   help="also show the libraries' own warnings that autopar hides (torchao's kernels that do not "
                        "load on this machine, torch's notes to torchao), here and on the ranks it starts")


def _add_picture_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--html", default=None, metavar="REPORT.html",
                   help="draw the pipeline timeline, memory per rank and layer strip in one self-contained HTML file")
    p.add_argument("--png", default=None, metavar="DIR", help="draw them as timeline/memory/layers.png in DIR")


def _add_explain_and_diff(sub: Any) -> None:
    explain = sub.add_parser("explain", help="why this plan: its runners-up or counterfactuals beside it")
    _add_problem_args(explain)
    for action in explain._actions:  # a plan file brings its own problem: no world size needed then
        if action.dest == "world_size":
            action.required, action.default = False, None
        if action.dest == "spec":
            action.metavar, action.help = "SPEC|PLAN.json", "a model SPEC to plan, or a saved plan"
    explain.add_argument("--why-not", action="append", default=[], metavar="PIN",
                         help="a counterfactual: pins (space-separated) added to the plan's, solved again "
                              "(repeatable); compile=off / compile=on: the plan itself priced eager / compiled")
    explain.add_argument("--compile", action="store_true",
                         help="plan the SPEC priced compiled (each block under torch.compile), as plan --compile")
    explain.add_argument("--model", default=None, metavar="SPEC",
                         help="the plan file's model, needed to solve --why-not counterfactuals of a saved plan")
    diff = sub.add_parser("diff", help="two plans of one model side by side")
    diff.add_argument("a", metavar="A.json")
    diff.add_argument("b", metavar="B.json")
    diff.add_argument("--json", action="store_true", help="print JSON instead of a table")
