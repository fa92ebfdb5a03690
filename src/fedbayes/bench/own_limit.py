"""A method's own limit: its round's computation as a plain jitted loop, without the simulator.

The fair speed limit of a federated method is the arithmetic it does by design: its clients'
updates over their examples and, where it has one, its server computation (FedLap-Func's server
optimisation, FedEP's site products). :func:`plain_round` runs exactly that for one round of a
:class:`~fedbayes.sim.simulator.Simulator`'s cohort as a plain single-process loop: one
``jit``-compiled ``client_update`` call per client (compiled with the round's XLA options), each
client's data laid out alone, the calls dispatched asynchronously to the local devices in turn
(longest client first to the least-loaded device, as the simulator balances them), then the
messages brought to the first device and one ``jit``-compiled server step there. The host work
that does not depend on the server state (the cohort, the clients' shuffles, their states'
rows) is done before the clock starts (:func:`prepare_plain_round`); the broadcast, the
transfers and both kinds of steps are timed.

What the simulator adds to this is its machinery (layout, stores, validation, pipelining, the
host work between programs); ``ratio_to_own_limit`` (:mod:`fedbayes.bench`) is the plain loop's
round time over the simulator's, measured interleaved in one process.

No JAX at top level (the parent process of ``fedbayes bench`` imports the package).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple


class PlainInputs(NamedTuple):
    """One plain round's inputs, on the devices (:func:`prepare_plain_round`)."""

    round: int
    server_device: Any  # where the server state, the weights and the server key live (the mesh's first device)
    devices: list  # per client: the device it runs on
    keys: list  # per client: its key (protocol.client_key)
    states: list  # per client: its state row on its device
    data: list  # per client: its ClientData on its device (its own order buffer at offset 0)
    weights: Any  # [M] on the first device
    server_key: Any


# A process may time several workloads interleaved (benchmarks/step_cost.py): each keeps its
# programs and its pooled data on the devices. With fewer slots than workloads every pass put
# the whole training set on the devices again, inside the timed rounds (the "five-workload
# slowdown" of docs/results/bench.md, 2026-11-27).
@functools.lru_cache(maxsize=8)
def _programs(sim):
    """``(client, broadcast, server)``: the jitted pieces of a plain round of ``sim``."""
    import jax

    from fedbayes import protocol, tree
    from fedbayes.sim.simulator import round_compiler_options

    alg, aggregator = sim.algorithm, sim.aggregator
    options = round_compiler_options(sim.mesh.devices.flat[0].platform)

    def server(key, server_state, messages, weights):
        new, ok, _ = protocol.server_step(key, alg, server_state, tree.stack(messages), weights, aggregator)
        return protocol.keep_unless_accepted(ok, new, server_state, alg)

    return (
        jax.jit(alg.client_update, compiler_options=options),
        jax.jit(alg.broadcast, compiler_options=options),
        jax.jit(server, compiler_options=options),
    )


@functools.lru_cache(maxsize=8)
def _pooled_on_devices(sim):
    """The pooled training set on each device (put there once, as the simulator puts it)."""
    import jax

    return {d: (jax.device_put(sim.federation.x, d), jax.device_put(sim.federation.y, d)) for d in sim.mesh.devices.flat}


def prepare_plain_round(sim, state, round_idx: int) -> PlainInputs:
    """The host work of a plain round of ``sim`` (a pooled federation's
    :class:`~fedbayes.sim.simulator.Simulator`): round ``round_idx``'s cohort, each client's
    shuffles in its own order buffer (one length for every client, one compile), its state's row
    from ``state``'s store and its device."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from fedbayes import protocol
    from fedbayes.data.batches import ClientData, layout_orders, size_class
    from fedbayes.sim.simulator import lpt_assign

    if sim.generated:
        raise ValueError("the plain loop takes a pooled federation (its data on the devices once)")
    alg, fed = sim.algorithm, sim.federation
    epochs, batch = alg.local_epochs, alg.local_batch_size
    cohort = sim.sample_cohort(round_idx)
    devices = list(sim.mesh.devices.flat)
    groups = lpt_assign(sim.sizes[cohort].astype(np.float64), len(devices))
    device_of = {int(i): devices[d] for d, g in enumerate(groups) for i in g}
    pooled = _pooled_on_devices(sim)
    length = size_class(epochs * int(sim.sizes.max()) + batch)
    out = PlainInputs(round_idx, devices[0], [], [], [], [], None, jax.device_put(protocol.server_key(sim.seed, round_idx), devices[0]))
    for i, cid in enumerate(cohort):
        dev, ix = device_of[i], fed.client_indices[cid]
        order, _, _ = layout_orders(sim.seed, round_idx, [cid], [ix], epochs, batch, length=length)
        x, y = pooled[dev]
        out.devices.append(dev)
        out.keys.append(jax.device_put(protocol.client_key(sim.seed, round_idx, int(cid)), dev))
        out.states.append(jax.device_put(jax.tree.map(lambda a: a[cid], state.client_states), dev))
        out.data.append(ClientData(x, y, jax.device_put(order, dev), jax.device_put(jnp.int32(0), dev), jax.device_put(jnp.int32(len(ix)), dev)))
    weights = jax.device_put(protocol.client_weights(sim.sizes[cohort], sim.weighting), devices[0])
    return out._replace(weights=weights)


def plain_round(sim, server_state, inputs: PlainInputs):
    """Runs a prepared plain round from ``server_state`` (on the first device) and returns the new
    server state, waited for. Client states are not written back: the limit is the arithmetic."""
    import jax

    client, broadcast, server = _programs(sim)
    first = inputs.server_device  # not the first client's device: the cohort's first client may run elsewhere
    message = broadcast(server_state)
    on = {d: jax.device_put(message, d) for d in set(inputs.devices)}
    messages = [client(k, on[d], s, data)[0] for d, k, s, data in zip(inputs.devices, inputs.keys, inputs.states, inputs.data)]
    messages = jax.device_put(messages, first)
    return jax.block_until_ready(server(inputs.server_key, server_state, messages, inputs.weights))


def first_device_state(sim, server_state):
    """``server_state`` (the simulator's, replicated) as a plain round takes it: on the first device."""
    import jax

    return jax.device_put(server_state, sim.mesh.devices.flat[0])
