"""`python -m labkit.gpu_check ...`: see labkit/gpu_check/__init__.py."""
from .command import main

raise SystemExit(main())
