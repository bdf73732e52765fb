"""`python -m vagen.warmstart` is `python -m vagen.sft`."""

from vagen.distributed import leave_process_group
from vagen.warmstart.cli import main

raise SystemExit(leave_process_group(main()))
