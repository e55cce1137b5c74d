"""`python -m labkit ...`: see labkit/cli.py."""
import sys

from .errors import FootprintError

try:
    from .cli import main
except FootprintError as refused:  # no room to load torch (`import_room`): before the CLI's own handler exists
    print(f"labkit: error: {refused}", file=sys.stderr)
    raise SystemExit(2) from None

raise SystemExit(main())
