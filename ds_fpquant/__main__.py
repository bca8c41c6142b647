"""``python -m ds_fpquant`` is the ``ds-fpquant`` command."""

import sys

from ds_fpquant.cli.main import main

sys.exit(main())
