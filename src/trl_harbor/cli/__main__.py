"""``python -m trl_harbor.cli``: the ``trl-harbor`` command."""

import sys

from trl_harbor.cli import main

sys.exit(main())
