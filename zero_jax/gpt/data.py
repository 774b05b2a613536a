"""Token streams and the batches cut from them.

The default corpus is the Python standard library's own source, read as bytes: it ships with
every Python, needs no download, and a byte-level model visibly learns its syntax in minutes.
A pretrained model reads text as its own tokenizer's ids (``Tokenizer``); ``python -m
zero_jax.gpt.data`` writes them once to a ``.npy`` for corpora too large to encode every run.
Batch ``i`` depends only on the seed and ``i``, so a run can be replayed or resumed exactly.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import sysconfig

import numpy as np

DEFAULT_BYTES = 4 << 20
HELD_OUT = 0.1  # the stream's last tenth, for evaluation (train.eval_every), as nanoGPT splits
TOKEN_FILES = (".bin", ".npy")  # token ids; any other file is text
TEXT_KEY = "text"  # a .jsonl record's document, as Hugging Face datasets name it
# A record of a prompt and the completion to train on, as TRL's prompt-completion datasets.
PROMPT_KEYS = ("prompt", "completion")
EVAL_SEED = 2**32  # held-out windows drawn alike in every run: no train.seed is this large


def stdlib_files(limit: int = DEFAULT_BYTES) -> list[bytes]:
    """The standard library's top-level modules, sorted by name, until ``limit`` bytes."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files, size = [], 0
    for path in sorted(root.glob("*.py")):
        files.append(path.read_bytes())
        size += len(files[-1])
        if size >= limit:
            break
    return files


def stdlib_corpus(limit: int = DEFAULT_BYTES) -> np.ndarray:
    """The first ``limit`` bytes of the standard library's top-level modules, sorted by name."""
    return np.frombuffer(b"".join(stdlib_files(limit))[:limit], np.uint8)


class Tokenizer:
    """A Hugging Face ``tokenizer.json`` (what GPT-2, Llama, Mistral, Qwen and Phi-3
    directories carry), read by the ``tokenizers`` package: a model trained from a pretrained
    directory must read text as the ids it was trained on, not as bytes."""

    FILE = "tokenizer.json"

    def __init__(self, path: pathlib.Path):
        try:
            import tokenizers
        except ImportError:
            raise ValueError(f"reading text with {path} needs the tokenizers package: pip "
                             "install 'zero_jax[hf]', or pass token ids (.bin, .npy)") from None
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises plain Exceptions
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(f"{path} is not a tokenizers file ({first}): copy the model's "
                             "tokenizer.json there again") from None
        self.path = path
        self.sha256 = self.digest(path)

    @staticmethod
    def digest(path: pathlib.Path) -> str:
        """The sha256 a checkpoint records of the tokenizer.json its text was read by."""
        return hashlib.sha256(path.read_bytes()).hexdigest()

    @classmethod
    def of(cls, directory: str | os.PathLike) -> Tokenizer | None:
        """``directory``'s tokenizer, or None where it has no ``tokenizer.json``."""
        path = pathlib.Path(directory) / cls.FILE
        return cls(path) if path.is_file() else None

    def __call__(self, documents: list[str]) -> np.ndarray:
        """The documents' ids, one after another, each encoded as Hugging Face's ``run_clm``
        encodes a text (with the tokenizer's special tokens: Llama's begin-of-text)."""
        ids = self.encode(documents)
        return np.concatenate(ids) if ids else np.zeros(0, np.uint32)

    def encode(self, texts: list[str], special: bool = True) -> list[np.ndarray]:
        """Each text's ids; ``special``: with the tokenizer's special tokens (a completion,
        which follows its prompt, goes without: no begin-of-text in the middle)."""
        return [np.asarray(e.ids, np.uint32)
                for e in self._tokenizer.encode_batch(texts, add_special_tokens=special)]


def is_text(path: str | None) -> bool:
    """Whether ``load_tokens`` reads ``path`` as text (the default corpus included)."""
    return (path is None or pathlib.Path(path).is_dir()
            or pathlib.Path(path).suffix.lower() not in TOKEN_FILES)


def documents(path: pathlib.Path) -> list[tuple[str, bytes, bytes]]:
    """A text file as one document, or a ``.jsonl``'s records (Hugging Face datasets'
    ``to_json``) each as one: its ``"text"``, or its ``"prompt"`` and ``"completion"``. Each is
    ``(name, prompt, text)``, the prompt empty but for prompt-completion records; named for the
    errors they may raise."""
    if path.suffix.lower() != ".jsonl":
        return [(str(path), b"", path.read_bytes())]
    docs = []
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            record = e
        if isinstance(record, dict) and all(isinstance(record.get(k), str) for k in PROMPT_KEYS):
            docs.append((f"{path} line {n}", record["prompt"].encode(),
                         record["completion"].encode()))
            continue
        if not isinstance(record, dict) or not isinstance(record.get(TEXT_KEY), str):
            raise ValueError(f"data file {path} line {n} is not a JSON object with a "
                             f'"{TEXT_KEY}" string, nor "prompt" and "completion" strings: '
                             f'each line of a .jsonl is one document, {{"{TEXT_KEY}": "..."}}, '
                             '{"prompt": "...", "completion": "..."}')
        docs.append((f"{path} line {n}", b"", record[TEXT_KEY].encode()))
    return docs


def text_tokens(files: list[tuple[str, bytes, bytes]], tokenizer: Tokenizer | None
                ) -> np.ndarray:
    """Text as bytes (ids 0-255), or as ``tokenizer``'s ids with each file or record one
    document. Where any document has a prompt, int32 ids with each prompt's stored as
    ``-1 - id`` (``prompted``): the completions alone can then be trained on."""
    if not any(prompt for _, prompt, _ in files):
        if tokenizer is None:
            return np.frombuffer(b"".join(b for _, _, b in files), np.uint8)
        return tokenizer([_utf8(name, raw, tokenizer) for name, _, raw in files])

    def encode(docs: list[tuple[str, bytes]], special: bool) -> list[np.ndarray]:
        if tokenizer is None:
            return [np.frombuffer(raw, np.uint8) for _, raw in docs]
        return tokenizer.encode([_utf8(name, raw, tokenizer) for name, raw in docs], special)
    pairs = [(name, prompt, text) for name, prompt, text in files if prompt]
    prompts = iter(encode([(name, prompt) for name, prompt, _ in pairs], True))
    # a completion follows its prompt: no special tokens between them; a text has its own
    after = iter(encode([(name, text) for name, _, text in pairs], False))
    alone = iter(encode([(name, text) for name, prompt, text in files if not prompt], True))
    parts = []
    for _, prompt, _ in files:
        parts += [-1 - next(prompts).astype(np.int64), next(after)] if prompt else [next(alone)]
    return np.concatenate([x.astype(np.int64) for x in parts]).astype(np.int32)


def _utf8(name: str, raw: bytes, tokenizer: Tokenizer) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{name} is not UTF-8 text ({e.reason} at byte {e.start}), which "
                         f"{tokenizer.path} reads: convert it to UTF-8, or pass token ids "
                         "(.bin, .npy)") from None


def prompted(tokens: np.ndarray) -> bool:
    """Whether ``tokens`` marks prompt tokens (stored as ``-1 - id``: ``text_tokens``)."""
    return tokens.dtype.kind == "i" and tokens.size > 0 and int(tokens.min()) < 0


def unprompted(tokens: np.ndarray) -> np.ndarray:
    """The ids alone, prompts and completions alike."""
    return np.where(tokens < 0, -1 - tokens, tokens) if prompted(tokens) else tokens


def npy_tokens(path: pathlib.Path) -> np.ndarray:
    """A ``.npy`` of integer ids, memory-mapped: any vocabulary (uint32 past uint16's 65,536);
    signed ones may mark prompts as ``text_tokens`` does."""
    fix = "save one row of token ids with numpy.save (uint16 or uint32)"
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as e:
        raise ValueError(f"data file {path} does not read as a .npy array "
                         f"({str(e).splitlines()[0]}): {fix}") from None
    if tokens.ndim != 1 or tokens.dtype.kind not in "ui" or not tokens.size:
        raise ValueError(f"data file {path} holds a {tokens.dtype} array of shape "
                         f"{tokens.shape}, not a row of integer token ids: {fix}")
    return tokens  # negative ids: a prompt's (``text_tokens``), written by ``main``


def load_tokens(path: str | None, tokenizer: Tokenizer | None = None) -> np.ndarray:
    """Token ids from ``path``: a ``.bin`` of uint16 ids (nanoGPT's format; ``.BIN`` too), a
    ``.npy`` of integer ids, a text file, a ``.jsonl`` of ``{"text": ...}`` records, or a
    directory of them (read as bytes, ids 0-255, or with ``tokenizer``, each file or record one
    document); the standard library when ``path`` is None. Anything else
    (a FIFO, a device) is refused before it is opened: reading one blocks, or never ends."""
    if path is None:
        return (stdlib_corpus() if tokenizer is None else
                text_tokens([("the standard library corpus", b"", b) for b in stdlib_files()],
                            tokenizer))
    p = pathlib.Path(path)
    if not p.exists():
        raise FileNotFoundError(f"data file {path} does not exist: pass an existing text file, "
                                "directory of text files, .bin of uint16 or .npy of token ids")
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file())
        return text_tokens([d for f in files for d in documents(f)], tokenizer)
    if not p.is_file():
        raise ValueError(f"data file {path} is not a regular file or directory (a FIFO or a "
                         "device, which would be read without end): pass a text file, a "
                         "directory of text files, a .bin of uint16 or .npy of token ids")
    if p.suffix.lower() == ".npy":
        return npy_tokens(p)
    if is_text(path):
        return text_tokens(documents(p), tokenizer)
    size = p.stat().st_size
    if size == 0 or size % 2:
        raise ValueError(f"data file {path} holds {size} bytes, not a whole number of uint16 "
                         f"token ids (2 bytes each{', and at least one' if not size else ''}): "
                         "a .bin is nanoGPT's token ids; rewrite it, or rename a text file")
    return np.memmap(p, dtype=np.uint16, mode="r")


def check_tokens(tokens: np.ndarray, vocab_size: int, seq_len: int, source: str) -> None:
    if len(tokens) < seq_len + 2:
        raise ValueError(f"{source} holds {len(tokens)} tokens, fewer than one sequence of "
                         f"{seq_len + 1}: use more data or a smaller model.seq_len")
    top = int(tokens.max())
    if prompted(tokens):  # a prompt's id i stored as -1 - i; no copy of a large stream
        top = max(top, -1 - int(tokens.min()))
    if top >= vocab_size:
        raise ValueError(f"{source} has token id {top} but model.vocab_size is {vocab_size}: "
                         f"set --set model.vocab_size={top + 1} or larger")


def batch(tokens: np.ndarray, step: int, batch_size: int, seq_len: int, seed: int,
          rows: slice = slice(None)) -> np.ndarray:
    """``(batch_size, seq_len + 1)`` int32 windows at positions drawn from (seed, step); with
    ``rows``, only those rows of it (one process's slice: the positions of the whole batch are
    drawn, so the rows are the same however the batch is split, but only these are read)."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)[rows]
    return np.stack([tokens[s: s + seq_len + 1] for s in starts]).astype(np.int32)


def held_out(tokens: np.ndarray, seq_len: int, source: str) -> tuple[np.ndarray, np.ndarray]:
    """The stream cut in two, the first nine tenths to train on and the last tenth to evaluate
    on: no window of one reads the other."""
    cut = int(len(tokens) * (1 - HELD_OUT))
    if len(tokens) - cut < seq_len + 2:
        raise ValueError(f"{source}'s last tenth, held out for train.eval_every, holds "
                         f"{len(tokens) - cut} tokens, fewer than one sequence of {seq_len + 1}: "
                         "use more data, a smaller model.seq_len, or train.eval_every=0")
    return tokens[:cut], tokens[cut:]


def eval_batch(held: np.ndarray, j: int, batch_size: int, seq_len: int) -> np.ndarray:
    """Held-out batch ``j``: the same windows whatever the run's seed, so that runs compare."""
    return batch(held, j, batch_size, seq_len, EVAL_SEED)


def main(argv: list[str] | None = None) -> int:
    """Text encoded once by a model directory's tokenizer, saved as a ``.npy`` of ids."""
    import argparse
    import sys
    import time

    parser = argparse.ArgumentParser(
        prog="python -m zero_jax.gpt.data",
        description="encode a text file, a .jsonl of {\"text\": ...} (or {\"prompt\": ..., "
                    "\"completion\": ...}) records or a directory of them (each file or record "
                    "one document) with a model directory's tokenizer.json, into a .npy of "
                    "token ids that train.py --data reads")
    parser.add_argument("text", help="text file, .jsonl, or a directory of them")
    parser.add_argument("out", help="the .npy to write (uint16 where every id fits, else "
                                    "uint32; int32 with prompts marked, as -1 - id)")
    parser.add_argument("--tokenizer", required=True, metavar="DIR",
                        help="a Hugging Face model directory holding tokenizer.json")
    args = parser.parse_args(argv)
    try:
        if not args.out.endswith(".npy"):
            raise ValueError(f"{args.out} does not end in .npy, which train.py --data reads as "
                             "token ids: name it .npy")
        if not is_text(args.text):
            raise ValueError(f"{args.text} holds token ids already (a {TOKEN_FILES} file): "
                             "pass text")
        tokenizer = Tokenizer.of(args.tokenizer)
        if tokenizer is None:
            raise ValueError(f"{args.tokenizer} holds no {Tokenizer.FILE}: pass the model's "
                             "directory")
        tick = time.perf_counter()
        tokens = load_tokens(args.text, tokenizer)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dtype = np.int32 if prompted(tokens) else np.uint16 if tokens.size and tokens.max() < 2**16 \
        else np.uint32
    with open(args.out + ".partial", "wb") as f:  # a run killed while writing leaves no .npy
        np.save(f, tokens.astype(dtype))
    os.replace(args.out + ".partial", args.out)
    print(f"{args.out}: {len(tokens):,} tokens ({np.dtype(dtype).name}) in "
          f"{time.perf_counter() - tick:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
