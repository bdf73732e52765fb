"""The warm start: scripted demonstrations (`demos`), questions about frames (`perception`) and the
supervised fine-tuning that turns a random built-in model into a policy that answers in the format
and reads the board (`sft`). An explicit stage, `python -m vagen.sft --config NAME`, that writes a
checkpoint; the training path never imports this package."""
