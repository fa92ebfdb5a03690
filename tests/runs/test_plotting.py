"""The curves plot: point curves set the axes, a curve far outside is drawn clipped and named."""

from fedbayes.runs.plotting import panel_limits, plot_curves


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    texts = []
    original = plt.Axes.text
    plt.Axes.text = lambda self, *a, **k: texts.append(a[2]) or original(self, *a, **k)
    try:
        plot_curves(tmp_path / "c.png", {"fedavg": good, "fedlap_cov": bad})
    finally:
        plt.Axes.text = original
    assert (tmp_path / "c.png").stat().st_size > 0
    assert texts == ["clipped below: fedlap_cov (marg.)", "clipped above: fedlap_cov (marg.)", "clipped above: fedlap_cov (marg.)"]


def test_a_marginalised_curve_near_the_point_curves_stretches_the_axes_instead_of_being_clipped():
    rounds = list(range(5))
    series = [("fedep", True, rounds, [3.0, 3.5, 4.0, 4.5, 5.0]), ("fedep (marg.)", False, rounds, [1.5] * 5)]  # ECE: better calibrated
    (lo, hi), clipped = panel_limits(series, start=0)
    assert lo < 1.5 and hi > 5.0 and clipped == []
