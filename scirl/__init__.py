"""scirl: GRPO post-training of language models on scientific multiple-choice questions."""

__version__ = "0.1.0"
