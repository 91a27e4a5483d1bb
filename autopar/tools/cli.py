"""The ``autopar`` command: plan a model, show a saved plan, compare with baselines, run.

    autopar plan examples/gpt.py:gpt3_175b --world-size 1024 --cluster a100-80g --batch-size 1536
    autopar show plan.json [--html report.html] [--png DIR]
    autopar compare examples/gpt.py:gpt2_small --world-size 64 [--html report.html]
    autopar explain examples/gpt.py:gpt2_small --world-size 64 [--why-not tp=8 ...]
    autopar explain plan.json [--model SPEC --why-not PIN ...]
    autopar diff a.json b.json
    autopar run examples/train_gpt.py --nproc 2 -- --steps 20
    autopar verify examples/gpt.py:gpt_tiny --world-size 2 --pin tp=2
    autopar calibrate --nproc 2 -o cluster.json
    autopar tune examples/gpt.py:gpt_tiny --nproc 2 -o plan.json --report tune.json --cluster-out tuned.json

Exit codes: 0 done; 1 ``verify`` found a difference above 1e-5 (in fp32, and its float64 re-run above 1e-10)
or one of its ranks crashed (that rank's error and file:line on stderr), or a ``run`` process failed; 2 bad
input (also a ``run`` whose failed ranks all exited with 2, the script's own bad-input code) (one ``autopar:
error: …`` line on stderr, no traceback); 3 no feasible plan; 130 interrupted (``calibrate`` then writes
nothing). Torch is imported only by commands that capture a model, so ``show`` starts in a fraction of a
second.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any, NoReturn

from autopar import quiet
from autopar.errors import AutoparError, InfeasibleError
from autopar.tools import startup
from autopar.tools.compare_table import compare_rows, render_compare
from autopar.units import device_noun

if TYPE_CHECKING:
    from autopar.graph import LayerGraph

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INFEASIBLE = 0, 1, 2, 3
# the cluster plan, compare and explain price on without --cluster: autopar.planning.api.DEFAULT_CLUSTER (not
# imported here: the parser is built before the planner, and `show` never imports it)
PLAN_CLUSTER = "a100-80g"


class _UsageError(Exception):
    """argparse's complaint, raised instead of printing usage and exiting."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{message} (see `{self.prog} --help`)")


# ------------------------------------------------------------------ output


def _out(text: str) -> None:
    sys.stdout.write(text + "\n")


def _err(message: str) -> None:
    """One line on stderr, whatever the message holds."""
    sys.stderr.write("autopar: error: " + " ".join(str(message).split()) + "\n")


# ------------------------------------------------------------------ arguments


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


def _parser() -> argparse.ArgumentParser:
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


# ------------------------------------------------------------------ commands


def _load(args: argparse.Namespace, device: str = "meta") -> tuple[Any, Any]:
    """The SPEC's ``(model, example_inputs)`` (this is where torch gets imported).

    ``meta`` for planning; a spec function without a ``device`` parameter is
    then built under ``torch.device("meta")``, so it allocates nothing.
    """
    from autopar.tools import hf_spec
    from autopar.tools.spec import load_spec

    if hf_spec.is_config_spec(args.spec):  # a config.json: planning's example batch may be the global one
        batch = args.batch_size if device == "meta" else None
        loaded = load_spec(args.spec, seq_len=args.seq_len, device=device, batch=batch)
        note = hf_spec.describe(args.spec, args.seq_len, batch)
        if note:
            sys.stderr.write(note + "\n")
        return loaded
    return load_spec(args.spec, seq_len=args.seq_len, device=device)


def _capture(args: argparse.Namespace, model: Any, inputs: Any) -> LayerGraph:
    from autopar.capturing import capture
    from autopar.tools import hf_spec

    startup.resume()  # the libraries are imported and the model built

    name = hf_spec.model_name(args.spec) if hf_spec.is_config_spec(args.spec) else args.spec.rpartition(":")[2]
    return capture(model, inputs, name=name)


def _graph(args: argparse.Namespace, device: str = "meta") -> LayerGraph:
    """Load the SPEC and capture it."""
    return _capture(args, *_load(args, device))


def _solve_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Keywords of :func:`autopar.solve`, with the cheap checks done before torch is imported.

    A typo in ``--cluster`` or ``--pin`` then fails in a fraction of a second
    instead of after the seconds that loading and capturing the model take.
    """
    from autopar.pins import Pins
    from autopar.planning.api import memory_budget, resolve_cluster

    cluster = resolve_cluster(args.cluster, args.world_size, nodes=args.nodes)
    memory_budget(cluster, args.memory_gb)
    pins = Pins.parse(args.pin)
    pins.check_form()
    return dict(cluster=cluster, nodes=args.nodes, global_batch=args.batch_size, dtype=args.dtype,
                memory_gb=args.memory_gb, pins=pins, time_limit_s=args.time_limit)


def _float8(args: argparse.Namespace, model: Any, graph: LayerGraph) -> Any:
    """The plan's float8 linears by the default rule (``--float8``), or None."""
    if args.float8 is None:
        return None
    from autopar.float8 import settings_for

    return settings_for(model, graph, args.float8)


def _cmd_plan(args: argparse.Namespace) -> int:
    from autopar.planning.api import solve

    kwargs = _solve_kwargs(args)
    model, inputs = _load(args)
    graph = _capture(args, model, inputs)
    plan = solve(graph, args.world_size, **kwargs, compiled=args.compile, float8=_float8(args, model, graph))
    if args.output:  # written first, so an unwritable path fails before any output
        plan.save(args.output)
    _out(plan.to_json() if args.json else plan.summary())
    if args.output and not args.json:
        _out(f"\nplan written to {args.output}")
    return EXIT_OK


def _cmd_show(args: argparse.Namespace) -> int:
    from pathlib import Path

    from autopar.plan import Plan
    from autopar.tools.hf_spec import is_config_spec
    from autopar.tools.tune.picture import is_report

    if Path(args.plan).is_file() and is_report(args.plan):  # a tune report: its picture (autopar.tools.tune)
        from autopar.tools.tune.command import show

        return show(args)
    if Path(args.plan).exists() and is_config_spec(args.plan):
        raise AutoparError(f"{args.plan} is a model, not a saved plan: plan it first "
                           f"(autopar plan {args.plan} --world-size N -o plan.json), then show plan.json")
    plan = Plan.load(args.plan)
    if args.html or args.png:  # refused before anything is printed if the plan cannot be drawn
        from autopar.tools import pictures

        pictures.require_details(plan)
    _out(plan.to_json() if args.json else plan.summary())
    if args.html:
        pictures.write_html(args.html, pictures.plan_html(plan))
        _note(args.json, f"report written to {args.html}")
    if args.png:
        paths = pictures.write_pngs(plan, args.png)
        _note(args.json, "pictures written to " + ", ".join(str(p) for p in paths))
    return EXIT_OK


def _note(quiet: bool, text: str) -> None:
    """Where files went: on stdout after a table, on stderr after JSON (which must stay parseable)."""
    if quiet:
        sys.stderr.write(text + "\n")
    else:
        _out("\n" + text)


def _cmd_compare(args: argparse.Namespace) -> int:
    from autopar.planning.api import compare

    kwargs = _solve_kwargs(args)
    chosen, baselines = compare(_graph(args), args.world_size, **kwargs)
    rows = compare_rows(chosen, baselines)
    table = render_compare(rows, device=device_noun(kwargs["cluster"]))
    _out(json.dumps(rows, indent=2) if args.json else table)
    if args.html:
        from autopar.tools import pictures

        drawn = [(r.name, r.plan) for r in (chosen, *baselines) if r.plan is not None and r.same_as is None]
        pictures.write_html(args.html, pictures.compare_html(table, drawn))
        _note(args.json, f"report written to {args.html}")
    if not chosen.fits:
        _err(chosen.reason)
        return EXIT_INFEASIBLE
    return EXIT_OK


def _cmd_run(args: argparse.Namespace) -> int:
    from pathlib import Path

    if args.nproc < 1:
        raise AutoparError(f"--nproc must be at least 1, got {args.nproc}")
    if not Path(args.script).is_file():
        raise AutoparError(f"script {args.script!r} does not exist")
    if args.max_restarts < 0:
        raise AutoparError(f"--max-restarts must be at least 0, got {args.max_restarts}")
    import os

    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from autopar.runtime.launch import bad_input_only, describe_failures

    # every rank runs the script through autopar.runtime.entry: its error is recorded for the
    # report below, and its process groups are shut down before the interpreter finalizes.
    # Restarted ranks sharing the agent's store read the failed attempt's gloo addresses
    # ("connectFullMesh failed ... Connection refused"; pytorch/pytorch#135712): a store of their own.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    from autopar.runtime.compiled import COMPILE_ENV
    from autopar.runtime.float8 import FLOAT8_ENV

    before = {k: os.environ.get(k) for k in (COMPILE_ENV, FLOAT8_ENV)}
    if args.compile:  # read by the ranks' autopar.compile when torch_compile is not given
        os.environ[COMPILE_ENV] = "1"
    if args.float8:  # read by the ranks' autopar.compile when float8 is not given
        os.environ[FLOAT8_ENV] = args.float8
    try:
        torchrun.main(["--standalone", "--nproc-per-node", str(args.nproc), "--max-restarts",
                       str(args.max_restarts), "-m", "autopar.runtime.entry", args.script, *args.args])
    except ChildFailedError as exc:
        _err(describe_failures(args.script, exc.failures, args.nproc))
        return EXIT_BAD_INPUT if bad_input_only(exc.failures) else EXIT_FAILED
    finally:  # this process's environment as it was (main() may be called again, as the tests do)
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return EXIT_OK


def _cmd_verify(args: argparse.Namespace) -> int:
    """Build the SPEC for real, dropout off; solve (or load) the plan; run it; compare.

    A crash on a rank is a finding: exit 1 with that rank's error and where
    it was raised (its traceback above). Bad input stays exit 2.
    """
    from autopar.plan import Plan
    from autopar.tools import verify as v

    if args.steps < 1:
        raise AutoparError(f"--steps must be at least 1, got {args.steps}")
    plan = Plan.load(args.plan) if args.plan is not None else None
    if plan is not None and plan.world_size != args.world_size:
        raise AutoparError(f"plan {args.plan!r} is for {plan.world_size} ranks, not --world-size "
                           f"{args.world_size}")
    kwargs = _solve_kwargs(args) if plan is None else {}
    from autopar.admission import Here, admit

    # what the gloo ranks are and are asked: a plan that would not run there is refused before the model is built
    here = Here(world_size=args.world_size, torch_compile=True if args.compile else None, float8=args.float8)
    if plan is not None:
        admit(None, plan, here)
    model, inputs = _load(args, device="cpu")
    dropout = v.disable_dropout(model)
    v.loss_function(args.loss)  # a --loss that does not load, or an output no default loss fits: bad input
    loss = v.loss_line(model, inputs, args.loss)
    graph = _capture(args, model, inputs)
    warnings = [v.RANDOM_FORWARD] if v.forward_is_random(model, inputs) else []
    if plan is not None:
        plan.check_fingerprint(graph.fingerprint())
    else:
        from autopar.planning.api import solve

        kwargs["cluster"] = kwargs["cluster"] if args.cluster else "cpu"
        kwargs["global_batch"] = args.batch_size or v.example_batch(inputs)
        plan = solve(graph, args.world_size, **kwargs, compiled=args.compile,
                     float8=_float8(args, model, graph))
    admit(graph, plan, here)  # with the model's layers: what a pin left possible that the ranks do not run
    warnings = v.plan_warnings(plan, model) + warnings
    if not args.json:
        _out("\n".join(v.setup_lines(plan, dropout, warnings, loss, graph)))
    try:
        report = v.verify(args.spec, plan.to_json(), graph.to_dict(), steps=args.steps, seq_len=args.seq_len,
                          loss=args.loss)
    except v.VerifyFailure as exc:
        if args.json:
            _out(json.dumps(v.result_json(plan, dropout, warnings, failure=exc, loss=loss,
                                          tolerance=v.tolerance_for(plan)), indent=2))
        elif isinstance(exc, v.RankFailedError) and exc.traceback:
            sys.stderr.write(f"rank {exc.rank}'s traceback:\n{exc.traceback}")
        _err(str(exc))
        return EXIT_FAILED
    from autopar.tools import rounding

    bar, wide = v.tolerance_for(plan), None
    if not args.json:
        _out("\n".join(v.result_lines(report, bar)))
    if rounding.rechecks(report, bar, plan):  # rounding or the plan: the same run in float64 tells
        sys.stderr.write("note: fp32 missed the bar: the plan runs again in float64 on both sides\n")
        try:
            wide = v.verify(args.spec, plan.to_json(), graph.to_dict(), steps=args.steps, seq_len=args.seq_len,
                            loss=args.loss, float64=True)
        except v.VerifyFailure as exc:  # a model that does not run in float64: the fp32 result stands
            sys.stderr.write(f"note: the float64 re-run failed ({' '.join(str(exc).split())[:200]})\n")
    if args.json:
        _out(json.dumps(v.result_json(plan, dropout, warnings, report, loss=loss, tolerance=bar, float64=wide),
                        indent=2))
    else:
        _out("\n".join(rounding.lines(report, wide, bar)))
    return EXIT_FAILED if rounding.verdict(report, wide, bar) == "DIFFERENT" else EXIT_OK


def _cmd_explain(args: argparse.Namespace) -> int:
    from pathlib import Path

    from autopar.plan import Plan
    from autopar.tools.explain import explain
    from autopar.tools.hf_spec import is_config_spec

    if not (Path(args.spec).exists() and is_config_spec(args.spec)) and (args.spec.endswith(".json") or
                                          (":" not in args.spec and Path(args.spec).is_file())):  # a saved plan
        plan, graph = Plan.load(args.spec), None
        _refuse_problem_options(args, plan)
        if args.why_not:
            if args.model is None:
                raise AutoparError("--why-not against a saved plan solves again, which needs its model: add "
                                   "--model SPEC")
            graph = _graph(argparse.Namespace(**{**vars(args), "spec": args.model}))
    else:
        if args.world_size is None:
            raise AutoparError("explaining a SPEC needs --world-size N (or give a saved plan)")
        from autopar.planning.api import solve

        kwargs = _solve_kwargs(args)
        graph = _graph(args)
        plan = solve(graph, args.world_size, **kwargs, compiled=args.compile)
    result = explain(plan, graph, args.why_not, time_limit_s=args.time_limit)
    _out(json.dumps(result.to_dict(), indent=2) if args.json else result.render())
    return EXIT_OK


def _refuse_problem_options(args: argparse.Namespace, plan: Any) -> None:
    """A plan file fixes the problem; an option that would change it is a mistake, not a wish."""
    given = [flag for flag, value in (("--world-size", args.world_size), ("--cluster", args.cluster),
                                      ("--nodes", args.nodes), ("--batch-size", args.batch_size),
                                      ("--memory-gb", args.memory_gb), ("--pin", args.pin or None),
                                      ("--seq-len", args.seq_len if args.model is None else None),
                                      ("--compile", True if getattr(args, "compile", False) else None))
             if value is not None]
    if given:
        raise AutoparError(f"{', '.join(given)}: a saved plan brings its own problem ({plan.world_size} ranks on "
                           f"{plan.cluster.name}, batch {plan.training.global_batch}); leave them out, or explain "
                           "the SPEC with them")


def _cmd_diff(args: argparse.Namespace) -> int:
    from autopar.plan import Plan
    from autopar.tools.diff import diff_plans

    result = diff_plans(Plan.load(args.a), Plan.load(args.b), args.a, args.b)
    _out(json.dumps(result.to_dict(), indent=2) if args.json else result.render())
    return EXIT_OK


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from autopar.tools.calibrate import CalibrationInterrupted, calibrate, describe

    if args.from_metrics or args.nproc is None:  # --nproc is required unless the figures come from a run
        from autopar.tools.tune.command import from_metrics

        return from_metrics(args)

    try:  # calibrate() refuses a bad -o or process count before any rank starts
        cluster = calibrate(args.nproc, args.output, backend=args.backend, name=args.name,
                            quick=args.quick)
    except CalibrationInterrupted as exc:
        _err(str(exc))
        return 130
    sys.stderr.write(describe(cluster) + "\n")
    if args.output:
        sys.stderr.write(f"cluster written to {args.output}; plan with --cluster {args.output}\n")
    else:
        _out(json.dumps(cluster.to_dict(), indent=2))
    return EXIT_OK


def _cmd_tune(args: argparse.Namespace) -> int:
    from autopar.tools.tune.command import run

    return run(args)


_COMMANDS = {"plan": _cmd_plan, "show": _cmd_show, "compare": _cmd_compare, "run": _cmd_run,
             "verify": _cmd_verify, "calibrate": _cmd_calibrate, "explain": _cmd_explain, "diff": _cmd_diff,
             "tune": _cmd_tune}


def main(argv: list[str] | None = None) -> int:
    """Run one command; bad input is one stderr line and exit 2, no feasible plan exit 3."""
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        # `autopar run SCRIPT --nproc N -- ARGS`: argparse's subparsers mishandle `--`, so split here
        rest = argv[argv.index("--") + 1:] if "--" in argv else []
        argv = argv[: argv.index("--")] if "--" in argv else argv
        try:
            args = _parser().parse_args(argv)
        except SystemExit as exc:  # --help and --version: argparse has printed them
            return int(exc.code or 0)
        if rest and args.command != "run":
            raise _UsageError(f"only `autopar run` takes arguments after --, got {' '.join(rest)}")
        if args.command == "run":
            args.args = [*args.args, *rest]
        with quiet.cli_filters(args.verbose):
            return _COMMANDS[args.command](args)
    except InfeasibleError as exc:
        _err(str(exc))
        return EXIT_INFEASIBLE
    except (AutoparError, _UsageError) as exc:  # CostModelError and ClusterError are AutoparErrors
        _err(str(exc))
        return EXIT_BAD_INPUT
    except OSError as exc:  # a missing or unwritable file named on the command line
        _err(f"{exc.strerror or exc}: {exc.filename}" if exc.filename else str(exc))
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        _err("interrupted")
        return 130


# Commands that only read and write files: once their output is flushed, nothing is left for the interpreter's
# teardown but freeing the model and graph (0.5-1 s of a 10 s `autopar plan`); these skip it.
_FAST_EXIT = frozenset({"plan", "show", "compare", "explain", "diff"})


def console() -> None:
    """The ``autopar`` console script: :func:`main`, then exit — at once after a :data:`_FAST_EXIT` command."""
    argv = sys.argv[1:]
    fast = bool(argv) and argv[0] in _FAST_EXIT
    if fast:
        startup.pause()  # until _capture: what the imports leave is not scanned again and again
    code = main(argv)
    if fast:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    console()
