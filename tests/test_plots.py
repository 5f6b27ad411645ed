"""Plots: the learning-curve PNG is written and valid; matplotlib stays optional and is imported only when drawing."""

import subprocess
import sys

import numpy as np
import pytest

from llamagym import plots
from llamagym.envs import blackjack as bj

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

pytest.importorskip("matplotlib")


def assert_png(path):
    data = path.read_bytes()
    assert len(data) > 1000 and data.startswith(PNG_MAGIC)


def test_learning_curve_png(tmp_path):
    returns = np.random.default_rng(0).choice([-1.0, 0.0, 1.0], size=300).tolist()
    refs = {name: r["expected_return"] for name, r in bj.reference_returns().items()}
    path = plots.plot_learning_curve(returns, tmp_path / "out" / "curve.png", window=50, references=refs)
    assert path == tmp_path / "out" / "curve.png"
    assert_png(path)


@pytest.mark.parametrize("returns", [[1.0], [0.0, 0.0]])
def test_learning_curve_handles_tiny_runs(tmp_path, returns):
    assert_png(plots.plot_learning_curve(returns, tmp_path / "c.png"))


def test_moving_average_is_a_trailing_mean():
    mean, stderr = plots.moving_average([1.0, 3.0, 5.0, 7.0], window=2)
    np.testing.assert_allclose(mean, [1.0, 2.0, 4.0, 6.0])
    np.testing.assert_allclose(stderr, [0.0, 1.0, 1.0, 1.0])


def test_missing_matplotlib_gives_an_install_hint(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plots.plot_learning_curve([0.0], tmp_path / "c.png")


def test_importing_the_modules_does_not_import_matplotlib():
    code = (
        "import sys, llamagym.plots, llamagym.envs.blackjack, llamagym.envs.blackjack_plot, llamagym.evaluation; "
        "assert not any(m.startswith('matplotlib') for m in sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
