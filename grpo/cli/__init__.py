"""Command lines: the layer above the library that may import envs and run a recipe's eval_setup."""
