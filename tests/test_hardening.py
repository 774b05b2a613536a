"""Bad input, damaged checkpoints, signals and concurrent use: each case a clear outcome.

The table runs ``train.main`` and ``zero_jax.export.main`` in this process: every row is
refused before a model is compiled, with exit code 2, one ``error:`` line naming the problem,
and nothing on disk added, removed or changed. Real runs share one trained checkpoint directory
and its per-step losses as the reference: ``train.main`` in this process, but for the runs a
signal stops or a terminal's closing hangs up, which are train.py processes. Both compile with
the suite's settings (``SUBPROCESS_ENV``), so a resumed run equals the reference bit for bit
whichever of the two made each.
"""

import contextlib
import io
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXED_SCHEDULE, ONE_LAYER, SUBPROCESS_ENV, TRAIN_ENV

from zero_jax import export, integrity, loop
from zero_jax.checkpoint import Checkpoints, NonFiniteStateError
from zero_jax.lock import WriterLock
from zero_jax.state import TrainState

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import train  # noqa: E402

pytestmark = pytest.mark.slow  # the tiers: docs/testing.md

# The train.py processes compile as this process does (LLVM at level 0, not TRAIN_ENV's 1,
# which rounds a loss differently in its last bit): their losses are the in-process runs'.
ENV = SUBPROCESS_ENV
# conftest.py's; a batch of 8, one sequence a device: what is tested here is the run, not how
# much it learns, and each step costs a quarter of the default batch's.
MODEL = [*ONE_LAYER, *FIXED_SCHEDULE, "--set", "train.batch_size=8"]
REF_STEPS = 40  # saved every 8: checkpoints 24, 32, 40 are kept


def run_train(*args) -> subprocess.CompletedProcess:
    """``train.main`` in this process, its output caught as a process's: a train.py start-up
    less (about 2 s of CPU each); the signalled runs below are processes of their own."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = train.main([*MODEL, *map(str, args)])
    return subprocess.CompletedProcess(["train.py", *args], code, out.getvalue(), err.getvalue())


def losses(path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, open(path))}


def listing(directory: pathlib.Path) -> dict:
    """Every file under ``directory`` with its size and modification time, every empty
    directory, and anything else (a FIFO)."""
    return {str(p.relative_to(directory)): p.is_file() and (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if not p.is_dir() or not any(p.iterdir())}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """40 uninterrupted steps, saved every 8 (the last 3 kept), and their losses."""
    d = tmp_path_factory.mktemp("reference")
    run = run_train("--steps", REF_STEPS, "--save-every", 8, "--checkpoint-dir", d / "ckpt",
                    "--metrics", d / "ref.jsonl")
    assert run.returncode == 0, run.stderr
    assert Checkpoints(d / "ckpt", read_only=True).steps() == [24, 32, 40]
    return d / "ckpt", losses(d / "ref.jsonl")


def flip(item: pathlib.Path) -> None:
    """Invert 4 KiB in the middle of the largest array data file of one item."""
    f = data_file(item)
    b = bytearray(f.read_bytes())
    mid = len(b) // 2
    b[mid: mid + 4096] = bytes(x ^ 0xFF for x in b[mid: mid + 4096])
    f.write_bytes(bytes(b))


def data_file(item: pathlib.Path) -> pathlib.Path:
    return max((p for p in item.glob("ocdbt.process_*/d/*") if p.is_file()),
               key=lambda p: p.stat().st_size)


# Faults, applied to a copy of the reference checkpoints (``c``) or to the work dir (``w``).
def keep_only_40(c, w):
    for s in (24, 32):
        shutil.rmtree(c / str(s))


def garbage_meta(c, w):
    keep_only_40(c, w)
    (c / "40/meta/metadata").write_text("{not json")


def no_meta(c, w):
    keep_only_40(c, w)
    (c / "40/meta/metadata").unlink()


def truncated(c, w):
    keep_only_40(c, w)
    f = data_file(c / "40/master" if (c / "40/master").exists() else c / "40/params")
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])


def missing_array(c, w):
    keep_only_40(c, w)
    data_file(c / "40/params").unlink()


def flipped(c, w):
    keep_only_40(c, w)
    flip(c / "40/params")


def no_array_metadata(c, w):
    keep_only_40(c, w)
    (c / "40/params/_METADATA").unlink()


def flipped_40(c, w):  # 32 and 24 kept
    flip(c / "40/params")


def flipped_40_32(c, w):
    flip(c / "40/params")
    flip(c / "32/params")


def foreign(c, w):
    (c / "30").mkdir()


def other_data(c, w):
    (w / "other.txt").write_text("some other text, not the standard library " * 100)


def a_file(c, w):
    (w / "file").write_text("x")


def ids_past_vocab(c, w):
    np.arange(5000, dtype=np.uint16).tofile(w / "tokens.bin")


def a_dir(c, w):
    (w / "dir").mkdir()


def duplicate_key(c, w):
    (w / "dup.yaml").write_text("optimizer:\n  lr: 1e-3\n  b1: 0.9\n  lr: 2e-3\n")


def bad_yaml(c, w):
    (w / "bad.yaml").write_text("optimizer:\n  lr: [1e-3\n")


def metrics_bad_line(c, w):
    (w / "m.jsonl").write_text('{"step": 1, "loss": 5.5}\n{"step": 2, "lo\n{"step": 3}\n')


def metrics_not_object(c, w):
    (w / "m.jsonl").write_text('{"step": 1, "loss": 5.5}\n[2, 5.4]\n')


def metrics_bad_step(c, w):
    (w / "m.jsonl").write_text('{"step": "one", "loss": 5.5}\n')


def metrics_cut_newline(c, w):  # a cut line is the last one only: here a newline follows it
    (w / "m.jsonl").write_text('{"step": 1, "loss": 5.5}\n{"step": 2, "lo\n')


def other_ckpt(c, w):
    shutil.copytree(c / "40", w / "other" / "40")


def deepspeed(config: dict):
    """A fault that writes ``config`` as {w}/ds.json."""
    return lambda c, w: (w / "ds.json").write_text(json.dumps(config))


def empty_ckpt(c, w):
    shutil.rmtree(c)
    c.mkdir()


T = ["train"]
R = ["train", "--checkpoint-dir", "{c}", "--resume", "--steps", "20"]
E = ["export", "{c}", "{w}/out"]
ROWS = [
    # (id, command, fault, phrase)
    ("stage 4", [*T, "--stage", "4"], None, "ZeRO stage must be 0, 1, 2 or 3"),
    ("stage x", [*T, "--stage", "x"], None, "invalid int value"),
    ("devices 0", [*T, "--devices", "0"], None, "--devices must be at least 1"),
    ("save-every -1", [*T, "--save-every", "-1"], None, "--save-every must be at least 0"),
    ("keep 0", [*T, "--keep", "0"], None, "--keep must be at least 1"),
    ("seed -1", [*T, "--seed", "-1"], None, "--seed must be 0 to 4294967295 (got -1)"),
    ("seed 2**70", [*T, "--seed", str(2**70)], None,
     f"--seed must be 0 to 4294967295 (got {2**70})"),
    ("seed 2**32", [*T, "--set", "train.seed=4294967296"], None,
     "train.seed must be 0 to 4294967295 (got 4294967296)"),
    ("max_bad_steps <0", [*T, "--set", "train.max_bad_steps=-1"], None,
     "train.max_bad_steps must be a finite number of at least 0"),
    ("train.seed -1", [*T, "--set", "train.seed=-1"], None,
     "train.seed must be a finite number of at least 0"),
    ("devices 2**31", [*T, "--devices", "2147483648"], None,
     "--devices must be at most 4096 (got 2147483648)"),
    ("n_heads 0", [*T, "--set", "model.n_heads=0"], None, "model.n_heads must be a finite"),
    ("d_model 0", [*T, "--set", "model.d_model=0"], None, "model.d_model must be a finite"),
    ("d_model <0", [*T, "--set", "model.d_model=-64"], None, "model.d_model must be a finite"),
    ("vocab 0", [*T, "--set", "model.vocab_size=0"], None, "model.vocab_size must be a finite"),
    ("d_ff 0", [*T, "--set", "model.d_ff=0"], None, "model.d_ff must be a finite"),
    ("n_layers 0", [*T, "--set", "model.n_layers=0"], None, "model.n_layers must be a finite"),
    ("lr nan", [*T, "--set", "optimizer.lr=.nan"], None, "optimizer.lr must be a finite"),
    ("lr inf", [*T, "--set", "optimizer.lr=.inf"], None, "optimizer.lr must be a finite"),
    ("lr <0", [*T, "--set", "optimizer.lr=-0.001"], None, "optimizer.lr must be a finite"),
    ("lr 0", [*T, "--set", "optimizer.lr=0"], None, "optimizer.lr is 0: no step would change"),
    ("warmup <0", [*T, "--set", "optimizer.warmup_steps=-1"], None,
     "optimizer.warmup_steps must be a finite number of at least 0"),
    ("clip <0", [*T, "--set", "optimizer.clip_norm=-1.0"], None, "optimizer.clip_norm must be"),
    ("b1 1", [*T, "--set", "optimizer.b1=1.0"], None, "optimizer.b1 must be in [0, 1)"),
    ("momentum 1.5", [*T, "--set", "optimizer.momentum=1.5"], None,
     "optimizer.momentum must be in [0, 1) (got 1.5)"),
    ("weight_decay 1e6", [*T, "--set", "optimizer.weight_decay=1e6"], None,
     "optimizer.weight_decay must be at most 1 (got 1e+06)"),
    ("decay < warmup", [*T, "--set", "optimizer.decay_steps=10"], None,
     "optimizer.decay_steps 10 ends the schedule before its warmup of 20 steps does"),
    ("scale power 128", [*T, "--set", "precision.initial_scale_power=128"], None,
     "precision.initial_scale_power must be at most 127 (got 128)"),
    ("scale power 2000", [*T, "--set", "precision.initial_scale_power=2000"], None,
     "precision.initial_scale_power must be at most 127 (got 2000)"),
    ("min scale 1e39", [*T, "--set", "precision.min_loss_scale=1e39"], None,
     "precision.min_loss_scale must be at most 2**127"),
    ("data ''", [*T, "--data", ""], None, "--data '' names nothing"),
    ("ckpt dir ''", [*T, "--checkpoint-dir", ""], None, "--checkpoint-dir '' names nothing"),
    ("metrics ''", [*T, "--metrics", ""], None, "--metrics '' names nothing"),
    ("report ' '", [*T, "--report", " "], None, "--report ' ' names nothing"),
    ("config ''", [*T, "--config", ""], None, "--config '' names nothing"),
    ("save-every no dir", [*T, "--save-every", "5"], None,
     "--save-every needs --checkpoint-dir DIR: without it nothing is saved or read"),
    ("keep no dir", [*T, "--keep", "2"], None, "--keep needs --checkpoint-dir DIR"),
    ("overwrite no dir", [*T, "--overwrite"], None, "--overwrite needs --checkpoint-dir DIR"),
    ("two no dir", [*T, "--save-every", "5", "--resume"], None,
     "--save-every and --resume need --checkpoint-dir DIR"),
    ("peer-timeout nan", [*T, "--peer-timeout", "nan"], None,
     "--peer-timeout must be a positive finite number of seconds (got nan)"),
    ("peer-timeout inf", [*T, "--peer-timeout", "inf"], None,
     "--peer-timeout must be a positive finite number of seconds (got inf)"),
    ("peer-timeout 0", [*T, "--peer-timeout", "0"], None,
     "--peer-timeout must be a positive finite number of seconds (got 0)"),
    ("min_shard <0", [*T, "--set", "zero.min_shard_elems=-1"], None,
     "zero.min_shard_elems must be a finite number of at least 0"),
    ("zero3-size -2", [*T, "--zero3-size", "-2"], None, "zero.zero3_size must be a finite"),
    ("frozen everything", [*T, "--set", "optimizer.frozen_modules=[blocks,ln_f,wpe,wte]"], None,
     "optimizer.frozen_modules=['blocks', 'ln_f', 'wpe', 'wte'] freezes every parameter: "
     "nothing to train"),
    ("unknown key", [*T, "--set", "model.n_layer=2"], None, "unknown config key model.n_layer"),
    ("set not yaml", [*T, "--set", "optimizer.lr=[1"], None,
     "--set optimizer.lr=[1: the value is not valid YAML: expected ',' or ']'"),
    ("set duplicate", [*T, "--set", "model={{d_model: 64, d_model: 32}}"], None,
     "d_model is given twice, on lines 1 and 1 of the value of model: keep one"),
    ("config duplicate", [*T, "--config", "{w}/dup.yaml"], duplicate_key,
     "config {w}/dup.yaml: optimizer.lr is given twice, on lines 2 and 4: keep one"),
    ("config not yaml", [*T, "--config", "{w}/bad.yaml"], bad_yaml,
     "config {w}/bad.yaml is not valid YAML: expected ',' or ']', but got '<stream end>' "
     "(line 3, column 1)"),
    ("lr 'x'", [*T, "--set", "optimizer.lr=fast"], None,
     "config key optimizer.lr must be a float, got 'fast'"),
    ("steps 'x'", [*T, "--set", "train.steps=many"], None,
     "config key train.steps must be an int, got 'many'"),
    ("remat policy", [*T, "--set", "model.remat=some"], None,
     "model.remat must be one of auto, full"),
    ("gather unit", [*T, "--set", "zero.gather=layer"], None,
     "zero.gather must be one of block, module (got 'layer')"),
    ("gather module stage 2", [*T, "--stage", "2", "--set", "zero.gather=module"], None,
     "zero.gather module gathers stage 3's modules one at a time; stage 2 gathers none"),
    ("offload nvme", [*T, "--set", "zero.offload_optimizer.device=nvme"], None,
     "zero.offload_optimizer.device nvme keeps the whole optimizer in files: set "
     "zero.offload_optimizer.nvme_path=DIR"),
    ("nvme path", [*T, "--set", "zero.offload_optimizer.device=nvme", "--set",
                   "zero.offload_optimizer.nvme_path=/no/such/dir", "--set",
                   "optimizer.clip_norm=0"], None,
     "NVMe path /no/such/dir is not an existing directory"),
    ("offload ratio 2", [*T, "--set", "zero.offload_optimizer.ratio=2"], None,
     "zero.offload_optimizer.ratio is the fraction"),
    ("params no optimizer", [*T, "--set", "zero.offload_params=cpu"], None,
     "zero.offload_params cpu needs stage 3 and the whole optimizer offloaded"),
    ("tensor parallel 3", [*T, "--tensor-parallel", "3"], None,
     "mesh.tensor_parallel 3 does not divide model.n_heads 4"),
    ("tensor parallel devices", [*T, "--devices", "6", "--tensor-parallel", "4"], None,
     "mesh.tensor_parallel 4 does not divide the 6 devices: pick a divisor"),
    ("tensor parallel d_ff", [*T, "--tensor-parallel", "2", "--set", "model.d_ff=101"], None,
     "mesh.tensor_parallel 2 does not divide model.d_ff 101: tensor parallelism cuts it into 2"),
    ("tensor parallel vocab", [*T, "--tensor-parallel", "2", "--set", "model.vocab_size=251",
                               "--set", "model.vocab_multiple=1"],
     None, "mesh.tensor_parallel 2 does not divide model.vocab_size 251"),
    ("attention unknown", [*T, "--set", "model.attention=flash"], None,
     "model.attention must be one of auto, xla, cudnn (got 'flash')"),
    ("attention cudnn on cpu", [*T, "--set", "model.attention=cudnn"], None,
     "model.attention=cudnn cannot run here: it runs on CUDA GPUs only (these devices are cpu)"),
    ("head_dim of gpt2", [*T, "--set", "model.head_dim=16"], None,
     "model.head_dim, model.qkv_bias, model.qk_norm, "
     "model.sliding_window, Gemma's, OLMo's, StableLM's, Cohere's, SmolLM3's, Granite's and "
     "GPT-OSS's keys and model.n_experts are the llama arch's"),
    ("parallel residual of gpt2", [*T, "--set", "model.parallel_residual=1"], None,
     "model.parallel_residual, model.head_bias and model.hidden_act are the neox arch's "
     "(parallel_residual 2, one norm for both, the llama arch's too): set model.arch=neox"),
    ("llama parallel residual 1", [*T, "--config", "llama", "--set",
                                   "model.parallel_residual=1"], None,
     "model.parallel_residual, model.head_bias and model.hidden_act are the neox arch's"),
    ("output norms and gemma", [*T, "--config", "llama", "--set", "model.output_norms=true",
                                "--set", "model.gemma=2"], None,
     "model.output_norms adds norms of the outputs to Llama's"),
    ("gpt-oss without experts", [*T, "--config", "llama", "--set", "model.gpt_oss=true"], None,
     "model.gpt_oss is GPT-OSS's mixture of experts, without q and k norms or a shared expert"),
    ("layer norm 3", [*T, "--config", "llama", "--set", "model.layer_norm=3"], None,
     "model.layer_norm must be 0, 1 or 2 (got 3)"),
    ("parallel residual 3", [*T, "--set", "model.arch=neox", "--set",
                             "model.parallel_residual=3"], None,
     "model.parallel_residual must be 0, 1 or 2 (got 3)"),
    ("head bias tied", [*T, "--set", "model.arch=neox", "--set", "model.head_bias=true", "--set",
                        "model.tie_head=true"], None, "model.head_bias is an untied head's"),
    ("activation unknown", [*T, "--set", "model.arch=neox", "--set", "model.hidden_act=relu"],
     None, "model.hidden_act must be one of gelu, gelu_new, gelu_pytorch_tanh, gelu_fast "
     "(got 'relu')"),
    ("neox grouped-query", [*T, "--set", "model.arch=neox", "--set", "model.n_kv_heads=2"],
     None, "model.n_kv_heads and model.rope_type are not the neox arch's"),
    ("declared context of gpt2", [*T, "--set", "model.max_positions=128"], None,
     "model.max_positions is the context a Hugging Face export declares for rotary positions"),
    ("logits scaled by 0", [*T, "--config", "llama", "--set", "model.logits_scaling=0"], None,
     "model.logits_scaling must be a finite number above 0 (got 0.0): 1 is none"),
    ("nope of gpt2", [*T, "--set", "model.nope_every=4"], None,
     "model.n_experts are the llama arch's: set model.arch=llama"),
    ("window pattern, no window", [*T, "--config", "llama", "--set", "model.window_pattern=2"],
     None, "model.window_pattern and model.rope_local_theta are the sliding layers' (Gemma 2's "
     "and 3's): set model.sliding_window too"),
    ("capacity, no experts", [*T, "--config", "llama", "--set",
                              "model.expert_capacity_factor=1.25"], None,
     "model.shared_expert_d_ff, model.router_aux_loss_coef, model.router_z_loss_coef, "
     "model.expert_capacity_factor and model.eval_capacity_factor are a mixture of experts': "
     "set model.n_experts too"),
    ("balance loss infinite", [*T, "--config", "llama", "--set", "model.n_experts=4", "--set",
                               "model.router_aux_loss_coef=inf"], None,
     "model.router_aux_loss_coef must be a finite number of at least 0 (got inf)"),
    ("global balance, no weight", [*T, "--config", "llama", "--set", "model.n_experts=4",
                                   "--set", "model.router_aux_loss_global=true"], None,
     "model.router_aux_loss_global says where the experts' balance loss is taken: set its "
     "weight, model.router_aux_loss_coef, too"),
    ("gemma 3", [*T, "--config", "llama", "--set", "model.gemma=3"], None,
     "model.gemma must be 0, 1 or 2 (got 3)"),
    ("olmo 3", [*T, "--config", "llama", "--set", "model.olmo=3"], None,
     "model.olmo must be 0, 1 or 2 (got 3)"),
    ("olmo 1 without q, k norms", [*T, "--config", "llama", "--set", "model.olmo=1"], None,
     "model.olmo 1 norms q and k over all heads at once: set model.qk_norm too"),
    ("olmo and gemma", [*T, "--config", "llama", "--set", "model.olmo=2", "--set",
                        "model.gemma=2"], None,
     "model.olmo, model.gemma and model.layer_norm make or place the norms each its own way"),
    ("layer norm and gemma", [*T, "--config", "llama", "--set", "model.layer_norm=1",
                              "--set", "model.gemma=1"], None,
     "model.olmo, model.gemma and model.layer_norm make or place the norms each its own way"),
    ("qkv bias and qk norm", [*T, "--config", "llama", "--set", "model.qkv_bias=true", "--set",
                              "model.qk_norm=true"], None,
     "model.qkv_bias, model.qk_norm and model.sliding_window together are no Hugging Face "
     "family's decoder"),
    ("rope type unknown", [*T, "--set", "model.rope_type=dynamic"], None,
     "model.rope_type must be one of default, linear, llama3, longrope, yarn (got 'dynamic')"),
    ("llama3 rope without its context", [*T, "--set", "model.rope_type=llama3"], None,
     "rope_type llama3 needs 0 < model.rope_low_freq_factor < model.rope_high_freq_factor and "
     "model.rope_original_max_positions >= 1 (got 1.0, 4.0, 0)"),
    ("longrope without its factors", [*T, "--config", "llama", "--set",
                                      "model.rope_type=longrope"], None,
     "rope_type longrope needs model.rope_short_factor and model.rope_long_factor, 16 positive "
     "numbers each (one per rotary pair)"),
    ("partial rotary odd", [*T, "--config", "llama", "--set", "model.partial_rotary_factor=0.3"],
     None, "model.partial_rotary_factor 0.3 must rotate an even part of each 32-wide head"),
    ("partial rotary of gpt2", [*T, "--set", "model.partial_rotary_factor=0.5"], None,
     "model.partial_rotary_factor below 1 is Phi-3's"),
    ("yarn without its context", [*T, "--config", "llama", "--set", "model.rope_type=yarn"],
     None, "rope_type yarn needs model.rope_original_max_positions >= 1"),
    ("longrope factors not numbers", [*T, "--set", "model.rope_long_factor=[1, a]"], None,
     "config key model.rope_long_factor must be a list of numbers, got [1, 'a']"),
    ("vocab multiple 0", [*T, "--set", "model.vocab_multiple=0"], None,
     "model.vocab_multiple must be a finite number of at least 1"),
    ("tensor parallel 0", [*T, "--tensor-parallel", "0"], None,
     "mesh.tensor_parallel must be a finite number of at least 1"),
    ("pa without tp", [*T, "--set", "zero.partition_activations=true"], None,
     "zero.partition_activations cuts each block's saved input over the tensor-parallel"),
    ("tile stage 2", [*T, "--stage", "2", "--set", "zero.tile_mb=1"], None,
     "Layers(tile_mb=...) gathers stage 3's large parameters tile by tile; it is not built "
     "with stage 2"),
    ("tile <0", [*T, "--set", "zero.tile_mb=-1"], None,
     "zero.tile_mb must be a finite number of at least 0"),
    ("bucket <0", [*T, "--set", "zero.bucket_mb=-1"], None,
     "zero.bucket_mb must be a finite number of at least 0"),
    ("int4 weights", [*T, "--set", "zero.quantize_weights=int4"], None,
     "zero.quantize_weights must be none or int8"),
    ("int8 weights stage 2", [*T, "--stage", "2", "--set", "zero.quantize_weights=int8"], None,
     "zero.quantize_weights int8 quantizes what stage 3 communicates; stage 2 does not"),
    ("int8 grads stage 1", [*T, "--stage", "1", "--set", "zero.quantize_grads=int8"], None,
     "zero.quantize_grads int8 quantizes what stage 2-3 communicates; stage 1 does not"),
    ("prefetch maybe", [*T, "--set", "zero.prefetch=maybe"], None,
     "config key zero.prefetch must be a bool, got 'maybe'"),
    ("planner size", [*T, "--dry-run", "--device-memory", "80XB", "--host-memory", "1TB"], None,
     "--device-memory '80XB' is not a memory size"),
    ("planner one size", [*T, "--dry-run", "--device-memory", "80GB"], None,
     "--device-memory and --host-memory plan layouts: pass both"),
    ("config dir", [*T, "--config", "{w}/dir"], a_dir, "is a directory: pass a YAML file"),
    ("config missing", [*T, "--config", "nope"], None, "config nope not found"),
    ("data missing", [*T, "--data", "{w}/none.txt"], None, "none.txt does not exist"),
    ("data ids past vocab", [*T, "--data", "{w}/tokens.bin"], ids_past_vocab,
     "tokens.bin has token id 4999 but model.vocab_size is 256"),
    ("metrics no dir", [*T, "--metrics", "{w}/no/m.jsonl"], None,
     "is not an existing directory"),
    ("report no dir", [*T, "--report", "{w}/no/r.json"], None, "is not an existing directory"),
    ("metrics is dir", [*T, "--metrics", "{w}/dir"], a_dir, "--metrics {w}/dir is a directory"),
    ("metrics unwritable", [*T, "--metrics", "/proc/m.jsonl"], None,
     "--metrics /proc/m.jsonl cannot be written"),
    ("report under file", [*T, "--report", "{w}/file/r.json"], a_file,
     "is not an existing directory"),
    ("metrics = report", [*T, "--metrics", "{w}/x.json", "--report", "{w}/./x.json"], None,
     "--metrics and --report both name"),
    ("resume no dir", [*T, "--resume"], None, "--resume needs --checkpoint-dir"),
    ("profile-steps 3:2", [*T, "--profile", "{w}/p", "--profile-steps", "3:2"], None,
     "--profile-steps 3:2 is not A:B with 1 <= A < B"),
    ("profile-steps x", [*T, "--profile", "{w}/p", "--profile-steps", "two:4"], None,
     "--profile-steps two:4 is not A:B with 1 <= A < B"),
    ("profile-steps 0:2", [*T, "--profile", "{w}/p", "--profile-steps", "0:2"], None,
     "--profile-steps 0:2 is not A:B with 1 <= A < B"),
    ("profile-steps past", [*T, "--profile", "{w}/p", "--profile-steps", "2:4"], None,
     "--profile-steps 2:4 reaches past the run's 1 steps"),
    ("profile-steps alone", [*T, "--profile-steps", "2:4"], None,
     "--profile-steps needs --profile DIR"),
    ("plot is file", [*T, "--plot", "{w}/file"], a_file, "--plot {w}/file is a file"),
    ("tensorboard ''", [*T, "--tensorboard", ""], None, "--tensorboard '' names nothing"),
    ("profile under file", [*T, "--profile", "{w}/file/prof"], a_file,
     "--profile {w}/file/prof cannot be written ({w}/file is not a writable directory)"),
    ("tensorboard in /proc", [*T, "--tensorboard", "/proc/tb"], None,
     "--tensorboard /proc/tb cannot be written (/proc is not a writable directory)"),
    ("deepspeed missing", [*T, "--deepspeed-config", "{w}/none.json"], None,
     "--deepspeed-config {w}/none.json cannot be read"),
    ("deepspeed unknown", [*T, "--deepspeed-config", "{w}/ds.json"],
     deepspeed({"zero_optimization": {"stage": 2}, "sparse_attention": {"mode": "fixed"}}),
     "--deepspeed-config {w}/ds.json: sparse_attention is not supported by zero_jax: remove"),
    ("deepspeed unknown zero key", [*T, "--deepspeed-config", "{w}/ds.json"],
     deepspeed({"zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}}),
     "zero_optimization.zero_quantized_nontrainable_weights is not supported by zero_jax"),
    ("deepspeed nvme", [*T, "--deepspeed-config", "{w}/ds.json"],
     deepspeed({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}),
     "zero_optimization.offload_param.device is nvme: the NVMe tier (ZeRO-Infinity) holds "
     "the optimizer's state, not the parameters"),
    ("deepspeed auto", [*T, "--deepspeed-config", "{w}/ds.json"],
     deepspeed({"zero_optimization": {"stage": "auto"}}),
     "zero_optimization.stage is \"auto\", which Hugging Face's Trainer does not fill either"),
    ("deepspeed batch", [*T, "--deepspeed-config", "{w}/ds.json"],
     deepspeed({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2,
                "gradient_accumulation_steps": 1}),
     "train_batch_size 32 is not train_micro_batch_size_per_gpu 2 x "
     "gradient_accumulation_steps 1 x 8 data-parallel devices = 16"),
    ("deepspeed static scale", [*T, "--deepspeed-config", "{w}/ds.json"],
     deepspeed({"fp16": {"enabled": True, "loss_scale": 128}}),
     "fp16.loss_scale is a static loss scale, which is not built"),
    ("deepspeed lamb", [*T, "--deepspeed-config", "{w}/ds.json"],
     deepspeed({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}),
     "optimizer.type Lamb is not built: zero_jax maps Adam and AdamW"),
    ("deepspeed stage type", [*T, "--deepspeed-config", "{w}/ds.json"],
     deepspeed({"zero_optimization": {"stage": "2"}}),
     "zero_optimization.stage must be a number (got \"2\")"),
    ("resume overwrite", [*R, "--overwrite"], None, "--resume continues the checkpoints that"),
    ("ckpt dir is file", [*T, "--checkpoint-dir", "{w}/file"], a_file, "is a file"),
    ("fresh into used", [*T, "--checkpoint-dir", "{c}"], None,
     "holds checkpoints of another run (steps 24, 32, 40): pass --resume"),
    ("foreign step dir", [*R], foreign, "holds 30/, which is not a zero_jax checkpoint"),
    ("locked", [*R], "lock", f"is being written by process {os.getpid()}"),
    ("resume fp16", [*R, "--set", "precision.param_dtype=fp16"], None,
     "written with precision.param_dtype=fp32, without fp16's loss scale, which an fp16 run "
     "keeps in its state: resume it with --set precision.param_dtype=bf16 or fp32"),
    ("resume no clip", [*R, "--set", "optimizer.clip_norm=0"], None,
     "trained with optimizer.clip_norm=1.0 but the config says 0.0"),
    ("resume d_model", [*R, "--set", "model.d_model=64"], None,
     "written for model.d_model=128 but the config says 64"),
    ("resume sgd", [*R, "--set", "optimizer.name=sgd"], None, "holds adamw optimizer state"),
    ("resume other data", [*R, "--data", "{w}/other.txt"], other_data,
     "but this run reads {w}/other.txt: pass the same --data, or --allow-other-data"),
    ("resume garbage meta", [*R], garbage_meta, "no checkpoint in {c} can be read"),
    ("resume metrics bad line", [*R, "--metrics", "{w}/m.jsonl"], metrics_bad_line,
     "--metrics {w}/m.jsonl: line 2 is not JSON (Unterminated string starting at column 13)"),
    ("resume metrics list", [*R, "--metrics", "{w}/m.jsonl"], metrics_not_object,
     "--metrics {w}/m.jsonl: line 2 is not a record of a step (it holds a JSON list)"),
    ("resume metrics step", [*R, "--metrics", "{w}/m.jsonl"], metrics_bad_step,
     "--metrics {w}/m.jsonl: line 1 is not a record of a step (its step is not a number)"),
    ("resume metrics cut", [*R, "--metrics", "{w}/m.jsonl"], metrics_cut_newline,
     "--metrics {w}/m.jsonl: line 2 is not JSON"),
    ("resume no meta", [*R], no_meta, "no checkpoint in {c} can be read"),
    ("load path missing", [*T, "--set", "train.ckpt_load_path={w}/none"], None,
     "train.ckpt_load_path: checkpoint directory"),
    ("export garbage meta", [*E], garbage_meta, "checkpoint step 40 in {c} cannot be read: meta"),
    ("export no meta", [*E], no_meta, "40/meta/metadata is missing"),
    ("export truncated", [*E], truncated, "checkpoint step 40 in {c} "),
    ("export missing array", [*E], missing_array,  # names the array, not orbax's index
     'checkpoint step 40 in {c} cannot be read: params: FAILED_PRECONDITION: Error reading '
     '"params.'),
    ("export flipped", [*E], flipped, "checkpoint step 40 in {c} "),
    ("export flipped hint", [*E], flipped_40,  # as --resume falls back
     "; checkpoint 32 reads: export it with --step 32"),
    ("export two flipped hint", [*E], flipped_40_32,
     "; checkpoint 24 reads: export it with --step 24"),
    ("export step flipped hint", [*E, "--step", "32"], flipped_40_32,
     "; checkpoint 24 reads: export it with --step 24"),
    ("export flipped no hint", [*E], flipped, "; no older checkpoint reads"),
    ("export no _METADATA", [*E], no_array_metadata, "40/params/_METADATA is missing"),
    ("export empty dir", [*E], empty_ckpt, "no complete checkpoint in {c}"),
    ("export exists", ["export", "{c}", "{w}"], None, "already exists"),
    ("export no dir", ["export", "{w}/none", "{w}/out"], None,
     "checkpoint directory {w}/none does not exist"),
    ("export unwritable", ["export", "{c}", "/proc/out"], None, "cannot export into /proc/out"),
    ("export dtype", [*E, "--dtype", "int8"], None, "dtype must be one of"),
    ("export into ckpt", ["export", "{c}", "{c}/99"], None,
     "cannot export into {c}/99: it is inside the checkpoint directory {c}, where a run would "
     "take it for a checkpoint"),
    ("export deep in ckpt", ["export", "{c}", "{c}/exports/a"], None,
     "cannot export into {c}/exports/a: it is inside the checkpoint directory {c}"),
    ("export into other ckpt", ["export", "{c}", "{w}/other/99"], other_ckpt,
     "cannot export into {w}/other/99: it is inside the checkpoint directory {w}/other"),
]


@pytest.mark.parametrize("name, command, fault, phrase", ROWS, ids=[r[0] for r in ROWS])
def test_refused_with_one_line_and_nothing_written(name, command, fault, phrase, reference,
                                                   tmp_path, capsys, monkeypatch):
    c, w = tmp_path / "ckpt", tmp_path / "work"
    if any("{c}" in a for a in command):  # a copy of the reference, for the rows that name it
        shutil.copytree(reference[0], c)
    w.mkdir()
    monkeypatch.chdir(w)
    if callable(fault):
        fault(c, w)
    before = listing(tmp_path)
    lock = WriterLock(c) if fault == "lock" else None  # another writer, released at the end
    argv = [a.format(c=c, w=w) for a in command[1:]]
    main = train.main if command[0] == "train" else export.main
    if command[0] == "train":
        argv = [*MODEL, *argv, *["--steps", "1"] * ("--steps" not in argv)]
    compiles = []
    monkeypatch.setattr(jax.stages.Lowered, "compile", lambda *a, **k: compiles.append(a))
    try:
        code = main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    finally:
        if lock:
            lock.release()
    out = capsys.readouterr()
    # One error line; beside it only the warnings naming each unreadable checkpoint, nothing else
    errors = [line for line in out.err.strip().splitlines() if not line.startswith("warning: ")]
    assert code == 2, out.err
    assert len(errors) == 1 and errors[0].startswith("error: ") \
        and phrase.format(c=c, w=w) in errors[0], out.err
    assert not compiles  # refused before any model was compiled
    assert listing(tmp_path) == before


def write(name: str, content: bytes | str):
    """A fault that writes ``content`` as {w}/``name``."""
    data = content.encode() if isinstance(content, str) else content
    return lambda w: (w / name).write_bytes(data)


NV = ["--set", "zero.offload_optimizer.device=nvme", "--set", "optimizer.clip_norm=0",
      "--set", "zero.offload_optimizer.nvme_path={w}"]
DS = ["--deepspeed-config", "{w}/ds.json"]
BIG = 100000000000000000000  # 1e20, as an integer
# (id, train.py arguments, fault on the work dir {w}, phrase): the inputs that once ended in
# a traceback, a hang or a run on the wrong thing.
INPUTS = [
    ("safetensors in checkpoints", ["--save-safetensors", "{w}/ckpt/hf"], None,
     "--save-safetensors {w}/ckpt/hf is inside --checkpoint-dir"),
    ("checkpoints in safetensors", ["--save-safetensors", "{w}"], None,
     "--save-safetensors {w} holds --checkpoint-dir {w}/ckpt, which each save there would "
     "delete"),
    ("safetensors over files", ["--save-safetensors", "{w}/out"],
     lambda w: (w / "out").mkdir() or (w / "out" / "notes.txt").write_text("mine"),
     "--save-safetensors {w}/out holds notes.txt, which a save there would delete"),
    ("ds micro batch 0", DS, write("ds.json", '{"train_batch_size": 32, '
                                   '"train_micro_batch_size_per_gpu": 0}'),
     "--deepspeed-config {w}/ds.json: train_micro_batch_size_per_gpu must be a whole number of "
     "at least 1 (got 0)"),
    ("ds accumulation 0", DS, write("ds.json", '{"train_batch_size": 32, '
                                    '"gradient_accumulation_steps": 0}'),
     "gradient_accumulation_steps must be a whole number of at least 1 (got 0)"),
    ("ds batch 0", DS, write("ds.json", '{"train_batch_size": 0}'),
     "--deepspeed-config {w}/ds.json: train_batch_size must be a whole number of at least 1"),
    ("ds nested deep", DS, write("ds.json", "[" * 200_000 + "]" * 200_000),
     "--deepspeed-config {w}/ds.json nests its values too deep to be a DeepSpeed config"),
    ("ds warmup 1e20", DS, write("ds.json", '{"scheduler": {"type": "WarmupLR", "params": '
                                 '{"warmup_num_steps": 1e20}}}'),
     f"optimizer.warmup_steps must be at most 2147483647 (got {BIG}): the step counter is an "
     "int32"),
    ("warmup 1e20", ["--set", "optimizer.schedule=constant", "--set",
                     f"optimizer.warmup_steps={BIG}"], None,
     f"optimizer.warmup_steps must be at most 2147483647 (got {BIG})"),
    ("warmup 2**31", ["--set", "optimizer.warmup_steps=2147483648"], None,
     "optimizer.warmup_steps must be at most 2147483647 (got 2147483648)"),
    ("steps 2**31", ["--steps", "2147483648"], None,
     "train.steps must be at most 2147483647 (got 2147483648)"),
    ("nvme buffer inf", [*NV, "--set", "zero.offload_optimizer.buffer_mb=.inf"], None,
     "buffer_mb a finite number of at least 0.00390625 (4 KiB, a disk page"),
    ("nvme buffer 1e-6", [*NV, "--set", "zero.offload_optimizer.buffer_mb=1e-6"], None,
     "buffer_mb a finite number of at least 0.00390625 (4 KiB, a disk page: smaller bands are "
     "many more reads of a page each) (got 4, 1e-06)"),
    ("vocab 2**31", ["--set", "model.vocab_size=2147483648"], None,
     "model.vocab_size must be at most 2147483647 (got 2147483648): token ids are int32"),
    ("vocab 2**64", ["--set", f"model.vocab_size={2**64}"], None,
     f"model.vocab_size must be at most 2147483647 (got {2**64})"),
    ("data fifo", ["--data", "{w}/fifo"], lambda w: os.mkfifo(w / "fifo"),
     "data file {w}/fifo is not a regular file or directory (a FIFO or a device"),
    ("data device", ["--data", "/dev/zero"], None,
     "data file /dev/zero is not a regular file or directory"),
    ("ds zero_optimization 3", DS, write("ds.json", '{"zero_optimization": 3}'),
     "--deepspeed-config {w}/ds.json: zero_optimization must be an object of its keys, e.g. "
     '{{"stage": ...}} (got 3)'),
    ("ds zero_optimization [3]", DS, write("ds.json", '{"zero_optimization": [3]}'),
     "zero_optimization must be an object of its keys, e.g. {{\"stage\": ...}} (got [3])"),
    ("ds zero_optimization str", DS, write("ds.json", '{"zero_optimization": "stage3"}'),
     'zero_optimization must be an object of its keys, e.g. {{"stage": ...}} (got "stage3")'),
    ("ds bf16 true", DS, write("ds.json", '{"bf16": true}'),
     'bf16 must be an object of its keys, e.g. {{"enabled": ...}} (got true)'),
    ("ds key twice", DS, write("ds.json", '{"zero_optimization": {"stage": 2, "stage": 3}}'),
     '--deepspeed-config {w}/ds.json: key "stage" is given twice in one object (JSON would '
     "keep the last): keep one"),
    ("ds section twice", DS, write("ds.json", '{"bf16": {"enabled": true}, "bf16": {}}'),
     'key "bf16" is given twice in one object'),
    ("data .BIN ids", ["--data", "{w}/ids.BIN"],  # read as uint16 ids, as .bin is: 4999
     lambda w: np.arange(5000, dtype=np.uint16).tofile(w / "ids.BIN"),
     "ids.BIN has token id 4999 but model.vocab_size is 256"),
    ("data empty .bin", ["--data", "{w}/ids.bin"], write("ids.bin", b""),
     "data file {w}/ids.bin holds 0 bytes, not a whole number of uint16 token ids"),
    ("data odd .bin", ["--data", "{w}/ids.bin"], write("ids.bin", b"\x01\x00\x02"),
     "data file {w}/ids.bin holds 3 bytes, not a whole number of uint16 token ids (2 bytes "
     "each)"),
    ("ds not utf-8", DS, write("ds.json", b'{"bf16": {"enabled": true}, "x": "\xff"}'),
     "--deepspeed-config {w}/ds.json is not UTF-8 text (byte 0xff at offset 34): save it as "
     "UTF-8 JSON"),
]


class _Hung(Exception):
    pass


@pytest.mark.parametrize("name, args, fault, phrase", INPUTS, ids=[r[0] for r in INPUTS])
def test_bad_input_is_refused_before_anything_runs(name, args, fault, phrase, tmp_path, capsys,
                                                   monkeypatch):
    """Each input that once ended in a traceback, a hang (a FIFO's open, bands of a byte) or a
    run on the wrong thing: one ``error:`` line naming it (and its file), exit code 2, within
    20 s, before anything is compiled, and nothing written: no checkpoint directory."""
    w = tmp_path / "work"
    w.mkdir()
    if fault:
        fault(w)
    before = listing(tmp_path)
    compiles = []
    monkeypatch.setattr(jax.stages.Lowered, "compile", lambda *a, **k: compiles.append(a))

    def hung(signum, frame):
        raise _Hung

    argv = [*MODEL, "--steps", "1", *[a.format(w=w) for a in args], "--checkpoint-dir",
            str(w / "ckpt")]
    previous, tick = signal.signal(signal.SIGALRM, hung), time.monotonic()
    signal.alarm(60)
    try:
        code = train.main(argv)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    took = time.monotonic() - tick
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") \
        and phrase.format(w=w) in err[0], err
    assert took < 20 and not compiles, (took, compiles)
    assert listing(tmp_path) == before and not (w / "ckpt").exists()


def test_export_of_a_missing_array_is_one_line_to_the_end(reference, tmp_path):
    """As a user runs it: the reads orbax leaves pending when one fails print nothing when
    the garbage collector closes them (made to run at once here; otherwise whenever it runs,
    at exit at the latest)."""
    c = tmp_path / "ckpt"
    shutil.copytree(reference[0], c)
    missing_array(c, tmp_path)
    before = listing(tmp_path)
    code = ("import gc, sys\nfrom zero_jax import export\ncode = export.main(sys.argv[1:])\n"
            "gc.collect()\nsys.exit(code)\n")
    run = subprocess.run([sys.executable, "-c", code, str(c), str(tmp_path / "out")],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == "", run
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"error: checkpoint step 40 in {c} cannot be read: params: "), run.stderr[-3000:]
    assert "TensorStore" not in lines[0]
    assert listing(tmp_path) == before


@pytest.mark.parametrize("text, value", [
    ("3e-4", 3e-4), ("1e30", 1e30), ("1.0e30", 1e30), ("1.0e+30", 1e30), ("1E-3", 1e-3),
    (".5e-2", 0.005), ("5.", 5.0), ("1_000.5", 1000.5), ("7", 7.0), ("'2e-3'", 2e-3)])
def test_every_float_spelling_python_reads(text, value, tmp_path):
    """YAML 1.1 reads 3e-4, 1e30 and 1.0e30 as strings; a float key takes them, in --set and in
    a config file, as Python's float() would."""
    from zero_jax.gpt import config

    assert config.load("tiny", [f"optimizer.lr={text}"])["optimizer"]["lr"] == value
    (tmp_path / "c.yaml").write_text(f"optimizer:\n  lr: {text}\n  eps: {text}\n")
    o = config.load(str(tmp_path / "c.yaml"))["optimizer"]
    assert o["lr"] == o["eps"] == value


def test_metrics_records_are_strict_json():
    """JSON has no NaN: a non-finite value is written as null, and named."""
    record = loop.finite_record({"step": 3, "loss": float("nan"), "grad_norm": float("inf"),
                                  "skipped": 1, "lr": 0.5})
    line = json.dumps(record, allow_nan=False)
    assert json.loads(line) == {"step": 3, "loss": None, "grad_norm": None, "skipped": 1,
                                "lr": 0.5, "nonfinite": ["loss", "grad_norm"]}
    assert loop.finite_record({"step": 1, "loss": 2.0}) == {"step": 1, "loss": 2.0}


@pytest.fixture(scope="module")
def resumed(reference, tmp_path_factory):
    """A copy of the reference resumed to step 42: its metrics file's last line cut short (a
    run SIGKILLed while writing it), and --profile-steps 2:4, behind the step it resumes from.
    One run for the two tests below: the profiler traces nothing here, and the metrics file is
    not the profile's (returns the run, the metrics file and the profile directory)."""
    ckpt, _ = reference
    d = tmp_path_factory.mktemp("resumed")
    c, m, p = d / "ckpt", d / "m.jsonl", d / "prof"
    shutil.copytree(ckpt, c)
    m.write_text((ckpt.parent / "ref.jsonl").read_text() + '{"step": 41, "loss": 2.2')
    run = run_train("--steps", REF_STEPS + 2, "--checkpoint-dir", c, "--resume", "--metrics", m,
                    "--profile", p, "--profile-steps", "2:4")
    return run, m, p


def test_a_metrics_line_cut_short_does_not_block_resume(reference, resumed):
    """SIGKILL while a record is written leaves half a line: --resume drops it with a warning,
    and the file goes on as the uninterrupted run's."""
    _, ref = reference
    run, m, _ = resumed
    assert run.returncode == 0, run.stderr
    assert (f"warning: --metrics {m}: its last line (line 41) was cut short, by a run killed "
            "while writing it: dropped") in run.stderr
    got = [json.loads(x) for x in m.read_text().splitlines()]
    assert [r["step"] for r in got] == list(range(1, REF_STEPS + 3))
    assert {r["step"]: r["loss"] for r in got[:REF_STEPS]} == ref


def test_an_update_gone_non_finite_stops_at_once(tmp_path):
    """The same without skipping, the guard on: step 2's NaN went into the state, so the run
    stops there (exit 3) without waiting for max_bad_steps, and without trying to save it."""
    c = tmp_path / "ckpt"
    run = run_train("--set", "precision.skip_nonfinite=false", "--set", "optimizer.lr=1.0e+38",
                    "--set", "optimizer.warmup_steps=0", "--steps", 4, "--save-every", 1,
                    "--checkpoint-dir", c)
    assert run.returncode == 3, run.stderr
    errors = [x for x in run.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        "error: training diverged: step 2 had a non-finite loss or gradient (1 in a row; its "
        "update went in); the last step with a finite loss was 1; nothing saved since, the "
        f"newest checkpoint, from before it, is 1 in {c}"), run.stderr
    assert Checkpoints(c, read_only=True).steps() == [1]


def test_a_model_that_cannot_fit_is_refused_before_allocating(tmp_path, capsys):
    """d_model 65536: the compiled step needs about 200 GiB per device. Refused with the
    numbers, from the compiled step, before anything is allocated or written."""
    code = train.main(["--set", "model.d_model=65536", "--steps", "2",
                       "--checkpoint-dir", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "GiB on each of 8 CPU devices" in err[0] and "GiB of host memory, but" in err[0]
    assert "--dry-run to see the report" in err[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("damage", ["flipped", "no opt_state", "no params/_METADATA"])
def test_corrupted_newest_falls_back_and_resumes_exactly(damage, reference, tmp_path):
    """Flip bytes in checkpoint 40, or delete one of its items or an item's index; --resume
    reports it, falls back to 32, moves 40 aside, and trains 33-40 exactly as the uninterrupted
    run did. No checkpoint ever holds a non-finite value."""
    ckpt, ref = reference
    c = tmp_path / "ckpt"
    shutil.copytree(ckpt, c)
    if damage == "flipped":
        flip(c / "40" / "params")
    elif damage == "no opt_state":
        shutil.rmtree(c / "40" / "opt_state")
    else:
        (c / "40" / "params" / "_METADATA").unlink()
    run = run_train("--steps", REF_STEPS, "--save-every", 8, "--checkpoint-dir", c,
                    "--resume", "--metrics", tmp_path / "m.jsonl")
    assert run.returncode == 0, run.stderr
    # A flip in array data fails the digest; one in orbax's index fails the read. Either way
    # the step and the item are named; a deletion names what is missing.
    said = {"flipped": [f"checkpoint step 40 in {c} is corrupted: params/",
                        f"checkpoint step 40 in {c} cannot be read: params"],
            "no opt_state": [f"checkpoint step 40 in {c} cannot be read: 40/opt_state/ is "
                             "missing"],
            "no params/_METADATA": [f"checkpoint step 40 in {c} cannot be read: "
                                    "40/params/_METADATA is missing"]}[damage]
    assert any(line in run.stderr for line in said), run.stderr
    assert "falling back to checkpoint 32" in run.stderr, run.stderr
    assert "resumed from step 32" in run.stdout
    assert f"corrupted checkpoint 40 moved aside to {c}/40.corrupt" in run.stderr
    got = losses(tmp_path / "m.jsonl")
    assert got == {s: ref[s] for s in range(33, 41)}  # exact
    ckpts = Checkpoints(c, read_only=True)
    assert ckpts.steps() == [24, 32, 40] and (c / "40.corrupt").is_dir()
    for step in ckpts.steps():  # every one verifies, and holds finite values only
        params = ckpts.read_params(step)
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))


def test_a_diverging_run_stops_and_saves_nothing_after(tmp_path):
    """lr 1e30: step 2's update (lr 5e28 after warmup's first step) sends the loss to NaN from
    step 3 on, and every step is skipped. The divergence guard stops the run after
    train.max_bad_steps (5) such steps with exit code 3 and one line; the periodic saves of steps
    4 and 6 are not made, so checkpoint 2 is the newest. The metrics are strict JSON."""
    c, m = tmp_path / "ckpt", tmp_path / "m.jsonl"
    run = run_train("--set", "optimizer.lr=1e30", "--steps", 20, "--save-every", 2,
                    "--checkpoint-dir", c, "--metrics", m)
    assert run.returncode == 3, run.stderr
    errors = [x for x in run.stderr.splitlines() if x.startswith("error:")]
    assert errors == [
        "error: training diverged: steps 3-7 had a non-finite loss or gradient (5 in a row; "
        "train.max_bad_steps is 5); the last step with a finite loss was 2; nothing saved since, "
        f"the newest checkpoint, from before it, is 2 in {c}: resume from it with a lower "
        "optimizer.lr, or a larger optimizer.warmup_steps"], run.stderr
    assert "done:" not in run.stdout
    assert Checkpoints(c, read_only=True).steps() == [2]

    def no_nan(word):
        raise AssertionError(f"{word} is not JSON")

    records = [json.loads(x, parse_constant=no_nan) for x in m.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 8))
    assert all(r["loss"] is None and "loss" in r["nonfinite"] and r["skipped"] == 1
               for r in records[2:])
    assert "nonfinite" not in records[1] and records[1]["loss"] > 0


def test_with_the_guard_off_a_run_that_ends_diverged_is_not_done(tmp_path, capsys):
    """train.max_bad_steps 0: the same divergence (NaN from step 3, every step skipped) neither
    stops the run nor holds back its saves (4 and 8: skipped steps leave the state finite), but
    a run that ends in it is not reported done: exit code 3 and the guard's one line."""
    c = tmp_path / "ckpt"
    code = train.main([*MODEL, "--set", "optimizer.lr=1e30", "--set", "train.max_bad_steps=0",
                       "--steps", "8", "--save-every", "4", "--checkpoint-dir", str(c)])
    out, err = capsys.readouterr()
    assert code == 3, err
    assert [x for x in err.splitlines() if x.startswith("error:")] == [
        "error: training diverged: steps 3-8 had a non-finite loss or gradient (6 in a row; the "
        "run ended in it); the last step with a finite loss was 2; train.max_bad_steps 0 kept it "
        f"going, the newest checkpoint, saved as it went, is 8 in {c}: train again from before "
        "step 3 with a lower optimizer.lr, or a larger optimizer.warmup_steps"], err
    assert "done:" not in out
    assert Checkpoints(c, read_only=True).steps() == [4, 8]


@pytest.mark.parametrize("m, bad", [
    ({"loss": 2.0, "grad_norm": 1.0, "skipped": 0}, False),
    ({"loss": float("nan"), "grad_norm": 1.0, "skipped": 0}, True),
    ({"loss": 2.0, "grad_norm": float("inf"), "skipped": 1}, True),  # bf16/fp32: skipped
    ({"loss": 2.0, "grad_norm": float("inf"), "skipped": 1, "loss_scale": 2.0**16}, False),
    ({"loss": 2.0, "grad_norm": float("inf"), "skipped": 1, "loss_scale": 1.0}, True),
    ({"loss": float("inf"), "grad_norm": float("inf"), "skipped": 1, "loss_scale": 8.0}, True),
], ids=["finite", "nan loss", "skipped", "fp16 scaler backs off", "fp16 at min scale",
        "fp16 inf loss"])
def test_bad_steps(m, bad):
    """fp16's scaler skipping steps while it can still lower the scale is not divergence."""
    assert loop.bad_step(m, min_loss_scale=1.0) == bad


@pytest.mark.parametrize("max_bad", [0, 3])
def test_the_guard_counts_a_streak_and_forgets_it_when_a_step_trains(max_bad):
    """A streak ends with the first step that trains: a run that recovers is done, guard on or
    off. Off, the streak is still counted (the end's verdict) but never stops the run or holds
    back a save (``bad_from``); on, its third bad step in a row stops it."""
    nan, good = {"loss": float("nan"), "grad_norm": 1.0, "skipped": 1}, \
        {"loss": 2.0, "grad_norm": 1.0, "skipped": 0}
    guard = loop.DivergenceGuard(max_bad, min_loss_scale=1.0)
    steps = [nan, nan, good, nan, nan, nan]
    stops = [guard.update(m, i + 1) for i, m in enumerate(steps[:3])]
    assert stops == [False] * 3 and guard.streak_from is None and guard.bad_from is None
    stops = [guard.update(m, i + 4) for i, m in enumerate(steps[3:])]
    assert guard.streak_from == 4 and guard.bad_from == (4 if max_bad else None)
    assert stops == [False, False, bool(max_bad)]


def test_a_run_gone_non_finite_stops_without_saving(tmp_path):
    """lr 1e38 without skipping non-finite steps, the divergence guard off: the parameters
    become NaN at step 2; the run stops with exit code 1 and keeps checkpoint 1, the last
    finite state."""
    c = tmp_path / "ckpt"
    run = run_train("--set", "precision.skip_nonfinite=false", "--set", "optimizer.lr=1.0e+38",
                    "--set", "optimizer.warmup_steps=0", "--set", "train.max_bad_steps=0",
                    "--steps", 3, "--save-every", 1, "--checkpoint-dir", c)
    assert run.returncode == 1, run.stderr
    assert "error: the state at step 2 has non-finite values in params/" in run.stderr
    assert "not saved, older checkpoints are kept" in run.stderr
    ckpts = Checkpoints(c, read_only=True)
    assert ckpts.steps() == [1]
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(ckpts.read_params(1)))


def test_non_finite_state_is_never_saved(tmp_path, mesh):
    """Saving a state with a NaN in its optimizer state is refused; nothing is written."""
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    w = jax.device_put(jnp.arange(16.0), sharded)
    state = TrainState(jnp.int32(1), {"w": w}, None, {"mu": w.at[3].set(jnp.nan)}, None,
                       jnp.int32(0))
    ckpts = Checkpoints(tmp_path / "ckpt")
    with pytest.raises(NonFiniteStateError, match="non-finite values in opt_state/mu: not saved"):
        ckpts.save(state, {})
    assert not [p for p in (tmp_path / "ckpt").iterdir() if p.name[0].isdigit()]
    ckpts.save(state._replace(opt_state={"mu": w}), {})
    ckpts.finish()
    ckpts.close()
    assert Checkpoints(tmp_path / "ckpt", read_only=True).steps() == [1]


def test_digest_is_the_same_in_any_layout_and_sees_one_bit(mesh):
    x = np.random.default_rng(0).standard_normal((16, 24)).astype(np.float32)
    P = jax.sharding.PartitionSpec
    layouts = [P("data"), P(None, "data"), P()]
    got = {integrity.digest(jax.device_put(x, jax.sharding.NamedSharding(mesh, s)))
           for s in layouts}
    got.add(integrity.digest(jnp.asarray(x)))
    assert len(got) == 1 and next(iter(got))[1]  # one digest, and finite
    y = x.copy()
    y.view(np.uint32)[5, 7] ^= 1  # one bit
    assert integrity.digest(jnp.asarray(y))[0] != next(iter(got))[0]
    z = x.copy()
    z[[0, 1]] = z[[1, 0]]  # the same values elsewhere
    assert integrity.digest(jnp.asarray(z))[0] != next(iter(got))[0]


# train.py keeps SIGHUP ignored when it starts so (nohup): the runs signalled here start with
# SIGHUP's default, as from a terminal, whatever the suite itself was started under (under
# nohup a hang-up was ignored, and its tests waited out their 60 s timeouts and failed).
HUP_DEFAULT = ("import os, signal, sys; signal.signal(signal.SIGHUP, signal.SIG_DFL); "
               "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


def start(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", HUP_DEFAULT, "train.py", *MODEL,
                             *map(str, args)], cwd=ROOT,
                            env={**ENV, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for_lines(path: pathlib.Path, n: int, proc: subprocess.Popen) -> None:
    deadline = time.time() + 120
    while lines(path) < n:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)


def lines(path: pathlib.Path) -> int:
    """The lines of a file train.py writes; none while it is missing, as it is again after
    train.py's start-up check of the path (created, then removed, before the run writes it)."""
    try:
        return len(path.read_text().splitlines())
    except FileNotFoundError:
        return 0


def stop_and_resume(proc, tmp_path, reference, sig: int, code: int, keep: int = 1) -> None:
    """Signal the run ``proc``: it finishes the step, saves, exits ``code`` within 30 s
    without a traceback; resuming continues exactly as the uninterrupted run."""
    c, m = tmp_path / "ckpt", tmp_path / "m.jsonl"
    proc.send_signal(sig)
    sent = time.time()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code and time.time() - sent < 30, err
    last = err.strip().splitlines()[-1]
    n = max(losses(m))
    assert last.endswith(f"stopped by {signal.Signals(sig).name} after step {n}: checkpoint "
                         f"{n} saved in {c}; continue with --resume"), err
    assert "Traceback" not in err
    assert Checkpoints(c, read_only=True).steps() == list(range(n - keep + 1, n + 1))
    if n + 2 > REF_STEPS:
        pytest.fail(f"the run went on to step {n} before stopping")
    run = run_train("--steps", n + 2, "--checkpoint-dir", c, "--resume", "--metrics", m)
    assert run.returncode == 0, run.stderr
    ref = reference[1]
    assert losses(m) == {s: ref[s] for s in range(1, n + 3)}  # bit for bit, the whole run


def test_an_fp32_run_goes_on_in_bf16(tmp_path, reference, resumed):
    """The reference's fp32 checkpoint as the start of a bf16 run (train.ckpt_load_path): its
    parameters become the fp32 master copy, and steps 41-42 are the fp32 run's (``resumed``)
    but for bf16's compute, not an untrained model's (5.3); the bf16 run's own checkpoint
    holds the master."""
    c, m = tmp_path / "bf16", tmp_path / "m.jsonl"
    run = run_train("--steps", REF_STEPS + 2, "--checkpoint-dir", c, "--metrics", m,
                    "--set", f"train.ckpt_load_path={reference[0]}",
                    "--set", "precision.param_dtype=bf16")
    assert run.returncode == 0, run.stderr
    assert f"resumed from step {REF_STEPS}" in run.stdout
    got, fp32 = losses(m), losses(resumed[1])
    assert sorted(got) == [REF_STEPS + 1, REF_STEPS + 2]
    for s in got:  # bf16's compute moves the loss a little
        assert abs(got[s] - fp32[s]) < 0.02, (got, fp32)
    assert (c / str(REF_STEPS + 2) / "master").is_dir()


def test_resume_is_bit_identical(tmp_path, reference):
    """18 steps, stop, resume to 24 == the reference's uninterrupted steps, loss for loss
    (inside the warmup, which ends at step 20, and after it: the schedule's step is restored
    too). The second run starts from the first's directory through train.ckpt_load_path (the
    seed's key) and saves into its own; --resume from a directory: the signals below."""
    ckpt, split = tmp_path / "ckpt", tmp_path / "split.jsonl"
    first = run_train("--steps", 18, "--save-every", 9, "--checkpoint-dir", ckpt, "--resume",
                      "--metrics", split)
    assert first.returncode == 0, first.stderr
    assert "starting fresh" in first.stdout
    assert "checkpoint 18:" in first.stdout and "MiB on disk" in first.stdout
    second = run_train("--steps", 24, "--checkpoint-dir", tmp_path / "next",
                       "--set", f"train.ckpt_load_path={ckpt}", "--metrics", split)
    assert second.returncode == 0, second.stderr
    assert "resumed from step 18" in second.stdout
    ref = reference[1]
    assert losses(split) == {s: ref[s] for s in range(1, 25)}  # exact float equality
    assert [json.loads(x)["step"] for x in open(split)] == list(range(1, 25))
    assert Checkpoints(ckpt, read_only=True).steps() == [9, 18]  # read, not written
    assert Checkpoints(tmp_path / "next", read_only=True).steps() == [24]


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGHUP, 129)],
                         ids=["ctrl-c", "hangup"])
def test_a_stop_signal_saves_and_resumes_exactly(sig, code, tmp_path, reference):
    """Ctrl-C, or SIGHUP (the terminal or ssh session closed), as SIGTERM below: the step is
    finished and saved, and the resumed run goes on as the uninterrupted one."""
    c, m = tmp_path / "ckpt", tmp_path / "m.jsonl"
    proc = start("--steps", 1000, "--checkpoint-dir", c, "--metrics", m)
    wait_for_lines(m, 2, proc)
    stop_and_resume(proc, tmp_path, reference, sig, code)


def test_a_resumed_run_says_its_profile_window_is_behind_it(resumed):
    """--profile-steps before the step a run resumes from traces nothing: a warning says so,
    and the run trains on (exit 0)."""
    run, _, p = resumed
    assert run.returncode == 0, run.stderr
    assert ("warning: --profile-steps 2:4 starts at step 2, but this run resumes after step 40: "
            "nothing is traced; pass --profile-steps A:B with A above 40") in run.stderr, \
        run.stderr
    assert not list(p.rglob("*.xplane.pb"))


def test_an_export_reads_a_step_without_orbax_step_metadata_quietly(reference, tmp_path,
                                                                      caplog):
    """A step without ``_CHECKPOINT_METADATA`` (a save killed as it finished) reads whole,
    checked by its digests: orbax's warning that the file is missing is not passed on."""
    c = tmp_path / "ckpt"
    shutil.copytree(reference[0], c)
    (c / "40" / "_CHECKPOINT_METADATA").unlink()
    assert export.main([str(c), str(tmp_path / "out")]) == 0
    assert not [r for r in caplog.records if "Metadata file does not exist" in r.getMessage()]


def test_the_nvme_tier_beside_offloaded_parameters_starts_without_a_warning(tmp_path, capsys):
    """With the NVMe tier and zero.offload_params every output of the parameters' shapes in
    the state's init is in host memory, so the donated parameters are taken by none: JAX's
    warning about it is not passed on (they are freed as the init returns)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        code = train.main([*MODEL, "--steps", "1", *[a.format(w=tmp_path) for a in NV],
                           "--set", "zero.offload_params=cpu"])
    assert code == 0, capsys.readouterr().err
    assert not [w for w in seen if "donated buffers" in str(w.message)], seen


def test_second_ctrl_c_aborts_at_once_keeping_the_last_checkpoint(tmp_path):
    """Ctrl-C, and again while the save it started (30 MB) is being written: exit 130 at
    once, and the half-written save is never a step. (No periodic saves here: a second
    signal that arrives before the first is handled merges with it.)"""
    c, m = tmp_path / "ckpt", tmp_path / "m.jsonl"
    proc = start("--set", "model.d_model=384", "--set", "model.d_ff=1536", "--steps", 1000,
                 "--checkpoint-dir", c, "--metrics", m)

    def wait_until(done):
        deadline = time.time() + 60
        while not done():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.01)

    saving = lambda: any("orbax-checkpoint-tmp" in p.name for p in c.iterdir())  # noqa: E731
    wait_for_lines(m, 2, proc)
    proc.send_signal(signal.SIGINT)
    wait_until(saving)  # the save the first Ctrl-C asked for is in flight
    proc.send_signal(signal.SIGINT)
    sent = time.time()
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and time.time() - sent < 5, err
    assert err.strip().splitlines()[-1].startswith("error: interrupted again: stopped at once")
    assert "Traceback" not in err
    assert Checkpoints(c, read_only=True).steps() == []  # the interrupted save is no step


def test_readers_delete_nothing(reference, tmp_path, capsys):
    """A save in flight (orbax's temporary directory) survives an export and a read; a
    numbered directory that is not ours is skipped with a warning."""
    c = tmp_path / "ckpt"
    shutil.copytree(reference[0], c)
    (c / "48.orbax-checkpoint-tmp-1234").mkdir()
    (c / "48.orbax-checkpoint-tmp-1234" / "partial").write_text("x")
    (c / "50").mkdir()
    before = listing(c)
    assert export.main([str(c), str(tmp_path / "out")]) == 0
    out = capsys.readouterr()
    assert f"warning: {c}/50 holds no zero_jax checkpoint: skipped" in out.err
    assert "exported step 40 parameters" in out.out
    assert Checkpoints(c, read_only=True).latest_step() == 40
    assert listing(c) == before


def test_overwrite_deletes_the_old_run(reference, tmp_path):
    """--overwrite, asked for explicitly, starts afresh: the old checkpoints go, and the new
    run's own are the ones on disk."""
    c = tmp_path / "ckpt"
    shutil.copytree(reference[0], c)
    run = run_train("--steps", 2, "--checkpoint-dir", c, "--overwrite")
    assert run.returncode == 0, run.stderr
    assert "--overwrite: deleted checkpoints 24, 32, 40" in run.stdout
    ckpts = Checkpoints(c, read_only=True)
    assert ckpts.steps() == [2] and ckpts.meta(2)["step"] == 2


def test_a_closed_terminal_stops_with_a_save(tmp_path, reference):
    """A run in a terminal that closes (its pty's other end closed: the kernel hangs the
    terminal up and sends SIGHUP): every write to it would fail, yet the step is finished and
    saved (exit 129), and the resumed run goes on as the uninterrupted one."""
    import pty
    import select
    import threading

    c, m = tmp_path / "ckpt", tmp_path / "m.jsonl"
    master, terminal = pty.openpty()
    # A session of its own, the pty its controlling terminal, then train.py in that process
    controlling = "import fcntl, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); " + HUP_DEFAULT
    proc = subprocess.Popen(
        [sys.executable, "-c", controlling, "train.py", *MODEL, "--steps", "1000",
         "--checkpoint-dir", str(c), "--metrics", str(m)], cwd=ROOT,
        env={**ENV, "PYTHONUNBUFFERED": "1"}, stdin=terminal, stdout=terminal, stderr=terminal,
        start_new_session=True)
    os.close(terminal)

    closing = threading.Event()

    def drain():  # what it prints, read as a terminal would show it
        while not closing.is_set():
            if select.select([master], [], [], 0.1)[0]:
                with contextlib.suppress(OSError):
                    os.read(master, 1 << 16)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    wait_for_lines(m, 2, proc)
    closing.set()
    reader.join()
    os.close(master)  # the terminal closes: no read of it is in flight to keep it open
    assert proc.wait(timeout=60) == 129
    n = max(losses(m))
    assert Checkpoints(c, read_only=True).steps() == [n]
    run = run_train("--steps", n + 2, "--checkpoint-dir", c, "--resume", "--metrics", m)
    assert run.returncode == 0, run.stderr
    assert losses(m) == {s: reference[1][s] for s in range(1, n + 3)}


def test_sigterm_during_a_second_writer_and_exports(tmp_path, reference, capsys):
    """A run saving every step: a second writer is refused and told who writes; exports
    meanwhile succeed and delete nothing (a save in flight survives them). SIGTERM then ends
    the run after a final step with all its checkpoints intact, and resuming continues
    exactly as the uninterrupted run."""
    c, m = tmp_path / "ckpt", tmp_path / "m.jsonl"
    proc = start("--steps", 1000, "--save-every", 1, "--checkpoint-dir", c, "--metrics", m)
    wait_for_lines(m, 2, proc)
    assert train.main([*MODEL, "--steps", "1", "--checkpoint-dir", str(c), "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"is being written by process {proc.pid} on " in err and "train.py" in err, err
    deadline = time.time() + 60
    while not any(p.name.isdigit() for p in c.iterdir()):  # a first checkpoint is complete
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.01)
    for i in range(2):  # each export starts next to a save in flight (orbax's temporary dir)
        deadline = time.time() + 60
        while not any("orbax-checkpoint-tmp" in p.name for p in c.iterdir()):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.002)
        assert export.main([str(c), str(tmp_path / f"out{i}")]) == 0, capsys.readouterr().err
    stop_and_resume(proc, tmp_path, reference, signal.SIGTERM, 143, keep=3)


def test_a_signal_during_the_save_poll_still_saves_its_step(tmp_path, monkeypatch, capsys):
    """SIGTERM landing inside the checkpoint manager's poll, after the step's save check: the
    run stops before another step and still saves the newest (exit 143), not "nothing new":
    step 3, which the loop queued before reading step 2 (``run_steps``)."""
    c, calls, poll = tmp_path / "ckpt", [], Checkpoints.poll

    def poll_then_signal(self):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return poll(self)

    monkeypatch.setattr(Checkpoints, "poll", poll_then_signal)
    code = train.main([*MODEL, "--steps", "6", "--checkpoint-dir", str(c)])
    err = capsys.readouterr().err
    assert code == 143, err
    assert f"stopped by SIGTERM after step 3: checkpoint 3 saved in {c}" in err, err
    assert Checkpoints(c, read_only=True).steps() == [3]


@pytest.mark.parametrize("flag", ["--metrics", "--report"])
def test_an_output_that_fails_mid_run_stops_in_one_line(flag, tmp_path, capsys):
    """A write to --metrics or --report that fails (a full disk: /dev/full) is one line and
    exit 1, not a traceback; a failed --metrics line saves the newest step trained: the one
    after it, which the loop queued before reading the step before (``run_steps``)."""
    c = tmp_path / "ckpt"
    code = train.main([*MODEL, "--steps", "3", "--checkpoint-dir", str(c), flag, "/dev/full"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 1 and "Traceback" not in err, err
    if flag == "--metrics":
        assert errors == [f"error: --metrics /dev/full: No space left on device; stopped after "
                          f"step 2; checkpoint 2 saved in {c}"], err
        assert Checkpoints(c, read_only=True).steps() == [2]
    else:
        assert errors == ["error: --report /dev/full: No space left on device; stopped before "
                          "training (at step 0)"], err


def test_a_failed_save_says_the_free_space(tmp_path):
    """A save that fails (a full disk, usually) says how much room the directory has left."""
    ckpts = Checkpoints(tmp_path / "c")
    try:
        e = ckpts._failed(5, OSError(28, "No space left on device"))
    finally:
        ckpts.close()
    free = shutil.disk_usage(tmp_path).free / 2**30
    assert str(e).startswith(f"saving checkpoint 5 in {tmp_path / 'c'} (") and \
        "GiB free there) failed: [Errno 28] No space left on device; older checkpoints are kept" \
        in str(e), str(e)
    assert abs(float(str(e).split(" (")[1].split(" GiB")[0]) - free) < 1, str(e)


def test_sigterm_during_compilation_is_answered_at_once(tmp_path):
    """Python runs no signal handler while XLA compiles: the run still says at once that it
    heard SIGTERM, then stops as the compile returns, before any state exists (exit 143,
    nothing saved)."""
    c = tmp_path / "ckpt"
    env = {k: v for k, v in TRAIN_ENV.items() if not k.startswith("JAX_PERSISTENT_CACHE")
           and k != "JAX_COMPILATION_CACHE_DIR"}  # a real compile (level 1), not a cache hit
    proc = subprocess.Popen([sys.executable, "train.py", *MODEL, "--steps", "3",
                             "--checkpoint-dir", str(c)], cwd=ROOT,
                            env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    while "compiling the train step" not in (line := proc.stdout.readline()):
        assert line, proc.communicate()
    proc.send_signal(signal.SIGTERM)
    sent = time.time()
    heard = proc.stderr.readline() + proc.stderr.readline()  # a blank line, then the answer
    answered = time.time() - sent
    out, err = proc.communicate(timeout=120)
    assert "SIGTERM during compilation: stopping once it returns; nothing to save yet" in heard
    assert answered < 2, answered
    assert proc.returncode == 143, err
    assert err.strip().endswith("stopped by SIGTERM during compilation: nothing trained, "
                                "nothing saved"), err
    assert "Traceback" not in err and "done" not in out
    assert not c.exists() or Checkpoints(c, read_only=True).steps() == []
