"""The default GPT-2 small step as libtpu compiled it for a TPU v5e slice of 8 chips, read from
saved programs (tests/data, made with no TPU present by ``python bench/tpu.py --runs '0;3'
--save-hlo DIR``; jax and libtpu from ``jax[tpu]==0.10.2``): ZeRO's partitioning is what each
chip takes in, and stage 3's buckets travel as all-gathers."""

import gzip
import math
import pathlib
import re

import jax

from zero_jax.gpt import config
from zero_jax.gpt.model import GPTConfig, build, init_fn
from zero_jax.hlo import DTYPE_BYTES, collectives, computations, instruction

DATA = pathlib.Path(__file__).resolve().parent / "data"
CHIPS = 8


def program(stage: int) -> str:
    return gzip.open(DATA / f"gpt2-124m-stage-{stage}-v5e-2x4.hlo.gz", "rt").read()


def arguments(text: str) -> dict[str, int]:
    """Bytes per chip of the program's arguments, by dtype, from its entry layout."""
    layout = re.search(r"entry_computation_layout=\{\((.*)\)->", text.split("\n", 1)[0]).group(1)
    out: dict[str, int] = {}
    for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", layout):
        size = math.prod(int(d) for d in dims.split(",") if d)
        out[dtype] = out.get(dtype, 0) + DTYPE_BYTES[dtype] * size
    return out


def psi() -> tuple[int, int]:
    """(parameters, parameters of one layer) of the gpt2-124m config."""
    model = build(GPTConfig(**config.load("gpt2-124m", [])["model"]))
    shapes = jax.eval_shape(init_fn(model), jax.random.key(0))
    sizes = [(p[0].key == "blocks", math.prod(x.shape))
             for p, x in jax.tree_util.tree_flatten_with_path(shapes)[0]]
    layers = model.cfg.n_layers
    return sum(n for _, n in sizes), sum(n for b, n in sizes if b) // layers


def test_each_chip_takes_in_zeros_share_of_the_state():
    """bf16 parameters (2 bytes each), an fp32 master copy and AdamW's two fp32 moments (12):
    whole on every chip at stage 0, an eighth at stage 3 (stages 1-2 cut the fp32 12 only),
    to the byte; the rest is the batch (int32 tokens)."""
    n, _ = psi()
    whole, cut = arguments(program(0)), arguments(program(3))
    assert (whole["bf16"], whole["f32"]) == (2 * n, 12 * n)
    assert (cut["bf16"], cut["f32"]) == (2 * n // CHIPS, 12 * n // CHIPS)
    assert whole["s32"] == cut["s32"] < 40_000


def test_stage_3_gathers_each_layer_with_an_all_gather_of_whole_tiles():
    """A layer's bucket is gathered by all-gathers of pieces padded to 128 elements
    (``Comm.align``), never by an all-reduce of the whole bucket, which libtpu makes of pieces
    that end inside a tile (7,087,872 / 8 = 885,984 elements: not a multiple of 128). The
    gradients' reduce-scatter is still an all-reduce (of ``(8, 885,984)``) in libtpu's program:
    docs/benchmarks/tpu-compile.md."""
    _, layer = psi()
    piece = -(-layer // CHIPS // 128) * 128  # 886,016
    gathers, reduces = [], []
    for lines in computations(program(3))[0].values():
        for inst in filter(None, map(instruction, lines)):
            shapes = [tuple(int(d) for d in dims.split(",") if d)
                      for dims in re.findall(r"\w+\[([\d,]*)\]", inst[1])]
            {"all-gather": gathers, "all-reduce": reduces}.get(inst[2], []).append(shapes)
    whole = [math.prod(s[0]) for s in gathers if len(s) == 1]
    assert whole.count(CHIPS * piece) >= 4  # the forward's and the backward's loops
    # the old form: the bucket laid flat, each chip's piece written in, all-reduced
    assert not any({(layer,), (CHIPS * piece,)} & set(s) for s in reduces)


def test_each_step_moves_zeros_bytes_read_with_libtpus_loops_and_fusions():
    """The collectives' bytes per step, as ``zero_jax.hlo`` reads libtpu's program: its loops'
    trip counts from their conditions, an asynchronous collective whose steps sit in several
    fusions once, its reduce-scatter fusion (an all-reduce and a slice) as a reduce-scatter.
    Stage 0 all-reduces 2 Psi in bf16 (to the byte, besides the loss's scalars). Stage 3
    gathers every layer twice (forward, and again for the backward) and the embeddings once;
    with the layers' gradient reductions compiled as all-reduces (the test above), it moves
    1.13 x ZeRO's 3 Psi."""
    n, layer = psi()
    zero = collectives(program(0), CHIPS)
    assert sum(c.volume for c in zero if c.dtype == "bf16") == 2 * n * 2
    assert sum(c.volume for c in zero if c.dtype != "bf16") <= 64
    three = collectives(program(3), CHIPS)
    piece = -(-layer // CHIPS // 128) * 128  # a layer's padded bucket, per chip
    gathered = sum(c.volume for c in three if c.kind == "all-gather") // 2  # bf16 elements
    rest = gathered - 2 * 12 * CHIPS * piece  # the embeddings and ln_f, in two buckets
    assert 0 <= rest - (n - 12 * layer) < 2 * CHIPS * 128  # each padded to whole tiles
    assert 1.0 < sum(c.volume for c in three) / (3 * n * 2) < 1.15
