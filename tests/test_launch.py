"""The launcher: exit codes, whole output lines, and arguments it refuses. Nothing here starts
JAX: the programs are one-line Python commands."""

import pathlib
import re
import signal
import subprocess
import sys

import pytest

from zero_jax import launch

ROOT = pathlib.Path(__file__).resolve().parent.parent


def launch_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zero_jax.launch", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def launch_main(capfd, *args: str) -> subprocess.CompletedProcess:
    """The launcher's ``main`` in this process (its own start-up, an import of JAX, is run by
    the help test below), its signal forwarding undone after; the programs are processes of
    their own, their pipes copied to this process's stdout and stderr."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    capfd.readouterr()
    try:
        code = launch.main(list(args))
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    out = capfd.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


@pytest.mark.parametrize("program, code", [(["nonexist.py"], 2),
                                           (["-c", "import sys; sys.exit(3)"], 3),
                                           (["-c", "import os; os.kill(os.getpid(), 9)"], 137)],
                         ids=["missing file", "exit 3", "killed"])
def test_the_first_failure_is_the_exit_code(program, code, capfd):
    """Every process fails before the launcher first looks: their code is not lost."""
    run = launch_main(capfd, "--processes", "3", "--", *program)
    assert run.returncode == code, run.stderr


def test_processes_that_exited_before_wait_keep_their_code():
    procs = launch.spawn(["-c", "import sys; sys.exit(5)"], 2, 1)
    for p in procs:
        p.wait()
    assert launch.wait(procs, grace=1) == 5


def test_two_processes_lines_never_run_together(capfd):
    """Each process prints its lines in two pieces, unbuffered, at the same time as the other:
    the launcher's output holds every line whole, and a last line without a newline ends.
    Between the pieces each writes what gloo's C++ writes to stdout when a communicator
    connects (a line per rank and communicator): left out, and the lines whole."""
    gloo = "[Gloo] Rank {i} is connected to 7 peer ranks. Expected number of connected peer " \
           "ranks is : 7\\n"
    program = ("import os, sys, time\n"
               "i = os.environ['JAX_PROCESS_ID']\n"
               "for n in range(40):\n"
               "    for out in (sys.stdout, sys.stderr):\n"
               "        out.write(f'error: process {i} line {n}')\n"
               f"        out is sys.stdout and out.write(f'{gloo}')\n"
               "        time.sleep(0.001)\n"
               "        out.write(' ends here\\n')\n"
               "sys.stderr.write(f'last {i}')\n")
    run = launch_main(capfd, "--processes", "2", "--", "-c", program)
    assert run.returncode == 0, run.stderr
    for text, last in ((run.stdout, False), (run.stderr, True)):
        lines = text.splitlines()
        body = [x for x in lines if not x.startswith("last ")]
        assert all(re.fullmatch(r"error: process [01] line \d+ ends here", x) for x in body), text
        assert len(body) == 80
        assert sorted(x for x in lines if x.startswith("last ")) == (["last 0", "last 1"]
                                                                     if last else [])


@pytest.mark.parametrize("args, phrase", [
    (["--port", "99999"], "--port must be a TCP port, 1 to 65535 (got 99999)"),
    (["--port", "0"], "--port must be a TCP port, 1 to 65535 (got 0)"),
    (["--port", "x"], "argument --port: invalid int value: 'x'"),
    (["--processes", "0"], "--processes and --devices-per-process must be at least 1"),
    (["--grace", "nan"], "--grace must be a finite number of seconds"),
    (["--grace", "-1"], "--grace must be a finite number of seconds"),
])
def test_refused_with_one_line(args, phrase, capsys):
    try:
        code = launch.main([*args, "--", "-c", "pass"])
    except SystemExit as e:  # argparse
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and phrase in err[0], err


def test_no_program_is_refused(capsys):
    assert launch.main(["--"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "put the program after --" in err[0]


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["--processes", "2", "--help"]])
def test_help_is_printed_with_exit_0(argv, capsys):
    """As a user first runs it: without ``--`` or a program, help and exit code 0. The first
    as a user types it, in a process of its own; the others through ``main`` in this one (the
    same parser)."""
    if argv == ["--help"]:
        run = launch_run(*argv)
    else:
        with pytest.raises(SystemExit) as exit_:
            launch.main(argv)
        out = capsys.readouterr()
        run = subprocess.CompletedProcess(argv, exit_.value.code, out.out, out.err)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert run.stdout.startswith("usage: python -m zero_jax.launch [options] -- PROGRAM")
    words = " ".join(run.stdout.split())  # argparse wraps the example at the terminal's width
    assert "--devices-per-process" in words and "4 -- train.py --stage 3" in words


@pytest.mark.parametrize("argv", [["train.py", "--stage", "3"], ["--processes", "2"]])
def test_a_program_without_dashes_is_refused(argv, capsys):
    assert launch.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: put the program after --"), err
