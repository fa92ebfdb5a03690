"""Compiled programs against Linux's cap on one process's memory mappings (docs/results/suite_time.md,
"The crash in deserialize_executable"; fedbayes.sim.compiled).

One jitted function (a small MLP's five SGD steps under ``lax.scan``), as a library's module-level
function is, is called again and again with a new value of a static argument that the program does
not use: each call is a new entry of the function's cache, which JAX keeps, and its program, the
same every time, is loaded from the persistent compilation cache (a fresh temporary folder), as a
test worker loads the programs of earlier tests. Prints the process's memory mappings and resident
memory every ``--every`` programs.

    python benchmarks/program_mappings.py --programs 3000            # dies at the cap (SIGSEGV)
    python benchmarks/program_mappings.py --programs 3000 --release  # release_if_crowded after each

Linux only (``/proc/self/maps``, ``vm.max_map_count``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--programs", type=int, default=2500, help="functions to jit and call, one after another")
    parser.add_argument("--every", type=int, default=250, help="print a line every this many programs")
    parser.add_argument("--release", action="store_true", help="call fedbayes.sim.compiled.release_if_crowded after each program")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from fedbayes.sim.compiled import mapping_limit, memory_mappings, release_if_crowded

    def train(w, x, y, tag):
        def loss(w):
            h = jnp.tanh(jnp.tanh(x @ w[0]) @ w[1])
            return jnp.mean((h @ w[2] - y) ** 2)

        def step(w, _):
            return jax.tree.map(lambda a, g: a - 0.1 * g, w, jax.grad(loss)(w)), loss(w)

        return jax.lax.scan(step, w, None, length=5)

    train = jax.jit(train, static_argnums=3)
    w = [jnp.full((20, 32), 0.01), jnp.full((32, 32), 0.01), jnp.full((32, 1), 0.01)]
    x, y = jnp.ones((16, 20)), jnp.ones((16, 1))
    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="program-mappings-"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

    def resident_mb() -> float:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

    print(f"cap (vm.max_map_count): {mapping_limit()}; release: {args.release}", flush=True)
    print("programs  mappings  resident MB  releases  seconds", flush=True)
    releases, start = 0, time.perf_counter()
    for i in range(args.programs + 1):
        if i:
            train(w, x, y, i)[1].block_until_ready()  # a new cache entry; the program from the persistent cache
            releases += bool(args.release and release_if_crowded())
        if i % args.every == 0:
            print(f"{i:8d}  {memory_mappings():8d}  {resident_mb():11.0f}  {releases:8d}  {time.perf_counter() - start:7.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
