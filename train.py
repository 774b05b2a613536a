"""Train a GPT with ZeRO stage 0-3 on every device there is: `python train.py --stage 3`.

With no accelerator the CPU is split into simulated devices (8 unless --devices says
otherwise), so every shard is its own buffer and every collective really runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit code 2, as for every bad input
        sys.exit(fail(message))


PROCESS = ""  # "[process i] " once several processes run: every error names its process


def fail(message: str) -> int:
    print(f"error: {PROCESS}{message}", file=sys.stderr)
    return 2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", type=int, help="ZeRO stage 0-3 (default: the config's, 3)")
    p.add_argument("--config", default="tiny",
                   help="YAML file, or a name in configs/: tiny, gpt2-124m, gpt-1.3b, gpt-7.5b")
    p.add_argument("--zero3-size", metavar="K",
                   help="hierarchical ZeRO: stage 3 within groups of K devices, optimizer state "
                   "over all; 'local' = one group per process/host (default: off)")
    p.add_argument("--steps", type=int, help="optimizer steps (default: the config's)")
    p.add_argument("--seed", type=int, help="seed of initialization and data order")
    p.add_argument("--devices", type=int, help="devices on the data axis (default: all; "
                   "8 simulated CPU devices when there is no accelerator)")
    p.add_argument("--data", help="text file, directory of text files, or .bin of uint16 token "
                   "ids (default: the Python standard library's sources, as bytes)")
    p.add_argument("--metrics", help="write one JSON object per step to this file")
    p.add_argument("--report", help="write the memory/communication report as JSON here")
    p.add_argument("--dry-run", action="store_true",
                   help="compile the step on abstract arrays, print the report, train nothing")
    p.add_argument("--checkpoint-dir", metavar="DIR",
                   help="save sharded orbax checkpoints here (at the end, and every --save-every)")
    p.add_argument("--save-every", type=int, default=0, metavar="N",
                   help="also save every N steps (default: only at the end)")
    p.add_argument("--keep", type=int, default=3, metavar="K", help="keep the last K (default 3)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest complete checkpoint in --checkpoint-dir, on any "
                   "stage and device count; --steps is the total to reach")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set optimizer.name=sgd (repeatable)")
    multi = p.add_argument_group("several processes, one per host (README: Several processes)")
    multi.add_argument("--coordinator", metavar="HOST:PORT",
                       help="process 0's address (default: $JAX_COORDINATOR_ADDRESS)")
    multi.add_argument("--num-processes", type=int, metavar="N",
                       help="processes in the run (default: $JAX_NUM_PROCESSES)")
    multi.add_argument("--process-id", type=int, metavar="I",
                       help="this process, 0 to N-1 (default: $JAX_PROCESS_ID)")
    multi.add_argument("--distributed", action="store_true",
                       help="join a process group JAX detects (Cloud TPU, Kubernetes, ...); "
                       "SLURM and Open MPI with several tasks are detected without it")
    multi.add_argument("--peer-timeout", type=float, default=30, metavar="S",
                       help="stop when a peer is lost or hangs this long, and the longest wait "
                       "for the coordinator at start-up (default 30)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.devices is not None and args.devices < 1:
        return fail(f"--devices must be at least 1 (got {args.devices})")
    from zero_jax.mesh import simulate_cpu_devices

    simulate_cpu_devices(args.devices or 8)

    from zero_jax import distributed  # jax is imported from here on

    try:
        spec = distributed.settings(args.coordinator, args.num_processes, args.process_id,
                                    auto=args.distributed)
        if args.peer_timeout <= 0:
            raise distributed.StartupError(f"--peer-timeout must be positive (got "
                                           f"{args.peer_timeout:g})")
        if spec is not None:
            distributed.initialize(spec, args.peer_timeout)
    except distributed.StartupError as e:
        return fail(str(e))
    if spec is None:
        return run_main(args)
    global PROCESS
    import jax

    PROCESS = f"[process {jax.process_index()}] "
    if jax.process_index():
        sys.stdout = open(os.devnull, "w")  # one progress bar, one report: process 0's
    watchdog = distributed.Watchdog(args.peer_timeout).start()
    try:
        code = run_main(args, watchdog)
    except Exception as e:  # reach the user with the process id, and stop the peers at once
        import traceback

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
    from zero_jax import distributed
    from zero_jax.gpt import config as configs

    if args.zero3_size == "local":
        import jax

        args.zero3_size = jax.local_device_count()
    elif args.zero3_size is not None:
        try:
            args.zero3_size = int(args.zero3_size)
        except ValueError:
            return fail(f"--zero3-size must be a number of devices or 'local' (got "
                        f"{args.zero3_size!r})")
    overrides = list(args.set)
    for flag, key in [("stage", "zero.stage"), ("steps", "train.steps"), ("seed", "train.seed"),
                      ("zero3_size", "zero.zero3_size")]:
        if getattr(args, flag) is not None:
            overrides.append(f"{key}={getattr(args, flag)}")
    try:
        cfg = configs.load(args.config, overrides)
        local = {"coordinator", "num_processes", "process_id", "distributed"}
        distributed.agree("configuration", {"config": cfg, "arguments": {
            k: v for k, v in vars(args).items() if k not in local}}, args.peer_timeout)
        run = Run(cfg, args, watchdog)
    except (configs.ConfigError, ValueError, FileNotFoundError) as e:
        return fail(str(e))
    return run.dry_run() if args.dry_run else run.train()


class Run:
    """One configured run: data, the experiment it trains, and where its outputs go."""

    def __init__(self, cfg: dict, args: argparse.Namespace, watchdog=None):
        import jax

        from zero_jax.checkpoint import CheckpointError, Checkpoints
        from zero_jax.gpt import data
        from zero_jax.gpt.experiment import Experiment, check_compatible, mesh_for

        self.cfg, self.args, self.watchdog = cfg, args, watchdog
        self.primary = jax.process_index() == 0  # writes the report and metrics files
        self.exp = Experiment.build(cfg, mesh_for(cfg, args.devices))
        self.seed = cfg["train"]["seed"]
        # Where the state comes from: --resume's latest checkpoint in --checkpoint-dir, else
        # train.ckpt_load_path's latest, else a fresh initialization.
        self.ckpts, self.source, self.resume_step = None, None, None
        if args.resume and not args.checkpoint_dir:
            raise ValueError("--resume needs --checkpoint-dir DIR")
        if args.checkpoint_dir and not args.dry_run:
            self.ckpts = Checkpoints(args.checkpoint_dir, keep=args.keep)
        if args.resume and not args.dry_run:
            self.source, self.resume_step = self.ckpts, self.ckpts.latest_step()
        load = cfg["train"]["ckpt_load_path"]
        if load and self.resume_step is None and not args.dry_run:
            try:
                self.source = Checkpoints(load, create=False)
            except CheckpointError as e:
                raise ValueError(f"train.ckpt_load_path: {e}") from e
            self.resume_step = self.source.latest_step()
            if self.resume_step is None:
                raise ValueError(f"train.ckpt_load_path {self.source.path} holds no complete "
                                 "checkpoint: point it at a --checkpoint-dir of an earlier run")
        if args.resume and self.resume_step is None and not args.dry_run:
            print(f"no checkpoint in {self.ckpts.path}: starting fresh")
        if self.resume_step is not None:
            meta = self.source.meta(self.resume_step)
            check_compatible(meta, cfg)
            self.seed = meta["data"]["seed"]  # the data order goes on where it stopped
        self.tokens = None
        if not args.dry_run:
            m = self.exp.model
            self.tokens = data.load_tokens(args.data)
            data.check_tokens(self.tokens, m.vocab_size, m.seq_len,
                              args.data or "the standard library corpus")

    def report(self, state) -> tuple[dict, object]:
        from zero_jax import report

        lowered = self.exp.step.lower(state, self.exp.batch_shape)
        compiled = lowered.compile()
        r = report.build(self.exp.plan, state, lowered, compiled)
        print(report.format_table(r))
        return r, compiled

    def write_report(self, r: dict) -> None:
        if self.args.report and self.primary:
            with open(self.args.report, "w") as f:
                json.dump(r, f, indent=1)

    def dry_run(self) -> int:
        from zero_jax import report
        from zero_jax.step import abstract_state

        plan = self.exp.plan
        r, _ = self.report(abstract_state(plan, self.exp.tx))
        if plan.outer is None:  # the flat stages side by side, on the same mesh
            r["stages"] = report.stages_table(plan, self.exp.tx)
            print("\n" + report.format_stages(r["stages"], r["n_params"], plan.dp_size))
        self.write_report(r)
        return 0

    def train(self) -> int:
        import jax
        import numpy as np
        from tqdm import tqdm

        from zero_jax import distributed
        from zero_jax.checkpoint import CheckpointError
        from zero_jax.gpt import data
        from zero_jax.step import abstract_state, init_state

        t, exp, ckpts = self.cfg["train"], self.exp, self.ckpts
        if self.resume_step is not None:
            tick = time.perf_counter()
            state, _ = self.source.restore(abstract_state(exp.plan, exp.tx), self.resume_step)
            print(f"resumed from step {self.resume_step} of {self.source.path} in "
                  f"{time.perf_counter() - tick:.2f} s")
        else:
            state = init_state(exp.plan, exp.init, exp.tx, jax.random.key(self.seed))
        r, step = self.report(state)
        self.write_report(r)
        first = int(state.step)
        if first >= t["steps"]:
            print(f"nothing to do: the checkpoint is at step {first} and --steps is {t['steps']}")
            return 0
        metrics_file = (open(self.args.metrics, "a" if first else "w", buffering=1)
                        if self.args.metrics and self.primary else None)
        losses, start, skipped = [], time.perf_counter(), 0
        bar = tqdm(range(first, t["steps"]), desc=f"stage {exp.plan.stage}", unit="step",
                   mininterval=0.5, initial=first, total=t["steps"], disable=not self.primary)
        shape = exp.batch_shape.shape
        rows = distributed.local_rows(exp.batch_sharding, shape)  # this process's slice
        try:
            for i in bar:
                batch = distributed.global_array(exp.batch_sharding, shape, data.batch(
                    self.tokens, i, t["batch_size"], exp.model.seq_len, self.seed, rows))
                if self.watchdog:
                    self.watchdog.reach(i + 1)
                tick = time.perf_counter()
                state, m = step(state, batch)
                m = {k: float(v) for k, v in m.items()}  # waits for the step
                m["skipped"] = int(m["skipped"])
                tps = exp.tokens_per_step / (time.perf_counter() - tick)
                record = {"step": i + 1, **m, "tokens_per_s": tps}
                skipped += m["skipped"]
                if metrics_file:
                    metrics_file.write(json.dumps(record) + "\n")
                losses.append(m["loss"])
                bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{tps:,.0f}")
                if ckpts:
                    every = self.args.save_every
                    if (every and (i + 1) % every == 0) or i + 1 == t["steps"]:
                        ckpts.save(state, self.checkpoint_meta(i + 1))
                        bar.write(f"saving checkpoint {i + 1} (training goes on)")
                    if done := ckpts.poll():
                        bar.write(str(done))
            if ckpts and (done := ckpts.finish()):
                print(done)
        except CheckpointError as e:
            bar.close()
            print(f"error: {e}", file=sys.stderr)
            return 1
        finally:
            if metrics_file:
                metrics_file.close()
        elapsed = time.perf_counter() - start
        steps = t["steps"] - first
        print(f"done: steps {first + 1}-{t['steps']} in {elapsed:.1f} s, loss {losses[0]:.3f} -> "
              f"{float(np.mean(losses[-10:])):.3f} (mean of last 10), "
              f"{steps * exp.tokens_per_step / elapsed:,.0f} tokens/s"
              + (f", {skipped} steps skipped (gradient not finite)" if skipped else ""))
        return 0

    def checkpoint_meta(self, step: int) -> dict:
        """What a checkpoint needs besides arrays to resume exactly and to be checked."""
        plan = self.exp.plan
        return {"config": self.cfg,
                "data": {"source": self.args.data, "seed": self.seed, "next_batch": step},
                "writer": {"stage": plan.stage, "devices": plan.mesh.size,
                           "processes": len({d.process_index for d in plan.mesh.devices.flat}),
                           "platform": plan.mesh.devices.flat[0].platform}}


if __name__ == "__main__":
    sys.exit(main())
