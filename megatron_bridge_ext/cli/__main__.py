"""``python -m megatron_bridge_ext.cli``: the ``mbx`` command."""

import sys

from megatron_bridge_ext.cli import main

sys.exit(main())
