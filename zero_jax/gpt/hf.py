"""The demo's models in Hugging Face's layout: config.json and GPT-2's tensor names here; the
Llamas' in ``llama.py`` (their config.json ``llama_config.py``), GPT-NeoX's and Phi's in
``neox.py``: this module picks by the model section's ``arch``.

GPT-2's safetensors hold ``Conv1D`` weights as ``(in, out)``, which is a Flax kernel already:
its fused ``c_attn`` is this model's ``(d, 3, heads, head_dim)`` qkv kernel with its output
axis split, and each layer's tensors are stacked into the scanned ``blocks``. The output
head is tied to ``wte`` (not written by ``GPT2LMHeadModel``; ignored if present).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import sys

from zero_jax.gpt import llama_config, neox
from zero_jax.gpt.data import Tokenizer
from zero_jax.gpt.model import GPTConfig
from zero_jax.safetensors_writer import COMPANION_FILES
from zero_jax.tensorfiles import WeightsError
from zero_jax.weights import Mapping, Tensor

CONFIG = "config.json"
# config.json's keys -> the model section of this demo's config
GPT2_KEYS = {"vocab_size": "vocab_size", "n_embd": "d_model", "n_layer": "n_layers",
             "n_head": "n_heads", "n_inner": "d_ff", "n_positions": "seq_len"}
GPT2_FIXED = {"activation_function": "gelu_new",
              "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
              "tie_word_embeddings": True}  # what this model computes; anything else refused


def gpt2_mapping(model: dict, prefix: str = "transformer.") -> Mapping:
    """GPT-2's tensors (``GPT2LMHeadModel``'s names; ``GPT2Model``'s with ``prefix=""``)."""
    h = "h.{layer}."
    qkv = (1, (3, model["n_heads"], -1))
    rows = [Tensor("wte.weight", "wte", pad=(0, model["vocab_size"])), Tensor("wpe.weight", "wpe"),
            Tensor("ln_f.weight", "ln_f/scale"), Tensor("ln_f.bias", "ln_f/bias"),
            Tensor(h + "attn.c_attn.weight", "blocks/qkv/kernel", split=qkv),
            Tensor(h + "attn.c_attn.bias", "blocks/qkv/bias", split=(0, qkv[1]))]
    for theirs, ours in [("ln_1", "ln1"), ("ln_2", "ln2")]:
        rows += [Tensor(f"{h}{theirs}.weight", f"blocks/{ours}/scale"),
                 Tensor(f"{h}{theirs}.bias", f"blocks/{ours}/bias")]
    for theirs, ours in [("attn.c_proj", "proj"), ("mlp.c_fc", "fc1"), ("mlp.c_proj", "fc2")]:
        rows += [Tensor(f"{h}{theirs}.weight", f"blocks/{ours}/kernel"),
                 Tensor(f"{h}{theirs}.bias", f"blocks/{ours}/bias")]
    # buffers of older transformers (the causal mask), and a head tied to wte
    ignore = (r"\.attn\.(masked_)?bias$", r"^lm_head\.weight$")
    return Mapping(tuple(rows), ignore=ignore, prefix=prefix)


def read_config(directory: str | os.PathLike) -> dict:
    """The model section of this demo's config from a Hugging Face directory's config.json;
    an architecture this demo does not compute exactly is refused."""
    path = pathlib.Path(directory) / CONFIG
    try:
        hf = json.loads(path.read_text())
        assert isinstance(hf, dict)
    except (OSError, ValueError, AssertionError):
        raise WeightsError(f"{path} is missing or not JSON: pass a Hugging Face model "
                           "directory (config.json and safetensors)") from None
    if hf.get("model_type") in (*llama_config.FAMILIES, "gemma3"):
        return llama_config.read_config(directory)
    if hf.get("model_type") in neox.FAMILIES:
        return neox.read_config(path, hf)
    if hf.get("model_type") != "gpt2":
        raise WeightsError(f"{path} is model_type {hf.get('model_type')!r}; this demo reads "
                           f"gpt2, {', '.join(neox.FAMILIES)}, "
                           f"{', '.join(llama_config.FAMILIES)} and gemma3's text: pass a "
                           "directory of one")
    for key, want in GPT2_FIXED.items():
        if key in hf and hf[key] != want:
            raise WeightsError(f"{path} has {key} {hf[key]!r}; this demo's GPT-2 computes "
                               f"{want!r}: pass a model with {key} {want!r}")
    try:
        model = {ours: hf[theirs] for theirs, ours in GPT2_KEYS.items() if theirs != "n_inner"}
    except KeyError as e:
        raise WeightsError(f"{path} has no {e.args[0]}: pass a GPT-2 config.json") from None
    model["d_ff"] = hf.get("n_inner") or 4 * model["d_model"]
    return {**model, "arch": "gpt2", "norm_eps": hf.get("layer_norm_epsilon", 1e-5)}


def dropout(directory: str | os.PathLike) -> dict[str, float]:
    """The dropout rates above 0 that a directory's config.json sets (``attention_dropout``,
    ``resid_pdrop``, ...; a classification head's aside): training settings, not the model,
    which the demo's models train without, as MaxText's and torchtune's do."""
    hf = json.loads((pathlib.Path(directory) / CONFIG).read_text())
    hf = hf.get("text_config", hf) if hf.get("model_type") == "gemma3" else hf
    return {k: v for k, v in hf.items() if re.search(r"(dropout|pdrop)$", k)
            and k != "classifier_dropout" and isinstance(v, (int, float)) and v > 0}


def config_overrides(directory: str | os.PathLike) -> list[str]:
    """``--set`` style overrides of the model section, from config.json."""
    return [f"model.{k}={v}" for k, v in read_config(directory).items()]


def weights_source(directory: str | os.PathLike):
    """The directory's tensors, and the mapping of their names (with or without the
    ``transformer.`` prefix ``GPT2LMHeadModel`` saves; Phi-3's fused ``qkv_proj`` where the
    files hold it)."""
    from zero_jax.tensorfiles import TensorFiles

    model = read_config(directory)
    files = TensorFiles(directory)
    if any(".self_attn.qkv_proj." in n for n in files.tensors):
        from zero_jax.gpt import llama

        return files, llama.phi3_mapping(GPTConfig(**model))
    if any(n.startswith("language_model.") for n in files.tensors):  # an image-text Gemma 3
        from zero_jax.gpt import llama

        return files, llama.text_mapping(mapping(model))
    prefix = "transformer." if any(n.startswith("transformer.") for n in files.tensors) else ""
    return files, mapping(model, prefix)


def mapping(model: dict, prefix: str = "transformer.") -> Mapping:
    """The mapping of the demo's ``model`` section: GPT-2's, Llama's or GPT-NeoX's."""
    if model.get("arch") == "neox":
        return neox.mapping(GPTConfig(**model))
    if model.get("arch", "gpt2") == "llama":
        from zero_jax.gpt import llama

        c = GPTConfig(**model)  # the family that computes it says how its tensors are kept
        family = llama_config.family_of(c)
        return llama.phi3_mapping(c, qkv=family == "phi3") if family in ("phi3", "glm", "glm4") \
            else llama.mapping(c)
    return gpt2_mapping(model, prefix)


def check_writable(model: dict) -> None:
    """Refuse, before a run or an export writes anything, a model the config.json it would be
    written with does not give back (``llama_config.hf_config``): one no Hugging Face family
    computes."""
    if model.get("arch", "gpt2") == "llama":
        llama_config.hf_config(model)
    if model.get("arch") == "neox":
        neox.hf_config(model)


def load(plan, directory: str | os.PathLike, check_only: bool = False):
    """A GPT-2 directory's weights in ``plan``'s shards (``zero_jax.weights.load_params``);
    with ``check_only``, every name, shape and dtype checked and nothing read."""
    from zero_jax import weights

    files, mapping = weights_source(directory)
    if check_only:
        return weights.check(plan, files, mapping)
    return weights.load_params(plan, files, mapping)


def write_config(directory: pathlib.Path, model: dict, dtype: str) -> None:
    """A GPT-2, Llama or GPT-NeoX config.json for this demo's ``model`` section, as
    transformers reads it."""
    if model.get("arch", "gpt2") == "llama":
        return llama_config.write_config(directory, model, dtype)
    if model.get("arch") == "neox":
        return neox.write_config(directory, model, dtype)
    hf = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
          **{theirs: model[ours] for theirs, ours in GPT2_KEYS.items()}, **GPT2_FIXED,
          "layer_norm_epsilon": model.get("norm_eps", 1e-5),
          "dtype": dtype, "bos_token_id": model["vocab_size"] - 1,
          "eos_token_id": model["vocab_size"] - 1}
    (directory / CONFIG).write_text(json.dumps(hf, indent=2))


def copy_tokenizer(source: str | None, directory: pathlib.Path) -> None:
    """``source``'s tokenizer files, chat template and generation defaults (the --init-from
    directory's) into ``directory``; a source gone since training is said, not fatal: the
    weights are what the export is for."""
    if not source:
        return
    if not pathlib.Path(source).is_dir():
        print(f"warning: {source}, which the model was initialized from, is gone: no "
              "tokenizer files copied beside the weights", file=sys.stderr)
        return
    for name in COMPANION_FILES:
        if (pathlib.Path(source) / name).is_file():
            shutil.copyfile(pathlib.Path(source) / name, directory / name)


def check_tokenizer(meta: dict) -> None:
    """Refuse to export beside a tokenizer.json other than the one the run's text was read by
    (its sha256 in the checkpoint): the weights' ids would be another tokenizer's."""
    trained, source = (meta.get("data") or {}).get("tokenizer"), meta.get("init_from")
    path = pathlib.Path(source or ".") / Tokenizer.FILE
    if trained and source and path.is_file():
        now = Tokenizer.digest(path)
        if now != trained:
            raise WeightsError(f"{path} has changed since step {meta['step']} was trained "
                               f"(sha256 {now[:12]}, the run read text with {trained[:12]}): "
                               "the export would pair the weights with another tokenizer; put "
                               "the run's tokenizer.json back there")


def saver(directory: str, step, model: dict, every: int, last: int, stop, guard,
          init_from: str | None = None):
    """The in-run save (``train.py --save-safetensors``): ``directory`` holds the latest
    trained parameters (the fp32 master where there is one) as a Hugging Face directory, each
    process writing its own shards' bytes (``zero_jax.save_safetensors``); ``step`` (a
    ``TrainStep``) gives the whole state, read back from the NVMe tier's files if need be."""
    from zero_jax.safetensors_writer import SafetensorsSaver, trained_params

    return SafetensorsSaver(directory, every, last, stop, guard,
                            params=lambda state: trained_params(step.whole(state)),
                            mapping=mapping(model),
                            extra=lambda d: (write_config(pathlib.Path(d), model, "float32"),
                                             copy_tokenizer(init_from, pathlib.Path(d))))


def export(checkpoint_dir: str, out: str, step: int | None = None, dtype: str = "fp32",
           max_shard_bytes: int | None = None) -> dict:
    """A demo checkpoint as a Hugging Face directory of its family: config.json (from the
    model config the run stored) and model.safetensors (or shards and their index), streamed;
    the tokenizer files of the directory the run was initialized from beside them."""
    from zero_jax import export as library

    def names(meta: dict) -> Mapping:
        model = (meta.get("config") or {}).get("model")
        if not model:
            raise WeightsError(f"checkpoint step {meta['step']} in {checkpoint_dir} records no "
                               "model config: it was not written by train.py; export it with "
                               "python -m zero_jax.export --format safetensors")
        check_tokenizer(meta)
        check_writable(model)
        return mapping(model)

    def config(directory: pathlib.Path, meta: dict) -> None:
        write_config(directory, meta["config"]["model"], library.DTYPES[dtype])
        copy_tokenizer(meta.get("init_from"), directory)

    return library.export(checkpoint_dir, out, step, dtype, {
        "mapping": names, "max_shard_bytes": max_shard_bytes, "extra": config})


def main(argv: list[str] | None = None) -> int:
    """``python -m zero_jax.gpt.hf CKPT_DIR OUT [--step N] [--dtype bf16] [--max-shard-size
    5GB]``: the export, as a Hugging Face directory."""
    import sys

    from zero_jax import export as library
    from zero_jax.checkpoint import CheckpointError, quiet_background_errors

    p = library._Parser(prog="python -m zero_jax.gpt.hf",
                        description="Export a demo checkpoint as a Hugging Face directory")
    p.add_argument("checkpoint_dir")
    p.add_argument("out")
    p.add_argument("--step", type=int, help="default: the latest complete checkpoint")
    p.add_argument("--dtype", default="fp32", help="fp32 (default), bf16 or fp16")
    p.add_argument("--max-shard-size", type=library._size, metavar="SIZE",
                   help="files of at most SIZE (e.g. 5GB) and their index")
    args = p.parse_args(argv)
    quiet_background_errors()
    try:
        done = export(args.checkpoint_dir, args.out, args.step, args.dtype, args.max_shard_size)
    except (CheckpointError, WeightsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported step {done['step']} as a Hugging Face directory ({done['dtype']}) to "
          f"{args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
