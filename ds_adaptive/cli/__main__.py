"""``python -m ds_adaptive.cli COMMAND ...``: the ``ds-adaptive`` console script."""
import sys

from ds_adaptive.cli import main

sys.exit(main())
