"""One process of 2 x 4 devices reading a GPT-2 directory at stage 3 and saving it back,
run under ``zero_jax.launch`` by tests/test_weights.py:

    python tests/weights_process.py GPT2_DIR OUT_DIR

Writes ``OUT_DIR/process-<i>.json``: the bytes this process read of the files, their tensors'
bytes, whether every shard it holds equals that slice read on its own, and the bytes it wrote
of ``OUT_DIR/saved`` (``save_safetensors`` of the loaded parameters, every process its own),
and the error of a save into a directory of its own (``apart``: one the processes do not share).
"""

import json
import pathlib
import sys

from zero_jax import distributed

distributed.initialize(distributed.settings(), timeout_s=60)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import zero_jax as zj  # noqa: E402
from zero_jax.gpt import hf  # noqa: E402
from zero_jax.gpt.model import GPT, LAYERS, GPTConfig  # noqa: E402
from zero_jax.weights import check  # noqa: E402

directory, out = sys.argv[1], pathlib.Path(sys.argv[2])
model = GPT(GPTConfig(**hf.read_config(directory), remat="none"))
tokens = np.zeros((1, model.cfg.seq_len), np.int32)
shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens)["params"])
plan = zj.make_plan(shapes, zj.make_mesh(), stage=3, layers=LAYERS)
files, mapping = hf.weights_source(directory)
params = zj.load_params(plan, files, mapping)
own, sources = check(plan, *hf.weights_source(directory))  # a second reader, for the values
equal = all(
    np.array_equal(np.asarray(shard.data), sources[zj.plan.path_str(path)].read(
        own, shard.index, x.dtype))
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
    for shard in x.addressable_shards)
saved = zj.save_safetensors(params, out / "saved", mapping)
try:  # a directory the processes do not share (each names its own, as on local disks)
    zj.save_safetensors(params, out / f"apart-{jax.process_index()}", mapping)
    apart = None
except OSError as e:
    apart = str(e)
(out / f"process-{jax.process_index()}.json").write_text(json.dumps({
    "bytes_read": files.bytes_read, "tensor_bytes": sum(i.nbytes for i in files.tensors.values()),
    "local_devices": jax.local_device_count(), "equal": equal,
    "bytes_written": saved.bytes_written, "apart": apart}))
