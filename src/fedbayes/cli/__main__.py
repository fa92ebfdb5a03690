"""``python -m fedbayes.cli``: the command line, as the ``fedbayes`` script runs it."""

import sys

from fedbayes.cli import main

sys.exit(main())
