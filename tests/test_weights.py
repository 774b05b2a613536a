"""Pretrained weights in and trained weights out, against a client nobody here wrote:
Hugging Face ``transformers``' PyTorch GPT-2 (CPU torch) saves a small random model, zero_jax
reads it into its shards at several layouts, computes the same logits, fine-tunes as one
device's optax does, and exports files that ``transformers`` loads with the same logits.
"""

import argparse
import contextlib
import dataclasses
import io
import json
import pathlib
import re
import subprocess
import sys
from unittest import mock

import jax
import numpy as np
import optax
import pytest
import safetensors.numpy
import torch
import transformers
from conftest import ROOT, TRAIN_ENV, max_rel, optax_steps, rel

import zero_jax as zj
from zero_jax.gpt import data, hf, resume
from zero_jax.gpt.model import GPT, LAYERS, TENSOR_PARALLEL, GPTConfig, lm_loss
from zero_jax.tensorfiles import TensorFiles, WeightsError
from zero_jax.weights import Mapping, Tensor, check, export_specs, load_params

sys.path.insert(0, str(ROOT))
import train as train_py  # noqa: E402

HF = {"vocab_size": 64, "n_positions": 16, "n_embd": 32, "n_layer": 2, "n_head": 4}
TOKENS = np.random.default_rng(0).integers(0, 64, (8, 17)).astype(np.int32)


def torch_logits_of(cls, directory, tokens=TOKENS[:, :-1], **config) -> np.ndarray:
    model = cls.from_pretrained(directory, **config).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def torch_logits(directory, tokens=TOKENS[:, :-1]) -> np.ndarray:
    return torch_logits_of(transformers.GPT2LMHeadModel, directory, tokens)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> dict:
    """A random GPT-2 saved by transformers, as one file and as shards with an index; every
    tensor drawn at random (its own init leaves biases 0 and layer norms 1, which would hide a
    bias or scale read into the wrong place)."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**HF)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    root = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(root / "one")
    model.save_pretrained(root / "sharded", max_shard_size="40KB")
    tokens = root / "tokens.bin"
    np.random.default_rng(1).integers(0, 64, 4096).astype(np.uint16).tofile(tokens)
    return {"one": root / "one", "sharded": root / "sharded", "tokens": tokens,
            "logits": torch_logits(root / "one"), "model": GPT(GPTConfig(  # 64 padded to 128
                **hf.read_config(root / "one"), remat="none", vocab_multiple=128))}


def logits_of(model, params) -> np.ndarray:
    """``model``'s logits on TOKENS, jitted: op by op on sharded parameters each operation
    compiles a program of its own."""
    return np.asarray(jax.jit(lambda p: model.apply({"params": p}, TOKENS[:, :-1]))(params))


def run_train(*args: str) -> subprocess.CompletedProcess:
    """``train.main`` in this process, its output caught as a process's (a start-up less, and
    compiled at the suite's level: the runs here train 2 steps)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = train_py.main(list(args))
    return subprocess.CompletedProcess(["train.py", *args], code, out.getvalue(), err.getvalue())


def plan_for(model: GPT, stage: int, tp: int = 1, rules=TENSOR_PARALLEL) -> zj.Plan:
    """``model``'s plan at ``stage`` over 8 devices (x tensor parallel ``tp``, by ``rules``)."""
    mesh = zj.make_mesh(axes={"data": 8 // tp, **({"model": tp} if tp > 1 else {})})
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), TOKENS[:1, :-1])["params"])
    return zj.make_plan(shapes, mesh, stage=stage, layers=LAYERS,
                        rules=list(rules) if tp > 1 else [])


def test_sharded_set_names_three_files(gpt2):
    index = json.loads((gpt2["sharded"] / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3


@pytest.mark.parametrize("stage,tp,source", [(0, 1, "one"), (3, 1, "sharded"), (3, 2, "one")])
def test_loaded_into_shards_gives_transformers_logits(gpt2, stage, tp, source):
    """Read straight into each layout's shards (the stage-3 one from the sharded set), each
    device's part is its slice of the whole, and the logits are transformers' within 1e-5."""
    plan = plan_for(gpt2["model"], stage, tp)
    files, mapping = hf.weights_source(gpt2[source])
    params = load_params(plan, files, mapping)
    assert files.bytes_read == sum(i.nbytes for i in files.tensors.values())  # each byte once
    for x, spec in zip(jax.tree.leaves(params), jax.tree.leaves(
            plan.opt_specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec)),
            strict=True):
        assert x.sharding.spec == spec
        whole = np.asarray(x)
        for shard in x.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), whole[shard.index])
    logits = logits_of(gpt2["model"], params)
    assert rel(logits, gpt2["logits"]) < 1e-5, rel(logits, gpt2["logits"])


def test_each_process_reads_about_half_the_file_at_stage_3(gpt2):
    """Stage 3 on 8 devices, as 2 processes of 4 devices hold it: the reads of the first 4
    devices' shards (what process 0 runs) come to half the tensors' bytes, each read from
    its own byte ranges of the memory map (the vocabulary unpadded: padded, the first half
    of its rows holds every real one)."""
    plan = plan_for(GPT(dataclasses.replace(gpt2["model"].cfg, vocab_multiple=1)), 3)
    files, mapping = hf.weights_source(gpt2["one"])
    _, sources = check(plan, files, mapping)
    first = set(plan.mesh.devices.flat[:4])
    flat = jax.tree_util.tree_flatten_with_path(plan.shapes)[0]
    shardings = jax.tree.leaves(plan.shardings(plan.opt_specs))
    for (path, want), sharding in zip(flat, shardings, strict=True):
        src = sources[zj.plan.path_str(path)]
        seen = set()
        for device, index in sharding.devices_indices_map(want.shape).items():
            key = tuple((s.start, s.stop) for s in index)
            if device in first and key not in seen:
                seen.add(key)
                src.read(files, index, want.dtype)
    total = sum(i.nbytes for i in files.tensors.values())
    assert files.bytes_read == total // 2, (files.bytes_read, total)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_fine_tuning_loaded_weights_equals_one_device_optax(gpt2, name):
    """Stage 3 from the loaded weights, 3 steps, against plain optax on one device from the
    same weights: losses and parameters (AdamW's state is the fp32 master's)."""
    tx = optax.sgd(0.1) if name == "sgd" else optax.adamw(1e-2)
    model = gpt2["model"]
    plan = plan_for(model, 3)
    files, mapping = hf.weights_source(gpt2["one"])
    whole = jax.device_get(load_params(plan_for(model, 0), files, mapping))
    state = zj.init_state(plan, load_params(plan, files, mapping), tx)
    step = zj.make_train_step(plan, lm_loss(model), tx)
    batches = [TOKENS, TOKENS[::-1], np.roll(TOKENS, 1, axis=1)]
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    ref = optax_steps(lm_loss(model), tx, whole, batches)
    np.testing.assert_allclose(losses, ref["losses"], rtol=1e-6)
    got, want = jax.device_get(state.params), jax.device_get(ref["params"])
    if name == "adamw":
        # The key bias adds q.b_k to every score of a row, which the softmax ignores: its
        # gradient is zero but for rounding, which Adam scales to +-lr whatever its size.
        for tree in (got, want):
            tree["blocks"]["qkv"]["bias"] = np.delete(tree["blocks"]["qkv"]["bias"], 1, 1)
    assert max_rel(got, want) < 1e-5


@pytest.mark.slow
def test_train_py_init_from_and_export_round_trip(gpt2, tmp_path):
    """train.py --init-from the directory: its first loss is transformers' on that batch; two
    SGD steps; the export (sharded, with an index) loads in transformers with zero_jax's
    logits of the trained checkpoint, and so does the run's own --save-safetensors directory,
    tensor for tensor the export's; and the plain safetensors export reads back in the
    safetensors client as the checkpoint's parameters."""
    ckpt, metrics, live = tmp_path / "ckpt", tmp_path / "metrics.jsonl", tmp_path / "live"
    run = run_train("--init-from", str(gpt2["sharded"]), "--steps", "2", "--data",
                    str(gpt2["tokens"]), "--checkpoint-dir", str(ckpt), "--save-every", "2",
                    "--metrics", str(metrics), "--save-safetensors", str(live),
                    "--set", "optimizer.name=sgd", "--set", "train.batch_size=8")
    assert run.returncode == 0, run.stderr
    first = json.loads(metrics.read_text().splitlines()[0])["loss"]
    batch = data.batch(np.fromfile(gpt2["tokens"], np.uint16), 0, 8, 16, 0)
    logits = torch.tensor(torch_logits(gpt2["one"], batch[:, :-1]))
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), torch.tensor(
        batch[:, 1:], dtype=torch.long).reshape(-1)).item()
    assert first == pytest.approx(ref, rel=1e-5)

    out = tmp_path / "hf"
    assert hf.main([str(ckpt), str(out), "--max-shard-size", "40KB"]) == 0
    assert len(list(out.glob("model-*.safetensors"))) >= 3
    ckpts = zj.Checkpoints(ckpt, read_only=True)
    trained = ckpts.read_params()
    ckpts.close()
    ours = logits_of(gpt2["model"], trained)
    theirs = torch_logits(out)
    assert rel(theirs, ours) < 1e-5 and rel(ours, gpt2["logits"]) > 1e-3
    exported = {k: v for f in out.glob("model-*.safetensors")
                for k, v in safetensors.numpy.load_file(f).items()}
    saved = safetensors.numpy.load_file(live / "model.safetensors")
    assert saved.keys() == exported.keys()
    for k, v in saved.items():
        np.testing.assert_array_equal(v, exported[k])
    assert rel(torch_logits(live), ours) < 1e-5

    from zero_jax import export

    assert export.main([str(ckpt), str(tmp_path / "st"), "--format", "safetensors"]) == 0
    back = safetensors.numpy.load_file(tmp_path / "st" / "model.safetensors")
    flat = {zj.plan.path_str(p): v for p, v in jax.tree_util.tree_flatten_with_path(trained)[0]}
    assert set(back) == {p.replace("/", ".") for p in flat}
    for p, v in flat.items():
        np.testing.assert_array_equal(back[p.replace("/", ".")], np.asarray(v))


def _reference_set(params, mapping, out: pathlib.Path) -> None:
    """The offline writer's files of ``params`` gathered (``write_set`` of ``export_arrays``,
    the tensor-by-tensor stream), with save_safetensors' metadata."""
    from zero_jax.tensorfiles import write_set
    from zero_jax.weights import export_arrays, export_specs

    flat = {zj.plan.path_str(p): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    specs = export_specs(mapping, {p: v.shape for p, v in flat.items()}, np.float32)
    out.mkdir()
    write_set(out, [s for s, *_ in specs], export_arrays(mapping, specs, flat.__getitem__),
              metadata={"format": "pt", "step": "3"})


@pytest.mark.parametrize("tp", [1, 2])
def test_in_run_save_writes_the_exports_bytes_from_the_shards(gpt2, tmp_path, tp):
    """Stage 3 (x tensor parallel 2) on 8 devices, the state's parameters saved by the loop
    hook straight from their shards as a Hugging Face directory: the file is byte for byte
    what the offline writer makes of the gathered parameters (and, at stage 3, what
    ``python -m zero_jax.gpt.hf`` exports from a checkpoint of the same state), every byte
    written once, and transformers loads it with zero_jax's logits."""
    from zero_jax.safetensors_writer import SafetensorsSaver

    section = hf.read_config(gpt2["one"])
    plan = plan_for(gpt2["model"], 3, tp)
    state = zj.init_state(plan, load_params(plan, *hf.weights_source(gpt2["one"])),
                          optax.sgd(0.1))
    mapping = hf.mapping(section)
    out = tmp_path / "hf"
    saver = SafetensorsSaver(out, every=0, last=3, mapping=mapping,
                             extra=lambda d: hf.write_config(d, section, "float32"))
    saver(2, state, {}, {})
    assert not out.exists()
    saver(3, state, {}, {})
    _reference_set(state.params, mapping, tmp_path / "ref")
    ours = (out / "model.safetensors").read_bytes()
    assert ours == (tmp_path / "ref" / "model.safetensors").read_bytes()
    if tp == 1:
        ckpts = zj.Checkpoints(tmp_path / "ckpt")
        ckpts.save(state._replace(step=jax.numpy.asarray(3)), {"config": {"model": section}})
        ckpts.finish()
        ckpts.close()
        assert hf.main([str(tmp_path / "ckpt"), str(tmp_path / "exported")]) == 0
        assert ours == (tmp_path / "exported" / "model.safetensors").read_bytes()
    logits = logits_of(gpt2["model"], state.params)
    assert rel(torch_logits(out), logits) < 1e-5


def test_in_run_save_in_shards_and_bf16_replaces_the_last_save(gpt2, tmp_path):
    """With max_shard_bytes and bf16, from arrays cut along inner axes (stage 3 x tensor
    parallel 2): the shards and index the offline writer makes, read back by the safetensors
    client; a second save replaces the first whole."""
    from zero_jax.tensorfiles import write_set
    from zero_jax.weights import export_arrays, export_specs

    plan = plan_for(gpt2["model"], 3, 2)
    params = load_params(plan, *hf.weights_source(gpt2["one"]))
    mapping = hf.mapping(hf.read_config(gpt2["one"]))
    zj.save_safetensors(jax.tree.map(lambda x: x * 0, params), tmp_path / "out", mapping)
    saved = zj.save_safetensors(params, tmp_path / "out", mapping, "bfloat16", 20_000)
    assert saved.bytes_written == sum(s.nbytes for s in saved_specs(params, mapping, "bfloat16"))
    flat = {zj.plan.path_str(p): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    specs = export_specs(mapping, {p: v.shape for p, v in flat.items()}, "bfloat16")
    (tmp_path / "ref").mkdir()
    files = write_set(tmp_path / "ref", [s for s, *_ in specs], export_arrays(
        mapping, specs, flat.__getitem__), 20_000)
    assert len(files) >= 4 and sorted(f.name for f in saved.files) == sorted(
        f.name for f in files)
    for f in files:
        assert (tmp_path / "out" / f.name).read_bytes() == f.read_bytes(), f.name
    back = TensorFiles(tmp_path / "out")
    np.testing.assert_array_equal(back.view("transformer.wte.weight"),  # its padding left out
                                  flat["wte"][:HF["vocab_size"]].astype(jax.numpy.bfloat16))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "ref"]


def test_a_save_replaces_only_an_earlier_save(tmp_path):
    """The save replaces its directory whole: one that holds anything a save does not write
    (a checkpoint directory, the user's files) is refused with nothing written or deleted; an
    earlier save, config.json included, is replaced by the new values."""
    plan = zj.make_plan({"w": jax.ShapeDtypeStruct((8, 4), np.float32)}, zj.make_mesh(),
                        stage=1)
    w = np.arange(32, dtype=np.float32).reshape(8, 4)
    params = jax.device_put({"w": w}, plan.shardings(plan.param_specs))
    runs = tmp_path / "runs"
    (runs / "ckpt" / "2").mkdir(parents=True)
    (runs / "notes.txt").write_text("mine")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(WeightsError, match=f"{runs} holds ckpt, which a save there would "
                       "delete with the directory: pass a new directory"):
        zj.save_safetensors(params, runs)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    zj.save_safetensors(jax.tree.map(lambda x: x * 0, params), tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text("{}")  # as extra= writes one
    zj.save_safetensors(params, tmp_path / "hf")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["model.safetensors"]
    np.testing.assert_array_equal(
        safetensors.numpy.load_file(tmp_path / "hf" / "model.safetensors")["w"], w)


def saved_specs(params, mapping, dtype) -> list:
    from zero_jax.weights import export_specs

    shapes = {zj.plan.path_str(p): v.shape
              for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    return [s for s, *_ in export_specs(mapping, shapes, dtype)]


# Bad input -------------------------------------------------------------------------------------


def _edit(src: pathlib.Path, dst: pathlib.Path, change) -> pathlib.Path:
    """A copy of the one-file directory whose tensors ``change(dict)`` edits (saved by the
    safetensors client), or whose directory ``change(path)`` edits."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = safetensors.numpy.load_file(src / "model.safetensors")
    if change(tensors) is not False:
        safetensors.numpy.save_file(tensors, dst / "model.safetensors")
    return dst


BAD = {
    "missing": (lambda t: t.pop("transformer.h.1.mlp.c_fc.bias"),
                "tensor transformer.h.1.mlp.c_fc.bias (for parameter blocks/fc1/bias) is "
                "missing from"),
    "unexpected": (lambda t: t.update(extra=np.zeros(3, np.float32)),
                   "tensor extra in"),
    "shape": (lambda t: t.update({"transformer.wpe.weight": np.zeros((8, 32), np.float32)}),
              "tensor transformer.wpe.weight in"),
    "dtype": (lambda t: t.update({"transformer.ln_f.bias": np.zeros(32, np.int32)}),
              "is int32, parameter ln_f/bias is float32"),
}
RAW = {
    "truncated": (lambda d: _cut(d / "model.safetensors", -100), "is truncated: tensor"),
    "corrupt header": (lambda d: _poke(d / "model.safetensors", 9, b"}"),
                       "has a corrupt safetensors header"),
    "index naming a missing file": (lambda d: _index_only(d),
                                    "names model-00002-of-00002.safetensors, which is not in"),
    "unknown architecture": (lambda d: _config(d, model_type="bert"),
                             "is model_type 'bert'; this demo reads gpt2"),
    "other GELU": (lambda d: _config(d, activation_function="relu"),
                   "has activation_function 'relu'"),
}


def _cut(file: pathlib.Path, by: int) -> None:
    raw = file.read_bytes()
    file.write_bytes(raw[:by])


def _poke(file: pathlib.Path, at: int, byte: bytes) -> None:
    raw = bytearray(file.read_bytes())
    raw[at:at + 1] = byte
    file.write_bytes(bytes(raw))


def _index_only(d: pathlib.Path) -> None:
    names = safetensors.numpy.load_file(d / "model.safetensors")
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names}
    weight_map["transformer.wte.weight"] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _config(d: pathlib.Path, **change) -> None:
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, **change}))


@pytest.mark.parametrize("case", [*BAD, *RAW])
def test_bad_weights_are_one_line_exit_2_nothing_written(gpt2, tmp_path, case, capsys):
    """train.py --init-from each bad directory: one line naming the tensor or file and the
    fix, exit code 2, and neither the checkpoint directory nor the metrics file exists."""
    if case in BAD:
        change, message = BAD[case]
        bad = _edit(gpt2["one"], tmp_path / "bad", change)
    else:
        change, message = RAW[case]
        bad = _edit(gpt2["one"], tmp_path / "bad", lambda t: None)
        change(bad)
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    code = train_py.main(["--init-from", str(bad), "--steps", "1", "--data",
                          str(gpt2["tokens"]), "--checkpoint-dir", str(ckpt), "--metrics",
                          str(metrics)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert message in err[0], err
    assert not ckpt.exists() and not metrics.exists()


def test_a_mapping_that_leaves_a_parameter_unset_or_sets_one_twice(gpt2):
    plan = plan_for(gpt2["model"], 3)
    files, mapping = hf.weights_source(gpt2["one"])
    rows = mapping.tensors
    short = Mapping(tuple(r for r in rows if r.path != "wpe"), prefix=mapping.prefix)
    with pytest.raises(WeightsError, match="the mapping sets no value for parameter wpe"):
        check(plan, files, short)
    twice = Mapping((*rows, Tensor("wte.weight", "wpe")), prefix=mapping.prefix)
    with pytest.raises(WeightsError, match="sets parameter wpe twice"):
        check(plan, files, twice)
    stray = Mapping((*rows, Tensor("wte.weight", "head")), prefix=mapping.prefix)
    with pytest.raises(WeightsError, match="sets head .* which is not a parameter"):
        check(plan, files, stray)


def test_bad_export_arguments_are_one_line_and_write_nothing(tmp_path, capsys):
    from zero_jax import export

    with pytest.raises(SystemExit) as e:
        export.main([str(tmp_path), str(tmp_path / "out"), "--format", "safetensors",
                     "--max-shard-size", "lots"])
    assert e.value.code == 2 and "is not a size" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_slice_reads_its_bytes_and_offsets_must_span_the_shape(tmp_path):
    """A slice reads (and counts) its own bytes; a tensor whose offsets do not span its shape
    is a corrupt header."""
    x = {"a": np.arange(6, dtype=np.float32).reshape(2, 3)}
    safetensors.numpy.save_file(x, tmp_path / "model.safetensors")
    files = TensorFiles(tmp_path)
    np.testing.assert_array_equal(files.read(files.view("a")[1:]), x["a"][1:])
    assert files.bytes_read == 12
    raw = (tmp_path / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["a"]["data_offsets"] = [0, 20]
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    (tmp_path / "model.safetensors").write_bytes(raw[:8] + text + raw[8 + n:])
    with pytest.raises(WeightsError, match=r"a is F32 \[2, 3\] \(24 bytes\) but spans 20"):
        TensorFiles(tmp_path)


def test_the_guide_maps_fused_transposed_heads_and_back(tmp_path, monkeypatch):
    """docs/guides/weights.md's mapping of separate PyTorch q, k, v onto one fused Flax kernel
    (it asserts PyTorch's output itself); run backwards, the table gives the tensors back."""
    from conftest import example

    from zero_jax.weights import export_arrays, export_specs

    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(compile(example("docs/guides/weights.md", "weights-example"), "weights.md", "exec"), ns)
    flat = {zj.plan.path_str(p): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(ns["params"])[0]}
    specs = export_specs(ns["mapping"], {p: v.shape for p, v in flat.items()}, np.float32)
    back = {s.name: x for (s, *_), x in zip(specs, export_arrays(ns["mapping"], specs,
                                                                 flat.__getitem__), strict=True)}
    assert set(back) == set(ns["theirs"])
    for name, x in back.items():
        np.testing.assert_array_equal(x, ns["theirs"][name])


def test_a_bf16_checkpoint_into_a_bf16_run_with_a_frozen_embedding(gpt2, tmp_path):
    """transformers' model saved in bf16 (BF16 tensors), read into a bf16 run at stage 3 whose
    position embedding is frozen: the fp32 master holds the file's values exactly, the compute
    copy is bf16, and a step trains everything but wpe."""
    model = transformers.GPT2LMHeadModel.from_pretrained(gpt2["one"]).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    files, mapping = hf.weights_source(tmp_path / "bf16")
    assert {i.dtype.name for i in files.tensors.values()} == {"bfloat16"}
    whole = load_params(plan_for(gpt2["model"], 0), *hf.weights_source(gpt2["one"]))
    want = jax.tree.map(lambda x: np.asarray(x).astype(jax.numpy.bfloat16).astype(np.float32),
                        whole)
    base = plan_for(gpt2["model"], 3)
    plan = zj.make_plan(base.shapes, base.mesh, stage=3, layers=LAYERS,
                        rules=[zj.Rule("^wpe$", frozen=True)], precision=zj.Precision("bf16"))
    state = zj.init_state(plan, load_params(plan, files, mapping), optax.sgd(0.1))
    master = jax.device_get(state.master)
    for a, b in zip(jax.tree.leaves(master), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jax.numpy.dtype("bfloat16")}
    state, _ = zj.make_train_step(plan, lm_loss(gpt2["model"]), optax.sgd(0.1))(state, TOKENS)
    after = jax.device_get(state.master)
    np.testing.assert_array_equal(after["wpe"], want["wpe"])
    assert not np.array_equal(after["wte"], want["wte"])
    assert not np.array_equal(after["blocks"]["qkv"]["kernel"], want["blocks"]["qkv"]["kernel"])


def _checkpoint_of(directory: pathlib.Path, shapes: dict) -> None:
    """A checkpoint of random fp32 parameters of ``shapes`` at stage 3 on 8 devices."""
    plan = zj.make_plan(shapes, zj.make_mesh(), stage=3)
    init = lambda key: {k: jax.random.normal(jax.random.fold_in(key, i), v.shape)
                        for i, (k, v) in enumerate(shapes.items())}
    ckpts = zj.Checkpoints(directory)
    ckpts.save(zj.init_state(plan, init, optax.sgd(0.1), jax.random.key(0)), {})
    ckpts.finish()
    ckpts.close()


def _stacked(layers: int, rows: int) -> dict:
    """Two scanned stacks of ``layers`` (rows, 1024) fp32 layers and an embedding of one."""
    shape = lambda *s: jax.ShapeDtypeStruct(s, np.float32)
    return {"wte": shape(rows, 1024), "up": shape(layers, rows, 1024),
            "down": shape(layers, rows, 1024)}


PEAK = """
import sys
from zero_jax import export
from zero_jax.weights import Mapping, Tensor
mapping = Mapping((Tensor("wte", "wte"), Tensor("layers.{layer}.up", "up"),
                   Tensor("layers.{layer}.down", "down", transpose=(1, 0))))
export._return_freed_memory()
export.export(sys.argv[1], sys.argv[2], safetensors={"mapping": mapping})
print([line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM")][0])
"""


@pytest.mark.slow
def test_export_peak_memory_follows_the_largest_tensor_not_the_stack(tmp_path):
    """The export in a process of its own, its peak resident memory (VmHWM), for a model of
    two scanned stacks of 8 layers (2 x 32 MiB) and an embedding, written one tensor per layer
    (4 MiB each, the largest): 17 times its largest tensor, yet it peaks within the largest
    tensor + 16 MiB of a tiny model's export (what the process costs by itself). Each stored
    chunk (the 4 MiB shard one device saved) is read once and its layers' parts written where
    they lie; nothing holds a stack. Measured (2 cores): tiny 202 MiB, model 214 MiB; reading
    each parameter whole, as the export did before, peaked at 298 MiB (tiny 204)."""
    peaks, layer = {}, 4 << 20
    for name, rows in [("tiny", 8), ("model", 1024)]:
        _checkpoint_of(tmp_path / name, _stacked(8, rows))
        run = subprocess.run([sys.executable, "-c", PEAK, str(tmp_path / name),
                              str(tmp_path / f"{name}-out")], cwd=ROOT, env=TRAIN_ENV,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        peaks[name] = int(run.stdout.split()[-1]) * 1024
    back = safetensors.numpy.load_file(tmp_path / "model-out" / "model.safetensors")
    ckpts = zj.Checkpoints(tmp_path / "model", read_only=True)
    want = jax.device_get(ckpts.read_params())
    ckpts.close()
    assert len(back) == 17 and max(x.nbytes for x in back.values()) == layer
    for i in range(8):
        np.testing.assert_array_equal(back[f"layers.{i}.up"], want["up"][i])
        np.testing.assert_array_equal(back[f"layers.{i}.down"], want["down"][i].T)
    assert peaks["model"] - peaks["tiny"] < layer + (16 << 20), peaks


# Each family's decoder as transformers makes it: 4 query heads sharing 2 key/value heads.
SMALL_LLAMA = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "max_position_embeddings": 16}
# Llama 3.2's 1B and 3B: the head tied to the embedding, rotary positions scaled as "llama3"
# (theta 500,000; these factors and a 256-token original context put one of the 4 frequencies
# of a head of 8 below the band the scaling blends, one in it and two above it).
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
FAMILIES = {  # name: (class, config, torch seed)
    "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig(
        **SMALL_LLAMA, tie_word_embeddings=False), 0),
    "llama3": (transformers.LlamaForCausalLM, transformers.LlamaConfig(
        **SMALL_LLAMA, tie_word_embeddings=True,
        rope_parameters={**LLAMA3_ROPE, "rope_theta": 5e5}), 1),
    "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig(
        **SMALL_LLAMA, head_dim=8, sliding_window=16), 2),  # TOKENS' 16: the window
    "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
        **SMALL_LLAMA, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}), 3),
    # heads twice as wide as hidden_size / heads, as Qwen3's are
    "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config(
        **SMALL_LLAMA, head_dim=16, tie_word_embeddings=True), 4),
    # q, k, v in one tensor, gate and up in another (its pad token inside this vocabulary)
    "phi3": (transformers.Phi3ForCausalLM, transformers.Phi3Config(
        **SMALL_LLAMA, pad_token_id=0, tie_word_embeddings=False), 5),
    # as Phi-3.5 mini: longrope past an original context of 8 tokens (``longrope_file``)
    "phi3.5": (transformers.Phi3ForCausalLM, transformers.Phi3Config(
        **SMALL_LLAMA, pad_token_id=0, tie_word_embeddings=False,
        original_max_position_embeddings=8, rope_parameters={
            "rope_type": "longrope", "short_factor": [1.0, 1.25, 1.5, 2.0],
            "long_factor": [1.0, 3.0, 9.0, 27.0]}), 6),
    # as Phi-4-mini: half of each head rotated (its 0.75 of 128 here 0.5 of 8), longrope, tied
    "phi4-mini": (transformers.Phi3ForCausalLM, transformers.Phi3Config(
        **SMALL_LLAMA, pad_token_id=0, tie_word_embeddings=True, partial_rotary_factor=0.5,
        original_max_position_embeddings=8, rope_parameters={
            "rope_type": "longrope", "short_factor": [1.0, 1.5], "long_factor": [2.0, 8.0]}),
        8),
    # Gemma: norms scaled by 1 + weight, the embedding by sqrt(d), a tanh-GELU gate, heads
    # wider than hidden_size / heads (as Gemma 7B's)
    "gemma": (transformers.GemmaForCausalLM, transformers.GemmaConfig(
        **SMALL_LLAMA, head_dim=12, tie_word_embeddings=True), 9),
    # Gemma 2: its output norms, soft caps small enough to count, a scores scalar that is not
    # the head's width, a window of 5 of the 16 tokens on every other layer (the first)
    "gemma2": (transformers.Gemma2ForCausalLM, transformers.Gemma2Config(
        **SMALL_LLAMA, head_dim=8, query_pre_attn_scalar=12, attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0, sliding_window=5, tie_word_embeddings=True), 10),
    # Gemma 3 (its text model, as 270M and 1B): Gemma 2's layers with q and k norms, no soft
    # caps, every 3rd of 3 layers full, the sliding ones rotating at their own base; its
    # config.json in the Hub's form (``gemma3_file``)
    "gemma3": (transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(
        **{**SMALL_LLAMA, "num_hidden_layers": 3}, head_dim=8, sliding_window=5,
        sliding_window_pattern=3, tie_word_embeddings=True), 11),
    # Gemma 3's image-text models (4B and up): that text model under ``language_model.``,
    # beside a vision tower (left unread), its full layers' rope scaled (linear, 8)
    "gemma3-vision": (transformers.Gemma3ForConditionalGeneration, transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig(
            **{**SMALL_LLAMA, "num_hidden_layers": 3}, head_dim=8, sliding_window=5,
            sliding_window_pattern=3, rope_scaling={"rope_type": "linear", "factor": 8.0}
        ).to_dict(), vision_config=transformers.SiglipVisionConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            image_size=28, patch_size=14).to_dict(), mm_tokens_per_image=4), 12),
    # mixtures of experts: Mixtral's 2 of (here) 4 experts a token, their weights renormalized;
    # Qwen3-MoE's narrower experts, the chosen ones' softmax weights as they are
    "mixtral": (transformers.MixtralForCausalLM, transformers.MixtralConfig(
        **SMALL_LLAMA, num_local_experts=4, num_experts_per_tok=2), 13),
    "qwen3-moe": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
        **SMALL_LLAMA, head_dim=16, tie_word_embeddings=True, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=False), 14),
    # Qwen2-MoE's: q, k, v biases, and a shared expert beside the routed ones, gated
    "qwen2-moe": (transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig(
        **SMALL_LLAMA, tie_word_embeddings=True, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=24, shared_expert_intermediate_size=40), 15),
    # OLMo 2: the attention's and MLP's outputs normed in place of their inputs, q and k normed
    # over all heads at once
    "olmo2": (transformers.Olmo2ForCausalLM, transformers.Olmo2Config(
        **SMALL_LLAMA, tie_word_embeddings=False), 16),
    # OLMo 3: OLMo 2's layers, every 4th of 4 full, the others sliding (5 tokens), the full
    # ones' rotary positions scaled (yarn, as its long-context models), the sliding ones' not
    "olmo3": (transformers.Olmo3ForCausalLM, transformers.Olmo3Config(
        **{**SMALL_LLAMA, "num_hidden_layers": 4}, sliding_window=5, rope_parameters={
            "full_attention": {"rope_type": "yarn", "rope_theta": 2e4, "factor": 4.0,
                               "original_max_position_embeddings": 4},
            "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}}), 17),
    # OLMoE: Llama's norms, q and k normed over all heads at once, 2 of 4 experts a token,
    # their weights as they are
    "olmoe": (transformers.OlmoeForCausalLM, transformers.OlmoeConfig(
        **SMALL_LLAMA, num_experts=4, num_experts_per_tok=2), 18),
    # SmolLM3: Llama's layers, every 4th of 4 without rotary positions (NoPE), the head tied
    "smollm3": (transformers.SmolLM3ForCausalLM, transformers.SmolLM3Config(
        **{**SMALL_LLAMA, "num_hidden_layers": 4}, pad_token_id=0, bos_token_id=None,
        eos_token_id=None), 19),
    # Granite: Llama's layers with its multipliers (the scores' 1/16: 1 / head_dim, as Granite
    # 3's are)
    "granite": (transformers.GraniteForCausalLM, transformers.GraniteConfig(
        **SMALL_LLAMA, embedding_multiplier=6.0, residual_multiplier=0.25,
        attention_multiplier=0.0625, logits_scaling=4.0), 20),
    # Seed-OSS: Qwen2's biases on q, k and v, heads wider than hidden_size / heads (as its
    # 128 of 5,120 / 80), its config.json's dropout rates read past
    "seed-oss": (transformers.SeedOssForCausalLM, transformers.SeedOssConfig(
        **SMALL_LLAMA, head_dim=16, attention_dropout=0.1, residual_dropout=0.1), 23),
    # StableLM 2: LayerNorms with biases, q, k, v biases, half of each head rotated
    "stablelm": (transformers.StableLmForCausalLM, transformers.StableLmConfig(
        **SMALL_LLAMA, use_qkv_bias=True, partial_rotary_factor=0.5), 25),
    # and as StableLM 2 12B: q and k normed by a LayerNorm per head, the attention and the MLP
    # side by side after one norm
    "stablelm-2-12b": (transformers.StableLmForCausalLM, transformers.StableLmConfig(
        **SMALL_LLAMA, use_qkv_bias=True, partial_rotary_factor=0.5, qk_layernorm=True,
        use_parallel_residual=True), 35),
    # Cohere (Command R, Aya): one LayerNorm without biases before the attention and the MLP
    # side by side, rotary pairs side by side, the logits scaled, the head tied; Cohere 2
    # (Command R7B): 3 of 4 layers sliding (5 tokens), the 4th without rotary positions
    "cohere": (transformers.CohereForCausalLM, transformers.CohereConfig(
        **SMALL_LLAMA, logit_scale=0.25), 26),
    # Command R+: Cohere's q and k normed, a scale per head
    "cohere-plus": (transformers.CohereForCausalLM, transformers.CohereConfig(
        **SMALL_LLAMA, logit_scale=0.25, use_qk_norm=True), 34),
    "cohere2": (transformers.Cohere2ForCausalLM, transformers.Cohere2Config(
        **{**SMALL_LLAMA, "num_hidden_layers": 4}, sliding_window=5, logit_scale=0.25), 27),
    # Helium and Ernie 4.5: Llama's layers, rotary pairs side by side; Ernie's heads wider
    # than hidden_size / heads, its head tied
    "helium": (transformers.HeliumForCausalLM, transformers.HeliumConfig(
        **SMALL_LLAMA, head_dim=8), 28),
    "ernie": (transformers.Ernie4_5ForCausalLM, transformers.Ernie4_5Config(
        **SMALL_LLAMA, head_dim=16), 29),
    # GLM (GLM-4-9B): q, k, v biases, half of each 16-wide head rotated in pairs side by side,
    # gate and up in one tensor
    "glm": (transformers.GlmForCausalLM, transformers.GlmConfig(
        **SMALL_LLAMA, head_dim=16, pad_token_id=0), 30),
    # GLM-4 (0414): GLM's layers with norms of the attention's and MLP's outputs too
    "glm4": (transformers.Glm4ForCausalLM, transformers.Glm4Config(
        **SMALL_LLAMA, head_dim=16, pad_token_id=0), 31),
    # GraniteMoE: Granite's multipliers, 2 of 4 experts a token, every expert's weights in one
    # tensor (gate and up fused)
    "granitemoe": (transformers.GraniteMoeForCausalLM, transformers.GraniteMoeConfig(
        **SMALL_LLAMA, num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=6.0,
        residual_multiplier=0.25, attention_multiplier=0.0625, logits_scaling=4.0), 32),
    # GPT-OSS: sinks, biases on q, k, v and o, 2 of 4 experts a token with biases (gate and up
    # interleaved in one tensor), the router's too, their GLU clamped at 0.5 (not 7: these
    # weights' gates pass 7 rarely), every other layer sliding over 5 tokens, yarn's ramp
    # unrounded (from pair 0 to pair 2.02 of 8, not 3)
    "gpt-oss": (transformers.GptOssForCausalLM, transformers.GptOssConfig(
        **SMALL_LLAMA, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=5, swiglu_limit=0.5, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}), 33),
    # as Qwen3's model card extends its context: yarn, 4 times an original 4 tokens
    "qwen3-yarn": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config(
        **SMALL_LLAMA, head_dim=16, tie_word_embeddings=True, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
            "original_max_position_embeddings": 4}), 7),
}


# GPT-NeoX as Pythia is made (a quarter of each head rotated, layer norms with biases, the
# attention and the MLP side by side, the head untied), and with the MLP after the attention,
# tanh's GELU and the head tied (heads of 16: 4 of their columns rotate)
SMALL_NEOX = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 16,
              "rotary_pct": 0.25}
NEOX = {
    "pythia": (transformers.GPTNeoXForCausalLM, transformers.GPTNeoXConfig(
        **SMALL_NEOX, use_parallel_residual=True, tie_word_embeddings=False), 21),
    "neox-sequential": (transformers.GPTNeoXForCausalLM, transformers.GPTNeoXConfig(
        **SMALL_NEOX, use_parallel_residual=False, tie_word_embeddings=True,
        hidden_act="gelu_new", rotary_emb_base=500.0), 22),
    # Phi-2's layers: one norm for the attention and the MLP side by side, q, k and v in three
    # projections, 0.4 of each head rotated (Phi-2's share; 6 of these heads' 16 columns), the
    # head with a bias, its residual dropout read past
    "phi": (transformers.PhiForCausalLM, transformers.PhiConfig(
        **{k: v for k, v in SMALL_NEOX.items() if k != "rotary_pct"},
        partial_rotary_factor=0.4, resid_pdrop=0.1), 24),
}
# what each reads as: parallel_residual, head_bias, tie_head, partial_rotary_factor, rope_theta,
# hidden_act
NEOX_SECTIONS = {"pythia": (1, False, False, 0.25, 10000.0, "gelu"),
                 "neox-sequential": (0, False, True, 0.25, 500.0, "gelu_new"),
                 "phi": (2, True, False, 0.4, 10000.0, "gelu_new")}


def cls_of(which: str):
    return {**FAMILIES, **NEOX}[which][0]


def longrope_file(path: pathlib.Path) -> None:
    """The config.json that transformers 5 wrote, in the form Phi-3.5 mini's has on the Hub:
    ``rope_scaling`` of ``type`` longrope with the two lists only, the original context and
    ``rope_theta`` beside it."""
    hf = json.loads((path / "config.json").read_text())
    rope = hf.pop("rope_parameters")
    hf.update(rope_scaling={"type": "longrope", "short_factor": rope["short_factor"],
                            "long_factor": rope["long_factor"]}, rope_theta=rope["rope_theta"],
              original_max_position_embeddings=8,
              partial_rotary_factor=rope.get("partial_rotary_factor", 1.0))
    (path / "config.json").write_text(json.dumps(hf))


def gemma3_file(path: pathlib.Path) -> None:
    """The config.json that transformers 5 wrote, in Gemma 3 1B's form on the Hub: the full
    layers' ``rope_theta``, the sliding ones' ``rope_local_base_freq`` and the layers by
    ``sliding_window_pattern``, not listed."""
    hf = json.loads((path / "config.json").read_text())
    rope, types = hf.pop("rope_parameters"), hf.pop("layer_types")
    hf.update(rope_theta=rope["full_attention"]["rope_theta"], rope_scaling=None,
              rope_local_base_freq=rope["sliding_attention"]["rope_theta"],
              sliding_window_pattern=types.index("full_attention") + 1)
    (path / "config.json").write_text(json.dumps(hf))


def _family(tmp_path_factory, name: str) -> pathlib.Path:
    """transformers' model of that family saved, every tensor random."""
    cls, config, seed = {**FAMILIES, **NEOX}[name]
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    if name in ("phi3.5", "phi4-mini"):
        longrope_file(path)
    if name == "gemma3":
        gemma3_file(path)
    return path


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    """``family_dir(name)``: transformers' model of ``FAMILIES[name]``, saved once."""
    made = {}

    def get(name: str) -> pathlib.Path:
        if name not in made:
            made[name] = _family(tmp_path_factory, name)
        return made[name]
    return get


@pytest.fixture(scope="module")
def llama_dir(family_dir) -> pathlib.Path:
    """A Llama: untied head, plain rotary positions."""
    return family_dir("llama")


# Phi-3's "longrope" (as Phi-3.5 mini's config.json: the original context beside the scaling,
# no factor: the declared context over it) for heads of 64: a factor per rotary pair.
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + i / 64 for i in range(32)],
            "long_factor": [1.0 + i for i in range(32)]}


# yarn as Qwen3's model card enables it (factor 4 over its original context)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}


@pytest.mark.parametrize("scaling, t", [({"rope_type": "linear", "factor": 4.0}, 64),
                                        (LLAMA3_ROPE, 64), (LONGROPE, 256), (LONGROPE, 257),
                                        (YARN, 64)])
def test_rope_frequencies_are_transformers(scaling, t):
    """The rotary frequencies of each rope type the demo's Llama reads from a config.json
    (as ``rope_scaling``, transformers 4's form) equal transformers' own (fp32, each within
    1e-6), and the factor on cos and sin too: longrope's within its original 256 tokens and
    past them, yarn's."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from zero_jax.gpt import llama, llama_config

    kind = scaling["rope_type"]
    beside = {"original_max_position_embeddings": 256} if kind == "longrope" else {}
    theirs = transformers.LlamaConfig(hidden_size=128, num_attention_heads=2,
                                      max_position_embeddings=512, rope_theta=5e5,
                                      rope_scaling={**scaling, **beside})
    want, attention_factor = ROPE_INIT_FUNCTIONS[kind](theirs, "cpu", seq_len=t)
    section = llama_config._rope(pathlib.Path("config.json"), {
        "rope_theta": 5e5, "rope_scaling": scaling, "max_position_embeddings": 512, **beside}, 64)
    cfg = GPTConfig(**section)
    ours = llama.rope_frequencies(cfg, 64, t)
    ratio = np.asarray(ours) / want.numpy()
    assert np.abs(ratio - 1).max() < 1e-6, ratio
    assert llama.rope_scale(cfg) == pytest.approx(attention_factor, rel=1e-12)
    # longrope's: sqrt(1 + ln 2 / ln 256); yarn's: 0.1 ln 4 + 1
    assert (attention_factor == 1.0) == (kind not in ("longrope", "yarn"))
    plain = np.asarray(ours) * 5e5 ** (np.arange(0, 64, 2) / 64)
    if kind != "longrope":  # linear scales every frequency, llama3 and yarn the low ones only
        assert plain.min() < 0.3 and (plain.max() > 0.99) == (kind != "linear")
    else:  # the short factors within the original context, the long ones past it
        np.testing.assert_allclose(1 / plain, scaling["long_factor" if t > 256 else
                                                       "short_factor"], rtol=1e-6)


# Llama 3.2 1B's config.json as Meta publishes it on the Hugging Face Hub.
LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 128256}


def test_the_shipped_llama_3_2_config_is_llama_3_2_1b(tmp_path, capsys):
    """``configs/llama3.2-1b.yaml`` is the model section ``--init-from`` reads from Llama 3.2
    1B's config.json (its training window aside: 1,024 tokens from a directory, as Hugging
    Face's run_clm starts, of the 131,072 it declares), and its parameter count transformers'
    (1,235,814,400: the head tied, counted once)."""
    from zero_jax.gpt import config, llama_config

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_2_1B))
    section = llama_config.read_config(tmp_path)
    shipped = config.load("llama3.2-1b")["model"]
    assert section.pop("seq_len") == 1024 and shipped["seq_len"] == 2048  # training windows
    assert {k: shipped[k] for k in section} == section
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(tmp_path))
    n = sum(p.numel() for p in model.parameters())
    assert GPTConfig(**shipped).n_params == n == 1_235_814_400
    # train.py says so, unless the command line chose the windows
    from zero_jax.gpt.cli import load_config, parse_args

    for sets, line in [([], f"--init-from {tmp_path}: training on windows of 1,024 tokens of "
                            "the 131,072 it declares; --set model.seq_len=N for longer ones\n"),
                       (["--set", "model.seq_len=4096"], "")]:
        cfg = load_config(parse_args(["--init-from", str(tmp_path), *sets]))
        assert capsys.readouterr().out == line
        assert cfg["model"]["seq_len"] == (4096 if sets else 1024)


PYTHIA_14M = {  # EleutherAI/pythia-14m's config.json (its later form: dropouts, rope_scaling)
    "architectures": ["GPTNeoXForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "bos_token_id": 0, "classifier_dropout": 0.1, "eos_token_id": 0, "hidden_act": "gelu",
    "hidden_dropout": 0.0, "hidden_size": 128, "initializer_range": 0.02,
    "intermediate_size": 512, "layer_norm_eps": 1e-5, "max_position_embeddings": 2048,
    "model_type": "gpt_neox", "num_attention_heads": 4, "num_hidden_layers": 6,
    "rope_scaling": None, "rotary_emb_base": 10000, "rotary_pct": 0.25,
    "tie_word_embeddings": False, "use_cache": False, "use_parallel_residual": True,
    "vocab_size": 50304}


def test_pythia_14m_reads_as_transformers_reads_it(tmp_path):
    """Pythia-14m's config.json gives its model section (a quarter of each 32-wide head
    rotated, at base 10,000, the attention and MLP side by side, the head untied, the whole
    2,048-token context as the training window), and the parameter count transformers builds
    from it."""
    (tmp_path / "config.json").write_text(json.dumps(PYTHIA_14M))
    section = hf.read_config(tmp_path)
    assert section == {"vocab_size": 50304, "d_model": 128, "n_layers": 6, "n_heads": 4,
                       "d_ff": 512, "seq_len": 2048, "max_positions": 2048, "norm_eps": 1e-5,
                       "arch": "neox", "hidden_act": "gelu", "tie_head": False,
                       "parallel_residual": 1, "head_bias": False, "rope_theta": 10000.0,
                       "partial_rotary_factor": 0.25}
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(tmp_path))
    assert GPTConfig(**section).n_params == sum(p.numel() for p in model.parameters())


MIXTRAL_8X7B = {  # mistralai/Mixtral-8x7B-v0.1's config.json
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1e6, "router_aux_loss_coef": 0.02,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 32000}


def test_the_shipped_mixtral_config_is_mixtral_8x7b(tmp_path):
    """``configs/mixtral-8x7b.yaml`` is the model section ``--init-from`` reads from Mixtral
    8x7B's config.json (the training window aside), its load-balancing loss on at Mixtral's
    weight as that file's reads with ``output_router_logits``; its parameter count
    transformers' (46,702,792,704), 12,879,925,248 of them a token's (2 of 8 experts)."""
    from zero_jax.gpt import config, llama_config

    shipped = config.load("mixtral-8x7b")["model"]
    for router in (False, True):
        (tmp_path / "config.json").write_text(json.dumps({**MIXTRAL_8X7B,
                                                          "output_router_logits": router}))
        section = llama_config.read_config(tmp_path)
        assert section.pop("seq_len") == 1024 and shipped["seq_len"] == 4096
        assert section.pop("router_aux_loss_coef") == (0.02 if router else 0.0)
        assert {k: shipped[k] for k in section} == section
    assert shipped["router_aux_loss_coef"] == 0.02
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(tmp_path))
    n = sum(p.numel() for p in model.parameters())
    assert GPTConfig(**shipped).n_params == n == 46_702_792_704
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    assert GPTConfig(**shipped).active_params == n - experts * 6 // 8 == 12_879_925_248


GPT_OSS_20B = {  # openai/gpt-oss-20b's config.json
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {
        "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
        "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 201088}


def test_the_shipped_gpt_oss_config_is_gpt_oss_20b(tmp_path):
    """``configs/gpt-oss-20b.yaml`` is the model section ``--init-from`` reads from GPT-OSS 20B's
    config.json, its experts in MXFP4 or dequantized (the file without ``quantization_config``),
    the training window aside, its load-balancing loss on at GPT-OSS's
    weight as that file's reads with ``output_router_logits``; its parameter count
    transformers' (20,914,757,184), 4,187,440,704 of them a token's (4 of 32 experts)."""
    from zero_jax.gpt import config, llama_config

    shipped = config.load("gpt-oss-20b")["model"]
    dequantized = {k: v for k, v in GPT_OSS_20B.items() if k != "quantization_config"}
    for hub, router in ((GPT_OSS_20B, False), (dequantized, False), (dequantized, True)):
        (tmp_path / "config.json").write_text(json.dumps({**hub, "output_router_logits": router}))
        section = llama_config.read_config(tmp_path)
        assert section.pop("seq_len") == 1024 and shipped["seq_len"] == 4096
        assert section.pop("router_aux_loss_coef") == (0.9 if router else 0.0)
        assert {k: shipped[k] for k in section} == section
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(tmp_path))
    n = sum(p.numel() for p in model.parameters())
    assert GPTConfig(**shipped).n_params == n == 20_914_757_184
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    assert GPTConfig(**shipped).active_params == n - experts * 28 // 32 == 4_187_440_704


LLAMA_NOT_COMPUTED = {  # config.json keys asking for what the demo's Llama does not compute
    "rope_scaling.rope_type": {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    "rope_parameters.rope_type": {"rope_parameters": {"rope_type": "dynamic", "factor": 8.0,
                                                      "rope_theta": 10000.0}},
    "attention_bias": {"attention_bias": True},
    "rope_scaling.factor": {"rope_scaling": {"rope_type": "linear", "factor": "eight"}},
    "rope_scaling.long_factor": {"rope_scaling": {  # 2 factors for heads of 4 rotary pairs
        "rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [1.0, 2.0],
        "original_max_position_embeddings": 8}},
    "rope_scaling.mscale": {"rope_scaling": {  # DeepSeek's yarn
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
        "mscale": 0.707, "mscale_all_dim": 0.707}},
    "sliding_window": {"model_type": "mistral", "sliding_window": "4096"},
    "use_sliding_window": {"model_type": "qwen2", "use_sliding_window": True},
    "layer_types": {"model_type": "gemma2", "sliding_window": 4,
                    "layer_types": ["full_attention", "sliding_attention"]},
    "router_jitter_noise": {"model_type": "mixtral", "router_jitter_noise": 0.01,
                            "num_local_experts": 4, "num_experts_per_tok": 2},
    "mlp_only_layers": {"model_type": "qwen3_moe", "mlp_only_layers": [0], "num_experts": 4,
                        "num_experts_per_tok": 2, "moe_intermediate_size": 24},
    "qkv_bias": {"model_type": "qwen2_moe", "qkv_bias": False},
    "num_experts_per_tok": {"model_type": "mixtral", "num_local_experts": 4,
                            "num_experts_per_tok": 8},
    "use_bidirectional_attention": {"model_type": "gemma", "hidden_act": "gelu",  # as read
                                    "use_bidirectional_attention": True},
    # GPT-OSS's checkpoints on the Hub: its experts in MXFP4
    "quantization_config": {"quantization_config": {"quant_method": "mxfp4"}},
}


NEOX_NOT_COMPUTED = {  # the same of the demo's GPT-NeoX
    "hidden_act": {"hidden_act": "relu"},
    "attention_bias": {"attention_bias": False},
    "rope_type": {"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                      "rope_theta": 10000.0, "partial_rotary_factor": 0.25}},
    "rotary_pct": {"rope_parameters": None, "rotary_pct": "quarter"},
    "use_parallel_residual": {"use_parallel_residual": "yes"},
}


@pytest.mark.parametrize("which, key", [*(("llama", k) for k in LLAMA_NOT_COMPUTED),
                                        *(("pythia", k) for k in NEOX_NOT_COMPUTED)])
def test_a_llama_asking_for_what_the_model_lacks_is_refused_naming_the_key(
        family_dir, gpt2, tmp_path, which, key, capsys):
    """train.py --init-from a Llama whose config.json asks for a rope type other than default,
    linear, llama3, longrope and yarn, for attention biases or a scaling factor that is no
    number, longrope factors that are not one per rotary pair, DeepSeek's yarn, a Mistral or
    Qwen2 with a sliding window; a GPT-NeoX with another activation, no biases, dropout, its
    rotary positions scaled: one line naming the key, exit code 2, nothing written."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(family_dir(which), bad)
    capsys.readouterr()  # transformers' progress, where the directory was made here
    _config(bad, **(LLAMA_NOT_COMPUTED if which == "llama" else NEOX_NOT_COMPUTED)[key])
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    code = train_py.main(["--init-from", str(bad), "--steps", "1", "--data",
                          str(gpt2["tokens"]), "--checkpoint-dir", str(ckpt), "--metrics",
                          str(metrics)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert f"has {key} " in err[0] and ": pass a model" in err[0], err
    assert not ckpt.exists() and not metrics.exists()


def test_dropout_in_a_config_json_is_read_past_and_said(family_dir, tmp_path, capsys):
    """A Phi-3 whose config.json sets dropout rates (as Phi-2's and Seed-OSS's do): training
    settings, not the model; the model section is the one without them, and train.py says in
    one line that the demo trains without dropout (as MaxText and torchtune do)."""
    import shutil

    from zero_jax.gpt.cli import load_config, parse_args

    source = family_dir("phi3")
    shutil.copytree(source, tmp_path / "phi3")
    _config(tmp_path / "phi3", resid_pdrop=0.1, attention_dropout=0.05, embd_pdrop=0.0,
            classifier_dropout=0.1)
    assert hf.read_config(tmp_path / "phi3") == hf.read_config(source)
    capsys.readouterr()
    cfg = load_config(parse_args(["--init-from", str(tmp_path / "phi3")]))
    assert capsys.readouterr().out == (f"--init-from {tmp_path / 'phi3'}: its config.json sets "
                                       "attention_dropout 0.05, resid_pdrop 0.1; the demo's "
                                       "models train without dropout\n")
    assert cfg["model"]["arch"] == "llama"


_THEIRS: dict[pathlib.Path, np.ndarray] = {}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("which", list(FAMILIES))
def test_a_llama_loads_at_stage_3_and_goes_back_to_transformers(which, tmp_path, tp,
                                                                family_dir):
    """Read at stage 3 (x tensor parallel 2) through the Llama mapping (transposes, head
    splits): a Llama untied with plain rotary positions, one as Llama 3.2 (tied head, llama3
    rope scaling), a Mistral, a Qwen2 (q, k, v biases), a Qwen3 (q, k norms, wider heads), a
    Phi-3 (q, k, v fused in one tensor, gate and up in another), one as Phi-3.5 mini (longrope,
    its long factors past the original context, its short ones within), a Qwen3 with yarn, an
    OLMo 2 (outputs normed, not inputs; q and k over all heads), an OLMoE (inputs normed, q
    and k over all heads, experts), a SmolLM3 (every 4th layer without rotary positions), a
    Granite (its four multipliers), an OLMo 3 (3 of 4 layers sliding, the full one's rope
    yarn-scaled, its config.json in both forms), a Seed-OSS (q, k, v biases, wider heads), a
    StableLM (LayerNorms with biases, q, k, v biases, half of each head rotated; also as
    StableLM 2 12B: q and k normed per head, the parallel residual), a Cohere (also
    as Command R+: q and k normed, a scale per head) and a Cohere 2 (one LayerNorm without
    biases, rotary pairs side by side, the logits scaled; 3 of 4 layers sliding, the 4th
    without rotary positions), a Helium and an Ernie 4.5
    (rotary pairs side by side; the Helium written back as Ernie 4.5), a GLM (pairs side by
    side on half of each head, q, k, v biases, gate and up in one tensor), a GLM-4 (its
    outputs normed too), a GraniteMoE (every expert in one tensor, gate and up fused), a GPT-OSS
    (sinks, biases on q, k, v, o, experts with biases, gate and up interleaved, their GLU
    clamped, every other layer sliding, yarn's ramp unrounded):
    logits within 1e-5 of transformers'; written back through Llama's table as shards with an
    index and a config.json (a Phi-3 as the Llama it computes as, a Seed-OSS as Qwen2, a Mistral
    with its sliding window; the context it declared, whatever the training window); a
    Mistral's and a Phi-3's window of 5 tokens, shorter than the sequence, as transformers
    computes it),
    transformers loads it with the same logits."""
    from zero_jax.gpt import llama, llama_config

    llama_dir = family_dir(which)
    # transformers' logits of the directory: computed once for both tp cases
    if llama_dir not in _THEIRS:
        _THEIRS[llama_dir] = torch_logits_of(transformers.AutoModelForCausalLM, llama_dir)
    theirs = _THEIRS[llama_dir]
    section = llama_config.read_config(llama_dir)
    family = which.split("-")[0]
    assert section["tie_head"] == (family in ("llama3", "qwen2", "qwen3", "phi4", "gemma",
                                              "gemma2", "gemma3", "smollm3", "cohere",
                                              "cohere2", "ernie"))
    assert section.get("nope_every", 0) == (4 if family in ("smollm3", "cohere2") else 0)
    assert section.get("gemma", 0) == {"gemma": 1, "gemma2": 2, "gemma3": 2}.get(family, 0)
    assert section.get("window_pattern", 0) == {"gemma2": 2, "gemma3": 3, "olmo3": 4,
                                                 "cohere2": 4, "gpt": 2}.get(family, 0)
    assert section.get("n_experts", 0) == (4 if which.endswith(("mixtral", "moe", "gpt-oss"))
                                           else 0)
    assert section.get("gpt_oss", False) == (family == "gpt")
    assert section.get("shared_expert_d_ff", 0) == (40 if which == "qwen2-moe" else 0)
    assert section["partial_rotary_factor"] == (0.5 if family in ("phi4", "stablelm", "glm",
                                                                  "glm4") else 1.0)
    assert section["qkv_bias"] == (family in ("qwen2", "seed", "stablelm", "glm", "glm4", "gpt"))
    assert section.get("output_norms", False) == (family == "glm4")
    assert section.get("layer_norm", 0) == {"stablelm": 1, "cohere": 2, "cohere2": 2}.get(
        family, 0)
    assert section.get("rope_interleaved", False) == (family in ("cohere", "cohere2", "helium",
                                                                "ernie", "glm", "glm4"))
    assert section["qk_norm"] == (family in ("qwen3", "gemma3", "olmo2", "olmo3", "olmoe")
                                  or which in ("cohere-plus", "stablelm-2-12b"))
    assert section.get("olmo", 0) == {"olmoe": 1, "olmo2": 2, "olmo3": 2}.get(family, 0)
    assert (family in ("qwen3", "seed", "ernie", "glm", "glm4", "gpt")) == (
        section["head_dim"] == 16)
    assert section["sliding_window"] == {"mistral": 16, "gemma2": 5, "gemma3": 5,
                                         "olmo3": 5, "cohere2": 5, "gpt": 5}.get(family, 0)
    counted = sum(p.numel() for n, p in cls_of(which)(FAMILIES[which][1]).named_parameters()
                  if not n.startswith(("model.vision_tower", "model.multi_modal_projector")))
    assert GPTConfig(**section).n_params == counted  # the planner's count, the head tied once
    cfg = GPTConfig(**section, remat="none", vocab_multiple=128)  # 64 padded to 128
    model = llama.Llama(cfg)
    files, mapping = hf.weights_source(llama_dir)  # Phi-3's: its fused tensors' rows
    params = load_params(plan_for(model, 3, tp, llama.tensor_parallel(cfg)), files, mapping)
    assert ("head" in params) != cfg.tie_head
    assert files.bytes_read == sum(  # each byte once, a vision tower's none
        i.nbytes for n, i in files.tensors.items()
        if not n.startswith(("vision_tower.", "multi_modal_projector.")))
    ours = logits_of(model, params)
    assert rel(ours, theirs) < 1e-5, rel(ours, theirs)
    if which in ("mistral", "phi3"):  # a window shorter than the sequence: 5 of 16 tokens
        narrow = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, sliding_window=5)
        with torch.no_grad():
            windowed = narrow(torch.tensor(TOKENS[:, :-1], dtype=torch.long)).logits.numpy()
        ours_windowed = logits_of(llama.Llama(dataclasses.replace(cfg, sliding_window=5)),
                                  params)
        assert rel(ours_windowed, windowed) < 1e-5 < 1e-3 < rel(windowed, theirs)
    # Whether a feature changes the logits is the model's, not the layout's: shown at tp 1 only
    # (at tp 2 the logits equal transformers' above, with the feature, all the same).
    counts = tp == 1
    if counts and family == "glm4":  # its outputs' norms count
        plain = logits_of(llama.Llama(dataclasses.replace(cfg, output_norms=False)), params)
        assert rel(plain, theirs) > 1e-3
    if counts and family in ("helium", "ernie", "glm", "glm4"):  # the rotary pairs count
        halves = logits_of(llama.Llama(dataclasses.replace(cfg, rope_interleaved=False)), params)
        assert rel(halves, theirs) > 1e-3
    if counts and family.startswith("cohere"):  # its norms, rotary pairs and logit scale count
        # (Command R+'s q and k norms are LayerNorms of a scale per head: no RMSNorm's form)
        for one in ([{"layer_norm": 0}] if which != "cohere-plus" else []) + [
                {"rope_interleaved": False}, {"logits_scaling": 1.0}]:
            other = logits_of(llama.Llama(dataclasses.replace(cfg, **one)), params)
            assert rel(other, theirs) > 1e-3, one
    if counts and family == "gpt":  # the sinks, the clamp and yarn's unrounded ramp count
        sinkless = jax.tree.map(lambda x: x, params)
        sinkless["blocks"]["sinks"] = np.full(params["blocks"]["sinks"].shape, -1e9, np.float32)
        for other in (logits_of(model, sinkless), *(
                logits_of(llama.Llama(dataclasses.replace(cfg, **one)), params)
                for one in ({"swiglu_limit": 100.0}, {"rope_truncate": True}))):
            assert rel(other, theirs) > 1e-3
    if counts and family in ("gemma2", "gemma3", "olmo3", "cohere2", "gpt"):  # the window
        for plain in ({"sliding_window": 0, "window_pattern": 0, "rope_local_theta": 0.0},
                      *([{"rope_local_theta": 0.0}] if family in ("gemma3", "olmo3") else [])):
            other = logits_of(llama.Llama(dataclasses.replace(cfg, **plain)), params)
            assert rel(other, theirs) > 1e-3, plain
    if counts and family.startswith("granite"):  # each multiplier counts
        for one in ({"embedding_multiplier": 1.0}, {"residual_multiplier": 1.0},
                    {"logits_scaling": 1.0}, {"query_pre_attn_scalar": 0.0}):
            other = logits_of(llama.Llama(dataclasses.replace(cfg, **one)), params)
            assert rel(other, theirs) > 1e-3, one
    if counts and which == "stablelm":  # its LayerNorms count
        rms = logits_of(llama.Llama(dataclasses.replace(cfg, layer_norm=False)), params)
        assert rel(rms, theirs) > 1e-3
    if counts and family == "smollm3":  # its layers without positions count
        roped = logits_of(llama.Llama(dataclasses.replace(cfg, nope_every=0)), params)
        assert rel(roped, theirs) > 1e-3
    if counts and section.get("n_experts"):  # the routing counts: one expert a token differs
        one = logits_of(llama.Llama(dataclasses.replace(cfg, experts_per_token=1)), params)
        assert rel(one, theirs) > 1e-3
    if counts and which == "gemma2":  # the soft caps count
        uncapped = logits_of(llama.Llama(dataclasses.replace(cfg, attn_softcap=0.0)), params)
        assert rel(uncapped, theirs) > 1e-3 and np.abs(ours).max() < 3.0 < np.abs(
            logits_of(llama.Llama(dataclasses.replace(cfg, logit_softcap=0.0)), params)).max()
    if counts and which in ("phi3.5", "phi4-mini", "qwen3-yarn", "olmo3"):  # the scaling counts
        unscaled = logits_of(llama.Llama(dataclasses.replace(cfg, rope_type="default")), params)
        assert rel(unscaled, theirs) > 1e-3
    if counts and which == "olmo3":  # as its files before transformers 5: one base for both
        hf_file = json.loads((llama_dir / "config.json").read_text())
        rope = hf_file.pop("rope_parameters")
        hf_file.update(rope_theta=2e4, rope_scaling={k: v for k, v in rope[
            "full_attention"].items() if k != "rope_theta"})
        (tmp_path / "legacy").mkdir()
        (tmp_path / "legacy" / "config.json").write_text(json.dumps(hf_file))
        assert llama_config.read_config(tmp_path / "legacy") == section
    if which == "phi3.5":  # longrope's long factors at 16 tokens, its short ones at 8
        short = TOKENS[:, :8]
        within = np.asarray(jax.jit(lambda p: model.apply({"params": p}, short))(params))
        assert rel(within, torch_logits_of(transformers.AutoModelForCausalLM, llama_dir,
                                           short)) < 1e-5

    out = tmp_path / "out"  # straight from the shards (Phi-4-mini's as Phi-3's fused tensors)
    zj.save_safetensors(params, out, hf.mapping(section), np.float32, 20_000)
    # as trained at a shorter window: the context config.json declared is written back
    llama_config.write_config(out, {**section, "seq_len": 8})
    assert (out / "model.safetensors.index.json").exists()
    assert llama_config.read_config(out) == section
    assert rel(torch_logits_of(transformers.AutoModelForCausalLM, out), ours) < 1e-5


def mxfp4_dir(src: pathlib.Path, out: pathlib.Path) -> None:
    """GPT-OSS's form on the Hub of a directory transformers saved: its experts' gate_up_proj
    and down_proj as MXFP4 blocks and scales (random: every byte, scales 2^-5 to 2^0), its
    config.json's quantization_config mxfp4."""
    import shutil

    shutil.copytree(src, out)
    tensors, rng = safetensors.numpy.load_file(out / "model.safetensors"), np.random.default_rng(0)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, k, rows = tensors.pop(name).shape
        tensors[name + "_blocks"] = rng.integers(0, 256, (experts, rows, k // 32, 16), np.uint8)
        tensors[name + "_scales"] = rng.integers(122, 128, (experts, rows, k // 32), np.uint8)
    safetensors.numpy.save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    _config(out, quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]})


def test_mxfp4_reads_as_transformers_dequantizes_and_only_the_groups_it_touches():
    """An MXFP4 tensor (every byte, scales 2^-27 to 2^13) reads as transformers'
    ``convert_moe_packed_tensors`` makes it, bit for bit; a slice reads the blocks and scales
    of the 32-value groups it touches only."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from zero_jax.mxfp4 import Mxfp4

    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (3, 10, 4, 16), np.uint8)
    scales = rng.integers(100, 141, (3, 10, 4), np.uint8)
    want = convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales),
                                      dtype=torch.float32).numpy()
    whole = Mxfp4(blocks, scales)
    assert whole.shape == want.shape == (3, 128, 10)
    np.testing.assert_array_equal(np.asarray(whole), want)
    part = whole[1:3][:, 40:70, 2:7]  # groups 1 and 2 of rows 2-6 of experts 1 and 2
    np.testing.assert_array_equal(np.asarray(part), want[1:3, 40:70, 2:7])
    assert part.nbytes == 2 * 5 * 2 * (16 + 1)


@pytest.mark.parametrize("tp", [1, 2])
def test_gpt_oss_with_mxfp4_experts_loads_as_transformers_dequantizes_it(tp, tmp_path,
                                                                        family_dir):
    """A GPT-OSS whose experts are MXFP4 (as on the Hub) read at stage 3 (x tensor parallel 2):
    the model section of its unquantized form, the logits of transformers' own dequantized
    model within 1e-5; written back unquantized, transformers loads it with those logits."""
    from zero_jax.gpt import llama, llama_config

    src, mx = family_dir("gpt-oss"), tmp_path / "mx"
    mxfp4_dir(src, mx)
    theirs = torch_logits_of(transformers.AutoModelForCausalLM, mx, dtype=torch.float32,
                             quantization_config=transformers.Mxfp4Config(dequantize=True))
    section = llama_config.read_config(mx)
    assert section == llama_config.read_config(src)
    cfg = GPTConfig(**section, remat="none", vocab_multiple=128)
    model = llama.Llama(cfg)
    params = load_params(plan_for(model, 3, tp, llama.tensor_parallel(cfg)),
                         *hf.weights_source(mx))
    ours = logits_of(model, params)
    assert rel(ours, theirs) < 1e-5, rel(ours, theirs)
    assert rel(ours, _THEIRS.get(src, torch_logits_of(transformers.AutoModelForCausalLM, src))
               ) > 1e-3  # the experts read are the MXFP4 ones
    out = tmp_path / "out"
    zj.save_safetensors(params, out, hf.mapping(section), np.float32)
    llama_config.write_config(out, section)
    assert rel(torch_logits_of(transformers.AutoModelForCausalLM, out), ours) < 1e-5


@pytest.mark.parametrize("tp", [1, 2])
def test_gpt_oss_gradients_are_transformers(tp, tmp_path, family_dir):
    """A GPT-OSS (its sinks, biases, clamped experts and sliding layers) at stage 3 (x tensor
    parallel 2): the gradient of the mean next-token loss on TOKENS, every parameter's, written
    in transformers' names and layout (gate and up interleaved), equals the gradient PyTorch's
    autograd gives transformers' model, each tensor within 1e-4 of its norm."""
    from zero_jax.gpt import llama

    directory = family_dir("gpt-oss")
    section = hf.read_config(directory)
    cfg = GPTConfig(**section, remat="full", vocab_multiple=128)
    model = llama.Llama(cfg)
    plan = plan_for(model, 3, tp, llama.tensor_parallel(cfg))
    params = load_params(plan, *hf.weights_source(directory))
    batch = jax.device_put(TOKENS, jax.sharding.NamedSharding(
        plan.mesh, jax.sharding.PartitionSpec("data")))
    loss, grads = jax.jit(lambda p: zj.make_grad_fn(plan, lm_loss(model))(p, batch))(params)
    zj.save_safetensors(grads, tmp_path / "grads", hf.mapping(section), np.float32)
    ours = safetensors.numpy.load_file(tmp_path / "grads" / "model.safetensors")

    theirs = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    logits = theirs(torch.tensor(TOKENS[:, :-1], dtype=torch.long)).logits
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.tensor(
        TOKENS[:, 1:], dtype=torch.long).reshape(-1))
    ref.backward()
    assert float(loss) == pytest.approx(ref.item(), rel=1e-5)
    named = dict(theirs.named_parameters())
    assert set(ours) == set(named)
    for name, g in ours.items():
        want = named[name].grad.numpy()
        assert np.linalg.norm(g - want) <= 1e-4 * np.linalg.norm(want), name


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("which", list(NEOX))
def test_a_gpt_neox_loads_at_stage_3_and_goes_back_to_transformers(which, tmp_path, tp,
                                                                   family_dir):
    """A GPT-NeoX as Pythia is made, one with its MLP after the attention (tanh's GELU, tied
    head, another rotary base), and a Phi as Phi-2 is made (one norm a layer, q, k and v in
    three tensors, a head bias), read at stage 3 (x tensor parallel 2): logits within 1e-5 of
    transformers'; a GPT-NeoX's config.json read alike in Pythia's form on the Hub; what each
    feature changes counts; written back from the shards with a config.json, transformers
    loads it with the same logits."""
    from zero_jax.gpt import neox

    directory = family_dir(which)
    if directory not in _THEIRS:
        _THEIRS[directory] = torch_logits_of(transformers.AutoModelForCausalLM, directory)
    theirs = _THEIRS[directory]
    section = hf.read_config(directory)
    keys = ("parallel_residual", "head_bias", "tie_head", "partial_rotary_factor",
            "rope_theta", "hidden_act")
    assert tuple(section[k] for k in keys) == NEOX_SECTIONS[which]
    assert (section["arch"], section["max_positions"]) == ("neox", 16)
    counted = sum(p.numel() for p in cls_of(which)(NEOX[which][1]).parameters())
    assert GPTConfig(**section).n_params == counted
    cfg = GPTConfig(**section, remat="none", vocab_multiple=128)
    model = neox.NeoX(cfg)
    files, mapping = hf.weights_source(directory)
    params = load_params(plan_for(model, 3, tp, neox.tensor_parallel(cfg)), files, mapping)
    assert files.bytes_read == sum(i.nbytes for i in files.tensors.values())
    ours = logits_of(model, params)
    assert rel(ours, theirs) < 1e-5, rel(ours, theirs)
    if tp == 1:  # each feature counts (the model's, not the layout's)
        for other in ({"parallel_residual": 1 - cfg.parallel_residual} if which != "phi" else
                      {"head_bias": False}, {"partial_rotary_factor": 0.5},
                      {"hidden_act": "gelu" if cfg.hidden_act != "gelu" else "gelu_new"}):
            changed = logits_of(neox.NeoX(dataclasses.replace(cfg, **other)), params)
            assert rel(changed, theirs) > 5e-5, other  # 150 times the agreement
    if tp == 1 and which != "phi":
        hub = json.loads((directory / "config.json").read_text())  # as Pythia's on the Hub
        rope = hub.pop("rope_parameters")
        hub.update(rotary_pct=rope["partial_rotary_factor"], rotary_emb_base=rope["rope_theta"])
        (tmp_path / "hub").mkdir()
        (tmp_path / "hub" / "config.json").write_text(json.dumps(hub))
        assert hf.read_config(tmp_path / "hub") == section

    out = tmp_path / "out"
    zj.save_safetensors(params, out, hf.mapping(section), np.float32, 20_000)
    hf.write_config(out, {**section, "seq_len": 8}, "float32")  # the declared context back
    assert (out / "model.safetensors.index.json").exists()
    assert hf.read_config(out) == section
    assert rel(torch_logits_of(transformers.AutoModelForCausalLM, out), ours) < 1e-5


@pytest.mark.parametrize("which", ["llama", "gemma2", "olmo2", "gpt-oss", "pythia", "phi"])
def test_bf16_logits_are_as_near_the_fp32_model_as_transformers_bf16(which, family_dir):
    """Parameters and compute in bf16 (a Llama's RMSNorms, Gemma 2's scales of 1 + weight and
    output norms, OLMo 2's output norms, GPT-OSS's sinks and clamped experts, GPT-NeoX's and
    Phi's layer norms and Phi's head bias), zero_jax's logits are as near the fp32 model's as
    transformers' own bf16 model's are (within 1.25 times its distance; measured 0.76 to 1.06
    times, each about 0.5 to 1%, GPT-OSS's 5 to 7%): the norms round at other places than
    transformers', no worse."""
    from zero_jax.gpt.model import build

    directory = family_dir(which)
    tokens = torch.tensor(TOKENS[:, :-1], dtype=torch.long)
    with torch.no_grad():
        exact, theirs = (transformers.AutoModelForCausalLM.from_pretrained(
            directory, dtype=dtype).eval()(tokens).logits.float().numpy()
            for dtype in (torch.float32, torch.bfloat16))
    model = build(GPTConfig(**hf.read_config(directory), remat="none", vocab_multiple=128))
    files, mapping = hf.weights_source(directory)
    params = jax.tree.map(lambda x: x.astype(jax.numpy.bfloat16),
                          load_params(plan_for(model, 0), files, mapping))
    ours = logits_of(model, params).astype(np.float32)
    assert rel(ours, exact) < 1.25 * rel(theirs, exact), (rel(ours, exact), rel(theirs, exact))


@pytest.mark.parametrize("which", ["mixtral", "qwen3-moe", "olmoe", "granitemoe", "gpt-oss"])
def test_the_experts_load_balancing_loss_is_transformers(which, family_dir, tmp_path):
    """``model.router_aux_loss_coef``: the load-balancing loss over a Mixtral's, a Qwen3-MoE's, an
    OLMoE's, a GraniteMoE's and a GPT-OSS's layers (top 2 of 4 experts; GPT-OSS's router
    biased) and its gradient in each layer's router within 1e-5 of transformers'
    (``output_router_logits``);
    ``model.router_z_loss_coef``: ST-MoE's router z-loss as transformers' ``router_z_loss_func``
    (Switch Transformers') computes it over those layers' router logits, and its gradient;
    ``lm_loss`` adds each times its weight, and returns each as a metric.
    config.json carries the weight both ways: a file without ``output_router_logits`` reads as 0
    (transformers adds none), one written with a weight reads back with it, and transformers
    reads it as on with that weight."""
    from transformers.models.switch_transformers.modeling_switch_transformers import (
        router_z_loss_func,
    )

    from zero_jax.gpt import llama, llama_config
    from zero_jax.gpt.model import lm_loss

    directory, ids = family_dir(which), TOKENS[:, :-1]
    section = llama_config.read_config(directory)
    assert section["router_aux_loss_coef"] == 0.0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        directory, output_router_logits=True).eval()
    out = theirs(torch.tensor(ids, dtype=torch.long))
    z_loss = router_z_loss_func(torch.stack(out.router_logits))
    refs = {}
    for name, loss in (("balance_loss", out.aux_loss), ("router_z_loss", z_loss)):
        theirs.zero_grad()
        loss.backward(retain_graph=True)
        router = {"granitemoe": "block_sparse_moe.router", "gpt-oss": "mlp.router"}.get(
            which, "mlp.gate")
        refs[name] = loss.item(), np.stack([theirs.get_parameter(
            f"model.layers.{i}.{router}.weight").grad.numpy().T
            for i in range(section["n_layers"])])

    cfg = GPTConfig(**{**section, "router_aux_loss_coef": 0.02}, remat="none",
                    vocab_multiple=128, router_z_loss_coef=0.001)
    model = llama.Llama(cfg)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), ids[:1])["params"])
    plan = zj.make_plan(shapes, zj.make_mesh(8), stage=0)
    params = jax.device_get(load_params(plan, *hf.weights_source(directory)))

    def ours(p, tokens, name):
        sown = model.apply({"params": p}, tokens, method="features", mutable=["losses"])[1]
        return sown["losses"][name][0]
    (with_it, metrics), without = (jax.jit(lm_loss(m))(params, TOKENS) for m in (
        model, llama.Llama(dataclasses.replace(cfg, router_aux_loss_coef=0.0,
                                               router_z_loss_coef=0.0))))
    for name, (ref, routers) in refs.items():
        value, grads = jax.jit(jax.value_and_grad(ours), static_argnums=2)(params, ids, name)
        assert abs(float(value) - ref) < 1e-5 * ref, (name, float(value), ref)
        assert rel(grads["blocks"]["moe"]["router"], routers) < 1e-5, name
        assert abs(float(metrics[name]) - float(value)) < 1e-6
    added = 0.02 * metrics["balance_loss"] + 0.001 * metrics["router_z_loss"]
    assert abs(float(with_it - without) - float(added)) < 1e-6
    # the z-loss alone: its metric alone, the loss plus it times its weight
    z_only, alone = jax.jit(lm_loss(llama.Llama(dataclasses.replace(
        cfg, router_aux_loss_coef=0.0))))(params, TOKENS)
    assert set(alone) == {"router_z_loss"}
    assert abs(float(z_only - without) - 0.001 * float(alone["router_z_loss"])) < 1e-6

    llama_config.write_config(tmp_path, {**section, "router_aux_loss_coef": 0.02})
    assert llama_config.read_config(tmp_path)["router_aux_loss_coef"] == 0.02
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert config.output_router_logits and config.router_aux_loss_coef == 0.02


def test_a_tensor_taken_in_ranges_is_read_once_whole_and_written_back_whole(family_dir,
                                                                             tmp_path):
    """Phi-3's fused tensors are taken in ranges that must tile them (an overlap or a gap is
    refused, naming the tensor); saved through the same mapping, each parameter is written into
    its range of the fused tensor: every tensor of the file, bit for bit (fp32), from the
    parameters' shards at stage 3."""
    import safetensors.numpy

    from zero_jax.gpt import llama, llama_config
    from zero_jax.weights import export_arrays

    phi3 = family_dir("phi3")
    cfg = GPTConfig(**llama_config.read_config(phi3), remat="none", vocab_multiple=128)
    model = llama.Llama(cfg)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), TOKENS[:1, :-1])["params"])
    plan = zj.make_plan(shapes, zj.make_mesh(), stage=3, layers=LAYERS)
    _, mapping = hf.weights_source(phi3)
    check(plan, TensorFiles(phi3), mapping)
    for wrong in [(0, 0, cfg.dh * cfg.kv_heads), (0, 8, 8 + cfg.d_ff)]:  # k over q; a gap
        rows = tuple(dataclasses.replace(t, take=wrong) if t.path == (
            "blocks/k/kernel" if wrong[1] == 0 else "blocks/gate/kernel") else t
            for t in mapping.tensors)
        with pytest.raises(WeightsError, match=r"model\.layers\.0\.\S+ in .* is taken in "
                                                "ranges .* do not cover its shape"):
            check(plan, TensorFiles(phi3), dataclasses.replace(mapping, tensors=rows))
        flat = {zj.plan.path_str(p): v.shape for p, v in jax.tree_util.tree_flatten_with_path(
            shapes)[0]}
        with pytest.raises(WeightsError, match=r"model\.layers\.0\.\S+ in the export is "
                                                "taken in ranges"):
            export_specs(dataclasses.replace(mapping, tensors=rows), flat, np.float32)
    params = load_params(plan, phi3, mapping)
    flat = {zj.plan.path_str(p): v for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    with pytest.raises(WeightsError, match="export_arrays does not write: save with "
                                           "save_safetensors"):
        next(export_arrays(mapping, export_specs(mapping, {p: v.shape for p, v in flat.items()},
                                                 np.float32), flat.__getitem__))
    # a whole tensor (down's, written before gate and up) named as the one they take ranges
    # of: refused, as any tensor written twice
    up = mapping.tensors[-1]
    twice = dataclasses.replace(mapping, tensors=tuple(
        dataclasses.replace(t, name=up.name) if t.path == "blocks/down/kernel" else t
        for t in mapping.tensors))
    with pytest.raises(WeightsError, match="writes tensor .* twice"):
        zj.save_safetensors(params, tmp_path / "twice", twice)
    zj.save_safetensors(params, tmp_path / "out", mapping)
    want = safetensors.numpy.load_file(str(phi3 / "model.safetensors"))
    got = safetensors.numpy.load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(got) == set(want) - ({"lm_head.weight"} if cfg.tie_head else set())
    assert any(".qkv_proj." in n for n in got) and any(".gate_up_proj." in n for n in got)
    for name, x in got.items():
        np.testing.assert_array_equal(x, want[name], err_msg=name)


@pytest.mark.slow
# (the plain Llama's untied head and rotary positions are the Mistral's, trained here too)
@pytest.mark.parametrize("which", ["llama3", "qwen2", "qwen3", "mistral", "phi4-mini",
                                   "gemma2", "olmo3", "granite", "mixtral", "seed-oss",
                                   "stablelm", "cohere2", "glm4", "gpt-oss", "pythia", "phi"])
def test_train_py_fine_tunes_a_llama_and_exports_it(which, gpt2, tmp_path, family_dir):
    """train.py --init-from a Llama directory (one made as Llama 3.2 is, a Qwen2, a Qwen3, a Mistral
    whose sliding window is set to 5 of the 16 tokens, one as Phi-4-mini: longrope, heads
    rotated in half, written back as Phi-3's fused tensors; a Gemma 2, an OLMo 3, a Granite (its
    logits scaled inside the chunked loss); a Mixtral with its load-balancing loss on at 0.02; a
    Seed-OSS, exported as Qwen2; a StableLM; a Cohere 2; a GLM-4; a GPT-OSS), a GPT-NeoX made as
    Pythia is or a Phi (its head's bias inside the chunked loss): the model section from its
    config.json,
    its first loss transformers' on that batch (with the Mixtral's weighted balance loss,
    reported as its ``balance_loss``); two SGD steps; the export loads in transformers with
    zero_jax's logits of the trained checkpoint."""
    from zero_jax.gpt.model import build

    llama_dir = family_dir(which)
    window = {"sliding_window": 5} if which == "mistral" else {}
    balance = {"router_aux_loss_coef": 0.02} if which == "mixtral" else {}

    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    run = run_train("--init-from", str(llama_dir), "--steps", "2", "--data",
                    str(gpt2["tokens"]), "--checkpoint-dir", str(ckpt), "--save-every", "2",
                    "--metrics", str(metrics), "--set", "optimizer.name=sgd",
                    "--set", "train.batch_size=8",
                    *[f"--set=model.{k}={v}" for k, v in {**window, **balance}.items()])
    assert run.returncode == 0, run.stderr
    first = json.loads(metrics.read_text().splitlines()[0])
    batch = data.batch(np.fromfile(gpt2["tokens"], np.uint16), 0, 8, 16, 0)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        llama_dir, **window, **({"output_router_logits": True} if balance else {})).eval()
    with torch.no_grad():
        out = theirs(torch.tensor(batch[:, :-1], dtype=torch.long))
        # each device's tokens: the mean of the 8 devices' balance losses (a row each)
        aux = np.mean([theirs(torch.tensor(batch[i:i + 1, :-1], dtype=torch.long)).aux_loss
                       .item() for i in range(8)]) if balance else 0.0
    ref = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 64), torch.tensor(
        batch[:, 1:], dtype=torch.long).reshape(-1)).item() + 0.02 * aux
    if balance:
        assert first["balance_loss"] == pytest.approx(aux, rel=1e-5)
    assert first["loss"] == pytest.approx(ref, rel=1e-5)

    out = tmp_path / "hf"
    assert hf.main([str(ckpt), str(out)]) == 0
    ckpts = zj.Checkpoints(ckpt, read_only=True)
    trained = ckpts.read_params()
    ckpts.close()
    model = build(GPTConfig(**{**hf.read_config(llama_dir), **window}, remat="none",
                            vocab_multiple=128))
    assert hf.read_config(out).get("sliding_window", 0) == model.cfg.sliding_window
    ours = logits_of(model, trained)
    theirs = torch_logits_of(transformers.AutoModelForCausalLM, out)
    assert rel(theirs, ours) < 1e-5


@pytest.mark.slow
def test_init_from_a_hub_id_reads_it_from_the_hubs_cache(gpt2, tmp_path, family_dir,
                                                         monkeypatch):
    """--init-from org/name, no such path here: the snapshot huggingface_hub gives, here from
    a Hub cache laid out as it lays one out (offline): the first loss of the directory itself.
    A name neither here nor in the cache: one line, exit code 2, nothing written."""
    import shutil

    import huggingface_hub.constants as hub

    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    shutil.copytree(family_dir("llama3"), repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    losses = {}
    for source in ("acme/tiny-llama", str(family_dir("llama3"))):
        metrics = tmp_path / f"{len(losses)}.jsonl"
        run = run_train("--init-from", source, "--steps", "1", "--data", str(gpt2["tokens"]),
                        "--metrics", str(metrics), "--set", "train.batch_size=8")
        assert run.returncode == 0, run.stderr
        losses[source] = json.loads(metrics.read_text())["loss"]
    assert len(set(losses.values())) == 1, losses
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "absent.jsonl"
    run = run_train("--init-from", "acme/absent", "--steps", "1", "--data",
                    str(gpt2["tokens"]), "--checkpoint-dir", str(ckpt), "--metrics", str(metrics))
    err = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(err) == 1, err
    assert err[0].startswith("error: --init-from acme/absent is no directory here, and the "
                             "Hugging Face Hub did not give it"), err
    assert not ckpt.exists() and not metrics.exists()


TEXTS = {"a.txt": "the quick brown fox jumps over the lazy dog. " * 20,
         "b.txt": "pack my box with five dozen liquor jugs! " * 20}


def save_tokenizer(path: pathlib.Path, vocab: int = 64) -> None:
    """A BPE of ``vocab`` ids learned from TEXTS (the models' vocabulary is 64) that begins
    each text with ``<s>``, as Llama's does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXTS.values(), trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<s>", "<unk>"], show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 0)])
    tok.save(str(path))


@pytest.mark.slow
def test_train_py_reads_text_with_the_directory_tokenizer(family_dir, tmp_path, capsys):
    """train.py --init-from a directory with a tokenizer.json trains on a directory of text (a
    file, a .jsonl record) as the ids transformers' tokenizer gives each (its <s> included):
    the first loss is transformers' on that batch; the export holds the tokenizer, which
    transformers loads. The checkpoint names the tokenizer: a resume or an export with another
    is refused; text without a tokenizer.json is refused; ``python -m zero_jax.gpt.data``
    writes the same ids to a .npy."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(family_dir("llama3"), model)
    save_tokenizer(model / "tokenizer.json")
    corpus = tmp_path / "corpus"  # a text file and a .jsonl record, each one document
    corpus.mkdir()
    (corpus / "a.txt").write_text(TEXTS["a.txt"])
    (corpus / "b.jsonl").write_text(json.dumps({"text": TEXTS["b.txt"], "id": 7}) + "\n\n")
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(model / "tokenizer.json"))
    ids = np.concatenate([theirs(TEXTS[n])["input_ids"] for n in sorted(TEXTS)])
    assert (ids == 0).sum() == 2 and ids.max() < 64  # each file begins with <s>

    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    args = ["--init-from", str(model), "--data", str(corpus), "--checkpoint-dir", str(ckpt),
            "--set", "optimizer.name=sgd", "--set", "train.batch_size=8"]
    live = tmp_path / "live"  # saved at steps 1 and 2: the second replaces the first
    run = run_train(*args, "--steps", "2", "--save-every", "1", "--save-safetensors", str(live),
                    "--metrics", str(metrics))
    assert run.returncode == 0, run.stderr
    assert f"{len(ids):,} tokens by {model / 'tokenizer.json'}" in run.stdout
    first = json.loads(metrics.read_text().splitlines()[0])["loss"]
    batch = data.batch(ids, 0, 8, 16, 0)
    logits = torch.tensor(torch_logits_of(transformers.AutoModelForCausalLM, model,
                                          batch[:, :-1]))
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), torch.tensor(
        batch[:, 1:], dtype=torch.long).reshape(-1)).item()
    assert first == pytest.approx(ref, rel=1e-5)
    out = tmp_path / "hf"  # the export carries the tokenizer: transformers loads it whole
    assert hf.main([str(ckpt), str(out)]) == 0
    for saved in (out, live):
        loaded = transformers.AutoTokenizer.from_pretrained(saved)
        assert loaded(TEXTS["b.txt"])["input_ids"] == theirs(TEXTS["b.txt"])["input_ids"]
        generation = (saved / "generation_config.json").read_bytes()  # transformers wrote it
        assert generation == (model / "generation_config.json").read_bytes()

    save_tokenizer(model / "tokenizer.json", vocab=60)  # another tokenizer
    capsys.readouterr()
    assert train_py.main([*args, "--steps", "3", "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "another tokenizer" in err[0], err
    other = tmp_path / "hf-other"  # nor is it exported beside the weights
    assert hf.main([str(ckpt), str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has changed since step 2" in err[0] and not other.exists(), err
    (model / "tokenizer.json").unlink()
    assert train_py.main([*args, "--steps", "3", "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no tokenizer.json" in err[0], err
    assert zj.Checkpoints(ckpt, read_only=True).steps() == [1, 2]

    save_tokenizer(model / "tokenizer.json")
    # Every process of a run reads the text; only process 0 says so.
    capsys.readouterr()
    cfg, ns = GPTConfig(vocab_size=64, seq_len=16), argparse.Namespace(init_from=str(model))
    read = lambda: resume.read_tokens(str(corpus), "--data", cfg, ns, data.Tokenizer.of(model))
    with mock.patch.object(jax, "process_index", return_value=1):
        assert np.array_equal(read(), ids) and capsys.readouterr().out == ""
    assert np.array_equal(read(), ids) and "tokens by" in capsys.readouterr().out
    assert data.main([str(corpus), str(tmp_path / "ids.npy"), "--tokenizer", str(model)]) == 0
    saved = np.load(tmp_path / "ids.npy")
    assert saved.dtype == np.uint16 and np.array_equal(saved, ids)


def test_token_files_of_large_vocabularies_and_bad_ones(tmp_path):
    """A .npy of uint32 ids (a vocabulary past uint16's, as Llama 3's 128,256) reads as is,
    memory-mapped; a .jsonl's records are its documents; a .npy that holds no row of integers,
    a .jsonl line that is no {"text": ...} nor {"prompt": ..., "completion": ...} record, and
    text that is not UTF-8 read by a tokenizer, are refused naming the file (and line)."""
    big = np.arange(65_000, 70_000, dtype=np.uint32)
    np.save(tmp_path / "big.npy", big)
    tokens = data.load_tokens(str(tmp_path / "big.npy"))
    assert isinstance(tokens, np.memmap) and np.array_equal(tokens, big)
    data.check_tokens(tokens, 70_000, 16, "big")
    with pytest.raises(ValueError, match="token id 69999 but model.vocab_size is 65536"):
        data.check_tokens(tokens, 65_536, 16, "big")
    for name, array, message in [("rows", np.zeros((4, 8), np.uint16), "shape (4, 8)"),
                                 ("floats", np.zeros(8, np.float32), "float32 array"),
                                 ("objects", np.array([1, "a"], object), "does not read")]:
        np.save(tmp_path / f"{name}.npy", array, allow_pickle=True)
        with pytest.raises(ValueError, match=re.escape(message)):
            data.load_tokens(str(tmp_path / f"{name}.npy"))
    save_tokenizer(tmp_path / "tokenizer.json")
    tokenizer = data.Tokenizer.of(tmp_path)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match="latin1.txt is not UTF-8 text"):
        data.load_tokens(str(tmp_path / "latin1.txt"), tokenizer)
    records = [json.dumps({"text": t}) for t in TEXTS.values()]
    (tmp_path / "docs.jsonl").write_text("\n".join([records[0], "", records[1]]))
    want = [i for t in TEXTS.values() for i in tokenizer([t])]
    assert list(data.load_tokens(str(tmp_path / "docs.jsonl"), tokenizer)) == want
    assert bytes(data.load_tokens(str(tmp_path / "docs.jsonl"))) == "".join(TEXTS.values()).encode()
    for bad in ['{"content": "x"}', '["x"]', '{"text": 3}', "{not json",
                '{"prompt": "x", "completion": 3}']:
        (tmp_path / "bad.jsonl").write_text(f"{records[0]}\n{bad}\n")
        with pytest.raises(ValueError, match="bad.jsonl line 2 is not a JSON object with a"):
            data.load_tokens(str(tmp_path / "bad.jsonl"))


def test_prompt_completion_records_mark_their_prompts(tmp_path):
    """A .jsonl's {"prompt", "completion"} records, among {"text"} ones: each prompt's ids
    stored as -1 - id, encoded as a text is (the tokenizer's <s> first), its completion after
    it with no special token between; a text record as before. The one-time .npy keeps the
    marks (int32), and reads back as they were."""
    save_tokenizer(tmp_path / "tokenizer.json")
    tokenizer = data.Tokenizer.of(tmp_path)
    (a, b), c = TEXTS.values(), "def f(x):\n    return x\n"
    (tmp_path / "sft.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"prompt": a, "completion": b}, {"text": c}]))
    tokens = data.load_tokens(str(tmp_path / "sft.jsonl"), tokenizer)
    prompt, completion = tokenizer.encode([a])[0], tokenizer.encode([b], special=False)[0]
    assert prompt[0] == 0 and 0 not in completion  # <s> begins the prompt alone
    want = np.concatenate([-1 - prompt.astype(np.int64), completion, tokenizer([c])])
    assert tokens.dtype == np.int32 and np.array_equal(tokens, want)
    assert data.prompted(tokens) and np.array_equal(
        data.unprompted(tokens), np.concatenate([prompt, completion, tokenizer([c])]))
    as_bytes = data.load_tokens(str(tmp_path / "sft.jsonl"))  # no tokenizer: bytes
    assert np.array_equal(as_bytes, np.concatenate([
        -1 - np.frombuffer(a.encode(), np.uint8).astype(np.int64),
        np.frombuffer((b + c).encode(), np.uint8)]))
    assert data.main([str(tmp_path / "sft.jsonl"), str(tmp_path / "ids.npy"),
                      "--tokenizer", str(tmp_path)]) == 0
    saved = data.load_tokens(str(tmp_path / "ids.npy"))
    assert saved.dtype == np.int32 and np.array_equal(saved, want)
    with pytest.raises(ValueError, match="token id 299 but model.vocab_size is 256"):
        data.check_tokens(np.array([-300, 5] * 8, np.int32), 256, 4, "a prompt's id")


@pytest.mark.slow
def test_two_processes_each_read_and_write_half_the_file_at_stage_3(gpt2, tmp_path):
    """2 processes x 4 devices (zero_jax.launch) read the directory at stage 3: each reads
    exactly half of the tensors' bytes, and every shard it holds is its slice of the file;
    saved back (save_safetensors), each writes exactly half, and the file is byte for byte the
    one a single process of 8 devices saves. Saved where the processes see different
    directories (as on disks of their own), both stop with an error that says so, rather than
    waiting at a barrier for the other, and nothing is left behind."""
    from conftest import SUBPROCESS_ENV

    from zero_jax.launch import spawn, wait

    with open(tmp_path / "log", "w") as log:
        procs = spawn([str(ROOT / "tests" / "weights_process.py"), str(gpt2["one"]),
                       str(tmp_path)], 2, 4, env={**SUBPROCESS_ENV, "PYTHONPATH": str(ROOT)},
                      cwd=ROOT, stdout=log, stderr=log)
        assert wait(procs, grace=30) == 0, (tmp_path / "log").read_text()[-3000:]
    runs = [json.loads((tmp_path / f"process-{i}.json").read_text()) for i in range(2)]
    for run in runs:
        assert run["local_devices"] == 4 and run["equal"], run
        assert run["bytes_read"] == run["tensor_bytes"] // 2, run
        assert run["bytes_written"] == run["tensor_bytes"] // 2, run
    plan = plan_for(gpt2["model"], 3)
    files, mapping = hf.weights_source(gpt2["one"])
    one = zj.save_safetensors(load_params(plan, files, mapping), tmp_path / "one", mapping)
    assert one.bytes_written == runs[0]["tensor_bytes"]
    assert (tmp_path / "saved" / "model.safetensors").read_bytes() == \
        (tmp_path / "one" / "model.safetensors").read_bytes()
    assert "process 1 does not see the files process 0 created: every process must see the " \
        "directory" in runs[1]["apart"], runs[1]
    assert runs[0]["apart"].startswith("process 1 could not write its shards in "), runs[0]
    assert not [p.name for p in tmp_path.iterdir() if "apart" in p.name]


def test_a_corrupted_checkpoint_exports_nothing(tmp_path, capsys):
    """A parameter whose bytes do not match its recorded digest, found while streaming: one
    line naming the step and the array, exit code 2, and neither the output nor its hidden
    partial directory left behind (the first parameter was already written when it failed)."""
    from zero_jax import export

    shapes = {f"w{i}": jax.ShapeDtypeStruct((8, 128), np.float32) for i in range(2)}
    _checkpoint_of(tmp_path / "ckpt", shapes)
    meta_file = tmp_path / "ckpt" / "0" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["digests"]["params/w1"] = "float32:0000000000000000"
    meta_file.write_text(json.dumps(meta))
    code = export.main([str(tmp_path / "ckpt"), str(tmp_path / "out"), "--format",
                        "safetensors"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "is corrupted: params/w1 does not match" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


# Decoders the config allows but no Hugging Face family computes, and the key each would lose.
NO_FAMILY = [({"gemma": 2, "n_experts": 4}, "gemma"), ({"gemma": 1, "qkv_bias": True}, "qkv_bias"),
             ({"sliding_window": 4, "window_pattern": 2}, "window_pattern"),
             ({"attn_softcap": 5.0}, "attn_softcap"),
             ({"gemma": 1, "query_pre_attn_scalar": 3.0}, "query_pre_attn_scalar"),
             ({"olmo": 2}, "olmo"), ({"olmo": 2, "qk_norm": True, "n_experts": 4}, "olmo"),
             ({"olmo": 1, "qk_norm": True}, "olmo")]


def test_a_model_no_family_computes_is_refused_before_anything_is_written(tmp_path, capsys):
    """The config.json a model would be written with is read back first: where a family
    cannot say what the model computes, the export refuses (one line naming the key, exit code
    2, no directory), as ``train.py --save-safetensors`` does before writing anything; each
    family's own models read back whole (every family's export test)."""
    section = {"arch": "llama", "vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4,
               "d_ff": 64, "seq_len": 16}
    for extra, key in NO_FAMILY:
        with pytest.raises(WeightsError, match=rf"^model\.{key} .* no Hugging Face family"):
            hf.check_writable({**section, **extra})
    # A Gemma 2 windowed on every layer is one: its layer_types all sliding, read back so.
    every = {**section, "gemma": 2, "sliding_window": 4}
    (tmp_path / "ok" / "gemma2").mkdir(parents=True)
    hf.write_config(tmp_path / "ok" / "gemma2", every, "float32")
    back = hf.read_config(tmp_path / "ok" / "gemma2")
    assert back["sliding_window"] == 4 and back["window_pattern"] == 3, back
    out, ckpt = tmp_path / "st", tmp_path / "run"
    sets = [f"model.{k}={v}" for k, v in {**section, **NO_FAMILY[1][0]}.items()]
    code = train_py.main(["--steps", "1", "--save-safetensors", str(out), "--checkpoint-dir",
                          str(ckpt), *[a for s in sets for a in ("--set", s)]])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "model.qkv_bias True does not survive" in err[0], err
    assert not out.exists() and not ckpt.exists()
    shapes = {"w": jax.ShapeDtypeStruct((8, 128), np.float32)}
    _checkpoint_of(tmp_path / "ckpt", shapes)
    meta_file = tmp_path / "ckpt" / "0" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["config"] = {"model": {**section, **NO_FAMILY[0][0]}}
    meta_file.write_text(json.dumps(meta))
    capsys.readouterr()  # the checkpoint's own warnings
    assert hf.main([str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.gemma 2 does not survive as a Hugging Face mixtral" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "ok"]


def test_the_export_streams_without_orbax_warnings(tmp_path, caplog):
    """Each array opened through the reader's one TensorStore context: orbax warns of every
    parameter opened without one (a line per parameter on the export's stderr)."""
    from zero_jax import export

    shapes = {f"w{i}": jax.ShapeDtypeStruct((8, 128), np.float32) for i in range(2)}
    _checkpoint_of(tmp_path / "ckpt", shapes)
    ckpts = zj.Checkpoints(tmp_path / "ckpt", read_only=True)
    want = ckpts.read_params()
    ckpts.close()
    with caplog.at_level("WARNING"):
        assert export.main([str(tmp_path / "ckpt"), str(tmp_path / "st"), "--format",
                            "safetensors"]) == 0
    assert not [r.getMessage() for r in caplog.records if "ts_context" in r.getMessage()]
    back = safetensors.numpy.load_file(tmp_path / "st" / "model.safetensors")
    for k, v in want.items():
        np.testing.assert_array_equal(back[k], np.asarray(v))


def test_a_checkpoint_from_before_norm_eps_resumes_only_with_its_epsilon():
    """The demo took GPT-2's layer-norm epsilon (1e-5); a checkpoint written before the key
    existed trained with flax's 1e-6, and resuming it with another is refused."""
    from zero_jax.checkpoint import CheckpointError
    from zero_jax.gpt import config as configs
    from zero_jax.gpt.experiment import check_compatible

    old = configs.load("tiny")
    del old["model"]["norm_eps"]
    with pytest.raises(CheckpointError, match=r"written for model.norm_eps=1e-06 but the config "
                                              r"says 1e-05"):
        check_compatible({"config": old}, configs.load("tiny"))
    check_compatible({"config": old}, configs.load("tiny", ["model.norm_eps=1e-6"]))


def test_the_balance_loss_weight_may_change_on_resume():
    """``model.router_aux_loss_coef`` (and ``_global``), ``model.router_z_loss_coef``,
    ``model.expert_capacity_factor`` and ``model.eval_capacity_factor`` change what is computed,
    not the state: a checkpoint written before the keys (or with other values) resumes with
    any; the experts' count does not."""
    from zero_jax.checkpoint import CheckpointError
    from zero_jax.gpt import config as configs
    from zero_jax.gpt.experiment import check_compatible

    moe = ["model.arch=llama", "model.n_experts=4"]
    old = configs.load("tiny", moe)
    for key in ("router_aux_loss_coef", "router_aux_loss_global", "router_z_loss_coef",
                "expert_capacity_factor", "eval_capacity_factor"):
        del old["model"][key]
    check_compatible({"config": old}, configs.load("tiny", [*moe, "model.router_aux_loss_coef=0.01",
                                                            "model.router_aux_loss_global=true",
                                                            "model.router_z_loss_coef=0.001",
                                                            "model.expert_capacity_factor=1.25",
                                                            "model.eval_capacity_factor=2.0"]))
    with pytest.raises(CheckpointError, match=r"written for model.n_experts=4 but the config "
                                              r"says 8"):
        check_compatible({"config": old}, configs.load("tiny", ["model.arch=llama",
                                                                "model.n_experts=8"]))
