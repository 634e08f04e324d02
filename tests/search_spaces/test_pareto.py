"""The non-dominated filter against a brute-force check, and the front's plot."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
from PIL import Image

from nats.search_spaces.pareto import dominates, pareto_front, plot_front, view_range


def _brute_force(points: list[tuple[float, ...]], modes: list[str]) -> list[int]:
    def better_or_equal(a: float, b: float, mode: str) -> bool:
        return a <= b if mode == "min" else a >= b

    out = []
    for i, p in enumerate(points):
        dominated = any(
            all(better_or_equal(q[k], p[k], m) for k, m in enumerate(modes)) and q != p
            for j, q in enumerate(points) if j != i)
        if not dominated:
            out.append(i)
    return out


@pytest.mark.parametrize("modes", [list(m) for n in (1, 2, 3)
                                   for m in itertools.product(("min", "max"), repeat=n)])
def test_front_matches_brute_force(modes: list[str]) -> None:
    rng = random.Random(len(modes) * 7 + modes.count("max"))
    for _ in range(60):
        n = rng.randint(0, 25)
        # Few distinct values: many ties and duplicates.
        points = [tuple(float(rng.randint(0, 5)) for _ in modes) for _ in range(n)]
        assert pareto_front(points, modes) == _brute_force(points, modes)


def test_dominance_and_duplicates() -> None:
    assert dominates((1, 1), (1, 2), ["min", "min"])
    assert not dominates((1, 2), (1, 2), ["min", "min"])
    assert dominates((1, 3), (1, 2), ["min", "max"])
    assert pareto_front([(1, 2), (1, 2), (2, 1), (2, 2)], ["min", "min"]) == [0, 1, 2]


def test_bad_points() -> None:
    with pytest.raises(ValueError, match="objectives"):
        pareto_front([(1.0,)], ["min", "min"])
    with pytest.raises(ValueError, match="one of"):
        pareto_front([(1.0,)], ["smallest"])
    with pytest.raises(ValueError, match="not a number"):
        pareto_front([(float("nan"),)], ["min"])


def test_plot_writes_a_png(tmp_path: Path) -> None:
    points = [(1e5, 2.0), (3e5, 1.0), (2e5, 2.5), (5e5, 0.9)]
    front = pareto_front(points, ["min", "min"])
    path = plot_front(points, front, tmp_path / "front.png", xlabel="FLOPs per token",
                      ylabel="eval/ce", title="test", labels=["a", "b", "c", "d"])
    with Image.open(path) as img:
        assert img.format == "PNG" and img.size == (720, 480)
    plot_front([(1.0, 1.0)], [0], tmp_path / "one.png", xlabel="x", ylabel="y")


def test_front_points_are_drawn_over_dominated_ones(tmp_path: Path) -> None:
    # The same points in two orders: a dominated point that nearly covers a front point
    # must not hide it whichever comes first, so the pictures are the same.
    points = [(1.0, 1.0), (1.0001, 1.0001), (2.0, 0.5), (3.0, 3.0)]
    front = pareto_front(points, ["min", "min"])
    assert front == [0, 2]
    order = [3, 2, 1, 0]
    a = plot_front(points, front, tmp_path / "a.png", xlabel="x", ylabel="y")
    b = plot_front([points[i] for i in order], pareto_front([points[i] for i in order],
                                                            ["min", "min"]),
                   tmp_path / "b.png", xlabel="x", ylabel="y")
    with Image.open(a) as img_a, Image.open(b) as img_b:
        assert img_a.tobytes() == img_b.tobytes()


def test_an_outlier_does_not_squash_the_front() -> None:
    ys = [1.0, 1.05, 1.1, 1000.0]  # the last: a diverged trial
    assert view_range(ys, ys[:3], log=False) == pytest.approx((1.0, 1.2))
    assert view_range([1.0, 2.0], [1.0, 2.0], log=False) == (1.0, 2.0)  # no wider than data
    lo, hi = view_range([1e3, 1e4, 1e9], [1e3, 1e4], log=True)
    assert lo == 1e3 and hi == pytest.approx(1e5)


def test_the_legend_names_points_drawn_on_the_edge(tmp_path: Path, monkeypatch) -> None:
    """A trial beyond the view is drawn hollow on its edge; the legend says what that means,
    and only when such a point is there."""
    from nats.search_spaces import pareto

    shown: list[list[str]] = []
    real = pareto.draw_legend
    monkeypatch.setattr(pareto, "draw_legend", lambda img, items, *a, **k: (
        shown.append([f"{i.label}:{i.marker}" for i in items]), real(img, items, *a, **k)))
    points = [(1.0, 1.0), (2.0, 0.5), (1.5, 1000.0)]  # the last: a diverged trial
    plot_front(points, pareto_front(points, ["min", "min"]), tmp_path / "a.png", xlabel="x",
               ylabel="y")
    plot_front(points[:2], [0, 1], tmp_path / "b.png", xlabel="x", ylabel="y")
    assert shown[0][-1] == "beyond the axes (on the edge):hollow"
    assert not any("beyond" in item for item in shown[1])
