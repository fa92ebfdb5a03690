"""Relative workloads: one computation's cost against a reference computation, in one process.

Some targets are ratios between two computations rather than throughput against the machine's
limit: a curvature pass against a training step, a CNN round against a plain jitted step loop,
a VBNN round against a CNN FedAvg round. Each relative workload builds its computations, calls
each once to compile and warm up, then runs ``settings.relative_reps`` repetitions; each
repetition times every computation once (``inner`` back-to-back calls for the short kernels), in
an order rotated from one repetition to the next, and keeps the ratio to the reference **of the
same repetition**. The report is the median and the range of those ratios: paired, so the load
of a shared machine moves numerator and denominator together.

* ``curvature``: :mod:`fedbayes.inference.curvature`'s diagonal flavours against a training step
  (the gradient of the mean loss and an SGD update), batch ``settings.batch_size``, on the MLP of
  ``settings.hidden`` and on the CNN (``settings.curvature_models``), 10 classes, inputs of ``settings.image_shape``: the
  sampled-label Fisher (one label per example), the empirical Fisher and the exact GGN
  (C = 10 output vectors). Ratios are costs (time over the step's); targets ``<= 2`` (MLP) and
  ``<= 3`` (CNN) for the Fishers, ``<= C + 1`` for the GGN.
* ``cnn``: the :class:`~fedbayes.sim.simulator.Simulator`'s FedAvg round (one host device per core, the
  CLI's layout) on Ozer et al. 2022 (VBNN aggregation)'s CNN against ``plain``, one ``jax.jit`` SGD
  step (lr 0.01, momentum 0.9, the masked mean cross-entropy) called from Python over every
  client's minibatches in turn: the same examples and steps as the round (each client's last
  batch partial and masked). Ratio: the round's throughput over the plain loop's (plain time
  over round time); target ``>= 0.8``.
* ``vbnn``: the VBNN round (the CNN with its dense layers variational, GAA aggregation, the same
  clients and optimizer) against the CNN FedAvg round. Ratio: throughput, target ``>= 0.7``.

The images are random normal values of ``settings.image_shape`` (the cost does not depend on the
values, and the workload then runs without any dataset): ``settings.cnn_clients`` clients of
``settings.cnn_per_client`` images, batch ``settings.cnn_batch``, one local epoch.

``cnn_100`` and ``vbnn_100`` are ``cnn`` and ``vbnn`` with 100 clients a round (the GPU record).

No JAX at top level (the parent process of ``fedbayes bench`` imports this module too).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

NUM_CLASSES = 10
CURVATURE_TARGETS = {"mlp": {"fisher": 2.0, "empirical": 2.0, "ggn": NUM_CLASSES + 1.0}, "cnn": {"fisher": 3.0, "empirical": 3.0, "ggn": NUM_CLASSES + 1.0}}
ROUND_TARGETS = {"cnn": 0.8, "vbnn": 0.7}


def interleaved_times(calls: dict[str, Callable[[], Any]], reps: int, inner: int = 1) -> dict[str, list[float]]:
    """Per call, its time (seconds per call) in each of ``reps`` repetitions.

    Every call runs once untimed first (compile, warm-up). Each repetition times every call once
    (``inner`` back-to-back calls, then ``block_until_ready`` on the last result), in an order
    rotated by one from the previous repetition, so that no call always follows the same one."""
    import jax

    names = list(calls)
    for f in calls.values():
        jax.block_until_ready(f())
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            t0 = time.perf_counter()
            for _ in range(inner):
                out = calls[n]()
            jax.block_until_ready(out)
            times[n].append((time.perf_counter() - t0) / inner)
    return times


def ratio_summary(numerator: list[float], denominator: list[float], target: float | None, direction: str) -> dict[str, Any]:
    """Median and range over repetitions of ``numerator[r] / denominator[r]``, with the target
    (``direction`` ``"<="`` for costs, ``">="`` for throughputs) and whether the median meets it."""
    ratios = [a / b for a, b in zip(numerator, denominator)]
    med = statistics.median(ratios)
    meets = None if target is None else (med <= target if direction == "<=" else med >= target)
    return {"median": med, "min": min(ratios), "max": max(ratios), "target": target, "direction": direction, "meets": meets}


def paired_rows(times: dict[str, list[float]], reference: str) -> dict[str, dict[str, Any]]:
    """Per name of :func:`interleaved_times`' result: its median in milliseconds and the median and
    range of its ratio to ``reference`` pass by pass (``{"ms", "ratio", "range"}``)."""
    rows = {}
    for name, ts in times.items():
        r = ratio_summary(ts, times[reference], None, "<=")
        rows[name] = {"ms": 1e3 * statistics.median(ts), "ratio": r["median"], "range": [r["min"], r["max"]]}
    return rows


def format_rows(rows: dict[str, dict[str, Any]], unit: str = "") -> list[str]:
    """:func:`paired_rows` as aligned lines: name, milliseconds, ratio (range) and ``unit``."""
    width = max(map(len, rows), default=0)
    return [f"{n:<{width}}  {e['ms']:9.3f} ms  {e['ratio']:6.2f} ({e['range'][0]:.2f}-{e['range'][1]:.2f}){unit}" for n, e in rows.items()]


# ----- curvature --------------------------------------------------------------------------------
def _curvature_calls(model_name: str, settings) -> dict[str, Callable[[], Any]]:
    import jax
    import jax.numpy as jnp
    import optax

    from fedbayes.inference import curvature as cv
    from fedbayes.models import init_params, loss_fn, make_model

    if model_name == "mlp":
        model = make_model("mlp", NUM_CLASSES, hidden=tuple(settings.hidden))
        shape = (math.prod(settings.image_shape),)
    else:
        model = make_model("cnn", NUM_CLASSES)
        shape = tuple(settings.image_shape)
    b = settings.batch_size
    params = init_params(model, jax.random.key(settings.seed), shape)
    apply = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    loss = loss_fn(model, "classification")
    opt = optax.sgd(settings.lr)
    x = jax.random.normal(jax.random.key(1), (b, *shape))
    y = jax.random.randint(jax.random.key(2), (b,), 0, NUM_CLASSES)
    mask = jnp.ones((b,))
    key = jax.random.key(3)
    state = opt.init(params)

    @jax.jit
    def step(p, s):
        u, s = opt.update(jax.grad(loss)(p, key, x, y, mask), s, p)
        return optax.apply_updates(p, u), s

    fisher = jax.jit(lambda p, k: cv.batch_diag_fisher(apply, p, x, y, mask, key=k))
    empirical = jax.jit(lambda p: cv.batch_diag_empirical_fisher(apply, p, x, y, mask))
    ggn = jax.jit(lambda p: cv.batch_diag_ggn(apply, p, x, y, mask))
    return {
        "step": lambda: step(params, state),
        "fisher": lambda: fisher(params, key),
        "empirical": lambda: empirical(params),
        "ggn": lambda: ggn(params),
    }


def measure_curvature(settings, inner: int = 5) -> dict[str, Any]:
    """The ``curvature`` workload: per model (``mlp``, ``cnn``) and flavour, its cost over a
    training step's (see the module docstring)."""
    ratios, step_s = {}, {}
    for model_name in settings.curvature_models:
        times = interleaved_times(_curvature_calls(model_name, settings), settings.relative_reps, inner)
        step_s[model_name] = statistics.median(times["step"])
        for flavour in ("fisher", "empirical", "ggn"):
            ratios[f"{model_name}/{flavour}"] = ratio_summary(times[flavour], times["step"], CURVATURE_TARGETS[model_name][flavour], "<=")
    return {"reference": "a training step (cost ratio)", "ratios": ratios, "reference_s": step_s, "reps": settings.relative_reps}


# ----- the CNN and VBNN rounds ------------------------------------------------------------------
def _images(settings):
    import numpy as np

    num = settings.cnn_clients * settings.cnn_per_client
    rng = np.random.default_rng(settings.seed)
    x = rng.normal(size=(num, *settings.image_shape)).astype(np.float32)
    y = rng.integers(0, NUM_CLASSES, num).astype(np.int32)
    parts = tuple(np.arange(k * settings.cnn_per_client, (k + 1) * settings.cnn_per_client) for k in range(settings.cnn_clients))
    return x, y, parts


def _optimizer():
    import optax

    return optax.sgd(0.01, momentum=0.9)  # Ozer et al. 2022 (VBNN aggregation)'s client SGD


def plain_loop(loss, x, y, parts, batch_size: int, epochs: int, optimizer) -> tuple[Callable, int]:
    """``(run, examples)``: ``run(params)`` calls one jitted SGD step of ``loss(params, key, x, y,
    mask)`` from Python over each
    client's minibatches in turn (epoch by epoch, the last batch of an epoch partial and masked,
    as the simulator's clients train), from a fresh optimizer state; ``examples`` is how many
    real (unmasked) examples that trains."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from fedbayes.data.batches import num_local_steps

    key = jax.random.key(0)  # the models are deterministic: their losses ignore the key

    @jax.jit
    def step(p, s, xb, yb, mb):
        u, s = optimizer.update(jax.grad(loss)(p, key, xb, yb, mb), s, p)
        return optax.apply_updates(p, u), s

    batches = []
    for idx in parts:
        n = len(idx)
        padded = -(-n // batch_size) * batch_size
        for t in range(num_local_steps(n, batch_size, epochs)):
            pos = t * batch_size + np.arange(batch_size)
            sel = idx[pos % n]
            m = (pos % padded < n).astype(np.float32)
            batches.append((jnp.asarray(x[sel]), jnp.asarray(y[sel]), jnp.asarray(m)))

    def run(params):
        p, s = params, optimizer.init(params)
        for xb, yb, mb in batches:
            p, s = step(p, s, xb, yb, mb)
        return p

    return run, int(sum(float(b[2].sum()) for b in batches))


def _round_call(sim, params) -> Callable[[], Any]:
    """One simulator round per call, carrying the state (as ``run_experiment`` does)."""
    box = [sim.init(params)]

    def call():
        box[0], _ = sim.run_round(box[0])
        return box[0].server_state

    return call


def _cnn_round(settings, x, y, parts):
    import jax

    from fedbayes.algorithms.fedavg import fedavg
    from fedbayes.algorithms.server_opt import make_server_optimizer
    from fedbayes.data.federation import Federation
    from fedbayes.inference import LocalTrainer
    from fedbayes.models import init_params, loss_fn, make_model
    from fedbayes.sim.simulator import Simulator

    model = make_model("cnn", NUM_CLASSES)
    params = init_params(model, jax.random.key(settings.seed), tuple(settings.image_shape))
    loss = loss_fn(model, "classification")
    trainer = LocalTrainer(loss, optimizer=_optimizer(), num_epochs=1, batch_size=settings.cnn_batch)
    sim = Simulator(fedavg(trainer, make_server_optimizer("sgd", 1.0)), Federation(x, y, parts), clients_per_round=len(parts), seed=settings.seed)
    return _round_call(sim, params), params, loss


def measure_cnn(settings) -> dict[str, Any]:
    """The ``cnn`` workload: the CNN FedAvg round's throughput over a plain jitted step loop's."""

    x, y, parts = _images(settings)
    round_call, params, loss = _cnn_round(settings, x, y, parts)
    plain, examples = plain_loop(loss, x, y, parts, settings.cnn_batch, 1, _optimizer())
    times = interleaved_times({"plain": lambda: plain(params), "round": round_call}, settings.relative_reps)
    return _throughput_result(
        settings, times, examples, "a plain jitted step loop over the same examples", "cnn round / plain loop", "plain", "round", ROUND_TARGETS["cnn"]
    )


def _throughput_result(settings, times, examples: int, reference: str, label: str, base: str, new: str, target: float) -> dict[str, Any]:
    """A round workload's raw result: ``new``'s throughput over ``base``'s, paired per repetition."""
    import jax

    return {
        "reference": f"{reference} (throughput ratio)",
        "ratios": {label: ratio_summary(times[base], times[new], target, ">=")},
        "examples_per_s": {k: examples / statistics.median(v) for k, v in times.items()},
        "examples_per_round": examples,
        "devices": len(jax.local_devices()),
        "reps": settings.relative_reps,
    }


def measure_vbnn(settings) -> dict[str, Any]:
    """The ``vbnn`` workload: the VBNN (GAA) round's throughput over the CNN FedAvg round's."""
    import jax

    from fedbayes.algorithms.vbnn import vbnn
    from fedbayes.data.federation import Federation
    from fedbayes.inference import LocalTrainer
    from fedbayes.models import init_params, make_model
    from fedbayes.models.variational import apply_with_key
    from fedbayes.sim.simulator import Simulator

    x, y, parts = _images(settings)
    cnn_call, _, _ = _cnn_round(settings, x, y, parts)
    vmodel = make_model("cnn", NUM_CLASSES, variational=True)
    vparams = init_params(vmodel, jax.random.key(settings.seed), tuple(settings.image_shape))
    trainer = LocalTrainer(None, optimizer=_optimizer(), num_epochs=1, batch_size=settings.cnn_batch)
    algo = vbnn(trainer, apply_with_key(vmodel), aggregation="gaa", total_examples=sum(len(p) for p in parts))
    vsim = Simulator(algo, Federation(x, y, parts), clients_per_round=len(parts), seed=settings.seed)
    times = interleaved_times({"cnn_round": cnn_call, "vbnn_round": _round_call(vsim, vparams)}, settings.relative_reps)
    examples = sum(len(p) for p in parts)
    return _throughput_result(
        settings, times, examples, "the CNN FedAvg round", "vbnn (gaa) round / cnn fedavg round", "cnn_round", "vbnn_round", ROUND_TARGETS["vbnn"]
    )


def _with_clients(measure: Callable[[Any], dict[str, Any]], clients: int) -> Callable[[Any], dict[str, Any]]:
    """``measure`` with ``settings.cnn_clients = clients`` (the GPU record's 100-client rounds)."""
    return lambda settings: measure(dataclasses.replace(settings, cnn_clients=clients))


MEASURES: dict[str, Callable[[Any], dict[str, Any]]] = {
    "curvature": measure_curvature,
    "cnn": measure_cnn,
    "vbnn": measure_vbnn,
    "cnn_100": _with_clients(measure_cnn, 100),
    "vbnn_100": _with_clients(measure_vbnn, 100),
}
