"""trajflow: asynchronous RL post-training as a streaming Ray Data pipeline."""

__version__ = "0.1.0"
