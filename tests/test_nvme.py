"""ZeRO-Infinity's NVMe tier: the master and optimizer state in files, updated band by band.

Against ``Offload(optimizer=1.0)`` (the same optax update, in host memory): the same losses,
parameters and state, bit for bit, at every stage (AdamW, and SGD over two microbatches); the
files where the policy says and nowhere else; the bands alive at once bounded by
``Nvme.buffers`` while the state is many times that; checkpoints across the tiers; bad paths,
failed files and unchunkable optimizers refused with one line; one writer per directory, and a
damaged band stopping the step that reads it, naming its file, before anything is trained on it.
"""

import contextlib
import dataclasses
import itertools
import json
import os
import re
import shutil
import sys
import tracemalloc
from types import SimpleNamespace

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import FIXED_SCHEDULE, KEY, ONE_LAYER, ROOT, example
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from lm import LAYERS

from zero_jax import Offload, Precision, init_state, lock, make_plan, make_train_step
from zero_jax import nvme as tiers
from zero_jax.checkpoint import CheckpointError, Checkpoints
from zero_jax.nvme import Nvme, NvmeError, check_elementwise
from zero_jax.state import abstract_state, state_shardings

pytestmark = pytest.mark.slow  # the tiers: docs/testing.md

# 3 steps: the second and third update through the moments the tier wrote and read back
STEPS = 3
BUFFERS = 3
CHUNK_MB = 1 / 128  # 8 KiB: the small model's state is read in many bands
ADAMW = optax.adamw(3e-3, weight_decay=0.1)


def setting(stage: int) -> tuple:
    """(optimizer, microbatches): stage 0 trains with SGD over two microbatches (the tier
    updates the finished gradient, whatever the optimizer and however it was summed), the
    others with AdamW on one batch."""
    return (optax.sgd(0.3), 2) if stage == 0 else (ADAMW, 1)


_HOST = {}  # per stage: the host-memory run (step, state, losses), shared by the tests


def plans(mesh, small, stage, path, **nvme):
    """(host memory, NVMe): at stage 3 the parameter shards in host memory too, as DeepSpeed's
    offload_param cpu beside offload_optimizer nvme."""
    _, init, _, _ = small
    shapes = jax.eval_shape(init, KEY)
    kw = dict(layers=LAYERS, precision=Precision("bf16"))
    host = Offload(optimizer=1.0, params=stage == 3)
    tier = Nvme(str(path), **{"chunk_mb": CHUNK_MB, "buffers": BUFFERS, **nvme})
    return tuple(make_plan(shapes, mesh, stage, offload=o, **kw)
                 for o in (host, dataclasses.replace(host, nvme=tier)))


def train(plan, small, state=None, first=0, steps=STEPS, step=None, tx=ADAMW):
    _, init, loss_fn, batches = small
    state = init_state(plan, init, tx, KEY) if state is None else state
    put = lambda b: jax.device_put(b, NamedSharding(plan.mesh, P("data")))
    step = step or make_train_step(plan, loss_fn, tx, accum_steps=setting(plan.stage)[1]).lower(
        state, put(batches[first])).compile()
    losses = []
    for b in batches[first:first + steps]:
        state, m = step(state, put(b))
        losses.append(float(m["loss"]))
    return step, state, losses


def host_run(mesh, small, stage, tmp_path, compiled=False):
    """(state, losses) of the host-memory run; with ``compiled``, its compiled step first."""
    if stage not in _HOST:
        _HOST[stage] = train(plans(mesh, small, stage, tmp_path)[0], small,
                             tx=setting(stage)[0])
    return _HOST[stage] if compiled else _HOST[stage][1:]


def assert_states_equal(a, b):
    for name in ("params", "master", "opt_state"):
        for x, y in zip(jax.tree.leaves(getattr(a, name)), jax.tree.leaves(getattr(b, name)),
                        strict=True):
            assert x.sharding.is_equivalent_to(y.sharding, x.ndim), name
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_equals_host_memory_offload_bit_for_bit(stage, mesh, small, tmp_path):
    want, want_losses = host_run(mesh, small, stage, tmp_path)
    _, nvme = plans(mesh, small, stage, tmp_path)
    tx = setting(stage)[0]
    step, got, losses = train(nvme, small, tx=tx)
    assert losses == want_losses
    assert got.master is None and got.opt_state is None  # they live in the files
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(got.params)}
    assert ("pinned_host" in kinds) == (stage == 3)  # stage 3: the parameter shards offloaded
    tier = step.tier
    assert_states_equal(tier.give(got, state_shardings(nvme, tx)), want)
    # At most ``buffers`` bands of at most a chunk each were alive, of a state 10x their size
    # (SGD's, the master alone: 6x)
    chunk = nvme.offload.nvme.chunk_bytes
    assert 0 < tier.high_water <= BUFFERS * chunk
    assert tier.bytes >= (10 if tx is ADAMW else 6) * BUFFERS * chunk
    # each step reads and writes every trained piece's bytes once, one band at a time, each
    # band one contiguous run of its slot's file; the files are all it wrote
    frozen = sum(s.shape[0] * tier._row_bytes(s) for s in tier._shards
                 if tier._leaves[s.leaf].frozen)
    assert sum(os.path.getsize(f) for f in tier.files) == tier.bytes
    assert tier.read_bytes == tier.written_bytes == tier.bytes - frozen
    assert os.listdir(tmp_path) == ["process0"]
    assert sorted(os.listdir(tmp_path / "process0")) == sorted(
        [os.path.basename(f) for f in tier.files] + ["layout.json", ".writer.lock"])


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x_BxD):
        for _ in range(4):
            x_BxD = jnp.tanh(nn.Dense(512)(x_BxD))
        return x_BxD


def test_host_memory_is_the_buffers_not_the_state(mesh, tmp_path):
    """A 1M-parameter model (12 MiB of master and Adam moments) through 3 buffers of 64 KiB:
    a new state holds no optimizer state, and what the host allocates during a step stays a
    small fraction of the state."""
    model, x_BxD = MLP(), jax.random.normal(KEY, (16, 512))
    init = lambda key: model.init(key, x_BxD)  # noqa: E731
    loss_fn = lambda params, x_BxD: jnp.mean(jnp.square(model.apply(params, x_BxD) - 0.5))
    plan = make_plan(jax.eval_shape(init, KEY), mesh, 2, offload=Offload(
        optimizer=1.0, nvme=Nvme(str(tmp_path), chunk_mb=1 / 16, buffers=BUFFERS)))
    live = lambda: sum(x.nbytes for x in jax.live_arrays())
    before = live()
    state = init_state(plan, init, ADAMW, KEY)
    born = live() - before
    step = make_train_step(plan, loss_fn, ADAMW)
    batch = jax.device_put(x_BxD, NamedSharding(mesh, P("data")))
    assert state.opt_state is None  # and no device or host holds it: see below
    state, first = step(state, batch)  # compiles; the master and Adam's moments go to files
    tracemalloc.start()  # the host's allocations during one step (numpy's are traced)
    state, second = step(state, batch)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    tier = step.tier
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    assert tier.bytes == 12 * n_params
    assert tier.bytes >= 50 * BUFFERS * plan.offload.nvme.chunk_bytes
    assert tier.high_water <= BUFFERS * plan.offload.nvme.chunk_bytes
    # On the CPU backend the devices keep the new compute copy in numpy's buffers (device
    # memory is host memory there): those are the parameters, not the optimizer's state.
    params = sum(x.nbytes for x in jax.tree.leaves(state.params))  # one copy, in pieces
    assert peak - params < tier.bytes / 8, (peak, params, tier.bytes)
    # A new state holds its master and compute copy (8 bytes a parameter here; 16 with Adam's
    # moments): the first step writes them to the files band by band with tx.init's values.
    assert born <= 8 * n_params + 64, (born, n_params)
    assert second["loss"] < first["loss"]


def test_checkpoints_cross_between_the_tiers(mesh, small, tmp_path):
    """A checkpoint of an NVMe run restores in host memory and back into files, and training
    goes on with the same losses."""
    host, nvme = plans(mesh, small, 3, tmp_path / "nvme")
    os.mkdir(tmp_path / "nvme")
    # the host-memory run's step trains the state restored into host memory: its plan is this
    # ``host`` (no path in it), and the program is compiled once
    host_step, _, want_losses = host_run(mesh, small, 3, tmp_path, compiled=True)
    step, state, losses = train(nvme, small, steps=1)  # moments set: what the checkpoint holds
    with pytest.raises(CheckpointError, match="live in the NVMe tier's files"):
        Checkpoints(tmp_path / "refused").save(state, {})
    ckpts = Checkpoints(tmp_path / "ckpt")
    ckpts.save(step.tier.give(state, state_shardings(nvme, ADAMW)), {})
    ckpts.finish()
    step.tier.close()  # the directory is free for the next step's tier
    for plan in (host, nvme):  # restored into host memory, and into the files again
        restored, _ = ckpts.restore(abstract_state(plan, ADAMW))
        _, _, more = train(plan, small, restored, 1, 2, host_step if plan is host else None)
        assert losses + more == want_losses
    ckpts.close()


def test_refuses_bad_paths_and_unchunkable_optimizers(mesh, small, tmp_path, monkeypatch):
    _, _, loss_fn, _ = small
    for path, match in [(tmp_path / "missing", "is not an existing directory"),
                        ("/proc", r"is not writable \(")]:
        with pytest.raises(ValueError, match=match):
            make_train_step(plans(mesh, small, 3, path)[1], loss_fn, ADAMW)
    monkeypatch.setattr("shutil.disk_usage", lambda path: SimpleNamespace(free=1000))
    with pytest.raises(ValueError, match=r"has 0.000 GiB free; this process's optimizer "
                                         r"state needs 0.00\d GiB"):
        make_train_step(plans(mesh, small, 3, tmp_path)[1], loss_fn, ADAMW)
    monkeypatch.undo()
    assert not os.listdir(tmp_path)  # nothing written
    nvme = plans(mesh, small, 3, tmp_path)[1]
    clipped = optax.chain(optax.clip_by_global_norm(1.0), ADAMW)
    with pytest.raises(ValueError, match="optimizer must be elementwise .* a reduction"):
        make_train_step(nvme, loss_fn, clipped)
    with pytest.raises(ValueError, match="factored moments"):
        make_train_step(nvme, loss_fn, optax.adafactor(1e-3, min_dim_size_to_factor=8))
    w = {"w": jax.ShapeDtypeStruct((4, 3), np.float32)}
    check_elementwise(lambda g, s, p: ADAMW.update(g, s, p), w, jax.eval_shape(ADAMW.init, w),
                      w)


def test_processes_sharing_the_path_check_it_at_once(tmp_path):
    """The processes of a host share one NVMe path and check it as each starts: 8 checks at
    once, 200 times each, all pass (with one probe name for all, one's removal of it failed
    another's check as "not writable": 2 processes on the CPU mesh met it), nothing left."""
    import concurrent.futures

    from zero_jax.nvme import Tier

    fake = SimpleNamespace(nvme=SimpleNamespace(path=str(tmp_path)), files=[], bytes=0)

    def check(_):
        for _ in range(200):
            Tier.check_path(fake)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(check, range(8)))
    assert not os.listdir(tmp_path)


def test_a_file_lost_mid_run_is_one_line(mesh, small, tmp_path):
    nvme = plans(mesh, small, 3, tmp_path)[1]
    step, state, _ = train(nvme, small, steps=1)
    lost = step.tier.files[-1]
    os.remove(lost)
    with pytest.raises(NvmeError, match=rf"^the NVMe tier's files under {tmp_path}/process0 "
                                        rf"failed mid-step \(.*{os.path.basename(lost)}.*\): "
                                        rf"the optimizer state there is partly updated; "
                                        rf"restart from the last checkpoint$"):
        train(nvme, small, state, 1, 1, step)


def test_one_writer_per_directory(mesh, small, tmp_path):
    """A second tier on a directory in use is refused in one line naming the directory and its
    holder, before it writes anything; once the first closes, the directory is free."""
    _, _, loss_fn, _ = small
    nvme = plans(mesh, small, 2, tmp_path)[1]
    first = make_train_step(nvme, loss_fn, ADAMW)
    with pytest.raises(ValueError, match=(
            rf"^the NVMe tier's directory {tmp_path}/process0 is being written by process "
            rf"{os.getpid()} on .+ since .+ \(.+\): two runs on one directory would "
            rf"train on each other's optimizer state; wait for it to finish, or give this run "
            rf"another NVMe path$")):
        make_train_step(nvme, loss_fn, ADAMW)
    assert os.listdir(tmp_path / "process0") == [".writer.lock"]
    first.tier.close()
    make_train_step(nvme, loss_fn, ADAMW).tier.close()
    assert not os.listdir(tmp_path)  # a tier that wrote nothing leaves nothing


def flip(path, offset: int, n: int) -> None:
    """``n`` bytes of a file inverted from ``offset``, as a disk's bad block would return them."""
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(n)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


def zero(path) -> None:
    with open(path, "r+b") as f:
        f.write(bytes(os.path.getsize(path)))


def test_a_damaged_band_stops_the_step_naming_its_file(mesh, small, tmp_path):
    """Bytes flipped in one band: the step that reads it stops with one line naming the file
    and the band, and reading the state back for a checkpoint is refused alike; files zeroed:
    the same. A checkpoint's state handed to the step rewrites the files and training goes on
    with the losses of host memory."""
    nvme = plans(mesh, small, 3, tmp_path)[1]
    want = host_run(mesh, small, 3, tmp_path)[1]
    step, state, losses = train(nvme, small, steps=1)
    tier, shardings = step.tier, state_shardings(nvme, ADAMW)
    good = tier.give(state, shardings)  # what a checkpoint after step 1 holds
    band = tier._placed[0][0][1]
    flip(tier.files[0], band.start + 16, 256)
    damaged = (rf"^the NVMe tier's file {tier.files[0]} is damaged: band 1 of {tier._nbands} "
               rf"\(bytes {band.start}-{band.start + band.nbytes}\) does not match the checksum "
               rf"written with it; nothing was trained on it or read back from it: restart "
               rf"from the last checkpoint$")
    with pytest.raises(NvmeError, match=damaged):
        train(nvme, small, state, 1, 1, step)
    with pytest.raises(NvmeError, match=damaged):
        tier.give(state, shardings)
    for f in tier.files:
        zero(f)
    with pytest.raises(NvmeError, match=rf"file {tier.files[0]} is damaged: band 0 of "):
        train(nvme, small, state, 1, 1, step)
    _, _, more = train(nvme, small, good, 1, 2, step)  # restarted from the checkpoint
    assert losses + more == want[:3]


def test_the_guides_example_runs_as_written(mesh, small, tmp_path):
    _, init, loss_fn, batches = small
    ns = {"params_shape": jax.eval_shape(init, KEY), "mesh": mesh, "init_params": init,
          "tx": ADAMW, "key": KEY, "loss_fn": loss_fn,
          "batch": jax.device_put(batches[0], NamedSharding(mesh, P("data")))}
    code = example("docs/guides/nvme.md", "nvme").replace('"/local/nvme"', repr(str(tmp_path)))
    exec(compile(code, "docs/guides/nvme.md", "exec"), ns)
    assert ns["state"].opt_state is None and ns["plan"].blocks == ["blocks"]
    # one more step: the first update went through the files as host memory would do it
    _, m = ns["step"](ns["state"], jax.device_put(batches[1], NamedSharding(mesh, P("data"))))
    want = host_run(mesh, small, 3, tmp_path)[1]
    assert [float(ns["metrics"]["loss"]), float(m["loss"])] == want[:2]
    assert len(os.listdir(tmp_path / "process0")) == len(ns["step"].tier.files) + 2


def _full():
    raise OSError(28, "No space left on device")


sys.path.insert(0, str(ROOT))
import train as cli  # noqa: E402

# train.py with the NVMe tier's directory ``nvme`` (relative: the run's working directory)
BASE = ["--config", "tiny", *ONE_LAYER, *FIXED_SCHEDULE, "--set", "optimizer.clip_norm=0",
        "--set", "zero.offload_optimizer.nvme_path=nvme"]
NVME = ["--set", "zero.offload_optimizer.device=nvme"]


@pytest.fixture(scope="module")
def nvme_run(tmp_path_factory):
    """train.py with the NVMe tier, 4 uninterrupted steps saved every 2: its checkpoint
    directory and its losses, which both train.py tests below start from or compare with."""
    d = tmp_path_factory.mktemp("nvme-run")
    (d / "nvme").mkdir()
    with contextlib.chdir(d):
        assert cli.main([*BASE, *NVME, "--steps", "4", "--checkpoint-dir", "ckpt",
                         "--save-every", "2", "--metrics", "m.jsonl"]) == 0
    return d / "ckpt", [json.loads(line)["loss"] for line in (d / "m.jsonl").open()]


def test_train_py_trains_resumes_and_reports_with_the_tier(tmp_path, monkeypatch, capsys,
                                                           nvme_run):
    """``zero.offload_optimizer.device nvme``: the same losses as ``cpu``; a checkpoint of it
    resumes into either tier with the same losses; the report names the files."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nvme").mkdir()
    base = BASE
    names = itertools.count()

    def run(device, steps, *more):
        out = tmp_path / f"{device}-{steps}-{next(names)}.jsonl"
        assert cli.main([*base, "--set", f"zero.offload_optimizer.device={device}", "--steps",
                         str(steps), "--metrics", str(out), *more]) == 0
        return [json.loads(line)["loss"] for line in out.read_text().splitlines()]

    # the uninterrupted cpu run: its steps 1-4 the NVMe run's (the schedule does not depend on
    # --steps: FIXED_SCHEDULE), its steps 5-6 what a resume from checkpoint 4 must give
    cpu = run("cpu", 6)
    ckpt, nvme = nvme_run
    assert nvme == cpu[:4] and len(nvme) == 4
    want = cpu[4:]
    for device in ("cpu", "nvme"):  # the NVMe run's checkpoint 4, into each tier
        shutil.copytree(ckpt, tmp_path / f"from-nvme-{device}")
        assert run(device, 6, "--checkpoint-dir", f"from-nvme-{device}", "--resume") == want
    assert len(want) == 2
    # a disk that fills mid-run: one line, exit 1, the last checkpoint kept
    writes = iter(range(10**6))
    capsys.readouterr()
    with monkeypatch.context() as m:
        m.setattr("zero_jax.nvme._write_at", lambda *a: next(writes) < 3 or _full())
        assert cli.main([*base, "--set", "zero.offload_optimizer.device=nvme", "--steps", "8",
                         "--checkpoint-dir", "from-nvme-nvme", "--resume"]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err[-1].startswith("error: the NVMe tier's files under nvme/process0 failed "
                              "mid-step ([Errno 28] No space left on device)"), err
    assert "Traceback" not in "\n".join(err)
    assert Checkpoints(tmp_path / "from-nvme-nvme", read_only=True).steps() == [2, 4, 6]
    assert cli.main([*base, "--set", "zero.offload_optimizer.device=nvme", "--dry-run",
                     "--report", "r.json"]) == 0
    assert "in files under nvme (the NVMe tier)" in capsys.readouterr().out
    report = json.loads((tmp_path / "r.json").read_text())["offload"]["nvme"]
    assert report["swapped_bytes_per_step"] == 2 * sum(report["file_bytes"].values()) > 0


def test_train_py_stops_on_a_damaged_tier_and_resumes_exactly(tmp_path, monkeypatch, capsys,
                                                              nvme_run):
    """Through ``train.py`` (4 steps, a checkpoint every 2): a band flipped just after
    checkpoint 2, and every file zeroed in the middle of step 3's update, each stop the run at
    once with one line naming the file (exit 1): no checkpoint after 2 is written, 2 is kept,
    and ``--resume`` gives the uninterrupted run's losses bit for bit. A second run on the
    tier's directory is refused in one line (exit 2) before it writes anything."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nvme").mkdir()
    base = [*BASE, *NVME, "--save-every", "2"]
    whole = nvme_run[1]  # the same run uninterrupted

    def run(name, *more):
        capsys.readouterr()
        rc = cli.main([*base, "--steps", "4", "--checkpoint-dir", name, "--metrics",
                       f"{name}.jsonl", *more])
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert "Traceback" not in "\n".join(err)
        return rc, err

    def losses(name):
        return [json.loads(line)["loss"] for line in (tmp_path / f"{name}.jsonl").open()]

    real_give, real_update, real_write = tiers.Tier.give, tiers.Tier.update, tiers.Tier._write

    def give_then_flip(self, *args):  # the checkpoint's state is read back, then damaged
        out = real_give(self, *args)
        flip(self.files[0], 1024, 4096)
        return out

    def counted(self, *args):
        self.updates = getattr(self, "updates", 0) + 1
        return real_update(self, *args)

    def write_then_zero(self, *args):  # step 3's first band written, then every file zeroed
        real_write(self, *args)
        if self.updates == 3 and not getattr(self, "zeroed", False):
            self.zeroed = [zero(f) for f in self.files]

    for name, patches in [("flipped", {"give": give_then_flip}),
                          ("zeroed", {"update": counted, "_write": write_then_zero})]:
        with monkeypatch.context() as m:
            for attr, fn in patches.items():
                m.setattr(tiers.Tier, attr, fn)
            rc, err = run(name)
        assert rc == 1 and len([e for e in err if e.startswith("error:")]) == 1, err
        assert re.fullmatch(
            r"error: the NVMe tier's file nvme/process0/slot\d+\.bin is damaged: band 0 of \d+ "
            r"\(bytes \d+-\d+\) does not match the checksum written with it; nothing was "
            r"trained on it or read back from it: restart from the last checkpoint; the "
            rf"newest checkpoint, from before it, is 2 in {tmp_path / name}: continue from it "
            r"with --resume", err[-1]), err
        assert Checkpoints(tmp_path / name, read_only=True).steps() == [2]
        assert losses(name) == whole[:2]  # step 3 stopped before its record
        assert run(name, "--resume")[0] == 0
        assert losses(name) == whole, name
    before = {p: p.read_bytes() for p in (tmp_path / "nvme" / "process0").glob("*.bin")}
    holder = lock.WriterLock(tmp_path / "nvme" / "process0")  # another run's, in effect
    try:
        rc, err = run("second")
    finally:
        holder.release()
    assert rc == 2 and len(err) == 1, err
    assert re.fullmatch(
        rf"error: the NVMe tier's directory nvme/process0 is being written by process "
        rf"{os.getpid()} on .+: two runs on one directory would train on each other's "
        r"optimizer state; wait for it to finish, or give this run another NVMe path", err[0])
    assert not (tmp_path / "second").exists() and not (tmp_path / "second.jsonl").exists()
    assert before == {p: p.read_bytes() for p in (tmp_path / "nvme" / "process0").glob("*.bin")}
