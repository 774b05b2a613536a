"""Train a GPT with ZeRO stage 0-3 on every device there is: the demo's composition of the
library (plan, step, checkpoints, loop services) and its own parts (``cli``, ``resume``,
``reports``, ``summary``). ``train.py`` and the ``zero-jax-train`` command run ``main``."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
import traceback
import warnings

import jax
from tqdm import tqdm

from zero_jax import distributed, fit, nvme, report, supervise
from zero_jax.checkpoint import CheckpointError, quiet_background_errors
from zero_jax.gpt import config as configs
from zero_jax.gpt import data, hf, reports, resume, summary
from zero_jax.gpt.cli import (
    build,
    check_args,
    check_observability,
    fail,
    in_flags,
    load_config,
    parse_args,
    profile_window,
    warn,
)
from zero_jax.loop import (
    SIGNAL_EXIT,
    Checkpointer,
    DivergenceGuard,
    Evaluation,
    Hook,
    MetricsFile,
    OutputError,
    Preemption,
    Profile,
    TensorBoard,
    run_steps,
)
from zero_jax.mesh import simulate_cpu_devices
from zero_jax.state import abstract_state


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if problem := check_args(args) or check_observability(args):
        return fail(problem)

    simulate_cpu_devices(args.devices or 8)

    # make_plan's warning for a loop of one's own: the report below says it for this one.
    warnings.filterwarnings("ignore", "stage 3 gathers .* once per step", UserWarning)
    try:
        spec = distributed.settings(args.coordinator, args.num_processes, args.process_id,
                                    auto=args.distributed)
        worker = supervise.attach() if spec is not None else None
        if spec is not None and worker is None:  # the worker runs as our child
            return supervise.run([sys.executable, "-m", "zero_jax.gpt.run",
                                  *(sys.argv[1:] if argv is None else argv)],
                                 spec.get("process_id"), args.checkpoint_dir)
        if spec is not None:
            group = distributed.initialize(spec, args.peer_timeout)
    except distributed.StartupError as e:
        return fail(str(e))
    return run_main(args) if spec is None else one_of_several(args, group, worker)


def one_of_several(args: argparse.Namespace, group, worker) -> int:
    """One process of several: a watchdog over its peers, and any failure stops them all."""
    if jax.process_index():
        sys.stdout = open(os.devnull, "w")  # one progress bar, one report: process 0's
    watchdog = distributed.Watchdog(args.peer_timeout).start()
    watchdog.checkpoints = args.checkpoint_dir  # named when a peer is lost
    worker.track(lambda: (group.process_id, watchdog.reached, group.coordinator or "-"))
    try:
        code = run_main(args, watchdog)
    except Exception as e:  # reach the user with the process id, and stop the peers at once
        watchdog.settle(e)  # a lost peer is named by the watchdog, not by gloo's socket error
        traceback.print_exc()
        fail(f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e) else ''}")
        code = 1
    if code:
        watchdog.failed(f"exit code {code}, see its error above")
        watchdog.linger()
        sys.stderr.flush()
        os._exit(code)  # not JAX's shutdown barrier: the peers will not reach it
    watchdog.stop()
    return 0


def run_main(args: argparse.Namespace, watchdog=None) -> int:
    with Preemption(enabled=not args.dry_run) as stop:  # a dry run has nothing to save

        quiet_background_errors()  # a failed save is its one CheckpointError line below
        try:
            cfg = load_config(args)
            if args.save_safetensors:
                hf.check_writable(cfg["model"])
            if problem := profile_window(args, cfg["train"]["steps"]):
                return fail(problem)
            local = {"coordinator", "num_processes", "process_id", "distributed"}
            distributed.agree("configuration", {"config": cfg, "arguments": {
                k: v for k, v in vars(args).items() if k not in local}}, args.peer_timeout)
            exp = build(cfg, args)  # with the NVMe tier, its directory locked
            with contextlib.closing(exp.step):  # the NVMe tier's directory released
                if args.dry_run:
                    return reports.plan_layouts(exp, cfg, args) if args.device_memory else \
                        reports.dry_run(exp, args)
                with resume.find_start(exp, cfg, args) as start:
                    return train(exp, cfg, args, start, stop, watchdog)
        except (configs.ConfigError, FileNotFoundError) as e:
            return fail(str(e))
        except ValueError as e:  # the library's refusals (CheckpointError too), in its terms
            return fail(in_flags(str(e)))
        except OutputError as e:  # --report of a dry run
            return fail(str(e), 1)


def compile_checked(exp, stop, args: argparse.Namespace):
    """``(report, compiled step, why it does not fit or None)``, or the exit code of a signal
    during the compile (nothing restored or initialized yet, nothing written). The peak's
    breakdown and the stages for the figures only when a report file or figures ask."""
    stop.compiling = True  # before the line that says so: a signal after it is answered
    print("compiling the train step", flush=True)
    try:
        r, step = reports.compile_report(exp, abstract_state(exp.plan, exp.tx),
                                         peak=bool(args.report or args.plot))
        problem = fit.check(step, list(exp.mesh.devices.flat))
        if args.plot and not problem and exp.plan.outer is None:
            r["stages"] = report.stages_table(exp.plan, exp.tx, exp.accum_steps)
            r["compiled_stages"] = reports.compiled_stages(exp, r)
    finally:
        stop.compiling = False
    if stop.signum:
        print(f"stopped by {signal.Signals(stop.signum).name} during compilation: nothing "
              "trained, nothing saved", file=sys.stderr)
        return SIGNAL_EXIT[stop.signum]
    return r, step, problem


def compile_fitting(exp, cfg: dict, stop, args: argparse.Namespace):
    """``(experiment, report, compiled step)``, or the exit code: a signal, or a model that
    cannot fit, also with ``full`` where ``model.remat: auto`` chose ``dots``."""
    compiled = compile_checked(exp, stop, args)
    if isinstance(compiled, tuple) and (
            again := reports.without_dots(exp, cfg, args, compiled[2])):
        exp, compiled = again, compile_checked(again, stop, args)
    if isinstance(compiled, int):
        return compiled
    r, step, problem = compiled
    if problem:
        return fail(f"{problem}: use {'a higher --stage, ' * (exp.plan.stage < 3)}"
                    "precision.param_dtype=bf16, zero.offload_grads, a smaller model or "
                    "train.batch_size, or --dry-run to see the report")
    return exp, r, step


def train(exp, cfg: dict, args: argparse.Namespace, start, stop, watchdog=None) -> int:
    """Compile, check the fit, start (restore or initialize), then the loop and its hooks."""
    compiled = compile_fitting(exp, cfg, stop, args)
    if isinstance(compiled, int):
        return compiled
    built, r, step = compiled
    with contextlib.closing(built.step) if built is not exp else contextlib.nullcontext():
        return trained(built, cfg, args, start, stop, watchdog, r, step)


def trained(exp, cfg: dict, args: argparse.Namespace, start, stop, watchdog, r, step) -> int:
    """``train`` once the step is compiled."""
    t = cfg["train"]
    state = resume.initial_state(start, abstract_state(exp.plan, exp.tx), cfg, args, exp)
    first = int(state.step)
    try:
        reports.write_json(args.report, r)
    except OutputError as e:
        return fail(f"{e}; stopped before training (at step {first})", 1)
    if first >= t["steps"]:
        print(f"nothing to do: the checkpoint is at step {first} and --steps is {t['steps']}")
        return 0
    guard = DivergenceGuard(t["max_bad_steps"], cfg["precision"]["min_loss_scale"], warn)
    bar = progress(exp.plan.stage, t["steps"], first)
    tally, saver = summary.Tally(bar, exp.tokens_per_step, keep_records=bool(args.plot)), None
    if start.ckpts:  # before the outputs: a step whose record cannot be written is saved
        saver = Checkpointer(start.ckpts, args.save_every, t["steps"], stop, guard,
                             lambda n: resume.checkpoint_meta(exp, cfg, args, start, n),
                             exp.step.whole, bar.write)
    if args.save_safetensors:  # every process writes its shards: not one of outputs()
        saver_st = hf.saver(args.save_safetensors, exp.step, cfg["model"], args.save_every,
                            t["steps"], stop, guard, args.init_from)
    hooks = [*([Reached(watchdog)] if watchdog else []),
             *([evaluation(exp, start, bar.write)] if t["eval_every"] else []),
             tally, *([saver] if saver else []),
             *([saver_st] if args.save_safetensors else []),
             *outputs(args, start, r, step, first, bar)]
    tick, done_steps = time.perf_counter(), first
    try:
        done_steps = loop(exp, step, state, start, bar, hooks, guard, stop)
        if saver:
            saver.finish()
    except (CheckpointError, nvme.NvmeError) as e:
        if watchdog:  # a save's collective that failed: a lost peer is named by the watchdog
            watchdog.settle(e)
        return fail(summary.tier_failed(e, saver) if isinstance(e, nvme.NvmeError)
                    else str(e), 1)
    except OutputError as e:
        trained = max(first + len(tally.losses), (saver.n or 0) if saver else 0)
        return summary.output_failed(e, saver, trained)
    finally:
        bar.close()
        for hook in hooks:
            hook.close()
    reports.draw(args, r, tally.records)
    return summary.ending(t, first, tally, time.perf_counter() - tick, stop, guard,
                          done_steps, saver)


def evaluation(exp, start, write) -> Evaluation:
    """``train.eval_every``'s hook: the mean loss of ``train.eval_batches`` held-out batches of
    ``train.batch_size`` windows (the same whatever the run's microbatches), evaluated a
    microbatch at a time (no more memory than a step's), placed once."""
    t, seq_len = exp.cfg["train"], exp.model.seq_len
    shape = (t["batch_size"] // t["accum_steps"], seq_len + 1)
    rows = distributed.local_rows(exp.batch_sharding, shape)
    pieces = []
    for j in range(t["eval_batches"]):
        whole = data.eval_batch(start.held_out, j, t["batch_size"], seq_len)
        pieces += [distributed.global_array(exp.batch_sharding, shape, whole[k:k + shape[0]][rows])
                   for k in range(0, t["batch_size"], shape[0])]
    evaluate = exp.eval_step()

    def mean_loss(state) -> dict:
        losses = [evaluate(state.params, piece)["loss"] for piece in pieces]
        return {"loss": sum(map(float, losses)) / len(losses)}
    return Evaluation(mean_loss, t["eval_every"], t["steps"], write)


def outputs(args: argparse.Namespace, start, r: dict, step, first: int, bar) -> list:
    """The hooks that write the run's files (process 0's): --metrics, --tensorboard,
    --profile."""
    if not resume.jax_primary():
        return []
    hooks = [MetricsFile(args.metrics, first, start.records, "--metrics")] if args.metrics \
        else []
    if args.tensorboard:
        hooks.append(TensorBoard(args.tensorboard, first, reports.headline(r)))
    if args.profile and args.profile_steps[0] <= first:  # a resumed run: never reached
        a, b = args.profile_steps
        warn(f"--profile-steps {a}:{b} starts at step {a}, but this run resumes after step "
             f"{first}: nothing is traced; pass --profile-steps A:B with A above {first}")
    if args.profile:
        hooks.append(Profile(args.profile, args.profile_steps, step, bar.write))
    return hooks


def loop(exp, step, state, start, bar, hooks: list, guard, stop) -> int:
    """Train until the last step, a stop signal or the divergence guard (``run_steps``: the
    host queues each step before reading the one before); each step's results go to every
    hook. Returns the last step trained."""
    first, batch_size = int(state.step), exp.cfg["train"]["batch_size"]
    rows = distributed.local_rows(exp.batch_sharding, exp.batch_shape.shape)  # this process's

    def batches():
        for i in bar:
            yield i + 1, distributed.global_array(
                exp.batch_sharding, exp.batch_shape.shape,
                data.batch(start.tokens, i, batch_size, exp.model.seq_len, start.seed, rows))

    last = run_steps(step, state, batches(), hooks, guard, stop, exp.tokens_per_step)
    return first if last is None else last


def progress(stage: int, steps: int, first: int):
    """The progress bar over the steps left (process 0's, on a terminal)."""
    shown = resume.jax_primary() and sys.stderr.isatty()
    return tqdm(range(first, steps), desc=f"stage {stage}", unit="step", mininterval=0.5,
                initial=first, total=steps, disable=not shown)


class Reached(Hook):
    """A hook: the watchdog told each step this process reaches, before it runs (a peer that
    falls behind is named by it)."""

    def __init__(self, watchdog):
        self.watchdog = watchdog

    def before(self, n: int) -> None:
        self.watchdog.reach(n)


if __name__ == "__main__":
    sys.exit(main())
