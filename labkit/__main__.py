"""`python -m labkit ...`: see labkit/cli.py."""
from .cli import main

raise SystemExit(main())
