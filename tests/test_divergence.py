"""The divergence guard (``zero_jax.loop``, train.py's) warns of a finite loss far above its
recent range (what damaged optimizer state, or too high a learning rate, shows first): once,
and without stopping the run or holding back a save, which only non-finite steps do
(tests/test_hardening.py)."""

import math
import random

import pytest

from zero_jax.loop import DivergenceGuard


def falling(n: int, seed: int = 0, noise: float = 0.05) -> list[float]:
    """A loss falling from ln 256 (an untrained byte model) toward 3, with a small batch's
    noise."""
    rng = random.Random(seed)
    return [3.0 + (math.log(256) - 3.0) * math.exp(-i / 8) + rng.gauss(0, noise)
            for i in range(n)]


def feed(losses: list[float], guard: DivergenceGuard | None = None) -> tuple:
    """(the warnings, whether each step stopped the run, the guard)."""
    said: list[str] = []
    guard = guard or DivergenceGuard(5, min_loss_scale=1.0, write=said.append)
    stops = [guard.update({"loss": x, "grad_norm": 1.0, "skipped": int(not math.isfinite(x))},
                          i + 1) for i, x in enumerate(losses)]
    return said, stops, guard


def test_a_falling_noisy_loss_is_no_jump():
    for seed in range(20):
        assert feed(falling(200, seed))[0] == []
    plateau = [2.0 + 0.01 * (-1) ** i for i in range(30)]  # settled: a tenth above is a jump
    assert feed([*plateau, 2.15])[0] == []
    assert len(feed([*plateau, 2.25])[0]) == 1


@pytest.mark.parametrize("jump", [5.09, math.log(256)], ids=["flipped band", "zeroed files"])
def test_a_jump_is_warned_once_and_stops_nothing(jump, capsys):
    """The losses the damaged NVMe tier trained on before it had checksums: 3.2 to 5.09 at
    step 27, and a model wiped to ln 256. Said once, though the loss stays there."""
    guard = DivergenceGuard(5, min_loss_scale=1.0)  # by default a warning line on stderr
    _, stops, _ = feed([*falling(26), *[jump] * 10], guard)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"warning: the loss jumped to {jump:.4g} at step 27, far above "
                             "its last 10 steps' "), err
    assert not any(stops) and guard.bad_from is None and guard.streak_from is None


def test_the_first_steps_and_non_finite_losses_are_not_jumps():
    """Fewer than 10 losses are no range yet; a NaN (its step skipped) is a bad step, the
    streak's business, and is left out of the range."""
    said, stops, guard = feed([5.5, 9.0, *falling(12), math.nan, 3.2])
    assert said == [] and not any(stops) and guard.streak_from is None
    assert all(math.isfinite(x) for x in guard.recent)
