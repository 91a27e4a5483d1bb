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
from typing import TYPE_CHECKING, Any

from autopar import quiet
from autopar.errors import AutoparError, InfeasibleError
from autopar.tools import startup
from autopar.tools.cli_args import UsageError, parser
from autopar.tools.compare_table import compare_rows, render_compare
from autopar.units import device_noun

if TYPE_CHECKING:
    from autopar.graph import LayerGraph

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INFEASIBLE = 0, 1, 2, 3


# ------------------------------------------------------------------ output


def _out(text: str) -> None:
    sys.stdout.write(text + "\n")


def _err(message: str) -> None:
    """One line on stderr, whatever the message holds."""
    sys.stderr.write("autopar: error: " + " ".join(str(message).split()) + "\n")


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
            args = parser().parse_args(argv)
        except SystemExit as exc:  # --help and --version: argparse has printed them
            return int(exc.code or 0)
        if rest and args.command != "run":
            raise UsageError(f"only `autopar run` takes arguments after --, got {' '.join(rest)}")
        if args.command == "run":
            args.args = [*args.args, *rest]
        with quiet.cli_filters(args.verbose):
            return _COMMANDS[args.command](args)
    except InfeasibleError as exc:
        _err(str(exc))
        return EXIT_INFEASIBLE
    except (AutoparError, UsageError) as exc:  # CostModelError and ClusterError are AutoparErrors
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
