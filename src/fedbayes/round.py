"""The former name of :mod:`fedbayes.protocol`, kept so that ``import fedbayes.round`` keeps working."""

import sys

from fedbayes import protocol

sys.modules[__name__] = protocol
