"""fedbayes.runs.resume: whether a run folder holds a finished run of a config (:func:`finished`)."""

from fedbayes.runs import folder
from fedbayes.runs.resume import finished


def test_finished_needs_the_same_config_and_a_summary(tmp_path):
    from fedbayes.config.schema import to_toml, validate

    cfg = validate({"name": "x", "data": {"dataset": "digits", "num_clients": 3}, "algorithm": {"name": "fedavg"}, "server": {"clients_per_round": 3}})
    run = tmp_path / "run"
    assert finished(cfg, run) is None  # nothing there
    run.mkdir()
    (run / folder.CONFIG).write_text(to_toml(cfg))
    assert finished(cfg, run) is None  # no summary yet: unfinished
    folder.write_json(run / folder.SUMMARY, {"name": "x", "diverged": {"round": 3}})
    assert finished(cfg, run) == {"name": "x", "diverged": {"round": 3}}  # a diverged run is finished as it stands
    assert finished(cfg.model_copy(update={"seed": cfg.seed + 1}), run) is None  # another config
    folder.write_json(run / folder.SUMMARY, {"name": "x"})
    lines = []
    assert finished(cfg, run, lines.append) is None  # a summary without its final checkpoint: named, rebuilt by resuming
    assert len(lines) == 1 and "final checkpoint (round 10) is missing" in lines[0]
