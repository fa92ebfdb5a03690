"""The curves plot: point curves set the axes, a curve far outside or worse than the untrained model
is drawn clipped and named; point and Bayesian methods are told apart by line style, and the legend
says which is which."""

import pytest

from fedbayes.runs.plotting import curves_figure, panel_limits, plot_curves


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


def test_point_curves_set_the_axes_and_outliers_are_named():
    rounds = list(range(11))
    series = [
        ("fedavg", True, rounds, [0.1] + [0.80 + 0.001 * r for r in rounds[1:]]),
        ("fedep", True, rounds, [0.1] + [0.82 + 0.001 * r for r in rounds[1:]]),
        ("fedep (marg.)", False, rounds, [0.1] + [0.83] * 10),
        ("fedlap_cov (marg.)", False, rounds, [0.07] * 11),
    ]
    (lo, hi), clipped = panel_limits(series, start=2)
    assert 0.79 < lo < 0.802 and 0.83 < hi < 0.84  # round 0 (chance) and the broken curve set nothing
    assert clipped == ["fedlap_cov (marg.) below"]
    assert panel_limits([("nan", True, [0, 1], [1.0, float("nan")])], 0)[1] == ["nan above"]


def test_plot_names_the_clipped_curve(tmp_path):
    good = [{"round": r, "accuracy": 0.8 + 0.01 * r, "nll": 0.5, "ece": 0.03} for r in range(6)]
    bad = [{**g, "accuracy_marg": 0.07, "nll_marg": 30.0, "ece_marg": 0.5} for g in good]
    fig = curves_figure({"fedavg": good, "fedlap_cov": bad}, bayesian={"fedlap_cov"})
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert texts == [
        "clipped below: fedlap_cov (marg.)",
        "clipped above (worse than the untrained model's 0.5): fedlap_cov (marg.)",  # its NLL: round 0's caps the axis
        "clipped above: fedlap_cov (marg.)",
    ]
    assert plot_curves(tmp_path / "c.png", {"fedavg": good}).stat().st_size > 0


def _records(accuracy, nll, rounds=11, marginal=False):
    """A run's records: round 0 untrained (accuracy 0.1, NLL 2.3), then the given curves of r."""
    out = [{"round": 0, "accuracy": 0.1, "nll": 2.3, "ece": 0.05}]
    out += [{"round": r, "accuracy": accuracy(r), "nll": nll(r), "ece": 0.03} for r in range(1, rounds)]
    return [{**r, "accuracy_marg": r["accuracy"], "nll_marg": r["nll"] * 0.95, "ece_marg": 0.02} for r in out] if marginal else out


def test_point_methods_are_solid_bayesian_ones_dashed_and_the_legend_says_so():
    runs = {
        "fedep": _records(lambda r: 0.8, lambda r: 0.5, marginal=True),
        "fedavg": _records(lambda r: 0.7, lambda r: 0.7),
        "fedprox": _records(lambda r: 0.75, lambda r: 0.6),
    }
    fig = curves_figure(runs, title="digits: 3 methods, 10 clients, 10 rounds", bayesian={"fedep"})
    styles = {(line.get_color(), line.get_linestyle(), round(line.get_linewidth(), 1)) for line in fig.axes[0].get_lines()}
    assert styles == {("C0", "--", 1.6), ("C0", ":", 1.0), ("C1", "-", 1.6), ("C2", "-", 1.6)}  # fedep, its marg., fedavg, fedprox
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["fedavg", "fedprox", "fedep", "fedep (marg.)"]  # point methods first
    assert legend.get_title().get_text() == "solid: point methods; dashed: Bayesian methods (their posterior mean); dotted: averaged over the posterior (marg.)"
    assert fig.get_suptitle() == "digits: 3 methods, 10 clients, 10 rounds"
    only_point = curves_figure({"fedavg": runs["fedavg"]})
    assert only_point.legends[0].get_title().get_text() == "solid: point methods"


def test_a_diverging_method_leaves_the_nll_axis_to_the_others():
    runs = {
        "fedavg": _records(lambda r: 0.8, lambda r: 0.5 + 0.1 / r),
        "fedep": _records(lambda r: 0.85, lambda r: 0.4 + 0.1 / r),
        "fedlap": _records(lambda r: 0.1, lambda r: 2.0 * r),  # diverges: NLL 20 at round 10
    }
    fig = curves_figure(runs, bayesian={"fedep", "fedlap"})
    accuracy, nll, _ = fig.axes[:3]
    lo, hi = nll.get_ylim()
    assert 0.55 < hi < 0.6 and 0.4 < lo < 0.42  # the others' range after round 2, not stretched to 20
    assert [t.get_text() for t in nll.texts] == ["clipped above (worse than the untrained model's 2.3): fedlap"]
    clipped = next(line for line in nll.get_lines() if line.get_color() == "C2")
    assert max(clipped.get_ydata()[2:]) == pytest.approx(hi)  # drawn along the top edge
    assert accuracy.get_ylim()[0] < 0.1  # accuracy has no cap: the diverged run's 0.1 stays in view


def test_a_ceiling_clips_point_curves_above_it_unless_every_one_is():
    rounds = [0, 1, 2, 3]
    good, bad = ("a", True, rounds, [2.0, 1.0, 0.8, 0.7]), ("b", True, rounds, [2.0, 3.0, 9.0, 40.0])
    (lo, hi), clipped = panel_limits([good, bad], start=1, ceiling=2.0)
    assert hi < 1.1 and clipped == ["b above"]
    (lo, hi), clipped = panel_limits([bad], start=1, ceiling=2.0)  # nothing below the cap: the curves' own range
    assert hi > 40 and clipped == []


def test_a_marginalised_curve_near_the_point_curves_stretches_the_axes_instead_of_being_clipped():
    rounds = list(range(5))
    series = [("fedep", True, rounds, [3.0, 3.5, 4.0, 4.5, 5.0]), ("fedep (marg.)", False, rounds, [1.5] * 5)]  # ECE: better calibrated
    (lo, hi), clipped = panel_limits(series, start=0)
    assert lo < 1.5 and hi > 5.0 and clipped == []
