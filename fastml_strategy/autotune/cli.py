"""``fastml-autotune``: the command-line front of :func:`fastml_strategy.autotune.autotune`.

Exit status: 0 done; 2 bad input (target, catalog, link, storage URL, option values), reported as one
line on stderr before anything is profiled or written; 1 a failure during the run; 130 interrupted
(rerun the same command to resume from the storage).

Distributed: ``torchrun --nproc_per_node N -m fastml_strategy.autotune.cli TARGET ...`` (or the
``fastml-autotune`` script under torchrun): every rank loads the target, the link is measured with
timed collectives, rank 0 searches and writes the outputs, all ranks measure the plans' step times.

Training length: every time and cost is for ``--target-steps`` steps of uncompressed training. Without
it, the command asks when run at a terminal (one process), and otherwise assumes
:data:`~fastml_strategy.autotune.result.ASSUMED_TARGET_STEPS`; the report says which.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Sequence

from fastml_strategy.config import DEFAULT_MIN_NUMEL

if TYPE_CHECKING:
    from fastml_strategy.autotune._settings import Settings
    from fastml_strategy.autotune.result import AutotuneResult

PROG = "fastml-autotune"
# A workload target that ships with FastML (the digits MLP of the recipes): the --help example.
EXAMPLE_TARGET = "recipes/autotune_workload.py:workload"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` only where it adds something: not for on/off flags (``--quiet``,
    ``--no-local-steps``: the flag's presence is the setting), not for None (the help says what
    happens), and not where the help already names its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.default is None or isinstance(action.default, bool) or action.nargs == 0
                or "default" in text.lower()):
            return text
        return super()._get_help_string(action)


def _steps_arg(text: str) -> float:
    """--target-steps: 20000, 20,000, 20k, 1.5M, 2e5 (the value is checked with the other inputs)."""
    t = text.strip().lower().replace(",", "").replace("_", "")
    scale = {"k": 1e3, "m": 1e6}.get(t[-1:], 1.0)
    try:
        return float(t[:-1] if scale != 1.0 else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of steps (e.g. 20000, 20k, 1.5M)") from None


def build_parser() -> argparse.ArgumentParser:
    """The command line: what to tune and for which hardware, then one group of options each for
    calibration and profiling, local steps and sharded training."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Choose per-layer gradient compression for a model by predicted time to accuracy "
                    "and cost on each hardware option. Writes plan.json, report.html, report.md and "
                    "CSV tables to --out.",
        epilog=f"Example (from a clone of the repository; {EXAMPLE_TARGET.split(':')[0]} is a target to "
               f"copy): fastml-autotune {EXAMPLE_TARGET} --link 1gbit --world-size 8 --target-steps 20000 "
               f"--out tune-out. Run it under torchrun to measure the link and the real step times; a "
               f"stopped run resumes from --storage.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("target", metavar="TARGET",
                   help="your training code: path/to/file.py:factory or package.module:factory; the "
                        "factory takes no arguments and returns a fastml_strategy.autotune.Workload, a "
                        "LightningModule, (LightningModule, LightningDataModule), or a Hugging Face "
                        "transformers.Trainer (recipes/autotune_transformers.py:workload)")
    p.add_argument("--world-size", type=int, default=None, metavar="N",
                   help="ranks your training runs on, each with the workload's batch (the global batch "
                        "is N times it); also the node count of --link's cluster. Default: the launched "
                        "world size, else 2")
    p.add_argument("--link", default=None, metavar="RATE",
                   help="your own cluster's link per rank, e.g. 1gbit, 10gbit, 100mbit, 1gbit,50us; "
                        "adds a 'local' option. Measured instead when launched distributed")
    p.add_argument("--hardware", default=None, metavar="CATALOG",
                   help="hardware catalog, YAML or CSV, one option per entry with fields name, nodes, "
                        "accelerators_per_node, price_per_hour, bandwidth_gbps, latency_us, "
                        "compute_speed. Default: the built-in catalog (Ethernet and InfiniBand clusters)")
    p.add_argument("--trials", type=int, default=200, metavar="N",
                   help="Optuna search trials per hardware option (model evaluations: cheap; at least "
                        "one per codec option is always run)")
    p.add_argument("--storage", default=None, metavar="URL",
                   help="Optuna storage URL; default sqlite:///OUT/autotune.db, so rerunning the same "
                        "command resumes a stopped run. An RDB URL (postgresql://...) lets several "
                        "machines tune one study")
    p.add_argument("--out", default="fastml-autotune-out", metavar="DIR",
                   help="output folder; one holding an earlier run's outputs is refused without --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the outputs of an earlier run in --out (its autotune.db is reused, so "
                        "finished steps are not redone)")
    _calibration_options(p)
    _local_steps_options(p)
    _sharding_options(p)
    return p


def _calibration_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("calibration and profiling")
    g.add_argument("--calibration-trials", type=int, default=6, metavar="N",
                   help="short training runs of candidate plans against uncompressed training")
    g.add_argument("--calibration-steps", type=int, default=60, metavar="N",
                   help="steps of each calibration run (at least 10)")
    g.add_argument("--calibration-ranks", type=int, default=None, metavar="N",
                   help="ranks each calibration step stands in for: its gradient is the mean of N batches, "
                        "as DDP's all-reduce averages the ranks' (default: the world size, at most 4; 1: one "
                        "rank's batch). The low-rank codec converges with the ranks' mean gradient")
    g.add_argument("--calibration-repeats", type=int, default=2, metavar="N",
                   help="rerun the N plans whose accuracy loss is nearest the limit with another seed "
                        "(0: none); the accuracy rule fits every run, so one noisy run cannot decide it")
    g.add_argument("--references", type=int, default=2, metavar="N",
                   help="uncompressed reference runs (seeds SEED, SEED+1, ...): their spread is the noise "
                        "the report's band and confidence use")
    g.add_argument("--threads-per-rank", type=int, default=None, metavar="N",
                   help="threads compute is profiled and timed with: what one rank of your training "
                        "has. Default: cores / --world-size in one process; under torchrun, as launched")
    g.add_argument("--budget", type=float, default=15.0, metavar="MINUTES",
                   help="wall-time cap: repeats, local-steps calibration and verification runs that "
                        "would not fit are skipped and the search uses what was measured (0: no cap)")
    g.add_argument("--profile-steps", type=int, default=5, metavar="N",
                   help="steps over which gradients, compute time and codec errors are measured")
    g.add_argument("--measure-steps", type=int, default=10, metavar="N",
                   help="timed steps per plan when checking predicted against measured step time")
    g.add_argument("--max-accuracy-loss", type=float, default=0.01, metavar="X",
                   help="largest accuracy loss allowed against uncompressed training (absolute, in the "
                        "eval function's units; without one, relative increase of the final loss)")
    g.add_argument("--target-steps", type=_steps_arg, default=None, metavar="N",
                   help="steps your uncompressed training takes to reach its target: every time and cost "
                        "is for this many steps (the choice of plan does not depend on it). Default: asked "
                        "at a terminal, else 10,000 assumed, and the report says so")
    g.add_argument("--max-groups", type=int, default=24, metavar="N",
                   help="search at most N layer groups (layers differing only in block index share a "
                        "choice; then similar sizes are merged)")
    g.add_argument("--min-numel", type=int, default=DEFAULT_MIN_NUMEL, metavar="N",
                   help="tensors with fewer elements travel uncompressed and are not searched")
    g.add_argument("--verify-rounds", type=int, default=2, metavar="N",
                   help="after the search, train the chosen plans, refit and search again, up to N "
                        "times (0: trust the first calibration)")
    g.add_argument("--seed", type=int, default=0, help="seed of the samplers and the calibration runs")
    g.add_argument("--quiet", action="store_true", help="no progress bar")


def _local_steps_options(p: argparse.ArgumentParser) -> None:
    ls = p.add_argument_group(
        "local steps",
        "With --local-steps, besides compressing every step's gradients, the search considers "
        "fastml_strategy.LocalSGD: synchronise every H steps (bytes per step / H), in F staggered "
        "fragments; calibration runs measure how much H stretches the steps to the target. The report "
        "compares both per option. Off by default: LocalSGD changes the training algorithm")
    ls.add_argument("--local-steps", dest="local_steps", action="store_true", default=None,
                    help="search LocalSGD (local steps) beside per-step compression (calibration runs of "
                         "max(--calibration-steps, 4 x the largest H) steps)")
    ls.add_argument("--no-local-steps", dest="local_steps", action="store_false", default=None,
                    help="search per-step compression only (the default)")
    ls.add_argument("--local-every", default=None, metavar="H,H",
                    help="sync periods H to calibrate and search, e.g. 10,50,100 (default: 10,50); each "
                         "costs one calibration run of max(--calibration-steps, 4 x the largest H) steps")
    ls.add_argument("--local-fragments", default=None, metavar="F,F",
                    help="fragment counts F searched (Streaming DiLoCo), e.g. 1,2 (default: 1,2,4,8, at "
                         "most one per trainable parameter)")


def _sharding_options(p: argparse.ArgumentParser) -> None:
    h = p.add_argument_group(
        "sharded training",
        "--sharding fsdp|hsdp tunes the plan for fastml_strategy.fsdp.register: the cost model then "
        "counts FSDP's parameter all-gathers, the compressed reduce-scatter (fsdp) or cross-node "
        "all-reduce (hsdp), and the error-feedback memory per rank; bf16-residual variants of every "
        "codec are searched too")
    h.add_argument("--sharding", default="ddp", metavar="KIND",
                   help="ddp (replicated, DDP's all-reduce), fsdp (FSDP2 over every rank) or hsdp "
                        "(FSDP2 inside each node, replicas across nodes)")
    h.add_argument("--ranks-per-node", type=int, default=None, metavar="S",
                   help="ranks on each node of your cluster (hsdp: the shard group); --world-size is "
                        "nodes x S and --link is each node's link, shared by its S ranks. Default: "
                        "LOCAL_WORLD_SIZE under torchrun, else 1")
    h.add_argument("--param-dtype", default=None, metavar="DTYPE",
                   help="fp32 or bf16: what FSDP all-gathers (MixedPrecisionPolicy(param_dtype)); "
                        "default fp32")
    h.add_argument("--reduce-dtype", default=None, metavar="DTYPE",
                   help="fp32 or bf16: what FSDP's own reduce-scatter and all-reduce send (the "
                        "baseline; FastML's uncompressed layers too); default: the param dtype")
    h.add_argument("--no-reshard-after-forward", dest="reshard_after_forward", action="store_false",
                   help="FSDP keeps parameters gathered from forward to backward "
                        "(fully_shard(reshard_after_forward=False)): no second all-gather")
    h.add_argument("--intra-node-link", default=None, metavar="RATE",
                   help="the link between ranks of one node, e.g. 200gbit (PCIe, the default), "
                        "2400gbit,2us (NVLink)")
    h.add_argument("--max-residual-gb", type=float, default=None, metavar="X",
                   help="error-feedback memory allowed per rank, GiB: plans above it are infeasible "
                        "(default: no limit; the report shows it beside FSDP's own memory)")


def _init_distributed() -> bool:
    from fastml_strategy._validate import env_whole_number

    if env_whole_number("WORLD_SIZE", None, 1, minimum=1) <= 1:
        return False
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend="gloo")
    return True


def _error(msg: str) -> None:
    print(f"{PROG}: error: {' '.join(msg.split())}", file=sys.stderr)


def _parse_steps(text: str) -> float | None:
    """'20000', '20,000', '20k', '1.5M', '2e5' -> a step count (None: not a positive number)."""
    try:
        v = _steps_arg(text)
    except argparse.ArgumentTypeError:
        return None
    return v if 0 < v < float("inf") else None


def _ask_target_steps() -> float | None:
    """At a terminal: ask for the training length once (Enter keeps the assumed one)."""
    from fastml_strategy.autotune.result import ASSUMED_TARGET_STEPS

    for _ in range(3):
        sys.stderr.write(f"{PROG}: how many optimizer steps does your training take, uncompressed, to reach "
                         f"its target? Times and costs are reported for that many (Enter: assume "
                         f"{ASSUMED_TARGET_STEPS:,}; --target-steps N skips this question): ")
        sys.stderr.flush()
        answer = sys.stdin.readline()
        if not answer.strip():  # Enter, or end of input
            return None
        steps = _parse_steps(answer)
        if steps is not None:
            return steps
        sys.stderr.write(f"{PROG}: {answer.strip()!r} is not a number of steps (e.g. 20000, 20k, 1.5M)\n")
    return None


def _interactive() -> bool:
    try:
        return sys.stdin.isatty() and sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed streams
        return False


def main(argv: Sequence[str] | None = None) -> int:
    """The ``fastml-autotune`` command; returns its exit status (0, 1 failed, 2 bad input, 130
    interrupted)."""
    args = build_parser().parse_args(argv)
    distributed = _init_distributed()
    from fastml_strategy.autotune._run import run

    steps_source = "given"
    if args.target_steps is None and not distributed and _interactive():
        try:
            args.target_steps = _ask_target_steps()
        except KeyboardInterrupt:
            _error("interrupted before anything was profiled or written")
            return 130
        steps_source = "entered"
    settings, failure = _prepare(args, steps_source)
    if distributed and _any_rank_failed(failure):
        return 2
    if failure is not None:
        _error(failure)
        return 2
    try:
        result = run(settings)
    except KeyboardInterrupt:
        _error(f"interrupted; rerun the same command to resume from {settings.storage_url}")
        return 130
    except Exception as e:
        _error(f"autotuning failed: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
        if os.environ.get("FASTML_DEBUG"):
            raise
        return 1
    finally:
        if distributed:
            _close_distributed()
    if settings.rank == 0:
        _print_answer(result, settings)
    return 0


def _prepare(args: argparse.Namespace, steps_source: str) -> tuple[Settings | None, str | None]:
    """The validated settings of the command line, or the one-line reason they are not valid."""
    from fastml_strategy.autotune._run import prepare

    try:
        return prepare(
            args.target, out=args.out, world_size=args.world_size, link=args.link,
            hardware=args.hardware, trials=args.trials, storage=args.storage,
            calibration_trials=args.calibration_trials, calibration_steps=args.calibration_steps,
            calibration_ranks=args.calibration_ranks,
            profile_steps=args.profile_steps, measure_steps=args.measure_steps,
            max_accuracy_loss=args.max_accuracy_loss, target_steps=args.target_steps,
            max_groups=args.max_groups, min_numel=args.min_numel,
            verify_rounds=args.verify_rounds, seed=args.seed,
            progress=not args.quiet, sharding=args.sharding, ranks_per_node=args.ranks_per_node,
            param_dtype=args.param_dtype, reduce_dtype=args.reduce_dtype,
            reshard_after_forward=args.reshard_after_forward, intra_node_link=args.intra_node_link,
            max_residual_gb=args.max_residual_gb, overwrite=args.overwrite,
            target_steps_source=steps_source if args.target_steps is not None else None,
            local_steps=args.local_steps, local_every=args.local_every,
            local_fragments=args.local_fragments, calibration_repeats=args.calibration_repeats,
            references=args.references, threads_per_rank=args.threads_per_rank,
            budget=args.budget), None
    except ValueError as e:
        return None, str(e)


def _any_rank_failed(failure: str | None) -> bool:
    """Whether any rank failed validation (every rank learns it, so none hangs); if so, print one
    line in all (rank 0's message, or the lowest failing rank's) and leave the process group."""
    import torch
    import torch.distributed as dist

    flags = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(flags, torch.tensor([0.0 if failure else 1.0]))
    if failure is None and all(float(f) == 1.0 for f in flags):
        return False
    first = min(i for i, f in enumerate(flags) if float(f) == 0.0)
    if failure is not None and dist.get_rank() == first:
        _error(failure)
    dist.destroy_process_group()
    return True


def _close_distributed() -> None:
    """Wait for every rank, then leave the process group."""
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def _print_answer(result: AutotuneResult, settings: Settings) -> None:
    """The report's answer, in words, then where the files are (rank 0). Markdown bold is dropped."""
    from fastml_strategy.autotune.report import headline, phase_words, winner_line

    lines = [line.replace("**", "") for line in headline(result)]
    b = result.best[result.option]
    if settings.sharding.sharded:
        lines.append(f"Sharding {settings.sharding.kind}; FastML residuals "
                     f"{b.get('residual_bytes', 0) / 2 ** 20:.4g} MiB per rank.")
    print(f"{PROG}: {lines[0]}")
    for line in lines[1:]:
        print(f"  {line}")
    print(f"  Wrote {settings.out}/plan.json (tuned for {result.option}), report.html, report.md and the "
          f"CSV tables.", flush=True)
    if result.phase_s:
        print(f"  Wall time: {phase_words(result.phase_s)}.", flush=True)
    if settings.local_steps:  # which mode wins (the last line, unless plain DDP wins)
        print(f"  {winner_line(result)}", flush=True)
    if not settings.sharding.sharded and not result.plan_uses_hook:  # the last line
        print(f"  Plain DDP on {result.option}: do not register FastML; plan.json is fp32 throughout "
              f"(meta.hook = false).", flush=True)


if __name__ == "__main__":
    sys.exit(main())
