"""fedbayes.bench.trace: self times, classes and the per-round breakdown of a profiler trace."""

import gzip
import json

import jax
import jax.numpy as jnp
import pytest

from fedbayes.bench import trace

DEV, OTHER, PY = (1, 10), (1, 11), (1, 12)
NAMES = {DEV: "tf_XLAEigen/1", OTHER: "tf_XLAEigen/2", PY: "python"}


def ev(key, name, ts, dur):
    return {"ph": "X", "pid": key[0], "tid": key[1], "name": name, "ts": ts, "dur": dur}


def one_round(t0, key):
    """A round of a device thread: a loop of 16 steps (a dot and an update), a per-client op, an
    all-reduce with its rendezvous, inside the executor's event."""
    evs = [ev(key, "ThunkExecutor::Execute", t0, 1000), ev(key, "while.3", t0 + 10, 900)]
    for s in range(16):
        evs += [ev(key, "dot.1", t0 + 20 + 50 * s, 30), ev(key, "multiply_add_fusion", t0 + 50 + 50 * s, 10)]
    evs += [ev(key, "cavity_fusion", t0 + 920, 20), ev(key, "all-reduce.7", t0 + 950, 40), ev(key, "Rendezvous", t0 + 955, 30)]
    return evs


def test_self_times_subtract_nested_events_and_drop_host_ones():
    events = one_round(0, DEV) + [ev(PY, "$simulate.py:614 run_round", 0, 5000), ev(OTHER, "Execute (wait for completion)", 0, 5000)]
    per = trace.self_times(events, NAMES)
    assert set(per) == {DEV}  # the python thread and the client's wait are host-side
    c = per[DEV]
    assert c["dot.1"] == 16 * 30 and c[("#", "dot.1")] == 16
    assert c["while.3"] == 900 - 16 * 40  # its body's thunks are not its own time
    assert c["all-reduce.7"] == 10 and c["Rendezvous"] == 30
    assert c["ThunkExecutor::Execute"] == 1000 - 900 - 20 - 40
    assert sum(v for k, v in c.items() if not isinstance(k, tuple)) == 1000  # self times tile the program


def test_breakdown_classes_per_round_and_threads():
    events = one_round(0, DEV) + one_round(2000, DEV) + one_round(0, OTHER)[:-2]  # OTHER: no collective
    r = trace.op_breakdown(events, NAMES, rounds=2, top=3)
    dev = next(t for t in r["threads"] if t["thread"] == "tf_XLAEigen/1")
    assert dev["busy_ms"] == pytest.approx(1.0)  # 1000 us a round
    assert dev["loop_ms"] == pytest.approx(16 * 40 / 1000)
    assert dev["once_ms"] == pytest.approx(0.02)
    assert dev["sync_ms"] == pytest.approx(0.04)
    assert dev["control_ms"] == pytest.approx(1.0 - 0.64 - 0.02 - 0.04)
    assert r["threads"][0]["thread"] == "tf_XLAEigen/1"  # the busiest first
    assert [o["name"] for o in r["ops"]][0] == "dot.1" and r["ops"][0]["class"] == "loop"
    assert r["ops"][0]["calls"] == pytest.approx(16 + 8)  # both threads, per round
    assert r["classes"]["sync"] == pytest.approx(0.04)
    assert trace.op_class("all-gather.2", 1, 100) == "sync" and trace.op_class("while.4", 100, 100) == "control"
    assert trace.op_class("x", 13, 100) == "loop" and trace.op_class("x", 12, 100) == "once"
    # The main loop is the count that carries the most time, not the most frequent op (a random
    # number generator's 5 calls a step must not demote the step's matmuls).
    times = {"dot": 90.0, "rng_add": 10.0, "cavity": 5.0, "all-reduce": 50.0}
    counts = {"dot": 100, "rng_add": 500, "cavity": 2, "all-reduce": 2}
    assert trace.main_loop_count(times, counts) == 100
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        trace.op_breakdown(events, NAMES, rounds=0)


def test_load_events_reads_plain_and_gzipped_traces(tmp_path):
    data = {"traceEvents": [{"ph": "M", "pid": 1, "tid": 10, "name": "thread_name", "args": {"name": "tf_XLAEigen/1"}}, *one_round(0, DEV)]}
    (tmp_path / "a.trace.json").write_text(json.dumps(data))
    with gzip.open(tmp_path / "b.trace.json.gz", "wt") as f:
        json.dump(data, f)
    for name in ("a.trace.json", "b.trace.json.gz"):
        events, names = trace.load_events(tmp_path / name)
        assert names == {DEV: "tf_XLAEigen/1"} and len(events) == len(one_round(0, DEV))
    assert trace.find_trace(tmp_path).name == "b.trace.json.gz"
    with pytest.raises(FileNotFoundError, match="create_perfetto_trace=True"):
        trace.find_trace(tmp_path / "nothing")


def test_a_real_profiler_trace_shows_the_loop_ops(tmp_path):
    # The format check: JAX's own trace of a jitted loop parses into a loop op that dominates.
    w = jnp.ones((64, 64))

    @jax.jit
    def f(x):
        return jax.lax.fori_loop(0, 50, lambda i, x: jnp.tanh(x @ w), x)

    x = jnp.ones((32, 64))
    jax.block_until_ready(f(x))
    with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
        for _ in range(3):
            jax.block_until_ready(f(x))
    events, names = trace.load_events(trace.find_trace(tmp_path))
    r = trace.op_breakdown(events, names, rounds=3)
    assert r["threads"] and r["ops"]
    loops = [o for o in r["ops"] if o["class"] == "loop"]
    assert loops and max(o["calls"] for o in loops) == pytest.approx(50)
