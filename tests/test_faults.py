"""``bench/faults.py``'s table, damages and argument checks, on hand-made trials and a fake
checkpoint tree (the script itself trains and is not run by the suite)."""

import pathlib
import random
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))
import faults  # noqa: E402  (bench/ is not a package)


def trial(kind, rc, lost=(), exact=True, traceback=False, **extra):
    return {"kind": kind, "trial": 0, "landed": True, "rc": rc, "resume_rc": 0,
            "lost": list(lost), "bit_exact": exact, "traceback": traceback, **extra}


def test_the_table_counts_each_kind():
    trials = [trial("term", 143), trial("term", -15, lost=[4]),
              trial("corrupt", -9, exact=False, outcome="fell back"),
              trial("corrupt", 0, traceback=True, outcome="refused"),
              trial("nvme-flip", 1, outcome="stopped", from_damaged=[]),
              trial("nvme-flip", 0, exact=False, outcome="missed", from_damaged=[8, 10])]
    assert faults.format_table(faults.summarize(trials)).splitlines() == [
        "| fault | trials | fault landed | checkpoints lost | checkpoints from damaged state "
        "| resumes bit-exact | tracebacks | damage | exit codes |",
        "|---|---|---|---|---|---|---|---|---|",
        "| term | 2 | 2 | 1 | - | 2/2 | 0 | - | run 143 x1, SIGTERM x1; resume 0 x2 |",
        "| corrupt | 2 | 2 | 0 | - | 1/2 | 1 | fell back 1, refused 1 "
        "| run SIGKILL x1, 0 x1; resume 0 x2 |",
        "| nvme-flip | 2 | 2 | 0 | 2 | 1/2 | 0 | stopped 1, missed 1 "
        "| run 1 x1, 0 x1; resume 0 x2 |"]


def test_checkpoints_that_differ_from_the_reference_are_counted(tmp_path):
    """A checkpoint saved from state the uninterrupted run never had shows in its digests."""
    for run, digest in (("ref", {2: "a", 4: "b", 6: "c"}), ("trial", {2: "a", 4: "x"})):
        for step, value in digest.items():
            meta = tmp_path / run / "ckpt" / str(step) / "meta"
            meta.mkdir(parents=True)
            (meta / "metadata").write_text(f'{{"digests": {{"params/w": "{value}"}}}}')
    assert faults.differing(tmp_path / "trial", tmp_path / "ref") == [4]


@pytest.mark.parametrize("how", faults.DAMAGES)
def test_each_damage_changes_the_newest_step_only(tmp_path, how):
    for step in (2, 4):
        for name in ("params/_METADATA", "params/d/abc", "opt_state/d/def", "meta/metadata"):
            (tmp_path / str(step) / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / str(step) / name).write_bytes(bytes(range(64)))
    (tmp_path / "6.orbax-checkpoint-tmp").mkdir()  # a save in flight is not a step
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    rng = random.Random(0)
    rng.choice = lambda seq: how if seq is faults.DAMAGES else random.Random(0).choice(seq)
    done = faults.damage(tmp_path, rng)
    assert done["step"] == 4 and done["how"] == how
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    changed = {p for p in before if after.get(p) != before[p]}
    assert changed and all(p.relative_to(tmp_path).parts[0] == "4" for p in changed)


@pytest.mark.parametrize("argv", [["--kinds", "kill,fire"], ["--trials", "0"], ["--seed", "x"]])
def test_bad_input_is_one_line_and_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        faults.parse_args(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1
