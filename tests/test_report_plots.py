"""The swarm report's link-rate series and its plots (links.png, eval.png)."""

from node.local.report import link_rates, plot_eval, plot_link_rates


def test_link_rates_are_per_link_differences_over_time(tmp_path):
    samples = [
        (0.0, {}),
        (2.0, {"0 forward": 1000, "0 backward": 500}),
        (4.0, {"0 forward": 3000, "0 backward": 500}),
    ]
    rates = link_rates(samples)
    assert rates == {"0 forward": [(1.0, 500.0), (3.0, 1000.0)], "0 backward": [(1.0, 250.0), (3.0, 0.0)]}
    plot_link_rates(samples, tmp_path / "links.png")
    plot_eval(
        {"n": 3, "loss_before": 2.0, "loss_after": 1.0, "em_before": 0.0, "em_after": 0.67},
        tmp_path / "e.png",
    )
    assert (tmp_path / "links.png").stat().st_size > 1000 and (tmp_path / "e.png").stat().st_size > 1000
