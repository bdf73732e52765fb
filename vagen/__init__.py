"""vagen: multi-turn reinforcement learning for vision-language agents.

Importing the package is cheap on purpose: heavy dependencies (torch, transformers, DeepSpeed)
load only in the modules that need them, so configuration errors surface in well under a second.
"""

__version__ = "0.1.0"
