"""`python -m vagen.sft --config NAME [--out DIR] [--eval 256]`: build a warm start (the code lives in
`vagen.warmstart.sft`; see its help)."""

if __name__ == "__main__":
    from vagen.distributed import leave_process_group
    from vagen.warmstart.cli import main

    raise SystemExit(leave_process_group(main()))
