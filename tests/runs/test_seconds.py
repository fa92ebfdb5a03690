"""``metrics.jsonl``'s ``seconds`` is the rounds' compute time: checked against a stopwatch of the
same round run alone (launched and completed; its host inputs prepared before the clock starts, as
the pipelined loop prepares them while the previous round computes), as a ratio (the one timed check the suite makes, with a model slow enough
that a round's compute dominates its fixed costs).

The stopwatch round runs between the run's rounds (from the progress reporter, while the run
evaluates and nothing of it is in flight), so each of the run's rounds is bracketed by two
stopwatch rounds, the one just before it and the one just after, and compared with their mean:
under a load that changes, the bracket follows it. It is a benchmark (marker ``benchmark``, left
out of `make test`; run it on its own: ``pytest -m benchmark --benchmarks``): beside another worker's tests the median ratio reached
1.11 in one CI run (2026-11-27), bursts of the other test landing in one of the pair and not the other. Each timed
stopwatch round follows an untimed one, as each of the run's rounds follows a round: timed straight
after an evaluation, a round ran 12-15% slower (the XLA threads idle, the caches cold), measured
2026-11-27: ratio medians 0.84-0.88 without the untimed round, 0.95-1.01 with it."""

import time

import jax
import numpy as np
import pytest

from fedbayes.config.schema import validate
from fedbayes.runs.build import build_experiment
from fedbayes.runs.folder import METRICS, read_metrics
from fedbayes.runs.loop import run_experiment

# About 0.2-0.4 s of compute a round on 2 cores; evaluation on digits' test split is cheap beside
# it, so a round's compute hidden in the evaluation time (the old accounting) gives a ratio near 0.
SLOW = {
    "rounds": 17,
    "eval_every": 1,
    "checkpoint_every": 0,
    "data": {"dataset": "digits", "num_clients": 3, "partition": "iid"},
    "model": {"name": "mlp", "hidden": [512, 512]},
    "client": {"lr": 0.05, "batch_size": 32, "epochs": 6},
    "server": {"clients_per_round": 3},
}


class StopwatchReporter:
    """Runs and times one round of its own simulator after each of the run's rounds."""

    def __init__(self, config):
        exp = build_experiment(config)
        self.sim = exp.simulator
        self.state, _ = self.sim.run_round(self.sim.init(exp.params), donate=True)  # compiles
        self.times: dict[int, float] = {}

    def start(self, name, total, done):
        pass

    def update(self, round_idx, total, record):
        if round_idx == 0:
            return
        self.state, _ = self.sim.run_round(self.state, donate=True)  # untimed: the timed round, like the run's, follows a round
        jax.block_until_ready(self.state.server_state)
        prepared = self.sim.prepare_round(self.state.round)  # host work the pipelined loop does while the previous round computes
        t0 = time.perf_counter()
        launched = self.sim.launch(self.state, prepared, donate=True)
        self.state, _ = self.sim.complete(self.state, launched, donate=True)
        jax.block_until_ready(self.state.server_state)
        self.times[round_idx] = time.perf_counter() - t0

    def stop(self):
        pass


@pytest.mark.slow  # 16 bracketed rounds of a deliberately slow model: 20-35 s on 2 loaded cores
@pytest.mark.benchmark  # a stopwatch: beside another xdist worker's tests its median reached 1.11 (CI, 2026-11-27)
def test_seconds_is_the_rounds_compute_time_against_a_stopwatch(tmp_path):
    config = validate(SLOW)
    stopwatch = StopwatchReporter(config)
    run_experiment(config, tmp_path / "run", reporter=stopwatch)
    seconds = [r["seconds"] for r in read_metrics(tmp_path / "run" / METRICS)]
    rounds = range(2, config.rounds + 1)  # round 1 includes the compile; its stopwatch round brackets round 2
    ratios = [(seconds[r] - seconds[r - 1]) / (0.5 * (stopwatch.times[r - 1] + stopwatch.times[r])) for r in rounds]
    # Within 10% as a median over the pairs; the old accounting (the round's compute landing in the
    # evaluation's time) gave about 0.01 here.
    assert 0.9 <= float(np.median(ratios)) <= 1.1, ratios
