"""``python -m ds_fpquant`` is the ``ds-fpquant`` command."""

import sys

from .cli import main

sys.exit(main())
