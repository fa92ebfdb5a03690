"""``python -m fedbayes.bench SPEC``: a benchmark worker (see :mod:`fedbayes.bench.protocol`)."""

import sys

from fedbayes.bench.protocol import worker

if __name__ == "__main__":
    worker(sys.argv[1:])
